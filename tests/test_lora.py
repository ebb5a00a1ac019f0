"""LoRA draft layers of circuit heads (python/mtprobe/heads/lora.py): an untrained adapter is the backbone's
own last layers, the draft's cache follows the committed tokens step by step, the backbone is never
trained, and decoding with trained adapters is token-identical to greedy."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe import cli, heads
from mtprobe.heads.lora import DraftLayers, LoraLinear
from mtprobe.offline import heads as offline_heads
from mtprobe.offline.calibration_data import calibration_sequences
from test_heads import _prompts


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(seed=7, num_hidden_layers=3)  # three layers: LoRA on one, two or all of them
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


@pytest.fixture(scope="module")
def sequences(model) -> list[tuple[torch.Tensor, int]]:
    return [(ids, plen - 1) for ids, plen in calibration_sequences(model, _prompts(8), max_new_tokens=40)]


def _spec(model, **kw) -> heads.HeadSpec:
    kw = {"circuit": "cp", "window": 4, "rank": 3, **kw}
    return heads.HeadSpec(hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, **kw)


@pytest.fixture(scope="module")
def base_head(model, sequences, tmp_path_factory) -> str:
    """A CP head without LoRA, trained briefly on the model's own greedy text."""
    torch.manual_seed(0)
    head = heads.new_head(model, _spec(model))
    stats = offline_heads.train_head(
        head, offline_heads.compute_features(model, sequences), steps=150, lr=3e-3
    )
    folder = tmp_path_factory.mktemp("cp")
    heads.save_head(head, model, folder, stats)
    return str(folder)


@pytest.fixture(scope="module")
def lora_heads(model, sequences, base_head, tmp_path_factory) -> dict[int | str, str]:
    """Per k in (1, 2): the base head continued with LoRA on the last k layers, as the paper does
    (emissions on the target's logits); "draft": k = 1 with emissions on the draft's own E h."""
    out = {}
    for k in (1, 2, "draft"):
        torch.manual_seed(1 if k == "draft" else k)
        layers, base = (1, "draft") if k == "draft" else (k, "target")
        head = heads.new_head(model, _spec(model, lora_layers=layers, lora_rank=4, lora_base=base))
        offline_heads.init_from(head, heads.load_head(base_head, model))
        feats = offline_heads.compute_features(model, sequences, layer=head.hidden_layer)
        stats = offline_heads.train_head(head, feats, steps=30, batch_size=16, lr=3e-4)
        folder = tmp_path_factory.mktemp(f"lora{k}")
        heads.save_head(head, model, folder, stats)
        out[k] = str(folder)
    return out


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_untrained_adapters_are_the_backbone_in_any_chunking(k, dtype):
    # B = 0: the draft's layers reproduce the backbone's last state, whether they see the sequence at
    # once or in prefill-then-steps chunks through their own cache.
    from transformers import DynamicCache

    model = tiny_llama(seed=k, num_hidden_layers=3).to(dtype)
    draft = DraftLayers(model, num_layers=k, rank=4)
    ids = torch.randint(0, 96, (1, 11))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        x = out.hidden_states[draft.first]  # [1, 11, d]
        whole = draft(x, torch.arange(11)[None])
        cache = DynamicCache()
        chunks = [draft(x[:, a:b], torch.arange(a, b)[None], cache) for a, b in ((0, 6), (6, 7), (7, 11))]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(whole, out.hidden_states[-1], rtol=tol, atol=tol)
    torch.testing.assert_close(torch.cat(chunks, 1), out.hidden_states[-1], rtol=tol, atol=tol)
    assert cache.get_seq_length() == 11


def test_zero_adapters_draft_what_the_base_head_drafts(model, base_head, tmp_path):
    # The whole decode path (the adapter's hidden layer, the committed rows, the positions, the cache)
    # against the head without LoRA: with B = 0 every step's draft, hence every accept length, agrees.
    head = heads.new_head(model, _spec(model, lora_layers=2, lora_rank=4))
    offline_heads.init_from(head, heads.load_head(base_head, model))
    heads.save_head(head, model, tmp_path, {})
    for prompt in _prompts(3):
        a = mtprobe.generate(
            model, prompt, mtprobe.HeadsConfig(path=base_head, block_complexity=9), max_new_tokens=30
        )
        b = mtprobe.generate(
            model, prompt, mtprobe.HeadsConfig(path=str(tmp_path), block_complexity=9), max_new_tokens=30
        )
        assert torch.equal(a.sequences, b.sequences)
        assert a.accept_lengths == b.accept_lengths
        assert sum(a.accept_lengths) > 1.2 * len(a.accept_lengths)  # drafts were accepted


