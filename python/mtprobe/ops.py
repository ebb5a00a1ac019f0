"""torch.ops.mtprobe: typed wrappers and fake kernels.

The CPU kernels are C++ (csrc/ops/); importing this module loads them. The fake kernels below
give every op its output metadata without running it, so the ops trace under torch.compile and
pass ``torch.library.opcheck``. Reference definitions: ``mtprobe.reference``.
"""

from __future__ import annotations

import torch

from mtprobe import _C  # noqa: F401  (registers torch.ops.mtprobe)

__all__ = [
    "tree_attention_mask",
    "tree_position_ids",
    "tree_ancestor_bits",
    "tree_attention",
    "expand_draft_tree",
    "verify_greedy",
    "verify_rejection",
    "compact_kv_",
]


@torch.library.register_fake("mtprobe::tree_attention_mask")
def _tree_attention_mask_fake(parents: torch.Tensor, prefix_len: int, dtype: torch.dtype) -> torch.Tensor:
    t = parents.shape[0]
    return parents.new_empty((1, 1, t, prefix_len + t), dtype=dtype)


@torch.library.register_fake("mtprobe::tree_position_ids")
def _tree_position_ids_fake(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    return parents.new_empty((1, parents.shape[0]), dtype=torch.long)


@torch.library.register_fake("mtprobe::tree_ancestor_bits")
def _tree_ancestor_bits_fake(parents: torch.Tensor) -> torch.Tensor:
    t = parents.shape[0]
    return parents.new_empty((t, (t + 63) // 64), dtype=torch.long)


@torch.library.register_fake("mtprobe::tree_attention")
def _tree_attention_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor, scale: float
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("mtprobe::expand_draft_tree")
def _expand_draft_tree_fake(
    logits: torch.Tensor, root_token: torch.Tensor, budget: int, width: int, prune: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # Fixed shapes (padded to the budget), so a step that expands the tree keeps static shapes.
    return (
        logits.new_empty((budget,), dtype=torch.long),
        logits.new_empty((budget,), dtype=torch.long),
        logits.new_empty((budget,), dtype=torch.float64),
        logits.new_empty((), dtype=torch.long),
    )


@torch.library.register_fake("mtprobe::verify_greedy")
def _verify_greedy_fake(
    tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, root: int
) -> torch.Tensor:
    # The accepted path's length depends on the data.
    n = torch.library.get_ctx().new_dynamic_size()
    return tokens.new_empty((n,), dtype=torch.long)


@torch.library.register_fake("mtprobe::verify_rejection")
def _verify_rejection_fake(
    tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    n = torch.library.get_ctx().new_dynamic_size()
    return tokens.new_empty((n,), dtype=torch.long), tokens.new_empty((), dtype=torch.long)


@torch.library.register_fake("mtprobe::compact_kv_")
def _compact_kv_fake(caches: list[torch.Tensor], src: torch.Tensor, dst_start: int) -> None:
    return None


def tree_attention_mask(
    parents: torch.Tensor, prefix_len: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Additive mask ``[1, 1, T, prefix_len + T]`` of a draft block (see ``reference.tree_mask``)."""
    return torch.ops.mtprobe.tree_attention_mask(parents, prefix_len, dtype)


def tree_position_ids(parents: torch.Tensor, prefix_len: int) -> torch.Tensor:
    """Position ids ``[1, T]``: ``prefix_len + depth``."""
    return torch.ops.mtprobe.tree_position_ids(parents, prefix_len)


def expand_draft_tree(
    logits: torch.Tensor,
    root_token: torch.Tensor | int,
    budget: int,
    width: int | None = None,
    prune: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The dynamic draft tree (seed 001, Alg. 1) from the mask tokens' logits, on their device.

    ``logits``: ``[depths, vocab]``, row ``d - 1`` the ``d``-th mask token's logits. Each row's top
    ``width`` tokens (by logit, ties to the lower id; default ``budget + 1``) and their softmax
    probabilities are that depth's candidates. Returns ``(tokens, parents, probs, num_nodes)``: the
    first ``num_nodes`` entries of the ``[budget]`` tensors are the tree (root first, parents before
    children, ``probs`` the cumulative path probabilities), the rest padding (token -1, parent -1,
    prob 0). On a GPU nothing is read back to the host. Reference: ``reference.expand_tree``.

    >>> logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 3.0, 0.0]]).log_softmax(-1)
    >>> tokens, parents, probs, n = expand_draft_tree(logits, torch.tensor(2), budget=4, width=2)
    >>> int(n), tokens.tolist(), parents.tolist()
    (4, [2, 0, 1, 1], [-1, 0, 0, 1])
    """
    if not torch.is_tensor(root_token):
        root_token = torch.tensor(int(root_token), device=logits.device)
    if width is None:
        width = min(budget + 1, logits.shape[-1])
    return torch.ops.mtprobe.expand_draft_tree(logits, root_token, budget, width, prune)


def verify_greedy(
    tokens: torch.Tensor, parents: torch.Tensor, target: torch.Tensor, root: int = 0
) -> torch.Tensor:
    """Accepted path ``[n_path]`` of node indices from ``root`` (see ``reference.verify``)."""
    return torch.ops.mtprobe.verify_greedy(tokens, parents, target, root)


def verify_rejection(
    tokens: torch.Tensor, parents: torch.Tensor, p: torch.Tensor, q: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection-sampling verification: (accepted path ``[n_path]``, output token ``[]``); see ``reference.verify``."""
    return torch.ops.mtprobe.verify_rejection(tokens, parents, p, q, uniforms)


def compact_kv_(caches: list[torch.Tensor], src: torch.Tensor, dst_start: int) -> None:
    """In place: ``cache[:, :, dst_start + j] = cache[:, :, src[j]]`` for every cache tensor."""
    torch.ops.mtprobe.compact_kv_(caches, src, dst_start)


def tree_ancestor_bits(parents: torch.Tensor) -> torch.Tensor:
    """The block's ancestor pattern, compact: ``[T, ceil(T / 64)]`` int64, bit ``a % 64`` of word
    ``a // 64`` in row ``i`` set when input ``a`` is ``i`` or an ancestor of ``i``.

    >>> tree_ancestor_bits(torch.tensor([-1, 0, 0, 1])).flatten().tolist()  # 0b0001, 0b0011, 0b0101, 0b1011
    [1, 3, 5, 11]
    """
    return torch.ops.mtprobe.tree_ancestor_bits(parents)


def tree_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ancestor_bits: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Tree attention ``[B, H, T, D]`` over the cached prefix and the tree inputs, the tree given by
    :func:`tree_ancestor_bits` (no dense mask). ``k``, ``v``: ``[B, Hkv, P + T, D]``, ``Hkv`` dividing
    ``H``; ``scale`` defaults to ``1 / sqrt(D)``. Reference: ``mtprobe.reference.tree_attention``."""
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return torch.ops.mtprobe.tree_attention(q, k, v, ancestor_bits, float(scale))
