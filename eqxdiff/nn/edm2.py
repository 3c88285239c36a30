"""EDM2's magnitude-preserving U-Net (Karras et al. 2024, "Analyzing and Improving the Training Dynamics of
Diffusion Models", Fig. 21; NVlabs/edm2 training/networks_edm2.py), channels-last, under eqxdiff's model
contract, with its uncertainty (`logvar`) head. One file in networks_edm2.py's order: the magnitude-preserving
layers, the block, the U-Net.

The layers (App. B) keep unit-variance inputs at unit variance: `mp_silu` (eq. 81), `mp_sum` (eq. 88), `mp_cat`
(eq. 103), `MPFourier` (eq. 75) and `MPConv`, a convolution or linear layer without bias whose weight is
normalised to unit norm per output channel in every forward pass (eq. 47) and, during training, also in storage
after every optimizer step (forced weight normalisation, eq. 66: `force_weight_normalization`).

EDM2's `Precond` is eqxdiff's `Denoiser(EDM2UNet, EDMSchedule(), EDMPreconditioning(sigma_data))`: the same
c_skip, c_out, c_in, and the network's time t is the schedule's `sigma_to_t`, c_noise = ln(σ)/4. The
Precond's own parameters, the logvar head (`logvar_fourier`, `logvar_linear`: u(σ) of eq. 21), live here
as `EDM2UNet.logvar(t)`, read by the training loss (`eqxdiff.diffusion.uncertainty_weighted`).
"""

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray

from eqxdiff.nn.remat import checkpointed
from eqxdiff.nn.upsample import nearest_upsample


def normalize(x: Array, axis: int | tuple[int, ...] | None = None, eps: float = 1e-4) -> Array:
    """x / (eps + ‖x‖/sqrt(n)) over `axis` (default: all but the first), n the elements per norm: unit RMS.
    The norm is taken in float32 whatever x's dtype (networks_edm2.py's `normalize`)."""
    axis = tuple(range(1, x.ndim)) if axis is None else axis
    axis = (axis,) if isinstance(axis, int) else axis
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=axis, keepdims=True))
    n = math.prod(x.shape[a] for a in axis)
    return x / (eps + norm / math.sqrt(n)).astype(x.dtype)


