"""``mtprobe heads train``: train a circuit head on the frozen backbone's features
(:mod:`mtprobe.offline.heads`) and write its checkpoint; ``mtprobe heads count DIR``: record in a head's
checkpoint how often each token occurs in its training windows (heads trained before ``train`` recorded
it), for ``HeadsConfig(vocab_top_k=...)``::

    python -m mtprobe heads train --circuit hmm --window 4 --rank 2 --out heads/hmm --features f.pt

Training data: the model's own greedy continuations of the calibration prompts (and of corpus prompts),
plus chunks of ``--text`` files; ``--features FILE`` caches the backbone's features of them.

``--device cuda`` (``--dtype bfloat16`` optional) runs the greedy generation, the features and the
training on a GPU (``scripts/gpu_check.sh heads``); the head file is the same either way: float32,
written over the model as loaded on the CPU. ``--max-seconds S`` caps the training loop's wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from mtprobe import models
from mtprobe.cli._common import (
    EXIT_OK,
    UsageError,
    add_calibration_arguments,
    add_corpus_arguments,
    add_device_arguments,
    calibration_prompts,
    check_corpus_arguments,
    print_progress,
    resolve_device,
)
from mtprobe.data import corpus_prompts
from mtprobe.heads.circuit import EMISSIONS, KINDS, LORA_BASES, CircuitHead, HeadSpec
from mtprobe.heads.inference import checkpoint_path, load_head, new_head, output_embedding, save_head
from mtprobe.heads.lora import decoder_of
from mtprobe.offline.bytelm import passage_prompts
from mtprobe.offline.calibration_data import calibration_sequences
from mtprobe.offline.heads import (
    Features,
    compute_features,
    features_at_layer,
    init_from,
    text_sequences,
    train_head,
    window_token_counts,
)

# What a head file committed to the repository may weigh (issue 43): larger ones are written all the
# same, with a warning.
MAX_COMMITTED_BYTES = 16 * 2**20

HELP = "train a circuit head (HeadsConfig) for a model, or record a head's token counts"
DESCRIPTION = (
    "Probabilistic-circuit heads (MTPC, seed 003): train a small head that drafts the next window of "
    "tokens from the target's hidden state, or update a trained head's checkpoint."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``heads train ...`` and ``heads count DIR ...``."""
    sub = parser.add_subparsers(dest="heads_command", required=True, metavar="{train,count}")
    p = sub.add_parser("train", help="train a circuit head on the frozen backbone's features")
    add_calibration_arguments(p)
    p.add_argument("--circuit", choices=KINDS, default="cp")
    p.add_argument("--window", type=int, default=4, help="n: the next token and n - 1 drafts")
    p.add_argument("--rank", type=int, default=4, help="r: latent states (1 for ff)")
    p.add_argument("--emission", choices=EMISSIONS, default="lowrank")
    p.add_argument("--adapter-rank", type=int, default=16)
    p.add_argument(
        "--lora-layers",
        type=int,
        default=0,
        help="k: give the draft LoRA-adapted copies of the backbone's last k layers (0: read its last state)",
    )
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument(
        "--lora-base",
        choices=LORA_BASES,
        default="target",
        help="with --lora-layers: the emissions build on the target's logits (free at decode time) or on "
        "the draft's own (a second LM-head pass per step)",
    )
    p.add_argument(
        "--init",
        default=None,
        help="start from this trained head (same circuit, window, rank and emissions; e.g. one without "
        "LoRA, continued with --lora-layers K as in the paper)",
    )
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gamma", type=float, default=None, help="discount (default 0.8, 0.9 for n > 8)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="length of each greedy continuation")
    p.add_argument("--text", nargs="*", default=[], help="local text files to train on as well (a corpus)")
    p.add_argument(
        "--text-holdout",
        type=float,
        default=0.0,
        help="leave out the last fraction of every --text file (e.g. 0.05: what mtprobe bytelm held out)",
    )
    p.add_argument("--max-text-tokens", type=int, default=None, help="at most this many --text tokens")
    p.add_argument(
        "--passage-prompts",
        type=int,
        default=0,
        help="self-distil on N more prompts: the first 96 bytes of passages of the --text files (their "
        "training part), continued as plain text without a chat template (for base models such as "
        "mtprobe bytelm's)",
    )
    add_corpus_arguments(p)
    p.add_argument("--no-self", action="store_true", help="skip the model's own greedy continuations")
    p.add_argument("--features", default=None, help="cache the backbone's features in this file")
    p.add_argument("--seed", type=int, default=0)
    add_device_arguments(
        p,
        "the backbone generates, computes the features and the head trains (the features and the head "
        "file stay float32 either way)",
    )
    p.add_argument(
        "--max-seconds",
        type=float,
        default=None,
        help="a wall-clock budget for the training loop: it stops after the step that crosses it (the "
        "head's stats record the steps run)",
    )
    c = sub.add_parser(
        "count",
        help="record in a head's checkpoint how often each token occurs in its training windows (heads "
        "trained before train recorded it), for HeadsConfig(vocab_top_k=...)",
    )
    c.add_argument("head", help="the head's folder (rewritten in place)")
    c.add_argument(
        "--features", required=True, help="the features file the head was trained on (train --features)"
    )
    c.add_argument("--model", default="smollm2-135m", help="the backbone the head belongs to")


