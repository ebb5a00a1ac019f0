"""Probabilistic-circuit heads (python/mtprobe/heads.py, csrc/drafters/heads.h): the training loss is the
circuit's exact prefix marginals, heads are normalised by construction, checkpoints belong to one
backbone, and decoding with a trained head of every circuit is token-identical to greedy."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import cli, heads
from mtprobe.offline import heads as offline_heads
from mtprobe.offline.calibration_data import calibration_sequences
from mtprobe.ops import circuit_prefix_log_marginals
from tolerances import dtype_id

KINDS = ("ff", "cp", "hmm", "btree")


def _spec(kind: str, model, **kw) -> heads.HeadSpec:
    kw = {"window": 4, "rank": 1 if kind == "ff" else 3, **kw}
    return heads.HeadSpec(
        circuit=kind, hidden_size=model.config.hidden_size, vocab_size=model.config.vocab_size, **kw
    )


@pytest.fixture(scope="module")
def model():
    m = tiny_llama(seed=5)
    m.generation_config.eos_token_id = None
    m.generation_config.pad_token_id = 0
    return m


def _prompts(n: int, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (1, 5 + i % 4), generator=g) for i in range(n)]


@pytest.fixture(scope="module")
def features(model) -> offline_heads.Features:
    seqs = calibration_sequences(model, _prompts(8), max_new_tokens=40)
    return offline_heads.compute_features(model, [(ids, plen - 1) for ids, plen in seqs])


@pytest.fixture(scope="module")
def trained(model, features, tmp_path_factory) -> dict[tuple[str, str], str]:
    """A checkpoint folder per (circuit, emission), trained briefly on the model's own greedy text."""
    out = {}
    for kind, emission in itertools.product(KINDS, heads.EMISSIONS):
        torch.manual_seed(0)
        head = heads.new_head(model, _spec(kind, model, emission=emission, adapter_rank=8))
        stats = offline_heads.train_head(head, features, steps=150, batch_size=32, lr=3e-3)
        folder = tmp_path_factory.mktemp(f"{kind}-{emission}")
        heads.save_head(head, model, folder, stats)
        out[kind, emission] = str(folder)
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [2, 3, 5, 6])
def test_window_marginals_are_the_circuit_ops(kind, n):
    # The differentiable training pass against the C++ core's one-pass prefix marginals.
    torch.manual_seed(n)
    b, r, v = 5, 1 if kind == "ff" else 3, 7
    num_latents = len(heads.latent_tree(kind, n)[0])
    params = heads.CircuitParams(
        kind,
        None if kind == "ff" else torch.randn(b, r, dtype=torch.float64).log_softmax(-1),
        torch.randn(b, num_latents - 1, r, r, dtype=torch.float64).log_softmax(-1)
        if kind in ("hmm", "btree")
        else None,
        torch.randn(b, n, r, v, dtype=torch.float64).log_softmax(-1),
    )
    tokens = torch.randint(0, v, (b, n))
    ours = heads.window_log_marginals(params, tokens)
    core = circuit_prefix_log_marginals(kind, *params.core_batch(), tokens)
    torch.testing.assert_close(ours, core, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("emission", heads.EMISSIONS)
def test_a_head_is_normalised_over_every_window(model, kind, emission):
    # Enumerate all V^n windows of a small-vocabulary head: their probabilities sum to one.
    small = tiny_llama(seed=1, vocab_size=5, hidden_size=16, intermediate_size=32)
    head = heads.new_head(small, _spec(kind, small, window=3, emission=emission, adapter_rank=4))
    with torch.no_grad():
        for p in head.parameters():  # away from the initialisation, where some parts are zero
            p.add_(0.3 * torch.randn_like(p))
        windows = torch.tensor(list(itertools.product(range(5), repeat=3)))  # [125, 3]
        params = head(torch.randn(1, 16).expand(windows.shape[0], 16))
        total = heads.window_log_marginals(params, windows)[:, -1].logsumexp(0)
    torch.testing.assert_close(total, torch.tensor(0.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["hmm", "btree"])
def test_hmm_and_btree_start_as_cp(model, kind):
    # Transitions start near the identity, so a fresh head equals the CP head of the same weights and
    # emissions up to the 1e-3 off-diagonal mass.
    torch.manual_seed(0)
    head = heads.new_head(model, _spec(kind, model))
    cp = heads.new_head(model, _spec("cp", model))
    cp.load_state_dict({k: v for k, v in head.state_dict().items() if not k.startswith("transitions")})
    with torch.no_grad():
        for h in (head, cp):
            h.up.add_(0.05 * torch.randn(h.up.shape, generator=torch.Generator().manual_seed(1)))
            h.weights.bias.copy_(torch.tensor([0.5, -0.2, 0.1]))
        hidden, tokens = torch.randn(6, 64), torch.randint(0, 96, (6, 4))
        a = heads.window_log_marginals(head(hidden), tokens)
        b = heads.window_log_marginals(cp(hidden), tokens)
    torch.testing.assert_close(a, b, atol=2e-2, rtol=0)
    assert not torch.equal(a, b)


def test_training_lowers_the_held_out_loss(model, features):
    pos, win = features.windows(4)
    torch.manual_seed(0)
    head = heads.new_head(model, _spec("cp", model))
    before = offline_heads.evaluate_head(head, features.hidden[pos], win, 0.8)
    stats = offline_heads.train_head(head, features, steps=150, batch_size=32, lr=3e-3)
    after = offline_heads.evaluate_head(head, features.hidden[pos], win, 0.8)
    assert after["heldout_loss"] < before["heldout_loss"] - 0.2, (before, after)
    assert stats["steps"] == 150 and stats["heldout_loss"] > 0


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("emission", heads.EMISSIONS)
def test_greedy_is_token_identical(model, trained, kind, emission):
    calls, new = 0, 0
    for bc in (2, 5, 30):
        cfg = mtprobe.HeadsConfig(path=trained[kind, emission], block_complexity=bc)
        for prompt in _prompts(3, seed=11):
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30
            )
            out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
            assert torch.equal(out.sequences, ref), (kind, emission, bc, prompt.tolist())
            calls, new = calls + out.forward_calls, new + 30
    assert calls < 0.9 * new, (calls, new)  # drafts were accepted: a test of the drafter, not of the loop


def test_the_drafter_drafts_window_minus_one_deep(model, trained):
    cfg = mtprobe.HeadsConfig(path=trained["cp", "lowrank"], block_complexity=30)
    out = mtprobe.generate(model, _prompts(1, seed=3)[0], cfg, max_new_tokens=40, do_sample=False)
    assert max(out.accept_lengths) <= 4  # n - 1 = 3 drafts and the bonus
    assert len(out.accepted_per_depth) <= 3


def test_a_probability_floor_verifies_fewer_inputs_and_stays_token_identical(model, trained):
    prompt = _prompts(1, seed=5)[0]
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30)
    drafted = {}
    for floor in (0.0, 0.05):
        cfg = mtprobe.HeadsConfig(path=trained["btree", "lowrank"], block_complexity=30, min_path_prob=floor)
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
        assert torch.equal(out.sequences, ref), floor
        drafted[floor] = sum(out.drafted_per_depth) / len(out.accept_lengths)
    assert drafted[0.05] < 0.5 * drafted[0.0], drafted  # 29 drafts a step without the floor


