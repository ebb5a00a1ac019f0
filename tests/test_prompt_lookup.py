"""Prompt lookup decoding: the C++ drafting rule against the reference, lossless decoding, and the
same tokens as transformers' own prompt lookup."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import chat_ids, tiny_llama
from mtprobe import _C
from mtprobe.reference import prompt_lookup


@pytest.mark.parametrize("max_ngram", [1, 2, 3])
@pytest.mark.parametrize("max_tokens", [1, 4, 10])
def test_core_rule_matches_reference(max_ngram, max_tokens):
    gen = torch.Generator().manual_seed(max_ngram * 100 + max_tokens)
    for length in [1, 2, 3, 5, 20, 200]:
        for _ in range(20):
            seq = torch.randint(0, 6, (length,), generator=gen).tolist()  # small vocabulary: many repeats
            assert _C.prompt_lookup(seq, max_ngram, max_tokens) == prompt_lookup(seq, max_ngram, max_tokens)


def test_rule_by_hand():
    assert _C.prompt_lookup([5, 6, 7, 8, 5, 6], 2, 3) == [7, 8, 5]
    assert _C.prompt_lookup([5, 6, 7, 8, 9, 6], 2, 3) == [7, 8, 9]  # falls back to the 1-gram [6]
    assert _C.prompt_lookup([1, 2, 3], 2, 3) == []


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama(vocab_size=32, eos_token_id=31)


@pytest.mark.parametrize("num_tokens", [1, 3, 10])
def test_lossless_on_tiny_llama(tiny, num_tokens):
    gen = torch.Generator().manual_seed(num_tokens)
    cfg = mtprobe.PromptLookupConfig(num_tokens=num_tokens)
    for length in (1, 8, 40):
        prompt = torch.randint(0, 31, (1, length), generator=gen)
        ref = tiny.generate(prompt, do_sample=False, max_new_tokens=30)
        out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=30)
        assert torch.equal(out.sequences, ref)
        assert all(1 <= a <= num_tokens + 1 for a in out.accept_lengths)


def test_same_tokens_as_transformers_prompt_lookup_on_smollm2(smollm2):
    model, tok = smollm2
    ids = chat_ids(
        tok,
        [
            {
                "role": "user",
                "content": "Repeat this list exactly: apples, pears, plums, apples, "
                "pears, plums, apples, pears, plums.",
            }
        ],
    )
    ref = model.generate(ids, do_sample=False, max_new_tokens=40)
    hf = model.generate(ids, do_sample=False, max_new_tokens=40, prompt_lookup_num_tokens=10)
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(num_tokens=10), max_new_tokens=40)
    assert torch.equal(out.sequences, ref) and torch.equal(hf, ref)
    assert max(out.accept_lengths) > 2  # the copied list is accepted several tokens at a time


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_tokens=0), "num_tokens=0"),
        (dict(max_ngram_size=0), "max_ngram_size=0"),
        (dict(num_tokens=10, block_complexity=8), "needs block_complexity >= 11 inputs per step, got 8"),
    ],
)
def test_bad_configuration_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mtprobe.PromptLookupConfig(**kwargs)


def test_a_larger_budget_is_a_cap_not_a_target(tiny):
    cfg = mtprobe.PromptLookupConfig(num_tokens=3, block_complexity=20)
    prompt = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    ref = tiny.generate(prompt, do_sample=False, max_new_tokens=20)
    out = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=20)
    assert torch.equal(out.sequences, ref)
    assert max(out.accept_lengths) <= 4  # still chains of 3
