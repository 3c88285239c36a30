"""Post-hoc EMA (Karras et al. 2024, §3): the EMA of any power-function profile, rebuilt from a run's snapshots.

    python train/main.py --phema_sigma_rels 0.05,0.10 --phema_every 100      # snapshots in RUN_DIR/phema/<step>/
    python train/posthoc_ema.py --run_dir runs/digits-unet --sigma_rel 0.02,0.05,0.1,0.2 [--step N]
    python train/sample.py --run_dir runs/digits-unet --ema sigma_rel=0.05 --eval

Each --sigma_rel's EMA at step N (default: the newest snapshot; N must be a snapshot's step) is Σ_i w_i ·
snapshot_i over every snapshot of steps <= N (each of the run's tracked profiles): w is the least-squares
fit of the asked profile by the snapshots' (eqxdiff/training/phema.py, float64), the sum is taken in
float64 on the host, and the result saved with its weights in RUN_DIR/posthoc_ema/<σ_rel>/<N>/, where
train/sample.py --ema sigma_rel=S reads it. One process; the snapshots are read whole onto its devices.
`--sweep` then samples each with the digits scorecard (digits runs) and prints one row per σ_rel; with
`--fid STATS.npz --inception FILE` it measures each one's FID instead (any class-conditional or unconditional
run), as train/sample.py --ema sigma_rel=S --fid STATS.npz does: the same samples, the same number.
"""

from dataclasses import dataclass
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from startup import Launch, dataclass_parser, exit_on_user_error, parsed_flags, start_jax

from eqxdiff.checkpoint import Checkpoints
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.paths import as_path
from eqxdiff.run.finetune import open_init  # a LoRA run's state holds its adapters only
from eqxdiff.run.rebuild import abstract_run_ema, posthoc_dir, stored_flags, stored_run, stored_run_condition
from eqxdiff.sharding import make_mesh
from eqxdiff.training.phema import parse_sigma_rels, posthoc_coefficients, sigma_rel_to_gamma


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Flags(Launch):
    """train/posthoc_ema.py's flags: each field is `--name`, its comment the flag's help, each `# section:` line a
    group of --help (train/startup.py); the launch flags (--cpu_devices, ...) are `Launch`'s."""

    # rebuild: the post-hoc EMAs made
    run_dir: str = ""  # a train/main.py run trained with --phema_sigma_rels
    sigma_rel: str = ""  # comma-separated relative widths, e.g. 0.02,0.05,0.1,0.2
    step: int = -1  # the snapshot step to rebuild at (default: the newest)
    from_sigma_rels: str = ""  # only the snapshots of these tracked profiles, e.g. 0.1 (default: all)
    # sweep: each one sampled and scored
    sweep: bool = False  # score each with the digits scorecard (digits runs)
    num: int = 1000  # --sweep: samples per σ_rel
    steps: int = 18  # --sweep: sampler steps
    guidance: float | None = None  # --sweep: guidance scale (1: none, the scorecard's unguided row; default: the run's --guidance)
    fid: str = ""  # --sweep: FID of --num samples against this .npz (fid_stats.py)
    inception: str = ""  # --fid: pytorch-fid's weights, pt_inception-2015-12-05-6726825d.pth
    fid_out: str = ""  # --fid: append a JSON line per σ_rel here (default: RUN_DIR/fid.jsonl)
    batch_size: int = 500  # --fid: samples per sampler call
    seed: int = 0  # --fid: the sampler's noise

    @property
    def sigma_rels(self) -> tuple[float, ...]:
        """--sigma_rel's widths."""
        return parse_sigma_rels(self.sigma_rel)

    @property
    def only(self) -> tuple[float, ...]:
        """--from_sigma_rels' profiles (empty: all)."""
        return parse_sigma_rels(self.from_sigma_rels)
# fmt: on


def parse_args(argv: list[str] | None = None) -> Flags:
    """The command line as one frozen `Flags`; a flag that does not fit is one line naming the fix."""
    parser = dataclass_parser(Flags, __doc__, required=("run_dir", "sigma_rel"))
    flags = parsed_flags(Flags, parser.parse_args(argv))
    try:
        sigma_rels, _ = flags.sigma_rels, flags.only
    except ValueError as e:
        parser.error(f"--sigma_rel, --from_sigma_rels: {e}")
    if not sigma_rels:
        parser.error("--sigma_rel: give at least one relative width, e.g. 0.05")
    if flags.fid and not (flags.sweep and flags.inception and flags.num >= 2 and flags.batch_size >= 1):
        parser.error(
            "--fid goes with --sweep and needs --inception FILE (pytorch-fid's weights), --num >= 2 and "
            "--batch_size >= 1"
        )
    if flags.num_processes > 1:
        parser.error("train/posthoc_ema.py runs in one process (it reads each snapshot whole)")
    return flags