def resample(x: Float[Array, "b h w c"], mode: str) -> Array:
    """EDM2's `resample` with its [1, 1] filter: 'down' averages 2×2 blocks, 'up' repeats each pixel 2×2."""
    if mode == "keep":
        return x
    b, h, w, c = x.shape
    if mode == "down":
        return x.reshape(b, h // 2, 2, w // 2, 2, c).mean(axis=(2, 4))
    return nearest_upsample(x)


def mp_silu(x: Array) -> Array:
    """SiLU scaled back to unit variance for unit-normal input (eq. 81)."""
    return jax.nn.silu(x) / 0.596


def mp_sum(a: Array, b: Array, t: float = 0.5) -> Array:
    """(1 - t)·a + t·b, rescaled to unit variance for independent unit-variance a, b (eq. 88)."""
    return (a + t * (b - a)) / math.sqrt((1 - t) ** 2 + t**2)


def mp_cat(a: Array, b: Array, t: float = 0.5) -> Array:
    """[a, b] along channels, weighted (1 - t) : t and scaled to keep unit variance (eq. 103)."""
    na, nb = a.shape[-1], b.shape[-1]
    c = math.sqrt((na + nb) / ((1 - t) ** 2 + t**2))
    return jnp.concatenate([c / math.sqrt(na) * (1 - t) * a, c / math.sqrt(nb) * t * b], axis=-1)


class MPFourier(eqx.Module):
    """cos(2π(f·x) + φ)·sqrt(2) with fixed random frequencies f ~ N(0, bandwidth²) and phases φ ~ U[0, 1)
    (eq. 75): float[b] -> float[b, n]. `freqs` and `phases` are constants (EDM2's buffers): no gradient
    reaches them, so Adam without weight decay (EDM2's, --lr_ref_steps) never moves them; AdamW's decoupled
    decay would shrink them by lr·wd a step."""

    freqs: Float[Array, " n"]  # 2π·f
    phases: Float[Array, " n"]  # 2π·φ

    def __init__(self, num_channels: int, bandwidth: float = 1.0, *, key: PRNGKeyArray):
        key_f, key_p = jax.random.split(key)
        self.freqs = 2 * np.pi * jax.random.normal(key_f, (num_channels,)) * bandwidth
        self.phases = 2 * np.pi * jax.random.uniform(key_p, (num_channels,))

    def __call__(self, x: Float[Array, " b"]) -> Float[Array, "b n"]:
        freqs, phases = jax.lax.stop_gradient((self.freqs, self.phases))
        y = x.astype(jnp.float32)[:, None] * freqs.astype(jnp.float32) + phases.astype(jnp.float32)
        return (jnp.cos(y) * math.sqrt(2)).astype(x.dtype)


class MPConv(eqx.Module):
    """A magnitude-preserving convolution (weight [out, in, k, k], "same" padding, NHWC input) or linear layer
    (weight [out, in]): the weight normalised per output channel, times gain/sqrt(fan-in) (eq. 47), no bias.
    The weight keeps PyTorch's layout, so EDM2's state_dict loads as it is."""

    weight: Float[Array, "out in *kernel"]

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, ...], *, key: PRNGKeyArray):
        # Stored normalised from the start: EDM2 normalises it in storage at its first training forward.
        self.weight = normalize(jax.random.normal(key, (out_channels, in_channels, *kernel)))

    def __call__(self, x: Array, gain: float | Array = 1.0) -> Array:
        w = normalize(self.weight.astype(jnp.float32))  # traditional weight normalisation
        w = (w * (gain / math.sqrt(math.prod(w.shape[1:])))).astype(x.dtype)  # magnitude-preserving scale
        if w.ndim == 2:
            return x @ w.T
        pad = w.shape[-1] // 2
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), [(pad, pad), (pad, pad)], dimension_numbers=("NHWC", "OIHW", "NHWC")
        )


def force_weight_normalization(tree):
    """`tree` (a model, or any pytree holding them) with every `MPConv` weight replaced by `normalize(weight)`:
    EDM2's forced weight normalisation (eq. 66), applied after each optimizer step (make_train_step's
    `after_update`), so the stored weights stay on the unit sphere and Adam's steps shrink relative to them
    as training proceeds. Leaves everything else as it is (a network without MPConv: unchanged)."""
    is_mp = lambda x: isinstance(x, MPConv)  # noqa: E731
    return jax.tree.map(
        lambda m: eqx.tree_at(lambda c: c.weight, m, normalize(m.weight)) if is_mp(m) else m, tree, is_leaf=is_mp
    )


