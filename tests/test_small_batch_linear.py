"""The small-batch linear op against its reference, and its route through the adapter.

The op (torch.ops.mtprobe.small_batch_linear) is checked against the float64 reference within
float32's rounding bound over awkward shapes, for its errors and with opcheck; the route
(mtprobe.small_batch_linear) for which modules it swaps, that it puts them back, that the adapter
takes it exactly for forwards over 2..MAX_ROWS inputs, and that the logits stay the model's.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.library import opcheck

import mtprobe
from conftest import tiny_llama
from mtprobe import _C, small_batch_linear
from mtprobe.adapter import HFAdapter
from mtprobe.profile import ForwardProfile, ProfileKey
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
    "float64_x": (lambda x, w, b: (x.double(), w, b), "x and weight must be float32"),
    "float16_weight": (lambda x, w, b: (x, w.half(), b), "x and weight must be float32"),
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


# --- the route --------------------------------------------------------------------------------------


class _OwnLinear(nn.Linear):
    """A subclass (as quantized linears are): it may compute something else, so it is never swapped."""


def test_routable_linears_picks_plain_float32_cpu_linears():
    model = nn.Sequential(
        nn.Linear(4, 4),
        nn.Linear(4, 4).double(),
        _OwnLinear(4, 4),
        nn.Linear(4, 4),
        nn.Linear(4, 4, bias=False),
    )
    model[3].forward = lambda x: x  # a forward of its own (accelerate's hooks set one)
    found = small_batch_linear.routable_linears(model)
    if not _C.small_batch_linear_simd():
        assert found == []  # a CPU without AVX2/FMA keeps torch's linear everywhere
        return
    assert found == [model[0], model[4]]


def test_the_environment_turns_the_route_off(monkeypatch):
    model = tiny_llama()
    for off in ("0", "false", "OFF"):
        monkeypatch.setenv(small_batch_linear.ENV, off)
        assert not small_batch_linear.enabled() and small_batch_linear.routable_linears(model) == []
        assert ProfileKey.of(model).linear == "stock"
    monkeypatch.setenv(small_batch_linear.ENV, "1")
    assert small_batch_linear.enabled() == bool(_C.small_batch_linear_simd())


requires_simd = pytest.mark.skipif(
    not _C.small_batch_linear_simd(), reason="this CPU has no AVX2/FMA: the route stays off"
)


@requires_simd
def test_routed_swaps_forward_and_puts_it_back_even_on_error():
    model = tiny_llama()
    linears = small_batch_linear.routable_linears(model)
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer, and the LM head
    with pytest.raises(RuntimeError, match="inside"):
        with small_batch_linear.routed(linears):
            assert all("forward" in vars(m) for m in linears)
            raise RuntimeError("inside")
    assert not any("forward" in vars(m) for m in model.modules())
    # Bound once, reused by every later forward; and the same with a plain list of modules.
    bound = linears.bound
    with small_batch_linear.routed(linears), torch.no_grad():
        assert linears.bound is bound
        assert all(vars(m)["forward"].__self__ is m for m in linears)
        q = linears[0]
        x = torch.randn(3, q.in_features)
        assert torch.equal(q(x), torch.ops.mtprobe.small_batch_linear(x, q.weight, q.bias))
    with small_batch_linear.routed(list(linears)):
        assert all(vars(m)["forward"].__self__ is m for m in linears)
    assert not any("forward" in vars(m) for m in model.modules())


@requires_simd
def test_a_routed_linear_falls_back_where_the_op_does_not_apply():
    layer = nn.Linear(16, 8)
    stock = nn.functional.linear
    with small_batch_linear.routed([layer]), torch.no_grad():
        few = torch.randn(3, 16)  # the op, bit for bit
        assert torch.equal(layer(few), torch.ops.mtprobe.small_batch_linear(few, layer.weight, layer.bias))
        many = torch.randn(small_batch_linear.MAX_ROWS + 1, 16)  # past MAX_ROWS: torch's linear
        assert torch.equal(layer(many), stock(many, layer.weight, layer.bias))
        doubles = torch.randn(2, 16, dtype=torch.float64)  # not float32: torch's linear (and its error)
        with pytest.raises(RuntimeError, match="dtype"):
            layer(doubles)
    # With autograd recording, the op (which has no backward) is not used: gradients still flow.
    with small_batch_linear.routed([layer]):
        x = torch.randn(2, 16, requires_grad=True)
        layer(x).sum().backward()
    assert x.grad is not None and layer.weight.grad is not None


@requires_simd
@pytest.mark.parametrize("t", [1, 2, 5, 12, 20, 21])
def test_the_adapter_routes_forwards_over_2_to_max_rows_inputs(t, monkeypatch):
    model = tiny_llama()
    entered = []
    real = small_batch_linear.routed

    def spy(linears):
        entered.append(len(linears))
        return real(linears)

    monkeypatch.setattr(small_batch_linear, "routed", spy)
    routed_adapter = HFAdapter(model, 64)
    stock_adapter = HFAdapter(model, 64)
    stock_adapter._small_batch_linears = []
    ids = torch.randint(0, 96, (12 + t,), generator=torch.Generator().manual_seed(t))
    logits = []
    with torch.inference_mode():
        for adapter in (routed_adapter, stock_adapter):
            adapter.forward(ids[:12], None, torch.arange(12)[None], None, 0, False)
            pos = torch.arange(12, 12 + t)[None]
            mask = (
                None
                if t == 1
                else mtprobe.ops.tree_attention_mask(torch.arange(-1, t - 1), 12, torch.float32)
            )
            out, _ = adapter.forward(ids[12:], None, pos, mask, 12, False)
            logits.append(out)
    # The prefill (12 inputs, within MAX_ROWS) and T outside [2, MAX_ROWS] keep torch's linear; the route
    # is entered once per routed forward, and only by the adapter that has it.
    assert entered == ([15] if 2 <= t <= small_batch_linear.MAX_ROWS else [])
    assert not any("forward" in vars(m) for m in model.modules())
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)


@requires_simd
def test_profiles_record_the_route_and_refuse_the_other(monkeypatch):
    model = tiny_llama()
    key = ProfileKey.of(model)
    assert key.linear == small_batch_linear.PROFILE_TAG == "small-batch v2, 2..20 inputs"
    stock = ForwardProfile(ProfileKey(**{**key.__dict__, "linear": "stock"}), (1, 2), (0,), ((1.0, 1.7),))
    with pytest.raises(ValueError, match=re.escape(f"linear: profile 'stock' vs now '{key.linear}'")):
        stock.check(model)
    # The first kernel (2..12 inputs, other costs) recorded "small-batch": its profiles are not this one's.
    first = ForwardProfile(
        ProfileKey(**{**key.__dict__, "linear": "small-batch"}), (1, 2), (0,), ((1.0, 1.0),)
    )
    with pytest.raises(ValueError, match="linear: profile 'small-batch' vs now"):
        first.check(model)
    # A profile saved before the field existed was measured with torch's linear.
    data = stock.to_dict()
    del data["key"]["linear"]
    assert ForwardProfile.from_dict(data).key.linear == "stock"
    monkeypatch.setenv(small_batch_linear.ENV, "0")
    stock.check(model)  # with the route off, the same model matches it


@requires_simd
@pytest.mark.parametrize(
    "method",
    [
        {"method": "stand", "block_complexity": 6},
        {"method": "pld", "num_tokens": 5},
        {"method": "probe", "block_complexity": 8},
    ],
    ids=["stand", "pld", "probe"],
)
def test_greedy_output_is_hf_greedy_with_the_route_on_and_off(method, monkeypatch):
    model = tiny_llama(vocab_size=64)
    ids = torch.tensor([[5, 9, 14, 5, 9, 14, 5, 9, 3, 7, 5, 9]])
    expected = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)[0, ids.shape[1] :]
    entered = []
    real = small_batch_linear.routed

    def spy(linears):
        entered.append(env)
        return real(linears)

    monkeypatch.setattr(small_batch_linear, "routed", spy)
    for env in ("1", "0"):
        monkeypatch.setenv(small_batch_linear.ENV, env)
        out = mtprobe.generate(model, ids, method, max_new_tokens=24)
        assert (env in entered) == (env == "1")  # the route ran only while on
        assert torch.equal(out.sequences[0, ids.shape[1] :], expected), (method, env)
        assert out.forward_calls < 24  # drafts were verified: some forwards had 2 or more inputs
