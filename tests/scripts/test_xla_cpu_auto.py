"""--xla_cpu auto (train/xla_cpu_auto.py): the run's own step is timed under each candidate set of
XLA:CPU switches, the fastest is switched on and stored for this machine and step, and a run of the
same step reads the stored choice instead of timing again."""

import itertools
import json
import shutil

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
import xla_cpu_auto
from eqxdiff import xla_cpu
from eqxdiff.sharding import make_mesh
from runs import TINY, train_here


@pytest.fixture
def switches_restored():
    with xla_cpu.only(xla_cpu.switched_on()):  # a run's start_jax switches them for this whole process
        yield


def stored(run_dir):
    (entry,) = json.loads((run_dir / xla_cpu_auto.FILE).read_text()).values()
    return entry


@pytest.mark.slow  # a run's step timed under each candidate
def test_auto_times_each_candidate_once_then_reads_its_choice(tmp_path, capsys, switches_restored, monkeypatch):
    # Two of the five sets, each a real step's compile and timing (the five, and the fastest of them: the test below).
    monkeypatch.setattr(xla_cpu_auto, "candidates", lambda on: {"on": on, "off": frozenset()})
    args = [*TINY, "--run_dir", tmp_path, "--xla_cpu", "auto", "--ckpt_every", 2]
    train_here(*args, "--steps", 4)  # TINY's 4 steps: test_sample_guidance's step too (the persistent cache has it)
    entry, sets = stored(tmp_path), xla_cpu_auto.candidates(xla_cpu.DEFAULT)  # no --remat: DEFAULT is "on"
    assert entry["choice"] in sets and set(entry["step_ms"]) == set(sets)
    assert all(ms > 0 for ms in entry["step_ms"].values())
    assert entry["switches"] == sorted(sets[entry["choice"]])
    assert "--xla_cpu auto:" in capsys.readouterr().out
    assert xla_cpu.switched_on() == sets[entry["choice"]]

    # The same step again (the run resumed from step 2, as if it had stopped there): the stored choice, nothing timed.
    # The run stops where its step is built: the choice is read before, and the step built under it (a compile and
    # two steps more would show nothing further).
    shutil.rmtree(tmp_path / "checkpoints" / "4")
    table = json.loads((tmp_path / xla_cpu_auto.FILE).read_text())
    (key,) = table
    table[key]["choice"] = "off"  # a stored choice (whatever was timed) shows it is read, not timed again
    (tmp_path / xla_cpu_auto.FILE).write_text(json.dumps(table))
    read, built = [], []

    def cached(*args):
        read.append(real_cached(*args))
        return read[-1]

    class Built(Exception):
        pass

    def build(**kwargs):
        built.append(xla_cpu.switched_on())
        raise Built

    real_cached = xla_cpu_auto.cached
    monkeypatch.setattr(xla_cpu_auto, "cached", cached)
    monkeypatch.setattr(train_main, "make_train_step", build)
    with pytest.raises(Built):
        train_here(*args, "--steps", 4)
    said = capsys.readouterr().out
    assert f"resuming {tmp_path} from step 2" in said and "--xla_cpu auto:" not in said
    assert read == ["off"]  # found: main.py times only when nothing is stored (`timed`)
    assert built == [frozenset()] and xla_cpu.switched_on() == frozenset()  # the step built under the stored choice


def test_the_fastest_candidate_wins_and_is_stored(tmp_path, capsys, switches_restored, monkeypatch):
    class Step:  # stands for a TrainStep: what choose() calls of one
        batch_sharding = NamedSharding(make_mesh(1, 1, jax.devices()[:1]), PartitionSpec())

        def __init__(self):
            self.switches = xla_cpu.switched_on()  # built under the candidate's switches

        def compile(self, *args):
            pass

    seconds = itertools.cycle([3.0, 2.0, 1.0, 4.0, 5.0])  # in the candidates' order: the conv-gradient matmuls fastest
    monkeypatch.setattr(xla_cpu_auto, "_seconds", lambda *_: next(seconds))
    spec = {"image": jax.ShapeDtypeStruct((4, 8, 8, 1), np.uint8)}
    sets = xla_cpu_auto.candidates(xla_cpu.shipped(remat=True))
    with xla_cpu.only(sets["on"]):
        shipped = Step()
    name, step = xla_cpu_auto.choose(Step, shipped, None, spec, None, tmp_path / "choice.json", "k", sets, steps=3)
    fastest = xla_cpu.DEFAULT | {"memory_scheduler", "conv_grad_matmul"}  # a remat run's set: with the scheduler
    assert name == "on_with_conv_grad_matmul" and step.switches == fastest == xla_cpu.switched_on()
    entry = json.loads((tmp_path / "choice.json").read_text())["k"]
    assert entry["choice"] == name and entry["switches"] == sorted(fastest)
    assert entry["step_ms"] == {
        "on": 1000.0,
        "off": 666.67,
        "on_with_conv_grad_matmul": 333.33,
        "on_with_ynnpack": 1333.33,
        "on_without_channel_sum_matmul": 1666.67,
    }
    with xla_cpu.only(()):
        assert xla_cpu_auto.cached(tmp_path / "choice.json", "k", sets) == name and xla_cpu.switched_on() == fastest
    assert xla_cpu_auto.cached(tmp_path / "x", "k", sets) is None


def test_the_key_changes_with_the_step():
    spec = {"image": jax.ShapeDtypeStruct((16, 8, 8, 1), "uint8")}
    key = lambda spec, extra: xla_cpu_auto.step_key(
        {"w": jax.ShapeDtypeStruct((3, 3), "float32")},
        spec,
        None,  # noqa: E731
        {"data": 8, "fsdp": 1},
        extra,
    )
    base = key(spec, {"precision": "fp32"})
    assert base == key(spec, {"precision": "fp32"})
    assert base != key({"image": jax.ShapeDtypeStruct((32, 8, 8, 1), "uint8")}, {"precision": "fp32"})
    assert base != key(spec, {"precision": "bf16"})
