"""AutoConfig: the scheduling drafter (csrc/drafters/auto.h) is lossless whatever it chooses, and
chooses what the forward profile says pays: deep drafts on a flat (GPU-like) profile, plain
decoding on a steep one."""

from __future__ import annotations

import json
import re

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe import _C
from mtprobe.target_model.profile import ForwardProfile, ProfileKey

REPEATING = [5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17]  # prompt lookup and STAND draft here


def _profile(model, *, slope: float, plain: float = 0.01) -> ForwardProfile:
    """A profile for ``model`` where T inputs cost 1 + slope (T - 1) / 63 plain forwards of ``plain``
    seconds (a long one makes the step overhead the scheduler measures negligible)."""
    return ForwardProfile(ProfileKey.of(model), (1, 64), (0,), ((plain, plain * (1 + slope)),))


def _greedy(model, ids, n=32):
    return model.generate(ids, do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0)


DRAFTER_SETS = {
    "pld+stand": (mtprobe.PromptLookupConfig(num_tokens=6), mtprobe.StandConfig(block_complexity=10)),
    "probe+pld": (mtprobe.ProbeConfig(block_complexity=10), mtprobe.PromptLookupConfig(num_tokens=4)),
    "hybrid+lookahead": (
        mtprobe.HybridConfig(block_complexity=10),
        mtprobe.LookaheadConfig(ngram_size=3, window=3, guess_set_size=2),
    ),
    "stand": (mtprobe.StandConfig(block_complexity=30),),
    "entmtp+pld": (
        mtprobe.EntMTPConfig(policy="ladder", feature="top1", thresholds=(0.05, 0.1, 0.15, 0.2, 0.3)),
        mtprobe.PromptLookupConfig(num_tokens=4),
    ),
}


@pytest.mark.parametrize("slope", [0.0, 0.5, 3.0, 30.0])
@pytest.mark.parametrize("drafters", list(DRAFTER_SETS))
def test_auto_is_token_identical_to_greedy(drafters, slope):
    model = tiny_llama()
    for prompt in (REPEATING, [7, 3, 81, 44, 12, 60]):
        ids = torch.tensor([prompt])
        cfg = mtprobe.AutoConfig(
            drafters=DRAFTER_SETS[drafters], profile=_profile(model, slope=slope), explore_every=4
        )
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
        assert torch.equal(out.sequences, _greedy(model, ids)), (drafters, slope, prompt)
        assert len(out.choices) == out.steps == len(out.accept_lengths)
        budgets = {c.method: c.block_complexity for c in cfg.drafters} | {"plain": 1}
        assert {m for m, _ in out.choices} <= set(budgets)
        for (method, t), gained in zip(out.choices, out.accept_lengths, strict=True):
            assert 1 <= t <= budgets[method] <= cfg.block_complexity  # each within its own budget
            if method == "plain":
                assert t == 1 and gained == 1  # plain decoding gains exactly one token


def test_each_drafter_drafts_within_its_own_block_complexity():
    """The step's budget is the largest drafter's, but STAND at block complexity 4 beside prompt
    lookup with 12 tokens still proposes at most 4 inputs (it proposed 13 before each child was
    handed its own budget)."""
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    stand = mtprobe.StandConfig(block_complexity=4)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=12), stand), profile=_profile(model, slope=0.0)
    )
    assert cfg.block_complexity == 13
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, _greedy(model, ids))
    stand_sizes = [t for m, t in out.choices if m == "stand"]
    assert stand_sizes and max(stand_sizes) <= 4, out.choices
    assert max(t for m, t in out.choices if m == "pld") > 4  # the larger budget is still the step's


def test_the_profile_decides():
    """A flat profile (T inputs cost one forward) verifies every chain prompt lookup proposes, so the
    run takes exactly prompt lookup's own steps; a profile where every extra input costs a whole
    forward verifies nothing but the committed token."""
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    pld = mtprobe.PromptLookupConfig(num_tokens=6)
    kw = dict(max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    ref = _greedy(model, ids)
    alone = mtprobe.generate(model, ids, pld, **kw)
    cheap = mtprobe.generate(
        model, ids, mtprobe.AutoConfig(drafters=(pld,), profile=_profile(model, slope=0.0)), **kw
    )
    dear = mtprobe.generate(
        model, ids, mtprobe.AutoConfig(drafters=(pld,), profile=_profile(model, slope=63.0)), **kw
    )
    assert torch.equal(cheap.sequences, ref) and torch.equal(dear.sequences, ref)
    assert cheap.accept_lengths == alone.accept_lengths and cheap.drafted_per_depth == alone.drafted_per_depth
    assert any(m == "pld" and t == 7 for m, t in cheap.choices)  # the root and a whole chain
    assert all(m == "plain" and t == 1 for m, t in dear.choices)  # t(T) = T t(1): no draft can pay
    assert dear.forward_calls == 32 and dear.tau == 1.0
    # Prompt lookup proposed chains in 10 steps: the steep profile refused real drafts.
    assert alone.drafted_per_depth[0] >= 5 and sum(dear.drafted_per_depth) == 0


class _ChainOracle(_C.Drafter):
    """Proposes the next three tokens of ``truth`` (prompt + greedy continuation) as a chain, and one
    wrong token as the depth-1 node's second sibling (rank 1)."""

    def __init__(self, truth: list[int], vocab: int = 96) -> None:  # tiny_llama's vocabulary
        super().__init__()
        self.truth = truth
        self.vocab = vocab

    def name(self) -> str:
        return "oracle"

    def begin(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, committed: torch.Tensor, prefix_len: int, limits) -> _C.DraftBlock:
        start = prefix_len + committed.numel()  # truth's index of the step's first new token
        chain = self.truth[start : start + 3]
        wrong = (self.truth[start] + 1) % self.vocab
        return _C.token_block(committed, [*chain, wrong], [-1, 0, 1, -1][: len(chain)] + [-1])

    def observe(self, outcome) -> None:
        pass


def test_plain_steps_still_learn_deep_acceptance(monkeypatch):
    """A plain step tells one token of the continuation; each proposed tree's walk waits for the later
    steps' tokens, so a run that verifies nothing beyond the committed token still judges deep nodes.
    Counted by hand (no decay): 31 decode steps after the prefill's token, each proposing the true
    chain t_s, t_s+1, t_s+2 and a wrong depth-1 sibling; depth d of step s is judged once token
    s + d - 1 exists (s + d - 1 <= 31)."""
    import sys

    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    truth = _greedy(model, ids, 40)[0].tolist()
    # t(T) = T t(1): nothing pays. Seconds, not milliseconds: the step overhead the scheduler measures (a
    # few ms, more on a loaded machine) would otherwise make a long block cheaper per input than plain.
    table = _C.CostTable([1, 64], [0], [1.0, 64.0])
    auto = _C.AutoDrafter([_ChainOracle(truth)], table, decay=1.0)
    gen = sys.modules["mtprobe.decode.sequence"]
    monkeypatch.setattr(gen, "make_drafter", lambda *a, **k: auto)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=6),), profile=_profile(model, slope=63.0)
    )
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0].tolist() == truth[: ids.shape[1] + 32]
    assert all(child == -1 for child, _, _ in auto.choices())  # every step plain
    trials, accepts = auto.stats[0].trials, auto.stats[0].accepts  # [depth][rank]
    assert trials == [[31, 31, 0, 0], [30, 0, 0, 0], [29, 0, 0, 0]]
    assert accepts == [[31, 0, 0, 0], [30, 0, 0, 0], [29, 0, 0, 0]]


