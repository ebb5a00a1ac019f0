"""Reference definition of greedy (lossless) verification of a draft tree.

``tokens[i]`` is the token drafted at node ``i``, ``parents`` the tree as in ``tree_mask``, and
``target[i]`` the target model's greedy token after node ``i`` (the argmax of its logits at node i).
Starting at ``root``, walk down to a child whose drafted token equals the current node's target token,
taking the lowest-index child on ties, until no child matches. Every node on the path is exactly what
greedy decoding would have produced, so the output is lossless; the caller then appends the bonus
token ``target[path[-1]]``.

Worked example::

    node    0    1    2    3    4         tree:  0 -- 1 -- 3
    token  10   11   12   13   14                `--- 2 -- 4
    parent -1    0    0    1    2
    target 12   99   14   99    7

At node 0 the target wants 12: child 1 drafted 11, child 2 drafted 12, so move to 2. At node 2 it
wants 14, which child 4 drafted. Node 4 has no children: accept [0, 2, 4], then bonus token 7.

>>> import torch
>>> tokens = torch.tensor([10, 11, 12, 13, 14])
>>> parents = torch.tensor([-1, 0, 0, 1, 2])
>>> target = torch.tensor([12, 99, 14, 99, 7])
>>> path = verify_greedy(tokens, parents, target, root=0)
>>> path
tensor([0, 2, 4])
>>> int(target[path[-1]])
7
"""

from __future__ import annotations

import torch

from .tree_mask import check_parents


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, root: int
) -> torch.Tensor:
    """Longest greedily-accepted path from ``root``, as node indices [root, ..., last]: LongTensor [n_path].

    A root whose target token no child drafted accepts only itself:

    >>> verify_greedy(torch.tensor([5, 6]), torch.tensor([-1, 0]), torch.tensor([7, 8]), root=0)
    tensor([0])
    """
    parent_list = check_parents(parents)
    num_nodes = len(parent_list)
    if tokens.dim() != 1 or target.dim() != 1:
        raise ValueError(
            f"tokens and target must be 1-D, got {tuple(tokens.shape)} and {tuple(target.shape)}"
        )
    if len(tokens) != num_nodes or len(target) != num_nodes:
        raise ValueError(f"lengths differ: {len(tokens)} tokens, {num_nodes} parents, {len(target)} targets")
    if not 0 <= root < num_nodes:
        raise ValueError(f"root {root} is out of range for {num_nodes} nodes")
    token_list: list[int] = tokens.tolist()
    target_list: list[int] = target.tolist()

    path = [root]
    while True:
        cur = path[-1]
        matches = [c for c in range(num_nodes) if parent_list[c] == cur and token_list[c] == target_list[cur]]
        if not matches:
            break
        path.append(matches[0])  # lowest-index matching child
    return torch.tensor(path, dtype=torch.long, device=tokens.device)


def verify_rejection(
    tokens: torch.Tensor,  # [n] draft tokens; node 0 is the root (its token is not used)
    parents: torch.Tensor,  # [n], parents[0] = -1, one tree rooted at node 0
    p: torch.Tensor,  # [n, vocab] target probabilities after each node
    q: torch.Tensor,  # [n - 1, vocab] row j - 1: the distribution node j's token was drawn from
    uniforms: torch.Tensor,  # [n + 1] in [0, 1): uniforms[j] decides node j, uniforms[n] the last draw
) -> tuple[torch.Tensor, int]:
    """Rejection sampling over a tree (Leviathan et al. for a chain, SpecInfer for siblings).

    At node i the residual starts as r = p[i]; its children c (independent draws from one q) are
    tried in index order: accept if u_c < r[x_c] / q_c[x_c], else r <- normalise(max(r - q_c, 0)).
    The walk moves to an accepted child; when no child is accepted the output token is drawn from r
    by inverse CDF with the last uniform. Returns (path [n_path], output token).

    A chain over vocab {0, 1}: p_0 = [0.6, 0.4]; node 1 drafted 1 from q = [0.2, 0.8], accepted iff
    u_1 < 0.4 / 0.8 = 0.5; on rejection r = [1, 0], so the output is 0:

    >>> p = torch.tensor([[0.6, 0.4], [0.5, 0.5]])
    >>> q = torch.tensor([[0.2, 0.8]])
    >>> verify_rejection(torch.tensor([7, 1]), torch.tensor([-1, 0]), p, q, torch.tensor([0.0, 0.3, 0.9]))
    (tensor([0, 1]), 1)
    >>> verify_rejection(torch.tensor([7, 1]), torch.tensor([-1, 0]), p, q, torch.tensor([0.0, 0.7, 0.9]))
    (tensor([0]), 0)
    """
    parent_list = check_parents(parents)
    n = len(parent_list)
    if parent_list[0] != -1 or any(x < 0 for x in parent_list[1:]):
        raise ValueError("verify_rejection needs one tree rooted at node 0")
    if p.shape[0] != n or q.shape != (n - 1, p.shape[1]) or uniforms.shape != (n + 1,):
        raise ValueError(
            f"need p [n, vocab], q [n - 1, vocab], uniforms [n + 1] for n = {n}; got "
            f"{tuple(p.shape)}, {tuple(q.shape)}, {tuple(uniforms.shape)}"
        )
    for name, probs in (("p", p), ("q", q)):
        if not bool((torch.isfinite(probs) & (probs >= 0)).all()):
            raise ValueError(
                f"{name} holds a NaN, inf or negative entry; probabilities must be finite and >= 0"
            )
    p, q, u = p.double(), q.double(), uniforms.double().tolist()
    path = [0]
    while True:
        cur = path[-1]
        r = p[cur].clone()  # [vocab]
        accepted = None
        for c in range(cur + 1, n):
            if parent_list[c] != cur:
                continue
            x = int(tokens[c])
            if u[c] * q[c - 1, x] < r[x]:
                accepted = c
                break
            leftover = (r - q[c - 1]).clamp(min=0)  # [vocab]
            if leftover.sum() > 0:
                r = leftover / leftover.sum()
        if accepted is None:
            cdf = torch.cumsum(r, 0)
            token = int(torch.searchsorted(cdf, u[n] * cdf[-1], right=True).clamp(max=len(r) - 1))
            return torch.tensor(path, dtype=torch.long), token
        path.append(accepted)