@pytest.mark.parametrize("emission", heads.EMISSIONS)
@pytest.mark.parametrize("given_base", [False, True])
def test_a_restricted_head_is_the_whole_head_renormalised_over_its_tokens(
    model, trained, features, emission, given_base
):
    head = heads.load_head(trained["btree", emission], model)
    counts = offline_heads.window_token_counts(features, 4, 96)  # what train_head recorded
    assert torch.equal(head.token_counts, counts)
    assert int(counts.sum()) == 4 * features.windows(4)[0].numel()
    vocab = head.restricted_vocab(20)
    ranked = sorted(range(96), key=lambda t: (-int(counts[t]), t))[:20]  # most frequent, ties by id
    assert vocab.ids.tolist() == sorted(ranked)
    hidden = torch.randn(3, 64)
    base = head.base_logits(hidden) + torch.randn(3, 96) if given_base else None
    target = torch.randn(96)  # a step's target logits: their top 16 join the kept tokens
    wide = vocab.widened(target, heads.ROOT_CANDIDATES)
    top = set(target.topk(16).indices.tolist())
    assert set(wide.extra.tolist()) == top - set(ranked) and wide.extra.numel() > 0
    with torch.no_grad():
        whole = head(hidden, base).emissions  # [3, n, r, V]
        for restricted, kept_ids in ((vocab, sorted(ranked)), (wide, sorted(top | set(ranked)))):
            part = head(hidden, base, restricted).emissions
            kept = whole[..., kept_ids]
            torch.testing.assert_close(part[..., kept_ids], kept - kept.logsumexp(-1, keepdim=True))
            dropped = torch.ones(96, dtype=torch.bool)
            dropped[kept_ids] = False
            assert torch.isneginf(part[..., dropped]).all()


