"""train/main.py --init RUN_DIR (eqxdiff/run/finetune.py's `FromRun`): a run starts from another run's EMA. A flow
run's network of one time becomes a MeanFlow network of two times that equals it at every (t, r) before the first
step (its interval embedding's output zero), the fine-tune trains, checkpoints and resumes bitwise, and a source
that is no run, a LoRA run, another noise or another network is refused in one line naming the fix."""

import functools
import shutil

import train_scripts  # noqa: F401 — puts train/ on sys.path: a test of the scripts
import main as train_main  # train/main.py
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from runs import TINY, assert_bitwise_equal, metric_rows, saved_arrays, train_here
from tests.core.test_meanflow import MEANFLOW_DIGITS, forward_mode, perturbed, tiny_dit, tiny_unet  # noqa: F401
from tests.scripts.test_script_errors import fake_run

from eqxdiff.nn.layers import TwoTimeEmbedding
from eqxdiff.run.finetune import one_time, with_intervals

FLOW = ["--schedule", "flow", "--parameterization", "flow"]

call = eqx.filter_jit(lambda model, x, t, cond, **kw: model(x, t, cond, **kw))


@pytest.mark.parametrize("make", [tiny_unet, tiny_dit], ids=["unet", "dit"])
def test_a_network_of_one_time_extended_is_itself_at_every_interval_and_learns_one(make):
    source = perturbed(make())  # every layer off its init: a trained network's
    fresh = make(interval_embedding=True)
    extended = with_intervals(source, fresh)
    assert isinstance(extended.time_embed, TwoTimeEmbedding)
    for a, b in zip(jax.tree.leaves(one_time(extended)), jax.tree.leaves(source), strict=True):
        np.testing.assert_array_equal(a, b)
    # the interval's first layer keeps its draw (not zero), so the zero output layer's gradient is not zero
    np.testing.assert_array_equal(extended.time_embed.interval.fc1.weight, fresh.time_embed.interval.fc1.weight)
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4, 4, 1)), jnp.float32)
    t, labels = jnp.array([300.0, 800.0]), jnp.array([0, 2])
    want = call(source, x, t, labels)
    for interval in (None, jnp.zeros(2), jnp.array([100.0, 500.0])):
        np.testing.assert_array_equal(call(extended, x, t, labels, interval=interval), want)
    # the interval embedding as the constructor draws it would move the network off the source even at r = t
    drawn = eqx.tree_at(lambda m: m.time_embed, source, TwoTimeEmbedding(source.time_embed, fresh.time_embed.interval))
    assert np.abs(np.asarray(call(drawn, x, t, labels) - want)).max() > 1e-5  # DiT's adaLN-Zero keeps it small

    def loss(model):
        return jnp.sum(call(model, x, t, labels, interval=jnp.array([100.0, 500.0])) ** 2)

    grads = eqx.filter_grad(loss)(extended)
    assert np.abs(np.asarray(grads.time_embed.interval.fc2.weight)).max() > 0


SOURCE = dict(
    schedule="flow",
    parameterization="flow",
    lr=2e-3,
    steps=4,
    weight_decay=1e-4,
    model_args={"constructor": "UNet", "kwargs": {"in_channels": 1, "channels": [16], "num_classes": 10}},
)


@pytest.mark.parametrize(
    "config, flags, message",
    [
        (None, [], "no checkpoint under .*: give a train/main.py run that saved one, or sd:FOLDER"),
        ({"schedule": "edm"}, [], "trained with --schedule edm, whose network sees another time .* --schedule flow"),
        ({"lora_rank": 4, "init": "sd:x"}, [], "trained LoRA adapters alone.*start from its --init sd:x"),
        ({}, ["--lora_rank", "2"], "adapt a diffusers UNet \\(--init sd:FOLDER\\); --init .* trains the whole"),
    ],
    ids=["no run", "other noise", "lora run", "lora flags"],
)
def test_what_cannot_start_a_run_is_refused_before_jax(tmp_path, config, flags, message):
    source = tmp_path / "source"
    fake_run(source, **(SOURCE | config)) if config is not None else source.mkdir()
    with pytest.raises(SystemExit, match=message):
        train_main.parse_config(["--run_dir", str(tmp_path / "run"), *FLOW, "--init", str(source), *flags])