class _SampledChain(_ChainOracle):
    """_ChainOracle's tree as sampled drafts: q one-hot on each proposed token (``draft_probs``)."""

    def propose(self, committed: torch.Tensor, prefix_len: int, limits) -> _C.DraftBlock:
        block = super().propose(committed, prefix_len, limits)
        drafts = block.tokens[block.num_committed : block.num_nodes]
        block.draft_probs = torch.nn.functional.one_hot(drafts, self.vocab).float()  # [drafts, vocab]
        return block


def test_sampled_drafts_are_judged_only_where_they_ran(monkeypatch):
    """A sampled draft is accepted with min(1, p/q); matching a continuation another block produced
    (probability p) would under-rate it, so its tree is not walked on steps where it did not run."""
    import sys

    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    truth = _greedy(model, ids, 40)[0].tolist()
    # t(T) = T t(1): nothing pays. Seconds, not milliseconds: the step overhead the scheduler measures (a
    # few ms, more on a loaded machine) would otherwise make a long block cheaper per input than plain.
    table = _C.CostTable([1, 64], [0], [1.0, 64.0])
    auto = _C.AutoDrafter([_SampledChain(truth, model.config.vocab_size)], table, decay=1.0)
    monkeypatch.setattr(sys.modules["mtprobe.decode.sequence"], "make_drafter", lambda *a, **k: auto)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=6),), profile=_profile(model, slope=63.0)
    )
    torch.manual_seed(0)
    mtprobe.generate(model, ids, cfg, max_new_tokens=16, do_sample=True, eos_token_id=None, pad_token_id=0)
    assert len(auto.choices()) > 0 and all(child == -1 for child, _, _ in auto.choices())
    assert all(t == 0 for row in auto.stats[0].trials for t in row)


def test_a_partial_cut_verifies_the_kept_subtree(monkeypatch):
    """With each extra input costing a tenth of a forward, the cut keeps the true chain of three and
    drops the wrong sibling once the statistics have learned it: the verified block is exactly the
    chain (4 inputs, 3 draft nodes), and each such step gains all three drafts plus the bonus."""
    import sys

    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    truth = _greedy(model, ids, 40)[0].tolist()
    table = _C.CostTable([1, 64], [0], [0.01, 0.01 * 7.3])  # t(T) = (1 + 0.1 (T - 1)) t(1)
    auto = _C.AutoDrafter([_ChainOracle(truth)], table, decay=1.0)
    monkeypatch.setattr(sys.modules["mtprobe.decode.sequence"], "make_drafter", lambda *a, **k: auto)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=6),), profile=_profile(model, slope=6.3)
    )
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0].tolist() == truth[: ids.shape[1] + 32]
    choices = auto.choices()
    # By hand, P(node) = product of a(depth, rank) = (accepts + 2m) / (trials + 2) along its path:
    # step 1, priors a = 1/2 (rank 0) and 1/4 (rank 1): the chain's P are 1/2, 1/4, 1/8 and the
    # sibling's 1/4, so the best cut keeps the sibling over the third node (2.0 / 1.3 beats 1.75 / 1.2
    # and 2.125 / 1.4). Step 2, a = 2/3 along the chain and 2/9 for the sibling: all four nodes
    # (2.630 / 1.4 beats 2.407 / 1.3). From step 3 on the sibling (3/16, then less) costs more than it
    # gains: the chain alone.
    assert choices[:2] == [(0, 4, 3), (0, 5, 4)] and out.accept_lengths[:2] == [3, 4]
    assert len(choices) >= 6 and choices[2:-1] == [(0, 4, 3)] * (len(choices) - 3)
    assert out.accept_lengths[2:-1] == [4] * (len(choices) - 3)
    assert out.block_sizes[:-1] == [4, 5] + [4] * (len(choices) - 3)


