"""Figures of Spec-Bench results (matplotlib, Agg backend: files only, no display).

Every figure has a title naming the model, dtype, device and number of questions; methods are
labelled by their short names (:func:`short_name`); Spec-Bench's tasks (with ``overall``) and
MT-bench's sub-categories are drawn in separate panels; error bars are the standard deviation over
repeated timing runs (``run --repeats``) where there are several; every axis says its unit.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtprobe.specbench.questions import MT_BENCH_CATEGORIES

__all__ = ["METRICS", "Metric", "Series", "plot_panels", "short_name", "title_from_meta"]


@dataclass(frozen=True)
class Metric:
    """One quantity plotted per group: the GroupStats attribute, its spread attribute, the axis label."""

    attr: str
    std_attr: str | None
    label: str
    reference: float | None
    """A horizontal reference line (1.0 for τ and speedup: no gain), None for none."""
    digits: int = 2


METRICS: dict[str, Metric] = {
    "tau": Metric("tau", None, "τ (mean accepted tokens per forward)", 1.0),
    "speedup": Metric("speedup", "speedup_std", "speedup over ar (× tokens/s)", 1.0),
    "tokens_per_second": Metric("tokens_per_second", "tokens_per_second_std", "tokens/s", None, 1),
}


@dataclass(frozen=True)
class Series:
    """One method's bars: its short name and its statistics by group name."""

    name: str
    groups: Mapping[str, Any]
    """group name -> a GroupStats (or anything with the metrics' attributes)."""


def short_name(model_id: str, meta: Mapping[str, Any] | None = None, common_prefix: str = "") -> str:
    """A method's label: its model_id without the model name, e.g. ``smollm2-135m-probe-bc30`` ->
    ``probe-bc30``. ``meta`` (an answer line's ``"mtprobe"`` metadata) names the model; otherwise
    ``common_prefix`` (shared by all ids of a comparison) is cut.

    >>> short_name("smollm2-135m-probe-bc30", {"model": "smollm2-135m"})
    'probe-bc30'
    >>> short_name("tiny-ar-t1", common_prefix="tiny-")
    'ar-t1'
    """
    model = (meta or {}).get("model")
    if isinstance(model, str) and model_id.startswith(model + "-") and len(model_id) > len(model) + 1:
        return model_id[len(model) + 1 :]
    if common_prefix and model_id.startswith(common_prefix) and len(model_id) > len(common_prefix):
        return model_id[len(common_prefix) :]
    return model_id


def common_dash_prefix(names: Sequence[str]) -> str:
    """The longest prefix ending with ``-`` that all ``names`` share (``""`` for fewer than two)."""
    if len(names) < 2:
        return ""
    first = min(names)
    last = max(names)
    n = next(
        (i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b), min(len(first), len(last))
    )
    prefix = first[:n]
    return prefix[: prefix.rfind("-") + 1] if "-" in prefix else ""


def title_from_meta(metas: Sequence[Mapping[str, Any] | None], questions: int, what: str) -> str:
    """``what`` — model, dtype, device (each listed once, or "mixed"), number of questions and the
    settings shared by all runs (max_new_tokens, temperature)."""

    def field(key: str, fmt=str) -> str | None:
        values = {fmt(m[key]) for m in metas if m and m.get(key) is not None}
        if not values:
            return None
        return values.pop() if len(values) == 1 else "/".join(sorted(values))

    parts = [
        field("model") or "model not recorded",
        field("dtype"),
        field("device"),
        f"{questions} question{'s' if questions != 1 else ''}",
    ]
    max_new = field("max_new_tokens")
    if max_new:
        parts.append(f"≤{max_new} new tokens per turn")
    temps = field("temperature", lambda t: f"T={float(t):g}")
    if temps:
        parts.append(temps)
    threads = field("threads")
    if threads and (field("device") or "").startswith("cpu"):
        parts.append(f"{threads} threads")
    return f"{what}\n" + ", ".join(p for p in parts if p)


