"""``mtprobe bench --prompts FILE``: HF greedy ``model.generate`` and a method on each of a user's
prompts, a check that the tokens are identical, and a table of τ, tokens/s and speedup."""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers

from mtprobe._jsonl import iter_jsonl
from mtprobe.cli._common import EXIT_DIFFERS, EXIT_OK, UsageError
from mtprobe.cli.generate import (
    add_decoding_arguments,
    encode_prompt,
    load_model,
    method_and_config,
    non_negative_int,
    positive_int,
    sync,
)
from mtprobe.specbench import methods as _methods

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HELP = "HF greedy against a method on your prompts: τ, tokens/s, speedup, equality"
DESCRIPTION = (
    "Run HF greedy model.generate and the method on every prompt of FILE, check the tokens are identical, "
    "and print per prompt and overall: τ, tokens/s and speedup over HF greedy. Greedy decoding only. Exit "
    "status 1 if any prompt's tokens differ."
)
_PREVIEW_CHARS = 40


def configure(parser: argparse.ArgumentParser) -> None:
    """``bench``'s arguments."""
    parser.add_argument(
        "--prompts",
        type=Path,
        required=True,
        metavar="FILE",
        help='.txt: one prompt per line; .jsonl: one object per line with a "prompt" string or a "turns" '
        "list (its first turn is used, so Spec-Bench question files work)",
    )
    add_decoding_arguments(parser)
    parser.add_argument(
        "--repeats",
        type=positive_int,
        default=1,
        help="timed runs of each prompt and method; the median time counts (default %(default)s)",
    )
    parser.add_argument(
        "--warmup",
        type=non_negative_int,
        default=1,
        help="discarded runs of the first prompt before timing (default %(default)s)",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the report as Markdown to this file"
    )


