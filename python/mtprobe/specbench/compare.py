"""Every answer file of a folder side by side (``python -m mtprobe.specbench compare DIR``).

Each ``*.jsonl`` file of the folder is scored with :func:`mtprobe.specbench.score.score` against an
``ar`` baseline, then all of them go into one markdown table (``compare.md``: per task and overall,
each method's τ, speedup and tokens/s, with the spread of repeated timing runs), one JSON file
(``compare.json``) and one figure (``compare.png``: τ, speedup and tokens/s, tasks and MT-bench
sub-categories in separate panels, error bars from the repeats).

Baseline: ``"auto"`` takes, for every sampling temperature present in the folder, the one ``ar``
file of that temperature (by its ``"mtprobe"`` metadata, else a model_id with an ``ar`` part such as
``smollm2-135m-ar`` or ``ar-t1``), so sampled runs are compared with sampled ``ar`` as Spec-Bench does
at T = 1; a path or a file name inside the folder is the baseline of every file.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtprobe._jsonl import read_jsonl
from mtprobe.specbench.metadata import setup_differences
from mtprobe.specbench.plots import Series, common_dash_prefix, plot_panels, short_name, title_from_meta
from mtprobe.specbench.questions import MT_BENCH_CATEGORIES
from mtprobe.specbench.report import GroupStats, ScoreReport
from mtprobe.specbench.score import load_tokenizer, score

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CompareReport", "CompareRow", "compare", "render_compare_markdown"]

_AR_ID = re.compile(r"(^|-)ar(-|$)")


@dataclass(frozen=True)
class CompareRow:
    """One method (or a baseline) in the comparison."""

    name: str
    """Short name: the model_id without the model (``probe-bc30``)."""
    model_id: str
    path: Path
    temperature: float
    baseline: Path
    is_baseline: bool
    lossless: bool | None
    """Texts identical to the baseline's; None for the baselines and for sampled runs."""
    groups: tuple[GroupStats, ...]
    meta: dict[str, Any] | None = None

    def group(self, name: str) -> GroupStats | None:
        return next((g for g in self.groups if g.group == name), None)


@dataclass(frozen=True)
class CompareReport:
    folder: Path
    rows: tuple[CompareRow, ...]
    order: tuple[str, ...]
    """Group names: the tasks, overall, then MT-bench's sub-categories present."""
    questions: int
    """Questions of the (first) baseline."""
    title: str
    markdown_path: Path | None = None
    figure_path: Path | None = None
    plot_note: str = ""
    reports: tuple[ScoreReport, ...] = ()


def _first_line(path: Path) -> dict[str, Any]:
    for _, _, obj in read_jsonl(path):
        if isinstance(obj, dict):
            return obj
        break
    raise ValueError(f"{path}: not a Spec-Bench answer file (its first line is not an answer object)")


def _temperature(line: dict[str, Any]) -> float:
    meta = line.get("mtprobe")
    t = meta.get("temperature", 0.0) if isinstance(meta, dict) else 0.0
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else 0.0


def _is_ar(line: dict[str, Any]) -> bool:
    meta = line.get("mtprobe")
    if isinstance(meta, dict) and "method" in meta:
        return meta["method"] == "ar"
    return bool(_AR_ID.search(str(line.get("model_id", ""))))


def _resolve_baseline(folder: Path, baseline: str | os.PathLike[str]) -> Path:
    given = Path(baseline)
    for candidate in (given, folder / given):
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"baseline {str(baseline)!r} is neither a file nor a file of {folder}; pass the ar answer file, "
        "or --baseline auto to find it by its metadata"
    )


