"""Reference definition of in-place KV-cache compaction after verification.

After a draft tree is verified, only the accepted path's entries should stay in the cache, packed right
after the already-kept positions. ``compact_kv`` moves ``cache[:, :, src[j]]`` to
``cache[:, :, dst_start + j]`` for each ``j`` in order. Because ``src`` is strictly increasing and
``src[j] >= dst_start + j``, each write lands at or before its own source and strictly before every
later source, so copying in order never overwrites a source that is still to be read.

Worked example: 2 cached positions, then 5 draft nodes at positions 2..6; the accepted path is nodes
[0, 2, 4], i.e. positions src = [2, 4, 6], packed to start at position 2:

>>> import torch
>>> cache = torch.arange(7.0).reshape(1, 1, 7, 1)  # [B, H, S, D], position s holds value s
>>> compact_kv([cache], torch.tensor([2, 4, 6]), dst_start=2)
>>> cache.flatten()
tensor([0., 1., 2., 4., 6., 5., 6.])

Positions past dst_start + len(src) keep stale values; the caller truncates its cache length.
"""

from __future__ import annotations

import torch


def check_compaction(src: torch.Tensor, dst_start: int, seq_len: int | None) -> list[int]:
    """Validate a compaction for caches of length ``seq_len`` (None: no caches); return ``src`` as a list.

    >>> check_compaction(torch.tensor([3, 3]), dst_start=0, seq_len=8)
    Traceback (most recent call last):
    ...
    ValueError: src must be strictly increasing, got src[1] = 3 after 3
    >>> check_compaction(torch.tensor([1, 3]), dst_start=2, seq_len=8)
    Traceback (most recent call last):
    ...
    ValueError: src[0] = 1 < dst_start + 0 = 2: an in-order copy would overwrite an unread source
    """
    if src.dim() != 1 or src.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"src must be a 1-D int32/int64 tensor, got {src.dtype} of shape {tuple(src.shape)}")
    if dst_start < 0:
        raise ValueError(f"dst_start must be >= 0, got {dst_start}")
    src_list: list[int] = src.tolist()
    for j, s in enumerate(src_list):
        if j > 0 and s <= src_list[j - 1]:
            raise ValueError(f"src must be strictly increasing, got src[{j}] = {s} after {src_list[j - 1]}")
        if s < dst_start + j:
            raise ValueError(
                f"src[{j}] = {s} < dst_start + {j} = {dst_start + j}: "
                "an in-order copy would overwrite an unread source"
            )
        if seq_len is not None and s >= seq_len:
            raise ValueError(f"src[{j}] = {s} is out of range for sequence length {seq_len}")
    return src_list


def compact_kv(caches: list[torch.Tensor], src: torch.Tensor, dst_start: int) -> None:
    """In place, for each [B, H, S, D] cache and j in order: cache[:, :, dst_start + j] = cache[:, :, src[j]].

    All caches must share the sequence length S; batch, heads and head size may differ (e.g. keys
    and values of different widths).
    """
    seq_lens = {cache.shape[2] if cache.dim() == 4 else -1 for cache in caches}
    if -1 in seq_lens:
        raise ValueError(f"caches must be 4-D [B, H, S, D], got shapes {[tuple(c.shape) for c in caches]}")
    if len(seq_lens) > 1:
        raise ValueError(f"caches have different sequence lengths {sorted(seq_lens)}")
    seq_len = seq_lens.pop() if seq_lens else None
    src_list = check_compaction(src, dst_start, seq_len)
    for cache in caches:
        for j, s in enumerate(src_list):
            cache[:, :, dst_start + j] = cache[:, :, s]
