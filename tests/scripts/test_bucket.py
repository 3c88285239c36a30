"""Runs whose --run_dir is a bucket (gs://), against the local GCS server of tests/bucket.py: checkpoints through
orbax and tensorstore, metrics.jsonl and run.json through etils.epath, resumed as on local disk; datasets (npz,
image folders, ArrayRecord files, latents), FID statistics, weight folders and the compile cache in a bucket."""

import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import encode as train_encode  # train/encode.py
import equinox as eqx
import fid_stats  # train/fid_stats.py
import fsspec
import gcsfs
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from fsspec.asyn import sync
from PIL import Image
from eqxdiff.run.rebuild import load_run
from runs import (
    LATENT_RUN,
    REFERENCE,
    REFERENCE_STEPS,
    TINY,
    assert_bitwise_equal,
    committed,
    metric_rows,
    run,
    saved_arrays,
    train_here,
)
from tests.eval.test_feature_stats import random_projection

from eqxdiff.autoencoders import check_autoencoder, describe_autoencoder, open_autoencoder
from eqxdiff.data import open_source, write_arrayrecord
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.eval import fid
from eqxdiff.images import save_image_grid
from eqxdiff.eval.fid import is_image_batch, load_reference
from eqxdiff.local_copies import local_copy
from eqxdiff.paths import append_text, as_path, write_whole
from eqxdiff.sharding import make_mesh
from eqxdiff.training import MetricsLogger
from eqxdiff.text.conditioning import check_text_folders, open_text_conditioning, tokenizer_location

STEPS = REFERENCE_STEPS
ROOT = Path(__file__).parents[2]
DATA = ROOT / "tests" / "data"
ARGS = [*REFERENCE, "--cpu_devices", 8]  # conftest's eight_device_run: the uninterrupted run


def counted(method, calls: list):
    """`method` (an async filesystem method), appending its path argument to `calls` on each call."""

    async def wrapper(self, path, *args, **kwargs):
        calls.append(path)
        return await method(self, path, *args, **kwargs)

    return wrapper


def arrays_by_path(tree) -> dict[str, np.ndarray]:
    flat, _ = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))
    return {jax.tree_util.keystr(path): np.asarray(x) for path, x in flat}


def test_objects_are_replaced_and_appended_whole(bucket):
    """metrics.jsonl's append and run.json's replacement, in a store that can do neither in place."""
    path = as_path(f"{bucket}/run/metrics.jsonl")
    for line in ("a\n", "b\n"):
        append_text(path, line)
    assert path.read_text() == "a\nb\n"
    write_whole(path, "c\n")
    append_text(path, "d\n")
    assert path.read_text() == "c\nd\n"


def test_npz_dataset_in_a_bucket_reads_as_its_local_copy(bucket, tmp_path):
    rng = np.random.default_rng(0)
    local = tmp_path / "pets.npz"
    np.savez(local, images=rng.integers(0, 256, (6, 4, 4, 3), dtype=np.uint8), labels=np.arange(6) % 2)
    as_path(f"{bucket}/data/pets.npz").write_bytes(local.read_bytes())
    in_bucket, on_disk = open_source(f"npz:{bucket}/data/pets.npz"), open_source(f"npz:{local}")
    assert len(in_bucket) == len(on_disk) == 6
    for i in range(6):
        assert {k: v.tobytes() for k, v in in_bucket[i].items()} == {k: v.tobytes() for k, v in on_disk[i].items()}


