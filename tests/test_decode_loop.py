"""The decode loop's guarantees against what drafters carry (csrc/decode/decode_loop.cpp).

Non-finite values: under the additive tree mask one NaN/inf key or value of a draft turns every row
of the block NaN, so the loop must never choose a token from such a block. The model here embeds
every token that greedy decoding never sees as NaN: greedy ``generate`` is unaffected, and every
wrong draft poisons its block.
"""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import cpu_decode_loop, tiny_llama
from mtprobe import _C

PROMPT = torch.tensor([[5, 17, 9, 33, 17, 9, 2, 40]])
NEW = 24


def poisoned_model(seed: int = 7):
    """A tiny Llama whose input embeddings are NaN for every token outside the greedy text."""
    model = tiny_llama(seed=seed)
    ref = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    keep = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    keep[ref[0]] = True
    with torch.no_grad():
        model.get_input_embeddings().weight[~keep] = float("nan")
    again = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    assert torch.equal(again, ref)  # greedy decoding never reads a poisoned row
    return model, ref


CONFIGS = {
    "probe-static": mtprobe.ProbeConfig(block_complexity=10),
    "probe-dynamic": mtprobe.ProbeConfig(block_complexity=30, num_masks=2, tree="dynamic"),
    "prompt-lookup": mtprobe.PromptLookupConfig(num_tokens=4),
    "stand": mtprobe.StandConfig(block_complexity=10),
    "lookahead": mtprobe.LookaheadConfig.for_block_complexity(10),
    "hybrid": mtprobe.HybridConfig(block_complexity=30),
    "draft-model": mtprobe.DraftModelConfig(num_draft_layers=1, num_tokens=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_nan_in_drafts_never_changes_greedy_output(name):
    model, ref = poisoned_model()
    out = mtprobe.generate(
        model, PROMPT, CONFIGS[name], max_new_tokens=NEW, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(out.sequences, ref)
    assert out.fallback_steps <= len(out.accept_lengths) + 1


@pytest.mark.parametrize("name", ["stand", "hybrid"])
def test_nan_in_drafts_never_changes_greedy_output_through_graphs(name, stand_in_graphs):
    """The plan's graphs attend over the whole KV buffer, the columns past the block hidden by the mask;
    a NaN a poisoned block wrote there would still poison every later row (0 * NaN), so the loop clears a
    poisoned block's entries before it re-runs the committed chain."""
    model, ref = poisoned_model()
    out = mtprobe.generate(
        model,
        PROMPT,
        CONFIGS[name],
        max_new_tokens=NEW,
        eos_token_id=None,
        pad_token_id=0,
        plan=mtprobe.PlanConfig(cuda_graphs=True),
    )
    assert torch.equal(out.sequences, ref)
    assert out.fallback_steps > 0 and out.plan["replays"] > 0  # the case arose, and through the graphs


def test_poisoned_drafts_are_re_run_not_trusted():
    # A drafter that always drafts a poisoned token: every decode step falls back.
    model, ref = poisoned_model()
    bad = next(t for t in range(model.config.vocab_size) if t not in set(ref[0].tolist()))

    class Poisoner(_C.Drafter):
        def name(self):
            return "poisoner"

        def begin(self, prompt):
            pass

        def propose(self, committed, prefix_len, limits):
            if limits.tokens_left < 2:
                return _C.token_block(committed, [], [])
            return _C.token_block(committed, [bad, bad], [-1, 0])

        def observe(self, outcome):
            if outcome.block_replaced:
                assert outcome.logits.shape[0] == len(outcome.path) == 1 or outcome.prefix_len == 0

    loop = cpu_decode_loop(
        model, Poisoner(), max_new_tokens=NEW, block_complexity=3, prompt_len=PROMPT.shape[1]
    )
    result = loop.run(PROMPT[0])
    assert result.sequence == ref[0].tolist()
    assert result.fallback_steps >= NEW - 2
    assert list(result.accept_lengths) == [1] * (NEW - 1)


def test_nan_auxiliary_inputs_never_change_greedy_output():
    # Embedding-only inputs (mask tokens) that are NaN: the verified tokens must not depend on them.
    model = tiny_llama(seed=2)
    ref = model.generate(PROMPT, do_sample=False, max_new_tokens=NEW, eos_token_id=None, pad_token_id=0)
    hidden = model.config.hidden_size

    class NanMasks(_C.Drafter):
        def name(self):
            return "nan-masks"

        def begin(self, prompt):
            pass

        def propose(self, committed, prefix_len, limits):
            block = _C.token_block(committed, [], [])
            c = committed.shape[0]
            block.parents = list(block.parents) + [c - 1, c]  # two chained aux inputs on the root
            block.embeds = torch.full((2, hidden), float("nan"))
            return block

        def observe(self, outcome):
            pass

    loop = cpu_decode_loop(
        model, NanMasks(), max_new_tokens=NEW, block_complexity=3, prompt_len=PROMPT.shape[1]
    )
    result = loop.run(PROMPT[0])
    assert result.sequence == ref[0].tolist()
    assert result.fallback_steps == NEW  # prefill included


def test_non_finite_target_logits_fail_loudly():
    # NaN in the LM head: the target itself has no token to choose, drafts or not.
    model = tiny_llama(seed=4)
    with torch.no_grad():
        model.lm_head.weight[11] = float("nan")
    with pytest.raises(RuntimeError, match="logits are NaN or \\+inf .* no draft in the forward"):
        mtprobe.generate(model, PROMPT, mtprobe.ProbeConfig(block_complexity=10), max_new_tokens=4)


class Plain(_C.Drafter):
    """No drafts: plain decoding through the loop."""

    def name(self):
        return "plain"

    def begin(self, prompt):
        pass

    def propose(self, committed, prefix_len, limits):
        return _C.token_block(committed, [], [])

    def observe(self, outcome):
        pass


def test_sampling_with_nan_auxiliary_inputs_draws_what_plain_sampling_draws():
    # The poisoned block is dropped before any random number is drawn, so with one seed the
    # samples are exactly plain decoding's: the poison changes nothing, not even the RNG stream.
    model = tiny_llama(seed=2)
    hidden = model.config.hidden_size

    class NanMask(Plain):
        def propose(self, committed, prefix_len, limits):
            block = _C.token_block(committed, [], [])
            block.parents = list(block.parents) + [committed.shape[0] - 1]
            block.embeds = torch.full((1, hidden), float("nan"))
            return block

    runs = []
    for drafter in (Plain(), NanMask()):
        torch.manual_seed(123)
        loop = cpu_decode_loop(
            model, drafter, max_new_tokens=NEW, block_complexity=2, prompt_len=PROMPT.shape[1], do_sample=True
        )
        runs.append(loop.run(PROMPT[0]))
    assert runs[0].sequence == runs[1].sequence
    assert runs[0].fallback_steps == 0 and runs[1].fallback_steps == NEW
