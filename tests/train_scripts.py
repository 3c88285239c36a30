"""Imported by the tests of the scripts themselves (they run a script's CLI or its `main`, or test the
functions a researcher edits in train/main.py): puts train/ on sys.path, so `import main` finds
train/main.py. No other test imports from train/ (tests/test_import_cycles.py names the ones that may)."""

import sys
from pathlib import Path

TRAIN = str(Path(__file__).resolve().parent.parent / "train")
if TRAIN not in sys.path:
    sys.path.insert(0, TRAIN)