def test_choices_timings_and_summary():
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    out = mtprobe.generate(
        model,
        ids,
        mtprobe.AutoConfig(profile=_profile(model, slope=1.0)),
        max_new_tokens=16,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert out.method == "auto"
    assert out.timings["draft_s"] > 0 and 0 < out.timings["schedule_s"] < out.timings["total_s"]
    assert out.summary()["method"] == "auto"


def test_hf_route_and_config_dict():
    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    cfg = mtprobe.AutoConfig(profile=_profile(model, slope=1.0))
    seq = model.generate(
        ids,
        custom_generate=mtprobe.custom_generate,
        mtprobe_config=cfg,
        max_new_tokens=16,
        eos_token_id=None,
        pad_token_id=0,
    )
    assert torch.equal(seq, _greedy(model, ids, 16))
    again = mtprobe.config_from_json(json.dumps(cfg.to_dict()))
    assert again == cfg and isinstance(again.profile, ForwardProfile)
    out = mtprobe.generate(model, ids, cfg.to_dict(), max_new_tokens=16, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, seq)


def test_auto_measures_and_caches_a_profile(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MTPROBE_CACHE", str(tmp_path))
    model = tiny_llama()
    ids = torch.tensor([REPEATING])

    def run():
        caplog.clear()
        with caplog.at_level("WARNING", logger="mtprobe"):
            return mtprobe.generate(
                model, ids, mtprobe.AutoConfig(), max_new_tokens=8, eos_token_id=None, pad_token_id=0
            )

    assert torch.equal(run().sequences, _greedy(model, ids, 8))
    assert len(list((tmp_path / "profiles").glob("*.json"))) == 1  # measured once, kept
    # The pause is announced where a notebook shows it (a warning), the first time only.
    assert "measuring the forward costs" in caplog.text and str(tmp_path / "profiles") in caplog.text
    assert torch.equal(run().sequences, _greedy(model, ids, 8))
    assert "measuring the forward costs" not in caplog.text


def test_profile_file_path(tmp_path):
    model = tiny_llama()
    path = _profile(model, slope=1.0).save(tmp_path / "p.json")
    cfg = mtprobe.AutoConfig(profile=str(path))
    ids = torch.tensor([REPEATING])
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, _greedy(model, ids, 8))


def test_bad_input():
    model = tiny_llama()
    with pytest.raises(ValueError, match="needs at least one drafter"):
        mtprobe.AutoConfig(drafters=())
    assert mtprobe.AutoConfig(drafters=(mtprobe.DraftModelConfig(),)).block_complexity == 6
    with pytest.raises(ValueError, match="which AutoConfig cannot schedule"):
        mtprobe.AutoConfig(drafters=(mtprobe.AutoConfig(),))
    with pytest.raises(TypeError, match=r"drafters\[1\] is str, not a drafter configuration"):
        mtprobe.AutoConfig(drafters=(mtprobe.StandConfig(), "pld"))
    with pytest.raises(ValueError, match=r"decay=0 must be a number in \(0, 1\]"):
        mtprobe.AutoConfig(decay=0)
    with pytest.raises(ValueError, match="explore_every=0 must be >= 1"):
        mtprobe.AutoConfig(explore_every=0)
    with pytest.raises(TypeError, match="profile must be a ForwardProfile"):
        mtprobe.AutoConfig(profile=3)
    other = tiny_llama(hidden_size=32)  # another architecture: its profile misleads
    cfg = mtprobe.AutoConfig(profile=_profile(other, slope=1.0))
    with pytest.raises(ValueError, match="measured for another setting \\(model: profile 'LlamaForCausalLM:"):
        mtprobe.generate(model, torch.tensor([REPEATING]), cfg, max_new_tokens=4)
    with pytest.raises(ValueError, match="has no field\\(s\\) 'budget'"):
        mtprobe.config_from_dict({"method": "auto", "budget": 3})
    # The binding's own checks: one budget per drafter, each at least 1.
    from mtprobe import _C
    from mtprobe.drafters import make_drafter

    table = _C.CostTable([1, 64], [0], [1.0, 2.0])
    kids = [make_drafter(model, mtprobe.PromptLookupConfig()), make_drafter(model, mtprobe.StandConfig())]
    with pytest.raises(ValueError, match="budgets has 1 entries for 2 drafters"):
        _C.AutoDrafter(kids, table, budgets=[4])
    with pytest.raises(ValueError, match=r"budgets\[1\] = 0; a block complexity is at least 1"):
        _C.AutoDrafter(kids, table, budgets=[4, 0])
    with pytest.raises(ValueError, match="own_forwards has 3 entries for 2 drafters"):
        _C.AutoDrafter(kids, table, own_forwards=[False, True, False])


class _DraftOracle(_ChainOracle):
    """A drafter with forwards of its own (a draft model's place in the scheduler): proposes the next
    ``limits.budget - 1`` tokens of ``truth`` as a chain and counts the decode steps it was asked at."""

    def __init__(self, truth: list[int]) -> None:
        super().__init__(truth)
        self.asked: list[int] = []
        self.step = -1  # the prefill's propose is step -1

    def propose(self, committed: torch.Tensor, prefix_len: int, limits) -> _C.DraftBlock:
        self.asked.append(self.step)
        start = prefix_len + committed.numel()
        chain = self.truth[start : start + limits.budget - 1]
        return _C.token_block(committed, chain, list(range(-1, len(chain) - 1)))

    def observe(self, outcome) -> None:
        self.step += 1


def _run_oracle(monkeypatch, table: _C.CostTable, *, explore_every: int = 16):
    import sys

    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    truth = _greedy(model, ids, 40)[0].tolist()
    oracle = _DraftOracle(truth)
    auto = _C.AutoDrafter(
        [oracle], table, decay=1.0, explore_every=explore_every, budgets=[7], own_forwards=[True]
    )
    monkeypatch.setattr(sys.modules["mtprobe.decode.sequence"], "make_drafter", lambda *a, **k: auto)
    cfg = mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(num_tokens=6),), profile=_profile(model, slope=1.0)
    )
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert out.sequences[0].tolist() == truth[: ids.shape[1] + 32]
    return oracle, auto, out


