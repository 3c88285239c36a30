"""Run a script the way the in-process tests run eqxdiff: under the jaxtyping + beartype import
hook, so every annotated shape is checked in subprocess runs too.

    python tests/typechecked.py train/main.py --steps 2 ...
"""

import runpy
import sys
from pathlib import Path

from jaxtyping import install_import_hook

if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))  # as `python script.py` would
    with install_import_hook("eqxdiff", "beartype.beartype"):
        runpy.run_path(str(script), run_name="__main__")
