"""Scoring of Spec-Bench answer files against the ``ar`` baseline (``python -m mtprobe.specbench score``).

Speed follows Spec-Bench's ``evaluation/speed.py`` (github.com/hemingkx/Spec-Bench, function
``speed``), restated here rather than copied:

* a task selects answer lines by category: ``overall`` takes all, ``mt_bench`` takes MT-bench's eight
  categories, any other name takes the lines of that exact category (so MT-bench sub-categories are
  scored the same way);
* method side: per question, ``sum(new_tokens) / sum(wall_time)`` over its turns; **tokens/s** is the
  plain mean of these per-question speeds; **mean accepted tokens** (τ) is the mean of all
  ``accept_lengths`` of all questions pooled into one list;
* baseline side: the same per-question mean, except that its tokens are counted by re-tokenizing the
  answer *texts* (Spec-Bench: ``len(tokenizer(text).input_ids) - 1`` per turn, the ``- 1`` removing
  the BOS that Llama/Vicuna tokenizers add); **speedup** = method tokens/s ÷ baseline tokens/s;
* each file contributes all of its own lines of the task (no matching of question ids).

Token counting differs in letter, not intent: a turn counts ``len(tokenizer(text,
add_special_tokens=False).input_ids)`` tokens, which equals Spec-Bench's ``- 1`` count for tokenizers
that add exactly one BOS and stays right for those that add none (SmolLM2, Qwen); ``literal=True``
(``--literal-token-count``) restores Spec-Bench's formula exactly.

Added here, not in Spec-Bench: the reduction in forward calls per generated token (the baseline's
``sum(decoding_steps) / sum(new_tokens)`` ÷ the method's, pooled over the questions present in both
files; for identical outputs that is baseline steps ÷ method steps), the losslessness check (answer
texts equal to the baseline's, turn by turn, for the same question_id), and a list of the questions
present in only one of the two files.

Repeated timing runs (``run --repeats N``; the answer lines' extra ``wall_times``): tokens/s is
Spec-Bench's number computed once per timed run (run r uses every question's r-th wall times), then
averaged over the runs, with its standard deviation, minimum and maximum; the speedup is the mean
method tokens/s ÷ the mean baseline tokens/s, and its spread is over every pairing of a method run
with a baseline run. A file without ``wall_times`` (Spec-Bench's own, or written before they existed)
has one run, and every number is then exactly Spec-Bench's.

Sampling (answer lines whose ``"mtprobe"`` metadata has ``temperature`` > 0, on either side): the
texts are samples, so equality with the baseline is not checked; τ and speed are reported as
Spec-Bench reports them at T > 0, and losslessness is established in distribution by the exactness
tests (tests/test_sampling.py). Files without metadata count as greedy.

This module computes the numbers; the answer files are read by :mod:`mtprobe.specbench.answers`, and
the report they make up, with its markdown, JSON and plots, is :mod:`mtprobe.specbench.report`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from transformers import AutoTokenizer

from mtprobe import models
from mtprobe.specbench.answers import Answer, load_answers
from mtprobe.specbench.questions import MT_BENCH_CATEGORIES, TASKS
from mtprobe.specbench.report import GroupStats, MethodReport, Mismatch, ScoreReport, write_report

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["group_names", "load_tokenizer", "score"]

_EXCERPT = 30  # characters of context shown on each side of a text mismatch


def load_tokenizer(name_or_path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """The tokenizer of a known model name (``mtprobe.models``) or of a local folder, offline."""
    if isinstance(name_or_path, str) and name_or_path in models.KNOWN_MODELS:
        folder = models.fetch(name_or_path)
    else:
        folder = Path(name_or_path).expanduser()
        if not folder.is_dir():
            raise ValueError(
                f"cannot load a tokenizer from {str(name_or_path)!r}: expected a known model name "
                f"({', '.join(models.KNOWN_MODELS)}) or a local folder holding a tokenizer"
            )
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _in_group(category: str, group: str) -> bool:
    if group == "overall":
        return True
    if group == "mt_bench":
        return category in MT_BENCH_CATEGORIES
    return category == group


def group_names(categories: set[str]) -> list[str]:
    """Report rows: Spec-Bench's six tasks, other categories, ``overall``, then MT-bench's sub-categories
    (only those with answers)."""
    present_tasks = [t for t in TASKS if any(_in_group(c, t) for c in categories)]
    others = sorted(c for c in categories if c not in TASKS and c not in MT_BENCH_CATEGORIES)
    subs = [c for c in MT_BENCH_CATEGORIES if c in categories]
    return [*present_tasks, *others, "overall", *subs]


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _std(xs: Sequence[float]) -> float | None:
    # sample standard deviation; None for fewer than two values
    if len(xs) < 2:
        return None
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _per_run(answers: Sequence[Answer], tokens: Callable[[Answer], float]) -> list[float]:
    """Spec-Bench's tokens/s (mean over questions of tokens / wall time) once per timed run."""
    if not answers:
        return []
    runs = min(len(a.runs) for a in answers)
    return [sum(tokens(a) / sum(a.runs[r]) for a in answers) / len(answers) for r in range(runs)]


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def _excerpt(text: str, pos: int) -> str:
    lo, hi = max(0, pos - _EXCERPT), pos + _EXCERPT
    return ("…" if lo > 0 else "") + text[lo:hi] + ("…" if hi < len(text) else "")