def snapshot_inputs(profiles: dict[int, list[float]], only: tuple[float, ...] = ()) -> list[tuple[int, int, float]]:
    """(step, index in its snapshot, σ_rel) of every EMA in `profiles` (step -> its snapshot's σ_rels, in step order;
    of the profiles `only`, when given), in order."""
    return [(s, k, r) for s, rels in profiles.items() for k, r in enumerate(rels) if not only or r in only]


def reconstruct(
    snapshots: EmaSnapshots,
    step: int,
    sigma_rels: tuple[float, ...],
    abstract_ema,
    sharding,
    only: tuple[float, ...] = (),
):
    """([one EMA model per σ_rel, laid out by `sharding`], weights [inputs, σ_rels], inputs): Σ_i w[i, k] · input_i
    summed in float64 on the host, over the snapshots of steps <= `step` (of the profiles `only`, when given), one
    step's in host memory at a time."""
    profiles = {s: snapshots.meta(s)["sigma_rels"] for s in snapshots.steps if 0 < s <= step}  # one read each
    inputs = snapshot_inputs(profiles, only)
    if not inputs:
        raise SystemExit(f"{snapshots.directory} holds no snapshot of profiles {list(only)} up to step {step}.")
    weights = posthoc_coefficients([s for s, _, _ in inputs], [r for _, _, r in inputs], step, sigma_rels)
    sums = [None] * len(sigma_rels)
    for j, s in enumerate(sorted({s for s, _, _ in inputs})):
        emas = snapshots.restore(s, (abstract_ema,) * len(profiles[s]), None, check=j == 0)  # one run: one model
        for i in (i for i, (s_i, _, _) in enumerate(inputs) if s_i == s):
            ema = emas[inputs[i][1]]
            leaves = [np.asarray(x, np.float64) for x in jax.tree.leaves(eqx.filter(ema, eqx.is_inexact_array))]
            for k in range(len(sigma_rels)):
                terms = [weights[i, k] * x for x in leaves]
                sums[k] = terms if sums[k] is None else [a + b for a, b in zip(sums[k], terms)]
    params, static = eqx.partition(ema, eqx.is_inexact_array)  # the last snapshot's other leaves and dtypes
    models = []
    for total in sums:
        it = iter(total)
        host = eqx.combine(jax.tree.map(lambda like: next(it).astype(like.dtype), params), static)
        arrays, others = eqx.partition(host, eqx.is_array)
        models.append(eqx.combine(jax.device_put(arrays, sharding), others))
    return models, weights, inputs


def same_inputs(a: list, b: list) -> bool:
    """Two reconstructions' [step, index, σ_rel, weight] rows name the same snapshots with the same weights (to
    rounding: one σ_rel solved alone or beside others differs in the last bits)."""
    return [r[:3] for r in a] == [r[:3] for r in b] and np.allclose([r[3] for r in a], [r[3] for r in b], rtol=1e-9)


