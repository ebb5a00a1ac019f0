#!/usr/bin/env python
"""τ of one drafter over a grid of its configuration's fields, on held-out tuning questions.

τ (tokens gained per decode forward) is deterministic under greedy decoding, so a sweep needs no quiet
machine. Questions are chosen per category with an offset, so that fields are tuned on questions that
the figures of record never use: ``--skip-per-category 5 --per-category 5`` takes the 6th to 10th
question of every category, which on Spec-Bench's dev split is 25 questions of the five 20-question
tasks (MT-bench's categories hold 2-3 questions each, none left after 5), none of them among the 45
(``--per-category 5``) that ``bench_suffix_decoding.py`` reports. Every answer is checked
token-identical to greedy ``model.generate``; a drafter with a cross-request memory starts each
configuration's run from an empty memory, questions in order.

    python benchmarks/sweep_tau.py --question-file ../shared/specbench/question-dev.jsonl \\
        --skip-per-category 5 --per-category 5 --method hybrid \\
        --base block_complexity=64 mask_init=calibrated mask_lambda=0 \\
            mask_path=benchmarks/results/calibrate/masks-smollm2-135m-k1-offsets.safetensors \\
        --grid max_depth=10,14,20 table_size=8,16 --out benchmarks/results/tau/sweep.md
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, run_lines, tau_counts, write_report
from mtprobe import models
from mtprobe.specbench.questions import load_questions

METHODS = {"stand": mtprobe.StandConfig, "probe": mtprobe.ProbeConfig, "hybrid": mtprobe.HybridConfig}


def parse_value(text: str) -> object:
    """A field's value as written on the command line: a Python literal (1, 0.5, None, True), else the
    text itself (a path)."""
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


def parse_fields(items: list[str], cls: type, many: bool) -> dict[str, object]:
    """``key=value`` (``many``: ``key=v1,v2,...``) items, each key a field of ``cls``."""
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{item!r}: expected key=value")
        if key not in names:
            raise SystemExit(
                f"{key!r} is not a field of {cls.__name__}; its fields: {', '.join(sorted(names))}"
            )
        out[key] = [parse_value(v) for v in value.split(",")] if many else parse_value(value)
    return out


def select(questions: list, skip: int, per_category: int) -> list:
    """The questions ``skip + 1`` to ``skip + per_category`` of every category, in file order."""
    seen: dict[str, int] = defaultdict(int)
    out = []
    for q in questions:
        seen[q.category] += 1
        if skip < seen[q.category] <= skip + per_category:
            out.append(q)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--skip-per-category", type=int, default=5)
    ap.add_argument("--per-category", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", choices=sorted(METHODS), required=True)
    ap.add_argument("--base", nargs="*", default=[], help="key=value fields every configuration shares")
    ap.add_argument(
        "--grid", nargs="*", default=[], help="key=v1,v2,... fields swept (every combination, in order)"
    )
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.skip_per_category < 0 or args.per_category < 1:
        raise SystemExit("--skip-per-category must be >= 0 and --per-category >= 1")
    cls = METHODS[args.method]
    base = parse_fields(args.base, cls, many=False)
    grid = parse_fields(args.grid, cls, many=True)
    combos = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    cfgs = [cls(**base, **combo) for combo in combos]  # every configuration validated before any run

    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model, dtype=torch.float32)
    questions = select(load_questions(args.question_file), args.skip_per_category, args.per_category)
    if not questions:
        raise SystemExit(f"no question left after skipping {args.skip_per_category} per category")
    prompts = first_turn_prompts(tok, questions)
    with torch.inference_mode():
        refs = [
            model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts
        ]
    tasks = sorted({q.task for q, _ in prompts})
    lines_head = [
        f"# τ of {cls.__name__} over a grid",
        "",
        *run_lines(args.model),
        f"- questions: first turns of the questions {args.skip_per_category + 1} to "
        f"{args.skip_per_category + args.per_category} of every category of `{Path(args.question_file).name}` "
        f"({len(questions)}: ids {', '.join(str(q.question_id) for q in questions)}), greedy, "
        f"max_new_tokens={args.max_new_tokens}",
        f"- every configuration: {cls.__name__}({', '.join(f'{k}={v!r}' for k, v in base.items())}, ...) with the "
        "swept fields below; τ = sum(accept_lengths) / decode forwards, pooled; mismatches: answers not "
        "token-identical to greedy `model.generate`",
        "",
        "| " + " | ".join(grid) + " | τ | " + " | ".join(tasks) + " | mismatches |",
        "|" + "---|" * (len(grid) + len(tasks) + 2),
    ]
    rows: list[str] = []
    for combo, cfg in zip(combos, cfgs, strict=True):
        t0 = time.perf_counter()
        per_task, _, bad = tau_counts(model, prompts, refs, cfg, args.max_new_tokens)
        tau = {k: v[0] / max(1, v[1]) for k, v in per_task.items()}
        print(
            f"{combo}: tau {tau['all']:.3f} mismatches {bad} [{time.perf_counter() - t0:.0f}s]",
            file=sys.stderr,
        )
        rows.append(
            "| "
            + " | ".join(str(v) for v in combo.values())
            + f" | **{tau['all']:.3f}** | "
            + " | ".join(f"{tau[t]:.3f}" for t in tasks)
            + f" | {bad} |"
        )
        Path(args.out).parent.mkdir(
            parents=True, exist_ok=True
        )  # rewritten per row: a cut run keeps its rows
        Path(args.out).write_text("\n".join([*lines_head, *rows]) + "\n")
    write_report(args.out, [*lines_head, *rows])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
