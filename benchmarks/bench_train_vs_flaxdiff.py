"""Training speed, side by side in one process: eqxdiff's step vs FlaxDiff 0.2.11's own trainer.

Same model topology, shape, batch, precision and optimizer on both sides: FlaxDiff's simple UNet
(`flaxdiff.models.simple_unet.Unet(emb_features=128, feature_depths=(32, 64, 128),
attention_configs=(None, None, None), num_res_blocks=2, num_middle_res_blocks=1)`, 2,141,379
params at 3 channels) against eqxdiff's `UNet.flaxdiff_simple(3)` (the same count), 32×32×3,
batch 32, fp32, one device, random images (the data does not change the speed).

The peer is an optional dependency, installed only where this benchmark runs. Keep it out of the
project's own environment, e.g.:

    python3 -m venv /tmp/peer
    /tmp/peer/bin/pip install "flaxdiff==0.2.11" "jax==0.10.2"   # pulls flax 0.12.8, optax, orbax, ...
    /tmp/peer/bin/pip install -e .                                # eqxdiff itself
    /tmp/peer/bin/python benchmarks/bench_train_vs_flaxdiff.py    # real run: 32x32x3, batch 32
    /tmp/peer/bin/python benchmarks/bench_train_vs_flaxdiff.py --quick   # smoke: 8x8, batch 4

Nothing is downloaded at run time (no data set, no weights, no text encoder; wandb is not used).

eqxdiff side: as benchmarks/bench_train.py — EDM schedule + EDMPreconditioning, `make_train_step`
(state donated, EMA 0.995), batches already on the device, at most 2 steps in flight (after
dispatching step i, block on step i-1's loss).

FlaxDiff side: FlaxDiff's own `GeneralDiffusionTrainer` (the class its training/training.py
uses), configured as that script's EDM setting: `EDMNoiseScheduler(1, sigma_max=80, rho=7,
sigma_data=0.5)` + `KarrasPredictionTransform(sigma_data=0.5)`, its default loss
(`optax.l2_loss`, weighted by the schedule) and EMA (0.999). The step is the function its
`_define_train_step(batch_size)` jits (batch donated, state not), timed through its own
`train_loop`, which checks `loss <= 1e-8 or isnan(loss) or isinf(loss)` on the host after every
step: one step in flight. Batches are host numpy uint8 `{"image": [b, h, w, 3]}`, as its loaders
yield (the step normalises with (x - 127.5) / 127.5 and uploads them itself). What had to be
supplied because the peer has no other way:
- the simple UNet's `__call__(x, temb, textcontext)` always reads `textcontext.shape`, and the
  trainer only feeds it through a `ConditionalInputConfig`; a null encoder gives a
  `[b, 1, 1]` zero context (with no attention layers the UNet reads only its shape);
- `trainer.wandb = None`: `train_loop` reads `self.wandb`, which is set only with a wandb config;
- its orbax checkpoint manager is pointed at a temporary directory (nothing is saved).

Optimizer, both sides: the same optax transform, eqxdiff's `adamw_cosine(2e-4, ...)`
(clip_by_global_norm(1) + AdamW with linear warm-up and cosine decay, weight decay 1e-4), which is
also how FlaxDiff's training.py composes `--optimizer adamw --clip_grads 1 --learning_rate_schedule
cosine`. The trainer itself has no default optimizer.

Measured per side, set-up and first step back to back (eqxdiff, then FlaxDiff, unless
--flaxdiff_first), so nothing of one side overlaps the other: `setup_s` (model + optimizer state
+ step function; eqxdiff's step starts compiling in a thread at the top of its set-up, as in
train/main.py), `first_step_s` (the rest of the compile + first step, dispatch to loss ready),
their sum `setup_plus_first_step_s` (the start-up figure), and steady state `samples_per_sec` over ALTERNATING rounds
after 2 warm-up steps each, the second through the timed path (so FlaxDiff's `train_loop` has
compiled its host-side checks): eqxdiff N steps, FlaxDiff N steps, eqxdiff N, FlaxDiff N, ...; the
order (also of set-up and first step) is swapped with --flaxdiff_first. Process start to first
step cannot be separated per side in one process, so it is not reported. Ratios are eqxdiff /
FlaxDiff. eqxdiff's side also reports its step's FLOPs (XLA's cost analysis, `step_flops`), the FLOP/s they make
at its step time, and that over the fp32 2048² matmul rate measured right after the rounds
(`achieved_over_matmul`, issue 35's bar); and FlaxDiff's step's FLOPs at eqxdiff's step time over the same rate
(`model_achieved_over_matmul`: the network's FLOPs as written, where eqxdiff computes its upsampling convs in
fewer, eqxdiff/nn/upsample.py). FlaxDiff's own prints go to stderr; stdout gets one JSON line.
"""