def main(args: Flags, features_fn=None) -> None:
    """`features_fn`: --fid's feature network, a stand-in (tests); default InceptionV3 from --inception."""
    run_dir = as_path(args.run_dir)  # a local folder or gs://BUCKET/PREFIX (eqxdiff/paths.py)
    if not (run_dir / "phema").is_dir():
        raise SystemExit(
            f"{run_dir / 'phema'} does not exist: train the run with --phema_sigma_rels 0.05,0.10 "
            f"(train/main.py) to write post-hoc EMA's snapshots."
        )
    ckpt_step, _ = stored_run(run_dir, -1)  # the run's model, as its newest checkpoint describes it
    start_jax(args)
    mesh = make_mesh(data=-1, fsdp=1)
    with Checkpoints(run_dir / "checkpoints", read_only=True) as checkpoints:
        stored = checkpoints.restore_config(ckpt_step)
    if args.sweep:  # what the sweep cannot score is refused before the solve
        check_sweep(args, stored)
    cfg = stored_flags(stored)
    condition = stored_run_condition(run_dir, stored, mesh)
    tune = open_init(cfg, mesh, 2**62, base=False)  # a LoRA run's state: the adapters
    abstract_ema, sharding = abstract_run_ema(cfg, stored, condition, mesh, tune)
    with EmaSnapshots(run_dir / "phema", read_only=True) as snapshots:
        if not snapshots.steps or (args.step >= 0 and args.step not in snapshots.steps):
            raise SystemExit(
                f"--step {args.step}: {run_dir / 'phema'} holds snapshots of steps "
                f"{', '.join(map(str, snapshots.steps)) or 'none'}; pick one of them."
            )
        step = snapshots.steps[-1] if args.step < 0 else args.step
        models, weights, inputs = reconstruct(snapshots, step, args.sigma_rels, abstract_ema, sharding, args.only)
    print(
        f"{run_dir} step {step}: {len(inputs)} snapshots ({len({s for s, _, _ in inputs})} steps × profiles "
        f"{sorted({r for _, _, r in inputs})})"
    )
    print(f"{'sigma_rel':>10}{'gamma':>9}{'sum|w|':>9}  saved")
    for sigma_rel, model, w in zip(args.sigma_rels, models, weights.T):
        folder = posthoc_dir(run_dir, sigma_rel)
        with EmaSnapshots(folder) as out:
            meta = {
                "step": step,
                "sigma_rels": [sigma_rel],
                "gamma": sigma_rel_to_gamma(sigma_rel),
                "inputs": [[s, k, r, float(x)] for (s, k, r), x in zip(inputs, w)],
            }
            if step in out.steps and not same_inputs(out.meta(step)["inputs"], meta["inputs"]):
                raise SystemExit(
                    f"{folder / str(step)} holds a reconstruction from other snapshots or weights "
                    f"(e.g. another --from_sigma_rels): remove that folder to make it again."
                )
            said = out.save(step, (model,), meta)
        kept = "" if said == "saved" else " (already there, the same: kept)"
        print(f"{sigma_rel:>10g}{meta['gamma']:>9.3f}{np.abs(w).sum():>9.3f}  {folder / str(step)}{kept}")
    if args.sweep and args.fid:
        fid_sweep(args, run_dir, step, features_fn)
    elif args.sweep:
        sweep(args, run_dir, step)


def check_sweep(args: Flags, stored: dict) -> None:
    """--sweep scores a digits run with the scorecard, or any class-conditional or unconditional run with --fid;
    anything else is one line naming the flag that would."""
    from outputs import check_writable  # train/outputs.py
    from eqxdiff.run.open_condition import stored_condition

    dataset = stored.get("image_dataset", stored["dataset"])  # latents: the images they encode
    kind = stored_condition(stored)["kind"]
    if args.fid and kind not in ("none", "labels"):
        raise SystemExit(
            f"--sweep --fid samples class-conditional or unconditional runs; this run is text-to-image "
            f"({dataset}): rebuild with --sigma_rel and measure with train/sample.py --ema sigma_rel=S "
            f"--fid STATS.npz --prompts ..."
        )
    if args.fid:  # its output's folder made and tried first, as sample.py --fid's
        check_writable(args.fid_out or as_path(args.run_dir) / "fid.jsonl", "--fid_out")
    elif not (kind == "labels" and dataset == "digits"):
        raise SystemExit(
            f"--sweep scores class-conditional digits runs with the digits scorecard; this run trained "
            f"on {dataset}: pass --fid STATS.npz (train/fid_stats.py) --inception FILE to sweep by FID."
        )


