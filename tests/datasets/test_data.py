"""Dataset sources and the per-process grain pipeline: order, sharding, resume, flips, formats."""

import functools
import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
import jax
from jaxtyping import Bool, Int
from PIL import Image

from eqxdiff.data import batch_stream as threaded_batch_stream
from eqxdiff.data import (
    UnreadableImagesError,
    batch_spec,
    check_position,
    data_position,
    describe_source,
    open_source,
    write_arrayrecord,
)

pytestmark = pytest.mark.quick  # the quick tier, the edit loop (tests/README.md)

N = 13  # odd, so batches straddle epoch boundaries
# Read in the test thread (tiny in-memory data); test_stream_does_not_depend_on_num_threads covers threads.
batch_stream = functools.partial(threaded_batch_stream, num_threads=0)


class IndexedSource:
    """Example i is the 1×2×1 image [i, 200] (so its index survives and a flip shows), label i % 3."""

    fields = {"image": jax.ShapeDtypeStruct((1, 2, 1), np.uint8), "label": jax.ShapeDtypeStruct((), np.int32)}

    def __init__(self, n: int = N):
        self.n, self.spec = n, f"indexed:{n}"

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {"image": np.array([[[i], [200]]], np.uint8), "label": np.int32(i % 3)}


def decode(images: np.ndarray) -> tuple[Int[np.ndarray, " b"], Bool[np.ndarray, " b"]]:
    """Dataset indices and whether each image was mirrored, from IndexedSource batches."""
    pixels = images[:, 0, :, 0].astype(int)
    flipped = pixels[:, 0] == 200
    return np.where(flipped, pixels[:, 1], pixels[:, 0]), flipped


def take(stream, n_batches: int) -> list[dict]:
    return list(islice(stream, n_batches))


def global_batches(source, batch_size: int, n_batches: int, process_count: int, **kw) -> list[dict]:
    """Each global batch, rebuilt by concatenating processes 0..n-1 (the layout JAX gives them)."""
    shares = [
        take(batch_stream(source, batch_size, 0, process_index=p, process_count=process_count, **kw), n_batches)
        for p in range(process_count)
    ]
    return [{k: np.concatenate([s[b][k] for s in shares]) for k in ("image", "label")} for b in range(n_batches)]


def example_ids(batches: list[dict]) -> np.ndarray:
    return decode(np.concatenate([b["image"] for b in batches]))[0]


def test_order_is_fixed_by_the_seed():
    source = IndexedSource()
    first, again = (example_ids(take(batch_stream(source, 4, seed=7), 10)) for _ in range(2))
    other = example_ids(take(batch_stream(source, 4, seed=8), 10))
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)


def test_every_epoch_is_a_new_permutation_of_every_example():
    ids = example_ids(take(batch_stream(IndexedSource(), 5, seed=0), 8))[: 3 * N]  # batches straddle epochs
    epochs = ids.reshape(3, N)
    for epoch in epochs:
        np.testing.assert_array_equal(np.sort(epoch), np.arange(N))
    assert not np.array_equal(epochs[0], epochs[1]) and not np.array_equal(epochs[1], epochs[2])


def test_processes_take_contiguous_disjoint_blocks_of_the_same_global_batch():
    source = IndexedSource()
    single = take(batch_stream(source, 6, 0), 5)
    shares = [take(batch_stream(source, 6, 0, process_index=p, process_count=2), 5) for p in range(2)]
    for b in range(5):
        ids = [decode(s[b]["image"])[0] for s in shares]
        assert len(ids[0]) == len(ids[1]) == 3
        np.testing.assert_array_equal(np.concatenate(ids), decode(single[b]["image"])[0])
        for key in ("image", "label"):
            np.testing.assert_array_equal(np.concatenate([s[b][key] for s in shares]), single[b][key])
    for processes in (2, 3):
        rebuilt = global_batches(source, 6, 5, processes)
        for b in range(5):
            np.testing.assert_array_equal(rebuilt[b]["image"], single[b]["image"])


def test_batch_spec_describes_the_global_batch():
    # The train step compiles from batch_spec before the first batch exists; a mismatch would
    # cost a second compile at the first step.
    source = IndexedSource()
    spec = batch_spec(source, 6)
    (batch,) = global_batches(source, 6, 1, 3)
    assert batch.keys() == spec.keys()
    for key, want in spec.items():
        assert (batch[key].shape, batch[key].dtype) == (want.shape, want.dtype), key


