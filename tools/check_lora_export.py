"""Check `eqxdiff.sd.lora_files.save_lora` against diffusers: `StableDiffusionPipeline.load_lora_weights` reads
the file eqxdiff wrote into the pipeline's UNet (the SD 1.x-like fixture, tests/data/sd_unet/sd1_like), and the
UNet's output is compared with eqxdiff's on the same inputs. Two halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_lora_export.py write --out /tmp/lora_export   # eqxdiff's side
    tools/.venv/bin/python tools/check_lora_export.py check --out /tmp/lora_export         # diffusers' (+ peft)

`write` adds adapters with three ranks and two alphas (r=4, alpha=6 on the attention projections; r=2, alpha=3
on proj_in/proj_out, which diffusers holds as 1x1 convolutions; r=3, alpha=3 on the resnets' conv1 and
conv_shortcut and the down/upsamplers' convolutions, PEFT's conv LoRA), draws every A and B off zero, saves them with
`save_lora` and eqxdiff's output with the LoRA on in `cases.npz`. `check` prints max |diffusers - eqxdiff|
relative to the output's max, with and without the LoRA (the LoRA's effect, so a silently dropped adapter
shows), and fails above 1e-5.
"""

import sys
from pathlib import Path

import numpy as np
from two_halves import run_halves  # tools/two_halves.py: the write/check command line

ROOT = Path(__file__).resolve().parent.parent
BASE = ROOT / "tests" / "data" / "sd_unet" / "sd1_like"
TOLERANCE = 1e-5  # relative to the output's largest value; SDUNet's own parity is 4e-6


def write(out: Path) -> None:
    """eqxdiff's side (the main venv)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from eqxdiff.nn import TextCond
    from eqxdiff.sd import SDUNet
    from eqxdiff.nn.lora import add_lora, lora_layers
    from eqxdiff.sd.lora_files import save_lora

    ref = {k: jnp.asarray(v) for k, v in np.load(BASE / "reference.npz").items()}
    unet = SDUNet.from_diffusers(BASE)
    lora = add_lora(unet, 4, alpha=6, key=jax.random.key(0))
    lora = add_lora(lora, 2, alpha=3, targets=r"\.proj_(in|out)$", key=jax.random.key(1))
    lora = add_lora(lora, 3, alpha=3, targets=r"conv1$|conv_shortcut$|samplers\.0\.conv$", key=jax.random.key(3))

    def adapter_weights(model) -> list:
        return [w for layer in lora_layers(model).values() for w in (layer.lora_A, layer.lora_B)]

    old = adapter_weights(lora)
    keys = jax.random.split(jax.random.key(2), len(old))
    lora = eqx.tree_at(
        adapter_weights, lora, [0.1 * jax.random.normal(k, w.shape) for k, w in zip(keys, old, strict=True)]
    )
    save_lora(lora, out, overwrite=True)
    forward = eqx.filter_jit(lambda m: m(ref["x"], ref["t"], TextCond(ref["context"], ref["mask"])))
    np.savez(out / "cases.npz", out=np.asarray(forward(lora)), base=np.asarray(forward(unet)))
    print(f"wrote {len(old) // 2} adapters to {out}")


def check(out: Path) -> None:
    """diffusers' side (tools/.venv with tools/requirements-lora.txt)."""
    import torch
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    ref, cases = np.load(BASE / "reference.npz"), np.load(out / "cases.npz")
    x = torch.from_numpy(ref["x"]).permute(0, 3, 1, 2)
    t, context = torch.from_numpy(ref["t"]), torch.from_numpy(ref["context"])
    pipe = StableDiffusionPipeline(
        vae=None,
        text_encoder=None,
        tokenizer=None,
        scheduler=None,
        safety_checker=None,
        unet=UNet2DConditionModel.from_pretrained(BASE).eval(),
        feature_extractor=None,
        requires_safety_checker=False,
    )
    pipe.load_lora_weights(out)
    with torch.no_grad():
        got = pipe.unet(x, t, context).sample.permute(0, 2, 3, 1).numpy()
    want = cases["out"]
    err = np.abs(got - want).max() / np.abs(want).max()
    effect = np.abs(cases["base"] - want).max() / np.abs(want).max()
    print(
        f"eqxdiff save_lora -> diffusers load_lora_weights: max |diffusers - eqxdiff| / max|out| = {err:.2e} "
        f"(the LoRA moves the output by {effect:.2e} of it)"
    )
    if not err <= TOLERANCE:
        sys.exit(f"check_lora_export: {err:.2e} above {TOLERANCE:.0e}")


if __name__ == "__main__":
    run_halves(__doc__, write, check, "folder for the LoRA file and cases.npz")
