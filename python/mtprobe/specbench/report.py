"""The score report: the numbers :func:`mtprobe.specbench.score.score` computes, and their renderings.

:class:`ScoreReport` holds the baseline's rows and one :class:`MethodReport` per answer file: a
:class:`GroupStats` per task, category and ``overall``, and the turns whose texts differ from the
baseline's (:class:`Mismatch`). :func:`render_markdown` writes a report as markdown; :func:`write_report`
puts ``report.md``, ``results.json`` and the plots ``tau_by_category.png`` and
``speedup_by_category.png`` into a folder.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from mtprobe.specbench.metadata import setup_differences
from mtprobe.specbench.plots import Series, common_dash_prefix, plot_panels, short_name, title_from_meta
from mtprobe.specbench.questions import MT_BENCH_CATEGORIES

__all__ = [
    "GroupStats",
    "MethodReport",
    "Mismatch",
    "ScoreReport",
    "render_markdown",
    "write_report",
]


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


def write_report(report: ScoreReport, out_dir: str | os.PathLike[str], *, plots: bool = True) -> ScoreReport:
    """Write ``report.md``, ``results.json`` and (with ``plots``, where matplotlib is installed) the plots
    into ``out_dir``; return the report with its ``report_path``, ``plots`` and ``plot_note`` set."""
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
