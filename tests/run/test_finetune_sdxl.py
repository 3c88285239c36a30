"""train/main.py --init sd:SDXL_FOLDER (eqxdiff/run/finetune.py, eqxdiff/run/sdxl_condition.py) on the tiny random
SDXL pipeline of tests/data/sd_pipeline, its unet/ a smaller random SDXL UNet (`SMALLER`): the condition the step
builds from a batch's captions is diffusers' (encode_prompt's embeddings of the fixture, time_ids written out by
hand); with --lora_rank its adapters alone train, sample (the run's grid) and write a LoRA file that loads back as
the model, and the run rebuilt as train/sample.py rebuilds it holds that model and a condition that encodes prompts as
the pipeline does; what stays unsupported is refused in one line. The whole-UNet path (no --lora_rank) is the same
for every folder once the condition is built: tests/run/test_finetune.py's SD 1.x test covers it (an SDXL copy of it
cost ~37 s of CI for no new code path)."""

import json
import shutil
from pathlib import Path

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode as train_encode  # train/encode.py
import equinox as eqx
import jax
import main as train_main  # train/main.py
import numpy as np
import pytest
from eqxdiff.run.rebuild import load_run
from eqxdiff.run.open_condition import run_condition
from runs import metric_rows, saved_arrays, train_here
from tests.run.test_finetune import captioned_latents
from tests.sd.test_sd_pipeline import PROMPTS, assemble, reference, relative

from eqxdiff.data.latents import LatentSource
from eqxdiff.sd import SDUNet, SDXLCond, save_diffusers
from eqxdiff.nn.lora import partition_lora
from eqxdiff.sd.lora_files import load_lora
from eqxdiff.run.sdxl_condition import SDXLText
from eqxdiff.sharding import make_mesh

STEPS = [
    "--batch_size",
    8,
    "--warmup_steps",
    1,
    "--lr",
    1e-2,
    "--sample_every",
    0,
    "--log_every",
    1,
    "--wandb",
    "disabled",
    "--ema_decay",
    0.5,
    "--no-ema_warmup",
]
LORA = [
    "--lora_rank",
    2,
    "--steps",
    2,
    "--sample_every",
    2,
    "--sample_steps",
    1,
    "--sample_method",
    "euler",
    "--sample_prompts",
    "a photo of a cat",
]  # its grid and checkpoint at the end: one row of ten images by one Euler step (Heun's program would hold a second
# UNet call, its corrector's, ~4 s of compile: the grid checks the adapters' sampling, not the sampler)
SIZE = 32  # pixels: 8×8 latents of the fixture's factor-4 VAE (4×4 at the UNet's lowest level)
# The fixture's SDXL UNet (three levels, two layers a block, a two-deep transformer at the bottom) cut to two levels
# of one layer and one-deep transformers, SDXL's own parts kept (the size/crop time_ids and pooled text added to the
# time embedding, linear projections, a head width per level): what this file asserts (the adapters alone train and
# sample, their file, the rebuilt model and condition) holds at any depth, and the step and grid programs, traced
# layer by layer, take a fraction of the time. The fixture's UNet against diffusers: tests/sd/test_sd_pipeline.py
# (an SDXL-like UNet's: tests/sd/test_sd_unet.py, sdxl_like).
SMALLER = dict(
    block_out_channels=[8, 16],
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D"],
    up_block_types=["CrossAttnUpBlock2D", "UpBlock2D"],
    layers_per_block=1,
    attention_head_dim=[2, 4],
    transformer_layers_per_block=[1, 1],
)


@pytest.fixture(scope="module")
def sdxl_data(tmp_path_factory) -> tuple[Path, Path]:
    """(the sdxl pipeline folder with a `SMALLER` random unet/, latents of 8 captioned 32×32 images encoded with its
    VAE, raw captions kept)."""
    root = tmp_path_factory.mktemp("finetune_sdxl")
    folder = assemble("sdxl", root / "sdxl")
    config = json.loads((folder / "unet" / "config.json").read_text()) | SMALLER
    shutil.rmtree(folder / "unet")
    save_diffusers(SDUNet.from_config(config, key=jax.random.key(2)), folder / "unet")
    return folder, captioned_latents(root, folder, SIZE, [PROMPTS[i % 2] for i in range(8)])


def train(run_dir: Path, sdxl_data, *flags) -> None:
    folder, latents = sdxl_data
    train_here("--run_dir", run_dir, "--init", f"sd:{folder}", "--dataset", f"latents:{latents}", *STEPS, *flags)


def test_the_condition_is_the_pipelines(sdxl_data, tmp_path):
    """The step's condition of the captions PROMPTS is what diffusers' StableDiffusionXLPipeline.encode_prompt made
    of them (the fixture's reference.npz), time_ids (h, w, 0, 0, h, w) of the images; the null is "" encoded."""
    folder, latents = sdxl_data
    cfg = train_main.parse_config(
        ["--run_dir", str(tmp_path), "--init", f"sd:{folder}", "--dataset", f"latents:{latents}"]
    )
    source = LatentSource(latents, f"latents:{latents}")
    condition = run_condition(cfg, source, make_mesh(data=-1, fsdp=1))
    assert isinstance(condition, SDXLText)
    records = condition.records(source)
    batch = {k: np.stack([records[i][k] for i in range(2)]) for k in ("input_ids", "input_ids_2")}
    frozen = condition.frozen()
    cond = eqx.filter_jit(condition.cond)(batch, frozen)
    ref = reference("sdxl")
    assert isinstance(cond, SDXLCond)
    assert relative(cond.text.context, ref["prompt_embeds"]) < 1e-5 and relative(cond.text.pooled, ref["pooled"]) < 1e-5
    assert np.array_equal(cond.time_ids, [[SIZE, SIZE, 0, 0, SIZE, SIZE]] * 2)
    null = condition.null(frozen)  # "" through both towers: the fixture's second negative prompt is ""
    assert relative(null.text.context[0], ref["negative_embeds"][1]) < 1e-5
    assert relative(null.text.pooled[0], ref["negative_pooled"][1]) < 1e-5
    assert np.array_equal(null.time_ids, cond.time_ids[:1])
    # The sampling side builds the same rows.
    sampled, _ = condition.for_sampling(PROMPTS, 1)
    assert relative(sampled.text.context, ref["prompt_embeds"]) < 1e-5
    assert np.array_equal(sampled.time_ids, cond.time_ids)


