"""Executes notebooks/probing_analysis.ipynb end to end with nbclient, in its small mode.

The committed notebook keeps the outputs of its full run (its plots are the point), so the test
executes a copy in a temporary folder, with the outputs stripped first, and never writes back. As in
tests/test_notebooks.py, the kernel is this very interpreter: a private kernelspec named ``python3``
is written into a temporary folder (``ipykernel.kernelspec.write_kernel_spec`` puts
``sys.executable`` in its argv), so the user's installed kernelspecs are neither needed nor touched.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from notebook_helpers import images, kernel_manager
from notebook_helpers import outputs as cell_outputs

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "probing_analysis.ipynb"


def test_committed_notebook_keeps_its_full_run_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    outputs = cell_outputs(nb)
    assert not [o for o in outputs if o.output_type == "error"]
    assert images(outputs), "the committed notebook must keep its figure"
    stdout = "".join(o.get("text", "") for o in outputs if o.output_type == "stream")
    assert "SMALL=False" in stdout, "the saved outputs must come from the full (non-SMALL) run"


def test_probing_analysis_notebook_runs_small(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = NOTEBOOK.read_bytes()
    copy = tmp_path / NOTEBOOK.name
    shutil.copyfile(NOTEBOOK, copy)
    nb = nbformat.read(copy, as_version=4)
    for cell in nb.cells:  # outputs seen after execution must come from this run
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None

    monkeypatch.setenv("MTPROBE_NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    client = nbclient.NotebookClient(
        nb,
        km=kernel_manager(tmp_path / "kernels"),
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(tmp_path)}},  # the kernel's cwd
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    nbformat.write(nb, copy)  # the executed copy, for inspection after a failure

    outputs = cell_outputs(nb)
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
    stdout = "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")
    assert "SMALL=True" in stdout, stdout[:500]
    assert "acceptance rate" in stdout
    assert images(outputs), "no image output (the per-layer cosine figure)"
    markdown = [o.data["text/markdown"] for o in outputs if "data" in o and "text/markdown" in o.data]
    assert any("premise" in m for m in markdown), "no Lemma 3.1 table"
    assert NOTEBOOK.read_bytes() == original, "the committed notebook was modified"
