"""A small byte-level causal LM trained by the project: the stand-in for EvaByte in seed 003's own regime
(circuit heads over n = 8 and 16 future bytes).

Every token is one byte of UTF-8 (ids 0..255 are the byte values, 256 is ``<|endoftext|>``), read by a
real Hugging Face tokenizer (:func:`byte_tokenizer`, a ``PreTrainedTokenizerFast`` with a byte-level BPE
model and no merges) and modelled by a real ``LlamaForCausalLM`` of a few million parameters
(:func:`byte_lm_config`). :func:`train_byte_lm` fits it to local text files by next-byte cross-entropy
(AdamW, cosine decay, minutes on a 2-core CPU); the last ``holdout`` of every file's bytes is kept out
of training and reported in bits per byte. The folder :func:`save_byte_lm` writes is an ordinary Hugging
Face model folder, so :func:`mtprobe.models.load` and everything in mtprobe take it by path::

    python -m mtprobe bytelm train --text /usr/share/games/fortunes/* --out bytelm --steps 1500
    python -m mtprobe heads train --model bytelm --circuit btree --window 8 --rank 4 \\
        --emission unembedding --text /usr/share/games/fortunes/* --no-self --out heads/btree-n8

It is a base model: its chat template writes each message's text followed by a newline, so a
"conversation" is a text for it to continue.

>>> tok = byte_tokenizer()
>>> tok("é!").input_ids  # the two UTF-8 bytes of é, then '!'
[195, 169, 33]
>>> tok.decode([195, 169, 33])
'é!'
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import BPE
from tqdm.auto import tqdm
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mtprobe.data import split_passages

__all__ = [
    "CHAT_TEMPLATE",
    "EOS",
    "VOCAB_SIZE",
    "byte_lm_config",
    "byte_tokenizer",
    "corpus_bytes",
    "passage_prompts",
    "save_byte_lm",
    "train_byte_lm",
]

EOS = "<|endoftext|>"
VOCAB_SIZE = 257  # 256 bytes + EOS
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }}\n{% endfor %}"
INFO_FILE = "mtprobe-bytelm.json"


def _byte_chars() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map, the alphabet of the ByteLevel pre-tokenizer."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer() -> Any:
    """The byte tokenizer: token id = byte value, ``<|endoftext|>`` = 256 (EOS, BOS and pad); no special
    token is added when encoding, so a prompt is exactly its bytes."""
    vocab = {c: b for b, c in _byte_chars().items()}
    vocab[EOS] = 256
    core = Tokenizer(BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, bos_token=EOS, pad_token=EOS)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def byte_lm_config(
    *, hidden_size: int = 256, num_layers: int = 4, num_heads: int = 4, max_positions: int = 2048
) -> Any:
    """A ``LlamaConfig`` for a byte LM: SwiGLU MLP of 3 x hidden, tied embeddings, RoPE."""
    for name, v in (("hidden_size", hidden_size), ("num_layers", num_layers), ("num_heads", num_heads)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if hidden_size % num_heads or (hidden_size // num_heads) % 2:
        raise ValueError(
            f"hidden_size={hidden_size} must be num_heads={num_heads} times an even head size (RoPE rotates pairs)"
        )
    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=hidden_size,
        intermediate_size=3 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=256,
        eos_token_id=256,
        pad_token_id=256,
    )


def corpus_bytes(
    paths: Sequence[str | os.PathLike[str]], holdout: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(train [N], held out [M]) uint8: each file's bytes, the last ``holdout`` of each held out."""
    if not paths:
        raise ValueError(
            "no text files given: pass local text files to train on (e.g. /usr/share/games/fortunes/*)"
        )
    if not 0.0 <= holdout < 1.0:
        raise ValueError(f"holdout={holdout} must be in [0, 1)")
    train, held = [], []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise ValueError(f"text file {str(path)!r} does not exist or is not a file")
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        cut = data.numel() - int(holdout * data.numel())
        train.append(data[:cut])
        held.append(data[cut:])
    train_t, held_t = torch.cat(train), torch.cat(held)
    if train_t.numel() < 2:
        raise ValueError(
            f"the text files {[str(p) for p in paths]} hold {train_t.numel()} training bytes; need >= 2"
        )
    return train_t, held_t


def _batch(data: torch.Tensor, seq_len: int, batch_size: int, g: torch.Generator) -> torch.Tensor:
    """``[batch_size, seq_len + 1]`` random windows of ``data`` (int64)."""
    start = torch.randint(data.numel() - seq_len, (batch_size,), generator=g)
    return data[start[:, None] + torch.arange(seq_len + 1)].long()


