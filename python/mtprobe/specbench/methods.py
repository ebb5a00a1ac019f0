"""Registry of decoding methods the Spec-Bench harness can run.

A method is one :class:`Method` entry: a frozen dataclass type for its configuration, the CLI options
that fill it, and a run function ``run(model, input_ids, config, max_new_tokens) -> MethodOutput``.
Adding a drafter (heads, ...) is one :func:`register` call, as for ``pld``, ``stand``,
``lookahead``, ``hybrid`` and ``sps`` at the end of this file.

``decoding_steps`` follows Spec-Bench: for ``ar`` it is the number of new tokens (as in Spec-Bench's
``inference_baseline.py``, which equals the forwards greedy decoding makes, prefill included); for
the mtprobe methods it is ``GenerateOutput.forward_calls``: target forwards, **prefill included**. Either way
``ar decoding_steps / method decoding_steps`` is the reduction in forward calls.
``accept_lengths`` holds the tokens gained per step: ``[1] * new_tokens`` for ``ar``; for the others
``GenerateOutput.accept_lengths``, one per decode forward, prefill *not* included (the prefill's
token is the one token of ``new_tokens`` not in ``sum(accept_lengths)``).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mtprobe.config import (
    DraftModelConfig,
    HybridConfig,
    LookaheadConfig,
    ProbeConfig,
    PromptLookupConfig,
    StandConfig,
)

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mtprobe.drafters import DecodingConfig

__all__ = [
    "METHODS",
    "GreedyConfig",
    "Method",
    "MethodOutput",
    "Option",
    "add_method_arguments",
    "available_methods",
    "config_from_args",
    "get_method",
    "register",
]


class MethodOutput(NamedTuple):
    """What one generation call of a method returns (a tuple, so it also unpacks)."""

    new_ids: torch.Tensor
    """1-D tensor of the generated tokens only (prompt removed), EOS included when generated."""
    decoding_steps: int
    accept_lengths: list[int]


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

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


RunFn = Callable[["PreTrainedModel", torch.Tensor, Any, int], MethodOutput]


@dataclass(frozen=True)
class Method:
    """One registry entry: how to configure and run a decoding method."""

    name: str
    summary: str
    config_type: type
    """A frozen dataclass; its own defaults and validation apply to options not given."""
    run: RunFn
    options: tuple[Option, ...] = ()
    steps_doc: str = ""
    """What ``decoding_steps`` counts for this method (shown in --help)."""
    supports_sampling: bool = False

    def make_config(self, values: Mapping[str, Any] | None = None) -> Any:
        """Build the configuration from ``{field: value}``; missing fields keep their defaults."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(self.config_type)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"method {self.name!r} has no option(s) {', '.join(unknown)}")
        return self.config_type(**values)

    def id_suffix(self, config: Any) -> str:
        """The option part of a default model_id, e.g. ``bc30-k1-tree-static-pruneTrue-init-prompt_mean-lam0.1``."""
        return "-".join(f"{o.id_key}{getattr(config, o.field)}" for o in self.options)

    def check_temperature(self, temperature: float) -> None:
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {temperature}")
        if temperature != 0 and not self.supports_sampling:
            raise NotImplementedError(
                f"temperature={temperature}: sampling is not implemented for method {self.name!r} yet; "
                "use --temperature 0 (greedy decoding)"
            )


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (a duplicate name is an error) and return it."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    if not (dataclasses.is_dataclass(method.config_type) and method.config_type.__dataclass_params__.frozen):
        raise TypeError(f"method {method.name!r}: config_type must be a frozen dataclass")
    METHODS[method.name] = method
    return method


def available_methods() -> tuple[str, ...]:
    return tuple(METHODS)


