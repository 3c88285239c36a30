"""Encode an image dataset into an autoencoder's latent space, once, offline: ArrayRecord shards
and a meta.json that `--dataset latents:DIR` reads (the format: eqxdiff/data/latents.py).

    python train/encode.py --dataset folder:~/data/pets --image_size 256 --vae ~/sd-vae --out ~/latents/pets
    python train/encode.py --dataset digits --vae space_to_depth:2 --out runs/digits_latents
    python train/encode.py --dataset folder:~/data/pets --vae ~/sd/vae --text_encoder ~/sd/text_encoder \\
        --encode_text --image_size 256 --out ~/latents/pets_text    # + the captions (a .txt beside each image)
    python train/encode.py --dataset npz:gs://BUCKET/pets.npz --vae gs://BUCKET/sd/vae --out gs://BUCKET/latents/pets

Every example of the source (with `--hflip_copies`, then every example mirrored: examples N..2N-1
are 0..N-1 flipped left-right) is encoded to the posterior moments (mean, logvar, stored float16)
with the source's other fields (label; a captioned source's raw caption) kept as they are. With
`--text_encoder DIR` (a transformers CLIP text folder) the source is read with its captions
(`--allow_uncaptioned`: "" for an image without one), each tokenized on the host (`--tokenizer`,
default the tokenizer/ folder beside DIR) and stored as input_ids and attention_mask;
`--encode_text` also stores the tower's last hidden states ("context") and pooled vector, float16,
encoded on the devices next to the VAE. The null condition of guidance (`--null_text`: the encoded
"" or zeros) is written to null_text.npz beside meta.json. `--attend_padding`: the tower reads every token,
the padding too, as Stable Diffusion's pipelines encode prompts (what `train/main.py --init sd:` trains with).
`--repa_encoder DIR` (a transformers Dinov2Model folder) also stores each image's DINOv2 patch tokens, float16, as
REPA's targets ("repa_features", eqxdiff/training/repa.py), at the side giving one token per patch of a DiT of patch
`--repa_dit_patch` on the latents (256² images, 32² latents, patch 2: 224², REPA's): `train/main.py --repa_weight`
reads them instead of running the tower in each step.

The examples, in order, are cut into shards of `--shard_size`; shard k belongs to process
k % process_count, which encodes it on its own devices (data-parallel over them) and writes it
under a temporary name, renamed when complete. Run the same command again after an interruption:
complete shards are skipped. Process 0 writes meta.json once every shard exists; a folder holding
another encode (other data, VAE or text settings) is refused. With `--out gs://...` each shard is written
locally and uploaded as one object; `--vae`/`--text_encoder` URLs are read from local copies
(eqxdiff/local_copies.py).
Multi-process flags as in train/main.py (`--coordinator`, `--num_processes`, `--process_id`).
"""

import collections
import hashlib
import json
import os
import time
from dataclasses import dataclass

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from eqxdiff.autoencoders import (
    TILING_MODES,
    auto_batch_size,
    check_autoencoder,
    describe_autoencoder,
    open_autoencoder,
    sha256_file,
    use_tiling,
)
from eqxdiff.data.latents import (
    META,
    NULL_FILE,
    TMP_SUFFIX,
    fields_from_meta,
    fields_to_meta,
    null_npz_bytes,
    record_bytes,
    shard_name,
    tokenizer_files_sha256,
    write_shard,
)
from eqxdiff.data.offline import run_offline  # a dataset through the devices once
from eqxdiff.images import from_uint8
from eqxdiff.local_copies import canonical, local_copy
from eqxdiff.nn import Dinov2Model
from eqxdiff.nn.clip_text import WEIGHTS_FILE as TEXT_WEIGHTS_FILE
from eqxdiff.nn.vae_tiling import encode_in_pieces
from eqxdiff.paths import is_url
from eqxdiff.sharding import batch_sharding, make_mesh
from eqxdiff.training.repa import dinov2_targets
from eqxdiff.text.conditioning import (
    NULL_TEXTS,
    SCRATCH,
    TextConditioning,
    check_text_folders,
    open_text_conditioning,
    tokenizer_folder,
    tokenizer_location,
)
from offline import open_dataset  # train/offline.py: the dataset named, or one line why not
from outputs import check_writable  # train/outputs.py: the output's folder, before the long part
from startup import Launch, dataclass_parser, exit_on_user_error, start_jax  # train/startup.py: flags; JAX's start

