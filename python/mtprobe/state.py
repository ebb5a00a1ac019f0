"""Everything mtprobe keeps for one model between calls, in one place.

A generation on a model leaves things behind that the model's next generation reuses: the static
forward plan and its KV buffer, the CPU linear routes measured for it, the cross-request n-gram
memories, the self-drafts made of it (and their C++ decoders), and what ``AutoConfig``'s scheduler
measured of its draft models. They live in one :class:`ModelState` per model, held in one weak
dictionary: the state goes when the model goes, and :func:`release` drops it earlier (the plan's KV
buffer, the drafts' weights and the memories with it).

This module imports nothing of mtprobe: every floor above it keeps its own things here, under
names this class declares, so that one look at it shows what a model carries.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelState", "release", "state_of"]


@dataclass(eq=False)
class ModelState:
    """What one model carries from call to call (each field filled by the floor named beside it)."""

    plan: Any = None
    """The static forward plan (:mod:`mtprobe.target_model.plan`): its KV buffer, buckets and graphs."""
    batch_plan: Any = None
    """The batch's plan through HF's modules (:mod:`mtprobe.target_model.batch_plan`): its buffers and graphs."""
    linear_routes: dict[Any, Any] = field(default_factory=dict)
    """The CPU linear routes chosen for it, by route key (:func:`mtprobe.target_model.profile.choose_linear_routes`)."""
    truncated_drafts: dict[int, Any] = field(default_factory=dict)
    """Its layer-truncated self-drafts by depth (:func:`mtprobe.target_model.self_draft.layer_truncated`)."""
    quantized_drafts: dict[str, Any] = field(default_factory=dict)
    """Its quantized self-drafts by format (:func:`mtprobe.target_model.self_draft.quantized`)."""
    on_q4_grid: bool | None = None
    """Whether the model's linear weights are Q4_1 values already (:func:`mtprobe.target_model.self_draft.on_q4_grid`)."""
    decoder: Any = None
    """For a quantized self-draft: its one-token forward in C++, or None where it cannot run one."""
    decoder_checked: bool = False
    """Whether ``decoder`` was decided (None is an answer too)."""
    margin_stats: dict[float, Any] = field(default_factory=dict)
    """A draft model's ``_C.MarginStats`` by ``stop_below``: how often its greedy drafts matched the target, by
    class of their top-2 logit margin, counted over the process's generations (``DraftModelConfig.stop_below``)."""
    native: Any = None
    """Its own forward in C++ (:mod:`mtprobe.target_model.native_forward`), or None where HF's runs."""
    native_key: tuple[Any, ...] = ()
    """The panels' switch and the address and version counter of each parameter when ``native`` was built:
    replaced or rewritten parameters make a new one."""
    native_bits: Any = None
    """Sampled values of every parameter when ``native`` was built (``native_forward.sampled_bits``): a write
    through ``.data``, which the version counter misses, makes a new one."""
    native_reason: str | None = None
    """Why HF's forward runs (``""`` where ``native`` does; None: not decided yet)."""
    ngram_memories: dict[tuple[int, int, int], Any] = field(default_factory=dict)
    """The cross-request n-gram memories, by (memory_size, max_ngram, table_size) (:mod:`mtprobe.drafters.stand`)."""
    carried: dict[tuple[Any, bool, int], tuple[Any, float]] = field(default_factory=dict)
    """What AutoConfig measured of each draft model: (configuration, sampling, rows decoded together) ->
    (acceptance counts, seconds per draft) (:mod:`mtprobe.drafters.auto_carry`)."""
    draft_formats: dict[Any, str] = field(default_factory=dict)
    """The format AutoConfig chose for each of its quantized self-drafts of ``draft_format="auto"`` (that
    configuration -> ``"q8_0"`` etc.; :mod:`mtprobe.drafters.auto_formats`)."""
    format_runs: dict[tuple[Any, bool], int] = field(default_factory=dict)
    """Generations in which each format of such a self-draft drafted while measured: (its configuration in
    that format, sampling) -> count (:mod:`mtprobe.drafters.auto_formats`)."""
    carry_loaded: set[Any] = field(default_factory=set)
    """The ``AutoConfig.carry`` settings whose file was read into ``carried`` already."""
    batch_drafting: dict[tuple[Any, bool, int], Any] = field(default_factory=dict)
    """Whether a batch's rows draft, as measured by its earlier batches: (configuration, sampling, rows decoded
    together) -> :class:`mtprobe._C.BatchDrafting` (:func:`mtprobe.decode.batch.batch_drafting`)."""
    unsearched_codes: dict[int, tuple[tuple[int, int], dict[str, Any]]] = field(default_factory=dict)
    """Its linear layers' weights in GGUF's rounding, made once and shared by whoever needs them (the C++
    forward's codes, the 4-bit self-draft's layers on the grid, the grid test): id(layer) -> ((the weight's
    address, version counter), format -> QuantizedWeight) (:func:`mtprobe.target_model.weight_codes.unsearched`)."""
    weights_fingerprint: str | None = None
    """A hash of its weights, the key of the measurements kept on disk (:mod:`mtprobe.drafters.auto_carry`)."""


_STATES: weakref.WeakKeyDictionary[Any, ModelState] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()  # two threads' first generations on one model make one state


def state_of(model: Any) -> ModelState:
    """The state mtprobe keeps for ``model`` (made empty on first use)."""
    with _LOCK:
        state = _STATES.get(model)
        if state is None:
            state = _STATES[model] = ModelState()
        return state


def kept(model: Any) -> bool:
    """Whether mtprobe keeps a state for ``model``."""
    return model in _STATES


def release(model: Any) -> None:
    """Drop everything mtprobe keeps for ``model``: its plan (and KV buffer), linear routes, self-drafts,
    n-gram memories and carried measurements. The next generation starts as the first did (measured
    routes and profiles stay on disk)."""
    with _LOCK:
        _STATES.pop(model, None)
