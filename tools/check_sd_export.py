"""Check `eqxdiff.sd.save_diffusers` / `save_pipeline` against diffusers: the folders eqxdiff writes are
loaded by diffusers' `UNet2DConditionModel.from_pretrained`, `AutoencoderKL.from_pretrained`,
`StableDiffusionPipeline.from_pretrained` and `StableDiffusionXLPipeline.from_pretrained`, and their outputs
compared with eqxdiff's on the same inputs. Two halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_sd_export.py write --out /tmp/sd_export   # eqxdiff's side
    tools/.venv/bin/python tools/check_sd_export.py check --out /tmp/sd_export         # diffusers'

`write` takes the committed fixtures (tests/data/sd_unet/*, autoencoder_kl/sd_like, the SD 1.x and SDXL pipelines
of tests/sd/test_sd_pipeline.py), moves every weight off the fixture's (a stand-in for fine-tuning, so a folder
diffusers could read only from the fixture would not pass), saves them with eqxdiff's exporters (the UNets in
float32, the SD 1.x-like one also as float16 and bfloat16 files) and eqxdiff's outputs in `cases.npz`: each UNet
on its reference inputs, the VAE's decode and encode, each pipeline's latents (4 steps, cfg 5, a prompt and a
negative prompt each, SDXL's size/crop conditioning) sampled by eqxdiff from the folder it wrote. `check` prints
max |diffusers - eqxdiff| / max |eqxdiff| for each and how far the weights moved the output from the fixture's
(so an exporter that wrote the old weights would show), and fails above 1e-4 (the issue's bar).
"""

import sys
from pathlib import Path

import numpy as np
from two_halves import run_halves  # tools/two_halves.py: the write/check command line

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
UNETS = ["sd1_like", "sd2_like", "sdxl_like", "upscaler_like", "unclip_like"]
TOLERANCE = 1e-4  # relative to the output's largest value
PROMPTS, NEGATIVE, STEPS, CFG = ["a photo of a cat", "wow! a dog!!"], ["blurry, ugly", ""], 4, 5.0
MICRO = dict(original_size=(40, 24), crops_coords_top_left=(2, 3), target_size=(32, 28))
UNET_DTYPES = {"sd1_like": ["float32", "float16", "bfloat16"]}  # the others: float32


def write(out: Path) -> None:
    """eqxdiff's side (the main venv)."""
    import dataclasses

    import equinox as eqx
    import jax

    sys.path.insert(0, str(ROOT / "tests"))
    from test_sd_pipeline import assemble, nhwc, reference
    from test_sd_unet import cond_of

    from eqxdiff.nn import AutoencoderKL
    from eqxdiff.sd import SDUNet
    from eqxdiff.sd import load_sd, save_diffusers, save_pipeline

    def moved(model, seed: int):  # every weight moved by 10% of its leaf's spread (or 0.01 for a constant leaf)
        params, static = eqx.partition(model, eqx.is_array)
        leaves, treedef = jax.tree.flatten(params)
        keys = jax.random.split(jax.random.key(seed), len(leaves))
        new = [
            x + 0.1 * (float(np.std(x)) or 0.1) * jax.random.normal(k, x.shape, x.dtype)
            for k, x in zip(keys, leaves, strict=True)
        ]
        return eqx.combine(jax.tree.unflatten(treedef, new), static)

    forward = eqx.filter_jit(lambda unet, x, t, cond: unet(x, t, cond))
    cases = {}
    for i, name in enumerate(UNETS):
        ref = dict(np.load(DATA / "sd_unet" / name / "reference.npz"))
        unet = moved(SDUNet.from_diffusers(DATA / "sd_unet" / name), i)
        cases[f"unet/{name}/fixture"] = ref["out"]
        for dtype in UNET_DTYPES.get(name, ["float32"]):
            folder = save_diffusers(unet, out / "unet" / f"{name}-{dtype}", dtype=dtype, overwrite=True)
            cases[f"unet/{name}-{dtype}"] = np.asarray(
                forward(SDUNet.from_diffusers(folder), ref["x"], ref["t"], cond_of(ref))
            )

    vae = moved(AutoencoderKL.from_diffusers(DATA / "autoencoder_kl" / "sd_like"), 10)
    save_diffusers(vae, out / "vae", overwrite=True)
    vae = AutoencoderKL.from_diffusers(out / "vae")
    z = np.asarray(jax.random.normal(jax.random.key(11), (2, 8, 8, 4)))
    x = np.asarray(jax.random.uniform(jax.random.key(12), (2, 32, 32, 3), minval=-1, maxval=1))
    cases |= {
        "vae/z": z,
        "vae/x": x,
        "vae/decode": np.asarray(eqx.filter_jit(vae.decode)(z)),
        "vae/encode_mean": np.asarray(eqx.filter_jit(vae.encode)(x)[0]),
    }

    for family in ("sd1", "sdxl"):
        source = (
            assemble(family, out / "sources" / family)
            if not (out / "sources" / family).is_dir()
            else out / "sources" / family
        )
        pipe = load_sd(source)
        if family == "sd1":
            prompts = dataclasses.replace(pipe.prompts, encoder=moved(pipe.prompts.encoder, 20))
        else:
            prompts = dataclasses.replace(pipe.prompts, encoders=moved(pipe.prompts.encoders, 21))
        pipe = dataclasses.replace(pipe, unet=moved(pipe.unet, 22), prompts=prompts, vae=moved(pipe.vae, 23))
        folder = save_pipeline(pipe, out / "pipelines" / family, tokenizers=source, overwrite=True)
        ref = reference(family)
        micro = MICRO if family == "sdxl" else {}
        again = load_sd(folder)  # eqxdiff samples the folder it wrote
        cases[f"pipeline/{family}"] = np.asarray(
            again.latents(PROMPTS, NEGATIVE, steps=STEPS, guidance=CFG, initial_latents=nhwc(ref["latents"]), **micro)
        )
        cases[f"pipeline/{family}/fixture"] = nhwc(ref["euler_latents" if family == "sdxl" else "ddim_latents"])
        cases[f"pipeline/{family}/initial"] = ref["latents"]
    np.savez(out / "cases.npz", **cases)
    print(
        f"wrote {len(UNETS)} UNets ({sum(len(UNET_DTYPES.get(n, [1])) for n in UNETS)} folders), a VAE and "
        f"2 pipelines to {out}"
    )