@pytest.mark.parametrize("emission", heads.EMISSIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_a_half_precision_restricted_head_is_the_float32_one_rounded(model, trained, emission, dtype):
    # Its tables are the float32 ones rounded to dtype, its products accumulate from them, and it
    # normalises in float32: the log-probabilities differ from float32's by about the rounding of
    # logits of this size, and the dropped tokens stay impossible.
    head = heads.load_head(trained["btree", emission], model)
    exact, half = head.restricted_vocab(20), head.restricted_vocab(20, dtype)
    assert half.table.dtype == half.lm_head.dtype == dtype and torch.equal(half.ids, exact.ids)
    torch.testing.assert_close(half.table, exact.table.to(dtype), atol=0, rtol=0)
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        want, got = head(hidden, None, exact).emissions, head(hidden, None, half).emissions
    assert got.dtype == torch.float32
    kept = torch.isfinite(want)
    assert torch.equal(kept, torch.isfinite(got))
    # Each product's output is rounded to dtype once (half an ulp, eps / 2 relative) and the
    # log-softmax adds the rounding of the log-normaliser: a few half-ulps at the size of the
    # log-probabilities (measured: 0.45 eps max|log q| in bfloat16, 0.44 in float16).
    bound = 2 * torch.finfo(dtype).eps * float(want[kept].abs().max())
    assert float((got[kept] - want[kept]).abs().max()) <= bound


@pytest.mark.parametrize("kind", ["ff", "btree"])
def test_a_restricted_head_is_token_identical(model, trained, kind):
    prompt = _prompts(1, seed=3)[0]
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30)
    calls = {}
    # The tiny model's text holds 80 of its 96 tokens; head_dtype needs vocab_top_k on a head without LoRA.
    for k, dtype in ((None, None), (40, None), (1, None), (40, "bfloat16"), (1, "bfloat16")):
        cfg = mtprobe.HeadsConfig(
            path=trained[kind, "lowrank"], block_complexity=12, vocab_top_k=k, head_dtype=dtype
        )
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
        assert torch.equal(out.sequences, ref), (kind, k, dtype)
        calls[k, dtype] = out.forward_calls
    assert calls[40, None] < 30 and calls[40, "bfloat16"] < 30  # still drafts that are accepted
    # Without draft layers or a restricted vocabulary there is nothing for head_dtype to change.
    cfg = mtprobe.HeadsConfig(path=trained[kind, "lowrank"], head_dtype="bfloat16")
    with pytest.raises(
        ValueError, match=r"head_dtype='bfloat16' .* this head has neither .* set vocab_top_k"
    ):
        mtprobe.generate(model, prompt, cfg, max_new_tokens=4)


def test_what_inference_builds_is_cached_until_the_parameters_change(model, trained):
    # The restricted tables and the fingerprint are built once per head, not per generate call, and
    # rebuilt after a training step (an in-place update of a parameter).
    head = heads.load_head(trained["btree", "lowrank"], model)
    vocab, print_ = head.restricted_vocab(20), head.fingerprint()
    assert head.restricted_vocab(20) is vocab and head.restricted_vocab(30) is not vocab
    with torch.no_grad():
        head.up.add_(0.5)
    again = head.restricted_vocab(20)
    assert again is not vocab and not torch.allclose(again.table, vocab.table)
    assert head.fingerprint() != print_


