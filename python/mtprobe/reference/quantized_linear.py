"""Reference definition of the group-quantized linear layer: ``y = x W^T + b`` with ``W`` given as codes.

Every weight row is cut into groups of 32 inputs, each with a scale (GGUF's formats):

- Q4_1, uint8 ``codes [out, in / 2]``: ``W[n, 32 g + j] = scale[n, g] * q + min[n, g]`` with 4-bit codes
  ``q``, two a byte: byte ``16 g + j`` of row n holds code ``32 g + j`` in its low nibble and
  ``32 g + 16 + j`` in its high one;
- Q8_0, int8 ``codes [out, in]``: ``W[n, 32 g + j] = scale[n, g] * q``.

The C++ op (``torch.ops.mtprobe.quantized_linear``) computes the same in float32; this sums in float64,
so a test bounds the op's rounding instead of comparing two float32 roundings.

Worked examples (those in csrc/core/quantized_linear.h), x all ones, bias 2:

>>> import torch
>>> nibbles = torch.arange(16)                                 # codes 0..15, and 16..31 again 0..15
>>> q4 = (nibbles | (nibbles << 4)).to(torch.uint8)[None]      # [out = 1, in / 2 = 16]
>>> quantized_linear(torch.ones(1, 32), q4, torch.tensor([[0.5]]), torch.tensor([[-1.0]]), torch.tensor([2.0]))
tensor([[90.]])
>>> q8 = (torch.arange(32) - 16).to(torch.int8)[None]          # [out = 1, in = 32]
>>> quantized_linear(torch.ones(1, 32), q8, torch.tensor([[0.25]]), None, torch.tensor([2.0]))
tensor([[-2.]])
"""

from __future__ import annotations

import torch


def quantized_weight(codes: torch.Tensor, scale: torch.Tensor, min: torch.Tensor | None) -> torch.Tensor:
    """The weight ``[out, in]`` in float64: Q4_1 from uint8 ``codes [out, in / 2]`` with ``min``, Q8_0 from
    int8 ``codes [out, in]``; ``scale`` and ``min`` ``[out, in / 32]``."""
    out = codes.shape[0]
    if codes.dtype == torch.uint8:
        b = codes.reshape(out, -1, 16).long()  # [out, groups, 16]
        q = torch.cat([b & 0x0F, b >> 4], dim=-1).double()  # [out, groups, 32]
        return (q * scale.double()[..., None] + min.double()[..., None]).reshape(out, -1)
    q = codes.reshape(out, -1, 32).double()  # [out, groups, 32]
    return (q * scale.double()[..., None]).reshape(out, -1)


def quantized_linear(
    x: torch.Tensor,  # [..., in]
    codes: torch.Tensor,  # [out, in / 2] uint8 (Q4_1) or [out, in] int8 (Q8_0)
    scale: torch.Tensor,  # [out, in / 32]
    min: torch.Tensor | None,  # [out, in / 32], Q4_1 only
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """``x @ W^T + bias`` summed in float64, returned in ``x``'s dtype."""
    y = x.double() @ quantized_weight(codes, scale, min).T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)
