"""Reference definition of the per-step scheduler (csrc/core/schedule.h), in plain Python.

A draft tree cut at depth n gains E[n] = 1 + sum_{d<=n} prod_{i<=d} a_i tokens in expectation and
costs t(T_n) / t(1) plain-decoding forwards, where a_i is the acceptance rate at depth i given that
depth i - 1 was reached and the tree reached depth i. The scheduler takes the cut with the most
tokens per unit of cost, E[n] / (t(T_n) / t(1)), and plain decoding (n = 0, score 1) when none is
better. The forward cost t is :meth:`mtprobe.profile.ForwardProfile.time`.

Worked example (the one of csrc/core/schedule.h): a_1 = 0.6, a_2 = 0.5 on a chain, costs
t(2)/t(1) = 1.1 and t(3)/t(1) = 1.3:

>>> stats = Stats(decay=1.0)
>>> for tree_depth, reached in [(1, 0)] * 3 + [(1, 1)] + [(2, 1)] * 2 + [(2, 2)] * 2:
...     stats.record(tree_depth, reached, known=5)
>>> round(stats.rate(1), 3), round(stats.rate(2), 3)
(0.6, 0.5)
>>> depth, inputs, expected, score = best_cut(stats, {1: 1.0, 2: 1.1, 3: 1.3}.__getitem__, 1, [1, 1], 0, True)
>>> depth, inputs, round(expected, 3), round(score, 3)
(2, 3, 1.9, 1.462)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class Stats:
    """Decayed per-depth acceptance counts with a Beta(1, 1) prior."""

    def __init__(self, decay: float = 0.95) -> None:
        if not 0 < decay <= 1:
            raise ValueError(f"decay must lie in (0, 1], got {decay}")
        self.decay = decay
        self.trials: list[float] = []
        self.accepts: list[float] = []

    def record(self, tree_depth: int, reached: int, known: int) -> None:
        """Depths 1..reached accepted; depth reached + 1 rejected when the tree had it and the
        continuation is known that far; deeper depths untested."""
        self.trials = [t * self.decay for t in self.trials]
        self.accepts = [a * self.decay for a in self.accepts]
        tested = min(tree_depth, reached + 1, known)
        while len(self.trials) < tested:
            self.trials.append(0.0)
            self.accepts.append(0.0)
        for d in range(1, tested + 1):
            self.trials[d - 1] += 1.0
            if d <= reached:
                self.accepts[d - 1] += 1.0

    def rate(self, depth: int) -> float:
        if depth < 1 or depth > len(self.trials):
            return 0.5
        return (self.accepts[depth - 1] + 1.0) / (self.trials[depth - 1] + 2.0)

    def reach(self, max_depth: int) -> list[float]:
        out, p = [], 1.0
        for d in range(1, max_depth + 1):
            p *= self.rate(d)
            out.append(p)
        return out


def best_cut(
    stats: Stats,
    relative: Callable[[int], float],
    committed: int,
    nodes_per_depth: Sequence[int],
    extra: int,
    cuttable: bool,
) -> tuple[int, int, float, float]:
    """``(depth, inputs, expected tokens, score)`` of the best cut; ``relative(T)`` = t(T) / t(1).
    A block with ``extra`` auxiliary inputs, or not ``cuttable``, runs whole or not at all; ties go
    to the smaller block."""
    best = (0, committed, 1.0, 1.0 / relative(committed))
    reach = stats.reach(len(nodes_per_depth))
    expected, inputs = 1.0, committed
    for n in range(1, len(nodes_per_depth) + 1):
        expected += reach[n - 1]
        inputs += nodes_per_depth[n - 1]
        if n < len(nodes_per_depth) and (not cuttable or extra > 0):
            continue
        t = inputs + (extra if n == len(nodes_per_depth) else 0)
        score = expected / relative(t)
        if score > best[3]:
            best = (n, t, expected, score)
    return best
