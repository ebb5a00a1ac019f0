"""EntMTP (seed 002): the topology bank's trees (csrc/core/topology.h) against their reference, the
policies, the offline frontier and calibration arithmetic on hand-computed cases, the bank's
refusals, and lossless generation whatever tree the policy picks."""

from __future__ import annotations

import json
import random
from dataclasses import replace as dataclasses_replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.cli import main as cli_main
from mtprobe.drafters import entmtp_drafter
from mtprobe.offline.topology import (
    StepRecord,
    acceptance_frontier,
    build_bank,
    calibrate_policies,
    policy_trees,
    replay_policy,
    simulate_policy,
    true_ranks,
)
from mtprobe.reference import topology as ref
from mtprobe.target_model.profile import ForwardProfile, ProfileKey
from mtprobe.topology import TopologyBank, chain_tree, default_bank

REPEATING = [5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17]


def _random_tree(rng: random.Random, nodes: int, depth: int, width: int) -> list[tuple[int, ...]]:
    """A prefix-closed set of rank paths (ranks may skip: (0,) and (2,) without (1,))."""
    paths: set[tuple[int, ...]] = set()
    for _ in range(50 * nodes):  # tries, not nodes: a shallow narrow tree holds only so many
        if len(paths) == nodes:
            break
        parent = rng.choice([(), *sorted(p for p in paths if len(p) < depth)])
        paths.add(parent + (rng.randrange(width),))
    return list(paths)


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), nodes=st.integers(0, 12), depth=st.integers(1, 4), prune=st.booleans())
def test_cpp_matches_reference(seed, nodes, depth, prune):
    rng = random.Random(seed)
    paths = _random_tree(rng, nodes, depth, width=4)
    t = _C.Topology([list(p) for p in paths])
    order, parents, depths, ranks = ref.compile_topology(paths)
    assert [tuple(p) for p in t.paths] == order
    assert (t.parents, t.depths, t.ranks) == (parents, depths, ranks)
    # Candidates drawn from a small vocabulary repeat the root and parents often: pruning matters.
    m = rng.randint(1, 7)
    cand = torch.tensor([[rng.randrange(6) for _ in range(m)] for _ in range(depth)])  # [depth, m]
    probs = (
        torch.rand(depth, m, generator=torch.Generator().manual_seed(seed)).sort(-1, descending=True).values
    )
    root = rng.randrange(6)
    got = t.fill(root, cand, probs, prune=prune)
    want = ref.fill_topology(paths, root, cand.tolist(), probs.tolist(), prune=prune)
    assert (got is None) == (want is None)
    if got is not None:
        assert got[0] == want[0]  # tokens: exact
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-6, atol=0)
    true = [rng.randrange(-1, 4) for _ in range(depth)]
    assert t.accepted_depth(true) == ref.accepted_depth(paths, true)


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["static", "ladder", "hysteretic"]),
    n=st.integers(1, 5),
    scores=st.lists(st.floats(0, 1), min_size=1, max_size=20),
    cuts=st.lists(st.floats(0, 1), min_size=4, max_size=4),
)
def test_policy_matches_reference(kind, n, scores, cuts):
    trees = {"static": [n - 1], "ladder": list(range(n)), "hysteretic": [0, n]}[kind]
    thresholds = {"static": [], "ladder": sorted(cuts[: n - 1]), "hysteretic": sorted(cuts[:2])}[kind]
    p = _C.TopologyPolicy(kind, trees, thresholds, bank_size=n + 1)
    current = p.initial()
    for s in scores:
        nxt = p.choose(s, current)
        assert nxt == ref.choose(kind, trees, thresholds, s, current)
        current = nxt


