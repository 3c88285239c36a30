"""A checkpoint describes its network: the constructor arguments its MODELS entry gave (eqxdiff/run/models.py),
so sample.py rebuilds what was trained after the entry is edited, and a resumed run refuses the edit.
(Checkpoints from before: tests/run/test_legacy_checkpoint.py.)"""

import json

import pytest

from runs import TINY, train_here
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts


@pytest.mark.slow  # reason: a training step's compile and a sampler's (~20 s)
def test_sample_rebuilds_the_trained_network_after_its_entry_changed_and_resume_refuses_it(tmp_path, monkeypatch):
    from eqxdiff.run import models
    import sample  # train/sample.py

    run_dir = tmp_path / "run"
    train_here("--run_dir", run_dir, *TINY, "--steps", 1, "--warmup_steps", 0)
    stored = json.loads((run_dir / "checkpoints" / "1" / "config" / "metadata").read_text())
    assert stored["model_args"] == {
        "constructor": "UNet",
        "kwargs": {"in_channels": 1, "channels": [16], "num_res_blocks": 1, "norm_groups": 4, "num_classes": 10},
    }
    assert stored["condition"] == {"kind": "labels", "num_classes": 10} and stored["codec"] == {"kind": "pixels"}

    edited = lambda shape, **sizes: (
        "UNet",
        dict(
            in_channels=shape[-1],
            channels=(8,),
            num_res_blocks=1,  # noqa: E731
            norm_groups=4,
            **sizes,
        ),
    )
    monkeypatch.setitem(models.MODELS, "unet_tiny", edited)
    sample.main(
        sample.parse_args(["--run_dir", str(run_dir), "--out", str(tmp_path / "s.npz"), "--num", "8", "--steps", "1"])
    )
    assert (tmp_path / "s.npz").is_file()
    with pytest.raises(SystemExit, match=r"channels \[16\] -> \[8\]"):
        train_here("--run_dir", run_dir, *TINY, "--steps", 2)