def _split_groups(order: Sequence[str]) -> tuple[list[str], list[str]]:
    subs = [g for g in order if g in MT_BENCH_CATEGORIES]
    tasks = [g for g in order if g not in MT_BENCH_CATEGORIES]
    return tasks, subs


def _wrap(name: str, width: int = 14) -> str:
    # break long method names at dashes so legend entries stay narrow
    out, line = [], ""
    for piece in re.split(r"(?<=-)", name):
        if line and len(line) + len(piece) > width:
            out.append(line)
            line = ""
        line += piece
    out.append(line)
    return "\n".join(out)


def plot_panels(
    series: Sequence[Series],
    metrics: Sequence[str],
    order: Sequence[str],
    title: str,
    path: Path,
) -> Path:
    """One figure: a row of panels per metric, the tasks (and overall) left, MT-bench's sub-categories
    right (when any have answers); one bar per method and group, with error bars where the metric has a
    spread. Saved to ``path`` (PNG)."""
    import matplotlib  # optional (the test extra): only plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not series:
        raise ValueError("nothing to plot: no methods")
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown metric(s) {unknown}; known: {', '.join(METRICS)}")
    tasks, subs = _split_groups(order)
    columns = [("Spec-Bench tasks", tasks)] + ([("MT-bench sub-categories", subs)] if subs else [])
    widths = [max(2, len(groups)) for _, groups in columns]
    n = len(series)
    fig_w = min(22.0, 2.5 + sum(widths) * (0.45 + 0.22 * n))
    fig, axes = plt.subplots(
        len(metrics),
        len(columns),
        figsize=(fig_w, 2.9 * len(metrics) + 1.2),
        gridspec_kw={"width_ratios": widths},
        squeeze=False,
        sharey="row",
    )
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bar_w = 0.8 / n
    for row, key in enumerate(metrics):
        metric = METRICS[key]
        for col, (panel, groups) in enumerate(columns):
            ax = axes[row][col]
            for i, s in enumerate(series):
                xs = [j + (i - (n - 1) / 2) * bar_w for j in range(len(groups))]
                ys, errs = [], []
                for g in groups:
                    st = s.groups.get(g)
                    v = getattr(st, metric.attr, None) if st is not None else None
                    e = getattr(st, metric.std_attr, None) if (st is not None and metric.std_attr) else None
                    ys.append(v if v is not None else float("nan"))  # no answers there: no bar
                    errs.append(e if e is not None else 0.0)
                has_err = any(errs)
                bars = ax.bar(
                    xs,
                    ys,
                    width=bar_w,
                    color=colours[i % len(colours)],
                    label=_wrap(s.name, 24) if row == 0 and col == 0 else None,
                    yerr=errs if has_err else None,
                    capsize=2 if has_err else 0,
                    error_kw={"elinewidth": 0.8, "ecolor": "black"},
                )
                if n <= 4 and len(groups) <= 9:
                    labels = [f"{y:.{metric.digits}f}" if y == y else "" for y in ys]
                    ax.bar_label(bars, labels=labels, fontsize=6, padding=1)
            if metric.reference is not None:
                ax.axhline(metric.reference, color="grey", linewidth=0.8, linestyle="--")
            ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right", fontsize=8)
            if "overall" in groups:
                ax.axvspan(
                    groups.index("overall") - 0.5, groups.index("overall") + 0.5, color="0.93", zorder=0
                )
            if row == 0:
                ax.set_title(panel, fontsize=9)
            if col == 0:
                ax.set_ylabel(metric.label, fontsize=8)
            ax.tick_params(axis="y", labelsize=8)
            ax.grid(axis="y", linewidth=0.4, alpha=0.5)
            ax.set_axisbelow(True)
    note = (
        "error bars: ± standard deviation over the timed runs"
        if any(
            getattr(st, METRICS[k].std_attr or "", None)
            for s in series
            for st in s.groups.values()
            for k in metrics
        )
        else ""
    )
    fig.suptitle(title, fontsize=10)
    fig.legend(
        loc="upper center",
        bbox_to_anchor=(0.5, 0.0),
        ncol=min(n, 6),
        fontsize=8,
        frameon=False,
        title=note or None,
        title_fontsize=7,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
