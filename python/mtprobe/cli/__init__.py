"""The ``mtprobe`` command (also ``python -m mtprobe``): one subcommand per program, each in its own
module of this package over the library's functions.

``mtprobe generate "prompt"`` streams one answer to stdout and prints one line of statistics on
stderr; ``mtprobe bench --prompts FILE`` runs HF greedy ``model.generate`` and a method on each of a
user's prompts, checks that the tokens are identical and prints a table of τ, tokens/s and speedup::

    mtprobe generate --model smollm2-135m --method pld "Summarise this: ..."
    mtprobe bench --prompts my_prompts.txt --method probe --block-complexity 30 --repeats 3

Methods and their options come from the method registry (:mod:`mtprobe.specbench.methods`), so
``--method`` takes the same names (``ar``, ``probe``, ``pld``, ``stand``, ``lookahead``, ``hybrid``,
``sps``, ...) and the same options as ``python -m mtprobe.specbench run``.

The offline programs: ``mtprobe models fetch|path|resolve`` (the model cache), ``mtprobe calibrate``
(learned mask tokens), ``mtprobe heads train|count`` (circuit heads), ``mtprobe topology`` (an EntMTP
topology bank) and ``mtprobe bytelm train`` (the byte-level LM).

Exit status: 0 done; 1 ``bench`` found a prompt whose tokens differ from HF greedy, or ``models``
could not fetch or find a model; 2 bad input (an unknown method or option, a missing or malformed
prompt file, no prompt, a model that cannot be loaded, a setting the library refuses), reported as one
line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from mtprobe.cli import bench, bytelm, calibrate, generate, heads, models, topology
from mtprobe.cli._common import EXIT_DIFFERS, EXIT_OK, EXIT_USAGE, Parser, UsageError, one_line
from mtprobe.cli.bench import BenchRow, read_prompts, render_bench
from mtprobe.cli.generate import encode_prompt
from mtprobe.cli.generate import method_and_config as _method_and_config  # noqa: F401  (tests' name)

__all__ = [
    "EXIT_DIFFERS",
    "EXIT_OK",
    "EXIT_USAGE",
    "PROGRAMS",
    "BenchRow",
    "UsageError",
    "encode_prompt",
    "main",
    "read_prompts",
    "render_bench",
]

# Subcommand -> its module: HELP and DESCRIPTION, configure(parser) adds its arguments, run(args) runs it
# and returns the exit status.
PROGRAMS = {
    "generate": generate,
    "bench": bench,
    "models": models,
    "calibrate": calibrate,
    "heads": heads,
    "topology": topology,
    "bytelm": bytelm,
}


def _build_parser() -> argparse.ArgumentParser:
    """The ``mtprobe`` parser, every subcommand's arguments included; its errors raise UsageError."""
    parser = Parser(
        prog="mtprobe",
        description="Lossless multi-token decoding of a Hugging Face causal LM: generate one answer, "
        "benchmark a method against HF greedy decoding on your own prompts, or prepare what a method "
        "needs offline (a model, mask calibrations, circuit heads, topology banks).",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(PROGRAMS) + "}")
    for name, program in PROGRAMS.items():
        program.configure(sub.add_parser(name, help=program.HELP, description=program.DESCRIPTION))
    return parser


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
        return PROGRAMS[args.command].run(args)
    except UsageError as e:
        print(f"mtprobe: error: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except (ValueError, NotImplementedError) as e:
        # What the library refuses (a configuration it cannot run, a prompt beyond the model's context,
        # a model that is not a causal LM) names what is wrong; show it as bad input, not a traceback.
        print(f"mtprobe: error: {type(e).__name__}: {one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
