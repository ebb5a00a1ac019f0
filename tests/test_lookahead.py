"""Lookahead decoding: the reference (mtprobe.reference.lookahead) against hand-computed values (the
cases of tests/core/test_lookahead.cpp); the C++ pool, guess tree and window against the reference;
the drafter step by step against the reference; lossless decoding; bad configurations."""

from __future__ import annotations

import random

import pytest
import torch

import mtprobe
from conftest import chat_ids, cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.reference.lookahead import LookaheadPool, LookaheadWindow, build_guess_tree
from mtprobe.reference.tree_mask import tree_attention_mask

# --- the reference by hand -----------------------------------------------------------------------


def test_pool_order_and_eviction():
    pool = LookaheadPool(3, 2)
    assert pool.lookup(5) == []
    pool.add([5, 1, 2])
    pool.add([5, 1, 3])
    assert pool.lookup(5) == [[1, 2], [1, 3]]
    pool.add([5, 1, 2])
    assert pool.lookup(5) == [[1, 3], [1, 2]]
    pool.add([5, 4, 4])
    assert pool.lookup(5) == [[1, 2], [4, 4]]


def test_guess_tree_by_hand():
    assert build_guess_tree([[1, 2], [1, 3], [4, 4]], 2) == ([1, 2, 3, 4, 4], [-1, 0, 0, -1, 3])
    assert build_guess_tree([[1, 2], [1, 2]], 2) == ([1, 2], [-1, 0])
    assert build_guess_tree([[1, 2], [1, 3], [4, 4]], 1) == ([1, 4], [-1, -1])
    assert build_guess_tree([[1, 2]], 0) == ([], [])
    assert build_guess_tree([], 2) == ([], [])


def test_window_update_shifts_and_pools_once_warm():
    w, pool = LookaheadWindow(3, 3), LookaheadPool(3, 4)
    w.reset([7, 8, 9, 10])
    w.update(6, [1, 2, 3], pool)
    assert w.cells == [[-1, 7, 8], [1, 2, 3]]
    w.update(1, [4, 5, 6], pool)
    assert w.cells == [[-1, 2, 3], [4, 5, 6]] and pool.sets == {}
    w.update(4, [11, 12, 13], pool)  # warm: the columns (4 4 11), (2 5 12), (3 6 13)
    assert pool.sets == {4: [[4, 11]], 2: [[5, 12]], 3: [[6, 13]]}
    assert w.cells == [[-1, 5, 6], [11, 12, 13]]


def test_window_is_a_comb_with_lade_attention():
    # LADE's rule: cell (l, j) sees level 0 up to column j, then its own column up to itself; the
    # comb's tree mask must be exactly that, with depth j + l.
    L, W = 4, 5
    w = LookaheadWindow(L, W)
    w.reset(list(range(100, 120)))
    _, parents = w.layout()
    cells = [(0, 0)] + [(lv, j) for lv in range(L - 1) for j in range(W) if (lv, j) != (0, 0)]
    block_parents = [-1] + [p + 1 for p in parents]  # input 0 is the root, cell i is input i + 1
    allowed = tree_attention_mask(torch.tensor(block_parents), 0, torch.float32)[0, 0] == 0  # [T, T]
    for a, (la, ja) in enumerate(cells):
        for b, (lb, jb) in enumerate(cells):
            sees = (lb == 0 and jb <= ja) or (jb == ja and 1 <= lb <= la)
            assert bool(allowed[a, b]) == sees, ((la, ja), (lb, jb))
    depths = [0] * len(cells)
    for i in range(1, len(cells)):
        depths[i] = depths[block_parents[i]] + 1
    assert depths == [j + lv for lv, j in cells]


def test_two_levels_window_is_a_jacobi_chain():
    w = LookaheadWindow(2, 4)
    w.reset([7, 8])
    assert w.layout() == ([8, 7, 8], [-1, 0, 1])


@pytest.mark.parametrize("ngram_size, window", [(1, 3), (3, 0)])
def test_reference_bad_arguments(ngram_size, window):
    with pytest.raises(ValueError):
        LookaheadWindow(ngram_size, window)


# --- the C++ core against the reference ------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_cpp_pool_and_guess_tree_match_reference(seed):
    rng = random.Random(seed)
    for _ in range(40):
        n, g = rng.randint(2, 5), rng.randint(1, 4)
        ref, cpp = LookaheadPool(n, g), _C.LookaheadPool(n, g)
        for _ in range(rng.randint(0, 60)):
            ngram = [rng.randint(0, 4) for _ in range(n)]
            ref.add(ngram)
            cpp.add(ngram)
            key = rng.randint(0, 4)
            assert cpp.lookup(key) == ref.lookup(key)
            depth = rng.randint(0, n)
            assert _C.build_guess_tree(ref.lookup(key), depth) == tuple(
                build_guess_tree(ref.lookup(key), depth)
            )


