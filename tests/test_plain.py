"""Plain decoding through mtprobe's own loop (``PlainConfig``): no drafts, one input per step, HF's
greedy output; the baseline of mtprobe's loop beside HF's ``generate``. Its sampling is checked with
the other drafters' in tests/test_sampling.py."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_llama


def test_plain_is_hf_greedy_one_input_per_step():
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17]])
    expected = model.generate(ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
    out = mtprobe.generate(model, ids, mtprobe.PlainConfig(), max_new_tokens=12, eos_token_id=None)
    assert torch.equal(out.sequences, expected)
    assert out.method == "plain" and out.block_sizes == [1] * 11 and out.tau == 1.0
    assert out.forward_calls == 12 and sum(out.drafted_per_depth) == 0  # prefill + 11 decode steps


def test_plain_on_smollm2_through_the_hf_route(smollm2, greedy):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(
        ids, max_new_tokens=16, custom_generate=mtprobe.custom_generate, mtprobe_config={"method": "plain"}
    )
    assert torch.equal(out, greedy(model, ids, 16))


def test_plain_is_registered_and_round_trips():
    cfg = mtprobe.PlainConfig()
    assert cfg.block_complexity == 1 and cfg.to_dict() == {"method": "plain"}
    assert mtprobe.config_from_dict({"method": "plain"}) == cfg
    with pytest.raises(TypeError):
        mtprobe.PlainConfig(block_complexity=4)  # nothing to budget: one input per step