def test_resume_on_another_process_count_and_global_batch_size():
    source = IndexedSource()
    uninterrupted = example_ids(take(batch_stream(source, 4, 0), 15))
    k = 11  # mid-epoch, not a multiple of either batch size
    resumed = global_batches(source, 6, 7, 2, start_example=k)
    np.testing.assert_array_equal(example_ids(resumed), uninterrupted[k : k + 42])
    labels = np.concatenate([b["label"] for b in resumed])
    np.testing.assert_array_equal(labels, uninterrupted[k : k + 42] % 3)


def test_resume_across_an_epoch_boundary():
    source = IndexedSource()
    uninterrupted = example_ids(take(batch_stream(source, 4, 3), 12))
    k = N - 2  # the first resumed batch holds the last 2 examples of epoch 0 and 2 of epoch 1
    resumed = example_ids(take(batch_stream(source, 4, 3, start_example=k), 9))
    np.testing.assert_array_equal(resumed, uninterrupted[k : k + 36])


def test_stream_does_not_depend_on_num_threads():
    streams = [take(threaded_batch_stream(IndexedSource(), 4, 1, hflip=True, num_threads=t), 8) for t in (0, 1, 3)]
    for stream in streams[1:]:
        for a, b in zip(streams[0], stream):
            np.testing.assert_array_equal(a["image"], b["image"])


def test_hflip_is_deterministic_and_process_count_independent():
    source = IndexedSource()
    flipped_1 = global_batches(source, 6, 10, 1, hflip=True)
    flipped_2 = global_batches(source, 6, 10, 2, hflip=True)
    plain = global_batches(source, 6, 10, 1)
    for a, b in zip(flipped_1, flipped_2):
        np.testing.assert_array_equal(a["image"], b["image"])
    ids, flipped = decode(np.concatenate([b["image"] for b in flipped_1]))
    np.testing.assert_array_equal(ids, example_ids(plain))  # flips change pixels, never the order
    assert 0.25 < flipped.mean() < 0.75
    again = decode(np.concatenate([b["image"] for b in global_batches(source, 6, 10, 1, hflip=True)]))[1]
    np.testing.assert_array_equal(flipped, again)
    resumed = global_batches(source, 4, 6, 2, hflip=True, start_example=17)  # flips follow g, not the batch
    uninterrupted = np.concatenate([b["image"] for b in flipped_1])
    np.testing.assert_array_equal(np.concatenate([b["image"] for b in resumed]), uninterrupted[17:41])


def test_no_flip_by_default():
    _, flipped = decode(np.concatenate([b["image"] for b in take(batch_stream(IndexedSource(), 6, 0), 10)]))
    assert not flipped.any()


def test_global_batch_must_divide_over_processes():
    with pytest.raises(ValueError, match="multiple of the process count 4"):
        batch_stream(IndexedSource(), 6, 0, process_count=4)


def test_digits_source():
    source = open_source("digits")
    assert (len(source), source.image_shape, source.num_classes) == (1797, (8, 8, 1), 10)
    (batch,) = take(batch_stream(source, 200, 0), 1)
    assert batch["image"].shape == (200, 8, 8, 1) and batch["image"].dtype == np.uint8
    assert batch["image"].min() == 0 and batch["image"].max() == 255  # levels 0 and 16 both occur
    assert set(batch["label"].tolist()) == set(range(10))


def test_npz_source_with_and_without_labels(tmp_path: Path):
    images = np.random.default_rng(0).integers(0, 256, (5, 4, 6, 3), dtype=np.uint8)
    np.savez(tmp_path / "labeled.npz", images=images, labels=np.array([0, 2, 1, 2, 0]))
    np.savez(tmp_path / "unlabeled.npz", images=images)
    labeled = open_source(f"npz:{tmp_path / 'labeled.npz'}", image_size=99)  # npz keeps its stored size
    assert (len(labeled), labeled.image_shape, labeled.num_classes) == (5, (4, 6, 3), 3)
    np.testing.assert_array_equal(labeled[1]["image"], images[1])
    assert labeled[1]["label"] == 2
    unlabeled = open_source(f"npz:{tmp_path / 'unlabeled.npz'}")
    assert unlabeled.num_classes == 0 and unlabeled[3].keys() == {"image"}  # unlabeled: no label field
    (batch,) = take(batch_stream(unlabeled, 5, 0), 1)
    assert batch.keys() == {"image"}
    np.testing.assert_array_equal(np.sort(batch["image"].ravel()), np.sort(images.ravel()))


