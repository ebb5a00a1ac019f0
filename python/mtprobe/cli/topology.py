"""``mtprobe topology --model M --out FILE``: build an EntMTP topology bank for a model
(:func:`mtprobe.offline.topology.build_bank`), for mask-token probing or, with ``--head DIR``, a circuit
head, and write it as JSON."""

from __future__ import annotations

import argparse

import torch

from mtprobe.cli._common import (
    EXIT_OK,
    UsageError,
    add_calibration_arguments,
    add_device_arguments,
    calibration_prompts,
    print_progress,
    resolve_device,
)
from mtprobe.drafters import HeadsConfig
from mtprobe.offline.topology import bucket_sizes, build_bank
from mtprobe.target_model.profile import ForwardProfile

HELP = "build an EntMTP topology bank for a model (or a circuit head)"
DESCRIPTION = (
    "Build an EntMTP topology bank for mask-token probing (or, with --head, a circuit head) on a model "
    "(seed 002): self-rollouts on calibration prompts, the acceptance and throughput frontiers, policy "
    "thresholds."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``topology``'s arguments."""
    add_calibration_arguments(parser)
    parser.add_argument("--num-masks", type=int, default=1, help="k, mask tokens per node (1..4)")
    parser.add_argument(
        "--head",
        default=None,
        help="a circuit head's folder (python -m mtprobe heads train): build the bank of its trees instead",
    )
    parser.add_argument(
        "--vocab-top-k",
        type=int,
        default=None,
        help="with --head: the head's restricted vocabulary (HeadsConfig.vocab_top_k) the bank is for",
    )
    parser.add_argument(
        "--head-dtype",
        default=None,
        help="with --head: the dtype of the head's per-step products (HeadsConfig.head_dtype), which its "
        "measured time per step depends on",
    )
    parser.add_argument(
        "--max-nodes", type=int, default=15, help="largest tree, root included (BC = (k+1) nodes)"
    )
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--debias-sizes",
        default="1,2,3,4,6,8,11,14",
        help="draft counts of the frontier trees re-run on their own (one rollout each; default %(default)s)",
    )
    parser.add_argument(
        "--buckets",
        default=None,
        help="comma-separated block sizes, e.g. the static plan's 1,2,4,8,16,32,64 (PlanConfig.buckets): the "
        "bank's trees are the largest that fill each (GPU graphs run a padded bucket, so a tree between two "
        "pays for the larger); replaces --max-nodes and --debias-sizes",
    )
    add_device_arguments(
        parser,
        "the rollouts and the forward profile run: a bank is for the device and dtype it was built on "
        "(a GPU bank: --device cuda --dtype bfloat16 --buckets 1,2,4,8,16,32,64)",
    )
    parser.add_argument(
        "--profile",
        default=None,
        help="a forward profile saved with mtprobe.ForwardProfile.save (default: measured once and cached)",
    )


def run(args: argparse.Namespace) -> int:
    """Build the bank, write it to ``args.out`` and print its trees and policies."""
    try:
        debias = tuple(int(x) for x in args.debias_sizes.split(","))
    except ValueError:
        raise UsageError(
            f"--debias-sizes must be comma-separated integers, got {args.debias_sizes!r}"
        ) from None
    for flag, value in (("--vocab-top-k", args.vocab_top_k), ("--head-dtype", args.head_dtype)):
        if value is not None and args.head is None:
            raise UsageError(f"{flag} is a circuit head's setting: give --head DIR too")
    head = None
    if args.head is not None:
        head = HeadsConfig(path=args.head, vocab_top_k=args.vocab_top_k, head_dtype=args.head_dtype)
    if args.buckets is not None:
        if args.max_nodes != 15 or args.debias_sizes != "1,2,3,4,6,8,11,14":
            raise UsageError("--buckets sets the trees' sizes: leave out --max-nodes and --debias-sizes")
        try:
            buckets = tuple(int(x) for x in args.buckets.split(","))
            args.max_nodes, debias = bucket_sizes(buckets, 1 if args.head is not None else args.num_masks + 1)
        except ValueError as e:
            raise UsageError(f"--buckets {args.buckets}: {e}") from None
    device = resolve_device(args)
    model, _, ids = calibration_prompts(args)  # on the CPU, float32
    if device.type != "cpu" or args.dtype != "float32":
        model = model.to(device=device, dtype=getattr(torch, args.dtype))
    bank = build_bank(
        model,
        ids,
        num_masks=args.num_masks,
        head=head,
        max_nodes=args.max_nodes,
        max_new_tokens=args.max_new_tokens,
        debias_sizes=debias,
        profile=None if args.profile is None else ForwardProfile.load(args.profile),
        progress=print_progress,
    )
    bank.save(args.out)
    s = bank.stats
    print(
        f"bank for {args.model}: {len(bank.trees)} trees, sizes {[len(t) for t in bank.trees]} drafts, "
        f"EntMTP* = tree {bank.best}; debiased tau {s['debiased_tau']}; built in {s['build_seconds']:.0f} s"
    )
    for name, p in bank.policies.items():
        print(
            f"  {name}: trees {p['trees']}, thresholds {[round(h, 4) for h in p['thresholds']]}, feature "
            f"{p['feature']}, simulated {p['simulated_tokens_per_s']:.2f} tok/s"
        )
    print(f"written to {args.out}")
    return EXIT_OK