def test_vocab_top_k_needs_token_counts_and_a_size_below_the_vocabulary(
    model, trained, features, tmp_path, monkeypatch
):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from mtprobe import models

    # A checkpoint from before token counts were recorded: it loads, and refuses vocab_top_k.
    old = tmp_path / "old"
    old.mkdir()
    with safe_open(f"{trained['cp', 'lowrank']}/head.safetensors", framework="pt") as f:
        meta = f.metadata()
        state = {k: f.get_tensor(k) for k in f.keys() if k != "token_counts"}  # noqa: SIM118
    save_file(state, str(old / "head.safetensors"), metadata=meta)
    head = heads.load_head(old, model)
    assert int(head.token_counts.sum()) == 0
    prompt = _prompts(1)[0]
    with pytest.raises(ValueError, match="records no token counts.*python -m mtprobe heads count"):
        mtprobe.generate(model, prompt, mtprobe.HeadsConfig(path=str(old), vocab_top_k=8), max_new_tokens=4)
    with pytest.raises(ValueError, match=r"vocab_top_k=96 must be in \[1, 96\)"):
        heads.load_head(trained["cp", "lowrank"], model).restricted_vocab(96)
    with pytest.raises(ValueError, match="vocab_top_k=0 must be >= 1"):
        mtprobe.HeadsConfig(path="x", vocab_top_k=0)
    with pytest.raises(TypeError, match="vocab_top_k must be an int"):
        mtprobe.HeadsConfig(path="x", vocab_top_k=2.0)
    # The count command records them from the features the head was trained on.
    monkeypatch.setattr(models, "load", lambda name: (model, None))  # the tiny model has no tokenizer
    feats = tmp_path / "features.pt"
    torch.save({"features": dataclasses.asdict(features), "data": {}}, feats)
    assert cli.main(["heads", "count", str(old), "--features", str(feats), "--model", "tiny"]) == 0
    again = heads.load_head(old, model)
    assert torch.equal(again.token_counts, offline_heads.window_token_counts(features, 4, 96))
    assert again.stats["data"]["token_counts_from"] == "features.pt"
    with torch.no_grad():  # nothing else changed
        torch.testing.assert_close(again(torch.ones(1, 64)).emissions, head(torch.ones(1, 64)).emissions)
    bad = ["heads", "count", str(tmp_path / "none"), "--features", str(feats), "--model", "tiny"]
    assert cli.main(bad) == cli.EXIT_USAGE


def test_checkpoint_round_trip(model, trained):
    head = heads.load_head(trained["btree", "lowrank"], model)
    again = heads.load_head(trained["btree", "lowrank"] + "/head.safetensors", model)
    hidden = torch.randn(3, 64)
    with torch.no_grad():
        a, b = head(hidden), again(hidden)
    torch.testing.assert_close(a.emissions, b.emissions)
    assert head.spec.circuit == "btree" and int(head.trained_steps) == 150
    assert head.stats["windows"] > 0


def test_a_checkpoint_is_refused_for_another_backbone(trained):
    other = tiny_llama(seed=6)
    with pytest.raises(ValueError, match="trained for another backbone: embedding_sha256"):
        heads.load_head(trained["cp", "lowrank"], other)
    bigger = tiny_llama(seed=5, vocab_size=100)
    with pytest.raises(ValueError, match="vocab_size"):
        mtprobe.generate(
            bigger,
            torch.tensor([[5, 6, 7]]),
            mtprobe.HeadsConfig(path=trained["cp", "lowrank"]),
            max_new_tokens=5,
        )


def test_missing_and_corrupt_checkpoints(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="python -m mtprobe heads train"):
        heads.load_head(tmp_path / "none", model)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "head.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="not a readable mtprobe circuit-head checkpoint"):
        heads.load_head(bad, model)


def test_an_untrained_head_is_refused(model, tmp_path):
    head = heads.new_head(model, _spec("cp", model))
    with pytest.raises(ValueError, match="has not been trained"):
        heads.heads_drafter(head)
    with pytest.raises(ValueError, match="has not been trained"):
        heads.save_head(head, model, tmp_path, {})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(window=1), ValueError, "window=1 must be >= 2"),
        (dict(rank=0), ValueError, "rank=0 must be >= 1"),
        (dict(circuit="ff", rank=4), ValueError, "an FF head has no latent states"),
        (dict(circuit="tree"), ValueError, "circuit='tree': expected one of ff, cp, hmm, btree"),
        (dict(emission="full"), ValueError, "emission='full'"),
        (dict(window=2.5), TypeError, "window must be an int"),
    ],
)
def test_bad_specs(kwargs, error, match):
    with pytest.raises(error, match=match):
        heads.HeadSpec(**{"circuit": "cp", "hidden_size": 8, "vocab_size": 10, **kwargs})


