"""`load_sd` / `SDPipeline` against diffusers' own StableDiffusionPipeline and StableDiffusionXLPipeline: given the
same unit latents, eqxdiff's latents equal the ones diffusers returns with `output_type="latent"` (fixtures:
tools/make_sd_pipeline_fixtures.py, tiny random pipelines, 4 steps, cfg 5, a prompt and a negative prompt each), on
the folder's scheduler and on ones swapped in as `from_config` does; the refusals; the CLI writing a png."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from PIL import Image

from eqxdiff.sd import load_sd
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

DATA = Path(__file__).parents[1] / "data"
ROOT = Path(__file__).parents[2]
PROMPTS = ["a photo of a cat", "wow! a dog!!"]
NEGATIVE = ["blurry, ugly", ""]
STEPS, CFG = 4, 5.0
MICRO = dict(original_size=(40, 24), crops_coords_top_left=(2, 3), target_size=(32, 28))
TOLERANCE = 2e-5  # relative; the bar is 1e-3, float32 on both sides measures <= 1.3e-6 (CPU)


def relative(ours, theirs) -> float:
    return float(np.abs(np.asarray(ours) - theirs).max() / np.abs(theirs).max())


def assemble(family: str, folder: Path) -> Path:
    """The fixture as the whole folder diffusers saved: its unet/, scheduler/ and model_index.json, plus the committed
    towers (tests/data/sdxl_text), tokenizers (tests/data/clip_tokenizer) and VAE (tests/data/autoencoder_kl/sd_like)
    the fixture script built it from, under the names diffusers gives them."""
    shutil.copytree(DATA / "sd_pipeline" / family, folder, ignore=shutil.ignore_patterns("reference.npz"))
    shutil.copytree(DATA / "autoencoder_kl" / "sd_like", folder / "vae", ignore=shutil.ignore_patterns("*.npz"))
    towers = ("text_encoder",) if family == "sd1" else ("text_encoder", "text_encoder_2")
    for name, tokenizer in zip(towers, ("sd1", "sd2")):
        shutil.copytree(DATA / "sdxl_text" / name, folder / name)
        shutil.copytree(DATA / "clip_tokenizer" / tokenizer, folder / name.replace("text_encoder", "tokenizer"))
    return folder


@pytest.fixture(scope="module")
def sd1_folder(tmp_path_factory) -> Path:
    return assemble("sd1", tmp_path_factory.mktemp("sd") / "sd1")


@pytest.fixture(scope="module")
def sd1(sd1_folder):
    return load_sd(sd1_folder)


@pytest.fixture(scope="module")
def sdxl_folder(tmp_path_factory) -> Path:
    return assemble("sdxl", tmp_path_factory.mktemp("sd") / "sdxl")


@pytest.fixture(scope="module")
def sdxl(sdxl_folder):
    return load_sd(sdxl_folder)


@pytest.fixture
def sd1_read_once(monkeypatch, sd1, sd1_folder):
    """train/sample_pretrained.py's load_sd serving sd1_folder by the module's pipeline: the script's runs below read
    that folder again and again, and each read (~2 s) would prove nothing the module's load_sd did not."""
    import sample_pretrained  # train/sample_pretrained.py (conftest puts train/ on the path)

    monkeypatch.setattr(sample_pretrained, "load_sd", lambda folder: sd1 if folder == sd1_folder else load_sd(folder))


def reference(family: str) -> dict:
    return dict(np.load(DATA / "sd_pipeline" / family / "reference.npz"))


def nhwc(x: np.ndarray) -> np.ndarray:
    return np.transpose(x, (0, 2, 3, 1))


def test_the_folders_are_read_as_their_pipelines(sd1, sdxl):
    assert (sd1.family, sd1.scheduler.method, sd1.scheduler.class_name) == ("sd", "ddim", "DDIMScheduler")
    assert (sdxl.family, sdxl.scheduler.method, sdxl.scheduler.spacing) == ("sdxl", "euler", "leading")
    assert sd1.vae_scale_factor == 4 and sdxl.prompts.force_zeros_for_empty_prompt