def write_png(path: Path, color, size=(12, 10), mode="RGB") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, color).save(path)


def test_folder_source_with_class_subfolders(tmp_path: Path):
    write_png(tmp_path / "dogs" / "b.png", (0, 0, 255))
    write_png(tmp_path / "cats" / "a.png", (255, 0, 0))
    write_png(tmp_path / "dogs" / "c.png", 128, mode="L")  # one grayscale file: the folder is still RGB
    (tmp_path / "cats" / "notes.txt").write_text("not an image, ignored")
    source = open_source(f"folder:{tmp_path}", image_size=8)
    assert (len(source), source.image_shape, source.num_classes) == (3, (8, 8, 3), 2)
    assert [source[i]["label"] for i in range(3)] == [0, 1, 1]  # sorted class names: cats, dogs
    np.testing.assert_array_equal(source[0]["image"], np.broadcast_to(np.uint8([255, 0, 0]), (8, 8, 3)))
    np.testing.assert_array_equal(source[2]["image"], np.full((8, 8, 3), 128, np.uint8))


def test_folder_source_unlabeled_grayscale(tmp_path: Path):
    for i in range(3):
        write_png(tmp_path / f"{i}.png", 40 * i, size=(6, 6), mode="L")
    source = open_source(f"folder:{tmp_path}", image_size=4)
    assert (len(source), source.image_shape, source.num_classes) == (3, (4, 4, 1), 0)
    np.testing.assert_array_equal(source[2]["image"], np.full((4, 4, 1), 80, np.uint8))


