"""``y = x W^T + b`` through oneDNN's float32 matmul: the Python side of ``csrc/runtime/onednn_linear.h``.

torch's CPU wheel sends a float32 ``nn.Linear`` of many rows to MKL's GEMM, which on AMD CPUs takes an AVX2
kernel: on a 2-core AMD EPYC Zen 5 it ran SmolLM2's linears at about 210 GFLOP/s where oneDNN's matmul
(``mkldnn::_linear_pointwise``, shipped in the same wheel) ran them at 450–470, float32 throughout
(benchmarks/results/native_forward/kernels-onednn.md). Few rows are bound by the weights' stream, not the
arithmetic: there the small-batch kernels serve.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["onednn_linear"]


@functools.cache
def _op() -> object | None:
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return None


def onednn_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """``F.linear(x, weight, bias)`` for float32 CPU tensors (x ``[..., in]``, weight ``[out, in]``) through
    oneDNN, or ``None`` where it does not apply: another dtype or device, or a torch without oneDNN or with it
    switched off (``torch.backends.mkldnn.flags(enabled=False)``). Equal to ``F.linear`` up to rounding."""
    op = _op()
    if (
        op is None
        or not torch.backends.mkldnn.is_available()
        or not torch._C._get_mkldnn_enabled()
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
        or weight.device.type != "cpu"
    ):
        return None
    y = op(x.reshape(-1, x.shape[-1]), weight, bias, "none", [], "")  # [rows, out]
    return y.reshape(*x.shape[:-1], weight.shape[0])
