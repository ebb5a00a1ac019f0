"""The forward's cost on a CPU with PyTorch's stock linear layers against the same layers with their
weights packed once for oneDNN (``torch.ops.mkldnn._linear_pointwise``), and what that does to HF
greedy, STAND and AutoConfig. The packing is a patch made here, on the benchmark's own model, for
every forward (the prefill and HF's generate too). mtprobe's own linear routes, its ``packed`` route
among them (:mod:`mtprobe.cpu.linear_routes`, decode steps only, chosen per block size), are held to
torch's linear here (``MTPROBE_LINEAR_ROUTE=stock``), so that this patch is all that differs between
the two models; ``benchmarks/bench_linear_routes.py`` compares the routes themselves. Each method is
compared with HF greedy on the same model, stock or packed. This is a benchmark: nothing here asserts a
speed.

    python benchmarks/bench_cpu_linear.py --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 1 --out benchmarks/results/cpu_linear.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import mtprobe
from _common import first_turn_prompts, load_average, run_lines, write_report
from mtprobe import models
from mtprobe.cpu import linear_routes
from mtprobe.specbench.questions import first_per_category, load_questions


def packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN with the weight packed once (``self._packed``; not
    mtprobe.cpu.linear_routes' packed copy (``has_packed``), which its own packed route keeps)."""
    shape = x.shape
    y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, shape[-1]), self._packed, self.bias, "none", [], "")
    return y.reshape(*shape[:-1], y.shape[-1])


def pack_linears(model: nn.Module) -> int:
    """Pack every float32 ``nn.Linear`` of ``model`` in place (a copy of each weight, kept beside it,
    so a tied LM head keeps its embedding); returns how many. The patched modules have a ``forward`` of
    their own, which mtprobe's linear routes never swap (``linear_routes.routable_linears``)."""
    count = 0
    for module in model.modules():
        if isinstance(module, nn.Linear) and module.weight.dtype == torch.float32:
            module._packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), 1)
            module.forward = types.MethodType(packed_forward, module)
            count += 1
    return count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", type=Path, required=True)
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    # This benchmark is about torch's own linear layers and this patch of them: mtprobe's routes are held
    # to torch's linear (no measuring, no packed copies of its own), on both models alike.
    os.environ[linear_routes.ENV] = linear_routes.STOCK
    if not torch.backends.mkldnn.is_available():
        raise SystemExit("this torch build has no oneDNN (torch.backends.mkldnn.is_available() is False)")
    torch.set_num_threads(args.threads)
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    load0 = load_average()
    rows, profiles, sequences = [], {}, {}
    for variant in ("stock", "packed"):
        model, tok = models.load("smollm2-135m")
        model.eval()
        if variant == "packed":
            n = pack_linears(model)
            x = torch.randn(3, model.config.hidden_size)
            w = model.lm_head.weight
            gap = float((model.lm_head(x) - F.linear(x, w)).abs().max())
            print(f"packed {n} linear layers; LM head max |difference| {gap:.2e}", file=sys.stderr)
        profile = mtprobe.profile_forward(
            model, block_sizes=args.block_sizes, context_lengths=[args.context], repeats=7, cache=False
        )
        profiles[variant] = [profile.time(b, args.context) for b in args.block_sizes]
        prompts = [ids for _, ids in first_turn_prompts(tok, questions)]
        methods = {
            "HF greedy": None,
            "STAND, BC 10": mtprobe.StandConfig(block_complexity=10),
            "AutoConfig": mtprobe.AutoConfig(profile=profile),
        }
        hf_tok_s = None
        for name, cfg in methods.items():
            new, wall, gained, steps, same = 0, 0.0, 0, 0, 0
            for i, ids in enumerate(prompts):
                mask = torch.ones_like(ids)
                t0 = time.perf_counter()
                if cfg is None:
                    out = model.generate(
                        ids, attention_mask=mask, do_sample=False, max_new_tokens=args.max_new_tokens
                    )
                    wall += time.perf_counter() - t0
                    new += out.shape[1] - ids.shape[1]
                    sequences[variant, i] = out
                    continue
                out = mtprobe.generate(model, ids, cfg, max_new_tokens=args.max_new_tokens, do_sample=False)
                wall += time.perf_counter() - t0
                new += out.new_tokens
                gained += sum(out.accept_lengths)
                steps += len(out.accept_lengths)
                same += torch.equal(out.sequences, sequences[variant, i])
            tok_s = new / wall
            hf_tok_s = hf_tok_s or tok_s
            tau = "1.000" if cfg is None else f"{gained / max(1, steps):.3f}"
            ident = "baseline" if cfg is None else f"{same}/{len(prompts)}"
            rows.append((variant, name, tau, tok_s, tok_s / hf_tok_s, ident))
            print(f"{variant} {name}: {tok_s:.2f} tok/s", file=sys.stderr)
    agree = sum(torch.equal(sequences["stock", i], sequences["packed", i]) for i in range(len(questions)))
    load1 = load_average()
    sizes = args.block_sizes
    lines = [
        "# The forward's cost with stock and oneDNN-packed linear layers on this CPU",
        "",
        *run_lines("smollm2-135m"),
        f"- prompts: first turn of the first {args.per_category} question(s) of every category of "
        f"`{args.question_file.name}` ({len(questions)} questions, chat template); max_new_tokens="
        f"{args.max_new_tokens}; greedy; one process, {args.threads} torch thread(s); load average {load0} -> {load1}",
        "- packed: every float32 `nn.Linear` runs `torch.ops.mkldnn._linear_pointwise` on a weight packed once "
        "with `torch.ops.mkldnn._reorder_linear_weight` (a patch made by this benchmark on every forward); "
        f"mtprobe's own linear routes held to torch's linear (`{linear_routes.ENV}={linear_routes.STOCK}`) on both",
        f"- t(T): `mtprobe.profile_forward` (medians of 7, not cached) after {args.context} cached positions",
        f"- HF greedy's output on the packed model equals the stock model's on {agree}/{len(questions)} prompts",
        "",
        "| linear | "
        + " | ".join(f"t({b}) ms" for b in sizes)
        + " | "
        + " | ".join(f"t({b})/t(1)" for b in sizes[1:])
        + " |",
        "|---|" + "---|" * (2 * len(sizes) - 1),
    ]
    for variant, ts in profiles.items():
        lines.append(
            f"| {variant} | "
            + " | ".join(f"{1000 * t:.1f}" for t in ts)
            + " | "
            + " | ".join(f"{t / ts[0]:.2f}" for t in ts[1:])
            + " |"
        )
    stock_hf = next(r[3] for r in rows if r[0] == "stock" and r[1] == "HF greedy")  # the baseline
    lines += [
        "",
        "| linear | method | τ | tok/s | × HF greedy, same model | × HF greedy, stock model | identical to HF greedy, same model |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant, name, tau, tok_s, speedup, ident in rows:
        lines.append(
            f"| {variant} | {name} | {tau} | {tok_s:.2f} | {speedup:.3f}x | {tok_s / stock_hf:.3f}x | {ident} |"
        )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