def _mismatches(base: Answer, other: Answer) -> tuple[list[Mismatch], int]:
    """Turn-by-turn text comparison; a turn missing on one side counts as a mismatch."""
    found = []
    n = max(len(base.turns), len(other.turns))
    for t in range(n):
        a = base.turns[t] if t < len(base.turns) else ""
        b = other.turns[t] if t < len(other.turns) else ""
        if a != b or t >= len(base.turns) or t >= len(other.turns):
            pos = _first_difference(a, b)
            found.append(
                Mismatch(base.question_id, base.category, t + 1, pos, _excerpt(a, pos), _excerpt(b, pos))
            )
    return found, n


def _group_stats(
    group: str,
    answers: dict[int, Answer],
    baseline: dict[int, Answer],
    baseline_tokens: Callable[[Answer], float],
    compare_texts: bool = True,
) -> GroupStats:
    mine = [a for a in answers.values() if _in_group(a.category, group)]
    base = [b for b in baseline.values() if _in_group(b.category, group)]
    # Spec-Bench: per-question speeds, averaged with equal weight per question; once per timed run.
    runs = _per_run(mine, lambda a: sum(a.new_tokens))
    base_runs = _per_run(base, baseline_tokens)
    pooled = [x for a in mine for x in a.accept_lengths]
    tps, base_tps = _mean(runs), _mean(base_runs)
    speedup = tps / base_tps if tps is not None and base_tps else None
    ratios = [t / b for t in runs for b in base_runs if b] if speedup is not None else []
    # Forward calls and texts can only be compared question by question.
    matched = [(baseline[a.question_id], a) for a in mine if a.question_id in baseline]
    steps_base = sum(sum(b.decoding_steps) for b, _ in matched)
    steps_mine = sum(sum(a.decoding_steps) for _, a in matched)
    tokens_base = sum(sum(b.new_tokens) for b, _ in matched)
    tokens_mine = sum(sum(a.new_tokens) for _, a in matched)
    reduction = None
    if matched and steps_mine and tokens_base and tokens_mine:
        # forward calls per generated token, baseline over method (sampled outputs differ in length)
        reduction = (steps_base / tokens_base) / (steps_mine / tokens_mine)
    identical = compared = 0
    for b, a in matched if compare_texts else []:
        bad, n = _mismatches(b, a)
        compared += n
        identical += n - len(bad)
    return GroupStats(
        group=group,
        questions=len(mine),
        baseline_questions=len(base),
        tau=_mean(pooled),
        tokens_per_second=tps,
        baseline_tokens_per_second=base_tps,
        speedup=speedup,
        matched=len(matched),
        forward_reduction=reduction,
        identical_turns=identical,
        compared_turns=compared,
        repeats=len(runs) or 1,
        tokens_per_second_std=_std(runs),
        tokens_per_second_min=min(runs) if len(runs) > 1 else None,
        tokens_per_second_max=max(runs) if len(runs) > 1 else None,
        speedup_std=_std(ratios),
        speedup_min=min(ratios) if len(ratios) > 1 else None,
        speedup_max=max(ratios) if len(ratios) > 1 else None,
    )


def _temperature(answers: dict[int, Answer]) -> float:
    return max((a.temperature for a in answers.values()), default=0.0)


