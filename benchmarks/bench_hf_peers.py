#!/usr/bin/env python
"""mtprobe's prompt lookup and draft-model decoding against transformers' own, side by side in one run.

Per question (the first turn of the first ``--per-category`` questions of every category of a
Spec-Bench question file), in turn: plain greedy ``model.generate``; transformers'
``generate(prompt_lookup_num_tokens=N)`` and ``mtprobe.PromptLookupConfig(num_tokens=N)``;
transformers' ``generate(assistant_model=draft)`` and ``mtprobe.DraftModelConfig(draft_model=draft,
num_tokens=K)`` with the same draft (by default SmolLM2's first layers: ``mtprobe.target_model.self_draft.layer_truncated``).
transformers' assistant runs with a constant K (``num_assistant_tokens=K``,
``num_assistant_tokens_schedule="constant"``, ``assistant_confidence_threshold=0``), so both draft
the same chains. Reports whether the tokens are identical to greedy, tokens per target forward
(forwards counted by a hook on the target model, prefill included, the same way for every mode),
draft forwards, and wall time. The modes alternate question by question, so load on the machine
hits all of them alike. A benchmark, not a test.

    python benchmarks/bench_hf_peers.py --question-file ../shared/specbench/question-dev.jsonl \
        --per-task --max-new-tokens 32 --threads 1 --out benchmarks/results/bench_hf_peers.md
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
from mtprobe.target_model.self_draft import layer_truncated


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument(
        "--per-task", action="store_true", help="one question per Spec-Bench task instead of per category"
    )
    ap.add_argument("--pld-tokens", type=int, default=10, help="N: prompt_lookup_num_tokens")
    ap.add_argument("--draft-layers", type=int, default=8, help="depth of the layer-truncated self-draft")
    ap.add_argument("--draft-tokens", type=int, default=4, help="K: drafts per step")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/bench_hf_peers.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    draft = layer_truncated(model, args.draft_layers)
    draft.generation_config.num_assistant_tokens = args.draft_tokens
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    forwards = {"target": 0, "draft": 0}
    model.register_forward_pre_hook(lambda *a: forwards.__setitem__("target", forwards["target"] + 1))
    draft.register_forward_pre_hook(lambda *a: forwards.__setitem__("draft", forwards["draft"] + 1))

    n = args.max_new_tokens
    pld = mtprobe.PromptLookupConfig(num_tokens=args.pld_tokens)
    sps = mtprobe.DraftModelConfig(draft_model=draft, num_tokens=args.draft_tokens)
    modes = {
        "HF greedy": lambda ids: model.generate(ids, do_sample=False, max_new_tokens=n),
        "HF prompt lookup": lambda ids: model.generate(
            ids, do_sample=False, max_new_tokens=n, prompt_lookup_num_tokens=args.pld_tokens
        ),
        "mtprobe prompt lookup": lambda ids: mtprobe.generate(model, ids, pld, max_new_tokens=n).sequences,
        "HF assisted (draft model)": lambda ids: model.generate(
            ids, do_sample=False, max_new_tokens=n, assistant_model=draft
        ),
        "mtprobe draft model": lambda ids: mtprobe.generate(model, ids, sps, max_new_tokens=n).sequences,
    }
    questions = load_questions(args.question_file)
    if args.per_task:  # Spec-Bench's six tasks (mt_bench groups its eight categories)
        questions = [
            next(q for q in questions if q.task == t) for t in dict.fromkeys(q.task for q in questions)
        ]
    else:
        questions = first_per_category(questions, args.per_category)
    totals = {m: dict(new=0, fwd=0, draft_fwd=0, sec=0.0, bad=0) for m in modes}
    rows = []
    for i, (q, ids) in enumerate(first_turn_prompts(tok, questions)):
        if i == 0:
            for fn in modes.values():
                fn(ids)  # warm-up
        ref = None
        cells = []
        for name, fn in modes.items():
            forwards.update(target=0, draft=0)
            t0 = time.perf_counter()
            seq = fn(ids)
            sec = time.perf_counter() - t0
            ref = seq if ref is None else ref
            new = seq.shape[1] - ids.shape[1]
            bad = not torch.equal(seq, ref)
            t = totals[name]
            t["new"] += new
            t["fwd"] += forwards["target"]
            t["draft_fwd"] += forwards["draft"]
            t["sec"] += sec
            t["bad"] += bad
            cells.append(f"{new / forwards['target']:.2f}, {new / sec:.1f}" + (" **DIFFERS**" if bad else ""))
        rows.append(f"| {q.question_id} | {q.category} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr)

    lines = [
        "# mtprobe against transformers' own prompt lookup and assisted generation",
        "",
        *run_lines(args.model),
        f"- draft: the target's first {args.draft_layers} layers + final norm + tied head (weights shared), "
        f"K = {args.draft_tokens} drafts per step; prompt lookup N = {args.pld_tokens}",
        "- questions: first turn of "
        + (
            "the first question of every task"
            if args.per_task
            else f"the first {args.per_category} of every category"
        )
        + f" of `{Path(args.question_file).name}` ({len(questions)} questions), chat template, greedy, "
        f"max_new_tokens={n}",
        "- tokens per forward = new tokens / target forwards (prefill included, counted by a hook on the target); "
        "draft forwards counted by a hook on the draft",
        "",
        "| mode | new tokens | target forwards | tokens per forward | draft forwards | tokens/s | "
        "speedup vs HF greedy | differs from greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    base = totals["HF greedy"]["new"] / totals["HF greedy"]["sec"]
    for name, t in totals.items():
        lines.append(
            f"| {name} | {t['new']} | {t['fwd']} | {t['new'] / t['fwd']:.3f} | {t['draft_fwd']} | "
            f"{t['new'] / t['sec']:.2f} | {t['new'] / t['sec'] / base:.2f}x | {t['bad']} |"
        )
    lines += [
        "",
        "Per question (tokens per forward, tokens/s):",
        "",
        "| question | category | " + " | ".join(modes) + " |",
        "|---|---|" + "---|" * len(modes),
        *rows,
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
