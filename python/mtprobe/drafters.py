"""Drafter construction from configurations. The drafters themselves are C++ (csrc/drafters/).

Every factory here has the registry's shared signature, ``factory(model, config, *, capacity, do_sample,
process, fold_memory)`` (:class:`mtprobe.registry.DrafterFactory`), and takes what it needs of it;
:mod:`mtprobe.methods` registers each with its configuration class, and :func:`make_drafter` builds a
configuration's drafter through the registry.
"""

from __future__ import annotations

import contextlib
import contextvars
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from transformers import PreTrainedModel

from mtprobe import _C, heads, registry
from mtprobe.adapter import HFAdapter
from mtprobe.calibrate import load_calibration
from mtprobe.config import (
    TRUNCATED_DRAFT_LAYERS,
    AutoConfig,
    DraftModelConfig,
    EntMTPConfig,
    HeadsConfig,
    HybridConfig,
    LookaheadConfig,
    PlainConfig,
    ProbeConfig,
    PromptLookupConfig,
    StandConfig,
    config_from_dict,
)
from mtprobe.draft_model import (
    check_draft_model,
    is_full_depth,
    layer_truncated,
    quantized,
    quantized_decoder,
    why_not_quantized,
)
from mtprobe.profile import ForwardProfile, choose_linear_routes, profile_forward
from mtprobe.registry import DecodingConfig, ProcessFn

_GAUSSIAN_SHIFT = {"gaussian": 0.0, "gaussian_5sigma": 5.0, "gaussian_10sigma": 10.0}


def _mask_options(model: PreTrainedModel, config: ProbeConfig) -> dict[str, object]:
    """The probing options both MaskProbeDrafter and HybridDrafter take; a calibration file is loaded
    and checked against ``model`` here (ValueError when it was learned for another model)."""
    init = config.mask_init
    initial_masks = None
    if init == "calibrated":
        cal = load_calibration(config.mask_path)
        cal.check(model, config.num_masks)
        initial_masks = cal.masks  # [>= k, hidden] float32; the drafter takes the first k
    return dict(
        num_masks=config.num_masks,
        block_complexity=config.block_complexity,
        prune=config.prune,
        mask_init="gaussian" if init in _GAUSSIAN_SHIFT else init,
        gaussian_shift=_GAUSSIAN_SHIFT.get(init, 0.0),
        mask_lambda=float(config.mask_lambda),
        seed=config.seed,
        initial_masks=initial_masks,
    )


