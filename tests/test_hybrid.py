"""The hybrid drafter: the tree merge (reference by hand, C++ against the reference), lossless
decoding, the budget, both sources drafting, bad configurations."""

from __future__ import annotations

import random

import pytest
import torch

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.drafters import hybrid_drafter
from mtprobe.reference.draft_tree import mask_source, merge_trees, plan_masks

# --- the merge -----------------------------------------------------------------------------------

A = ([7, 5, 9], [-1, 0, 0], [1.0, 0.6, 0.3])
B = ([7, 5, 4, 2], [-1, 0, 1, 0], [1.0, 1.0, 1.0, 0.2])


def test_merge_worked_example():  # csrc/core/draft_tree.h
    expected = ([7, 5, 9, 4], [-1, 0, 0, 1], [1.0, 1.0, 0.3, 1.0])
    assert merge_trees(A, B, 4) == expected
    assert _C.merge_draft_trees(*A, *B, 4) == expected


def test_merge_budget_and_empty_sides():
    assert merge_trees(A, B, 1) == ([7], [-1], [1.0])
    assert merge_trees(A, B, 100) == ([7, 5, 9, 4, 2], [-1, 0, 0, 1, 0], [1.0, 1.0, 0.3, 1.0, 0.2])
    empty = ([], [], [])
    assert merge_trees(empty, B, 3) == ([7, 5, 4], [-1, 0, 1], [1.0, 1.0, 1.0])
    assert merge_trees(A, empty, 2) == ([7, 5], [-1, 0], [1.0, 0.6])
    assert merge_trees(empty, empty, 5) == ([], [], [])
    assert _C.merge_draft_trees(*empty, *B, 3) == merge_trees(empty, B, 3)
    assert _C.merge_draft_trees(*empty, *empty, 5) == ([], [], [])


def test_merge_ties_prefer_the_node_met_first():
    a = ([1, 2], [-1, 0], [1.0, 0.5])
    b = ([1, 3], [-1, 0], [1.0, 0.5])
    assert merge_trees(a, b, 2) == ([1, 2], [-1, 0], [1.0, 0.5])
    assert merge_trees(b, a, 2) == ([1, 3], [-1, 0], [1.0, 0.5])


def _random_tree(rng: random.Random, root: int) -> tuple[list[int], list[int], list[float]]:
    tokens, parents, probs = [root], [-1], [1.0]
    for _ in range(rng.randint(0, 12)):
        parent = rng.randrange(len(tokens))
        tokens.append(rng.randint(0, 3))  # few tokens: the two trees share paths
        parents.append(parent)
        probs.append(probs[parent] * rng.choice([1.0, 0.75, 0.5, 0.25]))  # dyadic: exact ties
    return tokens, parents, probs


@pytest.mark.parametrize("seed", range(4))
def test_cpp_merge_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(200):
        a, b = _random_tree(rng, 9), _random_tree(rng, 9)
        budget = rng.randint(0, 20)
        got = _C.merge_draft_trees(*a, *b, budget)
        assert got == tuple(merge_trees(a, b, budget))
        tokens, parents, probs = got
        assert len(tokens) <= max(budget, 1)
        assert all(parents[i] < i and probs[i] <= probs[parents[i]] for i in range(1, len(tokens)))


def test_merge_rejects_a_malformed_tree():
    with pytest.raises(ValueError, match="parents before children"):
        _C.merge_draft_trees([1, 2], [-1, 1], [1.0, 0.5], [], [], [], 3)


# --- the mask plan (HybridConfig.mask_value) ----------------------------------------------------

PLAN_EXAMPLE = ([7, 5, 4, 9], [-1, 0, 1, 0], [1.0, 0.9, 0.8, 0.01])


def test_plan_worked_example():  # csrc/core/draft_tree.h
    expected = ([7, 5, 4], [-1, 0, 1], [1.0, 0.9, 0.8], [True, False, True])
    assert plan_masks(PLAN_EXAMPLE, 5, 1, 0.3) == expected
    assert _C.plan_mask_carriers(*PLAN_EXAMPLE, 5, 1, 0.3) == expected