def test_prompt_embeds_match_encode_prompt(sd1, sdxl):
    ref = reference("sd1")
    assert relative(sd1.prompts.encode(PROMPTS).context, ref["prompt_embeds"]) < 1e-5
    assert relative(sd1.prompts.negative(2, NEGATIVE).context, ref["negative_embeds"]) < 1e-5
    ref = reference("sdxl")
    cond, null = sdxl.prompts.encode(PROMPTS), sdxl.prompts.negative(2, NEGATIVE)
    assert relative(cond.context, ref["prompt_embeds"]) < 1e-5 and relative(cond.pooled, ref["pooled"]) < 1e-5
    assert relative(null.context, ref["negative_embeds"]) < 1e-5


# case: (scheduler swapped in (None: the folder's DDIM), its overrides, negative prompts given, cfg)
SD1_CASES = {
    "ddim": (None, {}, True, CFG),
    "ddim_no_negative": (None, {}, False, CFG),
    "ddim_unguided": (None, {}, True, 1.0),
    "ddim_v": ("ddim", dict(prediction_type="v_prediction"), True, CFG),
    "euler": ("EulerDiscreteScheduler", {}, True, CFG),
    "dpmpp_2m": ("dpmpp_2m", dict(use_karras_sigmas=True), True, CFG),
}


@pytest.mark.parametrize("case", SD1_CASES)
def test_sd1_latents_equal_diffusers(sd1, case):
    """Given diffusers' initial latents, and a key as train/sample_pretrained.py passes one (these schedulers draw
    nothing from it): [euler]'s program is then the one the script's runs below and test_drawn_latents_and_images
    sample with."""
    ref = reference("sd1")
    scheduler, overrides, negative, cfg = SD1_CASES[case]
    pipe = sd1 if scheduler is None else sd1.with_scheduler(scheduler, **overrides)
    ours = pipe.latents(
        PROMPTS,
        NEGATIVE if negative else None,
        steps=STEPS,
        guidance=cfg,
        initial_latents=nhwc(ref["latents"]),
        key=jax.random.key(0),
    )
    assert ours.shape == (2, 8, 8, 4)
    assert relative(ours, nhwc(ref[f"{case}_latents"])) < TOLERANCE


SDXL_CASES = {
    "euler": (None, True, MICRO),
    "euler_zeros": (None, False, MICRO),
    "euler_default_sizes": (None, True, {}),
    "dpmpp_2m": ("DPMSolverMultistepScheduler", True, MICRO),
}


@pytest.mark.parametrize("case", SDXL_CASES)
def test_sdxl_latents_equal_diffusers(sdxl, case):
    ref = reference("sdxl")
    scheduler, negative, micro = SDXL_CASES[case]
    pipe = sdxl if scheduler is None else sdxl.with_scheduler(scheduler)
    ours = pipe.latents(
        PROMPTS,
        NEGATIVE if negative else None,
        steps=STEPS,
        guidance=CFG,
        initial_latents=nhwc(ref["latents"]),
        **micro,
    )
    assert relative(ours, nhwc(ref[f"{case}_latents"])) < TOLERANCE


def test_sdxl_default_sizes_are_height_width_of_a_non_square_image(sdxl):
    """diffusers' defaults: original_size = target_size = (height, width). On 32×16-pixel latents (8×4, the VAE's
    factor 4), sizes left out, or only height/width given, sample as (32, 16) given; (16, 32) samples otherwise.
    Latents drawn from a key at height 32, width 16 are 8×4 (every draw passes a key: one sampler program)."""
    noise = np.asarray(jax.random.normal(jax.random.key(7), (1, 8, 4, 4)))
    draw = lambda **sizes: np.asarray(  # noqa: E731
        sdxl.latents(["a cat"], steps=2, guidance=CFG, key=jax.random.key(0), **{"initial_latents": noise, **sizes})
    )
    given = draw(original_size=(32, 16), target_size=(32, 16))
    assert given.shape == (1, 8, 4, 4)
    np.testing.assert_array_equal(draw(), given)
    np.testing.assert_array_equal(draw(height=32, width=16), given)
    np.testing.assert_array_equal(draw(original_size=(32, 16)), given)
    np.testing.assert_array_equal(draw(target_size=(32, 16)), given)
    assert relative(draw(original_size=(16, 32), target_size=(16, 32)), given) > 10 * TOLERANCE
    drawn = draw(initial_latents=None, height=32, width=16)
    assert drawn.shape == (1, 8, 4, 4) and relative(drawn, given) > 0.1  # its own noise


