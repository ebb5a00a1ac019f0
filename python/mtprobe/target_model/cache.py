"""A KV cache for tree decoding: grown geometrically, compacted in place by the C++ loop.

Each layer owns key/value buffers ``[batch, kv_heads, capacity, head_dim]`` and a length. A forward
writes its block at ``[length, length + T)`` and attends to ``[0, length + T)``. The decode loop
then moves the accepted path's entries down (``torch.ops.mtprobe.compact_kv_``, O(accepted)) and
sets the length for the next forward; nothing is concatenated or re-gathered per step.

Memory follows the tokens actually generated, not ``max_new_tokens``: ``reserve`` reallocates every
layer to a larger capacity (copying what it holds) when a block would not fit, and its owner grows
it by doubling, so the copies cost O(1) amortised per token. The C++ loop notices a reallocation by
the buffers' new size and fetches them again.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class TreeKVLayer(DynamicLayer):
    """One layer's cache, grown by ``reserve``. ``length`` is set by the owner before each forward."""

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        self.keys = key_states.new_zeros((b, h, self.capacity, dk))  # [B, H_kv, capacity, D]
        self.values = value_states.new_zeros((b, h, self.capacity, dv))  # [B, H_kv, capacity, D]
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(
                f"TreeKVCache is full: {self.length} cached + {n} new entries exceed its capacity {self.capacity}"
            )
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_seq_length(self) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_max_length(self) -> int:
        return self.capacity

    def reserve(self, capacity: int) -> None:
        """Room for ``capacity`` entries; what the layer holds is kept (a copy when it moves)."""
        if capacity <= self.capacity:
            return
        if self.is_initialized:
            keys, values = self.keys, self.values
            b, h, _, dk = keys.shape
            self.keys = keys.new_zeros((b, h, capacity, dk))  # [B, H_kv, capacity, D]
            self.values = values.new_zeros((b, h, capacity, values.shape[-1]))  # [B, H_kv, capacity, D]
            self.keys[:, :, : self.capacity] = keys
            self.values[:, :, : self.capacity] = values
        self.capacity = capacity

    def crop(self, max_length: int) -> None:
        self.length = min(self.length, max_length) if max_length >= 0 else max(0, self.length + max_length)

    def reset(self) -> None:
        self.length = 0


class TreeKVCache(Cache):
    """``num_layers`` layers of ``capacity`` entries each, allocated at the first forward."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"TreeKVCache capacity must be >= 1 entry, got {capacity}")
        super().__init__(layers=[TreeKVLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    def reserve(self, capacity: int) -> None:
        """Grow every layer to ``capacity`` entries (no-op if it holds that many already)."""
        if capacity > self.capacity:
            for layer in self.layers:
                layer.reserve(capacity)
            self.capacity = capacity

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def copy_entries(
        self, source: TreeKVCache, start: int, end: int, dtype: torch.dtype | None = None
    ) -> None:
        """Take ``source``'s entries ``[start, end)`` of every layer and hold the first ``end``: a draft of
        the target's architecture taking the target's verified entries instead of computing its own
        (the entries before ``start`` are this cache's already). The caller vouches that ``source``
        holds them: its lengths say where its last forward began, not what the loop verified since
        (and a :class:`~mtprobe.target_model.plan.PlannedKVCache` never advances them), so only its capacity is checked.
        ``dtype``: what this cache holds when the copy allocates it (a bfloat16 target's float32 draft);
        ``None``: the source's."""
        if len(source.layers) != len(self.layers):
            raise ValueError(
                f"copy_entries: the source cache has {len(source.layers)} layers, this one {len(self.layers)}"
            )
        if not 0 <= start <= end:
            raise ValueError(f"copy_entries: [{start}, {end}) is not a range of entries (0 <= start <= end)")
        self.reserve(end)
        for mine, theirs in zip(self.layers, source.layers, strict=True):
            if not theirs.is_initialized or theirs.keys.shape[-2] < end:
                raise ValueError(f"copy_entries: the source cache has room for fewer than {end} entries")
            if not mine.is_initialized:
                empty = theirs.keys[:, :, :0].to(dtype or theirs.keys.dtype)
                mine.lazy_initialization(empty, theirs.values[:, :, :0].to(empty.dtype))
            mine.keys[:, :, start:end] = theirs.keys[:, :, start:end]
            mine.values[:, :, start:end] = theirs.values[:, :, start:end]
            mine.length = end

    def buffers(self) -> list[torch.Tensor]:
        """Every initialised key and value buffer, for in-place compaction."""
        out: list[torch.Tensor] = []
        for layer in self.layers:
            if layer.is_initialized:
                out += [layer.keys, layer.values]
        return out
