"""GGUF to a Hugging Face folder: dequantize a GGUF file once with transformers' GGUF loader and save a
plain float32 model and its tokenizer, adding a known model's chat template and stop tokens where the
file lacks them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from mtprobe.models.specs import ModelSpec


def _convert(gguf_path: Path, out: Path, spec: ModelSpec | None = None) -> None:
    """Dequantize a GGUF file with transformers and save a plain (unquantized) HF folder to ``out``;
    ``spec``'s chat template and stop tokens are added where the file lacks them."""
    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    if spec is not None and spec.chat_template is not None and not getattr(tok, "chat_template", None):
        tok.chat_template = spec.chat_template
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, local_files_only=True
    )
    # The GGUF-loaded model is marked quantized, which makes save_pretrained refuse; rebuild a clean
    # model from the same config without the quantization marker and copy the dequantized weights in.
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=True)
    clean.generation_config = gguf_model.generation_config
    if spec is not None and spec.stop_tokens:
        eos = clean.generation_config.eos_token_id
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        for token in spec.stop_tokens:
            token_id = tok.convert_tokens_to_ids(token)
            if not isinstance(token_id, int) or token_id == tok.unk_token_id:
                raise ValueError(
                    f"stop token {token!r} of {spec.name!r} is not in the GGUF file's vocabulary"
                )
            eos += [token_id] if token_id not in eos else []
        clean.generation_config.eos_token_id = eos
    del gguf_model
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    # safetensors writes 0600 files; make the cache readable like any other file the user creates.
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)
