"""benchmarks/soak.py end to end on the tiny random Llama, a few generations instead of 1000."""

from __future__ import annotations

import re
from pathlib import Path

from conftest import load_benchmark


def test_soak_script_runs(tmp_path: Path) -> None:
    # 14 generations: each decoding config once, every output checked against greedy generate. Memory
    # is not judged on so short a run (the first generations grow the allocator), only reported.
    soak = load_benchmark("soak")
    out = tmp_path / "soak.md"
    argv = ["--n", "14", "--warmup", "7", "--every", "7", "--check-every", "1"]
    argv += ["--max-growth-mib", "1000", "--max-object-growth", "100000"]
    assert soak.main([*argv, "--out", str(out)]) == 0
    report = out.read_text()
    assert "14 of 14 checked generations token-identical" in report
    assert "**Verdict: PASS**" in report
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \|", report, flags=re.M)
    assert [int(g) for g, _ in rows] == [0, 7, 14]
    assert all(float(rss) > 0 for _, rss in rows)


def test_soak_fails_when_memory_grows_past_the_threshold(tmp_path: Path) -> None:
    # A negative bound no growth can meet: the verdict and the exit status say FAIL.
    soak = load_benchmark("soak")
    out = tmp_path / "soak.md"
    argv = ["--n", "2", "--warmup", "0", "--every", "1", "--max-growth-mib", "-1000", "--out", str(out)]
    assert soak.main(argv) == 1
    assert "**Verdict: FAIL** (memory GROWS" in out.read_text()
