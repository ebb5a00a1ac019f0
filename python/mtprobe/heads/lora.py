"""LoRA draft layers for circuit heads (seed 003, section 3.3 and App. D).

A head with ``lora_layers = k`` does not read the backbone's last hidden state: the draft has its own
copy of the backbone's last k decoder layers, every linear map of them adapted by a low-rank update
``W x + (alpha / rank) B A x`` (A ``[rank, in]``, B ``[out, rank]``, B zero at first, so an untrained
adapter reproduces the backbone exactly), and the head reads the draft's final-normed state. The base
weights are the backbone's own tensors, shared, frozen and never saved with the head.

Decoding stays one backbone call per step: the verifier's forward computes the shared first L - k
layers for every input; after verification, the draft layers run over the newly committed tokens
only (the block's committed chain and the accepted drafts), from their input to layer L - k, with a
KV cache of their own, so they never see a speculative token and cost about k / L of a forward over
the accepted tokens. Training runs them over whole training sequences (causal, no cache).

>>> import torch
>>> from transformers import LlamaConfig, LlamaForCausalLM
>>> model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
...     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)).eval()
>>> draft = DraftLayers(model, num_layers=2, rank=4)
>>> ids = torch.tensor([[1, 5, 7, 2]])
>>> out = model(ids, output_hidden_states=True)
>>> h = draft(out.hidden_states[draft.first], torch.arange(4)[None])  # [1, 4, d]
>>> torch.allclose(h, out.hidden_states[-1], atol=1e-5)  # B = 0: the backbone's own last state
True
"""

from __future__ import annotations

import copy
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mtprobe.target_model.adapter import cache_argument
from mtprobe.target_model.sliding import sliding_window

