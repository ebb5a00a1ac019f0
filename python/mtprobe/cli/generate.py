"""``mtprobe generate "prompt"``: stream one answer to stdout, then one line of statistics on stderr.

Also what ``mtprobe bench`` shares with it: the model and method options, loading the model, encoding
a prompt.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING, Any

import torch
from transformers import TextStreamer
from transformers.utils import logging as hf_logging

from mtprobe import models
from mtprobe.cli._common import EXIT_OK, UsageError, int_at_least
from mtprobe.data import encode_conversation
from mtprobe.decode import generate
from mtprobe.specbench import methods as _methods
from mtprobe.target_model.plan import PlanConfig

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

HELP = "stream the answer to one prompt; statistics on stderr"
DESCRIPTION = (
    "Stream the answer to one prompt to stdout, then print the method, new tokens, τ (tokens per decode "
    "forward), tokens/s and wall time as one line on stderr."
)
DEFAULT_METHOD = "probe"
DEFAULT_MAX_NEW_TOKENS = 128

positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


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
        ids = encode_conversation(tokenizer, [{"role": "user", "content": text}], device)  # [1, L]
    else:
        ids = tokenizer(text, return_tensors="pt")["input_ids"].to(device)  # [1, L]
    if ids.shape[1] == 0:
        raise UsageError(f"the prompt {text!r} encodes to no tokens; pass a non-empty prompt")
    return ids


def add_decoding_arguments(p: argparse.ArgumentParser) -> None:
    """The options ``generate`` and ``bench`` share: the model, the method and its options, the device."""
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
        type=positive_int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help="new tokens at most (default %(default)s)",
    )
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads")
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to the prompt (default: on when the tokenizer has one, "
        "as instruct models do)",
    )
    _methods.add_method_arguments(p)


def configure(parser: argparse.ArgumentParser) -> None:
    """``generate``'s arguments."""
    parser.add_argument("prompt", nargs="?", default=None, help='the prompt ("-" reads it from stdin)')
    add_decoding_arguments(parser)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy (default); > 0: lossless sampling"
    )
    parser.add_argument(
        "--top-k", type=positive_int, default=None, help="sampling only: keep the k best tokens"
    )
    parser.add_argument("--top-p", type=float, default=None, help="sampling only: nucleus probability mass")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="torch seed (default %(default)s)")
    parser.add_argument(
        "--plan",
        action="store_true",
        help="run the forwards through the static forward plan (mtprobe.PlanConfig: a fixed KV buffer, "
        "block-size buckets, CUDA graphs on a GPU)",
    )


def method_and_config(args: argparse.Namespace) -> tuple[_methods.Method, Any]:
    """The registered method ``--method`` names and its configuration from the method options;
    UsageError for an unknown method or an option it does not take."""
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


def load_model(args: argparse.Namespace) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model and tokenizer of ``--model`` in ``--dtype`` on ``--device``, with ``--threads`` set;
    UsageError for a model that cannot be loaded."""
    hf_logging.disable_progress_bar()  # stderr carries the one statistics line, not a weight-loading bar
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = _device(args.device)
    try:
        return models.load(args.model, dtype=args.dtype, device=device)
    except (ValueError, OSError) as e:
        raise UsageError(f"--model {args.model}: {e}") from None


def sync(device: torch.device) -> None:
    """Wait for ``device``'s queued work, so that a wall-clock time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def run(args: argparse.Namespace) -> int:
    """Stream the answer to ``args.prompt``; print the statistics line."""
    prompt = _read_prompt_arg(args.prompt)
    method, config = method_and_config(args)
    sampling = _sampling_kwargs(args)
    model, tokenizer = load_model(args)
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
    sync(model.device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        # "ar" is HF's own generate; every other registered method is mtprobe.generate with its config.
        if method.name == "ar":
            sequences = model.generate(input_ids, **common)  # [1, L + new]
            stats = "tau 1.00 (one token per forward)"
        else:
            out = generate(model, input_ids, config, plan=PlanConfig() if args.plan else None, **common)
            sequences = out.sequences  # [1, L + new]
            stats = f"tau {out.tau:.2f} ({out.forward_calls} forwards), stop: {out.stop_reason}"
    sync(model.device)
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
