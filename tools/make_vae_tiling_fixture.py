"""Write tests/data/autoencoder_kl/tiled/: diffusers' `AutoencoderKL` with `enable_tiling()` on a small
random VAE whose `sample_size` (32) makes the tiles small, for eqxdiff.nn.vae_tiling's parity test.

diffusers tiles an image larger than `sample_size` into `sample_size`² tiles at a stride of 3/4 of a
tile (`tile_overlap_factor` 0.25), encodes each, blends every tile into the one above and the one to
its left over a quarter of a latent tile (`blend_v`, `blend_h`, in place, so a tile's neighbours are
already blended when it is), and keeps the top-left `tile - blend` of each; decoding tiles the latent
the same way. The 40×76 images (latents 10×19 at f = 4) give two rows of four tiles, the last ones
cut short by the image's edge (a last column of one latent pixel, narrower than the blend).

The VAE is make_reference_fixtures.py's `sd_like` (same config, seed and weights: the test reads them
from `sd_like/`, checked equal here) with `sample_size` 32. reference.npz: `x_uint8` (images as uint8,
the model sees x/127.5 - 1, NHWC), the tiled posterior `mean` and `logvar`, a latent `z` ~ N(0, 1) and
the tiled `decoded` = decode(z) (NHWC float32).

    tools/.venv/bin/python tools/make_vae_tiling_fixture.py     # requirements-ports.txt
"""

import numpy as np
import torch
from safetensors.torch import load_file

from make_reference_fixtures import OUT, SMALL, nhwc, random_vae  # tools/ is on sys.path

CONFIG = SMALL["sd_like"][0] | {"sample_size": 32}
HEIGHT, WIDTH, BATCH = 40, 76, 2


def main() -> None:
    torch.set_num_threads(1)
    vae = random_vae(CONFIG, seed=0)  # sd_like's seed: its committed weights
    for key, value in load_file(str(OUT / "sd_like" / "diffusion_pytorch_model.safetensors")).items():
        assert torch.equal(vae.state_dict()[key], value), key
    vae.enable_tiling()
    assert vae.tile_sample_min_size == 32 and vae.tile_latent_min_size == 8 and vae.tile_overlap_factor == 0.25
    rng = np.random.default_rng(12)
    x_uint8 = rng.integers(0, 256, (BATCH, HEIGHT, WIDTH, 3), dtype=np.uint8)
    x = torch.from_numpy(x_uint8).permute(0, 3, 1, 2).float() / 127.5 - 1
    z = torch.from_numpy(rng.standard_normal((BATCH, 4, HEIGHT // 4, WIDTH // 4)).astype(np.float32))
    with torch.no_grad():
        posterior = vae.encode(x).latent_dist
        decoded = vae.decode(z).sample
        vae.disable_tiling()
        untiled = vae.decode(z).sample
    # Tiling changes the result (each tile sees only its own part of the image): else the test proves nothing.
    assert (decoded - untiled).abs().max() > 0.05, (decoded - untiled).abs().max()
    refs = {
        "x_uint8": x_uint8,
        "mean": nhwc(posterior.mean),
        "logvar": nhwc(posterior.logvar),
        "z": nhwc(z),
        "decoded": nhwc(decoded),
    }
    (OUT / "tiled").mkdir(exist_ok=True)
    np.savez_compressed(OUT / "tiled" / "reference.npz", **refs)


if __name__ == "__main__":
    main()