def test_hysteresis_holds_between_the_thresholds():
    p = _C.TopologyPolicy("hysteretic", [0, 2], [0.3, 0.5], bank_size=3)
    seq, cur = [], p.initial()
    for s in [0.4, 0.6, 0.4, 0.35, 0.2, 0.4, 0.51]:
        cur = p.choose(s, cur)
        seq.append(cur)
    assert seq == [0, 2, 2, 2, 0, 0, 2]


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="topology bank is empty"):
        TopologyBank(trees=())
    with pytest.raises(ValueError, match="switch-down 0.600000 is above switch-up 0.400000"):
        mtprobe.EntMTPConfig(policy="hysteretic", thresholds=(0.6, 0.4))
    with pytest.raises(ValueError, match="ladder's thresholds must be ascending"):
        mtprobe.EntMTPConfig(policy="ladder", trees=(0, 1, 2), thresholds=(0.5, 0.2))
    with pytest.raises(ValueError, match=r"topology id 9 is outside the bank \[0, 6\)"):
        mtprobe.EntMTPConfig(policy="static", trees=(9,))
    with pytest.raises(ValueError, match="has no parent node"):
        TopologyBank(trees=(((1, 0),),))
    with pytest.raises(ValueError, match="reaches depth 2, but 1 mask token"):
        TopologyBank(trees=(((0,), (0, 0)),))
    with pytest.raises(ValueError, match="appears twice"):
        _C.Topology([[0], [0]])
    with pytest.raises(ValueError, match="is negative"):
        _C.Topology([[-1]])
    with pytest.raises(ValueError, match="feature='logits' must be one of"):
        mtprobe.EntMTPConfig(feature="logits")
    with pytest.raises(ValueError, match="ema=0 must be a number in"):
        mtprobe.EntMTPConfig(ema=0)
    with pytest.raises(ValueError, match="unknown policy 'greedy'"):
        TopologyBank(trees=((),), policies={"greedy": {}})
    with pytest.raises(TypeError, match="bank must be a TopologyBank"):
        mtprobe.EntMTPConfig(bank=3)
    with pytest.raises(ValueError, match="a topology bank and its policy come together"):
        _C.MaskProbeDrafter(
            torch.zeros(8, 4),
            num_masks=1,
            block_complexity=10,
            dynamic_tree=False,
            branches=[1],
            prune=True,
            mask_init="prompt_mean",
            gaussian_shift=0.0,
            mask_lambda=0.1,
            bank=[_C.Topology([[0]])],
        )


def test_bank_files_and_refusals(tmp_path):
    model, other = tiny_llama(seed=0), tiny_llama(seed=1)
    bank = TopologyBank(
        trees=((), chain_tree([2])),
        model=mtprobe.topology.model_fingerprint(model),
        device=ProfileKey.of(model).device,
        dtype="float32",
        best=1,
        policies={"static": {"trees": [1], "thresholds": [], "feature": "top1"}},
    )
    path = bank.save(tmp_path / "bank.json")
    assert TopologyBank.load(path) == bank
    cfg = mtprobe.EntMTPConfig(bank=str(path), policy="static")
    assert cfg.trees == (1,) and cfg.feature == "top1" and cfg.block_complexity == 6
    ids = torch.tensor([REPEATING])
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=12, do_sample=False)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=12))
    with pytest.raises(ValueError, match="this topology bank was built for another setting \\(model: bank"):
        mtprobe.generate(other, ids, cfg, max_new_tokens=4)
    with pytest.raises(ValueError, match="dtype: bank 'float32' vs now 'bfloat16'"):
        mtprobe.generate(model.to(torch.bfloat16), ids, cfg, max_new_tokens=4)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match="bad.json is not a topology bank \\(corrupt JSON"):
        TopologyBank.load(tmp_path / "bad.json")
    (tmp_path / "old.json").write_text(json.dumps({"format": 0, "trees": []}))
    with pytest.raises(ValueError, match="not a topology bank of format 1"):
        TopologyBank.load(tmp_path / "old.json")
    with pytest.raises(FileNotFoundError, match="build one with `python -m mtprobe topology"):
        mtprobe.EntMTPConfig(bank=str(tmp_path / "missing.json"))


POLICIES = [
    ("static", "path_value", None),
    ("ladder", "top1", (0.05, 0.1, 0.2, 0.3, 0.5)),
    ("ladder", "accept", (0.2, 0.5, 0.8, 1.2, 2.0)),
    ("hysteretic", "path_value", (0.01, 0.05)),
    ("hysteretic", "entropy", (0.05, 0.1)),
    ("hysteretic", "accept", (0.3, 0.6)),
]


@pytest.mark.parametrize(("policy", "feature", "thresholds"), POLICIES)
def test_greedy_is_token_identical_on_a_tiny_model(policy, feature, thresholds):
    model = tiny_llama()
    for prompt in (REPEATING, [7, 3, 81, 44, 12, 60]):
        ids = torch.tensor([prompt])
        cfg = mtprobe.EntMTPConfig(policy=policy, feature=feature, thresholds=thresholds)
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=40, do_sample=False)
        assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=40))
        assert len(out.choices) == out.steps
        bank = cfg.resolved_bank
        for (name, t), gained in zip(out.choices, out.accept_lengths, strict=True):
            if name != "none":
                i = int(name.removeprefix("tree"))
                assert i in cfg.trees and t == bank.block_size(i)
                assert gained <= bank.topology(i).max_depth + 1


def test_greedy_is_token_identical_on_smollm2(smollm2, greedy):
    model, tok = smollm2
    prompts = [
        chat_ids(tok, [{"role": "user", "content": content}])
        for content in ("List three uses of copper.", "Write a Python function that reverses a string.")
    ]
    used = set()
    for i, (policy, feature, thresholds) in enumerate(POLICIES):
        ids = prompts[i % 2]  # every policy on one of the two prompts, each prompt under three policies
        if policy != "static":  # the tiny model's thresholds: re-centred on SmolLM2's scores
            thresholds = None if feature == "path_value" else thresholds
        cfg = mtprobe.EntMTPConfig(policy=policy, feature=feature, thresholds=thresholds)
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=40, do_sample=False)
        assert torch.equal(out.sequences, greedy(model, ids, 40)), (policy, feature)
        used |= {c for c, _ in out.choices}
    assert len(used - {"none"}) >= 3  # the policies did switch between trees