def run(args: argparse.Namespace) -> int:
    """Run the ``heads`` subcommand ``args.heads_command``."""
    return _count(args) if args.heads_command == "count" else _train(args)


def _count(args: argparse.Namespace) -> int:
    if not checkpoint_path(args.head).is_file():
        raise UsageError(f"{args.head}: no circuit-head checkpoint there")
    if not Path(args.features).is_file():
        raise UsageError(f"--features {args.features}: no such file")
    model, _ = models.load(args.model)
    head = load_head(args.head, model)
    features = Features(**torch.load(args.features)["features"])
    head.token_counts.copy_(window_token_counts(features, head.spec.window, head.spec.vocab_size))
    head.stats.setdefault("data", {})["token_counts_from"] = os.path.basename(args.features)  # type: ignore[attr-defined]
    path = save_head(head, model, args.head, head.stats)  # type: ignore[attr-defined]
    seen = int((head.token_counts > 0).sum())
    print(f"{path}: token counts of {int(head.token_counts.sum())} window tokens, {seen} distinct")
    return EXIT_OK


def _check_train_arguments(args: argparse.Namespace) -> None:
    """UsageError for what ``train``'s options get wrong: the architecture's own checks, run before any
    model is loaded."""
    try:
        HeadSpec(
            args.circuit,
            args.window,
            args.rank,
            args.emission,
            args.adapter_rank,
            1,
            1,
            args.lora_layers,
            args.lora_rank,
        )
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    if args.init is not None and not checkpoint_path(args.init).is_file():
        raise UsageError(f"--init {args.init}: no circuit-head checkpoint there")
    if args.steps < 1 or args.batch_size < 1:
        raise UsageError(f"steps={args.steps} and batch_size={args.batch_size} must be >= 1")
    if not 0.0 <= args.text_holdout < 1.0:
        raise UsageError(f"--text-holdout {args.text_holdout} must be in [0, 1)")
    if args.passage_prompts and not args.text:
        raise UsageError("--passage-prompts N takes its passages from --text FILES; give them")
    if args.max_text_tokens is not None and args.max_text_tokens < 256:
        raise UsageError(f"--max-text-tokens {args.max_text_tokens} must be >= 256 (one sequence)")
    if args.max_seconds is not None and not (math.isfinite(args.max_seconds) and args.max_seconds > 0):
        raise UsageError(f"--max-seconds {args.max_seconds} must be a number of seconds > 0")
    check_corpus_arguments(args)
    resolve_device(args)


def _float32_features(features: Features) -> Features:
    """``features`` as a features file holds them: float32 on the CPU (a no-op for what
    compute_features makes; a check that a GPU or bfloat16 run never writes anything else)."""
    return replace(
        features,
        hidden=features.hidden.to("cpu", torch.float32),
        last=None if features.last is None else features.last.to("cpu", torch.float32),
    )


def _cpu_head(head: CircuitHead, model: Any) -> CircuitHead:
    """``head``, trained on another device or over the backbone in bfloat16, as a float32 head over
    ``model`` (the backbone as loaded, on the CPU, in float32): what ``load_head`` would build from its file, with
    the trained parameters and buffers copied in. The frozen copies in its LoRA draft layers (norms)
    stay ``model``'s own float32 weights, and the checkpoint names ``model``, not a rounded copy."""
    frozen = {name for name, p in head.named_parameters() if not p.requires_grad}
    state = {k: v.detach().cpu() for k, v in head.state_dict().items() if k not in frozen}
    out = new_head(model, head.spec)
    missing, unexpected = out.load_state_dict(state, strict=False)  # casts to out's float32
    if unexpected or not set(missing) <= frozen:
        raise RuntimeError(f"the trained head does not fit its CPU copy: {missing}, {unexpected}")
    return out.eval()


