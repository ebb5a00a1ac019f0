"""The data of mask calibration and head training: the model's own greedy continuations of prompts.

:func:`calibration_sequences` generates them (HF ``generate``, optionally kept in a file checked against
the model's identity, :func:`~mtprobe.identity.model_identity`, the prompts and the settings);
:class:`Continuations` pairs each with its KV cache, the data every scoring and training loop of
:mod:`mtprobe.offline.calibrate` reads, keeping the caches in memory up to a budget.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from mtprobe.identity import model_identity
from mtprobe.target_model.adapter import cache_argument

__all__ = ["SEQUENCES_FORMAT", "Continuations", "calibration_sequences"]

SEQUENCES_FORMAT = "mtprobe-calibration-sequences/1"  # calibration_sequences(path=...)


def calibration_sequences(
    model: Any,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    progress: Callable[[str], None] | None = None,
    batch_size: int = 1,
    path: str | os.PathLike[str] | None = None,
) -> list[tuple[torch.Tensor, int]]:
    """(ids ``[n]``, prompt length) per prompt ``[1, L]``: the model's greedy continuation, HF ``generate``.

    ``batch_size`` > 1 generates that many prompts at once, left-padded (much faster on a CPU); padding
    can flip a near-tie greedy choice, so batched text is the model's own but not always bit-identical
    to one prompt at a time. Each continuation ends at its first EOS.

    ``path``: keep them in that file. They are read from it when it holds this model's continuations of
    exactly these prompts with the same ``max_new_tokens`` and ``batch_size`` (a retry, another learning
    rate or step count costs no generation), otherwise generated and written there. The file
    (safetensors): ``ids`` ``[total]`` int32, the sequences one after another, ``lengths`` and ``starts``
    ``[num]`` int64, and a JSON header with the model's identity and the generation's settings. ValueError,
    naming what differs, if it exists but was made for another model, other prompts or other settings."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if path is None:
        return _generated_sequences(model, prompts, max_new_tokens, progress, batch_size)
    p = Path(path)
    want = {
        "format": SEQUENCES_FORMAT,
        "model": model_identity(model),
        "max_new_tokens": max_new_tokens,
        "batch_size": batch_size,
    }
    if p.is_file():
        seqs = _read_sequences(p, want, prompts)
        if progress is not None:
            progress(f"read {len(seqs)} greedy continuations from {p}")
        return seqs
    seqs = _generated_sequences(model, prompts, max_new_tokens, progress, batch_size)
    tensors = {
        "ids": torch.cat([t for t, _ in seqs]).to(torch.int32),  # [total]
        "lengths": torch.tensor([int(t.shape[0]) for t, _ in seqs], dtype=torch.long),  # [num]
        "starts": torch.tensor([start for _, start in seqs], dtype=torch.long),  # [num]
    }
    p.parent.mkdir(parents=True, exist_ok=True)
    # Written whole, then renamed: an interrupted run leaves no half file for the next one to refuse.
    tmp = p.with_name(p.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"mtprobe": json.dumps(want)})
    os.replace(tmp, p)
    if progress is not None:
        progress(f"wrote {len(seqs)} greedy continuations to {p}")
    return seqs


def _generated_sequences(
    model: Any,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    progress: Callable[[str], None] | None,
    batch_size: int,
) -> list[tuple[torch.Tensor, int]]:
    """:func:`calibration_sequences` without a ``path``: HF ``generate``, ``batch_size`` prompts at once."""
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])
    pad = model.config.pad_token_id
    if pad is None:
        pad = min(eos_ids) if eos_ids else 0
    out = []
    for start in range(0, len(prompts), batch_size):
        group = prompts[start : start + batch_size]
        if progress is not None:
            progress(f"greedy continuations {start + 1}-{start + len(group)}/{len(prompts)}")
        width = max(int(p.shape[1]) for p in group)
        ids = torch.full((len(group), width), pad, dtype=torch.long)  # [b, width], left-padded
        mask = torch.zeros_like(ids)
        for b, p in enumerate(group):
            ids[b, width - p.shape[1] :] = p[0]
            mask[b, width - p.shape[1] :] = 1
        with torch.no_grad():
            seq = model.generate(
                ids.to(model.device),
                attention_mask=mask.to(model.device),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
            ).cpu()  # [b, width + new]
        for b, p in enumerate(group):
            new = seq[b, width:].tolist()
            for i, t in enumerate(new):
                if t in eos_ids:
                    new = new[: i + 1]
                    break
            out.append((torch.cat([p[0].cpu(), torch.tensor(new, dtype=torch.long)]), int(p.shape[1])))
    return out


