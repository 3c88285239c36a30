"""Check a LoRA run of train/main.py (--init sd:FOLDER --lora_rank R) against diffusers: the run's
RUN_DIR/lora/pytorch_lora_weights.safetensors, read by the pipeline's `load_lora_weights` (StableDiffusionPipeline,
or StableDiffusionXLPipeline: the UNet's adapters under the same PEFT names) into --init's pipeline, gives the UNet
output of eqxdiff's rebuilt run (eqxdiff/run/rebuild.py: the EMA's adapters in the base). Two halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_finetune_lora.py write --run_dir RUN --out /tmp/ft   # eqxdiff's side
    tools/.venv/bin/python tools/check_finetune_lora.py check --run_dir RUN --out /tmp/ft         # diffusers' (+ peft)

`write` stores random latents, timesteps and a text context (SDXL: the run's condition of two prompts, its context,
pooled text_embeds and time_ids) with eqxdiff's output in `cases.npz`; `check` prints max |diffusers - eqxdiff|
relative to the output's max, and the LoRA's own effect (so a dropped adapter shows), and fails above 1e-5. A 3-step
rank-4 run on tests/run/test_finetune.py's tiny SD 1.x folder: 7.7e-7 (the LoRA's effect 1.1e-2); on
tests/run/test_finetune_sdxl.py's tiny SDXL folder (32² images, StableDiffusionXLPipeline.load_lora_weights): 4.2e-7
(the LoRA's effect 4.3e-2).
"""

import sys
from pathlib import Path

import numpy as np
from two_halves import run_halves  # tools/two_halves.py: the write/check command line

TOLERANCE = 1e-5  # relative to the output's largest value; SDUNet's own parity is 4e-6


def write(run_dir: Path, out: Path) -> None:
    """eqxdiff's side (the main venv)."""
    import equinox as eqx
    import jax.numpy as jnp

    from eqxdiff.run.rebuild import load_run

    from eqxdiff.nn import TextCond
    from eqxdiff.run.sdxl_condition import SDXLText
    from eqxdiff.sharding import make_mesh

    run = load_run(run_dir, mesh=make_mesh(data=-1, fsdp=1))
    h, w, c = run.image_shape
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(2, h, w, c)).astype(np.float32), np.array([10.0, 700.0], np.float32)
    if isinstance(run.condition, SDXLText):  # the run's own condition of two prompts: context, pooled, time_ids
        cond = run.condition.for_sampling(["a photo of a cat", "wow! a dog!!"], 1)[0]
        added = {"pooled": cond.text.pooled, "time_ids": cond.time_ids}
        context = cond.text.context
    else:
        context = rng.normal(size=(2, 7, run.ema.context_dim)).astype(np.float32)
        cond, added = TextCond(jnp.asarray(context), jnp.ones((2, 7), jnp.int32)), {}
    got = eqx.filter_jit(lambda m, c: m(jnp.asarray(x), jnp.asarray(t), c))(run.ema, cond)
    np.savez(out / "cases.npz", x=x, t=t, context=context, out=np.asarray(got), **added)
    print(f"wrote eqxdiff's output of {run_dir} (step {run.step}) to {out / 'cases.npz'}")


def check(run_dir: Path, out: Path) -> None:
    """diffusers' side (tools/.venv with tools/requirements-lora.txt)."""
    import torch
    from diffusers import DiffusionPipeline

    import json

    # The newest checkpoint's config, plain JSON as train/resume.py's saved_config reads it (which imports eqxdiff).
    steps = sorted(int(p.name) for p in (run_dir / "checkpoints").glob("*") if p.name.isdigit())
    config = run_dir / "checkpoints" / str(steps[-1]) / "config" / "metadata" if steps else None
    init = json.loads(config.read_text()).get("init", "") if config and config.is_file() else ""
    folder = Path(init.removeprefix("sd:")).expanduser()
    if not (folder / "model_index.json").is_file():
        sys.exit(f"check_finetune_lora: the checkpoints of {run_dir} name no --init pipeline folder ({init!r})")
    cases = np.load(out / "cases.npz")
    sdxl = "pooled" in cases.files  # StableDiffusionXLPipeline: its UNet also takes text_embeds and time_ids
    extra = {} if sdxl else dict(safety_checker=None, requires_safety_checker=False)
    pipe = DiffusionPipeline.from_pretrained(folder, **extra)
    added = None
    if sdxl:
        added = {"text_embeds": torch.from_numpy(cases["pooled"]), "time_ids": torch.from_numpy(cases["time_ids"])}

    def unet_output():
        with torch.no_grad():
            x = torch.from_numpy(cases["x"]).permute(0, 3, 1, 2)
            t, context = torch.from_numpy(cases["t"]), torch.from_numpy(cases["context"])
            sample = pipe.unet(x, t, context, added_cond_kwargs=added).sample
            return sample.permute(0, 2, 3, 1).numpy()

    base = unet_output()
    pipe.load_lora_weights(run_dir / "lora")
    got, want = unet_output(), cases["out"]
    err, effect = (np.abs(a - want).max() / np.abs(want).max() for a in (got, base))
    print(
        f"{run_dir}/lora in diffusers: max |diffusers - eqxdiff| / max|out| = {err:.2e} (the LoRA moves the output "
        f"by {effect:.2e} of it)"
    )
    if not err <= TOLERANCE:
        sys.exit(f"check_finetune_lora: {err:.2e} above {TOLERANCE:.0e}")


if __name__ == "__main__":
    run_halves(
        __doc__, write, check, "folder for cases.npz", run_dir_help="a train/main.py --init sd:FOLDER --lora_rank run"
    )
