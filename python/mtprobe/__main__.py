"""``python -m mtprobe generate|bench ...``: the same command as the ``mtprobe`` console script."""

import sys

from mtprobe.cli import main

if __name__ == "__main__":
    sys.exit(main())
