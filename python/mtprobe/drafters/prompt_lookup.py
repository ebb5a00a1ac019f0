"""Prompt lookup decoding (``csrc/drafters/prompt_lookup.cpp``): a chain copied from an earlier
occurrence of the context's last n-gram, transformers' ``prompt_lookup_num_tokens``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData, check_int, resolve_budget
from mtprobe.registry import Method, Option, ProcessFn, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class PromptLookupConfig(ConfigData):
    """Prompt lookup decoding (PLD, seed 001 App. F): draft the chain that followed an earlier
    occurrence of the context's last n-gram, the rule of transformers' ``prompt_lookup_num_tokens``.

    Args:
        num_tokens: chain depth (transformers' ``prompt_lookup_num_tokens``; 10 in the paper).
        max_ngram_size: the longest n-gram matched (transformers' ``max_matching_ngram_size``).
        block_complexity: the budget of one step; ``None`` (the default): what the chain needs,
            ``1 + num_tokens`` (the root and the chain). A smaller budget is an error.

    >>> PromptLookupConfig().block_complexity
    11
    >>> PromptLookupConfig(num_tokens=10, block_complexity=5)
    Traceback (most recent call last):
    ...
    ValueError: a chain of num_tokens=10 drafts after the root needs block_complexity >= 11 inputs per step, got 5
    """

    method: ClassVar[str] = "pld"

    num_tokens: int = 10
    max_ngram_size: int = 2
    block_complexity: int | None = None

    def __post_init__(self) -> None:
        check_int("num_tokens", self.num_tokens)
        check_int("max_ngram_size", self.max_ngram_size)
        if self.num_tokens < 1:
            raise ValueError(f"num_tokens={self.num_tokens} must be >= 1 (the chain depth)")
        if self.max_ngram_size < 1:
            raise ValueError(f"max_ngram_size={self.max_ngram_size} must be >= 1")
        resolve_budget(
            self, 1 + self.num_tokens, f"a chain of num_tokens={self.num_tokens} drafts after the root"
        )


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


register(
    Method(
        name="pld",
        tokens_only=None,
        config_type=PromptLookupConfig,
        drafter=prompt_lookup_drafter,
        summary="prompt lookup decoding: a chain copied from an earlier occurrence of the last n-gram",
        schedulable=True,
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
    )
)
