"""The front page and its topic pages hold together: every link between them (and into the tree) lands on a
file and, with #anchor, on a heading of it; the README's Layout names every module and script that exists and
nothing that does not. No JAX: these read text."""

import re

import pytest

from docs_pages import ROOT, all_pages, page

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation but `-` and `_` dropped, spaces as `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    fenced, found = False, set()
    for line in text.splitlines():
        fenced ^= line.lstrip().startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            found.add(anchor(line.lstrip("#")))
    return found


def test_every_link_lands_on_a_file_and_a_heading():
    pages = all_pages()
    assert len(pages) > 10 and "docs/edits.md" in pages  # the split happened: a front page and its topics
    for name, text in pages.items():
        for target in LINK.findall(text):
            if target.startswith(("http://", "https://")):
                continue
            path, _, fragment = target.partition("#")
            file = (ROOT / name).parent / path if path else ROOT / name
            assert file.resolve().exists(), f"{name}: {target} does not exist"
            if fragment:
                assert fragment in anchors(file.read_text()), f"{name}: {target}: no such heading"


def test_the_front_page_links_every_topic_page():
    readme = page("README.md")
    for name in all_pages():
        if name != "README.md":
            assert f"]({name})" in readme, f"README.md links no {name}"


def layout_entries() -> dict[str, str]:
    """The Layout block of README.md, entry by entry: its first word (a path) -> the entry's text."""
    readme = page("README.md")
    block = readme[readme.index("## Layout") :]
    block = block[block.index("```\n") + 4 :]
    entries, key = {}, None
    for line in block[: block.index("```")].splitlines():
        if line and not line[0].isspace():
            key = line.split()[0]
            entries[key] = line
        else:
            entries[key] += " " + line.strip()
    return entries


def test_the_layout_names_every_module_and_script():
    entries = layout_entries()
    text = " ".join(entries.values())
    for package in sorted((ROOT / "eqxdiff").glob("*/__init__.py")):
        key = f"eqxdiff/{package.parent.name}/"
        assert key in entries, f"the Layout has no entry {key}"
        for module in sorted(package.parent.glob("*.py")):
            if module.stem != "__init__":
                assert re.search(rf"\b{module.stem}\b", entries[key]), f"the Layout's {key} does not name {module.stem}"
    for module in sorted((ROOT / "eqxdiff").glob("*.py")):
        if module.stem != "__init__":
            assert f"eqxdiff/{module.name}" in entries, f"the Layout has no entry eqxdiff/{module.name}"
    for script in sorted((ROOT / "train").glob("*.py")):
        assert f"train/{script.name}" in text, f"the Layout does not name train/{script.name}"
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if any(folder.glob("*.py")) or any(folder.glob("*.md")) or any(folder.glob("*.ipynb")):
            assert f"{folder.name}/" in text, f"the Layout does not name {folder.name}/"


def test_the_layout_names_only_what_exists():
    text = " ".join(layout_entries().values())
    for path in re.findall(r"\b(?:eqxdiff|train|tests|tools|docs|notebooks|benchmarks)/[\w/]*(?:\.py)?", text):
        assert (ROOT / path).exists(), f"the Layout names {path}, which does not exist"
