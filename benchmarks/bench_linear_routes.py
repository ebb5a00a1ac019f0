"""What a verification forward over T inputs costs on each CPU linear route, and whether the routes
mtprobe chooses on the machine at hand are at least as fast as torch's own linear.

The routes (:mod:`mtprobe.cpu.linear_routes`): ``stock`` (torch's ``F.linear``), ``packed`` (oneDNN on
weights packed once) and ``small-batch`` (mtprobe's op), each that runs here. First
``choose_linear_routes(model, refresh=True, cache=False)`` measures and chooses a route per block size,
as ``mtprobe.generate`` does once per machine and model; then every route is timed again on one
model in one process, interleaved (every repeat times each T with each route in turn, so a drift in
the machine's speed falls on all alike). The forward is the decode loop's own (``HFAdapter.forward``:
the loop's KV cache, a chain of T inputs after ``--contexts`` cached positions, its additive mask),
each route switched on around it with a ``linear_routes.Router``; medians of ``--repeats`` after one
warm-up round. Per T the report gives each route's ms and t(T) / t(1 stock), the chosen route, and
whether the chosen route's t(T) <= stock's t(T) (issue 42's target for T in 2-20). This is a
benchmark: nothing here asserts a speed.

    python benchmarks/bench_linear_routes.py --contexts 64 512 --repeats 7 \\
        --out benchmarks/results/linear_routes.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import torch

from _common import load_average, run_lines, write_report
from mtprobe import models
from mtprobe.cpu import linear_routes
from mtprobe.cpu.linear_routes import STOCK, LinearRoutes, Router
from mtprobe.cpu.machine import cpu_isa, cpu_name
from mtprobe.target_model.adapter import HFAdapter, max_positions
from mtprobe.target_model.profile import chain_mask, choose_linear_routes

TARGET = (2, 20)
"""The block sizes issue 42's target speaks of: the chosen route's t(T) <= stock's t(T) there."""


def runnable_routes() -> tuple[list[str], dict[str, str]]:
    """The routes that run here (stock first), and why each other one does not."""
    why = {r: linear_routes.unavailable(r) for r in linear_routes.ROUTES}
    return [r for r in linear_routes.ROUTES if not why[r]], {r: w for r, w in why.items() if w}


