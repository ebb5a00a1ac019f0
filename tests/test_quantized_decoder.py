"""The quantized self-draft's C++ decoder step (csrc/decode/quantized_decoder.h) against HF's modules.

Its reference is the quantized twin itself run through HF's Llama modules (``HFAdapter`` over
``draft_model.quantized``): the step must give the same logits and write the same KV rows, up to
float32 rounding, at every position of a sequence. The output of generation stays the target's either
way (the target verifies every draft), which the end-to-end tests check token for token.
"""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_family, tiny_llama
from mtprobe.state import state_of
from mtprobe.target_model import self_draft as draft_model
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.self_draft import DECODER_ENV, quantized, quantized_decoder, why_no_decoder

# The step's logits against HF's, relative to the largest logit: float32's summation orders apart (1.03e-5
# seen at one of 40 positions on a grouped-query Llama, and on Mistral's window on an Intel Xeon family 6
# model 167; under 1e-5 elsewhere).
LOGIT_TOL = 2e-5


def _hf_and_decoder_steps(model, tokens: list[int], fmt: str = "q4_1") -> tuple[list[float], list[float]]:
    """Each token's logits and key row errors (relative to the largest entry), the decoder against HF's
    modules over the quantized twin (in ``fmt``)."""
    draft = quantized(model, None, fmt)
    decoder = quantized_decoder(draft)
    assert decoder is not None
    adapter = HFAdapter(draft, len(tokens), checked=True)
    logit_err, kv_err = [], []
    with torch.inference_mode():
        adapter.forward(torch.tensor(tokens[:1]), None, torch.tensor([[0]]), None, 0, False)  # allocates
        keys = [torch.zeros_like(layer.keys) for layer in adapter.cache.layers]
        values = [torch.zeros_like(layer.values) for layer in adapter.cache.layers]
        for p, token in enumerate(tokens):
            want, _ = adapter.forward(torch.tensor([token]), None, torch.tensor([[p]]), None, p, False)
            got = decoder.step(token, p, keys, values)  # [vocab]
            logit_err.append((got - want[0]).abs().max().item() / want.abs().max().item())
            kv_err.append(
                max(
                    (
                        (mine[0, :, p] - layer.keys[0, :, p]).abs().max() / layer.keys[0, :, p].abs().max()
                    ).item()
                    for mine, layer in zip(keys, adapter.cache.layers, strict=True)
                )
            )
    return logit_err, kv_err


@pytest.mark.parametrize(
    "overrides",
    [
        {},  # grouped-query attention: 4 heads over 2 key/value heads
        {"num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True},  # biases everywhere
        {"num_attention_heads": 2, "num_key_value_heads": 1, "rope_theta": 100.0},  # head_dim 32, fast turns
    ],
)
def test_step_matches_hf_modules_at_every_position(overrides):
    model = tiny_llama(seed=3, vocab_size=64, num_hidden_layers=3, **overrides)
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logit_err, kv_err = _hf_and_decoder_steps(model, tokens)
    assert max(logit_err) < LOGIT_TOL, logit_err
    assert max(kv_err) < 1e-5, kv_err


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "gemma3"])
def test_step_matches_hf_modules_on_the_other_llama_family_architectures(monkeypatch, name):
    # Mistral's layers are Llama's; Qwen2's q, k and v carry biases; Qwen3 norms each query and key head
    # before RoPE (head_dim 32 apart from hidden / heads); Gemma 3: its scaled embedding, norms of the outputs,
    # GELU, two RoPE bases and a window of 8 on its sliding layers, which the 40 positions outgrow. 8-bit and
    # 4-bit drafts alike.
    model = tiny_family(name, seed=3, vocab_size=64, num_hidden_layers=3)
    if name == "gemma3":  # opt-in (self_draft.OPT_IN_MODEL_TYPES)
        assert "gemma3_text's C++ step runs with MTPROBE_QUANTIZED_DECODER=1 only" in why_no_decoder(
            quantized(model)
        )
        monkeypatch.setenv(DECODER_ENV, "1")
    assert why_no_decoder(quantized(model)) == ""
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    for fmt in ("q4_1", "q8_0"):
        logit_err, kv_err = _hf_and_decoder_steps(model, tokens, fmt)
        assert max(logit_err) < LOGIT_TOL, (fmt, logit_err)
        assert max(kv_err) < 1e-5, (fmt, kv_err)


