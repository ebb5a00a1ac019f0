"""The HuggingFace adapter: how the C++ loop reaches a transformers 5.x causal LM.

One call per decode step: token inputs are embedded with the model's own input embeddings,
embedding-only inputs (mask tokens) are appended, and the model runs on ``inputs_embeds`` with
explicit ``position_ids`` and a 4D additive float mask (0 / finfo(dtype).min; a boolean mask is
silently wrong on the eager path), writing into a ``TreeKVCache`` that the adapter grows by
doubling when a block would not fit. Logits come back for every input (the model's own
``logits_to_keep`` default of 0 keeps them all).
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel

from mtprobe.cache import TreeKVCache


def check_causal_lm(model: object) -> None:
    """Raise a clear error unless ``model`` is a decoder-only HF model that can generate: a TypeError
    for another kind of model (not a PreTrainedModel, encoder-decoder, bidirectional, no LM head), a
    ValueError for a model whose weights are on the meta device (never loaded)."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"mtprobe needs a transformers PreTrainedModel causal LM (e.g. AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(f"{name} is an encoder-decoder model; mtprobe decodes decoder-only causal LMs")
    bidirectional = _bidirectional_attention(model)
    if bidirectional is not None:
        raise TypeError(
            f"{name} attends bidirectionally ({bidirectional}), so it is not a causal LM: its logits at a "
            "position depend on the tokens after it, and decoding with it is not next-token prediction. mtprobe "
            "needs a decoder-only causal LM (AutoModelForCausalLM; for BERT-like models, a *ForCausalLM / "
            "*LMHeadModel class with config.is_decoder=True)"
        )
    if not isinstance(model, GenerationMixin) or model.get_output_embeddings() is None:
        raise TypeError(
            f"{name} has no language-modelling head; load the model with "
            "AutoModelForCausalLM so it returns next-token logits"
        )
    meta = _first_meta_tensor(model)
    if meta is not None:
        raise ValueError(
            f"{name} has tensors on the meta device (the first: {meta!r}): they have shapes but no values, so "
            "the model cannot run. It was built with device='meta' (or init_empty_weights) and its weights were "
            "never loaded; load them (from_pretrained, or to_empty(device=...) and load_state_dict) first"
        )


def _first_meta_tensor(model: PreTrainedModel) -> str | None:
    """The name of the first parameter or buffer on the meta device, or None. Tensors of modules that
    accelerate offloads (a module or an ancestor with an ``_hf_hook``) are meta on purpose, loaded by the
    hook at every forward, and are not counted."""
    hooked = [name for name, module in model.named_modules() if hasattr(module, "_hf_hook")]
    if "" in hooked:
        return None
    for name, tensor in (*model.named_parameters(), *model.named_buffers()):
        if tensor.device.type == "meta" and not any(name.startswith(h + ".") for h in hooked):
            return name
    return None


def _bidirectional_attention(model: PreTrainedModel) -> str | None:
    """Why ``model`` attends bidirectionally (the config setting that says so), or None for a causal model.

    transformers marks it three ways: ``config.is_causal = False`` (e.g. Gemma 4 with
    ``use_bidirectional_attention="all"``), ``use_bidirectional_attention`` (Gemma-family encoders such
    as EmbeddingGemma), and ``is_decoder=False`` in the BERT family (BertForMaskedLM, or BertLMHeadModel,
    RobertaForCausalLM, ... without ``is_decoder=True``). GPT-NeoX also carries ``is_decoder=False`` but its
    attention is always causal (its attention modules say ``is_causal = True``), so for ``is_decoder``
    the attention modules decide.
    """
    cfg = model.config.get_text_config(decoder=True)
    if getattr(cfg, "is_causal", None) is False:
        return "config.is_causal=False"
    both = getattr(cfg, "use_bidirectional_attention", None)
    if both is True or both == "all":
        return f"config.use_bidirectional_attention={both!r}"
    if getattr(cfg, "is_decoder", None) is False and not any(
        getattr(m, "is_causal", None) is True for m in model.modules()
    ):
        return "config.is_decoder=False"
    return None


def max_positions(model: PreTrainedModel) -> int:
    """The model's context limit in positions (absolute-position models fail beyond it)."""
    cfg = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**31 - 1


class HFAdapter:
    """Runs one draft block through ``model``; owns the model's KV cache for one sequence.

    ``capacity`` is the cache's first size in entries; it doubles whenever a block would not fit,
    never past ``max_capacity`` (the most one generation can need) unless a block needs more.
    """

    def __init__(self, model: PreTrainedModel, capacity: int, max_capacity: int | None = None) -> None:
        check_causal_lm(model)
        self.model = model
        self.embed = model.get_input_embeddings()
        num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache = TreeKVCache(num_layers, capacity)
        self.max_capacity = max_capacity

    def reserve(self, needed: int) -> None:
        """Room for ``needed`` entries: double the cache (amortised O(1) copy per token)."""
        capacity = self.cache.capacity
        if needed <= capacity:
            return
        grown = max(needed, 2 * capacity)
        if self.max_capacity is not None:
            grown = max(needed, min(grown, self.max_capacity))
        self.cache.reserve(grown)

    def forward(
        self,
        tokens: torch.Tensor,  # [n_tok] int64
        embeds: torch.Tensor | None,  # [n_emb, hidden]
        position_ids: torch.Tensor,  # [1, T]
        mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
        prefix_len: int,
        want_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self.reserve(prefix_len + position_ids.shape[-1])
        self.cache.set_length(prefix_len)
        x = self.embed(tokens.unsqueeze(0))  # [1, n_tok, hidden]
        if embeds is not None:
            x = torch.cat([x, embeds.unsqueeze(0).to(x.dtype)], dim=1)  # [1, T, hidden]
        out = self.model(
            inputs_embeds=x,
            attention_mask=mask,
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            output_hidden_states=want_hidden,
            return_dict=True,
        )
        hidden = out.hidden_states[-1][0] if want_hidden else None  # [T, hidden]
        return out.logits[0], hidden  # [T, vocab]

    def kv_buffers(self) -> list[torch.Tensor]:
        return self.cache.buffers()
