"""What AutoConfig's scheduler measured of its draft models, carried to the model's next generations.

A draft model's chain is forecast from its acceptance so far and the seconds of its own forwards
(``csrc/drafters/auto.h``). A scheduler with no measurements explores: its first step drafts every one
of ``num_tokens`` drafts (24 for the default self-draft) whatever they cost. So what one generation
measured, per draft configuration, sampling or not, and batch size, starts the next:

- in the process, in the model's state (:mod:`mtprobe.state`, ``ModelState.carried``);
- across processes, in a JSON file beside the forward profiles (``$MTPROBE_CACHE/auto/``), named by what
  the measurements depend on: the model's architecture, the CPU or GPU and its instruction set, dtype and
  threads (a draft's seconds), and the weights' fingerprint (its acceptance: the 4-bit self-draft of a
  checkpoint on the 4-bit grid accepts every draft, off it far fewer). Not the target's forward or linear
  routes, which price the verification, not the draft. A new process's first generation then starts where
  the last one stopped. The quantized self-draft's format, where AutoConfig chose it by measurement
  (:mod:`mtprobe.drafters.auto_formats`), goes with them, and the generations each format was measured in
  while it was being chosen.

``AutoConfig(carry=...)`` chooses: ``None`` (the default) the file above, a path a file of the user's
(refused, with what differs, when it was made for another model, weights, dtype, CPU or thread count),
``False`` the process only. ``MTPROBE_AUTO_CARRY=0`` turns the files off everywhere (the tests do, so
that no test depends on what an earlier run left). A model whose weights change in place keeps its
fingerprint until :func:`mtprobe.release`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtprobe import _C, registry
from mtprobe._jsonl import read_json, write_json
from mtprobe.cpu.machine import architecture, cpu_isa, device_name
from mtprobe.drafters.base import config_from_dict
from mtprobe.identity import model_identity
from mtprobe.models.cache import cache_root
from mtprobe.registry import DecodingConfig
from mtprobe.state import state_of
from mtprobe.target_model.self_draft import DRAFT_FORMATS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from transformers import PreTrainedModel

logger = logging.getLogger("mtprobe")

ENV = "MTPROBE_AUTO_CARRY"
"""``0``: AutoConfig's measurements stay in the process (no file is read or written)."""

VERSION = 1
"""The files' format."""


def carry_dir() -> Path:
    """Where the measurements are kept by default: ``$MTPROBE_CACHE/auto`` (``~/.cache/mtprobe/auto``)."""
    return cache_root() / "auto"


