"""Shared by the notebook tests: a kernel bound to this interpreter, and output access."""

from __future__ import annotations

from pathlib import Path


def kernel_manager(kernels_dir: Path):
    """An async kernel manager whose ``python3`` kernel runs ``sys.executable -m ipykernel_launcher``.

    A private kernelspec: an installed ``python3`` spec may start another interpreter.
    """
    from ipykernel.kernelspec import write_kernel_spec
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import AsyncKernelManager

    write_kernel_spec(kernels_dir / "python3")
    ksm = KernelSpecManager(kernel_dirs=[str(kernels_dir)], ensure_native_kernel=False)
    return AsyncKernelManager(kernel_name="python3", kernel_spec_manager=ksm)


def outputs(nb) -> list:
    """Every output of every code cell."""
    return [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]


def images(outs: list) -> list:
    """The rich outputs that hold a PNG image."""
    rich = [o for o in outs if o.output_type in ("display_data", "execute_result")]
    return [o for o in rich if "image/png" in o.data]


def stdout(outs: list) -> str:
    """Everything the cells printed to stdout."""
    return "".join(o.get("text", "") for o in outs if o.output_type == "stream" and o.name == "stdout")


def check_committed_run_and_clear(nb) -> list:
    """Assert the notebook is committed with the outputs of a real run (every code cell ran, in order,
    without errors), clear them for a fresh execution, and return the committed outputs."""
    code_cells = [c for c in nb.cells if c.cell_type == "code"]
    committed = outputs(nb)
    assert [c.execution_count for c in code_cells] == list(range(1, len(code_cells) + 1)), "run all cells"
    assert not [o for o in committed if o.output_type == "error"], "committed outputs hold an error"
    for c in code_cells:
        c.outputs, c.execution_count = [], None
    return committed


def execute_small(nb, notebook: Path, kernels_dir: Path, monkeypatch) -> list:
    """Execute ``nb`` afresh in its small mode (``MTPROBE_NOTEBOOK_SMALL=1``), the kernel's cwd being the
    notebook's folder; assert no cell raised and return every output."""
    import nbclient

    monkeypatch.setenv("MTPROBE_NOTEBOOK_SMALL", "1")  # the kernel inherits the environment
    client = nbclient.NotebookClient(
        nb,
        km=kernel_manager(kernels_dir),
        kernel_name="python3",
        timeout=600,
        resources={"metadata": {"path": str(notebook.parent)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outs = outputs(nb)
    errors = [o for o in outs if o.output_type == "error"]
    assert not errors, [f"{o.ename}: {o.evalue}" for o in errors]
    return outs
