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
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import AutoTokenizer

from mtprobe import models
from mtprobe._jsonl import read_jsonl
from mtprobe.specbench.plots import Series, common_dash_prefix, plot_panels, short_name, title_from_meta
from mtprobe.specbench.questions import MT_BENCH_CATEGORIES, TASKS

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "Answer",
    "GroupStats",
    "MethodReport",
    "Mismatch",
    "SETUP_KEYS",
    "ScoreReport",
    "group_names",
    "load_answers",
    "load_tokenizer",
    "render_markdown",
    "score",
    "setup_differences",
    "setup_value",
]

_EXCERPT = 30  # characters of context shown on each side of a text mismatch


@dataclass(frozen=True)
class Answer:
    """One answer line (its first choice, as Spec-Bench's speed.py reads it)."""

    question_id: int
    category: str
    model_id: str
    turns: tuple[str, ...]
    decoding_steps: tuple[int, ...]
    new_tokens: tuple[int, ...]
    wall_time: tuple[float, ...]
    accept_lengths: tuple[int, ...]
    wall_times: tuple[tuple[float, ...], ...] = ()
    """Per-turn wall times of every timed run (``run --repeats``); ``(wall_time,)`` when the line has none."""
    meta: dict[str, Any] | None = None
    """The line's ``"mtprobe"`` metadata (the run's configuration), None in Spec-Bench's own files."""

    @property
    def runs(self) -> tuple[tuple[float, ...], ...]:
        return self.wall_times or (self.wall_time,)

    @property
    def temperature(self) -> float:
        t = (self.meta or {}).get("temperature", 0.0)
        return float(t) if _is_num(t) else 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _parse_answer(obj: object, where: str) -> Answer:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question_id", "category", "model_id", "choices"):
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r}")
    if not _is_int(obj["question_id"]):
        raise ValueError(f"{where}: 'question_id' must be an int, got {obj['question_id']!r}")
    choices = obj["choices"]
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"{where}: 'choices' must be a non-empty list of objects")
    c = choices[0]
    if "decoding_steps" not in c and "idxs" in c:
        c = {**c, "decoding_steps": c["idxs"]}  # what Spec-Bench's earlier inference scripts called it
    for key in ("turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"):
        if not isinstance(c.get(key), list):
            raise ValueError(f"{where}: choices[0] needs a list {key!r}")
    n = len(c["turns"])
    if n == 0 or not all(isinstance(t, str) for t in c["turns"]):
        raise ValueError(f"{where}: choices[0]['turns'] must be a non-empty list of strings")
    for key, ok in (("decoding_steps", _is_int), ("new_tokens", _is_int), ("wall_time", _is_num)):
        values = c[key]
        if len(values) != n:
            raise ValueError(f"{where}: choices[0][{key!r}] has {len(values)} entries for {n} turns")
        if not all(ok(v) and v >= 0 for v in values):
            raise ValueError(f"{where}: choices[0][{key!r}] must hold non-negative numbers, got {values}")
    if sum(c["wall_time"]) <= 0:
        raise ValueError(f"{where}: the wall_time of the question sums to 0; a speed cannot be computed")
    if not all(_is_int(a) and a >= 0 for a in c["accept_lengths"]):
        raise ValueError(f"{where}: choices[0]['accept_lengths'] must hold non-negative ints")
    runs = c.get("wall_times", None)
    if runs is not None:
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{where}: choices[0]['wall_times'] must be a non-empty list (one list per run)")
        for r, w in enumerate(runs):
            if not isinstance(w, list) or len(w) != n or not all(_is_num(v) and v >= 0 for v in w):
                raise ValueError(
                    f"{where}: choices[0]['wall_times'][{r}] must list {n} non-negative wall times, got {w!r}"
                )
            if sum(w) <= 0:
                raise ValueError(
                    f"{where}: choices[0]['wall_times'][{r}] sums to 0; no speed can be computed"
                )
    meta = obj.get("mtprobe")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"{where}: 'mtprobe' metadata must be an object, got {type(meta).__name__}")
    return Answer(
        question_id=obj["question_id"],
        category=str(obj["category"]),
        model_id=str(obj["model_id"]),
        turns=tuple(c["turns"]),
        decoding_steps=tuple(c["decoding_steps"]),
        new_tokens=tuple(c["new_tokens"]),
        wall_time=tuple(float(w) for w in c["wall_time"]),
        accept_lengths=tuple(c["accept_lengths"]),
        wall_times=tuple(tuple(float(v) for v in w) for w in runs) if runs else (),
        meta=meta,
    )