def test_a_drafter_with_own_forwards_is_asked_when_its_forecast_pays(monkeypatch):
    """Free, exact drafts on a flat profile: the first step explores with every draft the budget allows
    (6), and from then on the forecast (p = 7/8, 13/14, ...) keeps asking for the longest chain."""
    oracle, auto, out = _run_oracle(monkeypatch, _C.CostTable([1, 64], [0], [1.0, 1.0]))
    assert -1 not in oracle.asked  # not at the prefill
    assert oracle.asked == list(range(len(auto.choices())))  # every decode step
    # Each step drafts 6 (fewer near the end: tokens_left), all accepted with the bonus.
    assert [c for c in auto.choices()[:4]] == [(0, 7, 6)] * 4 and out.accept_lengths[:4] == [7] * 4
    assert auto.draft_costs[0] > 0  # measured at the first step


def test_a_drafter_with_own_forwards_only_explores_where_it_cannot_pay(monkeypatch):
    """Where every input costs a whole forward (t(T) = T t(1)) no chain pays: after the first step's
    exploration the drafter is asked only once it has idled explore_every steps (every fifth step
    with explore_every = 4), with the forecast's best chain of at least one draft."""
    oracle, auto, out = _run_oracle(monkeypatch, _C.CostTable([1, 64], [0], [1.0, 64.0]), explore_every=4)
    steps = len(auto.choices())
    assert oracle.asked == list(range(0, steps, 5))
    for i, (child, t, nodes) in enumerate(auto.choices()):
        if i % 5 == 0:
            assert child == 0 and nodes == t - 1 >= 1 and (i > 0 or nodes == 6)
        else:
            assert (child, t, nodes) == (-1, 1, 0)


def test_auto_schedules_the_quantized_self_draft():
    """AutoConfig's default drafters name the quantized self-draft; on a float32 or bfloat16 CPU model it
    is a candidate (method "sps" in the choices) and the output is greedy's. On a float16 model, which the
    draft cannot run, it is left out; left with no drafter at all, the configuration is an error."""
    from mtprobe.drafters import auto_candidates

    model = tiny_llama()
    ids = torch.tensor([REPEATING])
    cfg = mtprobe.AutoConfig(profile=_profile(model, slope=0.0))
    # Off the 4-bit grid (a random model) one self-draft per format measured (tests/test_auto_formats.py).
    assert [c.method for c in auto_candidates(model, cfg)] == ["pld", "stand", "sps", "sps"]
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=32, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, _greedy(model, ids))
    assert {"sps:q8_0", "sps:q4_1"} <= {m for m, _ in out.choices}  # explored at least
    assert [c.method for c in auto_candidates(tiny_llama().to(torch.bfloat16), cfg)] == [
        "pld",
        "stand",
        "sps",
        "sps",
    ]
    half = tiny_llama().to(torch.float16)
    assert [c.method for c in auto_candidates(half, cfg)] == ["pld", "stand"]
    alone = mtprobe.AutoConfig(drafters=(mtprobe.DraftModelConfig(self_draft="quantized"),))
    with pytest.raises(ValueError, match="AutoConfig has no drafter that runs on this model: the quantized"):
        auto_candidates(half, alone)


def _no_chain_pays():
    """A tiny model, a repeating prompt and AutoConfig over the 4-bit self-draft (chains of 6) priced so
    that no chain pays (t(T) = T t(1)): a scheduler with nothing measured explores the draft at its first
    step, one that starts from measurements decodes plainly. (model, ids, draft, config, generate kwargs)."""
    model = tiny_llama()
    draft = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=6)
    cfg = mtprobe.AutoConfig(
        drafters=(draft,), profile=_profile(model, slope=63.0, plain=1.0), explore_every=64
    )
    return (
        model,
        torch.tensor([REPEATING]),
        draft,
        cfg,
        dict(max_new_tokens=16, eos_token_id=None, pad_token_id=0),
    )


def test_what_auto_measured_of_a_draft_model_carries_to_the_next_generation():
    """Where no chain pays (t(T) = T t(1)), the first generation explores the draft model at its first
    step; the next generation of the model starts from those measurements and does not."""
    from mtprobe.state import state_of

    model, ids, draft, cfg, kw = _no_chain_pays()
    first = mtprobe.generate(model, ids, cfg, **kw)
    (counts, seconds) = state_of(model).carried[(draft, False, 1)]
    assert seconds > 0 and sum(row[0] for row in counts[0]) >= 1  # trials of the first step's chain
    second = mtprobe.generate(model, ids, cfg, **kw)
    assert first.choices[0] == ("sps", 7) and all(m == "plain" for m, _ in second.choices)
    assert torch.equal(first.sequences, second.sequences)
    assert torch.equal(first.sequences, _greedy(model, ids, 16))


