"""The CUDA sources compile (compile-only): every ATen launcher csrc/ops/*_cuda.cu with its kernels
csrc/kernels/*.cuh, by nvcc against the installed torch's headers.

Nothing here runs a kernel; the GPU tests in test_tree_mask.py, test_tree_attention.py,
test_draft_tree.py, test_kv_compact.py and test_verify.py do, on a machine with a CUDA GPU (they
skip elsewhere; scripts/gpu_check.sh runs them there, after CMake has built each source on its own).
A CPU-only torch ships the c10/cuda headers but not the one CMake generates for CUDA builds
(cuda_cmake_macros.h); this test writes that one-line header into a temporary include directory.

Why one translation unit: torch's headers are most of each compile (nvcc's front end, cicc and the host
compiler each parse them: about 45 of a source's 48 s here), so the sources compile together, as one
unit that includes them all, in a module fixture: 61 s for the six instead of 6 x 48 s of CPU. Where
that unit fails, each source is compiled on its own in its parametrized test, which names the one that
fails; when each compiles alone but not together, the helpers of two files share a name
(test_cuda_sources_compile_as_one_unit says so).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((REPO_ROOT / "csrc" / "ops").glob("*_cuda.cu"))
NVCC = shutil.which("nvcc")
TORCH_INCLUDE = Path(torch.__file__).parent / "include"
needs_nvcc = pytest.mark.skipif(
    NVCC is None, reason="nvcc is not on PATH (CUDA sources are compiled where it is)"
)


def _compile(source: Path, out: Path) -> subprocess.CompletedProcess:
    """Compiles one source with nvcc into out/<stem>.o, with out as the stub include dir and TMPDIR."""
    assert NVCC is not None
    stub = out / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True, exist_ok=True)
    if not (TORCH_INCLUDE / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [
        NVCC,
        "-std=c++20",  # as CMakeLists.txt builds them: the standard torch's headers set for the .cpp files
        "-arch=sm_90",  # the H100/H200 of the lent GPU machine
        "-c",
        str(source),
        "-o",
        str(out / (source.stem + ".o")),
        "-I",
        str(out / "stub"),
        "-I",
        str(TORCH_INCLUDE),
        "-I",
        str(TORCH_INCLUDE / "torch" / "csrc" / "api" / "include"),
        "-I",
        str(REPO_ROOT / "csrc"),
        "-w",
    ]
    env = dict(os.environ, TMPDIR=str(out))
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, env=env)


def _report(built: subprocess.CompletedProcess) -> str:
    return f"nvcc failed ({built.returncode}):\n$ {' '.join(built.args)}\n{built.stdout}{built.stderr}"


@pytest.fixture(scope="module")
def together(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """(object file, nvcc's run) of one unit that #includes every source, in sorted order."""
    out = tmp_path_factory.mktemp("cuda_sources")
    unit = out / "all_cuda_sources.cu"
    unit.write_text("".join(f'#include "{source}"\n' for source in CUDA_SOURCES))
    return out / (unit.stem + ".o"), _compile(unit, out)


@needs_nvcc
def test_cuda_sources_compile_as_one_unit(together: tuple[Path, subprocess.CompletedProcess]) -> None:
    assert CUDA_SOURCES, "no csrc/ops/*_cuda.cu sources"
    obj, built = together
    assert built.returncode == 0, (
        "the CUDA sources do not compile as one unit. If each compiles on its own "
        "(test_cuda_source_compiles), two files' helpers share a name: give file-local helpers "
        "distinct names. " + _report(built)
    )
    assert obj.stat().st_size > 0


@needs_nvcc
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.stem)
def test_cuda_source_compiles(
    source: Path, together: tuple[Path, subprocess.CompletedProcess], tmp_path: Path
) -> None:
    obj, built = together
    if built.returncode == 0:
        assert obj.stat().st_size > 0  # this source compiled, within the unit
        return
    alone = _compile(source, tmp_path)  # the unit failed: which source, on its own?
    assert alone.returncode == 0, _report(alone)
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0
