"""Several sequences decoded at once: one target forward per step for all of them (issue 68).

A decode step on a CPU streams every weight of the target from memory; a batch of prompts (or
``num_return_sequences``) decoded one after another streams them once per sequence. Here every sequence
keeps its own decode loop, drafter and KV cache, as when decoded alone, and the loops meet at their target
forwards: :class:`mtprobe._C.BatchedForward` (``csrc/decode/batched_forward.h``) runs one loop per thread,
and when every loop still running has handed in its block, one C++ forward runs all of them, their rows
packed through every linear layer and each block attending over its own cache (where the C++ forward does
not run, HF's modules take the rows padded to one block: :mod:`mtprobe.target_model.batch_plan`). The quantized self-draft's
one-token steps meet the same way (``BatchedForward.draft_step``: one ``QuantizedDecoder.step_rows`` per
depth for every row still drafting, its 4-bit weights read once), and AutoConfig prices a row's step as the
batch's forward (``ForwardProfile.for_rows``), so that it drafts less the more rows share a forward. Every
batched forward, draft step and near-tie's HF forward runs on the calling thread, so that one warm team of
intra-op threads does all the parallel work. A finished sequence leaves the batch.

Each sequence's tokens are what decoding it alone gives: greedy, HF greedy's on its prompt alone (the
same C++ forward, the same margin check); sampled, a sample of the model's own distribution, each row
drawing from a generator of its own seeded from torch's (:func:`row_generators`), so that a seeded call
repeats. At most :data:`MAX_ROWS` sequences run together; more run in groups of that many. Where it does not apply (:func:`why_not_batched`), the
sequences are decoded one after another as before.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from mtprobe import _C
from mtprobe.state import state_of

__all__ = [
    "ENV",
    "MAX_ROWS",
    "PHASES_ENV",
    "SHARE_PREFILLS",
    "batch_drafting",
    "batched_forward",
    "row_generators",
    "why_not_batched",
]

ENV = "MTPROBE_BATCH"
"""``0``: decode a batch's sequences one after another even where one forward could run them together; ``1``:
together wherever one forward can run them, also where :func:`why_not_batched` measured apart faster (a
drafting configuration through HF's modules on a CPU)."""

PHASES_ENV = "MTPROBE_BATCH_PHASES"
"""``0``: a batch's AutoConfig rows draft whenever their schedulers choose to, without the phases of plain
decoding that :func:`batch_drafting` measures them against."""

SHARE_PREFILLS = True
"""Rows handing in the same prefill (the sequences of one prompt, ``num_return_sequences``) run it once, the
others taking copies of its cache entries and logits (``BatchedForward.shared_prefills`` counts them)."""

MAX_ROWS = 32
"""The most sequences decoded together (each on a thread of its own, with its KV cache allocated for the
whole generation); a larger batch, or ``num_return_sequences`` of many samples, runs in groups of this
many, one group after another (benchmarks/results/batch/ measured up to 32 rows)."""


def row_generators(count: int) -> list[torch.Generator]:
    """One CPU generator per row of a sampled batch, seeded from torch's default generator: a call under
    ``torch.manual_seed`` repeats, and each row draws its own stream (the rows' loops run on threads of
    their own, whose draws from one shared generator would interleave in no fixed order)."""
    seeds = torch.randint(0, 2**62, (count,), dtype=torch.int64).tolist()
    return [torch.Generator().manual_seed(s) for s in seeds]


def why_not_batched(
    count: int,
    native: Any,
    *,
    masks: Any,
    hidden_layer: int,
    shares_memory: bool = False,
    draft_model: bool = False,
    tree_attention: bool = False,
    drafts_on_cpu: bool = False,
) -> str:
    """Why ``count`` sequences of a call are decoded one after another rather than together, or ``""``.
    ``native``: the target's C++ forward (None where HF's runs: then the batch runs HF's modules through a
    :class:`~mtprobe.target_model.batch_plan.BatchedPlan`); ``tree_attention``: the model runs mtprobe's tree
    attention, which takes a block's tree as ancestor bits rather than the additive masks a batch pads;
    ``drafts_on_cpu``: the call drafts (any configuration but plain decoding) on a CPU model without CUDA
    graphs: there HF's modules take a batch's blocks padded to the largest, and drafted blocks ran slower
    together than apart (benchmarks/results/batch/bench_batch-gemma3.md: Gemma 3, prompt lookup 0.87x and
    AutoConfig 0.70x apart at 8 rows, plain decoding 1.73x), so only plain decoding batches there unless
    ``MTPROBE_BATCH=1``; ``masks``, ``hidden_layer``: what the
    call's drafter asks of the target's forward (calibrated masks' hooks and temperatures, another layer's
    hidden states), which only HF's forward, run by each sequence's adapter, computes; ``shares_memory``:
    its drafters read and fold a cross-request n-gram memory, which one thread at a time may touch;
    ``draft_model``: one of its drafters runs a draft model whose forwards run row by row
    (:func:`mtprobe.drafters.base.drafts_row_by_row`; the quantized self-draft's steps meet in the batch)."""
    if count < 2:
        return "one sequence"
    setting = os.environ.get(ENV, "").strip().lower()
    if setting in ("0", "false", "off", "no"):
        return f"{ENV}=0"
    if native is None and drafts_on_cpu and setting not in ("1", "true", "on", "yes"):
        return (
            "its drafted blocks run through HF's modules on the CPU, padded to the largest: measured slower "
            f"together than apart ({ENV}=1 batches them anyway)"
        )
    if native is None and tree_attention:
        return "the model runs mtprobe's tree attention (ancestor bits: a batch's padded rows need additive masks)"
    if masks.offsets is not None or masks.lora is not None or masks.temperature is not None:
        return "calibrated masks with layer offsets, a LoRA or temperatures (hooks in HF's forward)"
    if hidden_layer != -1:
        return "the drafter reads another layer's hidden states than the last"
    if shares_memory:
        return "the drafter shares a cross-request n-gram memory (its rows would fold into it at once)"
    if draft_model:
        # Its forwards would run row by row through HF's modules while the other rows wait.
        return "a draft model drafts through HF's modules (its forwards run row by row: batched, the rows would wait)"
    return ""


def batch_drafting(model: Any, config: Any, do_sample: bool, rows: int) -> Any:
    """Whether the rows of a batch of ``rows`` sequences under the scheduling ``config`` draft
    (:class:`mtprobe._C.BatchDrafting`, ``csrc/runtime/batch_drafting.h``): in phases of decode steps with drafting
    and without, whichever made more tokens per second, measured while the batch runs. A row's scheduler prices
    its drafts by the batch's forward, but not its drafts' every cost to the other rows (their waits on its draft
    steps, its drafters' work on shared cores, the batch's steps counted by its slowest row); the phases measure
    them all. One object per (configuration, sampling, rows) in the model's state: the next batch of that size
    starts from what this one measured. None where :data:`PHASES_ENV` is ``0``."""
    if os.environ.get(PHASES_ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return None
    return state_of(model).batch_drafting.setdefault((config, do_sample, rows), _C.BatchDrafting())


def batched_forward(
    native: Any,
    adapters: Sequence[Any],
    capacities: Sequence[int],
    overhead: Any = None,
    drafting: Any = None,
    plan: Any = None,
) -> Any:
    """The batched forward over ``adapters`` (each sequence's :class:`~mtprobe.target_model.adapter.HFAdapter`):
    the C++ forward ``native``, each adapter's cache allocated now at its ``capacities`` entries (the most its
    sequence can need), so that no buffer moves while the loops run; or, with ``native`` None, HF's modules
    through ``plan`` (a :class:`~mtprobe.target_model.batch_plan.BatchedPlan`), each adapter's cache row
    ``r`` of its buffers. ``overhead`` (a :class:`mtprobe._C.SharedSeconds` or None) gets the batch step's
    measured overhead, which the rows' schedulers price; ``drafting`` (:func:`batch_drafting` or None) is told
    each decode step's time."""
    if native is None:
        for row, adapter in enumerate(adapters):
            adapter.cache = plan.row_cache(row)
    else:
        for adapter, capacity in zip(adapters, capacities, strict=True):
            adapter.allocate_native_cache(capacity)
    return _C.BatchedForward(
        native,
        forward=plan.forward_fn(adapters) if native is None else None,
        keys=[[layer.keys for layer in a.cache.layers] for a in adapters],
        values=[[layer.values for layer in a.cache.layers] for a in adapters],
        prefill_logits_from=[a.prefill_logits_from for a in adapters],
        prefilled=[a.prefilled_flag for a in adapters],
        overhead=overhead,
        share_prefills=SHARE_PREFILLS,
        drafting=drafting,
    )
