"""Prefetch: order, error position, threading, prompt close, and sharded device batches."""

import threading
import time

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from eqxdiff.data import Prefetch


def _slow(items, delay):
    for i in items:
        time.sleep(delay)
        yield i


@pytest.mark.parametrize("slow_side", ["producer", "consumer"])
def test_order_preserved_over_100_items(slow_side):
    source = _slow(range(100), 0.001) if slow_side == "producer" else range(100)
    out = []
    with Prefetch(source, lambda i: i * 2, depth=3) as it:
        for x in it:
            out.append(x)
            if slow_side == "consumer":
                time.sleep(0.001)
    assert out == [2 * i for i in range(100)]
    assert it.delivered == 100
    with pytest.raises(StopIteration):  # stays exhausted
        next(it)


@pytest.mark.parametrize("where", ["source", "to_device"])
def test_error_raised_at_its_position_with_original_type(where):
    k = 5

    def source():
        for i in range(10):
            if where == "source" and i == k:
                raise KeyError(f"bad record {i}")
            yield i

    def to_device(i):
        if where == "to_device" and i == k:
            raise KeyError(f"bad record {i}")
        return i

    it = Prefetch(source(), to_device, depth=2)
    got = [next(it) for _ in range(k)]
    assert got == list(range(k)) and it.delivered == k
    with pytest.raises(KeyError, match=f"bad record {k}"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    assert not it.alive
    it.close()


def test_to_device_runs_off_the_main_thread():
    seen = []
    with Prefetch(range(3), lambda i: seen.append(threading.current_thread()) or i) as it:
        assert list(it) == [0, 1, 2]
    assert seen and all(t is not threading.main_thread() for t in seen)


def test_close_while_producer_blocked_on_full_queue_is_prompt_and_idempotent():
    produced = []
    it = Prefetch(iter(range(10**9)), lambda i: produced.append(i) or i, depth=2)
    assert next(it) == 0
    time.sleep(0.2)  # the producer fills the queue and blocks on put
    assert it.alive and len(produced) <= 2 + 2  # depth queued + one blocked + one delivered
    t0 = time.perf_counter()
    it.close()
    assert time.perf_counter() - t0 < 1.0
    assert not it.alive and it.delivered == 1
    it.close()  # idempotent
    with pytest.raises(StopIteration):
        next(it)


def test_depth_below_one_is_rejected():
    with pytest.raises(ValueError, match="depth"):
        Prefetch(range(3), lambda i: i, depth=0)


def test_make_array_from_process_local_data_arrives_sharded():
    mesh = Mesh(np.array(jax.devices()).reshape(8), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    rng = np.random.default_rng(0)
    host = [rng.normal(size=(16, 4, 4, 3)).astype(np.float32) for _ in range(4)]
    with Prefetch(host, lambda b: jax.make_array_from_process_local_data(sharding, b), depth=2) as it:
        out = list(it)
    assert len(out) == 4
    for got, want in zip(out, host):
        assert got.sharding == sharding and got.shape == want.shape
        assert {s.data.shape for s in got.addressable_shards} == {(2, 4, 4, 3)}
        np.testing.assert_array_equal(np.asarray(got), want)


def test_abandoned_prefetch_stops_its_thread():
    import gc

    it = Prefetch(iter(range(10**9)), lambda i: i, depth=1)
    thread = it._thread
    next(it)
    del it
    gc.collect()
    thread.join(timeout=1.0)
    assert not thread.is_alive()
