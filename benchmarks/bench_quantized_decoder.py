"""The quantized self-draft's C++ step on the CPU: its time per draft token by context length, and the
generation it drafts for against HF greedy, question by question, interleaved, repeated.

    OMP_NUM_THREADS=2 python benchmarks/bench_quantized_decoder.py \\
        --question-file ../shared/specbench/question-dev.jsonl --categories rag summarization qa \\
        --per-category 8 --max-new-tokens 64 --repeats 1 --out benchmarks/results/quantized_decoder/new.md

``--head-scans 0,16`` runs one self-draft row per value of ``MTPROBE_DRAFT_HEAD_SCAN`` (0: the whole 8-bit head;
N: the head in 4 bits first, then its best N rows in 8), interleaved question by question after HF greedy, and
times a draft token under each; ``--off-grid SEED`` moves the weights off the 4-bit grid first:

    python benchmarks/bench_quantized_decoder.py --question-file ../shared/specbench/question-dev.jsonl \
        --categories rag summarization qa --per-category 8 --repeats 2 --head-scans 0,16 \
        --out benchmarks/results/quantized_decoder/head-scan-on-grid.md

``--architectures qwen2.5-0.5b qwen3-0.6b ...`` instead times one draft token of models of those shapes with
random weights (no checkpoint of them ships here; a step's time depends on the shapes, not the values):
through HF's modules (what the self-draft ran on before the C++ step took their architecture) and through
the C++ step, after 256 positions, interleaved:

    python benchmarks/bench_quantized_decoder.py --architectures qwen2.5-0.5b qwen3-0.6b mistral-small \
        --out benchmarks/results/quantized_decoder/architectures.md

A draft token reads the model's 4-bit weights and, from a few hundred cached tokens on, as many bytes
again of its KV cache (SmolLM2-135M: 46 KB a position in float32), so the long prompts of RAG and
summarization are where its attention shows. ``--extension PATH`` loads another build of
``mtprobe._C`` (e.g. one built from an earlier commit: ``pip wheel --no-deps . -w DIR`` and the
``_C*.so`` from the wheel) in place of the installed one, so that a before/after pair runs the same
script, Python code and questions; run the two in turn, a few times each. The tokens of every
generation are checked against HF greedy's on the same question. This is a benchmark: nothing here
asserts a speed.
"""

from __future__ import annotations

import sys

from _extension import EXTENSION_HELP, load_extension

EXTENSION = load_extension(sys.argv)

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections import defaultdict  # noqa: E402

import torch  # noqa: E402

import mtprobe  # noqa: E402
from _common import (  # noqa: E402
    OFF_GRID_HELP,
    environ,
    first_turn_prompts,
    load_average,
    off_grid,
    off_grid_seed,
    run_lines,
    write_report,
)
from mtprobe import models  # noqa: E402
from mtprobe.specbench.questions import first_per_category, load_questions  # noqa: E402
from mtprobe.target_model import self_draft as draft_model  # noqa: E402


def step_times(
    model, positions: list[int], repeats: int, head_scan: int = 0, draft_format: str = "q4_1"
) -> dict[int, float]:
    """Median seconds of one ``QuantizedDecoder.step`` at each position (the context is that long), its head
    scanned for ``head_scan`` rows (0: the whole 8-bit head)."""
    decoder = draft_model.quantized_decoder(draft_model.quantized(model, None, draft_format))
    if decoder is None:
        raise SystemExit("the quantized self-draft has no C++ decoder for this model (see the log)")
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    capacity = max(positions) + 1
    keys = [torch.randn(1, cfg.num_key_value_heads, capacity, head_dim) for _ in range(cfg.num_hidden_layers)]
    values = [torch.randn_like(k) for k in keys]
    out = {}
    scan = head_scan if decoder.has_head_scan else 0
    for p in positions:
        decoder.step(1, p, keys, values, head_scan=scan)  # warm
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            decoder.step(1, p, keys, values, head_scan=scan)
            times.append(time.perf_counter() - t0)
        out[p] = statistics.median(times)
    return out


# Shapes of real checkpoints (their config.json's), built with random weights for --architectures.
ARCHITECTURES = {
    "qwen2.5-0.5b": (
        "qwen2",
        dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_theta=1e6,
        ),
    ),
    "qwen3-0.6b": (
        "qwen3",
        dict(
            vocab_size=151936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_theta=1e6,
        ),
    ),
    # A Mistral-architecture model of SmolLM2-135M's size (no small Mistral checkpoint exists).
    "mistral-small": (
        "mistral",
        dict(
            vocab_size=49152,
            hidden_size=576,
            intermediate_size=1536,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            tie_word_embeddings=True,
            sliding_window=None,
        ),
    ),
}


