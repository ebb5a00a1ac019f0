"""The C++ forward on the weights' own 4- and 8-bit codes (mtprobe.target_model.weight_codes): found only where
they reproduce the weights, the same logits as HF's forward within float32 rounding on every supported
architecture, greedy output token-identical to ``model.generate``, and the switch and the bad input."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_family, tiny_llama
from mtprobe import _C
from mtprobe.cpu import quantized_linear as ql
from mtprobe.target_model import native_forward as nf
from mtprobe.target_model import weight_codes as wc
from mtprobe.target_model.adapter import HFAdapter

needs_kernel = pytest.mark.skipif(
    wc.quantized_rows() == 0, reason="this CPU runs the codes' portable loop only"
)


def _on_grid(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with every linear weight moved onto the Q4_1 grid (its head, the tied embedding, onto Q8_0's), as
    a checkpoint dequantized from a GGUF file holds them; a weight whose rows do not split into 32s stays."""
    head = model.get_output_embeddings()
    with torch.no_grad():
        for _, module in nf._linears(model):
            w = module.weight
            if w.shape[1] % ql.GROUP == 0:
                w.copy_(ql.dequantize(ql.quantize(w, "q8_0" if module is head else "q4_1")))
    return model


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return tiny_llama(max_position_embeddings=512)
    if name == "llama-biases":
        return tiny_llama(attention_bias=True, mlp_bias=True, max_position_embeddings=512)
    return tiny_family(name)


ARCHS = ("llama", "llama-biases", "mistral", "qwen2", "qwen3", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def on_grid(request):
    return _on_grid(_build(request.param))


def test_codes_are_found_where_they_reproduce_the_weights():
    model = _on_grid(_build("llama"))
    codes = wc.weight_codes(model, nf._linears(model))
    assert set(codes) == {name for name, _ in nf._linears(model)}
    formats = {name: q.format for name, q in codes.items()}
    assert formats.pop("lm_head") == "q8_0" and set(formats.values()) == {"q4_1"}
    for name, module in nf._linears(model):
        torch.testing.assert_close(ql.dequantize(codes[name]), module.weight, atol=1e-6, rtol=0)
    # Off the grid (a full-precision checkpoint): none.
    off = _build("llama")
    assert wc.weight_codes(off, nf._linears(off)) == {}
    # One weight moved by more than the tolerance loses its codes; the others keep theirs.
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 7] += 1e-4
    assert set(codes) - set(wc.weight_codes(model, nf._linears(model))) == {"model.layers.1.mlp.up_proj"}


def test_the_self_draft_and_the_forward_share_one_copy_of_the_codes():
    """On the grid the 4-bit self-draft's layers hold the very codes the C++ forward found (one copy, quantized
    once); a weight written in place is quantized again."""
    from mtprobe.target_model import self_draft

    model = _on_grid(_build("llama"))
    codes = wc.weight_codes(model, nf._linears(model))
    assert self_draft.on_q4_grid(model)
    draft = self_draft.quantized(model, format="q4_1")
    layers = dict(draft.named_modules())
    for name, _ in nf._linears(model):
        assert layers[name].codes is codes[name].codes and layers[name].scale is codes[name].scale
    # A weight written in place (its version counter moves) is quantized anew, not served stale.
    up = model.model.layers[0].mlp.up_proj
    with torch.no_grad():
        up.weight.mul_(2.0)  # still on the grid (twice the steps), other codes' scales
    again = wc.unsearched(model, up, "q4_1")
    assert again is not codes["model.layers.0.mlp.up_proj"]
    torch.testing.assert_close(ql.dequantize(again), up.weight, atol=1e-6, rtol=0)
    # A write through .data (PEFT's merge) leaves the version counter: the forward's rebuild makes its codes anew.
    held = nf.native_forward(model).quantized_bytes
    with torch.no_grad():
        up.weight.data.mul_(0.5)
    assert nf.native_forward(model).quantized_bytes == held > 0  # every weight still has its codes
    assert "model.layers.0.mlp.up_proj" in wc.weight_codes(model, nf._linears(model))
    torch.testing.assert_close(ql.dequantize(wc.unsearched(model, up, "q4_1")), up.weight, atol=1e-6, rtol=0)
    # Codes that do not fit the layer are refused by name.
    with pytest.raises(ValueError, match="do not fit"):
        ql.QuantizedLinear(up, "q8_0", codes=again)
    mtprobe.release(model)


def test_reproduces_within_float32_rounding_only():
    w = torch.tensor([[0.5 * (j % 16) - 1.0 for j in range(32)]])  # [1, 32]: Q4_1 values, group max 6.5
    q = ql.quantize(w, "q4_1")
    eps = torch.finfo(torch.float32).eps
    assert wc.reproduces(w, q)
    assert wc.reproduces(w + torch.full_like(w, 3 * eps * 6.5), q)  # within the tolerance
    assert not wc.reproduces(w + torch.full_like(w, 8 * eps * 6.5), q)
    assert wc.codes_of(w) is not None and wc.codes_of(w.bfloat16()) is None  # float32 weights only
    assert wc.codes_of(torch.zeros(2, 48)) is None  # rows that do not split into groups of 32


