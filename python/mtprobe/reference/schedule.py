"""Reference definition of the per-step scheduler (csrc/core/schedule.h), in plain Python.

A draft node v is accepted with P(v) = P(parent) a(depth, rank): the acceptance of a node given its
parent was accepted, by its depth and its rank among its siblings (0: the drafter's first guess).
A cut keeping the k nodes of highest P gains E[k] = 1 + the sum of their P in expectation and costs
t(T_k) / t(1) plain-decoding forwards, T_k = committed + k. The scheduler takes the cut with the most
tokens per unit of cost, E[k] / (t(T_k) / t(1)), and plain decoding (k = 0, score 1) when none is
better. The forward cost t is :meth:`mtprobe.target_model.profile.ForwardProfile.time`.

Worked example (the one of csrc/core/schedule.h): a(1, 0) = 0.6, a(2, 0) = 0.5 on a chain, costs
t(2)/t(1) = 1.1 and t(3)/t(1) = 1.3:

>>> stats = Stats(decay=1.0)
>>> for depth, accepted in [(1, False)] * 3 + [(1, True)] * 5 + [(2, False)] * 2 + [(2, True)] * 2:
...     stats.record(depth, 0, accepted)
>>> round(stats.rate(1, 0), 3), round(stats.rate(2, 0), 3)
(0.6, 0.5)
>>> kept, inputs, expected, score = best_cut(stats, {1: 1.0, 2: 1.1, 3: 1.3}.__getitem__, 1, [-1, 0], 0, True)
>>> kept, inputs, round(expected, 4), round(score, 3)
([0, 1], 3, 1.9, 1.462)
>>> best_cut(stats, {1: 1.0, 2: 1.1, 3: 1.4}.__getitem__, 1, [-1, 0], 0, True)[:2]
([0], 2)

A second sibling at depth 1 is priced by its own rank: with no verdicts of its own, its prior mean is
half its elder's rate, 0.3 here; siblings exclude each other, so the rates of one node's children
are capped to sum to at most 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

RANKS = 4  # sibling ranks 0..RANKS-2 apart, the rest pooled


class Stats:
    """Decayed acceptance counts per (depth, sibling rank) with a Beta prior of weight 2."""

    def __init__(self, decay: float = 0.95) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must lie in (0, 1], got {decay}")
        self.decay = decay
        self.trials: list[list[float]] = []  # [depth][RANKS]
        self.accepts: list[list[float]] = []  # [depth][RANKS]

    def step(self) -> None:
        """One decode step passed: every count decays."""
        self.trials = [[t * self.decay for t in row] for row in self.trials]
        self.accepts = [[a * self.decay for a in row] for row in self.accepts]

    def record(self, depth: int, rank: int, accepted: bool) -> None:
        """A node at ``depth`` of sibling ``rank``, whose parent the continuation reached, was (not) the
        continuation's next token."""
        if depth < 1 or rank < 0:
            raise ValueError("a verdict needs depth >= 1 and rank >= 0")
        while len(self.trials) < depth:
            self.trials.append([0.0] * RANKS)
            self.accepts.append([0.0] * RANKS)
        r = min(rank, RANKS - 1)
        self.trials[depth - 1][r] += 1.0
        self.accepts[depth - 1][r] += float(accepted)

    def rate(self, depth: int, rank: int = 0) -> float:
        """(accepts + 2 m) / (trials + 2): prior mean m = 0.5 for a first child, half the elder
        sibling's rate for a later one; the prior alone at depths never recorded."""
        if depth < 1 or rank < 0:
            raise ValueError("a rate needs depth >= 1 and rank >= 0")
        mean = 0.5
        for k in range(min(rank, RANKS - 1) + 1):
            seen = depth <= len(self.trials)
            t = self.trials[depth - 1][k] if seen else 0.0
            a = self.accepts[depth - 1][k] if seen else 0.0
            rate = (a + 2 * mean) / (t + 2)
            mean = rate / 2
        return rate