def test_bad_configs():
    with pytest.raises(ValueError, match="HeadsConfig needs path=DIR"):
        mtprobe.HeadsConfig()
    with pytest.raises(ValueError, match="block_complexity=1 leaves no room"):
        mtprobe.HeadsConfig(path="x", block_complexity=1)
    with pytest.raises(ValueError, match="top_branches=0 must be >= 1"):
        mtprobe.HeadsConfig(path="x", top_branches=0)
    for bad in (1.0, -0.1, True, "0.1"):
        with pytest.raises(ValueError, match=f"min_path_prob={bad!r} must be a number in \\[0, 1\\)"):
            mtprobe.HeadsConfig(path="x", min_path_prob=bad)
    for bad in ("bf16", "float64", 16):
        with pytest.raises(ValueError, match=f"head_dtype={bad!r}: expected one of 'float32', 'bfloat16'"):
            mtprobe.HeadsConfig(path="x", head_dtype=bad)
    assert mtprobe.HeadsConfig(path="x", head_dtype=torch.bfloat16).head_dtype == "bfloat16"
    cfg = mtprobe.HeadsConfig(path="x", block_complexity=12, head_dtype="float16")
    assert mtprobe.config_from_dict(cfg.to_dict()) == cfg and cfg.torch_head_dtype == torch.float16


def test_a_head_that_returns_wrong_shapes_is_an_error(model):
    from mtprobe import _C

    def head(hidden, logits, prefix_len):
        return [torch.zeros(3).log_softmax(-1), torch.empty(0), torch.zeros(2, 4, 96)]  # want [3, 4, 96]

    drafter = _C.HeadsDrafter(head, circuit="cp", window=4, rank=3, vocab=96)
    loop = cpu_decode_loop(model, drafter, max_new_tokens=5, block_complexity=8, prompt_len=3)
    with pytest.raises(ValueError, match="emissions"):
        loop.run(torch.tensor([5, 6, 7]))


def test_a_head_that_returns_wrong_columns_is_an_error(model):
    # A restricted head's fourth tensor names its emission columns: ascending distinct ids in [0, V),
    # as many as the emissions have columns.
    from mtprobe import _C

    def run(columns, width=None):
        e = torch.zeros(3, 4, width or columns.numel()).log_softmax(-1)  # CP [r, n, N]

        def head(hidden, logits, prefix_len):
            return [torch.zeros(3).log_softmax(-1), torch.empty(0), e, columns]

        drafter = _C.HeadsDrafter(head, circuit="cp", window=4, rank=3, vocab=96)
        cpu_decode_loop(model, drafter, max_new_tokens=5, block_complexity=8, prompt_len=3).run(
            torch.tensor([5, 6, 7])
        )

    run(torch.tensor([1, 5, 9]))  # well formed: no error
    for bad, match in (
        (torch.tensor([5, 1, 9]), r"ascending distinct token ids in \[0, 96\), got 1 at 1 after 5"),
        (torch.tensor([1, 5, 5]), "ascending distinct token ids"),
        (torch.tensor([1, 5, 96]), r"in \[0, 96\), got 96 at 2"),
        (torch.tensor([-1, 5]), "got -1 at 0"),
        (torch.tensor([[1, 5]]), r"non-empty 1-D tensor of token ids, got shape \[1, 2\]"),
        (torch.tensor([], dtype=torch.long), "non-empty 1-D"),
    ):
        with pytest.raises(ValueError, match=match):
            run(bad, width=max(bad.numel(), 1))
    with pytest.raises(ValueError, match="emissions"):
        run(torch.tensor([1, 5, 9]), width=4)  # four columns of emissions for three ids


