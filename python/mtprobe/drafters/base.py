"""What every drafter method shares: the configuration base class, the dict and JSON forms, the
argument checks, and the questions the decode path asks of a configuration through its registration
(:class:`mtprobe.registry.Method`): its drafter, the prompt rows it reads, the hidden layer, the mask
adaptation and the n-gram memories.

Each method's own module (``mtprobe.drafters.<name>``, named as ``csrc/drafters/<name>.cpp``) holds its
configuration, its drafter factory and its one registration, and builds on this module only.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

import torch

from mtprobe import registry
from mtprobe.registry import DecodingConfig, Option, ProcessFn
from mtprobe.target_model.mask_calibration import load_calibration

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mtprobe import _C
    from mtprobe.target_model.adapter import HFAdapter

_T = TypeVar("_T")
_Config = TypeVar("_Config", bound="ConfigData")


class ConfigData:
    """``to_dict`` / ``from_dict`` / ``to_json`` / ``from_json`` for the decoding configurations.

    The dict holds ``"method"`` (the short name the class is registered under, :mod:`mtprobe.registry`)
    and every field with its resolved value (defaults such as ``num_masks=None`` already filled in),
    tuples as lists, so it is JSON as it stands and ``from_dict(to_dict(c)) == c``.
    """

    # The registered method's short name; each class declares it and registration checks it agrees.
    method: ClassVar[str]
    # How many of the prompt's last positions the drafter reads the target's distributions at (the
    # n-gram stores seed themselves from them); None: every position. The prefill computes logits
    # at those only, and always at the last, which picks the first token
    # (mtprobe.target_model.adapter.HFAdapter.prefill_logits_from): on a long prompt the LM head over every row
    # costs a sixth of the prefill.
    prompt_logit_rows: ClassVar[int | None] = 1

    def to_dict(self) -> dict[str, Any]:
        """``{"method": ..., field: value, ...}`` with JSON types (tuples become lists)."""
        out: dict[str, Any] = {"method": self.method}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if hasattr(value, "to_dict"):  # a nested object that serialises itself (a TopologyBank)
                value = value.to_dict()
            elif isinstance(value, os.PathLike):
                value = os.fspath(value)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def to_json(self, **dumps_kwargs: Any) -> str:
        """``to_dict()`` as JSON text (``dumps_kwargs`` go to ``json.dumps``, e.g. ``indent=2``)."""
        return json.dumps(self.to_dict(), **dumps_kwargs)

    @classmethod
    def from_dict(cls: type[_Config], data: Mapping[str, Any], **overrides: Any) -> _Config:
        """Rebuild a configuration from :meth:`to_dict`'s output (or any subset of its fields; the
        others keep their defaults). ``overrides`` set fields a dict cannot hold (a live
        ``draft_model``). Unknown keys and a ``"method"`` of another class are errors; the values are
        validated as the constructor validates them."""
        return dataclass_from_dict(cls, cls.method, data, overrides)

    @classmethod
    def from_json(cls: type[_Config], text: str | bytes, **overrides: Any) -> _Config:
        """Rebuild a configuration from :meth:`to_json`'s output."""
        return cls.from_dict(json.loads(text), **overrides)


