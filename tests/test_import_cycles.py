"""No two eqxdiff modules import each other, directly or round a loop (DESIGN.md: imports point down
only). Read from the source with `ast`, so an import inside a function (which Python resolves only
when it runs, and so never fails on a cycle) counts as much as one at the top. Packages do not import each
other either, and only the tests of the scripts import from train/ (the library is eqxdiff/)."""

import ast
import json
from pathlib import Path

import pytest

import eqxdiff

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

PACKAGE = Path(eqxdiff.__file__).parent


def module_names() -> dict[str, Path]:
    """Every eqxdiff module by dotted name (a package by its own name, for its __init__.py)."""
    names = {}
    for path in PACKAGE.rglob("*.py"):
        parts = ("eqxdiff", *path.relative_to(PACKAGE).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(path: Path, modules: dict[str, Path]) -> set[str]:
    """The eqxdiff modules a file's import statements name: `from a.b import c` is a.b.c when that is
    a module, else a.b. (Importing a.b.c also runs a.b's __init__; that is Python's doing, not an
    edge of this file.)"""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            named = {f"{node.module}.{alias.name}" for alias in node.names}
            out |= {name if name in modules else node.module for name in named}
    return {name for name in out if name in modules}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module, and modules that import themselves
    (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or v in graph[v]:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycles_finds_a_loop_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}, "f": set()}
    assert sorted(cycles(graph)) == [["a", "b", "c"], ["e"]]


def test_no_eqxdiff_module_imports_its_way_back_to_itself():
    modules = module_names()
    assert len(modules) > 50 and "eqxdiff.data.sources" in modules
    graph = {name: imported(path, modules) for name, path in modules.items()}
    assert "eqxdiff.data.captions" in graph["eqxdiff.data.sources"]  # the reader sees `from x import y`
    assert not cycles(graph), "eqxdiff modules that import each other (round a loop): " + "; ".join(
        " -> ".join(c) for c in cycles(graph)
    )


# DESIGN.md: "Nothing in diffusion/ or nn/ imports training, data or sharding code."
LOW_LAYERS = ("eqxdiff.nn", "eqxdiff.diffusion")
ABOVE_THEM = ("eqxdiff.data", "eqxdiff.training", "eqxdiff.sharding")


