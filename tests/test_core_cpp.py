"""The torch-free C++ core (csrc/core) through its own unit-test programs, tests/core/test_*.cpp.

Each program is compiled with no torch include paths at all, which is what proves the core is torch-free.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
CORE_SOURCES = sorted((REPO_ROOT / "csrc" / "core").glob("*.cpp"))
TEST_SOURCES = sorted((REPO_ROOT / "tests" / "core").glob("test_*.cpp"))
CXX = shutil.which("g++") or shutil.which("c++")
CXXFLAGS = ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread"]


@pytest.mark.skipif(CXX is None, reason="no C++ compiler found (neither g++ nor c++ is on PATH)")
@pytest.mark.parametrize("test_source", TEST_SOURCES, ids=lambda p: p.stem)
def test_core_cpp(test_source: Path, tmp_path: Path) -> None:
    assert CORE_SOURCES, f"no C++ sources under {REPO_ROOT / 'csrc' / 'core'}"
    exe = tmp_path / test_source.stem
    compile_cmd = [
        CXX,
        *CXXFLAGS,
        "-I",
        str(REPO_ROOT / "csrc"),
        *map(str, CORE_SOURCES),
        str(test_source),
        "-o",
        str(exe),
    ]
    built = subprocess.run(compile_cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, (
        f"compiling the core tests failed ({built.returncode}):\n$ {' '.join(compile_cmd)}\n"
        f"{built.stdout}{built.stderr}"
    )

    ran = subprocess.run([str(exe)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    output = ran.stdout + ran.stderr
    lines = output.strip().splitlines()
    last = lines[-1] if lines else ""
    assert ran.returncode == 0, f"{test_source.name} exited with {ran.returncode}:\n{output}"
    summary = re.fullmatch(r"(\d+) passed, (\d+) failed", last)
    assert summary is not None, f"last line is not `N passed, M failed`: {last!r}\n{output}"
    assert summary.group(2) == "0", f"{last}:\n{output}"
