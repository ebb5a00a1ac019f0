"""The GPU step, side by side (issue 41): HF's plain decodings against mtprobe's methods on the
static forward plan (:mod:`mtprobe.target_model.plan`: fixed KV buffer, buckets, CUDA graphs).

Rows, interleaved prompt by prompt after one warm-up pass (captures and compilation happen there
and are reported apart):

- ``hf-eager``: ``model.generate(do_sample=False)``, the reference every answer is checked against;
- ``hf-static-compile``: HF's fastest plain decoding as transformers documents it,
  ``cache_implementation="static"`` with the forward compiled (``torch.compile(mode="reduce-overhead")``;
  CUDA only, ``--no-compile`` leaves it out);
- ``plain``, ``pld``, ``stand``, ``probe``, ``hybrid``, ``auto``: mtprobe through ``PlanConfig()``.

With ``--batch-sizes`` (e.g. ``4,8``) a second table: the prompts in left-padded batches of B, HF's batched
greedy (``model.generate`` on the batch) against mtprobe's methods on the same batch (the batch's plan,
:mod:`mtprobe.target_model.batch_plan`: one forward per step for every row, graphs per (rows, tokens) bucket),
each row checked against hf-eager on its prompt alone.

Per row: tokens/s, speedup over hf-eager, τ, forward time per step, the loop's time per step outside
the forward, graphs captured and their cost, device->host reads per step, and token equality with
hf-eager (fp32: every answer must be identical; bf16: every first divergence with its top-2 logit
margin, a near-tie or not). Runs on the CPU too (eager plan, for a dry run):

    python benchmarks/bench_gpu.py --device cuda --dtype bfloat16 --out benchmarks/results/gpu/step.md
    python benchmarks/bench_gpu.py --device cpu --limit 1 --max-new-tokens 8 --methods plain,hybrid --no-compile
    python benchmarks/bench_gpu.py --device cuda --dtype bfloat16 --batch-sizes 4,8 --methods pld,auto --no-compile
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import mtprobe
import mtprobe.models
from _common import device_name, load_average, run_lines, write_report
from mtprobe.data import load_prompts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
METHODS = {
    "plain": lambda: mtprobe.PlainConfig(),
    "pld": lambda: mtprobe.PromptLookupConfig(),
    "stand": lambda: mtprobe.StandConfig(block_complexity=30),
    "probe": lambda: mtprobe.ProbeConfig(block_complexity=30),
    "hybrid": lambda: mtprobe.HybridConfig(block_complexity=30),
    "auto": lambda: mtprobe.AutoConfig(),
}


NO_PLAN = " (no plan)"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def encode(tokenizer: Any, messages: list[dict[str, str]], device: torch.device) -> torch.Tensor:
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    return (enc if torch.is_tensor(enc) else enc["input_ids"]).to(device)  # [1, L]


@torch.no_grad()
def top2_margin(model: Any, prefix: torch.Tensor) -> tuple[float, int, int]:
    """The model's top-2 logit margin after ``prefix`` ([1, L]), and its top two tokens."""
    logits = model(prefix).logits[0, -1].float()  # [vocab]
    top = logits.topk(2)
    return float(top.values[0] - top.values[1]), int(top.indices[0]), int(top.indices[1])


def divergence(model: Any, ref: torch.Tensor, got: torch.Tensor) -> str | None:
    """Where ``got`` first leaves ``ref`` ([1, L] each), with the margin there; None when identical."""
    a, b = ref[0].tolist(), got[0].tolist()
    for i in range(min(len(a), len(b))):
        if a[i] != b[i]:
            margin, t1, t2 = top2_margin(model, ref[:, :i])
            return f"index {i}: {b[i]} vs {a[i]} (top-2 {t1}, {t2}; margin {margin:.3f})"
    return None if len(a) == len(b) else f"lengths {len(b)} vs {len(a)}"


