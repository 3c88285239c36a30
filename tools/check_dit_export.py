"""Check `eqxdiff.pretrained.save_dit` against the official code: facebookresearch/DiT's `models.py` loads
each file eqxdiff saved — the `.pt` through DiT's own `download.find_model` (`torch.load`, as `sample.py
--ckpt` reads one), the `.safetensors` by `safetensors.torch.load_file` — with a strict `load_state_dict`,
and its `forward(x, t, y)` is compared with eqxdiff's on the same inputs. Two halves, two venvs:

    PYTHONPATH=. .venv/bin/python tools/check_dit_export.py write --out /tmp/dit_export    # eqxdiff's side
    tools/.venv/bin/python tools/check_dit_export.py check --out /tmp/dit_export --dit PATH/TO/DiT   # torch's

`write` saves, with random weights every one moved off its init (adaLN-Zero's zeros too): a DiT built as
`--model dit_s` builds it (DiT-S/2, learn_sigma off, loaded as `DiT_models["DiT-S/2"]`), a small one with
learn_sigma and patch 4 (loaded as `DiT(...)` with its sizes), and the official fixture read by `load_dit`
and saved again; each with inputs (NHWC x, t, labels with the null class) and eqxdiff's outputs in
`cases.npz`; for the learn_sigma ones also `sample_dit`'s DDIM latents ("ddim10", cfg 1.5 on 3 channels)
from a given x_T. `check` prints each case's and format's max |official - eqxdiff| and relative error for
the forward and, from the `.pt` as DiT's `sample.py --ckpt` reads it, for `create_diffusion("ddim10")
.ddim_sample_loop` with `forward_with_cfg` (sample.py's set-up), and fails above 1e-4 (forward) or 1e-3
(sampling, as tests/pretrained/test_dit_sampling.py's bound) relative. The official code comes from a clone given as `--dit` (timm stood in as
tools/make_dit_fixtures.py does; torchvision, which download.py imports for downloads only, too).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 1e-4  # relative to the output's largest value; float32 on both sides, summed in other orders
SAMPLING_TOLERANCE = 1e-3  # ten network calls' float32 differences, carried through the DDIM steps
STEPS, CFG = "ddim10", 1.5


def write(out: Path) -> None:
    """eqxdiff's side: the saved files, the inputs and eqxdiff's outputs (the main venv)."""
    import jax
    import jax.numpy as jnp

    from eqxdiff.nn import DiT
    from eqxdiff.pretrained import load_dit, sample_dit, save_dit

    def moved(model, seed):
        leaves, treedef = jax.tree.flatten(model)
        rng = np.random.default_rng(seed)
        return jax.tree.unflatten(
            treedef,
            [x + rng.normal(0, 0.05, x.shape).astype(np.float32) if isinstance(x, jax.Array) else x for x in leaves],
        )

    key = jax.random.key(0)
    cases = {
        # name: (eqxdiff model, how the official code builds it: a DiT_models entry or DiT's arguments)
        "dit_s": (
            moved(DiT.small(8, 4, 2, num_classes=10, key=key), 1),
            {"DiT_models": "DiT-S/2", "input_size": 8, "num_classes": 10, "learn_sigma": False},
        ),
        "learn_sigma_p4": (
            moved(DiT(8, 4, 4, 64, 2, 4, num_classes=10, learn_sigma=True, key=key), 2),
            {
                "input_size": 8,
                "patch_size": 4,
                "in_channels": 4,
                "hidden_size": 64,
                "depth": 2,
                "num_heads": 4,
                "num_classes": 10,
                "learn_sigma": True,
            },
        ),
        "loaded_fixture": (
            load_dit(ROOT / "tests" / "data" / "dit" / "ema.safetensors", num_heads=2),
            json.loads((ROOT / "tests" / "data" / "dit" / "config.json").read_text()),
        ),
    }
    out.mkdir(parents=True, exist_ok=True)
    rng, arrays = np.random.default_rng(0), {}
    for name, (model, official) in cases.items():
        save_dit(model, out / f"{name}.safetensors")
        save_dit(model, out / f"{name}.pt")
        size, c = model.image_size, model.in_channels
        x = rng.normal(size=(4, size, size, c)).astype(np.float32)
        t, y = np.array([0.0, 17.0, 500.0, 999.0], np.float32), np.array([0, 3, 9, model.num_classes], np.int32)
        arrays |= {
            f"{name}/x": x,
            f"{name}/t": t,
            f"{name}/y": y,
            f"{name}/out": np.asarray(model(jnp.asarray(x), jnp.asarray(t), jnp.asarray(y))),
        }
        if model.learn_sigma:  # DiT's protocol samples learn_sigma DiTs (its create_diffusion's default)
            labels = y[:3]  # real classes only
            arrays[f"{name}/sampled"] = np.asarray(
                sample_dit(model, jnp.asarray(labels), jnp.asarray(x[:3]), steps=STEPS, method="ddim", guidance=CFG)
            )
        (out / f"{name}.json").write_text(json.dumps(official))
    np.savez(out / "cases.npz", **arrays)
    print(f"wrote {', '.join(cases)} to {out}")


def check(out: Path, dit: Path) -> None:
    """torch's side: each file into the official model, its forward against eqxdiff's (tools/.venv)."""
    import types

    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(Path(__file__).parent))
    from make_dit_fixtures import official_models

    models = official_models(dit)
    if "torchvision" not in sys.modules:  # download.py's import, used only to download published checkpoints
        utils = types.ModuleType("torchvision.datasets.utils")
        utils.download_url = lambda *a, **k: sys.exit("check_dit_export: no downloads")
        sys.modules.update(
            {
                "torchvision": types.ModuleType("torchvision"),
                "torchvision.datasets": types.ModuleType("torchvision.datasets"),
                "torchvision.datasets.utils": utils,
            }
        )
    from diffusion import create_diffusion
    from download import find_model  # DiT's, from the clone (models.py put it on sys.path)

    arrays, worst, worst_sampling = np.load(out / "cases.npz"), 0.0, 0.0
    for spec in sorted(out.glob("*.json")):
        name, official = spec.stem, json.loads(spec.read_text())
        entry = official.pop("DiT_models", None)
        for suffix, read in ((".safetensors", load_file), (".pt", find_model)):  # the .pt's model samples below
            model = (models.DiT_models[entry](**official) if entry else models.DiT(**official)).eval()
            model.load_state_dict(read(str(out / f"{name}{suffix}")), strict=True)
            x, t, y = (torch.from_numpy(arrays[f"{name}/{k}"]) for k in "xty")
            with torch.no_grad():
                theirs = model(x.permute(0, 3, 1, 2), t, y.long()).permute(0, 2, 3, 1).numpy()
            ours = arrays[f"{name}/out"]
            diff, scale = np.abs(theirs - ours).max(), np.abs(theirs).max()
            worst = max(worst, diff / scale)
            print(
                f"{name}{suffix} ({entry or 'DiT(...)'}, out {list(ours.shape)}): max |official - eqxdiff| "
                f"{diff:.3g}, relative to the largest output {diff / scale:.3g}"
            )
        if f"{name}/sampled" in arrays:  # sample.py's set-up: z doubled, the null class, forward_with_cfg
            z, labels = x[:3].permute(0, 3, 1, 2), y[:3].long()
            kwargs = dict(y=torch.cat([labels, torch.full_like(labels, model.y_embedder.num_classes)]), cfg_scale=CFG)
            with torch.no_grad():
                latents = create_diffusion(STEPS).ddim_sample_loop(
                    model.forward_with_cfg,
                    (6, *z.shape[1:]),
                    torch.cat([z, z]),
                    clip_denoised=False,
                    model_kwargs=kwargs,
                    device="cpu",
                )
            theirs, ours = latents[:3].permute(0, 2, 3, 1).numpy(), arrays[f"{name}/sampled"]
            diff, scale = np.abs(theirs - ours).max(), np.abs(theirs).max()
            worst_sampling = max(worst_sampling, diff / scale)
            print(
                f"{name}.pt sampled ({STEPS}, cfg {CFG}): max |official - eqxdiff| {diff:.3g}, relative "
                f"{diff / scale:.3g}"
            )
    if worst > TOLERANCE or worst_sampling > SAMPLING_TOLERANCE:
        raise SystemExit(
            f"FAIL: relative differences {worst:.3g} (forward, bound {TOLERANCE}), {worst_sampling:.3g} "
            f"(sampling, bound {SAMPLING_TOLERANCE})"
        )
    print(
        f"OK: every saved DiT's official forward equals eqxdiff's within {TOLERANCE} relative, its official DDIM "
        f"samples sample_dit's within {SAMPLING_TOLERANCE}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("side", choices=("write", "check"), help="write: eqxdiff's side (main venv); check: torch's")
    parser.add_argument("--out", type=Path, required=True, help="a folder for the saved files and cases.npz")
    parser.add_argument("--dit", type=Path, help="check: a clone of github.com/facebookresearch/DiT")
    args = parser.parse_args()
    if args.side == "check" and not args.dit:
        parser.error("check needs --dit PATH: a clone of github.com/facebookresearch/DiT")
    write(args.out) if args.side == "write" else check(args.out, args.dit)


if __name__ == "__main__":
    main()
