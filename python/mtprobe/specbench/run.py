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
* ``"mtprobe"``: the run's full configuration (:func:`~mtprobe.specbench.metadata.run_metadata`):
  method and its configuration as a dict, model, dtype, device, threads, temperature, seed,
  max_new_tokens, repeats, draft model, the torch/transformers/mtprobe versions and the machine. It is
  on every line, so a file stays self-describing when lines are appended by a resumed run, and a
  resumed run whose settings differ from the file's is refused. The short ``model_id``
  (:func:`~mtprobe.specbench.metadata.default_model_id`, e.g. ``smollm2-135m-probe-bc30``) only names
  the run.

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

This module is the run loop; its configuration is :mod:`mtprobe.specbench.run_config`, the metadata
:mod:`mtprobe.specbench.metadata`, and the answer file's reading, resuming and writing
:mod:`mtprobe.specbench.answers`.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tqdm.auto import tqdm

from mtprobe import models
from mtprobe.data import encode_conversation
from mtprobe.drafters import ngram_memories
from mtprobe.specbench.answers import (
    append_answer,
    default_answer_file,
    end_with_complete_line,
    read_answer_file,
    sort_answer_file,
)
from mtprobe.specbench.metadata import default_model_id, run_metadata
from mtprobe.specbench.methods import Method, get_method, run_method
from mtprobe.specbench.questions import Question, first_per_category, load_questions, select_questions
from mtprobe.specbench.run_config import RunConfig, resolve_device

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "RepeatMismatchError",
    "RunSummary",
    "answer_question",
    "encode_conversation",
    "run",
]


class RepeatMismatchError(RuntimeError):
    """A repeated timing run of a question produced other tokens than its first run (greedy decoding)."""


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
        model, tokenizer = models.load(cfg.model, dtype=cfg.dtype, device=resolve_device(cfg.device))
    if cfg.draft_model is not None:
        draft, _ = models.load(cfg.draft_model, dtype=cfg.dtype, device=model.device)
        config = dataclasses.replace(config, draft_model=draft)
    meta = run_metadata(cfg, method, config, model)
    _log(f"{model_id}: {len(pending)} questions x {cfg.repeats} timed run(s) -> {answer_file}")
    if _shares_ngram_memory(config) is not None:
        _log(f"one shared n-gram memory of {_shares_ngram_memory(config)} keys across the run's questions")
    answer_file.parent.mkdir(parents=True, exist_ok=True)
    dropped = end_with_complete_line(answer_file)
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
            append_answer(answer_file, q, model_id, choice, meta)
            total_tokens += sum(choice["new_tokens"])
            total_time += sum(choice["wall_time"])
            pooled.extend(choice["accept_lengths"])
            if hasattr(bar, "set_postfix"):
                tau = sum(pooled) / max(1, len(pooled))
                bar.set_postfix(tau=f"{tau:.3f}", tok_s=f"{total_tokens / max(total_time, 1e-9):.1f}")
        if hasattr(bar, "close"):
            bar.close()
    sort_answer_file(answer_file)
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
