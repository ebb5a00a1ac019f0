"""``python -m mtprobe <subcommand> ...``: the ``mtprobe`` command (:mod:`mtprobe.cli`), e.g.
``python -m mtprobe generate ...`` or ``python -m mtprobe models fetch smollm2-135m``."""

import sys

from mtprobe.cli import main

if __name__ == "__main__":
    sys.exit(main())