def test_plan_extremes():
    star = ([7, 1, 2, 3, 4], [-1, 0, 0, 0, 0], [1.0, 0.5, 0.25, 0.125, 0.0625])
    # Masks worth nothing: the best inputs - 1 nodes and no masks.
    assert _C.plan_mask_carriers(*star, 5, 1, 0.0) == (*star, [False] * 5)
    # Masks worth more than any draft: every node masked (seed 001's rule, B = inputs / (k + 1)).
    assert _C.plan_mask_carriers(*star, 6, 1, 100.0) == ([7, 1, 2], [-1, 0, 0], [1.0, 0.5, 0.25], [True] * 3)
    assert _C.plan_mask_carriers(*star, 9, 2, 100.0)[3] == [True] * 3
    # A chain of sure nodes ends only at its leaf: one mask there, the rest drafts.
    chain = ([7, 1, 2, 3], [-1, 0, 1, 2], [1.0, 1.0, 1.0, 1.0])
    assert _C.plan_mask_carriers(*chain, 5, 1, 0.5) == (*chain, [False, False, False, True])
    assert _C.plan_mask_carriers([], [], [], 5, 1, 0.3) == ([], [], [], [])
    assert _C.plan_mask_carriers([7], [-1], [1.0], 1, 1, 0.3) == ([7], [-1], [1.0], [False])  # no room


@pytest.mark.parametrize("seed", range(3))
def test_cpp_plan_matches_brute_force(seed):
    rng = random.Random(seed)
    for _ in range(150):
        a, b = _random_tree(rng, 9), _random_tree(rng, 9)
        tree = merge_trees(a, b, 8)  # the hybrid plans its merged tree; <= 8 nodes for the brute force
        if not tree[0]:
            continue
        inputs, k = rng.randint(1, 12), rng.randint(1, 2)
        mask_value = rng.choice([0.0, 0.25, 0.5, 1.0, 4.0])
        got = _C.plan_mask_carriers(*tree, inputs, k, mask_value)
        assert got == plan_masks(tree, inputs, k, mask_value), (tree, inputs, k, mask_value)
        tokens, parents, _, carries = got
        assert len(tokens) + k * sum(carries) <= inputs  # the budget holds
        assert all(0 <= parents[i] < i for i in range(1, len(tokens)))  # a tree, parents first


def test_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="mask_value must be a finite number >= 0"):
        _C.plan_mask_carriers(*PLAN_EXAMPLE, 5, 1, -1.0)
    with pytest.raises(ValueError, match="inputs and k must be >= 1"):
        _C.plan_mask_carriers(*PLAN_EXAMPLE, 5, 0, 0.3)
    with pytest.raises(ValueError, match="parents before children"):
        _C.plan_mask_carriers([1, 2], [-1, 1], [1.0, 0.5], 5, 1, 0.3)


# --- the masks a step reads after ending where planned masks left none ----------------------------


def test_mask_source_worked_example():  # csrc/core/draft_tree.h
    assert (
        _C.mask_source([3, 5], [-1, -1, -1, 9, -1, -1], 2)
        == mask_source([3, 5], [-1, -1, -1, 9, -1, -1], 2)
        == (9, 1)
    )
    assert _C.mask_source([3, 5, 6], [-1, -1, -1, 9, -1, -1, -1], 2) == (
        -1,
        0,
    )  # two up: k = 2 reaches no depth
    assert _C.mask_source([3, 5, 6], [-1, -1, -1, 9, -1, -1, 11], 2) == (11, 0)  # its own masks first
    with pytest.raises(ValueError, match="k must be >= 1"):
        _C.mask_source([3], [9], 0)


@pytest.mark.parametrize("seed", range(2))
def test_cpp_mask_source_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(300):
        n = rng.randint(1, 12)
        mask_input = [rng.choice([-1, -1, rng.randint(n, 40)]) for _ in range(n)]
        path = sorted(
            rng.sample(range(n + 2), rng.randint(0, min(5, n + 2)))
        )  # may name nodes past the table
        k = rng.randint(1, 4)
        assert _C.mask_source(path, mask_input, k) == mask_source(path, mask_input, k), (path, mask_input, k)


