"""Public entry points: ``mtprobe.generate`` and the HF route ``custom_generate``.

Both run through ``model.generate``'s own preparation (generation config, logits processors,
stopping criteria, special tokens), so mtprobe honours exactly what greedy ``generate`` honours;
the decoding itself is the C++ loop (csrc/decode/decode_loop.cpp). Read it top to bottom:
:func:`generate` checks its arguments and calls ``model.generate``, which calls
:func:`custom_generate`; that prepares the call once (:class:`Call`), builds what every sequence
shares (:class:`Shared`), and decodes each sequence (:func:`decode_sequence`): the target adapter
first, then the drafter that is handed it, then the loop. Several sequences (a batch of prompts,
``num_return_sequences``) run their loops together where one forward can serve them all
(:func:`decode_batch`, :mod:`mtprobe.decode.batch`), else one after another.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from mtprobe import _C, registry
from mtprobe.decode import batch as batching
from mtprobe.decode import checks
from mtprobe.decode.batch import batched_forward, row_generators, why_not_batched
from mtprobe.decode.hf_arguments import check_call_arguments, check_refused
from mtprobe.decode.hf_call import (
    Prompt,
    apply_processors,
    call_arguments,
    hf_caller_locals,
    log_decoding_mode,
    prompts,
    split_stopping_criteria,
)
from mtprobe.decode.output import GenerateOutput, padding_id, per_token, stack_outputs
from mtprobe.drafters import (
    as_decoding_config,
    check_decoding_config,
    drafts_row_by_row,
    hidden_layer,
    make_drafter,
    mask_adaptation,
    max_prompt_logit_rows,
    ngram_memories,
)
from mtprobe.drafters.from_hf import resolve_config
from mtprobe.registry import DecodingConfig
from mtprobe.target_model.adapter import HFAdapter, SharedPrefill, check_causal_lm, max_positions
from mtprobe.target_model.native_forward import MARGIN_BOUND, native_forward
from mtprobe.target_model.native_forward import describe as describe_native
from mtprobe.target_model.plan import PlanConfig, plan_for
from mtprobe.target_model.profile import choose_linear_routes
from mtprobe.tree_attention import NAME as TREE_ATTENTION

logger = logging.getLogger(__name__)

# KV entries (and mask columns) allocated beyond the prompt and one block before the buffers double.
_INITIAL_HEADROOM = 256

_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    config: DecodingConfig | Mapping[str, Any] | None = None,
    *,
    max_new_tokens: int | None = None,
    streamer: Any = None,
    plan: PlanConfig | None = None,
    **generate_kwargs: Any,
) -> GenerateOutput:
    """Lossless multi-token generation with the drafter ``config`` describes: ``ProbeConfig`` (mask-token
    probing, the default), ``PromptLookupConfig``, ``StandConfig``, ``LookaheadConfig``,
    ``HybridConfig``, ``DraftModelConfig``, ``EntMTPConfig``, ``HeadsConfig`` (a trained circuit head),
    ``AutoConfig`` or the configuration of any method registered since (``mtprobe.register_method``), or
    a dict such as ``{"method": "pld", "num_tokens": 10}`` (:func:`mtprobe.config_from_dict`).

    The decoding mode is ``model.generate``'s: greedy unless the merged generation config says
    ``do_sample=True``, and the model's own ``generation_config`` counts (many instruct models ship
    ``do_sample=True``, and then ``model.generate(ids)`` samples too; mtprobe logs it at INFO).
    Greedy: token-identical to ``model.generate(ids, do_sample=False)``; pass ``do_sample=False`` to
    be sure of greedy decoding. Sampling (with ``temperature``, ``top_k``, ``top_p``, ... as HF
    applies them): every tree node samples the target's processed distribution and verification
    accepts the child equal to the sample (a draft model's drafts go through rejection sampling
    against its own q instead), so the output is distributed exactly as
    ``model.generate(do_sample=True)``; seed with ``torch.manual_seed`` for repeatable text.
    ``generate_kwargs`` go to ``model.generate`` (eos_token_id, stopping_criteria,
    logits_processor, repetition_penalty, ...), which prepares them exactly as for its own
    decoding. transformers' drafter arguments map onto mtprobe's drafters
    (``prompt_lookup_num_tokens``, ``assistant_model``, ``assistant_early_exit``; they must agree
    with an explicit ``config``) and the other decoding methods' arguments are refused: see
    :data:`mtprobe.decode.hf_arguments.HF_ARGUMENTS`.
    """
    check_causal_lm(model)
    checks.check_no_inputs_embeds(generate_kwargs)
    # HF's generate drops these before a custom_generate could see them: check and carry them here.
    check_call_arguments(generate_kwargs)
    assistant_model = generate_kwargs.pop("assistant_model", None)
    if config is not None:
        config = as_decoding_config(config)  # a bad dict fails here, before model.generate runs
    checks.check_input_ids(input_ids, model)
    checks.check_attention_mask(generate_kwargs.get("attention_mask"), input_ids)
    if max_new_tokens is not None:
        max_new_tokens = checks.check_max_new_tokens(max_new_tokens)
    if streamer is not None:
        if input_ids.shape[0] > 1:
            raise ValueError(
                f"a streamer takes one sequence, and input_ids holds {input_ids.shape[0]} prompts: drop the "
                "streamer or generate one prompt per call"
            )
        streamer.put(input_ids.cpu())  # HF puts the prompt first; this route bypasses that
    return model.generate(
        input_ids,
        custom_generate=custom_generate,
        mtprobe_config=config,
        mtprobe_return_output=True,
        mtprobe_model_checked=True,
        mtprobe_streamer=streamer,
        mtprobe_assistant_model=assistant_model,
        mtprobe_plan=plan,
        max_new_tokens=max_new_tokens,
        **generate_kwargs,
    )


def custom_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    logits_processor: LogitsProcessorList,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
    synced_gpus: bool = False,
    streamer: Any = None,
    mtprobe_config: DecodingConfig | Mapping[str, Any] | None = None,
    mtprobe_return_output: bool = False,
    mtprobe_model_checked: bool = False,
    mtprobe_streamer: Any = None,
    mtprobe_assistant_model: Any = None,
    mtprobe_plan: PlanConfig | None = None,
    **model_kwargs: Any,
) -> torch.Tensor | GenerateOutput:
    """The decoding method HF's ``generate`` calls when given ``custom_generate=mtprobe.custom_generate``.

    ``mtprobe_config``: a decoding configuration or a ``{"method": ...}`` dict; ``None``: the one
    transformers' drafter arguments describe (``prompt_lookup_num_tokens``, ``assistant_model``,
    ``assistant_early_exit``), else ``ProbeConfig()``. Returns the sequences tensor (as ``generate``
    does), or a ``GenerateOutput`` when ``return_dict_in_generate=True``. ``mtprobe_model_checked``:
    ``mtprobe.generate`` has run ``check_causal_lm`` on ``model`` already (a walk of the whole module
    tree), so it is not run again.
    """
    # transformers hands a callable custom_generate neither generate()'s assistant_model nor its
    # streamer: read them, and the call's own arguments, from generate()'s frame.
    caller = hf_caller_locals()
    call = Call.prepare(
        model,
        input_ids,
        stopping_criteria,
        generation_config,
        caller,
        config=mtprobe_config,
        assistant_model=mtprobe_assistant_model
        if mtprobe_assistant_model is not None
        else caller.get("assistant_model"),
        plan=mtprobe_plan,
        streamer=streamer
        if streamer is not None
        else (mtprobe_streamer if mtprobe_streamer is not None else caller.get("streamer")),
        synced_gpus=synced_gpus or bool(caller.get("synced_gpus")),  # HF keeps generate()'s from a callable
        model_checked=mtprobe_model_checked,
        model_kwargs=model_kwargs,
    )
    shared = Shared.build(model, call, logits_processor)
    of_prompt = [prompt for prompt in call.prompts for _ in range(call.num_sequences)]
    why = why_not_batched(
        len(of_prompt),
        shared.native,
        masks=shared.masks,
        hidden_layer=shared.hidden_layer,
        shares_memory=bool(ngram_memories(model, call.config)),
        draft_model=drafts_row_by_row(call.config),
    )
    if not why:  # the sequences together: one target forward per step for up to MAX_ROWS of them
        outputs, rows = [], batching.MAX_ROWS
        for start in range(0, len(of_prompt), rows):
            outputs += decode_batch(model, call, shared, of_prompt[start : start + rows])
    else:
        if len(of_prompt) > 1:
            logger.info("mtprobe: %d sequences decoded one after another: %s", len(of_prompt), why)
        outputs = []
        for prompt in call.prompts:
            # The sequences of one prompt share its prefill: the first runs it, the others take copies.
            prefill = SharedPrefill() if call.num_sequences > 1 else None
            for _ in range(call.num_sequences):
                outputs.append(decode_sequence(model, call, shared, prompt, prefill))
    if len(outputs) == 1:
        output = outputs[0]
        output.sequences = call.prompts[0].padded(output.sequences)  # [1, L + new], the padding as given
    else:
        output = stack_outputs(outputs, of_prompt, padding_id(generation_config))
    if not (mtprobe_return_output or generation_config.return_dict_in_generate):
        return output.sequences
    return output


@dataclass(frozen=True)
class Call:
    """One ``generate`` call as mtprobe runs it, every argument checked: the configuration and its
    method, the prompts without their padding, the lengths and the stopping rules."""

    config: DecodingConfig
    method: str
    prompts: list[Prompt]
    num_sequences: int
    max_new_tokens: int
    max_positions: int
    eos_ids: list[int]
    other_criteria: StoppingCriteriaList
    do_sample: bool
    streamer: Any
    plan: PlanConfig | None
    generation_config: GenerationConfig
    device: torch.device

    @classmethod
    def prepare(
        cls,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        stopping_criteria: StoppingCriteriaList,
        generation_config: GenerationConfig,
        caller: dict[str, Any],
        *,
        config: DecodingConfig | Mapping[str, Any] | None,
        assistant_model: Any,
        plan: PlanConfig | None,
        streamer: Any,
        synced_gpus: bool,
        model_checked: bool,
        model_kwargs: dict[str, Any],
    ) -> Call:
        # The generation config first: beam search and num_return_sequences expand the batch before we see it.
        checks.check_generation_config(generation_config, model_kwargs)
        check_refused(generation_config)
        check_call_arguments(call_arguments(caller))
        given = None if config is None else as_decoding_config(config)
        config = as_decoding_config(resolve_config(given, generation_config, assistant_model))
        log_decoding_mode(model, generation_config, caller)
        # What mtprobe.generate checks before calling model.generate, again for the HF route.
        if not model_checked:
            check_causal_lm(model)
        checks.check_no_inputs_embeds(model_kwargs)
        # HF has repeated each prompt row num_return_sequences times ([batch * n, L], left-padded where the
        # prompts differ in length). Each prompt is decoded without its padding, each copy in turn by its own
        # loop and drafter, after the checks and set-up they all share.
        num_sequences = generation_config.num_return_sequences or 1
        attention_mask = model_kwargs.get("attention_mask")
        checks.check_input_ids(input_ids, model)
        # HF drops an all-ones mask before this point and keeps only its length.
        checks.check_attention_mask(
            attention_mask, input_ids, getattr(generation_config, "_mask_length", None)
        )
        rows = prompts(input_ids, attention_mask, num_sequences)
        if plan is not None and not isinstance(plan, PlanConfig):
            raise TypeError(f"plan must be a mtprobe.PlanConfig or None, got {type(plan).__name__}")
        if synced_gpus:
            raise NotImplementedError("mtprobe does not support synced_gpus (multi-GPU lockstep generation)")
        if streamer is not None and len(rows) * num_sequences > 1:
            raise ValueError(
                f"a streamer takes one sequence, and this call asks for {len(rows) * num_sequences} "
                f"({len(rows)} prompt(s), num_return_sequences={num_sequences}): drop the streamer or generate "
                "one sequence per call"
            )
        longest = max(p.ids.shape[1] for p in rows)  # the longest prompt, without padding
        max_length, eos_ids, other_criteria = split_stopping_criteria(stopping_criteria, generation_config)
        # max_length counts the padding, as HF's does: every row of a batch gets the same max_new_tokens.
        max_new_tokens = max_length - input_ids.shape[1]
        if max_new_tokens < 1:
            raise ValueError(
                f"nothing to generate: max_length={max_length} leaves no room after a prompt of {input_ids.shape[1]} "
                "tokens; pass max_new_tokens >= 1"
            )
        limit = max_positions(model)
        if longest + max_new_tokens > limit:
            raise ValueError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) = {longest + max_new_tokens} "
                f"exceeds the model's context of {limit} positions; shorten the prompt or lower max_new_tokens"
            )
        checks.check_sliding_window(model, longest + max_new_tokens)
        method = check_decoding_config(config)
        if method.check_context is not None:  # a drafter with a context of its own (a user's draft model)
            method.check_context(model, config, longest, max_new_tokens)
        if config.block_complexity > limit:
            # One forward takes up to BC inputs and a [BC, prefix + BC] mask: beyond the model's context
            # that is no draft budget but a memory blow-up (and the dynamic tree's work grows as BC^2 log BC).
            raise ValueError(
                f"block_complexity={config.block_complexity} exceeds the model's context of {limit} positions: one "
                f"forward cannot usefully take more inputs than that; use a block_complexity <= {limit} "
                "(the paper's settings are 10, 30 and 60)"
            )
        return cls(
            config=config,
            method=method.name,
            prompts=rows,
            num_sequences=num_sequences,
            max_new_tokens=max_new_tokens,
            max_positions=limit,
            eos_ids=eos_ids,
            other_criteria=other_criteria,
            do_sample=bool(generation_config.do_sample),
            streamer=streamer,
            plan=plan,
            generation_config=generation_config,
            device=input_ids.device,
        )

    def capacities(self, prompt_len: int) -> tuple[int, int]:
        """A prompt's buffers, first size and largest: room for the prompt, one block and a little more
        at first, doubling when full, never past what this call can need (max_new_tokens is often a
        generous bound that EOS cuts short)."""
        full = prompt_len + self.max_new_tokens + self.config.block_complexity
        return min(full, prompt_len + self.config.block_complexity + _INITIAL_HEADROOM), full


@dataclass(frozen=True)
class Shared:
    """What every sequence of a call shares: the linear routes, the forward plan, the prompt rows whose
    logits the drafter reads, the mask adaptation, the hidden layer read, the processors and the stream."""

    routes: Any
    forward_plan: Any
    prompt_logit_rows: int | None
    masks: Any
    hidden_layer: int
    logits_processor: LogitsProcessorList
    native: Any
    """The target's C++ forward for decode blocks, or None where HF's runs (:mod:`mtprobe.target_model.native_forward`)."""
    target_forward: str
    """What runs the decode blocks: the C++ forward's version, or ``"HF (reason)"``."""

    @classmethod
    def build(cls, model: PreTrainedModel, call: Call, logits_processor: LogitsProcessorList) -> Shared:
        config = call.config
        capacity, max_capacity = call.capacities(max(p.ids.shape[1] for p in call.prompts))
        logger.info(
            "mtprobe %s (%s), %s, block complexity %d; KV cache and mask for %d positions at first, "
            "growing by doubling up to %d",
            call.method,
            config,
            "sampling" if call.do_sample else "greedy",
            config.block_complexity,
            capacity,
            max_capacity,
        )
        forward_plan = None
        if call.plan is not None:
            forward_plan = plan_for(
                model,
                call.plan,
                max_capacity,
                num_layers=model.config.get_text_config(decoder=True).num_hidden_layers,
                max_positions=call.max_positions,
            )
        native, target_forward = None, "HF (the model is not on the CPU)"
        if call.plan is not None:  # the plan's buckets and graphs run HF's modules
            target_forward = "HF (a static forward plan)"
        elif call.device.type == "cpu":
            native = native_forward(model)
            target_forward = describe_native(model)
        return cls(
            native=native,
            target_forward=target_forward,
            routes=choose_linear_routes(model),  # the CPU linear routes: measured once per machine and model
            forward_plan=forward_plan,
            # A registered configuration that does not say which rows it reads reads every one.
            prompt_logit_rows=max_prompt_logit_rows((config,)),
            masks=mask_adaptation(config),
            hidden_layer=hidden_layer(model, config),
            logits_processor=logits_processor,
        )


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
    drafter and loop, one C++ forward per step for all of them."""
    # The batch step's overhead, measured by the batched forward and priced by every row's scheduler.
    overhead = _C.SharedSeconds()
    seqs = [
        start_sequence(model, call, shared, prompt, None, batch_rows=len(prompts), batch_overhead=overhead)
        for prompt in prompts
    ]
    capacities = [call.capacities(p.ids.shape[1])[1] for p in prompts]
    batched = batched_forward(shared.native, [s.adapter for s in seqs], capacities, overhead)
    # Sampling: each row draws from a generator of its own, seeded from torch's (a seeded call repeats; the
    # rows' threads would interleave their draws from one generator in no fixed order).
    generators = row_generators(len(seqs)) if call.do_sample else [None] * len(seqs)
    loops = [sequence_loop(model, call, s, batched, row, generators[row]) for row, s in enumerate(seqs)]
    for row, s in enumerate(seqs):
        s.adapter.batch_row = (batched, row)  # the self-draft's steps meet there too
    try:
        results = batched.run(loops, [p.ids[0] for p in prompts])
    finally:
        for s in seqs:
            s.adapter.batch_row = None
    return [finish_sequence(model, call, shared, s, r) for s, r in zip(seqs, results, strict=True)]


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
) -> SequenceParts:
    """The target adapter of one sequence of ``prompt``, then the drafter handed it; ``batch_rows``: the
    sequences decoded together with it (:func:`decode_batch`), whose forwards its own share, and
    ``batch_overhead`` their step's measured overhead (a :class:`mtprobe._C.SharedSeconds`)."""
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
    model: PreTrainedModel, call: Call, shared: Shared, seq: SequenceParts, result: Any
) -> GenerateOutput:
    """What one sequence's loop returned (``result``, a :class:`mtprobe._C.DecodeResult`) as a GenerateOutput."""
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
        forward_calls=result.forward_calls - adapter.prefill_shared,  # the forwards the model ran
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