def _column_heads(vocab: int, columns_of):
    """One CP head (r = 3, window 4) two ways: over its columns ``columns_of(logits)`` (ascending ids) as
    a restricted head returns it, and widened to the whole vocabulary at log-probability -inf. Its
    emissions are the target's logits at the anchor plus fixed noise per (state, position)."""
    g = torch.Generator().manual_seed(0)
    noise = 2 * torch.randn(3, 4, vocab, generator=g)  # [r, n, V]
    weights = torch.randn(3, generator=g).log_softmax(-1)  # [r]

    def emissions(logits):
        cols = columns_of(logits)  # [N]
        return cols, (logits.float()[cols] + noise[..., cols]).log_softmax(-1)  # [r, n, N]

    def compact(hidden, logits, prefix_len):
        cols, e = emissions(logits)
        return [weights, torch.empty(0), e, cols]

    def whole(hidden, logits, prefix_len):
        cols, e = emissions(logits)
        return [weights, torch.empty(0), torch.full((3, 4, vocab), -float("inf")).index_copy_(-1, cols, e)]

    return compact, whole


@pytest.mark.parametrize("mode", ["best_first", "floor", "bank", "no_root"])
def test_a_head_over_columns_drafts_what_it_drafts_over_the_whole_vocabulary(model, mode):
    # The drafter runs the circuit over the N columns and maps its drafts back to ids: the same trees,
    # acceptances and bank records as the head widened to V at -inf, and greedy's output.
    from mtprobe import _C

    V = model.config.vocab_size
    kept = torch.randperm(V, generator=torch.Generator().manual_seed(1))[:40]

    def columns_of(logits):
        if mode == "no_root":  # never the target's choice: the root is impossible, nothing is drafted
            return kept[kept != logits.argmax()].sort().values
        return torch.cat([kept, logits.topk(8).indices]).unique()  # ascending

    options = {}
    if mode == "floor":
        options = {"min_path_prob": 0.05}
    if mode == "bank":
        options = {
            "bank": [_C.Topology([[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]])],
            "policy": _C.TopologyPolicy("static", [0], [], bank_size=1),
            "record": True,
        }
    prompt, new = torch.tensor([5, 6, 7, 8]), 40
    ref = model.generate(prompt[None], attention_mask=torch.ones(1, 4, dtype=torch.long), max_new_tokens=new)
    runs = {}
    for name, head in zip(("compact", "whole"), _column_heads(V, columns_of), strict=True):
        drafter = _C.HeadsDrafter(head, circuit="cp", window=4, rank=3, vocab=V, **options)
        out = cpu_decode_loop(model, drafter, max_new_tokens=new, block_complexity=12, prompt_len=4).run(
            prompt
        )
        assert out.sequence == ref[0].tolist(), name
        runs[name] = (
            list(out.accept_lengths),
            list(out.drafted_per_depth),
            drafter.step_log() if "bank" in options else None,
        )
    assert runs["compact"] == runs["whole"]
    accepted, drafted, _ = runs["compact"]
    if mode == "no_root":
        assert sum(drafted) == 0 and max(accepted) == 1
    else:
        assert max(accepted) > 1  # drafts were accepted, or equal trees would prove little


