"""eqxdiff/eval/sample_batches.py: ADM's sample batch (arr_0 uint8 NHWC, arr_1 int64 labels), balanced classes,
chunks that a restart skips (after an exception, a SIGKILL, a torn temp file) with a result equal byte for
byte to an uninterrupted run's, other flags refused by name; and train/sample.py --format adm on a run."""

import os
import subprocess
import sys
import textwrap
import time

import jax
import numpy as np
import pytest

import eqxdiff.run.sampling
from eqxdiff.eval import sample_batches
from eqxdiff.eval.sample_batches import balanced_labels, chunk_key, parts_dir, write_sample_batches
from runs import ROOT, Started, kill, wait_for
import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts

# A stand-in sampler: images that depend on the chunk's labels and key, as a model's do.
SAMPLER = textwrap.dedent("""
    import jax, numpy as np

    def sample_chunk(labels, key, delay=0.0):
        import time; time.sleep(delay)
        n = 6 if labels is None else len(labels)
        noise = np.asarray(jax.random.randint(key, (n, 4, 5, 3), 0, 200))
        return (noise + (0 if labels is None else 5 * labels[:, None, None, None])).astype(np.uint8)
""")
namespace: dict = {}
exec(SAMPLER, namespace)
sample_chunk = namespace["sample_chunk"]
FLAGS = {"--steps": 4, "--method": "heun", "--classes": (0, 1, 2, 3, 4)}  # a tuple: JSON gives back a list


def write(out, num=23, chunk_size=6, seed=3, classes=(0, 1, 2, 3, 4), flags=FLAGS, sampler=sample_chunk):
    return write_sample_batches(
        sampler,
        out,
        num=num,
        chunk_size=chunk_size,
        seed=seed,
        classes=None if classes is None else list(classes),
        flags=flags,
    )


def test_labels_are_balanced_with_the_remainder_spread_and_shuffled_by_the_seed():
    labels = balanced_labels(23, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], seed=0)
    counts = np.bincount(labels, minlength=10)
    np.testing.assert_array_equal(counts, [3, 2, 2, 3, 2, 2, 3, 2, 2, 2])  # 23 = 10·2 + 3 at ⌊j·10/3⌋ = 0, 3, 6
    np.testing.assert_array_equal(balanced_labels(23, list(range(10)), seed=0), labels)  # a function of its args
    assert not np.array_equal(balanced_labels(23, list(range(10)), seed=1), labels)  # shuffled by the seed
    assert not np.array_equal(np.sort(labels), labels)
    np.testing.assert_array_equal(np.unique(balanced_labels(6, [7, 2], seed=0), return_counts=True), [[2, 7], [3, 3]])


def test_the_batch_is_adms_format_each_chunk_a_function_of_seed_and_index(tmp_path):
    out = write(tmp_path / "s.npz")
    with np.load(out) as saved:
        assert saved.files == ["arr_0", "arr_1"]  # np.savez(out, arr, label_arr): ADM's image_sample.py
        images, labels = saved["arr_0"], saved["arr_1"]
    assert images.dtype == np.uint8 and images.shape == (23, 4, 5, 3) and labels.dtype == np.int64
    np.testing.assert_array_equal(labels, balanced_labels(23, [0, 1, 2, 3, 4], seed=3))
    for i, start in enumerate(range(0, 23, 6)):  # the last chunk padded with its last label, then cut
        rows = np.minimum(np.arange(start, start + 6), 22)
        expected = sample_chunk(labels[rows].astype(np.int32), chunk_key(3, i))[: min(6, 23 - start)]
        np.testing.assert_array_equal(images[start : start + 6], expected)
    assert not parts_dir(out).exists()  # its chunks are in the batch now
    keys = [np.asarray(jax.random.key_data(k)) for k in (chunk_key(3, 0), chunk_key(3, 1), chunk_key(4, 0))]
    assert all(not np.array_equal(a, b) for a, b in [(keys[0], keys[1]), (keys[0], keys[2]), (keys[1], keys[2])])

    unconditional = write(tmp_path / "u.npz", num=7, classes=None)
    with np.load(unconditional) as saved:
        assert saved.files == ["arr_0"] and saved["arr_0"].shape == (7, 4, 5, 3)


class Preempted(Exception):
    pass


def test_a_restart_skips_the_finished_chunks_and_ends_bitwise_equal(tmp_path):
    reference = write(tmp_path / "ref.npz").read_bytes()
    calls = []

    def preempted_after_two(labels, key):
        if len(calls) == 2:
            raise Preempted
        calls.append(key)
        return sample_chunk(labels, key)

    out = tmp_path / "s.npz"
    with pytest.raises(Preempted):
        write(out, sampler=preempted_after_two)
    assert sorted(p.name for p in parts_dir(out).glob("chunk_*")) == ["chunk_000000.npz", "chunk_000001.npz"]
    assert not out.exists()
    (parts_dir(out) / ".chunk_000002.npz.123.tmp").write_bytes(b"torn")  # killed while writing: never renamed
    resumed = []
    write(out, sampler=lambda labels, key: resumed.append(key) or sample_chunk(labels, key))
    assert len(resumed) == 2  # chunks 2 and 3 of 4 only
    assert out.read_bytes() == reference

    out2 = tmp_path / "deleted.npz"  # a chunk lost from the parts is made again, the same
    with pytest.raises(Preempted):
        calls.clear()
        write(out2, sampler=preempted_after_two)
    (parts_dir(out2) / "chunk_000000.npz").unlink()
    write(out2)
    assert out2.read_bytes() == reference


