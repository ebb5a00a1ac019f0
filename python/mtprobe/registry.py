"""The one registry of decoding methods.

A method is one :class:`Method` record, added by one :func:`register` call: its short name (what
``{"method": ...}`` dicts, ``--method`` and answer files say), its configuration class (a frozen
dataclass), its drafter factory, a one-line summary, the CLI :class:`Option` s that fill the
configuration, what ``decoding_steps`` counts and whether it samples. ``mtprobe.generate`` builds a
configuration's drafter through it (:func:`method_of`), ``mtprobe.config_from_dict`` finds a name's
configuration class in it, and the Spec-Bench harness and the ``mtprobe`` command list its methods
and their options. The built-in methods register in their own modules of :mod:`mtprobe.drafters`; the harness's peers with
no drafter (``ar``, ``hf-pld``) register a ``runner`` instead, in :mod:`mtprobe.specbench.methods`.

A drafter method's configuration must have a ``block_complexity`` (the most inputs one decode forward
takes: mtprobe sizes its buffers by it); it may set ``prompt_logit_rows`` (how many of the prompt's
last positions it reads the target's distributions at; default None: the prefill computes them at
every prompt position) and ``incremental_masks`` (default True). Its drafter factory is called as
``drafter(model, config, *, capacity, do_sample, process, fold_memory)`` (:class:`DrafterFactory`)
and returns a ``mtprobe._C.Drafter``: a C++ drafter, or a Python subclass of it.

This module imports nothing else of mtprobe: the configurations, the drafters and ``mtprobe.generate``
all sit above it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mtprobe import _C

__all__ = [
    "DecodingConfig",
    "DrafterFactory",
    "Method",
    "MethodOutput",
    "Option",
    "RunFn",
    "find",
    "get",
    "method_of",
    "methods",
    "names",
    "register",
    "unregister",
]

ProcessFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""HF's logits processors as one function ``process(ids, scores) -> scores``."""


class DecodingConfig(Protocol):
    """What ``mtprobe.generate`` reads of every drafter method's configuration (a frozen dataclass)."""

    @property
    def block_complexity(self) -> int:
        """The most inputs one decode forward takes: the committed token, drafts and auxiliary inputs."""
        ...


class DrafterFactory(Protocol):
    """How a method builds its drafter for one generation."""

    def __call__(
        self,
        model: PreTrainedModel,
        config: Any,
        *,
        capacity: int,
        do_sample: bool,
        process: ProcessFn | None,
        fold_memory: bool,
    ) -> _C.Drafter:
        """The drafter ``config`` describes over ``model``. ``capacity``: the target's first KV capacity
        (a drafter with a model of its own sizes its cache by it); ``do_sample``: the generation samples;
        ``process``: HF's logits processors, or None; ``fold_memory``: a drafter with a cross-request
        memory folds the finished generation into it (False when another drafter of the same
        generation does)."""
        ...


class MethodOutput(NamedTuple):
    """What one generation call of a method returns (a tuple, so it also unpacks)."""

    new_ids: torch.Tensor
    """1-D tensor of the generated tokens only (prompt removed), EOS included when generated."""
    decoding_steps: int
    accept_lengths: list[int]


RunFn = Callable[..., MethodOutput]
"""``runner(model, input_ids, config, max_new_tokens[, temperature=T]) -> MethodOutput``; ``temperature``
is passed only when it is above 0."""


