"""benchmarks/readme_examples.py times the README's train/main.py commands: each example's flags are
those of a command the README gives (BENCHMARKS.md's figures and the README's own stay about the
same commands)."""

from pathlib import Path

from runs import script_module

ROOT = Path(__file__).parent.parent


def readme_main_commands() -> list[str]:
    """Every `python train/main.py ...` command of the README's code blocks (from there to the line's
    comment; `pip install ... && python train/main.py` gives the default job)."""
    lines = (ROOT / "README.md").read_text().splitlines()
    commands = [line[line.find("python train/main.py") :] for line in lines if "python train/main.py" in line]
    return [c.split("#")[0].strip() for c in commands if not c.startswith("python train/main.py`")]


def test_every_timed_example_is_a_readme_command():
    examples = script_module("benchmarks/readme_examples.py")
    commands = readme_main_commands()
    assert "python train/main.py" in commands  # the default job, as written
    for name, flags in examples.EXAMPLES.items():
        dataset = ["--dataset folder:"] if "folder" in name else []  # the benchmark's folder stands in for ~/data/pets
        matching = [c for c in commands if " ".join(flags) in c and all(d in c for d in dataset)]
        assert matching, f"{name}: no README command has {' '.join(flags)}"


def test_readme_sampling_commands_write_into_a_folder_not_the_repository_root():
    """Every `python train/sample.py` command of the README (continued lines joined) writes its images or batch
    under a folder (--out DIR/FILE): run from a clone, none leaves files in the repository's root (--fid writes
    none: its line goes to RUN_DIR/fid.jsonl)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    commands = [line[line.find("python train/sample.py") :].split("#")[0].split() for line in text.splitlines()
                if "python train/sample.py " in line and "`" not in line]  # fmt: skip
    assert len(commands) >= 15
    for words in commands:
        out = words[words.index("--out") + 1] if "--out" in words else None
        assert "--fid" in words or (out and "/" in out), " ".join(words)