@pytest.mark.parametrize("seed", range(4))
def test_cpp_window_matches_reference(seed):
    rng = random.Random(seed)
    for _ in range(30):
        n, w = rng.randint(2, 5), rng.randint(1, 6)
        ref, cpp = LookaheadWindow(n, w), _C.LookaheadWindow(n, w)
        ref_pool, cpp_pool = LookaheadPool(n, 3), _C.LookaheadPool(n, 3)
        prompt = [rng.randint(0, 9) for _ in range(rng.randint(1, 12))]
        ref.reset(prompt)
        cpp.reset(prompt)
        assert cpp.num_cells == len(ref.layout()[0]) and cpp.max_depth == ref.max_depth
        for _ in range(rng.randint(1, 12)):
            assert cpp.layout() == ref.layout()
            root, nxt = rng.randint(0, 9), [rng.randint(0, 9) for _ in range(w)]
            ref.update(root, nxt, ref_pool)
            cpp.update(root, nxt, cpp_pool)
            assert cpp.updates == ref.updates
            for key in range(10):
                assert cpp_pool.lookup(key) == ref_pool.lookup(key)


def test_cpp_bad_arguments():
    with pytest.raises(ValueError, match="ngram_size must be >= 2"):
        _C.LookaheadPool(1, 2)
    with pytest.raises(ValueError, match="window >= 1"):
        _C.LookaheadWindow(3, 0)
    with pytest.raises(ValueError, match="an n-gram of 3 tokens"):
        _C.LookaheadPool(3, 2).add([1, 2])
    with pytest.raises(ValueError, match="next needs 2 tokens"):
        _C.LookaheadWindow(3, 2).update(0, [1], _C.LookaheadPool(3, 2))


# --- the drafter step by step against the reference ------------------------------------------------


class CheckedLookahead(_C.Drafter):
    """Runs the C++ LookaheadDrafter and, beside it, the reference pool and window fed by the rule
    lookahead.h states (argmax at the last level's cells, the columns pooled once warm); every
    proposed block must be the reference's [root | guess tree | window]."""

    def __init__(self, cfg: mtprobe.LookaheadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.inner = _C.LookaheadDrafter(
            ngram_size=cfg.ngram_size,
            window=cfg.window,
            guess_set_size=cfg.guess_set_size,
            pool_from_prompt=cfg.pool_from_prompt,
        )
        self.guessed = 0

    def name(self):
        return "checked_lookahead"

    def begin(self, prompt):
        self.inner.begin(prompt)
        L = self.cfg.ngram_size
        self.pool = LookaheadPool(L, self.cfg.guess_set_size)
        self.window = LookaheadWindow(L, self.cfg.window)
        self.window.reset(prompt.tolist())
        self.history = prompt.tolist()
        if self.cfg.pool_from_prompt:
            for i in range(L, len(self.history) + 1):
                self.pool.add(self.history[i - L : i])
        self.prefill = True

    def propose(self, committed, prefix_len, limits):
        block = self.inner.propose(committed, prefix_len, limits)
        if self.prefill:
            assert block.num_nodes == block.num_inputs == committed.shape[0]
            self.offset = None
            return block
        L, root = self.cfg.ngram_size, self.history[-1]
        depth = min(L - 1, limits.tokens_left - 1, limits.max_depth)
        tokens, parents = build_guess_tree(self.pool.lookup(root), depth)
        expected_tokens, expected_parents = [root] + tokens, [-1] + [p + 1 for p in parents]
        self.offset = None
        if self.window.max_depth <= limits.max_depth:
            self.offset = len(expected_tokens)
            cells, cell_parents = self.window.layout()
            expected_tokens += cells
            expected_parents += [0 if p < 0 else self.offset + p for p in cell_parents]
        assert block.tokens.tolist() == expected_tokens
        assert list(block.parents) == expected_parents
        assert block.num_nodes == 1 + len(tokens)
        assert block.num_inputs <= self.cfg.block_complexity
        self.guessed += bool(tokens)
        return block

    def observe(self, outcome):
        self.inner.observe(outcome)
        if self.offset is not None:
            last = self.cfg.ngram_size - 2
            rows = [
                0 if (last, j) == (0, 0) else self.offset + self.window.cell_index(last, j)
                for j in range(self.cfg.window)
            ]
            nxt = outcome.logits[rows].argmax(-1).tolist()
            self.window.update(self.history[-1], nxt, self.pool)
        L = self.cfg.ngram_size
        for t in outcome.new_tokens:
            self.history.append(t)
            if self.cfg.pool_from_prompt and len(self.history) >= L:
                self.pool.add(self.history[-L:])
        self.prefill = False


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=24, eos_token_id=23)