def run_row(name: str, model: Any, ids: torch.Tensor, n: int, compiled: Any) -> dict[str, Any]:
    device = ids.device
    sync(device)
    t0 = time.perf_counter()
    if name == "hf-eager":
        seq = model.generate(ids, do_sample=False, max_new_tokens=n)
        out = None
    elif name == "hf-static-compile":
        seq = compiled(ids)
        out = None
    else:
        plan = None if name.endswith(NO_PLAN) else mtprobe.PlanConfig()
        out = mtprobe.generate(model, ids, METHODS[name.removesuffix(NO_PLAN)](), max_new_tokens=n, plan=plan)
        seq = out.sequences
    sync(device)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"seq": seq, "wall": wall, "tokens": seq.shape[1] - ids.shape[1]}
    if out is not None:
        row.update(
            steps=out.steps,
            tau=out.tau,
            forward_s=out.timings["forward_s"] - out.timings["prefill_s"],
            outside_s=out.timings["total_s"] - out.timings["forward_s"],
            reads=out.host_reads,
            calls=out.forward_calls,
            plan=out.plan,
        )
    return row


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``prompts`` ([1, L_i] each) as HF batches them for generation: ``ids [B, L]`` and ``mask [B, L]``."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.stack([torch.nn.functional.pad(p[0], (width - p.shape[1], 0), value=pad) for p in prompts])
    mask = torch.stack(
        [torch.nn.functional.pad(torch.ones_like(p[0]), (width - p.shape[1], 0)) for p in prompts]
    )
    return ids, mask


def run_batch(
    name: str, model: Any, ids: torch.Tensor, mask: torch.Tensor, n: int, pad: int
) -> dict[str, Any]:
    """One batch through ``hf-batched`` (HF's batched greedy) or a method on the batch's plan: the rows' new
    tokens ([B] lists, padded after an early end), wall time, τ and the plan's account."""
    device = ids.device
    sync(device)
    t0 = time.perf_counter()
    kw = dict(attention_mask=mask, max_new_tokens=n, do_sample=False, pad_token_id=pad)
    out = None
    if name == "hf-batched":
        seq = model.generate(ids, **kw)
    else:
        out = mtprobe.generate(model, ids, METHODS[name](), plan=mtprobe.PlanConfig(), **kw)
        seq = out.sequences
    sync(device)
    wall = time.perf_counter() - t0
    row: dict[str, Any] = {"rows": seq[:, ids.shape[1] :].tolist(), "wall": wall}
    if out is not None:
        row.update(tau=out.tau, plan=out.plan)
    return row