@dataclass(frozen=True)
class Option:
    """A CLI option that sets one field of a method's configuration dataclass."""

    flag: str
    """Command-line flag, e.g. ``"--block-complexity"``; several methods may share one."""
    field: str
    """Field of the configuration dataclass it sets."""
    type: Callable[[str], Any]
    """Parser of the option's value (``int``, ``float``, ...)."""
    id_key: str
    """Short key used in the default model_id, e.g. ``"bc"`` -> ``bc30``."""
    help: str
    """What the field means for this method; name its default in the text when the field's own
    default is ``None`` (resolved by the configuration), otherwise the help appends it."""
    always_in_id: bool = False
    """Part of the default model_id even at its default value (the method's headline setting, e.g. BC);
    other options appear in the id only when they differ from the method's default."""
    const: Any = None
    """With a value, the flag may also be given alone and then means this value
    (``--shared-ngram-memory`` alone: a memory of the default size)."""

    def __post_init__(self) -> None:
        if not isinstance(self.flag, str) or not self.flag.startswith("--") or len(self.flag) < 3:
            raise ValueError(
                f"Option flag must be a long option such as '--block-complexity', got {self.flag!r}"
            )
        if not isinstance(self.field, str) or not self.field.isidentifier():
            raise ValueError(f"Option {self.flag}: field must name a configuration field, got {self.field!r}")
        if not callable(self.type):
            raise TypeError(
                f"Option {self.flag}: type must parse the option's text (int, float, ...), got {self.type!r}"
            )

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


# Method.tokens_only of a registration that has not said whether its drafter drafts from tokens alone.
NOT_DECLARED = (
    "its registration does not say whether it drafts from the token history alone (Method.tokens_only)"
)


