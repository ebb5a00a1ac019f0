"""benchmarks/sweep_tau.py: held-out question selection, field parsing with clear errors, and a real
sweep on SmolLM2 whose every row is greedy-identical."""

from __future__ import annotations

import json
import re

import pytest

from conftest import load_benchmark
from mtprobe.specbench.questions import Question

QUESTIONS = [
    {"question_id": 1, "category": "qa", "turns": ["What is the capital of France?"]},
    {"question_id": 2, "category": "qa", "turns": ["Name a prime number larger than ten."]},
    {"question_id": 3, "category": "translation", "turns": ["Translate 'good morning' into German."]},
    {"question_id": 4, "category": "qa", "turns": ["Who wrote Hamlet?"]},
    {"question_id": 5, "category": "translation", "turns": ["Translate 'thank you' into French."]},
]


def test_select_skips_the_first_questions_of_every_category():
    bench = load_benchmark("sweep_tau")
    qs = [Question(q["question_id"], q["category"], q["turns"]) for q in QUESTIONS]
    assert [q.question_id for q in bench.select(qs, 0, 1)] == [1, 3]
    assert [q.question_id for q in bench.select(qs, 1, 1)] == [2, 5]
    assert [q.question_id for q in bench.select(qs, 1, 5)] == [2, 4, 5]
    assert bench.select(qs, 3, 1) == []  # no category holds a 4th question


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--grid", "max_depthh=2,3"],
            r"'max_depthh' is not a field of StandConfig; its fields: .*max_depth",
        ),
        (["--base", "block_complexity"], r"'block_complexity': expected key=value"),
        (["--grid", "max_depth=0"], r"max_depth"),
        (["--skip-per-category", "9"], r"no question left after skipping 9 per category"),
    ],
)
def test_sweep_refuses_bad_fields_before_running(tmp_path, capsys, extra, message):
    bench = load_benchmark("sweep_tau")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    argv = ["--question-file", str(qfile), "--method", "stand", "--out", str(tmp_path / "r.md"), *extra]
    with pytest.raises((SystemExit, ValueError)) as err:
        bench.main(argv)
    assert re.search(message, str(err.value) + capsys.readouterr().err)
    assert not (tmp_path / "r.md").exists()


def test_sweep_runs_every_combination_greedy_identical(tmp_path, capsys):
    bench = load_benchmark("sweep_tau")
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    out = tmp_path / "r.md"
    argv = ["--question-file", str(qfile), "--skip-per-category", "1", "--per-category", "1"]
    argv += ["--max-new-tokens", "6", "--threads", "1", "--method", "stand", "--base", "block_complexity=8"]
    argv += ["--grid", "max_depth=1,3", "memory_size=None,64", "--out", str(out)]
    assert bench.main(argv) == 0
    text = out.read_text()
    assert "(2: ids 2, 5)" in text  # the 2nd question of each category
    rows = [line for line in text.splitlines() if re.match(r"\| \d+ \| (None|64) \|", line)]
    assert [r.split(" | ")[:2] for r in rows] == [
        ["| 1", "None"],
        ["| 1", "64"],
        ["| 3", "None"],
        ["| 3", "64"],
    ]
    assert all(r.endswith("| 0 |") for r in rows)  # no mismatch with greedy
    taus = [float(re.search(r"\*\*([\d.]+)\*\*", r).group(1)) for r in rows]
    assert all(t >= 1.0 for t in taus)
