"""The checks a user's draft model passes before it drafts for a target (``DraftModelConfig(draft_model=...)``):
the same vocabulary and special tokens, the same device, and a context as long as the generation's. The
self-drafts (:mod:`mtprobe.target_model.self_draft`) are the target's twins and pass by construction."""

from __future__ import annotations

from transformers import PreTrainedModel

from mtprobe.target_model.adapter import check_causal_lm, max_positions


def check_draft_model(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    *,
    prompt_len: int | None = None,
    max_new_tokens: int | None = None,
) -> None:
    """Raise when ``draft`` cannot draft for ``target``: another vocabulary, other special tokens,
    another device or, given ``prompt_len`` and ``max_new_tokens``, a context shorter than the
    generation reaches. (Token ids are compared; a tokenizer with the same size and special tokens
    but other merges cannot be detected from the models alone.)

    The draft's positions stay below ``prompt_len + max_new_tokens``: the C++ drafter drafts no
    further than the tokens still wanted (``csrc/drafters/draft_model.cpp``), so its context needs
    what the target's does and no more.
    """
    check_causal_lm(draft)
    v_t = target.get_output_embeddings().weight.shape[0]
    v_d = draft.get_output_embeddings().weight.shape[0]
    if v_t != v_d:
        raise ValueError(
            f"the draft model's vocabulary has {v_d} tokens but the target's has {v_t}; a draft model must use "
            "the target's tokenizer (the same vocabulary)"
        )
    t_cfg, d_cfg = target.config.get_text_config(decoder=True), draft.config.get_text_config(decoder=True)
    for name in ("bos_token_id", "eos_token_id"):
        a, b = getattr(t_cfg, name, None), getattr(d_cfg, name, None)
        if a is not None and b is not None and a != b:
            raise ValueError(
                f"the draft model's {name} is {b} but the target's is {a}: they use different tokenizers; a draft "
                "model must use the target's tokenizer"
            )
    if draft.device != target.device:
        raise ValueError(
            f"the draft model is on {draft.device} but the target is on {target.device}; move it with "
            f"draft.to({str(target.device)!r})"
        )
    if prompt_len is not None and max_new_tokens is not None:
        _check_draft_context(target, draft, prompt_len, max_new_tokens)


def _check_draft_context(
    target: PreTrainedModel, draft: PreTrainedModel, prompt_len: int, max_new_tokens: int
) -> None:
    needed = prompt_len + max_new_tokens
    context, target_context = max_positions(draft), max_positions(target)
    if needed <= context:
        return
    fix = (
        f"lower max_new_tokens to at most {context - prompt_len}"
        if context > prompt_len
        else f"shorten the prompt to at most {context - 1} tokens"
    )
    raise ValueError(
        f"the draft model's context is {context} positions, but this generation needs {needed}: prompt "
        f"({prompt_len} tokens) + max_new_tokens ({max_new_tokens}); the target's context is {target_context}. "
        f"A draft must hold every position the target reaches: {fix}, or use a draft model with a longer "
        "context (max_position_embeddings)"
    )