def test_a_chunk_is_renamed_into_place_only_once_written(tmp_path, monkeypatch):
    out = tmp_path / "s.npz"

    def torn_savez(f, **arrays):  # the process dies half-way through writing a chunk
        f.write(b"PK\x03\x04 half a chunk")
        raise Preempted

    monkeypatch.setattr(sample_batches.np, "savez", torn_savez)
    with pytest.raises(Preempted):
        write(out)
    assert not list(parts_dir(out).glob("chunk_*")) and (parts_dir(out) / "flags.json").exists()
    monkeypatch.undo()
    assert write(out).read_bytes() == write(tmp_path / "ref.npz").read_bytes()


def test_a_second_writer_of_the_same_out_is_refused_in_one_line(tmp_path):
    """While one process writes --out X.npz, another asked for the same X.npz is refused before it samples (the
    first removes X.npz.parts/ when it finishes, under the other's feet); once it is done, X.npz can be written
    again."""
    out, said = tmp_path / "s.npz", []

    def meanwhile(labels, key):  # the second writer starts while the first samples its first chunk
        if not said:
            with pytest.raises(SystemExit) as refused:
                write(out, sampler=lambda *_: pytest.fail("the second writer sampled"))
            said.append(str(refused.value.code))
        return sample_chunk(labels, key)

    reference = write(tmp_path / "ref.npz").read_bytes()
    assert write(out, sampler=meanwhile).read_bytes() == reference  # the first writer is undisturbed
    assert said == [
        f"--out {out}: process {os.getpid()} is writing it (its chunks in {parts_dir(out)}); wait for it "
        "to finish, or choose another --out."
    ]
    assert write(out).read_bytes() == reference and not parts_dir(out).exists()


def test_a_restart_with_other_flags_is_refused_naming_them(tmp_path):
    out = tmp_path / "s.npz"

    def fail(labels, key):
        raise Preempted

    with pytest.raises(Preempted):
        write(out, sampler=fail)
    with pytest.raises(SystemExit, match=r"--steps: 4 there, 8 now\).*pass the same flags.*remove .*s\.npz\.parts"):
        write(out, flags={**FLAGS, "--steps": 8})
    with pytest.raises(SystemExit, match=r"seed: 3 there, 4 now"):
        write(out, seed=4)
    with pytest.raises(SystemExit, match=r"--guidance: \(not given\) there, 1.5 now"):
        write(out, flags={**FLAGS, "--guidance": 1.5})
    write(out)  # the same flags: finished
    assert out.exists()


