"""Write tests/data/sit/: a small random-weight SiT built by the official code (willisma/SiT's
`models.py`), saved the ways SiT's checkpoints are published, and its outputs, for
tests/pretrained/test_pretrained_sit.py (eqxdiff.pretrained.load_sit reads them without torch).

The official model code is imported from a clone of https://github.com/willisma/SiT given as `--sit`
(written against commit 947f95bd3a510e9af441d38c1e9f72e0eee873c5); it is not copied here: SiT's code is
under the MIT licence (its LICENSE.txt). timm's three layers are stood in for as in
tools/make_dit_fixtures.py (imported from it).

- `train_checkpoint.pt`: what SiT's train.py saves, `{"model", "ema", "opt", "args"}` (zip format),
  "model" moved further than "ema"; `ema.pt`: the bare "ema" state_dict as SiT-XL-2-256x256.pt is
  published (zip format); `ema.safetensors`: the same as safetensors.
- `reference.npz`: `x` [b, h, w, c] (NHWC), `t` [b] in [0, 1], `y` [b] (the last one the null class)
  and `out` = the official `forward(x, t, y)` in eval mode, NHWC [b, h, w, c] (learn_sigma's second
  half dropped, as SiT's forward does); `config.json`: the constructor arguments.
- The official SiT-XL/2 (256², latent 32) state_dict shapes are checked equal to DiT-XL/2's in
  tests/data/dit/official_shapes.json (so the configuration reading tested there holds for SiT).

The network: depth 2, hidden 32, 2 heads, patch 2, input 8, 4 channels, 10 classes, learn_sigma;
every trainable parameter moved off its init by N(0, 0.2²), the frozen sin-cos `pos_embed` as set.

    tools/.venv/bin/python tools/make_sit_fixtures.py --sit PATH/TO/SiT
"""

import argparse
import json
from pathlib import Path

import torch
from make_dit_fixtures import official_models, perturbed, write_reference
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "data" / "sit"
CONFIG = dict(
    input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=2, num_heads=2, num_classes=10, learn_sigma=True
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sit", type=Path, required=True, help="a clone of github.com/willisma/SiT")
    clone = parser.parse_args().sit
    if not (clone / "models.py").is_file() or "class SiT(" not in (clone / "models.py").read_text():
        raise SystemExit(f"--sit {clone}: no SiT models.py there; pass a clone of github.com/willisma/SiT")
    models = official_models(clone)
    OUT.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = models.SiT(**CONFIG).eval()
    ema = perturbed(model, gen, 0.2)
    x = torch.randn(4, CONFIG["in_channels"], CONFIG["input_size"], CONFIG["input_size"], generator=gen)
    t = torch.tensor([0.0, 0.02, 0.5, 1.0])  # SiT's time in [0, 1], fed to the embedding unscaled
    y = torch.tensor([0, 3, 9, CONFIG["num_classes"]])
    with torch.no_grad():
        out = model(x, t, y)
    assert out.shape[1] == CONFIG["in_channels"] and out.abs().mean() > 0.1, "a degenerate reference"
    trained = perturbed(model, gen, 0.05)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    args = argparse.Namespace(model="SiT-XL/2", image_size=64, num_classes=CONFIG["num_classes"], path_type="Linear")
    torch.save({"model": trained, "ema": ema, "opt": opt.state_dict(), "args": args}, OUT / "train_checkpoint.pt")
    torch.save(ema, OUT / "ema.pt")
    save_file({k: v.contiguous() for k, v in ema.items()}, OUT / "ema.safetensors")
    write_reference(OUT, x, t, y, out, CONFIG)
    with torch.device("meta"):
        net = models.SiT_models["SiT-XL/2"](input_size=32, num_classes=1000)
    sit_shapes = {k: list(v.shape) for k, v in net.state_dict().items()}
    dit_shapes = json.loads((ROOT / "tests" / "data" / "dit" / "official_shapes.json").read_text())["DiT-XL/2 256"]
    assert sit_shapes == dit_shapes, "SiT-XL/2's state_dict is not DiT-XL/2's"
    print(f"wrote {OUT}; SiT-XL/2's {len(sit_shapes)} state_dict shapes equal DiT-XL/2's")


if __name__ == "__main__":
    main()