def test_the_log_explains_every_step(smollm2):
    """The recorded candidates and the true continuation reproduce what verification accepted: the
    frontier's one-step estimates rest on this."""
    model, tok = smollm2
    ids = chat_ids(tok, [{"role": "user", "content": "Name the planets of the solar system in order."}])
    bank = TopologyBank(trees=(chain_tree([3]), chain_tree([8])))
    cfg = mtprobe.EntMTPConfig(
        bank=bank, policy="hysteretic", trees=(0, 1), feature="top1", thresholds=(0.5, 0.8), record_steps=True
    )
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=48, do_sample=False)
    seq = out.sequences[0].tolist()
    log = out.topology_log
    n = len(log["positions"])
    assert n >= out.steps - 1 and log["candidates"].shape[1:] == (1, out.topology_log["candidates"].shape[2])
    root = ids.shape[1]
    checked = 0
    for j, (name, _) in enumerate(out.choices):
        assert log["positions"][j] == root  # step j's root: the first token after step j - 1's
        if name != "none" and root + 1 < len(seq):
            i = int(name.removeprefix("tree"))
            ranks = true_ranks(log["candidates"][j].tolist(), seq, root, bank.prune)
            assert bank.topology(i).accepted_depth(ranks) == out.accept_lengths[j] - 1
            checked += 1
            if j > 0:
                assert log["trees"][j] == i  # chosen from the features logged with step j's candidates
        root += out.accept_lengths[j]
    assert checked >= out.steps - 2 and max(out.accept_lengths) > 1
    # Calibration's replay picks the trees the drafter picked.
    recs = [
        StepRecord(0, tuple(true_ranks(c, seq, p, bank.prune)), tuple(f))
        for p, c, f in zip(log["positions"], log["candidates"].tolist(), log["features"], strict=True)
    ]
    accepted = [[bank.topology(i).accepted_depth(list(r.ranks)) for i in range(2)] for r in recs]
    live = [int(c.removeprefix("tree")) for c, _ in out.choices[: out.steps - 2]]
    assert replay_policy(recs, accepted, "hysteretic", [0, 1], [0.5, 0.8], "top1")[: len(live)] == live
    assert len(set(live)) == 2  # it switched


def test_switching_trees_reuses_their_mask_patterns():
    model = tiny_llama()
    bank = TopologyBank(trees=(chain_tree([1]), chain_tree([3]), chain_tree([6])))
    cfg = mtprobe.EntMTPConfig(bank=bank, policy="ladder", feature="top1", thresholds=(0.08, 0.12))
    drafter = entmtp_drafter(model, cfg)
    ids = torch.tensor(REPEATING)
    loop = cpu_decode_loop(
        model, drafter, max_new_tokens=60, block_complexity=cfg.block_complexity, prompt_len=len(ids)
    )
    result = loop.run(ids)
    used = [c for c in drafter.tree_choices() if c >= 0]
    switches = sum(a != b for a, b in zip(used, used[1:], strict=False))
    assert len(set(used)) >= 2 and switches >= 4
    # One pattern per shape: every later switch back is a lookup, not a rebuild.
    assert result.mask_rebuilds <= len(set(used)) + 1  # + the prefill's block


def test_true_ranks_follow_pruning():
    # Depth 1: 7 is the root, so 9 has rank 0 (7 skipped); depth 2: 9 is the parent, 4 has rank 0.
    assert true_ranks([[7, 9, 3], [9, 4, 8]], [7, 9, 4], pos=0, prune=True) == [0, 0]
    assert true_ranks([[7, 9, 3], [9, 4, 8]], [7, 9, 4], pos=0, prune=False) == [1, 1]
    assert true_ranks([[7, 9, 3], [9, 4, 8]], [7, 5, 4], pos=0, prune=True) == [-1, -1]  # below a miss
    assert true_ranks([[7, 9, 3], [9, 4, 8]], [7, 9], pos=0, prune=True) == [0, -1]  # past the end


def _records(ranks_list, rollout=0, features=(0.5, 0.5, 1.0, 0.0)):
    return [StepRecord(rollout, tuple(r), features) for r in ranks_list]


