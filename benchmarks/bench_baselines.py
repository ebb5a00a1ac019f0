#!/usr/bin/env python
"""Probing against the training-free baselines at equal block complexity, per Spec-Bench task (τ).

The shape of seed 001's Table 1 and Figure 4: mask-token probing, STAND, lookahead (LADE) and
prompt lookup at BC 10, 30 and 60, τ per task, and the hybrid of probing and STAND (App. C). Prompt lookup drafts a chain of depth BC - 1 (at
most 10, the paper's depth), STAND a tree of BC - 1 nodes of depth at most 10, LADE runs the
paper's L/W/G for the BC (App. F: L3 W4 G1, L4 W5 G5, L5 W8 G7). Greedy; every run is checked
token-identical to greedy ``model.generate``. τ does not depend on the machine.

    python benchmarks/bench_baselines.py --question-file ../shared/specbench/question-dev.jsonl \
        --per-category 1 --max-new-tokens 48 --out benchmarks/results/bench_baselines.md
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
from mtprobe import models
from mtprobe.drafters.lookahead import LOOKAHEAD_PAPER_CONFIGS
from mtprobe.specbench.questions import first_per_category, load_questions
from mtprobe.target_model.mask_calibration import load_calibration

OURS = (
    "probe",
    "hybrid",
    "probe-cal",
    "probe-cal-lam0",
    "hybrid-cal",
    "hybrid-cal-lam0",
)  # the rest are the baselines


def configs(bc: int, mask_path: str | None = None) -> dict[str, object]:
    out: dict[str, object] = {
        "probe": mtprobe.ProbeConfig.paper(bc),  # the paper's settings (λ 0.1), not today's defaults
        "stand": mtprobe.StandConfig(block_complexity=bc),
        "pld": mtprobe.PromptLookupConfig(num_tokens=min(10, bc - 1)),
    }
    out["hybrid"] = mtprobe.HybridConfig(block_complexity=bc, num_masks=2 if bc >= 60 else 1, mask_lambda=0.1)
    if bc in LOOKAHEAD_PAPER_CONFIGS:  # the paper's (L, W, G), (L - 1)(W + G) = BC
        out["lade"] = mtprobe.LookaheadConfig.for_block_complexity(bc)
    if (
        mask_path is not None
    ):  # learned masks (python -m mtprobe calibrate), with and without the running update
        cal = dict(mask_init="calibrated", mask_path=mask_path)
        out["probe-cal"] = mtprobe.ProbeConfig(block_complexity=bc, mask_lambda=0.1, **cal)
        out["probe-cal-lam0"] = mtprobe.ProbeConfig(block_complexity=bc, mask_lambda=0.0, **cal)
        # two masks from BC 60 (the paper's choice) where the file holds them
        k = 2 if bc >= 60 and load_calibration(mask_path).num_masks >= 2 else 1
        out["hybrid-cal"] = mtprobe.HybridConfig(block_complexity=bc, num_masks=k, mask_lambda=0.1, **cal)
        out["hybrid-cal-lam0"] = mtprobe.HybridConfig(
            block_complexity=bc, num_masks=k, mask_lambda=0.0, **cal
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument(
        "--per-task", type=int, default=None, help="instead: the first N questions of each Spec-Bench task"
    )
    ap.add_argument("--block-complexity", type=int, nargs="+", default=[10, 30, 60])
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/bench_baselines.md")
    ap.add_argument(
        "--mask-path",
        default=None,
        help="a mask calibration (python -m mtprobe calibrate): adds probe-cal, hybrid-cal (lambda 0.1) and "
        "probe-cal-lam0, hybrid-cal-lam0 (lambda 0, the learned masks kept) rows",
    )
    ap.add_argument("--methods", nargs="+", default=None, help="only these rows (default: all)")
    args = ap.parse_args(argv)
    known = list(dict.fromkeys(m for bc in args.block_complexity for m in configs(bc, args.mask_path)))
    unknown = sorted(set(args.methods or ()) - set(known))
    if unknown:
        ap.error(f"--methods {' '.join(unknown)}: no such row; the rows are {', '.join(known)}")
    torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    questions = load_questions(args.question_file)
    if args.per_task is not None:
        counts: dict[str, int] = defaultdict(int)
        picked = []
        for q in questions:
            counts[q.task] += 1
            if counts[q.task] <= args.per_task:
                picked.append(q)
        questions = picked
    else:
        questions = first_per_category(questions, args.per_category)
    prompts = first_turn_prompts(tok, questions)
    t0 = time.perf_counter()
    refs = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts]
    ref_s = time.perf_counter() - t0
    new_tokens = sum(r.shape[1] - ids.shape[1] for r, (_, ids) in zip(refs, prompts, strict=True))
    results = []  # (bc, method, tau, {task: tau}, mismatches, tokens/s)
    for bc in args.block_complexity:
        for method, cfg in configs(bc, args.mask_path).items():
            if args.methods is not None and method not in args.methods:
                continue
            t0 = time.perf_counter()
            per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
            bad = 0
            for (q, ids), ref in zip(prompts, refs, strict=True):
                out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens)
                bad += not torch.equal(out.sequences, ref)
                for key in (q.task, "all"):
                    per_task[key][0] += sum(out.accept_lengths)
                    per_task[key][1] += len(out.accept_lengths)
            taus = {k: g / max(1, s) for k, (g, s) in per_task.items()}
            results.append((bc, method, taus, bad, new_tokens / (time.perf_counter() - t0)))
            print(
                f"BC {bc} {method}: tau {taus['all']:.3f} [{time.perf_counter() - t0:.0f}s]", file=sys.stderr
            )

    tasks = sorted({t for _, _, taus, _, _ in results for t in taus if t != "all"})
    selection = (
        f"the first {args.per_task} question(s) of every Spec-Bench task"
        if args.per_task is not None
        else f"the first {args.per_category} question(s) of every category"
    )
    lines = [
        "# Probing against training-free baselines at equal block complexity (τ)",
        "",
        *run_lines(args.model),
        f"- questions: first turn of {selection} of "
        f"`{Path(args.question_file).name}` ({len(questions)} questions), greedy, "
        f"max_new_tokens={args.max_new_tokens}",
        f"- tok/s: new tokens over wall time of all questions, one process, {torch.get_num_threads()} torch "
        f"thread(s), on a machine shared with other jobs (timings are indicative only); greedy HF "
        f"`model.generate`: {new_tokens / ref_s:.2f} tok/s ({new_tokens} tokens in {ref_s:.0f} s)",
        "- τ = tokens gained per decode forward, pooled over decode steps (prefill not counted); "
        "probe = ProbeConfig.paper(BC) (the paper's settings, λ 0.1), hybrid with λ 0.1, stand = StandConfig(block_complexity=BC), "
        "pld = PromptLookupConfig(num_tokens=min(10, BC - 1)), "
        "lade = LookaheadConfig.for_block_complexity(BC) (L3 W4 G1, L4 W5 G5, L5 W8 G7), "
        "hybrid = HybridConfig(block_complexity=BC) (one mask below BC 60, two from 60, as probe); "
        + (
            f"probe-cal, hybrid-cal / probe-cal-lam0, hybrid-cal-lam0: the same with mask_init='calibrated', "
            f"mask_path=`{Path(args.mask_path).name}` and mask_lambda 0.1 (the paper's running update on top) / "
            "0 (the learned masks kept); "
            if args.mask_path
            else ""
        )
        + "the ratio column is probe's (and hybrid's) τ over the best baseline's",
        "",
        "| BC | method | τ | " + " | ".join(tasks) + " | ÷ best baseline | tok/s | mismatches |",
        "|---|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for bc in args.block_complexity:
        rows = [r for r in results if r[0] == bc]
        baselines = [r[2]["all"] for r in rows if r[1] not in OURS]  # none when --methods left them out
        best_baseline = max(baselines, default=None)
        for _, method, taus, bad, tok_s in rows:
            ratio = f"{taus['all'] / best_baseline:.3f}" if method in OURS and best_baseline else ""
            cells = " | ".join(f"{taus.get(t, float('nan')):.3f}" for t in tasks)
            lines.append(
                f"| {bc} | {method} | **{taus['all']:.3f}** | {cells} | {ratio} | {tok_s:.2f} | {bad} |"
            )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