def test_a_local_copy_follows_its_objects(bucket, tmp_path, monkeypatch):
    """local_copy of a prefix: fetched into $EQXDIFF_CACHE, fetched again when an object changes (rewritten at the
    same size: the change is told by more than name and size), and a file deleted from the bucket is gone from the
    copy; a single object's copy the same."""
    folder = as_path(f"{bucket}/weights")
    (folder / "a.bin").write_bytes(b"first")
    (folder / "sub" / "b.json").write_text("{}")
    (folder / "c.txt").write_text("unchanged")
    copy = local_copy(folder)
    kept = (copy / "c.txt").stat().st_ino  # an unchanged object is not fetched again (a fetch renames a new file in)
    assert copy.is_relative_to(os.environ["EQXDIFF_CACHE"])
    assert (copy / "a.bin").read_bytes() == b"first" and (copy / "sub" / "b.json").read_text() == "{}"
    (folder / "a.bin").write_bytes(b"again")  # as many bytes as b"first"
    (folder / "sub" / "b.json").unlink()
    infos = []  # metadata requests: the prefix's listing has every object's, so none per file
    fs = fsspec.core.url_to_fs(str(folder))[0]  # gcsfs's cached instance: its sync `info` wraps the async `_info`
    monkeypatch.setattr(gcsfs.GCSFileSystem, "_info", counted(gcsfs.GCSFileSystem._info, infos))
    monkeypatch.setattr(
        fs, "info", lambda path, **kwargs: infos.append(path) or sync(fs.loop, fs._info, path, **kwargs)
    )
    assert local_copy(folder) == copy and (copy / "a.bin").read_bytes() == b"again"
    assert not (copy / "sub" / "b.json").exists() and (copy / "c.txt").stat().st_ino == kept
    assert not [p for p in infos if p.endswith("c.txt")]  # an unchanged object: no request of its own
    with pytest.raises(FileNotFoundError, match=f"{bucket}/nothing: no such object or prefix"):
        local_copy(f"{bucket}/nothing")
    one = as_path(f"{bucket}/one.bin")
    for content in (b"1234", b"abcd"):  # one size
        one.write_bytes(content)
        assert local_copy(one).read_bytes() == content


@pytest.mark.slow  # encode.py and a latent run end to end
def test_a_latent_run_reads_the_latents_encode_wrote_in_a_bucket(bucket, tmp_path):
    """encode.py --out gs://...: its shards and meta.json in the bucket are the local encode's bytes, read back
    (from their local copy) as the local latents' examples; a run trains on latents:gs://..."""
    flags = ["--dataset", "digits", "--vae", "space_to_depth:2", "--shard_size", "1024"]  # two shards
    local, in_bucket = tmp_path / "latents", as_path(f"{bucket}/latents")
    for out in (local, in_bucket):
        train_encode.main(train_encode.parse_config([*flags, "--out", str(out)]))
    names = sorted(p.name for p in local.iterdir())
    assert sorted(p.name for p in in_bucket.iterdir()) == names and "meta.json" in names
    assert all((in_bucket / name).read_bytes() == (local / name).read_bytes() for name in names)
    from_bucket, from_disk = open_source(f"latents:{in_bucket}"), open_source(f"latents:{local}")
    assert len(from_bucket) == len(from_disk) == 1797
    for i in (0, 1023, 1024, 1796):  # both shards' ends
        assert {k: v.tobytes() for k, v in from_bucket[i].items()} == {k: v.tobytes() for k, v in from_disk[i].items()}
    train_here("--run_dir", tmp_path / "run", *LATENT_RUN, "--dataset", f"latents:{in_bucket}")
    assert [r["step"] for r in metric_rows(tmp_path / "run")] == [1, 2]


class Unauthorized(http.server.BaseHTTPRequestHandler):
    """GCS's answer to a request without valid credentials, whatever is asked."""

    def do_GET(self):
        body = json.dumps({"error": {"code": 401, "message": "Anonymous caller does not have storage.objects.list"}})
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    do_POST = do_PUT = do_DELETE = do_GET

    def log_message(self, *args):
        pass


def test_a_bucket_without_credentials_is_one_line(tmp_path, monkeypatch):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unauthorized)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{server.server_address[1]}")
    monkeypatch.setenv("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
    monkeypatch.chdir(tmp_path)
    fsspec.filesystem("gs").clear_instance_cache()  # a gs:// client made for another server must not answer
    try:
        with pytest.raises(SystemExit) as stop:
            train_here("--run_dir", "gs://private-bucket/run", *TINY, "--steps", 2)
    finally:
        server.shutdown()
        server.server_close()
        fsspec.filesystem("gs").clear_instance_cache()
    assert stop.value.code.startswith("--run_dir gs://private-bucket/run: cannot read the bucket: "), stop.value.code
    assert "\n" not in stop.value.code and list(tmp_path.iterdir()) == []


def records_bytes(source) -> list[dict[str, bytes]]:
    return [{k: np.asarray(v).tobytes() for k, v in source[i].items()} for i in range(len(source))]


def test_an_image_folder_in_a_bucket_reads_as_the_local_folder(bucket, tmp_path):
    """folder:gs://...: the prefix's local copy (class sub-folders, captions beside the images) read as the folder
    it was uploaded from; a prefix that holds nothing is one error naming it."""
    rng = np.random.default_rng(0)
    for name, mode in [("cat/a.png", "RGB"), ("cat/b.png", "L"), ("dog/c.png", "RGB")]:
        (tmp_path / "pets" / name).parent.mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 256, (6, 5, 3), dtype=np.uint8)).convert(mode).save(tmp_path / "pets" / name)
        (tmp_path / "pets" / name).with_suffix(".txt").write_text(f"a photo of {name}")
    put_folder(tmp_path / "pets", f"{bucket}/pets")
    in_bucket = open_source(f"folder:{bucket}/pets", 4, captions=True)
    on_disk = open_source(f"folder:{tmp_path / 'pets'}", 4, captions=True)
    assert in_bucket.class_names == on_disk.class_names == ["cat", "dog"] and len(in_bucket) == 3
    assert records_bytes(in_bucket) == records_bytes(on_disk)
    with pytest.raises(FileNotFoundError, match=f"Dataset folder not found: {bucket}/nothing: no such .*folder:"):
        open_source(f"folder:{bucket}/nothing")


