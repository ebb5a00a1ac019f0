"""Answer generation in Spec-Bench's format (``python -m mtprobe.specbench run``).

Follows Spec-Bench's ``evaluation/eval.py`` (github.com/hemingkx/Spec-Bench): every conversation is
encoded with the model's chat template, turn by turn (the second MT-bench turn is asked after the
model's own first answer, the whole conversation re-encoded); only the generation call is timed
(with a device synchronisation on both sides); the first question is run ``warmup`` (3) times and
discarded before the timed run; one answer line is appended per question::

    {"question_id", "category", "answer_id", "model_id",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [per turn],
                  "new_tokens": [per turn], "wall_time": [per turn], "accept_lengths": [flat]}],
     "tstamp"}

Differences from Spec-Bench, on purpose: the chat template is the tokenizer's own rather than a
FastChat conversation template, answers are decoded with ``skip_special_tokens=True`` and stripped
(instead of cutting at the template's stop string), and a failing generation stops the run instead
of writing ``"ERROR"`` (re-running resumes after the questions already answered; a last line that an
interruption cut off is dropped from the file and its question answered again).
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mtprobe.specbench.methods import Method, get_method
from mtprobe.specbench.questions import Question, load_questions, select_questions

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "RunConfig",
    "RunSummary",
    "answer_question",
    "default_answer_file",
    "default_model_id",
    "encode_conversation",
    "read_answer_file",
    "run",
]

DEFAULT_MAX_NEW_TOKENS = 1024  # Spec-Bench's default


@dataclass(frozen=True)
class RunConfig:
    """Everything one answer-generation run needs; built by the CLI or directly."""

    question_file: Path
    model: str = "smollm2-135m"
    """A name in ``mtprobe.models.KNOWN_MODELS`` or a local Hugging Face folder."""
    method: str = "ar"
    method_config: Any = None
    """The method's frozen configuration dataclass; None means its defaults."""
    model_id: str | None = None
    """None derives one from the model, method, options, dtype and temperature."""
    answer_file: Path | None = None
    """None derives ``model_answer/<question file stem>/<model_id>.jsonl``."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    limit: int | None = None
    question_begin: int | None = None
    question_end: int | None = None
    categories: tuple[str, ...] | None = None
    threads: int | None = None
    warmup: int = 3
    """Runs of the first pending question discarded before timing (Spec-Bench: 3)."""
    progress: bool = True


@dataclass(frozen=True)
class RunSummary:
    """What a run did: answers written now, skipped as already present, and pooled statistics."""

    answer_file: Path
    model_id: str
    written: int
    skipped: int
    new_tokens: int = 0
    wall_time: float = 0.0
    accept_lengths: tuple[int, ...] = field(default=(), repr=False)

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.wall_time if self.wall_time > 0 else 0.0


def _model_name(model: str) -> str:
    from mtprobe.models import KNOWN_MODELS

    if model in KNOWN_MODELS:
        return model
    return Path(model).expanduser().resolve().name or "model"


def default_model_id(
    model: str, method: Method, config: Any, dtype: str, temperature: float, max_new_tokens: int
) -> str:
    """Spec-Bench-style id, e.g. ``smollm2-135m-probe-bc30-k1-tree-static-pruneTrue-init-prompt_mean-lam0.1-float32-temp-0.0``.

    A non-default ``max_new_tokens`` is part of the id so that resuming never mixes answer lengths.
    """
    parts = [_model_name(model), method.name]
    suffix = method.id_suffix(config)
    if suffix:
        parts.append(suffix)
    parts += [dtype, f"temp-{float(temperature)}"]
    if max_new_tokens != DEFAULT_MAX_NEW_TOKENS:
        parts.append(f"max{max_new_tokens}")
    return "-".join(parts)


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


def read_answer_file(path: Path, model_id: str | None = None) -> dict[int, dict]:
    """Answer lines already in ``path`` by question_id ({} if it does not exist).

    With ``model_id``, a line written for another model_id is refused (ValueError naming both), so
    a resumed run never mixes two configurations in one file.

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
            obj = _answer_line(path, lineno, raw, model_id)
            done[obj["question_id"]] = obj
    if tail.strip():
        lineno = len(lines) + 1
        try:
            json.loads(tail.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return done  # cut off by an interrupted write
        obj = _answer_line(path, lineno, tail, model_id)
        done[obj["question_id"]] = obj
    return done


def _answer_line(path: Path, lineno: int, raw: bytes, model_id: str | None) -> dict:
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
    return obj


def _end_with_complete_line(path: Path) -> int | None:
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


def encode_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], device: torch.device | str
) -> torch.Tensor:
    """Token ids ``[1, L]`` of a conversation under the tokenizer's chat template, ready to answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"the tokenizer ({type(tokenizer).__name__}) has no chat template; Spec-Bench questions are "
            "asked as a chat, so use a chat/instruct model whose tokenizer defines one"
        )
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    ids = enc if isinstance(enc, torch.Tensor) else enc["input_ids"]
    return ids.to(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def answer_question(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    method: Method,
    config: Any,
    question: Question,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Answer every turn of ``question``; return Spec-Bench's ``choices[0]`` dict."""
    device = model.device
    messages: list[dict[str, str]] = []
    turns: list[str] = []
    steps: list[int] = []
    new_tokens: list[int] = []
    wall_time: list[float] = []
    accept_lengths: list[int] = []
    for text in question.turns:
        messages.append({"role": "user", "content": text})
        input_ids = encode_conversation(tokenizer, messages, device)
        _sync(device)
        t0 = time.perf_counter()
        out = method.run(model, input_ids, config, max_new_tokens)
        _sync(device)
        elapsed = time.perf_counter() - t0
        answer = tokenizer.decode(out.new_ids, skip_special_tokens=True).strip()
        turns.append(answer)
        steps.append(int(out.decoding_steps))
        new_tokens.append(int(out.new_ids.shape[0]))
        wall_time.append(elapsed)
        accept_lengths.extend(int(a) for a in out.accept_lengths)
        messages.append({"role": "assistant", "content": answer})  # the next turn sees the model's own answer
    return {
        "index": 0,
        "turns": turns,
        "decoding_steps": steps,
        "new_tokens": new_tokens,
        "wall_time": wall_time,
        "accept_lengths": accept_lengths,
    }


