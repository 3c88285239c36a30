"""Test setup: 8 simulated CPU devices and runtime shape checking of all of eqxdiff.

Both must happen before JAX initialises its backend and before eqxdiff is imported,
which is why they live at the top of conftest.py.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxtyping import install_import_hook  # noqa: E402

# Every jaxtyping annotation in eqxdiff is checked by beartype in every test.
with install_import_hook("eqxdiff", "beartype.beartype"):
    import eqxdiff  # noqa: F401
    import eqxdiff.diffusion  # noqa: F401
    import eqxdiff.nn  # noqa: F401
    import eqxdiff.checkpoint  # noqa: F401
    import eqxdiff.data  # noqa: F401
    import eqxdiff.eval  # noqa: F401
    import eqxdiff.generate  # noqa: F401
    import eqxdiff.images  # noqa: F401
    import eqxdiff.sharding  # noqa: F401
    import eqxdiff.training  # noqa: F401
    import eqxdiff.xla_cpu

# As train/main.py and the benchmarks run: XLA:CPU workarounds on (tests/test_xla_cpu.py checks
# the library without them, under `xla_cpu.disabled()`).
eqxdiff.xla_cpu.enable()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

# Tests use train/main.py's own prepare and loss_fn (`import main as train_main`).
sys.path.insert(0, str(Path(__file__).parent.parent / "train"))


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for every `train/main.py` subprocess of the session: runs with
    the same shapes and mesh load the step instead of compiling it again."""
    return tmp_path_factory.mktemp("xla_cache")
