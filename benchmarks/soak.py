#!/usr/bin/env python
"""Soak: N generations in one process, with memory that must stay flat and outputs that must stay greedy.

Runs ``mtprobe.generate`` N times (default 1000), cycling through the decoding configs (probing with
static and dynamic trees, one to three masks, the naive mask construction; STAND, prompt lookup,
lookahead, the hybrid and the self-draft model), prompt lengths and ``max_new_tokens``, some with a
logits processor. The three cycles have co-prime lengths, so every combination comes up. Every
``--every`` generations it records the resident set size (after ``gc.collect()`` and glibc's
``malloc_trim``, so freed memory does not count) and the number of live Python objects. A sample of
the generations (every ``--check-every``-th) is compared with ``model.generate(do_sample=False)``.

The verdict: RSS at generation N minus RSS at generation ``--warmup`` (by then every config has met
every prompt length and every ``max_new_tokens``, so the allocator's high-water marks are set) must
stay below ``--max-growth-mib``, the live Python objects may grow by at most ``--max-object-growth``
(besides the script's own records), and every checked output must be token-identical; else exit 1.

    python benchmarks/soak.py --out benchmarks/results/soak.md                   # tiny random Llama
    python benchmarks/soak.py --model smollm2-135m --n 300 --out /tmp/soak_smollm2.md
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import os
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

import mtprobe
from _common import device_name, write_report

TINY = "tiny-llama"


def tiny_llama(seed: int = 0) -> Any:
    """The tests' tiny random LlamaForCausalLM (tests/conftest.py ``tiny_llama``): 2 layers, hidden 64,
    vocabulary 96, 256 positions, eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
    )
    return LlamaForCausalLM(config).eval()