def batch_table(
    args: argparse.Namespace, model: Any, encoded: list[torch.Tensor], refs: list[list[int]], pad: int
) -> list[str]:
    """The ``--batch-sizes`` table (module docstring): per batch size, HF batched greedy and each method."""
    names = ["hf-batched", *args.methods.split(",")]
    lines = [
        "| B | row | tok/s | × hf-batched | τ | rows identical to hf-eager alone | graphs (replays) |",
        "|---|---|---|---|---|---|---|",
    ]
    departed: list[str] = []
    for size in (int(b) for b in args.batch_sizes.split(",")):
        batches = [encoded[i : i + size] for i in range(0, len(encoded) - size + 1, size)]
        if not batches:
            lines.append(f"| {size} | (fewer than {size} prompts: --limit) | | | | | |")
            continue
        for name in names:  # warm-up: captures
            ids, mask = left_padded(batches[0], pad)
            run_batch(name, model, ids, mask, args.max_new_tokens, pad)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
        same = dict.fromkeys(names, 0)
        for rep in range(args.repeats):
            for b, batch in enumerate(batches):
                ids, mask = left_padded(batch, pad)
                for name in names:  # interleaved batch by batch
                    r = run_batch(name, model, ids, mask, args.max_new_tokens, pad)
                    expected = refs[b * size : (b + 1) * size]
                    r["tokens"] = sum(len(want) for want in expected)  # what each row is to produce
                    runs[name].append(r)
                    if rep == 0:
                        for j, (got, want) in enumerate(zip(r["rows"], expected, strict=True)):
                            if got[: len(want)] == want and all(t == pad for t in got[len(want) :]):
                                same[name] += 1
                            else:  # where it departs, as the single-prompt table says it
                                prompt = batch[j][0]
                                ref, mine = (
                                    torch.cat([prompt, prompt.new_tensor(t)])[None] for t in (want, got)
                                )
                                departed.append(f"B {size} {name}: {divergence(model, ref, mine)}")
        base = sum(r["tokens"] for r in runs["hf-batched"]) / sum(r["wall"] for r in runs["hf-batched"])
        for name in names:
            rs = runs[name]
            tps = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
            tau = f"{statistics.fmean(r['tau'] for r in rs):.2f}" if "tau" in rs[0] else ""
            graphs = f"{rs[-1]['plan']['graphs']} ({rs[-1]['plan']['replays']})" if "plan" in rs[0] else ""
            rows = len(batches) * size
            lines.append(
                f"| {size} | {name} | {tps:.1f} | {tps / base:.2f} | {tau} | {same[name]}/{rows} | {graphs} |"
            )
    lines += [
        "",
        "Rows that depart from hf-eager alone (first index in prompt + row, top-2 logit margin there):",
        "",
    ]
    return lines + ([f"- {d}" for d in departed] or ["- none: every row identical"])


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--limit", type=int, default=6, help="prompts (the package's, in order)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    ap.add_argument("--no-compile", action="store_true", help="leave out hf-static-compile")
    ap.add_argument(
        "--unplanned",
        action="store_true",
        help="each method also without the plan (the growing cache), beside it",
    )
    ap.add_argument(
        "--batch-sizes",
        default="",
        help="comma-separated batch sizes: the prompts also in left-padded batches (module docstring)",
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    unknown = [m for m in args.methods.split(",") if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    model, tokenizer = mtprobe.models.load(args.model, dtype=dtype, device=args.device)
    model.eval()
    prompts = load_prompts()[: args.limit]
    encoded = [encode(tokenizer, p["messages"], device) for p in prompts]
    n = args.max_new_tokens
    rows = ["hf-eager"]
    compiled = None
    compile_s = 0.0
    if not args.no_compile and device.type == "cuda":
        rows.append("hf-static-compile")
        # transformers' documented recipe: a static cache and the forward compiled for CUDA graphs (only
        # in this row: generate's own automatic compilation is switched off, so nothing compiles twice).
        compiled_forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)

        def compiled(ids: torch.Tensor) -> torch.Tensor:
            eager, model.forward = model.forward, compiled_forward
            try:
                return model.generate(
                    ids,
                    do_sample=False,
                    max_new_tokens=n,
                    cache_implementation="static",
                    disable_compile=True,
                )
            finally:
                model.forward = eager

    for method in args.methods.split(","):
        rows += [method, method + NO_PLAN] if args.unplanned else [method]
    # Warm-up: every row once on the first prompt (compilation, captures, lazy initialisation).
    warm: dict[str, float] = {}
    failed: dict[str, str] = {}
    for name in rows:
        t0 = time.perf_counter()
        try:
            run_row(name, model, encoded[0], n, compiled)
        except Exception as e:  # noqa: BLE001 (a row that cannot run is reported, not fatal)
            failed[name] = f"{type(e).__name__}: {e}"
            print(f"{name}: warm-up failed: {failed[name]}", file=sys.stderr)
        warm[name] = time.perf_counter() - t0
    if "hf-eager" in failed:
        raise SystemExit(f"HF greedy itself failed: {failed['hf-eager']}")
    rows = [r for r in rows if r not in failed]
    if "hf-static-compile" in warm:
        compile_s = warm["hf-static-compile"]
    results: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
    diverged: dict[str, list[str]] = {r: [] for r in rows}
    for rep in range(args.repeats):
        for i, ids in enumerate(encoded):
            ref = None
            for name in rows:  # interleaved prompt by prompt
                r = run_row(name, model, ids, n, compiled)
                results[name].append(r)
                if name == "hf-eager":
                    ref = r["seq"]
                elif rep == 0:
                    d = divergence(model, ref, r["seq"])
                    if d is not None:
                        diverged[name].append(f"{prompts[i]['id']}: {d}")
            print(f"repeat {rep + 1}, prompt {i + 1}/{len(encoded)} done", file=sys.stderr)

    base = sum(r["tokens"] for r in results["hf-eager"]) / sum(r["wall"] for r in results["hf-eager"])
    table = [
        "| row | tok/s | × hf-eager | τ | forward ms/step | outside-forward ms/step | reads/forward "
        "| graphs held (captured in timed runs) | identical |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in rows:
        rs = results[name]
        tps = sum(r["tokens"] for r in rs) / sum(r["wall"] for r in rs)
        same = f"{len(encoded) - len(diverged[name])}/{len(encoded)}" if name != "hf-eager" else "ref"
        if "tau" in rs[0]:
            steps = sum(r["steps"] for r in rs)
            tau = statistics.fmean(r["tau"] for r in rs)
            fwd = 1e3 * sum(r["forward_s"] for r in rs) / steps
            outside = 1e3 * sum(r["outside_s"] for r in rs) / steps
            reads = sum(r["reads"] for r in rs) / sum(r["calls"] for r in rs)
            plan = rs[-1]["plan"]
            if plan is None:
                graphs = "no plan"
            else:
                captured = sum(r["plan"]["graphs"] for r in rs)
                graphs = f"{plan['graphs_held']} ({captured})"
                if plan["eager_reason"]:
                    graphs += f"; eager: {plan['eager_reason']}"
            table.append(
                f"| {name} | {tps:.1f} | {tps / base:.2f} | {tau:.2f} | {fwd:.2f} | {outside:.3f} | {reads:.2f} "
                f"| {graphs} | {same} |"
            )
        else:
            extra = f" (compile + first call {compile_s:.1f} s)" if name == "hf-static-compile" else ""
            table.append(f"| {name}{extra} | {tps:.1f} | {tps / base:.2f} | | | | | | {same} |")
    lines = [
        "# The GPU step: HF's plain decodings and mtprobe on the static forward plan",
        "",
        *run_lines(args.model)[:2],
        f"- model: `{args.model}`, {args.dtype}, device: {device_name(device)}",
        f"- {len(encoded)} prompts (mtprobe/data/prompts.jsonl), at most {n} new tokens each, "
        f"{args.repeats} repeats interleaved prompt by prompt after a warm-up pass; load {load_average()}",
        "- warm-up seconds per row (captures, compilation): "
        + ", ".join(f"{k} {v:.1f}" for k, v in warm.items()),
        "- forward ms/step: the host's time in the forward call; on a GPU that is the replay's (or the "
        "kernels') enqueue, and the GPU's own work is waited for at the step's device read, in "
        "outside-forward ms/step",
        "",
        *table,
        "",
        "Divergences from hf-eager (first index, top-2 logit margin there):",
        "",
    ]
    for name in rows:
        for d in diverged[name]:
            lines.append(f"- {name}: {d}")
    if not any(diverged.values()):
        lines.append("- none: every answer identical")
    for name, why in failed.items():
        lines.append(f"- {name} could not run: {why}")
    if args.batch_sizes:
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        refs = [
            r["seq"][0, ids.shape[1] :].tolist() for r, ids in zip(results["hf-eager"], encoded, strict=False)
        ]
        lines += [
            "",
            "## Batches: HF's batched greedy and mtprobe on the batch's plan",
            "",
            *batch_table(args, model, encoded, refs, pad),
        ]
    if args.out:
        write_report(args.out, lines)
    else:
        print("\n".join(lines))
    bad = args.dtype == "float32" and any(diverged.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
