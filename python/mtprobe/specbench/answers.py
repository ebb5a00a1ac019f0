"""Spec-Bench answer files (``.jsonl``, one answer line per question): read for scoring, written by a run.

Reading for scoring: :class:`Answer` is a line's first choice as Spec-Bench's ``evaluation/speed.py``
reads it, and :func:`load_answers` validates every line of a file (the line format is described in
:mod:`mtprobe.specbench.run`).

Writing by a run: :func:`default_answer_file` says where a run's answers go; :func:`read_answer_file`
finds what a resumed run has already answered (refusing lines of another configuration or timing
setup); :func:`end_with_complete_line` drops a last line that an interruption cut off;
:func:`append_answer` appends one line in one write; :func:`sort_answer_file` leaves one line per
question, sorted by question_id (Spec-Bench's ``reorg_answer_file``).
"""

from __future__ import annotations

import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mtprobe._jsonl import read_jsonl
from mtprobe.specbench.metadata import METADATA_KEY, setup_value

if TYPE_CHECKING:
    from mtprobe.specbench.questions import Question

__all__ = [
    "Answer",
    "append_answer",
    "default_answer_file",
    "end_with_complete_line",
    "load_answers",
    "read_answer_file",
    "sort_answer_file",
]


# --- reading for scoring -------------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """One answer line (its first choice, as Spec-Bench's speed.py reads it)."""

    question_id: int
    category: str
    model_id: str
    turns: tuple[str, ...]
    decoding_steps: tuple[int, ...]
    new_tokens: tuple[int, ...]
    wall_time: tuple[float, ...]
    accept_lengths: tuple[int, ...]
    wall_times: tuple[tuple[float, ...], ...] = ()
    """Per-turn wall times of every timed run (``run --repeats``); ``(wall_time,)`` when the line has none."""
    meta: dict[str, Any] | None = None
    """The line's ``"mtprobe"`` metadata (the run's configuration), None in Spec-Bench's own files."""

    @property
    def runs(self) -> tuple[tuple[float, ...], ...]:
        return self.wall_times or (self.wall_time,)

    @property
    def temperature(self) -> float:
        t = (self.meta or {}).get("temperature", 0.0)
        return float(t) if _is_num(t) else 0.0


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: object) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _parse_answer(obj: object, where: str) -> Answer:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    for key in ("question_id", "category", "model_id", "choices"):
        if key not in obj:
            raise ValueError(f"{where}: missing {key!r}")
    if not _is_int(obj["question_id"]):
        raise ValueError(f"{where}: 'question_id' must be an int, got {obj['question_id']!r}")
    choices = obj["choices"]
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ValueError(f"{where}: 'choices' must be a non-empty list of objects")
    c = choices[0]
    if "decoding_steps" not in c and "idxs" in c:
        c = {**c, "decoding_steps": c["idxs"]}  # what Spec-Bench's earlier inference scripts called it
    for key in ("turns", "decoding_steps", "new_tokens", "wall_time", "accept_lengths"):
        if not isinstance(c.get(key), list):
            raise ValueError(f"{where}: choices[0] needs a list {key!r}")
    n = len(c["turns"])
    if n == 0 or not all(isinstance(t, str) for t in c["turns"]):
        raise ValueError(f"{where}: choices[0]['turns'] must be a non-empty list of strings")
    for key, ok in (("decoding_steps", _is_int), ("new_tokens", _is_int), ("wall_time", _is_num)):
        values = c[key]
        if len(values) != n:
            raise ValueError(f"{where}: choices[0][{key!r}] has {len(values)} entries for {n} turns")
        if not all(ok(v) and v >= 0 for v in values):
            raise ValueError(f"{where}: choices[0][{key!r}] must hold non-negative numbers, got {values}")
    if sum(c["wall_time"]) <= 0:
        raise ValueError(f"{where}: the wall_time of the question sums to 0; a speed cannot be computed")
    if not all(_is_int(a) and a >= 0 for a in c["accept_lengths"]):
        raise ValueError(f"{where}: choices[0]['accept_lengths'] must hold non-negative ints")
    runs = c.get("wall_times", None)
    if runs is not None:
        if not isinstance(runs, list) or not runs:
            raise ValueError(f"{where}: choices[0]['wall_times'] must be a non-empty list (one list per run)")
        for r, w in enumerate(runs):
            if not isinstance(w, list) or len(w) != n or not all(_is_num(v) and v >= 0 for v in w):
                raise ValueError(
                    f"{where}: choices[0]['wall_times'][{r}] must list {n} non-negative wall times, got {w!r}"
                )
            if sum(w) <= 0:
                raise ValueError(
                    f"{where}: choices[0]['wall_times'][{r}] sums to 0; no speed can be computed"
                )
    meta = obj.get("mtprobe")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"{where}: 'mtprobe' metadata must be an object, got {type(meta).__name__}")
    return Answer(
        question_id=obj["question_id"],
        category=str(obj["category"]),
        model_id=str(obj["model_id"]),
        turns=tuple(c["turns"]),
        decoding_steps=tuple(c["decoding_steps"]),
        new_tokens=tuple(c["new_tokens"]),
        wall_time=tuple(float(w) for w in c["wall_time"]),
        accept_lengths=tuple(c["accept_lengths"]),
        wall_times=tuple(tuple(float(v) for v in w) for w in runs) if runs else (),
        meta=meta,
    )