def test_the_cases_are_told_apart():
    """Each reference differs from its neighbours by far more than the tolerance, so the parity tests can fail."""
    for family, pairs in (
        ("sd1", [("ddim", "ddim_no_negative"), ("ddim", "ddim_unguided"), ("ddim", "ddim_v")]),
        ("sdxl", [("euler", "euler_zeros"), ("euler", "euler_default_sizes")]),
    ):
        ref = reference(family)
        for a, b in pairs:
            assert relative(ref[f"{a}_latents"], ref[f"{b}_latents"]) > 10 * TOLERANCE, (family, a, b)


def test_drawn_latents_and_images(sd1):
    """Two prompts at the UNet's sample size, Euler, the parity tests' 4 steps and guidance 5: the sampler program of
    test_sd1_latents_equal_diffusers[euler] and of the CLI tests' default run below, the decode program of every
    2-image run here; and Euler ancestral's. Height and width drawn apart:
    test_sdxl_default_sizes_are_height_width_of_a_non_square_image (the same code for both families)."""
    prompts = ["a cat", "a dog"]
    images = sd1.images(prompts, steps=STEPS, guidance=CFG, key=jax.random.key(0), method="euler")
    assert images.shape == (2, 32, 32, 3) and np.isfinite(np.asarray(images)).all()
    # from the same initial latents, Euler ancestral's step noise comes from the key (Euler's does not exist)
    noise = np.asarray(jax.random.normal(jax.random.key(5), (2, 8, 8, 4)))
    draw = lambda method, seed: np.asarray(  # noqa: E731
        sd1.latents(prompts, steps=STEPS, guidance=CFG, initial_latents=noise, key=jax.random.key(seed), method=method)
    )
    a = draw("euler_ancestral", 0)
    assert np.isfinite(a).all() and relative(draw("euler_ancestral", 1), a) > 0.01  # 0.39: the steps' σ_up noise
    assert relative(draw("euler_ancestral", 0), a) == 0 and relative(draw("euler", 1), draw("euler", 0)) == 0


def test_refusals(sd1, sdxl, sd1_folder, tmp_path):
    with pytest.raises(ValueError, match="guidance_rescale"):
        sdxl.latents(PROMPTS, steps=2, key=jax.random.key(0), guidance_rescale=0.7)
    with pytest.raises(ValueError, match="SDXL's micro-conditioning"):
        sd1.latents(PROMPTS, steps=2, key=jax.random.key(0), original_size=(64, 64))
    with pytest.raises(ValueError, match="one row per prompt"):
        sd1.latents(PROMPTS, steps=2, initial_latents=np.zeros((3, 8, 8, 4), np.float32))
    with pytest.raises(ValueError, match="initial_latents .* or a key"):
        sd1.latents(PROMPTS, steps=2)
    with pytest.raises(ValueError, match="scheduler config thresholding"):
        sd1.with_scheduler("ddim", thresholding=True)
    folder = tmp_path / "other"
    shutil.copytree(sd1_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps(index | {"_class_name": "StableDiffusionImg2ImgPipeline"}))
    with pytest.raises(ValueError, match="is a StableDiffusionImg2ImgPipeline: load_sd reads"):
        load_sd(folder)
    with pytest.raises(FileNotFoundError, match="no model_index.json"):
        load_sd(tmp_path)
    shutil.rmtree(folder / "vae")
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="no vae/"):
        load_sd(folder)


