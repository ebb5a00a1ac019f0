"""AutoConfig and EntMTP's policies against HF greedy, HF prompt lookup and every mtprobe method, side by side.

Runs the Spec-Bench harness (``python -m mtprobe.specbench run``) once per method on the same
questions, one after another in fresh processes, then ``compare`` over the answer folder, and writes
``README.md`` there with the commands, the machine, versions and the load average before and after
each run. This is a benchmark: nothing here asserts a speed.

    python -m mtprobe topology --model smollm2-135m --num-prompts 12 --max-new-tokens 64 \\
        --debias-sizes 1,2,4,8,14 --out benchmarks/results/auto/bank-smollm2-135m.json
    python benchmarks/bench_auto.py --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 2 --max-new-tokens 64 --out-dir benchmarks/results/auto

The EntMTP rows use the topology bank ``--bank`` (built by the first command on mtprobe's own
prompts, not on Spec-Bench's questions). The ``-mem`` rows use one cross-request n-gram memory per run
(``--shared-ngram-memory``), ``auto-hybrid-mem`` also the calibrated masks ``MASKS``; the ``-stock``
rows run with mtprobe's small-batch linear op turned off (``MTPROBE_SMALL_BATCH_LINEAR=0``, torch's
own linear layers for every forward). Both kinds run only when named in ``--methods``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
import transformers

from _common import device_name, load_average
from mtprobe import small_batch_linear

MEMORY = 1 << 18  # the harness's --shared-ngram-memory size
MASKS = "benchmarks/results/calibrate/masks-smollm2-135m-k1-offsets.safetensors"
PLD = {"method": "pld"}
STAND_MEM = {"method": "stand", "block_complexity": 10, "memory_size": MEMORY}
HYBRID_MEM = {
    "method": "hybrid",
    "block_complexity": 10,
    "mask_init": "calibrated",
    "mask_path": MASKS,
    "memory_size": MEMORY,
}

# (answer file stem, method arguments): HF's own baselines, every mtprobe method at a static setting,
# and the scheduler.
METHODS = [
    ("ar", ["--method", "ar"]),
    ("hf-pld", ["--method", "hf-pld", "--num-tokens", "10"]),
    ("pld", ["--method", "pld", "--num-tokens", "10"]),
    ("stand-bc10", ["--method", "stand", "--block-complexity", "10"]),
    ("probe-bc10", ["--method", "probe", "--block-complexity", "10"]),
    ("hybrid-bc10", ["--method", "hybrid", "--block-complexity", "10"]),
    ("auto", ["--method", "auto"]),
    # AutoConfig's drafters with the cross-request n-gram memory (issue 14), and with the hybrid beside
    # them (its calibrated masks with layer offsets; memory too).
    ("stand-bc10-mem", ["--method", "stand", "--block-complexity", "10", "--shared-ngram-memory"]),
    ("auto-mem", ["--method", "auto", "--drafters", json.dumps([PLD, STAND_MEM])]),
    ("auto-hybrid-mem", ["--method", "auto", "--drafters", json.dumps([PLD, STAND_MEM, HYBRID_MEM])]),
    # The same with torch's own linear layers for every forward (MTPROBE_SMALL_BATCH_LINEAR=0), as
    # before mtprobe's small-batch op: what the op itself brings, in the same run.
    ("stand-bc10-stock", ["--method", "stand", "--block-complexity", "10"]),
    ("auto-stock", ["--method", "auto"]),
    ("entmtp-static", ["--method", "entmtp", "--policy", "static"]),
    ("entmtp-ladder", ["--method", "entmtp", "--policy", "ladder"]),
    ("entmtp-hysteretic", ["--method", "entmtp", "--policy", "hysteretic"]),
]


# Rows run with mtprobe's small-batch linear op turned off (mtprobe.small_batch_linear).
STOCK_LINEAR = {"stand-bc10-stock", "auto-stock"}
# What runs without --methods: all but the -mem and -stock rows.
DEFAULT_METHODS = [n for n, _ in METHODS if "mem" not in n and n not in STOCK_LINEAR]


def method_env(stem: str) -> dict[str, str] | None:
    """The environment a row's process runs in: the small-batch op turned off for a -stock row, else the
    inherited one (None)."""
    return {**os.environ, small_batch_linear.ENV: "0"} if stem in STOCK_LINEAR else None


def round_sizes(per_category: int, rounds: int) -> list[int]:
    """The --per-category of each round: round r answers the first ceil(r * P / K) questions of every
    category, and the harness skips those an earlier round answered, so each round adds the next
    slice to the same answer files. ``round_sizes(20, 4) == [5, 10, 15, 20]``."""
    if not 1 <= rounds <= per_category:
        raise ValueError(f"rounds must be between 1 and per_category ({per_category}), got {rounds}")
    return [-(-r * per_category // rounds) for r in range(1, rounds + 1)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--question-file", type=Path, required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run the methods in turn K times, each round answering the next slice of every category's "
        "questions, so that a drift in the machine's speed falls on every method alike (default %(default)s)",
    )
    ap.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help="comma list of the stems above (default: all but the -mem rows)",
    )
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument(
        "--bank",
        type=Path,
        default=Path("benchmarks/results/auto/bank-smollm2-135m.json"),
        help="the topology bank of the entmtp rows (default %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        sizes = round_sizes(args.per_category, args.rounds)
    except ValueError as e:
        ap.error(f"--{e}")
    stems = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(stems) - {stem for stem, _ in METHODS})
    if unknown or not stems:
        ap.error(
            f"--methods {args.methods!r}: no such row(s) {unknown}; the rows are {[s for s, _ in METHODS]}"
        )
    chosen = [m for m in METHODS if m[0] in stems]
    memory_rows = [stem for stem, _ in chosen if "mem" in stem]
    if memory_rows and args.repeats > 1:
        ap.error(
            f"{memory_rows} share an n-gram memory across questions: timed repeats would not time the same "
            "decoding; use --repeats 1"
        )
    if memory_rows and args.rounds > 1:
        ap.error(
            f"{memory_rows} share an n-gram memory that lives in one process, but each of --rounds "
            f"{args.rounds} runs its own process: use --rounds 1 for them"
        )
    answers = args.out_dir / "answers"
    answers.mkdir(parents=True, exist_ok=True)
    common = [
        "--question-file", str(args.question_file), "--model", args.model, "--first-turn-only",
        "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads),
        "--repeats", str(args.repeats), "--warmup", "1", "--no-progress", "--device", args.device,
        "--dtype", args.dtype,
    ]  # fmt: skip
    log = []
    for r, per_category in enumerate(sizes, 1):
        for stem, method_args in chosen:
            if stem.startswith("entmtp"):
                method_args = [*method_args, "--bank", str(args.bank)]
            cmd = [sys.executable, "-m", "mtprobe.specbench", "run", *common, "--per-category", str(per_category),
                   *method_args, "--answer-file", str(answers / f"{stem}.jsonl")]  # fmt: skip
            start, load0 = dt.datetime.now(dt.timezone.utc), load_average()
            env = method_env(stem)
            subprocess.run(cmd, check=True, env=env)
            end, load1 = dt.datetime.now(dt.timezone.utc), load_average()
            shown = shlex.join(["python", *cmd[1:]])
            if env is not None:
                shown = f"{small_batch_linear.ENV}=0 {shown}"
            log.append(f"| {stem} | `{shown}` | {start:%H:%M:%S}–{end:%H:%M:%S} | {load0} → {load1} |")
            print(f"bench_auto: {stem} (round {r}) done, load {load0} -> {load1}", file=sys.stderr)
    compare = [sys.executable, "-m", "mtprobe.specbench", "compare", str(answers), "--tokenizer", args.model,
               "--out-dir", str(args.out_dir)]  # fmt: skip
    subprocess.run(compare, check=True)
    # The machine's cores and the harness's threads are on the README's line already: a CPU is "CPU".
    where = "CPU" if args.device == "cpu" else device_name(args.device)
    readme = [
        "# AutoConfig and EntMTP beside HF greedy, HF prompt lookup and every mtprobe method",
        "",
        f"- command: `{shlex.join(['python', *sys.argv])}`",
        f"- date: {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M UTC}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, {args.threads} torch threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}; model `{args.model}`, {args.dtype}, {where}",
        f"- questions: the first {args.per_category} question(s) of every category of `{args.question_file.name}`, "
        f"first turns, at most {args.max_new_tokens} new tokens, greedy, {args.repeats} timed run(s) each",
        "- every method ran in its own process, one after another"
        + (
            f", in {args.rounds} rounds (each round ran every method on the next slice of every category's "
            "questions, so a drift in the machine's speed falls on all methods alike)"
            if args.rounds > 1
            else ""
        )
        + "; the load average (1, 5, 15 minutes) at the start and end of each run is below",
        "- the table and figure: `compare.md`, `compare.png` (speedup over `ar`, HF greedy)",
        *(
            [
                f"- EntMTP rows: the topology bank `{args.bank}` (trees, thresholds and how it was built are in the file)"
            ]
            if any(stem.startswith("entmtp") for stem, _ in chosen)
            else []
        ),
        "",
        "| run | command | time (UTC) | load average |",
        "| --- | --- | --- | --- |",
        *log,
        "",
        f"`{shlex.join(['python', *compare[1:]])}`",
        "",
    ]
    (args.out_dir / "README.md").write_text("\n".join(readme), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