def dataclass_from_dict(
    cls: type[_T], method: str, data: Mapping[str, Any], overrides: Mapping[str, Any]
) -> _T:
    """``cls(**fields)`` from a dict of method ``method``'s fields (``"method"`` optional; derived fields,
    ``init=False``, skipped); an unknown key or another method's name is a ValueError."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{cls.__name__}.from_dict takes a dict of its fields, got {type(data).__name__}")
    given = data.get("method", method)
    if given != method:
        raise ValueError(
            f"{cls.__name__}.from_dict got method={given!r}, but {cls.__name__} is method {method!r}; "
            f"use mtprobe.config_from_dict to pick the class from the method"
        )
    valid = [f.name for f in fields(cls)]  # type: ignore[arg-type]
    derived = {f.name for f in fields(cls) if not f.init}  # type: ignore[arg-type]
    # Derived fields (to_dict writes them) are recomputed by the constructor, not passed to it.
    values = {k: v for k, v in data.items() if k != "method" and k not in derived}
    unknown = sorted(set(values) - set(valid), key=str) + sorted(set(overrides) - set(valid))
    if unknown:
        raise ValueError(
            f"{cls.__name__} (method {method!r}) has no field(s) {', '.join(map(repr, unknown))}; "
            f"valid keys: method, {', '.join(valid)}"
        )
    values.update(overrides)
    # JSON has no tuples: a list stands for a tuple field (ProbeConfig.branches).
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**values)


def config_from_dict(data: Mapping[str, Any], **overrides: Any) -> Any:
    """The decoding configuration a dict describes, vLLM ``speculative_config`` style: ``"method"``
    names a registered drafter method (``probe``, ``pld``, ``sps``, ``stand``, ``lookahead``, ``hybrid``,
    ``entmtp``, ``heads``, ``auto`` and any registered since: the names the Spec-Bench harness uses) and
    the other keys are its configuration's fields (built by the class's ``from_dict`` if it has one).

    >>> config_from_dict({"method": "pld", "num_tokens": 4})
    PromptLookupConfig(num_tokens=4, max_ngram_size=2, block_complexity=5)
    >>> config_from_dict({"method": "medusa"})
    Traceback (most recent call last):
    ...
    ValueError: unknown method 'medusa'; known methods: probe, pld, sps, stand, lookahead, hybrid, entmtp, heads, auto, plain
    """
    if not isinstance(data, Mapping):
        raise TypeError(f"a configuration dict must be a dict with a 'method' key, got {type(data).__name__}")
    drafters = {m.name: m for m in registry.methods() if m.drafter is not None}
    known = ", ".join(drafters)
    if "method" not in data:
        raise ValueError(
            f"a configuration dict needs a 'method' key naming the decoding method (one of {known}); "
            f"got keys {sorted(map(str, data))}"
        )
    name = data["method"]
    if isinstance(name, str) and name in registry.names():
        if name not in drafters:
            raise ValueError(
                f"method {name!r} has no drafter (a Spec-Bench harness baseline, run by mtprobe.specbench only); "
                f"known methods: {known}"
            )
    if not isinstance(name, str) or name not in drafters:
        raise ValueError(f"unknown method {name!r}; known methods: {known}")
    cls = drafters[name].config_type
    from_dict = getattr(cls, "from_dict", None)
    if callable(from_dict):
        return from_dict(data, **overrides)
    return dataclass_from_dict(cls, name, data, overrides)


def config_from_json(text: str | bytes, **overrides: Any) -> ConfigData:
    """:func:`config_from_dict` of JSON text (what a configuration's ``to_json`` wrote)."""
    return config_from_dict(json.loads(text), **overrides)


# --- argument checks the configurations share -----------------------------------------------------------


def check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")


# The C++ drafters take the seed as an int64 and seed a uint64 generator with it (csrc/bindings/drafters.cpp,
# csrc/drafters/mask_probe.cpp): the seeds both sides carry unchanged are 0 .. 2**63 - 1.
SEED_MAX = 2**63 - 1


def check_seed(seed: object) -> None:
    check_int("seed", seed)
    if not 0 <= seed <= SEED_MAX:
        raise ValueError(
            f"seed={seed} is out of range: a seed must be an int in [0, 2**63 - 1] = [0, {SEED_MAX}] "
            "(the C++ drafters take it as a signed 64-bit integer)"
        )


def resolve_budget(config: object, needed: int, what: str) -> None:
    """Fill ``config.block_complexity`` with what its drafts need, or check a given budget holds them."""
    bc = config.block_complexity
    if bc is None:
        object.__setattr__(config, "block_complexity", needed)
        return
    check_int("block_complexity", bc)
    if bc < needed:
        raise ValueError(f"{what} needs block_complexity >= {needed} inputs per step, got {bc}")


def max_prompt_logit_rows(configs: Any) -> int | None:
    """The prompt rows (from its end) whose logits any of ``configs`` reads: the most of their
    ``prompt_logit_rows``, ``None`` (every row) when one reads every row or does not say."""
    rows = 1
    for c in configs:
        r = getattr(c, "prompt_logit_rows", None)
        if r is None:
            return None
        rows = max(rows, r)
    return rows


# --- the CLI options several methods share ------------------------------------------------------------


def bc_option(help_text: str) -> Option:
    return Option("--block-complexity", "block_complexity", int, "bc", help_text, always_in_id=True)


def parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    # argparse prints an ArgumentTypeError's own message (a ValueError: "invalid parse_bool value")
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


# --- a configuration's drafter, through its registration ----------------------------------------------


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
        return registry.get("probe").config_type()
    if isinstance(config, Mapping):
        return config_from_dict(config)
    check_decoding_config(config)
    return config


def make_drafter(
    model: PreTrainedModel,
    config: DecodingConfig,
    *,
    target: HFAdapter | None = None,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.Drafter:
    """The drafter a decoding configuration describes, built by its registered method's factory.
    ``target``: the generation's target adapter, handed to a method registered with ``takes_target``
    (None: a drafter that would read the target's cache runs on its own); ``capacity``, ``do_sample``
    and ``process`` matter only to drafters that run a model of their own; ``fold_memory`` only to
    drafters with a cross-request memory (:func:`mtprobe.drafters.stand.stand_drafter`)."""
    method = check_decoding_config(config)
    extra = {"target": target} if method.takes_target else {}
    return method.drafter(
        model,
        config,
        capacity=capacity,
        do_sample=do_sample,
        process=process,
        fold_memory=fold_memory,
        **extra,
    )


def leaves(config: object) -> tuple[Any, ...]:
    """The configurations whose drafters ``config`` runs: its children for a scheduler, else itself."""
    children = registry.method_of(config).children
    return tuple(children(config)) if children is not None else (config,)


def drafts_row_by_row(config: object) -> bool:
    """Whether one of the drafters ``config`` runs (a scheduler's children included) drafts with a draft model
    handed the target (``takes_target``) whose forwards a batch's rows cannot run together: a draft model of
    the user's or the layer-truncated self-draft (HF's modules, row by row); the quantized self-draft's steps
    meet (its configuration's ``steps_meet_in_batch``)."""
    return any(
        registry.method_of(c).takes_target and not getattr(c, "steps_meet_in_batch", False)
        for c in leaves(config)
    )


def hidden_layer(model: PreTrainedModel, config: DecodingConfig) -> int:
    """The ``hidden_states`` index the drafter of ``config`` reads (-1, the last, unless a circuit head
    has LoRA draft layers: then the input of the first of them); ValueError if two drafters of a
    scheduler read different layers."""
    layers = set()
    for c in leaves(config):
        read = registry.method_of(c).hidden_layer
        if read is not None:
            layers.add(read(model, c))
    if len(layers) > 1:
        raise ValueError(
            f"AutoConfig's circuit heads read different hidden states ({sorted(layers)}; -1 is the last): "
            "one forward returns one; use heads with the same lora_layers"
        )
    return layers.pop() if layers else -1


def ngram_memories(model: PreTrainedModel, config: object) -> list[_C.NgramMemory]:
    """Every cross-request memory ``config`` drafts with on ``model`` (a scheduler's drafters included):
    what a benchmark clears between runs."""
    found = []
    for c in leaves(config):
        memory = registry.method_of(c).memory
        m = memory(model, c) if memory is not None else None
        if m is not None:
            found.append(m)
    return found


class MaskAdaptation(NamedTuple):
    """What calibrated masks change in the model's computation at the masks, each None when they have none."""

    offsets: torch.Tensor | None  # [num_layers, hidden] or, one set per mask, [k, num_layers, hidden]
    lora: dict[str, torch.Tensor] | None  # "{layer}.{module}.A": [rank, in], ".B": [out, rank]
    temperature: torch.Tensor | None  # [k]


def mask_adaptation(config: DecodingConfig) -> MaskAdaptation:
    """The layer offsets (:func:`mtprobe.target_model.mask_hooks.layer_offsets`), mask LoRA
    (:func:`mtprobe.target_model.mask_hooks.mask_lora`) and mask temperatures
    (:func:`mtprobe.target_model.mask_hooks.scale_mask_logits`) of the calibrated masks ``config`` probes with.
    ValueError if two drafters of an AutoConfig bring different ones: one forward adds one set of
    offsets, adapts one way and scales its mask rows one way. The adapter checks each against the model
    (``HFAdapter.set_mask_layer_offsets``, ``set_mask_lora``, ``set_mask_temperature``)."""
    offsets: dict[tuple[str, int], torch.Tensor] = {}
    temperatures: dict[tuple[str, int], torch.Tensor] = {}
    loras: dict[str, dict[str, torch.Tensor]] = {}
    for c in leaves(config):
        calibrated = registry.method_of(c).mask_calibration
        found_file = calibrated(c) if calibrated is not None else None
        if found_file is None:
            continue
        path, num_masks = found_file
        cal = load_calibration(path)
        for found, t in (
            (offsets, cal.offsets_for(num_masks)),
            (temperatures, cal.temperature_for(num_masks)),
        ):
            if t is not None:
                found[(path, num_masks)] = t
        if cal.mask_lora is not None:
            loras[path] = cal.mask_lora
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