def fp16_only(folder: Path, copy: Path) -> Path:
    """A copy of the pipeline folder holding only `*.fp16.safetensors` (as `huggingface-cli download --include
    "*.fp16.*"` leaves it)."""
    shutil.copytree(folder, copy)
    for file in [*copy.glob("*/diffusion_pytorch_model.safetensors"), *copy.glob("*/model.safetensors")]:
        file.rename(file.with_name(file.name.replace(".safetensors", ".fp16.safetensors")))
    return copy


@pytest.mark.slow  # train/sample.py's process end to end
def test_cli_writes_a_png(sdxl_folder, tmp_path):
    """The script's process writes a PNG grid, from a folder of fp16 files alone, each model's file named in a
    one-line warning at the start (the script's warning format; what the fp16 folder samples:
    test_cli_reads_a_folder_of_fp16_files_alone). SDXL only: the process's wiring is the same for SD 1.x, whose
    pipeline runs through the script in the tests below. A missing folder is named by test_cli_refusals_name_the_fix
    (in this process: a second process here, to see the same line, cost a Python and JAX start; a script's refusal as
    one line with status 2 is tests/scripts/test_script_errors.py's)."""
    out, folder = tmp_path / "grid.png", fp16_only(sdxl_folder, tmp_path / "fp16_only")
    cmd = [
        sys.executable,
        str(ROOT / "train" / "sample_pretrained.py"),
        "--pretrained",
        f"sd:{folder}",
        "--prompts",
        "a cat",
        "a dog",
        "--negative_prompts",
        "blurry",
        "",
        "--guidance",
        "5",
        "--steps",
        "2",
        "--method",
        "euler",
        "--out",
        str(out),
    ]
    # The test's compile setting (conftest: JAX_DISABLE_MOST_OPTIMIZATIONS), nothing else of its environment
    optimizations = {"JAX_DISABLE_MOST_OPTIMIZATIONS": os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"]}
    env = {"PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", **optimizations}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 images (1 per prompt, euler, 2 steps, guidance 5)" in done.stdout
    grid = np.asarray(Image.open(out))
    assert grid.shape[0] > 2 * 32 and grid.std() > 0  # two rows of 32-pixel images (and their labels)
    lines = [line for line in done.stderr.splitlines() if "fp16" in line]
    parts = ("unet", "vae", "text_encoder", "text_encoder_2")
    assert {line.partition(" holds only")[0] for line in lines} >= {f"warning: {folder / p}" for p in parts}, lines
    assert all(line.startswith("warning: ") and line.endswith("reading those") for line in lines), lines


@pytest.mark.slow  # train/sample.py's process end to end
def test_cli_makes_per_prompt_images_each_its_own_noise(sd1_folder, sd1_read_once, tmp_path):
    """--per_prompt 3 (or --num 6) for two prompts: six images, prompt-major, each its own noise from --seed (the
    three of a prompt differ), the same whatever --batch_size splits them into; the default is one per prompt, image
    0 the same; a --num that the prompts do not divide is refused. The split is into calls of 2 rows, the default's
    size: two sampler programs in all, not three."""
    import sample_pretrained  # train/sample_pretrained.py (conftest puts train/ on the path)

    def run(name, *flags) -> dict:
        out = tmp_path / name / "samples.npz"  # its folder made
        sample_pretrained.main(
            sample_pretrained.parse_args(
                [
                    "--pretrained",
                    f"sd:{sd1_folder}",
                    "--prompts",
                    "a cat",
                    "a dog",
                    "--steps",
                    str(STEPS),
                    "--guidance",
                    str(CFG),
                    "--method",
                    "euler",
                    "--out",
                    str(out),
                    *flags,
                ]
            )
        )
        return dict(np.load(out))

    three = run("three", "--per_prompt", "3")
    assert three["images"].shape == (6, 32, 32, 3) and list(three["prompts"]) == ["a cat"] * 3 + ["a dog"] * 3
    z = three["latents"]
    assert min(relative(z[i], z[j]) for i, j in ((0, 1), (0, 2), (1, 2), (3, 4), (3, 5), (4, 5))) > 0.1
    chunked = run("chunked", "--num", "6", "--batch_size", "2")
    assert relative(chunked["latents"], z) < 1e-5
    one = run("one")
    assert one["latents"].shape[0] == 2 and relative(one["latents"][0], z[0]) < 1e-5
    with pytest.raises(SystemExit, match="--num 5: .* each of the 2 prompts"):
        run("five", "--num", "5")


@pytest.mark.slow  # the sampling of the test above: its compiles, when it runs alone
def test_cli_reads_a_folder_of_fp16_files_alone(sd1_folder, sd1_read_once, tmp_path):
    """A pipeline folder holding only `*.fp16.safetensors` samples through the script as the plain folder does, each
    model's file named in a warning (as the script's process prints it: test_cli_writes_a_png)."""
    import sample_pretrained  # train/sample_pretrained.py (conftest puts train/ on the path)

    fp16 = fp16_only(sd1_folder, tmp_path / "fp16_only")

    def run(folder) -> np.ndarray:  # the sampling of the test above ("one"): its compiled programs again
        out = tmp_path / f"{folder.name}.npz"
        flags = ["--prompts", "a cat", "a dog", "--steps", str(STEPS), "--guidance", str(CFG), "--method", "euler"]
        sample_pretrained.main(
            sample_pretrained.parse_args(["--pretrained", f"sd:{folder}", *flags, "--out", str(out)])
        )
        return np.load(out)["latents"]

    with pytest.warns(UserWarning) as said:
        ours = run(fp16)
    named = {str(w.message).partition(" holds only its 'fp16' weights")[0] for w in said}
    assert {str(fp16 / part) for part in ("unet", "vae", "text_encoder")} <= named, named
    np.testing.assert_array_equal(ours, run(sd1_folder))


def test_cli_refusals_name_the_fix(sd1_folder, tmp_path, capsys):
    import sample_pretrained  # train/sample_pretrained.py

    other = tmp_path / "img2img"
    shutil.copytree(sd1_folder, other, ignore=shutil.ignore_patterns("unet", "vae", "text_encoder"))
    index = json.loads((other / "model_index.json").read_text())
    (other / "model_index.json").write_text(json.dumps(index | {"_class_name": "StableDiffusionImg2ImgPipeline"}))
    sd = ["--pretrained", f"sd:{sd1_folder}", "--out", str(tmp_path / "x.png")]
    for flags, phrase in [
        (["--pretrained", f"sd:{tmp_path / 'none'}", "--prompts", "a"], "no model_index.json there: "),
        (["--pretrained", f"sd:{sd1_folder / 'unet'}", "--prompts", "a"], "is a model folder (config.json: UNet2D"),
        (
            ["--pretrained", f"sd:{sd1_folder / 'model_index.json'}", "--prompts", "a"],
            f"is a file (did you mean dit:{sd1_folder / 'model_index.json'} or sit:",
        ),
        ([*sd, "--prompts", "a", "--vae", str(sd1_folder / "vae")], "brings its own VAE"),
        (sd, "needs --prompts"),
        ([*sd, "--prompts", "a", "--method", "heun"], "samples with ddim, euler, euler_ancestral, dpmpp_2m"),
        ([*sd, "--prompts", "a", "b", "c", "--negative_prompts", "x", "y"], "one for all prompts or one per prompt"),
        (["--pretrained", f"sd:{other}", "--prompts", "a"], "is a StableDiffusionImg2ImgPipeline: load_sd reads"),
    ]:
        with pytest.raises(SystemExit) as refused:
            sample_pretrained.main(sample_pretrained.parse_args(flags))
        assert phrase in str(refused.value.code), flags
