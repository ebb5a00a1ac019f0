"""benchmarks/bench_gpu.py on the CPU (the eager plan; no speed asserted): the report's rows, the
equality check against HF greedy, and the divergence description with its margin."""

from __future__ import annotations

import torch

from conftest import load_benchmark


def test_bench_gpu_dry_run_on_the_cpu(tmp_path, smollm2):
    bench = load_benchmark("bench_gpu")
    out = tmp_path / "step.md"
    rc = bench.main(
        ["--device", "cpu", "--dtype", "float32", "--limit", "1", "--max-new-tokens", "6", "--repeats", "1",
         "--methods", "plain,hybrid", "--no-compile", "--unplanned", "--out", str(out)]
    )  # fmt: skip
    assert rc == 0  # float32: every answer identical to HF greedy, or the command fails
    text = out.read_text()
    for row in ("| hf-eager |", "| plain |", "| hybrid |", "| plain (no plan) |", "| hybrid (no plan) |"):
        assert row in text
    assert "| no plan | 1/1 |" in text
    assert "none: every answer identical" in text
    # One read per forward, no graphs on a CPU (and why), the one answer identical.
    assert "| 1.00 | 0 (0); eager: no CUDA graphs on cpu | 1/1 |" in text


def test_divergence_names_the_index_and_the_margin(smollm2):
    bench = load_benchmark("bench_gpu")
    model, tokenizer = smollm2
    ref = tokenizer("The capital of France is Paris", return_tensors="pt").input_ids
    got = ref.clone()
    got[0, -1] = 0
    assert bench.divergence(model, ref, ref) is None
    text = bench.divergence(model, ref, got)
    assert text.startswith(f"index {ref.shape[1] - 1}: 0 vs {int(ref[0, -1])}") and "margin" in text
    assert (
        bench.divergence(model, ref, torch.cat([ref, ref[:, :1]], dim=1))
        == f"lengths {ref.shape[1] + 1} vs {ref.shape[1]}"
    )
