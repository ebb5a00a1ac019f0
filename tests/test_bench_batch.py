"""benchmarks/bench_batch.py: the left-padded batch it builds, the tokens it counts, and a short real run
on SmolLM2 whose every row is greedy's on its prompt alone."""

from __future__ import annotations

import json
import re
import sys

import torch

from conftest import load_benchmark


def test_left_padding_and_counted_tokens():
    bench = load_benchmark("bench_batch")
    ids, mask = bench.left_padded([torch.tensor([[5, 6, 7]]), torch.tensor([[8]])], pad=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    row = torch.tensor([0, 0, 8, 4, 9, 2, 0, 0])  # width 3, then 4 9 and EOS 2, then padding
    assert bench.new_tokens(row, 3, {2}) == [4, 9, 2]
    assert bench.new_tokens(row[:5], 3, {2}) == [4, 9]  # no EOS: every token after the prompt


def test_a_short_run_reports_every_row_greedy(tmp_path, monkeypatch):
    questions = tmp_path / "q.jsonl"
    turns = ["Name two colours.", "What is the capital of Italy? Answer in one sentence.", "Count to five."]
    questions.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) for i, t in enumerate(turns))
    )
    out = tmp_path / "batch.md"
    bench = load_benchmark("bench_batch")
    argv = ["bench_batch.py", "--question-file", str(questions), "--per-category", "3", "--batch-size", "3"]
    argv += ["--max-new-tokens", "6", "--repeats", "1", "--configs", "quantized-draft-k12", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    table = {
        m[0]: m[1:]
        for m in re.findall(r"^\| (\S+) \| ([\d.]+) \| [\d.]+ \| [\d.]+ \| (\S+) \|$", out.read_text(), re.M)
    }
    assert set(table) == {"hf-single", "hf-batched", "mtprobe-quantized-draft-k12"}
    assert table["mtprobe-quantized-draft-k12"][1] == "0"  # every mtprobe row greedy's on its prompt alone
