"""The cross-request n-gram memory of STAND and the hybrid (csrc/core/ngram_store.h, NgramMemory):
the C++ memory and tree against the reference, the last generation folded in, sharing across
mtprobe.generate calls, lossless decoding with the memory drafting, bad input."""

from __future__ import annotations

import dataclasses
import gc
import random

import pytest
import torch

import mtprobe
from conftest import cpu_decode_loop, tiny_llama
from mtprobe import _C
from mtprobe.drafters import ngram_memories, ngram_memory
from mtprobe.reference.stand import NgramMemory, NgramStore, build_stand_tree

# --- the memory against the reference ------------------------------------------------------------


def _keys(memory) -> list[tuple[int, ...]]:
    return [tuple(k) for k in memory.keys()]


def test_worked_example():  # csrc/core/ngram_store.h
    memory = _C.NgramMemory(3, max_ngram=1)
    memory.fold([1, 2, 3, 1, 4])
    assert _keys(memory) == [(2,), (3,), (1,)]
    assert memory.lookup([1]) == ([2, 4], [0.25, 0.25])  # c / (total + distinct): PPM's escape
    memory.fold([5, 2])
    assert _keys(memory) == [(3,), (1,), (5,)]
    assert memory.lookup([3]) == ([1], [0.5])
    assert _keys(memory) == [(1,), (5,), (3,)]
    memory.fold([6, 1])
    assert _keys(memory) == [(5,), (3,), (6,)]
    assert len(memory) == memory.size == 3 and memory.hits == 2


def test_cpp_matches_reference_on_random_folds_and_lookups():
    rng = random.Random(3)
    for case in range(30):
        capacity, max_ngram, top_k = rng.randint(1, 40), rng.randint(1, 4), rng.randint(1, 4)
        cpp, ref = _C.NgramMemory(capacity, max_ngram, top_k), NgramMemory(capacity, max_ngram, top_k)
        for _ in range(12):
            if rng.random() < 0.5:
                text = [rng.randrange(6) for _ in range(rng.randint(0, 30))]
                cpp.fold(text)
                ref.fold(text)
            else:
                context = [rng.randrange(6) for _ in range(rng.randint(0, 5))]
                got, want = cpp.lookup(context), ref.lookup(context)
                assert got[0] == want[0], case
                assert got[1] == pytest.approx(want[1], rel=1e-12)
            assert _keys(cpp) == ref.keys(), case  # the same eviction order
            assert len(cpp) <= capacity


def test_tree_with_memory_matches_reference():
    rng = random.Random(5)
    trees_using_memory = 0
    for case in range(60):
        store_ngram, mem_ngram = rng.randint(1, 3), rng.randint(1, 4)
        cpp_store, ref_store = _C.NgramStore(store_ngram, 4), NgramStore(store_ngram, 4)
        capacity = rng.randint(1, 60)
        cpp_mem, ref_mem = _C.NgramMemory(capacity, mem_ngram, 3), NgramMemory(capacity, mem_ngram, 3)
        for _ in range(rng.randint(0, 10)):
            context = [rng.randrange(5) for _ in range(rng.randint(1, 5))]
            tokens = rng.sample(range(5), rng.randint(1, 3))
            probs = [rng.choice([0.125, 0.25, 0.5]) for _ in tokens]
            cpp_store.add(context, tokens, probs)
            ref_store.add(context, tokens, probs)
        for _ in range(3):
            text = [rng.randrange(5) for _ in range(rng.randint(2, 25))]
            cpp_mem.fold(text)
            ref_mem.fold(text)
        context = [rng.randrange(5) for _ in range(rng.randint(1, 6))]
        budget, depth = rng.randint(1, 12), rng.randint(1, 6)
        hits = cpp_mem.hits
        got = _C.build_stand_tree(cpp_store, context, budget, depth, memory=cpp_mem)
        assert got == tuple(build_stand_tree(ref_store, context, budget, depth, memory=ref_mem)), case
        assert _keys(cpp_mem) == ref_mem.keys(), case  # the tree's lookups refreshed the same keys
        trees_using_memory += cpp_mem.hits > hits
        if cpp_mem.hits == hits:  # the memory unused: the store's tree alone
            assert got == _C.build_stand_tree(cpp_store, context, budget, depth)
    assert trees_using_memory > 20


