"""Model identity: what the files and caches mtprobe makes for one model are checked against.

A mask calibration (:mod:`mtprobe.target_model.mask_calibration`), a circuit head's checkpoint
(:mod:`mtprobe.heads.inference`) and a file of calibration continuations
(:mod:`mtprobe.offline.calibration_data`) record :func:`model_identity` of the model they were made on,
and refuse a model whose identity differs. Imports nothing of mtprobe.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch

__all__ = ["model_identity"]


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
