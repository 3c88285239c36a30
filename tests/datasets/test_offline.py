"""eqxdiff/data/offline.py, the pipeline of encode.py and fid_stats.py: every example once, in order, through
one shape of batch (the last padded), its results cut back to the real rows."""

import jax
import numpy as np

from eqxdiff.data.offline import pad_rows, run_offline
from eqxdiff.sharding import batch_sharding, make_mesh


def test_pad_rows_repeats_the_last_row():
    np.testing.assert_array_equal(pad_rows(np.array([[1, 2], [3, 4]]), 4), [[1, 2], [3, 4], [3, 4], [3, 4]])


def test_every_example_once_in_order_through_one_batch_shape():
    mesh = make_mesh(devices=jax.local_devices())
    batch = 2 * len(jax.local_devices())
    indices = list(range(5, 5 + 2 * batch + 3))  # two whole batches and 3 rows
    shapes, kept, rows = [], [], []

    def split(examples):
        return [e["label"] for e in examples], {"x": np.stack([e["x"] for e in examples])}

    def compute(inputs):
        shapes.append(inputs["x"].shape)
        assert inputs["x"].sharding.is_equivalent_to(batch_sharding(mesh), 2)
        return {"y": inputs["x"] * 10}

    def collect(labels, outputs):
        kept.extend(labels)
        rows.extend(outputs["y"].tolist())

    read = lambda g: {"x": np.array([g, -g], np.int32), "label": f"#{g}"}  # noqa: E731
    run_offline(read, indices, batch, split, compute, collect, sharding=batch_sharding(mesh), desc="t", progress=False)
    assert shapes == [(batch, 2)] * 3
    assert kept == [f"#{g}" for g in indices]
    assert rows == [[10 * g, -10 * g] for g in indices]  # the padding's repeats of the last row cut off
