"""STAND: the reference (mtprobe.reference.stand) against hand-computed values (the cases of
tests/core/test_stand.cpp) and its relation to prompt lookup; the C++ store and tree against the
reference; lossless decoding with the STAND drafter."""

from __future__ import annotations

import random

import pytest
import torch

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.reference.prompt_lookup import prompt_lookup
from mtprobe.reference.stand import NgramStore, build_stand_tree


def example_store() -> NgramStore:  # the worked example of csrc/core/ngram_store.h
    store = NgramStore(2, 3)
    store.add([5, 6], [7, 8], [0.6, 0.2])
    store.add([6, 7], [9], [1.0])
    store.add([6, 8], [9, 7], [0.5, 0.5])
    return store


def history_store(seq: list[int], max_ngram: int, top_k: int) -> NgramStore:
    store = NgramStore(max_ngram, top_k)
    for i in range(1, len(seq)):
        store.add_token(seq[:i], seq[i])
    return store


def check_lookup(store, context, tokens, probs, cap=None):
    got_tokens, got_probs = store.lookup(context, cap)
    assert got_tokens == tokens
    assert got_probs == pytest.approx(probs)


def test_add_lookup_by_hand():
    store = NgramStore(2, 4)
    store.add([1, 2], [5, 6], [0.5, 0.25])
    store.add([3, 2], [6, 7], [0.5, 0.25])
    assert len(store.tables) == 3
    check_lookup(store, [9, 2], [6, 5, 7], [0.5, 1 / 3, 1 / 6])  # [9 2] unknown: [2]
    check_lookup(store, [1, 2], [5, 6], [2 / 3, 1 / 3])
    check_lookup(store, [3, 2], [6, 7], [2 / 3, 1 / 3])
    assert store.lookup([4]) == ([], [])
    assert store.lookup([]) == ([], [])


def test_add_token_one_hot():
    store = NgramStore(2, 4)
    for t in (3, 3, 4):
        store.add_token([1, 2], t)
    check_lookup(store, [1, 2], [3, 4], [2 / 3, 1 / 3])


def test_longest_match():
    store = NgramStore(3, 4)
    store.add_token([1, 2, 3], 4)
    store.add_token([9, 3], 5)
    assert store.lookup([1, 2, 3])[0] == [4]
    assert store.lookup([7, 2, 3])[0] == [4]  # falls back to [2 3]
    assert store.lookup([9, 3])[0] == [5]
    check_lookup(store, [8, 3], [4, 5], [0.5, 0.5])  # falls back to [3]
    assert store.lookup([3])[0] == [4, 5]


def test_top_k_eviction():
    store = NgramStore(1, 2)
    store.add([0], [1, 2, 3], [0.5, 0.3, 0.2])  # 3 is evicted, its mass dropped
    check_lookup(store, [0], [1, 2], [0.625, 0.375])
    store.add([0], [3], [0.4])  # 3 comes back with .4 only and evicts 2 (.3)
    check_lookup(store, [0], [1, 3], [0.5 / 0.9, 0.4 / 0.9])
    store.add([5], [8, 9, 7], [0.5, 0.5, 0.5])  # a tie: the lower token ids stay
    assert store.lookup([5])[0] == [7, 8]


def test_normalisation_and_cap():
    store = NgramStore(1, 8)
    store.add([0], [4, 3, 2], [0.2, 0.1, 0.1])
    tokens, probs = store.lookup([0])
    assert tokens == [4, 2, 3]  # 2 and 3 tie: lower id first
    assert sum(probs) == pytest.approx(1.0)
    check_lookup(store, [0], [4], [0.5], cap=1)  # normalised over the whole table
    assert store.lookup([0], 0) == ([], [])


def test_ignores_non_positive_probs():
    store = NgramStore(2, 4)
    store.add([1], [2, 3], [0.0, -1.0])
    assert store.tables == {}
    store.add([1], [2, 3], [0.0, 0.5])
    assert store.lookup([1])[0] == [3]


@pytest.mark.parametrize("max_ngram, top_k", [(0, 4), (2, 0)])
def test_bad_arguments(max_ngram, top_k):
    with pytest.raises(ValueError):
        NgramStore(max_ngram, top_k)


