"""The ``mtprobe`` command (also ``python -m mtprobe``).

``mtprobe generate "prompt"`` streams one answer to stdout and prints one line of statistics on
stderr; ``mtprobe bench --prompts FILE`` runs HF greedy ``model.generate`` and a method on each of a
user's prompts, checks that the tokens are identical and prints a table of τ, tokens/s and speedup::

    mtprobe generate --model smollm2-135m --method pld "Summarise this: ..."
    mtprobe bench --prompts my_prompts.txt --method probe --block-complexity 30 --repeats 3

Methods and their options come from the Spec-Bench registry (:mod:`mtprobe.specbench.methods`),
so ``--method`` takes the same names (``ar``, ``probe``, ``pld``, ``stand``, ``lookahead``,
``hybrid``, ``sps``) and the same options as ``python -m mtprobe.specbench run``.

Exit status: 0 done; 1 ``bench`` found a prompt whose tokens differ from HF greedy; 2 bad input
(an unknown method or option, a missing or malformed prompt file, no prompt, a model that cannot be
loaded), reported as one line on stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch

from mtprobe.specbench import methods as _methods

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "EXIT_DIFFERS",
    "EXIT_OK",
    "EXIT_USAGE",
    "BenchRow",
    "UsageError",
    "encode_prompt",
    "main",
    "read_prompts",
]

EXIT_OK = 0
EXIT_DIFFERS = 1
EXIT_USAGE = 2

DEFAULT_METHOD = "probe"
DEFAULT_MAX_NEW_TOKENS = 128
_PREVIEW_CHARS = 40


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    # argparse prints the whole usage and exits; a UsageError keeps every bad input to one line
    # and lets main(argv) return 2 instead of raising SystemExit.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


# --- prompts -------------------------------------------------------------------------------------


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
    from mtprobe._jsonl import iter_jsonl

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


def encode_prompt(
    tokenizer: PreTrainedTokenizerBase, text: str, chat: bool | None, device: torch.device | str
) -> torch.Tensor:
    """Token ids ``[1, L]`` of ``text``: under the tokenizer's chat template as one user message when
    ``chat`` is True (None: when the tokenizer has a template, as instruct models do), else as plain
    text with the tokenizer's own special tokens."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat is None:
        chat = has_template
    if chat and not has_template:
        raise UsageError(
            f"--chat: the tokenizer ({type(tokenizer).__name__}) has no chat template; "
            "pass --no-chat to encode the prompt as plain text"
        )
    if chat:
        from mtprobe.specbench.run import encode_conversation

        ids = encode_conversation(tokenizer, [{"role": "user", "content": text}], device)  # [1, L]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)  # [1, L]
    if ids.shape[1] == 0:
        raise UsageError(f"the prompt {text!r} encodes to no tokens; pass a non-empty prompt")
    return ids


# --- the parser ----------------------------------------------------------------------------------


