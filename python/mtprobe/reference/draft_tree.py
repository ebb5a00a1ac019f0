"""Reference draft-tree construction (seed 001, section 3.4, Alg. 1 and App. D).

Depth d of the next draft tree draws from the d-th mask token's distribution; the inputs are,
per depth, its top-m tokens in descending probability. Returns ``(tokens, parents, probs)`` with
the root (the last generated token) at index 0 and every parent before its children.

Static branches [K_1, ..., K_k], Top-1 expansion: only the most probable node of each depth gets
children. With the pruner, a candidate equal to its parent's token or to the root is skipped.

>>> tokens, parents, probs = static_tree(7, [[5, 9, 3], [4, 6, 8]], [[0.6, 0.3, 0.1], [0.5, 0.3, 0.2]],
...                                      branches=[2, 1], prune=False)
>>> tokens, parents
([7, 5, 9, 4], [-1, 0, 0, 1])
>>> [round(p, 2) for p in probs]
[1.0, 0.6, 0.3, 0.3]

The dynamic tree scores paths by cumulative probability and keeps the best ``budget - 1``:

>>> tokens, parents, _ = dynamic_tree(7, [[5, 9, 3], [4, 6, 8]], [[0.6, 0.3, 0.1], [0.5, 0.3, 0.2]],
...                                   budget=4, prune=False)
>>> tokens, parents  # 5 (0.6), 9 (0.3) and 5->4 (0.3) beat 5->6 (0.18)
([7, 5, 9, 4], [-1, 0, 0, 1])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _children(
    tokens: Sequence[int], probs: Sequence[float], parent_token: int, root_token: int, prune: bool, count: int
) -> list[tuple[int, float]]:
    out = []
    for t, p in zip(tokens, probs, strict=True):
        if len(out) == count:
            break
        if prune and t in (parent_token, root_token):
            continue
        out.append((int(t), float(p)))
    return out


def static_tree(
    root_token: int,
    cand_tokens: Sequence[Sequence[int]],  # [k][m], best first
    cand_probs: Sequence[Sequence[float]],  # [k][m]
    branches: Sequence[int],
    prune: bool = True,
) -> tuple[list[int], list[int], list[float]]:
    tokens, parents, probs = [root_token], [-1], [1.0]
    expand = 0
    for d, count in enumerate(branches):
        kids = _children(cand_tokens[d], cand_probs[d], tokens[expand], root_token, prune, count)
        if not kids:
            break
        first = len(tokens)
        for t, p in kids:
            tokens.append(t)
            parents.append(expand)
            probs.append(probs[expand] * p)
        expand = first  # the most probable child expands next (Top-1)
    return tokens, parents, probs


def dynamic_tree(
    root_token: int,
    cand_tokens: Sequence[Sequence[int]],  # [k][m], best first
    cand_probs: Sequence[Sequence[float]],  # [k][m]
    budget: int,
    prune: bool = True,
) -> tuple[list[int], list[int], list[float]]:
    # candidate: [token, parent candidate index, depth, cumulative probability]; index 0 = root
    cand: list[tuple[int, int, int, float]] = [(root_token, -1, 0, 1.0)]
    used = {0}  # picked for expansion once (Alg. 1: C <- C \ N)

    def ranked(skip_used: bool) -> list[int]:
        idx = [i for i in range(1, len(cand)) if not (skip_used and i in used)]
        return sorted(idx, key=lambda i: (-cand[i][3], cand[i][2], i))

    frontier = [0]
    depths = len(cand_tokens)
    for d in range(1, depths + 1):
        if budget - d <= 0:
            break
        for n in frontier:
            for t, p in _children(
                cand_tokens[d - 1], cand_probs[d - 1], cand[n][0], root_token, prune, budget - d
            ):
                cand.append((t, n, d, cand[n][3] * p))
        if d < depths:
            picked = ranked(skip_used=True)[: budget - d]
            used.update(picked)
            frontier = [i for i in picked if cand[i][2] == d]
    kept: list[int] = []
    kept_set = {0}
    for i in ranked(skip_used=False):
        if len(kept) >= budget - 1:
            break
        if cand[i][1] in kept_set:
            kept.append(i)
            kept_set.add(i)
    kept.sort(key=lambda i: cand[i][2])  # stable: by depth, then rank
    new_index = {0: 0}
    tokens, parents, probs = [root_token], [-1], [1.0]
    for i in kept:
        new_index[i] = len(tokens)
        tokens.append(cand[i][0])
        parents.append(new_index[cand[i][1]])
        probs.append(cand[i][3])
    return tokens, parents, probs


def expand_tree(
    logits: torch.Tensor,  # [depths, vocab], row d - 1 from the d-th mask token
    root_token: int,
    budget: int,
    width: int,
    prune: bool = True,
) -> tuple[list[int], list[int], list[float]]:
    """The dynamic tree straight from the masks' logits (the ``expand_draft_tree`` op, unpadded):
    each row's ``width`` best tokens by logit, ties to the lower id, with their softmax probabilities.

    >>> expand_tree(torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]), 2, budget=4, width=2)[:2]
    ([2, 0, 1, 1], [-1, 0, 0, 1])
    """
    x = logits.float()
    e = (x - x.max(-1, keepdim=True).values).exp()  # [depths, vocab]
    probs = (e.double() / e.sum(-1, keepdim=True, dtype=torch.float64)).float()  # the normaliser in double
    cand_tokens, cand_probs = [], []
    for row, p in zip(x.tolist(), probs.tolist(), strict=True):
        best = sorted(range(len(row)), key=lambda v: (-row[v], v))[:width]
        cand_tokens.append(best)
        cand_probs.append([p[v] for v in best])
    return dynamic_tree(root_token, cand_tokens, cand_probs, budget, prune)


def merge_trees(
    a: tuple[Sequence[int], Sequence[int], Sequence[float]],
    b: tuple[Sequence[int], Sequence[int], Sequence[float]],
    budget: int,
) -> tuple[list[int], list[int], list[float]]:
    """The hybrid drafter's merge: two trees of one root, each as (tokens, parents, probs) with the
    root at index 0, united by token path (a node scores the higher of its scores), then the best
    ``budget - 1`` nodes kept (ties: the node met first, a's before b's), in union order.

    >>> merge_trees(([7, 5, 9], [-1, 0, 0], [1, 0.6, 0.3]), ([7, 5, 4, 2], [-1, 0, 1, 0], [1, 1, 1, 0.2]), 4)
    ([7, 5, 9, 4], [-1, 0, 0, 1], [1.0, 1.0, 0.3, 1.0])
    """
    trees = [t for t in (a, b) if len(t[0]) > 0]
    if not trees:
        return [], [], []
    nodes: list[list] = [[int(trees[0][0][0]), -1, 1.0]]  # [token, parent, score] in union order
    for tokens, parents, probs in (a, b):
        to_union = [0] * len(tokens)
        for i in range(1, len(tokens)):
            parent = to_union[parents[i]]
            found = next((u for u in range(1, len(nodes)) if nodes[u][:2] == [tokens[i], parent]), None)
            if found is None:
                found = len(nodes)
                nodes.append([int(tokens[i]), parent, float(probs[i])])
            else:
                nodes[found][2] = max(nodes[found][2], float(probs[i]))
            to_union[i] = found
    order = sorted(range(1, len(nodes)), key=lambda u: -nodes[u][2])  # stable: ties keep union order
    kept = {0} | set(order[: max(budget - 1, 0)])
    new_index: dict[int, int] = {}
    out_tokens, out_parents, out_probs = [], [], []
    for u, (token, parent, score) in enumerate(nodes):
        if u in kept and (u == 0 or parent in new_index):
            new_index[u] = len(out_tokens)
            out_tokens.append(token)
            out_parents.append(-1 if u == 0 else new_index[parent])
            out_probs.append(score)
    return out_tokens, out_parents, out_probs


def plan_masks(
    tree: tuple[Sequence[int], Sequence[int], Sequence[float]], inputs: int, k: int, mask_value: float
) -> tuple[list[int], list[int], list[float], list[bool]]:
    """Which nodes carry the k mask tokens when masks and drafts share ``inputs`` (the hybrid with
    ``mask_value``). For every N, the best N nodes by score (ties: the earlier) with masks on as many
    of them as fit (1 + N + k * masked <= inputs), those most likely to end the step first (ties: the
    earlier; none where that chance is 0); the plan is the N maximising

        sum_{drafts} p_i + mask_value * sum_{masked} (p_i - sum_{children c of i} p_c)

    (p_i - sum p_c: the chance the step ends at node i), the smaller N on ties. Returns ``(tokens,
    parents, probs, carries)`` in the tree's order.

    >>> plan_masks(([7, 5, 4, 9], [-1, 0, 1, 0], [1.0, 0.9, 0.8, 0.01]), inputs=5, k=1, mask_value=0.3)
    ([7, 5, 4], [-1, 0, 1], [1.0, 0.9, 0.8], [True, False, True])
    """
    tokens, parents, probs = (list(x) for x in tree)
    if not tokens:
        return [], [], [], []
    order = sorted(range(1, len(tokens)), key=lambda i: -probs[i])
    best: tuple[float, list[int], list[int]] | None = None
    for n in range(min(inputs - 1, len(order)) + 1):
        kept = sorted([0, *order[:n]])
        ends = {
            i: (1.0 if i == 0 else probs[i]) - sum(probs[c] for c in kept if c and parents[c] == i)
            for i in kept
        }
        by_end = sorted(kept, key=lambda i: -ends[i])
        masked = [i for i in by_end[: (inputs - 1 - n) // k] if ends[i] > 0]
        value = sum(probs[i] for i in kept if i) + mask_value * sum(ends[i] for i in masked)
        if best is None or value > best[0]:
            best = (value, kept, masked)
    assert best is not None
    _, kept, masked = best
    index = {u: j for j, u in enumerate(kept)}
    return (
        [tokens[u] for u in kept],
        [-1 if u == 0 else index[parents[u]] for u in kept],
        [probs[u] for u in kept],
        [u in masked for u in kept],
    )


def mask_source(path: Sequence[int], mask_input: Sequence[int], k: int) -> tuple[int, int]:
    """``(first, shift)``: the masks the next tree reads after a step accepted ``path`` (block indices,
    root first): the last node's own (shift 0), else its nearest masked ancestor's within ``k - 1`` nodes
    up, whose masks ``m_{shift+1}..m_k`` (logit rows ``first + shift .. first + k - 1``) predict the next
    tree's depths; ``(-1, 0)`` when there are none. ``mask_input[i]``: input index of node i's m_1, or -1.

    >>> mask_source([3, 5], [-1, -1, -1, 9, -1, -1], 2)
    (9, 1)
    >>> mask_source([3, 5, 6], [-1, -1, -1, 9, -1, -1, -1], 2)
    (-1, 0)
    """
    for shift, node in enumerate(reversed(path)):
        if shift >= k:
            break
        if 0 <= node < len(mask_input) and mask_input[node] >= 0:
            return mask_input[node], shift
    return -1, 0
