"""Reference definitions of tree attention: mask, position ids and the attention itself.

A draft block is ``T`` inputs that follow ``prefix_len`` cached positions. ``parents[i]`` is the index
of the input that input ``i`` continues, in ``[-1, i - 1]``; ``-1`` means it follows the cached prefix
directly. Input ``i`` attends to every cached position, to its ancestors and to itself, so tree
attention is causal attention along every root-to-leaf path. A chain ``[-1, 0, 1, ..., T - 2]``
gives back plain causal attention.

Worked example: a 4-node tree after 2 cached positions::

    node 0 (root)          parents = [-1, 0, 0, 1]
    |-- node 1             depth   = [ 0, 1, 1, 2]
    |   `-- node 3         pos ids = [ 2, 3, 3, 4]   (prefix_len + depth)
    `-- node 2

>>> import torch
>>> parents = torch.tensor([-1, 0, 0, 1])
>>> tree_position_ids(parents, prefix_len=2)
tensor([[2, 3, 3, 4]])

Rows are queries (nodes 0..3), columns are keys (prefix p0 p1, then nodes 0..3); masked entries hold
``torch.finfo(dtype).min``, shown here as ``-inf``:

>>> mask = tree_attention_mask(parents, prefix_len=2, dtype=torch.float32)  # [1, 1, 4, 6]
>>> mask[0, 0].masked_fill(mask[0, 0] < 0, float("-inf"))
tensor([[0., 0., 0., -inf, -inf, -inf],
        [0., 0., 0., 0., -inf, -inf],
        [0., 0., 0., -inf, 0., -inf],
        [0., 0., 0., 0., -inf, 0.]])
>>> bool((mask[mask != 0] == torch.finfo(torch.float32).min).all())
True
"""

from __future__ import annotations

import math

import torch


def check_parents(parents: torch.Tensor) -> list[int]:
    """Validate a parent array and return it as a Python list.

    >>> check_parents(torch.tensor([-1, 0, 0, 1]))
    [-1, 0, 0, 1]
    >>> check_parents(torch.tensor([-1, 1]))
    Traceback (most recent call last):
    ...
    ValueError: parents[1] = 1 must be in [-1, 0]
    """
    if parents.dim() != 1:
        raise ValueError(f"parents must be 1-D, got shape {tuple(parents.shape)}")
    if parents.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"parents must be int32 or int64, got {parents.dtype}")
    parent_list: list[int] = parents.tolist()
    for i, p in enumerate(parent_list):
        if not -1 <= p < i:
            raise ValueError(f"parents[{i}] = {p} must be in [-1, {i - 1}]")
    return parent_list


def tree_depths(parents: torch.Tensor) -> list[int]:
    """Depth of each node: 0 for a root (parent -1), else its parent's depth + 1.

    >>> tree_depths(torch.tensor([-1, 0, 0, 1, -1]))
    [0, 1, 1, 2, 0]
    """
    parent_list = check_parents(parents)
    depths: list[int] = []
    for p in parent_list:
        # parents[i] < i, so the parent's depth is already known.
        depths.append(0 if p == -1 else depths[p] + 1)
    return depths


def tree_ancestors(parents: torch.Tensor, node: int) -> list[int]:
    """Nodes on the path from the root down to ``node``, both included, root first.

    >>> tree_ancestors(torch.tensor([-1, 0, 0, 1]), 3)
    [0, 1, 3]
    """
    parent_list = check_parents(parents)
    if not 0 <= node < len(parent_list):
        raise ValueError(f"node {node} is out of range for {len(parent_list)} nodes")
    return _ancestors(parent_list, node)


def _ancestors(parent_list: list[int], node: int) -> list[int]:
    path = [node]
    while parent_list[path[-1]] != -1:
        path.append(parent_list[path[-1]])
    return path[::-1]


def tree_attention_mask(parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive attention mask [1, 1, T, prefix_len + T]: 0.0 where attended, finfo(dtype).min elsewhere.

    >>> tree_attention_mask(torch.tensor([-1, 0]), prefix_len=1, dtype=torch.float16)
    tensor([[[[     0.,      0., -65504.],
              [     0.,      0.,      0.]]]], dtype=torch.float16)
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    parent_list = check_parents(parents)
    num_nodes = len(parent_list)
    allowed = torch.zeros(num_nodes, prefix_len + num_nodes, dtype=torch.bool)  # [T, P + T]
    allowed[:, :prefix_len] = True
    for i in range(num_nodes):
        for a in _ancestors(parent_list, i):
            allowed[i, prefix_len + a] = True
    mask = torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype)  # [T, P + T]
    mask.masked_fill_(allowed, 0.0)
    return mask[None, None].to(parents.device)


def tree_position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position id of each node, prefix_len + depth, as a LongTensor [1, T].

    >>> tree_position_ids(torch.tensor([-1, 0, 1, -1]), prefix_len=5)
    tensor([[5, 6, 7, 5]])
    """
    if prefix_len < 0:
        raise ValueError(f"prefix_len must be >= 0, got {prefix_len}")
    depths = tree_depths(parents)
    return (prefix_len + torch.tensor(depths, dtype=torch.long, device=parents.device))[None]  # [1, T]


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    parents: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Tree attention by definition: each node softmaxes over the prefix, its ancestors and itself.

    q is [B, H, T, D]; k and v are [B, Hkv, P + T, D] (the prefix, then the T draft inputs), with Hkv
    dividing H (grouped-query attention: query head h reads kv head h // (H // Hkv)). Deliberately
    written without tree_attention_mask so that mask + SDPA can be checked against it. Computed in
    float32, returned in q's dtype. Returns [B, H, T, D].

    With one node and no prefix the node can only attend to itself, so it returns its own value:

    >>> v = torch.randn(1, 1, 1, 4)
    >>> out = tree_attention(torch.randn(1, 1, 1, 4), torch.randn(1, 1, 1, 4), v, torch.tensor([-1]))
    >>> torch.equal(out, v)
    True
    """
    parent_list = check_parents(parents)
    batch, num_heads, num_nodes, head_dim = q.shape
    num_kv_heads, kv_len = k.shape[1], k.shape[2]
    if k.shape != v.shape or k.shape[0] != batch or k.shape[3] != head_dim:
        raise ValueError(f"bad shapes: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if len(parent_list) != num_nodes or kv_len < num_nodes:
        raise ValueError(f"{len(parent_list)} parents, {num_nodes} queries and {kv_len} keys do not match")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_kv_heads} kv heads do not divide {num_heads} query heads")
    prefix_len = kv_len - num_nodes
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale

    group = num_heads // num_kv_heads
    k = k.float().repeat_interleave(group, dim=1)  # [B, H, P + T, D]
    v = v.float().repeat_interleave(group, dim=1)  # [B, H, P + T, D]
    out = torch.empty(batch, num_heads, num_nodes, head_dim, dtype=torch.float32, device=q.device)
    for i in range(num_nodes):
        keys = list(range(prefix_len)) + [prefix_len + a for a in _ancestors(parent_list, i)]
        keys_t = torch.tensor(keys, device=q.device)  # [K]
        scores = q[:, :, i, None].float() @ k[:, :, keys_t].transpose(-1, -2) * scale  # [B, H, 1, K]
        out[:, :, i] = (scores.softmax(dim=-1) @ v[:, :, keys_t])[:, :, 0]
    return out.to(q.dtype)