def test_a_sliding_window_is_applied_by_the_step():
    # Mistral's window of 8 on every layer, outgrown five times: the step attends to the last 8 rows only,
    # as HF's mask lets it.
    model = tiny_family("mistral", seed=3, vocab_size=64, sliding_window=8)
    assert why_no_decoder(quantized(model)) == ""
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    logit_err, kv_err = _hf_and_decoder_steps(model, tokens)
    assert max(logit_err) < LOGIT_TOL, logit_err
    assert max(kv_err) < 1e-5, kv_err


def test_step_matches_hf_modules_where_each_head_splits_into_ranges():
    # From 256 cached rows on, each key/value head's rows are split into ranges (up to two per thread)
    # attended apart and merged by their log-sum-exps; 520 positions on two threads reach four ranges.
    model = tiny_llama(seed=4, vocab_size=64, num_hidden_layers=2, max_position_embeddings=1024)
    tokens = torch.randint(0, 64, (520,), generator=torch.Generator().manual_seed(5)).tolist()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        logit_err, kv_err = _hf_and_decoder_steps(model, tokens)
    finally:
        torch.set_num_threads(threads)
    assert max(logit_err) < LOGIT_TOL, max(logit_err)
    assert max(kv_err) < 1e-5, max(kv_err)


def test_smollm2_step_matches_hf_modules(smollm2):
    model, _ = smollm2
    tokens = torch.randint(0, 49152, (12,), generator=torch.Generator().manual_seed(2)).tolist()
    logit_err, kv_err = _hf_and_decoder_steps(model, tokens)
    assert max(logit_err) < 1e-4, logit_err
    assert max(kv_err) < 1e-4, kv_err


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "gemma3"])
def test_generation_runs_its_drafts_through_the_decoder_and_stays_greedy(monkeypatch, name):
    kw = dict(seed=4, vocab_size=48, num_hidden_layers=3, eos_token_id=47)
    if name == "gemma3":  # Gemma's pad id (0) is drawn in the random prompts: make it the end's
        kw["pad_token_id"] = 47
        monkeypatch.setenv(DECODER_ENV, "1")  # opt-in (self_draft.OPT_IN_MODEL_TYPES)
    model = tiny_llama(**kw) if name == "llama" else tiny_family(name, **kw)
    draft = quantized(model)  # the twin generate takes (kept in the model's state)
    steps = []
    decoder = quantized_decoder(draft)

    class Counting:
        has_head_scan = decoder.has_head_scan

        def step(self, *args, **kw):
            steps.append(args[1])
            return decoder.step(*args, **kw)

    monkeypatch.setattr(state_of(draft), "decoder", Counting())
    monkeypatch.setattr(state_of(draft), "decoder_checked", True)
    hf_forwards = []
    handle = draft.register_forward_pre_hook(lambda *_: hf_forwards.append(1))
    try:
        cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
        for length in (1, 9, 30):
            prompt = torch.randint(0, 47, (1, length), generator=torch.Generator().manual_seed(length))
            ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
            out = mtprobe.generate(model, prompt, cfg, max_new_tokens=24)
            assert torch.equal(out.sequences, ref), length
    finally:
        handle.remove()
    assert len(steps) > 3 * 4  # every one-token draft forward after the copied prompt
    assert not hf_forwards  # none through HF's modules: the prompt's entries are the target's, copied


def test_a_quantized_draft_of_the_first_layers_prefills_through_hf_then_steps_in_cpp():
    # Fewer layers than the target: the draft cannot take the target's entries, so it runs the prompt
    # through HF's modules (its float32 weights), then its one-token forwards through the decoder.
    model = tiny_llama(seed=9, vocab_size=48, num_hidden_layers=3, eos_token_id=47)
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_draft_layers=2, num_tokens=4)
    draft = quantized(model, 2)
    assert quantized_decoder(draft).num_layers == 2
    seen = []
    handle = draft.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    try:
        for length in (1, 12):
            prompt = torch.randint(0, 47, (1, length), generator=torch.Generator().manual_seed(length))
            ref = model.generate(prompt, do_sample=False, max_new_tokens=20)
            assert torch.equal(mtprobe.generate(model, prompt, cfg, max_new_tokens=20).sequences, ref), length
    finally:
        handle.remove()
    assert seen == [1, 12]  # each generation's first draft forward only


