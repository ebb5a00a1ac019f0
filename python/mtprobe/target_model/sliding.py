"""Sliding attention windows: which a model applies, and the tree mask with its window applied.

transformers 5 builds a sliding model's masks itself; mtprobe hands its models 4-D tree masks, so it
applies the window to them as HF's ``sliding_window_overlay`` does (:func:`sliding_mask`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class SlidingWindow:
    """How a model applies a sliding attention window (see :func:`sliding_window`)."""

    window: int
    """Keys at a position ``k`` with ``p - k >= window`` are hidden from a query at position ``p``."""
    per_layer_type: bool
    """True: the model reads ``attention_mask`` as a dict keyed by ``config.layer_types`` (only the
    ``sliding_attention`` layers slide). False: one mask for every layer, all of them sliding."""

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"SlidingWindow.window must be an int >= 1, got {self.window!r}")


def sliding_window(model: PreTrainedModel) -> SlidingWindow | None:
    """The sliding window ``model`` applies in its attention masks, or None when it has none.

    Follows transformers 5's own mask construction: a window exists when ``config.sliding_window``
    is a positive int and not switched off by ``use_sliding_window=False`` (Qwen 2/3); with
    ``config.layer_types`` it applies to the ``sliding_attention`` layers only (None if there are
    none); without, to every layer, provided the model's code builds sliding masks at all
    (``create_sliding_window_causal_mask``, as Mistral, Mixtral and Phi-3 do). Raises
    NotImplementedError for a layer type other than full or sliding attention (chunked, linear...).
    """
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        return None
    if getattr(cfg, "use_sliding_window", True) is False:
        return None
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise NotImplementedError(
                f"{type(model).__name__} has attention layer types {unknown}; mtprobe's tree mask handles "
                f"{' and '.join(_LAYER_TYPES)} layers only"
            )
        if "sliding_attention" not in layer_types:
            return None
        return SlidingWindow(window, per_layer_type=True)
    # No layer types: a Mistral-style model slides on every layer if its code builds sliding masks.
    base = getattr(model, "base_model", model)
    modules = {type(model).__module__, type(base).__module__}
    if not any(hasattr(sys.modules.get(m), "create_sliding_window_causal_mask") for m in modules):
        return None
    return SlidingWindow(window, per_layer_type=False)


def sliding_mask(
    mask: torch.Tensor,  # [1, 1, T, P + T] additive (0 / finfo.min)
    position_ids: torch.Tensor,  # [1, T]
    prefix_len: int,
    window: int,
) -> torch.Tensor:  # [1, 1, T, P + T]
    """``mask`` with every key at ``window`` or more positions behind its query hidden.

    The cache holds the committed tokens at index = position, then the block's inputs, whose
    positions are ``position_ids`` (the root's position plus the node's depth); the rule is HF's
    ``sliding_window_overlay`` (visible iff ``p - k < window``) applied to those positions.
    """
    t = position_ids.shape[-1]
    if mask.shape[-1] != prefix_len + t:
        raise ValueError(
            f"tree mask has {mask.shape[-1]} key columns; expected prefix_len + T = {prefix_len} + {t}"
        )
    q_pos = position_ids.reshape(-1)  # [T]
    k_pos = torch.cat([torch.arange(prefix_len, device=q_pos.device, dtype=q_pos.dtype), q_pos])  # [P + T]
    too_far = (q_pos[:, None] - k_pos[None, :]) >= window  # [T, P + T]
    # Out of place: the loop may reuse ``mask`` (incremental masks) for the full-attention layers.
    return mask.masked_fill(too_far, torch.finfo(mask.dtype).min)