def test_what_auto_measured_carries_to_a_new_process_through_its_file(tmp_path, monkeypatch):
    """With the files on, the model's next generation in a new process (here: its state released, as a new
    process holds none) starts from what the last one kept on disk, and does not explore. The file is
    keyed by the model, its weights and the machine: other weights start afresh. A file of the user's
    (carry=PATH) made for another model, dtype or machine is refused with what differs."""
    import dataclasses
    import json

    from mtprobe.drafters import auto_carry

    monkeypatch.setenv(auto_carry.ENV, "1")
    monkeypatch.setattr(auto_carry, "carry_dir", lambda: tmp_path / "auto")
    model, ids, draft, cfg, kw = _no_chain_pays()
    first = mtprobe.generate(model, ids, cfg, **kw)
    assert first.choices[0] == ("sps", 7)  # explored
    assert len(list((tmp_path / "auto").glob("*.json"))) == 1
    mtprobe.release(model)
    second = mtprobe.generate(model, ids, cfg, **kw)
    assert all(m == "plain" for m, _ in second.choices)  # started from the file
    assert torch.equal(first.sequences, second.sequences)
    other = tiny_llama()
    with torch.no_grad():
        other.model.layers[0].mlp.up_proj.weight[0, 0] += 1e-3  # other weights: another file
    assert mtprobe.generate(other, ids, cfg, **kw).choices[0] == ("sps", 7)
    assert len(list((tmp_path / "auto").glob("*.json"))) == 2

    mine = tmp_path / "mine.json"
    mtprobe.release(model)
    mtprobe.generate(model, ids, dataclasses.replace(cfg, carry=mine), **kw)  # written there too
    data = json.loads(mine.read_text())
    assert data["entries"][0]["config"] == draft.to_dict() and data["entries"][0]["rows"] == 1
    data["key"]["profile"]["dtype"] = "bfloat16"
    mine.write_text(json.dumps(data))
    mtprobe.release(model)
    with pytest.raises(
        ValueError, match=r"another model or machine \(dtype: file 'bfloat16' vs now 'float32'\)"
    ):
        mtprobe.generate(model, ids, dataclasses.replace(cfg, carry=str(mine)), **kw)
    mine.write_text('{"version": 1, "key": {}, "entries": [{"config": 3}]}')
    mtprobe.release(model)
    with pytest.raises(ValueError, match="holds AutoConfig's measurements of another model or machine"):
        mtprobe.generate(model, ids, dataclasses.replace(cfg, carry=str(mine)), **kw)
    mine.write_text("[1, 2")
    mtprobe.release(model)
    with pytest.raises(ValueError, match="is not a file of AutoConfig's measurements"):
        mtprobe.generate(model, ids, dataclasses.replace(cfg, carry=str(mine)), **kw)
    # The cache's own file, unreadable: ignored (and rewritten after the generation).
    for path in (tmp_path / "auto").glob("*.json"):
        path.write_text("not json")
    mtprobe.release(model)
    assert mtprobe.generate(model, ids, cfg, **kw).choices[0] == ("sps", 7)
    with pytest.raises(ValueError, match="carry='.*' is a directory; pass the path of a file"):
        mtprobe.generate(model, ids, dataclasses.replace(cfg, carry=str(tmp_path)), **kw)
    for bad in (3, "", True):
        with pytest.raises(TypeError, match="carry must be None .* False .* or the path of a file, got"):
            mtprobe.AutoConfig(carry=bad)


def test_carried_measurements_are_checked():
    from mtprobe.drafters import make_drafter

    table = _C.CostTable([1, 64], [0], [1.0, 2.0])
    kids = [make_drafter(tiny_llama(), mtprobe.PromptLookupConfig())]
    with pytest.raises(ValueError, match="carried_stats has 2 entries for 1 drafters"):
        _C.AutoDrafter(kids, table, carried_stats=[_C.AcceptanceStats(), _C.AcceptanceStats()])
    with pytest.raises(ValueError, match=r"carried_costs\[0\] = -1; seconds per draft are finite and >= 0"):
        _C.AutoDrafter(kids, table, carried_costs=[-1.0])
    with pytest.raises(ValueError, match="depth 1, rank 0 has 2.0+ accepts of 1.0+ trials"):
        _C.AcceptanceStats(0.95, [[1.0, 0, 0, 0]], [[2.0, 0, 0, 0]])
    with pytest.raises(ValueError, match="depth 1 needs 4 ranks of trials and of accepts"):
        _C.AcceptanceStats(0.95, [[1.0]], [[1.0]])
    with pytest.raises(ValueError, match="trials has 1 depths, accepts 0"):
        _C.AcceptanceStats(0.95, [[1.0, 0, 0, 0]], [])
    carried = _C.AcceptanceStats(0.95, [[3.0, 1, 0, 0]], [[2.0, 0, 0, 0]])
    assert carried.trials == [[3.0, 1.0, 0.0, 0.0]] and carried.rate(1) == pytest.approx(3 / 5)


def test_the_quantized_draft_catches_up_from_the_targets_cache(smollm2):
    """Asked only every fifth step (a profile where nothing pays, explore_every 4), the quantized
    self-draft has missed the tokens of four plain steps each time; it takes their entries from the
    target's cache and drafts as well as ever: almost every draft of its chains is accepted."""
    from conftest import chat_ids

    model, tok = smollm2
    ids = chat_ids(tok, [{"role": "user", "content": "Explain how a bicycle stays upright."}])
    draft = mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=4)
    cfg = mtprobe.AutoConfig(
        drafters=(draft,), profile=_profile(model, slope=63.0, plain=1.0), explore_every=4
    )
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=40)
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    assert torch.equal(out.sequences, ref)
    asked = [(i, t) for i, (m, t) in enumerate(out.choices) if m == "sps"]
    assert [i for i, _ in asked] == list(range(0, len(out.choices), 5))[: len(asked)] and len(asked) >= 4
    drafted = sum(t - 1 for _, t in asked)
    accepted = sum(out.accept_lengths[i] - 1 for i, _ in asked)
    assert accepted >= 0.8 * drafted, (accepted, drafted)


