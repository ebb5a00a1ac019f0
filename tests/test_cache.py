"""The tree KV cache grows with the tokens generated, not with max_new_tokens (python/mtprobe/target_model/cache.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe.target_model.adapter import HFAdapter
from mtprobe.target_model.cache import TreeKVCache

generate_module = importlib.import_module("mtprobe.decode.call")  # where a call sizes its first KV cache


def test_reserve_keeps_what_the_cache_holds():
    cache = TreeKVCache(num_layers=2, capacity=4)
    keys = torch.arange(2 * 3 * 4 * 5, dtype=torch.float32).view(2, 3, 4, 5)  # [B, H, 4, D]
    values = -keys
    for layer in cache.layers:
        layer.update(keys, values)
    cache.reserve(9)
    assert cache.capacity == 9
    for layer in cache.layers:
        assert layer.keys.shape == (2, 3, 9, 5) and layer.values.shape == (2, 3, 9, 5)
        assert torch.equal(layer.keys[:, :, :4], keys) and torch.equal(layer.values[:, :, :4], values)
        assert not layer.keys[:, :, 4:].any()
    cache.reserve(3)  # never shrinks
    assert cache.capacity == 9


def test_reserve_before_the_first_forward_sizes_the_lazy_allocation():
    cache = TreeKVCache(num_layers=1, capacity=2)
    cache.reserve(6)
    k = torch.ones(1, 2, 5, 4)  # [B, H, 5 new entries, D]: more than the first capacity
    keys, _ = cache.layers[0].update(k, k)
    assert keys.shape == (1, 2, 5, 4) and cache.layers[0].keys.shape[2] == 6


def test_copy_entries_takes_a_range_and_keeps_what_came_before():
    source, mine = TreeKVCache(num_layers=2, capacity=8), TreeKVCache(num_layers=2, capacity=2)
    keys = torch.arange(1 * 2 * 8 * 3, dtype=torch.float32).view(1, 2, 8, 3)  # [B, H, 8, D]
    for layer in source.layers:
        layer.update(keys, -keys)
    mine.copy_entries(source, 0, 3)  # allocates and grows as needed
    own = torch.full((1, 2, 2, 3), 7.0)
    mine.reserve(7)
    for layer in mine.layers:
        layer.length = 3
        layer.update(own, own)  # entries 3, 4: computed by the draft itself
    mine.copy_entries(source, 5, 7)  # only [5, 7): entries 3 and 4 stay the draft's
    for layer in mine.layers:
        assert layer.length == 7
        assert torch.equal(layer.keys[:, :, :3], keys[:, :, :3]) and torch.equal(
            layer.values[:, :, 5:7], -keys[:, :, 5:7]
        )
        assert torch.equal(layer.keys[:, :, 3:5], own)
    with pytest.raises(ValueError, match=r"copy_entries: \[4, 2\) is not a range of entries"):
        mine.copy_entries(source, 4, 2)
    with pytest.raises(ValueError, match="copy_entries: the source cache has room for fewer than 9 entries"):
        mine.copy_entries(source, 0, 9)
    with pytest.raises(ValueError, match="copy_entries: the source cache has 2 layers, this one 1"):
        TreeKVCache(num_layers=1, capacity=2).copy_entries(source, 0, 1)


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        TreeKVCache(num_layers=1, capacity=0)


def test_adapter_doubles_up_to_its_bound():
    adapter = HFAdapter(tiny_llama(), capacity=10, max_capacity=25)
    adapter.reserve(11)
    assert adapter.cache.capacity == 20  # doubled
    adapter.reserve(21)
    assert adapter.cache.capacity == 25  # doubling clamped to what the call can need
    adapter.reserve(40)
    assert adapter.cache.capacity == 40  # a block that needs more always fits


CONFIGS = {
    "probe-static": mtprobe.ProbeConfig(block_complexity=10),
    "probe-dynamic": mtprobe.ProbeConfig(block_complexity=30, num_masks=2, tree="dynamic"),
    "stand": mtprobe.StandConfig(block_complexity=10),
    "lookahead": mtprobe.LookaheadConfig.for_block_complexity(10),
    "draft-model": mtprobe.DraftModelConfig(num_draft_layers=1, num_tokens=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_growing_mid_generation_stays_token_identical(monkeypatch, name):
    # Four spare entries: the KV cache and the mask buffer double several times while decoding,
    # and the loop must compact into the new buffers.
    monkeypatch.setattr(generate_module, "_INITIAL_HEADROOM", 4)
    model = tiny_llama(seed=3)
    ids = torch.tensor([[5, 17, 9, 33, 17, 9, 2]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=120, eos_token_id=None, pad_token_id=0)
    out = mtprobe.generate(model, ids, CONFIGS[name], max_new_tokens=120, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    first = ids.shape[1] + CONFIGS[name].block_complexity + 4
    assert out.kv_capacity > first  # it did grow


def test_generous_max_new_tokens_allocates_for_the_tokens_generated():
    # max_new_tokens as a generous bound that EOS cuts short (common practice): memory must follow
    # the 6 tokens generated. Sizing buffers for 10^6 tokens up front was the bug.
    model = tiny_llama(seed=1, max_position_embeddings=2**21)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    greedy = model.generate(ids, do_sample=False, max_new_tokens=6, eos_token_id=None, pad_token_id=0)
    eos = int(greedy[0, -1])
    ref = model.generate(ids, do_sample=False, max_new_tokens=10**6, eos_token_id=eos, pad_token_id=0)
    cfg = mtprobe.ProbeConfig(block_complexity=10)
    out = mtprobe.generate(model, ids, cfg, max_new_tokens=10**6, eos_token_id=eos, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert out.stop_reason == "eos"
    assert out.kv_capacity <= ids.shape[1] + cfg.block_complexity + generate_module._INITIAL_HEADROOM