def under(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def test_nn_and_diffusion_import_no_data_training_or_sharding():
    modules = module_names()
    upward = sorted(
        f"{name} -> {target}"
        for name, path in modules.items()
        if under(name, LOW_LAYERS)
        for target in imported(path, modules)
        if under(target, ABOVE_THEM)
    )
    assert "eqxdiff.nn.torch_weights" in modules and "eqxdiff.sharding" in modules
    assert not upward, "imports that point up (pass what they need in from the caller instead): " + "; ".join(upward)


def package_of(name: str) -> str:
    """A module's package at the first level under eqxdiff: eqxdiff.text.conditioning -> eqxdiff.text; a
    module directly in eqxdiff/ is its own (eqxdiff.checkpoint), as DESIGN.md's layout draws them."""
    return ".".join(name.split(".")[:2])


def test_no_two_eqxdiff_packages_import_each_other():
    """Imports point down between packages too: eqxdiff.run -> eqxdiff.text, never back (a loop of two packages
    is a loop of modules spread over them: eqxdiff.conditions -> text.conditioning, text.sdxl_condition -> it)."""
    modules = module_names()
    graph = {package_of(name): set() for name in modules}
    for name, path in modules.items():
        graph[package_of(name)] |= {package_of(t) for t in imported(path, modules)} - {package_of(name)}
    assert {"eqxdiff.text", "eqxdiff.run", "eqxdiff.checkpoint"} <= graph.keys()
    assert "eqxdiff.text" in graph["eqxdiff.run"]  # the reader sees a package's imports
    assert cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert not cycles(graph), "eqxdiff packages that import each other: " + "; ".join(
        " <-> ".join(c) for c in cycles(graph)
    )


# train/ holds the scripts; only the tests of the scripts themselves reach into it: those that run a script's
# CLI or its `main` in-process, or test what a researcher edits in train/main.py (its prepare and loss_fn).
ROOT = PACKAGE.parent
SCRIPT_TESTS = {
    # helpers: put train/ on sys.path, run main in-process (`train_here`), run a script under the type checker
    "train_scripts.py",
    "runs.py",
    "sample_stand_in.py",
    # main.py's prepare and loss_fn, the functions a researcher edits
    "test_autoencoder_kl.py",
    "test_edm2.py",
    "test_loss.py",
    "test_meanflow.py",
    "test_model_contract.py",
    "test_repa_objective.py",
    "test_text_step.py",
    "test_train_step.py",
    # a script's CLI or main
    "test_bucket.py",
    "test_cli.py",
    "test_clip_score.py",
    "test_conditions.py",
    "test_evaluate_script.py",
    "test_fd_dinov2.py",
    "test_feature_stats.py",
    "test_fid.py",
    "test_finetune.py",
    "test_finetune_sdxl.py",
    "test_finetune_from_run.py",
    "test_frozen_rules.py",
    "test_latent_training.py",
    "test_latents.py",
    "test_legacy_checkpoint.py",
    "test_model_args.py",
    "test_multihost.py",
    "test_phema.py",
    "test_rebuild.py",
    "test_repa_training.py",
    "test_sample_batches.py",
    "test_sample_guidance.py",
    "test_sample_pretrained.py",
    "test_samplers.py",
    "test_script_errors.py",
    "test_sd_pipeline.py",
    "test_text_training.py",
    "test_torch_pickle.py",
    "test_train_main.py",
    "test_typecheck_hook.py",
    "test_vae_sizes.py",
    "test_vae_tiling.py",
    "test_xla_cpu_auto.py",
}
# Benchmarks of a script itself: main.py's own step (prepare, loss_fn, its loop) for the others, through
# unconditional_edm.py's `train_main`; train/encode.py's pipeline, timed in-process.
SCRIPT_BENCHMARKS = {"unconditional_edm.py", "bench_encode_pipeline.py"}


def code_of(path: Path) -> str:
    """A file's Python: a notebook's code cells, without their shell (!) and magic (%) lines."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    lines = "\n".join("".join(c["source"]) for c in cells).splitlines()
    return "\n".join(line for line in lines if not line.lstrip().startswith(("!", "%")))


def on_sys_path(node: ast.AST) -> bool:
    """Whether `node` adds to sys.path: sys.path.insert/append/extend(...), or sys.path[...] = ... ."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return ast.unparse(node.func) in ("sys.path.insert", "sys.path.append", "sys.path.extend")
    return isinstance(node, ast.Assign) and any(ast.unparse(t).startswith("sys.path") for t in node.targets)


def reaches_train(code: str) -> list[str]:
    """How `code` reaches into train/: a sys.path entry naming train, an import of tests/train_scripts.py (which
    makes one) or of a train/ module by its name (found only through such an entry), or `train_here` (runs.py:
    train/main.py's main in-process)."""
    scripts = {p.stem for p in (ROOT / "train").glob("*.py")} | {"train_scripts"}
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] in scripts]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module.split(".")[0] in scripts:
            found.append(f"from {node.module} import")  # its names (aliases) are walked below
        elif on_sys_path(node) and "train" in ast.unparse(node).lower():
            found.append(ast.unparse(node))
        elif (
            isinstance(node, ast.Name)
            and node.id == "train_here"
            or isinstance(node, ast.alias)
            and node.name == "train_here"
        ):
            found.append("train_here")
    return found


def test_reaches_train_sees_each_way_in():
    assert reaches_train("import main as m\nfrom startup import Launch") == ["import main", "from startup import"]
    assert reaches_train("import sys\nsys.path.insert(0, str(ROOT / 'train'))") == [
        "sys.path.insert(0, str(ROOT / 'train'))"
    ]
    assert reaches_train("import sys\nsys.path[:0] = ['../train']") == ["sys.path[:0] = ['../train']"]
    assert reaches_train("import train_scripts\nfrom runs import train_here") == ["import train_scripts", "train_here"]
    assert reaches_train("sys.path.append(TRAIN)") == ["sys.path.append(TRAIN)"]
    assert reaches_train("check(\"sys.path.insert(0, 'train')\")") == []  # a string that only names it
    assert reaches_train("from eqxdiff.run.rebuild import load_run\nimport harness\nsys.path.insert(0, ROOT)") == []


