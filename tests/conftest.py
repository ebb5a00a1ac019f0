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
