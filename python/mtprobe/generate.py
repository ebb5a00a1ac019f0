"""Public entry points: ``mtprobe.generate`` and the HF route ``custom_generate``.

Both run through ``model.generate``'s own preparation (generation config, logits processors,
stopping criteria, special tokens), so mtprobe honours exactly what greedy ``generate`` honours;
the decoding itself is the C++ loop (csrc/decode/decode_loop.cpp).
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import GenerationConfig, LogitsProcessorList, PreTrainedModel, StoppingCriteriaList
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from mtprobe import _C
from mtprobe.adapter import HFAdapter, check_causal_lm, max_positions
from mtprobe.config import ProbeConfig
from mtprobe.drafters import DecodingConfig, check_decoding_config, make_drafter
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


@dataclass
class GenerateOutput:
    """What one mtprobe generation did.

    Attributes:
        sequences: ``[1, prompt + new]`` tokens, identical to greedy ``model.generate``.
        accept_lengths: tokens gained per decode forward (accepted drafts + bonus), one per step.
        forward_calls: target forwards, prefill included.
        timings: seconds: ``total_s`` (whole loop), ``forward_s`` (inside model forwards, prefill
            included), ``prefill_s``.
        stop_reason: ``"eos"``, ``"max_new_tokens"`` or ``"stopping_criteria"``.
        fallback_steps: decode steps whose drafts made the target's logits non-finite (NaN/inf)
            and that were re-run on the committed token alone, as plain decoding runs it.
        kv_capacity: KV entries per layer the cache held at the end: it grows with the tokens
            generated (doubling), not with ``max_new_tokens``.
    """

    sequences: torch.Tensor
    accept_lengths: list[int]
    forward_calls: int
    timings: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""
    fallback_steps: int = 0
    kv_capacity: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens gained per decode forward (τ)."""
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))


def generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    config: DecodingConfig | None = None,
    *,
    max_new_tokens: int | None = None,
    streamer: Any = None,
    **generate_kwargs: Any,
) -> GenerateOutput:
    """Lossless multi-token generation with the drafter ``config`` describes: ``ProbeConfig`` (mask-token
    probing, the default), ``PromptLookupConfig``, ``StandConfig``, ``LookaheadConfig``,
    ``HybridConfig`` or ``DraftModelConfig``.

    Greedy (the default): token-identical to ``model.generate(do_sample=False)``. With
    ``do_sample=True`` (and ``temperature``, ``top_k``, ``top_p``, ... as HF applies them), every
    tree node samples the target's processed distribution and verification accepts the child equal
    to the sample (a draft model's drafts go through rejection sampling against its own q instead),
    so the output is distributed exactly as ``model.generate(do_sample=True)``;
    seed with ``torch.manual_seed`` for repeatable text. ``generate_kwargs`` go to
    ``model.generate`` (eos_token_id, stopping_criteria, logits_processor, repetition_penalty,
    ...), which prepares them exactly as for its own decoding.
    """
    check_causal_lm(model)
    _check_no_inputs_embeds(generate_kwargs)
    _check_input_ids(input_ids, model)
    _check_attention_mask(generate_kwargs.get("attention_mask"), input_ids)
    if max_new_tokens is not None:
        max_new_tokens = _check_max_new_tokens(max_new_tokens)
    if streamer is not None:
        streamer.put(input_ids.cpu())  # HF puts the prompt first; this route bypasses that
    return model.generate(
        input_ids,
        custom_generate=custom_generate,
        mtprobe_config=config if config is not None else ProbeConfig(),
        mtprobe_return_output=True,
        mtprobe_streamer=streamer,
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
    mtprobe_config: DecodingConfig | None = None,
    mtprobe_return_output: bool = False,
    mtprobe_streamer: Any = None,
    **model_kwargs: Any,
) -> torch.Tensor | GenerateOutput:
    """The decoding method HF's ``generate`` calls when given ``custom_generate=mtprobe.custom_generate``.

    Returns the sequences tensor (as greedy ``generate`` does), or a ``GenerateOutput`` when
    ``return_dict_in_generate=True``.
    """
    config = mtprobe_config if mtprobe_config is not None else ProbeConfig()
    # The config first: beam search and num_return_sequences expand the batch before we see it.
    _check_generation_config(generation_config, model_kwargs)
    # What mtprobe.generate checks before calling model.generate, again for the HF route.
    check_causal_lm(model)
    _check_no_inputs_embeds(model_kwargs)
    _check_input_ids(input_ids, model)
    # HF drops an all-ones mask before this point and keeps only its length.
    _check_attention_mask(
        model_kwargs.get("attention_mask"), input_ids, getattr(generation_config, "_mask_length", None)
    )
    _check_draft_context(model, config, input_ids.shape[1], stopping_criteria, generation_config)
    if synced_gpus:
        raise NotImplementedError("mtprobe does not support synced_gpus (multi-GPU lockstep generation)")
    if streamer is None and mtprobe_streamer is None:
        streamer = _streamer_from_hf_caller()
    streamer = streamer if streamer is not None else mtprobe_streamer

    device = input_ids.device
    prompt_len = input_ids.shape[1]
    max_length, eos_ids, other_criteria = _split_stopping_criteria(stopping_criteria, generation_config)
    max_new_tokens = max_length - prompt_len
    if max_new_tokens < 1:
        raise ValueError(
            f"nothing to generate: max_length={max_length} leaves no room after a prompt of {prompt_len} tokens; "
            "pass max_new_tokens >= 1"
        )
    limit = max_positions(model)
    if prompt_len + max_new_tokens > limit:
        raise ValueError(
            f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {prompt_len + max_new_tokens} "
            f"exceeds the model's context of {limit} positions; shorten the prompt or lower max_new_tokens"
        )
    _check_sliding_window(model, prompt_len + max_new_tokens)

    check_decoding_config(config)
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
    max_capacity = prompt_len + max_new_tokens + config.block_complexity
    capacity = min(max_capacity, prompt_len + config.block_complexity + _INITIAL_HEADROOM)
    process = None
    if len(logits_processor) > 0:

        def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return _apply_processors(logits_processor, ids, scores)

    do_sample = bool(generation_config.do_sample)
    drafter = make_drafter(model, config, capacity=capacity, do_sample=do_sample, process=process)
    adapter = HFAdapter(model, capacity, max_capacity=max_capacity)
    stop = None
    if other_criteria:

        def stop(ids: torch.Tensor, scores: torch.Tensor) -> bool:
            # HF greedy hands criteria the processed scores the last token was chosen from.
            return bool(other_criteria(ids.to(device), scores.to(device)).any())

    stream = None
    if streamer is not None:

        def stream(tokens: torch.Tensor) -> None:
            streamer.put(tokens)

    loop = _C.DecodeLoop(
        drafter,
        adapter.forward,
        adapter.kv_buffers,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_ids,
        max_positions=limit,
        block_complexity=config.block_complexity,
        kv_capacity=capacity,
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
    )
    result = loop.run(input_ids[0])
    if streamer is not None:
        streamer.end()
    if result.fallback_steps:
        logger.warning(
            "%d decode step(s) produced non-finite target logits with drafts in the block and were re-run "
            "without them (the output is unaffected; the drafts or mask tokens overflow the model's dtype?)",
            result.fallback_steps,
        )
    sequences = torch.tensor(result.sequence, dtype=torch.long, device=device).unsqueeze(0)  # [1, L + new]
    if not (mtprobe_return_output or generation_config.return_dict_in_generate):
        return sequences
    return GenerateOutput(
        sequences=sequences,
        accept_lengths=list(result.accept_lengths),
        forward_calls=result.forward_calls,
        timings={
            "total_s": result.total_seconds,
            "forward_s": result.forward_seconds,
            "prefill_s": result.prefill_seconds,
        },
        stop_reason=result.stop_reason,
        fallback_steps=result.fallback_steps,
        kv_capacity=result.kv_capacity,
    )


