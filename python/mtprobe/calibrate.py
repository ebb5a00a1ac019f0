"""Calibrated mask tokens: k mask embeddings learned once per model (beyond seed 001).

Seed 001 builds its mask tokens from the prompt (the mean of its embeddings) and nudges them toward
every generated token. Nothing in that choice is fitted to what a mask is for: its logits should
predict the token after next. Here the k mask embeddings (k x hidden numbers, nothing else; the
model's weights stay frozen) are learned by gradient descent so that, placed as in decoding, they
do exactly that:

    sequence  x_0 .. x_{n-1}        the model's own greedy continuation of a calibration prompt
    anchor p  a node of the sequence; mask j (1..k) sits at position p + j, attends to x_0..x_p
              and to masks 1..j-1 of the same anchor (the chained masks of csrc/drafters/mask_probe.h)
    loss      mean over anchors p and masks j of  -log softmax(logits(m_j at p))[x_{p+j+1}]

The model's own generations are the data because they are what verification compares against:
a draft is accepted iff it equals the model's greedy token (self-distillation). The sequences'
tokens run once per sequence without gradients (their keys and values do not depend on the
masks); each step forwards only the masks, a batch of anchors at a time, over that cached prefix.
The prompts are mtprobe's own set (or ``--prompts FILE``), and ``--corpus-prompts FILES`` adds
passages of local text files, each under an instruction (:func:`mtprobe.data.corpus_prompts`); those
go first, so the held-out prompts (the last ``--holdout``) stay the set's own.

``--layer-offsets`` also learns one vector per decoder layer, added to the masks' hidden state before
that layer (``[num_layers, hidden]``, 17 280 numbers for SmolLM2; :func:`mtprobe.adapter.layer_offsets`;
with ``--num-masks`` k >= 2 one such set per mask, ``[k, num_layers, hidden]``).
A mask embedding only chooses the first layer's input; the offsets steer every layer's computation at
the mask, which a 576-number input cannot. The model's weights and every token input stay untouched
(no draft token attends to a mask), so verification, and the output, are unchanged.

The result is a :class:`MaskCalibration` file (safetensors: the masks, the layer offsets if learned,
and a JSON header naming the model it belongs to); ``ProbeConfig(mask_init="calibrated", mask_path=FILE)`` starts every
generation's masks from it; they stay fixed (``mask_lambda`` defaults to 0 for them), and a positive
``mask_lambda`` applies the paper's running update on top.

    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors \
        --corpus-prompts /usr/share/games/fortunes/* --num-corpus-prompts 136 --gen-batch-size 16
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2-offsets.safetensors --layer-offsets
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from mtprobe import adapter
from mtprobe.adapter import cache_argument

__all__ = [
    "FORMAT",
    "MaskCalibration",
    "calibrate_masks",
    "calibration_sequences",
    "fit_mask_temperature",
    "load_calibration",
    "mask_loss",
    "score_calibration",
]

FORMAT = "mtprobe-mask-calibration/1"
SEQUENCES_FORMAT = "mtprobe-calibration-sequences/1"  # calibration_sequences(path=...)
LORA_PREFIX = "mask_lora."  # the file's names of the mask LoRA's tensors


def model_identity(model: Any) -> dict[str, Any]:
    """What a calibration belongs to: the class, the embedding shape and a hash of the embedding table's
    first rows (masks live in that table's space, so they belong to one checkpoint)."""
    table = model.get_input_embeddings().weight
    rows = table[:64].detach().to("cpu", torch.float32).contiguous()
    return {
        "model_class": type(model).__name__,
        "vocab_size": int(table.shape[0]),
        "hidden_size": int(table.shape[1]),
        "embedding_sha256": hashlib.sha256(rows.numpy().tobytes()).hexdigest()[:16],
    }


@dataclass(frozen=True)
class MaskCalibration:
    """Learned mask embeddings and the model they belong to.

    Attributes:
        masks: ``[k, hidden]`` float32; row j - 1 is mask j (predicts the token j + 1 after its node).
        model: :func:`model_identity` of the model they were learned on.
        stats: how they were learned (data, steps, held-out loss and accuracy before and after).
        layer_offsets: ``[num_layers, hidden]`` float32 or None; row l is added to every mask input's
            hidden state before decoder layer l (``--layer-offsets``; :func:`mtprobe.adapter.layer_offsets`).
            ``[k, num_layers, hidden]``: one set per mask (what ``--layer-offsets`` learns for k >= 2: mask
            j predicts a different depth, so it gets its own computation, not only its own input).
        mask_lora: a low-rank change of the model's projections at the mask inputs only (``--mask-lora
            RANK``; :func:`mtprobe.adapter.mask_lora`), shared by every mask, or None: entries
            ``"{layer}.{module}.A"`` ``[rank, in_features]`` and ``".B"`` ``[out_features, rank]`` float32.
        mask_temperature: ``[k]`` float32 or None: decoding divides mask j's logits by entry j - 1
            (:func:`mtprobe.adapter.scale_mask_logits`), fitted on the held-out continuations so that the
            masks' probabilities, which the dynamic draft tree multiplies, match how often they hit.

    >>> cal = MaskCalibration(torch.zeros(2, 4), {"model_class": "M", "vocab_size": 8, "hidden_size": 4,
    ...                                            "embedding_sha256": "0"})
    >>> cal.num_masks, cal.hidden_size
    (2, 4)
    >>> MaskCalibration(torch.zeros(2, 5), cal.model)
    Traceback (most recent call last):
    ...
    ValueError: masks are [2, 5] but the model's hidden size is 4: a calibration file is [num_masks, hidden_size]
    """

    masks: torch.Tensor  # [k, hidden] float32
    model: dict[str, Any]
    stats: dict[str, Any] = field(default_factory=dict)
    layer_offsets: torch.Tensor | None = None  # [num_layers, hidden] or [k, num_layers, hidden] float32
    mask_lora: dict[str, torch.Tensor] | None = None  # "{layer}.{module}.A": [rank, in], ".B": [out, rank]
    mask_temperature: torch.Tensor | None = None  # [k] float32

    def __post_init__(self) -> None:
        m = self.masks
        if not isinstance(m, torch.Tensor) or m.dim() != 2 or m.shape[0] < 1 or not m.is_floating_point():
            raise ValueError(
                f"masks must be a floating [num_masks, hidden_size] tensor with num_masks >= 1, got "
                f"{tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__}"
            )
        if not torch.isfinite(m).all():
            raise ValueError(
                "masks hold NaN or infinite values: the calibration diverged or the file is corrupt"
            )
        missing = {"model_class", "vocab_size", "hidden_size", "embedding_sha256"} - set(self.model)
        if missing:
            raise ValueError(f"the calibration's model identity lacks {sorted(missing)}")
        if m.shape[1] != self.model["hidden_size"]:
            raise ValueError(
                f"masks are [{m.shape[0]}, {m.shape[1]}] but the model's hidden size is "
                f"{self.model['hidden_size']}: a calibration file is [num_masks, hidden_size]"
            )
        object.__setattr__(self, "masks", m.detach().to("cpu", torch.float32).contiguous())
        o = self.layer_offsets
        if o is not None:
            shared = isinstance(o, torch.Tensor) and o.dim() == 2
            per_mask = isinstance(o, torch.Tensor) and o.dim() == 3 and o.shape[0] == m.shape[0]
            if not (shared or per_mask) or o.shape[-2] < 1 or o.shape[-1] != m.shape[1]:
                raise ValueError(
                    f"layer_offsets must be a [num_layers, {m.shape[1]}] tensor (one vector per decoder layer, "
                    f"the masks' hidden size) or [{m.shape[0]}, num_layers, {m.shape[1]}] (one set per mask), got "
                    f"{tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__}"
                )
            if not torch.isfinite(o).all():
                raise ValueError(
                    "layer_offsets hold NaN or infinite values: the calibration diverged or the file is corrupt"
                )
            object.__setattr__(self, "layer_offsets", o.detach().to("cpu", torch.float32).contiguous())
        if self.mask_lora is not None:
            lora = self.mask_lora
            if (
                not isinstance(lora, dict)
                or not lora
                or not all(isinstance(t, torch.Tensor) for t in lora.values())
            ):
                raise ValueError(
                    "mask_lora must be a non-empty dict of tensors ('<layer>.<module>.A' / '.B')"
                )
            if not all(torch.isfinite(t).all() for t in lora.values()):
                raise ValueError(
                    "mask_lora holds NaN or infinite values: the calibration diverged or the file is corrupt"
                )
            lora = {k: t.detach().to("cpu", torch.float32).contiguous() for k, t in sorted(lora.items())}
            object.__setattr__(self, "mask_lora", lora)
        if self.mask_temperature is not None:
            t = adapter.checked_mask_temperature(self.mask_temperature)
            if t.shape[0] != m.shape[0]:
                raise ValueError(
                    f"mask_temperature has {t.shape[0]} entries for {m.shape[0]} mask(s): one per mask"
                )
            object.__setattr__(self, "mask_temperature", t.cpu().contiguous())

    @property
    def num_masks(self) -> int:
        return int(self.masks.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.masks.shape[1])

    def offsets_for(self, num_masks: int) -> torch.Tensor | None:
        """The layer offsets a drafter with ``num_masks`` masks adds: the shared ``[num_layers, hidden]``
        set as it is, or the first ``num_masks`` sets of per-mask offsets (``[num_masks, num_layers,
        hidden]``: masks 1..k see nothing of later masks, so a k-mask file serves every smaller k)."""
        o = self.layer_offsets
        if o is None or o.dim() == 2:
            return o
        return o[:num_masks]

    def temperature_for(self, num_masks: int) -> torch.Tensor | None:
        """The temperatures of the first ``num_masks`` masks (``[num_masks]``), or None."""
        t = self.mask_temperature
        return None if t is None else t[:num_masks]

    def check(self, model: Any, num_masks: int | None = None) -> None:
        """ValueError unless these masks belong to ``model`` and hold at least ``num_masks`` masks."""
        now = model_identity(model)
        bad = [f"{k}: file {self.model[k]!r} vs model {now[k]!r}" for k in now if self.model.get(k) != now[k]]
        if bad:
            raise ValueError(
                "this mask calibration was learned for another model (" + "; ".join(bad) + "); "
                "learn one for this model with python -m mtprobe calibrate --model ... --out FILE"
            )
        if self.layer_offsets is not None:
            layers = model.config.get_text_config(decoder=True).num_hidden_layers
            if layers != self.layer_offsets.shape[-2]:
                raise ValueError(
                    f"this mask calibration has layer offsets for {self.layer_offsets.shape[-2]} decoder layers but "
                    f"the model has {layers}; learn one for this model with python -m mtprobe calibrate"
                )
        if self.mask_lora is not None:
            try:
                adapter.checked_mask_lora(self.mask_lora, adapter.decoder_layers(model))
            except ValueError as e:
                raise ValueError(f"this mask calibration's LoRA does not fit the model: {e}") from None
        if num_masks is not None and num_masks > self.num_masks:
            raise ValueError(
                f"num_masks={num_masks} but the calibration holds {self.num_masks} mask(s); calibrate with "
                f"--num-masks {num_masks} or use num_masks <= {self.num_masks}"
            )

    def save(self, path: str | os.PathLike[str], *, lora_dtype: torch.dtype = torch.bfloat16) -> Path:
        """Write the calibration to ``path`` (safetensors). The masks and layer offsets are stored in
        float32; a mask LoRA, millions of numbers, in ``lora_dtype`` (bfloat16 halves the file; loading
        gives float32 back)."""
        if lora_dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"lora_dtype={lora_dtype} must be torch.float32, torch.bfloat16 or torch.float16"
            )
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": FORMAT, "model": json.dumps(self.model), "stats": json.dumps(self.stats)}
        tensors = {"masks": self.masks}
        if self.layer_offsets is not None:
            tensors["layer_offsets"] = self.layer_offsets
        for key, t in (self.mask_lora or {}).items():
            tensors[LORA_PREFIX + key] = t.to(lora_dtype)
        if self.mask_temperature is not None:
            tensors["mask_temperature"] = self.mask_temperature
        save_file(tensors, str(path), metadata=meta)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> MaskCalibration:
        """The calibration in ``path``; FileNotFoundError or ValueError (naming the file) otherwise."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(
                f"mask calibration file {str(path)!r} does not exist; make one with "
                "python -m mtprobe calibrate --model ... --out FILE"
            )
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                masks = f.get_tensor("masks")
                offsets = f.get_tensor("layer_offsets") if "layer_offsets" in f.keys() else None
                lora = {k[len(LORA_PREFIX) :]: f.get_tensor(k) for k in f.keys() if k.startswith(LORA_PREFIX)}
                temperature = f.get_tensor("mask_temperature") if "mask_temperature" in f.keys() else None
        except (OSError, SafetensorError) as e:  # unreadable, a damaged header, no masks tensor
            raise ValueError(
                f"{str(path)!r} is not a mask calibration file (not readable as safetensors: {e})"
            ) from e
        if meta.get("format") != FORMAT:
            raise ValueError(f"{str(path)!r} has format {meta.get('format')!r}, expected {FORMAT!r}")
        try:
            model = json.loads(meta["model"])
            stats = json.loads(meta.get("stats", "{}"))
        except (KeyError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r} has a damaged header ({e})") from e
        return cls(masks, model, stats, offsets, lora or None, temperature)


_CACHE: dict[tuple[str, int, int], MaskCalibration] = {}


def load_calibration(path: str | os.PathLike[str]) -> MaskCalibration:
    """:meth:`MaskCalibration.load`, cached by path, size and modification time (generate builds its
    drafter per call)."""
    p = Path(path)
    st = p.stat() if p.is_file() else None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns) if st else None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    cal = MaskCalibration.load(p)
    if key is not None:
        _CACHE.clear()  # one file at a time is the common case; keep memory bounded
        _CACHE[key] = cal
    return cal


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


def _mask_logits(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    ids: torch.Tensor,  # [n]
    anchors: torch.Tensor,  # [a]
    cache: Any,
    layer_offsets: torch.Tensor | None,
    mask_lora: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logits ``[a*k, vocab]`` float32, targets ``[a*k]``, valid ``[a*k]``) of the k chained masks on every
    anchor, input (p, j) predicting ``ids[p + j + 1]``: :func:`mask_loss`'s forward."""
    n = int(ids.shape[0])
    k = int(masks.shape[0])
    a = int(anchors.shape[0])
    if cache is None:
        cache = _prefix_cache(model, ids)
    j = torch.arange(1, k + 1)  # [k]
    pos = (anchors[:, None] + j[None, :]).reshape(-1)  # [a*k]
    target_pos = pos + 1  # [a*k]
    valid = target_pos < n  # [a*k]
    targets = ids[target_pos.clamp(max=n - 1)]  # [a*k]
    # Mask input (p, j) sees prefix keys 0..p and mask inputs (p, 1..j).
    q_anchor = anchors.repeat_interleave(k)  # [a*k]
    q_j = j.repeat(a)  # [a*k]
    see_prefix = torch.arange(n)[None, :] <= q_anchor[:, None]  # [a*k, n]
    same = q_anchor[:, None] == q_anchor[None, :]
    see_masks = same & (q_j[None, :] <= q_j[:, None])  # [a*k, a*k]
    allowed = torch.cat([see_prefix, see_masks], dim=1)  # [a*k, n + a*k]
    dtype = model.get_input_embeddings().weight.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    device = model.get_input_embeddings().weight.device
    embeds = masks.to(dtype).repeat(a, 1).unsqueeze(0).to(device)  # [1, a*k, hidden]
    offsets = contextlib.nullcontext()
    if layer_offsets is not None:  # every input of this forward is a mask: offsets from position 0
        offsets = adapter.layer_offsets(adapter.decoder_layers(model), layer_offsets.to(device), 0)
    lora = contextlib.nullcontext()
    if mask_lora is not None:  # every input of this forward is a mask: adapted from position 0
        lora = adapter.mask_lora(adapter.decoder_layers(model), mask_lora, 0)
    with offsets, lora:
        out = model(
            inputs_embeds=embeds,
            attention_mask=additive[None, None].to(device),
            position_ids=pos[None].to(device),
            use_cache=True,
            # The forward appends the masks' keys; keep the prefix's.
            **{cache_argument(model): copy.deepcopy(cache)},
        )
    return out.logits[0].float(), targets, valid  # [a*k, vocab], [a*k], [a*k]


