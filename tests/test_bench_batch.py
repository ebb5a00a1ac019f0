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
    argv = [
        "bench_batch.py",
        "--question-file",
        str(questions),
        "--per-category",
        "3",
        "--batch-sizes",
        "1,3",
    ]
    argv += ["--max-new-tokens", "6", "--configs", "plain", "quantized-draft-k12", "--apart", "plain"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(out)])
    bench.main()
    rows = re.findall(
        r"^\| (\d+) \| (\S+) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (\S+) \| (\S+) \| (\d+) \|$",
        out.read_text(),
        re.M,
    )
    table = {(int(b), m): (tau, together, differ) for b, m, tau, together, differ in rows}
    names = {"hf-batched", "mtprobe-plain", "mtprobe-plain-apart", "mtprobe-quantized-draft-k12"}
    assert set(table) == {(b, m) for b in (1, 3) for m in names}
    for (b, m), (_, together, differ) in table.items():
        if m.startswith("mtprobe"):
            assert differ == "0", (b, m)  # every mtprobe row greedy's on its prompt alone
            # Three prompts in one batch decode together (the quantized self-draft's steps too); apart, or
            # one at a time, alone.
            alone = m.endswith("-apart")
            assert together == ("3" if b == 3 and not alone else "1"), (b, m, together)
