"""Registry of decoding methods the Spec-Bench harness can run.

A method is one :class:`Method` entry: a frozen dataclass type for its configuration, the CLI options
that fill it, and a run function ``run(model, input_ids, config, max_new_tokens) -> MethodOutput``.
Adding a drafter (heads, ...) is one :func:`register` call, as for ``pld``, ``stand``,
``lookahead``, ``hybrid`` and ``sps`` at the end of this file.

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
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from mtprobe.config import (
    AutoConfig,
    DraftModelConfig,
    EntMTPConfig,
    HeadsConfig,
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
    """What the field means for this method; name its default in the text when the field's own
    default is ``None`` (resolved by the configuration), otherwise the help appends it."""
    always_in_id: bool = False
    """Part of the default model_id even at its default value (the method's headline setting, e.g. BC);
    other options appear in the id only when they differ from the method's default."""
    const: Any = None
    """With a value, the flag may also be given alone and then means this value
    (``--shared-ngram-memory`` alone: a memory of the default size)."""

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")


RunFn = Callable[..., MethodOutput]
"""``run(model, input_ids, config, max_new_tokens, *, temperature=0.0) -> MethodOutput``."""


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
    supports_sampling: bool = True
    """Whether ``temperature > 0`` is implemented (every built-in method: all sample losslessly)."""

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
                parts.append(f"{o.id_key}{_id_value(value)}")
        return "-".join(parts)

    def check_temperature(self, temperature: float) -> None:
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


def _id_value(value: Any) -> str:
    if isinstance(value, tuple) and value and all(hasattr(v, "method") for v in value):
        return "+".join(v.method for v in value)  # AutoConfig's drafters: their methods
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, str) and ("/" in value or os.sep in value or value.endswith(".json")):
        return Path(value).stem  # a file (a profile, a bank): its name, not its folders
    return str(value)


METHODS: dict[str, Method] = {}


def register(method: Method) -> Method:
    """Add ``method`` to the registry (a duplicate name is an error) and return it."""
    if method.name in METHODS:
        raise ValueError(f"method {method.name!r} is already registered")
    if not (dataclasses.is_dataclass(method.config_type) and method.config_type.__dataclass_params__.frozen):
        raise TypeError(f"method {method.name!r}: config_type must be a frozen dataclass")
    registered = getattr(method.config_type, "method", method.name)
    if registered != method.name:
        # One name per method everywhere: config dicts, --method and answer files agree.
        raise ValueError(
            f"method {method.name!r}: {method.config_type.__name__} is registered in mtprobe.config as "
            f"{registered!r}; use name={registered!r}"
        )
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


def _sampling_kwargs(temperature: float) -> dict[str, Any]:
    # Greedy at 0 (Spec-Bench's inference_baseline.py: do_sample only for temperature > 1e-5).
    return {"do_sample": True, "temperature": float(temperature)} if temperature > 0 else {"do_sample": False}


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
    new_ids = _hf_generate(model, input_ids, max_new_tokens, **_sampling_kwargs(temperature))  # [new]
    n = int(new_ids.shape[0])
    # As Spec-Bench's inference_baseline.py: one step and one accepted token per new token.
    return MethodOutput(new_ids, n, [1] * n)


register(
    Method(
        name="ar",
        summary="autoregressive baseline: HF model.generate (greedy, or sampling at --temperature > 0)",
        config_type=GreedyConfig,
        run=_run_ar,
        steps_doc="new tokens (= forward calls, prefill included)",
    )
)


# --- probe: mtprobe's mask-token probing ---------------------------------------------------------


def _bc_option(help_text: str) -> Option:
    return Option("--block-complexity", "block_complexity", int, "bc", help_text, always_in_id=True)


def _parse_bool(text: str) -> bool:
    low = text.strip().lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected true or false, got {text!r}")


def _run_mtprobe(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [1, L]
    config: DecodingConfig,
    max_new_tokens: int,
    *,
    temperature: float = 0.0,
) -> MethodOutput:
    """Any method that is mtprobe.generate with a decoding configuration."""
    from mtprobe.generate import generate

    out = generate(
        model,
        input_ids,
        config,
        max_new_tokens=max_new_tokens,
        attention_mask=torch.ones_like(input_ids),
        **_sampling_kwargs(temperature),
    )
    return MethodOutput(
        out.sequences[0, input_ids.shape[1] :], int(out.forward_calls), list(out.accept_lengths)
    )


# The mask tokens' start, shared by probing and the hybrid's probing half.
_MASK_OPTIONS = (
    Option(
        "--mask-init",
        "mask_init",
        str,
        "init-",
        "mask design: prompt_mean, prompt_last, gaussian, gaussian_5sigma, gaussian_10sigma or "
        "calibrated (with --mask-path)",
    ),
    Option(
        "--mask-path",
        "mask_path",
        str,
        "masks-",
        "the mask calibration file of --mask-init calibrated (python -m mtprobe.calibrate)",
    ),
)