@pytest.mark.parametrize("k", [1, 2, "draft"])
def test_greedy_is_token_identical_with_trained_adapters(model, lora_heads, k):
    head = heads.load_head(lora_heads[k], model)
    layers = 1 if k == "draft" else k
    assert head.spec.lora_layers == layers and head.hidden_layer == 3 - layers
    assert head.target_base == (k != "draft")
    assert any(float(p.detach().abs().max()) > 0 for n, p in head.named_parameters() if n.endswith("lora_b"))
    calls, new = 0, 0
    for bc in (2, 5, 30):
        cfg = mtprobe.HeadsConfig(path=lora_heads[k], block_complexity=bc)
        for prompt in _prompts(3):  # prompts the heads were trained on: their drafts are accepted
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30
            )
            out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
            assert torch.equal(out.sequences, ref), (k, bc, prompt.tolist())
            calls, new = calls + out.forward_calls, new + 30
    assert calls < 0.9 * new, (calls, new)


def test_a_lora_head_inside_the_scheduler(model, lora_heads, base_head):
    # The other drafters read no hidden states, so they do not stop the forward from returning the
    # draft layers' input (they did: "different hidden states ([-1, 2])"); two heads that read
    # different layers still cannot share one forward.
    flat = mtprobe.ForwardProfile(
        mtprobe.target_model.profile.ProfileKey.of(model), (1, 64), (0,), ((1.0, 1.0),)
    )
    head = mtprobe.HeadsConfig(path=lora_heads[1], block_complexity=8)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=4), mtprobe.StandConfig(block_complexity=6), head),
        profile=flat,
    )
    prompt = _prompts(1)[0]
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30)
    out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert any(method == "heads" for method, _ in out.choices)
    both = mtprobe.AutoConfig(drafters=(head, mtprobe.HeadsConfig(path=base_head)), profile=flat)
    with pytest.raises(ValueError, match=r"read different hidden states \(\[-1, 2\]"):
        mtprobe.generate(model, prompt, both, max_new_tokens=4)


def test_training_leaves_the_backbone_alone(model, sequences, base_head):
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    head = heads.new_head(model, _spec(model, lora_layers=1, lora_rank=4))
    offline_heads.init_from(head, heads.load_head(base_head, model))
    feats = offline_heads.compute_features(model, sequences, layer=head.hidden_layer)
    stats = offline_heads.train_head(head, feats, steps=5, batch_size=8, lr=1e-2)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert stats["steps"] == 150 + 5  # continued from the base head's 150
    # The adapters moved; the draft's copies of the norms did not.
    assert float(head.draft.layers[0].mlp.down_proj.lora_b.detach().abs().max()) > 0
    torch.testing.assert_close(head.draft.norm.weight, model.model.norm.weight)


def test_the_step_builds_on_the_logits_its_spec_names(model, lora_heads):
    # lora_base="target": the emissions are the target's logits plus the adapters' term, so a shift
    # of the logits shifts nothing after log_softmax, and other logits change the draft; "draft": the
    # logits passed are ignored (E h of the draft's state instead).
    x = torch.randn(5, model.config.hidden_size)
    logits = torch.randn(model.config.vocab_size)
    for k, follows in ((1, True), ("draft", False)):
        head = heads.load_head(lora_heads[k], model)
        a = head.step_fn()(x, logits, 0)[2]
        b = head.step_fn()(x, logits + 3.0, 0)[2]
        c = head.step_fn()(x, 2 * logits, 0)[2]
        torch.testing.assert_close(a, b)
        assert (not torch.allclose(a, c)) == follows, k


def test_lora_heads_from_before_lora_base_load_as_draft(model, lora_heads, tmp_path):
    # A checkpoint whose spec has no lora_base was trained on the draft's own E h: it must load so.
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    src = heads.checkpoint_path(lora_heads["draft"])
    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
        state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    spec = json.loads(meta["spec"])
    del spec["lora_base"]
    meta["spec"] = json.dumps(spec)
    save_file(state, str(tmp_path / "head.safetensors"), metadata=meta)
    assert heads.load_head(tmp_path, model).spec.lora_base == "draft"
    assert heads.load_head(lora_heads[1], model).spec.lora_base == "target"


