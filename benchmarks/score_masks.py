#!/usr/bin/env python
"""Held-out scores of calibrated mask files side by side (``mtprobe.offline.calibrate.score_calibration``).

Every file is scored on the same greedy continuations: the last ``--holdout`` of mtprobe's 24 built-in
prompts, the ones ``python -m mtprobe calibrate`` holds out, generated here in one batch. Per mask j:
the loss and top-1 of its prediction of the token j + 1 after its node; the first row is seed 001's
soft start (each prompt's mean embedding) for the same number of masks.

    python benchmarks/score_masks.py --num-masks 2 \\
        benchmarks/results/calibrate/masks-smollm2-135m-k2-offsets.safetensors \\
        benchmarks/results/calibrate/masks-smollm2-135m-k2-lora8.safetensors \\
        --out benchmarks/results/calibrate/score_k2.md
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from _common import run_lines, write_report
from mtprobe import models
from mtprobe.data import encode_conversation, load_prompts
from mtprobe.offline.calibrate import score_calibration
from mtprobe.target_model.mask_calibration import load_calibration


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="mask calibration files (safetensors)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-masks", type=int, default=2, help="score each file's first N masks")
    parser.add_argument("--holdout", type=int, default=4, help="the last N built-in prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=None, help="write the Markdown table here too")
    args = parser.parse_args(argv)
    if not 1 <= args.holdout <= 24:
        parser.error(f"--holdout {args.holdout} must be between 1 and 24 (mtprobe has 24 built-in prompts)")
    if args.threads:
        torch.set_num_threads(args.threads)
    cals = {}
    for f in args.files:
        try:
            cals[f] = load_calibration(f)
        except (OSError, ValueError) as e:
            parser.error(str(e))
    model, tokenizer = models.load(args.model)
    prompts = [encode_conversation(tokenizer, p["messages"], "cpu") for p in load_prompts(None)]
    held = prompts[-args.holdout :]
    k = args.num_masks
    started = time.perf_counter()
    rows = [("seed 001's soft start (prompt mean)", None)] + [(Path(f).name, cals[f]) for f in args.files]
    header = (
        "| masks | pooled loss | top-1 | " + " | ".join(f"mask {j + 1} top-1 (loss)" for j in range(k)) + " |"
    )
    lines = [header, "|" + " --- |" * (3 + k)]
    for name, cal in rows:
        try:
            s = score_calibration(
                model, cal, held, num_masks=k, max_new_tokens=args.max_new_tokens, gen_batch_size=len(held)
            )
        except ValueError as e:
            parser.error(f"{name}: {e}")
        by = s.get("by_mask", [{"loss": s["loss"], "top1": s["top1"]}])
        cells = " | ".join(f"{b['top1']:.3f} ({b['loss']:.3f})" for b in by)
        lines.append(f"| {name} | {s['loss']:.3f} | {s['top1']:.3f} | {cells} |")
        print(lines[-1], flush=True)
    lines += [
        "",
        f"{k} mask(s), the last {args.holdout} built-in prompts' greedy continuations ({args.max_new_tokens} new "
        f"tokens, generated in one batch), {s['targets'] // k} targets per mask, {time.perf_counter() - started:.0f} s.",
        "",
        *run_lines(args.model),
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
