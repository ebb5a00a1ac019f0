"""A trained circuit head at inference: its checkpoint (:func:`save_head`, :func:`load_head`,
:func:`load_cached`), the heads that ship with the package (:func:`bundled_head`), and the C++ drafter
over it (:func:`heads_drafter`).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from importlib import resources
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from mtprobe import _C
from mtprobe.heads.circuit import CircuitHead, HeadSpec
from mtprobe.heads.lora import DraftLayers
from mtprobe.identity import model_identity

__all__ = [
    "BUNDLED_HEADS",
    "CHECKPOINT_FILE",
    "FORMAT",
    "bundled_head",
    "checkpoint_path",
    "heads_drafter",
    "load_cached",
    "load_head",
    "new_head",
    "output_embedding",
    "save_head",
]

CHECKPOINT_FILE = "head.safetensors"
FORMAT = "mtprobe-circuit-head/1"


def output_embedding(model: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``model``'s LM head: its weight ``[V, d]`` and bias ``[V]`` (None without one); ValueError if it
    has none."""
    out = model.get_output_embeddings()
    if out is None or not hasattr(out, "weight"):
        raise ValueError(f"{type(model).__name__} has no output embedding (LM head): circuit heads need one")
    return out.weight, getattr(out, "bias", None)


def new_head(model: Any, spec: HeadSpec) -> CircuitHead:
    """An untrained head of ``spec`` over ``model``'s LM head (``spec``'s sizes must be the model's),
    with LoRA draft layers over ``model``'s last ``spec.lora_layers`` layers if any."""
    weight, bias = output_embedding(model)
    draft = DraftLayers(model, spec.lora_layers, spec.lora_rank) if spec.lora_layers else None
    return CircuitHead(spec, weight, bias, draft).to(weight.device)  # the head runs where the backbone does


def save_head(head: CircuitHead, model: Any, out_dir: str | os.PathLike[str], stats: dict[str, Any]) -> Path:
    """Write ``head`` to ``out_dir/head.safetensors`` with its spec, ``model``'s identity and ``stats``."""
    if int(head.trained_steps) < 1:
        raise ValueError("this head has not been trained (0 steps); train it before saving it")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    meta = {
        "format": FORMAT,
        "spec": json.dumps(asdict(head.spec)),
        "model": json.dumps(model_identity(model)),
        "stats": json.dumps(stats),
    }
    path = out / CHECKPOINT_FILE
    save_file(tensors, str(path), metadata=meta)
    return path


def checkpoint_path(path: str | os.PathLike[str]) -> Path:
    """The checkpoint file of ``path``: ``path/head.safetensors`` for a folder, else ``path`` itself."""
    p = Path(path)
    return p / CHECKPOINT_FILE if p.is_dir() else p


def load_head(path: str | os.PathLike[str], model: Any) -> CircuitHead:
    """The trained head in ``path`` (a folder written by ``python -m mtprobe heads train``, or its
    head.safetensors) over ``model``'s LM head. FileNotFoundError for a missing checkpoint; ValueError
    for a damaged one or one trained for another backbone or vocabulary."""
    p = checkpoint_path(path)
    if not p.is_file():
        raise FileNotFoundError(
            f"circuit head checkpoint {str(p)!r} does not exist; train one with python -m mtprobe heads train "
            "--model ... --out DIR"
        )
    try:
        with safe_open(str(p), framework="pt") as f:
            meta = f.metadata() or {}
            state = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
        if meta.get("format") != FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, want {FORMAT!r}")
        raw = json.loads(meta["spec"])
        if raw.get("lora_layers", 0) > 0:
            raw.setdefault("lora_base", "draft")  # what LoRA heads were before lora_base existed
        spec = HeadSpec(**raw)
        identity = json.loads(meta["model"])
        stats = json.loads(meta.get("stats", "{}"))
    except Exception as e:  # safetensors and json raise their own types for a damaged file
        raise ValueError(f"{str(p)!r} is not a readable mtprobe circuit-head checkpoint: {e}") from e
    mine = model_identity(model)
    if identity != mine:
        differs = [k for k in mine if identity.get(k) != mine[k]]
        raise ValueError(
            f"the circuit head {str(p)!r} was trained for another backbone: {', '.join(differs)} differ "
            f"(checkpoint {identity}, this model {mine}); train a head for this model"
        )
    head = new_head(model, spec)
    state.setdefault("token_counts", head.token_counts)  # written before they were recorded: none
    try:
        head.load_state_dict(state)
    except RuntimeError as e:
        raise ValueError(f"{str(p)!r} does not match its own spec {spec}: {e}") from e
    head.stats = stats  # type: ignore[attr-defined]
    return head.eval()


