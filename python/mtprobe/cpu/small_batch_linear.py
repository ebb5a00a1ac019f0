"""The target's linear layers over a few inputs on the CPU, the weights read once.

Verifying a draft block of T inputs runs every linear layer of the model over T rows. On a CPU,
torch's linear takes a matrix-vector path for one row, reading each weight once, and a GEMM path for
two or more, which first packs the whole weight: a second pass over weights far larger than the
cache. With SmolLM2-135M on a 2-core CPU a forward over 2 inputs cost about 1.8x one over 1
(benchmarks/results/small_batch_linear.md), so a draft paid for itself only when it was long and
likely. ``torch.ops.mtprobe.small_batch_linear`` reads each weight row from memory once, multiplies
it into 4 inputs from registers and into the others from cache, and prefetches the next rows meanwhile,
its output columns split across torch's threads; AVX2/FMA (``mtprobe._C.small_batch_linear_isa()``; an
AVX-512 kernel measured no faster, see csrc/core/small_batch_linear.h).

Whether a forward's linear layers run here is chosen per block size by measurement on the machine
at hand (:mod:`mtprobe.cpu.linear_routes`): on some CPUs torch's GEMM is the cheaper one. The values
differ from torch's only in rounding, as two BLAS kernels do.

``MTPROBE_SMALL_BATCH_LINEAR=0`` in the environment keeps the op out of that choice; so does a CPU
without AVX2 and FMA, where the op's portable loop would be slower than BLAS.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe import _C

ENV = "MTPROBE_SMALL_BATCH_LINEAR"

MAX_ROWS = 20
"""The most inputs the op takes (more go to torch's linear). Past a few inputs the op's cost grows with its
multiply-adds, torch's GEMM more slowly: with SmolLM2-135M on the 2-core CPU a forward over 16 inputs
was 7-12 % faster routed, over 20 3-4 %, over 24 5 % slower (benchmarks/results/small_batch_linear.md)."""

KERNEL = f"small-batch v3 ({_C.small_batch_linear_isa()}), up to {MAX_ROWS} inputs"
"""The kernel's version, instruction set and range, recorded with every measurement of it
(:data:`mtprobe.cpu.linear_routes.VERSIONS`): a measurement of another kernel (v2, which ran on one thread
where torch's threads use OpenMP; the first, up to 12 inputs) is not taken for this one."""


def simd() -> bool:
    """Whether this CPU runs the op's SIMD kernel (AVX2 with FMA)."""
    return bool(_C.small_batch_linear_simd())


def enabled() -> bool:
    """Whether the op may be measured and routed to: ``MTPROBE_SMALL_BATCH_LINEAR`` is not
    ``0``/``false``/``off`` and this CPU runs the op's AVX2/FMA kernel."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return simd()


def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``nn.Linear.forward`` through the op; anything it is not for goes to ``F.linear`` as before."""
    if (
        x.dtype != torch.float32
        or x.device.type != "cpu"
        or x.numel() > MAX_ROWS * x.shape[-1]
        or (
            torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        )  # the op has no backward
    ):
        return F.linear(x, self.weight, self.bias)
    return torch.ops.mtprobe.small_batch_linear(x, self.weight, self.bias)
