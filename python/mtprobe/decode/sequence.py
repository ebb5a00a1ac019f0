"""One sequence of a call, from its parts to its output: its target adapter, then the drafter handed it, then
its decode loop (:func:`decode_sequence`); the sequences of a batch decoded together, one C++ forward per step
for all of them (:func:`decode_batch`, :mod:`mtprobe.decode.batch`). :mod:`mtprobe.decode.generate` prepares
the call (:mod:`mtprobe.decode.call`) and hands each sequence here."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedModel

from mtprobe import _C, registry
from mtprobe.decode.batch import batch_drafting, batched_forward, row_generators
from mtprobe.decode.hf_call import Prompt, apply_processors, logger
from mtprobe.decode.output import GenerateOutput, per_token
from mtprobe.drafters import auto_carry, make_drafter
from mtprobe.target_model.adapter import HFAdapter, SharedPrefill
from mtprobe.target_model.batch_plan import batch_plan_for
from mtprobe.target_model.native_forward import MARGIN_BOUND
from mtprobe.target_model.plan import PlanConfig
from mtprobe.tree_attention import NAME as TREE_ATTENTION

if TYPE_CHECKING:
    from mtprobe.decode.call import Call, Shared


_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def decode_sequence(
    model: PreTrainedModel, call: Call, shared: Shared, prompt: Prompt, prefill: SharedPrefill | None
) -> GenerateOutput:
    """One sequence of ``prompt``: its own target adapter, drafter, KV cache and loop (the prefill shared
    with the prompt's other sequences through ``prefill``)."""
    seq = start_sequence(model, call, shared, prompt, prefill)
    loop = sequence_loop(model, call, seq)
    plan = shared.forward_plan
    with plan.in_use() if plan is not None else contextlib.nullcontext():
        result = loop.run(prompt.ids[0])
    return finish_sequence(model, call, shared, seq, result)


def decode_batch(
    model: PreTrainedModel, call: Call, shared: Shared, prompts: list[Prompt]
) -> list[GenerateOutput]:
    """The sequences of ``prompts`` decoded together (:mod:`mtprobe.decode.batch`): each its own adapter,
    drafter and loop, one forward per step for all of them (the C++ forward's, else HF's modules on a
    :class:`~mtprobe.target_model.batch_plan.BatchedPlan`)."""
    # The batch step's overhead, measured by the batched forward and priced by every row's scheduler; whether
    # a scheduler's rows draft at all, measured there too.
    overhead = _C.SharedSeconds()
    rows = len(prompts)
    scheduled = registry.method_of(call.config).name == "auto"
    drafting = batch_drafting(model, call.config, call.do_sample, rows) if scheduled else None
    seqs = [
        start_sequence(
            model,
            call,
            shared,
            prompt,
            None,
            batch_rows=rows,
            batch_overhead=overhead,
            batch_drafting=drafting,
        )
        for prompt in prompts
    ]
    capacities = [call.capacities(p.ids.shape[1])[1] for p in prompts]
    # Without the C++ forward, HF's modules run the rows padded to one block, on a KV buffer with a row axis.
    plan = (
        batch_plan_for(model, call.plan or PlanConfig(), rows, max(capacities))
        if shared.native is None
        else None
    )
    batched = batched_forward(shared.native, [s.adapter for s in seqs], capacities, overhead, drafting, plan)
    # Sampling: each row draws from a generator of its own, seeded from torch's (a seeded call repeats; the
    # rows' threads would interleave their draws from one generator in no fixed order).
    generators = row_generators(len(seqs)) if call.do_sample else [None] * len(seqs)
    loops = [sequence_loop(model, call, s, batched, row, generators[row]) for row, s in enumerate(seqs)]
    for row, s in enumerate(seqs):
        s.adapter.batch_row = (batched, row)  # the self-draft's steps meet there too
    try:
        with plan.in_use() if plan is not None else contextlib.nullcontext():
            # On a GPU the loops' threads queue their reads on the caller's streams (not each thread's default).
            results = batched.run(
                loops, [p.ids[0] for p in prompts], cuda_streams=model.device.type == "cuda"
            )
    finally:
        for s in seqs:
            s.adapter.batch_row = None
    outputs = [
        finish_sequence(model, call, shared, s, r, prefill_copied=batched.prefill_copied(row))
        for row, (s, r) in enumerate(zip(seqs, results, strict=True))
    ]
    for output in outputs if plan is not None else ():
        output.plan = plan.describe()  # the batch's plan, as every row ran through it
    if scheduled:  # what the rows' schedulers measured, kept once for the batch (not once a row)
        auto_carry.save(model, call.config.carry)
    return outputs


@dataclass(frozen=True)
class SequenceParts:
    """One sequence of a call before its loop runs: its prompt, target adapter, drafter and the loop's
    callbacks (HF's processors, criteria and streamer, as the row sees them)."""

    prompt: Prompt
    adapter: HFAdapter
    drafter: Any
    process: Any
    stop: Any
    stream: Any


def start_sequence(
    model: PreTrainedModel,
    call: Call,
    shared: Shared,
    prompt: Prompt,
    prefill: SharedPrefill | None,
    batch_rows: int = 1,
    batch_overhead: Any = None,
    batch_drafting: Any = None,
) -> SequenceParts:
    """The target adapter of one sequence of ``prompt``, then the drafter handed it; ``batch_rows``: the
    sequences decoded together with it (:func:`decode_batch`), whose forwards its own share, and
    ``batch_overhead`` their step's measured overhead (a :class:`mtprobe._C.SharedSeconds`), ``batch_drafting``
    whether they draft (:func:`mtprobe.decode.batch.batch_drafting`)."""
    config, device, processors = call.config, call.device, shared.logits_processor
    prompt_len = prompt.ids.shape[1]
    rows = shared.prompt_logit_rows
    first, full = call.capacities(prompt_len)
    # HF's processors and criteria see a row as its batched generate shows it: after the row's padding
    # (a processor that counts new tokens from the padded prompt's length counts right).
    process, stop, stream = None, None, None
    if len(processors) > 0:

        def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return apply_processors(processors, prompt.padded(ids), scores)

    if call.other_criteria:

        def stop(ids: torch.Tensor, scores: torch.Tensor) -> bool:
            # HF greedy hands criteria the processed scores the last token was chosen from.
            return bool(call.other_criteria(prompt.padded(ids.to(device)), scores.to(device)).any())

    if call.streamer is not None:
        stream = call.streamer.put

    # The target first: the drafter is handed it (a self-draft copies its KV entries).
    adapter = HFAdapter(
        model,
        first,
        max_capacity=full,
        checked=True,
        linear_routes=shared.routes,
        plan=shared.forward_plan,
        shared_prefill=prefill,
        native=shared.native,
    )
    adapter.hidden_layer = shared.hidden_layer
    adapter.batch_rows = batch_rows
    adapter.batch_overhead = batch_overhead
    adapter.batch_drafting = batch_drafting
    adapter.set_mask_layer_offsets(shared.masks.offsets)
    adapter.set_mask_lora(shared.masks.lora)
    adapter.set_mask_temperature(shared.masks.temperature)
    adapter.prefill_logits_from = (
        0 if rows is None else max(0, prompt_len - rows)
    )  # rows >= 1: the first token
    drafter = make_drafter(
        model, config, target=adapter, capacity=first, do_sample=call.do_sample, process=process
    )
    return SequenceParts(prompt, adapter, drafter, process, stop, stream)


def sequence_loop(
    model: PreTrainedModel,
    call: Call,
    seq: SequenceParts,
    batched: Any = None,
    row: int = -1,
    generator: torch.Generator | None = None,
) -> Any:
    """The decode loop of ``seq``: its target forward the adapter's, or row ``row`` of ``batched`` (a
    :class:`mtprobe._C.BatchedForward`: one forward for every row of a batch); ``generator``: what its
    sampled draws take (None: torch's default generator)."""
    config, adapter = call.config, seq.adapter
    first, _ = call.capacities(seq.prompt.ids.shape[1])
    return _C.DecodeLoop(
        seq.drafter,
        adapter.forward if batched is None else None,
        adapter.kv_buffers,
        max_new_tokens=call.max_new_tokens,
        eos_token_ids=call.eos_ids,
        max_positions=call.max_positions,
        block_complexity=config.block_complexity,
        kv_capacity=first,
        mask_dtype=_DTYPE_NAMES.get(model.dtype, "float32"),
        device=str(call.device),
        incremental_masks=getattr(config, "incremental_masks", True),
        do_sample=call.do_sample,
        process=seq.process,
        stop=seq.stop,
        stream=seq.stream,
        # A model running mtprobe's own tree attention takes the tree as ancestor bits.
        ancestor_bits=getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION,
        vocab_size=model.get_input_embeddings().weight.shape[0],
        keep_scores=bool(call.generation_config.output_scores),
        keep_logits=bool(call.generation_config.output_logits),
        # The C++ forward's near-ties go to HF's forward (greedy: the tokens stay HF's; sampling draws from
        # distributions that differ by rounding alone).
        exact_forward=adapter.exact_forward if adapter.decides_near_ties else None,
        margin_bound=MARGIN_BOUND if adapter.decides_near_ties and not call.do_sample else 0.0,
        batched=batched,
        row=row,
        generator=generator,
    )


def finish_sequence(
    model: PreTrainedModel,
    call: Call,
    shared: Shared,
    seq: SequenceParts,
    result: Any,
    *,
    prefill_copied: bool = False,
) -> GenerateOutput:
    """What one sequence's loop returned (``result``, a :class:`mtprobe._C.DecodeResult`) as a GenerateOutput;
    ``prefill_copied``: a batch's row whose prefill was a copy of another row's (its loop counted it)."""
    config, device, adapter, drafter = call.config, call.device, seq.adapter, seq.drafter
    prompt_len = seq.prompt.ids.shape[1]
    plan = shared.forward_plan
    if call.streamer is not None:
        call.streamer.end()
    if result.fallback_steps:
        logger.warning(
            "%d decode step(s) produced non-finite target logits with drafts in the block and were re-run "
            "without them (the output is unaffected; the drafts or mask tokens overflow the model's dtype?)",
            result.fallback_steps,
        )
    output = GenerateOutput(
        sequences=torch.tensor(result.sequence, dtype=torch.long, device=device).unsqueeze(0),  # [1, L + new]
        accept_lengths=list(result.accept_lengths),
        block_sizes=list(result.block_sizes),
        # The forwards the model ran: a prefill copied from another sequence's ran none.
        forward_calls=result.forward_calls - adapter.prefill_shared - prefill_copied,
        timings={
            "total_s": result.total_seconds,
            "forward_s": result.forward_seconds,
            "prefill_s": result.prefill_seconds,
        },
        stop_reason=result.stop_reason,
        fallback_steps=result.fallback_steps,
        kv_capacity=result.kv_capacity,
        method=call.method,
        do_sample=call.do_sample,
        new_tokens=len(result.sequence) - prompt_len,
        linear_routes=shared.routes.describe() if device.type == "cpu" else "",
        target_forward=shared.target_forward,
        exact_steps=result.exact_steps,
        drafted_per_depth=list(result.drafted_per_depth),
        accepted_per_depth=list(result.accepted_per_depth),
        plan=plan.describe() if plan is not None else None,
        host_reads=result.host_reads,
        scores=per_token(result.scores),
        logits=per_token(result.logits),
    )
    output.batch = adapter.batch_rows
    finish = registry.method_of(config).finish
    if finish is not None:  # the method's own fields: a scheduler's choices, a bank's trees
        finish(model, config, drafter, output, call.do_sample)
    if logger.isEnabledFor(logging.INFO):
        stats = output.summary()
        logger.info(
            "mtprobe %s: %d new tokens in %d decode steps (tau %.3f), %d of %d drafted tokens accepted, "
            "%.1f tokens/s, stop: %s, KV capacity %d, mask columns %d, fallback steps %d%s",
            call.method,
            stats["new_tokens"],
            stats["steps"],
            stats["tau"],
            stats["accepted_tokens"],
            stats["drafted_tokens"],
            stats["tokens_per_s"],
            result.stop_reason,
            result.kv_capacity,
            result.mask_capacity,
            result.fallback_steps,
            f", linear routes: {output.linear_routes}" if output.linear_routes else "",
        )
    return output
