"""Comparison tolerances, one entry per floating dtype, for results that are computed rather than copied.

Masks, position ids, indices and cache copies are compared exactly; these are for attention outputs,
where two correct implementations may round differently (different kernels, accumulation orders, or a
float32 reference against a half-precision kernel). Measured worst cases on random inputs of magnitude
~1 with up to 1000 prefix positions: 1 ulp at magnitude 1 (5e-7, 1e-3, 8e-3); the tolerances allow ~2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Tolerance:
    atol: float
    rtol: float


TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(atol=1e-5, rtol=1e-5),
    torch.float16: Tolerance(atol=2e-3, rtol=2e-3),  # eps 9.8e-4
    torch.bfloat16: Tolerance(atol=1.6e-2, rtol=1.6e-2),  # eps 7.8e-3
}


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Keyword arguments for torch.testing.assert_close / torch.allclose at ``dtype``."""
    tol = TOLERANCES[dtype]
    return {"atol": tol.atol, "rtol": tol.rtol}


def dtype_id(dtype: torch.dtype) -> str:
    """Readable pytest id for a dtype parameter: "float16" rather than "dtype1"."""
    return str(dtype).removeprefix("torch.")