@pytest.mark.parametrize("committed_rows", [False, True])
def test_the_head_sees_the_rows_it_asks_for(model, committed_rows):
    """Without committed_rows the head gets the last committed row only (no gather); with it, every
    committed row once, in order: the calls' row counts chain through prefix_len to the whole text."""
    from mtprobe import _C

    calls: list[tuple[torch.Tensor, int]] = []

    def head(hidden, logits, prefix_len):
        calls.append((hidden.clone(), prefix_len))
        e = logits.float().log_softmax(-1).expand(3, 4, -1).contiguous()  # every position: the next token
        return [torch.full((3,), 3.0).log().neg(), torch.empty(0), e]

    prompt = torch.tensor([5, 6, 7, 8])
    drafter = _C.HeadsDrafter(head, circuit="cp", window=4, rank=3, vocab=96, committed_rows=committed_rows)
    loop = cpu_decode_loop(model, drafter, max_new_tokens=12, block_complexity=8, prompt_len=4)
    out = loop.run(prompt)
    assert len(calls) >= 2
    if not committed_rows:
        assert all(h.shape[0] == 1 for h, _ in calls)
        return
    ends = [p + h.shape[0] for h, p in calls]
    assert [p for _, p in calls] == [0, *ends[:-1]]  # each call starts where the last ended
    full = torch.tensor(out.sequence)  # [4 + 12]: the prompt, then the new tokens
    with torch.no_grad():  # the rows are the backbone's last hidden states of exactly those tokens
        want = model(full[None, : ends[-1]], output_hidden_states=True).hidden_states[-1][0]
    torch.testing.assert_close(torch.cat([h for h, _ in calls]), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "floor, per_depth",
    [
        # Paths: 10 (0.6), 11 (0.3); 10-12 (0.3), 10-13 (0.24), 11-12 (0.15), 11-13 (0.12), then the rest.
        (0.2, [2, 2]),
        (0.25, [2, 1]),
        (0.5, [1, 0]),
        (0.0, None),  # the budget fills: 7 drafts
    ],
)
def test_min_path_prob_leaves_out_the_improbable_drafts(model, floor, per_depth):
    # An FF head with fixed emissions drafts the same tree every step: exactly the paths whose
    # probability under the circuit reaches the floor, best first; greedy output is unchanged.
    from mtprobe import _C

    V = model.config.vocab_size
    e = torch.full((3, V), 0.1 / (V - 2))  # [n, V]: positions 1 and 2 hold the drafts
    e[1, 10], e[1, 11], e[2, 12], e[2, 13] = 0.6, 0.3, 0.5, 0.4
    e[1, 12] = e[1, 13] = e[2, 10] = e[2, 11] = 0.1 / (V - 2)

    def head(hidden, logits, prefix_len):
        return [torch.empty(0), torch.empty(0), (e / e.sum(-1, keepdim=True)).log()]

    prompt = torch.tensor([5, 6, 7])
    drafter = _C.HeadsDrafter(head, circuit="ff", window=3, rank=1, vocab=V, min_path_prob=floor)
    new = 40
    out = cpu_decode_loop(model, drafter, max_new_tokens=new, block_complexity=8, prompt_len=3).run(prompt)
    ref = model.generate(
        prompt[None], attention_mask=torch.ones(1, 3, dtype=torch.long), do_sample=False, max_new_tokens=new
    )
    assert out.sequence == ref[0].tolist()
    steps = len(out.accept_lengths)
    drafted = list(out.drafted_per_depth)
    # The last two steps may be short of room (depth <= tokens_left - 1); the others draft the same tree.
    if per_depth is None:
        assert (steps - 2) * 7 <= sum(drafted) <= steps * 7, (drafted, steps)
        return
    for d, w in enumerate(per_depth):
        got = drafted[d] if d < len(drafted) else 0
        assert (steps - 2) * w <= got <= steps * w, (floor, drafted, steps)


def test_command_line(tmp_path, capsys):
    from mtprobe import models
    from test_cli import _save_tiny

    folder = _save_tiny(tmp_path / "tiny")
    out = tmp_path / "head"
    argv = ["train", "--model", str(folder), "--out", str(out), "--num-prompts", "4"]
    feats = tmp_path / "features.pt"
    args = [
        *argv,
        "--max-new-tokens",
        "24",
        "--steps",
        "20",
        "--circuit",
        "hmm",
        "--rank",
        "2",
        "--window",
        "3",
    ]
    assert cli.main(["heads", *args, "--features", str(feats)]) == 0
    assert str(out) in capsys.readouterr().out and feats.is_file()
    model, _ = models.load(folder)
    head = heads.load_head(out, model)
    assert (head.spec.circuit, head.spec.window, head.spec.rank, int(head.trained_steps)) == ("hmm", 3, 2, 20)
    assert cli.main(["heads", *args, "--features", str(feats)]) == 0  # from the cached features
    capsys.readouterr()
    # A usage error naming the bad value, on one line.
    assert cli.main(["heads", *argv, "--window", "1"]) == cli.EXIT_USAGE
    assert "window=1 must be >= 2" in capsys.readouterr().err
    # The corpus options' check, shared with python -m mtprobe calibrate.
    assert cli.main(["heads", *argv, "--corpus-prompts", str(tmp_path / "none")]) == cli.EXIT_USAGE
    assert "no such file; give local text files" in capsys.readouterr().err


def test_the_hf_route(model, trained):
    # model.generate(custom_generate=mtprobe.custom_generate, mtprobe_config=HeadsConfig(...)).
    prompt = _prompts(1, seed=4)[0]
    cfg = mtprobe.HeadsConfig(path=trained["hmm", "lowrank"], block_complexity=8)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=False,
        max_new_tokens=20,
        custom_generate=mtprobe.custom_generate,
        mtprobe_config=cfg,
    )
    assert torch.equal(out, ref)