def test_other_architectures_and_the_switch_keep_hf_modules(monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=64, n_layer=1, n_head=4)).eval()
    assert (
        "model_type 'gpt2' is not one of ('llama', 'mistral', 'qwen2', 'qwen3', 'gemma3_text')"
        in why_no_decoder(gpt2)
    )
    model = tiny_llama(seed=6)
    assert "not every linear layer is quantized" in why_no_decoder(model)
    monkeypatch.setenv(DECODER_ENV, "0")
    assert why_no_decoder(quantized(model)) == f"{DECODER_ENV}=0"


def test_a_decoder_that_disagrees_with_hf_is_not_used():
    model = tiny_llama(seed=7, vocab_size=64)
    draft = quantized(model)
    assert draft_model._check_decoder(draft, draft_model._build_decoder(draft)) == ""
    args, kw = draft_model.decoder_arguments(draft)
    assert kw["scale"] == 0.25  # head_dim^-0.5
    wrong = draft_model._C.QuantizedDecoder(*args, **{**kw, "scale": 1.0})
    assert "differs from HF's forward" in draft_model._check_decoder(draft, wrong)


def test_bad_input_is_refused_with_what_is_wrong():
    model = tiny_llama(seed=8, vocab_size=64)
    draft = quantized(model)
    decoder = quantized_decoder(draft)
    keys = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    values = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    with pytest.raises(ValueError, match=r"token 64 is outside the vocabulary \[0, 64\)"):
        decoder.step(64, 0, keys, values)
    with pytest.raises(ValueError, match="position 8 does not fit a cache of capacity 8"):
        decoder.step(1, 8, keys, values)
    with pytest.raises(ValueError, match=r"keys must hold one buffer per layer \(2\), got 1"):
        decoder.step(1, 0, keys[:1], values)
    with pytest.raises(ValueError, match=r"must be float32 CPU \[1, 2, capacity, 16\]"):
        decoder.step(1, 0, [k.double() for k in keys], values)
    (embed, layers, final_norm, head, inv_freq), kw = draft_model.decoder_arguments(draft)
    with pytest.raises(ValueError, match=r"heads \(4\) must be a positive multiple of kv_heads \(3\)"):
        draft_model._C.QuantizedDecoder(embed, layers, final_norm, head, inv_freq, **{**kw, "kv_heads": 3})
    with pytest.raises(ValueError, match="layer 1 has no 'up.codes' tensor"):
        broken = [layers[0], {k: v for k, v in layers[1].items() if not k.startswith("up.")}]
        draft_model._C.QuantizedDecoder(embed, broken, final_norm, head, inv_freq, **kw)
    with pytest.raises(ValueError, match=r"layer 0 down is \[64, 64\] but the model needs \[64, 128\]"):
        swapped = [
            {**layers[0], **{k.replace("o.", "down."): v for k, v in layers[0].items() if k.startswith("o.")}}
        ]
        draft_model._C.QuantizedDecoder(embed, swapped + layers[1:], final_norm, head, inv_freq, **kw)
    with pytest.raises(ValueError, match=r"inv_freq must be a contiguous float32 CPU tensor \[8\]"):
        draft_model._C.QuantizedDecoder(embed, layers, final_norm, head, inv_freq[:4].clone(), **kw)


