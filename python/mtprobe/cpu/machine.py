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
    """The CPU's model name, e.g. ``AMD EPYC 7B13``; where a virtual machine shows only a family's name
    (``AMD EPYC``, ``Intel(R) Xeon(R) Processor``), with its cpuid family and model, which tell the
    generations apart (AMD family 25 model 17: Zen 4; family 26: Zen 5)."""
    info = _cpuinfo()
    name = info.get("model name") or platform.processor() or platform.machine()
    if not any(c.isdigit() for c in name) and "cpu family" in info:
        name += f" (family {info['cpu family']}, model {info.get('model', '?')})"
    return name


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


# A measurement during which other processes used more than this share of the machine's CPU time was
# made on a busy machine: the load can turn a route's ranking around, and a cache entry outlives the
# load, so such an entry is measured again once the machine is quiet (mtprobe.target_model.profile).
BUSY_SHARE = 0.25


def _cpu_ticks() -> tuple[int, int] | None:
    """(busy, total) clock ticks of the whole machine since boot, from /proc/stat (None elsewhere)."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            # cpu  user nice system idle iowait irq softirq steal (guest time is inside user)
            fields = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


class OtherLoad:
    """The share of this machine's CPU time that processes other than this one used while the ``with``
    block ran: 0 on a quiet machine, about 0.5 on 2 cores beside one busy process. ``share`` is None
    where the machine does not tell (no /proc/stat) or the block was too short to say.

    >>> with OtherLoad() as load:
    ...     pass
    >>> load.share is None or 0.0 <= load.share <= 1.0
    True
    """

    def __init__(self) -> None:
        self.share: float | None = None
        self._start: tuple[tuple[int, int] | None, float] = (None, 0.0)

    def __enter__(self) -> OtherLoad:
        self._start = (_cpu_ticks(), _own_cpu_seconds())
        return self

    def __exit__(self, *exc: object) -> None:
        ticks, own = _cpu_ticks(), _own_cpu_seconds()
        start, own0 = self._start
        if ticks is None or start is None:
            return
        hz = os.sysconf("SC_CLK_TCK")
        busy, total = (ticks[0] - start[0]) / hz, (ticks[1] - start[1]) / hz
        if total < 0.2:  # under 20 ticks of 10 ms: too coarse to say
            return
        self.share = min(1.0, max(0.0, (busy - (own - own0)) / total))

    @property
    def busy(self) -> bool:
        """Whether other processes used more than :data:`BUSY_SHARE` of the CPU meanwhile."""
        return self.share is not None and self.share > BUSY_SHARE

    def describe(self) -> str:
        return "unknown" if self.share is None else f"{100 * self.share:.0f}% of the CPU"


def check_other_load(other_load: object) -> None:
    """A recorded :attr:`OtherLoad.share`: None or a number in [0, 1] (ValueError otherwise)."""
    if other_load is None:
        return
    if (
        isinstance(other_load, bool)
        or not isinstance(other_load, (int, float))
        or not 0.0 <= other_load <= 1.0
    ):
        raise ValueError(
            f"other_load must be None or the share of the CPU other processes used, in [0, 1]; got {other_load!r}"
        )


def _own_cpu_seconds() -> float:
    """CPU seconds this process (every thread) has used."""
    t = os.times()
    return t.user + t.system