def load_answers(path: str | os.PathLike[str]) -> dict[int, Answer]:
    """Read and validate an answer file; return its answers by question_id, in file order.

    A malformed line or a question_id answered twice raises ValueError naming the file and line.
    """
    path = Path(path)
    answers: dict[int, Answer] = {}
    lines: dict[int, int] = {}
    for where, lineno, obj in read_jsonl(path):
        a = _parse_answer(obj, where)
        if a.question_id in answers:
            first = lines[a.question_id]
            raise ValueError(
                f"{where}: question_id {a.question_id} is answered again (first on line {first})"
            )
        answers[a.question_id] = a
        lines[a.question_id] = lineno
    if not answers:
        raise ValueError(f"{path}: no answers (the file is empty)")
    return answers


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


@dataclass(frozen=True)
class GroupStats:
    """Spec-Bench's numbers for one method on one group (task, category or overall).

    ``None`` marks a value that cannot be computed (no answers on that side, nothing matched).
    """

    group: str
    questions: int
    baseline_questions: int
    tau: float | None
    tokens_per_second: float | None
    baseline_tokens_per_second: float | None
    speedup: float | None
    matched: int
    """Questions of the group present in both files."""
    forward_reduction: float | None
    identical_turns: int
    compared_turns: int
    repeats: int = 1
    """Timed runs the speeds are averaged over (the fewest any question of the group has)."""
    tokens_per_second_std: float | None = None
    """Standard deviation over the timed runs (None with one run); min and max likewise."""
    tokens_per_second_min: float | None = None
    tokens_per_second_max: float | None = None
    speedup_std: float | None = None
    """Over every pairing of a method run with a baseline run; min and max likewise."""
    speedup_min: float | None = None
    speedup_max: float | None = None


@dataclass(frozen=True)
class Mismatch:
    """A turn whose answer text differs from the baseline's."""

    question_id: int
    category: str
    turn: int
    """1-based."""
    position: int
    """Index of the first differing character."""
    baseline_excerpt: str
    method_excerpt: str


@dataclass(frozen=True)
class MethodReport:
    name: str
    path: Path
    model_ids: tuple[str, ...]
    groups: tuple[GroupStats, ...]
    mismatches: tuple[Mismatch, ...]
    only_in_baseline: tuple[int, ...]
    only_in_method: tuple[int, ...]
    category_conflicts: tuple[int, ...]
    """Question ids whose category differs between the two files (scored under each file's own)."""
    temperature: float = 0.0
    """The highest sampling temperature of the method's or the baseline's lines (0: greedy)."""
    meta: dict[str, Any] | None = field(default=None, repr=False, compare=False)
    """The ``"mtprobe"`` metadata of the file's first line (None for files without it)."""

    def group(self, name: str) -> GroupStats:
        for g in self.groups:
            if g.group == name:
                return g
        raise KeyError(f"no group {name!r}; groups: {', '.join(g.group for g in self.groups)}")

    @property
    def sampled(self) -> bool:
        """Answers sampled (T > 0): texts are not compared; exactness is tested in distribution."""
        return self.temperature > 0

    @property
    def lossless(self) -> bool | None:
        """Texts identical to the baseline's; None when sampled (not checked by equality)."""
        return None if self.sampled else not self.mismatches


@dataclass(frozen=True)
class ScoreReport:
    baseline_path: Path
    baseline_model_ids: tuple[str, ...]
    baseline_questions: int
    baseline_groups: tuple[GroupStats, ...]
    tokenizer: str
    literal_token_count: bool
    methods: tuple[MethodReport, ...]
    report_path: Path | None = None
    plots: tuple[Path, ...] = ()
    plot_note: str = ""
    baseline_meta: dict[str, Any] | None = field(default=None, repr=False, compare=False)

    def method(self, name: str) -> MethodReport:
        for m in self.methods:
            if m.name == name:
                return m
        raise KeyError(f"no method {name!r}; methods: {', '.join(m.name for m in self.methods)}")


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
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot_paths: tuple[Path, ...] = ()
    note = "plots not requested (--no-plots)"
    if plots:
        try:
            plot_paths = _plot(report, out)
            note = ""
        except ImportError:
            note = "plots skipped: matplotlib is not installed (pip install matplotlib)"
            print(f"mtprobe.specbench: {note}", file=sys.stderr)
    report = replace(report, plots=plot_paths, plot_note=note, report_path=out / "report.md")
    (out / "report.md").write_text(render_markdown(report), encoding="utf-8")
    (out / "results.json").write_text(json.dumps(_to_json(report), indent=2) + "\n", encoding="utf-8")
    return report


# --- rendering -----------------------------------------------------------------------------------


def _f(x: float | None, digits: int, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:.{digits}f}{suffix}"


_COLUMNS = (
    "questions | τ (mean accepted tokens) | tokens/s | baseline tokens/s | speedup | "
    "forward-call reduction | identical turns"
)


