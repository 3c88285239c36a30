"""A checkpoint written before checkpoints stored their model's constructor arguments still samples.

tests/data/legacy_digits_unet_tiny.tar.xz is the run directory of, at commit a734ac8 (the last whose
checkpoints named their model only by its train/models.py key; the table is eqxdiff/run/models.py now), in an
empty folder:

    python train/main.py --run_dir legacy_digits_unet_tiny --model unet_tiny --batch_size 16 --steps 2 \
        --warmup_steps 1 --sample_every 0 --wandb disabled --log_every 1

(orbax's commit_success.txt files emptied of the absolute path they name), and
legacy_digits_unet_tiny_samples.npz what that commit's

    python train/sample.py --run_dir legacy_digits_unet_tiny --out before.npz --num 20 --steps 2

wrote from it (one CPU device).
"""

import json
import tarfile
from pathlib import Path

import numpy as np

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

DATA = Path(__file__).parents[1] / "data"


def test_sample_restores_a_checkpoint_written_before_model_args(tmp_path):
    """sample.py rebuilds the old run from its MODELS key and draws what the old sample.py drew."""
    import sample  # train/sample.py

    with tarfile.open(DATA / "legacy_digits_unet_tiny.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    run_dir = tmp_path / "legacy_digits_unet_tiny"
    sample.main(
        sample.parse_args(["--run_dir", str(run_dir), "--out", str(tmp_path / "s.npz"), "--num", "20", "--steps", "2"])
    )
    with np.load(tmp_path / "s.npz") as now, np.load(DATA / "legacy_digits_unet_tiny_samples.npz") as before:
        np.testing.assert_array_equal(now["labels"], before["labels"])
        # Here 8 simulated devices, there one: 20 rows do not split over 8, so the same program on each.
        np.testing.assert_array_equal(now["images"], before["images"])


def test_every_flag_an_old_checkpoint_lacks_reads_as_its_absence_meant(tmp_path):
    """eqxdiff/run/rebuild.py rebuilds a run without train/main.py's Config: a flag added since the old checkpoint
    (which stored every flag of its day) reads as LATER_FLAGS names it, which is Config's default; a renamed one
    (RENAMED_FLAGS: --cfg_scale, now --guidance) by its new name."""
    import dataclasses

    import main  # train/main.py
    from eqxdiff.run.rebuild import LATER_FLAGS, stored_flags
    from eqxdiff.run.run_dir import RENAMED_FLAGS, current_names

    with tarfile.open(DATA / "legacy_digits_unet_tiny.tar.xz") as archive:
        archive.extractall(tmp_path, filter="data")
    saved = json.loads((tmp_path / "legacy_digits_unet_tiny" / "checkpoints" / "2" / "config" / "metadata").read_text())
    assert "cfg_scale" in saved and saved["cfg_scale"] == 1.5  # stored under the name of its day
    stored = current_names(saved)
    assert stored["guidance"] == 1.5 and not RENAMED_FLAGS.keys() & stored.keys()
    defaults = main.Config()
    lacking = {f.name for f in dataclasses.fields(main.Config)} - stored.keys()
    assert lacking and lacking <= LATER_FLAGS.keys(), sorted(lacking - LATER_FLAGS.keys())
    assert {name: getattr(defaults, name) for name in LATER_FLAGS} == LATER_FLAGS
    flags = stored_flags(saved)
    fields = dataclasses.fields(main.Config)
    assert all(getattr(flags, f.name) == stored.get(f.name, getattr(defaults, f.name)) for f in fields)