def test_arrayrecord_files_in_a_bucket_read_as_the_local_files(bucket, tmp_path):
    """arrayrecord:gs://.../GLOB: the objects the glob matches (not the others beside them), from their local
    copies, read as the local files; a glob that matches nothing, or names no bucket, is one error naming it."""
    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (5, 4, 4, 3), dtype=np.uint8), np.array([0, 1, 2, 0, 1])
    write_arrayrecord(tmp_path / "train-0.array_record", images[:3], labels[:3], num_classes=3)
    write_arrayrecord(tmp_path / "train-1.array_record", images[3:], labels[3:], num_classes=3)
    write_arrayrecord(tmp_path / "val-0.array_record", images[:1], labels[:1], num_classes=3)
    put_folder(tmp_path, f"{bucket}/records")
    in_bucket = open_source(f"arrayrecord:{bucket}/records/train-*.array_record", 4)
    on_disk = open_source(f"arrayrecord:{tmp_path}/train-*.array_record", 4)
    assert len(in_bucket) == len(on_disk) == 5
    assert records_bytes(in_bucket) == records_bytes(on_disk)
    for nothing in (f"{bucket}/records/test-*.array_record", "gs://no-such-bucket/records/*.array_record"):
        with pytest.raises(FileNotFoundError, match=f"^No ArrayRecord files match {nothing.replace('*', '.')} "):
            open_source(f"arrayrecord:{nothing}", 4)


@pytest.mark.slow
def test_a_run_in_a_bucket_resumes_over_a_torn_save_bitwise(bucket, eight_device_run, tmp_path, capsys):
    """The uninterrupted run as a kill after its step-18 checkpoint leaves it, put in a bucket: its later rows in
    metrics.jsonl (dropped on resume) and step 24's folder as a kill in the middle of its save leaves it (objects,
    no commit_success.txt: a bucket cannot rename a finished step into place). The same command resumes from the
    newest committed step, saves over the torn one, prunes to --keep_checkpoints (2 here: step 12 goes) in the
    bucket and ends equal to the uninterrupted run. (A live run SIGKILLed and restarted: tests/scripts/test_resume.py,
    on local disk; a copied run resumed in a bucket by 2 processes: tests/scripts/test_multihost.py. A run started
    and killed here left the same state, a committed step and a torn one, for a process more: 29.6 -> 17.2 s, loaded
    box; resumed from step 18 rather than 12, 6 steps and one save to the bucket fewer.)"""
    shutil.copytree(eight_device_run, tmp_path / "run")
    shutil.rmtree(tmp_path / "run" / "checkpoints" / str(STEPS))
    run_dir = as_path(f"{bucket}/run")
    put_folder(tmp_path / "run", str(run_dir))
    killed_at = STEPS - 6
    assert committed(run_dir) == [killed_at - 6, killed_at] and len(metric_rows(run_dir)) == STEPS
    torn = run_dir / "checkpoints" / str(killed_at + 6)
    (torn / "state" / "_METADATA").write_text("{torn")  # what a save cut short leaves: no commit_success.txt
    result = run("main.py", "--run_dir", run_dir, *ARGS, "--keep_checkpoints", 2)
    output = result.stdout + result.stderr
    assert f"resumed from {run_dir}/checkpoints/{killed_at} ({killed_at * 16} examples consumed)" in output
    assert committed(run_dir) == [STEPS - 6, STEPS]  # the oldest pruned in the bucket
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [str(STEPS - 6), str(STEPS)]
    assert_bitwise_equal(saved_arrays(run_dir, STEPS), saved_arrays(eight_device_run, STEPS))
    assert [r["step"] for r in metric_rows(run_dir)] == list(range(1, STEPS + 1))
    # What train/sample.py samples, read from the bucket: the EMA of the newest step.
    mesh = make_mesh(data=-1, fsdp=1)
    in_bucket, on_disk = load_run(str(run_dir), mesh=mesh), load_run(eight_device_run, mesh=mesh)
    assert in_bucket.step == STEPS and in_bucket.stored["run_dir"] == str(run_dir)
    assert_bitwise_equal(arrays_by_path(in_bucket.ema), arrays_by_path(on_disk.ema))
    # The checks that read the run's saved config before anything compiles: a finished run, a changed flag.
    train_here("--run_dir", run_dir)
    assert f"{run_dir} is already at step {STEPS}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--seed 1 \(saved: 0\) cannot change"):
        train_here("--run_dir", run_dir, "--seed", 1, "--steps", STEPS + 6)


