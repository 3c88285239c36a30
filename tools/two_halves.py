"""The command line of a check in two halves: `write` runs in eqxdiff's venv (what eqxdiff computes, into
--out), `check` in tools/.venv (what torch's side computes from it), each half a function of the parsed
flags' values."""

import argparse
from collections.abc import Callable
from pathlib import Path


def run_halves(doc: str, write: Callable, check: Callable, out_help: str, *, run_dir_help: str = "") -> None:
    """Parse `half {write,check} --out DIR [--run_dir DIR]` and call write(...) or check(...) with
    ([run_dir,] out); --out is made first."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("half", choices=["write", "check"])
    if run_dir_help:
        parser.add_argument("--run_dir", type=Path, required=True, help=run_dir_help)
    parser.add_argument("--out", type=Path, required=True, help=out_help)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    (write if args.half == "write" else check)(*([args.run_dir] if run_dir_help else []), args.out)
