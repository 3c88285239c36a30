"""Write tests/data/dit_sampling/: facebookresearch/DiT's own sampling (its `diffusion/` package, as `sample.py`
calls it) run on the small random-weight DiT of tests/data/dit/, for tests/pretrained/test_dit_sampling.py.

The official code is imported from a clone of https://github.com/facebookresearch/DiT given as `--dit`
(written against commit ed81ce2229091fd4ecc9a223645f95cf379d582b), not copied (CC BY-NC 4.0); timm's layers
are tools/make_dit_fixtures.py's stand-ins where timm does not import. The network is tests/data/dit/'s
`ema.safetensors` loaded into DiT's `models.DiT` (tests/data/dit/config.json), in eval mode.

- `respacing.json`: `sorted(space_timesteps(1000, spec))` for several respacings.
- `reference.npz` (NHWC float32; b = 2 samples, labels `labels`, x_T `noise`):
  - `ddim_<steps>_cfg<scale>`: `create_diffusion(steps).ddim_sample_loop` from `noise` (eta 0, clip_denoised
    False), with `model.forward` at scale 1 and `forward_with_cfg` on the doubled batch (null class 10) above,
    the conditional half kept; `..._all`: the same with guidance on all 4 latent channels (the line
    forward_with_cfg has commented out).
  - `pmv_*`: `p_mean_variance` of `create_diffusion("25")` at respaced steps `pmv_t` of inputs `pmv_x`
    [k, b, h, w, c]: `pmv_mean_cfg<scale>`, `pmv_log_variance_cfg<scale>` (scale 1 and 4).
  - `ddpm_25_cfg4.0`: `p_sample_loop` from `noise` at cfg 4 as sample.py runs it, with every unit noise it
    drew (`th.randn_like`, recorded) in `ddpm_25_noises` [25, b, h, w, c] (conditional half; the first
    entry is the first step's).

    tools/.venv/bin/python tools/make_dit_sampling_fixtures.py --dit PATH/TO/DiT
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_dit_fixtures import official_models  # noqa: E402  (tools/, the timm stand-ins)

DATA = Path(__file__).resolve().parent.parent / "tests" / "data"
OUT = DATA / "dit_sampling"
RESPACINGS = ["250", "25", "ddim50", "ddim10", "10", "10,15,20", "7,1,3"]
LABELS = [3, 7]
DDIM = [("ddim10", 1.0), ("ddim10", 1.5), ("ddim10", 4.0), ("10", 4.0)]
PMV_STEPS = [24, 23, 12, 1, 0]  # respaced indices of "25": the first step, ..., the last (t = 0)


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(0, 2, 3, 1).numpy()


def guided(model, scale: float, channels: int):
    """forward_with_cfg with its guided channel count as a parameter (3 as published; 4 its commented line)."""

    def forward(x, t, y):
        half = x[: len(x) // 2]
        out = model.forward(torch.cat([half, half], dim=0), t, y)
        eps, rest = out[:, :channels], out[:, channels:]
        cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
        half_eps = uncond_eps + scale * (cond_eps - uncond_eps)
        return torch.cat([torch.cat([half_eps, half_eps], dim=0), rest], dim=1)

    return forward


def model_call(model, scale: float, z: torch.Tensor, y: torch.Tensor, all_channels: bool = False):
    """(function, x_T, model_kwargs) as DiT's sample_ddp.py sets them up: the doubled batch only with guidance."""
    if scale == 1.0:
        return model.forward, z, dict(y=y)
    if all_channels:
        fn = guided(model, scale, model.in_channels)
    else:
        fn = model.forward_with_cfg
        assert np.allclose(  # the stand-in computes what DiT's own forward_with_cfg does
            guided(model, scale, 3)(torch.cat([z, z]), torch.tensor([5, 5, 5, 5]), torch.cat([y, 0 * y + 10])).numpy(),
            fn(torch.cat([z, z]), torch.tensor([5, 5, 5, 5]), torch.cat([y, 0 * y + 10]), scale).numpy(),
        )
        return fn, torch.cat([z, z]), dict(y=torch.cat([y, torch.full_like(y, 10)]), cfg_scale=scale)
    return fn, torch.cat([z, z]), dict(y=torch.cat([y, torch.full_like(y, 10)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dit", type=Path, required=True, help="a clone of github.com/facebookresearch/DiT")
    dit = parser.parse_args().dit
    models = official_models(dit)
    from diffusion import create_diffusion
    from diffusion.respace import space_timesteps

    config = json.loads((DATA / "dit" / "config.json").read_text())
    model = models.DiT(**config).eval()
    model.load_state_dict(load_file(DATA / "dit" / "ema.safetensors"), strict=False)  # pos_embed: a fixed buffer
    torch.set_grad_enabled(False)
    OUT.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    b, size, c = len(LABELS), config["input_size"], config["in_channels"]
    z = torch.randn(b, c, size, size, generator=gen)
    y = torch.tensor(LABELS)
    ref = dict(labels=np.array(LABELS, np.int32), noise=nhwc(z))

    for steps, scale in DDIM:
        for all_channels in (False, True) if (steps, scale) == ("ddim10", 4.0) else (False,):
            fn, x_T, kwargs = model_call(model, scale, z, y, all_channels)
            loop = create_diffusion(steps).ddim_sample_loop
            out = loop(fn, x_T.shape, x_T, clip_denoised=False, model_kwargs=kwargs, device="cpu")
            ref[f"ddim_{steps}_cfg{scale}" + ("_all" if all_channels else "")] = nhwc(out[:b])

    diffusion = create_diffusion("25")
    pmv_x = torch.randn(len(PMV_STEPS), b, c, size, size, generator=gen)
    ref["pmv_t"] = np.array(PMV_STEPS, np.int32)
    ref["pmv_x"] = np.stack([nhwc(x) for x in pmv_x])
    for scale in (1.0, 4.0):
        means, log_variances = [], []
        for i, x in zip(PMV_STEPS, pmv_x):
            fn, x_in, kwargs = model_call(model, scale, x, y)
            t = torch.full((len(x_in),), i)
            out = diffusion.p_mean_variance(fn, x_in, t, clip_denoised=False, model_kwargs=kwargs)
            means.append(nhwc(out["mean"][:b]))
            log_variances.append(nhwc(out["log_variance"][:b]))
        ref[f"pmv_mean_cfg{scale}"], ref[f"pmv_log_variance_cfg{scale}"] = np.stack(means), np.stack(log_variances)

    drawn, randn_like = [], torch.randn_like

    def recorded(x, *args, **kwargs):
        noise = torch.randn(x.shape, generator=gen, dtype=x.dtype)
        drawn.append(nhwc(noise[:b]))
        return noise

    fn, x_T, kwargs = model_call(model, 4.0, z, y)
    torch.randn_like = recorded  # gaussian_diffusion draws as th.randn_like(x)
    try:
        out = diffusion.p_sample_loop(fn, x_T.shape, x_T, clip_denoised=False, model_kwargs=kwargs, device="cpu")
    finally:
        torch.randn_like = randn_like
    assert len(drawn) == 25, len(drawn)
    ref["ddpm_25_cfg4.0"], ref["ddpm_25_noises"] = nhwc(out[:b]), np.stack(drawn)
    for name, value in ref.items():
        assert np.isfinite(value).all() and (value.dtype != np.float32 or np.abs(value).max() > 0.1), name
    np.savez(OUT / "reference.npz", **ref)
    respacing = {spec: sorted(int(t) for t in space_timesteps(1000, spec)) for spec in RESPACINGS}
    (OUT / "respacing.json").write_text(json.dumps(respacing, separators=(",", ":")) + "\n")
    print(f"wrote {OUT}", {k: float(np.abs(v).max()) for k, v in ref.items() if k.startswith(("ddim", "ddpm"))})


if __name__ == "__main__":
    main()
