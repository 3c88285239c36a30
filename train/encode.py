"""Encode an image dataset into an autoencoder's latent space, once, offline: ArrayRecord shards
and a meta.json that `--dataset latents:DIR` reads (the format: eqxdiff/data/latents.py).

    python train/encode.py --dataset folder:~/data/pets --image_size 256 --vae ~/sd-vae --out ~/latents/pets
    python train/encode.py --dataset digits --vae space_to_depth:2 --out runs/digits_latents

Every example of the source (with `--hflip_copies`, then every example mirrored: examples N..2N-1
are 0..N-1 flipped left-right) is encoded to the posterior moments (mean, logvar, stored float16)
with the source's other fields (label) kept as they are. The examples, in order, are cut into
shards of `--shard_size`; shard k belongs to process k % process_count, which encodes it on its
own devices (data-parallel over them) and writes it under a temporary name, renamed when
complete. Run the same command again after an interruption: complete shards are skipped. Process
0 writes meta.json once every shard exists; a folder holding another encode is refused.
Multi-process flags as in train/main.py (`--coordinator`, `--num_processes`, `--process_id`).
"""

import collections
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from tqdm import tqdm

from eqxdiff.autoencoders import describe_autoencoder, open_autoencoder
from eqxdiff.data import Prefetch, open_source
from eqxdiff.data.latents import META, TMP_SUFFIX, fields_to_meta, record_bytes, shard_name, write_shard
from eqxdiff.images import from_uint8
from eqxdiff.sharding import batch_sharding, make_mesh
from main import dataclass_parser, start_jax  # train/main.py's; start_jax: devices, cache, jax.distributed, XLA:CPU

PLAN = "encode.json"  # the meta.json to be, written at the start: a restart with other flags is refused


@dataclass
class Config:
    dataset: str = "digits"  # any image source of train/main.py: digits | npz:PATH | folder:PATH | arrayrecord:GLOB
    vae: str = ""  # space_to_depth:F | a diffusers AutoencoderKL folder
    out: str = ""  # the latent folder (created)
    image_size: int = 32  # folder: and arrayrecord: images are resized to this
    batch_size: int = 64  # global: every process encodes batch_size / num_processes at a time
    hflip_copies: bool = False  # also store every image mirrored left-right, as extra examples
    shard_size: int = 1024  # examples per shard file
    cpu_devices: int = 0  # >0: simulate this many CPU devices
    compilation_cache_dir: str = ""
    coordinator: str = ""  # HOST:PORT of process 0 joins a jax.distributed job; "auto": cluster env
    num_processes: int = 1
    process_id: int = 0