def time_routes(
    forward: Callable[[int], object],
    router: Router,
    routes: Sequence[str],
    sizes: Sequence[int],
    repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[tuple[int, str], float]:
    """Median seconds of ``forward(T)`` on each route, keyed ``(T, route)``: every round times each T
    on each route in turn (interleaved), the first round a warm-up, then ``repeats`` timed rounds."""
    times: dict[tuple[int, str], list[float]] = {(t, r): [] for t in sizes for r in routes}
    for rnd in range(repeats + 1):
        for t in sizes:
            for r in routes:
                with router.routed(r):
                    t0 = clock()
                    forward(t)
                    elapsed = clock() - t0
                if rnd:
                    times[t, r].append(elapsed)
    return {k: statistics.median(v) for k, v in times.items()}


def verdict(ms: Mapping[str, float], chosen: str) -> str:
    """Whether ``chosen``'s time is at most stock's at one (context, T): ``ms`` maps route -> ms there."""
    if chosen == STOCK:
        return "yes (stock)"
    if chosen not in ms or STOCK not in ms:
        return "n/a (not timed)"
    gap = f"{ms[chosen] / ms[STOCK] - 1:+.1%} vs stock"
    return f"yes ({gap})" if ms[chosen] <= ms[STOCK] else f"**no** ({gap})"


def target_misses(
    ms: Mapping[tuple[int, int, str], float],
    chosen: LinearRoutes,
    contexts: Sequence[int],
    sizes: Sequence[int],
) -> tuple[int, list[str]]:
    """How many (context, T) with T in :data:`TARGET` were timed, and those where the chosen route's
    t(T) exceeded stock's (``context C, T t: route +x%``)."""
    checked, misses = 0, []
    for ctx in contexts:
        for t in sizes:
            if not TARGET[0] <= t <= TARGET[1]:
                continue
            checked += 1
            r = chosen.route(t)
            if r != STOCK and ms[ctx, t, r] > ms[ctx, t, STOCK]:
                misses.append(f"context {ctx}, T {t}: {r} {ms[ctx, t, r] / ms[ctx, t, STOCK] - 1:+.1%}")
    return checked, misses


def missed_gains(
    ms: Mapping[tuple[int, int, str], float],
    chosen: LinearRoutes,
    contexts: Sequence[int],
    sizes: Sequence[int],
    routes: Sequence[str],
) -> list[str]:
    """The (context, T) with T in :data:`TARGET` where a route not chosen was faster than the chosen
    one by more than the chooser's margin (``linear_routes.MARGIN``): gains the choice left here."""
    out = []
    for ctx in contexts:
        for t in sizes:
            if not TARGET[0] <= t <= TARGET[1]:
                continue
            r = chosen.route(t)
            best = min(routes, key=lambda x: ms[ctx, t, x])
            if best != r and ms[ctx, t, best] < ms[ctx, t, r] * (1 - linear_routes.MARGIN):
                out.append(f"context {ctx}, T {t}: {best} {ms[ctx, t, best] / ms[ctx, t, r] - 1:+.1%} vs {r}")
    return out


def report_lines(
    model_name: str,
    ms: Mapping[tuple[int, int, str], float],
    chosen: LinearRoutes,
    *,
    contexts: Sequence[int],
    sizes: Sequence[int],
    routes: Sequence[str],
    skipped: Mapping[str, str],
    repeats: int,
    choose_s: float,
    routable: int,
    loads: tuple[str, str],
) -> list[str]:
    """The report: ``ms[context, T, route]`` the medians in milliseconds, ``chosen`` what
    ``choose_linear_routes`` chose (measured ``choose_s`` seconds), ``routable`` the linears routed."""
    checked, misses = target_misses(ms, chosen, contexts, sizes)
    gains = missed_gains(ms, chosen, contexts, sizes, routes)
    lines = [
        "# A verification forward's cost on each CPU linear route, and the routes mtprobe chooses",
        "",
        *run_lines(model_name),
        f"- CPU: {cpu_name()}, ISA {cpu_isa()}; load average (1, 5, 15 min) {loads[0]} -> {loads[1]}",
        f"- routes timed: {', '.join(f'`{r}` ({linear_routes.VERSIONS[r]})' for r in routes)} on {routable} "
        "`nn.Linear` modules" + "".join(f"; `{r}` not timed: {why}" for r, why in skipped.items()),
        f"- chosen (`choose_linear_routes(model, refresh=True, cache=False)`, {choose_s:.1f} s, measured first "
        f"in this process): {chosen.describe()}",
        f"- forward: `HFAdapter.forward` over a chain of T inputs after the context's cached positions, each "
        f"route on every linear (a `linear_routes.Router`); medians of {repeats} interleaved repeats after one "
        "warm-up round; t(T)/t(1) divides by stock's t(1), plain decoding as HF runs it",
        f"- **target** (issue 42: for each T in {TARGET[0]}-{TARGET[1]} the chosen route's t(T) <= stock's): "
        + (
            f"met at all {checked} (context, T) timed"
            if not misses
            else f"missed at {len(misses)} of {checked} (context, T) timed: " + "; ".join(misses)
        ),
        f"- faster than the chosen route by more than {linear_routes.MARGIN:.0%} in this run (T in "
        f"{TARGET[0]}-{TARGET[1]}): " + ("; ".join(gains) if gains else "none"),
    ]
    for ctx in contexts:
        one = ms[ctx, 1, STOCK]
        lines += [
            "",
            f"## Context {ctx}",
            "",
            "| T | "
            + " | ".join(f"{r} ms" for r in routes)
            + " | "
            + " | ".join(f"{r} t(T)/t(1)" for r in routes)
            + " | chosen | chosen <= stock |",
            "|---|" + "---|" * (2 * len(routes) + 2),
        ]
        for t in sizes:
            row = {r: ms[ctx, t, r] for r in routes}
            best = min(row, key=row.__getitem__)
            cells = [f"**{row[r]:.2f}**" if r == best else f"{row[r]:.2f}" for r in routes]
            cells += [f"{row[r] / one:.2f}" for r in routes]
            lines.append(
                f"| {t} | " + " | ".join(cells) + f" | {chosen.route(t)} | {verdict(row, chosen.route(t))} |"
            )
    if chosen.seconds:
        measured = list(chosen.seconds)
        lines += [
            "",
            f"## What `choose_linear_routes` measured (context {chosen.context}; its own medians)",
            "",
            "| T | " + " | ".join(f"{r} ms" for r in measured) + " | chosen |",
            "|---|" + "---|" * (len(measured) + 1),
        ]
        for j, t in enumerate(chosen.block_sizes):
            cells = " | ".join(f"{1000 * chosen.seconds[r][j]:.2f}" for r in measured)
            lines.append(f"| {t} | {cells} | {chosen.routes[j]} |")
    lines += ["", "Bold: the fastest route at that T in this run."]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--block-sizes", type=int, nargs="+", default=list(linear_routes.BLOCK_SIZES))
    ap.add_argument("--contexts", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    sizes = args.block_sizes
    if sizes[0] != 1 or any(a >= b for a, b in zip(sizes, sizes[1:], strict=False)) or args.repeats < 1:
        ap.error(
            "--block-sizes must ascend strictly from 1 (plain decoding, what t(T) is divided by); --repeats >= 1"
        )
    if min(args.contexts) < 1:
        ap.error("--contexts must be >= 1: a decode step's forward has a cached prefix")
    torch.set_num_threads(args.threads)
    load0 = load_average()
    model, _ = models.load(args.model)
    model.eval()
    capacity = max(args.contexts) + sizes[-1]
    if capacity > max_positions(model):
        ap.error(
            f"the largest context + block ({capacity}) exceeds the model's {max_positions(model)} positions"
        )
    routes, skipped = runnable_routes()
    routable = len(linear_routes.routable_linears(model))
    if not routable or len(routes) == 1:
        raise SystemExit(
            f"nothing to compare: {routable} routable nn.Linear modules, routes that run here: {routes} ({skipped})"
        )
    # Measured first, as mtprobe.generate would on this machine (not from the disk cache: measured now).
    t0 = time.perf_counter()
    chosen = choose_linear_routes(model, refresh=True, cache=False)
    choose_s = time.perf_counter() - t0
    print(f"chosen in {choose_s:.1f} s: {chosen.describe()}", file=sys.stderr)
    router = Router(model, routes)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (capacity,), generator=torch.Generator().manual_seed(0))  # [capacity]
    ms: dict[tuple[int, int, str], float] = {}
    with torch.inference_mode():
        for ctx in args.contexts:
            adapter = HFAdapter(model, capacity, max_capacity=capacity)  # no routes: the router switches them
            adapter.forward(ids[:ctx], None, torch.arange(ctx)[None], None, 0, False)  # the cached prefix
            # Each T's inputs, positions [1, T] and mask made before timing: only the forward is timed.
            inputs = {
                t: (
                    ids[ctx : ctx + t],
                    torch.arange(ctx, ctx + t)[None],
                    chain_mask(model, t, ctx, torch.device("cpu")),
                )
                for t in sizes
            }

            def forward(t: int, ctx: int = ctx, inputs: dict = inputs, adapter: HFAdapter = adapter) -> None:
                x, pos, mask = inputs[t]
                adapter.forward(x, None, pos, mask, ctx, False)

            for (t, r), s in time_routes(forward, router, routes, sizes, args.repeats).items():
                ms[ctx, t, r] = 1000 * s
            print(f"context {ctx} done, load {load_average()}", file=sys.stderr)
    lines = report_lines(
        args.model,
        ms,
        chosen,
        contexts=args.contexts,
        sizes=sizes,
        routes=routes,
        skipped=skipped,
        repeats=args.repeats,
        choose_s=choose_s,
        routable=routable,
        loads=(load0, load_average()),
    )
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    sys.exit(main())
