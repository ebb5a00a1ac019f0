"""``mtprobe calibrate --model M --out FILE``: learn a model's mask-token embeddings
(:func:`mtprobe.offline.calibrate.calibrate_masks`) and write the calibration file::

    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2.safetensors \\
        --corpus-prompts /usr/share/games/fortunes/* --num-corpus-prompts 136 --gen-batch-size 16
    python -m mtprobe calibrate --model smollm2-135m --out masks-smollm2-offsets.safetensors --layer-offsets
    python -m mtprobe calibrate --model smollm2-135m --out masks-lora.safetensors --num-masks 2 --layer-offsets \\
        --mask-lora 8 --init masks-smollm2-offsets.safetensors --lr 0.01
    python -m mtprobe calibrate --model smollm2-135m --out masks-lora-t.safetensors --init masks-lora.safetensors \\
        --temperature-only
    python -m mtprobe calibrate --model smollm2-135m --out masks.safetensors --continuations seqs.safetensors
"""

from __future__ import annotations

import argparse
import os

from mtprobe.cli._common import (
    EXIT_OK,
    UsageError,
    add_calibration_arguments,
    add_corpus_arguments,
    calibration_prompts,
    check_corpus_arguments,
    print_progress,
)
from mtprobe.data import corpus_prompts
from mtprobe.offline.calibrate import calibrate_masks, fit_mask_temperature
from mtprobe.target_model.mask_calibration import MaskCalibration, load_calibration

HELP = "learn a model's mask-token embeddings (ProbeConfig(mask_init='calibrated'))"
DESCRIPTION = (
    "Learn mask-token embeddings for a model: the k masks are trained (model frozen) so that their logits "
    "predict the tokens after next on the model's own greedy continuations."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``calibrate``'s arguments."""
    add_calibration_arguments(parser)
    parser.add_argument("--num-masks", type=int, default=1, help="k, mask tokens per node (1..4)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="length of each greedy continuation")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--anchors-per-step", type=int, default=64)
    parser.add_argument(
        "--lr", type=float, default=0.05, help="Adam's step, relative to the embeddings' spread"
    )
    parser.add_argument("--holdout", type=int, default=4, help="prompts kept out of training and scored")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--layer-offsets",
        action="store_true",
        help="also learn one vector per decoder layer added to the masks' hidden state before it",
    )
    parser.add_argument(
        "--mask-lora",
        type=int,
        default=0,
        metavar="RANK",
        help="also learn a rank-RANK LoRA of every decoder layer's projections, applied at the masks only",
    )
    parser.add_argument("--lora-lr", type=float, default=1e-3, help="Adam's step for the mask LoRA")
    parser.add_argument(
        "--init",
        default=None,
        metavar="FILE",
        help="start from this calibration (its first --num-masks masks)",
    )
    parser.add_argument(
        "--no-temperature",
        action="store_true",
        help="do not fit the masks' temperatures on the held-out prompts after training",
    )
    parser.add_argument(
        "--temperature-only",
        action="store_true",
        help="learn nothing: write --init's calibration with its masks' temperatures fitted on the held-out "
        "prompts (the last --holdout of the prompts)",
    )
    parser.add_argument(
        "--continuations",
        default=None,
        metavar="FILE",
        help="keep the greedy continuations in FILE: read them from it when it holds this model's for these "
        "prompts and settings, else generate and write them (a second run on the same prompts skips "
        "the generation)",
    )
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=8.0,
        metavar="GIB",
        help="GiB of the sequences' KV caches kept in memory while training (default 8: SmolLM2 needs about "
        "9 GB per 1000 sequences of 128 new tokens); past it, a step rebuilds its sequence's cache",
    )
    add_corpus_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Calibrate the masks, write them to ``args.out`` and print the held-out scores."""
    check_corpus_arguments(args)
    if args.temperature_only:  # before the model loads: a wrong command costs no minutes
        if args.init is None:
            raise UsageError(
                "--temperature-only fits the temperatures of an existing calibration: give --init FILE"
            )
        if args.no_temperature:
            raise UsageError("--temperature-only and --no-temperature contradict each other: give one")
        if args.continuations is not None:
            raise UsageError(
                "--continuations keeps a training run's continuations; --temperature-only generates only the "
                "held-out prompts' and keeps none: drop one of them"
            )
    model, tokenizer, ids = calibration_prompts(args)
    sources = {"prompts": args.prompts or "built-in", "num_prompts": len(ids)}
    if args.corpus_prompts:
        try:
            extra = corpus_prompts(tokenizer, args.corpus_prompts, args.num_corpus_prompts, args.seed)
        except ValueError as e:
            raise UsageError(str(e)) from None
        ids = extra + ids
        sources.update(
            corpus_prompts=[os.path.basename(f) for f in args.corpus_prompts], num_corpus_prompts=len(extra)
        )
    try:
        init = load_calibration(args.init) if args.init is not None else None
    except (OSError, ValueError) as e:
        raise UsageError(f"--init: {e}") from None
    if args.temperature_only:
        return _fit_temperature_only(args, model, ids, init)
    try:
        cal = calibrate_masks(
            model,
            ids,
            num_masks=args.num_masks,
            max_new_tokens=args.max_new_tokens,
            epochs=args.epochs,
            anchors_per_step=args.anchors_per_step,
            lr=args.lr,
            holdout=args.holdout,
            seed=args.seed,
            gen_batch_size=args.gen_batch_size,
            layer_offsets=args.layer_offsets,
            mask_lora_rank=args.mask_lora,
            lora_lr=args.lora_lr,
            fit_temperature=not args.no_temperature,
            init=init,
            sources=sources,
            continuations=args.continuations,
            cache_gib=args.cache_gib,
            progress=print_progress,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    cal.save(args.out)
    s = cal.stats
    b, a = s["holdout_prompt_mean"], s["holdout_after"]
    if b:
        print(
            f"held-out top-1 of the masks: prompt-mean (seed 001) {b['top1']:.3f}, calibrated {a['top1']:.3f} "
            f"(loss {b['loss']:.3f} -> {a['loss']:.3f}, {a['targets']} targets)"
        )
    print(f"{cal.num_masks} mask(s) for {args.model} learned in {s['seconds']:.0f} s, written to {args.out}")
    return EXIT_OK


def _fit_temperature_only(args: argparse.Namespace, model, ids: list, init: MaskCalibration) -> int:
    """``--temperature-only``: --init's calibration with temperatures fitted on the held-out prompts."""
    if not 1 <= args.holdout <= len(ids):
        raise UsageError(f"--holdout {args.holdout} must be between 1 and the {len(ids)} prompts")
    try:
        cal = fit_mask_temperature(
            model,
            init,
            ids[-args.holdout :],
            max_new_tokens=args.max_new_tokens,
            gen_batch_size=args.gen_batch_size,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    cal.save(args.out)
    fit = cal.stats["temperature_fit"]
    print(
        f"mask temperatures {[round(float(t), 3) for t in cal.mask_temperature]}: held-out loss "
        f"{fit['loss_before']['loss']:.3f} -> {fit['loss_after']['loss']:.3f} ({fit['loss_after']['targets']} "
        f"targets), written to {args.out}"
    )
    return EXIT_OK