@dataclass(frozen=True, kw_only=True)
class Method:
    """One registry entry: how to configure, build and run a decoding method.

    A method has a ``drafter`` (``mtprobe.generate`` runs it), or only a ``runner`` (a harness peer
    such as ``ar``, which runs outside mtprobe); a ``runner`` next to a ``drafter`` replaces how the
    harness runs it (by default ``mtprobe.generate`` with the configuration).
    """

    name: str
    """The short name: ``{"method": name}`` dicts, ``--method name``, answer files."""
    config_type: type
    """A frozen dataclass; its own defaults and validation apply to options not given."""
    summary: str
    """One line for ``--help``."""
    drafter: DrafterFactory | None = None
    runner: RunFn | None = None
    options: tuple[Option, ...] = ()
    steps_doc: str = "forward calls, prefill included"
    """What ``decoding_steps`` counts for this method (shown in --help)."""
    supports_sampling: bool = True
    """Whether ``temperature > 0`` is implemented (every built-in drafter samples losslessly)."""
    schedulable: bool = False
    """Whether ``AutoConfig`` may choose among its drafts: it prices them by the target's forward
    profile and, with ``own_forwards``, by the measured seconds of the drafter's own forwards."""
    own_forwards: bool = False
    """Whether the drafter runs forwards of a model of its own to propose (a draft model): the
    scheduler then asks it for a chain only when the chain's forecast pays (csrc/drafters/auto.h)."""
    takes_target: bool = False
    """Whether the drafter factory takes ``target=``, the generation's target adapter
    (:class:`mtprobe.target_model.adapter.HFAdapter`), built before the drafter: a drafter that reads the
    target's KV cache (the quantized self-draft copies its entries) has it handed in."""

    # What a method adds to the shared decode path, each None where it adds nothing. The decode path
    # asks the registration, never the configuration's class.
    hidden_layer: Callable[[PreTrainedModel, Any], int] | None = None
    """Needs hidden states: ``hidden_layer(model, config)``, the ``hidden_states`` index its drafter
    reads (-1: the last); None: it reads none."""
    children: Callable[[Any], tuple[Any, ...]] | None = None
    """Runs other drafters (a scheduler): ``children(config)``, the configurations it chooses among;
    what they need of the shared path (hidden states, mask adaptation, memories) is asked of them."""
    mask_calibration: Callable[[Any], tuple[str, int] | None] | None = None
    """Probes with calibrated masks: ``mask_calibration(config)``, the calibration file and mask count
    whose layer offsets, LoRA and temperatures the target's forward applies, or None when it has none."""
    memory: Callable[[PreTrainedModel, Any], Any] | None = None
    """Drafts from a cross-request n-gram memory: ``memory(model, config)``, the model's memory it reads
    and folds into, or None when the configuration keeps none."""
    unavailable: Callable[[PreTrainedModel, Any], str | None] | None = None
    """``unavailable(model, config)``: why this drafter cannot run on ``model`` (a scheduler leaves it
    out), or None when it can."""
    check_context: Callable[[PreTrainedModel, Any, int, int], None] | None = None
    """``check_context(model, config, prompt_len, max_new_tokens)``: raise when the drafter cannot
    reach the positions one generation needs (a draft model with a shorter context)."""
    finish: Callable[[PreTrainedModel, Any, Any, Any, bool], None] | None = None
    """``finish(model, config, drafter, output, do_sample)`` after each sequence's loop: the method's own
    fields of the :class:`~mtprobe.decode.output.GenerateOutput` (a scheduler's choices, a bank's trees)
    and what it carries to the model's next generation."""
    tokens_only: str | None = NOT_DECLARED
    """Why the method's drafter cannot draft for a step verified outside mtprobe's decode loop, which hands back the
    accepted tokens only (no logits, no hidden states, no auxiliary inputs: a serving engine's step,
    :mod:`mtprobe.vllm`); None when it drafts from the token history alone."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() for c in self.name):
            raise ValueError(f"a method's name must be a non-empty string without spaces, got {self.name!r}")
        cls = self.config_type
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):
            raise TypeError(
                f"method {self.name!r}: config_type must be a frozen dataclass (@dataclass(frozen=True) class ...), "
                f"got {cls!r}"
            )
        if self.drafter is None and self.runner is None:
            raise ValueError(
                f"method {self.name!r} needs drafter=factory(model, config, *, capacity, do_sample, process, "
                "fold_memory) (mtprobe.generate runs it), or runner=run(model, input_ids, config, max_new_tokens) "
                "for a harness-only baseline"
            )
        hooks = (
            "hidden_layer",
            "children",
            "mask_calibration",
            "memory",
            "unavailable",
            "check_context",
            "finish",
        )
        for what in ("drafter", "runner", *hooks):
            if getattr(self, what) is not None and not callable(getattr(self, what)):
                raise TypeError(f"method {self.name!r}: {what} must be callable, got {getattr(self, what)!r}")
        if self.drafter is not None and not _has_attribute(cls, "block_complexity"):
            raise TypeError(
                f"method {self.name!r}: {cls.__name__} has no block_complexity field; a drafter method's "
                "configuration needs one (the most inputs one decode forward takes: mtprobe sizes its buffers by it)"
            )
        if self.own_forwards and not self.schedulable:
            raise ValueError(
                f"method {self.name!r}: own_forwards=True tells AutoConfig how to schedule it; set schedulable=True "
                "as well, or leave own_forwards False"
            )
        if not isinstance(self.options, tuple) or not all(isinstance(o, Option) for o in self.options):
            raise TypeError(
                f"method {self.name!r}: options must be a tuple of mtprobe.Option, got {self.options!r}"
            )
        fields = {f.name for f in dataclasses.fields(cls)}
        for o in self.options:
            if o.field not in fields:
                raise ValueError(
                    f"method {self.name!r}: option {o.flag} sets field {o.field!r}, which {cls.__name__} does not "
                    f"have (its fields: {', '.join(sorted(fields))})"
                )

    def make_config(self, values: Mapping[str, Any] | None = None) -> Any:
        """Build the configuration from ``{field: value}``; missing fields keep their defaults."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(self.config_type)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"method {self.name!r} has no option(s) {', '.join(unknown)}")
        return self.config_type(**values)

    def id_suffix(self, config: Any) -> str:
        """The option part of a short default model_id: the headline options (``always_in_id``) and
        every other option that differs from the method's default given those, e.g. ``bc30`` for
        ``ProbeConfig(block_complexity=30)`` and ``bc60-k1`` for ``ProbeConfig(60, num_masks=1)``.
        The full configuration goes into the answer file's metadata, not into the id."""
        headline = {o.field: getattr(config, o.field) for o in self.options if o.always_in_id}
        try:
            reference = self.make_config(headline)
        except (TypeError, ValueError):
            reference = None
        parts = []
        for o in self.options:
            value = getattr(config, o.field)
            if o.always_in_id or reference is None or value != getattr(reference, o.field):
                parts.append(f"{o.id_key}{id_value(value)}")
        return "-".join(parts)

    def check_temperature(self, temperature: float) -> None:
        """TypeError or ValueError unless ``temperature`` is a finite number >= 0; NotImplementedError
        for a positive one when the method does not sample."""
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise TypeError(f"temperature must be a float, got {temperature!r}")
        if not temperature >= 0 or temperature == float("inf"):  # also refuses NaN
            raise ValueError(
                f"temperature must be a finite number >= 0 (0: greedy decoding, > 0: sampling), got {temperature}"
            )
        if temperature != 0 and not self.supports_sampling:
            raise NotImplementedError(
                f"temperature={temperature}: sampling is not implemented for method {self.name!r} yet; "
                "use --temperature 0 (greedy decoding)"
            )


