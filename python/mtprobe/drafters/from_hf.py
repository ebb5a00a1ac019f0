"""transformers' drafter arguments as mtprobe's drafters: ``prompt_lookup_num_tokens`` is prompt lookup,
``assistant_model`` a draft model, ``assistant_early_exit`` the layer-truncated self-draft
(:func:`resolve_config`); the rest of HF's arguments are in :mod:`mtprobe.decode.hf_arguments`."""

from __future__ import annotations

from typing import Any

from transformers import GenerationConfig

from mtprobe.drafters.draft_model import TRUNCATED_DRAFT_LAYERS, DraftModelConfig
from mtprobe.drafters.prompt_lookup import PromptLookupConfig
from mtprobe.registry import DecodingConfig

_DEFAULTS = GenerationConfig._get_default_generation_params()


def is_set(generation_config: GenerationConfig, name: str) -> bool:
    """The merged value of ``name`` is not None and not transformers' own default for it."""
    value = getattr(generation_config, name, None)
    return value is not None and value != _DEFAULTS.get(name)


def _conflict(given: DecodingConfig, asked: str, wanted: DecodingConfig) -> ValueError:
    return ValueError(
        f"conflicting decoding methods: the mtprobe configuration {given!r} and {asked}, which means {wanted!r}; "
        "pass one of them (or make them agree)"
    )


def resolve_config(
    config: DecodingConfig | None,
    generation_config: GenerationConfig,
    assistant_model: Any = None,
) -> DecodingConfig | None:
    """The decoding configuration after mapping transformers' drafter arguments onto mtprobe's:

    - ``prompt_lookup_num_tokens=N`` (+ ``max_matching_ngram_size=g``) -> ``PromptLookupConfig(N, g or 2)``;
    - ``assistant_model=M`` (+ ``num_assistant_tokens=K``) -> ``DraftModelConfig(draft_model=M, num_tokens=K)``;
    - ``assistant_early_exit=L`` -> ``DraftModelConfig(draft_model=None, num_draft_layers=L, num_tokens=K)``.

    ``K`` is ``num_assistant_tokens`` where set, else the assistant's own
    ``generation_config.num_assistant_tokens`` (what transformers reads), else transformers' default 20.
    With ``config`` given explicitly, the arguments must agree with it, else ValueError naming both.
    Returns ``config`` unchanged (``None`` included) when no drafter argument is set; ValueError for
    a drafter argument without its drafter (``num_assistant_tokens`` with no draft model, ...).
    """
    gc = generation_config
    lookup = gc.prompt_lookup_num_tokens
    early_exit = gc.assistant_early_exit
    asked = [
        n
        for n, v in (
            ("prompt_lookup_num_tokens", lookup),
            ("assistant_model", assistant_model),
            ("assistant_early_exit", early_exit),
        )
        if v is not None
    ]
    if len(asked) > 1:
        raise ValueError(
            f"{' and '.join(asked)} each select a drafter; pass one of them (mtprobe runs one drafter per generation)"
        )
    ngram = gc.max_matching_ngram_size
    if lookup is not None:
        wanted: DecodingConfig = PromptLookupConfig(num_tokens=lookup, max_ngram_size=ngram or 2)
        described = f"prompt_lookup_num_tokens={lookup}" + (
            f", max_matching_ngram_size={ngram}" if ngram is not None else ""
        )
        if config is None:
            return wanted
        agrees = (
            isinstance(config, PromptLookupConfig)
            and config.num_tokens == lookup
            and (ngram is None or config.max_ngram_size == ngram)
        )
        if not agrees:
            raise _conflict(config, described, wanted)
        return config
    if ngram is not None and not isinstance(config, PromptLookupConfig):
        raise ValueError(
            f"max_matching_ngram_size={ngram} applies to prompt lookup decoding only; pass prompt_lookup_num_tokens "
            "too (or a PromptLookupConfig), or leave it unset"
        )
    if isinstance(config, PromptLookupConfig) and ngram is not None and config.max_ngram_size != ngram:
        raise _conflict(
            config,
            f"max_matching_ngram_size={ngram}",
            PromptLookupConfig(config.num_tokens, max_ngram_size=ngram),
        )

    num_tokens_set = is_set(gc, "num_assistant_tokens")
    if assistant_model is not None or early_exit is not None:
        own = getattr(getattr(assistant_model, "generation_config", None), "num_assistant_tokens", None)
        if num_tokens_set:
            num_tokens = gc.num_assistant_tokens
        elif isinstance(own, int) and not isinstance(own, bool):
            num_tokens = own
        else:
            num_tokens = _DEFAULTS["num_assistant_tokens"]
        if assistant_model is not None:
            wanted = DraftModelConfig(draft_model=assistant_model, num_tokens=num_tokens)
            described = f"assistant_model={type(assistant_model).__name__}"
        else:
            wanted = DraftModelConfig(num_draft_layers=early_exit, num_tokens=num_tokens)
            described = f"assistant_early_exit={early_exit}"
        if config is None:
            return wanted
        agrees = (
            isinstance(config, DraftModelConfig)
            and config.draft_model is wanted.draft_model
            and (
                assistant_model is not None
                or (
                    config.self_draft == "truncated"
                    and (config.num_draft_layers or TRUNCATED_DRAFT_LAYERS) == early_exit
                )
            )
            and (not num_tokens_set or config.num_tokens == num_tokens)
        )
        if not agrees:
            if num_tokens_set:
                described += f", num_assistant_tokens={num_tokens}"
            raise _conflict(config, described, wanted)
        return config
    if num_tokens_set:
        if not isinstance(config, DraftModelConfig):
            raise ValueError(
                f"num_assistant_tokens={gc.num_assistant_tokens} applies to a draft model; pass assistant_model=... "
                "(or a DraftModelConfig), or leave it unset"
            )
        if config.num_tokens != gc.num_assistant_tokens:
            raise _conflict(
                config,
                f"num_assistant_tokens={gc.num_assistant_tokens}",
                DraftModelConfig(
                    draft_model=config.draft_model,
                    num_draft_layers=config.num_draft_layers,
                    num_tokens=gc.num_assistant_tokens,
                    top_branches=config.top_branches,
                ),
            )
    return config