def load_answers(path: str | os.PathLike[str]) -> dict[int, Answer]:
    """Read and validate an answer file; return its answers by question_id, in file order.

    A malformed line or a question_id answered twice raises ValueError naming the file and line.
    """
    path = Path(path)
    answers: dict[int, Answer] = {}
    lines: dict[int, int] = {}
    for where, lineno, obj in read_jsonl(path):
        a = _parse_answer(obj, where)
        if a.question_id in answers:
            first = lines[a.question_id]
            raise ValueError(
                f"{where}: question_id {a.question_id} is answered again (first on line {first})"
            )
        answers[a.question_id] = a
        lines[a.question_id] = lineno
    if not answers:
        raise ValueError(f"{path}: no answers (the file is empty)")
    return answers


# --- writing by a run ----------------------------------------------------------------------------

# Settings that change the answers: a resumed run must match the file on all of them.
_ANSWER_SETTINGS = (
    "method",
    "method_config",
    "model",
    "dtype",
    "temperature",
    "seed",
    "max_new_tokens",
    "first_turn_only",
    "draft_model",
)
# Settings that change the timings: one answer file holds the timings of one setup. The device is
# compared by its type ("cuda" and "cuda:0" are one setup).
_TIMING_SETTINGS = ("device", "threads", "repeats")


def _timing_setup(meta: dict[str, Any]) -> dict[str, Any]:
    return {k: setup_value(meta, k) for k in _TIMING_SETTINGS if k in meta}


def default_answer_file(question_file: Path, model_id: str) -> Path:
    # Spec-Bench writes data/<bench>/model_answer/<model_id>.jsonl; keep the bench name (the
    # question file's stem) so that runs on different question files never share a file.
    return Path("model_answer") / Path(question_file).stem / f"{model_id}.jsonl"


def _answer_id() -> str:
    try:
        import shortuuid  # what Spec-Bench uses; optional here

        return shortuuid.uuid()
    except ImportError:
        return uuid.uuid4().hex