@pytest.mark.parametrize(("slope", "with_probe"), [(0.0, True), (1.2, False)])
def test_auto_on_the_real_model(smollm2, greedy, slope, with_probe):
    """SmolLM2 on two of the project's prompts: token-identical to greedy under a GPU-like profile
    (probing among the drafters) and a CPU-like one (t(64) = 2.2 t(1), as measured on the 2-core CPU;
    the default drafters)."""
    from conftest import chat_ids
    from mtprobe.data import load_prompts

    model, tok = smollm2
    prompts = [p for p in load_prompts() if p["id"].startswith(("long", "repetition"))][:2]
    drafters = (mtprobe.ProbeConfig(block_complexity=10), mtprobe.PromptLookupConfig())
    cfg = mtprobe.AutoConfig(
        profile=_profile(model, slope=slope), **({"drafters": drafters} if with_probe else {})
    )
    for p in prompts:
        ids = chat_ids(tok, p["messages"])
        ref = greedy(model, ids, 32)  # computed once for both profiles
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=32)
        assert torch.equal(out.sequences, ref), (p["id"], slope, with_probe)
        assert any(m != "plain" for m, _ in out.choices) or slope > 0  # a free forward always drafts


def test_bench_auto_rounds_slice_every_category():
    # benchmarks/bench_auto.py --rounds K: each round's --per-category; the last covers them all, each
    # round adds questions, and a round count the questions cannot fill is refused.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    assert bench.round_sizes(20, 4) == [5, 10, 15, 20]
    assert bench.round_sizes(7, 3) == [3, 5, 7]
    assert bench.round_sizes(2, 1) == [2]
    for bad in (0, 21):
        with pytest.raises(ValueError, match="rounds must be between 1 and per_category"):
            bench.round_sizes(20, bad)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--methods", "ar,autoo"], r"no such row\(s\) \['autoo'\]"),
        (["--methods", "ar,stand-bc10-mem", "--repeats", "2"], "use --repeats 1"),
        (["--methods", "auto-mem", "--per-category", "4", "--rounds", "2"], "use --rounds 1 for them"),
    ],
)
def test_bench_auto_refuses_bad_rows_before_running(tmp_path, capsys, extra, message):
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    with pytest.raises(SystemExit):
        bench.main(["--question-file", str(tmp_path / "q.jsonl"), "--out-dir", str(tmp_path / "out"), *extra])
    assert re.search(message, capsys.readouterr().err)
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


@pytest.mark.parametrize(
    "extra",
    [
        ["--rows", "llama.cpp"],
        ["--rows", "llama.cpp", "--llama-cpp", "/nowhere", "--dtype", "bfloat16"],
    ],
)
def test_bench_auto_refuses_the_llama_cpp_row_without_its_build(tmp_path, capsys, extra):
    # llama.cpp's row needs benchmarks/peers/build_llama_cpp.sh's folder and decodes F32 on the CPU: refused at
    # the command line, before the model loads; without --llama-cpp the default rows leave it out.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    argv = ["--interleaved", "--question-file", str(tmp_path / "q.jsonl"), "--out", str(tmp_path / "r.md")]
    with pytest.raises(SystemExit):
        bench.main([*argv, *extra])
    assert "--llama-cpp DIR" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


@pytest.mark.parametrize(
    ("extra", "device", "dtype"),
    [([], "cpu", "float32"), (["--device", "cuda", "--dtype", "bfloat16"], "cuda", "bfloat16")],
)
def test_bench_auto_runs_every_row_on_the_device_and_dtype_it_reports(
    tmp_path, monkeypatch, extra, device, dtype
):
    # Every harness command gets the benchmark's --device and --dtype (CPU float32 unless told), and the
    # README states them; the harness itself is not run here (subprocess.run is recorded instead).
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: calls.append(cmd))
    out = tmp_path / "out"
    argv = [
        "--question-file",
        "q.jsonl",
        "--per-category",
        "1",
        "--methods",
        "ar,auto",
        "--out-dir",
        str(out),
    ]
    assert bench.main([*argv, *extra]) == 0
    runs = [c for c in calls if c[2:4] == ["mtprobe.specbench", "run"]]
    assert len(runs) == 2 and len(calls) == 3  # two rows, then compare
    for cmd in runs:
        assert cmd[cmd.index("--device") + 1] == device and cmd[cmd.index("--dtype") + 1] == dtype
    assert f"`smollm2-135m`, {dtype}, " in (out / "README.md").read_text(encoding="utf-8")