def _has_attribute(cls: type, name: str) -> bool:
    return name in {f.name for f in dataclasses.fields(cls)} or hasattr(cls, name)


def id_value(value: Any) -> str:
    """``value`` as it appears in a default model_id (``on``/``off``, a file's stem, an AutoConfig's
    drafters as their method names joined by ``+``)."""
    if isinstance(value, tuple) and value and all(find(v) is not None for v in value):
        return "+".join(method_of(v).name for v in value)
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and ("/" in value or os.sep in value or value.endswith(".json")):
        return Path(value).stem  # a file (a profile, a bank): its name, not its folders
    return str(value)


# name -> Method, in registration order. The one store: lookups by configuration walk it.
_METHODS: dict[str, Method] = {}


def register(method: Method, *, replace: bool = False) -> Method:
    """Add ``method`` to the registry and return it.

    A name already registered, or a configuration class another method registered, is a ValueError;
    so is a configuration class whose ``method`` attribute names another method. ``replace=True``
    replaces the registration of ``method.name`` in place (its position in listings is kept).
    """
    if not isinstance(method, Method):
        raise TypeError(f"register takes a mtprobe.Method, got {type(method).__name__}")
    declared = getattr(method.config_type, "method", method.name)
    if declared != method.name:
        raise ValueError(
            f"method {method.name!r}: {method.config_type.__name__} declares method = {declared!r}; one name per "
            f"method everywhere (config dicts, --method, answer files): register it as {declared!r}"
        )
    existing = _METHODS.get(method.name)
    if existing is not None and not replace:
        raise ValueError(
            f"method {method.name!r} is already registered (configuration {existing.config_type.__name__}); "
            "choose another name, or pass replace=True to replace it"
        )
    for other in _METHODS.values():
        if other.config_type is method.config_type and other.name != method.name:
            raise ValueError(
                f"{method.config_type.__name__} is already registered as method {other.name!r}: one configuration "
                f"class per method; give {method.name!r} a configuration class of its own"
            )
    _METHODS[method.name] = method
    return method


def unregister(name: str) -> Method:
    """Remove the method ``name`` from the registry and return it (ValueError if it is not registered);
    its configurations are unknown to ``mtprobe.generate`` afterwards."""
    method = get(name)
    del _METHODS[name]
    return method


def methods() -> tuple[Method, ...]:
    """Every registered method, in registration order."""
    return tuple(_METHODS.values())


def names() -> tuple[str, ...]:
    """Every registered method's name, in registration order."""
    return tuple(_METHODS)


def get(name: str) -> Method:
    """The registered method ``name``; ValueError listing the registered ones otherwise."""
    try:
        return _METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown method {name!r}; registered methods: {', '.join(_METHODS)}") from None


def find(config: object) -> Method | None:
    """The registered method whose configuration class ``config`` is (or subclasses: the nearest
    registered class along its MRO), or None."""
    by_config = {m.config_type: m for m in _METHODS.values()}
    return next((by_config[c] for c in type(config).__mro__ if c in by_config), None)


def method_of(config: object) -> Method:
    """:func:`find`, but an unregistered configuration is a TypeError naming the registered
    configuration classes and how to register one."""
    method = find(config)
    if method is None:
        registered = ", ".join(f"{m.config_type.__name__} ({m.name})" for m in _METHODS.values())
        raise TypeError(
            f"unknown decoding configuration {type(config).__name__}: no registered method has it as its "
            f"config_type (registered: {registered}); register one with mtprobe.register_method(mtprobe.Method("
            f"name=..., config_type={type(config).__name__}, drafter=..., summary=...))"
        )
    return method
