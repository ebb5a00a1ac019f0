"""The Spec-Bench harness's side of the method registry (:mod:`mtprobe.registry`).

The methods themselves, their configurations, drafters and CLI options, are registered once, in
:mod:`mtprobe.registry` (the built-in ones in :mod:`mtprobe.drafters`); this module turns their
:class:`Option` s into argparse arguments (:func:`add_method_arguments`, :func:`config_from_args`),
lists them for ``--method`` (:data:`METHODS`, :func:`get_method`) and registers the two peers that have
no drafter and run outside mtprobe: ``ar`` (HF ``model.generate``) and ``hf-pld`` (transformers' own
prompt lookup).

Every method samples when asked: ``run(..., temperature=T)`` with ``T > 0`` decodes with
``do_sample=True, temperature=T`` (``ar`` through HF ``model.generate``, the others through
``mtprobe.generate``, whose sampling is exact in distribution: tests/test_sampling.py); ``top_k`` and
``top_p`` are what the model's generation config sets, the same for every method.

``decoding_steps`` follows Spec-Bench: for ``ar`` it is the number of new tokens (as in Spec-Bench's
``inference_baseline.py``, which equals the forwards greedy decoding makes, prefill included); for
the mtprobe methods it is ``GenerateOutput.forward_calls``: target forwards, **prefill included**. Either way
``ar decoding_steps / method decoding_steps`` is the reduction in forward calls.
``accept_lengths`` holds the tokens gained per step: ``[1] * new_tokens`` for ``ar``; for the others
``GenerateOutput.accept_lengths``, one per decode forward, prefill *not* included: the prefill's
tokens are the ``new_tokens - sum(accept_lengths)`` left over, its own token and, for drafters that
already draft from the prompt (prompt lookup, STAND), the drafts it verified.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from mtprobe import registry
from mtprobe.decode import generate
from mtprobe.drafters.stand import (
    SHARED_NGRAM_MEMORY_SIZE,  # importing mtprobe.drafters registers the built-ins
)
from mtprobe.registry import Method, MethodOutput, Option, RunFn, register
from mtprobe.registry import id_value as _id_value
from mtprobe.target_model.mask_hooks import this_thread_only

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "METHODS",
    "SHARED_NGRAM_MEMORY_SIZE",
    "GreedyConfig",
    "Method",
    "MethodOutput",
    "Option",
    "RunFn",
    "add_method_arguments",
    "available_methods",
    "config_from_args",
    "get_method",
    "register",
    "run_method",
    "sampling_kwargs",
]


def sampling_kwargs(temperature: float) -> dict[str, Any]:
    """``generate`` keywords for ``temperature``: greedy at 0 (as Spec-Bench's inference_baseline.py, which
    samples only above 1e-5 and compares with 0), ``do_sample=True, temperature=T`` above."""
    return {"do_sample": True, "temperature": float(temperature)} if temperature > 0 else {"do_sample": False}


def run_method(
    method: Method,
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [1, L]
    config: Any,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
) -> MethodOutput:
    """One generation of ``method`` as the harness runs it: greedy at ``temperature`` 0, else sampling
    with ``do_sample=True, temperature=T``. A harness-only peer runs its ``runner``; a drafter method runs
    through :func:`mtprobe.generate` with ``config``: ``decoding_steps`` is its ``forward_calls``
    (prefill included) and ``accept_lengths`` its ``accept_lengths`` (one per decode forward, prefill
    not included)."""
    if method.runner is not None:
        extra = {"temperature": temperature} if temperature else {}
        return method.runner(model, input_ids, config, max_new_tokens, **extra)
    out = generate(
        model,
        input_ids,
        config,
        max_new_tokens=max_new_tokens,
        attention_mask=torch.ones_like(input_ids),
        **sampling_kwargs(temperature),
    )
    return MethodOutput(
        out.sequences[0, input_ids.shape[1] :], int(out.forward_calls), list(out.accept_lengths)
    )


def available_methods() -> tuple[str, ...]:
    """Every registered method's name: the ``ar`` baseline first (every run is compared with it), then
    the registry's order."""
    names = registry.names()
    return tuple(sorted(names, key=lambda name: name != "ar"))


class _MethodView(Mapping[str, Method]):
    """The registry as a read-only mapping ``name -> Method`` in :func:`available_methods`' order, live:
    a method registered later is in it. Register and unregister through :mod:`mtprobe.registry`."""

    def __getitem__(self, name: str) -> Method:
        if name not in registry.names():
            raise KeyError(name)
        return registry.get(name)

    def __iter__(self) -> Iterator[str]:
        return iter(available_methods())

    def __len__(self) -> int:
        return len(registry.names())

    def __repr__(self) -> str:
        return f"METHODS({', '.join(self)})"


METHODS: Mapping[str, Method] = _MethodView()
"""Every registered method by name (``ar`` first), a live read-only view of :mod:`mtprobe.registry`."""


def get_method(name: str) -> Method:
    """The registered method ``name``; ValueError listing the available ones otherwise."""
    if not isinstance(name, str) or name not in registry.names():
        raise ValueError(f"unknown method {name!r}; available methods: {', '.join(available_methods())}")
    return registry.get(name)


def _all_options() -> dict[str, tuple[Option, list[str]]]:
    # flag -> (option, names of the methods that use it); methods may share a flag.
    flags: dict[str, tuple[Option, list[str]]] = {}
    for m in METHODS.values():
        for o in m.options:
            flags.setdefault(o.flag, (o, []))[1].append(m.name)
    return flags


def _field_default(method_name: str, option: Option) -> Any:
    for f in dataclasses.fields(METHODS[method_name].config_type):
        if f.name == option.field:
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            return None if f.default is dataclasses.MISSING else f.default
    return None


