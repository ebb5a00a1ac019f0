"""One ``generate`` call as mtprobe runs it, prepared once: its arguments checked (:class:`Call`) and what every
sequence of it shares (:class:`Shared`). :mod:`mtprobe.decode.generate` builds both;
:mod:`mtprobe.decode.sequence` decodes each sequence with them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from mtprobe.decode import checks
from mtprobe.decode.hf_arguments import check_call_arguments, check_refused
from mtprobe.decode.hf_call import (
    Prompt,
    call_arguments,
    log_decoding_mode,
    logger,
    prompts,
    split_stopping_criteria,
)
from mtprobe.drafters import (
    as_decoding_config,
    check_decoding_config,
    hidden_layer,
    mask_adaptation,
    max_prompt_logit_rows,
)
from mtprobe.drafters.from_hf import resolve_config
from mtprobe.registry import DecodingConfig
from mtprobe.target_model.adapter import check_causal_lm, max_positions
from mtprobe.target_model.native_forward import describe as describe_native
from mtprobe.target_model.native_forward import native_forward
from mtprobe.target_model.plan import PlanConfig, plan_for
from mtprobe.target_model.profile import choose_linear_routes

# KV entries (and mask columns) allocated beyond the prompt and one block before the buffers double.
_INITIAL_HEADROOM = 256


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