# The training tests compile SDXL's step and its sampler, each far past the quick tier's few seconds: marked slow.
@pytest.fixture(scope="module")
def lora_run(sdxl_data, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("sdxl_lora")
    train(run_dir, sdxl_data, *LORA)
    return run_dir


@pytest.mark.slow
def test_lora_trains_the_adapters_alone(lora_run, sdxl_data):
    """A second, resumed training (~40 s here) would add no code path: resuming a LoRA run is SD 1.x's
    (tests/run/test_finetune.py, bitwise, in a bucket), and SDXL's condition is built from the records alone."""
    rows = metric_rows(lora_run)
    assert list((lora_run / "samples").glob("*.png"))  # the grid of the EMA's adapters in the base
    assert [r["step"] for r in rows] == [1, 2] and all(np.isfinite(r["train/loss"]) for r in rows)
    trained = saved_arrays(lora_run, 2, parts=("model", "ema"))  # not the optimizer's moments
    assert trained and all(k.endswith(("['lora_A']", "['lora_B']")) for k in trained)
    assert all(np.abs(v).max() > 0 for k, v in trained.items() if k.endswith("['lora_B']"))  # B starts at 0

    run = load_run(lora_run, mesh=make_mesh(data=-1, fsdp=1))
    folder = SDUNet.from_diffusers(sdxl_data[0] / "unet")
    _, base = partition_lora(run.ema)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(eqx.filter(base, eqx.is_array)), jax.tree.leaves(folder), strict=True)
    )
    host = lambda model: jax.tree.map(np.asarray, model)  # noqa: E731
    assert eqx.tree_equal(host(load_lora(folder, lora_run / "lora")), host(run.ema)) is True
    # train/sample.py's prompts through the condition rebuilt from the run's config: diffusers' encode_prompt. With
    # the model above and the grid's sampling of it, that is what train/sample.py --run_dir draws from; running it
    # here (a second rebuild, ~14 s) showed no more than an array's shape.
    sampled, _ = run.condition.for_sampling(PROMPTS, 1)
    ref = reference("sdxl")
    assert relative(sampled.text.context, ref["prompt_embeds"]) < 1e-5
    assert relative(sampled.text.pooled, ref["pooled"]) < 1e-5
    assert np.array_equal(sampled.time_ids, [[SIZE, SIZE, 0, 0, SIZE, SIZE]] * 2)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tokenizer", "OTHER"], "tokenizes with its own tokenizer/ and tokenizer_2/; drop --tokenizer"),
        (
            ["--dataset", "latents:UNCAPTIONED"],
            "holds latents without captions; .* --image_size 32 .* --text_encoder .*/text_encoder --out DIR",
        ),
    ],
)
def test_what_sdxl_fine_tuning_refuses_at_start(sdxl_data, tmp_path, flags, message):
    folder, latents = sdxl_data
    uncaptioned = tmp_path / "uncaptioned"
    if "latents:UNCAPTIONED" in flags:  # the same images encoded without --text_encoder: no captions kept
        images = f"folder:{latents.parent / f'{latents.name}_images'}"
        train_encode.main(
            train_encode.parse_config(
                [
                    "--dataset",
                    images,
                    "--image_size",
                    str(SIZE),
                    "--vae",
                    str(folder / "vae"),
                    "--out",
                    str(uncaptioned),
                ]
            )
        )
    flags = [f.replace("OTHER", str(folder / "tokenizer")).replace("UNCAPTIONED", str(uncaptioned)) for f in flags]
    with pytest.raises(SystemExit, match=message):
        train_here(
            "--run_dir", tmp_path / "run", "--init", f"sd:{folder}", "--dataset", f"latents:{latents}", *STEPS, *flags
        )


def test_what_sdxl_folders_refuse_in_the_flags(sdxl_data, tmp_path):
    folder = sdxl_data[0]
    with pytest.raises(SystemExit, match="two towers condition its own UNet: pass --init sd:FOLDER"):
        train_main.parse_config(["--run_dir", str(tmp_path / "r"), "--text_encoder", str(folder)])
    with pytest.raises(SystemExit, match="an SDXL UNet .* give the StableDiffusionXLPipeline folder"):
        bare = shutil.copytree(folder / "unet", tmp_path / "alone" / "unet")
        train_main.parse_config(["--run_dir", str(tmp_path / "r"), "--init", f"sd:{bare}"])
    refiner = shutil.copytree(folder, tmp_path / "refiner", ignore=shutil.ignore_patterns("text_encoder", "tokenizer"))
    with pytest.raises(SystemExit, match="lacks one of text_encoder, .*base model's whole pipeline folder"):
        train_main.parse_config(["--run_dir", str(tmp_path / "r"), "--init", f"sd:{refiner}"])
