"""Public entry points: ``mtprobe.generate`` and the HF route ``custom_generate``.

Both run through ``model.generate``'s own preparation (generation config, logits processors,
stopping criteria, special tokens), so mtprobe honours exactly what greedy ``generate`` honours;
the decoding itself is the C++ loop (csrc/decode/decode_loop.cpp). Read it top to bottom:
:func:`generate` checks its arguments and calls ``model.generate``, which calls
:func:`custom_generate`; that prepares the call once (:class:`~mtprobe.decode.call.Call`), builds what
every sequence shares (:class:`~mtprobe.decode.call.Shared`), and decodes each sequence
(:func:`~mtprobe.decode.sequence.decode_sequence`): the target adapter first, then the drafter that is
handed it, then the loop. Several sequences (a batch of prompts, ``num_return_sequences``) run their loops
together where one forward can serve them all (:func:`~mtprobe.decode.sequence.decode_batch`,
:mod:`mtprobe.decode.batch`), up to ``MAX_ROWS`` at a time, else one after another.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList

from mtprobe.decode import batch as batching
from mtprobe.decode import checks
from mtprobe.decode.batch import why_not_batched
from mtprobe.decode.call import Call, Shared
from mtprobe.decode.hf_arguments import check_call_arguments
from mtprobe.decode.hf_call import (
    hf_caller_locals,
)
from mtprobe.decode.output import GenerateOutput, padding_id, stack_outputs
from mtprobe.decode.sequence import decode_batch, decode_sequence
from mtprobe.drafters import (
    as_decoding_config,
    drafts_row_by_row,
    ngram_memories,
)
from mtprobe.registry import DecodingConfig
from mtprobe.target_model.adapter import SharedPrefill, check_causal_lm
from mtprobe.target_model.plan import PlanConfig
from mtprobe.tree_attention import NAME as TREE_ATTENTION

logger = logging.getLogger(__name__)


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
        tree_attention=getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION,
        drafts_on_cpu=call.device.type == "cpu"
        and call.method != "plain"
        and not (call.plan is not None and call.plan.cuda_graphs),
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
