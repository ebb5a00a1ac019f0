"""The panel-packed linear ops (the C++ target forward's kernel) against their reference.

``torch.ops.mtprobe.pack_panels`` against :func:`mtprobe.reference.pack_panels` exactly;
``torch.ops.mtprobe.panel_linear`` against the float64 reference within float32's rounding bound over awkward
shapes, every kernel (AVX-512, AVX2, the portable loop) bit for bit the others, float32 and bfloat16 panels,
with opcheck; and its errors. How TargetForward uses the panels is tests/test_native_forward.py's.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import mtprobe
from mtprobe import _C
from mtprobe.reference import pack_panels, panel_linear
from mtprobe.reference.panel_linear import rounding_bound, unpack_panels

SHAPES = [  # (leading dims of x, in_features, out_features)
    ((1,), 1, 1),
    ((2,), 3, 5),
    ((1,), 576, 32),  # one whole panel
    ((3,), 8, 33),  # a last panel of 1 column
    ((7,), 9, 47),  # a last panel of 15 (AVX2: half a panel short)
    ((13,), 64, 64),  # one AVX-512 pass of 13
    ((14,), 64, 50),  # two passes of 7; a last panel of 18 columns (AVX2: its second half 2)
    ((6,), 17, 96),  # one AVX2 pass of 6
    ((27,), 33, 40),  # three AVX-512 passes of 9, five AVX2 passes
    ((40,), 40, 70),  # SMALL_ROWS
    ((1, 4), 576, 192),  # [batch, T, in], as a model calls it
    ((2, 3), 33, 1),
    ((0,), 16, 8),  # no rows
]
IDS = [f"{'x'.join(map(str, s[0]))}-{s[1]}-{s[2]}" for s in SHAPES]
LEVELS = {"portable": 0, "avx2": 1, "avx512": 2, "default": 3}


def _case(lead: tuple[int, ...], k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)  # [..., in]
    w = torch.randn(n, k, generator=g)  # [out, in]
    b = torch.randn(n, generator=g) if bias else None  # [out]
    return x, w, b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lead,k,n", SHAPES, ids=IDS)
def test_pack_is_the_reference_layout(lead, k, n, dtype):
    w = torch.randn(n, k).to(dtype)
    panels = torch.ops.mtprobe.pack_panels(w)
    assert panels.shape == (-(-n // 32), k, 32) and panels.dtype == dtype
    assert torch.equal(panels, pack_panels(w))
    assert torch.equal(unpack_panels(panels, n), w)
    assert (panels.transpose(1, 2).reshape(-1, k)[n:] == 0).all()  # the last panel's rows past `out`


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("lead,k,n", SHAPES, ids=IDS)
def test_every_kernel_matches_the_reference_and_each_other(lead, k, n, dtype, bias):
    """Within float32's bound of the float64 reference on the weight's values (a bfloat16 one widened
    exactly), and the same bits from every kernel: each sums its k in order, one fused multiply-add at a
    time (a level this CPU lacks falls back to the widest it has, so it is compared too)."""
    x, w, b = _case(lead, k, n, bias)
    w = w.to(dtype)
    panels = torch.ops.mtprobe.pack_panels(w)
    outs = {name: _C.panel_linear_at_level(x, panels, b, n, level) for name, level in LEVELS.items()}
    wide = w.float()
    exact = panel_linear(x, pack_panels(wide), b, n).double()
    bound = rounding_bound(x, wide) + torch.finfo(torch.float32).eps * exact.abs() + 1e-30
    for name, y in outs.items():
        assert y.shape == (*lead, n) and y.dtype == torch.float32, name
        assert ((y.double() - exact).abs() <= bound).all(), name
        assert torch.equal(y, outs["portable"]), name
    assert torch.equal(torch.ops.mtprobe.panel_linear(x, panels, b, n), outs["default"])


def test_op_is_independent_of_threads():
    # Each output column is one thread's own sum: the thread count cannot change a value.
    x, w, b = _case((5,), 300, 1000, True)
    panels = torch.ops.mtprobe.pack_panels(w)
    first = torch.ops.mtprobe.panel_linear(x, panels, b, 1000)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.ops.mtprobe.panel_linear(x, panels, b, 1000)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, single)


def test_ops_opcheck():
    for bias in (True, False):
        for dtype in (torch.float32, torch.bfloat16):
            x, w, b = _case((3,), 40, 50, bias)
            w = w.to(dtype)
            opcheck(torch.ops.mtprobe.pack_panels, (w,))
            panels = mtprobe.ops.pack_panels(w)
            opcheck(torch.ops.mtprobe.panel_linear, (x, panels, b, 50))
            assert mtprobe.ops.panel_linear(x, panels, b, 50).shape == (3, 50)


def _bad_panel_args():
    x, w, b = _case((3,), 8, 40, True)
    p = pack_panels(w)  # [2, 8, 32]
    return {
        "float64_x": ((x.double(), p, b, 40), "x must be float32 and panels float32 or bfloat16"),
        "float16_panels": ((x, p.half(), b, 40), "x must be float32 and panels float32 or bfloat16"),
        "in_features": ((x[:, :5], p, b, 40), r"x must be \[..., in_features\] with in_features = 8"),
        "out_features": (
            (x, p, b, 70),
            r"panels must be \[ceil\(out_features / 32\), in_features, 32\] = \[3",
        ),
        "negative_out": ((x, p, b, -1), "out_features must be >= 0"),
        "unpacked_weight": ((x, w, b, 40), r"panels must be \[ceil\(out_features / 32\)"),
        "not_contiguous": (
            (x, p.transpose(0, 1).contiguous().transpose(0, 1), b, 40),
            "panels must be contiguous",
        ),
        "bias_shape": ((x, p, b[:2], 40), r"bias must be \[out_features\] = \[40\]"),
        "bias_dtype": ((x, p, b.double(), 40), "bias must be a float32 CPU tensor"),
    }


@pytest.mark.parametrize("case", list(_bad_panel_args()))
def test_panel_linear_refuses_bad_arguments_with_the_reason(case):
    args, message = _bad_panel_args()[case]
    with pytest.raises(ValueError, match=message):
        torch.ops.mtprobe.panel_linear(*args)


@pytest.mark.parametrize(
    "weight,message",
    [
        (torch.zeros(4), r"weight must be \[out_features, in_features\]"),
        (torch.zeros(4, 3, dtype=torch.float64), "weight must be a float32 or bfloat16 CPU tensor"),
    ],
    ids=["1d", "float64"],
)
def test_pack_panels_refuses_bad_weights_with_the_reason(weight, message):
    with pytest.raises(ValueError, match=message):
        torch.ops.mtprobe.pack_panels(weight)


def test_bad_level_is_named():
    x, w, b = _case((2,), 8, 8, True)
    with pytest.raises(ValueError, match="level must be 0 .portable., 1 .AVX2., 2 .AVX-512. or 3"):
        _C.panel_linear_at_level(x, pack_panels(w), b, 8, 4)
