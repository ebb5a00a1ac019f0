"""Executes notebooks/quickstart.ipynb end to end with nbclient, in its small mode (its committed outputs
are checked, then cleared, then the notebook runs afresh).

The kernel is this very interpreter: a private kernelspec named ``python3`` is written into a
temporary folder (``ipykernel.kernelspec.write_kernel_spec`` puts ``sys.executable`` in its argv) and
handed to the kernel manager, so the test neither depends on nor touches the user's installed
kernelspecs (whose ``python3`` may name another interpreter, e.g. a bare ``python`` on PATH).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from notebook_helpers import check_committed_run_and_clear, execute_small

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "quickstart.ipynb"


def test_quickstart_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # The notebook is committed with the outputs of a real run (readable on GitHub), the speed chart
    # an image.
    committed = check_committed_run_and_clear(nb)
    assert any("image/png" in o.get("data", {}) for o in committed), "no committed chart"
    committed_stdout = "".join(o.get("text", "") for o in committed if o.get("name") == "stdout")
    assert "SMALL=False" in committed_stdout, "the saved outputs must come from the full (non-SMALL) run"
    assert "AutoConfig: every row identical to greedy on its prompt alone: True" in committed_stdout

    outputs = execute_small(nb, NOTEBOOK, tmp_path / "kernels", monkeypatch)

    stdout = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert "SMALL=True" in stdout, stdout[:500]
    assert "sequences identical to greedy generate" in stdout
    # AutoConfig through HF's generate on the left-padded batch: each row greedy's on its prompt alone
    assert "AutoConfig: every row identical to greedy on its prompt alone: True" in stdout
    assert "first prompt, first tokens and their probabilities:" in stdout

    rich = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    coloured = [
        o.data["text/html"]
        for o in rich
        if "text/html" in o.data and '<span class="mtprobe-step"' in o.data["text/html"]
    ]
    assert coloured, "no HTML output with the tokens coloured by decode step"
    assert "background-color:" in coloured[0]
    images = [o for o in rich if "image/png" in o.data]
    assert images, "no image output (Spec-Bench plots)"
    # small mode always runs the harness: its two plots and its report
    assert len(images) >= 2
    assert any("text/markdown" in o.data and "Losslessness" in o.data["text/markdown"] for o in rich)
