"""Several sequences through one C++ target forward per step (issue 68: mtprobe._C.BatchedForward,
TargetForward.forward_batch, mtprobe.decode.batch): the batched forward against each block's own forward,
a batch's answers against greedy on each prompt alone (tests/test_batch.py checks every method and route),
where a batch is decoded one sequence after another instead, near-ties decided by HF's forward inside a
batch, a row that fails without holding the others, and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import mtprobe
from conftest import tiny_family, tiny_llama
from mtprobe import _C
from mtprobe.decode import batch as batch_module
from mtprobe.target_model import native_forward as nf
from test_native_forward import _buffers, _build, _near_ties, _tree_mask

PAD = 0
ROWS = [[3, 7, 11, 5, 3, 7], [9, 4, 2], [5, 5, 5, 5, 5, 5, 5, 1], [8, 1]]
WIDTH = max(len(r) for r in ROWS)
IDS = torch.tensor([[PAD] * (WIDTH - len(r)) + r for r in ROWS])  # [4, WIDTH], left-padded
MASK = torch.tensor([[0] * (WIDTH - len(r)) + [1] * len(r) for r in ROWS])


def _blocks(model, seed: int):
    """Four sequences' blocks over caches of their own: a prefill of 9 (logits of its last row only), a
    chain of 5 after 3, a tree of 7 after 40 and one token with two mask inputs after 12."""
    g = torch.Generator().manual_seed(seed)
    vocab, hidden = model.config.vocab_size, model.config.hidden_size
    specs = [(0, [-1] * 1 + list(range(8)), False, 0), (3, [-1, 0, 1, 2, 3], False, 0)]
    specs += [(40, [-1, 0, 0, 1, 1, 2, 5], True, 0), (12, [-1, 0, 1], False, 2)]
    out = []
    for prefix, parents, tree, n_emb in specs:
        keys, values = _buffers(model, 64)
        # The prefix's entries: random, as a previous forward would have left them.
        for t in (*keys, *values):
            t[:, :, :prefix] = torch.randn(t[:, :, :prefix].shape, generator=g).to(t.dtype)
        T = len(parents)
        depth = [0] * T
        for i, p in enumerate(parents):
            depth[i] = 0 if p < 0 else depth[p] + 1
        out.append(
            dict(
                tokens=torch.randint(0, vocab, (T - n_emb,), generator=g),
                embeds=torch.randn(n_emb, hidden, generator=g) if n_emb else None,
                positions=prefix + torch.tensor(depth),
                mask=_tree_mask(parents, prefix)[0, 0] if tree else None,
                prefix_len=prefix,
                keys=keys,
                values=values,
                want_hidden=True,
                logits_from=T - 1 if prefix == 0 else 0,
            )
        )
    return out


@pytest.mark.parametrize("hidden", [True, False], ids=["hidden states", "logits only"])
@pytest.mark.parametrize("name", ["llama", "llama-mha-biases", "qwen2", "qwen3", "gemma3", "llama bfloat16"])
def test_forward_batch_is_each_blocks_own_forward(name, hidden):
    """The blocks of four sequences in one forward: each one's logits, hidden states and cache rows are what
    its own forward gives (up to the rounding of a linear layer over more rows). With logits only, the last
    layer runs past its attention on the rows read alone (the prefill's last among the others' rows)."""
    model = _build(name.split()[0])
    if name.endswith("bfloat16"):
        model = model.to(torch.bfloat16)
    native = nf.native_forward(model)
    together = _blocks(model, 0)
    for b in together:
        b["want_hidden"] = hidden
    if name.endswith("bfloat16"):
        # Two blocks, 14 rows: past SMALL_ROWS_BF16 (16) the rows would take bfloat16 GEMM together and the
        # small-batch kernel alone, which round differently.
        together = together[:2]
    alone = copy.deepcopy(together)
    outs = native.forward_batch([_C.TargetBlock(**b) for b in together])
    tol = dict(atol=2e-2, rtol=2e-2) if name.endswith("bfloat16") else dict(atol=1e-4, rtol=1e-4)
    for b, mine, (logits, states) in zip(alone, together, outs, strict=True):
        want, want_h = native.forward(**b)
        torch.testing.assert_close(logits, want, **tol)
        if hidden:
            torch.testing.assert_close(states, want_h, **tol)
        else:
            assert states is None and want_h is None
        end = b["prefix_len"] + b["positions"].shape[0]
        for a, c in zip(mine["keys"] + mine["values"], b["keys"] + b["values"], strict=True):
            torch.testing.assert_close(a[:, :, :end].float(), c[:, :, :end].float(), **tol)
        assert not logits[: b["logits_from"]].any()  # rows nobody reads: zeros


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_batch_is_decoded_together_and_each_row_is_greedy(arch):
    # gemma3: windows of 8 on two of its three layers, which prompt and answer outgrow.
    model = tiny_llama() if arch == "llama" else tiny_family("gemma3", pad_token_id=PAD)
    new = 10 if arch == "llama" else 14
    alone = [
        model.generate(torch.tensor([r]), do_sample=False, max_new_tokens=new, eos_token_id=None)
        for r in ROWS
    ]
    no_draft = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(), mtprobe.StandConfig(block_complexity=6))
    )
    configs = (
        mtprobe.PlainConfig(),
        mtprobe.PromptLookupConfig(num_tokens=3),
        no_draft,
        # The quantized self-draft, alone and among AutoConfig's default candidates: its draft steps meet too.
        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4),
        mtprobe.AutoConfig(),
    )
    for config in configs:
        out = mtprobe.generate(
            model,
            IDS,
            config,
            attention_mask=MASK,
            do_sample=False,
            max_new_tokens=new,
            eos_token_id=None,
            pad_token_id=PAD,
        )
        assert out.target_forward == nf.VERSION
        assert out.batch == len(ROWS) and all(o.batch == len(ROWS) for o in out.sequence_outputs)
        for i, (r, want) in enumerate(zip(ROWS, alone, strict=True)):
            assert out.sequences[i, WIDTH - len(r) :].tolist() == want[0].tolist(), (type(config).__name__, i)


def _capture_batched(monkeypatch) -> list:
    """The BatchedForward objects the next generations build, in order."""
    import importlib

    generate_module = importlib.import_module("mtprobe.decode.sequence")
    built, build = [], generate_module.batched_forward

    def capture(*args, **kwargs):
        built.append(build(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(generate_module, "batched_forward", capture)
    return built


@pytest.mark.parametrize("config", [mtprobe.PlainConfig(), mtprobe.StandConfig(block_complexity=10)])
def test_the_sampled_sequences_of_a_prompt_share_its_prefill(monkeypatch, config):
    """num_return_sequences sampled together: each prompt's prefill runs once and its other sequences take
    copies of its cache entries and logits; what every row samples is what it samples after a prefill of its
    own."""
    model = tiny_llama()
    built = _capture_batched(monkeypatch)
    kw = dict(attention_mask=MASK[:2], max_new_tokens=6, do_sample=True, eos_token_id=None, pad_token_id=PAD)
    torch.manual_seed(3)
    out = mtprobe.generate(model, IDS[:2], config, num_return_sequences=3, **kw)
    assert [o.batch for o in out.sequence_outputs] == [6] * 6
    assert built[-1].shared_prefills == 4  # 2 prompts x (3 - 1) sequences
    # Each prompt's first sequence ran its prefill; the copies count none, as one after another they do.
    copied = [built[-1].prefill_copied(row) for row in range(6)]
    assert copied == [False, True, True, False, True, True]
    steps = [len(o.accept_lengths) for o in out.sequence_outputs]
    assert [o.forward_calls for o in out.sequence_outputs] == [
        n + (not c) for n, c in zip(steps, copied, strict=True)
    ]
    assert out.forward_calls == sum(steps) + 2
    assert len({tuple(o.sequences[0].tolist()) for o in out.sequence_outputs}) == 6  # samples, not copies
    # Each row running its own prefill instead draws the same tokens: the copies are the prefill's own.
    monkeypatch.setattr(batch_module, "SHARE_PREFILLS", False)
    torch.manual_seed(3)
    apart = mtprobe.generate(model, IDS[:2], config, num_return_sequences=3, **kw)
    assert built[-1].shared_prefills == 0
    assert apart.forward_calls == sum(len(o.accept_lengths) for o in apart.sequence_outputs) + 6
    assert torch.equal(apart.sequences, out.sequences)


def test_the_self_drafts_steps_of_a_batch_run_together(monkeypatch):
    """Every row drafts its chain with the quantized self-draft: each depth's steps of the rows still drafting
    run in one QuantizedDecoder.step_rows (BatchedForward.draft_step), and every row stays greedy's."""
    model = tiny_llama()
    built = _capture_batched(monkeypatch)
    config = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    kw = dict(attention_mask=MASK, do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    out = mtprobe.generate(model, IDS, config, **kw)
    batched = built[-1]
    assert out.batch == len(ROWS)
    drafted = sum(sum(o.drafted_per_depth) for o in out.sequence_outputs)
    # Every chain's first draft comes from the target's logits' step (the bonus token's decoder step), and
    # every other from a decoder step: at least one step a draft, and rows met in them.
    assert batched.draft_steps > 0 and batched.draft_rows >= drafted
    assert batched.draft_rows > batched.draft_steps  # several rows per step_rows call
    assert batched.draft_seconds > 0 and batched.forward_seconds > 0
    monkeypatch.setenv(batch_module.ENV, "0")
    apart = mtprobe.generate(model, IDS, config, **kw)
    assert apart.batch == 1 and torch.equal(out.sequences, apart.sequences)


def test_autoconfig_prices_a_batch_step_as_the_batch_forward(monkeypatch):
    """A row of a batch of B is priced by the forward of B blocks (ForwardProfile.for_rows) and by the batch
    step's overhead as the batched forward measures it (its own wall time includes its waits on the other
    rows), and keeps its draft model's measurements apart from a single sequence's."""
    from mtprobe.state import state_of

    model = tiny_llama()
    built = _capture_batched(monkeypatch)
    config = mtprobe.AutoConfig()
    kw = dict(attention_mask=MASK, do_sample=False, max_new_tokens=10, eos_token_id=None, pad_token_id=PAD)
    out = mtprobe.generate(model, IDS, config, **kw)
    assert out.batch == len(ROWS)
    overhead = built[-1].step_overhead
    assert overhead > 0
    # Each row's scheduler reports (and priced) the batch's, read after the batch ran.
    assert all(o.timings["step_overhead_s"] == overhead for o in out.sequence_outputs)
    carried = state_of(model).carried
    assert {key[2] for key in carried} == {len(ROWS)}  # (configuration, sampling, rows)
    alone = mtprobe.generate(model, IDS[:1], config, **{**kw, "attention_mask": MASK[:1]})
    assert alone.batch == 1
    assert {key[2] for key in carried} == {1, len(ROWS)}
    # A batch size not measured yet starts from the nearest batch's measurements, never a single sequence's.
    from mtprobe.drafters.auto_carry import carried as carried_for

    draft = next(key[0] for key in carried)
    assert carried_for(model, draft, False, 2) is carried[(draft, False, len(ROWS))]
    assert carried_for(model, draft, False, 1) is carried[(draft, False, 1)]
    assert carried_for(model, draft, True, 2) is None  # nothing measured under sampling


def test_one_after_another_where_a_batch_cannot_run_together(monkeypatch):
    model = tiny_llama()
    kw = dict(attention_mask=MASK, max_new_tokens=6, eos_token_id=None, pad_token_id=PAD)
    together = mtprobe.generate(model, IDS, mtprobe.PlainConfig(), do_sample=False, **kw)
    monkeypatch.setenv(batch_module.ENV, "0")
    apart = mtprobe.generate(model, IDS, mtprobe.PlainConfig(), do_sample=False, **kw)
    assert (together.batch, apart.batch) == (len(ROWS), 1)
    assert torch.equal(together.sequences, apart.sequences)
    monkeypatch.delenv(batch_module.ENV)
    torch.manual_seed(0)
    sampled = mtprobe.generate(model, IDS, mtprobe.PlainConfig(), do_sample=True, **kw)
    assert sampled.batch == len(ROWS)  # sampled rows together too, each drawing from its own generator
    torch.manual_seed(0)
    again = mtprobe.generate(model, IDS, mtprobe.PlainConfig(), do_sample=True, **kw)
    assert torch.equal(again.sequences, sampled.sequences)  # a seeded call repeats
    monkeypatch.setattr(batch_module, "MAX_ROWS", 2)  # groups of 2 rows, one after another
    torch.manual_seed(0)
    grouped = mtprobe.generate(model, IDS, mtprobe.PlainConfig(), do_sample=False, **kw)
    assert [o.batch for o in grouped.sequence_outputs] == [2, 2, 2, 2]  # 4 rows
    assert torch.equal(grouped.sequences, together.sequences)
    masks = type("Masks", (), {"offsets": None, "lora": None, "temperature": None})()
    # Without the C++ forward a batch runs HF's modules on a batch plan, but not mtprobe's tree attention.
    assert batch_module.why_not_batched(3, None, masks=masks, hidden_layer=-1) == ""
    why = batch_module.why_not_batched(3, None, masks=masks, hidden_layer=-1, tree_attention=True)
    assert "tree attention" in why
    why = batch_module.why_not_batched(3, None, masks=masks, hidden_layer=-1, drafts_on_cpu=True)
    assert "measured slower together than apart" in why
    assert batch_module.why_not_batched(3, object(), masks=masks, hidden_layer=-1, drafts_on_cpu=True) == ""
    assert batch_module.why_not_batched(1, object(), masks=masks, hidden_layer=-1)
    kw = dict(masks=masks, hidden_layer=-1)
    assert "a draft model drafts" in batch_module.why_not_batched(3, object(), **kw, draft_model=True)
    assert "n-gram memory" in batch_module.why_not_batched(3, object(), **kw, shares_memory=True)
    assert batch_module.why_not_batched(3, object(), **kw) == ""


def test_near_ties_in_a_batch_are_decided_by_hf():
    """Every step of every row is a near-tie: each runs again through its own adapter's HF forward while the
    other rows wait, and every row is greedy's."""
    model = _near_ties(1e-4)
    rows = [[1, 2, 3, 4], [5, 6], [7, 8, 9]]
    ids = torch.tensor([[PAD] * (4 - len(r)) + r for r in rows])
    mask = (ids != PAD).long()
    out = mtprobe.generate(
        model,
        ids,
        mtprobe.PlainConfig(),
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=12,
        eos_token_id=None,
        pad_token_id=PAD,
    )
    assert out.batch == 3
    for i, r in enumerate(rows):
        want = model.generate(torch.tensor([r]), do_sample=False, max_new_tokens=12, eos_token_id=None)
        assert out.sequences[i, 4 - len(r) :].tolist() == want[0].tolist()
        seq = out.sequence_outputs[i]
        assert seq.exact_steps == len(seq.accept_lengths) + 1  # the prefill's first token too


class _FailsOnCall(LogitsProcessor):
    """Raises on its n-th call (from whichever row makes it)."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __call__(self, input_ids, scores):
        self.calls += 1
        if self.calls == self.n:
            raise RuntimeError("a processor failed")
        return scores


def test_a_failing_row_raises_without_holding_the_others():
    model = tiny_llama()
    processor = _FailsOnCall(5)
    with pytest.raises(RuntimeError, match="a processor failed"):
        mtprobe.generate(
            model,
            IDS,
            mtprobe.PlainConfig(),
            attention_mask=MASK,
            do_sample=False,
            max_new_tokens=8,
            eos_token_id=None,
            pad_token_id=PAD,
            logits_processor=LogitsProcessorList([processor]),
        )
    assert processor.calls >= 5


def test_bad_input_is_named():
    model = tiny_llama()
    native = nf.native_forward(model)
    keys, values = _buffers(model, 16)
    flag = torch.zeros((), dtype=torch.bool)
    with pytest.raises(ValueError, match="row 0 must hold one key and one value buffer per layer"):
        _C.BatchedForward(
            native, keys=[keys[:1]], values=[values[:1]], prefill_logits_from=[0], prefilled=[flag]
        )
    with pytest.raises(ValueError, match="need one entry per row"):
        _C.BatchedForward(native, keys=[keys], values=[values], prefill_logits_from=[], prefilled=[flag])
    with pytest.raises(ValueError, match="prefilled flag must be a one-element bool CPU tensor"):
        _C.BatchedForward(
            native, keys=[keys], values=[values], prefill_logits_from=[0], prefilled=[flag.long()]
        )
    batched = _C.BatchedForward(
        native, keys=[keys], values=[values], prefill_logits_from=[0], prefilled=[flag]
    )
    with pytest.raises(ValueError, match="the batch has 1 rows, given 0 loops and 0 prompts"):
        batched.run([], [])
    loop_kw = dict(
        max_new_tokens=2,
        eos_token_ids=[],
        max_positions=64,
        block_complexity=4,
        kv_capacity=16,
        mask_dtype="float32",
        device="cpu",
    )
    with pytest.raises(ValueError, match="draft_step: row 1 is not in \\[0, 1\\)"):
        batched.draft_step(1, None, 0, 0, [], [])
    with pytest.raises(ValueError, match="draft_step: no decoder"):
        batched.draft_step(0, None, 0, 0, [], [])
    from mtprobe.target_model.self_draft import quantized, quantized_decoder

    decoder = quantized_decoder(quantized(model))
    with pytest.raises(RuntimeError, match="row 0 is not running"):  # outside run(): no batch to meet
        batched.draft_step(0, decoder, 0, 0, keys, values)
    drafter = _C.PlainDrafter()
    with pytest.raises(ValueError, match="either a forward or a batched forward and its row, not both"):
        _C.DecodeLoop(drafter, lambda *a: None, list, **loop_kw, batched=batched, row=0)
    with pytest.raises(ValueError, match="not neither"):
        _C.DecodeLoop(drafter, None, list, **loop_kw)
    with pytest.raises(ValueError, match="row 3 is not in \\[0, 1\\)"):
        _C.DecodeLoop(drafter, None, list, **loop_kw, batched=batched, row=3)
    blocks = _blocks(model, 1)
    blocks[1]["tokens"] = torch.tensor([1, 2, 3, 4, 999])
    with pytest.raises(ValueError, match="block 1: token 999 at input 4 is outside the vocabulary"):
        native.forward_batch([_C.TargetBlock(**b) for b in blocks])


def _measured(drafting_rate: float, plain_rate: float, **kw) -> _C.BatchDrafting:
    """A BatchDrafting with one phase of each mode measured at these tokens per second (one-step phases)."""
    policy = _C.BatchDrafting(phase_steps=1, **kw)
    for rate in (drafting_rate, plain_rate):  # it starts drafting, then measures the mode it has not
        policy.add_tokens(int(rate))
        policy.end_step(1.0)
    return policy


def test_batch_drafting_keeps_the_faster_mode_and_tries_the_other_now_and_then():
    policy = _C.BatchDrafting(phase_steps=3, exploit_phases=2)
    assert policy.allowed  # a batch starts drafting: its schedulers' first steps explore
    for _ in range(3):  # a phase of 3 steps with drafting: 2 tokens a step in 0.5 s
        policy.add_tokens(2)
        policy.end_step(0.5)
    assert (
        policy.rate(True) == pytest.approx(4.0) and not policy.allowed
    )  # the other mode, never measured yet
    modes = []
    for _ in range(5):  # plain phases: 3 tokens a step in 0.5 s, faster
        for _ in range(3):
            policy.add_tokens(3)
            policy.end_step(0.5)
        modes.append(policy.allowed)
        if policy.allowed:  # the one drafting phase tried again: slower still
            for _ in range(3):
                policy.add_tokens(1)
                policy.end_step(0.5)
            modes.append(policy.allowed)
    assert policy.rate(False) == pytest.approx(6.0)
    # Plain kept for exploit_phases = 2 phases, then drafting tried once, then plain again.
    assert modes[:4] == [False, False, True, False]
    assert policy.steps(False) > policy.steps(True) >= 6
    with pytest.raises(ValueError, match="phase_steps must be >= 1"):
        _C.BatchDrafting(phase_steps=0)
    with pytest.raises(ValueError, match="exploit_phases must be >= 0"):
        _C.BatchDrafting(exploit_phases=-1)


@pytest.mark.parametrize("plain_faster", [True, False])
def test_a_batch_that_measured_plain_decoding_faster_holds_its_schedulers_rows_back(plain_faster):
    # The batch's BatchDrafting (kept in the model's state per configuration, sampling and rows) decides whether
    # AutoConfig's rows draft: one that measured plain decoding faster runs every step plainly, no drafter asked;
    # one that measured drafting faster leaves the rows' schedulers to choose. Every row stays greedy's either way.
    from mtprobe.state import state_of

    model = tiny_llama(seed=5, vocab_size=32)
    cfg = mtprobe.AutoConfig(drafters=(mtprobe.PromptLookupConfig(num_tokens=4),), carry=False)
    rows = [[3, 7, 11, 5, 3, 7, 11, 5, 3, 7], [9, 4, 2, 9, 4, 2, 9, 4], [5, 5, 5, 5, 5, 5, 5, 1]]
    width = max(map(len, rows))
    ids = torch.tensor([[PAD] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    slow, fast = 1.0, 100.0
    # Plain measured faster, kept for a million phases; or a first drafting phase that outlasts the call.
    policy = (
        _measured(slow, fast, exploit_phases=10**6) if plain_faster else _C.BatchDrafting(phase_steps=10**6)
    )
    state_of(model).batch_drafting[(cfg, False, 3)] = policy
    steps_before = policy.steps(False) + policy.steps(True)
    kw = dict(attention_mask=mask, max_new_tokens=12, eos_token_id=None, pad_token_id=PAD)
    out = mtprobe.generate(model, ids, cfg, **kw)
    for r, row in enumerate(rows):
        want = model.generate(torch.tensor([row]), do_sample=False, max_new_tokens=12, eos_token_id=None)
        assert out.sequence_outputs[r].sequences.tolist() == want.tolist(), r
    methods = {m for o in out.sequence_outputs for m, _ in o.choices}
    steps = max(len(o.choices) for o in out.sequence_outputs)
    if plain_faster:
        assert methods == {"plain"}  # held back: no drafter asked
        assert (
            policy.steps(False) - steps_before >= steps - 2
        )  # every decode step but the first ended plainly
    else:
        assert "pld" in methods  # repetitive prompts: prompt lookup's blocks chosen
        assert policy.steps(True) >= steps - 2