# --- the drafter folds its last generation in ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=24, eos_token_id=23)


def assert_same_lookup(memory, ref: NgramMemory, key: tuple[int, ...]) -> None:
    """The same next tokens, in the same order, with the same probabilities (pytest 9.2's approx takes
    no nested (tokens, probs) pair, so the two parts are compared one by one)."""
    tokens, probs = memory.lookup(list(key))
    ref_tokens, ref_probs = ref.lookup(list(key))
    assert list(tokens) == list(ref_tokens)
    assert list(probs) == pytest.approx(list(ref_probs))


def test_drafter_folds_the_finished_generation(tiny):
    memory = _C.NgramMemory(10_000, max_ngram=3, top_k=8)
    drafter = _C.StandDrafter(max_depth=6, max_ngram=3, table_size=8, logits_top_k=8, memory=memory)
    prompt = torch.tensor([5, 6, 7, 5, 6, 8, 9])
    loop = cpu_decode_loop(tiny, drafter, max_new_tokens=25, block_complexity=10, prompt_len=prompt.numel())
    sequence = loop.run(prompt).sequence
    assert len(sequence) == prompt.numel() + 25
    ref = NgramMemory(10_000, 3, 8)
    ref.fold(sequence)  # the whole committed text, the last step's tokens included
    assert sorted(_keys(memory)) == sorted(ref.keys())
    for key in ref.keys():
        assert_same_lookup(memory, ref, key)


# --- mtprobe.generate: sharing, lossless, the memory drafting ------------------------------------


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(seed=1)


def _prompts(n: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 96, (1, int(torch.randint(4, 20, (1,), generator=gen))), generator=gen)
        for _ in range(n)
    ]


@pytest.mark.parametrize(
    "cfg",
    [
        mtprobe.StandConfig(block_complexity=30, memory_size=50_000),
        mtprobe.HybridConfig(block_complexity=30, memory_size=50_000),
    ],
    ids=["stand", "hybrid"],
)
def test_lossless_and_the_memory_drafts_a_repeated_prompt(llama, cfg):
    memory = ngram_memory(llama, cfg)
    memory.clear()
    off = dataclasses.replace(cfg, memory_size=None)  # the same drafter without a memory
    prompts = _prompts(4, seed=11)
    repeated = prompts[1]
    for ids in [*prompts, repeated]:
        ref = llama.generate(ids, do_sample=False, max_new_tokens=40, attention_mask=torch.ones_like(ids))
        hits = memory.hits
        out = mtprobe.generate(llama, ids, cfg, max_new_tokens=40)
        assert torch.equal(out.sequences, ref)
        assert len(memory) > 0  # every finished generation is folded in
    assert memory.hits > hits  # the repeated prompt drafted from the memory
    alone = mtprobe.generate(llama, repeated, off, max_new_tokens=40)  # no memory
    assert torch.equal(alone.sequences, out.sequences)
    # The first answer to this prompt is in the memory: far fewer forwards the second time.
    assert out.forward_calls < alone.forward_calls, (out.forward_calls, alone.forward_calls)
    assert out.tau > alone.tau
    memory.clear()


