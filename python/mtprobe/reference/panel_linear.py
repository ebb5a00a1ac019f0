"""Reference definition of the panel-packed linear layer (``csrc/core/panel_linear.h``).

A weight ``W [out, in]`` packed in panels of 32 output features, k-major: ``panels [ceil(out / 32), in, 32]``
with ``panels[p, k, j] = W[32 p + j, k]`` (rows past ``out`` zero). ``panel_linear`` is ``x W^T + b`` read
from the panels: the C++ op (``torch.ops.mtprobe.panel_linear``) computes it in float32, each output's sum
in blocks of 64 terms by fused multiply-adds, the blocks' sums then added in order; the reference sums in float64, so a test can bound the op's
rounding instead of comparing two float32 roundings.

Worked example (the one in csrc/core/panel_linear.h):

>>> import torch
>>> w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])   # [out, in]
>>> panels = pack_panels(w)                                   # [1, 2, 32]
>>> panels[0, :, :4]
tensor([[1., 1., 0., 0.],
        [0., 1., 2., 0.]])
>>> panel_linear(torch.tensor([[1.0, 2.0], [3.0, 4.0]]), panels, torch.tensor([0.0, 0.0, 1.0]), 3)
tensor([[1., 3., 5.],
        [3., 7., 9.]])
"""

from __future__ import annotations

import torch

PANEL_WIDTH = 32
BLOCK_K = 64  # the op adds each output's terms in blocks of this many (its rounding bound)


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """``weight [out, in]`` as panels ``[ceil(out / 32), in, 32]`` of its dtype (rows past ``out`` zero)."""
    out, inp = weight.shape
    count = -(-out // PANEL_WIDTH)
    padded = weight.new_zeros(count * PANEL_WIDTH, inp)  # [count * 32, in]
    padded[:out] = weight
    return padded.view(count, PANEL_WIDTH, inp).transpose(1, 2).contiguous()


def unpack_panels(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight ``[out, in]`` the panels hold."""
    count, inp, width = panels.shape
    return panels.transpose(1, 2).reshape(count * width, inp)[:out_features]


def panel_linear(
    x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None, out_features: int
) -> torch.Tensor:
    """``x [..., in] @ W^T + bias`` with ``W`` read from its panels, summed in float64, in ``x``'s dtype."""
    y = x.double() @ unpack_panels(panels, out_features).double().T  # [..., out]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An upper bound on the op's float32 rounding error in each output (``[..., out]``), for tests.

    The op sums each output's n terms in blocks of 64, each block in order by fused multiply-adds, then the
    blocks' sums in order: it errs by at most gamma_m * sum_k |x_k w_k| with m = min(n, 64) + ceil(n / 64)
    and gamma_m = m u / (1 - m u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1).
    """
    n = x.shape[-1]
    u = torch.finfo(torch.float32).eps / 2
    m = min(n, BLOCK_K) + -(-n // BLOCK_K)
    gamma = m * u / (1 - m * u)
    return gamma * (x.double().abs() @ weight.double().abs().T)  # [..., out]
