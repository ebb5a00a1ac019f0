"""What the ``mtprobe`` subcommands share: exit statuses, the one-line bad-input error, argparse types,
and the options and set-up of the commands that calibrate something offline on a model's own answers
(``mtprobe calibrate``, ``mtprobe heads train``, ``mtprobe topology``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch

from mtprobe import models
from mtprobe.data import corpus_passages, encode_conversation, load_prompts

EXIT_OK = 0
EXIT_DIFFERS = 1
EXIT_USAGE = 2


class UsageError(Exception):
    """Bad input: reported as one line on stderr, exit status 2."""


class Parser(argparse.ArgumentParser):
    # argparse prints the whole usage and exits; a UsageError keeps every bad input to one line and
    # lets main(argv) return 2 instead of raising SystemExit. Subparsers are of the same class.
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def one_line(message: str) -> str:
    """``message`` on one line: a library message may list what it tried on several lines."""
    return "; ".join(" ".join(line.split()) for line in message.splitlines() if line.strip())


def int_at_least(minimum: int) -> Callable[[str], int]:
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


def print_progress(msg: str) -> None:
    """A calibration command's progress line on stderr, stamped with the time."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- offline calibration commands ----------------------------------------------------------------


def add_calibration_arguments(parser: argparse.ArgumentParser) -> None:
    """``--model``, ``--out``, ``--prompts`` and ``--num-prompts``: what every offline calibration
    command (``mtprobe topology``, ``mtprobe calibrate``, ``mtprobe heads train``) takes."""
    parser.add_argument(
        "--model", default="smollm2-135m", help="a known name, a local folder or a cached hub id"
    )
    parser.add_argument("--out", required=True, help="where to write the result")
    parser.add_argument(
        "--prompts",
        default=None,
        help="calibration prompts: a JSONL file in the format of mtprobe's prompt set ({'id', 'kind', "
        "'messages'} per line) (default: mtprobe's 24 built-in prompts, not Spec-Bench's questions)",
    )
    parser.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")


def add_device_arguments(parser: argparse.ArgumentParser, what: str) -> None:
    """``--device {cpu,cuda,auto}`` and ``--dtype {float32,bfloat16}`` for a command that runs the model
    on ``what`` (e.g. "the backbone generates"); resolve them with :func:`resolve_device`."""
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda", "auto"),
        default="cpu",
        help=f"where {what} (auto: cuda if torch sees a GPU)",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype on the device (bfloat16: on cuda only)",
    )


def resolve_device(args: argparse.Namespace) -> torch.device:
    """:func:`add_device_arguments`' ``--device`` resolved (auto: cuda if torch sees a GPU) and checked
    against ``--dtype``; UsageError naming what is wrong and what would do."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(
            f"--device cuda: this torch ({torch.__version__}) sees no CUDA device; run on the CPU with "
            "--device cpu (or --device auto), or on a machine with a GPU and a CUDA build of torch "
            "(docs/gpu.md)"
        )
    if args.dtype != "float32" and device.type != "cuda":
        raise UsageError(
            f"--dtype {args.dtype} needs --device cuda (the device here is {device.type}); on the CPU "
            "the model runs in float32: drop --dtype"
        )
    return device


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """``--corpus-prompts``, ``--num-corpus-prompts`` and ``--gen-batch-size``: what the commands that
    learn from the model's own greedy answers (``mtprobe heads train``, ``mtprobe calibrate``) take
    besides :func:`add_calibration_arguments`; check them with :func:`check_corpus_arguments`."""
    parser.add_argument(
        "--corpus-prompts",
        nargs="*",
        default=[],
        help="local text files whose passages become more prompts for self-distillation (e.g. "
        "/usr/share/games/fortunes/* from Debian's fortunes packages)",
    )
    parser.add_argument("--num-corpus-prompts", type=int, default=200, help="how many corpus prompts")
    parser.add_argument(
        "--gen-batch-size",
        type=int,
        default=1,
        help="prompts generated at once (left-padded; faster, and padding may flip near-tie greedy choices)",
    )


def check_corpus_arguments(args: argparse.Namespace) -> None:
    """UsageError naming what is wrong with :func:`add_corpus_arguments`' options."""
    if args.gen_batch_size < 1:
        raise UsageError(f"--gen-batch-size {args.gen_batch_size} must be >= 1")
    if args.num_corpus_prompts < 1:
        raise UsageError(f"--num-corpus-prompts {args.num_corpus_prompts} must be >= 1")
    for f in args.corpus_prompts:
        if not Path(f).is_file():
            raise UsageError(f"--corpus-prompts {f}: no such file; give local text files")
    # Checked here, before the model loads, so a wrong file costs no minutes.
    if args.corpus_prompts and not corpus_passages(args.corpus_prompts):
        raise UsageError(
            f"--corpus-prompts {args.corpus_prompts}: no passage of 60 to 600 characters; give text files"
        )


def calibration_prompts(args: argparse.Namespace) -> tuple[Any, Any, list[torch.Tensor]]:
    """(model, tokenizer, token tensors ``[1, L]``) from :func:`add_calibration_arguments`' options: the
    model loaded by name and each prompt under its tokenizer's chat template."""
    model, tokenizer = models.load(args.model)
    prompts = load_prompts(args.prompts)
    if args.num_prompts is not None:
        prompts = prompts[: args.num_prompts]
    return model, tokenizer, [encode_conversation(tokenizer, p["messages"], "cpu") for p in prompts]