def parse_config(argv: list[str] | None = None) -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`."""
    parser = dataclass_parser(Config, __doc__, required=("vae", "out"))
    cfg = Config(**vars(parser.parse_args(argv)))
    if cfg.shard_size < 1 or cfg.batch_size < 1:
        parser.error(f"--shard_size and --batch_size must be >= 1, got {cfg.shard_size} and {cfg.batch_size}")
    return cfg


def plan_meta(cfg: Config, source, vae) -> dict:
    """meta.json's content, known before anything is encoded (eqxdiff/data/latents.py lists the keys)."""
    images = jax.ShapeDtypeStruct((1, *source.image_shape), np.float32)
    try:  # shapes only: a size the VAE's factor does not divide, or other channels, fail here
        mean, _ = eqx.filter_eval_shape(type(vae).encode, vae, images)
    except (ValueError, TypeError) as e:
        raise SystemExit(f"--vae {cfg.vae} cannot encode the images of {source.spec}, {source.image_shape}: {e}") from e
    latent = tuple(mean.shape[1:])
    latent_field = jax.ShapeDtypeStruct(latent, np.float16)
    fields = {"mean": latent_field, "logvar": latent_field, **{k: f for k, f in source.fields.items() if k != "image"}}
    count = len(source) * (2 if cfg.hflip_copies else 1)
    return {
        "fields": fields_to_meta(fields), "vae": describe_autoencoder(cfg.vae),
        "scaling_factor": float(vae.scaling_factor), "shift_factor": float(vae.shift_factor),
        "latent_shape": list(latent), "count": count, "shard_size": cfg.shard_size,
        "num_shards": -(-count // cfg.shard_size), "num_classes": source.num_classes,
        "source": source.spec, "image_shape": list(source.image_shape), "hflip_copies": cfg.hflip_copies,
    }  # fmt: skip


def identity(meta: dict) -> dict:
    """What must agree for two encodes to share a folder: everything, the VAE by its weights
    (or spec, when weightless) rather than by where its folder is."""
    return {**meta, "vae": meta["vae"]["weights_sha256"] or meta["vae"]["spec"]}


def refuse_other_encode(out: Path, plan: dict) -> None:
    """Stop if `out` holds (the start of) an encode with other settings: shards must not mix."""
    for name in (META, PLAN):
        if (out / name).is_file():
            old, new = identity(json.loads((out / name).read_text())), identity(plan)
            differ = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            if differ:
                raise SystemExit(
                    f"{out} holds another encode ({name} differs in {', '.join(differ)}: "
                    f"{[old.get(k) for k in differ]} there, {[new.get(k) for k in differ]} now); "
                    "choose a new --out or delete that folder."
                )


def write_json(path: Path, obj: dict) -> None:
    """Written whole or not at all (temporary file + rename)."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def read_example(source, g: int) -> dict:
    """Global example g: source example g, or (g >= len(source), hflip copies) g - N mirrored."""
    n = len(source)
    example = source[g % n]
    return {**example, "image": example["image"][:, ::-1]} if g >= n else example


def host_batches(source, indices: list[int], batch_size: int, pool: ThreadPoolExecutor):
    """(other fields, uint8 images padded to batch_size, rows) for consecutive runs of `indices`;
    the padding repeats the last image so every batch has one shape (one compile)."""
    for start in range(0, len(indices), batch_size):
        examples = list(pool.map(lambda g: read_example(source, g), indices[start : start + batch_size]))
        images = np.stack([e["image"] for e in examples])
        rows = len(images)
        images = np.concatenate([images, np.repeat(images[-1:], batch_size - rows, axis=0)])
        others = [{k: v for k, v in e.items() if k != "image"} for e in examples]
        yield others, images, rows


@eqx.filter_jit
def encode_uint8(vae, images):
    """uint8 images -> float16 (mean, logvar), cast on device (half the bytes to copy back)."""
    mean, logvar = vae.encode(from_uint8(images))
    return mean.astype(np.float16), logvar.astype(np.float16)


def main(cfg: Config) -> None:
    start_jax(cfg)
    out = Path(cfg.out).expanduser()
    source = open_source(cfg.dataset, cfg.image_size)
    if "image" not in source.fields:
        raise SystemExit(f"--dataset {cfg.dataset} has no image field to encode (fields: {sorted(source.fields)}).")
    process, processes = jax.process_index(), jax.process_count()
    if cfg.batch_size % jax.device_count():
        raise SystemExit(f"--batch_size {cfg.batch_size} must be a multiple of the devices ({jax.device_count()}).")
    # Each process encodes its own shards on its own devices: no process waits for another until the end.
    mesh = make_mesh(devices=jax.local_devices())
    vae = open_autoencoder(cfg.vae, mesh=mesh)
    plan = plan_meta(cfg, source, vae)
    out.mkdir(parents=True, exist_ok=True)
    refuse_other_encode(out, plan)
    if process == 0:
        write_json(out / PLAN, plan)

    num_shards, size = plan["num_shards"], cfg.shard_size
    mine = [k for k in range(num_shards) if k % processes == process]
    for k in mine:  # an interrupted run's half-written shards
        (out / (shard_name(k, num_shards) + TMP_SUFFIX)).unlink(missing_ok=True)
    pending = [k for k in mine if not (out / shard_name(k, num_shards)).is_file()]
    shards = collections.deque((k, range(k * size, min((k + 1) * size, plan["count"]))) for k in pending)
    indices = [g for _, r in shards for g in r]

    fields = {k: jax.ShapeDtypeStruct(tuple(f["shape"]), np.dtype(f["dtype"])) for k, f in plan["fields"].items()}
    sharding = batch_sharding(mesh)
    records: list[bytes] = []
    bar = tqdm(total=len(indices), unit="img", desc="encode", disable=process != 0, smoothing=0.1)
    started = time.perf_counter()

    def collect(others, rows, moments) -> None:
        """Bring one batch's moments to the host; write every shard that is now complete."""
        mean, logvar = (np.asarray(m)[:rows] for m in moments)
        for i, other in enumerate(others):
            records.append(record_bytes({"mean": mean[i], "logvar": logvar[i], **other}, fields))
        while shards and len(records) >= len(shards[0][1]):
            k, r = shards.popleft()
            write_shard(out, k, num_shards, records[: len(r)])
            del records[: len(r)]
        bar.update(rows)

    batch = cfg.batch_size // processes
    with ThreadPoolExecutor(8) as pool:
        batches = host_batches(source, indices, batch, pool)
        with Prefetch(batches, lambda b: (b[0], jax.device_put(b[1], sharding), b[2]), depth=2) as device_batches:
            in_flight = collections.deque()  # one batch encodes while the previous one is collected
            for others, images, rows in device_batches:
                in_flight.append((others, rows, encode_uint8(vae, images)))
                if len(in_flight) > 1:
                    collect(*in_flight.popleft())
            while in_flight:
                collect(*in_flight.popleft())
    bar.close()
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
    main(parse_config())