# --- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=24, eos_token_id=23)


@pytest.mark.parametrize("mask_value, grow_probed", [(None, False), (0.5, False), (None, True), (0.5, True)])
@pytest.mark.parametrize("block_complexity, num_masks", [(4, 1), (10, 1), (30, 1), (60, 2), (30, 3)])
def test_lossless_on_tiny_llama(tiny, block_complexity, num_masks, mask_value, grow_probed):
    cfg = mtprobe.HybridConfig(
        block_complexity=block_complexity, num_masks=num_masks, mask_value=mask_value, grow_probed=grow_probed
    )
    gen = torch.Generator().manual_seed(block_complexity + num_masks)
    for length in (1, 9, 50):
        prompt = torch.randint(0, 6, (1, length), generator=gen)
        for max_new in (1, 3, 40):
            ref = tiny.generate(prompt, do_sample=False, max_new_tokens=max_new)
            out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref), (length, max_new)


@pytest.mark.parametrize("prompt_logits", [0, 3])
def test_lossless_with_fewer_prompt_logits(tiny, prompt_logits):
    # The n-gram half seeds its store from the prompt's last prompt_logits positions only (the prefill
    # skips the LM head over the rest, zeros there); probing reads the masks' rows as before.
    cfg = mtprobe.HybridConfig(block_complexity=30, prompt_logits=prompt_logits)
    gen = torch.Generator().manual_seed(5)
    for length in (1, 9, 50):
        prompt = torch.randint(0, 6, (1, length), generator=gen)
        ref = tiny.generate(prompt, do_sample=False, max_new_tokens=30)
        out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
        assert torch.equal(out.sequences, ref), length


def test_prompt_logits_reach_the_n_gram_half(tiny, monkeypatch):
    # The configuration's count reaches the binding, and the binding's reaches STAND's options in C++
    # (whose own check names a negative count).
    seen: dict = {}
    real = _C.HybridDrafter

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(_C, "HybridDrafter", spy)
    hybrid_drafter(tiny, mtprobe.HybridConfig(prompt_logits=3))
    assert seen["prompt_logits"] == 3
    kwargs = {**seen, "prompt_logits": -1}
    with pytest.raises(
        ValueError, match=r"prompt_logits must be None \(every prompt position\) or >= 0, got -1"
    ):
        real(tiny.get_input_embeddings().weight, **kwargs)


class Recorder(_C.Drafter):
    """Wraps the hybrid drafter and records, per decode step, how many drafts came from each
    source and the block's size."""

    def __init__(self, inner) -> None:
        super().__init__()
        self.inner = inner
        self.steps: list[tuple[int, int, int, int]] = []  # (probe, ngram, drafts, inputs)

    def name(self):
        return "recorded_hybrid"

    def begin(self, prompt):
        self.inner.begin(prompt)

    def propose(self, committed, prefix_len, limits):
        block = self.inner.propose(committed, prefix_len, limits)
        if committed.shape[0] == 1:
            drafts = block.num_nodes - 1
            self.steps.append((self.inner.probe_nodes, self.inner.ngram_nodes, drafts, block.num_inputs))
        return block

    def observe(self, outcome):
        self.inner.observe(outcome)


def _recorded_steps(tiny, cfg: mtprobe.HybridConfig) -> list[tuple[int, int, int, int]]:
    """Decode a repetitive prompt (the store has matches) at BC 12, check it is greedy's output, and
    return the Recorder's steps."""
    drafter = Recorder(hybrid_drafter(tiny, cfg))
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]])
    loop = cpu_decode_loop(tiny, drafter, max_new_tokens=40, block_complexity=12, prompt_len=prompt.shape[1])
    seq = loop.run(prompt[0]).sequence
    assert seq == tiny.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)[0].tolist()
    return drafter.steps