def _check_input_ids(input_ids: object, model: PreTrainedModel | None = None) -> None:
    """A ``[1, prompt_len]`` integer tensor of real token ids; with ``model``, ids within its vocabulary."""
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.LongTensor [1, prompt_len], got {type(input_ids).__name__}"
        )
    if input_ids.device.type == "meta":
        raise ValueError(
            "input_ids is on the meta device: a meta tensor has a shape but no values, so there are no token "
            "ids to decode; pass the prompt's token ids as a real tensor (e.g. from the tokenizer) on the model's device"
        )
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be 2-D [batch, prompt_len], got shape {tuple(input_ids.shape)}")
    if input_ids.shape[0] != 1:
        raise NotImplementedError(
            f"input_ids has batch size {input_ids.shape[0]}; mtprobe decodes one sequence at a time "
            "(call it once per row)"
        )
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
    if (cfg.num_return_sequences or 1) > 1:
        raise NotImplementedError("num_return_sequences > 1 is not supported by greedy mtprobe decoding")
    for flag in ("output_scores", "output_logits", "output_attentions", "output_hidden_states"):
        if getattr(cfg, flag, False):
            raise NotImplementedError(f"{flag}=True is not supported by mtprobe")
    # generate() always prepares an (empty) cache; only one the user passed in is refused.
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (getattr(cache, "_is_user_defined", False) or cache.get_seq_length() > 0):
        raise NotImplementedError("mtprobe manages its own KV cache; do not pass past_key_values")
    # model.generate has already refused a max_new_tokens it cannot compare with 0 (a str, ...); a float or
    # a bool gets through it and would be truncated or read as 1.
    for name in ("max_new_tokens", "max_length"):
        value = getattr(cfg, name, None)
        if value is not None:
            _check_max_new_tokens(value, name)
    # The attention mask is checked against input_ids by _check_attention_mask.


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
    cfg = model.config.get_text_config(decoder=True)
    window = getattr(cfg, "sliding_window", None)
    if (
        isinstance(window, int)
        and window > 0
        and total_len > window
        and getattr(cfg, "use_sliding_window", True)
    ):
        raise NotImplementedError(
            f"sequence of {total_len} tokens exceeds the model's sliding window ({window}); mtprobe's tree mask "
            "does not apply sliding windows yet"
        )


def _streamer_from_hf_caller() -> Any:
    # transformers 5.x hands a callable custom_generate only its own extra kwargs, dropping the
    # `streamer` argument of generate() (it has already put the prompt into it). Recover it from
    # generate()'s frame so streaming still works on the HF route.
    frame = inspect.currentframe()
    caller = frame.f_back.f_back if frame is not None and frame.f_back is not None else None
    if caller is not None and caller.f_code.co_name == "generate":
        return caller.f_locals.get("streamer")
    return None


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
        pos = int(bad[0].nonzero()[0, 0])
        raise ValueError(
            f"input_ids holds token id {int(input_ids[0, pos])} at position {pos}, outside the model's vocabulary: "
            f"token ids must be in [0, {vocab}) ({type(model).__name__}'s input embedding has {vocab} rows); "
            "encode the prompt with this model's own tokenizer"
        )


def _check_attention_mask(mask: object, input_ids: torch.Tensor, mask_length: int | None = None) -> None:
    """An attention mask covers the prompt exactly ([1, prompt_len]) and marks no token as padding.

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
    if not bool((mask == 1).all()):
        raise NotImplementedError(
            "attention_mask marks some prompt tokens as padding, which mtprobe does not support. transformers "
            "infers such a mask when the prompt contains pad_token_id and it differs from eos_token_id; pass "
            "attention_mask=torch.ones_like(input_ids) for an unpadded prompt"
        )


def _check_max_new_tokens(value: object, name: str = "max_new_tokens") -> int:
    """``value`` as a Python int >= 1. Python, numpy and 0-d torch integers pass; bool (an int to Python,
    but never a token count), float, str and tensors of another kind are refused."""
    import operator

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
    model: PreTrainedModel,
    config: object,
    prompt_len: int,
    stopping_criteria: StoppingCriteriaList,
    generation_config: GenerationConfig,
) -> None:
    """A user's draft model must have the positions this generation reaches (the layer-truncated
    self-draft has the target's own context). Limits the target itself cannot meet are left to the
    target's check, which names them."""
    from mtprobe.config import DraftModelConfig
    from mtprobe.draft_model import check_draft_model

    if not isinstance(config, DraftModelConfig) or config.draft_model is None:
        return
    max_length = _split_stopping_criteria(stopping_criteria, generation_config)[0]
    max_new_tokens = max_length - prompt_len
    if max_new_tokens < 1 or max_length > max_positions(model):
        return
    check_draft_model(model, config.draft_model, prompt_len=prompt_len, max_new_tokens=max_new_tokens)
