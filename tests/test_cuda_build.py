"""The CUDA sources compile (compile-only): every ATen launcher csrc/ops/*_cuda.cu with its kernels
csrc/kernels/*.cuh, by nvcc against the installed torch's headers.

Nothing here runs a kernel; the GPU tests in test_tree_mask.py, test_tree_attention.py,
test_draft_tree.py, test_kv_compact.py and test_verify.py do, on a machine with a CUDA GPU (they
skip elsewhere; scripts/gpu_check.sh runs them there). A CPU-only torch ships the
c10/cuda headers but not the one CMake generates for CUDA builds (cuda_cmake_macros.h); this test
writes that one-line header into a temporary include directory. All sources compile at once, one
nvcc per CPU core, in a module fixture; each parametrized test checks its own source's result.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
CUDA_SOURCES = sorted((REPO_ROOT / "csrc" / "ops").glob("*_cuda.cu"))
NVCC = shutil.which("nvcc")
TORCH_INCLUDE = Path(torch.__file__).parent / "include"


def _compile(source: Path, out: Path) -> subprocess.CompletedProcess:
    """Compiles one source with nvcc into out/<stem>.o, with out as the stub include dir and TMPDIR."""
    assert NVCC is not None
    stub = out / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
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
    return subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> dict[Path, tuple[Path, Future]]:
    """Starts every source's nvcc at once (one per CPU core) and waits for all: source -> (out dir, run).

    A run that raised (timeout) re-raises from its Future in that source's test only.
    """
    outs = {source: tmp_path_factory.mktemp(source.stem) for source in CUDA_SOURCES}
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        runs = {source: (out, pool.submit(_compile, source, out)) for source, out in outs.items()}
    return runs


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA sources are compiled where it is)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.stem)
def test_cuda_source_compiles(source: Path, compiled: dict[Path, tuple[Path, Future]]) -> None:
    assert CUDA_SOURCES, "no csrc/ops/*_cuda.cu sources"
    out, future = compiled[source]
    built = future.result()
    assert built.returncode == 0, (
        f"nvcc failed ({built.returncode}):\n$ {' '.join(built.args)}\n{built.stdout}{built.stderr}"
    )
    assert (out / (source.stem + ".o")).stat().st_size > 0
