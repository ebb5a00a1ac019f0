"""The checks of a generation's inputs: each bad input is refused with what is wrong and what would be
right, before anything runs (docs/errors.md lists them)."""

from __future__ import annotations

import operator
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from mtprobe.target_model.sliding import sliding_window
from mtprobe.tree_attention import NAME as TREE_ATTENTION


def check_input_ids(input_ids: object, model: PreTrainedModel | None = None) -> None:
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
        check_token_range(input_ids, model)


def check_generation_config(cfg: GenerationConfig, model_kwargs: dict[str, Any]) -> None:
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
            check_max_new_tokens(value, name)
    # The attention mask is checked against input_ids by _check_attention_mask.


def check_sliding_window(model: PreTrainedModel, total_len: int) -> None:
    """Sliding-window layers are honoured by the adapter's tree mask (``sliding.sliding_mask``); only
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


def check_no_inputs_embeds(kwargs: dict[str, Any]) -> None:
    """mtprobe decodes from token ids: its drafters read them and it embeds every input itself."""
    if kwargs.get("inputs_embeds") is not None:
        raise NotImplementedError(
            "inputs_embeds is not supported: mtprobe needs the prompt as token ids (its drafters read the tokens "
            "and it embeds every input itself); pass input_ids instead of inputs_embeds"
        )


def check_token_range(input_ids: torch.Tensor, model: PreTrainedModel) -> None:
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


def check_attention_mask(mask: object, input_ids: torch.Tensor, mask_length: int | None = None) -> None:
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


def check_max_new_tokens(value: object, name: str = "max_new_tokens") -> int:
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
