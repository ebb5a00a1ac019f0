"""The scheduler's arithmetic (csrc/core/schedule.h) against its Python reference
(mtprobe.reference.schedule) and the forward profile's interpolation (mtprobe.target_model.profile.ForwardProfile)."""

from __future__ import annotations

import math
import random

import pytest

from mtprobe import _C
from mtprobe.reference import schedule as ref
from mtprobe.target_model.profile import ForwardProfile, ProfileKey

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


def _random_tree(rng: random.Random) -> list[int]:
    """Parents of a random draft tree (-1: the root), parents before children."""
    return [rng.randint(-1, k - 1) if rng.random() < 0.7 else -1 for k in range(rng.randint(0, 20))]


def _layered(nodes_per_depth: list[int]) -> list[int]:
    """nodes_per_depth[d] nodes at depth d + 1, all children of the first node of the depth above."""
    parents: list[int] = []
    first = -1
    for n in nodes_per_depth:
        here = len(parents)
        parents += [first] * n
        first = here
    return parents


def test_stats_and_cuts_match_the_reference():
    rng = random.Random(1)
    for case in range(100):
        decay = rng.choice([1.0, 0.95, 0.5])
        cpp, py = _C.AcceptanceStats(decay), ref.Stats(decay)
        for _ in range(rng.randint(0, 60)):
            if rng.random() < 0.3:
                cpp.step()
                py.step()
            depth, rank, accepted = rng.randint(1, 8), rng.randint(0, 6), rng.random() < 0.5
            cpp.record(depth, rank, accepted)
            py.record(depth, rank, accepted)
        flat = lambda rows: [x for row in rows for x in row]  # noqa: E731
        assert len(cpp.trials) == len(py.trials)
        assert flat(cpp.trials) == pytest.approx(flat(py.trials))
        assert flat(cpp.accepts) == pytest.approx(flat(py.accepts))
        for depth in range(1, 11):
            for rank in range(6):
                assert cpp.rate(depth, rank) == pytest.approx(py.rate(depth, rank))
        p = _random_profile(rng)
        table, ctx = _table(p), rng.uniform(0, 2000)
        parents = _random_tree(rng)
        extra, cuttable, committed = rng.choice([0, 0, 3]), rng.random() < 0.8, rng.choice([1, 1, 2])
        o = rng.choice([0.0, rng.uniform(0, 0.05)])  # the step's overhead, seconds

        def relative(t, c=ctx, q=p, o=o):
            return (q.time(t, c) + o) / (q.time(1, c) + o)

        got = _C.best_cut(cpp, table, committed, parents, extra, cuttable, ctx, o)
        want = ref.best_cut(py, relative, committed, parents, extra, cuttable)
        assert got[:2] == want[:2], case
        assert got[2:] == pytest.approx(want[2:])


def test_expected_gain_is_the_sum_over_nodes_by_hand():
    # a(1, 0) = 3/4 (2 of 2 accepted), a(1, 1) = (0 + 2 * 3/8) / (1 + 2) = 1/4 (its one verdict a
    # rejection; prior mean half its elder's rate), a(2, 0) = 1/2 (no verdicts). The tree: two children
    # of the root, one grandchild below the first: 1 + 3/4 + 1/4 + 3/4 * 1/2 = 2.375 on a flat profile.
    stats = _C.AcceptanceStats(1.0)
    for accepted in (True, True):
        stats.record(1, 0, accepted)
    stats.record(1, 1, False)
    assert stats.rate(1, 0) == pytest.approx(0.75) and stats.rate(1, 1) == pytest.approx(0.25)
    flat = _C.CostTable([1, 64], [0], [1.0, 1.0])
    kept, inputs, expected, score = _C.best_cut(stats, flat, 1, [-1, -1, 0], 0, True, 0.0)
    assert (kept, inputs) == ([0, 1, 2], 4) and (expected, score) == pytest.approx((2.375, 2.375))
    # Costs 1, 1.5, 1.7, 3 for T = 1..4: the first child (3/4) and the grandchild (3/8) beat the second
    # child (1/4): 1 + 3/4 + 3/8 = 2.125 for T = 3 scores 1.25, above 1.75 / 1.5 and 2.375 / 3.
    rising = _C.CostTable([1, 2, 3, 4], [0], [1.0, 1.5, 1.7, 3.0])
    kept, inputs, expected, score = _C.best_cut(stats, rising, 1, [-1, -1, 0], 0, True, 0.0)
    assert (kept, inputs) == ([0, 2], 3) and (expected, score) == pytest.approx((2.125, 2.125 / 1.7))
    with pytest.raises(ValueError, match="node 1 has parent 1; parents must be -1 or an earlier node"):
        _C.best_cut(stats, flat, 1, [-1, 1], 0, True, 0.0)
    with pytest.raises(ValueError, match="depth >= 1 and rank >= 0"):
        stats.record(0, 0, True)


