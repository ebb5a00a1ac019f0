"""The project's own prompt set, used by tests and benchmarks.

``prompts.jsonl`` holds one JSON object per line::

    {"id": str, "kind": str, "messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}

Non-English prompts have kind ``"non-english"`` and carry their ISO 639-1 language code as the second
dash-separated part of their id (``non-english-fr-...``). Lines are ordered so that kinds are interleaved,
which keeps ``prompts[:n]`` varied for small benchmark runs.
"""

from __future__ import annotations

import sys
import time
from importlib import resources
from pathlib import Path
from typing import Any

from mtprobe._jsonl import iter_jsonl

__all__ = ["KINDS", "PROMPTS_FILE", "load_prompts", "prompts_file"]

# Every kind the shipped prompt set covers (tests check each one is present).
KINDS: tuple[str, ...] = (
    "chat",
    "factual",
    "long",
    "code",
    "math",
    "non-english",
    "repetition",
    "translation",
    "multi-turn",
)

_RESOURCE = "prompts.jsonl"
_ROLES = {"system", "user", "assistant"}


def prompts_file() -> Path:
    """Filesystem path of the shipped ``prompts.jsonl``.

    Goes through importlib.resources so an installed (non-editable) package resolves too; ``as_file``
    would be needed only for zipped installs, which this package does not support.
    """
    return Path(str(resources.files(__package__ or "mtprobe.data").joinpath(_RESOURCE)))


PROMPTS_FILE: Path = prompts_file()


def _validate(obj: Any, where: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("id", "kind"):
        if not isinstance(obj.get(key), str) or not obj[key]:
            raise ValueError(f"{where}: missing or empty string field {key!r}")
    messages = obj.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: 'messages' must be a non-empty list")
    for i, msg in enumerate(messages):
        if (
            not isinstance(msg, dict)
            or msg.get("role") not in _ROLES
            or not isinstance(msg.get("content"), str)
        ):
            raise ValueError(f"{where}: message {i} must be {{'role': {sorted(_ROLES)}, 'content': str}}")
    return obj


def load_prompts(path: str | Path | None = None) -> list[dict[str, Any]]:
    """Read the prompt set (the shipped one unless ``path`` is given), in file order.

    Blank lines are skipped; malformed lines raise ``ValueError`` naming the line, so a broken file
    fails loudly instead of silently shrinking a benchmark.
    """
    if path is None:
        text = resources.files(__package__ or "mtprobe.data").joinpath(_RESOURCE).read_text(encoding="utf-8")
        name = _RESOURCE
    else:
        text = Path(path).read_text(encoding="utf-8")
        name = str(path)
    return [_validate(obj, where) for where, _, obj in iter_jsonl(text, name)]


def add_calibration_arguments(parser: Any) -> None:
    """``--model``, ``--out``, ``--prompts`` and ``--num-prompts``: what every offline calibration
    command (``python -m mtprobe.topology``, ``python -m mtprobe.calibrate``) takes."""
    parser.add_argument(
        "--model", default="smollm2-135m", help="a known name, a local folder or a cached hub id"
    )
    parser.add_argument("--out", required=True, help="where to write the result")
    parser.add_argument(
        "--prompts",
        default=None,
        help="calibration prompts: a JSONL file in the format of mtprobe's prompt set ({'id', 'kind', "
        "'messages'} per line) (default: mtprobe's 24 built-in prompts, not Spec-Bench's questions)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")


def calibration_prompts(args: Any) -> tuple[Any, Any, list[Any]]:
    """(model, tokenizer, token tensors ``[1, L]``) from :func:`add_calibration_arguments`' options: the
    model loaded by name and each prompt under its tokenizer's chat template."""
    from mtprobe import models
    from mtprobe.specbench.run import encode_conversation

    model, tokenizer = models.load(args.model)
    prompts = load_prompts(args.prompts)
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    return model, tokenizer, [encode_conversation(tokenizer, p["messages"], "cpu") for p in prompts]


def print_progress(msg: str) -> None:
    """A calibration command's progress line on stderr, stamped with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
