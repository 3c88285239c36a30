"""train/main.py's flag checks that argparse cannot make (`cfg`: its Config): each a SystemExit
that names the fix, before anything loads or compiles."""

from pathlib import Path

from eqxdiff.diffusion import EDMSchedule
from eqxdiff.run.conditions import TextCondition
from eqxdiff.run.sampling import parse_interval
from eqxdiff.run.sdxl_condition import is_sdxl_folder
from eqxdiff.text.conditioning import check_text_folders
from eqxdiff.training import parse_step_range
from eqxdiff.training.phema import parse_sigma_rels

from repa_flags import repa_flag_error  # train/repa_flags.py


def flag_value_error(cfg) -> str | None:
    """What is wrong with a flag's value that argparse's type cannot see (parse_config's error), or None."""
    try:
        parse_interval(cfg.guidance_interval)
    except ValueError as e:
        return str(e)
    if cfg.profile_steps and not parse_step_range(cfg.profile_steps):
        return f"--profile_steps must look like A:B with 1 <= A < B, got {cfg.profile_steps!r}"
    try:
        parse_sigma_rels(cfg.phema_sigma_rels)
    except ValueError as e:
        return f"--phema_sigma_rels takes comma-separated relative widths, e.g. 0.05,0.10: {e}"
    if cfg.phema_every < 1:
        return f"--phema_every must be >= 1, got {cfg.phema_every}"
    return repa_flag_error(cfg)


def check_batch(cfg, num_devices: int) -> None:
    """The global batch must split into micro-batches that split over every device."""
    if cfg.ckpt_every < 1:
        raise SystemExit(f"--ckpt_every must be >= 1, got {cfg.ckpt_every}.")
    per_update = num_devices * cfg.grad_accum_steps
    if cfg.batch_size % per_update:
        raise SystemExit(
            f"--batch_size {cfg.batch_size} must be a multiple of devices ({num_devices}) x "
            f"--grad_accum_steps ({cfg.grad_accum_steps}) = {per_update}."
        )


def check_schedule(cfg) -> None:
    """--edm_p_mean and --edm_p_std belong to the EDM schedule; the others have their own training p(σ)."""
    if cfg.schedule == "edm":
        return
    for flag, default in (("edm_p_mean", EDMSchedule().p_mean), ("edm_p_std", EDMSchedule().p_std)):
        if getattr(cfg, flag) != default:
            raise SystemExit(f"--{flag} sets the edm schedule's training σ; --schedule {cfg.schedule} draws its "
                             f"own. Drop --{flag} or use --schedule edm.")  # fmt: skip


def check_objective(cfg) -> None:
    """--objective meanflow learns the flow z_t = (1 - t)·x0 + t·ε: its samples go through the flow schedule and
    parameterization (D = z_t - t·u, eqxdiff/diffusion/meanflow.py), and its jvp through the network rules out the
    workarounds --xla_cpu auto would time."""
    if cfg.objective != "meanflow":
        return
    if (cfg.schedule, cfg.parameterization) != ("flow", "flow"):
        raise SystemExit(f"--objective meanflow trains a flow: pass --schedule flow --parameterization flow (got "
                         f"--schedule {cfg.schedule} --parameterization {cfg.parameterization}).")  # fmt: skip
    if cfg.xla_cpu == "auto":
        raise SystemExit(
            "--objective meanflow takes jax.jvp through the network, which --xla_cpu auto's candidates "
            "(custom_vjp workarounds) do not allow: pass --xla_cpu on (main.py leaves those off)."
        )
    if not 0 <= cfg.meanflow_r_neq_t <= 1:
        raise SystemExit(f"--meanflow_r_neq_t is a share of the batch, in [0, 1]; got {cfg.meanflow_r_neq_t}.")


TWO_TIME_CONSTRUCTORS = ("UNet", "DiT", "DiT.small")  # given interval_embedding here (EDM2UNet takes it too: refused)


def with_two_times(cfg, args: dict) -> dict:
    """--objective meanflow's network: `args` (eqxdiff/run/models.py's model_args) with interval_embedding=True, a
    network of two times; another objective's unchanged. A constructor without the option names the models with it."""
    if cfg.objective != "meanflow":
        return args
    if args["constructor"] == "EDM2UNet":  # its option exists (eqxdiff/nn/edm2.py), its time features do not fit
        raise SystemExit(
            f"--objective meanflow: --model {cfg.model}'s EDM2UNet draws its Fourier time features for EDM's "
            "c_noise = ln(σ)/4, not the flow's 1000·t; use a unet or dit model (e.g. --model unet)."
        )
    if args["constructor"] not in TWO_TIME_CONSTRUCTORS:
        raise SystemExit(
            f"--objective meanflow needs a network of two times: --model {cfg.model} builds "
            f"{args['constructor']}, which has none; use a unet or dit model (e.g. --model unet)."
        )
    return {**args, "kwargs": {**args["kwargs"], "interval_embedding": True}}


def check_eval(cfg) -> None:
    """--eval_every's flags, before anything loads or compiles."""
    if bool(cfg.dinov2) != bool(cfg.fd_dinov2_ref):
        given, missing = ("--dinov2", "--fd_dinov2_ref") if cfg.dinov2 else ("--fd_dinov2_ref", "--dinov2")
        raise SystemExit(f"{given} measures FD-DINOv2 during training: pass {missing} too (a DINOv2 folder, e.g. "
                         f"facebook/dinov2-large, and the dataset's statistics from train/fid_stats.py --dinov2).")  # fmt: skip
    if cfg.dinov2 and cfg.eval_every <= 0:
        raise SystemExit("--dinov2 measures FD-DINOv2 in --eval_every's evaluation: pass --eval_every N too.")
    if cfg.eval_every <= 0:
        return
    missing = [f"--{name}" for name in ("fid_ref", "inception") if not getattr(cfg, name)]
    if missing:
        raise SystemExit(
            f"--eval_every {cfg.eval_every} measures FID: pass {' and '.join(missing)} (--fid_ref: the dataset's "
            "statistics from train/fid_stats.py; --inception: pytorch-fid's weights, pt_inception-2015-12-05-6726825d.pth)."
        )
    if cfg.eval_num < 2:
        raise SystemExit(f"--eval_num must be >= 2 (a covariance needs two samples; FID is usually taken of 10,000 to "
                         f"50,000), got {cfg.eval_num}.")  # fmt: skip


def check_text_folders_exist(cfg) -> None:
    """--text_encoder and --tokenizer name folders that exist and hold what they should (no weights read)."""
    if not cfg.text_encoder:
        return
    root = Path(cfg.text_encoder)  # an SDXL pipeline folder (--init): each tower and its tokenizer
    pairs = [(str(root / f"text_encoder{i}"), str(root / f"tokenizer{i}")) for i in ("", "_2")]
    for tower, tokenizer in pairs if is_sdxl_folder(root) else [(cfg.text_encoder, cfg.tokenizer)]:
        try:
            check_text_folders(tower, tokenizer)
        except (FileNotFoundError, ValueError) as e:
            raise SystemExit(str(e)) from e


def check_eval_condition(cfg, condition) -> None:
    """--eval_every's samples are class-conditional or unconditional."""
    if cfg.eval_every > 0 and isinstance(condition, TextCondition):
        raise SystemExit("--eval_every measures FID of class-conditional and unconditional runs; measure a text "
                         "run's checkpoints with train/sample.py --fid --prompts ...")  # fmt: skip
