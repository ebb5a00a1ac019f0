"""Reference definition of the group-quantized linear layer: ``y = x W^T + b`` with ``W`` given as codes.

Every weight row is cut into groups of 32 inputs, each with a scale (GGUF's formats):

- Q4_1, uint8 ``codes [out, in / 2]``: ``W[n, 32 g + j] = scale[n, g] * q + min[n, g]`` with 4-bit codes
  ``q``, two a byte: byte ``16 g + j`` of row n holds code ``32 g + j`` in its low nibble and
  ``32 g + 16 + j`` in its high one;
- Q8_0, int8 ``codes [out, in]``: ``W[n, 32 g + j] = scale[n, g] * q``.

The C++ op (``torch.ops.mtprobe.quantized_linear``) computes the same in float32; this sums in float64,
so a test bounds the op's rounding instead of comparing two float32 roundings. :func:`searched_q4_1` and
:func:`searched_q8_0` define the searched rounding (``torch.ops.mtprobe.quantize_search_q4_1`` and
``_q8_0``, csrc/core/quantized_linear.h), every group at once.

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


def quantized_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., in]`` float32 as int8 codes ``[..., in]`` (in x's own order) and scales ``[..., in / 32]``, per
    group of 32: ``d = max |x_g| / 127``, ``c = round(x * (127 / max |x_g|))`` half to even, in float32 as
    csrc/core/quantized_linear.cpp computes them (an all-zero group: ``d = 0``, codes 0)."""
    g = x.float().reshape(*x.shape[:-1], -1, 32)  # [..., groups, 32]
    amax = g.abs().amax(-1)  # [..., groups]
    factor = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(g * factor[..., None])  # [..., groups, 32]
    return codes.to(torch.int8).reshape(x.shape), amax / 127.0


def quantized_linear_int8(
    x: torch.Tensor,  # [..., in]
    codes: torch.Tensor,  # [out, in / 2] uint8 (Q4_1) or [out, in] int8 (Q8_0)
    scale: torch.Tensor,  # [out, in / 32]
    min: torch.Tensor | None,  # [out, in / 32], Q4_1 only
    bias: torch.Tensor | None = None,  # [out]
) -> torch.Tensor:  # [..., out]
    """:func:`quantized_linear` on x's int8 codes (:func:`quantized_activations`), as
    ``torch.ops.mtprobe.quantized_linear_int8``: each group's code products summed exactly, times
    ``scale[n, g] * d[g]``, plus Q4_1's ``min[n, g]`` times the float sum of x's group; float64 sums."""
    c, d = quantized_activations(x)
    groups = scale.shape[1]
    xd = (c.double().reshape(*x.shape[:-1], groups, 32) * d.double()[..., None]).reshape(x.shape)
    y = xd @ quantized_weight(codes, scale, None if min is None else torch.zeros_like(min)).T
    if min is not None:
        xsum = x.double().reshape(*x.shape[:-1], groups, 32).sum(-1)  # [..., groups]
        y = y + xsum @ min.double().T
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def searched_q4_1(
    weight: torch.Tensor,  # [out, in] float32
    codes: torch.Tensor,  # [out, in] GGUF's codes 0..15, as floats
    scale: torch.Tensor,  # [out, in / 32]
    min: torch.Tensor,  # [out, in / 32]
    error_weights: torch.Tensor,  # [in]
    cuts: list[float],
    refines: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # codes [out, in], scale, min [out, in / 32]
    """Each group's codes of the ranges ``[lo + b (hi - lo), hi - t (hi - lo)]`` (every pair of ``cuts`` but
    (0, 0)) with their weighted least-squares scale and minimum, then ``refines`` times the best codes
    re-rounded to their own; the best by ``sum_j a_j (W_j - w_j)^2`` where strictly better than the input's.
    Groups within a thousandth of a step of their grid are left alone."""
    out, inp = weight.shape
    w = weight.reshape(out, inp // 32, 32)
    a = error_weights.reshape(inp // 32, 32).expand_as(w)
    codes, scale, min = codes.reshape(w.shape).clone(), scale.clone(), min.clone()
    best = ((codes * scale[..., None] + min[..., None] - w).square() * a).sum(-1)  # [out, groups]
    on_grid = best <= (1e-3 * scale).square() * a.sum(-1)
    sa, saw = a.sum(-1), (a * w).sum(-1)

    def keep_better(start: torch.Tensor, step: torch.Tensor) -> None:  # [out, groups] each
        nonlocal best, codes, scale, min
        q = torch.round((w - start[..., None]) / step[..., None]).clamp(0, 15)
        aq = a * q
        sq, sqq, sqw = aq.sum(-1), (aq * q).sum(-1), (aq * w).sum(-1)
        det = sa * sqq - sq * sq
        ok = det > 1e-12 * sa * sqq
        s = torch.where(ok, (sa * sqw - sq * saw) / torch.where(ok, det, 1.0), 0.0)
        m = (saw - s * sq) / sa
        err = ((q * s[..., None] + m[..., None] - w).square() * a).sum(-1)
        better = ok & (s > 0) & (err < best) & ~on_grid
        best = torch.where(better, err, best)
        codes = torch.where(better[..., None], q, codes)
        scale, min = torch.where(better, s, scale), torch.where(better, m, min)

    low = w.amin(-1)
    width = w.amax(-1) - low
    tiny = torch.finfo(torch.float32).tiny
    for b in cuts:
        for t in cuts:
            if b or t:
                keep_better(low + b * width, (width * (1 - b - t) / 15).clamp_min(tiny))
    for _ in range(refines):
        keep_better(min, scale.clamp_min(tiny))
    return codes.reshape(out, inp), scale, min


def searched_q8_0(
    weight: torch.Tensor,  # [out, in] float32
    codes: torch.Tensor,  # [out, in] GGUF's codes -127..127, as floats
    scale: torch.Tensor,  # [out, in / 32]
    error_weights: torch.Tensor,  # [in]
    iterations: int,
) -> tuple[torch.Tensor, torch.Tensor]:  # codes [out, in], scale [out, in / 32]
    """``iterations`` times each group's scale refitted to its codes by weighted least squares and the codes
    re-rounded to it, kept where the weighted error falls."""
    out, inp = weight.shape
    w = weight.reshape(out, inp // 32, 32)
    a = error_weights.reshape(inp // 32, 32).expand_as(w)
    codes, scale = codes.reshape(w.shape).clone(), scale.clone()
    best = ((codes * scale[..., None] - w).square() * a).sum(-1)
    tiny = torch.finfo(torch.float32).tiny
    for _ in range(iterations):
        den = (a * codes * codes).sum(-1)
        s = torch.where(den > 0, (a * codes * w).sum(-1) / den.clamp_min(tiny), scale)
        q = torch.round(w / s.clamp_min(tiny)[..., None]).clamp(-127, 127)
        err = ((q * s[..., None] - w).square() * a).sum(-1)
        better = (s > 0) & (err < best)
        best = torch.where(better, err, best)
        codes = torch.where(better[..., None], q, codes)
        scale = torch.where(better, s, scale)
    return codes.reshape(out, inp), scale