def mask_probe_drafter(
    model: PreTrainedModel,
    config: ProbeConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.MaskProbeDrafter:
    """The mask-token probing drafter of ``config`` over ``model``'s input embedding table."""
    return _C.MaskProbeDrafter(
        model.get_input_embeddings().weight,
        dynamic_tree=config.tree == "dynamic",
        branches=list(config.branches or ()),
        mask_value=config.mask_value,
        **_mask_options(model, config),
    )


def _bank_arguments(config: EntMTPConfig | HeadsConfig, bank: Any) -> dict[str, Any]:
    """The C++ drafters' EntMTP keyword arguments (csrc/bindings/drafters.cpp, ``set_bank``): ``bank``'s
    compiled trees and ``config``'s policy over them."""
    return {
        "bank": [bank.topology(i) for i in range(len(bank.trees))],
        "policy": _C.TopologyPolicy(
            config.policy, list(config.trees), list(config.thresholds), bank_size=len(bank.trees)
        ),
        "feature": config.feature,
        "ema": float(config.ema),
        "record": config.record_steps,
    }


def entmtp_drafter(
    model: PreTrainedModel,
    config: EntMTPConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.MaskProbeDrafter:
    """Mask-token probing over ``config``'s topology bank, one tree per step by its policy; the bank is
    checked against ``model`` (ValueError when it was built for another model, device or dtype)."""
    bank = config.resolved_bank
    bank.check(model)
    init = bank.mask_init
    return _C.MaskProbeDrafter(
        model.get_input_embeddings().weight,
        num_masks=bank.num_masks,
        block_complexity=bank.block_complexity,
        dynamic_tree=False,
        branches=[],
        prune=bank.prune,
        mask_init="gaussian" if init in _GAUSSIAN_SHIFT else init,
        gaussian_shift=_GAUSSIAN_SHIFT.get(init, 0.0),
        mask_lambda=float(bank.mask_lambda),
        **_bank_arguments(config, bank),
    )


# model -> {(memory_size, max_ngram, table_size): memory}: the cross-request n-gram memories, one per
# model and memory settings, dropped with the model.
_NGRAM_MEMORIES: weakref.WeakKeyDictionary[Any, dict[tuple[int, int, int], _C.NgramMemory]] = (
    weakref.WeakKeyDictionary()
)


def ngram_memory(model: PreTrainedModel, config: StandConfig | HybridConfig) -> _C.NgramMemory | None:
    """The cross-request n-gram memory ``config`` (``memory_size`` set) uses with ``model``: one per
    model and (``memory_size``, ``max_ngram``, ``table_size``), created on first use and shared by every
    STAND or hybrid drafter built with those settings, so that repeated :func:`mtprobe.generate` calls
    draft from each other's text. ``None`` when ``config.memory_size`` is ``None``."""
    if not isinstance(config, (StandConfig, HybridConfig)):
        raise TypeError(
            f"ngram_memory takes a StandConfig or HybridConfig (the drafters with a cross-request memory), "
            f"got {type(config).__name__}"
        )
    if config.memory_size is None:
        return None
    key = (config.memory_size, config.max_ngram, config.table_size)
    memories = _NGRAM_MEMORIES.setdefault(model, {})
    if key not in memories:
        memories[key] = _C.NgramMemory(
            config.memory_size, max_ngram=config.max_ngram, top_k=config.table_size
        )
    return memories[key]


def ngram_memories(model: PreTrainedModel, config: object) -> list[_C.NgramMemory]:
    """Every cross-request memory ``config`` drafts with on ``model`` (an AutoConfig's drafters included):
    what a benchmark clears between runs."""
    if isinstance(config, AutoConfig):
        return [m for c in config.drafters for m in ngram_memories(model, c)]
    if isinstance(config, (StandConfig, HybridConfig)) and config.memory_size is not None:
        return [ngram_memory(model, config)]
    return []


def hybrid_drafter(
    model: PreTrainedModel,
    config: HybridConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.HybridDrafter:
    """Probing and STAND drafting one tree over ``model``'s input embedding table (``fold_memory``: see
    :func:`stand_drafter`)."""
    stand = config.stand
    return _C.HybridDrafter(
        model.get_input_embeddings().weight,
        max_depth=stand.max_depth,
        max_ngram=stand.max_ngram,
        table_size=stand.table_size,
        logits_top_k=stand.logits_top_k,
        memory=ngram_memory(model, config),
        fold_memory=fold_memory,
        mask_value=config.mask_value,
        grow_probed=config.grow_probed,
        prompt_logits=stand.prompt_logits,
        **_mask_options(model, config.probe),
    )


def draft_model_drafter(
    model: PreTrainedModel,
    config: DraftModelConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.DraftModelDrafter:
    """A draft-model drafter for ``model``: ``config.draft_model`` or the self-draft ``config.self_draft`` names,
    with a KV cache of ``capacity`` entries at first (it doubles when full); ``process`` (HF's logits
    processors) shapes its q."""
    if capacity < 1:
        raise ValueError(
            f"capacity={capacity}: the draft model's KV cache needs at least one entry (it grows as needed)"
        )
    draft = config.draft_model
    if draft is None and config.self_draft == "quantized":
        draft = quantized(model, config.num_draft_layers)
    elif draft is None:
        draft = layer_truncated(model, config.num_draft_layers or TRUNCATED_DRAFT_LAYERS)
    check_draft_model(model, draft)
    # Kept alive by the bound method the drafter holds; its linear layers routed as measured for it (the
    # quantized draft's are its own op already).
    routes = None if config.self_draft == "quantized" else choose_linear_routes(draft)
    adapter = HFAdapter(draft, capacity, linear_routes=routes)
    # Its one-token forwards in C++ where the architecture allows (draft_model.quantized_decoder).
    decoder = quantized_decoder(draft) if config.self_draft == "quantized" else None
    # The quantized self-draft of every layer would run the prompt through the target's own float32
    # weights (QuantizedLinear.MAX_ROWS): a second prefill, as costly as the target's. It takes the
    # target's cache instead: at every draft step the tokens it has not seen but the target verified
    # (all of the prompt at its first step; those of steps a scheduler gave other drafters) are the
    # target's entries, copied, and only the last committed token runs through the draft. The target is
    # the one of the generation running in this context (running_target, set by mtprobe.generate). The
    # loop's first forward verifies the prompt, so the draft proposes no chain in that block
    # (skip_prefill): it has nothing to draft from yet, and the block is then the same in every sequence
    # (num_return_sequences shares it). Called before any target forward all the same (a scheduler's
    # first step, outside mtprobe.generate), it drafts from flat logits, which verification rejects.
    share = (
        config.self_draft == "quantized"
        and config.draft_model is None
        and is_full_depth(model, config.num_draft_layers)
    )
    # held: the draft cache's entries that are real (the drafter counts the flat forwards' as cached).
    state: dict[str, Any] = {"held": 0}
    vocab = model.get_output_embeddings().weight.shape[0]

    def forward(
        tokens: torch.Tensor,  # [n] int64
        embeds: torch.Tensor | None,
        position_ids: torch.Tensor,  # [1, n]
        mask: torch.Tensor | None,
        prefix_len: int,
        want_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # [n, vocab], [n, hidden]?
        n = position_ids.shape[-1]
        if share:
            target = _RUNNING_TARGET.get()
            if target is None or not target.prefilled:  # before the target's prefill
                return tokens.new_zeros((1, vocab), dtype=torch.float32).expand(n, -1), None
            # The drafter feeds the tokens after its cache, ending with the last committed one, which the
            # target has not cached yet; every one before it, and every entry the draft counts as cached
            # but never computed, the target has verified.
            start, end = min(state["held"], prefix_len), prefix_len + n - 1
            if start < end:
                adapter.cache.copy_entries(target.cache, start, end)
            tokens, position_ids, prefix_len = tokens[n - 1 :], position_ids[:, n - 1 :], end
            state["held"] = end + 1
        # A token or two (the bonus token and the last draft, where the draft's cache lags) one step at a
        # time in C++; a prompt through HF's modules, which run its rows together on float32 weights.
        rows = tokens.shape[0]
        if decoder is not None and rows <= 2 and embeds is None and mask is None and not want_hidden:
            layers = adapter.cache.layers
            adapter.reserve(prefix_len + rows)
            if layers[0].is_initialized:  # after the draft's first forward through HF (or the copy)
                keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
                for i, token in enumerate(tokens.tolist()):
                    logits = decoder.step(token, prefix_len + i, keys, values)  # [vocab]
                adapter.cache.set_length(prefix_len + rows)
                return logits.unsqueeze(0).expand(n, -1), None  # the drafter reads the last row only
        # The drafter reads each forward's last row only (csrc/drafters/draft_model.cpp), so the prompt's
        # other rows need no logits: the head over a long prompt costs as much as its layers.
        adapter.prefill_logits_from = tokens.shape[0] - 1
        logits, hidden = adapter.forward(tokens, embeds, position_ids, mask, prefix_len, want_hidden)
        if logits.shape[0] < n:  # rows of copied entries: the last row stands for each (none is read)
            logits = logits[-1:].expand(n, -1)
        return logits, hidden

    return _C.DraftModelDrafter(
        forward,
        num_tokens=config.num_tokens,
        top_branches=config.top_branches,
        do_sample=do_sample,
        process=process,
        skip_prefill=share,
    )


# The target adapter of the generation running in this context (thread, task): a draft that takes the
# target's KV entries reads them from it. A context variable, not a hook on the model, so that two
# generations on one model in two threads each see their own.
_RUNNING_TARGET: contextvars.ContextVar[HFAdapter | None] = contextvars.ContextVar(
    "mtprobe_target", default=None
)


@contextlib.contextmanager
def running_target(adapter: HFAdapter) -> Iterator[None]:
    """While open, ``adapter`` is the target of the generation running in this context: what the
    quantized self-draft of every layer copies its KV entries from (:func:`draft_model_drafter`)."""
    token = _RUNNING_TARGET.set(adapter)
    try:
        yield
    finally:
        _RUNNING_TARGET.reset(token)


def heads_drafter(
    model: PreTrainedModel,
    config: HeadsConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.HeadsDrafter:
    """The circuit-head drafter of ``config``: its checkpoint loaded (cached) and checked against ``model``;
    with a topology bank, the bank checked against both (ValueError naming what differs)."""
    head = heads.load_cached(config.path, model)
    bank = config.resolved_bank
    entmtp: dict[str, Any] = {}
    if bank is not None:
        bank.check(model, head=head, vocab_top_k=config.vocab_top_k)
        entmtp = _bank_arguments(config, bank)
    return heads.heads_drafter(
        head,
        do_sample=do_sample,
        top_branches=config.top_branches,
        min_path_prob=config.min_path_prob,
        vocab_top_k=config.vocab_top_k,
        dtype=config.torch_head_dtype,
        **entmtp,
    )


def hidden_layer(model: PreTrainedModel, config: DecodingConfig) -> int:
    """The ``hidden_states`` index the drafter of ``config`` reads (-1, the last, unless a circuit head
    has LoRA draft layers: then the input of the first of them); ValueError if two heads of an
    AutoConfig read different layers."""
    if isinstance(config, HeadsConfig):
        return heads.load_cached(config.path, model).hidden_layer
    if isinstance(config, AutoConfig):
        # Only heads read hidden states; the other drafters do not constrain which the forward returns.
        layers = {hidden_layer(model, c) for c in config.drafters if isinstance(c, HeadsConfig)}
        if len(layers) > 1:
            raise ValueError(
                f"AutoConfig's circuit heads read different hidden states ({sorted(layers)}; -1 is the last): "
                "one forward returns one; use heads with the same lora_layers"
            )
        return layers.pop() if layers else -1
    return -1


class MaskAdaptation(NamedTuple):
    """What calibrated masks change in the model's computation at the masks, each None when they have none."""

    offsets: torch.Tensor | None  # [num_layers, hidden] or, one set per mask, [k, num_layers, hidden]
    lora: dict[str, torch.Tensor] | None  # "{layer}.{module}.A": [rank, in], ".B": [out, rank]
    temperature: torch.Tensor | None  # [k]


def mask_adaptation(config: DecodingConfig) -> MaskAdaptation:
    """The layer offsets (:func:`mtprobe.adapter.layer_offsets`), mask LoRA (:func:`mtprobe.adapter.mask_lora`)
    and mask temperatures (:func:`mtprobe.adapter.scale_mask_logits`) of the calibrated masks ``config``
    probes with. ValueError if two drafters of an AutoConfig bring different ones: one forward adds one set
    of offsets, adapts one way and scales its mask rows one way. The adapter checks each against the model
    (``HFAdapter.set_mask_layer_offsets``, ``set_mask_lora``, ``set_mask_temperature``)."""
    configs = config.drafters if isinstance(config, AutoConfig) else (config,)
    offsets: dict[tuple[str, int], torch.Tensor] = {}
    temperatures: dict[tuple[str, int], torch.Tensor] = {}
    loras: dict[str, dict[str, torch.Tensor]] = {}
    for c in configs:
        if isinstance(c, (ProbeConfig, HybridConfig)) and c.mask_init == "calibrated":
            cal = load_calibration(c.mask_path)
            for found, t in (
                (offsets, cal.offsets_for(c.num_masks)),
                (temperatures, cal.temperature_for(c.num_masks)),
            ):
                if t is not None:
                    found[(c.mask_path, c.num_masks)] = t
            if cal.mask_lora is not None:
                loras[c.mask_path] = cal.mask_lora
    for what, found in (("layer offsets", offsets), ("mask temperatures", temperatures)):
        first = next(iter(found.values()), None)
        if any(o.shape != first.shape or not torch.equal(o, first) for o in found.values()):
            raise ValueError(
                f"AutoConfig's drafters probe with different {what} ("
                + ", ".join(f"{p} with num_masks={k}" for p, k in sorted(found))
                + "); one forward has one set: use the same mask_path and, with per-mask offsets or "
                "temperatures, the same num_masks for every probing drafter"
            )
    if len(loras) > 1:
        raise ValueError(
            "AutoConfig's drafters probe with different mask LoRAs (" + ", ".join(sorted(loras)) + "); one "
            "forward adapts one way: use the same mask_path for every probing drafter"
        )
    return MaskAdaptation(
        next(iter(offsets.values()), None),
        next(iter(loras.values()), None),
        next(iter(temperatures.values()), None),
    )


def forward_profile(model: PreTrainedModel, config: AutoConfig) -> ForwardProfile:
    """The forward profile ``config`` names, checked against ``model`` (ValueError naming what differs),
    or the one :func:`~mtprobe.profile.profile_forward` measures (and caches) for ``model``."""
    profile = config.profile
    if profile is None:
        return profile_forward(model)
    if isinstance(profile, str):
        profile = ForwardProfile.load(profile)
    profile.check(model)
    return profile


def auto_candidates(model: PreTrainedModel, config: AutoConfig) -> tuple[DecodingConfig, ...]:
    """The drafters of ``config`` the scheduler chooses among for ``model``: all of them but a quantized
    self-draft the model cannot run (:func:`~mtprobe.draft_model.why_not_quantized`: a GPU or bfloat16
    model, nothing to quantize), which AutoConfig's defaults name for CPUs."""
    keep = tuple(
        c
        for c in config.drafters
        if not (
            isinstance(c, DraftModelConfig)
            and c.draft_model is None
            and c.self_draft == "quantized"
            and why_not_quantized(model)
        )
    )
    if not keep:
        raise ValueError(
            f"AutoConfig has no drafter that runs on this model: {why_not_quantized(model)}; add others, e.g. "
            "drafters=(PromptLookupConfig(), StandConfig(block_complexity=10))"
        )
    return keep


# What the scheduler measured of each drafter with own forwards (its acceptance counts and seconds per
# draft), per model, configuration and sampling mode: the model's next AutoConfig generation in this
# process starts from it (csrc/drafters/auto.h) instead of exploring the draft model from nothing.
_CARRIED: weakref.WeakKeyDictionary[PreTrainedModel, dict[tuple[Any, bool], tuple[Any, float]]] = (
    weakref.WeakKeyDictionary()
)


def carry_auto_measurements(
    model: PreTrainedModel, candidates: Sequence[DecodingConfig], drafter: _C.AutoDrafter, do_sample: bool
) -> None:
    """Keep what ``drafter`` (built by :func:`auto_drafter` for ``model`` over ``candidates``, its
    :func:`auto_candidates`) measured of its drafters with own forwards, for the model's next generation."""
    carried = _CARRIED.setdefault(model, {})
    for i, c in enumerate(candidates):
        if registry.method_of(c).own_forwards and drafter.draft_costs[i] > 0:
            stats = drafter.stats[i]
            carried[(c, do_sample)] = ((stats.trials, stats.accepts), drafter.draft_costs[i])


def auto_drafter(
    model: PreTrainedModel,
    config: AutoConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.AutoDrafter:
    """The scheduling drafter over :func:`auto_candidates`, priced by ``model``'s forward profile (and a
    draft model by the measured seconds of its own forwards)."""
    profile = forward_profile(model, config)
    cost = _C.CostTable(
        list(profile.block_sizes), list(profile.context_lengths), [s for row in profile.seconds for s in row]
    )
    candidates = auto_candidates(model, config)
    # A draft model samples its chain under sampling (rejection sampling then accepts more); the other
    # drafters draft as under greedy decoding, verified by sample matching, so that the scheduler can
    # judge their trees every step (a sampled tree only on steps it ran).
    own_forwards = [registry.method_of(c).own_forwards for c in candidates]
    # Drafters that share a cross-request memory all read it, but only the first folds the generation
    # into it: the same text folded twice would double its counts.
    children, folding = [], set()
    for c, own in zip(candidates, own_forwards, strict=True):
        memory = ngram_memory(model, c) if isinstance(c, (StandConfig, HybridConfig)) else None
        fold = memory is None or id(memory) not in folding
        sampling = {"do_sample": do_sample, "process": process} if own else {}
        children.append(make_drafter(model, c, capacity=capacity, fold_memory=fold, **sampling))
        if memory is not None:
            folding.add(id(memory))
    # Each drafter drafts within its own block complexity; the step's budget is the largest of them.
    budgets = [c.block_complexity for c in candidates]
    carried = [
        _CARRIED.get(model, {}).get((c, do_sample)) if own else None
        for c, own in zip(candidates, own_forwards, strict=True)
    ]
    decay = float(config.decay)
    return _C.AutoDrafter(
        children,
        cost,
        decay=decay,
        explore_every=config.explore_every,
        budgets=budgets,
        own_forwards=own_forwards,
        carried_stats=[_C.AcceptanceStats(decay, *m[0]) if m else _C.AcceptanceStats(decay) for m in carried],
        carried_costs=[m[1] if m else 0.0 for m in carried],
    )


def decoding_configs() -> tuple[type, ...]:
    """The configuration classes of every registered method with a drafter (what mtprobe.generate runs)."""
    return tuple(m.config_type for m in registry.methods() if m.drafter is not None)


def check_decoding_config(config: object) -> registry.Method:
    """The registered method of ``config``, a configuration mtprobe.generate can run; TypeError for an
    unregistered type (naming the registered ones and how to register) or a harness baseline's
    configuration (no drafter)."""
    method = registry.find(config)
    drafters = ", ".join(m.name for m in registry.methods() if m.drafter is not None)
    if method is None:
        expected = ", ".join(c.__name__ for c in decoding_configs())
        raise TypeError(
            f"unknown decoding configuration {type(config).__name__}; expected one of {expected}, or a dict "
            f"with a 'method' key ({drafters}) and that configuration's fields; a new drafter registers its "
            "configuration with mtprobe.register_method(mtprobe.Method(name=..., config_type=..., drafter=..., "
            "summary=...))"
        )
    if method.drafter is None:
        raise TypeError(
            f"{type(config).__name__} is method {method.name!r}, a Spec-Bench harness baseline with no drafter: "
            f"mtprobe.generate runs the methods with one ({drafters})"
        )
    return method


def as_decoding_config(config: DecodingConfig | Mapping[str, Any] | None) -> DecodingConfig:
    """``config`` itself, the configuration a ``{"method": ..., ...}`` dict describes
    (:func:`mtprobe.config_from_dict`), or ``ProbeConfig()`` for ``None``; TypeError for anything else."""
    if config is None:
        return ProbeConfig()
    if isinstance(config, Mapping):
        return config_from_dict(config)
    check_decoding_config(config)
    return config


def make_drafter(
    model: PreTrainedModel,
    config: DecodingConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.Drafter:
    """The drafter a decoding configuration describes, built by its registered method's factory
    (``capacity``, ``do_sample`` and ``process`` matter only to drafters that run a model of their own;
    ``fold_memory`` only to STAND and the hybrid, see :func:`stand_drafter`)."""
    drafter = check_decoding_config(config).drafter
    return drafter(
        model, config, capacity=capacity, do_sample=do_sample, process=process, fold_memory=fold_memory
    )


def plain_drafter(
    model: PreTrainedModel,
    config: PlainConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.PlainDrafter:
    """Plain decoding's drafter: no drafts, the last committed token alone each step."""
    return _C.PlainDrafter()


def prompt_lookup_drafter(
    model: PreTrainedModel,
    config: PromptLookupConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.PromptLookupDrafter:
    """Prompt lookup's drafter: the chain after an earlier occurrence of the context's last n-gram."""
    return _C.PromptLookupDrafter(num_tokens=config.num_tokens, max_ngram_size=config.max_ngram_size)


def lookahead_drafter(
    model: PreTrainedModel,
    config: LookaheadConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.LookaheadDrafter:
    """Lookahead decoding's drafter: a Jacobi window and its n-gram pool."""
    return _C.LookaheadDrafter(
        ngram_size=config.ngram_size,
        window=config.window,
        guess_set_size=config.guess_set_size,
        pool_from_prompt=config.pool_from_prompt,
    )


def stand_drafter(
    model: PreTrainedModel,
    config: StandConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.StandDrafter:
    """STAND's drafter, with the cross-request memory of ``config.memory_size`` if set; ``fold_memory``
    False: it reads the memory but leaves folding the finished generation in to another drafter of the
    same generation (an AutoConfig's drafters sharing one memory)."""
    return _C.StandDrafter(
        max_depth=config.max_depth,
        max_ngram=config.max_ngram,
        table_size=config.table_size,
        logits_top_k=config.logits_top_k,
        memory=ngram_memory(model, config),
        fold_memory=fold_memory,
        prompt_logits=config.prompt_logits,
    )
