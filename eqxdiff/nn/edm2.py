"""EDM2's magnitude-preserving U-Net (Karras et al. 2024, Fig. 21; NVlabs/edm2 training/networks_edm2.py),
channels-last, under eqxdiff's model contract, with its uncertainty (`logvar`) head.

EDM2's `Precond` is eqxdiff's `Denoiser(EDM2UNet, EDMSchedule(), EDMPreconditioning(sigma_data))`: the same
c_skip, c_out, c_in, and the network's time t is the schedule's `sigma_to_t`, c_noise = ln(σ)/4. The
Precond's own parameters, the logvar head (`logvar_fourier`, `logvar_linear`: u(σ) of eq. 21), live here
as `EDM2UNet.logvar(t)`, read by the training loss (`eqxdiff.diffusion.uncertainty_weighted`).
"""

from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.nn.edm2_block import EDM2Block
from eqxdiff.nn.mp_layers import MPConv, MPFourier, mp_cat, mp_silu, mp_sum
from eqxdiff.nn.remat import checkpointed


class EDM2UNet(eqx.Module):
    """`model(x[b,h,w,c], t[b], cond, *, key=None) -> [b,h,w,c]`; `t` is c_noise = ln(σ)/4 (EDMSchedule);
    `cond` int32[b] labels (label `num_classes`, or None: no class, EDM2's zero label vector) or float[b, n]
    label vectors; `key` drives dropout (training), None: none.

    Levels `channel_mult` of `model_channels`·m channels, `num_blocks` blocks each (+1 in the decoder),
    self-attention at the resolutions in `attn_resolutions` and in the first innermost decoder block.
    `enc_names`/`dec_names` are EDM2's block names (`8x8_conv`, `4x4_down`, ...), in order.
    """

    emb_fourier: MPFourier
    emb_noise: MPConv
    emb_label: MPConv | None
    enc: tuple
    dec: tuple
    out_conv: MPConv
    out_gain: Float[Array, ""]
    logvar_fourier: MPFourier
    logvar_linear: MPConv
    enc_names: tuple[str, ...] = eqx.field(static=True)
    dec_names: tuple[str, ...] = eqx.field(static=True)
    num_classes: int = eqx.field(static=True)
    label_balance: float = eqx.field(static=True)
    concat_balance: float = eqx.field(static=True)
    remat: bool = eqx.field(static=True)

    # EDM2's train_edm2.py presets: name -> (model_channels, dropout); the rest of the network is the
    # UNet's defaults (channel_mult (1, 2, 3, 4), 3 blocks, attention at 16 and 8). img512: 64×64×4 latents.
    PRESETS: ClassVar[dict[str, tuple[int, float]]] = {
        "img512-xxs": (64, 0.0), "img512-xs": (128, 0.0), "img512-s": (192, 0.0), "img512-m": (256, 0.1),
        "img512-l": (320, 0.1), "img512-xl": (384, 0.1), "img512-xxl": (448, 0.1),
        "img64-xs": (128, 0.0), "img64-s": (192, 0.0), "img64-m": (256, 0.1), "img64-l": (320, 0.1),
        "img64-xl": (384, 0.1),
    }  # fmt: skip

    def __init__(self, in_channels: int, image_size: int, num_classes: int = 0, model_channels: int = 192,
                 channel_mult: tuple[int, ...] = (1, 2, 3, 4), channel_mult_noise: int | None = None,
                 channel_mult_emb: int | None = None, num_blocks: int = 3, attn_resolutions: tuple[int, ...] = (16, 8),
                 label_balance: float = 0.5, concat_balance: float = 0.5, logvar_channels: int = 128,
                 channels_per_head: int = 64, dropout: float | int = 0.0, res_balance: float = 0.3,
                 attn_balance: float = 0.3, clip_act: float | int | None = 256, remat: bool = False, *,
                 key: PRNGKeyArray):  # fmt: skip
        keys = iter(jax.random.split(key, 8 + 4 * len(channel_mult) * (num_blocks + 2)))
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        block = dict(channels_per_head=channels_per_head, dropout=dropout, res_balance=res_balance,
                     attn_balance=attn_balance, clip_act=clip_act)  # fmt: skip
        self.num_classes, self.remat = num_classes, remat
        self.label_balance, self.concat_balance = label_balance, concat_balance
        self.out_gain = jnp.zeros(())
        self.emb_fourier = MPFourier(cnoise, key=next(keys))
        self.emb_noise = MPConv(cnoise, cemb, (), key=next(keys))
        self.emb_label = MPConv(num_classes, cemb, (), key=next(keys)) if num_classes else None

        enc, cout = {}, in_channels + 1
        for level, channels in enumerate(cblock):
            res = image_size >> level
            if level == 0:
                cin, cout = cout, channels
                enc[f"{res}x{res}_conv"] = MPConv(cin, cout, (3, 3), key=next(keys))
            else:
                enc[f"{res}x{res}_down"] = EDM2Block(cout, cout, cemb, "enc", "down", **block, key=next(keys))
            for idx in range(num_blocks):
                cin, cout = cout, channels
                enc[f"{res}x{res}_block{idx}"] = EDM2Block(cin, cout, cemb, "enc", attention=res in attn_resolutions,
                                                           **block, key=next(keys))  # fmt: skip
        dec, skips = {}, [_out_channels(b) for b in enc.values()]
        for level, channels in reversed(list(enumerate(cblock))):
            res = image_size >> level
            if level == len(cblock) - 1:
                dec[f"{res}x{res}_in0"] = EDM2Block(cout, cout, cemb, "dec", attention=True, **block, key=next(keys))
                dec[f"{res}x{res}_in1"] = EDM2Block(cout, cout, cemb, "dec", **block, key=next(keys))
            else:
                dec[f"{res}x{res}_up"] = EDM2Block(cout, cout, cemb, "dec", "up", **block, key=next(keys))
            for idx in range(num_blocks + 1):
                cin, cout = cout + skips.pop(), channels
                dec[f"{res}x{res}_block{idx}"] = EDM2Block(cin, cout, cemb, "dec", attention=res in attn_resolutions,
                                                           **block, key=next(keys))  # fmt: skip
        self.enc_names, self.enc = tuple(enc), tuple(enc.values())
        self.dec_names, self.dec = tuple(dec), tuple(dec.values())
        self.out_conv = MPConv(cout, in_channels, (3, 3), key=next(keys))
        self.logvar_fourier = MPFourier(logvar_channels, key=next(keys))
        self.logvar_linear = MPConv(logvar_channels, 1, (), key=next(keys))

    @classmethod
    def preset(cls, name: str, in_channels: int, image_size: int, num_classes: int = 0, **kwargs) -> "EDM2UNet":
        """One of EDM2's configurations by name (`PRESETS`: "img512-s", "img64-xl", ...)."""
        if name not in cls.PRESETS:
            raise ValueError(f"EDM2UNet.preset: no preset {name!r}; the presets are {sorted(cls.PRESETS)}.")
        model_channels, dropout = cls.PRESETS[name]
        return cls(in_channels, image_size, num_classes, model_channels=model_channels, dropout=dropout, **kwargs)

    def __call__(self, x: Float[Array, "b h w c"], t: Float[Array, " b"],
                 cond: Int[Array, " b"] | Float[Array, "b n"] | None = None, *,
                 key: PRNGKeyArray | None = None) -> Float[Array, "b h w c"]:  # fmt: skip
        emb = self.emb_noise(self.emb_fourier(t))
        if self.emb_label is not None:
            labels = self.null_cond(x.shape[0]) if cond is None else cond
            onehot = jax.nn.one_hot(labels, self.num_classes, dtype=emb.dtype) if labels.ndim == 1 else labels
            label_emb = self.emb_label(onehot.astype(emb.dtype) * np.sqrt(self.num_classes))
            emb = mp_sum(emb, label_emb, t=self.label_balance)
        elif cond is not None:
            raise ValueError("A condition was given to an unconditional EDM2UNet (num_classes=0).")
        emb = mp_silu(emb)
        n = len(self.enc) + len(self.dec)
        keys = iter([None] * n if key is None else jax.random.split(key, n))  # dropout's, one per block
        call = lambda blk, hid: checkpointed(blk, self.remat)(hid, emb, key=next(keys))  # noqa: E731

        x = jnp.concatenate([x, jnp.ones_like(x[..., :1])], axis=-1)
        skips = []
        for block in self.enc:
            x = block(x) if isinstance(block, MPConv) else call(block, x)
            skips.append(x)
        for name, block in zip(self.dec_names, self.dec):
            if "block" in name:
                x = mp_cat(x, skips.pop(), t=self.concat_balance)
            x = call(block, x)
        return self.out_conv(x, gain=self.out_gain)

    def logvar(self, t: Float[Array, " b"]) -> Float[Array, " b"]:
        """u(σ), the learned log-variance of the loss at c_noise `t` (EDM2's Precond `return_logvar`, eq. 21)."""
        return self.logvar_linear(self.logvar_fourier(t))[:, 0]

    def null_cond(self, batch_size: int) -> Int[Array, " b"] | None:
        """Label `num_classes`: one-hot of zeros, EDM2's unconditional label vector; None without labels."""
        return jnp.full((batch_size,), self.num_classes, jnp.int32) if self.num_classes else None


def _out_channels(block) -> int:
    return block.out_channels if isinstance(block, EDM2Block) else block.weight.shape[0]