def _pm(x: float | None, std: float | None, digits: int, suffix: str = "") -> str:
    # "mean ± std" over repeated timing runs; the plain value with one run
    if x is None or std is None:
        return _f(x, digits, suffix)
    return f"{x:.{digits}f}{suffix} ± {std:.{digits}f}"


def _row(label: str, g: GroupStats, baseline_row: bool = False, sampled: bool = False) -> str:
    same = (
        "—"
        if baseline_row
        else ("not compared (sampled)" if sampled else f"{g.identical_turns}/{g.compared_turns}")
    )
    cells = [
        label,
        str(g.questions),
        _f(g.tau, 3),
        _pm(g.tokens_per_second, g.tokens_per_second_std, 2),
        _f(g.baseline_tokens_per_second, 2),
        _pm(g.speedup, g.speedup_std, 3, "x"),
        _f(g.forward_reduction, 3, "x"),
        same,
    ]
    return "| " + " | ".join(cells) + " |"


def _table(first: str, rows: list[str]) -> list[str]:
    head = f"| {first} | {_COLUMNS} |"
    sep = "|" + " --- |" * (head.count("|") - 1)
    return [head, sep, *rows, ""]


def _ids(ids: Sequence[int]) -> str:
    return ", ".join(str(i) for i in ids)


# What a speedup holds fixed: the baseline and the method must share these (their "mtprobe" metadata).
SETUP_KEYS = ("model", "dtype", "device", "threads", "max_new_tokens", "first_turn_only")


def setup_differences(baseline: dict[str, Any] | None, method: dict[str, Any] | None) -> list[str]:
    """``"key: baseline X, method Y"`` for each of :data:`SETUP_KEYS` both metadata record and that
    differ (the device by its type: ``cuda`` and ``cuda:0`` are one); none when either has no metadata
    (Spec-Bench's own files).

    >>> setup_differences({"dtype": "float32", "device": "cuda:0"}, {"dtype": "bfloat16", "device": "cuda"})
    ["dtype: baseline 'float32', method 'bfloat16'"]
    """
    if not baseline or not method:
        return []
    return [
        f"{k}: baseline {setup_value(baseline, k)!r}, method {setup_value(method, k)!r}"
        for k in SETUP_KEYS
        if k in baseline and k in method and setup_value(baseline, k) != setup_value(method, k)
    ]


def setup_value(meta: dict[str, Any], key: str) -> Any:
    """``meta[key]`` as setups are compared: a device by its type (``cuda:0`` and ``cuda`` are one)."""
    v = meta[key]
    return v.split(":")[0] if key == "device" and isinstance(v, str) else v