def compare(
    folder: str | os.PathLike[str],
    tokenizer: str | os.PathLike[str] | PreTrainedTokenizerBase,
    out_dir: str | os.PathLike[str] | None = None,
    *,
    baseline: str | os.PathLike[str] = "auto",
    plots: bool = True,
    literal_token_count: bool = False,
) -> CompareReport:
    """Score every answer file of ``folder`` against its ``ar`` baseline and put them side by side.

    With ``out_dir``: writes ``compare.md``, ``compare.json`` and (``plots``) ``compare.png`` there.
    Raises ValueError for a missing folder, a folder without answer files, a baseline that cannot be
    found or is ambiguous, and a temperature with no ``ar`` file to compare with.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder; pass the folder that holds the answer files (*.jsonl)")
    files = sorted(folder.glob("*.jsonl"))
    if not files:
        raise ValueError(
            f"{folder} holds no answer files (*.jsonl); run `python -m mtprobe.specbench run` first"
        )
    firsts = {p: _first_line(p) for p in files}
    temps = {p: _temperature(firsts[p]) for p in files}

    # baseline per temperature
    baselines: dict[float, Path] = {}
    if str(baseline) == "auto":
        for t in sorted(set(temps.values())):
            ars = [p for p in files if temps[p] == t and _is_ar(firsts[p])]
            if len(ars) > 1:
                raise ValueError(
                    f"{folder}: several ar answer files at temperature {t:g} ({', '.join(p.name for p in ars)}); "
                    "pass --baseline FILE"
                )
            if not ars:
                others = [p.name for p in files if temps[p] == t]
                raise ValueError(
                    f"{folder}: no ar answer file at temperature {t:g} to compare {', '.join(others)} with "
                    f"(found by metadata method 'ar' or an '-ar' model_id); run "
                    f"`python -m mtprobe.specbench run --method ar --temperature {t:g}` or pass --baseline FILE"
                )
            baselines[t] = ars[0]
    else:
        path = _resolve_baseline(folder, baseline)
        baselines = dict.fromkeys(set(temps.values()), path)

    if not isinstance(tokenizer, (str, os.PathLike)):
        tok = tokenizer
    else:
        tok = load_tokenizer(tokenizer)

    rows: list[CompareRow] = []
    reports: list[ScoreReport] = []
    order: list[str] = []
    for t in sorted(baselines):
        base = baselines[t]
        members = [p for p in files if temps[p] == t and p.resolve() != base.resolve()]
        report = score(base, members or [base], tok, None, literal_token_count=literal_token_count)
        reports.append(report)
        base_line = _first_line(base)
        rows.append(
            CompareRow(
                name=str(base_line.get("model_id", base.stem)),
                model_id=str(base_line.get("model_id", base.stem)),
                path=base,
                temperature=_temperature(base_line),
                baseline=base,
                is_baseline=True,
                lossless=None,
                groups=report.baseline_groups,
                meta=report.baseline_meta,
            )
        )
        for m in report.methods if members else ():
            rows.append(
                CompareRow(
                    name=m.name,
                    model_id=m.model_ids[0] if len(m.model_ids) == 1 else m.name,
                    path=m.path,
                    temperature=m.temperature,
                    baseline=base,
                    is_baseline=False,
                    lossless=m.lossless,
                    groups=m.groups,
                    meta=m.meta,
                )
            )
        for g in [*report.baseline_groups, *(g for m in report.methods for g in m.groups)]:
            if g.group not in order:
                order.append(g.group)
    # tasks first, overall, then MT-bench's sub-categories (score's own order per report)
    order = (
        [g for g in order if g not in MT_BENCH_CATEGORIES and g != "overall"]
        + (["overall"] if "overall" in order else [])
        + [c for c in MT_BENCH_CATEGORIES if c in order]
    )

    prefix = common_dash_prefix([r.model_id for r in rows])
    rows = [CompareRow(**{**_fields(r), "name": short_name(r.model_id, r.meta, prefix)}) for r in rows]
    names = [r.name for r in rows]
    if len(set(names)) < len(names):  # two files of one id: tell them apart by file name
        rows = [
            CompareRow(**{**_fields(r), "name": f"{r.name} ({r.path.stem})"})
            if names.count(r.name) > 1
            else r
            for r in rows
        ]
    # Runs over fewer questions than the others (a --limit run) say so in their name, and the title
    # gives the largest count, so no figure claims more questions for a run than it answered.
    counts = [g.questions if (g := r.group("overall")) is not None else 0 for r in rows]
    questions = max([*counts, *(rep.baseline_questions for rep in reports)])
    rows = [
        CompareRow(**{**_fields(r), "name": f"{r.name} ({n} q)"}) if 0 < n < questions else r
        for r, n in zip(rows, counts, strict=True)
    ]
    what = "questions" if len(set(counts)) <= 1 else "questions at most"
    title = title_from_meta([r.meta for r in rows], questions, f"Spec-Bench comparison ({folder.name})")
    if what != "questions":
        title = title.replace(f"{questions} questions", f"{questions} {what}", 1)
    result = CompareReport(folder, tuple(rows), tuple(order), questions, title, reports=tuple(reports))
    if out_dir is None:
        return result
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig_path, note = None, "figure not requested (--no-plots)"
    if plots:
        try:
            fig_path = plot_panels(
                [Series(r.name, {g.group: g for g in r.groups}) for r in rows],
                ["tau", "speedup", "tokens_per_second"],
                order,
                title,
                out / "compare.png",
            )
            note = ""
        except ImportError:
            note = "figure skipped: matplotlib is not installed (pip install matplotlib)"
            print(f"mtprobe.specbench: {note}", file=sys.stderr)
    result = CompareReport(
        folder,
        tuple(rows),
        tuple(order),
        questions,
        title,
        out / "compare.md",
        fig_path,
        note,
        tuple(reports),
    )
    (out / "compare.md").write_text(render_compare_markdown(result), encoding="utf-8")
    (out / "compare.json").write_text(json.dumps(_to_json(result), indent=2) + "\n", encoding="utf-8")
    return result


def _fields(r: CompareRow) -> dict[str, Any]:
    return {k: getattr(r, k) for k in CompareRow.__dataclass_fields__}


def _cell(x: float | None, std: float | None, digits: int, suffix: str = "") -> str:
    if x is None:
        return "n/a"
    if std is None:
        return f"{x:.{digits}f}{suffix}"
    return f"{x:.{digits}f}{suffix} ± {std:.{digits}f}"


def _same(r: CompareRow, g: GroupStats) -> str:
    if r.is_baseline:
        return "baseline"
    if r.temperature > 0:
        return "sampled: not compared"
    return f"{g.identical_turns}/{g.compared_turns}"


def render_compare_markdown(c: CompareReport) -> str:
    """``compare.md``: the title, the files, then one table: every group, every method."""
    lines = [f"# {c.title.splitlines()[0]}", "", c.title.splitlines()[-1], ""]
    lines += ["| method | file | temperature | baseline | timed runs |", "| --- | --- | --- | --- | --- |"]
    for r in c.rows:
        g = r.group("overall")
        runs = g.repeats if g is not None else 1
        lines.append(
            f"| {r.name} | `{r.path.name}` | {r.temperature:g} | "
            f"{'—' if r.is_baseline else f'`{r.baseline.name}`'} | {runs} |"
        )
    base_meta = {r.path: r.meta for r in c.rows if r.is_baseline}
    differ = [(r, setup_differences(base_meta.get(r.baseline), r.meta)) for r in c.rows if not r.is_baseline]
    if any(d for _, d in differ):
        lines.append("")
        lines += [
            f"- `{r.name}` ran on another setup than its baseline ({'; '.join(d)}): its speedup compares two "
            "setups, not two methods"
            for r, d in differ
            if d
        ]
    lines += [
        "",
        "| task | method | questions | τ | speedup | tokens/s | forward-call reduction | identical turns |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for group in c.order:
        for r in c.rows:
            g = r.group(group)
            if g is None or g.questions == 0:
                continue
            label = f"**{group}**" if group == "overall" else group
            lines.append(
                f"| {label} | {r.name} | {g.questions} | {_cell(g.tau, None, 3)} | "
                f"{_cell(g.speedup, g.speedup_std, 3, 'x')} | "
                f"{_cell(g.tokens_per_second, g.tokens_per_second_std, 2)} | "
                f"{_cell(g.forward_reduction, None, 3, 'x')} | {_same(r, g)} |"
            )
    lines += [
        "",
        "Speed as Spec-Bench's evaluation/speed.py (tokens/s: mean over questions of new tokens / wall time; "
        "the baseline's tokens re-counted from its texts; speedup: method tokens/s / baseline tokens/s of "
        "the same temperature). With several timed runs: mean ± standard deviation over the runs, the "
        "speedup being mtprobe's ratio of mean tokens/s with its spread over every pairing of a method run "
        "with a baseline run (Spec-Bench's get_mean_speedup averages per-run ratios instead). τ: mean of all accept_lengths pooled. "
        "Identical turns: answer texts equal to the greedy baseline's; sampled runs are not compared by "
        "equality, their exactness is tested in distribution (tests/test_sampling.py).",
        "",
    ]
    if c.figure_path is not None:
        lines += [f"![comparison]({c.figure_path.name})", ""]
    elif c.plot_note:
        lines += [c.plot_note, ""]
    return "\n".join(lines)


def _to_json(c: CompareReport) -> dict[str, Any]:
    return {
        "folder": str(c.folder),
        "title": c.title,
        "questions": c.questions,
        "order": list(c.order),
        "rows": [
            {
                "name": r.name,
                "model_id": r.model_id,
                "path": str(r.path),
                "temperature": r.temperature,
                "baseline": str(r.baseline),
                "is_baseline": r.is_baseline,
                "lossless": r.lossless,
                "groups": {g.group: {k: v for k, v in asdict(g).items() if k != "group"} for g in r.groups},
                "mtprobe": r.meta,
            }
            for r in c.rows
        ],
    }
