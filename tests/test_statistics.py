"""Per-call statistics and logging: drafted vs accepted tokens per depth (``DecodeResult`` in
csrc/decode/decode_loop.cpp, ``GenerateOutput`` in python/mtprobe/generate.py) and the library's log lines."""

from __future__ import annotations

import logging

import pytest
import torch

import mtprobe
from conftest import cpu_decode_loop, tiny_llama
from mtprobe import _C

PROMPT = torch.tensor([5, 17, 9, 33, 2])
VOCAB = 128  # tiny_llama's vocabulary


class Oracle(_C.Drafter):
    """Knows the greedy continuation ``ref``. Every block drafts the next two true tokens as a chain
    with a wrong third token under them, and a wrong sibling of the first: depths 1, 2, 3 and 1.
    Verification must accept exactly depths 1 and 2 of every step."""

    def __init__(self, ref: list[int]):
        super().__init__()
        self.ref = ref

    def name(self):
        return "oracle"

    def begin(self, prompt):
        self.seq = prompt.tolist()

    def propose(self, committed, prefix_len, limits):
        n = len(self.seq)
        t1, t2, t3 = self.ref[n], self.ref[n + 1], self.ref[n + 2]
        wrong = lambda t: (t + 1) % VOCAB  # noqa: E731
        return _C.token_block(committed, [t1, t2, wrong(t3), wrong(t1)], [-1, 0, 1, -1])

    def observe(self, outcome):
        self.seq += list(outcome.new_tokens)


def test_per_depth_counts_of_a_scripted_drafter():
    model = tiny_llama()
    ref = model.generate(PROMPT[None], do_sample=False, max_new_tokens=30, eos_token_id=None, pad_token_id=0)
    ref = ref[0].tolist()
    loop = cpu_decode_loop(model, Oracle(ref), max_new_tokens=15, block_complexity=5, prompt_len=len(PROMPT))
    result = loop.run(PROMPT)
    assert result.sequence == ref[: len(PROMPT) + 15]
    # The prefill verifies its drafts too (3 tokens) but is not a decode step: 4 steps of 3 tokens.
    assert list(result.accept_lengths) == [3, 3, 3, 3]
    steps = len(result.accept_lengths)
    assert list(result.drafted_per_depth) == [2 * steps, steps, steps]
    assert list(result.accepted_per_depth) == [steps, steps]
    assert list(result.block_sizes) == [5] * steps  # the committed token and four drafts


@pytest.mark.parametrize(
    "config",
    [
        mtprobe.ProbeConfig(block_complexity=10),
        mtprobe.ProbeConfig(block_complexity=12, num_masks=2, tree="dynamic"),
        mtprobe.PromptLookupConfig(num_tokens=4),
        mtprobe.StandConfig(block_complexity=10),
        mtprobe.LookaheadConfig.for_block_complexity(10),
        mtprobe.HybridConfig(block_complexity=12),
    ],
    ids=lambda c: type(c).__name__,
)
def test_statistics_agree_with_the_accept_lengths(config):
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9, 33, 2, 5, 17]])
    ref = model.generate(ids, do_sample=False, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    out = mtprobe.generate(model, ids, config, max_new_tokens=24, eos_token_id=None, pad_token_id=0)
    assert torch.equal(out.sequences, ref)
    assert out.new_tokens == 24 and out.do_sample is False
    accepted, drafted = out.accepted_per_depth, out.drafted_per_depth
    # A path that reached depth d reached every depth above it, through a drafted node.
    assert all(a >= b for a, b in zip(accepted, accepted[1:], strict=False))
    assert len(accepted) <= len(drafted)
    assert all(a <= d for a, d in zip(accepted, drafted[: len(accepted)], strict=True))
    assert all(a <= out.steps for a in accepted)
    # Drafts accepted per step = accept length - 1, except where max_new_tokens cut the last step.
    gained = sum(n - 1 for n in out.accept_lengths)
    assert gained <= sum(accepted) <= gained + config.block_complexity
    assert sum(out.acceptance_per_depth()) == pytest.approx(sum(accepted) / out.steps)
    # One forward per step over the committed token, the drafts and any auxiliary inputs.
    assert len(out.block_sizes) == out.steps and min(out.block_sizes) >= 1
    assert sum(t - 1 for t in out.block_sizes) >= sum(drafted)
    if isinstance(config, (mtprobe.PromptLookupConfig, mtprobe.StandConfig)):  # drafts only
        assert sum(t - 1 for t in out.block_sizes) == sum(drafted)


def test_method_names_and_summary():
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2, 5, 17, 9]])
    out = mtprobe.generate(model, ids, mtprobe.PromptLookupConfig(), max_new_tokens=8, eos_token_id=None)
    assert out.method == "pld"
    stats = out.summary()
    assert stats["method"] == "pld" and stats["new_tokens"] == 8 and stats["steps"] == out.steps
    assert stats["drafted_tokens"] == sum(out.drafted_per_depth)
    assert mtprobe.generate(model, ids, max_new_tokens=2, eos_token_id=None).method == "probe"


def test_generate_logs_the_method_buffers_and_statistics(caplog):
    model = tiny_llama()
    ids = torch.tensor([[5, 17, 9, 33, 2]])
    with caplog.at_level(logging.INFO, logger="mtprobe"):
        out = mtprobe.generate(model, ids, mtprobe.StandConfig(), max_new_tokens=6, eos_token_id=None)
    text = "\n".join(r.getMessage() for r in caplog.records if r.name.startswith("mtprobe"))
    assert "mtprobe stand (StandConfig(" in text and "greedy" in text
    assert f"KV cache and mask for {ids.shape[1] + mtprobe.StandConfig().block_complexity + 6}" in text
    assert f"{out.new_tokens} new tokens in {out.steps} decode steps" in text
    assert f"{sum(out.accepted_per_depth)} of {sum(out.drafted_per_depth)} drafted tokens accepted" in text


def test_nothing_is_logged_at_the_default_level(caplog):
    model = tiny_llama()
    with caplog.at_level(logging.WARNING):
        mtprobe.generate(model, torch.tensor([[5, 17, 9]]), max_new_tokens=3, eos_token_id=None)
    assert not [r for r in caplog.records if r.name.startswith("mtprobe")]
