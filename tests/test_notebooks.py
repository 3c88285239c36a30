"""The notebooks run top to bottom (at smoke size: the test sets SMOKE = True), with eqxdiff's
shapes checked by the jaxtyping import hook as in every other test."""

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

# A rank-2 numpy argument where `per_example` annotates a 1-D jax array fails only when checked.
HOOK_WAS_ACTIVE = """
import jaxtyping, numpy as np
from eqxdiff.diffusion.denoiser import per_example
try:
    per_example(np.zeros((2, 3)), np.zeros((2, 3)))
except jaxtyping.TypeCheckError:
    pass
else:
    raise AssertionError("eqxdiff ran without the jaxtyping import hook")
"""
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
    hook = (  # dependencies first, from their .pyc (tests/typechecked.py says why)
        f"import sys\nsys.path.insert(0, {str(Path(__file__).parent)!r})\nfrom typechecked import import_dependencies\n"
        "import_dependencies()\nfrom jaxtyping import install_import_hook\n"
        '_hook = install_import_hook("eqxdiff", "beartype.beartype")'
    )
    nb.cells.insert(0, nbformat.v4.new_code_cell(hook))  # before the notebook imports eqxdiff
    nb.cells.append(nbformat.v4.new_code_cell(HOOK_WAS_ACTIVE))
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()


def test_the_readme_tutorial_opens_and_runs_with_the_dev_extra():
    """The README names notebooks/quickstart.ipynb as the tutorial and the two commands that run and open
    it; both come with `pip install -e ".[dev]"` (the suite's own environment)."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert "The tutorial is `notebooks/quickstart.ipynb`" in readme
    assert "`jupyter execute notebooks/quickstart.ipynb`" in readme and "`jupyter lab notebooks/`" in readme
    scripts = Path(sys.executable).parent  # the entry points `jupyter execute` and `jupyter lab` dispatch to
    assert (scripts / "jupyter-execute").is_file() and (scripts / "jupyter-lab").is_file()
    assert importlib.util.find_spec("jupyterlab") and importlib.util.find_spec("nbclient")
