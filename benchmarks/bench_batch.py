"""A batch of prompts on the CPU: HF's batched greedy against mtprobe on the same left-padded batch (which
it decodes prompt by prompt) and HF greedy one prompt at a time, interleaved batch by batch, repeated.

    OMP_NUM_THREADS=2 python benchmarks/bench_batch.py --question-file ../shared/specbench/question-dev.jsonl \\
        --per-category 4 --batch-size 4 --max-new-tokens 64 --repeats 2 --out benchmarks/results/batch/bench_batch.md

Batches are consecutive first turns of ``--per-category`` questions of every category, in file order.
Each method's tokens/s counts the new tokens of its own rows (up to and including an EOS), over the wall
time of its calls. Every mtprobe row is checked against greedy on its prompt alone; HF's batched rows are
compared with the same (its padded attention rounds differently, so a near-tie may flip). This is a
benchmark: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

import mtprobe
from _common import first_turn_prompts, load_average, run_lines, write_report
from mtprobe import models
from mtprobe.specbench.questions import first_per_category, load_questions

CONFIGS = {
    "auto": mtprobe.AutoConfig(),
    "quantized-draft-k12": mtprobe.DraftModelConfig(self_draft="quantized", num_tokens=12),
}


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
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--out")
    args = ap.parse_args()

    model, tok = models.load(args.model, dtype=torch.float32)
    questions = first_per_category(load_questions(args.question_file), args.per_category)
    prompts = [ids for _, ids in first_turn_prompts(tok, questions)]
    batches = [prompts[i : i + args.batch_size] for i in range(0, len(prompts), args.batch_size)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    n = args.max_new_tokens
    load_before = load_average()

    def hf_batched(ids, mask):
        return model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=pad)

    def hf_single(rows):
        return [model.generate(r, do_sample=False, max_new_tokens=n, pad_token_id=pad)[0] for r in rows]

    def mtprobe_batched(cfg):
        def run(ids, mask):
            return model.generate(
                ids, attention_mask=mask, do_sample=False, max_new_tokens=n, pad_token_id=pad,
                custom_generate=mtprobe.custom_generate, mtprobe_config=cfg,
            )  # fmt: skip

        return run

    methods = {
        "hf-batched": hf_batched,
        **{f"mtprobe-{c}": mtprobe_batched(CONFIGS[c]) for c in args.configs},
    }
    # Warm-up: the linear routes, AutoConfig's forward profile and each method's first call.
    ids, mask = left_padded(batches[0], pad)
    hf_single(batches[0][:1])
    for run in methods.values():
        run(ids[:1], mask[:1])

    seconds: dict[str, float] = defaultdict(float)
    tokens: dict[str, int] = defaultdict(int)
    differ: dict[str, int] = defaultdict(int)  # rows not token-identical to greedy on the prompt alone
    for _ in range(args.repeats):
        for rows in batches:
            ids, mask = left_padded(rows, pad)
            t0 = time.perf_counter()
            singles = hf_single(rows)
            seconds["hf-single"] += time.perf_counter() - t0
            want = [s[r.shape[1] :].tolist() for s, r in zip(singles, rows, strict=True)]
            tokens["hf-single"] += sum(len(w) for w in want)
            for name, run in methods.items():
                t0 = time.perf_counter()
                out = run(ids, mask)
                seconds[name] += time.perf_counter() - t0
                got = [new_tokens(row, ids.shape[1], eos) for row in out]
                tokens[name] += sum(len(g) for g in got)
                differ[name] += sum(g != w for g, w in zip(got, want, strict=True))

    base = tokens["hf-batched"] / seconds["hf-batched"]
    single = tokens["hf-single"] / seconds["hf-single"]
    lines = [
        "# A batch of prompts: HF batched greedy, HF one prompt at a time, mtprobe on the padded batch",
        "",
        *run_lines(args.model),
        f"- questions: first turns of the first {args.per_category} question(s) of every category of "
        f"`{args.question_file.split('/')[-1]}` ({len(prompts)} prompts, in file order), in batches of "
        f"{args.batch_size} padded on the left; greedy, max_new_tokens={n}; {args.repeats} repeat(s), the "
        "methods interleaved batch by batch after one warm-up call each",
        "- tok/s: each method's new tokens (up to and including an EOS) over the wall time of its calls; "
        "rows ≠ alone: rows not token-identical to greedy `model.generate` on the prompt alone",
        f"- load average before / after: {load_before} / {load_average()}",
        "",
        "| method | tok/s | × HF batched | × HF one at a time | rows ≠ alone |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in ["hf-single", *methods]:
        rate = tokens[name] / seconds[name]
        lines.append(
            f"| {name} | {rate:.1f} | {rate / base:.2f} | {rate / single:.2f} | "
            f"{'–' if name == 'hf-single' else differ[name]} |"
        )
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
