"""``mtprobe bytelm train --text FILES --out DIR``: train the project's small byte-level LM
(:func:`mtprobe.offline.bytelm.train_byte_lm`) and write it as a Hugging Face model folder::

    python -m mtprobe bytelm train --text /usr/share/games/fortunes/* --out bytelm --steps 1500
"""

from __future__ import annotations

import argparse
import json

from mtprobe.cli._common import EXIT_OK, UsageError
from mtprobe.offline.bytelm import byte_lm_config, corpus_bytes, save_byte_lm, train_byte_lm

HELP = "train a small byte-level LM on local text files (seed 003's byte-level regime)"
DESCRIPTION = (
    "A small byte-level causal LM trained by the project: the stand-in for EvaByte in seed 003's own "
    "regime (circuit heads over n = 8 and 16 future bytes)."
)


def configure(parser: argparse.ArgumentParser) -> None:
    """``bytelm train ...``."""
    sub = parser.add_subparsers(dest="bytelm_command", required=True, metavar="{train}")
    p = sub.add_parser("train", help="train a byte-level LlamaForCausalLM on local text files")
    p.add_argument(
        "--text", nargs="+", required=True, help="local text files (e.g. /usr/share/games/fortunes/*)"
    )
    p.add_argument("--out", required=True, help="the model folder to write")
    p.add_argument("--hidden-size", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--holdout", type=float, default=0.05, help="the last fraction of each file, kept out")
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    """Train the byte LM, write its folder and print its training stats as JSON."""
    try:  # the configuration's and the corpus's own checks, before any training
        byte_lm_config(hidden_size=args.hidden_size, num_layers=args.layers, num_heads=args.heads)
        corpus_bytes(args.text, args.holdout)
    except ValueError as e:
        raise UsageError(str(e)) from None
    model, stats = train_byte_lm(
        args.text,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        lr=args.lr,
        holdout=args.holdout,
        seed=args.seed,
        progress=True,
    )
    out = save_byte_lm(model, args.out, stats)
    print(json.dumps({"model": str(out), **stats}, indent=1))
    return EXIT_OK
