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
