"""The mask calibration file: what decode time reads of masks calibrated once per model.

A :class:`MaskCalibration` holds k learned mask embeddings and, where they were learned, layer offsets,
a mask LoRA and mask temperatures (what each does at the mask inputs: :mod:`mtprobe.target_model.mask_hooks`),
with :func:`~mtprobe.identity.model_identity` of the model they belong to. The file is safetensors: the
tensors ``masks``, ``layer_offsets``, ``mask_lora.<layer>.<module>.A`` / ``.B`` (:data:`LORA_PREFIX`) and
``mask_temperature``, and a header with the format (:data:`FORMAT`), the model's identity and the stats
of the run that learned them. ``ProbeConfig(mask_init="calibrated", mask_path=FILE)`` reads one
(:func:`load_calibration`); :mod:`mtprobe.offline.calibrate` (``python -m mtprobe calibrate``) learns them.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mtprobe.identity import model_identity
from mtprobe.target_model.mask_hooks import checked_mask_lora, checked_mask_temperature, decoder_layers

__all__ = ["FORMAT", "LORA_PREFIX", "MaskCalibration", "load_calibration"]

FORMAT = "mtprobe-mask-calibration/1"
LORA_PREFIX = "mask_lora."  # the file's names of the mask LoRA's tensors


@dataclass(frozen=True)
class MaskCalibration:
    """Learned mask embeddings and the model they belong to.

    Attributes:
        masks: ``[k, hidden]`` float32; row j - 1 is mask j (predicts the token j + 1 after its node).
        model: :func:`model_identity` of the model they were learned on.
        stats: how they were learned (data, steps, held-out loss and accuracy before and after).
        layer_offsets: ``[num_layers, hidden]`` float32 or None; row l is added to every mask input's
            hidden state before decoder layer l (``--layer-offsets``; :func:`mtprobe.target_model.mask_hooks.layer_offsets`).
            ``[k, num_layers, hidden]``: one set per mask (what ``--layer-offsets`` learns for k >= 2: mask
            j predicts a different depth, so it gets its own computation, not only its own input).
        mask_lora: a low-rank change of the model's projections at the mask inputs only (``--mask-lora
            RANK``; :func:`mtprobe.target_model.mask_hooks.mask_lora`), shared by every mask, or None: entries
            ``"{layer}.{module}.A"`` ``[rank, in_features]`` and ``".B"`` ``[out_features, rank]`` float32.
        mask_temperature: ``[k]`` float32 or None: decoding divides mask j's logits by entry j - 1
            (:func:`mtprobe.target_model.mask_hooks.scale_mask_logits`), fitted on the held-out continuations so that the
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
            t = checked_mask_temperature(self.mask_temperature)
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
                checked_mask_lora(self.mask_lora, decoder_layers(model))
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
