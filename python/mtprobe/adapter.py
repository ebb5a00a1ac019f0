"""The HuggingFace adapter: how the C++ loop reaches a transformers 5.x causal LM.

One call per decode step: token inputs are embedded with the model's own input embeddings,
embedding-only inputs (mask tokens) are appended, and the model runs on ``inputs_embeds`` with
explicit ``position_ids`` and a 4D additive float mask (0 / finfo(dtype).min; a boolean mask is
silently wrong on the eager path), writing into a preallocated ``TreeKVCache``. Logits come back
for every input (the model's own ``logits_to_keep`` default of 0 keeps them all).
"""

from __future__ import annotations

import torch
from transformers import GenerationMixin, PreTrainedModel

from mtprobe.cache import TreeKVCache


def check_causal_lm(model: object) -> None:
    """Raise a clear TypeError unless ``model`` is a decoder-only HF model that can generate."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(
            f"mtprobe needs a transformers PreTrainedModel causal LM (e.g. AutoModelForCausalLM), "
            f"got {type(model).__name__}"
        )
    if getattr(model.config, "is_encoder_decoder", False):
        raise TypeError(
            f"{type(model).__name__} is an encoder-decoder model; mtprobe decodes decoder-only causal LMs"
        )
    if not isinstance(model, GenerationMixin) or model.get_output_embeddings() is None:
        raise TypeError(
            f"{type(model).__name__} has no language-modelling head; load the model with "
            "AutoModelForCausalLM so it returns next-token logits"
        )


def max_positions(model: PreTrainedModel) -> int:
    """The model's context limit in positions (absolute-position models fail beyond it)."""
    cfg = model.config.get_text_config(decoder=True)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2**31 - 1


class HFAdapter:
    """Runs one draft block through ``model``; owns the model's KV cache for one sequence."""

    def __init__(self, model: PreTrainedModel, capacity: int) -> None:
        check_causal_lm(model)
        self.model = model
        self.embed = model.get_input_embeddings()
        num_layers = model.config.get_text_config(decoder=True).num_hidden_layers
        self.cache = TreeKVCache(num_layers, capacity)

    def forward(
        self,
        tokens: torch.Tensor,  # [n_tok] int64
        embeds: torch.Tensor | None,  # [n_emb, hidden]
        position_ids: torch.Tensor,  # [1, T]
        mask: torch.Tensor | None,  # [1, 1, T, P + T] additive, None for a causal chain
        prefix_len: int,
        want_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
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