@needs_kernel
@pytest.mark.parametrize("T", [1, 3], ids=["1 input", "chain of 3"])
def test_logits_on_the_codes_match_hf(on_grid, T, monkeypatch):
    """A block small enough for the codes: HF's logits within float32 rounding, as the float32 weights' are."""
    native = nf.native_forward(on_grid)
    assert native is not None and native.quantized_bytes > 0
    assert T <= wc.quantized_rows()
    P = 40
    ids = torch.randint(0, on_grid.config.vocab_size, (P + T,), generator=torch.Generator().manual_seed(1))
    got = {}
    for codes in ("1", "0"):
        monkeypatch.setenv(wc.ENV, codes)
        adapter = HFAdapter(on_grid, 128, checked=True, native=nf.native_forward(on_grid))
        with torch.inference_mode():
            adapter.exact_forward(ids[:P], None, torch.arange(P)[None], None, 0, False)
            got[codes], _ = adapter.forward(ids[P:], None, torch.arange(P, P + T)[None], None, P, False)
    assert nf.native_forward(on_grid).quantized_rows == 0  # the switch, read at every call: off
    assert nf.describe(on_grid) == nf.VERSION
    ref = HFAdapter(on_grid, 128, checked=True)
    with torch.inference_mode():
        ref.exact_forward(ids[:P], None, torch.arange(P)[None], None, 0, False)
        want, _ = ref.forward(ids[P:], None, torch.arange(P, P + T)[None], None, P, False)
    torch.testing.assert_close(got["1"], want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got["1"], got["0"], atol=1e-4, rtol=1e-4)
    assert not torch.equal(got["1"], got["0"])  # the codes ran: their sums round otherwise


@needs_kernel
@pytest.mark.parametrize(
    "config", [mtprobe.PlainConfig(), mtprobe.PromptLookupConfig()], ids=["plain", "prompt lookup"]
)
def test_greedy_on_the_codes_identical_to_generate(on_grid, config):
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 17, 33, 5, 9]])
    want = on_grid.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)
    out = mtprobe.generate(on_grid, ids, config, do_sample=False, max_new_tokens=40, eos_token_id=None)
    assert out.target_forward == nf.VERSION + nf.CODES
    assert torch.equal(out.sequences, want)


def test_off_the_grid_and_bfloat16_keep_no_codes():
    off = _build("llama")
    assert nf.native_forward(off).quantized_bytes == 0
    assert nf.describe(off) == nf.VERSION
    half = _on_grid(_build("llama")).to(
        torch.bfloat16
    )  # Q4_1 values rounded to bfloat16: not float32 weights
    assert nf.native_forward(half).quantized_bytes == 0


def test_the_switch(monkeypatch):
    model = _on_grid(_build("llama"))
    monkeypatch.setenv(wc.ENV, "0")
    assert wc.weight_codes(model, nf._linears(model)) == {}
    assert nf.native_forward(model).quantized_bytes == 0  # built with the switch off: none found
    monkeypatch.setenv(wc.ENV, "1")
    assert nf.native_forward(model).quantized_bytes == 0  # and none until it is built again
    mtprobe.release(model)
    assert nf.native_forward(model).quantized_bytes > 0
    monkeypatch.setenv(wc.ENV, "sometimes")
    with pytest.raises(ValueError, match="MTPROBE_NATIVE_CODES='sometimes': use 0"):
        nf.native_forward(model)


def test_bad_codes_are_named():
    model = _on_grid(_build("llama"))
    args, kwargs = nf.arguments(model)
    embed, layers, norm, head, inv_freq = args
    assert "q.codes" in layers[0] and kwargs["quantized_rows"] == wc.quantized_rows()
    cases = [
        ([layers[0] | {"q.codes": layers[0]["q.codes"][:, :16].contiguous()}, layers[1]], head, "layer 0 q.quantized is \\[64, 32\\] but the model needs \\[64, 64\\]"),
        ([layers[0] | {"up.scale": layers[0]["up.scale"].double()}, layers[1]], head, "layer 0 up.quantized.scale must be contiguous float32"),
        ([{k: v for k, v in layers[0].items() if k != "down.codes"}, layers[1]], head, "layer 0 has down.scale or down.min but no down.codes"),
        (layers, head | {"head.min": head["head.scale"]}, "head.quantized is Q8_0, which has no min"),
    ]  # fmt: skip
    for built, h, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.TargetForward(embed, built, norm, h, inv_freq, **kwargs)
    # A layer whose inputs do not split into groups of 32 (a hidden size of 48) cannot take codes.
    a48, k48 = nf.arguments(tiny_llama(hidden_size=48))
    odd = {"q.codes": torch.zeros(48, 24, dtype=torch.uint8), "q.scale": torch.zeros(48, 1), "q.min": torch.zeros(48, 1)}  # fmt: skip
    with pytest.raises(ValueError, match="layer 0 q.quantized has 48 inputs, not groups of 32"):
        _C.TargetForward(a48[0], [a48[1][0] | odd, a48[1][1]], *a48[2:], **k48)
    with pytest.raises(ValueError, match="quantized_rows must be >= 0"):
        _C.TargetForward(*args, **(kwargs | {"quantized_rows": -1}))
    half = (
        embed.bfloat16(),
        [{k: v if ".codes" in k or ".scale" in k or ".min" in k else v.bfloat16() for k, v in L.items()} for L in layers],
        norm.bfloat16(),
        {k: v if k != "head.weight" else v.bfloat16() for k, v in head.items()},
        inv_freq,
    )  # fmt: skip
    with pytest.raises(ValueError, match="which a float32 model's forward reads only; this one is bfloat16"):
        _C.TargetForward(*half, **kwargs)