def test_acceptance_frontier_by_hand():
    # 10 steps, k = 2: ranks (0, 0) x4, (0, 1) x1, (1, 0) x3, (2, -1) x2.
    recs = _records([(0, 0)] * 4 + [(0, 1)] + [(1, 0)] * 3 + [(2, -1)] * 2)
    frontier = acceptance_frontier(recs, depth=2, max_nodes=6)
    # (0,) reaches 5 steps; then (0, 0) 4 and (1,) 3 -> (0, 0); then (1,) 3; then (1, 0) 3 vs (2,) 2.
    assert frontier == [
        ((0,),),
        ((0,), (0, 0)),
        ((0,), (0, 0), (1,)),
        ((0,), (0, 0), (1,), (1, 0)),
        ((0,), (0, 0), (1,), (1, 0), (2,)),
    ]
    # Ties go to the smaller rank sum, then the shallower node: (0, 1) reaches 1 step like (2,) does
    # not exist here, so with max_rank = 0 only depth can grow.
    assert acceptance_frontier(recs, depth=2, max_nodes=3, max_rank=0) == [((0,),), ((0,), (0, 0))]


def test_simulated_policies_by_hand():
    # Two trees: a root alone (accepts nothing, costs 1 s) and one draft (costs 2 s).
    recs = _records([(0,), (0,), (-1,), (0,)], features=(0.9, 0.9, 0.0, 0.0))
    bank = TopologyBank(trees=((), ((0,),)))
    accepted = [[bank.topology(i).accepted_depth(list(r.ranks)) for i in range(2)] for r in recs]
    assert accepted == [[0, 1], [0, 1], [0, 0], [0, 1]]
    costs = [1.0, 2.0]
    # Static on tree 1: 4 steps, 3 + 4 = 7 tokens in 8 s.
    assert simulate_policy(recs, accepted, costs, "static", [1], [], "path_value") == pytest.approx(7 / 8)
    # Static on tree 0: 4 tokens in 4 s.
    assert simulate_policy(recs, accepted, costs, "static", [0], [], "path_value") == pytest.approx(1.0)
    # Hysteretic (down 0.5, up 0.8) on path value 0.9 every step: tree 1 from the first step on (a step's
    # own features pick its tree), 7 tokens in 8 s.
    rate = simulate_policy(recs, accepted, costs, "hysteretic", [0, 1], [0.5, 0.8], "path_value")
    assert rate == pytest.approx(7 / 8)
    # Path values 0.9, 0.9, 0.0, 0.6: tree 1, 1, then 0 (0.0 < down), and 0 again (0.6 is not above up):
    # 2 + 2 + 1 + 1 tokens in 6 s.
    varied = [
        StepRecord(0, r.ranks, (0.5, v, 1.0, 0.0)) for r, v in zip(recs, (0.9, 0.9, 0.0, 0.6), strict=True)
    ]
    assert replay_policy(varied, accepted, "hysteretic", [0, 1], [0.5, 0.8], "path_value") == [1, 1, 0, 0]
    rate = simulate_policy(varied, accepted, costs, "hysteretic", [0, 1], [0.5, 0.8], "path_value")
    assert rate == pytest.approx(6 / 6)
    # The accept feature is replayed: on tree 0 nothing is ever accepted, so the ladder never climbs.
    assert simulate_policy(recs, accepted, costs, "ladder", [0, 1], [0.5], "accept") == pytest.approx(1.0)
    best = calibrate_policies(recs, bank, costs)
    assert best["static"]["trees"] == [0] and best["static"]["simulated_tokens_per_s"] == pytest.approx(1.0)
    assert set(best) == {"static", "ladder", "hysteretic"}


def test_an_accept_driven_policy_never_switches_to_the_root_alone():
    # On the root alone nothing is accepted: the accept EMA would stay at 0 and the policy there.
    bank = TopologyBank(trees=((), ((0,),), chain_tree([3])))
    assert policy_trees(bank, "accept") == [1, 2]
    assert policy_trees(bank, "top1") == policy_trees(bank, "path_value") == [0, 1, 2]
    recs = _records([(0,), (1,), (2,), (-1,)] * 5)
    accepted = [[bank.topology(i).accepted_depth(list(r.ranks)) for i in range(3)] for r in recs]
    # Replayed from the root alone with a threshold it can never reach, the ladder would stay there.
    assert set(replay_policy(recs, accepted, "ladder", [0, 1, 2], [0.5, 0.9], "accept")) == {0}
    best = calibrate_policies(recs, bank, [1.0, 1.1, 1.2])
    for p in best.values():
        assert p["feature"] != "accept" or 0 not in p["trees"]