def best_cut(
    stats: Stats,
    relative: Callable[[int], float],
    committed: int,
    parents: Sequence[int],
    extra: int,
    cuttable: bool,
) -> tuple[list[int], int, float, float]:
    """``(kept draft nodes, inputs, expected tokens, score)`` of the best cut of the draft tree
    ``parents`` (each draft node's parent among the draft nodes, -1 the last committed token; siblings
    in the drafter's order); ``relative(T)`` = t(T) / t(1). A cut keeps the k nodes most likely
    accepted (ties: the earlier node), a subtree since no child outranks its parent. A block with
    ``extra`` auxiliary inputs, or not ``cuttable``, runs whole or not at all; ties go to the smaller
    block."""
    if committed < 1:
        raise ValueError(f"committed = {committed}; a block holds at least the last committed token (>= 1)")
    if extra < 0:
        raise ValueError(f"extra = {extra}; auxiliary inputs are counted from 0 (extra >= 0)")
    depth: list[int] = []
    reach: list[float] = []
    children: dict[int, int] = {}
    left: dict[int, float] = {}  # P(no earlier child accepted | the parent was)
    for k, parent in enumerate(parents):
        if not -1 <= parent < k:
            raise ValueError(f"node {k} has parent {parent}; parents must be -1 or an earlier node")
        d = 1 if parent < 0 else depth[parent] + 1
        rank = children.get(parent, 0)
        children[parent] = rank + 1
        depth.append(d)
        a = min(stats.rate(d, rank), left.get(parent, 1.0))  # siblings exclude each other
        left[parent] = left.get(parent, 1.0) - a
        reach.append((1.0 if parent < 0 else reach[parent]) * a)
    best: tuple[list[int], int, float, float] = ([], committed, 1.0, 1.0 / relative(committed))
    if not parents:
        return best
    if not cuttable or extra > 0:  # whole or nothing
        t = committed + len(parents) + extra
        expected = 1.0 + sum(reach)
        score = expected / relative(t)
        return (list(range(len(parents))), t, expected, score) if score > best[3] else best
    order = sorted(range(len(parents)), key=lambda k: (-reach[k], k))
    expected = 1.0
    for k in range(1, len(order) + 1):
        expected += reach[order[k - 1]]
        score = expected / relative(committed + k)
        if score > best[3]:
            best = (sorted(order[:k]), committed + k, expected, score)
    return best


def forecast_chain(
    stats: Stats, relative: Callable[[int], float], draft_cost: float, max_drafts: int
) -> tuple[int, float, float, float]:
    """``(drafts, rate, expected tokens, score)`` of the best chain of a drafter that runs forwards of its
    own to propose: every draft accepted with one pooled rate p = (accepts + 1) / (trials + 2) over the
    first children of every depth; k drafts gain 1 + p + ... + p^k for ``relative(1 + k) + k draft_cost``
    plain steps (``relative``: a step's cost by T, its overhead included; ``draft_cost``: one draft's
    seconds over a plain step's). The best k in 1..max_drafts (ties:
    the shorter chain); 0 drafts and score 0 when max_drafts < 1.

    The worked example of csrc/core/schedule.h: p = 0.9, a draft costing half a plain forward,
    t(1 + k) / t(1) = 1 + 0.1 k:

    >>> stats = Stats(decay=1.0)
    >>> for accepted in [True] * 17 + [False]:
    ...     stats.record(1, 0, accepted)
    >>> drafts, rate, expected, score = forecast_chain(stats, lambda t: 1 + 0.1 * (t - 1), 0.5, 12)
    >>> drafts, round(rate, 3), round(expected, 3), round(score, 3)
    (2, 0.9, 2.71, 1.232)
    """
    if not draft_cost >= 0 or draft_cost == float("inf"):
        raise ValueError("draft_seconds must be a finite number of seconds >= 0")
    trials = sum(row[0] for row in stats.trials)
    accepts = sum(row[0] for row in stats.accepts)
    rate = (accepts + 1) / (trials + 2)
    best = (0, rate, 1.0, 0.0)
    expected, reach = 1.0, 1.0
    for k in range(1, max_drafts + 1):
        reach *= rate
        expected += reach
        score = expected / (relative(1 + k) + k * draft_cost)
        if score > best[3]:
            best = (k, rate, expected, score)
    return best


MARGIN_EDGES = (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
"""Class edges of a draft's top-2 logit margin (``csrc/core/schedule.h``, ``MarginStats``)."""


class MarginStats:
    """How often a greedy draft of each margin class was the target's token: rate = (matches + 1.9) /
    (trials + 2); a draft whose class's rate is below ``stop_below`` ends its chain.

    >>> s = MarginStats(0.9)
    >>> s.stops(0.005)
    False
    >>> s.record(0.005, False)
    >>> round(s.rate(0.005), 4), s.stops(0.005), s.stops(3.0)
    (0.6333, True, False)
    """

    def __init__(self, stop_below: float = 0.9) -> None:
        if not 0 < stop_below <= 1:
            raise ValueError(f"stop_below must lie in (0, 1], got {stop_below}")
        self.stop_below = stop_below
        self.trials = [0.0] * (len(MARGIN_EDGES) + 1)  # [classes]
        self.matches = [0.0] * (len(MARGIN_EDGES) + 1)  # [classes]

    @staticmethod
    def class_of(margin: float) -> int:
        if not (margin >= 0 and margin < float("inf")):
            raise ValueError(f"a top-2 logit margin is finite and >= 0, got {margin}")
        return sum(margin >= e for e in MARGIN_EDGES)

    def rate(self, margin: float) -> float:
        c = self.class_of(margin)
        return (self.matches[c] + 1.9) / (self.trials[c] + 2.0)

    def record(self, margin: float, matched: bool) -> None:
        c = self.class_of(margin)
        self.trials[c] += 1.0
        self.matches[c] += 1.0 if matched else 0.0

    def stops(self, margin: float) -> bool:
        return self.rate(margin) < self.stop_below
