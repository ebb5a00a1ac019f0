"""Spec-Bench question files: reading, validation and selection.

A question file holds one JSON object per line (Spec-Bench's ``data/spec_bench/question.jsonl``)::

    {"question_id": int, "category": str, "turns": [str, ...], "reference": ...}

``turns`` are the user messages of one conversation (MT-bench questions have two: the second is
asked after the model's own first answer); other keys, such as ``reference``, are kept but unused.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from mtprobe._jsonl import read_jsonl

__all__ = [
    "MT_BENCH_CATEGORIES",
    "TASKS",
    "Question",
    "load_questions",
    "select_questions",
    "task_of",
]

# Spec-Bench's six tasks (evaluation/speed.py); mt_bench is the union of MT-bench's eight categories.
MT_BENCH_CATEGORIES: tuple[str, ...] = (
    "writing",
    "roleplay",
    "reasoning",
    "math",
    "coding",
    "extraction",
    "stem",
    "humanities",
)
TASKS: tuple[str, ...] = ("mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def task_of(category: str) -> str:
    """The Spec-Bench task a category belongs to (``"mt_bench"`` for MT-bench's sub-categories)."""
    return "mt_bench" if category in MT_BENCH_CATEGORIES else category


@dataclass(frozen=True)
class Question:
    """One Spec-Bench question: a conversation of one or more user turns."""

    question_id: int
    category: str
    turns: tuple[str, ...]

    @property
    def task(self) -> str:
        return task_of(self.category)


def _parse_line(obj: object, where: str) -> Question:
    # `where` is "FILE, line N" so that every message names both.
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    qid = obj.get("question_id")
    if "question_id" not in obj:
        raise ValueError(f"{where}: missing 'question_id'")
    if isinstance(qid, bool) or not isinstance(qid, int):
        raise ValueError(f"{where}: 'question_id' must be an int, got {qid!r} ({type(qid).__name__})")
    if "category" not in obj:
        raise ValueError(f"{where}: missing 'category'")
    category = obj["category"]
    if not isinstance(category, str) or not category:
        raise ValueError(f"{where}: 'category' must be a non-empty string, got {category!r}")
    if "turns" not in obj:
        raise ValueError(f"{where}: missing 'turns'")
    turns = obj["turns"]
    if not isinstance(turns, list):
        raise ValueError(f"{where}: 'turns' must be a list of strings, got {type(turns).__name__}")
    if not turns:
        raise ValueError(f"{where}: 'turns' is empty; a question needs at least one turn")
    for i, turn in enumerate(turns):
        if not isinstance(turn, str):
            raise ValueError(f"{where}: 'turns'[{i}] must be a string, got {type(turn).__name__}")
    return Question(question_id=qid, category=category, turns=tuple(turns))


def load_questions(
    path: str | os.PathLike[str], *, begin: int | None = None, end: int | None = None
) -> list[Question]:
    """Read and validate a question file; return its questions in file order.

    ``begin``/``end`` slice the list of questions like Spec-Bench's ``--question-begin`` and
    ``--question-end`` (0-based, end exclusive, applied after reading). Blank lines are skipped.
    Raises ValueError naming the file and line for malformed JSON, a missing or mistyped field, an
    empty ``turns`` list or a repeated question_id, and for a file with no questions.
    """
    path = Path(path)
    questions: list[Question] = []
    first_line: dict[int, int] = {}
    for where, lineno, obj in read_jsonl(path):
        q = _parse_line(obj, where)
        if q.question_id in first_line:
            first = first_line[q.question_id]
            raise ValueError(f"{where}: question_id {q.question_id} repeats the one on line {first}")
        first_line[q.question_id] = lineno
        questions.append(q)
    if not questions:
        raise ValueError(f"{path}: no questions (the file is empty)")
    return questions[begin:end]


def select_questions(
    questions: Sequence[Question], *, categories: Iterable[str] | None = None, limit: int | None = None
) -> list[Question]:
    """Keep the questions of ``categories`` (category names or task names such as ``mt_bench``),
    then the first ``limit`` of them. An unknown category name raises ValueError."""
    selected = list(questions)
    if categories is not None:
        wanted = {c.strip() for c in categories if c.strip()}
        present = {q.category for q in questions} | {q.task for q in questions}
        unknown = sorted(wanted - present)
        if unknown:
            raise ValueError(
                f"unknown categor{'y' if len(unknown) == 1 else 'ies'} {', '.join(map(repr, unknown))}; "
                f"the questions have: {', '.join(sorted(present))}"
            )
        selected = [q for q in selected if q.category in wanted or q.task in wanted]
    if limit is not None:
        if limit < 0:
            raise ValueError(f"limit must be >= 0, got {limit}")
        selected = selected[:limit]
    return selected


def first_per_category(questions: Sequence[Question], per_category: int) -> list[Question]:
    """The first ``per_category`` questions of every category, in file order (benchmark subsets).

    >>> qs = [Question(i, c, ["?"]) for i, c in enumerate(["qa", "qa", "rag", "qa", "rag"])]
    >>> [q.question_id for q in first_per_category(qs, 1)]
    [0, 2]
    """
    if per_category < 1:
        raise ValueError(f"per_category must be >= 1, got {per_category}")
    seen: dict[str, int] = {}
    out = []
    for q in questions:
        if seen.get(q.category, 0) < per_category:
            seen[q.category] = seen.get(q.category, 0) + 1
            out.append(q)
    return out
