"""Plain decoding through mtprobe's own loop (``csrc/drafters/plain.cpp``): no drafts, one input per
decode step; the baseline that prices mtprobe's loop beside HF's ``generate``, and the step
``AutoConfig`` falls back to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from mtprobe import _C
from mtprobe.drafters.base import ConfigData
from mtprobe.registry import Method, ProcessFn, register

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class PlainConfig(ConfigData):
    """Plain decoding through mtprobe's own loop: no drafts, one input per decode step (T = 1), the
    step :class:`~mtprobe.AutoConfig` falls back to when no draft pays. Its output is the model's own
    greedy (or sampled) decoding; it is the baseline that prices mtprobe's loop, KV cache and linear
    routes beside HF's ``generate``.

    >>> PlainConfig().block_complexity
    1
    """

    method: ClassVar[str] = "plain"
    block_complexity: ClassVar[int] = 1


def plain_drafter(
    model: PreTrainedModel,
    config: PlainConfig,
    *,
    capacity: int = 0,
    do_sample: bool = False,
    process: ProcessFn | None = None,
    fold_memory: bool = True,
) -> _C.PlainDrafter:
    """Plain decoding's drafter: no drafts, the last committed token alone each step."""
    return _C.PlainDrafter()


register(
    Method(
        name="plain",
        tokens_only="it drafts nothing: run the engine without speculative decoding",
        config_type=PlainConfig,
        drafter=plain_drafter,
        summary="plain decoding through mtprobe's own loop: no drafts, one input per step (the baseline "
        "that prices mtprobe's loop, KV cache and linear routes beside HF's generate)",
    )
)