def checked_files() -> dict[str, Path]:
    """Every file that must not reach into train/ unless named, by its path in the checkout: eqxdiff's, the
    tests' (in every folder), the notebooks', the benchmarks'."""
    files = [
        *PACKAGE.rglob("*.py"),
        *(ROOT / "tests").rglob("*.py"),
        *(ROOT / "notebooks").rglob("*.ipynb"),
        *(ROOT / "benchmarks").rglob("*.py"),
    ]
    return {path.relative_to(ROOT).as_posix(): path for path in files}


def named_in_lists(name: str) -> bool:
    """A script test (SCRIPT_TESTS: by file name, in whichever folder of tests/) or a script benchmark."""
    top, *_, file = name.split("/")
    return top == "tests" and file in SCRIPT_TESTS or top == "benchmarks" and file in SCRIPT_BENCHMARKS


def test_only_the_tests_of_the_scripts_reach_into_train():
    """Nothing in eqxdiff, notebooks or benchmarks (but SCRIPT_BENCHMARKS), and no test but SCRIPT_TESTS, puts train/
    on sys.path or imports from it: what they need of a run is in the library (eqxdiff/run/)."""
    files = checked_files()
    assert "tests/core/test_loss.py" in files  # the tests' folders are read
    reach = {name: reaches_train(code_of(path)) for name, path in files.items()}
    outside = {name: how for name, how in reach.items() if how and not named_in_lists(name)}
    assert not outside, f"reach into train/ (move what they use into eqxdiff/, or name a script test): {outside}"
    reaching = {(name.split("/")[0], name.split("/")[-1]) for name, how in reach.items() if how}
    listed = {("tests", file) for file in SCRIPT_TESTS} | {("benchmarks", file) for file in SCRIPT_BENCHMARKS}
    assert not listed - reaching, (
        f"named as script tests but reaching no script (drop them from the list): {sorted(listed - reaching)}"
    )


# The scripts' tests reach train/ through tests/train_scripts.py, the one test file that puts it on sys.path;
# sample_stand_in.py is a script of its own (`launch_local.py --script`) in a process without the tests'; the two
# script benchmarks enter through unconditional_edm.py and their own line.
PATH_SETTERS = {
    "tests/train_scripts.py",
    "tests/sample_stand_in.py",
    "benchmarks/unconditional_edm.py",
    "benchmarks/bench_encode_pipeline.py",
}


def test_only_train_scripts_puts_train_on_sys_path():
    """Of the files checked above, only PATH_SETTERS add train/ to sys.path themselves: a script test imports
    train_scripts (or calls runs.train_here) rather than spelling out its own entry."""
    entries = {
        name
        for name, path in checked_files().items()
        if any(h.startswith("sys.path") for h in reaches_train(code_of(path)))
    }
    assert "tests/train_scripts.py" in entries  # the reader sees the one entry there is
    assert entries <= PATH_SETTERS, (
        f"put train/ on sys.path themselves (import train_scripts instead): {sorted(entries - PATH_SETTERS)}"
    )


# The weight-file formats are the bottom layer (bytes on disk <-> numpy): networks, ports and loaders read
# through them, so they read nothing of those. And nn/ holds networks any run uses: the Stable Diffusion
# family (sd/) and the published checkpoints (pretrained/) build on it, never the other way.
BELOW = {"eqxdiff.weights": ("eqxdiff",), "eqxdiff.nn": ("eqxdiff.sd", "eqxdiff.pretrained")}


def test_weights_import_no_eqxdiff_and_nn_no_sd_or_pretrained():
    modules = module_names()
    assert "eqxdiff.weights.torch_pickle" in modules and "eqxdiff.sd.unet" in modules
    upward = sorted(
        f"{name} -> {target}"
        for package, forbidden in BELOW.items()
        for name, path in modules.items()
        if under(name, (package,))
        for target in imported(path, modules)
        if under(target, forbidden) and not under(target, (package,))
    )
    assert not upward, "imports that point up: " + "; ".join(upward)