def architecture_rows(names: list[str], position: int, repeats: int) -> list[str]:
    """Per architecture: median ms of one draft token of its quantized self-draft (4 bits) after ``position``
    cached positions, through HF's modules and through the C++ step, interleaved token by token."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from mtprobe.target_model.adapter import HFAdapter

    rows = []
    for name in names:
        model_type, kwargs = ARCHITECTURES[name]
        torch.manual_seed(0)
        config = AutoConfig.for_model(model_type, max_position_embeddings=4096, **kwargs)
        model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32).eval()
        draft = draft_model.quantized(model)
        decoder = draft_model.quantized_decoder(draft)
        if decoder is None:
            raise SystemExit(
                f"{name}: {draft_model.why_no_decoder(draft) or 'its C++ step disagrees with HF'}"
            )
        adapter = HFAdapter(draft, position + repeats + 2, checked=True)
        tokens = torch.randint(0, kwargs["vocab_size"], (position + repeats + 1,))
        hf_times, cpp_times = [], []
        with torch.inference_mode():
            adapter.forward(tokens[:position], None, torch.arange(position)[None], None, 0, False)
            keys = [layer.keys.clone() for layer in adapter.cache.layers]
            values = [layer.values.clone() for layer in adapter.cache.layers]
            for i in range(repeats + 1):
                p = position + i
                t0 = time.perf_counter()
                adapter.forward(tokens[p : p + 1], None, torch.tensor([[p]]), None, p, False)
                t1 = time.perf_counter()
                decoder.step(int(tokens[p]), p, keys, values)
                t2 = time.perf_counter()
                if i:  # the first of each is a warm-up
                    hf_times.append(t1 - t0)
                    cpp_times.append(t2 - t1)
        params = sum(p.numel() for p in model.parameters()) / 1e6
        hf_ms, cpp_ms = statistics.median(hf_times) * 1e3, statistics.median(cpp_times) * 1e3
        rows.append(
            f"| {name} (`{model_type}`, {params:.0f}M) | {hf_ms:.1f} | {cpp_ms:.1f} | {hf_ms / cpp_ms:.2f}× |"
        )
        del model, draft, decoder, adapter
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--question-file")
    ap.add_argument(
        "--architectures",
        nargs="+",
        choices=list(ARCHITECTURES),
        help="time a draft token of these shapes (random weights) instead of the generation",
    )
    ap.add_argument("--categories", nargs="+", default=["rag", "summarization", "qa"])
    ap.add_argument("--per-category", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-tokens", type=int, default=12, help="the draft's chain length K")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--positions", type=int, nargs="+", default=[64, 256, 512, 1024, 1536])
    ap.add_argument("--step-repeats", type=int, default=30)
    ap.add_argument("--extension", default="", help=EXTENSION_HELP)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument(
        "--head-scans",
        type=lambda text: [int(v) for v in text.split(",")],
        default=None,
        help="one self-draft row per value of MTPROBE_DRAFT_HEAD_SCAN, comma-separated (default: the "
        "environment's, one row)",
    )
    ap.add_argument(
        "--draft-format", default="q4_1", choices=draft_model.DRAFT_FORMATS, help="the self-draft's weights"
    )
    ap.add_argument("--off-grid", type=off_grid_seed, default=None, metavar="SEED", help=OFF_GRID_HELP)
    ap.add_argument("--out")
    args = ap.parse_args()
    scans = args.head_scans if args.head_scans is not None else [draft_model.draft_head_scan()]
    if args.architectures:
        load_before = load_average()
        position, repeats = 256, args.step_repeats
        rows = architecture_rows(args.architectures, position, repeats)
        write_report(
            args.out,
            [
                "# The quantized self-draft's step on other Llama-family architectures",
                "",
                *run_lines(args.model)[:2],
                f"- models: the shapes of each checkpoint's config.json with random weights (float32), the "
                f"quantized self-draft in 4 bits (`draft_format='q4_1'`, its head in 8); one draft token after "
                f"{position} cached positions, through HF's modules (`HFAdapter` over the quantized twin) and "
                f"through `mtprobe._C.QuantizedDecoder.step`, in turn, the median of {repeats}",
                f"- load average before / after: {load_before} / {load_average()}",
                "",
                "| architecture | HF's modules, ms a draft token | C++ step, ms | × |",
                "| --- | --- | --- | --- |",
                *rows,
            ],
        )
        return
    if args.question_file is None:
        ap.error("--question-file is required (or --architectures)")

    questions = [
        q
        for q in first_per_category(load_questions(args.question_file), args.per_category)
        if q.category in args.categories
    ]
    missing = sorted(set(args.categories) - {q.category for q in questions})
    if missing:
        raise SystemExit(f"--categories: no question of {missing} in {args.question_file}")
    model, tok = models.load(args.model, dtype=torch.float32)
    weights = "the wheel's (on the 4/8-bit grid)" if args.off_grid is None else off_grid(model, args.off_grid)
    prompts = first_turn_prompts(tok, questions)
    n = args.max_new_tokens
    cfg = mtprobe.DraftModelConfig(
        self_draft="quantized", num_tokens=args.num_tokens, draft_format=args.draft_format
    )
    load_before = load_average()

    def hf(ids):
        return model.generate(ids, do_sample=False, max_new_tokens=n)[0, ids.shape[1] :].tolist()

    def mine(ids, scan: int):
        with environ(draft_model.SCAN_ENV, str(scan)):
            out = mtprobe.generate(model, ids, cfg, do_sample=False, max_new_tokens=n)
        return out.sequences[0, ids.shape[1] :]

    # Warm-up: the linear routes and each method's first call.
    hf(prompts[0][1])
    for scan in scans:
        mine(prompts[0][1], scan)
    steps = {
        scan: step_times(model, args.positions, args.step_repeats, scan, args.draft_format) for scan in scans
    }

    seconds: dict[tuple[str, str], float] = defaultdict(float)
    tokens: dict[tuple[str, str], int] = defaultdict(int)
    differ = 0
    for repeat in range(args.repeats):
        for i, (q, ids) in enumerate(prompts):
            t0 = time.perf_counter()
            want = hf(ids)
            seconds["hf", q.category] += time.perf_counter() - t0
            tokens["hf", q.category] += len(want)
            for scan in scans if (repeat + i) % 2 == 0 else scans[::-1]:  # the rows' order alternates
                t0 = time.perf_counter()
                got = mine(ids, scan).tolist()
                seconds[scan, q.category] += time.perf_counter() - t0
                tokens[scan, q.category] += len(got)
                differ += got != want

    def row(scan: int) -> str:
        return "the whole 8-bit head" if scan == 0 else f"head scan {scan}"

    lines = [
        f"# The quantized self-draft's C++ step{' (another build of mtprobe._C)' if EXTENSION else ''}",
        "",
        *run_lines(args.model),
        f"- extension: `{EXTENSION or mtprobe._C.__file__}`",
        f"- weights: {weights}",
        f"- step: `QuantizedDecoder.step` with a context of p positions (random float32 KV), the median of "
        f"{args.step_repeats}; its head: {', '.join(row(s) for s in scans)} (`MTPROBE_DRAFT_HEAD_SCAN`)",
        f"- generation: first turns of the first {args.per_category} question(s) of each of "
        f"{', '.join(args.categories)} in `{args.question_file.split('/')[-1]}` ({len(prompts)} prompts, mean "
        f"{statistics.mean(ids.shape[1] for _, ids in prompts):.0f} tokens), greedy, max_new_tokens={n}; "
        f"`DraftModelConfig(self_draft='quantized', num_tokens={args.num_tokens}, "
        f"draft_format='{args.draft_format}')` (one row per head) against "
        f"HF greedy `model.generate`, question by question (HF greedy first, the drafts' rows in alternating order), "
        f"{args.repeats} repeat(s); {differ} "
        "generation(s) not token-identical to HF greedy's",
        f"- load average before / after: {load_before} / {load_average()}",
        "",
        "| ms a draft token, context p | " + " | ".join(str(p) for p in args.positions) + " |",
        "| --- | " + " | ".join("---" for _ in args.positions) + " |",
        *(
            f"| {row(scan)} | " + " | ".join(f"{steps[scan][p] * 1e3:.2f}" for p in args.positions) + " |"
            for scan in scans
        ),
        "",
        "| task | HF greedy tok/s | "
        + " | ".join(f"self-draft, {row(scan)}: tok/s (× HF greedy)" for scan in scans)
        + " |",
        "| --- | --- | " + " | ".join("---" for _ in scans) + " |",
    ]
    for c in [*args.categories, "all"]:
        pick = args.categories if c == "all" else [c]
        hf_rate = sum(tokens["hf", k] for k in pick) / sum(seconds["hf", k] for k in pick)
        cells = []
        for scan in scans:
            rate = sum(tokens[scan, k] for k in pick) / sum(seconds[scan, k] for k in pick)
            cells.append(f"{rate:.2f} ({rate / hf_rate:.3f}×)")
        lines.append(f"| {c} | {hf_rate:.2f} | " + " | ".join(cells) + " |")
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