def test_heads_inside_the_scheduler(model, trained):
    # AutoConfig passes hidden states to a child that wants them; its steps stay token-identical.
    cfg = mtprobe.AutoConfig(
        drafters=(
            mtprobe.HeadsConfig(path=trained["cp", "lowrank"], block_complexity=8),
            mtprobe.StandConfig(),
        ),
        profile=mtprobe.ForwardProfile(
            mtprobe.target_model.profile.ProfileKey.of(model), (1, 64), (0,), ((1.0, 1.0),)
        ),
    )
    prompt = _prompts(1, seed=8)[0]
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=30)
    out = mtprobe.generate(model, prompt, cfg, max_new_tokens=30, do_sample=False)
    assert torch.equal(out.sequences, ref)
    assert any(method == "heads" for method, _ in out.choices)
    assert all(t <= 8 for method, t in out.choices if method == "heads")  # its own budget, not STAND's


def test_generate_under_inference_mode(model, trained):
    # generate loads (and caches) the head inside the caller's inference mode: inference tensors.
    from mtprobe.heads.inference import _CACHE

    _CACHE.clear()
    prompt = _prompts(1, seed=9)[0]
    cfg = mtprobe.HeadsConfig(path=trained["btree", "lowrank"], block_complexity=10)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False, max_new_tokens=20)
    with torch.inference_mode():
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=20, do_sample=False)
    assert torch.equal(out.sequences, ref)
    again = mtprobe.generate(
        model, prompt, cfg, max_new_tokens=20, do_sample=False
    )  # the cached head, outside
    assert torch.equal(again.sequences, ref)


ROOT = Path(__file__).resolve().parents[1]
RESULT_HEADS = sorted(
    p.parent for p in (ROOT / "benchmarks" / "results" / "heads").glob("*/head.safetensors")
)


@pytest.mark.parametrize("folder", RESULT_HEADS, ids=lambda p: p.name)
def test_the_committed_heads_load_for_smollm2(smollm2, folder):
    # The heads benchmarks/results/heads/README.md measured: each loads for the model it names, and
    # its spec says what its folder's name does (circuit, rank, window, LoRA layers and base).
    model, _ = smollm2
    head = heads.load_head(folder, model)
    s = head.spec
    assert folder.name.startswith(f"smollm2-135m-{s.circuit}-r{head.r}-n{s.window}")
    assert ("-lora" in folder.name) == (s.lora_layers > 0)
    if s.lora_layers:
        assert f"-lora{s.lora_layers}" in folder.name
        # Folders without a base in their name predate lora_base: their checkpoints load as "draft".
        want = "target" if "-target" in folder.name else "draft"
        assert s.lora_base == want


def test_the_readme_example_of_a_heads_bank(smollm2, tmp_path):
    # README's "EntMTP over a head" example, with an uncalibrated bank of the committed head's trees in
    # place of one built by python -m mtprobe topology (minutes): it runs, reports its trees, and is greedy.
    from mtprobe.topology import TopologyBank, chain_tree
    from test_readme import block_with

    model, tok = smollm2
    bank = TopologyBank(
        trees=((), chain_tree([4]), chain_tree([3, 1, 1])), drafter="heads", num_masks=0, window=4
    )
    path = bank.save(tmp_path / "bank.json")
    block = block_with('bank="bank.json"').replace('"bank.json"', repr(str(path)))
    block = block.replace('"benchmarks/results', '"' + str(ROOT / "benchmarks" / "results"))
    input_ids = chat_ids(tok, [{"role": "user", "content": "List three prime numbers."}])
    ns = {"mtprobe": mtprobe, "model": model, "input_ids": input_ids}
    exec(
        compile(block.replace("max_new_tokens=64", "max_new_tokens=24"), "README.md (heads bank)", "exec"), ns
    )
    out = ns["out"]
    assert torch.equal(out.sequences, model.generate(input_ids, do_sample=False, max_new_tokens=24))
    # Uncalibrated hysteretic defaults: trees 1 and 2 of the bank (4 and 5 inputs).
    assert set(out.choices) - {("none", 1)} <= {("tree1", 5), ("tree2", 6)} and out.choices[0] == ("tree1", 5)