def test_both_sources_draft_within_the_budget(tiny):
    cfg = mtprobe.HybridConfig(block_complexity=12)  # B = 6 nodes, each with its mask
    steps = _recorded_steps(tiny, cfg)
    assert all(inputs <= 12 and drafts <= 5 for _, _, drafts, inputs in steps)
    assert all(inputs == 2 * (drafts + 1) for _, _, drafts, inputs in steps if inputs > 2)
    # Both sources offered drafts on the same step, and the union had to choose.
    assert any(p > 0 and n > 0 and p + n > d for p, n, d, _ in steps)


@pytest.mark.parametrize("mask_value", [None, 0.5])
def test_grown_tree_drafts_within_the_budget_and_below_probed_nodes(tiny, mask_value):
    # grow_probed: one best-first tree, so the block never exceeds BC and, on a repetitive prompt,
    # holds store drafts besides probing's.
    cfg = mtprobe.HybridConfig(block_complexity=12, mask_value=mask_value, grow_probed=True)
    steps = _recorded_steps(tiny, cfg)
    assert all(inputs <= 12 for _, _, _, inputs in steps)
    if mask_value is None:
        assert all(drafts <= 5 and inputs == 2 * (drafts + 1) for _, _, drafts, inputs in steps if inputs > 2)
    assert any(p > 0 and n > 0 for p, n, _, _ in steps)  # both sources in one block
    assert all(n <= d for _, n, d, _ in steps)  # the store's count is of the block's own nodes


def test_planned_masks_draft_more_within_the_budget(tiny):
    # mask_value: masks only where the step is likely to end, so on a repetitive prompt (confident
    # n-gram chains) a step drafts more than B - 1 = 5 nodes, and never more inputs than BC.
    cfg = mtprobe.HybridConfig(block_complexity=12, mask_value=0.5)
    steps = _recorded_steps(tiny, cfg)
    assert all(inputs <= 12 for _, _, _, inputs in steps)
    assert any(drafts > 5 for _, _, drafts, _ in steps)
    assert any(inputs < 2 * (drafts + 1) for _, _, drafts, inputs in steps)  # some nodes unmasked


def test_smollm2_greedy_equality_and_gain_over_probing(smollm2):
    model, tok = smollm2
    text = "Repeat this list twice, exactly: apple, river, candle, mountain, violin, pepper, lantern, meadow."
    ids = chat_ids(tok, [{"role": "user", "content": text}])
    ref = model.generate(ids, do_sample=False, max_new_tokens=48)
    hybrid = mtprobe.generate(model, ids, mtprobe.HybridConfig(block_complexity=30), max_new_tokens=48)
    probe = mtprobe.generate(model, ids, mtprobe.ProbeConfig(block_complexity=30), max_new_tokens=48)
    grown = mtprobe.HybridConfig(block_complexity=30, grow_probed=True)
    assert torch.equal(mtprobe.generate(model, ids, grown, max_new_tokens=48).sequences, ref)
    assert torch.equal(hybrid.sequences, ref)
    assert torch.equal(probe.sequences, ref)
    # Text that repeats the prompt: the n-gram half must add what probing alone does not draft.
    assert hybrid.tau > probe.tau


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_complexity=3), "too small for 1 mask token"),
        (dict(num_masks=5), "num_masks=5 must be between 1 and 4"),
        (dict(max_depth=0), "max_depth=0 must be >= 1"),
        (dict(mask_lambda=2.0), "mask_lambda"),
        (dict(mask_init="zeros"), "mask_init"),
        (dict(mask_value=-0.5), "mask_value=-0.5 must be None .* or a finite number >= 0"),
        (dict(mask_value=float("inf")), "mask_value=inf must be None"),
        (dict(prompt_logits=-1), "prompt_logits=-1 must be >= 0"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mtprobe.HybridConfig(**kwargs)
    with pytest.raises(TypeError, match="mask_value must be None or a number >= 0, got '0.5'"):
        mtprobe.HybridConfig(mask_value="0.5")
    with pytest.raises(TypeError, match="grow_probed must be True or False, got 1"):
        mtprobe.HybridConfig(grow_probed=1)