PLAN = "encode.json"  # the meta.json to be, written at the start: a restart with other flags is refused


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Config(Launch):
    """The flags: each field is `--name`, its comment the flag's help; the launch flags are `Launch`'s."""

    dataset: str = "digits"  # any image source of train/main.py: digits | npz:PATH | folder:PATH | arrayrecord:GLOB
    vae: str = ""  # space_to_depth:F | a diffusers autoencoder folder (AutoencoderKL: SD, SDXL, SD3, FLUX)
    out: str = ""  # the latent folder (created), or a prefix in a bucket, gs://BUCKET/PREFIX
    image_size: int = 32  # folder: and arrayrecord: images are resized to this
    batch_size: int = 0  # global, per call (each process batch_size / num_processes); 0: from the image size
    vae_tiling: str = "auto"  # auto: images above 768² go through the VAE tile by tile (diffusers' tiling) | on | off
    hflip_copies: bool = False  # also store every image mirrored left-right, as extra examples
    shard_size: int = 1024  # examples per shard file
    text_encoder: str = ""  # a transformers CLIP text folder (SD's text_encoder/): store each caption's tokens
    tokenizer: str = ""  # the captions' tokenizer folder (default: tokenizer/ beside --text_encoder)
    encode_text: bool = False  # also store the encoded captions: hidden states and pooled vector, float16
    null_text: str = "empty"  # the null condition stored in null_text.npz: the encoded "" | zeros
    attend_padding: bool = False  # the tower reads the padding tokens too, as SD's pipelines (for main.py --init sd:)
    allow_uncaptioned: bool = False  # an image without a caption gets "" instead of stopping the encode
    repa_encoder: str = ""  # a transformers Dinov2Model folder: also store each image's patch tokens, REPA's targets (main.py --repa_weight)
    repa_dit_patch: int = 2  # with --repa_encoder: the DiT's patch size on the latents; one DINOv2 token per DiT token
# fmt: on