def test_checkpoint_round_trip(model, lora_heads):
    head = heads.load_head(lora_heads[1], model)
    again = heads.load_head(lora_heads[1], model)
    x = torch.randn(1, 6, model.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(
            head.draft(x, torch.arange(6)[None]), again.draft(x, torch.arange(6)[None])
        )
    saved = {k for k in head.state_dict() if k.startswith("draft.")}
    assert saved and all("lora_" in k or "norm" in k for k in saved)  # never the backbone's linear weights


def test_the_folded_draft_is_the_draft(model, lora_heads):
    # merged(): one linear map W + s B A per adapter, the same function up to rounding, whether it
    # sees the sequence at once or through its cache; in bfloat16 up to bfloat16's rounding.
    from transformers import DynamicCache

    from tolerances import tolerance

    head = heads.load_head(lora_heads[2], model)
    draft = head.draft
    assert any(float(p.detach().abs().max()) > 0 for n, p in draft.named_parameters() if "lora_b" in n)
    x = torch.randn(1, 9, model.config.hidden_size)  # [1, T, d]
    pos = torch.arange(9)[None]
    backbone = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        want = draft(x, pos)
        for dtype in (None, torch.bfloat16):
            folded = draft.merged(dtype)
            assert not any(isinstance(m, LoraLinear) for m in folded.modules())
            assert not any(p.requires_grad for p in folded.parameters())
            cache = DynamicCache()
            chunks = torch.cat(
                [folded(x[:, a:b], pos[:, a:b], cache) for a, b in ((0, 5), (5, 6), (6, 9))], 1
            )
            whole = folded(x, pos)
            assert whole.dtype == (dtype or torch.float32) and cache.get_seq_length() == 9
            tol = tolerance(dtype or torch.float32)
            # Rounding of the folded weights and of every layer's output in dtype: a few ulps per layer.
            scale = 1.0 if dtype is None else 4.0
            torch.testing.assert_close(
                whole.float(), want, atol=scale * tol["atol"], rtol=scale * tol["rtol"]
            )
            # Blocks of 5, 1 and 3 rows may take other matmul kernels than the 9 rows at once (other
            # accumulation orders): in bfloat16 a 1-ulp difference in one layer's output carries on.
            torch.testing.assert_close(chunks, whole, atol=scale * tol["atol"], rtol=scale * tol["rtol"])
            # Its weights are its own: changing them leaves the backbone and the trained draft alone.
            folded.layers[0].mlp.up_proj.weight.add_(1.0)
            torch.testing.assert_close(draft(x, pos), want, atol=0, rtol=0)
    assert all(torch.equal(p, backbone[n]) for n, p in model.named_parameters())


def test_the_inference_draft_follows_training(model, lora_heads):
    # The folded copy is cached on the head, and rebuilt once an adapter changes (a training step).
    head = heads.load_head(lora_heads[1], model)
    first = head.inference_draft()
    assert head.inference_draft() is first and head.inference_draft(torch.bfloat16) is not first
    x = torch.randn(1, 3, model.config.hidden_size)
    with torch.no_grad():
        before = first(x, torch.arange(3)[None])
        head.draft.layers[0].mlp.down_proj.lora_b.mul_(2.0)
        again = head.inference_draft()
        assert again is not first
        assert not torch.allclose(again(x, torch.arange(3)[None]), before)
        torch.testing.assert_close(again(x, torch.arange(3)[None]), head.draft(x, torch.arange(3)[None]))
    with pytest.raises(ValueError, match="no LoRA draft layers"):
        heads.new_head(model, _spec(model)).inference_draft()


@pytest.mark.parametrize("head_dtype", ["bfloat16", "float16"])
def test_greedy_is_token_identical_with_a_half_precision_draft(model, lora_heads, head_dtype):
    # A half-precision head drafts slightly different tokens at most; the output never differs.
    for k in (1, "draft"):
        cfg = mtprobe.HeadsConfig(path=lora_heads[k], block_complexity=6, head_dtype=head_dtype)
        calls, new = 0, 0
        for prompt in _prompts(3):
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30
            )
            out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
            assert torch.equal(out.sequences, ref), (k, head_dtype, prompt.tolist())
            calls, new = calls + out.forward_calls, new + 30
        assert calls < 0.9 * new, (k, calls, new)  # its drafts are still accepted


