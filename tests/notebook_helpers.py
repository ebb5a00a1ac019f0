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
