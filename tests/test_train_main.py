"""`python train/main.py` runs end to end and writes a sample grid (tiny step count)."""

import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_main_trains_and_writes_a_sample_grid(tmp_path):
    cmd = [sys.executable, "train/main.py", "--run_dir", str(tmp_path), "--steps", "4", "--log_every", "2",
           "--sample_every", "4", "--sample_steps", "3"]  # fmt: skip
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    grid = tmp_path / "samples" / "step_000004.png"
    # 10×10 tiles of 8×8 pixels with 1-pixel gaps, upscaled 4×.
    with Image.open(grid) as image:
        assert image.size == ((10 * 9 + 1) * 4, (10 * 9 + 1) * 4)


def test_bad_flag_value_is_a_clear_error():
    result = subprocess.run(
        [sys.executable, "train/main.py", "--schedule", "cosine", "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0
    assert "invalid choice: 'cosine'" in result.stderr and "'vp_cosine'" in result.stderr
