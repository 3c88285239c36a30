"""The jaxtyping + beartype hook of tests/conftest.py reaches every eqxdiff module: one imported
before the hook, or after a hook that was only on for a while, would never have its shapes checked.
The hook's mark is the loader it gives the modules it instruments."""

import importlib
import pkgutil
import sys

import pytest

import eqxdiff
from jaxtyping._import_hook import _JaxtypingLoader  # the hook's loader (jaxtyping has no public test for it)

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)


def test_every_eqxdiff_module_is_loaded_through_the_jaxtyping_hook():
    # The train/ scripts import eqxdiff modules of their own.
    for script in ("main", "sample", "sample_pretrained", "encode", "fid_stats", "launch_local"):
        importlib.import_module(script)
    for module in pkgutil.walk_packages(eqxdiff.__path__, "eqxdiff."):
        importlib.import_module(module.name)
    loaded = {name: module for name, module in sys.modules.items() if name == "eqxdiff" or name.startswith("eqxdiff.")}
    assert len(loaded) > 50, sorted(loaded)
    unchecked = sorted(
        name for name, module in loaded.items() if not isinstance(module.__spec__.loader, _JaxtypingLoader)
    )
    assert not unchecked, f"imported without the jaxtyping hook: {unchecked}"
