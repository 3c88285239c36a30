"""Write tests/data/sit_sampling/reference.npz: what willisma/SiT's own sampling code (`transport/`,
as sample.py and sample_ddp.py call it) computes from given noise with the tiny random-weight SiT of
tests/data/sit (tools/make_sit_fixtures.py), for tests/pretrained/test_sit_sampling.py.

The official code is imported from a clone of https://github.com/willisma/SiT given as `--sit` (written
against commit 947f95bd3a510e9af441d38c1e9f72e0eee873c5; MIT licence, not copied here), with torchdiffeq
(tools/requirements-sit-sampling.txt). Every case starts from the same noise `z` [b, h, w, c] (NHWC here,
NCHW for the official code) and labels `y`; with cfg (scale > 1) the batch is doubled as sample_ddp.py does
(`z` twice, the null label in the second half, `model.forward_with_cfg`) and every array keeps its 2b rows.

Arrays, NHWC float32, per case NAME:
- `NAME/x`: the official trajectory, `[steps, rows, h, w, c]` (float64 for the `_f64` cases): `sample_ode`'s
  odeint output at SiT's time grid linspace(t0, t1, steps); `sample_sde`'s list: one entry per SDE step,
  then the last step's;
- `NAME/w`: for the SDE, the unit normals each SDE step drew (`torch.randn`, recorded), `[steps - 1, rows, ...]`;
- `NAME/t_calls`: for dopri5, the time of every network call torchdiffeq made, in order.
`cases.json` gives each case's settings.

    tools/.venv/bin/pip install -r tools/requirements-sit-sampling.txt
    tools/.venv/bin/python tools/make_sit_sampling_fixtures.py --sit PATH/TO/SiT
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from make_dit_fixtures import official_models

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "tests" / "data" / "sit"
OUT = ROOT / "tests" / "data" / "sit_sampling"
LABELS = [1, 7]

# name: (mode, settings, cfg_scale[, dtype]); settings are sample_ode's / sample_sde's keyword arguments. The
# float64 runs (model and noise in float64) take dopri5's step sizes out of float32 rounding's reach.
CASES = {
    "ode_heun": ("ODE", dict(sampling_method="heun2", num_steps=11), 1.0),
    "ode_heun_cfg": ("ODE", dict(sampling_method="heun2", num_steps=11), 4.0),
    "ode_euler": ("ODE", dict(sampling_method="euler", num_steps=11), 1.0),
    "ode_dopri5": ("ODE", dict(sampling_method="dopri5", num_steps=2, atol=1e-6, rtol=1e-3), 1.0),
    "ode_dopri5_cfg": ("ODE", dict(sampling_method="dopri5", num_steps=2, atol=1e-6, rtol=1e-3), 4.0),
    "ode_dopri5_f64": ("ODE", dict(sampling_method="dopri5", num_steps=2, atol=1e-6, rtol=1e-3), 1.0, "float64"),
    "ode_dopri5_cfg_f64": ("ODE", dict(sampling_method="dopri5", num_steps=2, atol=1e-6, rtol=1e-3), 4.0, "float64"),
    "sde_euler_mean": ("SDE", dict(sampling_method="Euler", num_steps=12), 1.0),
    "sde_euler_mean_cfg": ("SDE", dict(sampling_method="Euler", num_steps=12), 4.0),
    "sde_heun_mean": ("SDE", dict(sampling_method="Heun", num_steps=12), 1.0),
    "sde_euler_tweedie": ("SDE", dict(sampling_method="Euler", num_steps=12, last_step="Tweedie"), 1.0),
    "sde_euler_euler": ("SDE", dict(sampling_method="Euler", num_steps=12, last_step="Euler", last_step_size=0.1), 1.0),
    "sde_euler_none": ("SDE", dict(sampling_method="Euler", num_steps=12, last_step=None), 1.0),
    "sde_euler_linear": (
        "SDE",
        dict(sampling_method="Euler", num_steps=12, diffusion_form="linear", diffusion_norm=0.5),
        1.0,
    ),
    "sde_heun_decreasing": (
        "SDE",
        dict(sampling_method="Heun", num_steps=12, diffusion_form="decreasing", diffusion_norm=2.0),
        1.0,
    ),
}
SDE_DEFAULTS = dict(diffusion_form="sigma", diffusion_norm=1.0, last_step="Mean", last_step_size=0.04)  # parse_sde_args


class Recorder:
    """Stands in for torch.randn while the SDE runs (integrators.py draws `th.randn(x.size())`)."""

    def __init__(self):
        self.draws, self.randn = [], torch.randn

    def __call__(self, *args, **kwargs):
        w = self.randn(*args, **kwargs)
        self.draws.append(w.clone())
        return w


def nhwc(x: torch.Tensor) -> np.ndarray:
    return x.permute(0, 2, 3, 1).numpy()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sit", type=Path, required=True, help="a clone of github.com/willisma/SiT")
    clone = parser.parse_args().sit
    if not (clone / "transport" / "transport.py").is_file():
        raise SystemExit(f"--sit {clone}: no transport/transport.py there; pass a clone of github.com/willisma/SiT")
    models = official_models(clone)
    sys.path.insert(0, str(clone))
    from transport import Sampler, create_transport

    config = json.loads((MODEL / "config.json").read_text())
    model = models.SiT(**config).eval()
    model.load_state_dict(torch.load(MODEL / "ema.pt", weights_only=True))
    c, size = config["in_channels"], config["input_size"]
    z = torch.randn(len(LABELS), c, size, size, generator=torch.Generator().manual_seed(1))
    y = torch.tensor(LABELS)
    sampler = Sampler(create_transport("Linear", "velocity"))  # sample.py's defaults: Linear, velocity, eps None
    arrays, cases = {"z": nhwc(z), "y": np.asarray(LABELS, np.int32)}, {}
    for i, (name, (mode, settings, cfg_scale, *dtype)) in enumerate(CASES.items()):
        dtype = getattr(torch, dtype[0] if dtype else "float32")
        model.to(dtype)
        # models.py embeds t in float32 (`.float()`), as eqxdiff's DiT does; its Linear then needs the model's dtype.
        embed = models.TimestepEmbedder.timestep_embedding
        model.t_embedder.timestep_embedding = lambda t, dim, embed=embed, dtype=dtype: embed(t, dim).to(dtype)
        if cfg_scale > 1:
            x0, kwargs = torch.cat([z, z]), dict(y=torch.cat([y, torch.full_like(y, config["num_classes"])]))
            forward, kwargs["cfg_scale"] = model.forward_with_cfg, cfg_scale
        else:
            x0, kwargs, forward = z, dict(y=y), model.forward
        x0 = x0.to(dtype)
        t_calls = []

        def net(x, t, t_calls=t_calls, forward=forward, **kw):
            t_calls.append(float(t[0]))
            return forward(x, t, **kw)

        torch.manual_seed(100 + i)
        with torch.no_grad():
            if mode == "ODE":
                xs = sampler.sample_ode(**settings)(x0, net, **kwargs)
            else:
                settings = {**SDE_DEFAULTS, **settings}
                recorder = torch.randn = Recorder()
                try:
                    xs = sampler.sample_sde(**settings)(x0, net, **kwargs)
                finally:
                    torch.randn = recorder.randn
                arrays[f"{name}/w"] = np.stack([nhwc(w) for w in recorder.draws])
        arrays[f"{name}/x"] = np.stack([nhwc(x) for x in xs])
        if settings["sampling_method"] == "dopri5":
            arrays[f"{name}/t_calls"] = np.asarray(t_calls, np.float64)
        cases[name] = dict(mode=mode, cfg_scale=cfg_scale, dtype=str(dtype).removeprefix("torch."), **settings)
        print(f"{name}: {len(t_calls)} network calls, final |x| max {xs[-1].abs().max():.3f}")
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **arrays)
    (OUT / "cases.json").write_text(json.dumps(cases, indent=1) + "\n")
    print(f"wrote {OUT}: {(OUT / 'reference.npz').stat().st_size / 1e3:.0f} kB")


if __name__ == "__main__":
    main()
