"""The project's own prompt set, used by tests and benchmarks; chat prompts made of local text files'
passages (:func:`corpus_prompts`); a conversation's token ids under a chat template
(:func:`encode_conversation`). The circuit heads that ship with the package live in ``heads/`` beside it.

``prompts.jsonl`` holds one JSON object per line::

    {"id": str, "kind": str, "messages": [{"role": "user" | "assistant" | "system", "content": str}, ...]}

Non-English prompts have kind ``"non-english"`` and carry their ISO 639-1 language code as the second
dash-separated part of their id (``non-english-fr-...``). Lines are ordered so that kinds are interleaved,
which keeps ``prompts[:n]`` varied for small benchmark runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtprobe._jsonl import iter_jsonl

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "KINDS",
    "PROMPTS_FILE",
    "corpus_passages",
    "corpus_prompts",
    "encode_conversation",
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
    passages = corpus_passages(paths)
    if not passages:
        raise ValueError(f"no passage of 60 to 600 characters in {list(paths)}")
    order = torch.randperm(len(passages), generator=torch.Generator().manual_seed(seed))[:num].tolist()
    prompts = []
    for i, k in enumerate(order):
        content = f"{_CORPUS_INSTRUCTIONS[i % len(_CORPUS_INSTRUCTIONS)]}\n\n{passages[k]}"
        prompts.append(encode_conversation(tokenizer, [{"role": "user", "content": content}], "cpu"))
    return prompts


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], device: torch.device | str
) -> torch.Tensor:
    """Token ids ``[1, L]`` of a conversation under the tokenizer's chat template, ready to answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template; a conversation (a Spec-Bench "
            "question, a calibration prompt) is asked as a chat, so use a chat/instruct model whose tokenizer "
            "defines one"
        )
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids.to(device)
