"""What a verification forward over T inputs costs with torch's own linear layers and with mtprobe's
small-batch op (mtprobe.small_batch_linear), on the model and machine at hand.

Both adapters run on one model in one process, their forwards interleaved (every repeat times each T
with each route in turn), so a drift in the machine's speed falls on both alike. The forward is the
decode loop's own (``HFAdapter.forward``: the loop's KV cache, a chain-shaped block of T inputs after
``--context`` cached positions, its additive mask); medians of ``--repeats``. This is a benchmark:
nothing here asserts a speed.

    python benchmarks/bench_small_batch_linear.py --contexts 64 512 \\
        --out benchmarks/results/small_batch_linear.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import device_name, load_average, run_lines, write_report
from mtprobe import models, small_batch_linear
from mtprobe.adapter import HFAdapter
from mtprobe.profile import chain_mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 9, 12, 16])
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    if args.block_sizes[0] != 1 or args.repeats < 1:
        ap.error("--block-sizes must start at 1 (plain decoding, what t(T) is divided by); --repeats >= 1")
    torch.set_num_threads(args.threads)
    model, _ = models.load(args.model)
    routes = {"torch": [], "small-batch": small_batch_linear.routable_linears(model)}
    if not routes["small-batch"]:
        raise SystemExit(
            f"the small-batch route is off here ({small_batch_linear.ENV}=0, a CPU without AVX2/FMA, or no "
            "float32 CPU nn.Linear in the model): nothing to compare"
        )
    sizes, load0 = args.block_sizes, load_average()
    capacity = max(args.contexts) + max(sizes)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (capacity,), generator=torch.Generator().manual_seed(0))  # [capacity]
    ms: dict[tuple[int, int, str], float] = {}
    with torch.inference_mode():
        for ctx in args.contexts:
            adapters = {}
            for name, linears in routes.items():
                adapters[name] = HFAdapter(model, capacity, max_capacity=capacity)
                adapters[name]._small_batch_linears = linears  # this route for every forward
                adapters[name].forward(ids[:ctx], None, torch.arange(ctx)[None], None, 0, False)
            times: dict[tuple[int, str], list[float]] = {(t, n): [] for t in sizes for n in routes}
            for rep in range(args.repeats + 1):  # the first round warms up
                for t in sizes:
                    pos = torch.arange(ctx, ctx + t)[None]  # [1, T]
                    mask = chain_mask(model, t, ctx, torch.device("cpu"))
                    for name, adapter in adapters.items():
                        t0 = time.perf_counter()
                        adapter.forward(ids[ctx : ctx + t], None, pos, mask, ctx, False)
                        if rep:
                            times[t, name].append(time.perf_counter() - t0)
            for (t, name), xs in times.items():
                ms[ctx, t, name] = 1000 * statistics.median(xs)
            print(f"context {ctx} done, load {load_average()}", file=sys.stderr)
    load1 = load_average()
    lines = [
        "# A verification forward's cost with torch's linear layers and with mtprobe's small-batch op",
        "",
        *run_lines(args.model),
        f"- device: {device_name(torch.device('cpu'))}; load average {load0} -> {load1}",
        f"- forward: `HFAdapter.forward` over a chain of T inputs after the context's cached positions; medians "
        f"of {args.repeats} interleaved repeats (after one warm-up round); routes: `torch` (every linear "
        f"through torch), `small-batch` ({len(routes['small-batch'])} `nn.Linear` modules through "
        f"`torch.ops.mtprobe.small_batch_linear` for 2 <= T <= {small_batch_linear.MAX_ROWS}, torch's "
        "otherwise, as mtprobe decodes)",
        "",
        "| context | route | " + " | ".join(f"t({t}) ms" for t in sizes) + " |",
        "|---|---|" + "---|" * len(sizes),
    ]
    for ctx in args.contexts:
        for name in routes:
            lines.append(f"| {ctx} | {name} | " + " | ".join(f"{ms[ctx, t, name]:.1f}" for t in sizes) + " |")
    lines += [
        "",
        "t(T) / t(1), each route over its own t(1):",
        "",
        "| context | route | " + " | ".join(f"T={t}" for t in sizes[1:]) + " |",
        "|---|---|" + "---|" * (len(sizes) - 1),
    ]
    for ctx in args.contexts:
        for name in routes:
            one = ms[ctx, sizes[0], name]
            lines.append(
                f"| {ctx} | {name} | " + " | ".join(f"{ms[ctx, t, name] / one:.2f}" for t in sizes[1:]) + " |"
            )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
