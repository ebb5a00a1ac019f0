"""benchmarks/suite_timeline.py: the per-worker record of a pytest run and its summary, on a record
written here and on one pytest itself writes through the plugin."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def test_file_spans_count_the_gap_before_a_file_and_each_worker_apart(tmp_path):
    timeline = load_benchmark("suite_timeline")
    (tmp_path / "timeline-gw0.tsv").write_text(
        "start\t100.0\ttests/a.py::t1\nend\t101.0\ttests/a.py::t1\n"
        "start\t101.0\ttests/a.py::t2\nend\t103.5\ttests/a.py::t2\n"
        "start\t106.0\ttests/b.py::t[1]\nend\t110.0\ttests/b.py::t[1]\n"  # 2.5 s of b's fixtures first
    )
    (tmp_path / "timeline-gw1.tsv").write_text("start\t100.5\ttests/c.py::t\nend\t104.0\ttests/c.py::t\n")
    spans = timeline.spans(tmp_path)
    got = {(s.worker, s.path): (s.begin, s.end) for s in spans}
    assert got == {
        ("gw0", "tests/a.py"): (0.0, 3.5),
        ("gw0", "tests/b.py"): (3.5, 10.0),  # from a's last end: its set-up counts to b
        ("gw1", "tests/c.py"): (0.5, 4.0),
    }
    text = timeline.summary(spans, min_seconds=4.0)
    assert "### gw0: busy 10.0 s, ends at 10.0 s" in text and "| 3.5 | 10.0 | 6.5 | tests/b.py |" in text
    assert "tests/a.py" not in text and "tests/c.py" not in text  # shorter than min_seconds
    assert text.endswith("Last worker ends at 10.0 s, the first at 4.0 s.")


def test_bad_records_are_named(tmp_path):
    timeline = load_benchmark("suite_timeline")
    with pytest.raises(ValueError, match="no timeline-.*tsv in .*SUITE_TIMELINE_DIR"):
        timeline.spans(tmp_path)
    (tmp_path / "timeline-gw0.tsv").write_text("begin\t1.0\ttests/a.py::t\n")
    with pytest.raises(ValueError, match="a line of kind 'begin'"):
        timeline.spans(tmp_path)


def test_the_plugin_records_a_real_run(tmp_path):
    (tmp_path / "test_two.py").write_text("def test_a():\n    pass\n\n\ndef test_b():\n    pass\n")
    env = dict(
        os.environ,
        SUITE_TIMELINE_DIR=str(tmp_path / "tl"),
        PYTHONPATH=os.pathsep.join([str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run on a worker
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "suite_timeline", "-p", "no:cacheprovider", "-n", "0"]
    ran = subprocess.run([*cmd, "test_two.py"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stdout + ran.stderr
    lines = (tmp_path / "tl" / "timeline-main.tsv").read_text().splitlines()
    assert [line.split("\t")[0] + " " + line.split("\t")[2] for line in lines] == [
        "start test_two.py::test_a",
        "end test_two.py::test_a",
        "start test_two.py::test_b",
        "end test_two.py::test_b",
    ]
