"""The prefill's LM head over the prompt: prompt lookup with it skipped (the default since the
drafter does not read the prompt's logits) against the same method forced to compute it, beside HF
greedy, on long-prompt Spec-Bench questions. A/B on the same code, interleaved, medians of repeats.
This is a benchmark: nothing here asserts a speed.

    python benchmarks/bench_prefill_logits.py --question-file ../shared/specbench/question-dev.jsonl \\
        --categories rag,summarization --per-category 2 --repeats 3 \\
        --out benchmarks/results/prefill_logits.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers

import mtprobe
from _common import load_average
from mtprobe import models
from mtprobe.data import encode_conversation


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", type=Path, required=True)
    ap.add_argument("--categories", default="rag,summarization")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = models.load("smollm2-135m")
    wanted = args.categories.split(",")
    questions, seen = [], dict.fromkeys(wanted, 0)
    for line in args.question_file.read_text(encoding="utf-8").splitlines():
        q = json.loads(line)
        if q["category"] in seen and seen[q["category"]] < args.per_category:
            seen[q["category"]] += 1
            questions.append(q)
    skip = mtprobe.PromptLookupConfig(num_tokens=10)
    load0 = load_average()
    rows = []
    for q in questions:
        ids = encode_conversation(tok, [{"role": "user", "content": q["turns"][0]}], "cpu")  # [1, L]
        ref = model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
        times: dict[str, list[float]] = {"hf": [], "skip": [], "full": []}
        prefill: dict[str, list[float]] = {"skip": [], "full": []}
        for _ in range(args.repeats + 1):  # the first round warms up and is dropped
            t = time.perf_counter()
            model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens)
            times["hf"].append(time.perf_counter() - t)
            for mode in ("skip", "full"):
                # "full": the same drafter, told that it reads the prompt's logits (as STAND does).
                type(skip).prompt_logit_rows = None if mode == "full" else 1
                try:
                    t = time.perf_counter()
                    out = mtprobe.generate(
                        model, ids, skip, max_new_tokens=args.max_new_tokens, do_sample=False
                    )
                    times[mode].append(time.perf_counter() - t)
                finally:
                    type(skip).prompt_logit_rows = 1
                assert torch.equal(out.sequences, ref), q["question_id"]
                prefill[mode].append(out.timings["prefill_s"])
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        pre = {k: statistics.median(v[1:]) for k, v in prefill.items()}
        rows.append(
            f"| {q['category']} {q['question_id']} | {ids.shape[1]} | {med['hf']:.3f} | {med['full']:.3f} "
            f"({pre['full']:.3f}) | {med['skip']:.3f} ({pre['skip']:.3f}) | {med['hf'] / med['full']:.3f}× | "
            f"{med['hf'] / med['skip']:.3f}× |"
        )
        print(rows[-1], file=sys.stderr)
    load1 = load_average()
    text = [
        "# The prefill's LM head over the prompt: skipped vs computed (prompt lookup, 10 tokens)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads; torch "
        f"{torch.__version__}, transformers {transformers.__version__}; SmolLM2-135M-Instruct, float32, CPU; "
        f"load average {load0} → {load1}",
        f"- greedy, {args.max_new_tokens} new tokens, first turns; per question the median of {args.repeats} "
        "interleaved rounds (HF greedy, computed, skipped) after one warm-up round; every output identical "
        "to HF greedy",
        "",
        "| question | prompt tokens | HF greedy s | computed s (prefill s) | skipped s (prefill s) | "
        "speedup computed | speedup skipped |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    args.out.write_text("\n".join(text), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