@pytest.mark.parametrize("format", ["q4_1", "q8_0"])
def test_step_rows_is_step_for_each_row(format):
    """Rows of different sequences at different positions (one past 128, whose heads split into ranges)
    step together as each would alone, and each writes only its own cache."""
    model = tiny_llama(seed=9, vocab_size=64)
    decoder = quantized_decoder(quantized(model, format=format))
    gen = torch.Generator().manual_seed(0)
    lengths = [1, 5, 140]
    caches = [
        (
            [torch.randn(1, 2, 160, 16, generator=gen) for _ in range(2)],
            [torch.randn(1, 2, 160, 16, generator=gen) for _ in range(2)],
        )
        for _ in lengths
    ]
    alone = [([k.clone() for k in ks], [v.clone() for v in vs]) for ks, vs in caches]
    tokens = [3, 17, 42]
    positions = [n - 1 for n in lengths]
    want = torch.stack(
        [decoder.step(t, p, ks, vs) for t, p, (ks, vs) in zip(tokens, positions, alone, strict=True)]
    )
    got = decoder.step_rows(tokens, positions, [ks for ks, _ in caches], [vs for _, vs in caches])
    assert got.shape == (3, 64)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (ks, vs), (ka, va) in zip(caches, alone, strict=True):
        for a, b in zip(ks + vs, ka + va, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_step_rows_refuses_rows_that_do_not_line_up():
    model = tiny_llama(seed=8, vocab_size=64)
    decoder = quantized_decoder(quantized(model))
    keys = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    values = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    with pytest.raises(
        ValueError, match="one token, position, keys and values per row; got 2 tokens, 1 positions"
    ):
        decoder.step_rows([1, 2], [0], [keys], [values])
    with pytest.raises(ValueError, match="rows 0 and 1 share a cache"):
        decoder.step_rows([1, 2], [0, 0], [keys, keys], [values, values])
    with pytest.raises(ValueError, match=r"row 1's token 64 is outside the vocabulary"):
        decoder.step_rows(
            [1, 64], [0, 0], [keys, [k.clone() for k in keys]], [values, [v.clone() for v in values]]
        )


def test_int8_activations_run_when_asked_and_generation_stays_greedy(monkeypatch):
    """``MTPROBE_DRAFT_ACTIVATIONS=int8``: the step on int8 activations (core::quantized_linear_int8) stays
    within the activations' rounding of HF's modules, and generation with it stays greedy; another value
    is refused with the choices."""
    model = tiny_llama(seed=5, vocab_size=64, num_hidden_layers=3)
    monkeypatch.setenv(draft_model.ACTIVATIONS_ENV, "int8")
    tokens = torch.randint(0, 64, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    for fmt in ("q4_1", "q8_0"):
        draft = quantized(model, None, fmt)
        assert quantized_decoder(draft).int8_activations
        logit_err, _ = _hf_and_decoder_steps(model, tokens, fmt)
        assert 1e-5 < max(logit_err) < 0.25, logit_err  # not float32's rounding, within the check's bound
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    prompt = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(9))
    ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
    assert torch.equal(mtprobe.generate(model, prompt, cfg, max_new_tokens=24).sequences, ref)
    monkeypatch.setenv(draft_model.ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match=r"MTPROBE_DRAFT_ACTIVATIONS='int4'.*'int8', 'float32'"):
        draft_model.draft_activations()
    monkeypatch.delenv(draft_model.ACTIVATIONS_ENV)
    assert draft_model.draft_activations() == "float32"


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_draft_vocabulary_computes_its_rows_and_no_other(monkeypatch, fmt, activations):
    """``head_rows``/``extra_rows``: those rows' logits are the whole head's, bit for bit (the same kernel on
    the same columns); every other logit is -inf; step_rows takes them for every row."""
    monkeypatch.setenv(draft_model.ACTIVATIONS_ENV, activations)
    model = tiny_llama(seed=6, vocab_size=200)
    decoder = quantized_decoder(quantized(model, None, fmt))
    keys = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    values = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    full = decoder.step(3, 0, keys, values)  # [200]
    extra = [150, 71, 199, 5]  # unsorted, one below head_rows: computed once all the same
    sub = decoder.step(3, 0, keys, values, head_rows=70, extra_rows=extra)
    kept = torch.zeros(200, dtype=torch.bool)
    kept[:70] = True
    kept[extra] = True
    assert torch.equal(sub[kept], full[kept])
    assert torch.isneginf(sub[~kept]).all() and (~kept).sum() == 200 - 73
    other = ([k.clone() for k in keys], [v.clone() for v in values])
    rows = decoder.step_rows(
        [3, 3], [0, 0], [keys, other[0]], [values, other[1]], head_rows=70, extra_rows=extra
    )
    assert torch.equal(rows[0], sub) and torch.equal(rows[1], sub)
    assert torch.equal(decoder.step(3, 0, keys, values, head_rows=200), full)  # all of them: the whole head
    with pytest.raises(ValueError, match=r"head_rows must be in \[0, 200\] \(0: the whole head\), got 201"):
        decoder.step(3, 0, keys, values, head_rows=201)
    with pytest.raises(ValueError, match=r"head_rows must be in \[0, 200\]"):
        decoder.step(3, 0, keys, values, head_rows=-1)
    with pytest.raises(ValueError, match=r"extra_rows holds 200, outside the vocabulary \[0, 200\)"):
        decoder.step(3, 0, keys, values, head_rows=70, extra_rows=[5, 200])


def test_generation_drafts_from_its_vocabulary_and_the_sequence_tokens(monkeypatch):
    """``MTPROBE_DRAFT_VOCAB``: every C++ step computes that many rows and every token the sequence holds
    past them (the prompt's first among them); the output stays HF greedy's. Unset or 0 it is the whole head;
    anything but a whole number a ValueError."""
    model = tiny_llama(seed=4, vocab_size=48, num_hidden_layers=3, eos_token_id=47)
    draft = quantized(model)
    decoder = quantized_decoder(draft)
    calls = []

    class Recording:
        has_head_scan = decoder.has_head_scan

        def step(self, token, position, keys, values, **kw):
            calls.append({**kw, "extra_rows": list(kw["extra_rows"])})  # as it was at this step
            return decoder.step(token, position, keys, values, **kw)

    monkeypatch.setattr(state_of(draft), "decoder", Recording())
    monkeypatch.setattr(state_of(draft), "decoder_checked", True)
    monkeypatch.setenv(draft_model.VOCAB_ENV, "8")
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    prompt = torch.tensor([[3, 30, 5, 12, 30, 7, 41]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
    out = mtprobe.generate(model, prompt, cfg, max_new_tokens=24)
    assert torch.equal(out.sequences, ref)
    assert calls and all(kw["head_rows"] == 8 for kw in calls)
    first, last = calls[0]["extra_rows"], calls[-1]["extra_rows"]
    assert first == [12, 30, 41]  # the prompt's tokens past the first 8 rows, sorted, once each
    assert last == sorted(set(last))
    # Grown by the answer's tokens as they came, and by no token outside the sequence.
    assert len(last) > len(first) and set(last) <= {t for t in ref[0].tolist() if t >= 8}

    assert draft_model.draft_vocab(48) == 8
    monkeypatch.delenv(draft_model.VOCAB_ENV)
    assert draft_model.draft_vocab(48) == 0  # the whole head
    for value, rows in (("0", 0), ("48", 0), ("100", 0), (" 12 ", 12)):
        monkeypatch.setenv(draft_model.VOCAB_ENV, value)
        assert draft_model.draft_vocab(48) == rows, value
    for value in ("-1", "half", "0.5"):
        monkeypatch.setenv(draft_model.VOCAB_ENV, value)
        with pytest.raises(
            ValueError, match=r"MTPROBE_DRAFT_VOCAB=.*a whole number >= 0 \(0 or unset: the whole head\)"
        ):
            draft_model.draft_vocab(48)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("activations", ["float32", "int8"])
def test_a_head_scan_computes_its_best_rows_as_the_whole_head(monkeypatch, fmt, activations):
    """``head_scan``: the 4-bit scan head ranks, its best rows are then the 8-bit head's, bit for bit (the same
    kernel on the same columns); the draft's best two tokens are the whole head's; with a draft vocabulary the
    scan covers its rows and the extra rows are the head's; step_rows the same for every row."""
    monkeypatch.setenv(draft_model.ACTIVATIONS_ENV, activations)
    model = tiny_llama(seed=6, vocab_size=200)
    decoder = quantized_decoder(quantized(model, None, fmt))
    assert decoder.has_head_scan  # a quantized twin's head is in 8 bits
    keys = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    values = [torch.zeros(1, 2, 8, 16) for _ in range(2)]
    for position, token in enumerate([3, 17, 42, 199]):
        full = decoder.step(token, position, keys, values)  # [200]
        scanned = decoder.step(token, position, keys, values, head_scan=16)
        same = scanned == full
        # Its 16 rows (and hardly another: the rest are the 4-bit head's values) match, its best two among them.
        assert 16 <= int(same.sum()) < 200
        top = full.topk(2).indices
        assert torch.equal(scanned.topk(2).indices, top) and bool(same[top].all())
        assert torch.equal(decoder.step(token, position, keys, values, head_scan=200), full)  # no scan
    extra = [150, 71, 199, 5]
    sub = decoder.step(3, 0, keys, values, head_rows=70, extra_rows=extra)
    scanned = decoder.step(3, 0, keys, values, head_rows=70, extra_rows=extra, head_scan=8)
    assert torch.isneginf(scanned[[i for i in range(70, 200) if i not in extra]]).all()
    assert torch.equal(scanned[[150, 71, 199]], sub[[150, 71, 199]])
    assert scanned.argmax() == sub.argmax() and scanned.max() == sub.max()
    other = ([k.clone() for k in keys], [v.clone() for v in values])
    rows = decoder.step_rows(
        [3, 3], [0, 0], [keys, other[0]], [values, other[1]], head_rows=70, extra_rows=extra, head_scan=8
    )
    assert torch.equal(rows[0], scanned) and torch.equal(rows[1], scanned)
    with pytest.raises(ValueError, match=r"head_scan must be >= 0 \(0: the whole 8-bit head\), got -1"):
        decoder.step(3, 0, keys, values, head_scan=-1)


def test_a_head_scan_needs_a_4_bit_scan_head():
    """A decoder built without one (or given one in the wrong format or shape) says so."""
    model = tiny_llama(seed=7, vocab_size=64)
    draft = quantized(model)
    args, kw = draft_model.decoder_arguments(draft)
    bare = draft_model._C.QuantizedDecoder(*args, **kw)
    assert not bare.has_head_scan
    keys = [torch.zeros(1, 2, 4, 16) for _ in range(2)]
    values = [torch.zeros(1, 2, 4, 16) for _ in range(2)]
    with pytest.raises(
        ValueError, match=r"head_scan=4 needs a 4-bit scan head \(set_head_scan\).*head_scan=0"
    ):
        bare.step(1, 0, keys, values, head_scan=4)
    head = draft.get_output_embeddings()
    eight = {"scan.codes": head.codes, "scan.scale": head.scale}
    with pytest.raises(ValueError, match=r"the scan head must be Q4_1 codes"):
        bare.set_head_scan(eight)
    q = draft_model.quantized_linear.quantize(head.weight[:32], "q4_1")
    with pytest.raises(ValueError, match=r"head_scan"):
        bare.set_head_scan({"scan.codes": q.codes, "scan.scale": q.scale, "scan.min": q.min})
    q = draft_model.quantized_linear.quantize(head.weight, "q4_1")
    bare.set_head_scan({"scan.codes": q.codes, "scan.scale": q.scale, "scan.min": q.min})
    assert bare.has_head_scan and bare.step(1, 0, keys, values, head_scan=4).shape == (64,)


def test_generation_scans_the_head_as_configured(monkeypatch):
    """``MTPROBE_DRAFT_HEAD_SCAN``: the C++ steps of a generation pass its value (16 unset; 0 the whole head),
    and the output stays HF greedy's either way; anything but a whole number >= 0 is a ValueError."""
    model = tiny_llama(seed=4, vocab_size=48, num_hidden_layers=3, eos_token_id=47)
    draft = quantized(model)
    decoder = quantized_decoder(draft)
    scans = []

    class Recording:
        has_head_scan = True

        def step(self, token, position, keys, values, **kw):
            scans.append(kw["head_scan"])
            return decoder.step(token, position, keys, values, **kw)

    monkeypatch.setattr(state_of(draft), "decoder", Recording())
    monkeypatch.setattr(state_of(draft), "decoder_checked", True)
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    prompt = torch.tensor([[3, 30, 5, 12, 30, 7, 41]])
    ref = model.generate(prompt, do_sample=False, max_new_tokens=24)
    for value, want in ((None, draft_model.SCAN_TOP), ("0", 0), (" 4 ", 4)):
        if value is None:
            monkeypatch.delenv(draft_model.SCAN_ENV, raising=False)
        else:
            monkeypatch.setenv(draft_model.SCAN_ENV, value)
        scans.clear()
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=24)
        assert torch.equal(out.sequences, ref)
        assert scans and set(scans) == {want}, value
    for value in ("-1", "all", "0.5"):
        monkeypatch.setenv(draft_model.SCAN_ENV, value)
        with pytest.raises(ValueError, match=r"MTPROBE_DRAFT_HEAD_SCAN=.*a whole number >= 0 \(0: the whole"):
            draft_model.draft_head_scan()