def test_tree_worked_example():
    store = example_store()
    check_lookup(store, [5, 6], [7, 8], [0.75, 0.25])
    assert build_stand_tree(store, [5, 6], 4, 3) == ([7, 9, 8, 7], [-1, 0, -1, 2])


def test_tree_budget_limit():
    store = example_store()
    assert build_stand_tree(store, [5, 6], 2, 3) == ([7, 9], [-1, 0])
    assert build_stand_tree(store, [5, 6], 10, 3) == ([7, 9, 8, 7, 9, 9], [-1, 0, -1, 2, 2, 3])
    assert build_stand_tree(store, [5, 6], 0, 3) == ([], [])


def test_tree_depth_limit():
    store = example_store()
    assert build_stand_tree(store, [5, 6], 10, 1) == ([7, 8], [-1, -1])
    assert build_stand_tree(store, [5, 6], 10, 2) == ([7, 9, 8, 7, 9], [-1, 0, -1, 2, 2])
    assert build_stand_tree(store, [5, 6], 10, 0) == ([], [])


def test_tree_no_match():
    assert build_stand_tree(example_store(), [1, 2], 4, 3) == ([], [])
    assert build_stand_tree(example_store(), [], 4, 3) == ([], [])
    assert build_stand_tree(NgramStore(), [5, 6], 4, 3) == ([], [])


def test_tree_ties():
    # Every score is .5: 3 before 4 (lower id), 4 before 3 -> 1 (root first), 3 -> 1 before 4 -> 1.
    store = history_store([1, 2, 3, 1, 2, 4, 1, 2], 2, 4)
    assert build_stand_tree(store, [1, 2], 4, 3) == ([3, 4, 1, 1], [-1, -1, 0, 1])


def test_tree_branches_at_budget_equal_depth():
    store = NgramStore(1, 4)
    store.add([0], [1, 2], [0.6, 0.4])
    store.add([1], [3, 4], [0.5, 0.5])
    assert build_stand_tree(store, [0], 2, 2) == ([1, 2], [-1, -1])  # 2 (.4) beats 1 -> 3 (.3)


def test_tree_one_hot_chain_is_prompt_lookup():
    seq = [5, 6, 7, 8, 5, 6]
    store = history_store(seq, 2, 4)
    assert build_stand_tree(store, seq, 3, 3) == (prompt_lookup(seq, 2, 3), [-1, 0, 1])
    assert prompt_lookup(seq, 2, 6) == [7, 8, 5, 6]  # stops at the history's end; STAND goes on
    assert build_stand_tree(store, seq, 6, 6) == ([7, 8, 5, 6, 7, 8], [-1, 0, 1, 2, 3, 4])


def test_single_entry_tables_draft_prompt_lookup_chains():
    # The header's claim: when every table the tree looks up has one entry, the tree is a chain
    # that starts with prompt lookup's draft.
    rng = random.Random(0)
    held = 0
    for _ in range(3000):
        max_ngram, depth = rng.randint(1, 3), rng.randint(1, 8)
        seq = [rng.randrange(4) for _ in range(rng.randint(1, 25))]
        store = history_store(seq, max_ngram, 8)
        tokens, parents = build_stand_tree(store, seq, depth, depth)
        if any(len(store.lookup(seq + tokens[:i])[0]) != 1 for i in range(len(tokens))):
            continue
        held += 1
        pld = prompt_lookup(seq, max_ngram, depth)
        assert parents == list(range(-1, len(tokens) - 1))
        assert tokens[: len(pld)] == pld and len(tokens) >= len(pld)
    assert held > 300


# --- the C++ store and tree against the reference ----------------------------------------------


