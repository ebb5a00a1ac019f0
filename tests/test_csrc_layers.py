"""The layers of csrc/ include only downward.

Lowest first: core (torch-free C++17), kernels (CUDA device code over core), ops (the ATen ops and
their CUDA launchers), runtime (the ATen-level callbacks drafters and the decode loop share),
drafters, decode (the decode loop), bindings (pybind11). A file's `#include "..."` may name its own
layer or a lower one, never a higher one; core also includes no torch, c10, ATen, pybind11 or CUDA
header (tests/test_core_cpp.py compiles it without them). The checker reads the source text only, so
it runs without a build.
"""

from __future__ import annotations

import re
from pathlib import Path

CSRC = Path(__file__).resolve().parent.parent / "csrc"
LAYERS = ("core", "kernels", "ops", "runtime", "drafters", "decode", "bindings")  # lowest first
SOURCE_SUFFIXES = {".h", ".cpp", ".cu", ".cuh", ".inc"}
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)
TORCH_INCLUDE = re.compile(r"^\s*#\s*include\s+<((?:ATen|c10|torch|pybind11|cuda)[^>]*)>", re.MULTILINE)


def layer_violations(sources: dict[str, str]) -> list[str]:
    """One message per include in ``sources`` (path relative to csrc/ -> text) that breaks the layering.

    Flags a file outside every layer folder, a quoted include that is not a path from csrc/ to one
    of ``sources``, an include of a higher layer, and a torch or CUDA header in core.
    """
    problems = []
    for path, text in sorted(sources.items()):
        layer = path.split("/", 1)[0]
        if layer not in LAYERS:
            problems.append(
                f"csrc/{path}: '{layer}' is not a layer folder ({', '.join(LAYERS)}); add it to LAYERS "
                "in tests/test_csrc_layers.py at its place in the order"
            )
            continue
        allowed = LAYERS[: LAYERS.index(layer) + 1]
        for target in QUOTED_INCLUDE.findall(text):
            if target not in sources:
                problems.append(
                    f'csrc/{path}: #include "{target}" names no file under csrc/ (quoted includes are '
                    'paths from csrc/, e.g. "core/tree.h")'
                )
                continue
            target_layer = target.split("/", 1)[0]
            if target_layer not in allowed:
                problems.append(
                    f'csrc/{path}: #include "{target}" reaches up from {layer} to {target_layer}; '
                    f"{layer} may include only {', '.join(allowed)}"
                )
        if layer == "core":
            for header in TORCH_INCLUDE.findall(text):
                problems.append(
                    f"csrc/{path}: #include <{header}> in core, which must stay torch- and CUDA-free"
                )
    return problems


def csrc_sources() -> dict[str, str]:
    """Every C++/CUDA source and header under csrc/, by its path relative to csrc/."""
    return {
        p.relative_to(CSRC).as_posix(): p.read_text()
        for p in sorted(CSRC.rglob("*"))
        if p.is_file() and p.suffix in SOURCE_SUFFIXES
    }


def test_csrc_includes_only_lower_layers() -> None:
    sources = csrc_sources()
    assert len(sources) > 50, f"found only {len(sources)} sources under {CSRC}"
    assert {path.split("/", 1)[0] for path in sources} == set(LAYERS), "a layer folder is missing or empty"
    problems = layer_violations(sources)
    assert not problems, "\n".join(problems)


def test_checker_flags_an_upward_include() -> None:
    sources = {
        "core/tree.h": "#pragma once\n",
        "ops/ops.h": '#include "core/tree.h"\n',
        "runtime/callbacks.h": "#include <ATen/ATen.h>\n",
        "decode/callbacks.h": "#pragma once\n",
        "drafters/drafter.h": '#include "ops/ops.h"\n#include "runtime/callbacks.h"\n',
        "drafters/draft_model.h": '#include "drafters/drafter.h"\n#include "decode/callbacks.h"\n',
    }
    problems = layer_violations(sources)
    assert len(problems) == 1, problems
    assert problems[0].startswith('csrc/drafters/draft_model.h: #include "decode/callbacks.h" reaches up')


def test_checker_flags_torch_in_core_unknown_folders_and_missing_files() -> None:
    sources = {
        "core/tree.h": "#include <vector>\n#include <ATen/ATen.h>\n",
        "common/util.h": "#pragma once\n",
        "ops/ops.h": '#include "tree.h"\n',
    }
    problems = layer_violations(sources)
    assert len(problems) == 3, problems
    assert problems[0].startswith("csrc/common/util.h: 'common' is not a layer folder")
    assert (
        problems[1]
        == "csrc/core/tree.h: #include <ATen/ATen.h> in core, which must stay torch- and CUDA-free"
    )
    assert problems[2].startswith('csrc/ops/ops.h: #include "tree.h" names no file under csrc/')
