"""The quantized self-draft's format under AutoConfig, chosen by measurement.

Which format drafts fastest depends on the weights and on the machine: on weights that are Q4_1 values
already the 4-bit draft *is* the target up to rounding, and 8 bits would only read twice the bytes; on a
full-precision checkpoint the 4-bit copy disagrees with the target more often, and whether 8 bits' longer
accepted chains pay for their reads depends on how fast this CPU streams them. So a self-draft of
``draft_format="auto"`` under :class:`~mtprobe.drafters.auto.AutoConfig`:

- on weights on the Q4_1 grid (:func:`~mtprobe.target_model.self_draft.on_q4_grid`) drafts in ``"q4_1"``;
- else, until a format is chosen, is one candidate per format of ``AutoConfig.draft_formats``: each explores
  a whole chain in the first steps of every generation (its carried seconds are not handed to the
  scheduler, which explores what it has not measured) and the scheduler uses whichever its forecast prefers
  in the others; after :data:`MEASURE_GENERATIONS` single-sequence generations in which every format drafted,
  the format whose chain the scheduler forecasts the most tokens per second for (its pooled acceptance, its
  seconds per draft, this machine's forward profile: ``csrc/core/schedule.h``'s ``forecast_chain``) is kept;
- once chosen, drafts in that format alone. The choice is kept in the model's state and, beside AutoConfig's
  other measurements, on disk (:mod:`mtprobe.drafters.auto_carry`, keyed by the weights and the machine),
  so a new process builds only the chosen draft.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from mtprobe import _C
from mtprobe.drafters import auto_carry
from mtprobe.drafters.draft_model import DraftModelConfig
from mtprobe.state import state_of
from mtprobe.target_model.self_draft import draft_format_for, on_q4_grid

if TYPE_CHECKING:
    from transformers import PreTrainedModel

logger = logging.getLogger("mtprobe")

MEASURE_GENERATIONS = 3
"""Single-sequence generations in which every offered format must have drafted before one is kept: one
chain each is too few verdicts to tell formats whose acceptance differs by a few per cent."""


def chooses_format(config: Any) -> bool:
    """Whether ``config`` is a quantized self-draft whose format AutoConfig chooses (``draft_format="auto"``)."""
    return (
        isinstance(config, DraftModelConfig)
        and config.self_draft == "quantized"
        and config.draft_format == "auto"
    )


def formats_for(model: PreTrainedModel, offered: Sequence[str], origin: DraftModelConfig) -> tuple[str, ...]:
    """The formats the self-draft ``origin`` (``draft_format="auto"``) drafts in on ``model`` now: the one
    chosen for it, ``("q4_1",)`` on weights on the Q4_1 grid, else every ``offered`` format (measured)."""
    chosen = state_of(model).draft_formats.get(origin)
    if chosen is not None:
        return (chosen,)
    if on_q4_grid(model):
        return ("q4_1",)
    return tuple(offered)


def expand(
    model: PreTrainedModel, offered: Sequence[str], candidates: Sequence[Any]
) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """``candidates`` with each format-choosing self-draft replaced by one configuration per format it drafts in
    (:func:`formats_for`), and for each of the result its origin: the ``draft_format="auto"`` configuration it
    stands for, or None."""
    out, origins = [], []
    for c in candidates:
        if not chooses_format(c):
            out.append(c)
            origins.append(None)
            continue
        for f in formats_for(model, offered, c):
            out.append(dataclasses.replace(c, draft_format=f))
            origins.append(c)
    return tuple(out), tuple(origins)


def measuring(model: PreTrainedModel, origins: Sequence[Any]) -> list[bool]:
    """For each candidate: whether it is one of several formats still being measured (its seconds per draft
    are re-measured at every generation's start, so that each format drafts a chain in each)."""
    chosen = state_of(model).draft_formats
    offered: dict[Any, int] = {}
    for o in origins:
        if o is not None:
            offered[o] = offered.get(o, 0) + 1
    return [o is not None and offered[o] > 1 and o not in chosen for o in origins]


def settle(
    model: PreTrainedModel,
    candidates: Sequence[Any],
    origins: Sequence[Any],
    drafter: _C.AutoDrafter,
    cost: _C.CostTable,
    do_sample: bool,
    context: int,
) -> None:
    """After a single sequence's generation: count the formats that drafted in it, and keep the best one of a
    self-draft whose every format has drafted in :data:`MEASURE_GENERATIONS` generations: the one whose chain
    ``forecast_chain`` scores highest (tokens per plain forward's time at ``context`` cached positions, with
    this generation's step overhead; ties: the earlier of ``AutoConfig.draft_formats``)."""
    state = state_of(model)
    still = measuring(model, origins)
    groups: dict[Any, list[int]] = {}
    for i, o in enumerate(origins):
        if still[i]:
            groups.setdefault(o, []).append(i)
    for origin, members in groups.items():
        for i in members:
            if drafter.draft_costs[i] > 0:  # it drafted in this generation
                key = (candidates[i], do_sample)
                state.format_runs[key] = state.format_runs.get(key, 0) + 1
        if any(state.format_runs.get((candidates[i], do_sample), 0) < MEASURE_GENERATIONS for i in members):
            continue
        scores = {
            candidates[i].draft_format: _C.forecast_chain(
                drafter.stats[i],
                cost,
                drafter.draft_costs[i],
                candidates[i].num_tokens,
                float(context),
                drafter.step_overhead,
            )
            for i in members
        }  # format -> (drafts, rate, expected tokens, score)
        best = max(scores, key=lambda f: scores[f][3])  # the first of equals: dicts keep the offered order
        state.draft_formats[origin] = best
        logger.info(
            "AutoConfig: the quantized self-draft drafts in %s on this model and machine (forecast over %d "
            "generations, tokens per plain forward's time / acceptance / seconds per draft: %s)",
            best,
            MEASURE_GENERATIONS,
            ", ".join(
                f"{f} {s[3]:.2f} / {s[1]:.3f} / {drafter.draft_costs[i] * 1e3:.2f} ms"
                for (f, s), i in zip(scores.items(), members, strict=True)
            ),
        )


def without_measuring(model: PreTrainedModel, config: Any) -> Any:
    """``config`` (an AutoConfig) with each format-choosing self-draft in one format: the one chosen for it on
    ``model`` (in this process or, with ``config.carry``, an earlier one), else the weights' grid rule
    (:func:`~mtprobe.target_model.self_draft.draft_format_for`). For hosts whose generations never finish as
    mtprobe's do (vLLM's proposer): measuring would explore every format in every request."""
    auto_carry.load(model, config.carry)
    chosen = state_of(model).draft_formats
    drafters = tuple(
        dataclasses.replace(c, draft_format=chosen.get(c) or draft_format_for(model))
        if chooses_format(c)
        else c
        for c in config.drafters
    )
    return dataclasses.replace(config, drafters=drafters)