# Heads shipped with the package (python/mtprobe/data/heads/), trained by `python -m mtprobe heads train`
# for a known model; benchmarks/results/heads/README.md gives the command and what they measure.
BUNDLED_HEADS = {"smollm2-135m": "smollm2-135m-btree-r2-n4"}


def bundled_head(model_name: str = "smollm2-135m") -> str:
    """The folder of the head mtprobe ships for the known model ``model_name``, for
    ``HeadsConfig(path=...)``; ValueError naming the models that have one otherwise.

    >>> Path(bundled_head()).name
    'smollm2-135m-btree-r2-n4'
    """
    if model_name not in BUNDLED_HEADS:
        raise ValueError(
            f"no circuit head ships for {model_name!r}; heads ship for {', '.join(map(repr, BUNDLED_HEADS))}. "
            "Train one with python -m mtprobe heads train --model ... --out DIR"
        )
    return str(resources.files("mtprobe.data").joinpath("heads").joinpath(BUNDLED_HEADS[model_name]))


_CACHE: dict[tuple[Any, ...], CircuitHead] = {}


def load_cached(path: str | os.PathLike[str], model: Any) -> CircuitHead:
    """:func:`load_head`, cached by file (path, size, modification time) and model (generate builds its
    drafter per call)."""
    p = checkpoint_path(path)
    st = p.stat() if p.is_file() else None
    key = (str(p.resolve()), st.st_size, st.st_mtime_ns, id(model)) if st else None
    if key is not None and key in _CACHE:
        return _CACHE[key]
    head = load_head(path, model)
    if key is not None:
        _CACHE.clear()  # one head at a time is the common case; keep memory bounded
        _CACHE[key] = head
    return head


def heads_drafter(
    head: CircuitHead,
    *,
    do_sample: bool = False,
    top_branches: int = 1,
    min_path_prob: float = 0.0,
    vocab_top_k: int | None = None,
    dtype: torch.dtype | None = None,
    **entmtp: Any,
) -> Any:
    """The C++ drafter over a trained ``head`` (ValueError for an untrained one). The block-complexity
    budget is the decode loop's (StepLimits), not the drafter's; ``min_path_prob``, ``vocab_top_k``
    and ``dtype`` (``head_dtype``): see :class:`mtprobe.HeadsConfig`; ``entmtp``: the bank's compiled trees, policy,
    feature, ema and record (:func:`mtprobe.drafters.heads_drafter` builds them from a HeadsConfig)."""
    if int(head.trained_steps) < 1:
        raise ValueError(
            "this circuit head has not been trained (0 steps): its drafts would be noise; train it with "
            "python -m mtprobe heads train, or load a checkpoint with mtprobe.heads.load_head"
        )
    if dtype is not None and head.draft is None and vocab_top_k is None:
        raise ValueError(
            f"head_dtype={str(dtype).removeprefix('torch.')!r} sets the dtype of a head's LoRA draft layers and "
            "of its restricted vocabulary's tables, and this head has neither (lora_layers=0, vocab_top_k=None): "
            "it would change nothing; set vocab_top_k=K too, or leave head_dtype=None"
        )
    head.eval()
    spec = head.spec
    return _C.HeadsDrafter(
        head.step_fn(vocab_top_k, dtype),
        circuit=spec.circuit,
        window=spec.window,
        rank=head.r,
        vocab=spec.vocab_size,
        do_sample=do_sample,
        top_branches=top_branches,
        committed_rows=head.draft is not None,  # only draft layers read the rows before the last
        min_path_prob=min_path_prob,
        **entmtp,
    )
