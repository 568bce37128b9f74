"""Every notebook in experiments/notebooks/ executes top to bottom on CPU (nbclient, a fresh ipykernel each), and is
committed with its outputs stripped. A cell that raises fails the test with the cell's traceback.
About 1.5-3 minutes for the three notebooks on 2 cores (02 and 03 compile a few small programs)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "experiments" / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
EXPECTED = {"01_quickstart_formats.ipynb", "02_checkpoint_fp8.ipynb", "03_training_workdir.ipynb"}


def test_the_notebooks_are_there():
    assert EXPECTED <= {p.name for p in NOTEBOOKS}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stripped(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name} cell {i} has outputs: strip them"
    assert path.stat().st_size < 60_000


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.delenv("JAXRL_WORKDIR", raising=False)  # notebook 03 then trains its own tiny run
    monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    nb = nbformat.read(path, as_version=4)
    # run in a temp cwd so nothing a notebook writes lands in the repository
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError naming the failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors, errors
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 2, f"{path.name}: expected its plots in the outputs, found {images}"
    assert not any(tmp_path.iterdir()), f"{path.name} left files in its working directory: {list(tmp_path.iterdir())}"
