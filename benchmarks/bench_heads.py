#!/usr/bin/env python
"""Probabilistic-circuit heads (MTPC, seed 003): τ, tokens/s and the head's per-step cost, greedy and
sampling, next to training-free drafters at the same block complexity.

The shape of seed 003's Tables 6 and 7 at this machine's scale: one row per trained head (circuit,
window n, rank r), per BC and per temperature (greedy and sampling), with τ, latency per cycle,
tokens/s and the speed-up over HF ``generate``; every greedy run is checked token-identical to greedy
``model.generate``. Prompts are Spec-Bench first turns (SmolLM2), or, with ``--text``, held-out
passages of a byte LM's corpus (python -m mtprobe bytelm, seed 003's own byte-level regime). The
head's cost is the mean time of one head call (``CircuitHead.step_fn``, what the drafter calls once
per step) over the median time of one single-token decode forward of the backbone with a KV cache of
the first prompt's length, both on this machine, same threads.

    python benchmarks/bench_heads.py --question-file ../shared/specbench/question-dev.jsonl \\
        --heads DIR [DIR ...] --baselines stand hybrid-cal --mask-path FILE \\
        --out benchmarks/results/heads/bench_heads.md
    python benchmarks/bench_heads.py --model BYTELM_DIR --text /usr/share/games/fortunes/* \\
        --heads DIR [DIR ...] --baselines stand pld --temperature 0 1 --block-complexity 16 \\
        --max-new-tokens 128 --out benchmarks/results/heads/bench_heads_bytes.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

import mtprobe
from _common import first_turn_prompts, run_lines, write_report
from bench_baselines import configs as baseline_configs
from mtprobe import heads, models
from mtprobe.offline import bytelm
from mtprobe.specbench.questions import first_per_category, load_questions
from mtprobe.target_model.adapter import cache_argument


def head_cost(
    model,
    head: heads.CircuitHead,
    ids: torch.Tensor,
    vocab_top_k: int | None = None,
    dtype: torch.dtype | None = None,
    repeats: int = 30,
) -> tuple[float, float]:
    """(seconds per head call, seconds per single-token decode forward with ``ids`` cached), medians of
    ``repeats`` of each, timed alternately so that a drift of the machine's speed moves both. A head
    call is the drafter's callback over one committed token (after a prefill over ``ids``): with LoRA
    draft layers it includes them, their cache growing by one token per call as in decoding;
    ``vocab_top_k``, ``dtype``: the head restricted and cast as ``HeadsConfig(vocab_top_k=K,
    head_dtype=...)`` does it."""
    with torch.no_grad():
        out = model(ids, use_cache=True, output_hidden_states=True)
        hidden, logits = out.hidden_states[head.hidden_layer][0], out.logits[0, -1]  # [P, d], [V]
        step, p = head.step_fn(vocab_top_k, dtype), hidden.shape[0]
        step(hidden, logits, 0)  # warm-up (the prefill; and E C precomputed once, as in decoding)
        nxt = logits.argmax().view(1, 1)
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        calls, fwd = [], []
        for i in range(repeats):
            t0 = time.perf_counter()
            step(hidden[-1:], logits, p + i)
            calls.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            model(nxt, use_cache=True, **{cache_argument(model): cache})
            fwd.append(time.perf_counter() - t0)
            cache.crop(-1)  # back to the prompt, so every forward sees the same context
    return sorted(calls)[len(calls) // 2], sorted(fwd)[len(fwd) // 2]


def load_prompts(args, tok) -> list[tuple[str, torch.Tensor]]:
    """(task, input_ids [1, L]) per prompt: Spec-Bench first turns, or held-out passages of ``--text``."""
    if args.question_file:
        questions = first_per_category(load_questions(args.question_file), args.per_category)
        return [(q.task, ids) for q, ids in first_turn_prompts(tok, questions)]
    texts = bytelm.passage_prompts(args.text, args.num_prompts, prompt_bytes=args.prompt_bytes)
    return [("text", tok(t, return_tensors="pt").input_ids) for t in texts]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--question-file", help="Spec-Bench questions (first turns, chat template)")
    src.add_argument(
        "--text", nargs="+", help="instead: continue held-out passages of these files (a byte LM's corpus)"
    )
    ap.add_argument("--num-prompts", type=int, default=16, help="with --text: how many passages")
    ap.add_argument("--prompt-bytes", type=int, default=96, help="with --text: each prompt's length in bytes")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--heads", nargs="+", required=True, help="head checkpoint folders")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--block-complexity", type=int, nargs="+", default=[30])
    ap.add_argument("--temperature", type=float, nargs="+", default=[0.0], help="0: greedy; > 0: sampling")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--top-branches",
        type=int,
        nargs="+",
        default=[4],
        help="sampling: windows each heads step draws (HeadsConfig.top_branches); several give a row each (bN)",
    )
    ap.add_argument(
        "--min-path-prob",
        type=float,
        nargs="+",
        default=[0.0],
        help="greedy: HeadsConfig.min_path_prob, drafts below this path probability left out; several give "
        "a row each (p>=X)",
    )
    ap.add_argument(
        "--vocab-top-k",
        type=int,
        nargs="+",
        default=[0],
        help="HeadsConfig.vocab_top_k: the head emits only its K most frequent training tokens (0: the whole "
        "vocabulary); several give a row each (top-K vocab)",
    )
    ap.add_argument(
        "--head-dtype",
        nargs="+",
        default=["none"],
        choices=["none", "float32", "bfloat16", "float16"],
        help="HeadsConfig.head_dtype (none: the default); several give a row each",
    )
    ap.add_argument("--seed", type=int, default=0, help="sampling: torch seed before every generation")
    ap.add_argument("--baselines", nargs="*", default=["stand"], help="rows of bench_baselines.py to add")
    ap.add_argument("--mask-path", default=None, help="mask calibration for the *-cal baseline rows")
    ap.add_argument("--out", default="benchmarks/results/heads/bench_heads.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    model, tok = models.load(args.model, dtype=torch.float32)
    if args.text:
        model.generation_config.eos_token_id = None  # continue a text for the full length
    prompts = load_prompts(args, tok)
    loaded = {path: heads.load_head(path, model) for path in args.heads}  # a broken head fails first
    dtypes = [None if d == "none" else d for d in args.head_dtype]
    costs = {}  # (path, vocab_top_k, head_dtype) -> head cost
    for (path, head), k, d in itertools.product(loaded.items(), args.vocab_top_k, dtypes):
        head_s, fwd_s = head_cost(
            model, head, prompts[0][1], k or None, None if d is None else getattr(torch, d)
        )
        costs[path, k, d] = head_s / fwd_s

    def sampling(temp: float) -> dict:
        if temp == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": temp, "top_k": 0, "top_p": 1.0}

    rows = []  # (temperature, bc, name, {task: tau}, mismatches, ms per cycle, tok/s, head cost)
    hf: dict[float, float] = {}  # temperature -> HF generate tok/s
    for temp in args.temperature:
        t0, refs = time.perf_counter(), []
        for _, ids in prompts:
            torch.manual_seed(args.seed)
            refs.append(
                model.generate(
                    ids, max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id, **sampling(temp)
                )
            )
        new_tokens = sum(r.shape[1] - ids.shape[1] for r, (_, ids) in zip(refs, prompts, strict=True))
        hf[temp] = new_tokens / (time.perf_counter() - t0)
        for bc in args.block_complexity:
            runs: dict[str, tuple[object, float | None]] = {}
            for name, cfg in baseline_configs(bc, args.mask_path).items():
                if name in args.baselines:
                    runs[name] = (cfg, None)
            # Sampling drafts top_branches windows drawn from the circuit; greedy drafts one best-first tree.
            branches = args.top_branches if temp > 0 else args.top_branches[:1]
            floors = args.min_path_prob if temp == 0 else [0.0]
            for path, tb, floor, k, d in itertools.product(
                args.heads, branches, floors, args.vocab_top_k, dtypes
            ):
                head = loaded[path]
                s = head.spec
                name = f"{s.circuit} n{s.window} r{head.r}" + (
                    f" ρ{s.adapter_rank}" if s.emission == "lowrank" else ""
                )
                name += f" LoRA {s.lora_layers}" if s.lora_layers else ""
                name += " (draft base)" if s.lora_layers and s.lora_base == "draft" else ""
                if sum(loaded[q].spec == s for q in args.heads) > 1:  # same architecture: name the folder
                    name += f" ({Path(path).name})"
                name += f" b{tb}" if temp > 0 and len(args.top_branches) > 1 else ""
                name += f" p≥{floor:g}" if floor > 0 else ""
                name += f" top-{k} vocab" if k else ""
                name += f" {d}" if d else ""
                cfg = mtprobe.HeadsConfig(
                    path=path,
                    block_complexity=bc,
                    top_branches=tb,
                    min_path_prob=floor,
                    vocab_top_k=k or None,
                    head_dtype=d,
                )
                runs[name] = (cfg, costs[path, k, d])
            for name, (cfg, cost) in runs.items():
                t0 = time.perf_counter()
                per_task: dict[str, list[int]] = defaultdict(lambda: [0, 0])
                bad, got, cycle_s, outside_s, drafted = 0, 0, 0.0, 0.0, 0
                for (task, ids), ref in zip(prompts, refs, strict=True):
                    torch.manual_seed(args.seed)
                    out = mtprobe.generate(
                        model,
                        ids,
                        cfg,
                        max_new_tokens=args.max_new_tokens,
                        pad_token_id=tok.pad_token_id,
                        **sampling(temp),
                    )
                    bad += temp == 0 and not torch.equal(out.sequences, ref)  # sampling: see test_sampling.py
                    got += out.new_tokens
                    cycle_s += out.timings["total_s"] - out.timings["prefill_s"]
                    outside_s += out.timings["total_s"] - out.timings["forward_s"]
                    drafted += sum(out.drafted_per_depth)
                    for key in (task, "all"):
                        per_task[key][0] += sum(out.accept_lengths)
                        per_task[key][1] += len(out.accept_lengths)
                wall = time.perf_counter() - t0
                taus = {k: g / max(1, n) for k, (g, n) in per_task.items()}
                steps = max(1, per_task["all"][1])
                ms, outside = 1000 * cycle_s / steps, 1000 * outside_s / steps
                rows.append((temp, bc, name, taus, bad, ms, outside, got / wall, cost, 1 + drafted / steps))
                print(f"T {temp} BC {bc} {name}: tau {taus['all']:.3f} [{wall:.0f}s]", file=sys.stderr)

    tasks = sorted({t for _, _, _, taus, *_ in rows for t in taus if t != "all"})
    source = (
        f"first turn of the first {args.per_category} question(s) of every category of "
        f"`{Path(args.question_file).name}` ({len(prompts)} questions, chat template)"
        if args.question_file
        else f"{len(prompts)} held-out passages of {len(args.text)} text file(s) (the last 5 % of each, which "
        f"the byte LM never saw), the first {args.prompt_bytes} bytes of each continued"
    )
    hf_line = "; ".join(f"T = {t:g}: {v:.2f} tok/s ({1000 / v:.1f} ms per token)" for t, v in hf.items())
    lines = [
        "# Probabilistic-circuit heads against training-free drafters",
        "",
        *run_lines(args.model),
        f"- prompts: {source}; max_new_tokens={args.max_new_tokens}; T = 0 greedy, T > 0 pure sampling "
        f"(temperature T, no top-k/top-p), seed {args.seed} before every generation",
        f"- HF `model.generate` (same prompts, one process, {torch.get_num_threads()} torch thread(s)): {hf_line}",
        "- τ = tokens gained per decode forward (prefill not counted); ms/cycle = decode-loop time after the "
        "prefill over decode forwards (one draft + verify cycle each); outside = the loop's time outside the "
        "model's forwards (the drafter's work, the head's calls included, and the loop's own) over decode forwards; tok/s = new tokens over the wall time "
        "of all prompts; × HF = tok/s over HF `generate`'s at the same T; heads rows: HeadsConfig(path, "
        "block_complexity=BC, top_branches=b, min_path_prob=X for p≥X, vocab_top_k=K for top-K vocab, "
        "head_dtype=D when a dtype is named), circuit, "
        "window n, rank r, adapter rank ρ "
        "(lowrank emissions; none: one "
        "unembedding per position and state); head cost = one head call (step_fn) over one single-token decode "
        "forward (medians of 30 each, calls and forwards alternating, the first prompt cached); T/step = inputs of one "
        "decode forward, the root and its drafts, averaged over steps; mismatches: greedy runs not token-identical to "
        "HF greedy (sampling is checked by the chi-square tests of tests/test_sampling.py instead)",
        "",
        "| T | BC | drafter | τ | "
        + "".join(f"{t} | " for t in tasks if len(tasks) > 1)
        + "T/step | ms/cycle | outside ms | tok/s | × HF | head cost | mismatches |",
        "|---|---|---|---|" + "---|" * (len(tasks) if len(tasks) > 1 else 0) + "---|---|---|---|---|---|---|",
    ]
    for temp, bc, name, taus, bad, ms, outside, tok_s, cost, inputs in rows:
        cells = "".join(f"{taus.get(t, float('nan')):.3f} | " for t in tasks if len(tasks) > 1)
        c = "" if cost is None else f"{100 * cost:.1f} %"
        m = str(bad) if temp == 0 else "–"
        lines.append(
            f"| {temp:g} | {bc} | {name} | **{taus['all']:.3f}** | {cells}{inputs:.1f} | {ms:.1f} | {outside:.1f} | {tok_s:.2f} | "
            f"{tok_s / hf[temp]:.2f} | {c} | {m} |"
        )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