def read_prompts(path: str | os.PathLike[str]) -> list[str]:
    """The prompts of a ``.txt`` file (one per non-blank line) or a ``.jsonl`` file (one object per line
    with a ``"prompt"`` string, or a ``"turns"`` list of strings of which the first is used, so
    Spec-Bench question files work as they are). UsageError naming the file (and line) otherwise."""
    path = Path(path)
    if path.suffix not in (".txt", ".jsonl"):
        raise UsageError(
            f"--prompts {path}: expected a .txt file (one prompt per line) or a .jsonl file (one "
            '{"prompt": ...} or {"turns": [...]} object per line), got a file ending in '
            f"{path.suffix or '(no suffix)'!r}"
        )
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"--prompts {path}: no such file") from None
    except IsADirectoryError:
        raise UsageError(f"--prompts {path}: is a directory, expected a .txt or .jsonl file") from None
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompts {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    if path.suffix == ".txt":
        prompts = [line.strip() for line in text.splitlines() if line.strip()]
    else:
        prompts = _jsonl_prompts(text, path)
    if not prompts:
        raise UsageError(f"--prompts {path}: the file holds no prompts (blank lines are skipped)")
    return prompts


def _jsonl_prompts(text: str, path: Path) -> list[str]:
    prompts: list[str] = []
    try:
        for where, _, obj in iter_jsonl(text, path):
            prompts.append(_prompt_of(obj, where))
    except ValueError as e:  # iter_jsonl's "FILE, line N: invalid JSON ..."
        raise UsageError(str(e)) from None
    return prompts


def _prompt_of(obj: Any, where: str) -> str:
    want = 'expected an object with a "prompt" string or a "turns" list of strings'
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: {want}, got {type(obj).__name__}")
    if "prompt" in obj:
        prompt = obj["prompt"]
        if not isinstance(prompt, str) or not prompt.strip():
            raise UsageError(f'{where}: "prompt" must be a non-empty string, got {prompt!r}')
        return prompt
    if "turns" in obj:
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise UsageError(f'{where}: "turns" must be a non-empty list of strings, got {turns!r}')
        if not turns[0].strip():
            raise UsageError(f'{where}: the first of "turns" is empty')
        return turns[0]
    raise UsageError(f"{where}: {want}; found the keys {', '.join(map(repr, obj)) or '(none)'}")


@dataclass(frozen=True)
class BenchRow:
    """One prompt's result: HF greedy against the method (times are medians over the repeats)."""

    index: int
    prompt: str
    prompt_tokens: int
    baseline_tokens: int
    baseline_s: float
    method_tokens: int
    method_s: float
    accept_lengths: tuple[int, ...]
    """Tokens gained per decode forward of the method's first timed run."""
    first_difference: int | None
    """Index of the first new token where the method differs from HF greedy; None when identical."""

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / max(1, len(self.accept_lengths))

    @property
    def baseline_tps(self) -> float:
        return self.baseline_tokens / max(self.baseline_s, 1e-9)

    @property
    def method_tps(self) -> float:
        return self.method_tokens / max(self.method_s, 1e-9)


def _first_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """First index where the 1-D token tensors differ (a length difference counts); None if equal."""
    n = min(a.shape[0], b.shape[0])
    diff = (a[:n].cpu() != b[:n].cpu()).nonzero()
    if diff.numel():
        return int(diff[0, 0])
    return None if a.shape[0] == b.shape[0] else n


def _timed(
    call: Callable[..., _methods.MethodOutput], device: torch.device, *args: Any
) -> tuple[_methods.MethodOutput, float]:
    sync(device)
    t0 = time.perf_counter()
    out = call(*args)
    sync(device)
    return out, time.perf_counter() - t0


def _bench_prompt(
    index: int,
    prompt: str,
    input_ids: torch.Tensor,  # [1, L]
    model: PreTrainedModel,
    method: _methods.Method,
    config: Any,
    max_new_tokens: int,
    repeats: int,
) -> BenchRow:
    ar = _methods.get_method("ar")
    greedy = _methods.GreedyConfig()
    base_times, method_times = [], []
    first_difference = None
    base = out = None
    for r in range(repeats):
        # Interleaved, so that a change of machine load hits both sides alike.
        b, tb = _timed(_methods.run_method, model.device, ar, model, input_ids, greedy, max_new_tokens)
        o, tm = _timed(_methods.run_method, model.device, method, model, input_ids, config, max_new_tokens)
        base_times.append(tb)
        method_times.append(tm)
        if r == 0:
            base, out = b, o
        if first_difference is None:
            first_difference = _first_difference(b.new_ids, o.new_ids)
    assert base is not None and out is not None
    return BenchRow(
        index=index,
        prompt=prompt,
        prompt_tokens=int(input_ids.shape[1]),
        baseline_tokens=int(base.new_ids.shape[0]),
        baseline_s=statistics.median(base_times),
        method_tokens=int(out.new_ids.shape[0]),
        method_s=statistics.median(method_times),
        accept_lengths=tuple(int(a) for a in out.accept_lengths),
        first_difference=first_difference,
    )


def _preview(text: str) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= _PREVIEW_CHARS else flat[: _PREVIEW_CHARS - 1] + "…"


def render_bench(rows: Sequence[BenchRow], header: Sequence[str], method_name: str) -> str:
    """The bench report: ``header`` lines, one table row per prompt and the pooled overall row."""
    lines = [f"- {h}" for h in header]
    lines += [
        "",
        f"| # | prompt | prompt tokens | new tokens | HF greedy tokens/s | {method_name} tokens/s | τ | speedup "
        "| identical to HF greedy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        same = "yes" if r.first_difference is None else f"**no** (from new token {r.first_difference})"
        lines.append(
            f"| {r.index} | {_preview(r.prompt)} | {r.prompt_tokens} | {r.method_tokens} | {r.baseline_tps:.2f} "
            f"| {r.method_tps:.2f} | {r.tau:.3f} | {r.method_tps / max(r.baseline_tps, 1e-9):.2f}x | {same} |"
        )
    base_tps = sum(r.baseline_tokens for r in rows) / max(sum(r.baseline_s for r in rows), 1e-9)
    method_tps = sum(r.method_tokens for r in rows) / max(sum(r.method_s for r in rows), 1e-9)
    pooled = [a for r in rows for a in r.accept_lengths]
    tau = sum(pooled) / max(1, len(pooled))
    identical = sum(r.first_difference is None for r in rows)
    lines.append(
        f"| overall | {len(rows)} prompts | {sum(r.prompt_tokens for r in rows)} "
        f"| {sum(r.method_tokens for r in rows)} | {base_tps:.2f} | {method_tps:.2f} | {tau:.3f} "
        f"| {method_tps / max(base_tps, 1e-9):.2f}x | {identical}/{len(rows)} |"
    )
    lines += [
        "",
        "τ = tokens gained per decode forward of the method (accepted drafts + bonus; prefill not counted), "
        "pooled over the prompts; tokens/s = new tokens ÷ the median wall time of a generate call (prefill "
        "included); speedup = method tokens/s ÷ HF greedy tokens/s; overall tokens/s pools tokens and times.",
    ]
    return "\n".join(lines) + "\n"


def _bench_header(
    args: argparse.Namespace, model: PreTrainedModel, method: _methods.Method, config: Any, n: int
) -> list[str]:
    argv = " ".join(shlex.quote(a) for a in (args.argv or []))
    return [
        f"command: `mtprobe {argv}`",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}",
        f"model: `{args.model}` ({type(model).__name__}), {str(model.dtype).removeprefix('torch.')}, "
        f"device {model.device}",
        f"method: {method.name}: `{config!r}`",
        f"prompts: {n} from `{args.prompts}`, greedy, max_new_tokens={args.max_new_tokens}, "
        f"{args.repeats} timed run(s) each (median), {args.warmup} warm-up run(s) of the first prompt",
    ]


def run(args: argparse.Namespace) -> int:
    """Time every prompt of ``args.prompts``; print (and write) the report."""
    prompts = read_prompts(args.prompts)
    method, config = method_and_config(args)
    model, tokenizer = load_model(args)
    encoded = [encode_prompt(tokenizer, p, args.chat, model.device) for p in prompts]  # each [1, L]
    ar = _methods.get_method("ar")
    with torch.inference_mode():
        for _ in range(args.warmup):
            _methods.run_method(ar, model, encoded[0], _methods.GreedyConfig(), args.max_new_tokens)
            _methods.run_method(method, model, encoded[0], config, args.max_new_tokens)
        rows = []
        for i, (prompt, ids) in enumerate(zip(prompts, encoded, strict=True), start=1):
            rows.append(
                _bench_prompt(i, prompt, ids, model, method, config, args.max_new_tokens, args.repeats)
            )
            print(f"mtprobe bench: prompt {i}/{len(prompts)} done", file=sys.stderr, flush=True)
    report = render_bench(rows, _bench_header(args, model, method, config, len(prompts)), method.name)
    sys.stdout.write(report)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(f"# mtprobe bench: {method.name} against HF greedy\n\n{report}", encoding="utf-8")
    differs = [r for r in rows if r.first_difference is not None]
    if differs:
        first = differs[0]
        print(
            f"mtprobe bench: {len(differs)} of {len(rows)} prompts differ from HF greedy (the first: prompt "
            f"{first.index}, from new token {first.first_difference}); a lossless method never differs, "
            "except on a floating-point near-tie of the top two logits",
            file=sys.stderr,
        )
        return EXIT_DIFFERS
    return EXIT_OK
