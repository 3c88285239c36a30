"""The tests' own layout (tests/README.md): a folder per part of the package, each a package (so two folders may
hold files of the same name without pytest mixing them up), the house's tests alone at tests/, and the README's
loop for each folder. No JAX: these read the tree."""

import re

import pytest

from docs_pages import ROOT, page

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

TESTS = ROOT / "tests"
# What stays at tests/: the tests of the repository itself rather than of one part of the package.
HOUSE = {
    "test_accelerator.py",
    "test_bench_harness.py",
    "test_docs.py",
    "test_hlo_ops.py",
    "test_import_cycles.py",
    "test_notebooks.py",
    "test_readme_examples.py",
    "test_test_folders.py",
    "test_typecheck_hook.py",
}


def folders() -> list[str]:
    """tests/'s folders of tests (tests/data holds the fixtures)."""
    return sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name != "data" and any(p.rglob("test_*.py")))


def test_every_folder_of_tests_is_a_package():
    assert {"core", "nn", "scripts"} <= set(folders())
    missing = sorted(
        {
            f"tests/{p.relative_to(TESTS).parent}"
            for p in TESTS.rglob("test_*.py")
            if not (p.parent / "__init__.py").exists()
        }
    )
    assert not missing, (
        f"folders of tests without an __init__.py (pytest would import their files by bare name): {missing}"
    )


def test_only_the_house_tests_sit_at_the_top():
    stray = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in HOUSE)
    assert not stray, f"tests at tests/ rather than in their part's folder (the rule: tests/README.md): {stray}"


def test_the_readme_names_each_folder_s_loop():
    loops = set(re.findall(r"^pytest tests/(\w+)\b", page("README.md"), re.MULTILINE))
    assert loops == set(folders()), f"README.md's loops {sorted(loops)} against the folders {folders()}"
    rule = page("tests/README.md")
    unnamed = [name for name in folders() if f"`tests/{name}/`" not in rule]
    assert not unnamed, f"tests/README.md does not say what goes to {unnamed}"
