"""Decoding configurations: frozen dataclasses that validate themselves when built."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProbeConfig:
    """Mask-token probing (seed 001).

    Args:
        block_complexity: BC, the most input tokens one decode forward may take. With k mask
            tokens and K draft children of the root, BC = (k + 1)(1 + K) (Eq. 6); K is the
            largest value that fits, e.g. K = 14 at BC = 30 with one mask.
        num_masks: mask tokens per node (k). This version implements k = 1.
        mask_lambda: step of the running mask update m <- m + lambda (e_new - m), in [0, 1].
        incremental_masks: reuse the attention mask and position ids across steps of the same
            tree shape (seed 001, App. E) instead of rebuilding them every step.

    >>> ProbeConfig(block_complexity=30).num_branches
    14
    >>> ProbeConfig(block_complexity=3)
    Traceback (most recent call last):
    ...
    ValueError: block_complexity=3 is too small for 1 mask token(s): BC = (k + 1)(1 + K) needs at least 4 to draft K >= 1 token
    """

    block_complexity: int = 30
    num_masks: int = 1
    mask_lambda: float = 0.1
    incremental_masks: bool = True

    def __post_init__(self) -> None:
        for name in ("block_complexity", "num_masks"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
        if self.num_masks != 1:
            raise ValueError(
                f"num_masks={self.num_masks}: this version of mtprobe implements one mask token per node "
                "(num_masks=1)"
            )
        k = self.num_masks
        if self.block_complexity < 2 * (k + 1):
            raise ValueError(
                f"block_complexity={self.block_complexity} is too small for {k} mask token(s): "
                f"BC = (k + 1)(1 + K) needs at least {2 * (k + 1)} to draft K >= 1 token"
            )
        if isinstance(self.mask_lambda, bool) or not isinstance(self.mask_lambda, (int, float)):
            raise TypeError(f"mask_lambda must be a float, got {self.mask_lambda!r}")
        if not 0.0 <= float(self.mask_lambda) <= 1.0:
            raise ValueError(f"mask_lambda={self.mask_lambda} must be in [0, 1] (0 keeps the initial mask)")
        if not isinstance(self.incremental_masks, bool):
            raise TypeError(f"incremental_masks must be a bool, got {self.incremental_masks!r}")

    @property
    def num_branches(self) -> int:
        """K, the draft children of the root: the largest K with (k + 1)(1 + K) <= BC."""
        return self.block_complexity // (self.num_masks + 1) - 1