import argparse
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
import itertools
import shutil
import sys
import tempfile
import time
import warnings

try:
    import flaxdiff  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the environment
    sys.exit(
        f"flaxdiff is not importable ({error}). This benchmark needs the peer installed next to "
        'eqxdiff, e.g. `pip install "flaxdiff==0.2.11" "jax==0.10.2"` in a separate venv '
        "(see this file's docstring)."
    )

import jax  # noqa: E402
import numpy as np  # noqa: E402

from eqxdiff import xla_cpu  # noqa: E402
from eqxdiff.nn import UNet  # noqa: E402
from eqxdiff.sharding import batch_sharding, make_mesh  # noqa: E402
from eqxdiff.training import abstract_train_state, adamw_cosine, create_train_state, make_train_step  # noqa: E402
from eqxdiff.training.metrics import step_flops  # noqa: E402
from harness import PACKAGES, alternate, matmul_gflops, param_count, report, steps_in_flight  # noqa: E402
from flaxdiff_peer import UNET  # noqa: E402
from unconditional_edm import unconditional_edm  # noqa: E402  (puts train/ on sys.path)

WARMUP_STEPS = 2  # the first (compile) step + one more, per side


# ---------------------------------------------------------------------------------------------
# eqxdiff side (as benchmarks/bench_train.py)
# ---------------------------------------------------------------------------------------------
class EqxdiffSide:
    name = "eqxdiff"

    def __init__(self, args, images_u8: list[np.ndarray], optimizer, lr_schedule):
        mesh = make_mesh(1, 1, jax.devices()[:1])
        channels = images_u8[0].shape[-1]

        def make_model(key):
            return UNet.flaxdiff_simple(channels, key=key)

        abstract, shardings = abstract_train_state(make_model, optimizer, mesh, 2**14)

        prepare, loss_fn = unconditional_edm()  # as train/main.py, without labels

        data_sharding = batch_sharding(mesh)
        self.train_step = make_train_step(
            prepare=prepare,
            loss_fn=loss_fn,
            optimizer=optimizer,
            lr_schedule=lr_schedule,
            ema_decay=0.995,
            state_shardings=shardings,
            batch_sharding=data_sharding,
            seed=args.seed,
            precision="fp32",
        )
        # As train/main.py: the step compiles in a thread while the state is built.
        spec = {"image": jax.ShapeDtypeStruct(images_u8[0].shape, np.uint8)}
        self.compiling = ThreadPoolExecutor(1).submit(self.train_step.compile, abstract, spec)
        self.state, _ = create_train_state(
            make_model, optimizer, jax.random.key(args.seed), mesh, 2**14, shardings=shardings
        )
        self.params = param_count(self.state.model)
        # The same uint8 images as the peer gets, on the device; prepare maps them to [-1, 1].
        self.batches = [{"image": jax.device_put(u8, data_sharding)} for u8 in images_u8]
        jax.block_until_ready((self.state, self.batches))
        self.steps_done = 0

    def first_step(self) -> None:
        self.compiling.result()  # the rest of the compile, if set-up finished first
        self.state, metrics = self.train_step(self.state, self.batches[0])
        jax.block_until_ready(metrics["loss"])
        self.steps_done = 1

    def run(self, n: int) -> float:
        """n steps, at most 2 in flight, then a final block; returns seconds."""
        start = time.perf_counter()
        batches = (self.batches[i % len(self.batches)] for i in range(self.steps_done, self.steps_done + n))
        self.state, self.last_metrics = steps_in_flight(self.train_step, self.state, batches)
        self.steps_done += n
        return time.perf_counter() - start

    def final_loss(self) -> float:
        last = jax.device_get(self.last_metrics)
        assert bool(last["finite"]) and int(self.state.step) == self.steps_done, "an eqxdiff step was not finite"
        return float(last["loss"])