# The linear maps of a Llama-style decoder layer that get an adapter (attention and MLP).
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraLinear(nn.Module):
    """``base(x) + (alpha / rank) B A x``; ``base`` is the backbone's layer, held but not registered (its
    weights stay the backbone's: frozen, not in this module's state dict)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self._base = [base]  # a list: not a submodule
        self.lora_a = nn.Parameter(
            torch.randn(rank, base.in_features) / math.sqrt(base.in_features)
        )  # [rank, in]
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))  # [out, rank]
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = F.linear(F.linear(x.float(), self.lora_a), self.lora_b)  # [..., out], float32
        return self._base[0](x) + (self.scale * delta).to(x.dtype)


def decoder_of(model: Any) -> Any:
    """The decoder stack of a Llama-style causal LM (``.layers``, ``.norm``, ``.rotary_emb``), or ValueError."""
    decoder = getattr(model, "model", None)
    missing = [a for a in ("layers", "norm", "rotary_emb") if not hasattr(decoder, a)]
    if not missing:
        rotary = inspect.signature(decoder.rotary_emb.forward).parameters
        if "position_embeddings" not in inspect.signature(decoder.layers[0].forward).parameters or any(
            p.default is inspect.Parameter.empty for n, p in rotary.items() if n not in ("x", "position_ids")
        ):
            missing = ["one rotary embedding (x, position_ids) shared by every layer"]
        elif sliding_window(model) is not None:
            missing = ["full causal attention in every layer (it has a sliding window)"]
    if decoder is None or missing:
        raise ValueError(
            f"LoRA draft layers need a Llama-style decoder (model.model.layers, .norm and .rotary_emb); "
            f"{type(model).__name__} lacks {', '.join(missing) or 'model.model'}. Use lora_layers=0 (the "
            "backbone's last hidden state) for this model"
        )
    return decoder


class DraftLayers(nn.Module):
    """The draft's adapted copies of ``model``'s last ``num_layers`` decoder layers and its final norm.

    Attributes:
        first: the index of the first adapted layer, L - k; its input is ``hidden_states[first]`` of
            an HF forward with ``output_hidden_states=True`` (index 0 is the embeddings).
    """

    def __init__(self, model: Any, num_layers: int, rank: int, alpha: float | None = None) -> None:
        super().__init__()
        decoder = decoder_of(model)
        total = len(decoder.layers)
        if not 1 <= num_layers <= total:
            raise ValueError(f"lora_layers={num_layers} must be between 1 and the model's {total} layers")
        if rank < 1:
            raise ValueError(f"lora_rank={rank} must be >= 1")
        self.first = total - num_layers
        alpha = float(2 * rank if alpha is None else alpha)
        layers = []
        for i in range(num_layers):
            original = decoder.layers[self.first + i]
            layer = copy.deepcopy(original)
            for name, module in original.named_modules():
                if name.rsplit(".", 1)[-1] in TARGETS and isinstance(module, nn.Linear):
                    parent, _, leaf = name.rpartition(".")
                    setattr(layer.get_submodule(parent), leaf, LoraLinear(module, rank, alpha))
            attn = layer.self_attn
            attn.layer_idx = i  # its slot in the draft's own cache
            # Plain SDPA over an explicit causal mask: the backbone may run a tree-attention kernel
            # that expects mtprobe's KV cache, which the draft does not use.
            attn.config = copy.copy(attn.config)
            attn.config._attn_implementation = "sdpa"
            for pname, p in layer.named_parameters():
                p.requires_grad_("lora_" in pname)
            layers.append(layer)
        self.layers = nn.ModuleList(layers)
        self.norm = copy.deepcopy(decoder.norm).requires_grad_(False)
        self._rotary = [decoder.rotary_emb]  # shared, not a submodule
        self._cache_arg = cache_argument(self.layers[0])  # the decoder layers' name for their KV cache

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, d] the input of layer L - k
        position_ids: torch.Tensor,  # [B, T]
        cache: Any = None,  # a transformers Cache of the draft's own k layers, or None (no cache)
    ) -> torch.Tensor:
        """The draft's final-normed hidden states ``[B, T, d]``, in the layers' dtype; the cache, if
        any, grows by T."""
        hidden = hidden.to(self.norm.weight.dtype)  # an inference copy (merged) may run in another dtype
        past = 0 if cache is None else cache.get_seq_length()
        t = hidden.shape[1]
        keys = torch.arange(past + t, device=hidden.device)  # [P + T]
        queries = torch.arange(past, past + t, device=hidden.device)  # [T]
        mask = torch.zeros(t, past + t, dtype=hidden.dtype, device=hidden.device)  # [T, P + T] additive
        mask.masked_fill_(keys[None, :] > queries[:, None], torch.finfo(hidden.dtype).min)
        mask = mask[None, None]  # [1, 1, T, P + T]
        embeddings = self._rotary[0](hidden, position_ids)
        h = hidden
        for layer in self.layers:
            out = layer(
                h,
                attention_mask=mask,
                position_ids=position_ids,
                use_cache=cache is not None,
                **{self._cache_arg: cache},
                position_embeddings=embeddings,
            )
            h = out[0] if isinstance(out, tuple) else out
        return self.norm(h)

    def merged(self, dtype: torch.dtype | None = None) -> DraftLayers:
        """A frozen inference copy with every adapter folded into its layer: one ``nn.Linear`` of
        weight ``W + (alpha / rank) B A`` (summed in float32) instead of three products a step; its
        weights, norms and KV cache in ``dtype`` (default: the backbone's). Equal to this module up
        to rounding; it owns its weights (the backbone's are not shared), so it costs a copy of the k
        layers. A half-precision copy reads half the memory a step, which is most of a one-row
        forward's time on a CPU."""
        shared = {id(self._rotary[0]): self._rotary[0]}  # the backbone's modules stay shared, not copied
        for module in self.modules():
            if isinstance(module, LoraLinear):
                shared[id(module._base[0])] = module._base[0]
        out = copy.deepcopy(self, memo=shared)
        for layer, trained in zip(out.layers, self.layers, strict=True):
            for name, module in trained.named_modules():
                if not isinstance(module, LoraLinear):
                    continue
                base = module._base[0]
                with torch.no_grad():
                    weight = base.weight.float() + module.scale * (
                        module.lora_b.float() @ module.lora_a.float()
                    )
                # On the meta device: no random init, since both tensors are replaced just below.
                linear = nn.Linear(
                    base.in_features, base.out_features, bias=base.bias is not None, device="meta"
                )
                linear.weight = nn.Parameter(weight.to(dtype or base.weight.dtype), requires_grad=False)
                if base.bias is not None:
                    linear.bias = nn.Parameter(base.bias.detach().clone(), requires_grad=False)
                parent, _, leaf = name.rpartition(".")
                setattr(layer.get_submodule(parent), leaf, linear)
        out.requires_grad_(False)
        return out.to(dtype) if dtype is not None else out
