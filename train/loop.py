"""train/main.py's training loop: steps, logging, sample grids, FID, checkpoints and the stop on
SIGTERM or too many non-finite steps (`cfg`: its Config)."""

import jax
from tqdm import tqdm

from eqxdiff.checkpoint import Checkpoints
from eqxdiff.data import Prefetch, data_position
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.training import LogWindow, MetricsLogger, ProfileWindow, process_age_s


def train_loop(cfg, state, train_step, batches, logger: MetricsLogger, *, start_step: int,
               log_window: LogWindow, profile: ProfileWindow, write_samples, save_checkpoint, stop,
               evaluate=None, save_snapshot=None) -> object:  # fmt: skip
    """Steps start_step+1 .. cfg.steps; returns the state. At most two steps are in flight, and the
    host reads metrics only at the log cadence. `evaluate(step, state)`: metrics logged every
    --eval_every steps. `save_snapshot(step, state)`: post-hoc EMA's snapshots, every --phema_every
    steps and at the end."""
    previous, first = None, start_step + 1
    bar = tqdm(range(first, cfg.steps + 1), desc="train", total=cfg.steps, initial=start_step, mininterval=2.0,
               disable=not logger.enabled)  # fmt: skip
    for step in bar:
        profile.before(step)
        try:
            batch = next(batches)
        except Exception as e:  # a record that does not decode, a file gone: keep what was trained first
            saved = step - 1 > start_step and jax.process_count() == 1  # a lone process cannot save a shared state
            if saved:
                save_checkpoint(step - 1, state)
            kept = f"saved step {step - 1}" if saved else "nothing new saved"
            raise SystemExit(f"data error at step {step} ({kept}): {e} Fix the file and run the same command to "
                             f"resume, or drop it (folder: --skip_bad_images) and resume with --allow_dataset_change."
                             ) from e  # fmt: skip
        state, metrics = train_step(state, batch)
        if previous is not None:  # at most 2 in flight: more deadlocks XLA:CPU's collective rendezvous
            jax.block_until_ready(previous["loss"])
        previous = metrics
        log_window.add(metrics)
        if step == first:  # the compile (or the cache load) is not a step time
            jax.block_until_ready(metrics)
            logger.log_once({"startup/time_to_first_step_s": process_age_s()})
            log_window.restart_clock()
        profile.after(step, metrics)
        if step % cfg.log_every == 0 or step == cfg.steps:
            logged, worst = log_window.read()
            logger.log(step, logged)
            bar.set_postfix(loss=f"{logged['train/loss']:.4f}", img_s=f"{logged['train/samples_per_sec']:.0f}")
            if worst >= cfg.max_bad_steps:
                raise RuntimeError(
                    f"{worst} consecutive non-finite steps (loss or gradients) by step {step}; the state "
                    f"was kept from before them. Lower --lr, try --precision fp32, or raise --max_bad_steps."
                )
        stopping = stop.should_stop(step, cfg.log_every)
        with log_window.paused():  # sampling, FID and saving are not training time
            if cfg.sample_every > 0 and (step % cfg.sample_every == 0 or step == cfg.steps):
                write_samples(step, state)
            if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.steps):
                scores = evaluate(step, state)
                logger.log(step, scores)
                if logger.enabled:  # on the console too, as train/sample.py --fid prints it
                    shown = "  ".join(f"{name.removeprefix('eval/')} {value:.4f}" for name, value in scores.items())
                    bar.write(f"step {step}: {shown}")
            if save_snapshot is not None and (step % cfg.phema_every == 0 or step == cfg.steps):
                save_snapshot(step, state)
            if stopping or step % cfg.ckpt_every == 0 or step == cfg.steps:
                save_checkpoint(step, state)
        if stopping:
            bar.write(f"{stop.received or 'another process'} received: saved step {step}, exiting")
            break
    return state


def save_checkpoint(step: int, state, *, checkpoints: Checkpoints, config: dict, source, batches: Prefetch,
                    start_example: int) -> None:  # fmt: skip
    """`state` saved as step `step` with `config` (train/main.py's `checkpoint_config`: its run_dir,
    seed and batch_size among them) and the data position: `start_example` plus the batches `batches`
    handed to the step (not those still queued) of `source`. A state holding a non-finite value, or a
    step older than the run's newest, is not saved, and says so."""
    examples = start_example + batches.delivered * config["batch_size"]
    saved = checkpoints.save(step, state, data_position(examples, config["seed"], source), config)
    if saved == "non_finite":
        tqdm.write(f"step {step}: the state holds a non-finite value; checkpoint not saved")
    elif saved == "not_newest":
        tqdm.write(
            f"step {step}: not saved, {config['run_dir']} holds newer step {checkpoints.steps[-1]}; "
            f"to branch from an older step, copy it into a new --run_dir"
        )


def save_snapshot(step: int, state, *, snapshots: EmaSnapshots, sigma_rels: tuple[float, ...]) -> None:
    """Post-hoc EMA's input: the state's power-function EMAs (`state.phema`, of `sigma_rels`) as step `step`
    (train/posthoc_ema.py reads them); a step already there (a resumed run replays it) is kept."""
    snapshots.save(step, state.phema, {"step": step, "sigma_rels": list(sigma_rels)})
