"""Shared fixtures: the real default model, loaded once per session."""

from __future__ import annotations

import pytest
import torch

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (Q4_1-dequantized, fp32), fetched by the set-up command."""
    from mtprobe import models

    model, tokenizer = models.load("smollm2-135m", dtype=torch.float32)
    return model, tokenizer


def chat_ids(tokenizer, messages: list[dict]) -> torch.Tensor:
    """Token ids [1, L] of a conversation under the model's chat template."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return enc if isinstance(enc, torch.Tensor) else enc["input_ids"]


def tiny_llama(seed: int = 0, **overrides):
    """A small randomly initialised LlamaForCausalLM (2 layers, hidden 64), eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    kwargs.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kwargs)).eval()