def test_bench_auto_stock_rows_are_their_rows_on_torchs_linear(tmp_path, monkeypatch):
    # A -stock row runs its base row's method with MTPROBE_LINEAR_ROUTE=stock (torch's linear on every
    # decode step, whatever the routes measured here), only when named, and its README line says so.
    from conftest import load_benchmark
    from mtprobe.cpu import linear_routes
    from mtprobe.target_model.profile import choose_linear_routes

    bench = load_benchmark("bench_auto")
    methods = dict(bench.METHODS)
    assert bench.STOCK_LINEAR == {"stand-bc10-stock", "auto-stock"}
    for stem in bench.STOCK_LINEAR:
        assert methods[stem] == methods[stem.removesuffix("-stock")]
    monkeypatch.delenv("MTPROBE_LINEAR_ROUTE", raising=False)
    for stem in bench.STOCK_LINEAR:
        env = bench.method_env(stem)
        assert env is not None and env["MTPROBE_LINEAR_ROUTE"] == "stock"
        monkeypatch.setenv("MTPROBE_LINEAR_ROUTE", env["MTPROBE_LINEAR_ROUTE"])
        # What the row's process reads: every block size on torch's linear, nothing measured.
        routes = choose_linear_routes(tiny_llama())
        assert routes.forced == "stock" and {routes.route(t) for t in (1, 2, 8, 64)} == {"stock"}
        monkeypatch.delenv("MTPROBE_LINEAR_ROUTE")
    assert linear_routes.forced_route() == ""  # the benchmark's own process is left as it was
    for stem in methods.keys() - bench.STOCK_LINEAR:
        assert bench.method_env(stem) is None
    assert "auto" in bench.DEFAULT_METHODS and not bench.STOCK_LINEAR & set(bench.DEFAULT_METHODS)
    calls = []
    monkeypatch.setattr(bench.subprocess, "run", lambda cmd, **kw: calls.append((cmd, kw.get("env"))))
    out = tmp_path / "out"
    argv = ["--question-file", "q.jsonl", "--per-category", "1", "--methods", "auto,auto-stock", "--out-dir"]
    assert bench.main([*argv, str(out)]) == 0
    envs = {cmd[cmd.index("--answer-file") + 1]: env for cmd, env in calls if "--answer-file" in cmd}
    assert envs[str(out / "answers" / "auto.jsonl")] is None
    assert envs[str(out / "answers" / "auto-stock.jsonl")]["MTPROBE_LINEAR_ROUTE"] == "stock"
    readme = (out / "README.md").read_text(encoding="utf-8")
    assert "| auto-stock | `MTPROBE_LINEAR_ROUTE=stock python -m mtprobe.specbench run " in readme
    assert "| auto | `python -m mtprobe.specbench run " in readme


def _timed_runs(bench):
    """Synthetic --interleaved runs: two questions (tasks qa and rag), three repeats, HF greedy and auto."""
    runs = []
    walls = {  # (method, question) -> seconds of each repeat; each median is the middle value
        ("HF greedy", 1): (1.0, 9.0, 1.0),
        ("HF greedy", 2): (2.0, 2.0, 2.0),
        ("auto", 1): (0.5, 0.1, 0.5),
        ("auto", 2): (4.0, 4.0, 5.0),
    }
    for (method, q), seconds in walls.items():
        for rep, wall in enumerate(seconds):
            mt = method == "auto"
            runs.append(
                bench.Timed(
                    method,
                    q,
                    "qa" if q == 1 else "rag",
                    rep,
                    wall,
                    new_tokens=10 * q,
                    gained=(3 if mt else 1) * (10 * q - 1),
                    steps=10 * q - 1,
                    identical=not (mt and q == 2 and rep == 0),
                    linear_routes="T 1+: stock" if mt else "",
                )
            )
    return runs


def test_bench_auto_interleaved_tables_pool_the_median_of_each_questions_repeats():
    # --interleaved's tables from synthetic timings: per question the median of its repeats, summed;
    # tokens/s against HF greedy's, pooled and per Spec-Bench task, and each row's worst task.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    runs = _timed_runs(bench)
    methods = ["HF greedy", "auto"]
    assert bench.question_medians(runs, "HF greedy") == {1: (1.0, 10), 2: (2.0, 20)}
    assert bench.tokens_per_s(runs, "HF greedy") == pytest.approx(30 / 3)
    assert bench.tokens_per_s(runs, "auto") == pytest.approx(30 / 4.5)
    assert bench.tokens_per_s(runs, "auto", {2}) == pytest.approx(20 / 4)
    greedy, auto = bench.pooled_rows(runs, methods)
    assert greedy == ["HF greedy", "1.000", "10.00", "1.000x", "reference", "–"]
    assert auto == ["auto", "3.000", "6.67", "0.667x", "5/6", "`T 1+: stock`"]
    speedups = bench.task_speedups(runs, methods)
    assert list(speedups) == ["qa", "rag"]  # Spec-Bench's task order
    assert speedups["qa"] == pytest.approx({"HF greedy": 1.0, "auto": 2.0})
    assert speedups["rag"] == pytest.approx({"HF greedy": 1.0, "auto": 0.5})
    assert bench.worst_tasks(speedups, ["auto"]) == {"auto": ("rag", pytest.approx(0.5))}
    lines = bench.interleaved_report(["# header"], runs, methods, question_count=2)
    assert lines[0] == "# header" and "HF greedy: **10.00 tokens/s**." in "\n".join(lines)
    assert "| auto | 3.000 | 6.67 | 0.667x | 5/6 | `T 1+: stock` |" in lines
    assert "| qa | 1 | 10.00 | 2.000x |" in lines and "| rag | 1 | 10.00 | 0.500x |" in lines
    assert "| **worst task** | | | rag 0.500x |" in lines
    assert "| 1 | qa | 1.00 (10) | 0.50 (10) |" in lines