def mask_loss(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    ids: torch.Tensor,  # [n] the sequence
    anchors: torch.Tensor,  # [a] node positions p, each with p + 2 <= n - 1 (mask 1 has a target)
    cache: Any = None,
    *,
    layer_offsets: torch.Tensor | None = None,  # [num_layers, hidden] or [k, num_layers, hidden]
    mask_lora: dict[str, torch.Tensor] | None = None,
    temperature: torch.Tensor | None = None,  # [k]
    return_hits: bool = False,
    per_mask: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean cross-entropy, number of targets) of the k chained masks on every anchor, predicting
    ``ids[p + j + 1]`` from mask j; with ``return_hits`` also the number of targets the mask's top-1 hits.
    ``per_mask``: the three as ``[k]`` tensors, one entry per mask (summed cross-entropy, not the mean).

    One forward over the a * k mask inputs on the cached prefix ``ids`` (``cache``: the sequence's own,
    left unchanged: the forward runs on a copy): mask j of anchor p sits at position p + j and attends to ids[0..p] and to
    masks 1..j-1 of its own anchor. ``layer_offsets`` (or None) are added to every mask's hidden state
    before each decoder layer, as in decoding; ``mask_lora`` (or None) adapts the projections at the
    masks (:func:`mtprobe.adapter.mask_lora`); mask j's logits are divided by ``temperature[j - 1]`` (or
    not, None), as decoding does with a calibration's ``mask_temperature``.
    """
    a, k = int(anchors.shape[0]), int(masks.shape[0])
    logits, targets, valid = _mask_logits(model, masks, ids, anchors, cache, layer_offsets, mask_lora)
    device = logits.device
    if temperature is not None:
        logits = logits / temperature.to(device).repeat(a)[:, None]  # [a*k, vocab]
    ce = torch.nn.functional.cross_entropy(logits, targets.to(device), reduction="none")  # [a*k]
    count = valid.sum()
    loss = (ce * valid.to(device)).sum() / count.clamp(min=1)
    if per_mask:
        by_mask = lambda x: x.reshape(a, k).sum(0)  # noqa: E731  [a*k] -> [k]
        hits = (logits.argmax(-1).cpu() == targets) & valid
        return by_mask((ce * valid.to(device)).detach().cpu()), by_mask(valid.long()), by_mask(hits.long())
    if return_hits:
        hits = ((logits.argmax(-1).cpu() == targets) & valid).sum()
        return loss, count, hits
    return loss, count


def _anchors(n: int, start: int) -> torch.Tensor:
    """Every node from the last prompt token (the first decode root) on whose mask 1 has a target."""
    return torch.arange(max(0, start - 1), n - 2)  # [a]


def _evaluate(
    model: Any,
    masks: torch.Tensor | None,
    data: Sequence[tuple[torch.Tensor, int, Any]],
    k: int = 1,
    layer_offsets: torch.Tensor | None = None,  # [num_layers, hidden] or [k, num_layers, hidden]
    mask_lora: dict[str, torch.Tensor] | None = None,
    temperature: torch.Tensor | None = None,  # [k]
) -> dict[str, Any]:
    """Held-out loss and top-1 of ``masks`` ([k, hidden]; ``None``: seed 001's soft initialisation,
    the mean of each prompt's embeddings, the baseline calibration has to beat), pooled over the k
    masks, and with k >= 2 also per mask (``by_mask``: mask j predicts the token j + 1 after its node)."""
    if masks is not None:
        k = int(masks.shape[0])
    total = torch.zeros(k, dtype=torch.float64)  # [k]
    hits = torch.zeros(k, dtype=torch.long)  # [k]
    count = torch.zeros(k, dtype=torch.long)  # [k]
    table = model.get_input_embeddings().weight
    with torch.no_grad():
        for ids, start, cache in data:
            anchors = _anchors(int(ids.shape[0]), start)
            if anchors.numel() == 0:
                continue
            if masks is None:
                m = table[ids[:start].to(table.device)].float().mean(0).repeat(k, 1).cpu()  # [k, hidden]
            else:
                m = masks
            ce, c, h = mask_loss(
                model, m, ids, anchors, cache, layer_offsets=layer_offsets, mask_lora=mask_lora,
                temperature=temperature, per_mask=True,
            )  # fmt: skip
            total += ce.double()
            count += c
            hits += h
    n = max(int(count.sum()), 1)
    out: dict[str, Any] = {
        "loss": float(total.sum()) / n,
        "top1": int(hits.sum()) / n,
        "targets": int(count.sum()),
    }
    if k > 1:
        out["by_mask"] = [
            {"loss": float(total[j]) / max(int(count[j]), 1), "top1": int(hits[j]) / max(int(count[j]), 1)}
            for j in range(k)
        ]
    return out


def _fit_temperature(
    model: Any,
    masks: torch.Tensor,  # [k, hidden]
    data: Sequence[tuple[torch.Tensor, int, Any]],
    layer_offsets: torch.Tensor | None,
    mask_lora: dict[str, torch.Tensor] | None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """(temperatures ``[k]``, :func:`_evaluate`'s scores with them) on ``data``: per mask, the T that
    minimises the cross-entropy of softmax(logits / T) on ``data``'s targets (temperature scaling, Guo et
    al. 2017), a search over log T in [1/16, 16] (the bounds where masks predict nothing better than
    uniform or never miss)."""
    k = int(masks.shape[0])
    by_mask: list[list[torch.Tensor]] = [[] for _ in range(k)]
    picked: list[list[torch.Tensor]] = [[] for _ in range(k)]
    with torch.no_grad():
        for ids, start, cache in data:
            anchors = _anchors(int(ids.shape[0]), start)
            if anchors.numel() == 0:
                continue
            logits, targets, valid = _mask_logits(model, masks, ids, anchors, cache, layer_offsets, mask_lora)
            j = torch.arange(logits.shape[0]) % k  # [a*k]
            for m in range(k):
                rows = (j == m) & valid
                by_mask[m].append(logits[rows.to(logits.device)].cpu())  # [a_m, vocab]
                picked[m].append(targets[rows])
    out = torch.ones(k)
    for m in range(k):
        if not by_mask[m]:
            continue
        logits, targets = torch.cat(by_mask[m]), torch.cat(picked[m])  # [N, vocab], [N]

        def loss(log_t: float, logits=logits, targets=targets) -> float:
            return float(torch.nn.functional.cross_entropy(logits / math.exp(log_t), targets))

        lo, hi = math.log(1 / 16), math.log(16)
        for _ in range(40):  # golden-section search: the loss is convex in 1 / T, so unimodal in log T
            a, b = hi - 0.618 * (hi - lo), lo + 0.618 * (hi - lo)
            if loss(a) < loss(b):
                hi = b
            else:
                lo = a
        out[m] = math.exp((lo + hi) / 2)
    return out, _evaluate(
        model, masks, data, layer_offsets=layer_offsets, mask_lora=mask_lora, temperature=out
    )


def score_calibration(
    model: Any,
    cal: MaskCalibration | None,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int | None = None,
    max_new_tokens: int = 128,
    gen_batch_size: int = 1,
) -> dict[str, Any]:
    """Loss and top-1 of ``cal``'s first ``num_masks`` masks (all by default; with its layer offsets and
    mask LoRA) on the model's greedy continuations of ``prompts`` (token tensors ``[1, L]``), as
    :func:`calibrate_masks` scores its held-out prompts; ``cal`` None scores seed 001's soft start (each
    prompt's mean embedding) for ``num_masks`` masks. ValueError if ``cal`` does not belong to the model."""
    k = num_masks if num_masks is not None else (cal.num_masks if cal is not None else 1)
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 4:
        raise ValueError(f"num_masks={k!r} must be an int between 1 and 4")
    if cal is not None:
        cal.check(model, k)
    data = _continuations(model, prompts, max_new_tokens, gen_batch_size)
    if cal is None:
        return _evaluate(model, None, data, k)
    return _evaluate(
        model, cal.masks[:k], data, layer_offsets=cal.offsets_for(k), mask_lora=cal.mask_lora,
        temperature=cal.temperature_for(k),
    )  # fmt: skip


