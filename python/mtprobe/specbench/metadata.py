"""The ``"mtprobe"`` metadata of answer lines: what a run records about itself, and how two records compare.

Every answer line a run writes holds, under :data:`METADATA_KEY`, the run's full configuration
(:func:`run_metadata`: method and its configuration as a dict (:func:`config_dict`), model, dtype,
device, threads, temperature, seed, max_new_tokens, repeats, draft model, versions and machine), so that
a file describes itself; the short ``model_id`` (:func:`default_model_id`) only names the run.

A speedup compares two methods only on one setup: :data:`SETUP_KEYS` are the settings that make one,
:func:`setup_value` reads a setting as setups are compared, and :func:`setup_differences` lists those on
which a method's file and the baseline's differ (``score`` and ``compare`` warn about them).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from mtprobe import models
from mtprobe.specbench.run_config import DEFAULT_MAX_NEW_TOKENS, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from mtprobe.specbench.methods import Method
    from mtprobe.specbench.run_config import RunConfig

__all__ = [
    "METADATA_KEY",
    "SETUP_KEYS",
    "config_dict",
    "default_model_id",
    "run_metadata",
    "setup_differences",
    "setup_value",
]

METADATA_KEY = "mtprobe"
"""Key of the run's configuration on every answer line (Spec-Bench ignores keys it does not know)."""

# What a speedup holds fixed: the baseline and the method must share these (their "mtprobe" metadata).
SETUP_KEYS = ("model", "dtype", "device", "threads", "max_new_tokens", "first_turn_only")


def setup_differences(baseline: dict[str, Any] | None, method: dict[str, Any] | None) -> list[str]:
    """``"key: baseline X, method Y"`` for each of :data:`SETUP_KEYS` both metadata record and that
    differ (the device by its type: ``cuda`` and ``cuda:0`` are one); none when either has no metadata
    (Spec-Bench's own files).

    >>> setup_differences({"dtype": "float32", "device": "cuda:0"}, {"dtype": "bfloat16", "device": "cuda"})
    ["dtype: baseline 'float32', method 'bfloat16'"]
    """
    if not baseline or not method:
        return []
    return [
        f"{k}: baseline {setup_value(baseline, k)!r}, method {setup_value(method, k)!r}"
        for k in SETUP_KEYS
        if k in baseline and k in method and setup_value(baseline, k) != setup_value(method, k)
    ]


def setup_value(meta: dict[str, Any], key: str) -> Any:
    """``meta[key]`` as setups are compared: a device by its type (``cuda:0`` and ``cuda`` are one)."""
    v = meta[key]
    return v.split(":")[0] if key == "device" and isinstance(v, str) else v


def _model_name(model: str) -> str:
    if model in models.KNOWN_MODELS:
        return model
    return Path(model).expanduser().resolve().name or "model"


def default_model_id(
    model: str,
    method: Method,
    config: Any,
    dtype: str = "float32",
    temperature: float = 0.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    draft_model: str | None = None,
) -> str:
    """A short readable id: model, method, its headline options and those that differ from its defaults,
    then the draft model, a dtype other than float32 and a temperature other than 0, e.g.
    ``smollm2-135m-probe-bc30``, ``smollm2-135m-ar-t1``, ``smollm2-135m-sps-n5-draft-tiny``.

    The full configuration (``max_new_tokens`` included) goes into each answer line's ``"mtprobe"``
    metadata instead; a resumed run that differs from it on any setting that changes the answers is
    refused, so two runs never mix in one file even where their ids agree.
    """
    del max_new_tokens  # in the metadata, not in the id
    parts = [_model_name(model), method.name]
    suffix = method.id_suffix(config)
    if suffix:
        parts.append(suffix)
    if draft_model is not None:
        parts.append(f"draft-{_model_name(draft_model)}")
    if dtype != "float32":
        parts.append({"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype))
    if temperature:
        parts.append(f"t{float(temperature):g}")
    return "-".join(parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    # A model object (DraftModelConfig.draft_model): its class and where it came from.
    name = getattr(getattr(value, "config", None), "_name_or_path", "") or ""
    return f"{type(value).__name__}({name})" if name else type(value).__name__


def config_dict(config: Any) -> dict[str, Any]:
    """A method configuration as a JSON-able dict: its ``to_dict()`` where it has one, else its fields."""
    draft = getattr(config, "draft_model", None)
    if draft is not None and dataclasses.is_dataclass(config):
        # a live model object cannot go into JSON: the configuration without it, the model named
        out = config_dict(dataclasses.replace(config, draft_model=None))
        out["draft_model"] = _jsonable(draft)
        return out
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    if dataclasses.is_dataclass(config):
        return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return {"repr": repr(config)}


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_metadata(
    cfg: RunConfig, method: Method, config: Any, model: PreTrainedModel | None
) -> dict[str, Any]:
    """The ``"mtprobe"`` metadata of ``cfg``'s answer lines: everything needed to reproduce the run."""
    device = model.device if model is not None else resolve_device(cfg.device)
    meta: dict[str, Any] = {
        "method": method.name,
        "method_config": config_dict(config),
        "model": _model_name(cfg.model),
        "model_path": str(cfg.model),
        "dtype": cfg.dtype,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "temperature": float(cfg.temperature),
        "do_sample": cfg.temperature > 0,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "first_turn_only": cfg.first_turn_only,
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
        "draft_model": cfg.draft_model,
        "versions": {
            "mtprobe": version("mtprobe"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": _machine(device),
    }
    if cfg.draft_model is not None:
        meta["method_config"]["draft_model"] = cfg.draft_model  # the name given, not the loaded object
    gen = getattr(model, "generation_config", None)
    if cfg.temperature > 0 and gen is not None:
        # what model.generate(do_sample=True) applies on top of the temperature, for every method alike
        meta["top_k"], meta["top_p"] = getattr(gen, "top_k", None), getattr(gen, "top_p", None)
    return meta
