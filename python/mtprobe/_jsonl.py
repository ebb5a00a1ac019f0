"""JSON files and JSON lines, read with errors that name the file (and line), written atomically."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def iter_jsonl(text: str, name: str | Path) -> Iterator[tuple[str, int, Any]]:
    """Yields ``(where, lineno, object)`` for every non-blank line of ``text`` read from ``name``."""
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}, line {lineno}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: invalid JSON: {e.msg} (column {e.colno})") from None
        yield where, lineno, obj


def read_jsonl(path: str | Path) -> Iterator[tuple[str, int, Any]]:
    path = Path(path)
    return iter_jsonl(path.read_text(encoding="utf-8"), path)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")  # processes writing one file at once
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def read_json(path: str | Path, what: str, how_to_make: str) -> Any:
    """The JSON at ``path``; FileNotFoundError ``no {what} at {path}; {how_to_make}`` when it is
    missing, ValueError naming the file when it is not JSON."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FileNotFoundError(f"no {what} at {path}; {how_to_make}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not a {what} (corrupt JSON: {e})") from None