def parse_config(argv: list[str] | None = None) -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`."""
    choices = {"null_text": list(NULL_TEXTS), "vae_tiling": list(TILING_MODES)}
    parser = dataclass_parser(Config, __doc__, choices, required=("vae", "out"))
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.shard_size < 1 or cfg.batch_size < 0:
        parser.error(
            f"--shard_size must be >= 1 and --batch_size >= 0 (0: from the image size), got "
            f"{cfg.shard_size} and {cfg.batch_size}"
        )
    text_flags = {
        "--tokenizer": cfg.tokenizer,
        "--encode_text": cfg.encode_text,
        "--null_text zeros": cfg.null_text != "empty",
        "--allow_uncaptioned": cfg.allow_uncaptioned,
        "--attend_padding": cfg.attend_padding,
    }
    given = [flag for flag, value in text_flags.items() if value]
    if given and not cfg.text_encoder:
        parser.error(f"{given[0]} applies to captions, which are read and tokenized only with --text_encoder DIR")
    if cfg.repa_dit_patch < 1:
        parser.error(f"--repa_dit_patch must be >= 1, got {cfg.repa_dit_patch}")
    if cfg.text_encoder == SCRATCH:
        parser.error(
            "--text_encoder scratch is a tower trained with the model, which has nothing to store ahead of time: "
            "encode without --text_encoder (a captioned dataset keeps its raw captions) and train with it"
        )
    return cfg


def plan_meta(cfg: Config, source, vae, text, files_sha256: dict[str, str], repa=None) -> dict:
    """meta.json's content, known before anything is encoded (eqxdiff/data/latents.py lists the keys);
    `text`: what the encode stores of the captions (`ImagesOnly` or `Captions`), `files_sha256`: the
    hashes of its files beside meta.json; `repa`: --repa_encoder's `RepaFeatures`, or None."""
    images = jax.ShapeDtypeStruct((1, *source.image_shape), np.float32)
    try:  # shapes only: a size the VAE's factor does not divide, or other channels, fail here
        mean, _ = eqx.filter_eval_shape(type(vae).encode, vae, images)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--vae {cfg.vae} cannot encode the images of {source.spec}, {source.image_shape}: {e}") from e
    latent = tuple(mean.shape[1:])
    latent_field = jax.ShapeDtypeStruct(latent, np.float16)
    fields = {"mean": latent_field, "logvar": latent_field, **{k: f for k, f in source.fields.items() if k != "image"}}
    fields |= {} if repa is None else repa.fields(latent)
    count = len(source) * (2 if cfg.hflip_copies else 1)
    meta = {
        "fields": fields_to_meta(fields | text.fields()),
        "vae": describe_autoencoder(cfg.vae),
        # per channel (lists) for a VAE with latents_mean/latents_std
        "scaling_factor": np.asarray(vae.scaling_factor).tolist(),
        "shift_factor": np.asarray(vae.shift_factor).tolist(),
        "latent_shape": list(latent),
        "count": count,
        "shard_size": cfg.shard_size,
        "num_shards": -(-count // cfg.shard_size),
        "num_classes": source.num_classes,
        "source": source.spec,
        "image_shape": list(source.image_shape),
        "hflip_copies": cfg.hflip_copies,
        "class_names": getattr(source, "class_names", None) or None,  # a folder's sub-folders: grid rows, --classes
    }
    return meta | text.meta(files_sha256) | ({} if repa is None else repa.meta())


class RepaFeatures:
    """--repa_encoder DIR: each image's DINOv2 patch tokens (`dinov2_targets`, the torch.hub tower's resize), float16,
    at the side 14·(latent side / --repa_dit_patch): one token per DiT token."""

    def __init__(self, cfg: Config, mesh):
        config = local_copy(cfg.repa_encoder) / "config.json"
        if not config.is_file():
            raise SystemExit(f"--repa_encoder {cfg.repa_encoder}: no config.json there; pass a transformers "
                             f"Dinov2Model folder (huggingface-cli download facebook/dinov2-base --local-dir DIR).")  # fmt: skip
        tower = Dinov2Model.from_transformers(config.parent, interpolate_offset=0.1)
        replicated = NamedSharding(mesh, PartitionSpec())
        self.tower = jax.tree.map(lambda x: jax.device_put(x, replicated) if eqx.is_array(x) else x, tower)
        self.folder, self.dit_patch = canonical(cfg.repa_encoder), cfg.repa_dit_patch
        self.weights_sha256 = sha256_file(config.parent / "model.safetensors")
        self.side = 0  # known with the latent's shape (`fields`)

    def fields(self, latent: tuple) -> dict:
        if latent[0] % self.dit_patch:
            raise SystemExit(f"--repa_dit_patch {self.dit_patch} does not divide the latent side {latent[0]}.")
        grid = latent[0] // self.dit_patch
        self.side = self.tower.patch_size * grid
        width = self.tower.layernorm.weight.shape[0]
        return {"repa_features": jax.ShapeDtypeStruct((grid * grid, width), np.float16)}

    def meta(self) -> dict:
        return {"repa": {"encoder": self.folder, "weights_sha256": self.weights_sha256, "side": self.side}}

    def __call__(self, images) -> jax.Array:
        return repa_features16(self.tower, images, self.side)


@eqx.filter_jit
def repa_features16(tower, images, side: int) -> jax.Array:
    return dinov2_targets(tower, images.astype(np.float32), side).astype(np.float16)


def identity(meta: dict) -> dict:
    """What must agree for two encodes to share a folder: everything, the VAE and the text side
    by their weights and tokenizer files (or spec, when weightless) rather than by where their
    folders are. The null's file hash is left out: it follows from the rest, and its last bits
    may depend on the devices it was computed on; so are the class names (the source's, which
    encodes begun before meta.json kept them lack)."""
    text = meta.get("text")
    if text is not None:
        text = {k: v for k, v in text.items() if k not in ("text_encoder", "tokenizer", "null")}
    rest = {k: v for k, v in meta.items() if k != "class_names"}
    repa = meta.get("repa") and {k: v for k, v in meta["repa"].items() if k != "encoder"}  # by weights, not folder
    return {**rest, "vae": meta["vae"]["weights_sha256"] or meta["vae"]["spec"], "text": text, "repa": repa}


def refuse_other_encode(out: os.PathLike, plan: dict) -> None:
    """Stop if `out` holds (the start of) an encode with other settings: shards must not mix."""
    for name in (META, PLAN):
        if (out / name).is_file():
            old, new = identity(json.loads((out / name).read_text())), identity(plan)
            differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            if differ:
                found = differences(old, new)
                said = "; ".join(found[:3]) + (f"; {len(found) - 3} more" if len(found) > 3 else "")
                raise SystemExit(
                    f"{out} holds another encode ({name} differs in {', '.join(differ)}: {said}); choose "
                    "a new --out or delete that folder."
                )


def differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    """`key.sub: THERE there, NOW now` for each differing leaf of two nested dicts, each value cut to a few words."""

    def short(value) -> str:
        text = "absent" if value is None else json.dumps(value)
        return text if len(text) <= 32 else text[:31] + "…"

    found = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            found += differences(a, b, f"{prefix}{key}.")
        elif a != b:
            found.append(f"{prefix}{key}: {short(a)} there, {short(b)} now")
    return found


def write_json(path: os.PathLike, obj: dict) -> None:
    """Written whole or not at all (temporary file + rename)."""
    write_bytes(path, json.dumps(obj, indent=1).encode())


def write_bytes(path: os.PathLike, data: bytes) -> None:
    """Written whole or not at all (temporary file + rename; in a bucket one upload)."""
    if is_url(path):
        path.write_bytes(data)
        return
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_bytes(data)
    tmp.replace(path)


def read_example(source, g: int) -> dict:
    """Global example g: source example g, or (g >= len(source), hflip copies) g - N mirrored."""
    n = len(source)
    example = source[g % n]
    return {**example, "image": example["image"][:, ::-1]} if g >= n else example


def split_examples(examples: list[dict], text) -> tuple[list[dict], tuple]:
    """(other fields of each example, with the captions' tokens `text` stores, if any; (uint8 images,
    those tokens {"input_ids", "attention_mask"}, or {}))."""
    images = np.stack([e["image"] for e in examples])
    tokens = text.tokens(examples)
    others = [
        {**{k: v for k, v in e.items() if k != "image"}, **{k: v[i] for k, v in tokens.items()}}
        for i, e in enumerate(examples)
    ]
    return others, (images, text.tower_tokens(tokens))


@eqx.filter_jit
def encode_uint8(vae, images, text_encoder=None, tokens: dict | None = None) -> dict:
    """uint8 images -> float16 {"mean", "logvar"}; with a text tower, its tokens -> float16 "context"
    (last hidden states) and "pooled". Cast on device: half the bytes to copy back."""
    mean, logvar = vae.encode(from_uint8(images))
    out = {"mean": mean, "logvar": logvar}
    if text_encoder is not None:
        out["context"], out["pooled"] = text_encoder(tokens["input_ids"], tokens["attention_mask"])
    return {k: v.astype(np.float16) for k, v in out.items()}


@eqx.filter_jit
def encode_text16(text_encoder, tokens: dict) -> dict:
    context, pooled = text_encoder(tokens["input_ids"], tokens["attention_mask"])
    return {"context": context.astype(np.float16), "pooled": pooled.astype(np.float16)}


def encode_batch(vae, images, text_encoder=None, tokens: dict | None = None, tiling: bool = False) -> dict:
    """`encode_uint8`, or with `tiling` the VAE tile by tile (one jitted call per tile:
    eqxdiff/nn/vae_tiling.py) and the text in a call of its own."""
    if not tiling:
        return encode_uint8(vae, images, text_encoder, tokens)
    mean, logvar = encode_in_pieces(vae, from_uint8(images))
    out = {"mean": mean.astype(np.float16), "logvar": logvar.astype(np.float16)}
    return out if text_encoder is None else out | encode_text16(text_encoder, tokens)


class ImagesOnly:
    """An encode without --text_encoder stores the latents and the source's other fields (a captioned
    source keeps its raw captions): no tokens, no "text" entry in meta.json, no file beside it."""

    encoder = None  # no text tower runs next to the VAE

    def fields(self) -> dict:
        return {}

    def tokens(self, examples: list[dict]) -> dict:
        return {}

    def tower_tokens(self, tokens: dict) -> dict:
        return tokens

    def files(self) -> dict[str, bytes]:
        """The files written beside meta.json, by name."""
        return {}

    def meta(self, files_sha256: dict[str, str]) -> dict:
        return {}  # encodes without text keep their bytes


class Captions:
    """--text_encoder DIR: each caption's tokens (input_ids, attention_mask), with --encode_text also the
    tower's last hidden states ("context") and pooled vector, float16, encoded on the devices next to the
    VAE; the null condition of guidance (--null_text) in null_text.npz beside meta.json."""

    def __init__(self, cfg: Config, text: TextConditioning):
        self.text, self.encode_text = text, cfg.encode_text
        self.encoder = text.encoder if cfg.encode_text else None
        self.folders = canonical(cfg.text_encoder), tokenizer_location(cfg.text_encoder, cfg.tokenizer)  # as recorded
        self.local = local_copy(cfg.text_encoder), tokenizer_folder(cfg.text_encoder, cfg.tokenizer)

    def fields(self) -> dict:
        tokens = jax.ShapeDtypeStruct((self.text.max_length,), np.int32)
        fields = {"input_ids": tokens, "attention_mask": tokens}
        if self.encode_text:
            width = self.text.encoder_width
            fields |= {
                "context": jax.ShapeDtypeStruct((self.text.max_length, width), np.float16),
                "pooled": jax.ShapeDtypeStruct((width,), np.float16),
            }
        return fields

    def tokens(self, examples: list[dict]) -> dict:
        """The stored tokens: ids and the tokenizer's mask (a run that attends to the padding ignores it)."""
        ids, mask = self.text.tokenizer([e["caption"] for e in examples], self.text.max_length)
        return {"input_ids": ids, "attention_mask": mask}

    def tower_tokens(self, tokens: dict) -> dict:
        """The tokens the tower encodes: the mask all ones with --attend_padding."""
        return tokens | {"attention_mask": self.text.read_mask(tokens["attention_mask"])}

    def files(self) -> dict[str, bytes]:
        return {NULL_FILE: null_npz_bytes(self.text.encoded_null())}

    def meta(self, files_sha256: dict[str, str]) -> dict:
        (encoder, tokenizer), (local_encoder, local_tokenizer) = self.folders, self.local
        return {
            "text": {
                "text_encoder": encoder,
                "weights_sha256": sha256_file(local_encoder / TEXT_WEIGHTS_FILE),
                "tokenizer": tokenizer,
                "tokenizer_sha256": tokenizer_files_sha256(local_tokenizer),
                "max_length": self.text.max_length,
                "null_text": self.text.null_text,
                "encoded": self.encode_text,
                "null": {"file": NULL_FILE, "sha256": files_sha256[NULL_FILE]},
            }
            | ({"attend_padding": True} if self.text.attend_padding else {})
        }


def open_text(cfg: Config, mesh) -> ImagesOnly | Captions:
    """What the encode stores of the captions: with --text_encoder DIR its tower read into `mesh`'s layout."""
    if not cfg.text_encoder:
        return ImagesOnly()
    text = open_text_conditioning(
        cfg.text_encoder, cfg.tokenizer, null_text=cfg.null_text, mesh=mesh, attend_padding=cfg.attend_padding
    )
    return Captions(cfg, text)


def main(cfg: Config) -> None:
    start_jax(cfg)
    try:  # a mistyped folder is named before anything is made or read
        check_autoencoder(cfg.vae)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--vae: {e}") from e
    if cfg.text_encoder:
        try:
            check_text_folders(cfg.text_encoder, cfg.tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from e
    out = check_writable(cfg.out, "--out", folder=True)  # every process writes its shards there
    captions = bool(cfg.text_encoder)
    source = open_dataset(cfg.dataset, cfg.image_size, captions=captions, allow_uncaptioned=cfg.allow_uncaptioned)
    if "image" not in source.fields:
        raise SystemExit(f"--dataset {cfg.dataset} has no image field to encode (fields: {sorted(source.fields)}).")
    if cfg.hflip_copies and not getattr(source, "hflip_keeps_meaning", True):
        raise SystemExit(f"--hflip_copies would swap what {cfg.dataset}'s captions place left and right.")
    process, processes = jax.process_index(), jax.process_count()
    image_hw = tuple(source.image_shape[:2])
    count = len(source) * (2 if cfg.hflip_copies else 1)
    batch_size = cfg.batch_size or auto_batch_size(image_hw, jax.device_count(), count)
    if batch_size % jax.device_count():
        raise SystemExit(f"--batch_size {cfg.batch_size} must be a multiple of the devices ({jax.device_count()}).")
    # Each process encodes its own shards on its own devices: no process waits for another until the end.
    mesh = make_mesh(devices=jax.local_devices())
    try:  # weights that do not fit their config, a tokenizer of another tower
        vae = open_autoencoder(cfg.vae, mesh=mesh)
        text = open_text(cfg, mesh)
        repa = RepaFeatures(cfg, mesh) if cfg.repa_encoder else None
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(str(e)) from e
    out.mkdir(parents=True, exist_ok=True)
    files = text.files()  # beside meta.json: null_text.npz with captions
    if any((out / name).is_file() for name in (META, PLAN)):  # an encode resumed: keep the files its plan names
        files = {name: (out / name).read_bytes() if (out / name).is_file() else data for name, data in files.items()}
    plan = plan_meta(
        cfg, source, vae, text, {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}, repa
    )
    refuse_other_encode(out, plan)
    if process == 0:
        for name, data in files.items():
            write_bytes(out / name, data)
        write_json(out / PLAN, plan)
    tiling = use_tiling(cfg.vae_tiling, vae, image_hw)

    num_shards, size = plan["num_shards"], cfg.shard_size
    mine = [k for k in range(num_shards) if k % processes == process]
    for k in mine:  # an interrupted run's half-written shards
        (out / (shard_name(k, num_shards) + TMP_SUFFIX)).unlink(missing_ok=True)
    pending = [k for k in mine if not (out / shard_name(k, num_shards)).is_file()]
    shards = collections.deque((k, range(k * size, min((k + 1) * size, plan["count"]))) for k in pending)
    indices = [g for _, r in shards for g in r]

    fields = fields_from_meta(plan["fields"])
    records: list[bytes] = []

    def collect(others, encoded) -> None:
        """Take one batch's moments (and encoded text); write every shard that is now complete."""
        for i, other in enumerate(others):
            records.append(record_bytes({**{k: v[i] for k, v in encoded.items()}, **other}, fields))
        while shards and len(records) >= len(shards[0][1]):
            k, r = shards.popleft()
            write_shard(out, k, num_shards, records[: len(r)])
            del records[: len(r)]

    def compute(inputs) -> dict:
        images, tokens = inputs
        encoded = encode_batch(vae, images, text.encoder, tokens, tiling)
        return encoded if repa is None else encoded | {"repa_features": repa(images)}

    started = time.perf_counter()
    run_offline(
        lambda g: read_example(source, g),
        indices,
        batch_size // processes,
        lambda examples: split_examples(examples, text),
        compute,
        collect,
        sharding=batch_sharding(mesh),
        desc="encode",
        progress=process == 0,
    )
    elapsed = time.perf_counter() - started

    if processes > 1:
        multihost_utils.sync_global_devices("eqxdiff encode: every process wrote its shards")
    if process == 0:
        names = [shard_name(k, num_shards) for k in range(num_shards)]
        missing = [name for name in names if not (out / name).is_file()]
        if missing:
            raise SystemExit(f"{len(missing)} shards are missing after the encode ({missing[0]}, ...); run it again.")
        write_json(out / META, plan)
        print(
            f"encoded {plan['count']} examples of {cfg.dataset} with {cfg.vae} into {out}: {num_shards} shards "
            f"of latents {plan['latent_shape']}; this process wrote {len(pending)} of its {len(mine)} shards, "
            f"{len(indices) / max(elapsed, 1e-9):.1f} images/s"
        )


if __name__ == "__main__":
    exit_on_user_error(lambda: main(parse_config()))