@pytest.mark.parametrize(
    "cfg",
    [
        mtprobe.LookaheadConfig(3, 4, 1),
        mtprobe.LookaheadConfig(4, 5, 5),
        mtprobe.LookaheadConfig(2, 3, 2),
        mtprobe.LookaheadConfig(3, 2, 3, pool_from_prompt=True),
    ],
    ids=str,
)
def test_drafter_matches_the_reference_step_by_step(tiny, cfg):
    prompt = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2]])
    drafter = CheckedLookahead(cfg)
    max_new = 60
    loop = cpu_decode_loop(
        tiny,
        drafter,
        max_new_tokens=max_new,
        block_complexity=cfg.block_complexity,
        prompt_len=prompt.shape[1],
    )
    result = loop.run(prompt[0])
    ref = tiny.generate(prompt, do_sample=False, max_new_tokens=max_new, eos_token_id=None)[0].tolist()
    assert result.sequence == ref
    assert drafter.guessed > 5  # guesses were verified (and every block matched the reference)
    assert max(result.accept_lengths) > 1


# --- decoding --------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_complexity", [10, 30, 60])
def test_lossless_on_tiny_llama_paper_configs(tiny, block_complexity):
    cfg = mtprobe.LookaheadConfig.for_block_complexity(block_complexity)
    gen = torch.Generator().manual_seed(block_complexity)
    for length in (1, 9, 50):
        prompt = torch.randint(0, 6, (1, length), generator=gen)
        for max_new in (1, 3, 60):
            ref = tiny.generate(prompt, do_sample=False, max_new_tokens=max_new)
            out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=max_new)
            assert torch.equal(out.sequences, ref), (length, max_new)
            assert all(1 <= a <= cfg.ngram_size for a in out.accept_lengths)


def test_blocks_fill_the_budget_and_never_pass_it(tiny):
    cfg = mtprobe.LookaheadConfig(3, 4, 2)  # BC = 2 * 6 = 12
    seen = []

    def forward_sizes(module, args, kwargs):
        seen.append(kwargs["inputs_embeds"].shape[1])

    handle = tiny.register_forward_pre_hook(forward_sizes, with_kwargs=True)
    try:
        prompt = torch.tensor([[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]])
        mtprobe.generate(tiny, prompt, cfg, max_new_tokens=40)
    finally:
        handle.remove()
    decode = seen[1:]  # the prefill excluded
    assert max(decode) <= cfg.block_complexity
    assert min(decode) >= 1 + (cfg.ngram_size - 1) * cfg.window - 1  # the root and the whole window
    assert max(decode) > min(decode)  # some steps verified guesses


def test_window_is_dropped_near_the_last_position():
    # max_position_embeddings 24: the window's deepest cell would pass it near the end; decoding
    # must stay exact up to the model's limit.
    model = tiny_llama(vocab_size=24, eos_token_id=23, max_position_embeddings=24)
    prompt = torch.tensor([[1, 2, 3, 1, 2, 3]])
    cfg = mtprobe.LookaheadConfig(4, 5, 2)
    ref = model.generate(prompt, do_sample=False, max_new_tokens=18, eos_token_id=None)
    out = mtprobe.generate(model, prompt, cfg, max_new_tokens=18, eos_token_id=None)
    assert torch.equal(out.sequences, ref)


def test_smollm2_greedy_equality(smollm2):
    model, tok = smollm2
    for text in [
        "Count from one to twenty in words, separated by commas.",
        "Write a Python function that returns the squares of a list of numbers.",
    ]:
        ids = chat_ids(tok, [{"role": "user", "content": text}])
        ref = model.generate(ids, do_sample=False, max_new_tokens=48)
        out = mtprobe.generate(
            model, ids, mtprobe.LookaheadConfig.for_block_complexity(30), max_new_tokens=48
        )
        assert torch.equal(out.sequences, ref), text


# --- bad configurations ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(ngram_size=1), ValueError, "ngram_size=1 must be >= 2"),
        (dict(window=0), ValueError, "window=0 must be >= 1"),
        (dict(guess_set_size=0), ValueError, "guess_set_size=0 must be >= 1"),
        (dict(ngram_size=2.5), TypeError, "ngram_size must be an int"),
        (dict(pool_from_prompt="yes"), TypeError, "pool_from_prompt must be a bool"),
        (
            dict(block_complexity=20),
            ValueError,
            r"\(L - 1\)\(W \+ G\)\) needs block_complexity >= 30 inputs per step, got 20",
        ),
    ],
)
def test_bad_config(kwargs, error, message):
    with pytest.raises(error, match=message):
        mtprobe.LookaheadConfig(**kwargs)


def test_paper_configs():
    assert [mtprobe.LookaheadConfig.for_block_complexity(b).block_complexity for b in (10, 30, 60)] == [
        10,
        30,
        60,
    ]
    with pytest.raises(ValueError, match="10, 30 and 60, not 20"):
        mtprobe.LookaheadConfig.for_block_complexity(20)


def test_drafter_refuses_a_smaller_budget(tiny):
    drafter = _C.LookaheadDrafter(ngram_size=4, window=5, guess_set_size=5)
    loop = cpu_decode_loop(tiny, drafter, max_new_tokens=8, block_complexity=20, prompt_len=3)
    with pytest.raises(
        ValueError, match=r"\(L - 1\)\(W \+ G\) = 30 inputs per step, over the block complexity 20"
    ):
        loop.run(torch.tensor([1, 2, 3]))
