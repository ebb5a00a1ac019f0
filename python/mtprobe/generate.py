"""Public entry points: ``mtprobe.generate`` and the HF route ``custom_generate``.

Both run through ``model.generate``'s own preparation (generation config, logits processors,
stopping criteria, special tokens), so mtprobe honours exactly what greedy ``generate`` honours;
the decoding itself is the C++ loop (csrc/decode/decode_loop.cpp).
"""

from __future__ import annotations

import inspect
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
    """

    sequences: torch.Tensor
    accept_lengths: list[int]
    forward_calls: int
    timings: dict[str, float] = field(default_factory=dict)
    stop_reason: str = ""

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
    _check_input_ids(input_ids)
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
    _check_input_ids(input_ids)
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
    capacity = prompt_len + max_new_tokens + config.block_complexity
    process = None
    if len(logits_processor) > 0:

        def process(ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            return logits_processor(ids, scores)

    do_sample = bool(generation_config.do_sample)
    drafter = make_drafter(model, config, capacity=capacity, do_sample=do_sample, process=process)
    adapter = HFAdapter(model, capacity)
    stop = None
    if other_criteria:

        def stop(ids: torch.Tensor) -> bool:
            return bool(other_criteria(ids.to(device), None).any())

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
    )
    result = loop.run(input_ids[0])
    if streamer is not None:
        streamer.end()
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
    )


def _check_input_ids(input_ids: object) -> None:
    if not isinstance(input_ids, torch.Tensor):
        raise TypeError(
            f"input_ids must be a torch.LongTensor [1, prompt_len], got {type(input_ids).__name__}"
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
    mask = model_kwargs.get("attention_mask")
    if mask is not None and not bool((mask == 1).all()):
        raise NotImplementedError(
            "attention_mask marks some prompt tokens as padding, which mtprobe does not support. transformers "
            "infers such a mask when the prompt contains pad_token_id and it differs from eos_token_id; pass "
            "attention_mask=torch.ones_like(input_ids) for an unpadded prompt"
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