@pytest.mark.slow  # a sampling process killed and restarted
def test_a_killed_process_restarted_writes_the_same_batch(tmp_path, capsys):
    """SIGKILL (a preempted job) after some chunks, then the same batch asked for again (in this process: what
    the restart reads is the files the killed process left, its pid among them)."""
    reference = write(tmp_path / "ref.npz", num=40, chunk_size=4).read_bytes()
    out = tmp_path / "s.npz"
    script = SAMPLER + textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT / "train")!r})
        from eqxdiff.eval.sample_batches import write_sample_batches
        delay = float(sys.argv[1])
        write_sample_batches(lambda labels, key: sample_chunk(labels, key, delay), {str(out)!r}, num=40, chunk_size=4,
                             seed=3, classes=[0, 1, 2, 3, 4], flags={FLAGS!r})
    """)
    proc = Started([sys.executable, "-c", script, "0.5"])
    wait_for(lambda: len(list(parts_dir(out).glob("chunk_*.npz"))) >= 3, proc, timeout=120)
    kill(proc)
    finished = len(list(parts_dir(out).glob("chunk_*.npz")))
    assert 3 <= finished < 10 and not out.exists()
    started = time.monotonic()
    capsys.readouterr()
    write(out, num=40, chunk_size=4)
    said = capsys.readouterr().err
    assert f"{4 * finished}/40" in said  # the bar starts at the finished chunks' images, img/s and ETA
    assert "img/s" in said and time.monotonic() - started < 120
    assert out.read_bytes() == reference


# The --format adm tests below sample conftest's eight_device_run (a tiny digits run, newest step 24), which the
# session trains anyway: a run of their own cost a step's compile (sampling writes nothing into the run).
@pytest.mark.slow  # a run sampled, interrupted and sampled again
def test_sample_py_format_adm_resumes_a_run_bitwise(eight_device_run, tmp_path, monkeypatch):
    import sample  # train/sample.py

    run_dir = eight_device_run
    flags = [
        "--run_dir",
        str(run_dir),
        "--format",
        "adm",
        "--num",
        "21",
        "--batch_size",
        "5",
        "--steps",
        "2",
        "--classes",
        "3,5,7",
        "--seed",
        "1",
    ]
    sample.main(sample.parse_args([*flags, "--out", str(tmp_path / "ref.npz")]))
    with np.load(tmp_path / "ref.npz") as saved:
        images, labels = saved["arr_0"], saved["arr_1"]
    assert images.shape == (21, 8, 8, 1) and images.dtype == np.uint8 and len(np.unique(images)) > 5
    np.testing.assert_array_equal(np.unique(labels, return_counts=True), [[3, 5, 7], [7, 7, 7]])

    out = tmp_path / "s.npz"  # --batch_size 5 is 8 rows over 8 devices: chunks of 8, the second interrupted
    calls = []
    original = eqxdiff.run.sampling.generate_images

    def preempted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Preempted
        return original(*args, **kwargs)

    monkeypatch.setattr(eqxdiff.run.sampling, "generate_images", preempted)
    with pytest.raises(Preempted):
        sample.main(sample.parse_args([*flags, "--out", str(out)]))
    monkeypatch.setattr(eqxdiff.run.sampling, "generate_images", original)
    assert [p.name for p in parts_dir(out).glob("chunk_*")] == ["chunk_000000.npz"]
    with pytest.raises(SystemExit, match=r"--steps: 2 there, 3 now"):
        sample.main(sample.parse_args([*flags, "--steps", "3", "--out", str(out)]))
    sample.main(sample.parse_args([*flags, "--out", str(out)]))
    assert out.read_bytes() == (tmp_path / "ref.npz").read_bytes()

    sample.main(sample.parse_args([*flags, "--seed", "2", "--out", str(tmp_path / "seed2.npz")]))
    with np.load(tmp_path / "seed2.npz") as other:  # the noise follows --seed (through each chunk's key)
        same_labels = other["arr_1"] == labels
        changed = (other["arr_0"][same_labels] != images[same_labels]).reshape(int(same_labels.sum()), -1).mean(axis=1)
    # Each image, not their mean: a chunk that kept its noise shows. Measured on eight_device_run's step 24: 0.33-0.55
    # of each image's pixels changed (mean 0.44; its digits' flat background keeps some; a seed ignored: 0).
    assert same_labels.any() and changed.min() > 0.25, changed


def test_sample_py_format_adm_refuses_what_its_batch_cannot_hold(tmp_path):
    import dataclasses

    import jax.numpy as jnp

    import main as train_main
    import sample
    from eqxdiff.checkpoint import Checkpoints

    for extra in (["--out", "s.png"], ["--out", "s.npz", "--eval"], ["--out", "s.npz", "--prompts", "a"]):
        with pytest.raises(SystemExit):
            sample.parse_args(["--run_dir", "r", "--format", "adm", *extra])
    # A text run, refused from its saved config before anything loads (the checkpoint holds no model).
    config = dict(
        dataclasses.asdict(train_main.Config(dataset="captioned_digits")),
        image_shape=[8, 16, 1],
        num_classes=0,
        condition={"kind": "scratch_text"},
    )
    with Checkpoints(tmp_path / "t2i" / "checkpoints", async_save=False) as checkpoints:
        assert checkpoints.save(6, {"w": jnp.ones(3)}, {"examples_consumed": 0}, config) == "saved"
    with pytest.raises(
        SystemExit,
        match=r"^--format adm writes ADM's batch of images and class labels; this run is "
        r"text-to-image",
    ):
        sample.main(
            sample.parse_args(["--run_dir", str(tmp_path / "t2i"), "--format", "adm", "--out", str(tmp_path / "s.npz")])
        )
    assert not (tmp_path / "s.npz.parts").exists()


@pytest.mark.slow
def test_two_processes_finish_a_batch_one_process_began(eight_device_run, tmp_path, monkeypatch):
    """Process 0 reads which chunks are done and tells process 1: both sample the same chunks (else their
    collectives pair different chunks); the result is the one-process batch."""
    import sample

    run_dir = eight_device_run
    flags = [
        "--run_dir",
        str(run_dir),
        "--format",
        "adm",
        "--num",
        "21",
        "--batch_size",
        "8",
        "--steps",
        "2",
        "--seed",
        "2",
    ]
    sample.main(sample.parse_args([*flags, "--out", str(tmp_path / "ref.npz")]))
    out, original, calls = tmp_path / "s.npz", eqxdiff.run.sampling.generate_images, []

    def preempted(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Preempted
        return original(*args, **kwargs)

    monkeypatch.setattr(eqxdiff.run.sampling, "generate_images", preempted)
    with pytest.raises(Preempted):
        sample.main(sample.parse_args([*flags, "--out", str(out)]))
    assert [p.name for p in parts_dir(out).glob("chunk_*")] == ["chunk_000000.npz"]
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "train" / "launch_local.py"),
            "--script",
            str(ROOT / "train" / "sample.py"),
            "--num_processes",
            "2",
            "--",
            *flags,
            "--out",
            str(out),
            "--cpu_devices",
            "4",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "[p0] step 24: 21 samples" in result.stdout and "[p0] samples:  38%" in result.stderr  # began at 8/21
    assert out.read_bytes() == (tmp_path / "ref.npz").read_bytes()
