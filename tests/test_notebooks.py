"""The notebooks in `notebooks/` run top to bottom on a CPU, and are committed without outputs.

Each notebook ends with a cell of assertions on its own results (accuracy rises, the TV scale falls, the dispersion
statistics are finite, ...), so a silent regression fails here as a cell error. Together they take about six minutes
on a 2-core CPU.
"""

import math
import os
import sys
from pathlib import Path

import nbformat
import pytest
from jupyter_client.kernelspec import KernelSpecManager
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from .timeouts import time_limit


NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT = 600  # seconds, per cell
NOTEBOOK_TIMEOUT = 900  # seconds, per notebook (pytest-timeout); both times TVOPD_TEST_TIMEOUT_SCALE
STRIP_HINT = "commit notebooks without outputs: see notebooks/README.md for the one-line strip command"


def kernel_manager():
    # An empty kernel search path leaves only ipykernel's built-in "python3" spec, which launches this interpreter
    # (`sys.executable -m ipykernel_launcher`): never a "python3" kernel that another environment installed into the
    # user's or the system's Jupyter paths.
    return KernelManager(kernel_name="python3", kernel_spec_manager=KernelSpecManager(kernel_dirs=[]))


def execute(notebook, cwd):
    """Runs `notebook` in place in a fresh kernel started in `cwd`; raises `CellExecutionError` on any cell error."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("MPLBACKEND", None)  # the kernel's inline backend, as in Jupyter
    km = kernel_manager()
    client = NotebookClient(
        notebook,
        km=km,
        timeout=math.ceil(time_limit(CELL_TIMEOUT)),
        startup_timeout=math.ceil(time_limit(120)),
        resources={"metadata": {"path": str(cwd)}},
    )
    try:
        client.execute(env=env)
    finally:
        # nbclient leaves running a kernel whose manager it was given: each held its notebook's models until the
        # pytest worker ended
        if km.has_kernel:
            km.shutdown_kernel(now=True)
    return notebook


def stream_text(cell):
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


def test_the_notebooks_are_there():
    assert [path.name for path in NOTEBOOKS] == [
        "01_quickstart.ipynb",
        "02_advantage_anatomy.ipynb",
        "03_compare_methods.ipynb",
    ]


def test_the_kernel_is_this_interpreter_in_the_given_directory(tmp_path):
    source = (
        "import os, sys\n"
        "print(sys.executable, sys.prefix, os.getcwd(), os.environ['OMP_NUM_THREADS'], os.getpid(), sep='\\n')"
    )
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    executable, prefix, cwd, threads, pid = stream_text(execute(notebook, tmp_path).cells[0]).split("\n")[:5]
    assert (executable, prefix) == (sys.executable, sys.prefix)
    assert Path(cwd).resolve() == tmp_path.resolve() and threads == "1"
    with pytest.raises(ProcessLookupError):  # the kernel is shut down
        os.kill(int(pid), 0)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_without_outputs(path):
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}, cell {index} has outputs: {STRIP_HINT}"
            assert cell.execution_count is None, f"{path.name}, cell {index} has an execution count: {STRIP_HINT}"
    assert notebook.metadata.kernelspec.name == "python3"
    assert "widgets" not in notebook.metadata, f"{path.name} stores widget state: {STRIP_HINT}"


@pytest.mark.long
@pytest.mark.timeout(NOTEBOOK_TIMEOUT)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs_top_to_bottom(path, tmp_path):
    notebook = execute(nbformat.read(path, as_version=4), tmp_path)
    last = [cell for cell in notebook.cells if cell.cell_type == "code"][-1]
    assert "all checks passed" in stream_text(last)
    # Outputs land under the working directory (git-ignored `outputs/` in a checkout), not in the repository tree.
    assert (tmp_path / "outputs" / "notebooks" / path.stem).is_dir()