def _random_stores(seed: int):
    rng = random.Random(seed)
    for _ in range(60):
        max_ngram, top_k = rng.randint(1, 4), rng.randint(1, 6)
        ref, cpp = NgramStore(max_ngram, top_k), _C.NgramStore(max_ngram, top_k)
        for _ in range(rng.randint(0, 40)):
            context = [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
            if rng.random() < 0.3:
                nxt = rng.randint(0, 5)
                ref.add_token(context, nxt)
                cpp.add_token(context, nxt)
            else:
                k = rng.randint(1, 4)
                tokens = rng.sample(range(8), k)
                # probabilities exactly representable in float32, so both sides sum the same values
                probs = [rng.randint(1, 16) / 16 for _ in range(k)]
                ref.add(context, tokens, probs)
                cpp.add(context, tokens, probs)
        yield rng, ref, cpp


@pytest.mark.parametrize("seed", range(5))
def test_cpp_store_and_tree_match_reference(seed):
    for rng, ref, cpp in _random_stores(seed):
        for _ in range(5):
            context = [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
            ref_tokens, ref_probs = ref.lookup(context)
            cpp_tokens, cpp_probs = cpp.lookup(context)
            assert cpp_tokens == ref_tokens
            assert cpp_probs == pytest.approx(ref_probs, rel=1e-6)
            budget, depth = rng.randint(1, 12), rng.randint(1, 6)
            assert _C.build_stand_tree(cpp, context, budget, depth) == tuple(
                build_stand_tree(ref, context, budget, depth)
            )


def _random_seed_tree(rng: random.Random) -> tuple[list[int], list[int], list[float]]:
    """A probing-like tree over the root (node 0): tokens from the stores' alphabet, distinct among
    siblings, scores in sixteenths that never rise above a parent's."""
    tokens, parents, scores = [rng.randint(0, 5)], [-1], [1.0]
    for _ in range(rng.randint(0, 7)):
        parent = rng.randrange(len(tokens))
        token = rng.randint(0, 7)
        if any(p == parent and t == token for p, t in zip(parents, tokens, strict=True)):
            continue
        tokens.append(token)
        parents.append(parent)
        scores.append(scores[parent] * rng.randint(1, 16) / 16)
    return tokens, parents, scores


@pytest.mark.parametrize("seed", range(5))
def test_cpp_seeded_tree_matches_reference(seed):
    for rng, ref, cpp in _random_stores(100 + seed):
        for _ in range(5):
            context = [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
            grow = _random_seed_tree(rng)
            budget, depth = rng.randint(1, 12), rng.randint(1, 6)
            got = _C.build_stand_tree(cpp, context, budget, depth, seed=grow)
            want = build_stand_tree(ref, context, budget, depth, seed=grow)
            assert got[:2] == tuple(want[:2]), (context, grow, budget, depth)
            assert got[2] == pytest.approx(want[2], rel=1e-9)


def test_seeded_tree_properties():
    # Every seed node within the budget and depth is in the tree; no (parent, token) twice; each
    # node's score is the best of its sources; a seed of the root alone is the store's tree.
    rng = random.Random(7)
    for _, ref, _ in _random_stores(200):
        context = [rng.randint(0, 5) for _ in range(rng.randint(1, 8))]
        plain = build_stand_tree(ref, context, 12, 4)
        assert build_stand_tree(ref, context, 12, 4, seed=([context[-1]], [-1], [1.0]))[:2] == plain
        grow = _random_seed_tree(rng)
        tokens, parents, scores = build_stand_tree(ref, context, 64, 8, seed=grow)
        pairs = list(zip(parents, tokens, strict=True))
        assert len(set(pairs)) == len(pairs)
        assert all(p < i for i, p in enumerate(parents))
        assert all(scores[i] <= scores[p] + 1e-12 for i, p in enumerate(parents) if p >= 0)
        if len(tokens) == 64:
            continue  # the budget cut the tree: seed nodes may be among the cut
        where = {0: -1}  # each seed path is a tree path
        for i in range(1, len(grow[0])):
            if grow[1][i] in where:
                match = [j for j, pt in enumerate(pairs) if pt == (where[grow[1][i]], grow[0][i])]
                assert match, (grow, i)
                where[i] = match[0]
                assert scores[match[0]] >= grow[2][i] - 1e-12


def test_seeded_tree_worked_example():
    # csrc/core/ngram_store.h: 8 enters at the seed's .5 (the store's is .25) and its seed child 7 (.3)
    # outranks the store's 7 below it (.25), the same node.
    grow = ([6, 8, 7], [-1, 0, 1], [1.0, 0.5, 0.3])
    for store in (example_store(), _C.NgramStore(2, 3)):
        if isinstance(store, _C.NgramStore):
            store.add([5, 6], [7, 8], [0.6, 0.2])
            store.add([6, 7], [9], [1.0])
            store.add([6, 8], [9, 7], [0.5, 0.5])
            tokens, parents, scores = _C.build_stand_tree(store, [5, 6], 4, 3, seed=grow)
        else:
            tokens, parents, scores = build_stand_tree(store, [5, 6], 4, 3, seed=grow)
        assert (tokens, parents) == ([7, 9, 8, 7], [-1, 0, -1, 2])
        assert scores == pytest.approx([0.75, 0.75, 0.5, 0.3])
    # A probed token the store never predicted after [5 6] still gets the store's continuation
    # below it (its key [4]): the union of two separate trees would end that branch at 4.
    store = example_store()
    store.add([3, 4], [9], [1.0])
    assert build_stand_tree(store, [5, 6], 3, 3) == ([7, 9, 8], [-1, 0, -1])
    tokens, parents, _ = build_stand_tree(store, [5, 6], 3, 3, seed=([6, 4], [-1, 0], [1.0, 0.9]))
    assert (tokens, parents) == ([4, 9, 7], [-1, 0, -1])


def test_cpp_seed_must_be_a_tree():
    store = _C.NgramStore(2, 3)
    with pytest.raises(ValueError, match="seed node 2 has parent 2"):
        _C.build_stand_tree(store, [5, 6], 4, 3, seed=([6, 8, 7], [-1, 0, 2], [1.0, 0.5, 0.3]))
    with pytest.raises(ValueError, match="seed nodes 1 and 2 share parent 0 and token 8"):
        _C.build_stand_tree(store, [5, 6], 4, 3, seed=([6, 8, 8], [-1, 0, 0], [1.0, 0.5, 0.3]))
    with pytest.raises(ValueError, match="one entry per node, got 3, 2 and 3"):
        _C.build_stand_tree(store, [5, 6], 4, 3, seed=([6, 8, 7], [-1, 0], [1.0, 0.5, 0.3]))


def test_cpp_worked_example():
    store = _C.NgramStore(2, 3)
    store.add([5, 6], [7, 8], [0.6, 0.2])
    store.add([6, 7], [9], [1.0])
    store.add([6, 8], [9, 7], [0.5, 0.5])
    assert _C.build_stand_tree(store, [5, 6], 4, 3) == ([7, 9, 8, 7], [-1, 0, -1, 2])


# --- decoding ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=24, eos_token_id=23)


@pytest.mark.parametrize("block_complexity", [2, 10, 30, 60])
def test_lossless_on_tiny_llama(tiny, block_complexity):
    cfg = mtprobe.StandConfig(block_complexity=block_complexity)
    gen = torch.Generator().manual_seed(block_complexity)
    for length in (1, 9, 50):
        # a small vocabulary and repeated text: the store has matches, so trees are drafted
        prompt = torch.randint(0, 6, (1, length), generator=gen)
        for max_new in (1, 3, 40):
            ref = tiny.generate(prompt, do_sample=False, max_new_tokens=max_new)
            out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref), (length, max_new)
            assert all(1 <= a <= cfg.max_depth + 1 for a in out.accept_lengths)


def test_stand_drafts_trees_within_the_budget(tiny):
    seen = []

    def forward_sizes(module, args, kwargs):
        seen.append(kwargs["inputs_embeds"].shape[1])

    handle = tiny.register_forward_pre_hook(forward_sizes, with_kwargs=True)
    try:
        prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]])
        mtprobe.generate(tiny, prompt, mtprobe.StandConfig(block_complexity=7), max_new_tokens=30)
    finally:
        handle.remove()
    assert max(seen[1:]) <= 7  # decode forwards, the prefill excluded
    assert max(seen[1:]) > 2  # it did draft


