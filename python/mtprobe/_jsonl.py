"""JSON-lines reading with errors that name the file and line."""

from __future__ import annotations

import json
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