def _read_sequences(
    p: Path, want: dict[str, Any], prompts: Sequence[torch.Tensor]
) -> list[tuple[torch.Tensor, int]]:
    """The continuations in the file ``p`` (:func:`calibration_sequences`' ``path``); ValueError unless its
    header matches ``want`` and they continue exactly ``prompts``."""
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get("mtprobe", "{}"))
            ids, lengths, starts = (f.get_tensor(n) for n in ("ids", "lengths", "starts"))
    except (OSError, SafetensorError, json.JSONDecodeError) as e:  # unreadable, no such tensor, bad header
        raise ValueError(
            f"{p} is not a file of calibration continuations ({type(e).__name__}: {e}): delete it or give "
            "another path"
        ) from None
    for key, value in want.items():
        if meta.get(key) != value:
            raise ValueError(
                f"{p} holds continuations with {key}={meta.get(key)!r}, this run wants {value!r}: "
                "delete the file or give another path"
            )
    seqs = [
        (t.long(), int(start)) for t, start in zip(ids.split(lengths.tolist()), starts.tolist(), strict=True)
    ]
    if len(seqs) != len(prompts) or any(
        start != int(q.shape[1]) or not torch.equal(t[:start], q[0].cpu())
        for (t, start), q in zip(seqs, prompts, strict=True)
    ):
        raise ValueError(
            f"{p} holds the continuations of other prompts ({len(seqs)} of them, this run has "
            f"{len(prompts)}): delete the file or give another path"
        )
    return seqs


def _prefix_cache(model: Any, ids: torch.Tensor) -> Any:
    """The KV cache of the whole sequence ``ids [n]`` (no gradients: tokens never attend to masks)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids.unsqueeze(0), use_cache=True, **{cache_argument(model): cache})
    return cache


def _cache_bytes(cache: Any) -> int:
    """The bytes of a DynamicCache's tensors (keys and values of every layer)."""
    return sum(
        t.numel() * t.element_size()
        for layer in getattr(cache, "layers", ())
        for t in vars(layer).values()
        if isinstance(t, torch.Tensor)
    )


class Continuations(Sequence[tuple[torch.Tensor, int, Any]]):
    """(ids ``[n]``, prompt length, KV cache) per sequence, the data every scoring and training loop here
    reads. The caches in ``kept`` (by index) are kept; the others are built again at every access (one
    forward over the sequence each), so that memory stays bounded: SmolLM2's cache of a 200-token
    sequence is about 9 MB, ~9 GB for 1000 sequences. :meth:`build` keeps those it is told to first (the
    held-out ones), then the first ones, up to a budget; a slice is a Continuations over the same kept
    caches."""

    def __init__(self, model: Any, seqs: Sequence[tuple[torch.Tensor, int]], kept: dict[int, Any]) -> None:
        self._model, self._seqs, self._kept = model, list(seqs), kept

    @classmethod
    def build(
        cls,
        model: Any,
        seqs: Sequence[tuple[torch.Tensor, int]],
        cache_bytes: float,
        first: Sequence[int] = (),
    ) -> Continuations:
        """``seqs`` (ids ``[n]``, prompt length) with caches kept up to ``cache_bytes`` in all: those of
        the indices in ``first`` before the others (the held-out set, read by every scoring), then from
        the start."""
        order = list(dict.fromkeys(range(len(seqs))[i] for i in first))  # negative indices allowed
        chosen = set(order)
        order += [i for i in range(len(seqs)) if i not in chosen]
        kept: dict[int, Any] = {}
        used = 0
        for i in order:
            cache = _prefix_cache(model, seqs[i][0])
            used += _cache_bytes(cache)
            if used > cache_bytes:
                break
            kept[i] = cache
        return cls(model, seqs, kept)

    @property
    def sequences(self) -> list[tuple[torch.Tensor, int]]:
        """(ids ``[n]``, prompt length) per sequence, without their caches."""
        return list(self._seqs)

    @property
    def num_kept(self) -> int:
        """How many caches are kept."""
        return len(self._kept)

    def __len__(self) -> int:
        return len(self._seqs)

    def __getitem__(self, i):  # type: ignore[override]
        index = range(len(self._seqs))[i]  # negative indices; IndexError past the end
        if isinstance(index, range):
            kept = {n: self._kept[j] for n, j in enumerate(index) if j in self._kept}
            return Continuations(self._model, [self._seqs[j] for j in index], kept)
        ids, start = self._seqs[index]
        cache = self._kept.get(index)
        return ids, start, cache if cache is not None else _prefix_cache(self._model, ids)


def _continuations(
    model: Any,
    prompts: Sequence[torch.Tensor],
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[str], None] | None = None,
    path: str | os.PathLike[str] | None = None,
    cache_bytes: float = math.inf,
    first: Sequence[int] = (),
) -> Continuations:
    """:func:`calibration_sequences` (kept in ``path`` if given) as :class:`Continuations`, with up to
    ``cache_bytes`` of their KV caches kept, those of ``first`` before the others."""
    seqs = calibration_sequences(model, prompts, max_new_tokens, progress, batch_size, path)
    return Continuations.build(model, seqs, cache_bytes, first)
