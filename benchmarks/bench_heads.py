#!/usr/bin/env python
"""Probabilistic-circuit heads (MTPC, seed 003) on Spec-Bench questions: τ, tokens/s and the head's
per-step cost, next to training-free drafters at the same block complexity.

The shape of seed 003's Tables 6 and 7 at this machine's scale: one row per trained head (circuit,
window n, rank r) and per BC, greedy; every run is checked token-identical to greedy
``model.generate``. The head's cost is the mean time of one ``CircuitHead.step_params`` call (what the
drafter calls once per step) over the mean time of one single-token decode forward of the backbone with
a KV cache of the prompt's length, both on this machine, same threads.

    python benchmarks/bench_heads.py --question-file ../shared/specbench/question-dev.jsonl \\
        --heads DIR [DIR ...] --baselines stand hybrid-cal --mask-path FILE \\
        --out benchmarks/results/heads/bench_heads.md
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, run_lines, write_report
from bench_baselines import configs as baseline_configs
from mtprobe import heads, models
from mtprobe.specbench.questions import first_per_category, load_questions


def head_cost(model, head: heads.CircuitHead, ids: torch.Tensor, repeats: int = 30) -> tuple[float, float]:
    """(seconds per step_params call, seconds per single-token decode forward with ``ids`` cached)."""
    with torch.no_grad():
        out = model(ids, use_cache=True, output_hidden_states=True)
        hidden, logits = out.hidden_states[-1][0, -1], out.logits[0, -1]
        head.step_params(hidden, logits)  # warm-up (and E C precomputed once, as in decoding)
        t0 = time.perf_counter()
        for _ in range(repeats):
            head.step_params(hidden, logits)
        head_s = (time.perf_counter() - t0) / repeats
        nxt = logits.argmax().view(1, 1)
        fwd = []
        for _ in range(repeats):
            cache = out.past_key_values
            t0 = time.perf_counter()
            model(nxt, past_key_values=cache, use_cache=True)
            fwd.append(time.perf_counter() - t0)
            cache.crop(-1)  # back to the prompt, so every forward sees the same context
    return head_s, sorted(fwd)[len(fwd) // 2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads", nargs="+", required=True, help="head checkpoint folders")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--block-complexity", type=int, nargs="+", default=[30])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--baselines", nargs="*", default=["stand"], help="rows of bench_baselines.py to add")
    ap.add_argument("--mask-path", default=None, help="mask calibration for the *-cal baseline rows")
    ap.add_argument("--out", default="benchmarks/results/heads/bench_heads.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = first_turn_prompts(tok, questions)
    costs = {}  # path -> head cost, measured first (a broken head fails before the long runs)
    for path in args.heads:
        head_s, fwd_s = head_cost(model, heads.load_head(path, model), prompts[0][1])
        costs[path] = head_s / fwd_s
    t0 = time.perf_counter()
    refs = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts]
    ref_s = time.perf_counter() - t0
    new_tokens = sum(r.shape[1] - ids.shape[1] for r, (_, ids) in zip(refs, prompts, strict=True))

    rows = []  # (bc, name, {task: tau}, mismatches, tok/s, head cost or None)
    for bc in args.block_complexity:
        runs: dict[str, tuple[object, float | None]] = {}
        for name, cfg in baseline_configs(bc, args.mask_path).items():
            if name in args.baselines:
                runs[name] = (cfg, None)
        for path in args.heads:
            head = heads.load_head(path, model)
            s = head.spec
            name = f"{s.circuit} n{s.window} r{head.r}" + (
                f" ρ{s.adapter_rank}" if s.emission == "lowrank" else ""
            )
            runs[name] = (mtprobe.HeadsConfig(path=path, block_complexity=bc), costs[path])
        for name, (cfg, cost) in runs.items():
            t0 = time.perf_counter()
            per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            bad = 0
            for (q, ids), ref in zip(prompts, refs, strict=True):
                out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens, do_sample=False)
                bad += not torch.equal(out.sequences, ref)
                for key in (q.task, "all"):
                    per_task[key][0] += sum(out.accept_lengths)
                    per_task[key][1] += len(out.accept_lengths)
            taus = {k: g / max(1, n) for k, (g, n) in per_task.items()}
            rows.append((bc, name, taus, bad, new_tokens / (time.perf_counter() - t0), cost))
            print(f"BC {bc} {name}: tau {taus['all']:.3f} [{time.perf_counter() - t0:.0f}s]", file=sys.stderr)

    tasks = sorted({t for _, _, taus, _, _, _ in rows for t in taus if t != "all"})
    lines = [
        "# Probabilistic-circuit heads against training-free drafters (τ, greedy)",
        "",
        *run_lines(args.model),
        f"- questions: first turn of the first {args.per_category} question(s) of every category of "
        f"`{Path(args.question_file).name}` ({len(questions)} questions), greedy, max_new_tokens={args.max_new_tokens}",
        f"- tok/s: new tokens over wall time of all questions, one process, {torch.get_num_threads()} torch "
        f"thread(s); greedy HF `model.generate`: {new_tokens / ref_s:.2f} tok/s ({new_tokens} tokens in {ref_s:.0f} s)",
        "- τ = tokens gained per decode forward (prefill not counted); heads rows: HeadsConfig(path, "
        "block_complexity=BC), circuit, window n, rank r, adapter rank ρ; head cost = one step_params call "
        "over one single-token decode forward (median of 30, the first question's prompt cached)",
        "",
        "| BC | drafter | τ | " + " | ".join(tasks) + " | tok/s | head cost | mismatches |",
        "|---|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for bc, name, taus, bad, tok_s, cost in rows:
        cells = " | ".join(f"{taus.get(t, float('nan')):.3f}" for t in tasks)
        c = "" if cost is None else f"{100 * cost:.1f} %"
        lines.append(f"| {bc} | {name} | **{taus['all']:.3f}** | {cells} | {tok_s:.2f} | {c} | {bad} |")
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
