"""Reference definition of the small-batch linear layer: ``y = x W^T + b``, what ``nn.Linear`` computes.

The C++ op (``torch.ops.mtprobe.small_batch_linear``) computes the same values in float32 with the
weight read once for up to 8 rows; it differs from this only in rounding. The reference sums in
float64, so a test can bound the op's rounding error instead of comparing two float32 roundings.

Worked example (the one in csrc/core/small_batch_linear.h):

>>> import torch
>>> x = torch.tensor([[1.0, 2.0], [3.0, 4.0]])               # [rows, in]
>>> w = torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 2.0]])   # [out, in]
>>> small_batch_linear(x, w, torch.tensor([0.0, 0.0, 1.0]))
tensor([[1., 3., 5.],
        [3., 7., 9.]])
"""

from __future__ import annotations

import torch


def small_batch_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., in] @ weight[out, in]^T + bias [out]`` summed in float64, returned in ``x``'s dtype."""
    y = x.double() @ weight.double().T  # [..., out]
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


def rounding_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """An upper bound on float32's rounding error in each output (``[..., out]``), for tests.

    A dot product of length n summed as 8 interleaved partial sums of n / 8 terms, then added
    pairwise, errs by at most gamma_m * sum_k |x_k w_k| with m = ceil(n / 8) + 3 and gamma_m =
    m u / (1 - m u), u = 2^-24 (Higham, Accuracy and Stability of Numerical Algorithms, 3.1).
    BLAS's own orders fit the same bound with their own m; this one is for the op's order.
    """
    n = x.shape[-1]
    u = torch.finfo(torch.float32).eps / 2
    m = -(-n // 8) + 3
    gamma = m * u / (1 - m * u)
    return gamma * (x.double().abs() @ weight.double().abs().T)  # [..., out]
