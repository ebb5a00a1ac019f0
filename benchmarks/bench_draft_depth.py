#!/usr/bin/env python
"""τ of draft-model decoding with the layer-truncated self-draft, by draft depth.

The default draft of ``mtprobe.DraftModelConfig`` is the target's own first layers, final norm and
head. This measures how many tokens per target forward such drafts buy at each depth (greedy,
every run checked token-identical to greedy ``model.generate``). τ does not depend on the machine.

    python benchmarks/bench_draft_depth.py --question-file ../shared/specbench/question-dev.jsonl \
        --layers 4 8 12 16 20 24 --out benchmarks/results/bench_draft_depth.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, run_lines, write_report
from mtprobe import models
from mtprobe.specbench.questions import first_per_category, load_questions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 12, 16, 20, 24])
    ap.add_argument("--num-tokens", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/bench_draft_depth.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    total_layers = model.config.num_hidden_layers
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = [ids for _, ids in first_turn_prompts(tok, questions)]
    refs = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for ids in prompts]
    rows = []
    for layers in args.layers:
        cfg = mtprobe.DraftModelConfig(num_draft_layers=layers, num_tokens=args.num_tokens)
        gained, steps, bad, t0 = 0, 0, 0, time.perf_counter()
        for ids, ref in zip(prompts, refs, strict=True):
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens)
            bad += not torch.equal(out.sequences, ref)
            gained += sum(out.accept_lengths)
            steps += len(out.accept_lengths)
        tau = gained / max(1, steps)
        # acceptance of one draft = (τ - 1) / K: the share of drafted tokens the target kept
        rows.append(
            f"| {layers} / {total_layers} | {tau:.3f} | {(tau - 1) / args.num_tokens:.3f} | "
            f"{time.perf_counter() - t0:.0f} | {bad} |"
        )
        print(rows[-1], file=sys.stderr)
    lines = [
        "# Draft-model decoding with the layer-truncated self-draft: τ by draft depth",
        "",
        *run_lines(args.model),
        f"- questions: first turn of the first {args.per_category} question(s) of every category of "
        f"`{Path(args.question_file).name}` ({len(questions)} questions), greedy, "
        f"max_new_tokens={args.max_new_tokens}, K = {args.num_tokens} drafts per step",
        "- τ = tokens gained per target decode forward; seconds are wall time of the whole depth's runs "
        "(draft and target forwards, on a shared machine: indicative only)",
        "",
        "| draft layers | τ | accepted share of drafts | seconds | differs from greedy |",
        "|---|---|---|---|---|",
        *rows,
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