def test_smollm2_greedy_equality(smollm2):
    model, tok = smollm2
    for text in [
        "Repeat exactly: red, green, blue, red, green, blue, red, green, blue.",
        "Summarise in one sentence: The river rose overnight after three days of rain, and the town "
        "council closed the old bridge until engineers could inspect it.",
    ]:
        ids = chat_ids(tok, [{"role": "user", "content": text}])
        ref = model.generate(ids, do_sample=False, max_new_tokens=40)
        out = mtprobe.generate(model, ids, mtprobe.StandConfig(block_complexity=30), max_new_tokens=40)
        assert torch.equal(out.sequences, ref), text
        assert out.tau > 1.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(block_complexity=1), "leaves no room for a draft"),
        (dict(max_depth=0), "max_depth=0 must be >= 1"),
        (dict(max_ngram=0), "max_ngram=0 must be >= 1"),
        (dict(table_size=0), "table_size=0 must be >= 1"),
        (dict(prompt_logits=-1), "prompt_logits=-1 must be >= 0"),
    ],
)
def test_bad_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mtprobe.StandConfig(**kwargs)


def test_the_drafter_takes_none_for_every_prompt_logit_and_refuses_a_negative_count():
    # The binding passes None through as "every prompt position" (std::optional), not a sentinel.
    kw = dict(max_depth=4, max_ngram=3, table_size=8, logits_top_k=3)
    assert _C.StandDrafter(**kw, prompt_logits=None).name() == "stand"
    assert _C.StandDrafter(**kw, prompt_logits=0).name() == "stand"
    with pytest.raises(
        ValueError, match=r"prompt_logits must be None \(every prompt position\) or >= 0, got -1"
    ):
        _C.StandDrafter(**kw, prompt_logits=-1)


