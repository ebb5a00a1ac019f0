"""``--extension PATH``: another build of ``mtprobe._C`` (e.g. one built from an earlier commit) loaded in place of
the installed one, so that a before/after pair runs the same script and Python code. Imported by a benchmark
before anything imports mtprobe:

    git worktree add /tmp/oldtree COMMIT
    pip wheel --no-build-isolation --no-deps /tmp/oldtree -w /tmp/oldwheel
    (cd /tmp/oldC && unzip /tmp/oldwheel/mtprobe-*.whl 'mtprobe/_C*')
    python benchmarks/bench_native_forward.py --curve --extension /tmp/oldC/mtprobe/_C.cpython-311-x86_64-linux-gnu.so
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys

EXTENSION_HELP = (
    "another build of mtprobe._C (a _C*.so) loaded in place of the installed one, for a before/after pair"
)


def load_extension(argv: list[str]) -> str:
    """Registers ``--extension``'s build as ``mtprobe._C`` before mtprobe is imported; its path or ""."""
    if "--extension" not in argv:
        return ""
    if "mtprobe" in sys.modules:
        raise RuntimeError("--extension must be loaded before mtprobe is imported")
    at = argv.index("--extension") + 1
    if at >= len(argv):
        raise SystemExit("--extension needs the path of a _C*.so")
    path = argv[at]
    import torch  # noqa: F401  (the extension links against libc10 and libtorch, which importing torch loads)

    loader = importlib.machinery.ExtensionFileLoader("mtprobe._C", path)
    spec = importlib.util.spec_from_file_location("mtprobe._C", path, loader=loader)
    if spec is None:
        raise SystemExit(f"--extension {path}: not a loadable extension module (a _C*.so built by pip)")
    module = importlib.util.module_from_spec(spec)
    sys.modules["mtprobe._C"] = module
    loader.exec_module(module)
    return path