def write_truncated(path: Path, mode: str = "RGB") -> None:
    """A noise image whose header is intact but whose pixel data is cut in half."""
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(noise).convert(mode).save(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_folder_corrupt_files_are_named(tmp_path: Path):
    write_png(tmp_path / "ok.png", (1, 2, 3))
    (tmp_path / "bad.png").write_bytes(b"definitely not a png")
    with pytest.raises(ValueError, match="bad.png"):
        open_source(f"folder:{tmp_path}")
    write_truncated(tmp_path / "bad.png")  # header fine, pixels cut: found at open too, since every file is decoded
    with pytest.raises(ValueError, match="bad.png"):
        open_source(f"folder:{tmp_path}")
    write_png(tmp_path / "bad.png", (4, 5, 6))
    source = open_source(f"folder:{tmp_path}")
    write_truncated(tmp_path / "bad.png")  # broken after the open: the read names it
    with pytest.raises(ValueError, match="bad.png"):
        source[0]


def broken_folder(root: Path) -> list[str]:
    """Two good images (a PNG and a JPEG), a truncated PNG, a truncated JPEG and a text file named .png;
    returns the names of the three bad ones."""
    write_png(root / "good.png", (10, 20, 30))
    Image.new("RGB", (16, 16), (200, 100, 50)).save(root / "good.jpg")
    write_truncated(root / "cut.png")
    write_truncated(root / "cut.jpg")
    (root / "fake.png").write_text("not an image")
    return ["cut.jpg", "cut.png", "fake.png"]


def test_folder_lists_every_unreadable_file_in_one_error(tmp_path: Path):
    bad = broken_folder(tmp_path)
    with pytest.raises(UnreadableImagesError) as error:
        open_source(f"folder:{tmp_path}")
    message = str(error.value)
    assert message.startswith(f"3 of 5 image files in {tmp_path} cannot be read:")
    for name in bad:
        assert f"{tmp_path / name}: " in message
    assert "truncated" in message  # pillow's reason is kept
    assert message.endswith("skip_bad_images=True (train/main.py: --skip_bad_images) to go without them.")
    assert sorted(p.name for p, _ in error.value.bad) == bad


def test_folder_skip_bad_images_keeps_the_readable_ones(tmp_path: Path):
    bad = broken_folder(tmp_path)
    source = open_source(f"folder:{tmp_path}", image_size=4, skip_bad_images=True)
    assert len(source) == 2 and sorted(p.name for p, _ in source.skipped) == bad
    assert all(reason for _, reason in source.skipped)
    np.testing.assert_array_equal(source[1]["image"], np.broadcast_to(np.uint8([10, 20, 30]), (4, 4, 3)))
    assert abs(source[0]["image"].astype(int) - [200, 100, 50]).max() <= 3  # good.jpg (JPEG: near, not exact)
    assert describe_source(source).endswith("3 unreadable files skipped")
    (batch,) = take(batch_stream(source, 4, 0), 1)  # every kept record reads through the pipeline
    assert batch["image"].shape == (4, 4, 4, 3)


def test_folder_skip_bad_images_channels_and_captions_come_from_the_kept_files(tmp_path: Path):
    write_png(tmp_path / "gray.png", 90, mode="L")
    (tmp_path / "gray.txt").write_text("a gray square")
    write_truncated(tmp_path / "color.png")  # RGB and uncaptioned: neither counts once it is skipped
    source = open_source(f"folder:{tmp_path}", image_size=4, captions=True, skip_bad_images=True)
    assert (len(source), source.image_shape, source[0]["caption"]) == (1, (4, 4, 1), "a gray square")


def test_folder_unreadable_errors_stay_short_and_all_bad_is_an_error(tmp_path: Path):
    for i in range(23):
        (tmp_path / f"x{i:02d}.png").write_text("not an image")
    with pytest.raises(UnreadableImagesError, match="none of the images is readable") as error:
        open_source(f"folder:{tmp_path}", skip_bad_images=True)
    lines = str(error.value).splitlines()
    assert len(lines) == 1 + 20 + 1 + 1 and lines[-2] == "  ... and 3 more"


def test_describe_source(tmp_path: Path):
    write_png(tmp_path / "pets" / "dogs" / "b.png", (0, 0, 255))
    write_png(tmp_path / "pets" / "cats" / "a.png", (255, 0, 0))
    write_png(tmp_path / "pets" / "dogs" / "c.png", (0, 255, 0))
    pets = open_source(f"folder:{tmp_path / 'pets'}", image_size=8)
    want = f"folder:{tmp_path / 'pets'}: 3 images, classes 0=cats, 1=dogs, model input 8×8×3 after resizing"
    assert describe_source(pets) == want
    assert describe_source(open_source("digits")) == "digits: 1,797 images, labels 0..9, model input 8×8×1"
    images = np.zeros((5, 4, 6, 3), np.uint8)
    np.savez(tmp_path / "plain.npz", images=images)
    assert describe_source(open_source(f"npz:{tmp_path / 'plain.npz'}")) == (
        f"npz:{tmp_path / 'plain.npz'}: 5 images, unlabeled, model input 4×6×3"
    )
    for k in range(12):
        write_png(tmp_path / "many" / f"class{k:02d}" / "a.png", (k, k, k))
    many = describe_source(open_source(f"folder:{tmp_path / 'many'}", image_size=4))
    assert "classes 0=class00, 1=class01," in many and "9=class09, ... (12 classes)," in many
    assert "class10" not in many


def test_missing_paths_raise_file_not_found(tmp_path: Path):
    for spec in ("npz:{}/x.npz", "folder:{}/images", "arrayrecord:{}/*.array_record"):
        spec = spec.format(tmp_path / "missing")
        with pytest.raises(FileNotFoundError, match=str(tmp_path / "missing")):
            open_source(spec)


def test_arrayrecord_round_trip(tmp_path: Path):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (7, 5, 5, 3), dtype=np.uint8)
    labels = np.array([3, 0, 1, 2, 3, 1, 0])
    write_arrayrecord(tmp_path / "train-0.array_record", images[:4], labels[:4], num_classes=4)
    write_arrayrecord(tmp_path / "train-1.array_record", images[4:], labels[4:], num_classes=4)
    source = open_source(f"arrayrecord:{tmp_path}/train-*.array_record", image_size=5)
    assert (len(source), source.image_shape, source.num_classes) == (7, (5, 5, 3), 4)
    np.testing.assert_array_equal(np.stack([source[i]["image"] for i in range(7)]), images)  # PNG: lossless
    assert [source[i]["label"] for i in range(7)] == labels.tolist()
    assert open_source(source.spec, image_size=3)[0]["image"].shape == (3, 3, 3)

    gray = images[..., :1]
    write_arrayrecord(tmp_path / "gray.array_record", gray)
    unlabeled = open_source(f"arrayrecord:{tmp_path}/gray.array_record", image_size=5)
    assert (unlabeled.image_shape, unlabeled.num_classes, set(unlabeled[6])) == ((5, 5, 1), 0, {"image"})
    np.testing.assert_array_equal(unlabeled[6]["image"], gray[6])

    (tmp_path / "junk.array_record").write_bytes(b"not an array record")
    with pytest.raises(ValueError, match="junk.array_record"):
        open_source(f"arrayrecord:{tmp_path}/junk.array_record")


