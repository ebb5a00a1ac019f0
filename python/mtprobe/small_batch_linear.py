"""The target's linear layers over a few inputs on the CPU, the weights read once.

Verifying a draft block of T inputs runs every linear layer of the model over T rows. On a CPU,
torch's linear takes a matrix-vector path for one row, reading each weight once, and a GEMM path for
two or more, which first packs the whole weight: a second pass over weights far larger than the
cache. With SmolLM2-135M on a 2-core CPU a forward over 2 inputs cost about 1.8x one over 1
(benchmarks/results/small_batch_linear.md), so a draft paid for itself only when it was long and
likely. ``torch.ops.mtprobe.small_batch_linear`` reads each weight row from memory once, multiplies
it into 4 inputs from registers and into the others from cache, and prefetches the next rows meanwhile.

mtprobe routes only its own verification forwards there: :class:`~mtprobe.adapter.HFAdapter` swaps
the ``forward`` of the model's float32 CPU ``nn.Linear`` modules for the length of one forward over
2 to :data:`MAX_ROWS` inputs, and puts them back after it. Plain decoding (one input), the prefill and
anything the user runs stay on torch's own linear, so HF's ``generate`` is compared with the same
one-input forward it runs itself. The values differ from torch's only in rounding, as two BLAS
kernels do (the greedy-identity tests run with the route on).

``MTPROBE_SMALL_BATCH_LINEAR=0`` in the environment turns the route off (read when an adapter is
made, i.e. when a generation or a cost profile starts); it is also off on CPUs without AVX2 and FMA,
where the op's portable loop would be slower than BLAS.
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from collections.abc import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe import _C

ENV = "MTPROBE_SMALL_BATCH_LINEAR"

MAX_ROWS = 20
"""The most inputs a forward may have to be routed. Past a few inputs the op's cost grows with its
multiply-adds, torch's GEMM more slowly: with SmolLM2-135M on the 2-core CPU a forward over 16 inputs
was 7-12 % faster routed, over 20 3-4 %, over 24 5 % slower (benchmarks/results/small_batch_linear.md)."""

PROFILE_TAG = f"small-batch v2, 2..{MAX_ROWS} inputs"
"""What :class:`mtprobe.profile.ProfileKey` records for a model routed here: it names the kernel's
version and the routed range, so a cost profile measured with another kernel or range (``small-batch``,
the first kernel with 2..12 inputs) is not taken for this one."""


def enabled() -> bool:
    """Whether the route is on: ``MTPROBE_SMALL_BATCH_LINEAR`` is not ``0``/``false``/``off`` and this CPU
    runs the op's AVX2/FMA kernel."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return bool(_C.small_batch_linear_simd())


class Linears(list):
    """The modules :func:`routable_linears` found, each one's routed ``forward`` bound once, at the first
    :func:`routed`: later forwards then only write the modules' instance dictionaries (0.03 ms per
    forward for SmolLM2's 211 linears, against 1.1-1.4 ms when binding the methods and going through
    ``nn.Module.__setattr__`` every time; 2-core CPU). Not to be changed once routed."""

    @functools.cached_property
    def bound(self) -> tuple[tuple[dict, types.MethodType], ...]:
        return tuple((vars(m), types.MethodType(_forward, m)) for m in self)


def routes(num_inputs: int) -> bool:
    """Whether a cached decode-step forward over ``num_inputs`` inputs runs through the op: 2 to
    :data:`MAX_ROWS`. One input (plain decoding) keeps torch's linear, as do larger blocks.

    >>> routes(1), routes(2), routes(MAX_ROWS), routes(MAX_ROWS + 1)
    (False, True, True, False)
    """
    return 2 <= num_inputs <= MAX_ROWS


def routable_linears(model: nn.Module) -> Linears:
    """The modules of ``model`` the route would swap (none while it is off): exactly ``nn.Linear``
    (subclasses, such as quantized linears, compute something else), float32 weights on the CPU,
    contiguous, and no ``forward`` of their own already (accelerate's hooks, another patch)."""
    found = Linears()
    if not enabled():
        return found
    for m in model.modules():
        if type(m) is not nn.Linear or "forward" in vars(m) or hasattr(m, "_hf_hook"):
            continue
        w, b = m.weight, m.bias
        if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
            continue
        if b is not None and (b.dtype != torch.float32 or b.device.type != "cpu"):
            continue
        found.append(m)
    return found


def _forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
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


@contextlib.contextmanager
def routed(linears: Sequence[nn.Linear]) -> Iterator[None]:
    """While open, each of ``linears`` (from :func:`routable_linears`) runs :func:`_forward`; on exit,
    its class's ``forward`` again (the instance attribute is removed, whatever happened inside)."""
    if isinstance(linears, Linears):
        bound = linears.bound
    else:
        bound = tuple((vars(m), types.MethodType(_forward, m)) for m in linears)
    # The instance dictionary directly: what nn.Module.__setattr__ ends up doing for a method, minus
    # its checks for parameters, buffers and submodules.
    for attrs, forward in bound:
        attrs["forward"] = forward
    try:
        yield
    finally:
        for attrs, _ in bound:
            attrs.pop("forward", None)
