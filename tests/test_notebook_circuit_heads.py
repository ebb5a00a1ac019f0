"""Executes notebooks/circuit_heads.ipynb end to end with nbclient, in its small mode (its committed
outputs are checked, then cleared, then the notebook runs afresh; the file is never written back).

As in tests/test_notebooks.py, the kernel is this very interpreter: a private kernelspec named
``python3`` is written into a temporary folder (``ipykernel.kernelspec.write_kernel_spec`` puts
``sys.executable`` in its argv), so the user's installed kernelspecs are neither needed nor touched.
The kernel's cwd is notebooks/, where the notebook finds the committed benchmark results it plots.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from notebook_helpers import check_committed_run_and_clear, execute_small, images, stdout

nbformat = pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "circuit_heads.ipynb"


def test_circuit_heads_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = NOTEBOOK.read_bytes()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    # Committed with the outputs of a full run (readable on GitHub), the expressiveness-latency chart
    # an image.
    committed = check_committed_run_and_clear(nb)
    assert images(committed), "no committed chart"
    assert "SMALL=False" in stdout(committed), "the saved outputs must come from the full (non-SMALL) run"
    assert "sequences identical to greedy generate: True" in stdout(committed)

    outputs = execute_small(nb, NOTEBOOK, tmp_path / "kernels", monkeypatch)
    printed = stdout(outputs)
    assert "SMALL=True" in printed, printed[:500]
    assert "sequences identical to greedy generate: True" in printed, printed
    assert "x2 = " in printed and "x3 = " in printed, "no draft-tree excerpt"
    assert images(outputs), "no image output (the expressiveness-latency plane)"
    assert NOTEBOOK.read_bytes() == original, "the committed notebook was modified"
