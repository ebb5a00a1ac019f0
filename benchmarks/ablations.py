#!/usr/bin/env python
"""The paper's probing ablations (seed 001, Tables 2-5, 9-11), redone on one model.

Tables 2, 5, 9-11 compare τ (tokens gained per decode forward), which is deterministic under greedy
decoding, so they need no quiet machine. Tables 3 and 4 compare naive against efficient (App. E)
mask construction in tokens/s and in time per step outside the model forward; the two are run
interleaved prompt by prompt so that load on the machine hits both alike. Every run is checked
token-identical to plain greedy ``model.generate``. Results are rewritten after every configuration,
so an interrupted run keeps what it measured. Every configuration is the paper's settings
(``mtprobe.ProbeConfig.paper``) with the ablated fields changed, whatever ProbeConfig's defaults are.

Examples (the committed results, benchmarks/results/ablations/): the first pass over every table, and
the whole development split (120 questions) for the configurations that set the defaults, split over
two processes that share one set of greedy references::

    python benchmarks/ablations.py --question-file ../shared/specbench/question-dev.jsonl \
        --per-category 2 --max-new-tokens 48 --out benchmarks/results/ablations/first_pass.md
    python benchmarks/ablations.py --question-file ../shared/specbench/question-dev.jsonl \
        --per-category 20 --max-new-tokens 64 --threads 1 --refs refs120.pt --only Lambda \
        --labels 'lambda 0.1;lambda 0.3;lambda 0.5;lambda 0.7' --out benchmarks/results/ablations/dev_lambda.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, run_lines
from mtprobe import models
from mtprobe.specbench.questions import first_per_category, load_questions, task_of

# (table, label, overrides of the paper's settings: mtprobe.ProbeConfig.paper(**overrides))
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
    *[
        (
            "Lambda sweep (not in the paper), BC 30, one mask",
            f"lambda {lam}",
            dict(block_complexity=30, mask_lambda=lam),
        )
        for lam in (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0)
    ],
    *[
        (
            "Candidate defaults (not in the paper): the winners combined",
            label,
            kwargs,
        )
        for label, kwargs in (
            ("m1 [14] BC 30, lambda 0.5", dict(block_complexity=30, mask_lambda=0.5)),
            (
                "m1 [14] BC 30, Gaussian, lambda 0.5",
                dict(block_complexity=30, mask_init="gaussian", mask_lambda=0.5),
            ),
            ("m1 [29] BC 60, lambda 0.1", dict(block_complexity=60, num_masks=1)),
            ("m1 [29] BC 60, lambda 0.5", dict(block_complexity=60, num_masks=1, mask_lambda=0.5)),
            ("m2 dynamic BC 60, lambda 0.5", dict(block_complexity=60, num_masks=2, mask_lambda=0.5)),
        )
    ],
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


# Tables 3 and 4: static trees whose shape repeats every step, naive vs efficient masks.
TIMING: list[tuple[str, dict]] = [
    ("m1 [14], BC 30", dict(block_complexity=30, num_masks=1)),
    ("m2 [15, 4], BC 60", dict(block_complexity=60, num_masks=2, tree="static", branches=(15, 4))),
]


def run_config(model, cfg: mtprobe.ProbeConfig, prompts: list, refs: list, max_new_tokens: int) -> dict:
    """τ pooled over all prompts and per task, and the mismatches with greedy ``generate``."""
    gained, steps, mismatches = 0, 0, 0
    per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for (q, ids), ref in zip(prompts, refs, strict=True):
        out = mtprobe.generate(model, ids, cfg, max_new_tokens=max_new_tokens)
        mismatches += not torch.equal(out.sequences, ref)
        gained += sum(out.accept_lengths)
        steps += len(out.accept_lengths)
        acc = per_task[task_of(q.category)]
        acc[0] += sum(out.accept_lengths)
        acc[1] += len(out.accept_lengths)
    return dict(
        tau=gained / max(1, steps),
        per_task={k: v[0] / max(1, v[1]) for k, v in per_task.items()},
        mismatches=mismatches,
    )


def time_naive_vs_efficient(model, cfg_kwargs: dict, prompts: list, refs: list, max_new_tokens: int) -> dict:
    """Tokens/s and ms per step outside the forward, naive and efficient masks interleaved per prompt."""
    cfgs = {
        "naive": mtprobe.ProbeConfig.paper(**cfg_kwargs, incremental_masks=False),
        "efficient": mtprobe.ProbeConfig.paper(**cfg_kwargs, incremental_masks=True),
    }
    acc = {k: dict(tokens=0, steps=0, total_s=0.0, forward_s=0.0, mismatches=0) for k in cfgs}
    for (_, ids), ref in zip(prompts, refs, strict=True):
        for name, cfg in cfgs.items():
            out = mtprobe.generate(model, ids, cfg, max_new_tokens=max_new_tokens)
            a = acc[name]
            a["mismatches"] += not torch.equal(out.sequences, ref)
            a["tokens"] += out.sequences.shape[1] - ids.shape[1]
            a["steps"] += len(out.accept_lengths)
            a["total_s"] += out.timings["total_s"]
            a["forward_s"] += out.timings["forward_s"]
    return {
        name: dict(
            tokens_per_s=a["tokens"] / a["total_s"],
            # everything but the model: drafting, masks, verification, KV compaction
            other_ms_per_step=1e3 * (a["total_s"] - a["forward_s"]) / max(1, a["steps"]),
            mismatches=a["mismatches"],
        )
        for name, a in acc.items()
    }


def greedy_references(model, args, prompts: list) -> list[torch.Tensor]:
    """Plain greedy ``generate`` per prompt, the token-for-token check of every run (cached with --refs)."""
    key = dict(
        model=args.model,
        max_new_tokens=args.max_new_tokens,
        questions=[q.question_id for q, _ in prompts],
        prompts=[ids.tolist() for _, ids in prompts],
    )
    if args.refs and Path(args.refs).exists():
        cached = torch.load(args.refs)
        if cached["key"] != key:
            raise SystemExit(
                f"--refs {args.refs} was made for other questions, model or max_new_tokens; delete it"
            )
        return cached["refs"]
    refs = [model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens) for _, ids in prompts]
    if args.refs:
        torch.save(dict(key=key, refs=refs), args.refs)
    return refs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument(
        "--only",
        default="",
        help="semicolon-separated table name prefixes to run, e.g. 'Table 2;Table 3' (default: all; table "
        "names contain commas)",
    )
    ap.add_argument(
        "--labels",
        default="",
        help="semicolon-separated configuration labels to run within the selected tables, e.g. "
        "'lambda 0.1;lambda 0.5' (default: every configuration of them)",
    )
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--refs",
        default=None,
        help="cache of the greedy generate() references (a .pt file): read if it exists and matches the "
        "model, questions and max_new_tokens, else computed and written, so that runs split with --only "
        "compute them once",
    )
    ap.add_argument("--out", default="benchmarks/results/ablations/ablations.md")
    args = ap.parse_args(argv)
    wanted = [p.strip() for p in args.only.split(";") if p.strip()]
    tables = {table for table, _, _ in ABLATIONS}
    unmatched = [w for w in wanted if not any(t.startswith(w) for t in tables)]
    if unmatched:
        raise SystemExit(f"--only: no table name starts with {unmatched}; the tables are {sorted(tables)}")

    labels = {x.strip() for x in args.labels.split(";") if x.strip()}
    unknown = labels - {label for _, label, _ in ABLATIONS}
    if unknown:
        raise SystemExit(f"--labels: no configuration is labelled {sorted(unknown)}")
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = first_turn_prompts(tok, questions)
    refs = greedy_references(model, args, prompts)

    def selected(table: str, label: str | None = None) -> bool:
        in_table = not wanted or any(table.startswith(w) for w in wanted)
        return in_table and (label is None or not labels or label in labels)

    header = [
        "# Probing ablations",
        "",
        *run_lines(args.model),
        f"- questions: the first {args.per_category} of every category of `{Path(args.question_file).name}` "
        f"({len(questions)} questions, first turn only), greedy, max_new_tokens={args.max_new_tokens}",
        "- τ = tokens gained per decode forward (accepted drafts + bonus), pooled over all decode steps; "
        "the prefill forward is not counted. Every run was compared token for token with greedy "
        "`model.generate` (column 'mismatches').",
        "",
    ]
    rows: list[dict] = []
    timing: list[dict] = []

    def write() -> None:
        tasks = sorted({t for r in rows for t in r["per_task"]})
        lines = list(header)
        for table in dict.fromkeys(r["table"] for r in rows):
            lines += [
                f"## {table}",
                "",
                "| configuration | τ | " + " | ".join(tasks) + " | mismatches |",
                "|---|---|" + "---|" * len(tasks) + "---|",
            ]
            for r in rows:
                if r["table"] == table:
                    cells = " | ".join(f"{r['per_task'].get(x, float('nan')):.3f}" for x in tasks)
                    lines.append(f"| {r['label']} | **{r['tau']:.3f}** | {cells} | {r['mismatches']} |")
            lines.append("")
        if timing:
            lines += [
                "## Tables 3 and 4: naive vs efficient masks",
                "",
                "Same questions; the two constructions alternate prompt by prompt. 'other ms/step' is the "
                "loop's time outside the model forward (drafting, masks, verification, KV compaction).",
                "",
                "| tree | masks | tokens/s | other ms/step | mismatches |",
                "|---|---|---|---|---|",
            ]
            for t in timing:
                for name in ("naive", "efficient"):
                    m = t[name]
                    lines.append(
                        f"| {t['label']} | {name} | {m['tokens_per_s']:.2f} | {m['other_ms_per_step']:.2f} "
                        f"| {m['mismatches']} |"
                    )
            lines.append("")
        if rows:
            lines += ["Configurations in full:", ""]
            lines += [f"- {r['label']}: `{r['config']}`" for r in rows]
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text("\n".join(lines) + "\n")
        Path(args.out).with_suffix(".json").write_text(
            json.dumps(
                dict(tau=[{k: v for k, v in r.items() if k != "config"} for r in rows], timing=timing),
                indent=1,
            )
        )

    t0 = time.time()
    done: dict[str, dict] = {}
    for table, label, kwargs in ABLATIONS:
        if not selected(table, label):
            continue
        cfg = mtprobe.ProbeConfig.paper(**kwargs)
        if repr(cfg) not in done:  # the same configuration in two tables runs once
            done[repr(cfg)] = run_config(model, cfg, prompts, refs, args.max_new_tokens)
        r = done[repr(cfg)]
        rows.append(dict(table=table, label=label, config=cfg, **r))
        print(
            f"{table} | {label}: tau {r['tau']:.3f} ({r['mismatches']} mismatches) [{time.time() - t0:.0f}s]",
            file=sys.stderr,
        )
        write()
    if selected("Tables 3 and 4") and not labels:
        for label, kwargs in TIMING:
            t = time_naive_vs_efficient(model, kwargs, prompts, refs, args.max_new_tokens)
            timing.append(dict(label=label, **t))
            print(f"Tables 3/4 | {label}: {t} [{time.time() - t0:.0f}s]", file=sys.stderr)
            write()
    write()
    print(Path(args.out).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