def test_build_bank_end_to_end(tmp_path):
    model = tiny_llama()
    # A flat profile (GPU-like): bigger trees cost nothing extra, so the largest useful tree is best. A
    # second a forward: the drafter's own milliseconds per step do not decide.
    profile = ForwardProfile(ProfileKey.of(model), (1, 64), (0,), ((1.0, 1.0),))
    prompts = [torch.tensor([REPEATING]), torch.tensor([[4, 2, 9, 4, 2, 9, 4, 2, 11, 3]])]
    messages = []
    bank = build_bank(
        model,
        prompts,
        max_nodes=5,
        debias_sizes=(1, 2, 4),
        max_new_tokens=24,
        profile=profile,
        progress=messages.append,
    )
    assert messages and bank.trees[0] == () and bank.model == mtprobe.topology.model_fingerprint(model)
    taus = [bank.stats["debiased_tau"][str(len(t))] for t in bank.trees]
    assert taus == sorted(taus) and len(set(taus)) == len(taus)  # each kept tree raises tau
    assert bank.best == len(bank.trees) - 1  # flat cost: the highest tau wins
    assert set(bank.policies) == {"static", "ladder", "hysteretic"}
    # A step costs its forward plus the drafter's own time, measured in the tree's rollout.
    overhead = bank.stats["drafter_seconds_per_step"]
    assert len(overhead) == len(bank.trees) and all(0 < s < 0.5 for s in overhead)
    for i, t in enumerate(bank.trees):
        rate = bank.stats["debiased_tau"][str(len(t))] / (1.0 + overhead[i])
        assert bank.stats["predicted_tokens_per_s"][i] == pytest.approx(rate)
    for p in bank.policies.values():
        assert p["feature"] != "accept" or 0 not in p["trees"]  # never stuck on the root alone
    path = bank.save(tmp_path / "b.json")
    for policy in ("static", "ladder", "hysteretic"):
        cfg = mtprobe.EntMTPConfig(bank=str(path), policy=policy)
        out = mtprobe.generate(model, prompts[0], cfg, max_new_tokens=24, do_sample=False)
        assert torch.equal(out.sequences, model.generate(prompts[0], do_sample=False, max_new_tokens=24))
    with pytest.raises(ValueError, match="another setting"):
        mtprobe.generate(
            tiny_llama(seed=3), prompts[0], mtprobe.EntMTPConfig(bank=str(path)), max_new_tokens=4
        )


def test_default_bank_shapes():
    assert [len(t) for t in default_bank(1, 10).trees] == [0, 1, 2, 4]
    b2 = default_bank(2, 60)
    assert [len(t) for t in b2.trees] == [0, 1, 2, 4, 8, 19] and b2.block_complexity == 60
    assert all(b2.topology(i).max_depth <= 2 for i in range(len(b2.trees)))
    with pytest.raises(ValueError, match="leaves no draft"):
        default_bank(2, 5)


# --- EntMTP over a circuit head (csrc/drafters/heads.h) ----------------------------------------------


def _fixed_ff_head(vocab: int, ranked: list[int], window: int = 3):
    """An FF head whose emissions never change: at every window position the tokens ``ranked`` come
    first, in that order, then all the others; all probabilities distinct (ranks are unambiguous)."""
    e = torch.rand(window, vocab, generator=torch.Generator().manual_seed(0)) * 1e-3  # [n, V]
    for i, t in enumerate(ranked):
        e[:, t] = 1.0 - 0.05 * i
    logq = (e / e.sum(-1, keepdim=True)).log()
    order = torch.argsort(e[1], descending=True).tolist()  # the same at every position
    return (lambda hidden, logits, prefix_len: [torch.empty(0), torch.empty(0), logq]), order


def test_a_heads_bank_drafts_the_heads_ranked_tokens():
    # Node (r_1, r_2) drafts the r_2-th most probable token after the r_1-th: for an FF head the
    # emissions' own order at each depth. The logged ranks, worked out here from the emissions alone,
    # explain what verification accepted at every step, and the output is greedy's.
    model = tiny_llama()
    prompt, new = torch.tensor(REPEATING), 40
    seq = model.generate(prompt[None], do_sample=False, max_new_tokens=new)[0].tolist()
    ranked = list(dict.fromkeys(seq[len(REPEATING) :]))
    random.Random(1).shuffle(ranked)
    head, order = _fixed_ff_head(model.config.vocab_size, ranked[:12])
    paths = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
    topo = _C.Topology([list(p) for p in paths])
    drafter = _C.HeadsDrafter(
        head,
        circuit="ff",
        window=3,
        rank=1,
        vocab=model.config.vocab_size,
        bank=[topo],
        policy=_C.TopologyPolicy("static", [0], [], bank_size=1),
        record=True,
    )
    assert drafter.bank_width == 16
    out = cpu_decode_loop(model, drafter, max_new_tokens=new, block_complexity=7, prompt_len=len(prompt)).run(
        prompt
    )
    assert out.sequence == seq
    steps = len(out.accept_lengths)  # every step but the last (short of room) drafts the whole tree
    assert list(out.drafted_per_depth) == [3 * (steps - 1), 3 * (steps - 1)], (out.drafted_per_depth, steps)
    log = drafter.step_log()

    def rank(t: int) -> int:
        return order.index(t) if order.index(t) < 16 else -1  # the shortlist: the 16 most probable

    root, checked = len(prompt), 0
    for j, accepted in enumerate(out.accept_lengths):
        want = [rank(seq[root + d]) if root + d < len(seq) else -1 for d in (1, 2)]
        want[1] = -1 if want[0] < 0 else want[1]  # below a miss
        assert log["positions"][j] == root and log["ranks"][j] == want, j
        if root + 3 < len(seq):  # not cut short by the end
            assert topo.accepted_depth(want) == accepted - 1, j
            checked += 1
        root += accepted
    assert checked >= len(out.accept_lengths) - 2 and max(out.accept_lengths) > 1
    assert drafter.tree_choices() == [0] * (steps - 1) + [-1]


