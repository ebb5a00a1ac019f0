"""Drafter construction from configurations. The drafters themselves are C++ (csrc/drafters/)."""

from __future__ import annotations

from transformers import PreTrainedModel

from mtprobe import _C
from mtprobe.config import ProbeConfig, PromptLookupConfig

DecodingConfig = ProbeConfig | PromptLookupConfig

_GAUSSIAN_SHIFT = {"gaussian": 0.0, "gaussian_5sigma": 5.0, "gaussian_10sigma": 10.0}


def mask_probe_drafter(model: PreTrainedModel, config: ProbeConfig) -> _C.MaskProbeDrafter:
    """The mask-token probing drafter of ``config`` over ``model``'s input embedding table."""
    init = config.mask_init
    return _C.MaskProbeDrafter(
        model.get_input_embeddings().weight,
        num_masks=config.num_masks,
        block_complexity=config.block_complexity,
        dynamic_tree=config.tree == "dynamic",
        branches=list(config.branches or ()),
        prune=config.prune,
        mask_init="gaussian" if init in _GAUSSIAN_SHIFT else init,
        gaussian_shift=_GAUSSIAN_SHIFT.get(init, 0.0),
        mask_lambda=float(config.mask_lambda),
        seed=config.seed,
    )


def make_drafter(model: PreTrainedModel, config: DecodingConfig) -> _C.Drafter:
    """The drafter a decoding configuration describes."""
    if isinstance(config, ProbeConfig):
        return mask_probe_drafter(model, config)
    if isinstance(config, PromptLookupConfig):
        return _C.PromptLookupDrafter(num_tokens=config.num_tokens, max_ngram_size=config.max_ngram_size)
    raise TypeError(
        f"unknown decoding configuration {type(config).__name__}; expected one of "
        "mtprobe.ProbeConfig, mtprobe.PromptLookupConfig"
    )
