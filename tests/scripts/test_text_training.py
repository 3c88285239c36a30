"""Text-to-image end to end: train/main.py on captions -> train/sample.py --prompts --eval, with a frozen
pretrained CLIP tower read from a transformers folder (a random one here: nothing downloads) in SD's layout.
A tower trained from scratch (captioned_digits' default) runs end to end in notebooks/text_to_image.ipynb."""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

import eqxdiff.generate
from eqxdiff.checkpoint import Checkpoints
from eqxdiff.data import load_tokenizer
from eqxdiff.sharding import make_mesh
from eqxdiff.run.open_condition import open_text
from runs import ROOT, assert_finite_training, metric_rows, random_clip_folder, train_here
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

TOKENIZER = ROOT / "tests" / "data" / "clip_tokenizer" / "sd1"  # 10,514 ids, CLIP's real first merges
SMOKE = ["--model", "unet_tiny", "--batch_size", 16, "--log_every", 1, "--sample_steps", 1, "--wandb", "disabled"]


def stored_config(run_dir: Path) -> dict:
    """The config the newest checkpoint stores (what sample.py rebuilds the run from)."""
    with Checkpoints(run_dir / "checkpoints") as checkpoints:
        return checkpoints.restore_config(checkpoints.latest())


@pytest.mark.slow
def test_a_frozen_clip_tower_trains_on_captions_and_samples_prompts(tmp_path, capsys, monkeypatch):
    """SD's layout: text_encoder/ with tokenizer/ beside it (found without --tokenizer); captioned_digits'
    captions through CLIP's BPE; the zeros null; a grid row per prompt; prompts scored by the digits
    classifier on each half. Also the scripts' run of the flow schedule and parameterization
    (tests/scripts/test_train_main.py's SMOKE says which test runs which): finite losses, no skipped step."""
    tokenizer = load_tokenizer(TOKENIZER)
    config = dict(
        vocab_size=tokenizer.tokenizer.get_vocab_size(),
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        eos_token_id=int(tokenizer([""])[0][0, 1]),
    )
    tower = random_clip_folder(tmp_path / "sd" / "text_encoder", config)
    shutil.copytree(TOKENIZER, tmp_path / "sd" / "tokenizer")

    run_dir = tmp_path / "run"
    # main.py in this process (runs.train_here): nothing checked needs a process of its own (the test alone, cold:
    # 25.7 s with main.py as a 1-device process, 17.3 s here).
    train_here(
        "--run_dir",
        run_dir,
        "--dataset",
        "captioned_digits",
        "--text_encoder",
        tower,
        "--null_text",
        "zeros",
        "--steps",
        2,
        "--sample_every",
        2,
        *SMOKE,
        "--schedule",
        "flow",
        "--parameterization",
        "flow",
    )
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    assert_finite_training(rows)
    with Image.open(run_dir / "samples" / "step_000002.png") as grid:
        assert grid.size == ((10 * 17 + 1) * 4, (10 * 9 + 1) * 4)  # 10 prompts × 10 samples of 8×16
    assert stored_config(run_dir)["condition"] == {
        "kind": "frozen_text",
        "text_encoder": str(tower.resolve()),
        "tokenizer": str((tmp_path / "sd" / "tokenizer").resolve()),
        "null_text": "zeros",
        "max_length": 16,
    }

    prompts = ["a 3 left of a 7", "nine then one"]
    import sample  # train/sample.py, in this process (its script runs: tests/scripts/test_multihost.py)

    nulls, scales = [], []  # the null condition sample.py guides against, and the guidance scale

    def generate(*args, null_cond=None, **kwargs):
        nulls.append(null_cond)
        scales.append(kwargs["guidance"])
        return real_generate(*args, null_cond=null_cond, **kwargs)

    real_generate = eqxdiff.generate.generate  # what sample.py's Sampling.images samples with (generate_images)
    monkeypatch.setattr(eqxdiff.generate, "generate", generate)
    sample.main(
        sample.parse_args(
            [
                "--run_dir",
                str(run_dir),
                "--prompts",
                *prompts,
                "--per_prompt",
                "3",
                "--steps",
                "1",
                "--guidance",
                "3",
                "--out",
                str(tmp_path / "s.npz"),
                "--eval",
            ]
        )
    )
    assert "two digits: left" in capsys.readouterr().out  # (3, 7) and (9, 1), read from the prompts
    with np.load(tmp_path / "s.npz") as saved:
        assert saved["images"].shape == (6, 8, 16, 1) and "labels" not in saved.files  # one prompt per image
        assert list(saved["prompts"]) == [p for p in prompts for _ in range(3)]
    # --guidance 3 guides against zeros in place of the hidden states and pooled vector of "", whose
    # encoding by the tower is not zero; the mask stays the one of "" (SDXL's zeroed empty prompt).
    (null,) = nulls
    assert not np.any(null.context) and not np.any(null.pooled)
    empty = open_text(str(tower), "", "empty", scratch_config={}, mesh=make_mesh(data=-1, fsdp=1), min_size=2**62)
    encoded = empty.encoded_null()
    assert np.abs(encoded.context).min() > 0 and np.abs(encoded.pooled).min() > 0
    np.testing.assert_array_equal(null.mask, encoded.mask)
    assert null.context.shape == encoded.context.shape and null.pooled.shape == encoded.pooled.shape

    # The same samples as a grid: a row per prompt, labelled with it (the sampler program above, reused).
    sample.main(
        sample.parse_args(
            [
                "--run_dir",
                str(run_dir),
                "--prompts",
                *prompts,
                "--per_prompt",
                "3",
                "--steps",
                "1",
                "--guidance",
                "3",
                "--out",
                str(tmp_path / "s.png"),
            ]
        )
    )
    assert scales == [3.0, 3.0]  # each flag overrides the run's --guidance (1.5)
    from tests.scripts.test_train_main import row_label_margin

    with Image.open(tmp_path / "s.png") as grid:
        want = row_label_margin(prompts, 8, "L", grid.height)
        assert grid.size == (want.shape[1] + (3 * 17 + 1) * 4, (2 * 9 + 1) * 4)
        np.testing.assert_array_equal(np.asarray(grid)[:, : want.shape[1]], want)


