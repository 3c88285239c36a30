"""Test setup: 8 simulated CPU devices and runtime shape checking of all of eqxdiff.

Both must happen before JAX initialises its backend and before eqxdiff is imported,
which is why they live at the top of conftest.py.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

# tests/ and its folders are packages (tests/README.md: a test's folder mirrors the package, and two folders may
# hold files of the same name), so pytest puts the checkout's root on sys.path, not tests/. The shared helpers
# (runs.py, weight_folders.py, ...) keep their bare names through tests/ at the end of the path, where its
# folders (core, nn, run, ...) cannot hide an installed package of the same name.
sys.path.append(str(Path(__file__).parent))

from accelerators import accelerator_platform  # noqa: E402 — tests/, on sys.path above

# On a machine with an accelerator the unit tests still run on the CPU's 8 simulated devices: the CPU is
# the default backend, the accelerator started beside it for the `accelerator` tier (tests/test_accelerator.py).
# Subprocesses (scripts, notebooks) run on the CPU: one process at a time can hold a TPU. A JAX_PLATFORMS set
# by the user wins.
ACCELERATOR = accelerator_platform()
if ACCELERATOR and not os.environ.get("JAX_PLATFORMS"):
    jax.config.update("jax_platforms", f"cpu,{ACCELERATOR}")
    os.environ["JAX_PLATFORMS"] = "cpu"

# The edit loop reruns the suite: programs the edit did not touch load from a persistent XLA cache
# instead of compiling again (the quick tier is mostly compiles; BENCHMARKS.md "Test suite" has
# both timings). Keyed by the program, its flags and jax's version, so a stale entry is never hit;
# `--cache-clear` empties it, EQXDIFF_TEST_XLA_CACHE=off switches it off (e.g. to time a cold run).
XLA_CACHE = os.environ.get("EQXDIFF_TEST_XLA_CACHE", str(Path(__file__).parent.parent / ".pytest_cache" / "xla"))
if XLA_CACHE != "off":
    jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

# The tests' programs compile for longer than they run: LLVM does not optimise the code XLA
# generates (jax_disable_most_optimizations: the same HLO passes, fusions and buffers; XLA:CPU
# allows no fast-math at any level). Subprocesses inherit it; JAX_DISABLE_MOST_OPTIMIZATIONS=0
# runs the scripts' full pipeline.
if "JAX_DISABLE_MOST_OPTIMIZATIONS" not in os.environ:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    jax.config.update("jax_disable_most_optimizations", True)

# The checkout's root first on the path, as `python -m pytest` has it: a plain `pytest` (CI's) would
# find the package through the editable install's own finder, which the hook below does not wrap,
# and eqxdiff/__init__.py would go unchecked (tests/test_typecheck_hook.py).
sys.path.insert(0, str(Path(__file__).parent.parent))

from jaxtyping import install_import_hook  # noqa: E402
from typechecked import import_dependencies  # noqa: E402 — tests/, on sys.path above

# Every jaxtyping annotation in eqxdiff is checked by beartype in every test. Its dependencies are
# imported first, from their .pyc (tests/typechecked.py says why). The hook stays installed for the
# whole session: an eqxdiff module first imported later (by `import main` at collection, or in a
# test) is checked too (tests/test_typecheck_hook.py).
import_dependencies()
install_import_hook("eqxdiff", "beartype.beartype")
import eqxdiff  # noqa: E402, F401
import eqxdiff.diffusion  # noqa: E402, F401
import eqxdiff.nn  # noqa: E402, F401
import eqxdiff.checkpoint  # noqa: E402, F401
import eqxdiff.data  # noqa: E402, F401
import eqxdiff.eval  # noqa: E402, F401
import eqxdiff.generate  # noqa: E402, F401
import eqxdiff.images  # noqa: E402, F401
import eqxdiff.sharding  # noqa: E402, F401
import eqxdiff.text  # noqa: E402, F401
import eqxdiff.text.conditioning  # noqa: E402, F401
import eqxdiff.training  # noqa: E402, F401
import eqxdiff.xla_cpu  # noqa: E402

# As train/main.py and the benchmarks run: XLA:CPU workarounds on (tests/nn/test_xla_cpu.py checks
# the library without them, under `xla_cpu.disabled()`).
eqxdiff.xla_cpu.enable()

import gc  # noqa: E402

# Tracing makes millions of short-lived Python objects, few of them in cycles: at Python's default of 700 allocations
# a young collection the cyclic collector runs thousands of times a module for little (BENCHMARKS.md "Test suite").
gc.set_threshold(20_000, 10, 10)

import pytest  # noqa: E402
from bucket import bucket, gcs_server  # noqa: E402, F401 -- tests/bucket.py: a local GCS server for gs:// tests


@pytest.fixture(scope="session", autouse=True)
def compile_cache(tmp_path_factory):
    """One persistent XLA cache for every subprocess of the session (`train/*.py` runs, launcher
    children, notebook kernels), through the environment they inherit: a program compiled by one
    of them loads in the next. This process read its JAX config at import and keeps jax's
    in-memory caches only."""
    path = tmp_path_factory.mktemp("xla_cache")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = str(path)
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    return path


@pytest.fixture(scope="session", autouse=True)
def host_matmul_peak():
    """The host's fp32 matmul peak measured once here and handed to every subprocess of the session (their MFU's
    denominator, eqxdiff/training/metrics.py): each script would otherwise spend its start measuring it again
    (the cost: BENCHMARKS.md "Test suite")."""
    from eqxdiff.training.metrics import CPU_MATMUL_FLOPS_ENV, measured_cpu_matmul_flops

    os.environ.setdefault(CPU_MATMUL_FLOPS_ENV, repr(measured_cpu_matmul_flops(repeats=2)))


@pytest.fixture(scope="session")
def eight_device_run(tmp_path_factory, compile_cache):
    """The reference job (tests/runs.py) uninterrupted, one process × 8 devices: resumed runs
    must end bitwise equal to it, 2-process runs train like it."""
    from runs import REFERENCE, committed, run

    run_dir = tmp_path_factory.mktemp("eight_devices")
    run("main.py", "--run_dir", run_dir, *REFERENCE, "--cpu_devices", 8)
    assert committed(run_dir) == [12, 18, 24]  # --keep_checkpoints 3
    return run_dir


@pytest.fixture(scope="module", autouse=True)
def clear_jax_caches():
    """After each test module, jax's caches (traces, lowerings, compiled programs) are dropped: kept
    for the whole session they grow with every program of every module, and a later module's
    in-process runs take longer than they do alone (BENCHMARKS.md, "Test suite")."""
    yield
    jax.clear_caches()
    gc.collect()


@pytest.fixture
def optimised_compile():
    """LLVM's optimisations back on while a test compiles programs that run long loops (they run
    slower unoptimised than they compile optimised); jax reads the switch at each compile."""
    from jax._src.compiler import _DISABLE_MOST_OPTIMIZATIONS

    before = _DISABLE_MOST_OPTIMIZATIONS.value
    jax.config.update("jax_disable_most_optimizations", False)
    yield
    jax.config.update("jax_disable_most_optimizations", before)