def render_markdown(r: ScoreReport) -> str:
    """The report as markdown (what ``report.md`` holds)."""
    subs = set(MT_BENCH_CATEGORIES)
    counting = (
        "Spec-Bench literal: len(tokenizer(text).input_ids) - 1"
        if r.literal_token_count
        else "tokens of the text without special tokens"
    )
    lines = [
        "# Spec-Bench results",
        "",
        f"- Baseline: `{r.baseline_path}` (model_id {', '.join(f'`{i}`' for i in r.baseline_model_ids)}), "
        f"{r.baseline_questions} questions",
        *(f"- Method `{m.name}`: `{m.path}`, {m.group('overall').questions} questions" for m in r.methods),
        f"- Tokenizer for the baseline's token counts: `{r.tokenizer}` ({counting})",
        "",
    ]
    warnings = []
    for m in r.methods:
        differ = setup_differences(r.baseline_meta, m.meta)
        if differ:
            warnings.append(
                f"- `{m.name}` ran on another setup than the baseline ({'; '.join(differ)}): its speedup "
                "compares two setups, not two methods"
            )
        if m.only_in_baseline or m.only_in_method:
            warnings.append(
                f"- `{m.name}`: questions only in the baseline: {_ids(m.only_in_baseline) or 'none'}; "
                f"only in `{m.name}`: {_ids(m.only_in_method) or 'none'} (speed and τ use each file's own "
                "questions, as Spec-Bench does; forward-call reduction and losslessness use the common ones)"
            )
        if m.category_conflicts:
            warnings.append(
                f"- `{m.name}`: category differs from the baseline's for {_ids(m.category_conflicts)}"
            )
    lines += ["## Coverage", ""]
    lines += warnings or ["Every answer file holds the same question ids as the baseline.", ""]
    if warnings:
        lines.append("")

    lines += ["## Overall", ""]
    rows = [_row("ar (baseline)", g, True) for g in r.baseline_groups if g.group == "overall"]
    rows += [_row(m.name, g, sampled=m.sampled) for m in r.methods for g in m.groups if g.group == "overall"]
    lines += _table("method", rows)
    runs = sorted({g.repeats for m in r.methods for g in m.groups} | {g.repeats for g in r.baseline_groups})
    if runs != [1]:
        lines += [
            f"Timed runs per question: {', '.join(map(str, runs))}. tokens/s is mean ± standard deviation over "
            "the runs (Spec-Bench's number once per run); speedup is mean method tokens/s / mean baseline "
            "tokens/s ± the standard deviation over every pairing of a method run with a baseline run.",
            "",
        ]

    for m in r.methods:
        lines += [f"## `{m.name}` by task", ""]
        lines += _table(
            "task", [_row(g.group, g, sampled=m.sampled) for g in m.groups if g.group not in subs]
        )
        mt = [g for g in m.groups if g.group in subs]
        if mt:
            lines += [f"### `{m.name}`: MT-bench sub-categories", ""]
            lines += _table("category", [_row(g.group, g, sampled=m.sampled) for g in mt])

    lines += ["## Losslessness (answer texts identical to the baseline's)", ""]
    for m in r.methods:
        g = m.group("overall")
        if m.sampled:
            lines.append(
                f"- `{m.name}`: sampled at temperature {m.temperature:g}: the texts are samples, so equality "
                "with the baseline is not checked; exactness in distribution is what tests/test_sampling.py "
                "tests (every method's samples against model.generate(do_sample=True))"
            )
            continue
        verdict = "lossless" if m.lossless else f"{len(m.mismatches)} mismatching turn(s)"
        lines.append(
            f"- `{m.name}`: {g.identical_turns}/{g.compared_turns} turns identical over {g.matched} "
            f"common questions: {verdict}"
        )
        for x in m.mismatches:
            lines.append(
                f"  - question {x.question_id} ({x.category}), turn {x.turn}: first difference at character "
                f"{x.position}: baseline {json.dumps(x.baseline_excerpt, ensure_ascii=False)} vs "
                f"{json.dumps(x.method_excerpt, ensure_ascii=False)}"
            )
    lines.append("")
    if r.plots:
        lines += ["## Plots", "", *(f"![{p.stem}]({p.name})" for p in r.plots), ""]
    elif r.plot_note:
        lines += ["## Plots", "", r.plot_note, ""]
    lines += [
        "## Method",
        "",
        "Speed as Spec-Bench's evaluation/speed.py: tokens/s is the mean over questions of "
        "sum(new_tokens) / sum(wall_time); the baseline's tokens are re-counted from its answer texts; "
        "speedup = method tokens/s / baseline tokens/s; τ is the mean of all accept_lengths pooled. "
        "Forward-call reduction = baseline decoding steps per new token / method decoding steps per new "
        "token, pooled over the common questions (ar: steps = new tokens; the others: forward calls "
        "including prefill); for identical outputs it is baseline steps / method steps. With several "
        "timed runs (--repeats), mean ± std over the runs, and the speedup is mtprobe's ratio of the mean "
        "tokens/s (Spec-Bench's get_mean_speedup averages per-run ratios instead); with one run every "
        "number is Spec-Bench's.",
        "",
    ]
    return "\n".join(lines)


def _to_json(r: ScoreReport) -> dict[str, Any]:
    def groups(gs: Sequence[GroupStats]) -> dict[str, dict]:
        return {g.group: {k: v for k, v in asdict(g).items() if k != "group"} for g in gs}

    return {
        "baseline": {
            "path": str(r.baseline_path),
            "model_ids": list(r.baseline_model_ids),
            "groups": groups(r.baseline_groups),
        },
        "tokenizer": r.tokenizer,
        "literal_token_count": r.literal_token_count,
        "methods": [
            {
                "name": m.name,
                "path": str(m.path),
                "model_ids": list(m.model_ids),
                "lossless": m.lossless,
                "temperature": m.temperature,
                "groups": groups(m.groups),
                "mismatches": [asdict(x) for x in m.mismatches],
                "only_in_baseline": list(m.only_in_baseline),
                "only_in_method": list(m.only_in_method),
            }
            for m in r.methods
        ],
    }


def _plot(r: ScoreReport, out: Path) -> tuple[Path, ...]:
    order = [g.group for g in r.baseline_groups]
    for m in r.methods:
        order += [g.group for g in m.groups if g.group not in order]
    prefix = common_dash_prefix([*r.baseline_model_ids[:1], *(m.name for m in r.methods)])
    series = [Series(short_name(m.name, m.meta, prefix), {g.group: g for g in m.groups}) for m in r.methods]
    metas = [r.baseline_meta, *(m.meta for m in r.methods)]
    written = []
    for metric, fname, what in (
        ("tau", "tau_by_category.png", "Spec-Bench: τ, mean tokens accepted per forward"),
        ("speedup", "speedup_by_category.png", "Spec-Bench: speedup over ar (tokens/s ratio)"),
    ):
        title = title_from_meta(metas, r.baseline_questions, what)
        written.append(plot_panels(series, [metric], order, title, out / fname))
    return tuple(written)