@pytest.mark.parametrize(
    "url, says",
    [
        ("gs://no-such-bucket/run", "--run_dir gs://no-such-bucket/run: no bucket gs://no-such-bucket"),
        ("gs://Not_A_Bucket/run", "--run_dir gs://Not_A_Bucket/run: 'Not_A_Bucket' is not a bucket name"),
        ("s3://bucket/run", "--run_dir s3://bucket/run: orbax writes checkpoints to gs:// and local paths only"),
    ],
)
def test_a_bad_bucket_is_one_line_and_nothing_is_written_locally(gcs_server, url, says, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where a URL mistaken for a local path would be written
    with pytest.raises(SystemExit) as stop:
        train_here("--run_dir", url, *TINY, "--steps", 2)
    assert isinstance(stop.value.code, str) and stop.value.code.startswith(says), stop.value.code
    assert "\n" not in stop.value.code
    assert list(tmp_path.iterdir()) == []


def put_folder(local: Path, url: str) -> None:
    """Upload the files of a local folder to the prefix `url`."""
    fsspec.filesystem("gs").put(f"{local}/", url.removeprefix("gs://"), recursive=True)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def test_weight_folders_in_a_bucket_load_as_the_local_folders(bucket):
    """--vae gs://... and --text_encoder gs://... (with the tokenizer/ beside it): copied into $EQXDIFF_CACHE and
    loaded from there, the local folders' weights and tokens; what encode's meta.json records is the URL."""
    for local, name in [
        (DATA / "autoencoder_kl" / "flux_like", "vae"),
        (DATA / "sdxl_text" / "text_encoder", "text_encoder"),
        (DATA / "clip_tokenizer" / "sd1", "tokenizer"),
    ]:
        put_folder(local, f"{bucket}/sd/{name}")
    vae = f"{bucket}/sd/vae"
    check_autoencoder(vae)
    assert all(
        np.array_equal(a, b)
        for a, b in zip(
            leaves(open_autoencoder(vae)),
            leaves(open_autoencoder(str(DATA / "autoencoder_kl" / "flux_like"))),
            strict=True,
        )
    )
    described = describe_autoencoder(vae)
    assert described["path"] == vae
    assert (
        described["weights_sha256"]
        == describe_autoencoder(str(DATA / "autoencoder_kl" / "flux_like"))["weights_sha256"]
    )
    text = f"{bucket}/sd/text_encoder"
    check_text_folders(text)
    assert tokenizer_location(text, "") == f"{bucket}/sd/tokenizer"
    in_bucket = open_text_conditioning(text, "")
    on_disk = open_text_conditioning(str(DATA / "sdxl_text" / "text_encoder"), str(DATA / "clip_tokenizer" / "sd1"))
    assert all(np.array_equal(a, b) for a, b in zip(leaves(in_bucket.encoder), leaves(on_disk.encoder), strict=True))
    captions = ["a photo of a cat", ""]
    assert all(np.array_equal(in_bucket.tokens(captions)[k], v) for k, v in on_disk.tokens(captions).items())
    with pytest.raises(FileNotFoundError, match=f"--text_encoder {bucket}/sd/nothing: {bucket}/sd/nothing: no such"):
        check_text_folders(f"{bucket}/sd/nothing")
    with pytest.raises(FileNotFoundError, match=f"Autoencoder '{bucket}/sd/nothing': {bucket}/sd/nothing: no such"):
        check_autoencoder(f"{bucket}/sd/nothing")


def test_fid_statistics_written_to_a_bucket_are_read_from_it(bucket):
    """train/fid_stats.py --out gs://...: the file in the bucket holds the dataset's statistics, which
    --fid_ref gs://... reads (open_fid's is_image_batch and load_reference)."""
    features_fn, _ = random_projection()
    url = f"{bucket}/fid/digits.npz"
    fid_stats.main(fid_stats.parse_config(["--inception", "unused", "--out", url, "--batch_size", "64"]), features_fn)
    assert not is_image_batch(url)
    reference = load_reference(url, dim=16)
    whole = fid_stats.dataset_stats(open_source("digits"), features_fn, 64, progress=False)
    for a, b in zip((reference.mu, reference.sigma), whole.mean_cov(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    assert reference.dataset == "digits"


def test_snapshots_grids_and_the_wandb_id_of_a_run_go_to_its_bucket(bucket, tmp_path):
    """What a gs:// run writes besides checkpoints and metrics: post-hoc EMA snapshots (orbax through
    tensorstore, read back with their meta), sample grids (the local file's bytes) and the wandb id file (made
    once, the same id on the next start)."""
    run = f"{bucket}/run"
    emas = ({"w": jnp.arange(6.0).reshape(2, 3), "b": jnp.ones(3)},)
    with EmaSnapshots(f"{run}/phema") as snapshots:
        assert snapshots.save(4, emas, {"sigma_rels": [0.05]}) == "saved"
    with EmaSnapshots(f"{run}/phema", read_only=True) as snapshots:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), emas)
        shardings = jax.tree.map(lambda x: x.sharding, emas)
        restored = snapshots.restore(4, abstract, shardings)
        on_host = snapshots.restore(4, abstract, None)  # as train/posthoc_ema.py reads them
        assert snapshots.steps == [4] and snapshots.meta(4) == {"sigma_rels": [0.05]}
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), restored, emas)
    assert all(isinstance(a, np.ndarray) for a in jax.tree.leaves(on_host))
    jax.tree.map(np.testing.assert_array_equal, on_host, jax.tree.map(np.asarray, emas))
    images = np.linspace(-1, 1, 4 * 8 * 8).reshape(4, 8, 8, 1)
    save_image_grid(f"{run}/samples/step_000004.png", images, ncols=2, upscale=2)
    save_image_grid(tmp_path / "grid.png", images, ncols=2, upscale=2)
    assert as_path(f"{run}/samples/step_000004.png").read_bytes() == (tmp_path / "grid.png").read_bytes()
    first = MetricsLogger(run, wandb_mode="disabled").wandb_run_id()
    assert as_path(f"{run}/wandb_run_id").exists() and MetricsLogger(run, wandb_mode="disabled").wandb_run_id() == first
    assert not list(tmp_path.glob("gs*")) and not Path("gs:").exists()


