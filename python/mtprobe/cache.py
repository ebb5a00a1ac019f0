"""A KV cache for tree decoding: preallocated, compacted in place by the C++ loop.

Each layer owns key/value buffers ``[batch, kv_heads, capacity, head_dim]`` and a length. A forward
writes its block at ``[length, length + T)`` and attends to ``[0, length + T)``. The decode loop
then moves the accepted path's entries down (``torch.ops.mtprobe.compact_kv_``, O(accepted)) and
sets the length for the next forward; nothing is ever concatenated or re-gathered.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer


class TreeKVLayer(DynamicLayer):
    """One layer's preallocated cache. ``length`` is set by the owner before each forward."""

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

    def crop(self, max_length: int) -> None:
        self.length = min(self.length, max_length) if max_length >= 0 else max(0, self.length + max_length)

    def reset(self) -> None:
        self.length = 0


class TreeKVCache(Cache):
    """``num_layers`` preallocated layers of ``capacity`` entries each."""

    def __init__(self, num_layers: int, capacity: int) -> None:
        super().__init__(layers=[TreeKVLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    def set_length(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def buffers(self) -> list[torch.Tensor]:
        """Every initialised key and value buffer, for in-place compaction."""
        out: list[torch.Tensor] = []
        for layer in self.layers:
            if layer.is_initialized:
                out += [layer.keys, layer.values]
        return out
