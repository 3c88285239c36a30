"""The notebooks run top to bottom (at smoke size: the test sets SMOKE = True)."""

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "SMOKE = False" in cell.source:
            cell.source = cell.source.replace("SMOKE = False", "SMOKE = True")
            break
    else:
        raise AssertionError(f"{path.name} has no `SMOKE = False` switch for the test run.")
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
