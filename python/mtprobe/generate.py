"""Public entry points: ``mtprobe.generate`` and the HF route ``custom_generate``.

Both run through ``model.generate``'s own preparation (generation config, logits processors,
stopping criteria, special tokens), so mtprobe honours exactly what greedy ``generate`` honours;
the decoding itself is the C++ loop (csrc/decode/decode_loop.cpp).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import operator
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria
from transformers.utils import ModelOutput

from mtprobe import _C, registry
from mtprobe import methods as _builtin_methods  # noqa: F401  (registers the built-in methods)
from mtprobe.adapter import HFAdapter, SharedPrefill, check_causal_lm, max_positions, sliding_window
from mtprobe.config import DraftModelConfig, EntMTPConfig, HeadsConfig, max_prompt_logit_rows
from mtprobe.draft_model import check_draft_model
from mtprobe.drafters import (
    DecodingConfig,
    as_decoding_config,
    auto_candidates,
    carry_auto_measurements,
    check_decoding_config,
    hidden_layer,
    make_drafter,
    mask_adaptation,
    running_target,
)
from mtprobe.hf_route import check_call_arguments, check_refused, resolve_config
from mtprobe.plan import PlanConfig, plan_for
from mtprobe.profile import choose_linear_routes
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


@dataclass(eq=False)
class GenerateOutput(ModelOutput):
    """What one mtprobe generation did.

    Attributes:
        sequences: ``[1, prompt + new]`` tokens, identical to greedy ``model.generate``; ``[batch * n,
            L + new]`` for a batch of prompts (left-padded to L tokens, as HF pads them) with
            ``num_return_sequences=n``, each prompt's n sequences together, as HF orders them.
        accept_lengths: tokens gained per decode forward (accepted drafts + bonus), one per step.
        block_sizes: inputs T of each decode step's forward (committed, drafts and auxiliary inputs),
            one per step: with the forward profile, what the step cost.
        forward_calls: target forwards, prefill included. With ``num_return_sequences``, the sequences
            share the prompt's prefill: the first runs it, the others take copies of its logits and
            KV entries, and count no prefill forward (their ``prefill_s`` is the copy's time).
        timings: seconds: ``total_s`` (whole loop), ``forward_s`` (inside model forwards, prefill
            included), ``prefill_s``.
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"stopping_criteria"``.
        fallback_steps: decode steps whose drafts made the target's logits non-finite (NaN/inf)
            and that were re-run on the committed token alone, as plain decoding runs it.
        kv_capacity: KV entries per layer the cache held at the end: it grows with the tokens
            generated (doubling), not with ``max_new_tokens``.
        new_tokens: tokens generated (``sequences.shape[1]`` minus the prompt; the prefill's
            forward may already verify drafts, so this can exceed ``sum(accept_lengths) + 1``).
        method: the drafter that ran, by its short name (``"probe"``, ``"pld"``, ...).
        do_sample: whether this call sampled (``generation_config.do_sample`` after HF merged the
            model's generation config with the call's arguments) or decoded greedily.
        drafted_per_depth: decode steps only; index ``d - 1`` counts the draft nodes placed at depth
            ``d`` below the last committed token, over all steps.
        accepted_per_depth: index ``d - 1`` counts the steps whose verified path reached depth ``d``
            (drafts accepted; the bonus token is no draft). An EOS or stopping criterion may cut the
            last step's tokens short after verification; ``accept_lengths`` counts what was kept.
        choices: with :class:`~mtprobe.AutoConfig`, one ``(method, block size T)`` per decode step:
            the drafter whose block (or cut of it) was verified, or ``("plain", 1)``; ``timings``
            then also holds ``draft_s`` (the drafters' own work) and ``schedule_s`` (the scheduler's).
            With :class:`~mtprobe.EntMTPConfig` or a ``HeadsConfig`` with a bank: ``("tree<i>", T)``,
            the bank tree the policy chose, or ``("none", 1 + k)`` for a step without candidates (the
            root and its k masks; k = 0 for a head).
        topology_log: with ``EntMTPConfig(record_steps=True)``: per step with candidates, ``positions``
            (the next root's index in ``sequences[0]``), ``candidates`` ``[n, k, m]``, ``features``
            ``[n, 4]`` (top1, path_value, entropy_ema, accept_ema) and ``trees`` (the tree chosen next).
            With ``HeadsConfig(bank=..., record_steps=True)``: ``ranks`` ``[n, window - 1]`` (the true
            continuation's child ranks, -1 for none) instead of the candidates.
        linear_routes: on a CPU, how the decode steps' linear layers ran by block size, e.g.
            ``T 1: stock; T 2-16: small-batch; T 17+: stock`` (:mod:`mtprobe.linear_routes`: measured
            once per machine and model, forced with ``MTPROBE_LINEAR_ROUTE``); empty on a GPU.
        host_reads: device->host reads the decode loop made (prefill included; counted on the CPU
            too, where they are plain copies): one per forward for greedy decoding and sample
            matching with the built-in drafters, which hand their drafts over on the host. The
            drafters' own reads (e.g. STAND's and probing's candidate tables) are not counted.
        plan: with ``plan=PlanConfig(...)``, how the static forward plan ran (:mod:`mtprobe.plan`):
            ``capacity``, ``buckets``, ``pad``, ``graphs`` (captured buckets), ``replays``,
            ``capture_s``, ``growths`` and ``eager_reason`` (why no graphs ran, "" when they did);
            None without a plan.
        scores: with ``output_scores=True``, as HF's: one ``[rows, vocab]`` float32 tensor per new token,
            the scores (after the logits processors) that token was chosen from, for
            ``model.compute_transition_scores``. They come from the forward that verified the token, so
            they sit within rounding of greedy ``generate``'s own (under greedy decoding their argmax is
            the token, exactly).
            A row that ended before the longest holds zeros after its end. None without the flag.
        logits: with ``output_logits=True``: the same for the raw logits, before any processor.
        sequence_outputs: with several sequences (a batch of prompts, or ``num_return_sequences=n > 1``
            under sampling): each sequence's own output, in order, as a call on its prompt alone
            (without padding) returns it; ``sequences`` is then ``[rows, L + longest]``, each row after
            its prompt's left padding and the shorter ones padded after their end with the pad token,
            as HF pads them, and the other fields cover all the sequences (counts and timings summed,
            per-step lists concatenated, ``stop_reason`` the distinct reasons joined by ","). None for
            one sequence.

    A worked example: two decode steps, the first drafting the chain ``a -> b`` (depths 1, 2) of
    which ``a`` is accepted, the second drafting two siblings at depth 1, neither accepted:
    ``accept_lengths == [2, 1]``, ``drafted_per_depth == [3, 1]``, ``accepted_per_depth == [1]``,
    ``block_sizes == [3, 3]`` (the committed token and the drafts, without auxiliary inputs).

    A transformers ``ModelOutput``, read as HF's ``GenerateDecoderOnlyOutput`` is (pipelines take its
    sequences and scores): ``out["sequences"]``, ``out[0]``, ``"scores" in out``, ``out.keys()``,
    ``dict(out)`` and ``out.to_tuple()`` see the fields HF's output has and that are set (``sequences``,
    then ``scores`` and ``logits`` when asked for), in HF's order; ``attentions`` and ``hidden_states`` are
    None, as HF's are unless asked for (mtprobe refuses those flags). ``cache`` (``past_key_values``) is
    None: mtprobe's cache holds draft trees, not an HF cache to continue from. mtprobe's own statistics
    are attributes only.
    """

    sequences: torch.Tensor
    accept_lengths: list[int]
    forward_calls: int
    timings: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    fallback_steps: int = 0
    kv_capacity: int = 0
    method: str = ""
    do_sample: bool = False
    new_tokens: int = 0
    drafted_per_depth: list[int] = field(default_factory=list)
    accepted_per_depth: list[int] = field(default_factory=list)
    block_sizes: list[int] = field(default_factory=list)
    choices: list[tuple[str, int]] | None = None
    topology_log: dict[str, Any] | None = None
    linear_routes: str = ""
    plan: dict[str, Any] | None = None
    host_reads: int = 0
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None
    sequence_outputs: tuple[GenerateOutput, ...] | None = None

    # HF's GenerateDecoderOnlyOutput: its fields mtprobe fills, in its order; and those it leaves None.
    _HF_FIELDS: ClassVar[tuple[str, ...]] = ("sequences", "scores", "logits")
    attentions: ClassVar[None] = None
    hidden_states: ClassVar[None] = None

    def __post_init__(self) -> None:
        # ModelOutput's own check wants every field but the first to default to None; mtprobe's statistics
        # have other defaults, and only the HF fields are the mapping's (see __setattr__).
        pass

    def __setattr__(self, name: str, value: Any) -> None:
        # A ModelOutput's mapping holds its set fields; this one holds HF's only, so that keys(),
        # items(), to_tuple() and out[i] are what HF's generate output gives (a pipeline reads them).
        if name in self._HF_FIELDS and value is not None:
            OrderedDict.__setitem__(self, name, value)
        object.__setattr__(self, name, value)

    def __getitem__(self, key: str | int | slice) -> Any:
        if isinstance(key, str) and key not in self.keys():
            why = (
                "mtprobe returns no cache: its own holds draft trees, not an HF cache to continue from"
                if key in ("past_key_values", "cache")
                else "mtprobe's own statistics are attributes, e.g. out.tau, out.accept_lengths"
            )
            raise KeyError(
                f"{key!r} is not in this GenerateOutput: it holds {list(self.keys())}, the fields of HF's "
                "generate output this call set (scores and logits with output_scores=True / "
                f"output_logits=True); {why}"
            )
        return super().__getitem__(key)

    @property
    def past_key_values(self) -> None:
        """None: mtprobe returns no cache (ModelOutput's would look for ``cache``)."""
        return None

    @property
    def cache(self) -> None:
        """None: mtprobe's cache holds draft trees, not an HF cache to continue from."""
        return None

    @property
    def tau(self) -> float:
        """Mean tokens gained per decode forward (τ)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def steps(self) -> int:
        """Decode forwards (prefill excluded)."""
        return len(self.accept_lengths)

    def acceptance_per_depth(self) -> list[float]:
        """Fraction of decode steps whose verified path reached depth ``d`` (index ``d - 1``): the
        curve whose sum is ``tau - 1`` when nothing was cut short by EOS or a stopping criterion."""
        return [n / max(1, self.steps) for n in self.accepted_per_depth]

    def summary(self) -> dict[str, Any]:
        """The call's statistics in one flat dict (what the log line and the CLI print)."""
        new_tokens = self.new_tokens
        total = self.timings.get("total_s", 0.0)
        drafted, accepted = sum(self.drafted_per_depth), sum(self.accepted_per_depth)
        return {
            "method": self.method,
            "do_sample": self.do_sample,
            "new_tokens": new_tokens,
            "steps": self.steps,
            "forward_calls": self.forward_calls,
            "tau": self.tau,
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "draft_acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_s": new_tokens / total if total > 0 else 0.0,
            "fallback_steps": self.fallback_steps,
            "kv_capacity": self.kv_capacity,
            "stop_reason": self.stop_reason,
            "linear_routes": self.linear_routes,
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
    :data:`mtprobe.hf_route.HF_ARGUMENTS`.
    """
    check_causal_lm(model)
    _check_no_inputs_embeds(generate_kwargs)
    # HF's generate drops these before a custom_generate could see them: check and carry them here.
    check_call_arguments(generate_kwargs)
    assistant_model = generate_kwargs.pop("assistant_model", None)
    if config is not None:
        config = as_decoding_config(config)  # a bad dict fails here, before model.generate runs
    _check_input_ids(input_ids, model)
    _check_attention_mask(generate_kwargs.get("attention_mask"), input_ids)
    if max_new_tokens is not None:
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
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
    caller = _hf_caller_locals()
    # The config first: beam search and num_return_sequences expand the batch before we see it.
    _check_generation_config(generation_config, model_kwargs)
    check_refused(generation_config)
    check_call_arguments(_call_arguments(caller))
    assistant_model = mtprobe_assistant_model
    if assistant_model is None:
        assistant_model = caller.get("assistant_model")
    given = None if mtprobe_config is None else as_decoding_config(mtprobe_config)
    config = as_decoding_config(resolve_config(given, generation_config, assistant_model))
    _log_decoding_mode(model, generation_config, caller)
    # What mtprobe.generate checks before calling model.generate, again for the HF route.
    if not mtprobe_model_checked:
        check_causal_lm(model)
    _check_no_inputs_embeds(model_kwargs)
    # HF has repeated each prompt row num_return_sequences times ([batch * n, L], left-padded where the
    # prompts differ in length). Each prompt is decoded without its padding, each copy in turn by its own
    # loop and drafter, after the checks and set-up they all share.
    num_sequences = generation_config.num_return_sequences or 1
    attention_mask = model_kwargs.get("attention_mask")
    _check_input_ids(input_ids, model)
    # HF drops an all-ones mask before this point and keeps only its length.
    _check_attention_mask(attention_mask, input_ids, getattr(generation_config, "_mask_length", None))
    prompts = _prompts(input_ids, attention_mask, num_sequences)
    if mtprobe_plan is not None and not isinstance(mtprobe_plan, PlanConfig):
        raise TypeError(f"plan must be a mtprobe.PlanConfig or None, got {type(mtprobe_plan).__name__}")
    if synced_gpus or caller.get("synced_gpus"):  # HF keeps generate()'s synced_gpus from a callable
        raise NotImplementedError("mtprobe does not support synced_gpus (multi-GPU lockstep generation)")
    if streamer is None and mtprobe_streamer is None:
        streamer = caller.get("streamer")
    streamer = streamer if streamer is not None else mtprobe_streamer
    if streamer is not None and len(prompts) * num_sequences > 1:
        raise ValueError(
            f"a streamer takes one sequence, and this call asks for {len(prompts) * num_sequences} "
            f"({len(prompts)} prompt(s), num_return_sequences={num_sequences}): drop the streamer or generate "
            "one sequence per call"
        )

    device = input_ids.device
    longest = max(p.ids.shape[1] for p in prompts)  # the longest prompt, without padding
    max_length, eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria, generation_config)
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
    _check_sliding_window(model, longest + max_new_tokens)
    _check_draft_context(model, config, longest, max_new_tokens)

    method = check_decoding_config(config).name
    if config.block_complexity > limit:
        # One forward takes up to BC inputs and a [BC, prefix + BC] mask: beyond the model's context
        # that is no draft budget but a memory blow-up (and the dynamic tree's work grows as BC^2 log BC).
        raise ValueError(
            f"block_complexity={config.block_complexity} exceeds the model's context of {limit} positions: one "
            f"forward cannot usefully take more inputs than that; use a block_complexity <= {limit} "
            "(the paper's settings are 10, 30 and 60)"
        )

    # Buffers follow the tokens actually generated: they start with room for the prompt, one block
    # and a little more, and double when full, never past what this call can need (max_new_tokens
    # is often a generous bound that EOS cuts short).
    def capacities(prompt_len: int) -> tuple[int, int]:
        """A prompt's buffers: first size, largest size."""
        full = prompt_len + max_new_tokens + config.block_complexity
        return min(full, prompt_len + config.block_complexity + _INITIAL_HEADROOM), full

    capacity, max_capacity = capacities(longest)  # the plan's, and the log's
    do_sample = bool(generation_config.do_sample)
    logger.info(
        "mtprobe %s (%s), %s, block complexity %d; KV cache and mask for %d positions at first, "
        "growing by doubling up to %d",
        method,
        config,
        "sampling" if do_sample else "greedy",
        config.block_complexity,
        capacity,
        max_capacity,
    )
    # The CPU linear routes: measured once per machine and model, then read from disk.
    routes = choose_linear_routes(model)
    forward_plan = None
    if mtprobe_plan is not None:
        forward_plan = plan_for(
            model,
            mtprobe_plan,
            max_capacity,
            num_layers=model.config.get_text_config(decoder=True).num_hidden_layers,
            max_positions=limit,
        )

    # What every sequence shares: the prompt rows whose logits the drafter reads (a registered
    # configuration that does not say reads every one: computed, to be safe; the last row picks the
    # first token), the mask adaptation, the hidden layer read, the criteria and the stream.
    rows = max_prompt_logit_rows((config,))
    masks = mask_adaptation(config)
    layer = hidden_layer(model, config)
    stream = None
    if streamer is not None:

        def stream(tokens: torch.Tensor) -> None:
            streamer.put(tokens)

    def decode_one(prompt: _Prompt, shared_prefill: SharedPrefill | None) -> GenerateOutput:
        """One sequence of ``prompt``: its own drafter, KV cache and loop (the prefill shared)."""
        prompt_len = prompt.ids.shape[1]
        logits_from = 0 if rows is None else max(0, prompt_len - rows)  # rows >= 1: the first token
        first, full = capacities(prompt_len)
        # HF's processors and criteria see a row as its batched generate shows it: after the row's padding
        # (a processor that counts new tokens from the padded prompt's length counts right).
        process, stop = None, None
        if len(logits_processor) > 0:

            def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
                return _apply_processors(logits_processor, prompt.padded(ids), scores)

        if other_criteria:

            def stop(ids: torch.Tensor, scores: torch.Tensor) -> bool:
                # HF greedy hands criteria the processed scores the last token was chosen from.
                return bool(other_criteria(prompt.padded(ids.to(device)), scores.to(device)).any())

        drafter = make_drafter(model, config, capacity=first, do_sample=do_sample, process=process)
        adapter = HFAdapter(
            model,
            first,
            max_capacity=full,
            checked=True,
            linear_routes=routes,
            plan=forward_plan,
            shared_prefill=shared_prefill,
        )
        adapter.hidden_layer = layer
        adapter.set_mask_layer_offsets(masks.offsets)
        adapter.set_mask_lora(masks.lora)
        adapter.set_mask_temperature(masks.temperature)
        adapter.prefill_logits_from = logits_from
        loop = _C.DecodeLoop(
            drafter,
            adapter.forward,
            adapter.kv_buffers,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos_ids,
            max_positions=limit,
            block_complexity=config.block_complexity,
            kv_capacity=first,
            mask_dtype=_DTYPE_NAMES.get(model.dtype, "float32"),
            device=str(device),
            incremental_masks=getattr(config, "incremental_masks", True),
            do_sample=do_sample,
            process=process,
            stop=stop,
            stream=stream,
            # A model running mtprobe's own tree attention takes the tree as ancestor bits.
            ancestor_bits=getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION,
            vocab_size=model.get_input_embeddings().weight.shape[0],
            keep_scores=bool(generation_config.output_scores),
            keep_logits=bool(generation_config.output_logits),
        )
        plan_in_use = forward_plan.in_use() if forward_plan is not None else contextlib.nullcontext()
        with plan_in_use, running_target(adapter):
            result = loop.run(prompt.ids[0])
        if streamer is not None:
            streamer.end()
        if result.fallback_steps:
            logger.warning(
                "%d decode step(s) produced non-finite target logits with drafts in the block and were re-run "
                "without them (the output is unaffected; the drafts or mask tokens overflow the model's dtype?)",
                result.fallback_steps,
            )
        sequences = torch.tensor(result.sequence, dtype=torch.long, device=device).unsqueeze(
            0
        )  # [1, L + new]
        output = GenerateOutput(
            sequences=sequences,
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
            method=method,
            do_sample=do_sample,
            new_tokens=len(result.sequence) - prompt_len,
            linear_routes=routes.describe() if device.type == "cpu" else "",
            drafted_per_depth=list(result.drafted_per_depth),
            accepted_per_depth=list(result.accepted_per_depth),
            plan=forward_plan.describe() if forward_plan is not None else None,
            host_reads=result.host_reads,
            scores=_per_token(result.scores),
            logits=_per_token(result.logits),
        )
        if isinstance(drafter, _C.AutoDrafter):
            # What the scheduler chose each step, and its share of the time.
            candidates = auto_candidates(model, config)  # the drafter's children, in its order
            names = [registry.method_of(c).name for c in candidates]
            output.choices = [(names[i] if i >= 0 else "plain", t) for i, t, _ in drafter.choices()]
            output.timings["draft_s"] = drafter.draft_seconds
            output.timings["schedule_s"] = drafter.schedule_seconds
            output.timings["step_overhead_s"] = drafter.step_overhead
            carry_auto_measurements(model, candidates, drafter, do_sample)
        bank = config.resolved_bank if isinstance(config, (EntMTPConfig, HeadsConfig)) else None
        if bank is not None:
            output.choices = [
                (f"tree{i}", bank.block_size(i)) if i >= 0 else ("none", 1 + bank.num_masks)
                for i in drafter.tree_choices()
            ]
            if config.record_steps:
                output.topology_log = drafter.step_log()
        if logger.isEnabledFor(logging.INFO):
            stats = output.summary()
            logger.info(
                "mtprobe %s: %d new tokens in %d decode steps (tau %.3f), %d of %d drafted tokens accepted, "
                "%.1f tokens/s, stop: %s, KV capacity %d, mask columns %d, fallback steps %d%s",
                method,
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

    outputs, of_prompt = [], []
    for prompt in prompts:
        # The sequences of one prompt share its prefill: the first runs it, the others take copies.
        shared = SharedPrefill() if num_sequences > 1 else None
        for _ in range(num_sequences):
            outputs.append(decode_one(prompt, shared))
            of_prompt.append(prompt)
    if len(outputs) == 1:
        output = outputs[0]
        output.sequences = prompts[0].padded(output.sequences)  # [1, L + new], the padding as given
    else:
        output = _stack_outputs(outputs, of_prompt, _padding_id(generation_config))
    if not (mtprobe_return_output or generation_config.return_dict_in_generate):
        return output.sequences
    return output


def _check_input_ids(input_ids: object, model: PreTrainedModel | None = None) -> None:
    """A ``[batch, prompt_len]`` integer tensor of real token ids; with ``model``, ids within its vocabulary."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.LongTensor [batch, prompt_len], got {type(input_ids).__name__}"
        )
    if input_ids.device.type == "meta":
        raise ValueError(
            "input_ids is on the meta device: a meta tensor has a shape but no values, so there are no token "
            "ids to decode; pass the prompt's token ids as a real tensor (e.g. from the tokenizer) on the model's device"
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: pass at least one prompt, shape [batch >= 1, prompt_len]")
    if input_ids.shape[1] == 0:
        raise ValueError("input_ids is empty: the prompt needs at least one token")
    if input_ids.dtype not in (torch.long, torch.int32):
        raise TypeError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if model is not None:
        _check_token_range(input_ids, model)


def _check_generation_config(cfg: GenerationConfig, model_kwargs: dict[str, Any]) -> None:
    if (cfg.num_beams or 1) > 1:
        raise NotImplementedError(
            f"num_beams={cfg.num_beams}: mtprobe implements greedy decoding (num_beams=1)"
        )
    if (cfg.num_return_sequences or 1) > 1 and not cfg.do_sample:
        raise ValueError(
            f"num_return_sequences={cfg.num_return_sequences} with greedy decoding would return the same "
            "sequence that many times: pass do_sample=True for several different ones, or "
            "num_return_sequences=1"
        )
    for flag in ("output_attentions", "output_hidden_states"):
        if getattr(cfg, flag, False):
            raise NotImplementedError(f"{flag}=True is not supported by mtprobe")
    # generate() always prepares an (empty) cache; only one the user passed in is refused.
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # renamed in transformers 5.2x
    if cache is not None and (getattr(cache, "_is_user_defined", False) or cache.get_seq_length() > 0):
        raise NotImplementedError(
            "mtprobe manages its own KV cache; do not pass past_key_values (or cache): call without it, "
            "with the whole sequence as input_ids"
        )
    # model.generate has already refused a max_new_tokens it cannot compare with 0 (a str, ...); a float or
    # a bool gets through it and would be truncated or read as 1.
    for name in ("max_new_tokens", "max_length"):
        value = getattr(cfg, name, None)
        if value is not None:
            _check_max_new_tokens(value, name)
    # The attention mask is checked against input_ids by _check_attention_mask.


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a batch: its tokens without the left padding, and that padding as given."""

    ids: torch.Tensor  # [1, L_b]
    padding: torch.Tensor  # [1, L - L_b]

    def padded(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` ``[n, L_b + t]`` (rows of this prompt and what follows it) after the padding: ``[n, L + t]``."""
        if self.padding.shape[1] == 0:
            return ids
        return torch.cat([self.padding.to(ids.device).expand(ids.shape[0], -1), ids], dim=1)


def _prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor | None, count: int) -> list[_Prompt]:
    """The prompts of HF's batch ``[batch * count, L]``, which repeated each row ``count`` times for
    ``num_return_sequences``, each without its left padding (the mask is checked already)."""
    if input_ids.shape[0] % count:
        raise ValueError(
            f"input_ids has {input_ids.shape[0]} rows, not a multiple of num_return_sequences={count}: "
            "transformers' generate repeats each prompt that many times before mtprobe decodes them"
        )
    prompts = []
    for row in range(0, input_ids.shape[0], count):
        group = input_ids[row : row + count]  # [count, L]
        if not bool((group == group[:1]).all()):
            raise ValueError(
                f"rows {row}..{row + count - 1} of input_ids should be copies of one prompt (transformers' generate "
                f"repeats each prompt num_return_sequences={count} times): call model.generate with the prompts, "
                "not with copies of them"
            )
        start = 0 if attention_mask is None else int((attention_mask[row] == 0).sum())
        prompts.append(
            _Prompt(ids=input_ids[row : row + 1, start:], padding=input_ids[row : row + 1, :start])
        )
    return prompts


def _padding_id(cfg: GenerationConfig) -> int | None:
    """The id that fills the tail of a sequence that stopped before the longest, as HF's generate does."""
    pad = getattr(cfg, "_pad_token_tensor", None)
    if pad is None:
        pad = cfg.pad_token_id
    if pad is None:
        pad = getattr(cfg, "_eos_token_tensor", None)
        if pad is None:
            pad = cfg.eos_token_id
    if pad is None:
        return None
    return int(torch.as_tensor(pad).flatten()[0])


def _stack_outputs(
    outputs: list[GenerateOutput], prompts: list[_Prompt], pad_id: int | None
) -> GenerateOutput:
    """One output for several sequences (a batch of prompts, ``num_return_sequences``): ``sequences``
    ``[n, L + longest]``, each after the left padding of its prompt (``prompts[i]``) as HF's batched
    generate returns it, the shorter ones padded with ``pad_id`` after their end; the counts and timings
    summed over the sequences, the per-step lists concatenated in order (so ``tau`` is over every step),
    each one's own output in ``sequence_outputs``."""
    padded = [p.padded(o.sequences) for o, p in zip(outputs, prompts, strict=True)]  # [1, L + new_i] each
    longest = max(x.shape[1] for x in padded)
    if pad_id is None and any(x.shape[1] < longest for x in padded):
        raise ValueError(
            "the returned sequences have different lengths and the generation config has neither "
            "pad_token_id nor eos_token_id to pad the shorter ones with: pass pad_token_id"
        )
    rows = [torch.nn.functional.pad(x, (0, longest - x.shape[1]), value=pad_id or 0) for x in padded]

    def summed(lists: list[list[int]]) -> list[int]:
        total = [0] * max((len(x) for x in lists), default=0)
        for x in lists:
            for i, v in enumerate(x):
                total[i] += v
        return total

    timings: dict[str, float] = {}
    for o in outputs:
        for key, value in o.timings.items():
            timings[key] = timings.get(key, 0.0) + value
    reasons = sorted({o.stop_reason for o in outputs})
    first = outputs[0]
    return GenerateOutput(
        sequences=torch.cat(rows),  # [n, prompt + longest]
        accept_lengths=[a for o in outputs for a in o.accept_lengths],
        forward_calls=sum(o.forward_calls for o in outputs),
        timings=timings,
        stop_reason=",".join(reasons),
        fallback_steps=sum(o.fallback_steps for o in outputs),
        kv_capacity=max(o.kv_capacity for o in outputs),
        method=first.method,
        do_sample=first.do_sample,
        new_tokens=sum(o.new_tokens for o in outputs),
        drafted_per_depth=summed([o.drafted_per_depth for o in outputs]),
        accepted_per_depth=summed([o.accepted_per_depth for o in outputs]),
        block_sizes=[t for o in outputs for t in o.block_sizes],
        choices=None if first.choices is None else [c for o in outputs for c in o.choices or []],
        linear_routes=first.linear_routes,
        plan=first.plan,
        host_reads=sum(o.host_reads for o in outputs),
        scores=_stacked_rows([o.scores for o in outputs]),
        logits=_stacked_rows([o.logits for o in outputs]),
        sequence_outputs=tuple(outputs),
    )


def _per_token(rows: torch.Tensor | None) -> tuple[torch.Tensor, ...] | None:
    """``[new, vocab]`` (the loop's kept rows) as HF returns them: one ``[1, vocab]`` tensor per new token."""
    return None if rows is None else tuple(rows.split(1))


def _stacked_rows(per_sequence: list[tuple[torch.Tensor, ...] | None]) -> tuple[torch.Tensor, ...] | None:
    """Each sequence's per-token ``[1, vocab]`` rows as HF's batched output: one ``[sequences, vocab]``
    tensor per new token of the longest, zeros where a sequence had ended."""
    if any(rows is None for rows in per_sequence):
        return None
    steps = max(len(rows) for rows in per_sequence)
    zeros = torch.zeros_like(per_sequence[0][0])  # [1, vocab]
    return tuple(
        torch.cat([rows[t] if t < len(rows) else zeros for rows in per_sequence]) for t in range(steps)
    )


def _split_stopping_criteria(
    criteria: StoppingCriteriaList, cfg: GenerationConfig
) -> tuple[int, list[int], StoppingCriteriaList]:
    """Length and EOS are checked natively in C++; anything else is called from the loop."""
    max_length = cfg.max_length
    eos: list[int] = []
    others = StoppingCriteriaList()
    for c in criteria:
        if isinstance(c, MaxLengthCriteria):
            max_length = min(max_length, c.max_length) if max_length is not None else c.max_length
        elif isinstance(c, EosTokenCriteria):
            eos += [int(t) for t in torch.as_tensor(c.eos_token_id).flatten().tolist()]
        else:
            others.append(c)
    return int(max_length), sorted(set(eos)), others


def _check_sliding_window(model: PreTrainedModel, total_len: int) -> None:
    """Sliding-window layers are honoured by the adapter's tree mask (``adapter.sliding_mask``); only
    mtprobe's own tree attention, which takes ancestor bits and no window, must stay inside it."""
    sw = sliding_window(model)  # raises NotImplementedError for chunked / linear attention layers
    if sw is None or total_len <= sw.window:
        return
    if getattr(model.config, "_attn_implementation", None) == TREE_ATTENTION:
        raise NotImplementedError(
            f"sequence of {total_len} tokens exceeds the model's sliding window ({sw.window}) and the model runs "
            f"the {TREE_ATTENTION!r} attention, which takes the tree as ancestor bits and cannot apply a window; "
            "load it with attn_implementation='sdpa' or 'eager' (both honour the window), or keep prompt + "
            f"max_new_tokens <= {sw.window}"
        )


def _hf_caller_locals() -> dict[str, Any]:
    """The local variables of transformers' ``generate`` when it called ``custom_generate`` (else {}).

    transformers 5.x hands a callable custom_generate only its own extra kwargs, dropping
    generate()'s ``streamer`` (after putting the prompt into it) and ``assistant_model``; its frame
    still holds them, and ``kwargs``: the call's generation arguments as the caller passed them.
    """
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    if caller is not None and caller.f_code.co_name == "generate":
        return dict(caller.f_locals)
    return {}


def _call_arguments(caller: dict[str, Any]) -> dict[str, Any]:
    """generate()'s named arguments and keyword arguments as its caller passed them."""
    kwargs = caller.get("kwargs")
    args = dict(kwargs) if isinstance(kwargs, dict) else {}
    for name in ("negative_prompt_ids", "negative_prompt_attention_mask", "assistant_model"):
        if caller.get(name) is not None:
            args[name] = caller[name]
    return args


def decoding_mode(generation_config: GenerationConfig) -> str:
    """``"sample"`` or ``"greedy"``: what a generation with this (merged) generation config does.

    transformers' rule (``GenerationConfig.get_generation_mode``): sampling exactly when
    ``do_sample is True``; ``None`` and ``False`` decode greedily.
    """
    return "sample" if generation_config.do_sample is True else "greedy"


def _log_decoding_mode(
    model: PreTrainedModel, generation_config: GenerationConfig, caller: dict[str, Any]
) -> None:
    """INFO when sampling comes from the model's generation_config rather than from the call."""
    if decoding_mode(generation_config) != "sample":
        return
    call = _call_arguments(caller)
    model_samples = getattr(getattr(model, "generation_config", None), "do_sample", None) is True
    if model_samples and "do_sample" not in call:
        logger.info(
            "sampling (do_sample=True) because %s's generation_config says do_sample=True, as model.generate does "
            "with it; the output is a sample, not the greedy text. Pass do_sample=False for greedy decoding "
            "(token-identical to model.generate(do_sample=False))",
            type(model).__name__,
        )


def _apply_processors(
    processors: LogitsProcessorList, ids: torch.Tensor, scores: torch.Tensor
) -> torch.Tensor:
    """HF's processors one by one, as ``LogitsProcessorList`` chains them, with each result checked:
    a processor that returns None or another shape is named instead of failing deep in the loop."""
    for proc in processors:
        out = proc(ids, scores)
        if not isinstance(out, torch.Tensor) or out.shape != scores.shape:
            got = (
                type(out).__name__
                if not isinstance(out, torch.Tensor)
                else f"a tensor of shape {tuple(out.shape)}"
            )
            raise TypeError(
                f"logits processor {type(proc).__name__} returned {got}; a logits processor must return the "
                f"processed scores, a tensor of shape {tuple(scores.shape)} like the scores it was given"
            )
        scores = out
    return scores


def _check_no_inputs_embeds(kwargs: dict[str, Any]) -> None:
    """mtprobe decodes from token ids: its drafters read them and it embeds every input itself."""
    if kwargs.get("inputs_embeds") is not None:
        raise NotImplementedError(
            "inputs_embeds is not supported: mtprobe needs the prompt as token ids (its drafters read the tokens "
            "and it embeds every input itself); pass input_ids instead of inputs_embeds"
        )


def _check_token_range(input_ids: torch.Tensor, model: PreTrainedModel) -> None:
    """Every id in [0, vocab), vocab = rows of the model's input embedding (what the embedding can look up)."""
    embed = model.get_input_embeddings()
    weight = getattr(embed, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return
    vocab = weight.shape[0]
    bad = (input_ids < 0) | (input_ids >= vocab)
    if bool(bad.any()):
        row, pos = (int(i) for i in bad.nonzero()[0])
        where = f"position {pos}" if input_ids.shape[0] == 1 else f"row {row}, position {pos}"
        raise ValueError(
            f"input_ids holds token id {int(input_ids[row, pos])} at {where}, outside the model's vocabulary: "
            f"token ids must be in [0, {vocab}) ({type(model).__name__}'s input embedding has {vocab} rows); "
            "encode the prompt with this model's own tokenizer"
        )


def _check_attention_mask(mask: object, input_ids: torch.Tensor, mask_length: int | None = None) -> None:
    """An attention mask of input_ids' shape ``[batch, prompt_len]``, of ones and zeros, with padding only on
    the left of each row (a batch padded with ``tokenizer.padding_side = "left"``, as transformers pads for
    generation) and at least one real token per row.

    ``mask_length``: the length of an all-ones mask that HF's generate has already dropped (it keeps
    ``generation_config._mask_length``); checked against the prompt the same way.
    """
    shape = tuple(input_ids.shape)
    if mask is None:
        if mask_length is not None and mask_length != shape[1]:
            raise ValueError(
                f"attention_mask has length {mask_length} but input_ids has {shape[1]} tokens: the mask must "
                f"have input_ids' shape {shape} (one entry per prompt token); pass attention_mask=torch.ones_like(input_ids)"
            )
        return
    if not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"attention_mask must be a torch.Tensor of input_ids' shape {shape}, got {type(mask).__name__}"
        )
    if tuple(mask.shape) != shape:
        raise ValueError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids has shape {shape}: the mask must have "
            "input_ids' shape (one entry per prompt token); pass attention_mask=torch.ones_like(input_ids)"
        )
    if mask.device.type == "meta":
        raise ValueError(
            "attention_mask is on the meta device (a shape without values); pass a real tensor, "
            "e.g. attention_mask=torch.ones_like(input_ids)"
        )
    real = mask == 1  # [batch, prompt_len]
    if not bool((real | (mask == 0)).all()):
        value = mask[~(real | (mask == 0))][0].item()
        raise ValueError(
            f"attention_mask holds {value!r}: an attention mask marks each prompt token 1 (a real token) or 0 "
            "(padding), as the tokenizer returns it"
        )
    for row in range(shape[0]):
        tokens = real[row].nonzero()  # [real, 1]
        if tokens.numel() == 0:
            raise ValueError(
                f"attention_mask marks every token of row {row} as padding: each prompt needs at least one real "
                "token to continue from"
            )
        first, last = int(tokens[0, 0]), int(tokens[-1, 0])
        if last - first + 1 == tokens.shape[0] and last == shape[1] - 1:
            continue  # left padding (or none): the real tokens run to the end
        gap = int((~real[row, first:]).nonzero()[0, 0]) + first
        where = f"row {row}, position {gap}" if shape[0] > 1 else f"position {gap}"
        if last - first + 1 == tokens.shape[0]:
            raise NotImplementedError(
                f"attention_mask marks padding after the prompt ({where} on): right padding, which mtprobe does not "
                "support, since each prompt continues from its last token. Pad a batch on the left "
                "(tokenizer.padding_side = 'left', as transformers recommends for generation)"
            )
        raise NotImplementedError(
            f"attention_mask marks a prompt token as padding between real ones ({where}), which mtprobe does not "
            "support (padding is taken on the left of a row only). transformers infers such a mask when the "
            "prompt contains pad_token_id and it differs from eos_token_id; pass attention_mask=torch.ones_like("
            "input_ids) for an unpadded prompt"
        )


def _check_max_new_tokens(value: object, name: str = "max_new_tokens") -> int:
    """``value`` as a Python int >= 1. Python, numpy and 0-d torch integers pass; bool (an int to Python,
    but never a token count), float, str and tensors of another kind are refused."""
    is_bool = isinstance(value, bool) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool)
    is_multi = isinstance(value, torch.Tensor) and value.dim() != 0
    try:
        if is_bool or is_multi:
            raise TypeError
        n = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be an int >= 1 (a number of tokens), got {value!r} of type {type(value).__name__}"
        ) from None
    if n < 1:
        raise ValueError(f"{name}={n} must be >= 1 (a number of tokens)")
    return n


def _check_draft_context(
    model: PreTrainedModel, config: object, prompt_len: int, max_new_tokens: int
) -> None:
    """A user's draft model must have the positions this generation reaches (the layer-truncated
    self-draft has the target's own context); the target's were checked before."""
    if not isinstance(config, DraftModelConfig) or config.draft_model is None:
        return
    check_draft_model(model, config.draft_model, prompt_len=prompt_len, max_new_tokens=max_new_tokens)
