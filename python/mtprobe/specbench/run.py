"""Answer generation in Spec-Bench's format (``python -m mtprobe.specbench run``).

Follows Spec-Bench's ``evaluation/eval.py`` (github.com/hemingkx/Spec-Bench): every conversation is
encoded with the model's chat template, turn by turn (the second MT-bench turn is asked after the
model's own first answer, the whole conversation re-encoded); only the generation call is timed
(with a device synchronisation on both sides); the first question is run ``warmup`` (3) times and
discarded before the timed run; one answer line is appended per question::

    {"question_id", "category", "answer_id", "model_id",
     "choices": [{"index": 0, "turns": [text per turn], "decoding_steps": [per turn],
                  "new_tokens": [per turn], "wall_time": [per turn], "accept_lengths": [flat],
                  "wall_times": [[per turn] per timed run]}],
     "tstamp", "mtprobe": {metadata}}

Every key Spec-Bench writes is there with its meaning unchanged, so Spec-Bench's own
``evaluation/speed.py`` reads these files; two keys are added:

* ``choices[0]["wall_times"]``: with ``repeats`` = N > 1 every question is generated N times in a
  row (each time from the same seed) and every run's per-turn wall times are kept here, the first
  run's being ``wall_time``. The texts and counts are the first run's; under greedy decoding every
  repeat must produce the same tokens (:class:`RepeatMismatchError` otherwise), so all timings time
  the same output. ``score`` and ``compare`` report the mean and spread over the runs.
* ``"mtprobe"``: the run's full configuration (:func:`run_metadata`): method and its configuration
  as a dict, model, dtype, device, threads, temperature, seed, max_new_tokens, repeats, draft model,
  the torch/transformers/mtprobe versions and the machine. It is on every line, so a file stays
  self-describing when lines are appended by a resumed run, and a resumed run whose settings differ
  from the file's is refused. The short ``model_id`` (:func:`default_model_id`,
  e.g. ``smollm2-135m-probe-bc30``) only names the run.

A shared n-gram memory (``--shared-ngram-memory [SIZE]``, methods ``stand`` and ``hybrid``;
``memory_size`` of their configuration) is one memory for all the run's questions: it starts empty,
is emptied again after the warm-up, and each question drafts from the answers of the questions
before it (a resumed run starts it empty at the first unanswered question). Repeats above 1 are
refused with it, since a repeat would draft its own earlier answer.

Sampling: with ``temperature`` T > 0 every method decodes with ``do_sample=True, temperature=T``
(mtprobe's sampling is exact in distribution; ``ar`` is HF ``generate``); the seed is set before every
question as for greedy decoding.

Differences from Spec-Bench, on purpose: the chat template is the tokenizer's own rather than a
FastChat conversation template, answers are decoded with ``skip_special_tokens=True`` and stripped
(instead of cutting at the template's stop string), and a failing generation stops the run instead
of writing ``"ERROR"`` (re-running resumes after the questions already answered; a last line that an
interruption cut off is dropped from the file and its question answered again).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import sys
import time
import uuid
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from tqdm.auto import tqdm

from mtprobe import models
from mtprobe.data import encode_conversation
from mtprobe.drafters import ngram_memories
from mtprobe.specbench.methods import Method, get_method, run_method
from mtprobe.specbench.questions import Question, first_per_category, load_questions, select_questions
from mtprobe.specbench.score import setup_value

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "METADATA_KEY",
    "RepeatMismatchError",
    "RunConfig",
    "RunSummary",
    "answer_question",
    "default_answer_file",
    "default_model_id",
    "encode_conversation",
    "read_answer_file",
    "run",
    "run_metadata",
]

DEFAULT_MAX_NEW_TOKENS = 1024  # Spec-Bench's default
METADATA_KEY = "mtprobe"
"""Key of the run's configuration on every answer line (Spec-Bench ignores keys it does not know)."""
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