def test_text_dropout_is_the_dropout_of_a_text_run(tmp_path, monkeypatch):
    """train/main.py hands --text_dropout (not --label_dropout) to the step's `prepare`: main runs up to
    the step's construction (train/main.py's own setup, no compile), then its `prepare` is called on
    a batch of random tokens. A replaced caption is the null's tokens, one row for all."""
    import main as train_main

    class Built(Exception):
        pass

    def capture(**kwargs):
        built.update(kwargs)
        raise Built

    built = {}
    monkeypatch.setattr(train_main, "make_train_step", capture)
    with pytest.raises(Built):
        train_here(
            "--run_dir",
            tmp_path,
            "--dataset",
            "captioned_digits",
            "--text_dropout",
            0.5,
            "--label_dropout",
            0,
            "--steps",
            1,
            *SMOKE,
        )
    n, length = 256, 8  # captioned_digits' scratch tower reads 8 tokens
    rng = np.random.default_rng(0)
    ids = rng.integers(1000, 2000, (n, length)).astype(np.int32)
    batch = {
        "image": rng.integers(0, 256, (n, 8, 16, 1), dtype=np.uint8),
        "input_ids": ids,
        "attention_mask": np.ones((n, length), np.int32),
    }
    cond = built["prepare"](batch, jax.random.key(1))["cond"]
    replaced = np.any(np.asarray(cond["input_ids"]) != ids, axis=1)
    assert 0.35 < replaced.mean() < 0.65, replaced.mean()  # 128 ± 8 of 256
    assert len(np.unique(np.asarray(cond["input_ids"])[replaced], axis=0)) == 1