register(
    Method(
        name=ProbeConfig.method,  # the short name mtprobe.config registers
        summary="mask-token probing: mtprobe.generate with a ProbeConfig",
        config_type=ProbeConfig,
        run=_run_mtprobe,
        options=(
            _bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option(
                "--num-masks",
                "num_masks",
                int,
                "k",
                "k, chained mask tokens per tree node, 1 to 4; default 1",
            ),
            Option(
                "--tree",
                "tree",
                str,
                "tree-",
                "static (fixed branches, Top-1 expansion) or dynamic (the best candidates by cumulative "
                "probability); default static for 1 mask, else dynamic",
            ),
            Option(
                "--prune",
                "prune",
                _parse_bool,
                "prune-",
                "true/false: replace a draft that repeats its parent or the last token by the next best",
            ),
            *_MASK_OPTIONS,
            Option(
                "--mask-lambda",
                "mask_lambda",
                float,
                "lam",
                "lambda in [0, 1], step of the running mask update m <- m + lambda (e_new - m); 0 keeps "
                "the initial masks",
            ),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- pld: prompt lookup decoding ------------------------------------------------------------------


register(
    Method(
        name=PromptLookupConfig.method,  # the short name mtprobe.config registers
        summary="prompt lookup decoding: a chain copied from an earlier occurrence of the last n-gram",
        config_type=PromptLookupConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "chain depth: drafts copied after the matched n-gram per step (transformers' "
                "prompt_lookup_num_tokens); a step takes 1 + this inputs",
            ),
            Option(
                "--max-ngram-size",
                "max_ngram_size",
                int,
                "g",
                "the longest n-gram matched (transformers' max_matching_ngram_size)",
            ),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- stand: STAND's n-gram store of the target's own distributions ----------------------------------

SHARED_NGRAM_MEMORY_SIZE = 1 << 18
"""Keys of the cross-request n-gram memory that ``--shared-ngram-memory`` alone asks for."""


def _memory_option() -> Option:
    return Option(
        "--shared-ngram-memory",
        "memory_size",
        int,
        "mem",
        "one cross-request n-gram memory of at most this many keys (least recently used evicted; "
        f"{SHARED_NGRAM_MEMORY_SIZE} when the flag is given alone) shared by every question of the run: each "
        "finished answer's text is folded in and drafted from where the question's own store has no "
        "key (emptied after the warm-up; refuses --repeats above 1); default off",
        const=SHARED_NGRAM_MEMORY_SIZE,
    )


register(
    Method(
        name=StandConfig.method,  # the short name mtprobe.config registers
        summary="STAND: a draft tree from an n-gram store of the target's own next-token distributions",
        config_type=StandConfig,
        run=_run_mtprobe,
        options=(
            _bc_option("most inputs of one decode forward: the root and BC - 1 draft nodes"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft (tokens after the root)"),
            _memory_option(),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- lookahead: lookahead decoding (LADE) --------------------------------------------------------------


register(
    Method(
        name=LookaheadConfig.method,  # the short name mtprobe.config registers
        summary="lookahead decoding: a Jacobi window and the verification of its n-grams in one forward",
        config_type=LookaheadConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--ngram-size",
                "ngram_size",
                int,
                "L",
                "L, n-gram size, at least 2 (a step takes (L - 1)(W + G) inputs)",
                always_in_id=True,
            ),
            Option("--window", "window", int, "W", "W, Jacobi window width", always_in_id=True),
            Option(
                "--guess-set-size",
                "guess_set_size",
                int,
                "G",
                "G, n-grams verified per step",
                always_in_id=True,
            ),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- hybrid: probing and STAND's n-gram store in one tree ----------------------------------------------


register(
    Method(
        name=HybridConfig.method,  # the short name mtprobe.config registers
        summary="hybrid: mask-token probing and STAND's n-gram store drafting one tree under one budget",
        config_type=HybridConfig,
        run=_run_mtprobe,
        options=(
            _bc_option("BC, the most input tokens of one decode forward, mask tokens included"),
            Option("--num-masks", "num_masks", int, "k", "k, mask tokens per tree node (the probing half)"),
            Option("--max-depth", "max_depth", int, "d", "deepest draft of the n-gram half"),
            *_MASK_OPTIONS,
            _memory_option(),
            Option(
                "--mask-value",
                "mask_value",
                float,
                "mv",
                "masks only where the step is likely to end, drafts with the inputs freed, valuing the "
                "next step's probing at V tokens (default: masks on every node, seed 001's rule)",
            ),
        ),
        steps_doc="forward calls, prefill included",
    )
)


# --- auto: per-step scheduling by measured forward cost -------------------------------------------------


def _drafter_configs(text: str) -> tuple[Any, ...]:
    """``--drafters``: a JSON list of drafter configurations (``config.to_dict()``'s form), or the path of
    a ``.json`` file holding one."""
    import json

    from mtprobe.config import config_from_dict

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
        name=AutoConfig.method,  # the short name mtprobe.config registers
        summary="per-step choice among drafters (default prompt lookup and STAND) and plain decoding by expected "
        "tokens per second under this machine's measured forward cost",
        config_type=AutoConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--drafters",
                "drafters",
                _drafter_configs,
                "",
                "the drafters to choose among: a JSON list of configurations, e.g. "
                '\'[{"method": "pld"}, {"method": "heads", "path": "DIR", "vocab_top_k": 4096}]\', or a '
                ".json file of one",
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
        steps_doc="forward calls, prefill included",
    )
)


# --- entmtp: a bank of static probing trees, one per step by a policy (seed 002) ---------------------------


register(
    Method(
        name=EntMTPConfig.method,  # the short name mtprobe.config registers
        summary="EntMTP: mask-token probing over a topology bank of static trees, the tree chosen every step by "
        "a static, ladder or hysteretic policy (seed 002)",
        config_type=EntMTPConfig,
        run=_run_mtprobe,
        options=(
            Option("--policy", "policy", str, "", "static, ladder or hysteretic", always_in_id=True),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "a topology bank built with `python -m mtprobe.topology` (default: the uncalibrated default "
                "bank, which fits any model)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "the policy's score: path_value, top1, entropy or accept (default: the bank's calibrated "
                "one, else path_value)",
            ),
        ),
        steps_doc="forward calls, prefill included",
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

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
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
        summary="transformers' own prompt lookup (model.generate(prompt_lookup_num_tokens=N)): a peer baseline",
        config_type=HFPromptLookupConfig,
        run=_run_hf_pld,
        options=(
            Option("--num-tokens", "num_tokens", int, "n", "prompt_lookup_num_tokens"),
            Option("--max-ngram-size", "max_ngram_size", int, "g", "max_matching_ngram_size"),
        ),
        steps_doc="target forward calls, prefill included",
        supports_sampling=False,
    )
)


# --- sps: draft-model speculative decoding -----------------------------------------------------------


register(
    Method(
        name=DraftModelConfig.method,  # the short name mtprobe.config registers
        summary="draft-model speculative decoding: a draft model (--draft-model; default the target's "
        "layer-truncated self-draft) proposes a chain, the target verifies it",
        config_type=DraftModelConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--num-tokens",
                "num_tokens",
                int,
                "n",
                "K, tokens the draft model drafts per step in a chain; a step feeds the target "
                "K + top branches inputs",
                always_in_id=True,
            ),
            Option(
                "--draft-layers",
                "num_draft_layers",
                int,
                "l",
                "layers of the target's layer-truncated self-draft (used when --draft-model is not given)",
            ),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "b",
                "children of the root: the chain's first draft and b - 1 siblings (1: a plain chain)",
            ),
        ),
        steps_doc="target forward calls, prefill included (the draft model's forwards are not counted)",
    )
)


# --- heads: probabilistic-circuit heads (MTPC) ----------------------------------------------------


register(
    Method(
        name=HeadsConfig.method,
        summary="probabilistic-circuit heads (MTPC): drafts from a trained head over the last hidden state",
        config_type=HeadsConfig,
        run=_run_mtprobe,
        options=(
            Option(
                "--head-path",
                "path",
                str,
                "head-",
                "the head's checkpoint folder (python -m mtprobe.heads train --out DIR); required",
                always_in_id=True,
            ),
            _bc_option("BC, the most input tokens of one decode forward"),
            Option(
                "--top-branches",
                "top_branches",
                int,
                "branches",
                "under sampling: independent windows drawn from the circuit as chains below the root",
            ),
            Option(
                "--min-path-prob",
                "min_path_prob",
                float,
                "floor",
                "greedy: leave out drafts whose path probability under the circuit is below this (0: fill BC)",
            ),
            Option(
                "--vocab-top-k",
                "vocab_top_k",
                int,
                "vocab",
                "the head emits only its K most frequent training tokens (default: the whole vocabulary)",
            ),
            Option(
                "--head-dtype",
                "head_dtype",
                str,
                "hd-",
                "the dtype of the head's per-step products: float32, bfloat16 or float16 (default: the "
                "model's for the LoRA draft layers, float32 for the rest)",
            ),
            Option(
                "--bank",
                "bank",
                str,
                "bank-",
                "EntMTP over the head: a topology bank built for it with `python -m mtprobe.topology --head DIR` "
                "(default: none, the best-first tree)",
            ),
            Option(
                "--policy",
                "policy",
                str,
                "",
                "with --bank: static, ladder or hysteretic (default: static, the bank's best tree)",
            ),
            Option(
                "--feature",
                "feature",
                str,
                "f-",
                "with --bank: the policy's score, path_value, top1, entropy or accept (default: the bank's "
                "calibrated one, else path_value)",
            ),
        ),
        steps_doc="forward calls, prefill included",
    )
)
