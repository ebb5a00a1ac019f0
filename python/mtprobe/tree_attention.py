"""Tree attention as a transformers attention implementation: ``attn_implementation="mtprobe_tree"``.

HF models call the registered function from every attention layer. It reads the tree from the
``attention_mask`` argument, which for this implementation carries the compact ancestor bits of
:func:`mtprobe.ops.tree_ancestor_bits` as a 4D int64 tensor ``[1, 1, T, ceil(T / 64)]`` (transformers
passes a 4D mask through untouched) instead of a dense ``[T, P + T]`` float mask; the prefix length
is the keys' length minus T. Without a mask (the prefill, plain generation) the block is a chain:
causal attention. The registered mask function therefore builds nothing.

    import mtprobe.tree_attention
    mtprobe.tree_attention.register()
    model.set_attn_implementation("mtprobe_tree")
    bits = mtprobe.ops.tree_ancestor_bits(parents)[None, None]        # [1, 1, T, W]
    out = model(input_ids, attention_mask=bits, position_ids=..., cache=cache)  # past_key_values= before 5.2x

The op under it is ``torch.ops.mtprobe.tree_attention`` (CPU: ATen SDPA on the unpacked pattern;
CUDA: csrc/kernels/tree_attention.cuh, matching SDPA on an H100 but slower than it so far). ``mtprobe.generate`` on a
model running this implementation passes every tree block as ancestor bits.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from mtprobe import ops

NAME = "mtprobe_tree"


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [B, H, T, D]
    key: torch.Tensor,  # [B, Hkv, P + T, D]
    value: torch.Tensor,  # [B, Hkv, P + T, D]
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls (its AttentionInterface signature); returns
    ``([B, T, H, D], None)`` as its own implementations do."""
    if dropout != 0.0:
        raise ValueError(f"{NAME} attention is for inference: dropout must be 0, got {dropout}")
    t = query.shape[2]
    if attention_mask is None:  # a chain: plain causal attention over the prefix and the block
        bits = _chain_bits(t, query.device)
    elif attention_mask.dtype == torch.long and attention_mask.dim() == 4:
        bits = attention_mask[0, 0]  # [T, W]
    else:
        raise ValueError(
            f"{NAME} attention takes the tree as int64 ancestor bits [1, 1, T, ceil(T / 64)] "
            f"(mtprobe.ops.tree_ancestor_bits(parents)[None, None]) or no mask, got a {attention_mask.dtype} "
            f"mask of shape {tuple(attention_mask.shape)}"
        )
    out = ops.tree_attention(query, key, value, bits, scaling)  # [B, H, T, D]
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=64)
def _chain_bits(t: int, device: torch.device) -> torch.Tensor:
    # Every layer of every causal forward asks for the same pattern: built once per (length, device).
    return ops.tree_ancestor_bits(torch.arange(-1, t - 1, device=device))


def _no_mask(*args: Any, **kwargs: Any) -> None:
    # The tree travels as ancestor bits in attention_mask; without one the block is causal.
    return None


def register() -> None:
    """Register ``"mtprobe_tree"`` with transformers' AttentionInterface and AttentionMaskInterface."""
    AttentionInterface.register(NAME, tree_attention_forward)
    AttentionMaskInterface.register(NAME, _no_mask)
