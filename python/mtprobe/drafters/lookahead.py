"""Lookahead decoding (LADE; ``csrc/drafters/lookahead.cpp``): a Jacobi window and the verification of
its n-grams in one forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData, check_int, resolve_budget
from mtprobe.registry import Method, Option, ProcessFn, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel


# The paper's LADE configurations per block complexity (seed 001, App. F): (L, W, G).
LOOKAHEAD_PAPER_CONFIGS = {10: (3, 4, 1), 30: (4, 5, 5), 60: (5, 8, 7)}


@dataclass(frozen=True)
class LookaheadConfig(ConfigData):
    """Lookahead decoding (LADE, Fu et al. 2024; seed 001 App. F): each forward runs one Jacobi
    iteration of a window of W future tokens over L - 1 levels, collects the n-grams along the
    window's trajectories into a pool, and verifies the pool's n-grams that start with the current
    token (at most G of them) in the same forward. See csrc/core/lookahead.h.

    Args:
        ngram_size: L, the n-gram size (the window keeps L - 1 levels); at least 2.
        window: W, future positions the window looks ahead; at least 1.
        guess_set_size: G, n-grams kept and verified per starting token; at least 1.
        pool_from_prompt: also pool every n-gram of the prompt and of the output (LADE's
            ``POOL_FROM_PROMPT``; off in LADE and in the paper's baseline).
        block_complexity: the budget of one step; ``None`` (the default): (L - 1)(W + G). A
            smaller budget is an error.

    A step feeds at most (L - 1)(W + G) inputs, the root included: LADE's block complexity.

    >>> LookaheadConfig(ngram_size=4, window=5, guess_set_size=5).block_complexity
    30
    >>> LookaheadConfig.for_block_complexity(60)
    LookaheadConfig(ngram_size=5, window=8, guess_set_size=7, pool_from_prompt=False, block_complexity=60)
    >>> LookaheadConfig(ngram_size=1)
    Traceback (most recent call last):
    ...
    ValueError: ngram_size=1 must be >= 2: lookahead collects n-grams of at least 2 tokens (L = 2 is Jacobi decoding)
    """

    method: ClassVar[str] = "lookahead"

    ngram_size: int = 4
    window: int = 5
    guess_set_size: int = 5
    pool_from_prompt: bool = False
    block_complexity: int | None = None

    # The prefill reads the last prompt row only (the first token): the window starts after the prompt
    # and reads its own cells' logits from the first decode step on (csrc/drafters/lookahead.cpp).
    prompt_logit_rows: ClassVar[int | None] = 1

    def __post_init__(self) -> None:
        for name in ("ngram_size", "window", "guess_set_size"):
            check_int(name, getattr(self, name))
        if self.ngram_size < 2:
            raise ValueError(
                f"ngram_size={self.ngram_size} must be >= 2: lookahead collects n-grams of at least 2 tokens "
                "(L = 2 is Jacobi decoding)"
            )
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1 (future positions of the Jacobi window)")
        if self.guess_set_size < 1:
            raise ValueError(
                f"guess_set_size={self.guess_set_size} must be >= 1: with no guesses nothing is ever verified"
            )
        if not isinstance(self.pool_from_prompt, bool):
            raise TypeError(f"pool_from_prompt must be a bool, got {type(self.pool_from_prompt).__name__}")
        L, W, G = self.ngram_size, self.window, self.guess_set_size
        resolve_budget(self, (L - 1) * (W + G), f"lookahead with L={L}, W={W}, G={G} ((L - 1)(W + G))")

    @classmethod
    def for_block_complexity(cls, block_complexity: int) -> LookaheadConfig:
        """The paper's configuration at BC 10 (L3 W4 G1), 30 (L4 W5 G5) or 60 (L5 W8 G7)."""
        try:
            ngram_size, window, guess_set_size = LOOKAHEAD_PAPER_CONFIGS[block_complexity]
        except KeyError:
            raise ValueError(
                f"the paper gives lookahead configurations for block_complexity 10, 30 and 60, not "
                f"{block_complexity!r}; build LookaheadConfig(ngram_size=L, window=W, guess_set_size=G) with "
                "(L - 1)(W + G) <= your budget instead"
            ) from None
        return cls(ngram_size, window, guess_set_size)


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


register(
    Method(
        name="lookahead",
        tokens_only="its Jacobi window runs as extra inputs of the target's forward, and it reads their logits",
        config_type=LookaheadConfig,
        drafter=lookahead_drafter,
        summary="lookahead decoding: a Jacobi window and the verification of its n-grams in one forward",
        schedulable=True,
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
    )
)
