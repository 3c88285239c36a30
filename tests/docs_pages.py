"""The documentation the tests read: the front page (README.md) and the topic pages it links (docs/*.md)."""

from pathlib import Path

ROOT = Path(__file__).parent.parent


def page(name: str) -> str:
    """The text of README.md or of a topic page, `page("docs/edits.md")`."""
    return (ROOT / name).read_text()


def all_pages() -> dict[str, str]:
    """README.md and every docs/*.md page, by path: where a test scans every command the documentation gives."""
    names = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    return {name: page(name) for name in names}