def _resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _sort_answer_file(path: Path) -> None:
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


def _log(msg: str) -> None:
    print(f"mtprobe.specbench: {msg}", file=sys.stderr, flush=True)


def run(
    cfg: RunConfig, *, model: PreTrainedModel | None = None, tokenizer: PreTrainedTokenizerBase | None = None
) -> RunSummary:
    """Generate answers for the selected questions not yet in the answer file; return a summary.

    ``model`` and ``tokenizer`` may be passed already loaded (``cfg.model`` still names them in the
    default model_id); otherwise ``mtprobe.models.load(cfg.model, dtype=cfg.dtype)`` loads them.
    """
    from mtprobe import models

    method = get_method(cfg.method)
    method.check_temperature(cfg.temperature)
    config = cfg.method_config if cfg.method_config is not None else method.make_config()
    if not isinstance(config, method.config_type):
        raise TypeError(
            f"method {method.name!r} takes a {method.config_type.__name__}, got {type(config).__name__}"
        )
    if cfg.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {cfg.max_new_tokens}")
    if cfg.warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {cfg.warmup}")
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise ValueError(f"threads must be >= 1, got {cfg.threads}")
        torch.set_num_threads(cfg.threads)

    questions = load_questions(cfg.question_file, begin=cfg.question_begin, end=cfg.question_end)
    questions = select_questions(questions, categories=cfg.categories, limit=cfg.limit)
    model_id = cfg.model_id or default_model_id(
        cfg.model, method, config, cfg.dtype, cfg.temperature, cfg.max_new_tokens
    )
    answer_file = (
        Path(cfg.answer_file)
        if cfg.answer_file is not None
        else default_answer_file(cfg.question_file, model_id)
    )
    done = read_answer_file(answer_file, model_id)
    pending = [q for q in questions if q.question_id not in done]
    skipped = len(questions) - len(pending)
    if skipped:
        _log(f"{skipped} of {len(questions)} questions already answered in {answer_file}; skipping them")
    if not pending:
        return RunSummary(answer_file, model_id, written=0, skipped=skipped)

    if model is None or tokenizer is None:
        model, tokenizer = models.load(cfg.model, dtype=cfg.dtype, device=_resolve_device(cfg.device))
    _log(f"{model_id}: {len(pending)} questions -> {answer_file}")
    answer_file.parent.mkdir(parents=True, exist_ok=True)
    dropped = _end_with_complete_line(answer_file)
    if dropped is not None:
        _log(
            f"line {dropped} of {answer_file} was cut off by an interrupted run: dropped, its question counts as unanswered"
        )

    total_tokens, total_time, pooled = 0, 0.0, []
    with torch.inference_mode():
        for i in range(cfg.warmup):  # Spec-Bench: the first question, three times, discarded
            torch.manual_seed(cfg.seed)
            answer_question(model, tokenizer, method, config, pending[0], cfg.max_new_tokens)
            _log(f"warm-up {i + 1}/{cfg.warmup} done")

        bar = _progress(pending, cfg.progress, model_id)
        for q in bar:
            torch.manual_seed(cfg.seed)  # Spec-Bench seeds every question (with the choice index 0)
            choice = answer_question(model, tokenizer, method, config, q, cfg.max_new_tokens)
            line = {
                "question_id": q.question_id,
                "category": q.category,
                "answer_id": _answer_id(),
                "model_id": model_id,
                "choices": [choice],
                "tstamp": time.time(),
            }
            with open(answer_file, "a", encoding="utf-8") as f:
                f.write(json.dumps(line) + "\n")  # one write per line: an interrupted run loses at most one
            total_tokens += sum(choice["new_tokens"])
            total_time += sum(choice["wall_time"])
            pooled.extend(choice["accept_lengths"])
            if hasattr(bar, "set_postfix"):
                tau = sum(pooled) / max(1, len(pooled))
                bar.set_postfix(tau=f"{tau:.3f}", tok_s=f"{total_tokens / max(total_time, 1e-9):.1f}")
        if hasattr(bar, "close"):
            bar.close()
    _sort_answer_file(answer_file)
    summary = RunSummary(
        answer_file, model_id, len(pending), skipped, total_tokens, total_time, tuple(pooled)
    )
    _log(
        f"wrote {summary.written} answers to {answer_file}: tau {summary.tau:.3f}, "
        f"{summary.tokens_per_second:.2f} tokens/s"
    )
    return summary


def _progress(items: list[Question], enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm comes with transformers; fall back silently if it is missing
        return items
    return tqdm(items, desc=desc, unit="q", dynamic_ncols=True)