@pytest.mark.parametrize(
    ("committed", "extra", "context", "message"),
    [
        (0, 0, 0.0, r"committed = 0; a block holds at least the last committed token"),
        (1, -1, 0.0, r"extra = -1; auxiliary inputs are counted from 0"),
        (1, 0, float("nan"), "context must be a finite number of cached positions"),
        (1, 0, -1.0, "context must be a finite number of cached positions"),
    ],
)
def test_best_cut_bad_input(committed: int, extra: int, context: float, message: str):
    stats = _C.AcceptanceStats(1.0)
    flat = _C.CostTable([1, 64], [0], [1.0, 1.0])
    with pytest.raises(ValueError, match=message):
        _C.best_cut(stats, flat, committed, [-1, 0], extra, True, context)
    if not math.isnan(context) and context >= 0:  # the reference takes no context
        with pytest.raises(ValueError, match=message):
            ref.best_cut(ref.Stats(1.0), lambda t: 1.0, committed, [-1, 0], extra, True)


def test_rate_bad_input():
    for stats in (_C.AcceptanceStats(1.0), ref.Stats(1.0)):
        for depth, rank in ((0, 0), (-1, 0), (1, -1)):
            with pytest.raises(ValueError, match="a rate needs depth >= 1 and rank >= 0"):
                stats.rate(depth, rank)
        assert stats.rate(7, 2) == pytest.approx(0.5 / 2 / 2)  # unrecorded depth: the prior alone


def test_cheap_forwards_verify_deep_and_dear_ones_plain():
    stats = _C.AcceptanceStats(1.0)
    for _ in range(20):  # first children: depths 1 and 2 accepted, 3 rejected
        for depth, accepted in ((1, True), (2, True), (3, False)):
            stats.record(depth, 0, accepted)
    flat = _C.CostTable([1, 64], [0], [1.0, 1.0])  # a GPU-like profile: T inputs cost one
    steep = _C.CostTable([1, 64], [0], [1.0, 4.0])  # a small CPU: 64 inputs cost four
    assert _C.best_cut(stats, flat, 1, [-1, 0, 1, 2], 0, True, 0.0)[0] == [0, 1, 2, 3]  # everything
    kept, inputs, expected, score = _C.best_cut(stats, steep, 1, _layered([8, 8, 8, 8]), 0, True, 0.0)
    assert (kept, inputs) == ([0, 8], 3) and score > 1  # the first child at depths 1 and 2: the likely ones
    assert _C.best_cut(stats, steep, 1, _layered([2, 40]), 0, True, 0.0)[:2] == ([0, 2], 3)
    # Whole or nothing (an auxiliary input): the wide tree does not pay for itself.
    assert _C.best_cut(stats, steep, 1, _layered([30, 30]), 1, True, 0.0)[:2] == ([], 1)
    rejected = _C.AcceptanceStats(1.0)
    for _ in range(40):
        rejected.record(1, 0, False)
    assert _C.best_cut(rejected, steep, 1, _layered([30, 30]), 0, True, 0.0)[:2] == (
        [],
        1,
    )  # nothing pays: plain


def test_chain_forecast_matches_the_reference():
    rng = random.Random(2)
    for case in range(100):
        cpp, py = _C.AcceptanceStats(1.0), ref.Stats(1.0)
        for _ in range(rng.randint(0, 40)):
            depth, rank, accepted = rng.randint(1, 12), rng.choice([0, 0, 0, 1]), rng.random() < 0.85
            cpp.record(depth, rank, accepted)
            py.record(depth, rank, accepted)
        p = _random_profile(rng)
        ctx, draft_seconds, most = rng.uniform(0, 2000), rng.uniform(0, 0.2), rng.randint(0, 16)
        o = rng.choice([0.0, rng.uniform(0, 0.05)])
        got = _C.forecast_chain(cpp, _table(p), draft_seconds, most, ctx, o)
        plain = p.time(1, ctx) + o

        def relative(t, c=ctx, q=p, o=o, plain=plain):
            return (q.time(t, c) + o) / plain

        want = ref.forecast_chain(py, relative, draft_seconds / plain, most)
        assert got[0] == want[0], case
        assert got[1:] == pytest.approx(want[1:])