def test_unknown_spec_lists_the_accepted_forms():
    for spec in ("mnist", "npz:", "csv:data.csv"):
        with pytest.raises(ValueError, match=r"digits, npz:PATH, folder:PATH, arrayrecord:GLOB"):
            open_source(spec)


def test_a_builtin_dataset_is_a_row_of_the_table(monkeypatch):
    """Built-in names are looked up in `BUILTIN_SOURCES` (no string compared per name): a new row opens."""
    from eqxdiff.data import specs

    opened, digits = [], open_source("digits")
    monkeypatch.setitem(specs.BUILTIN_SOURCES, "tiny_digits", lambda *flags: opened.append(flags) or digits)
    assert open_source("tiny_digits", captions=True, allow_uncaptioned=True) is digits
    assert opened == [(True, True)]
    assert type(open_source("captioned_digits")).__name__ == "CaptionedDigitsSource"


def test_data_position_round_trip_and_mismatch():
    source = IndexedSource()
    position = json.loads(json.dumps(data_position(1234, 5, source)))
    assert check_position(position, 5, source) == 1234
    with pytest.raises(ValueError, match="written for a dataset of 13 records.*seed differ"):
        check_position(position, 6, source)
    with pytest.raises(
        ValueError,
        match="this run has 14.*dataset_size differ.*pass --allow_dataset_change to continue"
        " from example 1234; else resume with the checkpoint's --dataset and --seed",
    ):
        check_position(position, 5, IndexedSource(14))
    changed = IndexedSource(14)
    changed.spec = "indexed:new"
    assert check_position(position, 5, changed, allow_dataset_change=True) == 1234
    with pytest.raises(ValueError, match="seed differ. Resume with"):  # a changed dataset never excuses another seed
        check_position(position, 6, changed, allow_dataset_change=True)
    older = {k: v for k, v in position.items() if k != "fields"}  # written before sources declared fields
    assert check_position(older, 5, source) == 1234
    for allow in (False, True):  # different fields cannot feed the same model
        with pytest.raises(ValueError, match="fields differ. Resume with"):
            check_position(dict(position, fields={"image": "uint8[2, 2, 1]"}), 5, source, allow_dataset_change=allow)


class LatentSource:
    """Not images: a float16 latent mean and a caption's token ids per record."""

    fields = {"mean": jax.ShapeDtypeStruct((2, 2, 4), np.float16), "tokens": jax.ShapeDtypeStruct((7,), np.int32)}
    spec = "latents:test"

    def __init__(self, bad_index: int = -1):
        self.bad_index = bad_index

    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> dict:
        mean = np.full((2, 2, 4), i / 8, np.float16)
        tokens = np.arange(7, dtype=np.int32) + i
        return {"mean": mean.astype(np.float32) if i == self.bad_index else mean, "tokens": tokens}


def test_pipeline_batches_whatever_fields_a_source_declares():
    source = LatentSource()
    (batch,) = take(batch_stream(source, 10, 0), 1)
    spec = batch_spec(source, 10)
    for key, want in spec.items():
        assert (batch[key].shape, batch[key].dtype) == (want.shape, want.dtype), key
    ids = batch["tokens"][:, 0]  # record i has tokens i..i+6 and mean i/8
    assert sorted(ids.tolist()) == list(range(10))
    np.testing.assert_array_equal(batch["mean"][:, 0, 0, 0], (ids / 8).astype(np.float16))
    with pytest.raises(ValueError, match="--hflip mirrors the 'image' field"):
        batch_stream(source, 10, 0, hflip=True)


def test_a_record_off_its_declaration_names_the_field():
    with pytest.raises(
        ValueError, match=r"Field 'mean' of a record is float32\[2, 2, 4\], but its source declares float16\[2, 2, 4\]"
    ):
        take(batch_stream(LatentSource(bad_index=3), 10, 0), 1)