class RepeatMismatchError(RuntimeError):
    """A repeated timing run of a question produced other tokens than its first run (greedy decoding)."""


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
    """None derives a short one from the model, method, headline options, dtype and temperature."""
    answer_file: Path | None = None
    """None derives ``model_answer/<question file stem>/<model_id>.jsonl``."""
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    """0: greedy decoding; T > 0: sampling with ``do_sample=True, temperature=T`` for every method."""
    seed: int = 0
    dtype: str = "float32"
    device: str = "auto"
    limit: int | None = None
    question_begin: int | None = None
    question_end: int | None = None
    categories: tuple[str, ...] | None = None
    per_category: int | None = None
    """Keep only the first N questions of every category (before ``limit``): a small subset that still
    covers every task and MT-bench sub-category."""
    first_turn_only: bool = False
    """Ask only the first turn of every question (MT-bench has two): shorter runs; Spec-Bench asks all."""
    threads: int | None = None
    warmup: int = 3
    """Runs of the first pending question discarded before timing (Spec-Bench: 3)."""
    progress: bool = True
    repeats: int = 1
    """Timed runs of every question (all wall times are kept; the first run's answer is written)."""
    draft_model: str | None = None
    """For ``sps``: a known model name or local folder loaded as the draft model (same tokenizer as
    the target). None keeps the method configuration's own draft: the target's layer-truncated copy."""

    def __post_init__(self) -> None:
        if isinstance(self.repeats, bool) or not isinstance(self.repeats, int) or self.repeats < 1:
            raise ValueError(f"repeats must be an int >= 1 (timed runs per question), got {self.repeats!r}")
        if self.draft_model is not None and self.method != "sps":
            raise ValueError(
                f"draft_model={self.draft_model!r} is for method 'sps' (draft-model speculative decoding), "
                f"not {self.method!r}"
            )


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
    if model in models.KNOWN_MODELS:
        return model
    return Path(model).expanduser().resolve().name or "model"


def default_model_id(
    model: str,
    method: Method,
    config: Any,
    dtype: str = "float32",
    temperature: float = 0.0,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    draft_model: str | None = None,
) -> str:
    """A short readable id: model, method, its headline options and those that differ from its defaults,
    then the draft model, a dtype other than float32 and a temperature other than 0, e.g.
    ``smollm2-135m-probe-bc30``, ``smollm2-135m-ar-t1``, ``smollm2-135m-sps-n5-draft-tiny``.

    The full configuration (``max_new_tokens`` included) goes into each answer line's ``"mtprobe"``
    metadata instead; a resumed run that differs from it on any setting that changes the answers is
    refused, so two runs never mix in one file even where their ids agree.
    """
    del max_new_tokens  # in the metadata, not in the id
    parts = [_model_name(model), method.name]
    suffix = method.id_suffix(config)
    if suffix:
        parts.append(suffix)
    if draft_model is not None:
        parts.append(f"draft-{_model_name(draft_model)}")
    if dtype != "float32":
        parts.append({"bfloat16": "bf16", "float16": "fp16"}.get(dtype, dtype))
    if temperature:
        parts.append(f"t{float(temperature):g}")
    return "-".join(parts)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, Path):
        return str(value)
    # A model object (DraftModelConfig.draft_model): its class and where it came from.
    name = getattr(getattr(value, "config", None), "_name_or_path", "") or ""
    return f"{type(value).__name__}({name})" if name else type(value).__name__


def config_dict(config: Any) -> dict[str, Any]:
    """A method configuration as a JSON-able dict: its ``to_dict()`` where it has one, else its fields."""
    draft = getattr(config, "draft_model", None)
    if draft is not None and dataclasses.is_dataclass(config):
        # a live model object cannot go into JSON: the configuration without it, the model named
        out = config_dict(dataclasses.replace(config, draft_model=None))
        out["draft_model"] = _jsonable(draft)
        return out
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        return _jsonable(to_dict())
    if dataclasses.is_dataclass(config):
        return {f.name: _jsonable(getattr(config, f.name)) for f in dataclasses.fields(config)}
    return {"repr": repr(config)}