def test_chain_forecast_bad_input():
    stats, flat = _C.AcceptanceStats(1.0), _C.CostTable([1, 64], [0], [1.0, 1.0])
    for seconds in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="draft_seconds must be a finite number of seconds >= 0"):
            _C.forecast_chain(stats, flat, seconds, 4, 0.0)
        with pytest.raises(ValueError, match="draft_seconds must be a finite number of seconds >= 0"):
            ref.forecast_chain(ref.Stats(1.0), lambda t: 1.0, seconds, 4)
    with pytest.raises(ValueError, match="context must be a finite number of cached positions"):
        _C.forecast_chain(stats, flat, 0.1, 4, -1.0)
    for overhead in (-0.1, float("nan")):
        with pytest.raises(ValueError, match="overhead must be a finite number of seconds >= 0"):
            _C.forecast_chain(stats, flat, 0.1, 4, 0.0, overhead)
        with pytest.raises(ValueError, match="overhead must be a finite number of seconds >= 0"):
            _C.best_cut(stats, flat, 1, [-1], 0, True, 0.0, overhead)


def test_the_step_overhead_favours_blocks_that_gain_more():
    # A chain of two with a = 0.6, 0.5 (P 0.6, 0.3) where t(2), t(3) = 1.1, 1.4 t(1): without overhead
    # the first node alone pays best (1.6 / 1.1 = 1.455 > 1.9 / 1.4 = 1.357); with an overhead of one
    # forward per step, the costs are 2.1 / 2 and 2.4 / 2, and the whole chain wins (1.583 > 1.524).
    stats = _C.AcceptanceStats(1.0)
    for depth, accepted in [(1, False)] * 3 + [(1, True)] * 5 + [(2, False)] * 2 + [(2, True)] * 2:
        stats.record(depth, 0, accepted)
    table = _C.CostTable([1, 2, 3], [0], [1.0, 1.1, 1.4])
    assert _C.best_cut(stats, table, 1, [-1, 0], 0, True, 0.0)[:2] == ([0], 2)
    kept, inputs, _, score = _C.best_cut(stats, table, 1, [-1, 0], 0, True, 0.0, 1.0)
    assert (kept, inputs) == ([0, 1], 3) and score == pytest.approx(1.9 / 1.2)
    assert table.relative(3, 0.0, 1.0) == pytest.approx(1.2)


def test_margin_stats_match_the_reference():
    # A draft's confidence by class of its top-2 margin, after random verdicts: the same classes, rates
    # and stops as the Python reference, at the edges too.
    rng = random.Random(7)
    for stop_below in (0.5, 0.9, 1.0):
        cpp, py = _C.MarginStats(stop_below), ref.MarginStats(stop_below)
        assert cpp.edges == list(ref.MARGIN_EDGES) and cpp.stop_below == stop_below
        probes = [0.0, *ref.MARGIN_EDGES, *(e * 0.999 for e in ref.MARGIN_EDGES), 3.0, 1e300]
        for _ in range(300):
            margin = rng.choice(probes) if rng.random() < 0.3 else rng.expovariate(3.0)
            matched = rng.random() < (0.5 if margin < 0.05 else 0.97)
            cpp.record(margin, matched)
            py.record(margin, matched)
            for m in probes:
                assert _C.MarginStats.class_of(m) == ref.MarginStats.class_of(m)
                assert cpp.rate(m) == pytest.approx(py.rate(m), rel=1e-12)
                assert cpp.stops(m) == py.stops(m)
        assert cpp.trials == py.trials and cpp.matches == py.matches


@pytest.mark.parametrize("margin", [-0.1, math.nan, math.inf])
def test_margin_stats_bad_input(margin: float):
    with pytest.raises(ValueError, match="a top-2 logit margin is finite and >= 0"):
        _C.MarginStats().record(margin, True)
    with pytest.raises(ValueError, match="a top-2 logit margin is finite and >= 0"):
        ref.MarginStats.class_of(margin)
    for stop_below in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="stop_below must lie in"):
            _C.MarginStats(stop_below)
