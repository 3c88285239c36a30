"""train/main.py's data side (`cfg`: its Config): the dataset opened and described, and its codec (pixels,
or the latents of an autoencoder)."""

import numpy as np

from eqxdiff.run.codecs import Pixels, codec_from_config
from eqxdiff.data import describe_source, open_source
from eqxdiff.data.latents import LatentSource
from eqxdiff.sharding import RuleError


def run_codec(source, mesh, *, min_size: int, rules: tuple = ()) -> tuple:
    """(the run's codec, what checkpoints store beside it): latents from train/encode.py decode with the
    autoencoder their meta.json names (its absolute folder, or a weightless spec; laid out over `mesh` by
    `min_size` and the run's sharding `rules`), here and in train/sample.py, and name the images they
    encode; anything else is pixels."""
    if not isinstance(source, LatentSource):
        return Pixels(), {}
    vae = source.meta["vae"]
    spec = vae["path"] or vae["spec"]
    try:
        codec = codec_from_config({"kind": "latents", "autoencoder": spec}, mesh=mesh, min_size=min_size, rules=rules)
    except RuleError as e:  # the rules, not the folder
        raise SystemExit(f"SHARDING_RULES in train/main.py: {e}") from e
    except (FileNotFoundError, ValueError) as e:  # the VAE folder moved since the encode
        raise SystemExit(f"{source.spec}: the VAE its meta.json names cannot be read ({e}); put it back there.") from e
    return codec, {"image_dataset": source.meta["source"]}


def open_dataset(cfg, say) -> object:
    """--dataset as a record source (eqxdiff/data/sources.py), every folder image decoded once first: the
    unreadable ones listed, or dropped with --skip_bad_images; what was found is `say`d."""
    try:
        source = open_source(cfg.dataset, cfg.image_size, captions=bool(cfg.text_encoder),
                             allow_uncaptioned=cfg.allow_uncaptioned, skip_bad_images=cfg.skip_bad_images)  # fmt: skip
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as e:
        raise SystemExit(str(e)) from e
    say(f"dataset {describe_source(source)}")
    return source


def scaled_latent_std(source, scaling_factor, shift_factor, num: int = 64) -> float:
    """The std of the latents the model sees, `(z - shift_factor) · scaling_factor` with z drawn from each
    record's posterior N(mean, exp(logvar)), from `num` records spread evenly over the data (law of total
    variance: the scaled means' variance plus the mean scaled posterior variance)."""
    rows = np.unique(np.linspace(0, len(source) - 1, min(num, len(source))).round().astype(int))
    records = [source[int(i)] for i in rows]
    mean = np.stack([r["mean"] for r in records]).astype(np.float64)
    var = np.exp(np.stack([r["logvar"] for r in records]).astype(np.float64))
    scale = np.asarray(scaling_factor, np.float64)
    return float(np.sqrt(((mean - shift_factor) * scale).var() + (var * scale**2).mean()))