def _machine(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def run_metadata(
    cfg: RunConfig, method: Method, config: Any, model: PreTrainedModel | None
) -> dict[str, Any]:
    """The ``"mtprobe"`` metadata of ``cfg``'s answer lines: everything needed to reproduce the run."""
    device = model.device if model is not None else _resolve_device(cfg.device)
    meta: dict[str, Any] = {
        "method": method.name,
        "method_config": config_dict(config),
        "model": _model_name(cfg.model),
        "model_path": str(cfg.model),
        "dtype": cfg.dtype,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "temperature": float(cfg.temperature),
        "do_sample": cfg.temperature > 0,
        "seed": cfg.seed,
        "max_new_tokens": cfg.max_new_tokens,
        "first_turn_only": cfg.first_turn_only,
        "repeats": cfg.repeats,
        "warmup": cfg.warmup,
        "draft_model": cfg.draft_model,
        "versions": {
            "mtprobe": version("mtprobe"),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "machine": _machine(device),
    }
    if cfg.draft_model is not None:
        meta["method_config"]["draft_model"] = cfg.draft_model  # the name given, not the loaded object
    gen = getattr(model, "generation_config", None)
    if cfg.temperature > 0 and gen is not None:
        # what model.generate(do_sample=True) applies on top of the temperature, for every method alike
        meta["top_k"], meta["top_p"] = getattr(gen, "top_k", None), getattr(gen, "top_p", None)
    return meta


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
    temperature: float = 0.0,
) -> dict[str, Any]:
    """Answer every turn of ``question``; return Spec-Bench's ``choices[0]`` dict.

    ``temperature`` > 0 samples (``do_sample=True``); the caller seeds torch before the call."""
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
        out = run_method(method, model, input_ids, config, max_new_tokens, temperature=temperature)
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
    With ``cfg.draft_model`` (method ``sps``) the draft model is loaded the same way.
    """
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
    if cfg.draft_model is not None and getattr(config, "draft_model", None) is not None:
        raise ValueError(
            "draft_model is given twice: as RunConfig.draft_model and inside the method configuration; "
            "give one of them"
        )
    if cfg.repeats > 1 and _shares_ngram_memory(config):
        raise ValueError(
            f"repeats={cfg.repeats} with a shared n-gram memory (memory_size={_shares_ngram_memory(config)}): "
            "every repeat of a question would draft the previous run's answer from the memory, so the "
            "timed runs would not time the same decoding; use repeats 1 (--repeats 1) with "
            "--shared-ngram-memory"
        )
    if cfg.threads is not None:
        if cfg.threads < 1:
            raise ValueError(f"threads must be >= 1, got {cfg.threads}")
        torch.set_num_threads(cfg.threads)

    questions = load_questions(cfg.question_file, begin=cfg.question_begin, end=cfg.question_end)
    if cfg.per_category is not None:
        questions = first_per_category(questions, cfg.per_category)
    questions = select_questions(questions, categories=cfg.categories, limit=cfg.limit)
    if not questions:
        raise ValueError(
            f"no questions selected from {cfg.question_file} (question_begin={cfg.question_begin}, "
            f"question_end={cfg.question_end}, per_category={cfg.per_category}, categories={cfg.categories}, "
            f"limit={cfg.limit}); widen the selection"
        )
    if cfg.first_turn_only:
        questions = [dataclasses.replace(q, turns=q.turns[:1]) for q in questions]
    model_id = cfg.model_id or default_model_id(
        cfg.model, method, config, cfg.dtype, cfg.temperature, cfg.max_new_tokens, cfg.draft_model
    )
    answer_file = (
        Path(cfg.answer_file)
        if cfg.answer_file is not None
        else default_answer_file(cfg.question_file, model_id)
    )
    done = read_answer_file(answer_file, model_id, run_metadata(cfg, method, config, model))
    pending = [q for q in questions if q.question_id not in done]
    skipped = len(questions) - len(pending)
    if skipped:
        _log(f"{skipped} of {len(questions)} questions already answered in {answer_file}; skipping them")
    if not pending:
        return RunSummary(answer_file, model_id, written=0, skipped=skipped)

    if model is None or tokenizer is None:
        model, tokenizer = models.load(cfg.model, dtype=cfg.dtype, device=_resolve_device(cfg.device))
    if cfg.draft_model is not None:
        draft, _ = models.load(cfg.draft_model, dtype=cfg.dtype, device=model.device)
        config = dataclasses.replace(config, draft_model=draft)
    meta = run_metadata(cfg, method, config, model)
    _log(f"{model_id}: {len(pending)} questions x {cfg.repeats} timed run(s) -> {answer_file}")
    if _shares_ngram_memory(config) is not None:
        _log(f"one shared n-gram memory of {_shares_ngram_memory(config)} keys across the run's questions")
    answer_file.parent.mkdir(parents=True, exist_ok=True)
    dropped = _end_with_complete_line(answer_file)
    if dropped is not None:
        _log(
            f"line {dropped} of {answer_file} was cut off by an interrupted run: dropped, its question counts as unanswered"
        )

    def answer(q: Question) -> dict[str, Any]:
        torch.manual_seed(cfg.seed)  # Spec-Bench seeds every question (with the choice index 0)
        return answer_question(model, tokenizer, method, config, q, cfg.max_new_tokens, cfg.temperature)

    # A shared n-gram memory (--shared-ngram-memory) starts empty, and what the warm-up folded into
    # it is forgotten: the timed questions see only the answers of the questions before them.
    memories = ngram_memories(model, config)
    total_tokens, total_time, pooled = 0, 0.0, []
    with torch.inference_mode():
        for memory in memories:
            memory.clear()
        for i in range(cfg.warmup):  # Spec-Bench: the first question, three times, discarded
            answer(pending[0])
            _log(f"warm-up {i + 1}/{cfg.warmup} done")
        for memory in memories:
            memory.clear()

        bar = _progress(pending, cfg.progress, model_id)
        for q in bar:
            choice = answer(q)
            wall_times = [list(choice["wall_time"])]
            for r in range(1, cfg.repeats):
                again = answer(q)
                _check_repeat(q, choice, again, r, cfg)
                wall_times.append(list(again["wall_time"]))
            choice["wall_times"] = wall_times
            line = {
                "question_id": q.question_id,
                "category": q.category,
                "answer_id": _answer_id(),
                "model_id": model_id,
                "choices": [choice],
                "tstamp": time.time(),
                METADATA_KEY: meta,
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
        f"{summary.tokens_per_second:.2f} tokens/s (first timed runs)"
    )
    return summary


def _shares_ngram_memory(config: Any) -> int | None:
    """The memory size of a configuration that drafts from a cross-request n-gram memory (an AutoConfig's
    drafters included), else None."""
    for c in (config, *getattr(config, "drafters", ())):
        if getattr(c, "memory_size", None) is not None:
            return c.memory_size
    return None


def _check_repeat(q: Question, first: dict[str, Any], again: dict[str, Any], r: int, cfg: RunConfig) -> None:
    """Under greedy decoding a repeat must reproduce the first run's output, or its timing would time
    another answer; under sampling (same seed) a difference means non-deterministic kernels: logged."""
    same = first["turns"] == again["turns"] and first["new_tokens"] == again["new_tokens"]
    if same:
        return
    turn = next(
        (
            t + 1
            for t, (a, b) in enumerate(zip(first["turns"], again["turns"], strict=False))
            if a != b or first["new_tokens"][t] != again["new_tokens"][t]
        ),
        len(first["turns"]),
    )
    what = (
        f"question {q.question_id} ({q.category}): timed run {r + 1} of {cfg.repeats} produced other tokens "
        f"than the first run in turn {turn} ({first['new_tokens']} vs {again['new_tokens']} new tokens)"
    )
    if cfg.temperature > 0:
        _log(f"{what}; sampling with the same seed should repeat itself: non-deterministic kernels?")
        return
    raise RepeatMismatchError(
        f"{what}, under greedy decoding: the method is not deterministic, so the repeated timings would "
        "time different answers; run with --repeats 1, or fix the method"
    )


def _progress(items: list[Question], enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    return tqdm(items, desc=desc, unit="q", dynamic_ncols=True)
