"""Reference of csrc/core/topology.h: static draft trees by child rank, and the EntMTP policies.

A topology is a set of rank paths (the root is implicit). The node ``(r_1, ..., r_d)`` drafts the
``r_d``-th candidate of depth ``d`` among the children of ``(r_1, ..., r_{d-1})``; with pruning the
parent's and the root's tokens are skipped first.

>>> paths, parents, depths, ranks = compile_topology([(0, 0), (1,), (0,)])
>>> paths, parents, depths, ranks
([(0,), (1,), (0, 0)], [-1, 0, 0, 1], [0, 1, 1, 2], [-1, 0, 1, 0])
>>> fill_topology(paths, root_token=7, cand_tokens=[[5, 9, 3], [4, 8, 6]], cand_probs=[[.6, .3, .1], [.5, .3, .2]])
([7, 5, 9, 4], [1.0, 0.6, 0.3, 0.3])
>>> accepted_depth(paths, [0, 0]), accepted_depth(paths, [1, 0]), accepted_depth(paths, [2, 0])
(2, 1, 0)
>>> choose("hysteretic", [0, 3], [0.2, 0.5], score=0.6, current=0), choose("hysteretic", [0, 3], [0.2, 0.5], 0.3, 3)
(3, 3)
"""

from __future__ import annotations

from collections.abc import Sequence

Path = tuple[int, ...]


def compile_topology(paths: Sequence[Sequence[int]]) -> tuple[list[Path], list[int], list[int], list[int]]:
    """(sorted paths, parents [N], depths [N], ranks [N]): node 0 is the root, nodes by depth then rank."""
    ordered = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    index = {(): 0}
    parents, depths, ranks = [-1], [0], [-1]
    for p in ordered:
        if not p or min(p) < 0 or p in index or p[:-1] not in index:
            raise ValueError(f"bad path {p}: non-empty, ranks >= 0, no repeats, every prefix a node")
        index[p] = len(parents)
        parents.append(index[p[:-1]])
        depths.append(len(p))
        ranks.append(p[-1])
    return ordered, parents, depths, ranks


def fill_topology(
    paths: Sequence[Sequence[int]],
    root_token: int,
    cand_tokens: Sequence[Sequence[int]],
    cand_probs: Sequence[Sequence[float]],
    prune: bool = True,
) -> tuple[list[int], list[float]] | None:
    """Tokens and cumulative probabilities of every node ([root, ...]), or None when candidates run out."""
    ordered, parents, depths, ranks = compile_topology(paths)
    tokens, probs = [root_token], [1.0]
    for node in range(1, len(parents)):
        d, parent = depths[node], parents[node]
        if d > len(cand_tokens):
            return None
        # The parent's children by rank: candidates of depth d without the parent's and the root's token.
        allowed = [
            (t, p)
            for t, p in zip(cand_tokens[d - 1], cand_probs[d - 1], strict=True)
            if not (prune and t in (tokens[parent], root_token))
        ]
        if ranks[node] >= len(allowed):
            return None
        token, prob = allowed[ranks[node]]
        tokens.append(int(token))
        probs.append(probs[parent] * float(prob))
    return tokens, probs


def accepted_depth(paths: Sequence[Sequence[int]], true_ranks: Sequence[int]) -> int:
    """Depth reached along a continuation of child ranks ``true_ranks`` (-1: not a candidate)."""
    nodes = {tuple(p) for p in paths}
    d = 0
    while d < len(true_ranks) and true_ranks[d] >= 0 and tuple(true_ranks[: d + 1]) in nodes:
        d += 1
    return d


def choose(kind: str, trees: Sequence[int], thresholds: Sequence[float], score: float, current: int) -> int:
    """The next step's topology: static, ladder (``#{h <= score}`` steps up) or hysteretic (down, up)."""
    if kind == "static":
        return trees[0]
    if kind == "ladder":
        return trees[sum(1 for h in thresholds if score >= h)]
    down, up = thresholds
    if current == trees[1]:
        return trees[0] if score < down else trees[1]
    return trees[1] if score > up else trees[0]
