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

from notebook_helpers import kernel_manager
from notebook_helpers import outputs as cell_outputs

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "circuit_heads.ipynb"


def _stdout(outputs: list) -> str:
    return "".join(o.get("text", "") for o in outputs if o.output_type == "stream" and o.name == "stdout")


def _images(outputs: list) -> list:
    rich = [o for o in outputs if o.output_type in ("display_data", "execute_result")]
    return [o for o in rich if "image/png" in o.data]


def test_circuit_heads_notebook_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    original = NOTEBOOK.read_bytes()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    # The notebook is committed with the outputs of a full run (readable on GitHub): every code cell
    # ran, in order, without errors, and the expressiveness-latency chart is an image.
    committed = cell_outputs(nb)
    assert [c.execution_count for c in code_cells] == list(range(1, len(code_cells) + 1)), "run all cells"
    assert not [o for o in committed if o.output_type == "error"], "committed outputs hold an error"
    assert _images(committed), "no committed chart"
    assert "SMALL=False" in _stdout(committed), "the saved outputs must come from the full (non-SMALL) run"
    assert "sequences identical to greedy generate: True" in _stdout(committed)
    for c in code_cells:  # executed afresh below
        c.outputs, c.execution_count = [], None

    monkeypatch.setenv("MTPROBE_NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    client = nbclient.NotebookClient(
        nb,
        km=kernel_manager(tmp_path / "kernels"),
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # the kernel's cwd: notebooks/
    )
    client.execute()  # raises CellExecutionError on the first failing cell

    outputs = cell_outputs(nb)
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
    stdout = _stdout(outputs)
    assert "SMALL=True" in stdout, stdout[:500]
    assert "sequences identical to greedy generate: True" in stdout, stdout
    assert "x2 = " in stdout and "x3 = " in stdout, "no draft-tree excerpt"
    assert _images(outputs), "no image output (the expressiveness-latency plane)"
    assert NOTEBOOK.read_bytes() == original, "the committed notebook was modified"
