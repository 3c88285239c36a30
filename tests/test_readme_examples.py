"""benchmarks/readme_examples.py times the documentation's train/main.py commands (README.md and its
topic pages, docs/*.md): each example's flags are those of a command the pages give (BENCHMARKS.md's
figures and the pages' own stay about the same commands)."""

from docs_pages import all_pages, page
from runs import script_module


def main_commands(text: str) -> list[str]:
    """Every `python train/main.py ...` command of a page's code blocks (from there to the line's
    comment; `pip install ... && python train/main.py` gives the default job)."""
    lines = text.splitlines()
    commands = [line[line.find("python train/main.py") :] for line in lines if "python train/main.py" in line]
    return [c.split("#")[0].strip() for c in commands if not c.startswith("python train/main.py`")]


def test_every_timed_example_is_a_readme_command():
    examples = script_module("benchmarks/readme_examples.py")
    commands = [c for text in all_pages().values() for c in main_commands(text)]
    assert "python train/main.py" in main_commands(page("README.md"))  # the default job, as written, on the front page
    for name, flags in examples.EXAMPLES.items():
        dataset = ["--dataset folder:"] if "folder" in name else []  # the benchmark's folder stands in for ~/data/pets
        matching = [c for c in commands if " ".join(flags) in c and all(d in c for d in dataset)]
        assert matching, f"{name}: no command of README.md or docs/ has {' '.join(flags)}"


def test_readme_sampling_commands_write_into_a_folder_not_the_repository_root():
    """Every `python train/sample.py` and `python train/sample_pretrained.py` command of README.md and docs/
    (continued lines joined) writes its images or batch under a folder (--out DIR/FILE): run from a clone, none
    leaves files in the repository's root (--fid writes none: its line goes to RUN_DIR/fid.jsonl)."""
    text = "\n".join(all_pages().values()).replace("\\\n", " ")
    commands = [
        line[line.find("python train/sample") :].split("#")[0].split()
        for line in text.splitlines()
        if ("python train/sample.py " in line or "python train/sample_pretrained.py " in line) and "`" not in line
    ]
    assert len(commands) >= 15
    for words in commands:
        out = words[words.index("--out") + 1] if "--out" in words else None
        assert "--fid" in words or (out and "/" in out), " ".join(words)
