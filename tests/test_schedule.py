"""The scheduler's arithmetic (csrc/core/schedule.h) against its Python reference
(mtprobe.reference.schedule) and the forward profile's interpolation (mtprobe.profile.ForwardProfile)."""

from __future__ import annotations

import random

import pytest

from mtprobe import _C
from mtprobe.profile import ForwardProfile, ProfileKey
from mtprobe.reference import schedule as ref

KEY = ProfileKey(model="M:0", device="cpu", dtype="float32", threads=1)


def _random_profile(rng: random.Random) -> ForwardProfile:
    sizes = [1, *sorted(rng.sample(range(2, 80), rng.randint(0, 5)))]
    contexts = sorted(rng.sample(range(0, 2000), rng.randint(1, 4)))
    seconds = [[rng.uniform(0.001, 0.2) for _ in sizes] for _ in contexts]
    return ForwardProfile(KEY, sizes, contexts, seconds)


def _table(p: ForwardProfile) -> _C.CostTable:
    return _C.CostTable(list(p.block_sizes), list(p.context_lengths), [s for r in p.seconds for s in r])


def test_cost_table_matches_the_profile():
    rng = random.Random(0)
    for _ in range(200):
        p = _random_profile(rng)
        t = _table(p)
        for _ in range(10):
            size = rng.choice([1, rng.randint(1, 100), rng.uniform(1, 120)])
            ctx = rng.uniform(-10, 2500)
            assert t.time(size, ctx) == pytest.approx(p.time(size, ctx), rel=1e-12)
            assert t.relative(size, ctx) == pytest.approx(p.relative(size, ctx), rel=1e-12)


def test_cost_table_bad_input():
    with pytest.raises(ValueError, match="block sizes must start at 1"):
        _C.CostTable([2, 4], [0], [1.0, 2.0])
    with pytest.raises(ValueError, match="positive finite"):
        _C.CostTable([1, 2], [0], [1.0, 0.0])
    with pytest.raises(ValueError, match="must hold contexts x block sizes = 1 x 2 values, got 3"):
        _C.CostTable([1, 2], [0], [1.0, 2.0, 3.0])


def test_stats_and_cuts_match_the_reference():
    rng = random.Random(1)
    for case in range(100):
        decay = rng.choice([1.0, 0.95, 0.5])
        cpp, py = _C.AcceptanceStats(decay), ref.Stats(decay)
        for _ in range(rng.randint(0, 40)):
            tree_depth = rng.randint(0, 8)
            reached = rng.randint(0, tree_depth)
            known = rng.randint(reached + (reached < tree_depth), 12)
            cpp.record(tree_depth, reached, known)
            py.record(tree_depth, reached, known)
        assert cpp.trials == pytest.approx(py.trials) and cpp.accepts == pytest.approx(py.accepts)
        assert cpp.reach(10) == pytest.approx(py.reach(10))
        p = _random_profile(rng)
        table, ctx = _table(p), rng.uniform(0, 2000)
        per_depth = [rng.randint(1, 6) for _ in range(rng.randint(0, 6))]
        extra, cuttable, committed = rng.choice([0, 0, 3]), rng.random() < 0.8, rng.choice([1, 1, 2])
        got = _C.best_cut(cpp, table, committed, per_depth, extra, cuttable, ctx)
        want = ref.best_cut(py, lambda t, c=ctx, q=p: q.relative(t, c), committed, per_depth, extra, cuttable)
        assert got[:2] == want[:2], case
        assert got[2:] == pytest.approx(want[2:])


def test_cheap_forwards_verify_deep_and_dear_ones_plain():
    stats = _C.AcceptanceStats(1.0)
    for _ in range(20):
        stats.record(4, 2, 10)  # depths 1 and 2 accepted, 3 rejected
    flat = _C.CostTable([1, 64], [0], [1.0, 1.0])  # a GPU-like profile: T inputs cost one
    steep = _C.CostTable([1, 64], [0], [1.0, 4.0])  # a small CPU: 64 inputs cost four
    assert _C.best_cut(stats, flat, 1, [1, 1, 1, 1], 0, True, 0.0)[0] == 4  # everything
    depth, inputs, expected, score = _C.best_cut(stats, steep, 1, [8, 8, 8, 8], 0, True, 0.0)
    assert (depth, inputs) == (2, 17) and score > 1  # the two depths that are accepted
    assert _C.best_cut(stats, steep, 1, [2, 40], 0, True, 0.0)[:2] == (1, 3)  # a wide depth 2 does not pay
    assert _C.best_cut(stats, steep, 1, [30, 30], 0, True, 0.0)[:2] == (0, 1)  # nothing pays: plain