def weights_fingerprint(model: PreTrainedModel) -> str:
    """A hash of the model's weights: :func:`~mtprobe.identity.model_identity` (the embedding's first rows)
    and up to 256 evenly spaced values of every parameter, so that weights moved anywhere (fine-tuned, or
    moved off a quantization grid) read as other weights. Milliseconds; kept in the model's state."""
    digest = hashlib.sha256(json.dumps(model_identity(model), sort_keys=True).encode())
    with torch.no_grad():
        for name, p in model.named_parameters():
            flat = p.detach().reshape(-1)
            sample = flat[:: max(1, flat.numel() // 256)][:256].to("cpu", torch.float32).contiguous()
            digest.update(name.encode())
            digest.update(sample.numpy().tobytes())
    return digest.hexdigest()[:16]


def carry_key(model: PreTrainedModel) -> dict[str, Any]:
    """What the measurements depend on (named as a forward profile's key names them): the architecture,
    device, instruction set, dtype and threads, and the weights' fingerprint. Cheap after the first call
    on a model (the fingerprint is kept): it is read at every AutoConfig generation."""
    state = state_of(model)
    if state.weights_fingerprint is None:
        state.weights_fingerprint = weights_fingerprint(model)
    device = next(model.parameters()).device
    machine = {
        "model": architecture(model),
        "device": device_name(device),
        "isa": cpu_isa() if device.type == "cpu" else "",
        "dtype": str(model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads() if device.type == "cpu" else 0,
    }
    return {"profile": machine, "weights": state.weights_fingerprint}


def _path(model: PreTrainedModel, carry: Any) -> tuple[Path | None, dict[str, Any] | None]:
    # The file ``carry`` names for ``model`` and its key, or (None, None) where nothing goes to disk.
    if carry is False or os.environ.get(ENV, "1").strip() == "0":
        return None, None
    key = carry_key(model)
    if carry is not None:
        return Path(carry), key
    ident = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return carry_dir() / f"{ident}.json", key


def _mismatches(made: dict[str, Any], now: dict[str, Any]) -> list[str]:
    out = [
        f"{name}: file {made.get('profile', {}).get(name)!r} vs now {value!r}"
        for name, value in now["profile"].items()
        if made.get("profile", {}).get(name) != value
    ]
    if made.get("weights") != now["weights"]:
        out.append(f"weights: file {made.get('weights')!r} vs now {now['weights']!r}")
    return out


def load(model: PreTrainedModel, carry: Any) -> None:
    """Read what earlier processes measured on ``model`` into its state, once per model state (what this
    process measured since wins). ``carry`` as :class:`~mtprobe.drafters.auto.AutoConfig` takes it.
    ValueError for a file of the user's made for another model, weights, dtype, CPU or thread count, or one
    that is not such a file; a file of the cache that cannot be read is logged and ignored (it is rewritten
    after the generation)."""
    state = state_of(model)
    if carry in state.carry_loaded:
        return
    path, key = _path(model, carry)
    state.carry_loaded.add(carry)
    if path is None or key is None or not path.exists():
        return
    if path.is_dir():
        if carry is not None:
            raise ValueError(
                f"carry={str(carry)!r} is a directory; pass the path of a file (made if missing)"
            )
        logger.warning("mtprobe: ignoring %s (a directory where AutoConfig's measurements go)", path)
        return
    try:
        data = read_json(path, "file of AutoConfig's measurements", "")
        if (
            not isinstance(data, dict)
            or data.get("version") != VERSION
            or not isinstance(data.get("key"), dict)
        ):
            raise ValueError(f"{path} is not a file of AutoConfig's measurements (version {VERSION})")
        bad = _mismatches(data["key"], key)
        if bad:
            raise ValueError(
                f"{path} holds AutoConfig's measurements of another model or machine ({'; '.join(bad)}): they "
                "would mislead its scheduler; pass another file, or carry=None to keep them per model and machine"
            )
        entries = [_entry(e, path) for e in data.get("entries", [])]
        formats = [_format(e, path) for e in data.get("formats", [])]
        runs = [_runs(e, path) for e in data.get("format_runs", [])]
    except (ValueError, OSError) as e:
        if carry is None:  # the cache's own file: rewritten after this generation
            logger.warning("mtprobe: ignoring %s (unreadable AutoConfig measurements)", path, exc_info=True)
            return
        if isinstance(e, OSError):
            raise ValueError(f"carry={str(carry)!r}: cannot read it ({e})") from None
        raise
    for k, v in entries:
        state.carried.setdefault(k, v)
    for origin, chosen in formats:
        state.draft_formats.setdefault(origin, chosen)
    for k, n in runs:
        state.format_runs[k] = max(n, state.format_runs.get(k, 0))


def _entry(e: Any, path: Path) -> tuple[tuple[Any, bool, int], tuple[Any, float]]:
    try:
        config = config_from_dict(e["config"])
        k = (config, bool(e["do_sample"]), int(e["rows"]))
        counts = ([list(map(float, r)) for r in e["trials"]], [list(map(float, r)) for r in e["accepts"]])
        seconds = float(e["draft_seconds"])
        _C.AcceptanceStats(0.95, *counts)  # the shape the scheduler takes, checked here
    except (KeyError, TypeError, ValueError, RuntimeError) as err:
        raise ValueError(f"{path}: a measurement it holds is malformed ({err!r})") from None
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{path}: a draft's seconds must be a finite number >= 0, got {seconds}")
    return k, (counts, seconds)


def _format(e: Any, path: Path) -> tuple[Any, str]:
    try:
        origin, chosen = config_from_dict(e["config"]), e["format"]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: a chosen draft format it holds is malformed ({err!r})") from None
    if getattr(origin, "draft_format", None) != "auto" or chosen not in DRAFT_FORMATS or chosen == "auto":
        raise ValueError(
            f"{path}: a chosen draft format must name a self-draft of draft_format 'auto' and one of "
            f"{', '.join(repr(f) for f in DRAFT_FORMATS if f != 'auto')}, got {e!r}"
        )
    return origin, chosen


def _runs(e: Any, path: Path) -> tuple[tuple[Any, bool], int]:
    try:
        k, n = (config_from_dict(e["config"]), bool(e["do_sample"])), e["generations"]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: a draft format's measured generations are malformed ({err!r})") from None
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise ValueError(f"{path}: a draft format's measured generations must be an int >= 0, got {n!r}")
    return k, n


def save(model: PreTrainedModel, carry: Any) -> None:
    """Write what the model's state holds (every configuration a dict can name) to ``carry``'s file."""
    path, key = _path(model, carry)
    if path is None:
        return
    state = state_of(model)
    entries = []
    for (config, do_sample, rows), ((trials, accepts), seconds) in state.carried.items():
        try:
            data = config.to_dict()
        except ValueError:  # a live draft_model object: no other process can name it
            continue
        entries.append(
            {
                "config": data,
                "do_sample": do_sample,
                "rows": rows,
                "trials": trials,
                "accepts": accepts,
                "draft_seconds": seconds,
            }
        )
    # A self-draft's configuration names no live object: every one converts to a dict.
    formats = [{"config": c.to_dict(), "format": f} for c, f in state.draft_formats.items()]
    runs = [
        {"config": c.to_dict(), "do_sample": sampled, "generations": n}
        for (c, sampled), n in state.format_runs.items()
    ]
    try:
        write_json(
            path,
            {"version": VERSION, "key": key, "entries": entries, "formats": formats, "format_runs": runs},
        )
    except OSError as e:  # a read-only cache costs the next process an exploration, not this generation
        logger.warning("mtprobe: could not keep AutoConfig's measurements in %s: %s", path, e)


def record(
    model: PreTrainedModel,
    candidates: Sequence[DecodingConfig],
    drafter: _C.AutoDrafter,
    do_sample: bool,
    rows: int = 1,
) -> None:
    """Keep what ``drafter`` (built by :func:`~mtprobe.drafters.auto.auto_drafter` over ``candidates``)
    measured of its drafters with own forwards, in the model's state: its next AutoConfig generation starts
    from it (csrc/drafters/auto.h) instead of exploring the draft model from nothing. Kept per batch size
    ``rows``: a draft step of a batch of 8 costs several times one sequence's."""
    carried = state_of(model).carried
    for i, c in enumerate(candidates):
        if registry.method_of(c).own_forwards and drafter.draft_costs[i] > 0:
            stats = drafter.stats[i]
            carried[(c, do_sample, rows)] = ((stats.trials, stats.accepts), drafter.draft_costs[i])


def carried(model: PreTrainedModel, config: DecodingConfig, do_sample: bool, rows: int) -> Any:
    """What an earlier generation of ``rows`` sequences measured of the draft model ``config``; for a batch
    of a size not measured yet, the nearest batch size's (its acceptance holds, its seconds per draft are
    re-measured at the first draft): else its first step would explore with every draft it may make, for
    every row. A single sequence starts from a single sequence's only (a batch's draft step costs several
    times one row's)."""
    kept = state_of(model).carried
    exact = kept.get((config, do_sample, rows))
    if exact is not None or rows == 1:
        return exact
    sizes = [r for (c, sampled, r) in kept if c == config and sampled == do_sample and r > 1]
    if not sizes:
        return None
    nearest = min(sizes, key=lambda r: (abs(math.log(r / rows)), r))
    return kept[(config, do_sample, nearest)]
