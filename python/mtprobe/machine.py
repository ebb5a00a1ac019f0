"""Names of the machine and model a measurement holds for: the keys of forward profiles and linear routes.

A time measured on one CPU, instruction set, thread count or model architecture says little about
another, so every cached measurement is keyed by these names and refused where they differ.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
from typing import Any

import torch

# Config entries that name or date a checkpoint without changing its arithmetic.
_NOT_ARCHITECTURE = {"_name_or_path", "name_or_path", "transformers_version", "_commit_hash", "architectures"}

# /proc/cpuinfo flags beyond torch's CPU capability that change which linear kernel is fastest.
_ISA_FLAGS = ("avx512_bf16", "avx512_fp16", "avx512_vnni", "amx_tile")


def _cpuinfo() -> dict[str, str]:
    """The first processor's entries of /proc/cpuinfo ({} where there is none)."""
    info: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break
                name, _, value = line.partition(":")
                info[name.strip()] = value.strip()
    except OSError:
        pass
    return info


@functools.cache
def cpu_name() -> str:
    """The CPU's model name, e.g. ``Intel(R) Xeon(R) Processor`` or ``AMD EPYC 7B13``."""
    return _cpuinfo().get("model name") or platform.processor() or platform.machine()


@functools.cache
def cpu_isa() -> str:
    """The vector instruction set torch's CPU kernels use here (``AVX512``, ``AVX2``, ``DEFAULT``...)
    and the extensions beyond it that matter to a linear layer, e.g. ``AVX512+avx512_bf16+amx_tile``."""
    flags = set(_cpuinfo().get("flags", "").split())
    return "+".join([torch.backends.cpu.get_cpu_capability(), *(f for f in _ISA_FLAGS if f in flags)])


def device_name(device: torch.device) -> str:
    """``cpu (CPU name, N cores)`` or ``cuda (GPU name)``."""
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        return f"cpu ({cpu_name()}, {os.cpu_count()} cores)"
    return device.type


def architecture(model: Any) -> str:
    """Class name and a hash of the architecture's config: two checkpoints of one architecture cost
    the same per forward, so they share a measurement; any change of shape or attention does not."""
    cfg = model.config.to_dict()
    arch = {k: v for k, v in sorted(cfg.items()) if k not in _NOT_ARCHITECTURE}
    arch["_attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    digest = hashlib.sha256(json.dumps(arch, sort_keys=True, default=str).encode()).hexdigest()[:16]
    return f"{type(model).__name__}:{digest}"
