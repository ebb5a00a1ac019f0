"""The small-batch linear op against its reference, and the linear forward built on it.

The op (torch.ops.mtprobe.small_batch_linear) is checked against the float64 reference within
float32's rounding bound over awkward shapes, for its errors and with opcheck;
``mtprobe.cpu.small_batch_linear.forward`` for where it hands over to torch's linear, and the switch
that keeps the op out. How the adapter routes a decode step's linears through it (one route among
several, chosen by measurement) is tests/test_linear_routes.py's.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.library import opcheck

import mtprobe
from mtprobe import _C
from mtprobe.cpu import linear_routes, small_batch_linear
from mtprobe.reference import small_batch_linear as reference
from mtprobe.reference.small_batch_linear import rounding_bound

SHAPES = [  # (leading dims of x, in_features, out_features)
    ((1,), 1, 1),
    ((2,), 3, 5),
    ((3,), 8, 64),
    ((7,), 9, 67),
    ((8,), 577, 130),
    ((4,), 64, 33),  # one register block of 4 inputs, 11 of 3 weight rows
    ((5,), 64, 34),  # a second block of 1 input; a last block of 1 weight row
    ((12,), 64, 35),  # a last block of 2 weight rows
    ((20,), 64, 33),  # MAX_ROWS
    ((33,), 64, 33),  # past MAX_ROWS (the op itself takes any count)
    ((17,), 20, 7),
    ((1, 4), 576, 192),  # [batch, T, in], as a model calls it
    ((2, 3), 33, 1),
    ((0,), 16, 8),  # no rows
    # The AVX-512 kernel's blocks: 8 weight rows for 1-2 inputs, 5 for 3, 4 for more, in passes of 3 to 6
    # inputs; groups cut short run column by column; `in` past whole vectors takes a masked step.
    ((2,), 16, 17),  # two 8-row groups, 1 column left
    ((3,), 32, 13),  # two 5-row groups, 3 columns left
    ((6,), 48, 41),  # one pass of 6
    ((7,), 40, 10),  # passes of 3 and 4; a masked tail of 8
    ((13,), 80, 9),  # passes of 4, 4 and 5
    ((25,), 33, 6),  # five passes of 5; a masked tail of 1
]


def _case(lead: tuple[int, ...], k: int, n: int, bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)  # [..., in]
    w = torch.randn(n, k, generator=g)  # [out, in]
    b = torch.randn(n, generator=g) if bias else None  # [out]
    return x, w, b


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "lead,k,n", SHAPES, ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}-{s[2]}" for s in SHAPES]
)
def test_op_matches_the_reference_within_float32_rounding(lead, k, n, bias):
    x, w, b = _case(lead, k, n, bias)
    y = torch.ops.mtprobe.small_batch_linear(x, w, b)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    exact = reference(x, w, b).double()
    # The bias adds one rounding of the output's own size.
    bound = rounding_bound(x, w) + torch.finfo(torch.float32).eps * exact.abs() + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["portable", "avx2", "avx512", "default"])
@pytest.mark.parametrize(
    "lead,k,n", SHAPES, ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}-{s[2]}" for s in SHAPES]
)
def test_bfloat16_weights_match_the_reference_of_their_float32_values(lead, k, n, level):
    """A bfloat16 weight is widened exactly as it is read: the op equals the reference on the weight's
    float32 values within float32's rounding, every kernel, awkward shapes (tails of 8 and 16 included)."""
    x, w, b = _case(lead, k, n, True)
    half = w.bfloat16()
    y = _C.small_batch_linear_at_level(x, half, b, level)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    wide = half.float()  # the exact values the kernel multiplies
    exact = reference(x, wide, b).double()
    bound = rounding_bound(x, wide) + torch.finfo(torch.float32).eps * exact.abs() + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()
    if x.numel():
        opcheck(torch.ops.mtprobe.small_batch_linear, (x, half, b))


def test_the_reference_is_nn_linear():
    x, w, b = _case((4,), 24, 10, True)
    layer = nn.Linear(24, 10)
    with torch.no_grad():
        layer.weight.copy_(w)
        layer.bias.copy_(b)
    torch.testing.assert_close(reference(x, w, b), layer(x).detach(), rtol=1e-5, atol=1e-5)