def test_another_network_is_refused_naming_its_model(tmp_path):
    source = fake_run(tmp_path / "source", **SOURCE)  # unet_tiny's arguments, as a flow run stored them
    with pytest.raises(SystemExit, match="trained another network \\(.*channels \\[16\\] -> .*its --model unet_tiny"):
        train_here("--run_dir", tmp_path / "run", *FLOW, "--model", "unet", "--init", source)


@pytest.fixture(scope="module")
def flow_run(tmp_path_factory):
    """A flow-matching run of unet_tiny, two steps (its EMA moved off the draw: --ema_decay 0.5)."""
    run_dir = tmp_path_factory.mktemp("flow") / "run"
    train_here("--run_dir", run_dir, *TINY, *FLOW, "--steps", 2, "--ema_decay", 0.5, "--no-ema_warmup")
    return run_dir


def fine_tune(run_dir, source, *flags):
    """docs/meanflow.md's MeanFlow flags on unet_tiny (TINY's batch; its --log_every 1 last), from `source`."""
    train_here("--run_dir", run_dir, *MEANFLOW_DIGITS, *TINY, "--init", source, "--lr", 1e-2, *flags)


@pytest.mark.slow  # a flow run, a MeanFlow start and a fine-tune with its resume, end to end (~20 s)
def test_a_flow_run_starts_a_meanflow_run_that_trains_and_resumes_bitwise(flow_run, tmp_path):
    from eqxdiff.run.conditions import Labels
    from eqxdiff.run.finetune import open_init
    from eqxdiff.run.models import build_model, model_args
    from eqxdiff.run.rebuild import load_run
    from eqxdiff.sharding import make_mesh
    from eqxdiff.training import abstract_train_state, run_optimizer

    from checks import with_two_times  # train/checks.py

    # The first step's network, as train/main.py makes it: the source's EMA with a zero interval embedding.
    cfg = train_main.parse_config(
        ["--run_dir", str(tmp_path / "start"), *TINY, *MEANFLOW_DIGITS, "--init", str(flow_run)]
    )
    mesh = make_mesh(-1, 1)
    tune = open_init(cfg, mesh, cfg.fsdp_min_param_size, (), object())  # any data: the network is checked, not it
    args = with_two_times(cfg, tune.network(model_args("unet_tiny", (8, 8, 1), Labels(10)), None, None, ()).args)
    training = tune.training(functools.partial(build_model, args, False, condition=Labels(10)), None)
    optimizer = run_optimizer(cfg.lr, cfg.steps, 1, cfg.weight_decay)[0]
    _, shardings = abstract_train_state(training.make_model, optimizer, mesh, cfg.fsdp_min_param_size)
    start = training.start(optimizer, shardings)
    source = load_run(flow_run, mesh=mesh).ema
    x = jnp.asarray(np.random.default_rng(0).normal(size=(4, 8, 8, 1)), jnp.float32)
    t, labels = jnp.array([10.0, 300.0, 600.0, 990.0]), jnp.array([0, 3, 5, 9])
    want = call(source, x, t, labels)
    for model in (start.model, start.ema):
        np.testing.assert_array_equal(call(model, x, t, labels), want)  # r = t
        np.testing.assert_array_equal(call(model, x, t, labels, interval=t / 2), want)  # and any r, at first

    # It trains, checkpoints, and a copy resumed from step 2 reaches the uninterrupted run's step 4 bitwise.
    run_dir, copied = tmp_path / "meanflow", shutil.copytree(flow_run, tmp_path / "source")
    fine_tune(run_dir, copied, "--steps", 4, "--ckpt_every", 2)
    rows = metric_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(np.isfinite(r["train/loss"]) for r in rows)
    resumed = tmp_path / "resumed"
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoints" / "4")
    train_here("--run_dir", resumed)  # the flags from the checkpoint
    assert_bitwise_equal(saved_arrays(resumed, 4), saved_arrays(run_dir, 4))
    shutil.rmtree(copied)  # its weights are the run's own now: train/sample.py's rebuild reads nothing of the source
    trained = load_run(run_dir, mesh=mesh).ema
    assert isinstance(trained.time_embed, TwoTimeEmbedding)
    assert np.abs(np.asarray(trained.time_embed.interval.fc2.weight)).max() > 0  # the interval is being learned
