"""eqxdiff/run/rebuild.py: `load_run` rebuilds a trained run from its directory alone, the EMA weights as saved and
the codec, condition, schedule and parameterization the run trained with. (A checkpoint from before model
arguments were stored: tests/run/test_legacy_checkpoint.py.)"""

import json
import re

import numpy as np
import pytest

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode as train_encode  # train/encode.py
from eqxdiff.checkpoint import CheckpointError
from eqxdiff.nn import UNet
from eqxdiff.run.codecs import Latents, Pixels
from eqxdiff.run.conditions import Labels, ScratchText
from eqxdiff.data import CaptionedDigitsSource
from eqxdiff.diffusion import EDMPreconditioning, VPSchedule
from eqxdiff.sharding import make_mesh
from eqxdiff.run.models import CONSTRUCTORS
from eqxdiff.run.rebuild import load_run
from runs import LATENT_RUN, TINY, saved_arrays, train_here
from tests.scripts.test_train_main import leaf_paths


def stored_config(run_dir, step: int) -> dict:
    return json.loads((run_dir / "checkpoints" / str(step) / "config" / "metadata").read_text())


def assert_ema_as_saved(run, run_dir) -> None:
    """Every leaf of the rebuilt EMA model is the checkpoint's EMA leaf of that path, and every saved EMA
    leaf has its place in it."""
    saved = leaf_paths(saved_arrays(run_dir, run.step, parts=("ema", "model")))  # what is compared below, read once
    on_disk = {path[1:]: a for path, a in saved.items() if path[0] == "ema"}
    rebuilt = leaf_paths(run.ema)
    assert rebuilt.keys() == on_disk.keys()
    for path, leaf in rebuilt.items():
        np.testing.assert_array_equal(leaf, on_disk[path], err_msg=str(path))
    model = {path[1:]: a for path, a in saved.items() if path[0] == "model"}
    assert any(not np.array_equal(leaf, model[path]) for path, leaf in rebuilt.items())  # the EMA, not the model


@pytest.mark.slow  # a latent run trained end to end
def test_a_latent_class_run_comes_back_with_its_codec_condition_and_schedule(tmp_path):
    latents = tmp_path / "latents"
    train_encode.main(
        train_encode.parse_config(["--dataset", "digits", "--vae", "space_to_depth:2", "--out", str(latents)])
    )
    run_dir = tmp_path / "run"
    train_here(
        "--run_dir", run_dir, *LATENT_RUN, "--dataset", f"latents:{latents}", "--ckpt_every", 1, "--keep_checkpoints", 2
    )
    stored = stored_config(run_dir, 1)

    traced = []  # the constructor's calls: a trace of the network's structure each (nothing is drawn)
    counted = {**CONSTRUCTORS, "UNet": lambda **kwargs: traced.append(kwargs) or UNet(**kwargs)}
    run = load_run(run_dir, 1, mesh=make_mesh(data=-1, fsdp=1), constructors=counted)  # not the newest
    assert run.step == 1 and run.stored == stored and run.cfg.model == "unet_tiny" and run.cfg.steps == 2
    assert_ema_as_saved(run, run_dir)
    assert isinstance(run.codec, Latents) and run.codec.to_config() == stored["codec"] == {
        "kind": "latents",
        "autoencoder": "space_to_depth:2",
    }
    assert isinstance(run.condition, Labels) and run.condition.to_config() == stored["condition"] == {
        "kind": "labels",
        "num_classes": 10,
    }
    assert run.schedule == VPSchedule.cosine() and run.parameterization == EDMPreconditioning(0.7)  # as trained
    assert run.image_shape == (4, 4, 4) and run.image_dataset == "digits" and run.class_names is None
    newest = load_run(run_dir, mesh=make_mesh(data=-1, fsdp=1), constructors=counted)
    assert newest.step == 2  # step -1: the newest
    assert len(traced) == 1  # its structure traced once: the second load (sample.py's again and again) reuses it

    # A network that no longer fits the EMA it saved (its constructor widened since): one line naming an EMA leaf,
    # as train/sample.py prints it; only the EMA's leaves are compared (the EMA alone is read). Another constructor
    # of the same name and arguments: its own structure, not the one remembered above.
    wider = {**CONSTRUCTORS, "UNet": lambda **kwargs: UNet(**kwargs | {"channels": (32,)})}
    with pytest.raises(CheckpointError) as refused:
        load_run(run_dir, mesh=make_mesh(data=-1, fsdp=1), constructors=wider)
    message = str(refused.value)
    assert "\n" not in message and "opt_state" not in message and "model." not in message
    assert re.search(r"step 2 .* cannot be restored into this run's ema, which differs in: ema\.\S+: saved", message)


@pytest.mark.slow
def test_a_text_run_comes_back_with_its_tower_inside_the_ema(tmp_path, capsys):
    """captioned_digits' scratch tower: causal, no pooled vector, the word tokenizer named by its dataset.
    sample.py on it asks the dataset for its scoring prompts (no --prompts) and a prompt's digits (--eval)."""
    run_dir = tmp_path / "run"
    train_here("--run_dir", run_dir, *TINY, "--dataset", "captioned_digits", "--steps", 1)
    run = load_run(run_dir, mesh=make_mesh(data=-1, fsdp=1))
    stored = stored_config(run_dir, 1)
    assert_ema_as_saved(run, run_dir)
    assert isinstance(run.codec, Pixels) and stored["codec"] == {"kind": "pixels"}
    assert isinstance(run.condition, ScratchText) and run.condition.to_config() == stored["condition"]
    assert stored["condition"]["causal"] and not stored["condition"]["pooled"]
    assert stored["condition"]["tokenizer"] == "captioned_digits"
    assert run.parameterization == EDMPreconditioning(0.5) and run.image_shape == (8, 16, 1)
    assert run.image_dataset == "captioned_digits"

    import sample  # train/sample.py

    # one Euler step: one network call in the sampler's program (Heun's holds its corrector's too)
    flags = ["--run_dir", str(run_dir), "--steps", "1", "--method", "euler", "--per_prompt", "2", "--eval", "--json"]
    capsys.readouterr()
    sample.main(sample.parse_args([*flags, "--num", "6", "--seed", "3", "--out", str(tmp_path / "s.npz")]))
    scores = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert scores["num"] == 6 and scores["guidance"] == run.cfg.guidance and 0 <= scores["both"] <= 1
    prompts, _ = CaptionedDigitsSource.scoring_prompts(3, seed=3)  # the dataset's own: 6 // 2 prompts, --seed's
    with np.load(tmp_path / "s.npz") as saved:
        assert list(saved["prompts"]) == [p for p in prompts for _ in range(2)]
    with pytest.raises(SystemExit, match="--eval: 'a cat' is not a captioned_digits caption"):  # asked, refused
        sample.main(
            sample.parse_args([*flags, "--prompts", "a 3 left of a 7", "a cat", "--out", str(tmp_path / "t.npz")])
        )
