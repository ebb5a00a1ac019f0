#!/usr/bin/env python
"""Fuzzing at scale: the hypothesis properties of tests/test_fuzz.py with >= 10^5 cases in all.

The test suite runs a fast, derandomized slice of the same properties; this runs each for its
``bench_examples`` cases (times ``--scale``) under the ``mtprobe-fuzz-bench`` profile, from a random
seed that the report records (``--seed`` repeats a run), and reports cases, failures, rounding
near-ties and time per property. A failure prints hypothesis's shrunk counterexample and makes the
exit status 1.

    python benchmarks/fuzz.py --out benchmarks/results/fuzz.md
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import platform
import random
import shlex
import sys
import time
import traceback
from pathlib import Path
from types import ModuleType

import hypothesis
import torch

from _common import write_report

TESTS = Path(__file__).resolve().parent.parent / "tests"


def load_fuzz_tests() -> ModuleType:
    """tests/test_fuzz.py as a module (tests/ is no package; it imports tests/tolerances.py)."""
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    spec = importlib.util.spec_from_file_location("tests_test_fuzz", TESTS / "test_fuzz.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every property's bench_examples")
    ap.add_argument("--only", nargs="+", default=None, help="property names (default: all)")
    ap.add_argument(
        "--seed", type=int, default=None, help="hypothesis seed (default: a random one, reported)"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/fuzz.md")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)

    fuzz = load_fuzz_tests()
    props = [p for p in fuzz.PROPERTIES if args.only is None or p.name in args.only]
    unknown = set(args.only or []) - {p.name for p in fuzz.PROPERTIES}
    if unknown:
        ap.error(f"unknown properties {sorted(unknown)}; known: {[p.name for p in fuzz.PROPERTIES]}")

    rows, failures, started = [], [], time.perf_counter()
    for prop in props:
        examples = max(1, round(prop.bench_examples * args.scale))
        t0 = time.perf_counter()
        failed = 0
        try:
            fuzz.run_property(prop, fuzz.PROFILE_BENCH, examples, seed=seed)
        except Exception as e:  # a falsified property: hypothesis has shrunk it already
            failed = 1
            notes = "\n".join(getattr(e, "__notes__", []))
            failures.append(
                f"### {prop.name}\n\n```\n{notes}\n{''.join(traceback.format_exception_only(e))}```"
            )
            print(failures[-1], file=sys.stderr)
        seconds = time.perf_counter() - t0
        cases = fuzz.STATS.cases.get(prop.name, 0)
        near = fuzz.STATS.near_ties.get(prop.name, 0)
        rows.append(
            f"| {prop.name} | {examples} | {cases} | {failed} | {near} | {seconds:.0f} | {1e3 * seconds / max(1, cases):.1f} |"
        )
        print(rows[-1], file=sys.stderr, flush=True)
    wall = time.perf_counter() - started
    total = sum(fuzz.STATS.cases.get(p.name, 0) for p in props)

    lines = [
        "# Fuzzing: the ops and the C++ core against `mtprobe.reference` (hypothesis)",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- machine: {platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU: ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU'}, "
        f"{torch.get_num_threads()} torch thread(s); Python {platform.python_version()}, torch {torch.__version__}, "
        f"hypothesis {hypothesis.__version__}",
        f"- properties: `tests/test_fuzz.py` (`PROPERTIES`), profile `{fuzz.PROFILE_BENCH}`, hypothesis seed "
        f"{seed} (`--seed {seed}` repeats this run), scale {args.scale}",
        f"- {total} cases in {wall:.0f} s wall time, {len(failures)} failing propert{'y' if len(failures) == 1 else 'ies'}",
        "",
        "Cases count every call of the property, hypothesis's shrinking included. A near-tie is a case where "
        "the op and the reference differ only because one uniform lies within "
        f"{fuzz.NUDGE:g} of a decision boundary (the op's float32 residual against the reference's float64); "
        "moving that uniform by that much gives the op's answer, so it is rounding, not a wrong rule.",
        "",
        "| property | examples asked | cases | failures | near-ties | seconds | ms / case |",
        "|---|---|---|---|---|---|---|",
        *rows,
        f"| **all** | {sum(max(1, round(p.bench_examples * args.scale)) for p in props)} | {total} | "
        f"{len(failures)} | {sum(fuzz.STATS.near_ties.values())} | {wall:.0f} | {1e3 * wall / max(1, total):.1f} |",
    ]
    if failures:
        lines += ["", "## Counterexamples", "", *failures]
    write_report(args.out, lines)
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