def test_op_is_deterministic_and_independent_of_threads():
    # Each output column is one thread's own sum: the thread count cannot change a value.
    x, w, b = _case((5,), 300, 1000, True)
    first = torch.ops.mtprobe.small_batch_linear(x, w, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.ops.mtprobe.small_batch_linear(x, w, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, single)


def test_op_opcheck():
    for bias in (True, False):
        x, w, b = _case((3,), 40, 24, bias)
        opcheck(torch.ops.mtprobe.small_batch_linear, (x, w, b))
        assert mtprobe.ops.small_batch_linear(x, w, b).shape == (3, 24)


BAD_ARGS = {
    "float64_x": (lambda x, w, b: (x.double(), w, b), "x must be float32 and weight float32 or bfloat16"),
    "float16_weight": (lambda x, w, b: (x, w.half(), b), "x must be float32 and weight float32 or bfloat16"),
    "bfloat16_x": (lambda x, w, b: (x.bfloat16(), w, b), "x must be float32 and weight float32 or bfloat16"),
    "in_features": (lambda x, w, b: (x[:, :5], w, b), r"x must be \[..., in_features\] with in_features = 8"),
    "weight_1d": (lambda x, w, b: (x, w[0], b), r"weight must be \[out_features, in_features\]"),
    "weight_not_contiguous": (lambda x, w, b: (x, w.t().contiguous().t(), b), "weight must be contiguous"),
    "bias_shape": (lambda x, w, b: (x, w, b[:2]), r"bias must be \[out_features\] = \[6\]"),
    "bias_dtype": (lambda x, w, b: (x, w, b.double()), "bias must be a float32 CPU tensor"),
}


@pytest.mark.parametrize("case", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_op_refuses_bad_arguments_with_the_reason(case):
    change, message = case
    x, w, b = _case((3,), 8, 6, True)
    with pytest.raises(ValueError, match=message):
        torch.ops.mtprobe.small_batch_linear(*change(x, w, b))


# --- the forward and its switch ---------------------------------------------------------------------


def test_the_environment_keeps_the_op_out(monkeypatch):
    assert small_batch_linear.simd() == bool(_C.small_batch_linear_simd())
    # Why the small-batch route cannot run: the CPU first (nothing to turn on), else the switch.
    off_why = "lacks AVX2/FMA" if not small_batch_linear.simd() else f"{small_batch_linear.ENV}=0"
    for off in ("0", "false", "OFF", " no "):
        monkeypatch.setenv(small_batch_linear.ENV, off)
        assert not small_batch_linear.enabled()
        assert off_why in linear_routes.unavailable(linear_routes.SMALL_BATCH)
    for on in ("1", "yes", ""):
        monkeypatch.setenv(small_batch_linear.ENV, on)
        assert small_batch_linear.enabled() == small_batch_linear.simd()
        assert (linear_routes.unavailable(linear_routes.SMALL_BATCH) == "") == small_batch_linear.simd()
    monkeypatch.delenv(small_batch_linear.ENV)
    assert small_batch_linear.enabled() == small_batch_linear.simd()  # on by default where it runs


def test_the_forward_falls_back_to_torch_linear_where_the_op_does_not_apply():
    # The op itself runs on any CPU (its portable loop without AVX2): forward is tested everywhere.
    layer = nn.Linear(16, 8)
    forward = small_batch_linear.forward
    stock = nn.functional.linear
    with torch.no_grad():
        for rows in ((3,), (1, 5), (small_batch_linear.MAX_ROWS,)):  # the op, bit for bit
            few = torch.randn(*rows, 16)  # [..., in]
            assert torch.equal(
                forward(layer, few), torch.ops.mtprobe.small_batch_linear(few, layer.weight, layer.bias)
            )
        for rows in ((small_batch_linear.MAX_ROWS + 1,), (3, 7)):  # past MAX_ROWS: torch's linear
            many = torch.randn(*rows, 16)
            assert torch.equal(forward(layer, many), stock(many, layer.weight, layer.bias))
        doubles = torch.randn(2, 16, dtype=torch.float64)  # not float32: torch's linear (and its error)
        with pytest.raises(RuntimeError, match="dtype"):
            forward(layer, doubles)
    # With autograd recording, the op (which has no backward) is not used: gradients still flow, to the
    # input and to the weight, also from an input that records none.
    x = torch.randn(2, 16, requires_grad=True)
    forward(layer, x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None and layer.bias.grad is not None
    layer.zero_grad()
    forward(layer, torch.randn(2, 16)).sum().backward()
    assert layer.weight.grad is not None
    # A frozen layer under autograd with an input that records nothing: the op, as in inference.
    layer.requires_grad_(False)
    x = torch.randn(2, 16)
    assert torch.equal(forward(layer, x), torch.ops.mtprobe.small_batch_linear(x, layer.weight, layer.bias))


# --- the kernels and the threads ----------------------------------------------------------------------


@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["portable", "avx2", "avx512", "default"])
def test_every_kernel_matches_the_reference(level):
    gen = torch.Generator().manual_seed(level)
    x = torch.randn(5, 77, generator=gen)  # 77: a tail past every vector width
    w = torch.randn(67, 77, generator=gen)
    b = torch.randn(67, generator=gen)
    got = _C.small_batch_linear_at_level(x, w, b, level)  # a level this CPU lacks falls back to the default
    want = reference(x, w, b)
    bound = rounding_bound(x, w) + 1e-6 * want.abs()
    assert ((got - want).abs() <= bound).all()
    with pytest.raises(ValueError, match="level must be 0"):
        _C.small_batch_linear_at_level(x, w, b, 4)


@pytest.mark.parametrize("level", [0, 1, 2], ids=["portable", "avx2", "avx512"])
@pytest.mark.parametrize(
    "lead,k,n", SHAPES, ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}-{s[2]}" for s in SHAPES]
)
def test_every_kernel_on_every_shape(lead, k, n, level):
    x, w, b = _case(lead, k, n, bias=True, seed=k + n)
    got = _C.small_batch_linear_at_level(x.reshape(-1, k), w, b, level)  # [rows, out]
    want = reference(x.reshape(-1, k), w, b)
    bound = rounding_bound(x.reshape(-1, k), w) + 1e-6 * want.abs()
    assert got.shape == want.shape
    assert ((got - want).abs() <= bound).all()


def test_the_default_kernel_is_named():
    assert _C.small_batch_linear_isa() == ("avx2" if _C.small_batch_linear_simd() else "scalar")
    assert _C.small_batch_linear_isa() in small_batch_linear.KERNEL


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to split")
def test_ops_split_their_work_across_torch_threads():
    # at::parallel_for is inline in ATen's headers: built without OpenMP, as the extension was until
    # 2026-11-27, every op of mtprobe ran on one thread (the small-batch op at half torch's speed).
    torch.set_num_threads(2)  # restored by conftest's fixture
    assert _C.parallel_for_threads(64) == 2
