"""CLIP score against torchmetrics' CLIPScore on a random CLIPModel folder (tools/make_clip_score_fixture.py): the
uint8 bicubic resize of torch's kernel (torchvision's backend) and of Pillow's (the PIL backend, which made the
fixture's inputs), CLIPProcessor's pixel values and token ids, the per-pair scores and the score."""

import shutil
from pathlib import Path

import numpy as np
import pytest

from eqxdiff.eval.clip_score import CLIPScorer, clip_score
from eqxdiff.nn.bicubic import resize_uint8

DATA = Path(__file__).parents[1] / "data"
FOLDER = DATA / "clip_score" / "model"


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(DATA / "clip_score" / "reference.npz") as f:
        return dict(f)


@pytest.fixture(scope="module")
def scorer(tmp_path_factory) -> CLIPScorer:
    """The fixture's model folder with sd1's tokenizer files copied in (as the tool did for torchmetrics)."""
    folder = tmp_path_factory.mktemp("clip") / "model"
    shutil.copytree(FOLDER, folder)
    for f in (DATA / "clip_tokenizer" / "sd1").iterdir():
        shutil.copy(f, folder / f.name)
    return CLIPScorer.from_transformers(folder, kernel="pillow")


def images(ref) -> list[np.ndarray]:
    return [ref[f"image_{i}"] for i in range(4)]


@pytest.mark.parametrize("i", range(4))
def test_uint8_resizes_are_torchs_and_pillows(ref, i):
    """Bit for bit: torch's uint8 kernel (int16 weights, its own precision) and Pillow's (22 bits, its pass order)."""
    for kernel in ("torch", "pillow"):
        expected = ref[f"{kernel.replace('pillow', 'pil')}_resized_{i}"]
        np.testing.assert_array_equal(resize_uint8(ref[f"image_{i}"], expected.shape[:2], kernel=kernel), expected)
    differ = (ref[f"torch_resized_{i}"] != ref[f"pil_resized_{i}"]).sum()
    assert differ == 0 if i == 1 else differ > 0  # the two kernels round apart (the square 40² image is not resized)


def test_inputs_are_clip_processors(ref, scorer):
    pixels, ids, mask = scorer.inputs(images(ref), list(ref["captions"]))
    np.testing.assert_allclose(pixels, ref["pixel_values"], rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ids, ref["input_ids"])
    np.testing.assert_array_equal(mask, ref["attention_mask"])
    eos = ids[0, mask[0].sum() - 1]
    assert ids.shape[1] == 77 and mask[3].all() and eos not in ids[3]  # the long caption cut at 77, its eos lost


def test_scores_are_torchmetrics(ref, scorer):
    scores = scorer.scores(images(ref), list(ref["captions"]))
    np.testing.assert_allclose(scores, ref["scores"], rtol=1e-4, atol=1e-4)
    assert abs(clip_score(scores) - float(ref["clip_score"])) <= 1e-4 * float(ref["clip_score"])
    assert clip_score([-3.0, 1.0]) == 0.0 and clip_score([-1.0, 3.0]) == 1.0  # the mean is clamped, not each pair


def test_pairs_must_match(ref, scorer):
    with pytest.raises(ValueError, match="4 images, 3 captions"):
        scorer.scores(images(ref), list(ref["captions"])[:3])


def test_sample_sd_reports_the_clip_score_of_its_images(scorer, tmp_path, capsys):
    """train/sample_pretrained.py --pretrained sd:FOLDER --clip_score CLIP: the printed score is the images' against
    their prompts (the images as saved in --out); sample.py (a run's samples) names the script that takes it."""
    import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
    import sample  # train/sample.py
    import sample_pretrained  # train/sample_pretrained.py
    from tests.sd.test_sd_pipeline import assemble

    pipeline = assemble("sd1", tmp_path / "sd1")
    clip = tmp_path / "clip"
    shutil.copytree(FOLDER, clip)
    for f in (DATA / "clip_tokenizer" / "sd1").iterdir():
        shutil.copy(f, clip / f.name)
    out = tmp_path / "s.npz"
    sample_pretrained.main(
        sample_pretrained.parse_args(
            [
                "--pretrained",
                f"sd:{pipeline}",
                "--prompts",
                "a cat",
                "a red car",
                "--steps",
                "2",
                "--out",
                str(out),
                "--clip_score",
                str(clip),
            ]
        )
    )
    with np.load(out) as f:
        images, prompts = list(f["images"]), [str(p) for p in f["prompts"]]
    expected = clip_score(CLIPScorer.from_transformers(clip).scores(images, prompts))  # torch's kernel: the default
    assert f"CLIP score {expected:.4f} (2 images against their prompts" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        sample.parse_args(["--run_dir", "r", "--clip_score", str(clip)])
    assert "--clip_score: python train/sample_pretrained.py --pretrained" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--clip_score scores --pretrained sd:FOLDER's images"):
        sample_pretrained.parse_args(["--pretrained", "dit:x.pt", "--clip_score", str(clip)])