def _bits_per_byte(model: Any, data: torch.Tensor, seq_len: int, max_windows: int = 64) -> float:
    """Mean next-byte cross-entropy in bits over up to ``max_windows`` consecutive windows of ``data``."""
    n = min(max_windows, (data.numel() - 1) // seq_len)
    if n < 1:
        return float("nan")
    x = data[: n * seq_len + 1].long()
    inputs = torch.stack([x[i * seq_len : (i + 1) * seq_len] for i in range(n)])  # [n, seq_len]
    labels = torch.stack([x[i * seq_len + 1 : (i + 1) * seq_len + 1] for i in range(n)])
    total = 0.0
    with torch.no_grad():
        for s in range(0, n, 8):
            logits = model(inputs[s : s + 8]).logits  # [b, seq_len, V]
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), labels[s : s + 8].flatten(), reduction="sum"
                )
            )
    return total / labels.numel() / math.log(2)


def train_byte_lm(
    paths: Sequence[str | os.PathLike[str]],
    *,
    hidden_size: int = 256,
    num_layers: int = 4,
    num_heads: int = 4,
    steps: int = 1500,
    seq_len: int = 256,
    batch_size: int = 16,
    lr: float = 3e-3,
    holdout: float = 0.05,
    seed: int = 0,
    progress: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """A ``LlamaForCausalLM`` over bytes fitted to ``paths``; returns ``(model in eval mode, stats)``."""
    for name, v in (("steps", steps), ("seq_len", seq_len), ("batch_size", batch_size)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name}={v!r} must be an int >= 1")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be > 0")
    config = byte_lm_config(
        hidden_size=hidden_size, num_layers=num_layers, num_heads=num_heads, max_positions=max(2048, seq_len)
    )
    train, held = corpus_bytes(paths, holdout)
    if train.numel() <= seq_len:
        raise ValueError(
            f"{train.numel()} training bytes is not more than seq_len={seq_len}: shorten seq_len"
        )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 20)
    # Linear warm-up, then cosine decay to 10 % of lr: the usual small-LM schedule.
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, s / steps)))),
    )
    bar = None
    if progress:
        bar = tqdm(total=steps, desc="train byte LM", unit="step")
    model.train()
    start, losses = time.perf_counter(), []
    for _ in range(steps):
        x = _batch(train, seq_len, batch_size, g)  # [b, seq_len + 1]
        logits = model(x[:, :-1], use_cache=False).logits  # [b, seq_len, V]
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())  # next byte
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if bar is not None:
            bar.set_postfix(bits=f"{sum(losses[-20:]) / len(losses[-20:]) / math.log(2):.3f}")
            bar.update()
    if bar is not None:
        bar.close()
    model.eval()
    stats = {
        "parameters": sum(p.numel() for p in model.parameters()),
        "steps": steps,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "lr": lr,
        "seed": seed,
        "train_bytes": int(train.numel()),
        "heldout_bytes": int(held.numel()),
        "train_bits_per_byte": sum(losses[-50:]) / len(losses[-50:]) / math.log(2),
        "heldout_bits_per_byte": _bits_per_byte(model, held, seq_len),
        "seconds": round(time.perf_counter() - start, 1),
        "text": [os.path.basename(str(p)) for p in paths],
    }
    return model, stats


def save_byte_lm(model: Any, out_dir: str | os.PathLike[str], stats: dict[str, Any]) -> Path:
    """Write ``model`` with :func:`byte_tokenizer` and its training stats as a Hugging Face folder."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.generation_config.eos_token_id = 256
    model.generation_config.pad_token_id = 256
    model.save_pretrained(out)
    byte_tokenizer().save_pretrained(out)
    (out / INFO_FILE).write_text(json.dumps(stats, indent=1) + "\n")
    return out


def passage_prompts(
    paths: Sequence[str | os.PathLike[str]],
    num: int,
    *,
    part: str = "heldout",
    holdout: float = 0.05,
    prompt_bytes: int = 96,
    seed: int = 0,
) -> list[str]:
    """``num`` texts to continue: passages (split by :func:`mtprobe.data.split_passages`) of the
    ``"heldout"`` tail of the text files (what :func:`train_byte_lm` never saw; the first ``num``) or of
    their ``"train"`` part (``num`` drawn at random with ``seed``), each cut to its first
    ``prompt_bytes`` bytes at a character boundary."""
    if part not in ("heldout", "train"):
        raise ValueError(f"part={part!r}: expected 'heldout' or 'train'")
    train, held = corpus_bytes(paths, holdout)
    data = held if part == "heldout" else train
    passages = split_passages(data.numpy().tobytes().decode("utf-8", errors="ignore"), prompt_bytes, 10**9)
    if len(passages) < num:
        raise ValueError(
            f"the {part} text has {len(passages)} passages of >= {prompt_bytes} bytes; {num} asked"
        )
    if part == "train":
        order = torch.randperm(len(passages), generator=torch.Generator().manual_seed(seed))[:num].tolist()
        passages = [passages[i] for i in order]
    return [p.encode()[:prompt_bytes].decode("utf-8", errors="ignore") for p in passages[:num]]