def fid_sweep(args: Flags, run_dir: Path, step: int, features_fn=None) -> list[tuple[float, dict]]:
    """Each reconstruction's FID, measured as train/sample.py --ema sigma_rel=S --fid does (train/sample_many.py's
    measure_fid: the run's sampler, guidance (or --guidance) and interval, --seed, --batch_size chunks), one JSON line
    each in --fid_out and one table row each, the lowest marked. Returns [(σ_rel, measure_fid's result)]."""
    import functools

    import sample  # train/sample.py; imported here: the reconstruction alone does not need it
    from eqxdiff.run.rebuild import load_run
    from eqxdiff.run.sampling import run_sampling
    from sample_many import measure_fid, open_fid_flags

    mesh = make_mesh(data=-1, fsdp=1)
    opened, rows = None, []
    for sigma_rel in args.sigma_rels:
        run = load_run(run_dir, step, mesh=mesh, ema=sigma_rel)
        num_classes = run.stored["num_classes"]
        labels = sample.balanced_labels(args.num, list(range(num_classes))) if num_classes else None
        cond, null_cond = run.condition.for_sampling(labels, 1)  # as sample.py's: one image per label, or none
        sampling = run_sampling(run.cfg, steps=args.steps, guidance=args.guidance)  # as sample.py's
        sample_images = functools.partial(
            sampling.images,
            run.ema,
            run.codec,
            run.schedule,
            run.parameterization,
            run.image_shape,
            mesh=mesh,
            null_cond=null_cond,
        )
        image_shape = run.codec.image_shape(run.image_shape)
        opened = opened or open_fid_flags(args, image_shape, features_fn, run.image_dataset)  # one network, one read
        print(f"\nsigma_rel {sigma_rel:g}:")
        rows.append(
            (
                sigma_rel,
                measure_fid(
                    args,
                    run.step,
                    mesh,
                    sample_images,
                    cond,
                    image_shape,
                    sampling.record(),
                    opened=opened,
                    num=args.num,
                    ema=sigma_rel,
                ),
            )
        )
    if jax.process_index() == 0:
        keys = [k for k in ("fid", "precision", "recall") if k in rows[0][1]]
        best = min(rows, key=lambda r: r[1]["fid"])[0]
        interval = f" for σ in ({sampling.interval_text()}]" if sampling.guidance_interval else ""
        print(
            f"\nsweep: FID of {args.num} samples each against {args.fid}, {sampling.method} {sampling.steps} steps, "
            f"guidance {sampling.guidance:g}{interval}"
        )
        print(f"{'sigma_rel':>10}" + "".join(f"{k:>12}" for k in keys))
        for sigma_rel, result in rows:
            lowest = "  <- lowest fid" if sigma_rel == best else ""
            print(f"{sigma_rel:>10g}" + "".join(f"{result[k]:>12.4f}" for k in keys) + lowest)
    return rows


def sweep(args: Flags, run_dir: Path, step: int) -> None:
    """Each reconstruction sampled as train/sample.py --ema sigma_rel=S --eval does, one row of scores each."""
    import sample  # train/sample.py; imported here: the reconstruction alone does not need it
    from eqxdiff.eval import digits_sample_metrics
    from eqxdiff.images import to_uint8
    from eqxdiff.run.rebuild import load_run
    from eqxdiff.run.sampling import run_sampling

    mesh = make_mesh(data=-1, fsdp=1)
    keys = ("class_accuracy", "diversity_ratio", "nn_distance", "copy_fraction", "fd")
    guided = "the run's guidance" if args.guidance is None else f"guidance {args.guidance:g}"
    print(f"\nsweep: {args.num} samples each, {args.steps} steps, the run's sampler, {guided}")
    print(f"{'sigma_rel':>10}" + "".join(f"{k:>16}" for k in keys))
    rows = []
    for sigma_rel in args.sigma_rels:
        run = load_run(run_dir, step, mesh=mesh, ema=sigma_rel)
        sample.check_eval(run.stored)
        sampling = run_sampling(run.cfg, steps=args.steps, guidance=args.guidance)  # as sample.py --eval's
        labels = sample.balanced_labels(args.num, list(range(run.stored["num_classes"])))
        cond, null_cond = run.condition.for_sampling(labels, 1)
        images, _ = sampling.images(
            run.ema,
            run.codec,
            run.schedule,
            run.parameterization,
            run.image_shape,
            cond,
            args.num,
            mesh=mesh,
            null_cond=null_cond,
            seed=0,
        )
        scores = digits_sample_metrics(to_uint8(images), labels)
        rows.append((sigma_rel, scores))
        print(f"{sigma_rel:>10g}" + "".join(f"{scores[k]:>16.4f}" for k in keys))
    best = min(rows, key=lambda r: r[1]["fd"])
    print(
        f"lowest fd: sigma_rel {best[0]:g} (real digits: fd {best[1]['fd_real']:.4f}, class_accuracy "
        f"{best[1]['class_accuracy_real']:.3f})"
    )


if __name__ == "__main__":
    exit_on_user_error(lambda: main(parse_args()))