class EDM2Block(eqx.Module):
    """An encoder ('enc': skip conv and pixel norm on the main branch first) or decoder ('dec': skip conv
    where the branches join) block: resample, a residual branch of two 3×3 MPConvs modulated by the
    embedding (gain `emb_gain`, zero at init), `mp_sum` with the main branch, optional self-attention on
    pixel-normalised q, k, v, and activations clipped to ±`clip_act`."""

    conv_res0: MPConv
    emb_linear: MPConv
    conv_res1: MPConv
    conv_skip: MPConv | None
    attn_qkv: MPConv | None
    attn_proj: MPConv | None
    emb_gain: Float[Array, ""]
    out_channels: int = eqx.field(static=True)
    flavor: str = eqx.field(static=True)
    resample_mode: str = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    dropout: float | int = eqx.field(static=True)
    res_balance: float = eqx.field(static=True)
    attn_balance: float = eqx.field(static=True)
    clip_act: float | int | None = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        emb_channels: int,
        flavor: str = "enc",
        resample_mode: str = "keep",
        attention: bool = False,
        channels_per_head: int = 64,
        dropout: float | int = 0.0,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        clip_act: float | int | None = 256,
        *,
        key: PRNGKeyArray,
    ):
        keys = jax.random.split(key, 6)
        self.out_channels, self.flavor, self.resample_mode = out_channels, flavor, resample_mode
        self.num_heads = out_channels // channels_per_head if attention else 0
        self.dropout, self.res_balance, self.attn_balance, self.clip_act = dropout, res_balance, attn_balance, clip_act
        self.emb_gain = jnp.zeros(())
        self.conv_res0 = MPConv(out_channels if flavor == "enc" else in_channels, out_channels, (3, 3), key=keys[0])
        self.emb_linear = MPConv(emb_channels, out_channels, (), key=keys[1])
        self.conv_res1 = MPConv(out_channels, out_channels, (3, 3), key=keys[2])
        self.conv_skip = MPConv(in_channels, out_channels, (1, 1), key=keys[3]) if in_channels != out_channels else None
        self.attn_qkv = MPConv(out_channels, out_channels * 3, (1, 1), key=keys[4]) if self.num_heads else None
        self.attn_proj = MPConv(out_channels, out_channels, (1, 1), key=keys[5]) if self.num_heads else None

    def __call__(
        self, x: Float[Array, "b h w ci"], emb: Float[Array, "b e"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "b h2 w2 co"]:
        """`key`: dropout's (training); None: no dropout."""
        x = resample(x, self.resample_mode)
        if self.flavor == "enc":
            if self.conv_skip is not None:
                x = self.conv_skip(x)
            x = normalize(x, axis=-1)  # pixel norm

        y = self.conv_res0(mp_silu(x))
        c = self.emb_linear(emb, gain=self.emb_gain) + 1
        y = mp_silu(y * c[:, None, None, :].astype(y.dtype))
        if key is not None and self.dropout:
            keep = jax.random.bernoulli(key, 1 - self.dropout, y.shape)
            y = jnp.where(keep, y / (1 - self.dropout), 0).astype(y.dtype)
        y = self.conv_res1(y)

        if self.flavor == "dec" and self.conv_skip is not None:
            x = self.conv_skip(x)
        x = mp_sum(x, y, t=self.res_balance)

        if self.num_heads:
            b, h, w, c = x.shape
            # Channels as EDM2 splits them: head, channel within the head, then q/k/v.
            y = self.attn_qkv(x).reshape(b, h * w, self.num_heads, -1, 3)
            q, k, v = (a[..., 0] for a in jnp.split(normalize(y, axis=3), 3, axis=-1))  # pixel norm per head
            att = jax.nn.softmax(jnp.einsum("bqhc,bkhc->bhqk", q, k / math.sqrt(q.shape[-1])), axis=-1)
            y = jnp.einsum("bhqk,bkhc->bqhc", att, v).reshape(b, h, w, c)
            x = mp_sum(x, self.attn_proj(y), t=self.attn_balance)

        if self.clip_act is not None:
            x = jnp.clip(x, -self.clip_act, self.clip_act)
        return x


class EDM2UNet(eqx.Module):
    """`model(x[b,h,w,c], t[b], cond, *, key=None) -> [b,h,w,c]`; `t` is c_noise = ln(σ)/4 (EDMSchedule);
    `cond` int32[b] labels (label `num_classes`, or None: no class, EDM2's zero label vector) or float[b, n]
    label vectors; `key` drives dropout (training), None: none.

    Levels `channel_mult` of `model_channels`·m channels, `num_blocks` blocks each (+1 in the decoder),
    self-attention at the resolutions in `attn_resolutions` and in the first innermost decoder block.
    `enc_names`/`dec_names` are EDM2's block names (`8x8_conv`, `4x4_down`, ...), in order.

    `interval_embedding` makes a network of two times (MeanFlow, Geng et al. 2025, as UNet's and DiT's): `interval`
    = t − r, in the units of t, gets its own Fourier features and linear layer (`emb_interval_fourier`,
    `emb_interval`), joined to t's embedding by `mp_sum` as EDM2 joins the label's; called without it, the network
    at r = t. Without the option both are None: the module's leaves are as they were, drawn alike (the option's
    keys are folded off `key`).
    """

    emb_fourier: MPFourier
    emb_noise: MPConv
    emb_label: MPConv | None
    emb_interval_fourier: MPFourier | None
    emb_interval: MPConv | None
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
        "img512-xxs": (64, 0.0),
        "img512-xs": (128, 0.0),
        "img512-s": (192, 0.0),
        "img512-m": (256, 0.1),
        "img512-l": (320, 0.1),
        "img512-xl": (384, 0.1),
        "img512-xxl": (448, 0.1),
        "img64-xs": (128, 0.0),
        "img64-s": (192, 0.0),
        "img64-m": (256, 0.1),
        "img64-l": (320, 0.1),
        "img64-xl": (384, 0.1),
    }

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int = 0,
        model_channels: int = 192,
        channel_mult: tuple[int, ...] = (1, 2, 3, 4),
        channel_mult_noise: int | None = None,
        channel_mult_emb: int | None = None,
        num_blocks: int = 3,
        attn_resolutions: tuple[int, ...] = (16, 8),
        label_balance: float = 0.5,
        concat_balance: float = 0.5,
        logvar_channels: int = 128,
        channels_per_head: int = 64,
        dropout: float | int = 0.0,
        res_balance: float = 0.3,
        attn_balance: float = 0.3,
        clip_act: float | int | None = 256,
        remat: bool = False,
        interval_embedding: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        keys = iter(jax.random.split(key, 8 + 4 * len(channel_mult) * (num_blocks + 2)))
        cblock = [model_channels * m for m in channel_mult]
        cnoise = model_channels * channel_mult_noise if channel_mult_noise is not None else cblock[0]
        cemb = model_channels * channel_mult_emb if channel_mult_emb is not None else max(cblock)
        block = dict(
            channels_per_head=channels_per_head,
            dropout=dropout,
            res_balance=res_balance,
            attn_balance=attn_balance,
            clip_act=clip_act,
        )
        self.num_classes, self.remat = num_classes, remat
        self.label_balance, self.concat_balance = label_balance, concat_balance
        self.out_gain = jnp.zeros(())
        self.emb_fourier = MPFourier(cnoise, key=next(keys))
        self.emb_noise = MPConv(cnoise, cemb, (), key=next(keys))
        self.emb_label = MPConv(num_classes, cemb, (), key=next(keys)) if num_classes else None
        self.emb_interval_fourier, self.emb_interval = None, None
        if interval_embedding:  # MeanFlow's t − r: keys folded off `key`, so every other draw stays as it was
            key_fourier, key_linear = jax.random.split(jax.random.fold_in(key, 2))
            self.emb_interval_fourier = MPFourier(cnoise, key=key_fourier)
            self.emb_interval = MPConv(cnoise, cemb, (), key=key_linear)

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
                enc[f"{res}x{res}_block{idx}"] = EDM2Block(
                    cin, cout, cemb, "enc", attention=res in attn_resolutions, **block, key=next(keys)
                )
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
                dec[f"{res}x{res}_block{idx}"] = EDM2Block(
                    cin, cout, cemb, "dec", attention=res in attn_resolutions, **block, key=next(keys)
                )
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

    def __call__(
        self,
        x: Float[Array, "b h w c"],
        t: Float[Array, " b"],
        cond: Int[Array, " b"] | Float[Array, "b n"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
        interval: Float[Array, " b"] | None = None,  # t − r, a network of two times only (interval_embedding)
    ) -> Float[Array, "b h w c"]:
        emb = self.emb_noise(self.emb_fourier(t))
        if self.emb_interval is not None:  # no interval: r = t
            h = jnp.zeros_like(t) if interval is None else interval.astype(t.dtype)
            emb = mp_sum(emb, self.emb_interval(self.emb_interval_fourier(h)), t=0.5)
        elif interval is not None:
            raise ValueError("EDM2UNet was built for one time; a second (interval=t-r) needs interval_embedding=True")
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
