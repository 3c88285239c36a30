"""No two eqxdiff modules import each other, directly or round a loop (DESIGN.md: imports point down
only). Read from the source with `ast`, so an import inside a function (which Python resolves only
when it runs, and so never fails on a cycle) counts as much as one at the top."""

import ast
from pathlib import Path

import eqxdiff

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