def _int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= ``minimum``, with an error saying so."""
    what = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1)
_non_negative_int = _int_at_least(0)


def _add_common(p: argparse.ArgumentParser) -> None:
    methods_help = "; ".join(f"{m.name}: {m.summary}" for m in _methods.METHODS.values())
    p.add_argument(
        "--model",
        default="smollm2-135m",
        help="a known model name or a local Hugging Face folder (default %(default)s)",
    )
    p.add_argument(
        "--method", default=DEFAULT_METHOD, help=f"decoding method (default %(default)s). {methods_help}"
    )
    p.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="new tokens at most (default %(default)s)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--threads", type=_positive_int, default=None, help="torch CPU threads")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to the prompt (default: on when the tokenizer has one, "
        "as instruct models do)",
    )
    _methods.add_method_arguments(p)


def _build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="mtprobe",
        description="Lossless multi-token decoding of a Hugging Face causal LM: generate one answer, or "
        "benchmark a method against HF greedy decoding on your own prompts.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,bench}")
    g = sub.add_parser(
        "generate",
        help="stream the answer to one prompt; statistics on stderr",
        description="Stream the answer to one prompt to stdout, then print the method, new tokens, τ "
        "(tokens per decode forward), tokens/s and wall time as one line on stderr.",
    )
    g.add_argument("prompt", nargs="?", default=None, help='the prompt ("-" reads it from stdin)')
    _add_common(g)
    g.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: lossless sampling"
    )
    g.add_argument("--top-k", type=_positive_int, default=None, help="sampling only: keep the k best tokens")
    g.add_argument("--top-p", type=float, default=None, help="sampling only: nucleus probability mass")
    g.add_argument("--seed", type=_non_negative_int, default=0, help="torch seed (default %(default)s)")

    b = sub.add_parser(
        "bench",
        help="HF greedy against a method on your prompts: τ, tokens/s, speedup, equality",
        description="Run HF greedy model.generate and the method on every prompt of FILE, check the tokens "
        "are identical, and print per prompt and overall: τ, tokens/s and speedup over HF greedy. Greedy "
        "decoding only. Exit status 1 if any prompt's tokens differ.",
    )
    b.add_argument(
        "--prompts",
        type=Path,
        required=True,
        metavar="FILE",
        help='.txt: one prompt per line; .jsonl: one object per line with a "prompt" string or a "turns" '
        "list (its first turn is used, so Spec-Bench question files work)",
    )
    _add_common(b)
    b.add_argument(
        "--repeats",
        type=_positive_int,
        default=1,
        help="timed runs of each prompt and method; the median time counts (default %(default)s)",
    )
    b.add_argument(
        "--warmup",
        type=_non_negative_int,
        default=1,
        help="discarded runs of the first prompt before timing (default %(default)s)",
    )
    b.add_argument("--out", type=Path, default=None, help="also write the report as Markdown to this file")
    return parser


# --- shared set-up -------------------------------------------------------------------------------


def _method_and_config(args: argparse.Namespace) -> tuple[_methods.Method, Any]:
    try:
        method = _methods.get_method(args.method)
        return method, _methods.config_from_args(method, args)
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise UsageError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA device")
    return device


def _load(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers.utils import logging as hf_logging

    from mtprobe import models

    hf_logging.disable_progress_bar()  # stderr carries the one statistics line, not a weight-loading bar
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    try:
        return models.load(args.model, dtype=args.dtype, device=device)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_plain_greedy(config: Any) -> bool:
    # "ar" is HF's own generate; every other registered method is mtprobe.generate with its config.
    return isinstance(config, _methods.GreedyConfig)


# --- generate ------------------------------------------------------------------------------------


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.temperature < 0 or args.temperature != args.temperature:
        raise UsageError(f"--temperature must be >= 0 (0 is greedy), got {args.temperature}")
    if args.temperature == 0:
        for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)):
            if value is not None:
                raise UsageError(f"{flag} applies to sampling only; pass --temperature > 0 with it")
        return {"do_sample": False}
    kwargs: dict[str, Any] = {"do_sample": True, "temperature": args.temperature}
    if args.top_k is not None:
        kwargs["top_k"] = args.top_k
    if args.top_p is not None:
        if not 0 < args.top_p <= 1:
            raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
        kwargs["top_p"] = args.top_p
    return kwargs


def _read_prompt_arg(prompt: str | None) -> str:
    if prompt is None:
        raise UsageError('no prompt given: pass it as the last argument, e.g. mtprobe generate "Hello"')
    if prompt == "-":
        prompt = sys.stdin.read()
    if not prompt.strip():
        raise UsageError("the prompt is empty: pass a non-empty prompt")
    return prompt


def _generate(args: argparse.Namespace) -> int:
    from transformers import TextStreamer

    import mtprobe

    prompt = _read_prompt_arg(args.prompt)
    method, config = _method_and_config(args)
    sampling = _sampling_kwargs(args)
    model, tokenizer = _load(args)
    input_ids = encode_prompt(tokenizer, prompt, args.chat, model.device)  # [1, L]
    prompt_len = input_ids.shape[1]
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    common = dict(
        attention_mask=torch.ones_like(input_ids),  # one unpadded row; silences HF's pad-token warning
        max_new_tokens=args.max_new_tokens,
        streamer=streamer,
        **sampling,
    )
    torch.manual_seed(args.seed)
    _sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        if _is_plain_greedy(config):
            sequences = model.generate(input_ids, **common)  # [1, L + new]
            stats = "tau 1.00 (one token per forward)"
        else:
            out = mtprobe.generate(model, input_ids, config, **common)
            sequences = out.sequences  # [1, L + new]
            stats = f"tau {out.tau:.2f} ({out.forward_calls} forwards), stop: {out.stop_reason}"
    _sync(model.device)
    elapsed = time.perf_counter() - t0
    new_tokens = int(sequences.shape[1] - prompt_len)
    mode = "greedy" if not sampling["do_sample"] else f"sampling at temperature {args.temperature}"
    print(
        f"mtprobe: {method.name} ({mode}): {new_tokens} new tokens, {stats}, "
        f"{new_tokens / max(elapsed, 1e-9):.1f} tokens/s, {elapsed:.4f} s",
        file=sys.stderr,
        flush=True,
    )
    return EXIT_OK


# --- bench ---------------------------------------------------------------------------------------


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
    run: Callable[..., _methods.MethodOutput], device: torch.device, *args: Any
) -> tuple[_methods.MethodOutput, float]:
    _sync(device)
    t0 = time.perf_counter()
    out = run(*args)
    _sync(device)
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
        b, tb = _timed(ar.run, model.device, model, input_ids, greedy, max_new_tokens)
        o, tm = _timed(method.run, model.device, model, input_ids, config, max_new_tokens)
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
    argv = " ".join(_quote(a) for a in (args.argv or []))
    return [
        f"command: `mtprobe {argv}`",
        f"date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; machine: {platform.machine()}, "
        f"{os.cpu_count()} cores, torch threads {torch.get_num_threads()}; torch {torch.__version__}, "
        f"transformers {_transformers_version()}",
        f"model: `{args.model}` ({type(model).__name__}), {str(model.dtype).removeprefix('torch.')}, "
        f"device {model.device}",
        f"method: {method.name}: `{config!r}`",
        f"prompts: {n} from `{args.prompts}`, greedy, max_new_tokens={args.max_new_tokens}, "
        f"{args.repeats} timed run(s) each (median), {args.warmup} warm-up run(s) of the first prompt",
    ]


def _quote(arg: str) -> str:
    import shlex

    return shlex.quote(arg)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def _bench(args: argparse.Namespace) -> int:
    prompts = read_prompts(args.prompts)
    method, config = _method_and_config(args)
    model, tokenizer = _load(args)
    encoded = [encode_prompt(tokenizer, p, args.chat, model.device) for p in prompts]  # each [1, L]
    ar = _methods.get_method("ar")
    with torch.inference_mode():
        for _ in range(args.warmup):
            ar.run(model, encoded[0], _methods.GreedyConfig(), args.max_new_tokens)
            method.run(model, encoded[0], config, args.max_new_tokens)
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


# --- entry point ---------------------------------------------------------------------------------


def _one_line(message: str) -> str:
    # A library message may list what it tried on several lines; the command's errors stay one line.
    return "; ".join(" ".join(line.split()) for line in message.splitlines() if line.strip())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``mtprobe`` command with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _build_parser()
    try:
        try:
            args = parser.parse_args(argv)
        except SystemExit as e:  # --help
            return int(e.code or 0)
        args.argv = argv
        return _generate(args) if args.command == "generate" else _bench(args)
    except UsageError as e:
        print(f"mtprobe: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, NotImplementedError) as e:
        # What the library refuses (a configuration it cannot run, a prompt beyond the model's context,
        # a model that is not a causal LM) names what is wrong; show it as bad input, not a traceback.
        print(f"mtprobe: error: {type(e).__name__}: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