def test_command_line(tmp_path, capsys, base_head):
    from mtprobe import models
    from test_cli import _save_tiny

    folder = _save_tiny(tmp_path / "tiny")
    model, _ = models.load(folder)
    base, out = tmp_path / "base", tmp_path / "lora"
    common = [
        "heads",
        "train",
        "--model",
        str(folder),
        "--num-prompts",
        "4",
        "--max-new-tokens",
        "16",
        "--steps",
        "10",
    ]
    spec = ["--circuit", "cp", "--rank", "2", "--window", "3"]
    feats = tmp_path / "features.pt"
    assert cli.main([*common, *spec, "--out", str(base), "--features", str(feats)]) == 0
    argv = [
        *common,
        *spec,
        "--out",
        str(out),
        "--features",
        str(feats),
        "--lora-layers",
        "1",
        "--init",
        str(base),
    ]
    assert cli.main(argv) == 0  # cached features of the last layer, recomputed for the draft's input
    head = heads.load_head(out, model)
    assert (head.spec.lora_layers, int(head.trained_steps), head.stats["data"]["init"]) == (1, 20, "base")
    capsys.readouterr()
    for bad, match in (
        (["--lora-layers", "-1"], "lora_layers=-1 must be >= 0"),
        (["--lora-layers", "1", "--lora-rank", "0"], "lora_rank=0 must be >= 1"),
        (["--lora-layers", "9"], "exceeds the model's 2 layers"),
        (["--init", str(tmp_path / "nothing")], "no circuit-head checkpoint"),
    ):
        rc = cli.main([*common, *spec, "--out", str(tmp_path / "x"), *bad])
        assert rc == cli.EXIT_USAGE and match in capsys.readouterr().err, bad
    other_window = ["--circuit", "cp", "--rank", "2", "--window", "4"]
    assert (
        cli.main([*common, *other_window, "--out", str(tmp_path / "x"), "--init", str(base)])
        == cli.EXIT_USAGE
    )
    assert "differs in window" in capsys.readouterr().err


def test_bad_input(model, sequences, base_head):
    with pytest.raises(ValueError, match="between 1 and the model's 3 layers"):
        heads.new_head(model, _spec(model, lora_layers=4))
    with pytest.raises(ValueError, match="lora_rank=0"):
        _spec(model, lora_layers=1, lora_rank=0)
    with pytest.raises(ValueError, match="lora_base='both': expected one of target, draft"):
        _spec(model, lora_layers=1, lora_base="both")
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=2))
    with pytest.raises(ValueError, match="Llama-style decoder"):
        DraftLayers(gpt2, num_layers=1, rank=4)
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, MistralConfig, MistralForCausalLM

    small = dict(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2
    )
    gemma3 = Gemma3ForCausalLM(Gemma3TextConfig(**small, num_key_value_heads=1, head_dim=16))
    with pytest.raises(ValueError, match="one rotary embedding"):  # per-layer-type rotary embeddings
        DraftLayers(gemma3, num_layers=1, rank=4)
    mistral = MistralForCausalLM(MistralConfig(**small, num_key_value_heads=1, sliding_window=4))
    with pytest.raises(ValueError, match="sliding window"):
        DraftLayers(mistral, num_layers=1, rank=4)
    head = heads.new_head(model, _spec(model, lora_layers=1))
    with pytest.raises(ValueError, match=r"hidden_states\[-1\]"):  # features of the wrong layer
        offline_heads.train_head(head, offline_heads.compute_features(model, sequences[:2]), steps=1)
    feats = offline_heads.compute_features(model, sequences[:2], layer=head.hidden_layer)
    with pytest.raises(ValueError, match="hold no last hidden state"):  # features from before `last`
        offline_heads.train_head(head, offline_heads.Features(**{**vars(feats), "last": None}), steps=1)
    step = head.step_fn()
    x, logits = torch.randn(4, model.config.hidden_size), torch.randn(model.config.vocab_size)
    step(x, logits, 0)
    with pytest.raises(RuntimeError, match="holds 4 tokens, the step starts at 6"):
        step(x[:1], logits, 6)
