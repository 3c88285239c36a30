"""A checkpoint describes its network: the constructor arguments its MODELS entry gave (eqxdiff/run/models.py),
so sample.py rebuilds what was trained after the entry is edited, and a resumed run refuses the edit.
(Checkpoints from before: tests/run/test_legacy_checkpoint.py.)"""

import json
import shutil

import pytest

from runs import REFERENCE_STEPS, TINY, train_here
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts


@pytest.mark.slow  # reason: a sampler's compile, and the session's 8-device run (conftest) where it is made first
def test_sample_rebuilds_the_trained_network_after_its_entry_changed_and_resume_refuses_it(
    tmp_path, monkeypatch, eight_device_run
):
    """On a copy of conftest's `eight_device_run` (unet_tiny on digits, TINY's flags: what a run of its own here
    trained, a step program fewer); its newest checkpoint alone, which both the rebuild and the resume read."""
    from eqxdiff.run import models
    import sample  # train/sample.py

    run_dir = tmp_path / "run"
    shutil.copytree(
        eight_device_run / "checkpoints" / str(REFERENCE_STEPS), run_dir / "checkpoints" / str(REFERENCE_STEPS)
    )
    stored = json.loads((run_dir / "checkpoints" / str(REFERENCE_STEPS) / "config" / "metadata").read_text())
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
    with pytest.raises(SystemExit, match=r"channels \[16\] -> \[8\]"):  # a resume: --steps past the run's
        train_here("--run_dir", run_dir, *TINY, "--steps", REFERENCE_STEPS + 1)
