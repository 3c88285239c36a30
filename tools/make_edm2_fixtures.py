"""Write tests/data/edm2/: a small random-weight EDM2 network built by the official code (NVlabs/edm2's
training/networks_edm2.py `Precond`), pickled the way EDM2's training loop writes its network snapshots,
converted by tools/convert_edm2.py, and its outputs, for tests/nn/test_edm2.py.

The official code is imported from a clone of https://github.com/NVlabs/edm2 given as `--edm2` (written
against commit 4bf8162); it is not copied here, and neither is the pickle (it embeds that code: EDM2's
code is under CC BY-NC-SA 4.0, its LICENSE.txt).

- The snapshot: training_loop.py's `dnnlib.EasyDict(encoder, dataset_kwargs, loss_fn)` with `ema` the
  network `.eval().requires_grad_(False).to(torch.float16)`, `pickle.dump`ed (persistence embeds the
  source of each persistent class), into a temporary folder; converted by `convert_edm2.convert` to
  `network.safetensors` (float16, as published) and `network.json`. The conversion is checked here: the
  safetensors hold exactly the network's state_dict.
- `reference.npz`: inputs `x` [b, h, w, c] (NHWC), `sigma` [b], `y` [b] int labels (the last one
  `label_dim`: no class, EDM2's zero label vector), and the unpickled network's outputs in float32, NHWC:
  `denoised` = Precond(x, σ, one-hot y), `raw` = its UNet's F(c_in·x, ln(σ)/4, y), `logvar` [b].
- `official_shapes.json`: every state_dict key's shape of the full-size networks EDM2 publishes, built on
  torch's meta device (no weights): train_edm2.py's `edm2-img512-xs` (64×64×4 latents) and `edm2-img64-s`
  (64×64×3 pixels), 1000 classes, with the preset's constructor keywords.

The network: 8×8×3, 5 classes, model_channels 16, channel_mult (1, 2), 1 block per level, attention at
4×4 with 8 channels per head, logvar_channels 8, label_balance 0.4 and concat_balance 0.6 (EDM2's 0.5 would
hide a swapped balance); every trainable parameter moved off its init (the weights by N(0, 0.2²)·their scale,
the zero-initialised gains by N(0, 0.5²)).

    tools/.venv/bin/python tools/make_edm2_fixtures.py --edm2 PATH/TO/edm2
"""

import argparse
import copy
import json
import pickle
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "edm2"
CONFIG = dict(
    img_resolution=8,
    img_channels=3,
    label_dim=5,
    use_fp16=False,
    model_channels=16,
    channel_mult=[1, 2],
    num_blocks=1,
    attn_resolutions=[4],
    channels_per_head=8,
    logvar_channels=8,
    dropout=0.1,
    label_balance=0.4,
    concat_balance=0.6,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--edm2", type=Path, required=True, help="a clone of github.com/NVlabs/edm2")
    clone = parser.parse_args().edm2.resolve()
    sys.path.insert(0, str(clone))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import dnnlib  # noqa: PLC0415 — EDM2's, from the clone
    from convert_edm2 import convert  # noqa: PLC0415
    from training.encoders import StandardRGBEncoder  # noqa: PLC0415
    from training.networks_edm2 import Precond  # noqa: PLC0415
    from training.training_loop import EDM2Loss  # noqa: PLC0415

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    net = Precond(**CONFIG)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.add_((0.5 if p.ndim == 0 else 0.2 * p.std()) * torch.randn(p.shape, generator=gen))
    data = dnnlib.EasyDict(encoder=StandardRGBEncoder(), dataset_kwargs={}, loss_fn=EDM2Loss())
    data.ema = copy.deepcopy(net).cpu().eval().requires_grad_(False).to(torch.float16)

    OUT.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        pkl = Path(tmp) / "network-snapshot-0000000-0.100.pkl"
        with open(pkl, "wb") as f:
            pickle.dump(data, f)
        with open(pkl, "rb") as f:  # what a user of a published pickle has
            loaded = pickle.load(f)["ema"].float().eval()
        convert(pkl, OUT / "network")
    converted = load_file(str(OUT / "network.safetensors"))
    state = loaded.state_dict()
    assert converted.keys() == state.keys() and all(torch.equal(converted[k].float(), state[k]) for k in state), (
        "convert_edm2 did not write the network's state_dict"
    )

    b = 3
    x = torch.randn(b, 3, 8, 8, generator=gen)
    sigma = torch.tensor([0.02, 0.7, 25.0])
    y = torch.tensor([2, 0, CONFIG["label_dim"]])
    onehot = torch.nn.functional.one_hot(y, CONFIG["label_dim"] + 1)[:, :-1].float()
    with torch.no_grad():
        denoised, logvar = loaded(x * sigma.reshape(-1, 1, 1, 1), sigma, onehot, return_logvar=True)
        c_in = 1 / (0.5**2 + sigma**2).sqrt().reshape(-1, 1, 1, 1)
        raw = loaded.unet(c_in * x * sigma.reshape(-1, 1, 1, 1), sigma.log() / 4, onehot)
    nhwc = lambda a: a.permute(0, 2, 3, 1).numpy()  # noqa: E731
    np.savez(
        OUT / "reference.npz",
        x=nhwc(x * sigma.reshape(-1, 1, 1, 1)),
        sigma=sigma.numpy(),
        y=y.numpy().astype(np.int32),
        denoised=nhwc(denoised),
        raw=nhwc(raw),
        logvar=logvar.reshape(-1).numpy(),
    )
    shapes = {}
    for preset, channels, img in (("img512-xs", 128, (64, 4)), ("img64-s", 192, (64, 3))):
        kwargs = dict(img_resolution=img[0], img_channels=img[1], label_dim=1000, model_channels=channels)
        with torch.device("meta"):
            state = Precond(**kwargs).state_dict()
        shapes[preset] = {"network": kwargs, "shapes": {k: list(v.shape) for k, v in state.items()}}
    (OUT / "official_shapes.json").write_text(json.dumps(shapes) + "\n")
    print(json.dumps({k: list(v.shape) for k, v in np.load(OUT / "reference.npz").items()}))


if __name__ == "__main__":
    main()
