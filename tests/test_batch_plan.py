"""A batch through HF's modules (mtprobe.target_model.batch_plan): where the C++ forward does not run (a GPU, an
architecture it does not take, MTPROBE_NATIVE_FORWARD=0), the rows still meet at one forward per step, padded
to one block on a KV buffer with a row axis, and on a GPU replayed as graphs per (rows, tokens) bucket (here the
CPU stand-in for CUDA graph capture). Each row must stay greedy on its prompt alone."""

from __future__ import annotations

import pytest
import torch

import mtprobe
from conftest import tiny_llama
from mtprobe.state import state_of
from mtprobe.target_model.batch_plan import BatchedKVCache, BatchedPlan
from mtprobe.target_model.plan import PlanConfig
from test_architectures import _build_sliding
from test_batch import (
    CONFIGS,
    IDS,
    MASK,
    N_NEW,
    PAD,
    ROUTES,
    alone,
    eos_ending_one_row_early,
    laid_out,
    paddings,
)


@pytest.fixture(scope="module")
def tiny():
    return tiny_llama()


@pytest.fixture
def hf_forward(monkeypatch):
    """The C++ forward off: every forward through HF's modules; drafting rows together on the CPU too (where
    the default decodes them apart, measured faster: test_drafting_rows_on_the_cpu_run_apart_by_default)."""
    monkeypatch.setenv("MTPROBE_NATIVE_FORWARD", "0")
    monkeypatch.setenv("MTPROBE_BATCH", "1")


def _batch_plan(model) -> BatchedPlan:
    plan = state_of(model).batch_plan
    assert plan is not None, "the batch did not run through a BatchedPlan"
    return plan