@pytest.fixture(scope="module")
def tiny_head(tmp_path_factory):
    """A tiny Llama and a CP head of window 3 trained briefly on its own greedy text."""
    from mtprobe import heads
    from mtprobe.offline import heads as offline_heads
    from mtprobe.offline.calibration_data import calibration_sequences

    model = tiny_llama(seed=5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 96, (1, 5 + i % 4), generator=g) for i in range(8)]
    seqs = calibration_sequences(model, prompts, max_new_tokens=40)
    features = offline_heads.compute_features(model, [(ids, plen - 1) for ids, plen in seqs])
    torch.manual_seed(0)
    spec = heads.HeadSpec("cp", window=3, rank=2, hidden_size=model.config.hidden_size, vocab_size=96)
    head = heads.new_head(model, spec)
    folder = tmp_path_factory.mktemp("cp3")
    heads.save_head(
        head, model, folder, offline_heads.train_head(head, features, steps=150, batch_size=32, lr=3e-3)
    )
    return model, str(folder), prompts


def test_build_a_heads_bank_end_to_end(tiny_head, tmp_path):
    from mtprobe import heads

    model, path, prompts = tiny_head
    profile = ForwardProfile(ProfileKey.of(model), (1, 64), (0,), ((1.0, 1.0),))  # flat: size is free
    cfg = mtprobe.HeadsConfig(path=path, block_complexity=30)
    bank = build_bank(
        model, prompts[:4], head=cfg, max_nodes=7, debias_sizes=(1, 3, 6), max_new_tokens=24, profile=profile
    )
    assert bank.drafter == "heads" and bank.num_masks == 0 and bank.window == 3 and bank.vocab_top_k is None
    assert bank.head == heads.load_head(path, model).fingerprint() and bank.trees[0] == ()
    assert all(bank.topology(i).max_depth <= 2 for i in range(len(bank.trees)))
    taus = [bank.stats["debiased_tau"][str(len(t))] for t in bank.trees]
    assert len(bank.trees) >= 2 and taus == sorted(taus) and taus[-1] > 1.2
    assert bank.block_size(len(bank.trees) - 1) == len(bank.trees[-1]) + 1  # no mask inputs
    saved = bank.save(tmp_path / "heads.json")
    assert TopologyBank.load(saved) == bank
    for policy in ("static", "ladder", "hysteretic"):
        config = mtprobe.HeadsConfig(path=path, bank=str(saved), policy=policy)
        for ids in prompts[4:6]:
            out = mtprobe.generate(model, ids, config, max_new_tokens=24, do_sample=False)
            assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=24)), policy
            assert all(c.startswith("tree") for c, _ in out.choices[:-2]), out.choices


@pytest.mark.parametrize("feature", ["top1", "accept"])
def test_the_offline_replay_picks_the_trees_the_drafter_picked(tiny_head, feature):
    # Calibration replays recorded steps to score a policy; with the tree the replay picks at every
    # step equal to the live drafter's, its simulated rates are the drafter's own.
    model, path, prompts = tiny_head
    bank = TopologyBank(
        trees=((), ((0,),), ((0,), (1,), (0, 0), (0, 1))), drafter="heads", num_masks=0, window=3
    )
    # The target's top-1 probability is 0.1 - 0.5 here; on tree 1 (one draft) the accept EMA is in [0, 1].
    trees, thresholds = ((0, 2), (0.15, 0.2)) if feature == "top1" else ((1, 2), (0.5, 0.8))
    cfg = mtprobe.HeadsConfig(
        path=path,
        bank=bank,
        policy="hysteretic",
        trees=trees,
        thresholds=thresholds,
        feature=feature,
        record_steps=True,
    )
    used: set[int] = set()
    for ids in prompts[:4]:
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=30, do_sample=False)
        log = out.topology_log
        recs = [StepRecord(0, tuple(r), tuple(f)) for r, f in zip(log["ranks"], log["features"], strict=True)]
        accepted = [[bank.topology(i).accepted_depth(list(r.ranks)) for i in range(3)] for r in recs]
        live = [-1 if c == "none" else int(c.removeprefix("tree")) for c, _ in out.choices]
        steps = len(live) - 2  # the last steps may be cut short by the end, which the replay does not know
        replayed = replay_policy(recs, accepted, "hysteretic", list(trees), thresholds, feature)
        assert replayed[:steps] == live[:steps] == log["trees"][:steps]
        assert [accepted[s][t] + 1 for s, t in enumerate(live)][:steps] == out.accept_lengths[:steps]
        assert torch.equal(out.sequences, model.generate(ids, do_sample=False, max_new_tokens=30))
        used |= set(live[:steps])
    assert used == set(trees)  # the policy did switch