def decoding_configs(num_layers: int) -> list[tuple[str, Any]]:
    """(label, config): every drafter, and the probing variants with their own code paths."""
    return [
        ("probe bc10 static", mtprobe.ProbeConfig(block_complexity=10)),
        ("probe bc30 static", mtprobe.ProbeConfig(block_complexity=30)),
        ("probe bc30 dynamic", mtprobe.ProbeConfig(block_complexity=30, tree="dynamic")),
        ("probe bc60 k2 dynamic", mtprobe.ProbeConfig(block_complexity=60, num_masks=2)),
        ("probe bc30 k2 static [7, 2]", mtprobe.ProbeConfig(block_complexity=30, num_masks=2, tree="static")),
        (
            "probe bc24 k3 gaussian",
            mtprobe.ProbeConfig(block_complexity=24, num_masks=3, mask_init="gaussian"),
        ),
        ("probe bc30 naive masks", mtprobe.ProbeConfig(block_complexity=30, incremental_masks=False)),
        ("stand bc30", mtprobe.StandConfig(block_complexity=30)),
        ("prompt lookup 10", mtprobe.PromptLookupConfig(num_tokens=10)),
        ("lookahead L4 W5 G5", mtprobe.LookaheadConfig(4, 5, 5)),
        ("lookahead bc10", mtprobe.LookaheadConfig.for_block_complexity(10)),
        ("hybrid bc30", mtprobe.HybridConfig(block_complexity=30)),
        ("hybrid bc60 k2", mtprobe.HybridConfig(block_complexity=60, num_masks=2)),
        (
            "draft model",
            mtprobe.DraftModelConfig(num_draft_layers=max(1, min(8, num_layers // 2)), num_tokens=4),
        ),
    ]


PROMPT_LENGTHS = [1, 9, 30, 70, 120]
MAX_NEW_TOKENS = [1, 24, 64]
# Every other generation goes through a logits processor (the drafters' process callback).
GENERATE_KWARGS: list[dict[str, Any]] = [{}, {"repetition_penalty": 1.3}]


def rss_bytes() -> int:
    """Resident set size now (not the peak): /proc/self/statm's second field, in pages."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_LIBC = ctypes.CDLL(ctypes.util.find_library("c")) if sys.platform.startswith("linux") else None


def settle() -> None:
    """Free what is garbage and hand free heap pages back, so RSS counts live memory only."""
    gc.collect()
    if _LIBC is not None and hasattr(_LIBC, "malloc_trim"):
        _LIBC.malloc_trim(0)


def token_pool(model_name: str, tokenizer: Any, vocab: int, size: int = 4096) -> torch.Tensor:
    """Tokens [size] to cut prompts from: the shipped prompts under the chat template for a real model;
    for the tiny one random tokens with repeated stretches, so that n-gram drafters find matches."""
    if tokenizer is not None:
        from mtprobe.data import load_prompts

        ids: list[int] = []
        for prompt in load_prompts():
            enc = tokenizer.apply_chat_template(
                prompt["messages"], add_generation_prompt=True, return_tensors="pt"
            )
            ids += (enc if isinstance(enc, torch.Tensor) else enc["input_ids"])[0].tolist()
            if len(ids) >= size:
                break
        return torch.tensor(ids[:size])
    g = torch.Generator().manual_seed(1)
    pieces, total = [], 0
    while total < size:
        piece = torch.randint(0, vocab, (int(torch.randint(4, 16, (), generator=g)),), generator=g)
        pieces += [piece, piece] if torch.rand((), generator=g) < 0.5 else [piece]
        total += sum(len(p) for p in pieces[-2:])
    return torch.cat(pieces)[:size]


@dataclass
class Checkpoint:
    generation: int
    rss: int
    objects: int
    seconds: float


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default=TINY, help=f"{TINY!r} (random, 2 layers) or a name for mtprobe.models.load"
    )
    ap.add_argument("--n", type=int, default=1000, help="generations")
    ap.add_argument("--every", type=int, default=25, help="record memory every this many generations")
    ap.add_argument("--warmup", type=int, default=100, help="the generation growth is measured from")
    ap.add_argument(
        "--check-every", type=int, default=11, help="compare every k-th output with greedy generate"
    )
    # 4 MiB: ~40x the checkpoint-to-checkpoint noise seen here (+-0.1 MiB), and 1/27 of what keeping
    # the tiny model's largest KV cache (122 KiB) per generation would add over 900 generations.
    ap.add_argument("--max-growth-mib", type=float, default=4.0)
    # A Python object (a tensor, a cache, a closure) kept per generation would add one per generation.
    ap.add_argument("--max-object-growth", type=int, default=100)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/soak.md")
    args = ap.parse_args(argv)
    if not 0 <= args.warmup < args.n:
        ap.error(f"--warmup {args.warmup} must be in [0, --n {args.n})")
    torch.set_num_threads(args.threads)

    if args.model == TINY:
        model, tokenizer = tiny_llama(), None
    else:
        from mtprobe import models

        model, tokenizer = models.load(args.model, dtype=torch.float32)
    if (
        model.generation_config.pad_token_id is None
    ):  # quiets generate's per-call notice; batch 1 has no padding
        model.generation_config.pad_token_id = model.config.eos_token_id
    configs = decoding_configs(model.config.num_hidden_layers)
    pool = token_pool(args.model, tokenizer, model.config.vocab_size)

    checkpoints: list[Checkpoint] = []
    checked = mismatches = 0
    mismatch_lines: list[str] = []
    gained = forwards = 0
    settle()
    rss_start = rss_bytes()
    t0 = time.perf_counter()
    for i in range(args.n + 1):
        if i % args.every == 0 or i in (args.warmup, args.n):
            settle()
            checkpoints.append(Checkpoint(i, rss_bytes(), len(gc.get_objects()), time.perf_counter() - t0))
            print(
                f"gen {i:5d}: RSS {checkpoints[-1].rss / 2**20:8.1f} MiB, {checkpoints[-1].objects} objects",
                file=sys.stderr,
                flush=True,
            )
        if i == args.n:
            break
        # Co-prime cycle lengths (14 configs, 5 lengths, 3 max_new_tokens, 2 kwargs sets): i runs
        # through every combination of the first three within 210 generations.
        label, cfg = configs[i % len(configs)]
        length = PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)]
        max_new = MAX_NEW_TOKENS[i % len(MAX_NEW_TOKENS)]
        kwargs = GENERATE_KWARGS[(i // len(configs)) % len(GENERATE_KWARGS)]
        start = (i * 37) % (len(pool) - length)
        prompt = pool[start : start + length].unsqueeze(0)  # [1, L]
        out = mtprobe.generate(model, prompt, cfg, max_new_tokens=max_new, **kwargs)
        gained += sum(out.accept_lengths)
        forwards += len(out.accept_lengths)
        if i % args.check_every == 0:
            ref = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=max_new,
                **kwargs,
            )
            checked += 1
            if not torch.equal(out.sequences, ref):
                mismatches += 1
                mismatch_lines.append(
                    f"- generation {i}: {label}, prompt {length}, max_new_tokens {max_new}, {kwargs}"
                )
                print(mismatch_lines[-1], file=sys.stderr)
    elapsed = time.perf_counter() - t0

    at = {c.generation: c for c in checkpoints}
    base, last = at[args.warmup], at[args.n]
    growth = last.rss - base.rss
    after = [c for c in checkpoints if c.generation >= args.warmup]
    peak = max(after, key=lambda c: c.rss)
    # Least-squares slope of RSS over the generations after warm-up: a leak is a steady climb.
    xs = [c.generation for c in after]
    ys = [c.rss for c in after]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    # Net of the Checkpoint records this loop itself appended after the warm-up one.
    object_growth = last.objects - base.objects - (len(after) - 1)
    flat = growth <= args.max_growth_mib * 2**20 and object_growth <= args.max_object_growth
    ok = flat and mismatches == 0
    mib = 2**20

    dtype = str(model.dtype).removeprefix("torch.")
    model_line = (
        f"`{TINY}` (random LlamaForCausalLM as tests/conftest.py `tiny_llama`: 2 layers, hidden 64, vocab 96)"
        if args.model == TINY
        else f"`{args.model}` (mtprobe.models.load)"
    )
    lines = [
        "# Soak: memory and losslessness over many generations",
        "",
        f"- command: `{shlex.join(['python', 'benchmarks/soak.py', *(sys.argv[1:] if argv is None else argv)])}`",
        f"- machine: {device_name(torch.device('cpu'))}; torch {torch.__version__}; "
        f"{'GPU present but unused' if torch.cuda.is_available() else 'no GPU'}",
        f"- model: {model_line}, {dtype}, CPU",
        f"- {args.n} generations of `mtprobe.generate` in one process ({elapsed:.0f} s), cycling "
        f"{len(configs)} configs x prompt lengths {PROMPT_LENGTHS} x max_new_tokens {MAX_NEW_TOKENS}, every other "
        f"round of configs with `repetition_penalty=1.3`; τ over the run {gained / max(1, forwards):.2f}",
        f"- configs: {', '.join(label for label, _ in configs)}",
        f"- RSS: /proc/self/statm after gc.collect() and malloc_trim(0), every {args.every} generations; "
        f"{rss_start / mib:.1f} MiB before the first generation",
        "",
        "| generation | RSS (MiB) | change since the previous (MiB) | live Python objects | seconds |",
        "|---|---|---|---|---|",
    ]
    previous = None
    for c in checkpoints:
        delta = "" if previous is None else f"{(c.rss - previous.rss) / mib:+.2f}"
        lines.append(f"| {c.generation} | {c.rss / mib:.1f} | {delta} | {c.objects} | {c.seconds:.0f} |")
        previous = c
    lines += [
        "",
        f"- growth from generation {args.warmup} to {args.n}: {growth / mib:+.2f} MiB "
        f"({growth / max(1, args.n - args.warmup) / 1024:+.2f} KiB per generation); least-squares slope after "
        f"generation {args.warmup}: {slope / 1024:+.3f} KiB per generation; peak after warm-up "
        f"{peak.rss / mib:.1f} MiB at generation {peak.generation}; live Python objects "
        f"{base.objects} -> {last.objects}, {object_growth:+d} net of the script's {len(after) - 1} records",
        f"- thresholds: {args.max_growth_mib:g} MiB of RSS and {args.max_object_growth} Python objects over "
        f"{args.n - args.warmup} generations. One generation's KV cache here is "
        f"{kv_bytes(model, max(PROMPT_LENGTHS) + max(MAX_NEW_TOKENS) + 60) / 1024:.0f} KiB at the largest "
        "prompt, so a cache (or anything of its size) kept per generation would exceed the RSS bound many "
        "times over, and one object kept per generation the object bound; the slack covers allocator noise",
        f"- losslessness: {checked - mismatches} of {checked} checked generations token-identical to "
        "`model.generate(do_sample=False)` with the same arguments",
        *mismatch_lines,
        "",
        f"**Verdict: {'PASS' if ok else 'FAIL'}** (memory {'flat' if flat else 'GROWS'}, "
        f"{mismatches} mismatch{'es' if mismatches != 1 else ''})",
    ]
    write_report(args.out, lines)
    return 0 if ok else 1


def kv_bytes(model: Any, positions: int) -> int:
    """Bytes of a KV cache of ``positions`` positions: keys and values of every layer."""
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * kv_heads * head_dim * positions * model.dtype.itemsize


if __name__ == "__main__":
    raise SystemExit(main())
