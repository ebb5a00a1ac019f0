"""Sampling is lossless: the output distribution equals the target's, proven statistically.

Verification by sample matching: every tree node samples the target's processed distribution
and the child equal to the sample is accepted. On a tiny model with a 16-token vocabulary the
exact joint distribution of the first two generated tokens is computed by enumeration (256
cells), and many seeded mtprobe samples are compared with it by a chi-square test. The test's
power is checked too: the same test at the same sample count rejects a slightly wrong sampler.
"""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare
from transformers import LlamaConfig, LlamaForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import mtprobe
from mtprobe import _C
from mtprobe.adapter import HFAdapter

V = 16
ALPHA = 1e-3  # false-alarm rate of each test; the seeds are fixed, so each run is deterministic
N_SAMPLES = 2000
SAMPLE_KW = dict(temperature=0.9, top_k=10, top_p=0.95)


@pytest.fixture(scope="module")
def tiny():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 32-wide model gains nothing from threads; they only add overhead
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.3,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    yield model
    torch.set_num_threads(threads)


def processors() -> LogitsProcessorList:
    # What HF's generate builds for SAMPLE_KW, in its order.
    return LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(10), TopPLogitsWarper(0.95)])


@torch.no_grad()
def exact_pair_distribution(model, prompt: torch.Tensor) -> torch.Tensor:
    """P(x1, x2) under the processed target distribution: [V, V]."""
    proc = processors()
    p1 = proc(prompt, model(prompt).logits[:, -1].float()).softmax(-1)[0]  # [V]
    ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1)  # [V, L + 1]
    p2 = proc(ext, model(ext).logits[:, -1].float()).softmax(-1)  # [V, V]
    return p1[:, None] * p2


def chi_square_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, cells with expected count < 5 pooled into one.

    A sample in a cell of probability zero is impossible under ``probs``: p-value 0.
    """
    n = counts.sum().item()
    expected = probs.flatten().double() * n
    observed = counts.flatten().double()
    if observed[expected == 0].sum() > 0:
        return 0.0
    big = expected >= 5
    obs = torch.cat([observed[big], observed[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    exp = exp * (obs.sum() / exp.sum())  # float rounding only: chisquare wants equal totals
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


class FullTreeDrafter(_C.Drafter):
    """Proposes every vocabulary token as a child of the root: a sample is always accepted."""

    def name(self):
        return "full_tree"

    def begin(self, prompt):
        pass

    def propose(self, committed, prefix_len, limits):
        c = committed.shape[0]
        b = _C.DraftBlock()
        k = V if limits.tokens_left >= 2 else 0
        b.tokens = torch.cat([committed, torch.arange(k)])
        b.parents = [i - 1 for i in range(c)] + [c - 1] * k
        b.num_committed = c
        b.num_nodes = c + k
        return b

    def observe(self, outcome):
        pass


def sample_with_loop(model, prompt: torch.Tensor, drafter, n: int, seed: int) -> torch.Tensor:
    """n two-token continuations from the C++ loop: counts [V, V]."""
    proc = processors()
    counts = torch.zeros(V, V, dtype=torch.long)
    torch.manual_seed(seed)
    for _ in range(n):
        adapter = HFAdapter(model, prompt.shape[1] + 2 + 64)
        loop = _C.DecodeLoop(
            drafter,
            adapter.forward,
            adapter.kv_buffers,
            max_new_tokens=2,
            eos_token_ids=[],
            max_positions=64,
            block_complexity=64,
            kv_capacity=prompt.shape[1] + 2 + 64,
            mask_dtype="float32",
            device="cpu",
            do_sample=True,
            process=lambda ids, s: proc(ids, s),
        )
        seq = loop.run(prompt[0]).sequence
        counts[seq[-2], seq[-1]] += 1
    return counts


def test_full_tree_drafter_sampling_is_exact(tiny):
    # Every step accepts a draft, so each pair is (accepted draft sample, bonus sample).
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    exact = exact_pair_distribution(tiny, prompt)
    counts = sample_with_loop(tiny, prompt, FullTreeDrafter(), n=N_SAMPLES, seed=1)
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"sampled pairs differ from the target distribution (chi-square p = {p:.2e})"


def test_mask_probe_sampling_is_exact(tiny):
    prompt = torch.tensor([[2, 7, 1, 8]])
    exact = exact_pair_distribution(tiny, prompt)
    counts = torch.zeros(V, V, dtype=torch.long)
    torch.manual_seed(2)
    cfg = mtprobe.ProbeConfig(block_complexity=10)
    for _ in range(N_SAMPLES):
        seq = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=2, do_sample=True, **SAMPLE_KW).sequences[0]
        counts[seq[-2], seq[-1]] += 1
    p = chi_square_pvalue(counts, exact)
    assert p > ALPHA, f"sampled pairs differ from the target distribution (chi-square p = {p:.2e})"


@pytest.mark.parametrize("bug", ["bonus_from_root", "temperature_1.3"])
def test_chi_square_rejects_a_wrong_sampler(tiny, bug):
    # The same test at the same sample count rejects the kind of bug it is there to catch: the
    # bonus token drawn from the wrong node's distribution, or the wrong temperature.
    prompt = torch.tensor([[3, 1, 4, 1, 5]])
    exact = exact_pair_distribution(tiny, prompt)
    if bug == "bonus_from_root":
        p1 = exact.sum(1)
        wrong = p1[:, None] * p1[None, :]
    else:
        with torch.no_grad():
            ext = torch.cat([prompt.repeat(V, 1), torch.arange(V)[:, None]], dim=1)
            logits1, logits2 = tiny(prompt).logits[:, -1].float(), tiny(ext).logits[:, -1].float()
        proc = LogitsProcessorList(
            [TemperatureLogitsWarper(1.3), TopKLogitsWarper(10), TopPLogitsWarper(0.95)]
        )
        wrong = proc(prompt, logits1).softmax(-1)[0][:, None] * proc(ext, logits2).softmax(-1)
    gen = torch.Generator().manual_seed(3)
    draws = torch.multinomial(wrong.flatten(), N_SAMPLES, replacement=True, generator=gen)
    counts = torch.bincount(draws, minlength=V * V).view(V, V)
    tv = 0.5 * (wrong - exact).abs().sum().item()
    assert chi_square_pvalue(counts, exact) < ALPHA, f"missed a sampler at total variation {tv:.3f}"


def test_same_seed_same_text(tiny):
    prompt = torch.tensor([[1, 2, 3]])
    cfg = mtprobe.ProbeConfig(block_complexity=10)
    runs = []
    for _ in range(2):
        torch.manual_seed(123)
        runs.append(
            mtprobe.generate(tiny, prompt, cfg, max_new_tokens=12, do_sample=True, **SAMPLE_KW).sequences
        )
    assert torch.equal(runs[0], runs[1])
    torch.manual_seed(124)
    other = mtprobe.generate(tiny, prompt, cfg, max_new_tokens=12, do_sample=True, **SAMPLE_KW).sequences
    assert not torch.equal(runs[0], other)  # a different seed gives a different text (V**12 choices)
