"""The lowest transformers that pyproject.toml allows still works (issue 66, item 4).

The environment holds the transformers constraints.txt pins; scripts/setup.sh also installs the floor of
pyproject.toml's range, with the tokenizers and huggingface-hub it requires, into build/transformers-lowest
(``pip install --no-deps --target``). This file runs a part of the suite that covers ``mtprobe.generate``,
the HF route, the output and batches in a subprocess with that folder first on PYTHONPATH, and checks
that it passed and that the transformers it ran was that floor.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOWEST = ROOT / "build" / "transformers-lowest"
UNDER_LOWEST = "MTPROBE_UNDER_LOWEST_TRANSFORMERS"
"""Set in the subprocess: its run reports its transformers instead of starting another subprocess."""
REPORT = "MTPROBE_LOWEST_TRANSFORMERS_REPORT"

# The subset: this file's report first (so a failure further on still shows what ran), then greedy
# identity, EOS, streamers and processors through generate, the HF route and its arguments, the output's
# scores and fields, batches, and the architectures. About a minute on 2 cores; the whole of
# test_generate.py (its 25 prompts and the long block complexities) would add two more.
SUBSET = [
    "tests/test_transformers_lowest.py::test_report_the_transformers_this_run_uses",
    "tests/test_generate.py::test_token_identical_to_greedy_bc30[chat-lighthouse-story]",
    "tests/test_generate.py::test_hf_custom_generate_route",
    "tests/test_generate.py::test_stops_at_eos_like_greedy",
    "tests/test_generate.py::test_custom_eos_token_mid_output",
    "tests/test_generate.py::test_max_new_tokens_one",
    "tests/test_generate.py::test_logits_processors_apply_per_node",
    "tests/test_generate.py::test_streamer_sees_prompt_then_every_token",
    "tests/test_generate.py::test_bad_input_is_named",
    "tests/test_hf_route.py",
    "tests/test_output_scores.py",
    "tests/test_batch.py",
    "tests/test_architectures.py",
]


def pyproject_floor() -> str:
    """X in pyproject.toml's ``"transformers>=X,<Y"``."""
    found = re.search(
        r'"transformers>=([0-9][0-9.]*),', (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    )
    assert found, 'pyproject.toml names no "transformers>=FLOOR,<CEILING" dependency'
    return found.group(1)


@pytest.mark.skipif(
    os.environ.get(UNDER_LOWEST) != "1", reason="only in the run under the lowest transformers"
)
def test_report_the_transformers_this_run_uses():
    import huggingface_hub
    import tokenizers
    import transformers

    report = {
        "transformers": transformers.__version__,
        "transformers_file": transformers.__file__,
        "tokenizers": tokenizers.__version__,
        "huggingface_hub": huggingface_hub.__version__,
    }
    Path(os.environ[REPORT]).write_text(json.dumps(report), encoding="utf-8")


@pytest.mark.skipif(
    os.environ.get(UNDER_LOWEST) == "1", reason="this is the run under the lowest transformers"
)
def test_the_subset_passes_under_the_lowest_transformers(tmp_path):
    if not (LOWEST / "transformers").is_dir():
        pytest.fail(
            f"{LOWEST.relative_to(ROOT)} holds no transformers: run `bash scripts/setup.sh`, which installs "
            "the lowest supported transformers there"
        )
    report = tmp_path / "report.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(LOWEST), os.environ.get("PYTHONPATH", "")) if p),
        **{UNDER_LOWEST: "1", REPORT: str(report)},
    )
    env.pop("PYTEST_XDIST_WORKER", None)  # this test may itself run on a worker (its thread share is kept)
    cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-x", "-p", "no:cacheprovider", "--durations=5"]
    cmd += ["--tb=short", "--show-capture=no"]  # a failure's traceback, not the weight-loading progress bars
    ran = subprocess.run([*cmd, *SUBSET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = ran.stdout + ran.stderr
    assert report.exists(), f"the run under {LOWEST.relative_to(ROOT)} reported nothing:\n{out[-6000:]}"
    used = json.loads(report.read_text(encoding="utf-8"))
    floor = pyproject_floor()
    assert used["transformers"] == floor, (
        f"the run used transformers {used['transformers']} ({used['transformers_file']}), but pyproject.toml's "
        f"floor is {floor}: make scripts/setup.sh install the floor and run it again"
    )
    assert Path(used["transformers_file"]).resolve().is_relative_to(LOWEST.resolve()), used
    assert ran.returncode == 0, (
        f"the suite's subset fails under transformers {floor} (tokenizers {used['tokenizers']}, "
        f"huggingface-hub {used['huggingface_hub']}):\n{out[-6000:]}"
    )
