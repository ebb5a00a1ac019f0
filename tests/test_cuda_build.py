"""The CUDA sources compile (compile-only): every ATen launcher csrc/ops/*_cuda.cu with its kernels
csrc/kernels/*.cuh, by nvcc against the installed torch's headers.

Nothing here runs a kernel; the GPU tests in test_tree_mask.py, test_tree_attention.py,
test_draft_tree.py, test_kv_compact.py and test_verify.py do, on a machine with a CUDA GPU (they
skip elsewhere; scripts/gpu_check.sh runs them there). A CPU-only torch ships the
c10/cuda headers but not the one CMake generates for CUDA builds (cuda_cmake_macros.h); this test
writes that one-line header into a temporary include directory.
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


@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (CUDA sources are compiled where it is)")
@pytest.mark.parametrize("source", CUDA_SOURCES, ids=lambda p: p.stem)
def test_cuda_source_compiles(source: Path, tmp_path: Path) -> None:
    assert CUDA_SOURCES, "no csrc/ops/*_cuda.cu sources"
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl"
    stub.mkdir(parents=True)
    if not (TORCH_INCLUDE / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        (stub / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    cmd = [
        NVCC,
        "-std=c++17",
        "-arch=sm_90",  # the H100/H200 of the lent GPU machine
        "-c",
        str(source),
        "-o",
        str(tmp_path / (source.stem + ".o")),
        "-I",
        str(tmp_path / "stub"),
        "-I",
        str(TORCH_INCLUDE),
        "-I",
        str(TORCH_INCLUDE / "torch" / "csrc" / "api" / "include"),
        "-I",
        str(REPO_ROOT / "csrc"),
        "-w",
    ]
    env = dict(os.environ, TMPDIR=str(tmp_path))
    built = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert built.returncode == 0, (
        f"nvcc failed ({built.returncode}):\n$ {' '.join(cmd)}\n{built.stdout}{built.stderr}"
    )
    assert (tmp_path / (source.stem + ".o")).stat().st_size > 0
