"""Decode time as the forward profile prices it: AutoConfig against the static drafters it chooses
among, free of the machine's drift.

On a small shared CPU the wall clock of one process can differ from the next by tens of percent,
more than most changes to a scheduler are worth. Every method's output is the same greedy text, and
what a method controls is only how many forwards it runs and how many inputs each takes. So this
script runs every method in one process and prices each decode step by the profile the scheduler
itself uses (``mtprobe.profile_forward``, cached): modelled time = sum over steps of t(T, context),
and plain decoding's = sum over tokens of t(1, context). The modelled speedup is the second over
the first: deterministic for a given profile, so two runs of a method agree to the digit and a
change to the scheduler shows its own effect. The measured decode seconds of the same runs are
reported beside it. This is a benchmark: nothing here asserts a speed.

    python benchmarks/bench_auto_modelled.py --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 2 --out benchmarks/results/auto/modelled/README.md

``--config NAME=JSON`` adds a method by its configuration dictionary (``mtprobe.config_from_dict``),
e.g. ``--config 'auto-d90={"method": "auto", "decay": 0.9}'``.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, load_average, run_lines, write_report
from mtprobe import models
from mtprobe.specbench.questions import first_per_category, load_questions

METHODS = {
    "pld": {"method": "pld", "num_tokens": 10},
    "stand-bc10": {"method": "stand", "block_complexity": 10},
    "auto": {"method": "auto"},
}


def modelled_seconds(profile, prompt_len: int, block_sizes: list[int], accept_lengths: list[int]) -> float:
    """Sum over decode steps of t(T, context): the step's forward after every token before it."""
    total, context = 0.0, prompt_len
    for t, gained in zip(block_sizes, accept_lengths, strict=True):
        total += profile.time(t, context)
        context += gained
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--question-file", type=Path, required=True)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--config", action="append", default=[], metavar="NAME=JSON")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/auto/modelled/README.md"))
    args = ap.parse_args()
    methods = {}
    for name in args.methods.split(","):
        if name not in METHODS:
            ap.error(f"--methods: unknown method {name!r}; choose from {', '.join(METHODS)}")
        methods[name] = mtprobe.config_from_dict(METHODS[name])
    for spec in args.config:
        name, sep, text = spec.partition("=")
        if not sep or not name:
            ap.error(f"--config takes NAME=JSON, got {spec!r}")
        methods[name] = mtprobe.config_from_dict(json.loads(text))
    torch.set_num_threads(args.threads)
    model, tokenizer = models.load(args.model, dtype=torch.float32)
    profile = mtprobe.profile_forward(model)
    prompts = first_turn_prompts(
        tokenizer, first_per_category(load_questions(args.question_file), args.per_category)
    )
    load0 = load_average()
    # [method][category] -> [steps, tokens, modelled s, plain modelled s, measured decode s, scheduler s]
    rows: dict[str, dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(lambda: [0, 0, 0.0, 0.0, 0.0, 0.0])
    )
    reference = None
    for question, ids in prompts:
        prompt_len = ids.shape[1]
        for name, cfg in methods.items():
            t0 = time.perf_counter()
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens)
            wall = time.perf_counter() - t0
            if name == next(iter(methods)):
                reference = out.sequences
            elif not torch.equal(out.sequences, reference):
                raise SystemExit(
                    f"{name} differs from {next(iter(methods))} on question {question.question_id}"
                )
            decoded = sum(out.accept_lengths)  # the decode steps' tokens (the prefill's is not theirs)
            plain = modelled_seconds(profile, prompt_len, [1] * decoded, [1] * decoded)
            for key in (question.category, "all"):
                r = rows[name][key]
                r[0] += out.steps
                r[1] += decoded
                r[2] += modelled_seconds(profile, prompt_len, out.block_sizes, out.accept_lengths)
                r[3] += plain
                r[4] += wall - out.timings["prefill_s"]
                r[5] += out.timings.get("schedule_s", 0.0)  # AutoConfig's choosing, inside the decode loop
    categories = sorted({q.category for q, _ in prompts})
    lines = [
        "# Modelled decode time: AutoConfig and the static drafters, priced by the forward profile",
        "",
        *run_lines(args.model),
        f"- questions: the first {args.per_category} of every category of `{args.question_file.name}` "
        f"({len(prompts)}), first turns, at most {args.max_new_tokens} new tokens, greedy; every method in "
        "this one process, question by question; every output checked token-identical to the first method's",
        f"- profile: `{profile.key}`, block sizes {list(profile.block_sizes)}, contexts "
        f"{list(profile.context_lengths)}",
        f"- load average at the start and end: {load0} → {load_average()}",
        "- modelled: the sum over decode steps of the profile's t(T, context); plain: the same for one "
        "input per token; speedup = plain / modelled. Measured: wall-clock decode seconds of the same runs "
        "(prefill excluded), for reference only; scheduler: AutoConfig's own time choosing among the "
        "drafters' blocks and cuts (`out.timings['schedule_s']`, which excludes drafting and the forward), "
        "as a share of the measured decode seconds",
        "",
        "| method | steps | τ | modelled s | modelled speedup | measured decode s | scheduler | "
        + " | ".join(categories)
        + " |",
        "| --- | --- | --- | --- | --- | --- | --- | " + " | ".join("---" for _ in categories) + " |",
    ]
    for name in methods:
        steps, tokens, modelled, plain, measured, scheduler = rows[name]["all"]
        share = f"{100 * scheduler / measured:.2f} %" if scheduler else "–"
        per_cat = " | ".join(f"{rows[name][c][3] / rows[name][c][2]:.3f}×" for c in categories)
        lines.append(
            f"| {name} | {steps} | {tokens / steps:.3f} | {modelled:.2f} | {plain / modelled:.3f}× | "
            f"{measured:.1f} | {share} | {per_cat} |"
        )
    lines += ["", "Configurations: " + "; ".join(f"`{n}` = `{c.to_dict()}`" for n, c in methods.items())]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
