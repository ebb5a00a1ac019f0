"""Reference STAND drafter (Song et al. 2025; seed 001, App. F): an n-gram store and its draft tree.

For n = 1..max_ngram the key ``context[-n:]`` maps to a table token -> accumulated probability mass;
each table keeps its ``top_k`` entries by mass (ties: lower token id), dropping the evicted mass.
``lookup`` takes the longest matching key and normalises its table to sum 1.

The tree grows best-first: a candidate scores its parent's score times its normalised probability
(the root, the last context token, scores 1); ties go to the earlier parent (the root first), then
the higher probability, then the lower token id. ``parents[i] == -1`` marks a child of the root.

>>> store = NgramStore(max_ngram=2, top_k=3)
>>> store.add([5, 6], [7, 8], [0.6, 0.2])
>>> store.add([6, 7], [9], [1.0])
>>> store.add([6, 8], [9, 7], [0.5, 0.5])
>>> tokens, probs = store.lookup([5, 6])
>>> tokens, [round(p, 2) for p in probs]
([7, 8], [0.75, 0.25])
>>> build_stand_tree(store, [5, 6], budget=4, max_depth=3)  # 7 (.75) -> 9 (.75); 8 (.25) -> 7 (.125)
([7, 9, 8, 7], [-1, 0, -1, 2])
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


class NgramStore:
    def __init__(self, max_ngram: int = 3, top_k: int = 8) -> None:
        if max_ngram < 1 or top_k < 1:
            raise ValueError("NgramStore: max_ngram and top_k must be >= 1")
        self.max_ngram = max_ngram
        self.top_k = top_k
        self.tables: dict[tuple[int, ...], dict[int, float]] = {}  # key -> {token: mass}, best first

    def add(self, context: Sequence[int], tokens: Sequence[int], probs: Sequence[float]) -> None:
        """Adds the next-token distribution after ``context``, given as its top-k (tokens, probs)."""
        pairs = [(int(t), float(p)) for t, p in zip(tokens, probs, strict=True) if p > 0]
        if not pairs:  # no empty tables
            return
        context = list(context)
        for n in range(1, min(self.max_ngram, len(context)) + 1):
            key = tuple(context[-n:])
            table = self.tables.get(key, {})
            for t, p in pairs:
                table[t] = table.get(t, 0.0) + p
            self.tables[key] = dict(sorted(table.items(), key=lambda e: (-e[1], e[0]))[: self.top_k])

    def add_token(self, context: Sequence[int], next_token: int) -> None:
        self.add(context, [next_token], [1.0])

    def lookup(self, context: Sequence[int], cap: int | None = None) -> tuple[list[int], list[float]]:
        """The longest matching key's table, normalised over the whole table, at most ``cap`` entries."""
        context = list(context)
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            table = self.tables.get(tuple(context[-n:]))
            if table:
                total = sum(table.values())  # tables are kept sorted, as in C++
                kept = list(table.items())[:cap]
                return [t for t, _ in kept], [m / total for _, m in kept]
        return [], []


def build_stand_tree(
    store: NgramStore, context: Sequence[int], budget: int, max_depth: int
) -> tuple[list[int], list[int]]:
    tail = list(context)[-store.max_ngram :]  # lookups read only the last max_ngram tokens
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    heap: list[tuple[float, int, float, int]] = []  # (-score, parent, -prob, token): best first

    def push_children(node: int, score: float) -> None:
        path, v = [], node
        while v >= 0 and len(path) < store.max_ngram:
            path.append(tokens[v])
            v = parents[v]
        toks, probs = store.lookup(tail + path[::-1])
        for t, p in zip(toks, probs, strict=True):
            heapq.heappush(heap, (-(score * p), node, -p, t))

    if not tail or budget < 1 or max_depth < 1:
        return [], []
    push_children(-1, 1.0)
    while heap and len(tokens) < budget:
        neg_score, parent, _, token = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if depths[-1] < max_depth and len(tokens) < budget:
            push_children(len(tokens) - 1, -neg_score)
    return tokens, parents