def relative(got, want) -> float:
    return float(np.abs(got - want).max() / np.abs(want).max())


def check(out: Path) -> None:
    """diffusers' side (tools/.venv with tools/requirements-ports.txt)."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel

    torch.set_num_threads(1)
    cases = dict(np.load(out / "cases.npz"))
    nchw, nhwc = (
        (lambda a: torch.from_numpy(np.ascontiguousarray(np.transpose(a, (0, 3, 1, 2))))),
        (lambda t: t.permute(0, 2, 3, 1).numpy()),
    )
    rows, worst = [], 0.0
    with torch.no_grad():
        for name in UNETS:
            ref = dict(np.load(DATA / "sd_unet" / name / "reference.npz"))
            kwargs = {"encoder_hidden_states": torch.from_numpy(ref["context"])}
            if "class_labels" in ref:
                kwargs["class_labels"] = torch.from_numpy(ref["class_labels"])
            if "time_ids" in ref:
                kwargs["added_cond_kwargs"] = {
                    "text_embeds": torch.from_numpy(ref["pooled"]),
                    "time_ids": torch.from_numpy(ref["time_ids"]),
                }
            for dtype in UNET_DTYPES.get(name, ["float32"]):
                unet = UNet2DConditionModel.from_pretrained(out / "unet" / f"{name}-{dtype}", torch_dtype=torch.float32)
                got = nhwc(unet.eval()(nchw(ref["x"]), torch.from_numpy(ref["t"]), **kwargs).sample)
                want = cases[f"unet/{name}-{dtype}"]
                rows.append(
                    (
                        f"UNet2DConditionModel {name} ({dtype} file)",
                        relative(got, want),
                        relative(cases[f"unet/{name}/fixture"], want),
                    )
                )
        vae = AutoencoderKL.from_pretrained(out / "vae", torch_dtype=torch.float32).eval()
        got = nhwc(vae.decode(nchw(cases["vae/z"])).sample)
        rows.append(("AutoencoderKL decode", relative(got, cases["vae/decode"]), float("nan")))
        got = nhwc(vae.encode(nchw(cases["vae/x"])).latent_dist.mean)
        rows.append(("AutoencoderKL encode (mean)", relative(got, cases["vae/encode_mean"]), float("nan")))
        for family, cls in (("sd1", StableDiffusionPipeline), ("sdxl", StableDiffusionXLPipeline)):
            extra = {"add_watermarker": False} if family == "sdxl" else {}
            pipe = cls.from_pretrained(out / "pipelines" / family, torch_dtype=torch.float32, **extra)
            micro = MICRO if family == "sdxl" else {}
            latents = pipe(
                prompt=PROMPTS,
                negative_prompt=NEGATIVE,
                num_inference_steps=STEPS,
                guidance_scale=CFG,
                latents=torch.from_numpy(cases[f"pipeline/{family}/initial"]),
                height=32,
                width=32,
                output_type="latent",
                **micro,
            ).images
            want = cases[f"pipeline/{family}"]
            rows.append(
                (
                    f"{cls.__name__} latents ({type(pipe.scheduler).__name__})",
                    relative(nhwc(latents), want),
                    relative(cases[f"pipeline/{family}/fixture"], want),
                )
            )
    for label, err, moved in rows:
        change = "" if np.isnan(moved) else f" (the moved weights change it by {moved:.2e} from the fixture's)"
        print(f"{label}: max |diffusers - eqxdiff| / max |eqxdiff| = {err:.2e}{change}")
        worst = max(worst, err)
    if not worst <= TOLERANCE:
        sys.exit(f"check_sd_export: {worst:.2e} above {TOLERANCE:.0e}")
    print(f"all {len(rows)} within {TOLERANCE:.0e} (worst {worst:.2e})")


if __name__ == "__main__":
    run_halves(__doc__, write, check, "folder for the exported models and cases.npz")