@pytest.mark.parametrize("name", ["probe", "stand", "pld", "quantized-self-draft"])
@pytest.mark.parametrize("route", ROUTES)
def test_each_row_is_greedy_on_its_prompt_alone(tiny, hf_forward, route, name):
    eos = eos_ending_one_row_early(tiny)
    kw = dict(attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    if route == "mtprobe.generate":
        out = mtprobe.generate(tiny, IDS, CONFIGS[name], **kw)
    else:
        hf = dict(custom_generate=mtprobe.custom_generate, return_dict_in_generate=True)
        out = tiny.generate(IDS, mtprobe_config=CONFIGS[name], **hf, **kw)
    expected = laid_out(alone(tiny, eos_token_id=eos, pad_token_id=PAD), paddings())
    assert torch.equal(out.sequences, expected)
    assert {o.batch for o in out.sequence_outputs} == {len(IDS)}
    # Together: one batch forward ran every row's prefill, then each decode step served every row still running.
    assert 1 < out.plan["forwards"] <= 1 + N_NEW, out.plan
    assert state_of(tiny).batch_plan is None  # an eager plan is not kept between calls


@pytest.mark.parametrize("name", ["probe", "pld"])
def test_graphs_per_rows_and_tokens_bucket(tiny, stand_in_graphs, name):
    # The stand-in captures on the CPU: every decode step padded to its (rows, tokens) bucket and replayed.
    config = PlanConfig(cuda_graphs=True, row_buckets=(1, 2, 4), buckets=(1, 2, 4, 8))
    kw = dict(attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD, plan=config)
    out = mtprobe.generate(tiny, IDS, CONFIGS[name], **kw)
    assert torch.equal(out.sequences, laid_out(alone(tiny), paddings()))
    plan = _batch_plan(tiny)
    described = plan.describe()
    assert described["graphs"] >= 1 and described["replays"] >= N_NEW // 2, described
    assert described["eager_reason"] == ""
    assert all(key[0] in (1, 2, 4) and key[1] in (1, 2, 4, 8) for key in plan._graphs)
    # The next call of the same shape takes the kept plan and its graphs.
    captured = plan.captures
    again = mtprobe.generate(tiny, IDS, CONFIGS[name], **kw)
    assert torch.equal(again.sequences, out.sequences)
    assert _batch_plan(tiny) is plan and plan.captures == captured


def test_a_sliding_window_model_batches(hf_forward):
    # Gemma 3's per-layer-type masks (sliding and global layers), its window outgrown many times over.
    model = _build_sliding("gemma3")
    rows = [[5, 9, 13, 2, 7, 7, 30], [11, 4], [8, 8, 21, 3]]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[1] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    for config in (mtprobe.ProbeConfig(block_complexity=6), mtprobe.PromptLookupConfig(num_tokens=3)):
        out = mtprobe.generate(model, ids, config, attention_mask=mask, max_new_tokens=20, do_sample=False)
        for i, r in enumerate(rows):
            ref = model.generate(torch.tensor([r]), max_new_tokens=20, do_sample=False)[0, len(r) :]
            got = out.sequences[i, width:][: ref.shape[0]]
            assert torch.equal(got, ref), (i, got, ref)
        assert out.plan["forwards"] > 1 and {o.batch for o in out.sequence_outputs} == {len(rows)}


def test_drafting_rows_on_the_cpu_run_apart_by_default(tiny, monkeypatch):
    # On a CPU, HF's modules take drafted blocks padded to the largest: apart was measured faster there
    # (benchmarks/results/batch/bench_batch-gemma3.md), plain decoding together.
    monkeypatch.setenv("MTPROBE_NATIVE_FORWARD", "0")
    kw = dict(attention_mask=MASK, max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD)
    drafted = mtprobe.generate(tiny, IDS, CONFIGS["pld"], **kw)
    plain = mtprobe.generate(tiny, IDS, mtprobe.PlainConfig(), **kw)
    assert {o.batch for o in drafted.sequence_outputs} == {1}
    assert {o.batch for o in plain.sequence_outputs} == {len(IDS)}
    assert torch.equal(drafted.sequences, plain.sequences)
    monkeypatch.setenv("MTPROBE_BATCH", "1")
    together = mtprobe.generate(tiny, IDS, CONFIGS["pld"], **kw)
    assert {o.batch for o in together.sequence_outputs} == {len(IDS)}
    assert torch.equal(together.sequences, plain.sequences)


def test_sampled_rows_repeat_under_a_seed(tiny, hf_forward):
    kw = dict(
        attention_mask=MASK, max_new_tokens=N_NEW, do_sample=True, num_return_sequences=2, pad_token_id=PAD
    )
    config = mtprobe.ProbeConfig(block_complexity=6)
    torch.manual_seed(3)
    first = mtprobe.generate(tiny, IDS, config, **kw).sequences
    torch.manual_seed(3)
    second = mtprobe.generate(tiny, IDS, config, **kw).sequences
    assert first.shape[0] == 2 * IDS.shape[0] and torch.equal(first, second)


def test_the_cache_writes_and_reads_rows_as_its_reference():
    # Rows 2 and 0 of a 3-row buffer (out of order: gathered), 2 inputs each at their own positions.
    g = torch.Generator().manual_seed(0)
    keys = [torch.randn(4, 2, 10, 3, generator=g)]
    values = [torch.randn(4, 2, 10, 3, generator=g)]
    ref_k, ref_v = keys[0].clone(), values[0].clone()
    cache = BatchedKVCache(keys, values)
    s = cache.slots
    s.rows, s.write_pos, s.key_len, s.view = torch.tensor([2, 0]), torch.tensor([[5, 6], [1, 2]]), 7, None
    new_k, new_v = torch.randn(2, 2, 2, 3, generator=g), torch.randn(2, 2, 2, 3, generator=g)
    k, v = cache.layers[0].update(new_k, new_v)
    for i, (r, at) in enumerate([(2, [5, 6]), (0, [1, 2])]):
        ref_k[r][:, at] = new_k[i]
        ref_v[r][:, at] = new_v[i]
    assert torch.equal(keys[0], ref_k) and torch.equal(values[0], ref_v)
    assert torch.equal(k, ref_k[[2, 0], :, :7]) and torch.equal(v, ref_v[[2, 0], :, :7])
    s.rows, s.view = torch.tensor([0, 1]), (0, 2)  # a range: sliced, no copy
    k, _ = cache.layers[0].update(new_k, new_v)
    assert k.data_ptr() == keys[0].data_ptr() and k.shape == (2, 2, 7, 3)
    with pytest.raises(RuntimeError, match=r"where the plan expected \[rows, kv_heads, inputs, head_dim\]"):
        cache.layers[0].update(torch.zeros(2, 3, 2, 3), torch.zeros(2, 3, 2, 3))


def test_bad_plans_are_named(tiny):
    with pytest.raises(ValueError, match="row_buckets must start at 1"):
        PlanConfig(row_buckets=(2, 4))
    with pytest.raises(ValueError, match="row_buckets must be strictly ascending"):
        PlanConfig(row_buckets=(1, 4, 2))
    with pytest.raises(ValueError, match=r"cuda_graphs=True\) needs a model on a CUDA device"):
        BatchedPlan(tiny, PlanConfig(cuda_graphs=True), 2, 16)
    with pytest.raises(ValueError, match="rows >= 1 and capacity >= 1"):
        BatchedPlan(tiny, PlanConfig(), 0, 16)
    assert PlanConfig().row_bucket(5) == 8 and PlanConfig().row_bucket(33) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("name", ["probe", "pld"])
def test_cuda_batch_replays_real_graphs(name):
    # On a GPU the batch's plan captures real CUDA graphs per (rows, tokens) bucket; float32 rows stay greedy.
    model = tiny_llama().cuda()
    kw = dict(attention_mask=MASK.cuda(), max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD)
    out = mtprobe.generate(model, IDS.cuda(), CONFIGS[name], plan=PlanConfig(), **kw)
    assert torch.equal(out.sequences.cpu(), laid_out([o.cpu() for o in alone(model.cpu())], paddings()))
    described = _batch_plan(model).describe()
    assert described["eager_reason"] == "" and described["graphs"] >= 1 and described["replays"] >= 1, (
        described
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
def test_cuda_batch_on_the_callers_stream():
    # The rows' loops run on threads of their own: they read the forward's logits on the caller's stream, not
    # the default one (the first H200 run, under a stream left current: every row departed from greedy).
    model = tiny_llama().cuda()
    kw = dict(attention_mask=MASK.cuda(), max_new_tokens=N_NEW, do_sample=False, pad_token_id=PAD)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        out = mtprobe.generate(model, IDS.cuda(), CONFIGS["pld"], plan=PlanConfig(), **kw)
    torch.cuda.synchronize()
    assert torch.equal(out.sequences.cpu(), laid_out([o.cpu() for o in alone(model.cpu())], paddings()))