def read_answer_file(
    path: Path, model_id: str | None = None, settings: dict[str, Any] | None = None
) -> dict[int, dict]:
    """Answer lines already in ``path`` by question_id ({} if it does not exist).

    With ``model_id``, a line written for another model_id is refused (ValueError naming both), so
    a resumed run never mixes two configurations in one file. With ``settings`` (a run's metadata), a
    line whose ``"mtprobe"`` metadata differs on a setting that changes the answers (method and its
    configuration, model, dtype, temperature, seed, max_new_tokens, draft model) is refused likewise;
    lines written before the metadata existed are checked by model_id only.

    A last line without its newline that does not parse is the line an interrupted run was writing:
    it is left out (``run`` removes it from the file and answers its question again). Any other line
    that is not an answer line is an error naming the file and the line.
    """
    done: dict[int, dict] = {}
    if not path.exists():
        return done
    lines = path.read_bytes().split(b"\n")
    tail = lines.pop()  # what follows the last newline: b"" when the file ends with one
    for lineno, raw in enumerate(lines, start=1):
        if raw.strip():
            obj = _answer_line(path, lineno, raw, model_id, settings)
            done[obj["question_id"]] = obj
    if tail.strip():
        lineno = len(lines) + 1
        try:
            json.loads(tail.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return done  # cut off by an interrupted write
        obj = _answer_line(path, lineno, tail, model_id, settings)
        done[obj["question_id"]] = obj
    return done


def _answer_line(
    path: Path, lineno: int, raw: bytes, model_id: str | None, settings: dict[str, Any] | None = None
) -> dict:
    try:
        obj = json.loads(raw.decode("utf-8"))
        _, found = obj["question_id"], obj["model_id"]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(
            f"{path}, line {lineno}: not a Spec-Bench answer line ({type(e).__name__}: {e}). Resuming drops only "
            "an unfinished last line (the write an interrupted run left without its newline); a damaged line "
            "before it is not one: repair or delete that line, or pass another --answer-file"
        ) from None
    if model_id is not None and found != model_id:
        raise ValueError(
            f"{path} holds answers of model_id {found!r} (line {lineno}), not of this run's "
            f"model_id {model_id!r}; pass another --answer-file (or --model-id {found!r} to resume)"
        )
    meta = obj.get(METADATA_KEY)
    if settings is not None and isinstance(meta, dict):
        differ = [k for k in _ANSWER_SETTINGS if k in meta and meta[k] != settings.get(k)]
        if differ:
            detail = "; ".join(f"{k}: file {meta[k]!r}, this run {settings.get(k)!r}" for k in differ)
            raise ValueError(
                f"{path}, line {lineno}: answers of another configuration ({detail}); resuming would mix "
                "two runs in one file: pass another --answer-file or --model-id"
            )
        before, now = _timing_setup(meta), _timing_setup(settings)
        differ = [k for k in before if k in now and before[k] != now[k]]
        if differ:
            detail = "; ".join(f"{k}: file {before[k]!r}, this run {now[k]!r}" for k in differ)
            raise ValueError(
                f"{path}, line {lineno}: answers timed on another setup ({detail}); resuming would mix the "
                "timings of two setups in one file: pass another --answer-file or --model-id, or run with "
                "the file's settings"
            )
    return obj


def end_with_complete_line(path: Path) -> int | None:
    """Make ``path`` end with a complete line before answers are appended to it: drop an unfinished last
    line (an interrupted write; read_answer_file has left it out) or end a complete one with its newline.
    Returns the number of the line dropped, or None."""
    if not path.exists():
        return None
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return None
    cut = data.rfind(b"\n") + 1  # start of the last line
    tail = data[cut:]
    try:
        json.loads(tail.decode("utf-8"))
        complete = True
    except (UnicodeDecodeError, json.JSONDecodeError):
        complete = False  # unfinished (or only whitespace)
    with open(path, "r+b") as f:
        if complete:
            f.seek(0, os.SEEK_END)
            f.write(b"\n")
            return None
        f.truncate(cut)
    return data.count(b"\n", 0, cut) + 1 if tail.strip() else None


def append_answer(
    path: Path, question: Question, model_id: str, choice: dict[str, Any], meta: dict[str, Any]
) -> None:
    """Append the answer line of ``question`` (``choice``: Spec-Bench's ``choices[0]``; ``meta``: the
    run's :data:`~mtprobe.specbench.metadata.METADATA_KEY` metadata) to ``path``."""
    line = {
        "question_id": question.question_id,
        "category": question.category,
        "answer_id": _answer_id(),
        "model_id": model_id,
        "choices": [choice],
        "tstamp": time.time(),
        METADATA_KEY: meta,
    }
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")  # one write per line: an interrupted run loses at most one


def sort_answer_file(path: Path) -> None:
    # As Spec-Bench's reorg_answer_file: one line per question_id (the last wins), sorted by id.
    lines: dict[int, str] = {}
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                lines[json.loads(line)["question_id"]] = line if line.endswith("\n") else line + "\n"
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.writelines(lines[q] for q in sorted(lines))
    os.replace(tmp, path)