def get_method(name: str) -> Method:
    """The registered method ``name``; ValueError listing the available ones otherwise."""
    try:
        return METHODS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown method {name!r}; available methods: {', '.join(available_methods())}"
        ) from None


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
            return f.default
    return None


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every registered method's options to ``parser`` (default None = the method's default)."""
    group = parser.add_argument_group("method options")
    for flag, (option, users) in _all_options().items():
        default = _field_default(users[0], option)
        group.add_argument(
            flag,
            dest=option.dest,
            type=option.type,
            default=None,
            help=f"{option.help} (method{'s' if len(users) > 1 else ''}: {', '.join(users)}; "
            f"default: {'chosen by the method' if default is None else default})",
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


# --- ar: plain greedy decoding with HF generate --------------------------------------------------


@dataclass(frozen=True)
class GreedyConfig:
    """Plain greedy ``model.generate(do_sample=False)``: nothing to configure."""


def _run_ar(
    model: PreTrainedModel, input_ids: torch.Tensor, config: GreedyConfig, max_new_tokens: int
) -> MethodOutput:
    # The all-ones attention mask changes nothing for one unpadded row; it silences HF's warning
    # for models whose pad token is their EOS token.
    out = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
    )
    new_ids = out[0, input_ids.shape[1] :]
    n = int(new_ids.shape[0])
    # As Spec-Bench's inference_baseline.py: one step and one accepted token per new token.
    return MethodOutput(new_ids, n, [1] * n)


register(
    Method(
        name="ar",
        summary="autoregressive baseline: HF model.generate(do_sample=False)",
        config_type=GreedyConfig,
        run=_run_ar,
        steps_doc="new tokens (= forward calls, prefill included)",
    )
)


# --- probe: mtprobe's mask-token probing ---------------------------------------------------------

BLOCK_COMPLEXITY_OPTION = Option(
    "--block-complexity", "block_complexity", int, "bc", "BC: most input tokens per decode forward"
)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _run_mtprobe(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    config: DecodingConfig,
    max_new_tokens: int,
) -> MethodOutput:
    """Any method that is mtprobe.generate with a decoding configuration."""
    from mtprobe.generate import generate

    out = generate(
        model, input_ids, config, max_new_tokens=max_new_tokens, attention_mask=torch.ones_like(input_ids)
    )
    return MethodOutput(
        out.sequences[0, input_ids.shape[1] :], int(out.forward_calls), list(out.accept_lengths)
    )


register(
    Method(
        name="probe",
        summary="mask-token probing: mtprobe.generate with a ProbeConfig",
        config_type=ProbeConfig,
        run=_run_mtprobe,
        options=(
            BLOCK_COMPLEXITY_OPTION,
            Option(
                "--num-masks", "num_masks", int, "k", "mask tokens per node (default: 1 below BC 60, else 2)"
            ),
            Option(
                "--tree", "tree", str, "tree-", "static or dynamic (default: static for 1 mask, else dynamic)"
            ),
            Option("--prune", "prune", _parse_bool, "prune", "tree pruner on or off (true/false)"),
            Option("--mask-init", "mask_init", str, "init-", "mask design, e.g. prompt_mean, gaussian"),
            Option("--mask-lambda", "mask_lambda", float, "lam", "running mask update step lambda"),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- pld: prompt lookup decoding ------------------------------------------------------------------


register(
    Method(
        name="pld",
        summary="prompt lookup decoding: a chain copied from an earlier occurrence of the last n-gram",
        config_type=PromptLookupConfig,
        run=_run_mtprobe,
        options=(
            Option("--num-tokens", "num_tokens", int, "n", "chain depth (block complexity = 1 + this)"),
            Option("--max-ngram-size", "max_ngram_size", int, "g", "longest n-gram matched"),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- stand: STAND's n-gram store of the target's own distributions ----------------------------------


register(
    Method(
        name="stand",
        summary="STAND: a draft tree from an n-gram store of the target's own next-token distributions",
        config_type=StandConfig,
        run=_run_mtprobe,
        options=(
            BLOCK_COMPLEXITY_OPTION,
            Option("--max-depth", "max_depth", int, "d", "deepest draft"),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- lookahead: lookahead decoding (LADE) --------------------------------------------------------------


register(
    Method(
        name="lookahead",
        summary="lookahead decoding: a Jacobi window and the verification of its n-grams in one forward",
        config_type=LookaheadConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--ngram-size", "ngram_size", int, "L", "L, n-gram size (block complexity (L - 1)(W + G))"
            ),
            Option("--window", "window", int, "W", "W, Jacobi window width"),
            Option("--guess-set-size", "guess_set_size", int, "G", "G, n-grams verified per step"),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- hybrid: probing and STAND's n-gram store in one tree ----------------------------------------------


register(
    Method(
        name="hybrid",
        summary="hybrid: mask-token probing and STAND's n-gram store drafting one tree under one budget",
        config_type=HybridConfig,
        run=_run_mtprobe,
        options=(
            BLOCK_COMPLEXITY_OPTION,
            Option("--num-masks", "num_masks", int, "k", "mask tokens per node"),
            Option("--max-depth", "max_depth", int, "d", "deepest n-gram draft"),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- sps: draft-model speculative decoding -----------------------------------------------------------


register(
    Method(
        name="sps",
        summary="draft-model speculative decoding with the target's layer-truncated self-draft",
        config_type=DraftModelConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "chain drafts per step (block complexity = this + top branches)",
            ),
            Option("--draft-layers", "num_draft_layers", int, "l", "layers of the truncated self-draft"),
            Option("--top-branches", "top_branches", int, "b", "children of the root (1: a chain)"),
        ),
        steps_doc="target forward calls, prefill included (the draft model's forwards are not counted)",
    )
)
