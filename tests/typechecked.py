"""Run a script the way the in-process tests run eqxdiff: under the jaxtyping + beartype import
hook, so every annotated shape is checked in subprocess runs too.

    python tests/typechecked.py train/main.py --steps 2 ...
"""

import importlib
import runpy
import sys
from pathlib import Path

from jaxtyping import install_import_hook

# Third-party modules eqxdiff imports at module level. jaxtyping's hook patches importlib's
# `cache_from_source` while an eqxdiff module executes, so a dependency first imported from inside
# one misses its .pyc and is compiled from source (every time, under PYTHONDONTWRITEBYTECODE):
# import them before eqxdiff (not scipy: only `eqxdiff.eval` needs it, and few runs import that).
DEPENDENCIES = (
    "beartype",
    "jax",
    "jax.numpy",
    "jax.experimental",
    "equinox",
    "optax",
    "orbax.checkpoint",
    "grain",
    "numpy",
    "PIL.Image",
    "safetensors.numpy",
    "tokenizers",
    "ml_dtypes",
)


def import_dependencies() -> None:
    for name in DEPENDENCIES:
        importlib.import_module(name)


if __name__ == "__main__":
    script = Path(sys.argv[1]).resolve()
    sys.argv = [str(script), *sys.argv[2:]]
    sys.path.insert(0, str(script.parent))  # as `python script.py` would
    sys.path.insert(1, str(Path(__file__).parent.parent))  # eqxdiff by the path finder the hook wraps (conftest.py)
    import_dependencies()
    # The hook's bytecode is cached under its own tag (`*.opt-jaxtyping*.pyc`); under PYTHONDONTWRITEBYTECODE each
    # run would rewrite and recompile all of eqxdiff from source (~2 s of every test's process start).
    sys.dont_write_bytecode = False
    with install_import_hook("eqxdiff", "beartype.beartype"):
        runpy.run_path(str(script), run_name="__main__")