def test_heads_bank_refusals(tiny_head):
    model, path, prompts = tiny_head
    tree = ((0,), (1,), (0, 0))
    bank = TopologyBank(trees=(tree,), drafter="heads", num_masks=0, window=3)
    with pytest.raises(ValueError, match="reaches depth 3, but a head of window 3 drafts depths 1..2"):
        TopologyBank(trees=(((0,), (0, 0), (0, 0, 0)),), drafter="heads", num_masks=0, window=3)
    with pytest.raises(ValueError, match="num_masks=1 must be 0 for a head's bank"):
        TopologyBank(trees=(tree,), drafter="heads", window=3)
    with pytest.raises(ValueError, match="needs the head's window"):
        TopologyBank(trees=(tree,), drafter="heads", num_masks=0)
    with pytest.raises(ValueError, match="describe a circuit head's bank"):
        TopologyBank(trees=(tree,), window=3)
    with pytest.raises(ValueError, match="'probe'.*or a circuit head"):
        TopologyBank(trees=(tree,), drafter="medusa")
    with pytest.raises(ValueError, match="HeadsConfig needs a bank of 'heads' trees; this one holds 'probe'"):
        mtprobe.HeadsConfig(path=path, bank=TopologyBank(trees=(tree,), num_masks=2))
    with pytest.raises(ValueError, match="EntMTPConfig needs a bank of 'probe' trees.*HeadsConfig"):
        mtprobe.EntMTPConfig(bank=bank)
    with pytest.raises(ValueError, match="policy, record_steps set without bank"):
        mtprobe.HeadsConfig(path=path, policy="ladder", record_steps=True)
    with pytest.raises(ValueError, match="needs block_complexity 4, above block_complexity=3"):
        mtprobe.HeadsConfig(path=path, bank=bank, block_complexity=3)
    with pytest.raises(ValueError, match="switch-down 0.9.* is above switch-up 0.1"):
        mtprobe.HeadsConfig(path=path, bank=bank, policy="hysteretic", trees=(0, 0), thresholds=(0.9, 0.1))
    ids = prompts[0]
    wide = TopologyBank(trees=(tree,), drafter="heads", num_masks=0, window=4)
    other = TopologyBank(trees=(tree,), drafter="heads", num_masks=0, window=3, head="cp:000000000000")
    restricted = dataclasses_replace(
        bank, head=mtprobe.heads.load_head(path, model).fingerprint(), vocab_top_k=8
    )
    for b, match in [
        (wide, "for a head of window 4, not 3"),
        (other, r"built for another circuit head \(cp:000000000000"),
        (restricted, "built with vocab_top_k=8, not None"),
    ]:
        with pytest.raises(ValueError, match=match):
            mtprobe.generate(model, ids, mtprobe.HeadsConfig(path=path, bank=b), max_new_tokens=4)
    with pytest.raises(ValueError, match="another setting"):  # another model: its own head is refused first
        mtprobe.generate(
            model,
            ids,
            mtprobe.HeadsConfig(path=path, bank=dataclasses_replace(bank, model="X:1")),
            max_new_tokens=4,
        )


@pytest.mark.parametrize("flag", [["--vocab-top-k", "8"], ["--head-dtype", "bfloat16"]])
def test_the_command_line_refuses_head_settings_without_a_head(flag, capsys):
    from mtprobe.cli import main

    assert main(["topology", *flag, "--out", "bank.json"]) == 2
    assert f"{flag[0]} is a circuit head's setting: give --head DIR too" in capsys.readouterr().err


