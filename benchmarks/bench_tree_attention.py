#!/usr/bin/env python
"""Tree attention from ancestor bits (``mtprobe.ops.tree_attention``) against SDPA with a dense float mask.

Example (the figures issue 6 asks for, on the lent GPU)::

    python benchmarks/bench_tree_attention.py --device cuda --dtype bfloat16 \
        --prefix 512 2048 8192 --tree-tokens 16 32 64 --out benchmarks/results/bench_tree_attention.md

One attention call per row, shaped like one layer of the default model (SmolLM2-135M: 9 query heads,
3 KV heads, head dim 64; change with --heads/--kv-heads/--head-dim): T tree queries over P cached
keys plus the T tree keys, the tree a random one (parents drawn with a fixed seed, as a dynamic draft
tree would be). SDPA gets the dense additive mask ``[1, 1, T, P + T]`` (``tree_attention_mask``) and
GQA through ``enable_gqa``; mtprobe gets ``[T, ceil(T / 64)]`` int64 ancestor bits. Both masks are
built once per decode step, not per layer, so their construction is timed apart. Times are medians
over --reps calls after --warmup calls (CUDA events on a GPU, ``perf_counter`` on the CPU). The
largest absolute difference between the two outputs is reported beside each time; a benchmark, not a
test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import datetime as dt
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

import mtprobe.ops as ops
from _common import device_name, write_report

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def random_tree(num_nodes: int, seed: int) -> torch.Tensor:
    """Parents ``[T]`` of a random tree: node i hangs under one of the nodes before it (root 0)."""
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(max(0, i - 4), i, (), generator=g)) for i in range(1, num_nodes)]
    return torch.tensor(parents)


def time_call(fn: Callable[[], object], device: torch.device, reps: int, warmup: int) -> float:
    """Median milliseconds of one call."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def bench_row(args: argparse.Namespace, prefix: int, tree_tokens: int, device: torch.device) -> list[str]:
    dtype = DTYPES[args.dtype]
    g = torch.Generator(device=device).manual_seed(prefix * 1000 + tree_tokens)
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    q = torch.randn(1, h, tree_tokens, d, generator=g, device=device).to(dtype)  # [1, H, T, D]
    k = torch.randn(1, hkv, prefix + tree_tokens, d, generator=g, device=device).to(
        dtype
    )  # [1, Hkv, P + T, D]
    v = torch.randn(1, hkv, prefix + tree_tokens, d, generator=g, device=device).to(dtype)
    parents = random_tree(tree_tokens, seed=tree_tokens).to(device)
    scale = d**-0.5

    bits = ops.tree_ancestor_bits(parents)  # [T, ceil(T / 64)]
    mask = ops.tree_attention_mask(parents, prefix, dtype)  # [1, 1, T, P + T]

    def tree() -> torch.Tensor:
        return ops.tree_attention(q, k, v, bits, scale)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=hkv != h)

    diff = (tree().float() - sdpa().float()).abs().max().item()
    t_tree = time_call(tree, device, args.reps, args.warmup)
    t_sdpa = time_call(sdpa, device, args.reps, args.warmup)
    t_bits = time_call(lambda: ops.tree_ancestor_bits(parents), device, args.reps, args.warmup)
    t_mask = time_call(
        lambda: ops.tree_attention_mask(parents, prefix, dtype), device, args.reps, args.warmup
    )
    return [
        str(prefix),
        str(tree_tokens),
        f"{t_tree:.4f}",
        f"{t_sdpa:.4f}",
        f"{t_sdpa / t_tree:.2f}",
        f"{t_bits:.4f}",
        f"{t_mask:.4f}",
        f"{diff:.2e}",
    ]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--prefix", type=int, nargs="+", default=[512, 2048, 8192], help="cached keys P")
    ap.add_argument("--tree-tokens", type=int, nargs="+", default=[16, 32, 64], help="tree inputs T")
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=100)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    ap.add_argument("--out", type=Path, default=None, help="markdown report path (also printed)")
    args = ap.parse_args(argv)
    if min(args.prefix) < 0 or min(args.tree_tokens) < 1:
        ap.error("--prefix values must be >= 0 and --tree-tokens values >= 1")
    if args.heads % args.kv_heads:
        ap.error(f"--heads ({args.heads}) must be a multiple of --kv-heads ({args.kv_heads})")
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps must be >= 1 and --warmup >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [bench_row(args, p, t, device) for p in args.prefix for t in args.tree_tokens]
    cols = [
        "P",
        "T",
        "mtprobe ms",
        "SDPA dense ms",
        "SDPA / mtprobe",
        "bits ms",
        "dense mask ms",
        "max |diff|",
    ]
    lines = [
        "# Tree attention: ancestor bits vs SDPA with a dense mask",
        "",
        f"- command: `{shlex.join([Path(sys.executable).name, 'benchmarks/bench_tree_attention.py', *(argv if argv is not None else sys.argv[1:])])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- device: {device_name(device)}",
        f"- torch {torch.__version__}, Python {platform.python_version()}, dtype {args.dtype}",
        f"- shapes: batch 1, {args.heads} query heads, {args.kv_heads} KV heads, head dim {args.head_dim}; "
        f"a random tree of T nodes; median of {args.reps} calls after {args.warmup} warm-ups",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "|".join("---" for _ in cols) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
        "mtprobe ms / SDPA dense ms: one attention call (one layer). bits ms / dense mask ms: building the "
        "tree's pattern once per decode step (`tree_ancestor_bits` / `tree_attention_mask`). max |diff|: "
        "largest absolute difference between the two outputs.",
    ]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