def test_memory_is_shared_per_model_and_settings(llama):
    a = mtprobe.StandConfig(memory_size=100)
    assert ngram_memory(llama, a) is ngram_memory(
        llama, mtprobe.StandConfig(block_complexity=10, memory_size=100)
    )
    # the hybrid with the same memory settings shares it too
    assert ngram_memory(llama, a) is ngram_memory(llama, mtprobe.HybridConfig(memory_size=100))
    assert ngram_memory(llama, a) is not ngram_memory(llama, mtprobe.StandConfig(memory_size=101))
    assert ngram_memory(llama, a) is not ngram_memory(
        llama, mtprobe.StandConfig(memory_size=100, max_ngram=2)
    )
    assert ngram_memory(llama, mtprobe.StandConfig()) is None  # off by default
    assert (
        ngram_memory(llama, a).capacity,
        ngram_memory(llama, a).max_ngram,
        ngram_memory(llama, a).top_k,
    ) == (
        100,
        3,
        8,
    )
    auto = mtprobe.AutoConfig(drafters=(mtprobe.PromptLookupConfig(), a))
    assert ngram_memories(llama, auto) == [ngram_memory(llama, a)]
    assert ngram_memories(llama, mtprobe.ProbeConfig()) == []
    with pytest.raises(TypeError, match="takes a StandConfig or HybridConfig"):
        ngram_memory(llama, mtprobe.ProbeConfig())
    # a memory does not outlive its model
    other = tiny_llama(seed=2)
    ngram_memory(other, a).fold([1, 2, 3])
    from mtprobe import state

    count = len(state._STATES)
    del other
    gc.collect()
    assert len(state._STATES) == count - 1


def test_an_auto_generation_folds_its_text_once(llama):
    # AutoConfig's STAND and hybrid share one memory; the finished generation goes in once, as the
    # reference's single fold of the same text (twice would double every count).
    stand = mtprobe.StandConfig(block_complexity=8, memory_size=50_000)
    auto = mtprobe.AutoConfig(drafters=(stand, mtprobe.HybridConfig(block_complexity=8, memory_size=50_000)))
    memory = ngram_memory(llama, stand)
    memory.clear()
    ids = _prompts(1, seed=21)[0]
    out = mtprobe.generate(llama, ids, auto, max_new_tokens=30)
    ref = NgramMemory(50_000, 3, 8)
    ref.fold(out.sequences[0].tolist())
    assert sorted(_keys(memory)) == sorted(ref.keys())
    for key in ref.keys():
        assert_same_lookup(memory, ref, key)
    memory.clear()


def test_capacity_bounds_the_memory_and_stays_lossless(llama):
    cfg = mtprobe.StandConfig(block_complexity=10, memory_size=7)
    memory = ngram_memory(llama, cfg)
    memory.clear()
    for ids in _prompts(3, seed=4):
        ref = llama.generate(ids, do_sample=False, max_new_tokens=20, attention_mask=torch.ones_like(ids))
        assert torch.equal(mtprobe.generate(llama, ids, cfg, max_new_tokens=20).sequences, ref)
        assert len(memory) == 7


# --- configuration and bad input -----------------------------------------------------------------


def test_config_round_trip():
    for cfg in (mtprobe.StandConfig(memory_size=64), mtprobe.HybridConfig(memory_size=64)):
        data = cfg.to_dict()
        assert data["memory_size"] == 64
        assert mtprobe.config_from_dict(data) == cfg and hash(cfg) == hash(
            mtprobe.config_from_json(cfg.to_json())
        )
    assert mtprobe.StandConfig().memory_size is None and mtprobe.HybridConfig().memory_size is None
    assert mtprobe.HybridConfig(memory_size=9).stand.memory_size == 9


@pytest.mark.parametrize("config", [mtprobe.StandConfig, mtprobe.HybridConfig])
@pytest.mark.parametrize(
    "value, error, message",
    [
        (0, ValueError, "memory_size=0 must be >= 1 (the most n-gram keys the shared memory keeps), or None"),
        (-1, ValueError, "memory_size=-1 must be >= 1"),
        (
            2.5,
            TypeError,
            "memory_size must be an int >= 1 (the most n-gram keys the shared memory keeps) or None, got 2.5",
        ),
        (True, TypeError, "memory_size must be an int"),
        ("64", TypeError, "got '64' (str)"),
    ],
)
def test_bad_memory_size(config, value, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        config(memory_size=value)


@pytest.mark.parametrize("capacity", [0, -1])
def test_bad_capacity(capacity):
    with pytest.raises(
        ValueError, match=rf"capacity must be >= 1 \(the most n-gram keys it keeps\), got {capacity}"
    ):
        _C.NgramMemory(capacity)
    with pytest.raises(ValueError, match="max_ngram and top_k must be >= 1, got 0 and 8"):
        _C.NgramMemory(4, max_ngram=0)
    with pytest.raises(TypeError):
        _C.NgramMemory(2.5)
