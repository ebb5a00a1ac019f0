"""Reference lookahead decoding (LADE, Fu et al. 2024; seed 001 App. F): the n-gram pool, the guess
tree and the Jacobi window of csrc/core/lookahead.h, in plain Python.

L = ngram_size, W = window, G = guess_set_size. The window holds L - 1 levels of W cells; cell
(l, j) sits at depth j + l below the root and cell (0, 0) is the root itself. Its parent is
(0, j - 1) on level 0 and (l - 1, j) above: a comb, so "cell (l, j) sees level 0 up to column j, then
its column" is ordinary tree attention. After a forward, ``next[j]`` (the argmax at cell
(L - 2, j)) closes the column n-gram (cell(0, j), ..., cell(L - 2, j), next[j]); once the window is
warm (L - 1 updates) those W n-grams go to the pool, then every level moves up one (next becomes
the last level).

>>> pool = LookaheadPool(ngram_size=3, guess_set_size=2)
>>> for ngram in ([5, 1, 2], [5, 1, 3], [5, 1, 2], [5, 4, 4]):
...     pool.add(ngram)
>>> pool.lookup(5)  # [1 2] was refreshed, so [1 3] was the oldest when [4 4] came
[[1, 2], [4, 4]]
>>> build_guess_tree([[1, 2], [1, 3], [4, 4]], max_depth=2)  # [1 2] and [1 3] share their 1
([1, 2, 3, 4, 4], [-1, 0, 0, -1, 3])
>>> w = LookaheadWindow(ngram_size=3, window=3)
>>> w.reset([7, 8, 9, 10])  # cell k = l W + j gets prompt[k mod 4]
>>> w.cells
[[-1, 8, 9], [10, 7, 8]]
>>> w.layout()  # cells (0, 1), (0, 2), (1, 0), (1, 1), (1, 2); parent -1 = the root
([8, 9, 10, 7, 8], [-1, 0, -1, 0, 1])
>>> w.update(root=6, next=[1, 2, 3], pool=pool)
>>> w.cells  # up one level; not warm yet (L - 1 = 2 updates), so nothing was pooled
[[-1, 7, 8], [1, 2, 3]]
"""

from __future__ import annotations

from collections.abc import Sequence


class LookaheadPool:
    def __init__(self, ngram_size: int, guess_set_size: int) -> None:
        if ngram_size < 2 or guess_set_size < 1:
            raise ValueError("LookaheadPool: ngram_size must be >= 2 and guess_set_size >= 1")
        self.ngram_size = ngram_size
        self.guess_set_size = guess_set_size
        self.sets: dict[int, list[list[int]]] = {}  # key -> continuations, oldest first

    def add(self, ngram: Sequence[int]) -> None:
        key, continuation = int(ngram[0]), [int(t) for t in ngram[1:]]
        assert len(continuation) == self.ngram_size - 1
        entries = self.sets.setdefault(key, [])
        if continuation in entries:
            entries.remove(continuation)  # a repeat moves to the newest place
        elif len(entries) == self.guess_set_size:
            entries.pop(0)  # full: the oldest goes
        entries.append(continuation)

    def lookup(self, key: int) -> list[list[int]]:
        return [list(c) for c in self.sets.get(int(key), [])]


def build_guess_tree(guesses: Sequence[Sequence[int]], max_depth: int) -> tuple[list[int], list[int]]:
    """Chains from the root merged into one tree, each cut to ``max_depth`` tokens; nodes in the
    order first met, parent -1 = a child of the root."""
    tokens: list[int] = []
    parents: list[int] = []
    for guess in guesses:
        parent = -1
        for token in list(guess)[: max(max_depth, 0)]:
            node = next((i for i in range(len(tokens)) if parents[i] == parent and tokens[i] == token), None)
            if node is None:
                node = len(tokens)
                tokens.append(int(token))
                parents.append(parent)
            parent = node
        # (an empty guess list or max_depth <= 0 gives the empty tree)
    return tokens, parents


class LookaheadWindow:
    def __init__(self, ngram_size: int, window: int) -> None:
        if ngram_size < 2 or window < 1:
            raise ValueError("LookaheadWindow: ngram_size must be >= 2 and window >= 1")
        self.L, self.W = ngram_size, window
        self.cells = [[-1] * window for _ in range(ngram_size - 1)]  # cells[lv][j]; [0][0] is the root
        self.updates = 0

    def reset(self, prompt: Sequence[int]) -> None:
        prompt = list(prompt)
        self.cells = [
            [-1 if (lv, j) == (0, 0) else prompt[(lv * self.W + j) % len(prompt)] for j in range(self.W)]
            for lv in range(self.L - 1)
        ]
        self.updates = 0

    def cell_index(self, level: int, column: int) -> int:
        """The cell's place among the non-root cells, level 0 first; -1 for the root."""
        return level * self.W + column - 1

    @property
    def max_depth(self) -> int:
        return self.W - 1 + self.L - 2

    def layout(self) -> tuple[list[int], list[int]]:
        cells = [(lv, j) for lv in range(self.L - 1) for j in range(self.W) if (lv, j) != (0, 0)]
        tokens = [self.cells[lv][j] for lv, j in cells]
        parents = [self.cell_index(0, j - 1) if lv == 0 else self.cell_index(lv - 1, j) for lv, j in cells]
        return tokens, parents

    def update(self, root: int, next: Sequence[int], pool: LookaheadPool) -> None:
        next = list(next)
        levels = self.L - 1
        if self.updates >= levels:  # every cell came from the model
            for j in range(self.W):
                column = [root if j == 0 else self.cells[0][j]] + [
                    self.cells[lv][j] for lv in range(1, levels)
                ]
                pool.add(column + [next[j]])
        above = self.cells[1:] + [next]  # level l + 1, with next as level L - 1
        self.cells = [
            [-1 if (lv, j) == (0, 0) else above[lv][j] for j in range(self.W)] for lv in range(levels)
        ]
        self.updates += 1