def fit_mask_temperature(
    model: Any,
    cal: MaskCalibration,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int = 128,
    gen_batch_size: int = 1,
) -> MaskCalibration:
    """``cal`` with a ``mask_temperature`` fitted on the model's greedy continuations of ``prompts``
    (token tensors ``[1, L]``, prompts it did not learn from: the held-out ones), the rest unchanged; its
    stats gain ``temperature_fit`` (the prompts' count and the scores before and after). ValueError if
    ``cal`` does not belong to the model."""
    cal.check(model)
    data = _continuations(model, prompts, max_new_tokens, gen_batch_size)
    offsets, lora = cal.offsets_for(cal.num_masks), cal.mask_lora
    before = _evaluate(model, cal.masks, data, layer_offsets=offsets, mask_lora=lora)
    t, after = _fit_temperature(model, cal.masks, data, offsets, lora)
    fit = {
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
        "loss_before": before,
        "loss_after": after,
    }
    return dataclasses.replace(cal, stats={**cal.stats, "temperature_fit": fit}, mask_temperature=t)


def calibrate_masks(
    model: Any,
    prompts: Sequence[torch.Tensor],
    *,
    num_masks: int = 1,
    max_new_tokens: int = 128,
    epochs: int = 4,
    anchors_per_step: int = 64,
    lr: float = 0.05,
    holdout: int = 4,
    seed: int = 0,
    gen_batch_size: int = 1,
    layer_offsets: bool = False,
    mask_lora_rank: int = 0,
    lora_lr: float = 1e-3,
    fit_temperature: bool = True,
    init: MaskCalibration | None = None,
    sources: dict[str, Any] | None = None,
    continuations: str | os.PathLike[str] | None = None,
    cache_gib: float = 8.0,
    progress: Callable[[str], None] | None = None,
) -> MaskCalibration:
    """Learn ``num_masks`` mask embeddings for ``model`` on its greedy continuations of ``prompts``
    (token tensors ``[1, L]``). The last ``holdout`` prompts are kept out of training and scored
    before and after (loss and top-1 accuracy of mask 1..k on their true next tokens).

    Adam on the masks only; they start from the mean of the training sequences' embeddings (the
    paper's soft initialisation over the whole data), ``lr`` is relative to the embedding table's
    RMS deviation, so it means the same for every model. ``gen_batch_size`` prompts are generated at
    once (see :func:`calibration_sequences`); ``sources`` (where the prompts came from) is recorded in
    the result's stats.

    ``layer_offsets``: also learn one vector per decoder layer, added to the masks' hidden state
    before that layer (``[num_layers, hidden]``, starting at zero, with the same step size): 30 x 576
    more numbers for SmolLM2, still nothing of the model's own. They shape the model's computation at
    the mask, not only its input, and token inputs never see them. With ``num_masks`` >= 2 every mask
    gets its own set (``[k, num_layers, hidden]``).

    ``mask_lora_rank`` > 0: also learn a rank-``mask_lora_rank`` LoRA of every decoder layer's projections
    (:data:`mtprobe.adapter.MASK_LORA_MODULES`), applied at the masks only (:func:`mtprobe.adapter.mask_lora`),
    shared by the k masks, with Adam step ``lora_lr``; B starts at zero, so training starts from the masks
    as they are. ``fit_temperature`` (with held-out prompts): fit each mask's temperature on them at the end,
    as :func:`fit_mask_temperature` does (stats: ``holdout_after`` stays the scores at T = 1,
    ``temperature_fit["loss_after"]`` those with the temperatures). ``init``: start from that calibration's
    first ``num_masks`` masks (and its layer offsets and mask LoRA, where it has them and this run learns
    them) instead of the data's mean embedding. ``continuations``: a file that keeps the greedy continuations
    between runs on the same prompts (:func:`calibration_sequences`' ``path``). ``cache_gib``: the GiB of
    the sequences' KV caches kept in memory (:class:`Continuations`); past it, a step rebuilds its
    sequence's cache (a step of the two-mask LoRA calibration on SmolLM2 then takes about 1.5x as long:
    ``benchmarks/bench_calibrate_cache.py``)."""
    if not 1 <= num_masks <= 4:
        raise ValueError(f"num_masks={num_masks} must be between 1 and 4")
    for name, v, low in (
        ("epochs", epochs, 1),
        ("anchors_per_step", anchors_per_step, 1),
        ("holdout", holdout, 0),
        ("gen_batch_size", gen_batch_size, 1),
        ("mask_lora_rank", mask_lora_rank, 0),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"{name}={v!r} must be an int >= {low}")
    if len(prompts) <= holdout:
        raise ValueError(f"{len(prompts)} prompt(s) leave none to train on with holdout={holdout}")
    if isinstance(cache_gib, bool) or not isinstance(cache_gib, (int, float)) or not cache_gib >= 0:
        raise ValueError(f"cache_gib={cache_gib!r} must be a number >= 0 (GiB of KV caches kept)")
    if not lr > 0:
        raise ValueError(f"lr={lr} must be > 0")
    if not lora_lr > 0:
        raise ValueError(f"lora_lr={lora_lr} must be > 0")
    if init is not None:
        init.check(model, num_masks)
    started = time.perf_counter()
    say = progress or (lambda _msg: None)
    was_training = model.training
    model.eval()
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.requires_grad_(False)  # frozen: only the masks learn
    try:
        say(f"generating {len(prompts)} greedy continuations of {max_new_tokens} tokens")
        data = _continuations(
            model,
            prompts,
            max_new_tokens,
            gen_batch_size,
            say,
            continuations,
            cache_gib * 2**30,
            first=range(len(prompts) - holdout, len(prompts)),  # scored ~5 times: kept first
        )
        if data.num_kept < len(data):
            say(
                f"kept the KV caches of {data.num_kept} of {len(data)} sequences (cache_gib={cache_gib:g}); "
                "the others are built again at every step that reads them"
            )
        train, held = data[: len(data) - holdout], data[len(data) - holdout :]
        table = model.get_input_embeddings().weight.detach().float()  # [vocab, hidden]
        sigma = float((table - table.mean(0)).pow(2).mean().sqrt())
        tokens = torch.cat([ids for ids, _ in train.sequences])  # [total]
        first = table[tokens.to(table.device)].mean(0).cpu()  # [hidden]
        masks = first.repeat(num_masks, 1)  # [k, hidden]
        if init is not None:
            masks = init.masks[:num_masks]
        masks = masks.clone().requires_grad_(True)
        learned = [masks]
        offsets = None
        if layer_offsets:
            num_layers = len(adapter.decoder_layers(model))
            # One set per mask from k = 2 on: mask j predicts depth j + 1, a different job for every layer.
            shape = (
                (num_layers, masks.shape[1]) if num_masks == 1 else (num_masks, num_layers, masks.shape[1])
            )
            offsets = torch.zeros(shape)  # [num_layers, hidden] or [k, num_layers, hidden]
            start_offsets = init.offsets_for(num_masks) if init is not None else None
            if start_offsets is not None:
                if start_offsets.shape != offsets.shape:
                    raise ValueError(
                        f"init's layer offsets are {tuple(start_offsets.shape)}, this run learns {tuple(shape)}"
                    )
                offsets = start_offsets.clone()
            offsets.requires_grad_(True)
            learned.append(offsets)
        lora: dict[str, torch.Tensor] | None = None
        if mask_lora_rank > 0:
            lora = _initial_lora(model, mask_lora_rank, seed)
            if init is not None and init.mask_lora is not None:
                if {k: t.shape for k, t in init.mask_lora.items()} != {k: t.shape for k, t in lora.items()}:
                    raise ValueError(
                        f"init's mask LoRA is not of rank {mask_lora_rank} over every projection"
                    )
                lora = {k: t.clone() for k, t in init.mask_lora.items()}
            for t in lora.values():
                t.requires_grad_(True)
        paper = _evaluate(model, None, held, num_masks) if held else {}
        before = (
            _evaluate(model, masks.detach(), held, layer_offsets=_detached(offsets), mask_lora=lora)
            if held
            else {}
        )
        if held:
            say(
                f"held out, prompt-mean masks (seed 001): loss {paper['loss']:.3f}, top-1 {paper['top1']:.3f}; "
                f"calibration's start: loss {before['loss']:.3f}, top-1 {before['top1']:.3f}"
            )
        groups: list[dict[str, Any]] = [{"params": learned, "lr": lr * sigma}]
        if lora is not None:
            groups.append({"params": list(lora.values()), "lr": lora_lr})
        opt = torch.optim.Adam(groups)
        gen = torch.Generator().manual_seed(seed)
        batches = []
        for i, (ids, start) in enumerate(train.sequences):
            anchors = _anchors(int(ids.shape[0]), start)
            for chunk in anchors.split(anchors_per_step):
                batches.append((i, chunk))
        total_steps = epochs * len(batches)
        step = 0
        for epoch in range(epochs):
            order = torch.randperm(len(batches), generator=gen).tolist()
            run = 0.0
            for b in order:
                i, chunk = batches[b]
                ids, _, cache = train[i]
                loss, _ = mask_loss(model, masks, ids, chunk, cache, layer_offsets=offsets, mask_lora=lora)
                opt.zero_grad()
                loss.backward()
                opt.step()
                value = loss.item()  # a plain float: float() on a tensor that requires grad warns
                run += value
                step += 1
                if step % max(1, total_steps // 20) == 0 or step == total_steps:
                    say(f"step {step}/{total_steps} (epoch {epoch + 1}) loss {value:.3f}")
            say(f"epoch {epoch + 1}/{epochs}: mean training loss {run / max(1, len(order)):.3f}")
        offsets = offsets.detach() if offsets is not None else None
        lora = {k: t.detach() for k, t in lora.items()} if lora is not None else None
        after = _evaluate(model, masks.detach(), held, layer_offsets=offsets, mask_lora=lora) if held else {}
        temperature, tempered = None, {}
        if held and fit_temperature:
            temperature, tempered = _fit_temperature(model, masks.detach(), held, offsets, lora)
        if held:
            say(f"held out after: loss {after['loss']:.3f}, top-1 {after['top1']:.3f}")
            if temperature is not None:
                say(
                    f"  temperatures {[round(float(t), 3) for t in temperature]}: loss {tempered['loss']:.3f}"
                )
            for j, row in enumerate(after.get("by_mask", [])):
                say(
                    f"  mask {j + 1} (the token {j + 2} after its node): loss {row['loss']:.3f}, top-1 {row['top1']:.3f}"
                )
    finally:
        for p in params:
            p.requires_grad_(True)
        model.train(was_training)
    return MaskCalibration(
        masks.detach(),
        model_identity(model),
        {
            "data": "greedy self-continuations",
            "sources": dict(sources or {}),
            "prompts": len(prompts) - holdout,
            "holdout_prompts": holdout,
            "max_new_tokens": max_new_tokens,
            "gen_batch_size": gen_batch_size,
            "layer_offsets": bool(layer_offsets),
            "mask_lora_rank": mask_lora_rank,
            "lora_lr": lora_lr if mask_lora_rank else None,
            "init": dict(init.stats.get("sources", {}), steps=init.stats.get("steps"))
            if init is not None
            else None,
            "epochs": epochs,
            "steps": total_steps,
            "anchors_per_step": anchors_per_step,
            "lr": lr,
            "seed": seed,
            "holdout_prompt_mean": paper,
            "holdout_before": before,
            "holdout_after": after,
            # The scores before the fit are holdout_after's: the same prompts at T = 1.
            "temperature_fit": {"prompts": holdout, "max_new_tokens": max_new_tokens, "loss_after": tempered}
            if temperature is not None
            else None,
            "seconds": time.perf_counter() - started,
            "torch": torch.__version__,
        },
        offsets,
        lora,
        temperature,
    )


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.detach() if t is not None else None


def _initial_lora(model: Any, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank-``rank`` mask LoRA of every decoder layer's projections that changes nothing yet: A
    ``[rank, in]`` random (scaled by 1 / sqrt(in)), B ``[out, rank]`` zero."""
    gen = torch.Generator().manual_seed(seed)
    lora = {}
    for index, layer in enumerate(adapter.decoder_layers(model)):
        for name in adapter.MASK_LORA_MODULES:
            try:
                linear = layer.get_submodule(name)
            except AttributeError:
                continue  # a model without this projection
            lora[f"{index}.{name}.A"] = (
                torch.randn(rank, linear.in_features, generator=gen) / linear.in_features**0.5
            )
            lora[f"{index}.{name}.B"] = torch.zeros(linear.out_features, rank)
    if not lora:
        raise ValueError(
            f"{type(model).__name__} has none of the projections a mask LoRA adapts "
            f"({', '.join(adapter.MASK_LORA_MODULES)})"
        )
    return lora