# --- the drafter's learning rule, step by step against the reference ----------------------------


class CheckedStand(_C.Drafter):
    """Runs the C++ StandDrafter and, beside it, the reference store fed by the rule stand.h states
    (prompt text one-hot + prompt logits at prefill, logits of every accepted node afterwards); every
    proposed tree must be the reference's tree."""

    def __init__(self, cfg: mtprobe.StandConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inner = _C.StandDrafter(
            max_depth=cfg.max_depth,
            max_ngram=cfg.max_ngram,
            table_size=cfg.table_size,
            logits_top_k=cfg.logits_top_k,
            prompt_logits=cfg.prompt_logits,
        )
        self.trees = 0

    def name(self):
        return "checked_stand"

    def begin(self, prompt):
        self.inner.begin(prompt)
        self.ref = NgramStore(self.cfg.max_ngram, self.cfg.table_size)
        self.history = prompt.tolist()
        self.prefill = True

    def propose(self, committed, prefix_len, limits):
        block = self.inner.propose(committed, prefix_len, limits)
        c = block.num_committed
        depth = min(self.cfg.max_depth, limits.tokens_left - 1, limits.max_depth)
        budget = limits.budget - 1 if c == 1 else self.cfg.max_depth
        expected = build_stand_tree(self.ref, self.history, budget, depth) if depth >= 1 else ([], [])
        got = (
            block.tokens[c : block.num_nodes].tolist(),
            [p - c if p >= c else -1 for p in block.parents[c : block.num_nodes]],
        )
        assert got == tuple(expected), f"step at history length {len(self.history)}"
        self.trees += bool(got[0])
        return block

    def observe(self, outcome):
        self.inner.observe(outcome)
        k = self.cfg.logits_top_k
        if self.prefill:
            n = len(self.history)
            for i in range(1, n):
                self.ref.add_token(self.history[:i], self.history[i])
            first = 0 if self.cfg.prompt_logits is None else max(0, n - self.cfg.prompt_logits)
            probs, ids = outcome.logits[:n].float().softmax(-1).topk(k, -1)
            for i in range(first, n):  # the last prompt_logits positions' distributions only
                self.ref.add(self.history[: i + 1], ids[i].tolist(), probs[i].tolist())
            self.prefill = False
        else:
            context = list(self.history)
            for node, token in zip(outcome.path, outcome.new_tokens, strict=False):
                probs, ids = outcome.logits[node].float().softmax(-1).topk(k)
                self.ref.add(context, ids.tolist(), probs.tolist())
                context.append(token)
        self.history += list(outcome.new_tokens)


@pytest.mark.parametrize(("block_complexity", "prompt_logits"), [(4, None), (16, None), (16, 0), (16, 5)])
def test_drafter_learns_and_drafts_as_the_reference(tiny, block_complexity, prompt_logits):
    cfg = mtprobe.StandConfig(
        block_complexity=block_complexity, max_depth=4, logits_top_k=3, prompt_logits=prompt_logits
    )
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]])
    drafter = CheckedStand(cfg)
    loop = cpu_decode_loop(
        tiny, drafter, max_new_tokens=40, block_complexity=block_complexity, prompt_len=prompt.shape[1]
    )
    seq = loop.run(prompt[0]).sequence
    assert seq == tiny.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=None)[0].tolist()
    assert drafter.trees > 5  # trees were drafted (and each matched the reference)
