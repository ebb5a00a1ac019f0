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
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from mtprobe._jsonl import iter_jsonl

__all__ = [
    "KINDS",
    "PROMPTS_FILE",
    "add_corpus_arguments",
    "corpus_argument_error",
    "corpus_passages",
    "corpus_prompts",
    "load_prompts",
    "prompts_file",
    "split_passages",
]

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


def add_corpus_arguments(parser: Any) -> None:
    """``--corpus-prompts``, ``--num-corpus-prompts`` and ``--gen-batch-size``: what the commands that
    learn from the model's own greedy answers (``python -m mtprobe.heads train``, ``python -m
    mtprobe.calibrate``) take besides :func:`add_calibration_arguments`; check them with
    :func:`corpus_argument_error`."""
    parser.add_argument(
        "--corpus-prompts",
        nargs="*",
        default=[],
        help="local text files whose passages become more prompts for self-distillation (e.g. "
        "/usr/share/games/fortunes/* from Debian's fortunes packages)",
    )
    parser.add_argument("--num-corpus-prompts", type=int, default=200, help="how many corpus prompts")
    parser.add_argument(
        "--gen-batch-size",
        type=int,
        default=1,
        help="prompts generated at once (left-padded; faster, and padding may flip near-tie greedy choices)",
    )


def corpus_argument_error(args: Any) -> str | None:
    """What is wrong with :func:`add_corpus_arguments`' options, or None."""
    if args.gen_batch_size < 1:
        return f"--gen-batch-size {args.gen_batch_size} must be >= 1"
    if args.num_corpus_prompts < 1:
        return f"--num-corpus-prompts {args.num_corpus_prompts} must be >= 1"
    for f in args.corpus_prompts:
        if not Path(f).is_file():
            return f"--corpus-prompts {f}: no such file; give local text files"
    # Checked here, before the model loads, so a wrong file costs no minutes.
    if args.corpus_prompts and not corpus_passages(args.corpus_prompts):
        return f"--corpus-prompts {args.corpus_prompts}: no passage of 60 to 600 characters; give text files"
    return None


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


# Instructions that turn a corpus passage into a chat prompt, in rotation: the model's answers are the
# self-distillation data (circuit heads, calibrated masks), so the prompts should ask for the kinds of
# text Spec-Bench asks for.
_CORPUS_INSTRUCTIONS = (
    "Explain what the following text means, in a short paragraph.",
    "Summarize the following text in two sentences.",
    "Write a short story inspired by the following text.",
    "Is the following statement true? Reason step by step.",
    "Translate the following text into French.",
    "Answer in a few sentences: what would an expert say about the following?",
    "Continue the following text.",
    "Extract the key facts from the following text as a bulleted list.",
)


def corpus_passages(paths: Sequence[str], *, min_chars: int = 60, max_chars: int = 600) -> list[str]:
    """Passages of local text files: fortune-cookie files split on their ``%`` lines, other files on
    blank lines; passages outside [min_chars, max_chars] are dropped."""
    out = []
    for p in paths:
        out += split_passages(Path(p).read_text(encoding="utf-8", errors="replace"), min_chars, max_chars)
    return out


def split_passages(text: str, min_chars: int, max_chars: int) -> list[str]:
    """``text``'s passages: split on fortune-cookie ``%`` lines if it has any, else on blank lines;
    those outside [min_chars, max_chars] characters are dropped."""
    parts = text.split("\n%\n") if "\n%\n" in text else text.split("\n\n")
    return [t.strip() for t in parts if min_chars <= len(t.strip()) <= max_chars]


def corpus_prompts(tokenizer: Any, paths: Sequence[str], num: int, seed: int = 0) -> list[Any]:
    """``num`` chat prompts ``[1, L]`` from passages of local text files (:func:`corpus_passages`, drawn
    without replacement), each under one of a rotation of instructions."""
    import torch

    from mtprobe.specbench.run import encode_conversation

    passages = corpus_passages(paths)
    if not passages:
        raise ValueError(f"no passage of 60 to 600 characters in {list(paths)}")
    order = torch.randperm(len(passages), generator=torch.Generator().manual_seed(seed))[:num].tolist()
    prompts = []
    for i, k in enumerate(order):
        content = f"{_CORPUS_INSTRUCTIONS[i % len(_CORPUS_INSTRUCTIONS)]}\n\n{passages[k]}"
        prompts.append(encode_conversation(tokenizer, [{"role": "user", "content": content}], "cpu"))
    return prompts