def _train(args: argparse.Namespace) -> int:
    _check_train_arguments(args)
    device = resolve_device(args)
    model, tokenizer, prompts = calibration_prompts(args)  # on the CPU, float32
    # The backbone that generates, computes the features and carries the head: the model as loaded on
    # the CPU in float32, else moved to the device in --dtype (not copied: host memory stays one
    # model's). A checkpoint names the float32 CPU model (its identity hashes float32 weights;
    # bfloat16 ones would differ), so a moved one is loaded afresh where that model is needed.
    as_loaded = device.type == "cpu" and args.dtype == "float32"
    work = model if as_loaded else model.to(device=device, dtype=getattr(torch, args.dtype))

    def cpu_model() -> Any:
        return model if as_loaded else models.load(args.model)[0]

    layer = -1
    if args.lora_layers:
        try:
            layers = len(decoder_of(work).layers)
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.lora_layers > layers:
            raise UsageError(f"--lora-layers {args.lora_layers} exceeds the model's {layers} layers")
        layer = layers - args.lora_layers  # the draft layers' input
    data = {
        "self": not args.no_self,
        "prompts": args.prompts or "built-in",
        "num_prompts": args.num_prompts,
        "corpus_prompts": [os.path.basename(c) for c in args.corpus_prompts],
        "num_corpus_prompts": args.num_corpus_prompts if args.corpus_prompts else 0,
        "max_new_tokens": args.max_new_tokens,
        "gen_batch_size": args.gen_batch_size,
        "text": [os.path.basename(t) for t in args.text],
        "text_holdout": args.text_holdout,
        "max_text_tokens": args.max_text_tokens,
        "passage_prompts": args.passage_prompts,
    }
    if args.features and Path(args.features).is_file():
        print_progress(f"features from {args.features} (its data options replace this command's)")
        saved = torch.load(args.features)
        features, data = Features(**saved["features"]), saved["data"]
        features = features_at_layer(work, features, layer, print_progress)
    else:
        seqs: list[tuple[torch.Tensor, int]] = []
        if args.passage_prompts:
            texts = passage_prompts(
                args.text, args.passage_prompts, part="train", holdout=args.text_holdout, seed=args.seed
            )
            prompts = prompts + [tokenizer(t, return_tensors="pt").input_ids for t in texts]
        if args.corpus_prompts:
            made = corpus_prompts(tokenizer, args.corpus_prompts, args.num_corpus_prompts, args.seed)
            data["corpus_prompts_made"] = len(made)  # fewer than asked where the files hold fewer passages
            prompts = prompts + made
        if not args.no_self:
            seqs += [
                (ids, plen - 1)
                for ids, plen in calibration_sequences(
                    work, prompts, args.max_new_tokens, print_progress, batch_size=args.gen_batch_size
                )
            ]
        if args.text:
            seqs += text_sequences(
                tokenizer, args.text, 256, holdout=args.text_holdout, max_tokens=args.max_text_tokens
            )
        if not seqs:
            raise UsageError("no training data: drop --no-self or give --text FILES")
        features = compute_features(work, seqs, print_progress, layer)
        if args.features:
            torch.save({"features": asdict(_float32_features(features)), "data": data}, args.features)
    weight, _ = output_embedding(work)
    spec = HeadSpec(
        circuit=args.circuit,
        window=args.window,
        rank=args.rank,
        emission=args.emission,
        adapter_rank=args.adapter_rank,
        hidden_size=int(weight.shape[1]),
        vocab_size=int(weight.shape[0]),
        lora_layers=args.lora_layers,
        lora_rank=args.lora_rank,
        lora_base=args.lora_base,
    )
    torch.manual_seed(args.seed)
    head = new_head(work, spec)  # initialised on the CPU, then moved: the same start on every device
    if args.init is not None:  # loaded over the CPU model, whose identity its checkpoint names
        init_from(head, load_head(args.init, cpu_model()))
        data["init"] = os.path.basename(os.path.normpath(args.init))
    stats = train_head(
        head,
        features,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        gamma=args.gamma,
        seed=args.seed,
        progress=True,
        max_seconds=args.max_seconds,
    )
    stats["data"] = data
    stats["device"] = device.type
    stats["dtype"] = args.dtype
    if getattr(args, "argv", None):  # the training command, recorded with the head it made
        stats["command"] = "python -m mtprobe " + shlex.join(args.argv)
    if not as_loaded:
        model = cpu_model()
        head = _cpu_head(head, model)
    path = save_head(head, model, args.out, stats)
    size = path.stat().st_size
    print(json.dumps({"checkpoint": str(path), "file_bytes": size, **stats}, indent=1))
    # stdout stays one JSON object (scripts parse it); the size line goes with the progress, to stderr
    print(f"head file: {path}, {size / 2**20:.2f} MiB", file=sys.stderr)
    if size > MAX_COMMITTED_BYTES:
        print(
            f"mtprobe: warning: {path} is {size / 2**20:.1f} MiB, over the "
            f"{MAX_COMMITTED_BYTES // 2**20} MiB a committed head may take (a smaller --rank, "
            "--adapter-rank or --lora-layers makes it smaller)",
            file=sys.stderr,
        )
    return EXIT_OK