def test_bucket_sizes_fill_the_plan_buckets():
    from mtprobe.offline.topology import bucket_sizes

    # probing, one mask: nodes 1, 2, 4, ..., 32 fill 2, 4, ..., 64 inputs exactly
    assert bucket_sizes((1, 2, 4, 8, 16, 32, 64), 2) == (32, (1, 3, 7, 15, 31))
    # a head drafts no masks: one input per node
    assert bucket_sizes((1, 2, 4, 8), 1) == (8, (1, 3, 7))
    # three inputs per node: the largest tree under each bucket
    assert bucket_sizes((8, 16, 64), 3) == (21, (1, 4, 20))
    with pytest.raises(ValueError, match="hold no tree with a draft at 3 inputs per node"):
        bucket_sizes((1, 2, 4), 3)
    with pytest.raises(ValueError, match="buckets must be positive ints"):
        bucket_sizes((0, 4), 2)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--buckets", "4,x"], "--buckets 4,x: invalid literal"),
        (["--buckets", "1,2"], "hold no tree with a draft at 2 inputs per node"),
        (["--buckets", "8,16", "--max-nodes", "9"], "leave out --max-nodes and --debias-sizes"),
    ],
)
def test_the_command_line_checks_buckets(argv, message, capsys):
    from mtprobe.cli import main

    assert main(["topology", *argv, "--out", "bank.json"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--dtype", "bfloat16"], "--dtype bfloat16 needs --device cuda (the device here is cpu)"),
        *(
            []
            if torch.cuda.is_available()
            else [(["--device", "cuda"], "--device cuda: this torch"), (["--device", "cuda"], "--device cpu")]
        ),
    ],
)
def test_the_command_line_checks_the_device_before_loading(argv, message, capsys, monkeypatch):
    import mtprobe.cli.topology as cli

    monkeypatch.setattr(cli, "calibration_prompts", lambda args: pytest.fail("loaded before the check"))
    assert cli_main(["topology", *argv, "--out", "bank.json"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_the_command_line_builds_on_the_device_it_names(device, monkeypatch, tmp_path):
    # --device auto on a machine without CUDA is the CPU; the model reaches build_bank there, float32.
    import mtprobe.cli.topology as cli

    seen = {}

    def fake_build(model, ids, **kw):
        seen["param"] = next(model.parameters())
        raise SystemExit(0)

    monkeypatch.setattr(cli, "build_bank", fake_build)
    monkeypatch.setattr(cli, "calibration_prompts", lambda args: (tiny_llama(), None, []))
    with pytest.raises(SystemExit):
        cli_main(["topology", "--device", device, "--out", str(tmp_path / "b.json")])
    want = "cuda" if device == "auto" and torch.cuda.is_available() else "cpu"
    assert seen["param"].device.type == want and seen["param"].dtype == torch.float32


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_bank_built_on_the_gpu_names_its_device_and_dtype(tmp_path):
    from mtprobe.topology.bank import TopologyBank

    out = tmp_path / "b.json"
    argv = ["topology", "--model", "smollm2-135m", "--device", "cuda", "--dtype", "bfloat16"]
    argv += ["--buckets", "1,2,4,8", "--num-prompts", "2", "--max-new-tokens", "16", "--out", str(out)]
    assert cli_main(argv) == 0
    bank = TopologyBank.load(out)
    assert bank.device.startswith("cuda") and bank.dtype == "bfloat16"


def test_the_command_line_builds_the_bank_of_the_buckets(monkeypatch, capsys, tmp_path):
    import mtprobe.cli.topology as cli

    seen = {}

    def fake_build(model, ids, **kw):
        seen.update(kw)
        raise SystemExit(0)

    monkeypatch.setattr(cli, "build_bank", fake_build)
    monkeypatch.setattr(cli, "calibration_prompts", lambda args: (None, None, []))
    from mtprobe.cli import main

    with pytest.raises(SystemExit):
        main(
            [
                "topology",
                "--buckets",
                "1,2,4,8,16,32,64",
                "--num-masks",
                "1",
                "--out",
                str(tmp_path / "b.json"),
            ]
        )
    assert seen["max_nodes"] == 32 and tuple(seen["debias_sizes"]) == (1, 3, 7, 15, 31)


def test_the_command_line_refuses_a_profile_from_another_device(capsys, monkeypatch, tmp_path):
    # A profile measured on a GPU, given to a CPU build: one line naming the field, exit 2, no rollout.
    import mtprobe.cli.topology as cli

    model = tiny_llama()
    key = ProfileKey.of(model)
    gpu = ProfileKey(**{**key.__dict__, "device": "cuda (NVIDIA H100 80GB HBM3)", "threads": 0, "isa": ""})
    path = ForwardProfile(gpu, (1, 2), (0,), ((1.0, 1.1),)).save(tmp_path / "gpu.json")
    monkeypatch.setattr(cli, "calibration_prompts", lambda args: (model, None, [torch.tensor([[1, 2, 3]])]))
    assert cli_main(["topology", "--profile", str(path), "--out", str(tmp_path / "b.json")]) == 2
    err = capsys.readouterr().err
    assert "measured for another setting (device: profile 'cuda (NVIDIA H100 80GB HBM3)'" in err
    assert "Traceback" not in err and not (tmp_path / "b.json").exists()
