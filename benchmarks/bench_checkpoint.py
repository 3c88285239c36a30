"""Checkpoint cost: the async-save stall on training and the restore time.

The default digits job's state and step (`UNet(1, (32, 64), 1, num_classes=10)`, batch 64, EDM,
one device unless --cpu_devices/--fsdp_size say otherwise). After warm-up, rounds alternate:

- plain: `--steps` training steps (at most 2 in flight, as train/main.py);
- saving: `Checkpoints.save` of the current state, then the same `--steps` steps, then
  `wait()` for the background write — so the window holds the whole save, blocking part and
  asynchronous write, competing with training for the CPU.

stall = saving / plain (target <= 1.1). Then the newest checkpoint is restored `--restores`
times onto the run's mesh (and onto one device when there are several): seconds per restore.
Prints one JSON line.

    python benchmarks/bench_checkpoint.py [--steps 50 --rounds 3]
    python benchmarks/bench_checkpoint.py --quick
"""

import argparse
import tempfile
import time

import jax


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50, help="training steps per timed window")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--restores", type=int, default=3)
    parser.add_argument("--cpu_devices", type=int, default=0)
    parser.add_argument("--fsdp_size", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch 16, 5-step windows, 1 round")
    args = parser.parse_args()
    if args.quick:
        args.batch, args.steps, args.rounds, args.restores = 16, 5, 1, 1
    if args.cpu_devices:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)

    import equinox as eqx

    from digits_job import MODEL, digits_job  # benchmarks/ is on sys.path when run as a script
    from harness import report, steps_in_flight
    from eqxdiff import xla_cpu
    from eqxdiff.checkpoint import Checkpoints
    from eqxdiff.data import batch_stream
    from eqxdiff.sharding import batch_sharding, make_mesh
    from eqxdiff.training import abstract_train_state

    xla_cpu.enable()  # XLA:CPU workarounds on, as in train/main.py (eqxdiff/xla_cpu.py)

    mesh = make_mesh(data=-1, fsdp=args.fsdp_size)
    job = digits_job(mesh, total_steps=10_000)
    digits, make_model, optimizer, state, train_step = (
        job.digits,
        job.make_model,
        job.optimizer,
        job.state,
        job.train_step,
    )
    data_sharding = batch_sharding(mesh)
    stream = batch_stream(digits, args.batch, 0)
    batches = [
        jax.tree.map(lambda x: jax.make_array_from_process_local_data(data_sharding, x), next(stream))
        for _ in range(args.steps)
    ]

    def train(state):
        return steps_in_flight(train_step, state, batches)[0]

    times = {"plain": [], "saving": []}
    blocking = []
    with tempfile.TemporaryDirectory() as run_dir:
        checkpoints = Checkpoints(run_dir, keep=2)
        state = train(state)  # compiles the step
        checkpoints.save(int(state.step), state, {"examples_consumed": 0}, {})  # orbax's first-save set-up
        checkpoints.wait()
        for _ in range(args.rounds):
            start = time.perf_counter()
            state = train(state)
            times["plain"].append(time.perf_counter() - start)
            start = time.perf_counter()
            checkpoints.save(int(state.step), state, {"examples_consumed": 0}, {})
            blocking.append(time.perf_counter() - start)
            state = train(state)
            checkpoints.wait()
            times["saving"].append(time.perf_counter() - start)

        step = checkpoints.latest()
        targets = {"same_mesh": mesh}
        if mesh.size > 1:
            targets["one_device"] = make_mesh(1, 1, jax.devices()[:1])
        restore_s = {}
        for name, target_mesh in targets.items():
            abstract, target_shardings = abstract_train_state(make_model, optimizer, target_mesh, 2**12)
            seconds = []
            for _ in range(args.restores):
                start = time.perf_counter()
                restored, _, _ = checkpoints.restore(step, abstract, target_shardings)
                jax.block_until_ready(eqx.filter(restored, eqx.is_array))
                seconds.append(time.perf_counter() - start)
            restore_s[name] = [round(s, 4) for s in seconds]
        checkpoints.close()

    state_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(state, eqx.is_array)))
    report(
        "checkpoint",
        {
            "model": MODEL,
            "state_mib": round(state_bytes / 2**20, 2),
            "mesh": dict(mesh.shape),
            "batch": args.batch,
            "steps_per_window": args.steps,
            "rounds": args.rounds,
            "quick": args.quick,
            "plain_window_s": [round(t, 4) for t in times["plain"]],
            "saving_window_s": [round(t, 4) for t in times["saving"]],
            "save_blocking_s": [round(t, 4) for t in blocking],
            "step_ms_plain": round(1000 * sum(times["plain"]) / (args.rounds * args.steps), 2),
            "stall_ratio": round(sum(times["saving"]) / sum(times["plain"]), 4),
            "restore_s": restore_s,
        },
    )


if __name__ == "__main__":
    main()