def test_bench_auto_interleaved_splits_each_rows_seconds_and_rates_its_decode_alone():
    # "Where the time went": each row's seconds summed over its runs, split into prefill, decode forwards,
    # drafting and the rest (HF's rows: all after the prefill), and the decode's own rate against HF's.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")

    def run(method, wall, prefill, forward=0.0, draft=0.0):
        return bench.Timed(method, 1, "qa", 0, wall, 11, 10, 5, True, "", "", prefill, forward, draft)

    runs = [
        run("HF greedy", 3.0, 1.0),
        run("HF greedy", 3.0, 1.0),  # 20 decode tokens in 4 s after the prefills: 5 tok/s
        run("auto", 2.0, 1.0, 0.5, 0.25),
        run("auto", 2.0, 1.0, 0.5, 0.25),  # 20 in 2 s: 10 tok/s
    ]
    greedy, auto = bench.time_split_rows(runs, ["HF greedy", "auto"])
    assert greedy == [
        "HF greedy",
        "6.00",
        "2.00 (33 %)",
        "–",
        "–",
        "4.00 (decode, all of it)",
        "5.00",
        "1.000x",
    ]
    assert auto == [
        "auto",
        "4.00",
        "2.00 (50 %)",
        "1.00 (25 %)",
        "0.50 (12 %)",
        "0.50 (12 %)",
        "10.00",
        "2.000x",
    ]
    lines = bench.interleaved_report(["# header"], runs, ["HF greedy", "auto"], question_count=1)
    assert "| " + " | ".join(auto) + " |" in lines


def test_bench_auto_interleaved_refuses_the_subprocess_modes_options(tmp_path, capsys, monkeypatch):
    # --interleaved runs its own rows in this process: options of the subprocess mode, no --out, or a
    # route forced from outside are refused before anything loads; without --interleaved, --out-dir is
    # still required.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    monkeypatch.setattr(bench, "run_interleaved", lambda args: pytest.fail("ran despite a refused option"))
    q = ["--question-file", str(tmp_path / "q.jsonl")]
    out = ["--out", str(tmp_path / "r.md")]
    for argv, message in [
        (["--interleaved", *q], "writes its report to --out"),
        (["--interleaved", *q, *out, "--methods", "auto"], "drop --methods"),
        (["--interleaved", *q, *out, "--out-dir", str(tmp_path)], "drop --out-dir"),
        (["--interleaved", *q, *out, "--per-category", "2", "--rounds", "2"], "drop --rounds"),
        (["--interleaved", *q, *out, "--repeats", "0"], "--repeats must be >= 1"),
        (["--interleaved", *q, *out, "--rows", "auto,autoo"], "--rows: unknown row(s) 'autoo'; choose from"),
        (q, "--out-dir is required"),
    ]:
        with pytest.raises(SystemExit):
            bench.main(argv)
        assert message in capsys.readouterr().err, argv
    # A route forced from outside would hold for the auto row too, which must run the routes as measured.
    monkeypatch.setenv("MTPROBE_LINEAR_ROUTE", "small-batch")
    with pytest.raises(SystemExit):
        bench.main(["--interleaved", *q, *out])
    assert "would force auto's linear route too" in capsys.readouterr().err
    assert not (tmp_path / "r.md").exists()


def test_bench_auto_environ_sets_a_variable_for_one_block_only(monkeypatch):
    # auto-stock's MTPROBE_LINEAR_ROUTE=stock holds for its own call only, even when the call fails.
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto")
    monkeypatch.delenv("MTPROBE_LINEAR_ROUTE", raising=False)
    with bench.environ("MTPROBE_LINEAR_ROUTE", "stock"):
        assert bench.linear_routes.forced_route() == "stock"
    assert "MTPROBE_LINEAR_ROUTE" not in bench.os.environ
    monkeypatch.setenv("MTPROBE_LINEAR_ROUTE", "packed")
    with pytest.raises(RuntimeError), bench.environ("MTPROBE_LINEAR_ROUTE", "stock"):
        raise RuntimeError("the call failed")
    assert bench.os.environ["MTPROBE_LINEAR_ROUTE"] == "packed"


def test_bench_auto_memory_rows_name_valid_drafters():
    # The -mem rows pass --drafters JSON to the harness: each parses into AutoConfig's drafters, and the
    # calibrated masks they name are the committed file.
    from pathlib import Path

    from conftest import load_benchmark
    from mtprobe.drafters.auto import drafter_configs as _drafter_configs

    bench = load_benchmark("bench_auto")
    rows = {stem: args for stem, args in bench.METHODS if stem.startswith("auto-") and stem.endswith("-mem")}
    assert set(rows) == {"auto-mem", "auto-hybrid-mem"}
    for args in rows.values():
        drafters = _drafter_configs(args[args.index("--drafters") + 1])
        mtprobe.AutoConfig(drafters=drafters)
        assert all(getattr(d, "memory_size", 1 << 18) == 1 << 18 for d in drafters)
    assert (Path(__file__).resolve().parents[1] / bench.MASKS).is_file()


def test_bench_auto_modelled_prices_each_step_by_the_profile():
    # Steps of T = 3, 1, 2 gaining 2, 1, 1 tokens after a 10-token prompt: t(3, 10) + t(1, 12) + t(2, 13),
    # with t(T, c) = T + c / 100 on this profile (linear in both coordinates between its grid points).
    from conftest import load_benchmark

    bench = load_benchmark("bench_auto_modelled")
    key = ProfileKey(model="M:0", device="cpu", dtype="float32", threads=1)
    profile = ForwardProfile(key, (1, 4), (0, 100), ((1.0, 4.0), (2.0, 5.0)))
    got = bench.modelled_seconds(profile, 10, [3, 1, 2], [2, 1, 1])
    assert got == pytest.approx((3 + 0.1) + (1 + 0.12) + (2 + 0.13))
    with pytest.raises(ValueError):  # one block size per accept length
        bench.modelled_seconds(profile, 10, [3, 1], [2, 1, 1])
    for name, spec in bench.METHODS.items():
        assert mtprobe.config_from_dict(spec).method == spec["method"], name
