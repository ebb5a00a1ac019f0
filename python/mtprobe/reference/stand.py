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

With a ``seed`` tree over the same root (tokens, parents, scores; node 0 the root), its nodes compete
with the store's and every placed node gets the store's children as well (the hybrid: probing's tree
with STAND drafting below probed tokens); a (parent, token) taken twice is one node, at the score
taken first (the higher). It returns the scores too:

>>> tokens, parents, scores = build_stand_tree(store, [5, 6], 4, 3, seed=([6, 8, 7], [-1, 0, 1], [1, 0.5, 0.3]))
>>> tokens, parents, [round(x, 3) for x in scores]  # 8 at the seed's .5, above the store's .25
([7, 9, 8, 7], [-1, 0, -1, 2], [0.75, 0.75, 0.5, 0.3])

``NgramMemory`` is the cross-request memory: ``fold(text)`` adds count 1 for ``text[i]`` to every key
``text[i-n:i]``, n = 1..max_ngram; at most ``capacity`` keys, the least recently used (written by a
fold or returned by a lookup) evicted first. A lookup gives each count c as c / (total + distinct)
(PPM's method-C escape: a continuation seen once is a guess, not a certainty). The tree reads it where
the store has no key of the length looked up (the longest key of either store; at equal length the
store's).

>>> memory = NgramMemory(capacity=3, max_ngram=1)
>>> memory.fold([1, 2, 3, 1, 4]); memory.keys()
[(2,), (3,), (1,)]
>>> memory.fold([5, 2]); memory.keys()  # [2] was the least recently used
[(3,), (1,), (5,)]
>>> memory.lookup([3]), memory.keys()
(([1], [0.5]), [(1,), (5,), (3,)])
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
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


class NgramMemory:
    def __init__(self, capacity: int, max_ngram: int = 3, top_k: int = 8) -> None:
        if capacity < 1:
            raise ValueError(
                f"NgramMemory: capacity must be >= 1 (the most n-gram keys it keeps), got {capacity}"
            )
        self.capacity, self.max_ngram, self.top_k = capacity, max_ngram, top_k
        self.tables: OrderedDict[tuple[int, ...], dict[int, float]] = OrderedDict()  # LRU first

    def fold(self, text: Sequence[int]) -> None:
        text = list(text)
        for i in range(1, len(text)):
            for n in range(1, min(self.max_ngram, i) + 1):
                key = tuple(text[i - n : i])
                if key in self.tables:
                    self.tables.move_to_end(key)
                else:
                    if len(self.tables) >= self.capacity:
                        self.tables.popitem(last=False)
                    self.tables[key] = {}
                table = self.tables[key]
                table[text[i]] = table.get(text[i], 0.0) + 1.0
                self.tables[key] = dict(sorted(table.items(), key=lambda e: (-e[1], e[0]))[: self.top_k])

    def lookup_ngram(
        self, context: Sequence[int], n: int, cap: int | None = None
    ) -> tuple[list[int], list[float]]:
        context = list(context)
        if not 1 <= n <= min(self.max_ngram, len(context)):
            return [], []
        key = tuple(context[-n:])
        table = self.tables.get(key)
        if not table:
            return [], []
        self.tables.move_to_end(key)
        total = sum(table.values()) + len(table)  # PPM's method-C escape: one count per distinct token
        kept = list(table.items())[:cap]
        return [t for t, _ in kept], [m / total for _, m in kept]

    def lookup(self, context: Sequence[int], cap: int | None = None) -> tuple[list[int], list[float]]:
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            found = self.lookup_ngram(context, n, cap)
            if found[0]:
                return found
        return [], []

    def keys(self) -> list[tuple[int, ...]]:
        return list(self.tables)


def _store_lookup_ngram(store: NgramStore, context: list[int], n: int) -> tuple[list[int], list[float]]:
    if not 1 <= n <= min(store.max_ngram, len(context)):
        return [], []
    table = store.tables.get(tuple(context[-n:]))
    if not table:
        return [], []
    total = sum(table.values())
    return list(table), [m / total for m in table.values()]


def build_stand_tree(
    store: NgramStore,
    context: Sequence[int],
    budget: int,
    max_depth: int,
    memory: NgramMemory | None = None,
    seed: tuple[Sequence[int], Sequence[int], Sequence[float]] | None = None,
) -> tuple[list[int], list[int]] | tuple[list[int], list[int], list[float]]:
    # lookups read only the last max_ngram tokens (of either store)
    longest = max(store.max_ngram, memory.max_ngram if memory is not None else 0)
    tail = list(context)[-longest:]
    tokens: list[int] = []
    parents: list[int] = []
    depths: list[int] = []
    heap: list[tuple[float, int, float, int]] = []  # (-score, parent, -prob, token): best first

    def push_children(node: int, score: float) -> None:
        path, v = [], node
        while v >= 0 and len(path) < longest:
            path.append(tokens[v])
            v = parents[v]
        ctx = (tail + path[::-1])[-longest:]
        toks, probs = [], []
        for n in range(len(ctx), 0, -1):  # the longest key of either store; at equal length the store's
            toks, probs = _store_lookup_ngram(store, ctx, n)
            if not toks and memory is not None:
                toks, probs = memory.lookup_ngram(ctx, n)
            if toks:
                break
        for t, p in zip(toks, probs, strict=True):
            heapq.heappush(heap, (-(score * p), node, -p, t))

    scores: list[float] = []
    seed_tokens, seed_parents, seed_scores = seed if seed is not None else ([], [], [])
    seed_of: list[int] = []  # the seed node each placed node is, -1: none

    def push_seed_children(node: int, s: int) -> None:
        for i in range(1, len(seed_tokens)):
            if seed_parents[i] == s:
                heapq.heappush(heap, (-seed_scores[i], node, -seed_scores[i], seed_tokens[i]))

    if not tail or budget < 1 or max_depth < 1:
        return ([], [], []) if seed is not None else ([], [])
    push_children(-1, 1.0)
    if seed_tokens:
        push_seed_children(-1, 0)
    while heap and len(tokens) < budget:
        neg_score, parent, _, token = heapq.heappop(heap)
        if any(p == parent and t == token for p, t in zip(parents, tokens, strict=True)):
            continue  # taken already, at a score at least this one
        tokens.append(token)
        parents.append(parent)
        scores.append(-neg_score)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        if depths[-1] < max_depth and len(tokens) < budget:
            push_children(len(tokens) - 1, -neg_score)
        if seed_tokens:
            ps = 0 if parent < 0 else seed_of[parent]
            match = [i for i in range(1, len(seed_tokens)) if ps >= 0 and seed_parents[i] == ps]
            s = next((i for i in match if seed_tokens[i] == token), -1)
            seed_of.append(s)
            if s >= 0 and depths[-1] < max_depth and len(tokens) < budget:
                push_seed_children(len(tokens) - 1, s)
    return (tokens, parents, scores) if seed is not None else (tokens, parents)