# ---------------------------------------------------------------------------------------------
# FlaxDiff side: its GeneralDiffusionTrainer, its jitted step, its train_loop
# ---------------------------------------------------------------------------------------------
class FlaxdiffSide:
    name = "flaxdiff"

    def __init__(self, args, images_u8: list[np.ndarray], optimizer, checkpoint_dir: str):
        from flaxdiff.predictors import KarrasPredictionTransform
        from flaxdiff.schedulers import EDMNoiseScheduler
        from flaxdiff.trainer import GeneralDiffusionTrainer

        from flaxdiff_peer import input_config, simple_unet

        h, w, c = images_u8[0].shape[1:]
        self.model = simple_unet(c)
        edm_schedule = EDMNoiseScheduler(1, sigma_max=80, rho=7, sigma_data=0.5)
        self.trainer = GeneralDiffusionTrainer(
            self.model,
            optimizer=optimizer,
            input_config=input_config((h, w, c)),
            noise_schedule=edm_schedule,
            rngs=jax.random.PRNGKey(args.seed),
            name="bench",
            model_output_transform=KarrasPredictionTransform(sigma_data=edm_schedule.sigma_data),
            distributed_training=False,
            checkpoint_base_path=checkpoint_dir,
            native_resolution=h,
        )
        self.trainer.wandb = None  # train_loop reads it; only a wandb config would set it
        self.train_step = self.trainer._define_train_step(batch_size=images_u8[0].shape[0])
        self.state, self.rng_state = self.trainer.state, self.trainer.rngstate
        self.params = param_count(self.state.params)
        b = images_u8[0].shape[0]
        # Host numpy batches, as its loaders yield; the jitted step donates (its copy of) the batch.
        self.host_batches = [{"image": u8, "textcontext": np.zeros((b,), np.uint8)} for u8 in images_u8]
        self.data = itertools.cycle(self.host_batches)
        jax.block_until_ready((self.state, self.rng_state))
        self.steps_done = 0
        self.last_loss = None

    def _step(self):
        # local_device_index 0: what train_loop passes when not distributed.
        self.state, loss, self.rng_state = self.train_step(self.state, self.rng_state, next(self.data), 0)
        return loss

    def first_step(self) -> None:
        jax.block_until_ready(self._step())
        self.steps_done = 1

    def run(self, n: int) -> float:
        """n steps through FlaxDiff's own train_loop (syncs on the loss every step); returns seconds."""
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):
            epoch_loss, _, self.state, self.rng_state = self.trainer.train_loop(
                self.state, self.train_step, self.data, n, self.steps_done, self.rng_state
            )
        jax.block_until_ready((self.state, epoch_loss))
        elapsed = time.perf_counter() - start
        self.steps_done += n
        self.last_loss = float(epoch_loss) / n
        return elapsed

    def final_loss(self) -> float:
        assert self.last_loss is not None and np.isfinite(self.last_loss), "a FlaxDiff step was not finite"
        assert int(self.state.step) == self.steps_done, (int(self.state.step), self.steps_done)
        return self.last_loss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--channels", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="global batch (one device)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per side per round")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds (each: both sides)")
    parser.add_argument("--num_batches", type=int, default=4, help="distinct batches, cycled")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--flaxdiff_first", action="store_true", help="FlaxDiff first in set-up, first step, rounds")
    parser.add_argument("--quick", action="store_true", help="smoke run: 8x8 images, batch 4, 3 steps x 2 rounds")
    parser.add_argument("--xla_cpu", default="on", help="eqxdiff's XLA:CPU switches, as the train scripts' flag")
    args = parser.parse_args()
    if args.quick:
        args.image_size, args.batch, args.steps, args.rounds, args.num_batches = 8, 4, 3, 2, 2
    # Before JAX's backend starts, as train/main.py: the process-level part (YNNPACK off in XLA_FLAGS)
    # holds for both sides alike; the report prints XLA_FLAGS and each side's compiler options.
    xla_cpu.enable(xla_cpu.named_switches(args.xla_cpu))

    shape = (args.batch, args.image_size, args.image_size, args.channels)
    rng = np.random.default_rng(args.seed)
    images_u8 = [rng.integers(0, 256, shape, dtype=np.uint8) for _ in range(args.num_batches)]
    total_steps = 2 * (WARMUP_STEPS + args.rounds * args.steps)  # an upper bound for either side
    optimizer, lr_schedule = adamw_cosine(2e-4, max(1000, total_steps + 1), 10, 1e-4)

    # FlaxDiff's step donates the batch, but no output can reuse a uint8 buffer: harmless.
    warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
    checkpoint_dir = tempfile.mkdtemp(prefix="bench_flaxdiff_ckpt_")  # its orbax manager's; nothing saved
    builders = {
        "eqxdiff": lambda: EqxdiffSide(args, images_u8, optimizer, lr_schedule),
        "flaxdiff": lambda: FlaxdiffSide(args, images_u8, optimizer, checkpoint_dir),
    }
    order = ["flaxdiff", "eqxdiff"] if args.flaxdiff_first else ["eqxdiff", "flaxdiff"]
    sides, setup_s, first_step_s = {}, {}, {}
    for name in order:  # each side's set-up and first step back to back: nothing overlaps the other side
        start = time.perf_counter()
        with contextlib.redirect_stdout(sys.stderr):  # FlaxDiff prints as it builds
            sides[name] = builders[name]()
        setup_s[name] = time.perf_counter() - start
        start = time.perf_counter()
        sides[name].first_step()
        first_step_s[name] = time.perf_counter() - start
    for name in order:  # through the timed path: FlaxDiff's train_loop compiles its host-side checks
        sides[name].run(WARMUP_STEPS - 1)

    round_s = alternate({name: lambda name=name: sides[name].run(args.steps) for name in order}, args.rounds)

    timed_steps = args.rounds * args.steps
    sps = {name: args.batch * timed_steps / sum(round_s[name]) for name in order}
    per_side = {
        name: {
            "params": sides[name].params,
            "setup_s": round(setup_s[name], 3),
            "first_step_s": round(first_step_s[name], 3),
            "setup_plus_first_step_s": round(setup_s[name] + first_step_s[name], 3),
            "samples_per_sec": round(sps[name], 2),
            "step_time_ms": round(1000 * sum(round_s[name]) / timed_steps, 2),
            "round_samples_per_sec": [round(args.batch * args.steps / t, 2) for t in round_s[name]],
            "final_loss": round(sides[name].final_loss(), 5),
        }
        for name in ["eqxdiff", "flaxdiff"]
    }
    # Issue 35's FLOP/s bar: XLA's cost analysis of eqxdiff's step over its time, against the box's matmul rate now.
    flops = step_flops(sides["eqxdiff"].train_step, sides["eqxdiff"].state, sides["eqxdiff"].batches[0])
    achieved, matmul = flops / (per_side["eqxdiff"]["step_time_ms"] / 1000) / 1e9, matmul_gflops()
    # The network as written (its upsampling convs on the repeated map, as FlaxDiff runs them; eqxdiff's run on the
    # small map, 4/9 of their FLOPs): FlaxDiff's step's count, the "model FLOPs" of an MFU, at eqxdiff's step time.
    peer = sides["flaxdiff"]
    model_flops = step_flops(peer.train_step, peer.state, peer.rng_state, peer.host_batches[0], 0)
    model_achieved = model_flops / (per_side["eqxdiff"]["step_time_ms"] / 1000) / 1e9
    per_side["eqxdiff"].update(
        gflop_per_step=round(flops / 1e9, 2),
        achieved_gflops=round(achieved, 1),
        matmul_2048_fp32_gflops_after_rounds=matmul,
        achieved_over_matmul=round(achieved / matmul, 3),
        flaxdiff_gflop_per_step=round(model_flops / 1e9, 2),
        model_achieved_over_matmul=round(model_achieved / matmul, 3),
        model="UNet.flaxdiff_simple",
        schedule="EDMSchedule + EDMPreconditioning",
        ema_decay=0.995,
        step="eqxdiff.training.make_train_step (state donated)",
        max_in_flight=2,
        compiler_options=sides["eqxdiff"].train_step.compiler_options,
        batch_format="uint8 on device (prepare maps to [-1, 1])",
    )
    per_side["flaxdiff"].update(
        model=UNET,
        schedule="EDMNoiseScheduler(1, sigma_max=80, rho=7, sigma_data=0.5) + KarrasPredictionTransform(0.5)",
        loss="optax.l2_loss x schedule weights",
        ema_decay=0.999,
        step="GeneralDiffusionTrainer._define_train_step (jit, batch donated), timed via its train_loop",
        max_in_flight=1,
        batch_format="host numpy uint8 {'image'} + [b] dummy 'textcontext' key",
        compiler_options={},  # jax.jit's defaults
    )
    shutil.rmtree(checkpoint_dir, ignore_errors=True)
    if per_side["eqxdiff"]["params"] != per_side["flaxdiff"]["params"]:
        print(f"warning: parameter counts differ: {per_side}", file=sys.stderr)

    report(
        "train_vs_flaxdiff",
        {
            "backend": jax.default_backend(),
            "image_size": args.image_size,
            "channels": args.channels,
            "batch": args.batch,
            "precision": "fp32",
            "devices": 1,
            "optimizer": "adamw_cosine(2e-4, warmup 10, wd 1e-4, clip 1.0), same optax transform both sides",
            "warmup_steps": WARMUP_STEPS,
            "timed_steps_per_round": args.steps,
            "rounds": args.rounds,
            "order": order,
            "quick": args.quick,
            "xla_flags_both_sides": os.environ.get("XLA_FLAGS", ""),
            "xla_cpu_switches": sorted(xla_cpu.switched_on()),
            "eqxdiff": per_side["eqxdiff"],
            "flaxdiff": per_side["flaxdiff"],
            "ratio_eqxdiff_over_flaxdiff": {
                "samples_per_sec": round(sps["eqxdiff"] / sps["flaxdiff"], 3),
                "first_step_s": round(first_step_s["eqxdiff"] / first_step_s["flaxdiff"], 3),
                "setup_s": round(setup_s["eqxdiff"] / setup_s["flaxdiff"], 3),
                "setup_plus_first_step_s": round(
                    (setup_s["eqxdiff"] + first_step_s["eqxdiff"]) / (setup_s["flaxdiff"] + first_step_s["flaxdiff"]), 3
                ),
                "note": "measured side by side in this process, alternating rounds; "
                "samples_per_sec > 1 and first_step_s < 1 favour eqxdiff",
            },
        },
        (*PACKAGES, "flax", "flaxdiff", "optax"),
    )


if __name__ == "__main__":
    main()