def test_inception_weights_in_a_bucket_are_read_from_their_local_copy(bucket, monkeypatch):
    """--inception gs://...: load_inception hands the port a local file with the object's bytes (the port itself
    reads local files: tests/eval/test_inception.py)."""
    url = f"{bucket}/weights/pt_inception.pth"
    as_path(url).write_bytes(b"pytorch-fid's weights")
    read = []
    shapes = eqx.filter_eval_shape(fid.InceptionV3, key=jax.random.key(0))  # a network's structure, no weights
    monkeypatch.setattr(fid.InceptionV3, "from_pytorch_fid", lambda p: read.append(Path(p).read_bytes()) or shapes)
    fid.load_inception(url)
    assert read == [b"pytorch-fid's weights"]


def test_the_compile_cache_in_a_bucket_is_written_by_jax(bucket):
    """--compilation_cache_dir gs://...: JAX's own cache writes its entries there (through etils.epath)."""
    script = (
        "import sys, jax; from startup import Launch, start_jax; start_jax(Launch(compilation_cache_dir="
        "sys.argv[1])); jax.jit(lambda x: x * 3 + 1)(jax.numpy.ones(7))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "train"), str(ROOT)])}
    subprocess.run([sys.executable, "-c", script, f"{bucket}/xla"], check=True, env=env, timeout=120)
    entries = list(as_path(f"{bucket}/xla").iterdir())
    assert entries and all(e.read_bytes() for e in entries)