def _own_option(method_name: str, flag: str) -> Option:
    return next(o for o in METHODS[method_name].options if o.flag == flag)


def option_help(flag: str) -> str:
    """The --help text of ``flag``: what it sets for each method that takes it, with that method's default.

    A flag shared by methods whose meaning or default differ (``--num-tokens``: pld's chain depth, 10,
    and sps's drafts per step, 5) gets one clause per method, so no method is described by another's text.
    """
    option, users = _all_options()[flag]
    clauses = []
    for name in users:
        own = _own_option(name, flag)
        default = _field_default(name, own)
        text = own.help if default is None else f"{own.help}; default {_id_value(default).lower()}"
        clauses.append((name, text))
    if len({text for _, text in clauses}) == 1:
        return f"{clauses[0][1]} (method{'s' if len(users) > 1 else ''}: {', '.join(users)})"
    return " | ".join(f"{name}: {text}" for name, text in clauses)


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every registered method's options to ``parser`` (default None = the method's default)."""
    group = parser.add_argument_group("method options (each applies only to the methods named in its help)")
    for flag, (option, _users) in _all_options().items():
        optional = {"nargs": "?", "const": option.const} if option.const is not None else {}
        group.add_argument(
            flag, dest=option.dest, type=option.type, default=None, help=option_help(flag), **optional
        )


def config_from_args(method: Method, args: argparse.Namespace) -> Any:
    """Build ``method``'s configuration from parsed CLI options.

    An option given on the command line that belongs only to other methods is an error rather than
    silently ignored (``--block-complexity 10 --method ar`` would otherwise look like a probe run).
    """
    own = {o.flag for o in method.options}
    for flag, (option, users) in _all_options().items():
        if flag not in own and getattr(args, option.dest, None) is not None:
            raise ValueError(
                f"{flag} does not apply to method {method.name!r} (it is an option of: {', '.join(users)})"
            )
    values = {
        o.field: getattr(args, o.dest) for o in method.options if getattr(args, o.dest, None) is not None
    }
    return method.make_config(values)


# --- ar: plain decoding with HF generate --------------------------------------------------------


@dataclass(frozen=True)
class GreedyConfig:
    """Plain ``model.generate``: greedy (``do_sample=False``), or sampling at ``--temperature T > 0``.
    Nothing to configure."""


def _hf_generate(
    model: PreTrainedModel, input_ids: torch.Tensor, max_new_tokens: int, **kwargs: Any
) -> torch.Tensor:
    """HF ``model.generate`` of one prompt ``[1, L]``: the new tokens ``[new]``."""
    # The all-ones attention mask changes nothing for one unpadded row; it silences HF's warning
    # for models whose pad token is their EOS token.
    out = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, **kwargs
    )
    return out[0, input_ids.shape[1] :]


def _run_ar(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [1, L]
    config: GreedyConfig,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
) -> MethodOutput:
    new_ids = _hf_generate(model, input_ids, max_new_tokens, **sampling_kwargs(temperature))  # [new]
    n = int(new_ids.shape[0])
    # As Spec-Bench's inference_baseline.py: one step and one accepted token per new token.
    return MethodOutput(new_ids, n, [1] * n)


register(
    Method(
        name="ar",
        config_type=GreedyConfig,
        runner=_run_ar,
        summary="autoregressive baseline: HF model.generate (greedy, or sampling at --temperature > 0)",
        steps_doc="new tokens (= forward calls, prefill included)",
    )
)


# --- hf-pld: transformers' own prompt lookup, a peer baseline -------------------------------------------


@dataclass(frozen=True)
class HFPromptLookupConfig:
    """transformers' prompt lookup: ``model.generate(prompt_lookup_num_tokens=N)``, as a peer baseline."""

    num_tokens: int = 10
    max_ngram_size: int = 2

    def __post_init__(self) -> None:
        for name in ("num_tokens", "max_ngram_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")


def _run_hf_pld(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [1, L]
    config: HFPromptLookupConfig,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
) -> MethodOutput:
    # Before each target forward the cache holds the committed tokens but the last (HF crops it to
    # that after every step), so consecutive forwards' cache lengths differ by the tokens a step
    # gained (accepted drafts + bonus). The first forward is the prefill; its gain is not a step's.
    starts: list[int] = []

    def hook(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))  # renamed in transformers 5.2x
        starts.append(int(cache.get_seq_length()) if cache is not None else -1)

    handle = model.register_forward_pre_hook(this_thread_only(hook), with_kwargs=True)
    try:
        new_ids = _hf_generate(  # [new]
            model,
            input_ids,
            max_new_tokens,
            prompt_lookup_num_tokens=config.num_tokens,
            max_matching_ngram_size=config.max_ngram_size,
            do_sample=False,
        )
    finally:
        handle.remove()
    n = int(new_ids.shape[0])
    if any(s < 0 for s in starts):
        raise RuntimeError(
            "hf-pld: a target forward got no past_key_values; cannot count the tokens each step gained"
        )
    ends = [*starts[2:], input_ids.shape[1] + n - 1]
    accept = [e - s for s, e in zip(starts[1:], ends, strict=True)]
    return MethodOutput(new_ids, len(starts), accept)


register(
    Method(
        name="hf-pld",
        config_type=HFPromptLookupConfig,
        runner=_run_hf_pld,
        summary="transformers' own prompt lookup (model.generate(prompt_lookup_num_tokens=N)): a peer baseline",
        options=(
            Option("--num-tokens", "num_tokens", int, "n", "prompt_lookup_num_tokens"),
            Option("--max-ngram-size", "max_ngram_size", int, "g", "max_matching_ngram_size"),
        ),
        steps_doc="target forward calls, prefill included",
        supports_sampling=False,
    )
)