def _method_report(
    name: str, path: Path, answers: dict[int, Answer], baseline: dict[int, Answer], groups: list[str], tokens0
) -> MethodReport:
    temperature = max(_temperature(answers), _temperature(baseline))
    greedy = temperature == 0
    mismatches = []
    for qid, a in answers.items():
        if qid in baseline and greedy:
            mismatches += _mismatches(baseline[qid], a)[0]
    return MethodReport(
        name=name,
        path=path,
        model_ids=tuple(dict.fromkeys(a.model_id for a in answers.values())),
        groups=tuple(
            _group_stats(g, answers, baseline, tokens0, compare_texts=greedy)
            for g in groups
            if any(_in_group(a.category, g) for a in answers.values())
            or any(_in_group(b.category, g) for b in baseline.values())
        ),
        mismatches=tuple(sorted(mismatches, key=lambda m: (m.question_id, m.turn))),
        only_in_baseline=tuple(sorted(set(baseline) - set(answers))),
        only_in_method=tuple(sorted(set(answers) - set(baseline))),
        category_conflicts=tuple(
            sorted(q for q, a in answers.items() if q in baseline and baseline[q].category != a.category)
        ),
        temperature=temperature,
        meta=next((a.meta for a in answers.values() if a.meta), None),
    )


def _method_names(paths: Sequence[Path], files: Sequence[dict[int, Answer]]) -> list[str]:
    # A file's single model_id names it; a file with several, or a repeated id, uses the file name.
    ids = [list(dict.fromkeys(a.model_id for a in f.values())) for f in files]
    names = [i[0] if len(i) == 1 else p.stem for i, p in zip(ids, paths, strict=True)]
    if len(set(names)) < len(names):
        names = [p.stem if names.count(n) > 1 else n for n, p in zip(names, paths, strict=True)]
    if len(set(names)) < len(names):
        names = [str(p) for p in paths]
    return names


def _as_baseline_row(g: GroupStats, base: dict[int, Answer], tokens: Callable[[Answer], float]) -> GroupStats:
    runs = _per_run([b for b in base.values() if _in_group(b.category, g.group)], tokens)
    return replace(
        g,
        tokens_per_second=g.baseline_tokens_per_second,
        speedup=1.0 if g.baseline_tokens_per_second else None,
        tokens_per_second_std=_std(runs),
        tokens_per_second_min=min(runs) if len(runs) > 1 else None,
        tokens_per_second_max=max(runs) if len(runs) > 1 else None,
        speedup_std=None,
        speedup_min=None,
        speedup_max=None,
    )


def score(
    baseline: str | os.PathLike[str],
    answers: Sequence[str | os.PathLike[str]],
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    literal_token_count: bool = False,
    plots: bool = True,
) -> ScoreReport:
    """Score answer files against the ``ar`` baseline file; with ``out_dir``, write ``report.md``,
    ``results.json`` and the plots ``tau_by_category.png`` and ``speedup_by_category.png`` there."""
    if not answers:
        raise ValueError("no answer files to score")
    base_path = Path(baseline)
    base = load_answers(base_path)
    paths = [Path(p) for p in answers]
    files = [load_answers(p) for p in paths]
    if isinstance(tokenizer, (str, os.PathLike)):
        tok_name = str(tokenizer)
        tok = load_tokenizer(tokenizer)
    else:
        tok_name, tok = type(tokenizer).__name__, tokenizer

    counts: dict[str, int] = {}

    def count(text: str) -> int:
        if text not in counts:
            if literal_token_count:
                counts[text] = len(tok(text).input_ids) - 1  # Spec-Bench, letter for letter
            else:
                counts[text] = len(tok(text, add_special_tokens=False).input_ids)
        return counts[text]

    def baseline_tokens(b: Answer) -> float:
        return sum(count(t) for t in b.turns)

    categories = {a.category for f in [base, *files] for a in f.values()}
    groups = group_names(categories)
    names = _method_names(paths, files)
    methods = tuple(
        _method_report(n, p, f, base, groups, baseline_tokens)
        for n, p, f in zip(names, paths, files, strict=True)
    )
    baseline_groups = tuple(
        _group_stats(g, base, base, baseline_tokens, compare_texts=False)
        for g in groups
        if any(_in_group(b.category, g) for b in base.values())
    )
    # The baseline row uses the baseline's own (re-tokenized) speed on both sides: speedup 1 by definition.
    baseline_groups = tuple(_as_baseline_row(g, base, baseline_tokens) for g in baseline_groups)
    report = ScoreReport(
        baseline_path=base_path,
        baseline_model_ids=tuple(dict.fromkeys(b.model_id for b in base.values())),
        baseline_questions=len(base),
        baseline_groups=baseline_groups,
        tokenizer=tok_name,
        literal_token_count=literal_token_count,
        methods=methods,
        baseline_meta=next((b.meta for b in base.values() if b.meta), None),
    )
    if out_dir is None:
        return report
    return write_report(report, out_dir, plots=plots)
