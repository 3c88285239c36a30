"""Train a diffusion model; by default a class-conditional UNet on scikit-learn's 8×8 digits.

    python train/main.py                                   # a few minutes on a 2-core CPU
    python train/main.py --cpu_devices 8 --fsdp_size 4     # FSDP over 8 simulated devices
    python train/main.py --precision bf16 --remat --grad_accum_steps 2
    python train/launch_local.py --num_processes 2 -- --cpu_devices 4   # multi-host on one machine

A run is its --run_dir (default runs/DATASET-MODEL) and resumes by itself from the newest checkpoint
there: the same command again, or a shorter one (flags left off come from the checkpoint; those that
define the run cannot change, train/resume.py). SIGTERM or Ctrl-C finishes the current step, saves and
exits 0; an expected error (data, flags, a checkpoint that does not fit) prints one line, exits 2.

Everything a researcher changes is in this file: the Config, the sharding rules, `prepare` (a
batch of records -> the model's input and condition), `loss_fn` (its weighting is one line) and
the run's setup in `main`; the model table is eqxdiff/run/models.py, the loop train/loop.py. The step
itself (sharding, donation, NaN guard, accumulation) is `eqxdiff.training.make_train_step`.
"""

import contextlib
import dataclasses
import functools
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec  # noqa: F401 — for SHARDING_RULES entries
from tqdm import tqdm

from eqxdiff import xla_cpu
from eqxdiff.checkpoint import CheckpointError, Checkpoints
from eqxdiff.ema_snapshots import EmaSnapshots
from eqxdiff.paths import as_path
from eqxdiff.data import Prefetch, batch_spec, batch_stream, check_position, global_batch
from eqxdiff.diffusion import (
    METHODS,
    PARAMETERIZATIONS,
    SCHEDULES,
    EDMSchedule,
    condition_where,
    denoising_prediction,
    draw_condition_drop,
    draw_times,
    meanflow_prediction,
    draw_sigma_and_noise,
    drop_condition,
    loss_weight,
    parameterization_by_name,
    schedule_by_name,
    uncertainty_weighted,
)
from eqxdiff.nn import force_weight_normalization
from eqxdiff.nn.remat import DEFAULT_REMAT_POLICY, REMAT_POLICIES, set_remat_policy
from eqxdiff.run.codecs import Latents, Pixels  # what x0 is
from eqxdiff.run.finetune import open_init  # --init RUN_DIR: a run's EMA; sd:FOLDER: the pretrained UNet, LoRA
from eqxdiff.run.models import MODELS, build_model, model_args  # the model table
from eqxdiff.run.open_condition import run_condition, sample_grid_rows  # the condition, from flags and data
from eqxdiff.run.run_dir import checkpoint_steps
from eqxdiff.run.sampling import run_sampling  # how the grids and FID sample the EMA
from eqxdiff.sharding import RuleError, batch_sharding, check_rules_match, make_mesh, sharding_summary, state_shardings
from eqxdiff.text.conditioning import NULL_TEXTS
from eqxdiff.training import (
    PRECISIONS,
    LogWindow,
    MetricsLogger,
    ProfileWindow,
    abstract_train_state,
    ema_warmup,
    make_train_step,
    peak_flops_per_device,
    run_optimizer,
    step_flops,
)
from eqxdiff.training.phema import parse_sigma_rels, sigma_rel_to_gamma
from eqxdiff.training.repa import dinov2_targets, network_of, repa_loss
from eqxdiff.training.logging import WANDB_MODES
from eqxdiff.training.preemption import StopRequest

from checks import (  # train/checks.py
    check_batch,
    check_eval,
    check_eval_condition,
    check_objective,
    check_schedule,
    check_text_folders_exist,
    flag_value_error,
    with_two_times,
)
from finetune import FineTuneFlags, with_init_flags  # train/finetune.py: --init sd:FOLDER, --lora_rank
from ema_samples import evaluate_fid, open_eval_fd_dinov2, open_eval_fid, write_sample_grid  # train/ema_samples.py
from loop import save_checkpoint, save_snapshot, train_loop  # train/loop.py: steps, logs, samples, FID, checkpoints
from resume import check_model_args, default_run_dir, run_config  # train/resume.py: the run's directory and saved flags
from run_data import open_dataset, run_codec, scaled_latent_std  # train/run_data.py
from outputs import check_writable  # train/outputs.py: --run_dir can be written, before anything loads
from repa_flags import open_repa, sampled_network  # train/repa_flags.py: --repa_*'s tower, block and projector
from startup import Launch, dataclass_parser, exit_on_user_error, start_jax  # train/startup.py: flags, JAX's start
import xla_cpu_auto  # train/xla_cpu_auto.py: --xla_cpu auto


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclass(frozen=True)
class Config(FineTuneFlags, Launch):
    """train/main.py's flags: each field is `--name`, its comment the flag's help, each `# section:` line a group of
    --help (train/startup.py); the launch flags (--cpu_devices, ...) are `Launch`'s, --init and --lora_* finetune's."""

    # data: the examples and their order
    dataset: str = "digits"  # digits | npz:PATH | folder:PATH | arrayrecord:GLOB | latents:DIR (train/encode.py) | captioned_digits
    image_size: int = 32  # folder: and arrayrecord: images are resized to this; digits stay 8×8
    skip_bad_images: bool = False  # folder: train without the files that do not decode (else: listed, no run)
    allow_dataset_change: bool = False  # resume on other data, from the saved example count
    hflip: bool = False  # random horizontal flips (not for digits)
    # model: the network, its arithmetic and its layout over the devices
    model: str = "unet"  # the network, eqxdiff/run/models.py
    precision: str = "fp32"  # fp32 | bf16 (bf16 compute, fp32 parameters and optimizer state)
    remat: bool = False  # recompute activations in the backward pass (less memory, more compute)
    remat_policy: str = DEFAULT_REMAT_POLICY  # with --remat: what each block keeps for the backward pass (eqxdiff/nn/remat.py)
    fsdp_size: int = 1  # devices each parameter is split over (the mesh's 'fsdp' axis; the rest is 'data')
    fsdp_min_param_size: int = 2**12  # leaves with fewer elements are replicated
    # diffusion: the noise training draws, what the network predicts, classifier-free dropout
    schedule: str = "edm"  # the training noise distribution p(σ), eqxdiff/diffusion/schedules.py
    edm_p_mean: float = -1.2  # edm: the mean of ln σ in training (EDM's -1.2); higher trains more where the condition decides the image
    edm_p_std: float = 1.2  # edm: the std of ln σ in training (EDM's 1.2; EDM2's img64 1.6, img512 1.0)
    parameterization: str = "edm"  # what the network predicts, and the loss weight (eqxdiff/diffusion/)
    sigma_data: float = 0.0  # EDM's data std; 0: 0.5 for images in [-1, 1], 1.0 for scaled VAE latents
    label_dropout: float = 0.05  # classifier-free guidance training: a label replaced by the null class (MeanFlow's: 0.1)
    # meanflow: one-step generation (Geng et al. 2025), defaults the official MF-B/4 ImageNet run's (configs/default.py)
    objective: str = "denoising"  # denoising: loss_fn | meanflow: meanflow_loss_fn (with --schedule flow --parameterization flow)
    meanflow_p_mean: float = -0.4  # the training times t, r: logit-normal, logit ~ N(mean, std²), sorted
    meanflow_p_std: float = 1.0  # (the paper's lognorm(-0.4, 1.0))
    meanflow_r_neq_t: float = 0.25  # the share of each batch with r < t; the rest train the instantaneous velocity
    meanflow_norm_p: float = 1.0  # the adaptive loss weight 1/(‖u - u_tgt‖² + c)^p (0: the plain squared error)
    meanflow_norm_eps: float = 0.01  # its c
    meanflow_omega: float = 1.0  # guidance folded into training: v_g = ω·v + (1-ω-κ)·u(∅) + κ·u(c), scale ω/(1-κ)
    meanflow_kappa: float = 0.5  # (ω = 1, κ = 0: unguided; the labels still drop with --label_dropout)
    # text: text-to-image, from captions (folder: .txt beside each image or captions.jsonl; arrayrecord: a caption field)
    text_encoder: str = ""  # a CLIP text folder (frozen, e.g. SD's text_encoder/) | scratch (trained with the model); captioned_digits: scratch
    tokenizer: str = ""  # the captions' tokenizer folder (default: tokenizer/ beside --text_encoder)
    text_dropout: float = 0.1  # captions replaced by the null text (classifier-free guidance training)
    null_text: str = "empty"  # the null text: the encoded "" | zeros
    allow_uncaptioned: bool = False  # an image without a caption gets "" instead of an error
    # repa: representation alignment (Yu et al. 2025) of a DiT's tokens to a frozen DINOv2's, docs/vision-towers.md
    repa_weight: float = 0.0  # λ of REPA's loss added to the denoising loss (REPA's --proj-coeff: 0.5); 0: off; DiT models only
    repa_block: int = 0  # the block (1..depth) whose tokens align (REPA's --encoder-depth: 8 of SiT-XL/2's 28); 0: round(depth·8/28)
    repa_encoder: str = ""  # a transformers Dinov2Model folder, frozen (facebook/dinov2-base: REPA's dinov2-vit-b)
    repa_projector_dim: int = 2048  # the width of REPA's projector MLP (its projector_dim)
    # optimisation: AdamW over --steps updates, the EMA, the non-finite guard
    steps: int = 900  # optimizer updates in the whole run (a resumed run trains up to this step)
    batch_size: int = 128  # global, per optimizer update (split over every device and process)
    grad_accum_steps: int = 1  # micro-batches per optimizer update
    lr: float = 2e-3  # AdamW's peak learning rate, reached after --warmup_steps, then cosine to 0 at --steps
    warmup_steps: int = 100  # linear learning-rate warm-up
    lr_ref_steps: int = 0  # >0: EDM2's Adam (β2 0.99, no decay, no clip), --lr/sqrt(max(step/N, 1)) after warm-up
    weight_decay: float = 1e-4  # AdamW's decoupled weight decay
    ema_decay: float = 0.995  # the EMA of the weights that sample grids, FID and train/sample.py use
    ema_warmup: bool = True  # decay min(ema_decay, (1 + t) / (10 + t)) at step t (eqxdiff.training.ema_warmup)
    phema_sigma_rels: str = ""  # post-hoc EMA (train/posthoc_ema.py): track EMAs of these σ_rel, e.g. 0.05,0.10
    phema_every: int = 100  # steps between their snapshots in RUN_DIR/phema (and one at the end); never pruned
    max_bad_steps: int = 5  # stop after this many consecutive non-finite steps (each is skipped, the state kept)
    # sampling: the sample grids of the EMA
    sample_every: int = 300  # steps between sample grids in RUN_DIR/samples (and one at the end); 0: none
    sample_steps: int = 18  # sampler steps of the grids
    sample_method: str = "heun"  # the grids' sampler, eqxdiff/diffusion/samplers.py
    guidance: float = 1.5  # the grids' classifier-free guidance scale (1: none); train/sample.py's default too
    guidance_interval: str = ""  # "LO,HI": the grids' guidance only for σ in (LO, HI] (Kynkäänniemi et al. 2024)
    sample_prompts: str = ""  # "|"-separated prompts for sample grids (default: the dataset's first captions)
    # evaluation: FID (and FD-DINOv2) during training
    eval_every: int = 0  # >0: FID of --eval_num EMA samples against --fid_ref every N steps (and at the end)
    eval_num: int = 10000  # sampled --batch_size at a time
    fid_ref: str = ""  # the dataset's statistics, train/fid_stats.py (--keep_features: also precision/recall)
    inception: str = ""  # pytorch-fid's Inception weights: pt_inception-2015-12-05-6726825d.pth (or a .safetensors copy)
    dinov2: str = ""  # also FD-DINOv2 (EDM2's) of the same samples, by this transformers DINOv2 folder (facebook/dinov2-large)
    fd_dinov2_ref: str = ""  # with --dinov2: the dataset's DINOv2 statistics, train/fid_stats.py --dinov2
    # run: its directory, seed, logs, checkpoints and profile
    run_dir: str = ""  # where checkpoints, grids and logs go; a run resumes from it (default: runs/DATASET-MODEL)
    seed: int = 0  # the model's initialisation, the data order and every draw of σ, ε and dropout
    log_every: int = 50  # steps between metrics.jsonl rows (the host reads metrics only then)
    ckpt_every: int = 500  # steps between checkpoints, and always at the end (or on SIGTERM/SIGINT)
    keep_checkpoints: int = 3  # the newest N are kept
    resume_step: int = -1  # the checkpoint to resume from; -1: the newest in --run_dir, if any
    profile_steps: str = ""  # "A:B" traces steps A..B-1 to RUN_DIR/profile
    wandb: str = "offline"  # Weights & Biases: offline (files in RUN_DIR/wandb) | online | disabled
# fmt: on


# (regex on a leaf's path, PartitionSpec or spec function): the first match decides how a leaf is laid
# out; no match: FSDP by size (fsdp_spec). One list for every module the run places, each leaf by its path:
#   a parameter of the model     down_blocks.0.0.conv1.weight (its EMA copy and Adam moments follow it)
#   the step's frozen argument   text_encoder.final_layer_norm.weight, null_cond.context (a frozen tower)
#   a latent run's VAE           autoencoder.decoder.conv_out.weight
# re.search: anchor with ^ to name one module; a rule that matches no leaf of any of them is an error.
SHARDING_RULES = [
    # ("conv_out", PartitionSpec()),  # keep the last conv whole on every device (the VAE's decoder.conv_out too)
]
CHOICES = {
    "model": sorted(MODELS),
    "schedule": sorted(SCHEDULES),
    "parameterization": sorted(PARAMETERIZATIONS),
    "precision": sorted(PRECISIONS),
    "remat_policy": sorted(REMAT_POLICIES),
    "objective": ["denoising", "meanflow"],
    "sample_method": METHODS,  # live: a sampler registered below (SAMPLERS["midpoint"] = ...) is a choice
    "null_text": list(NULL_TEXTS),
    "wandb": list(WANDB_MODES),
}


# ---- where a batch of records meets the model, and the loss: edit these ----
def prepare(
    batch: dict,
    key: jax.Array,
    frozen: dict | None = None,
    *,
    codec=Pixels(),
    condition,
    schedule,
    cond_dropout: float,
    repa_side: int = 0,
) -> dict:
    """A record batch -> what `loss_fn` reads: x0 (`codec`: images in [-1, 1], or latents), the condition
    (`condition`, eqxdiff/run/conditions.py: labels, tokens, or text encoded by the step's frozen tower; each
    example's replaced by the condition's null with probability `cond_dropout` for classifier-free
    guidance), and the training draw σ, ε. Runs
    inside the step on the whole global batch. Latent records (train/encode.py) hold the VAE
    posterior's mean and log-variance: each step draws z from it and scales it (eqxdiff/run/codecs.py).
    `repa_side` > 0 (--repa_weight): also REPA's targets, the clean images' DINOv2 patch tokens at that side²
    (eqxdiff/training/repa.py), by the step's frozen tower, or train/encode.py's when the records hold them."""
    key_draw, key_drop = jax.random.split(key)
    key_latent = jax.random.fold_in(key, 1)  # its own key: σ, ε and dropout draw alike for pixels and latents
    x0 = codec.x0(batch, key_latent)
    sigma, noise = draw_sigma_and_noise(schedule, x0, key_draw)
    cond = drop_condition(key_drop, condition.cond(batch, frozen), cond_dropout, condition.null(frozen))
    out = dict(x0=x0, cond=cond, sigma=sigma, noise=noise)
    if repa_side and "repa_features" in batch:  # written ahead beside the latents (train/encode.py --repa_encoder)
        out["repa_targets"] = batch["repa_features"].astype(jnp.float32)
    elif repa_side:
        out["repa_targets"] = dinov2_targets(frozen["repa_encoder"], batch["image"].astype(jnp.float32), repa_side)
    return out


def loss_fn(model, batch: dict, key: jax.Array, *, schedule, parameterization, repa_weight: float = 0.0) -> jax.Array:
    """E λ(σ)·‖D(x0 + σε; σ, cond) - x0‖² (Karras et al. 2022, eq. 2) over a (micro-)batch; with --repa_weight (the
    model then `Aligned`: the network and REPA's projector) + repa_weight·REPA's loss (Yu et al. 2025, eq. 8)."""
    network = network_of(model)
    tokens_after = model.block if repa_weight else None  # REPA: also the network's tokens after that block
    pred = denoising_prediction(
        network,
        schedule,
        parameterization,
        batch["x0"],
        batch["sigma"],
        batch["noise"],
        batch["cond"],
        key=key,
        tokens_after=tokens_after,
    )
    weight = loss_weight(batch["sigma"], parameterization, schedule)  # 1/c_out²: ε-, v-, EDM, flow-matching MSE
    # weight = jnp.minimum(1 / batch["sigma"] ** 2, 5.0)  # min-SNR-5 (Hang et al. 2023): SNR = 1/σ²
    # EDM2's learned per-σ weighting: λ·mse/e^u + u, u = the network's logvar head (eq. 21); without one: λ·mse
    loss = jnp.mean(uncertainty_weighted(network, schedule.sigma_to_t(batch["sigma"]), weight * pred.mse))
    if repa_weight:  # -cos(the clean image's DINOv2 patch token, the projected token), averaged over tokens
        loss = loss + repa_weight * repa_loss(batch["repa_targets"], model.projector(pred.tokens))
    return loss


# --objective meanflow: a network of two times learns the average velocity u(z_t, r, t), one step z_0 = z_1 - u.
def prepare_meanflow(
    batch: dict,
    key: jax.Array,
    frozen: dict | None = None,
    *,
    codec=Pixels(),
    condition,
    cond_dropout: float,
    p_mean: float,
    p_std: float,
    r_neq_t: float,
) -> dict:
    """A record batch -> what `meanflow_loss_fn` reads: x0 and ε as `prepare` draws them, the condition and its
    null (b rows; the loss puts the null where `drop`, as it folds guidance in), and MeanFlow's times t >= r
    (eqxdiff/diffusion/meanflow.py: logit-normal, r = t on all but `r_neq_t` of the batch)."""
    key_times, key_noise, key_drop = jax.random.split(key, 3)
    x0 = codec.x0(batch, jax.random.fold_in(key, 1))
    b = x0.shape[0]
    t, r = draw_times(key_times, b, p_mean=p_mean, p_std=p_std, r_neq_t=r_neq_t)
    cond = condition.cond(batch, frozen)
    null = None if cond is None else condition_where(jnp.ones(b, bool), condition.null(frozen), cond)  # b rows
    return dict(
        x0=x0,
        cond=cond,
        null_cond=null,
        drop=draw_condition_drop(key_drop, b, cond_dropout),
        t=t,
        r=r,
        noise=jax.random.normal(key_noise, x0.shape, jnp.float32),
    )


def meanflow_loss_fn(
    model,
    batch: dict,
    key: jax.Array,
    *,
    omega: float,
    kappa: float,
    norm_p: float,
    norm_eps: float,
    t_range: tuple[float, float] = (0.0, 1.0),
) -> jax.Array:
    """MeanFlow's loss (Geng et al. 2025, eq. 9-10, guidance eq. 21): ‖u - sg(u_tgt)‖², summed over each example's
    elements as the official code sums it, under the adaptive weight 1/sg(‖·‖² + c)^p (§4.3)."""
    u, target = meanflow_prediction(
        model,
        batch["x0"],
        batch["noise"],
        batch["t"],
        batch["r"],
        batch["cond"],
        batch["null_cond"],
        batch["drop"],
        omega=omega,
        kappa=kappa,
        t_range=t_range,
        key=key,
    )
    error = jnp.sum((u - target) ** 2, axis=tuple(range(1, u.ndim)))
    weight = 1 / jax.lax.stop_gradient(error + norm_eps) ** norm_p  # p = 0: the plain squared error
    return jnp.mean(weight * error)


def parse_config(argv: list[str] | None = None) -> Config:
    """Every Config field is a flag `--name value`; booleans are `--name` / `--no-name`. Flags left
    off come from the run's checkpoint when --run_dir holds one, else from Config (train/resume.py)."""
    parser = dataclass_parser(Config, __doc__, CHOICES)
    parser.parse_args(argv)  # --help, and argparse's checks of every flag
    given = vars(dataclass_parser(Config, __doc__, CHOICES, given_only=True).parse_args(argv))
    cfg = run_config(Config, given, say=tqdm.write if given.get("process_id", 0) == 0 else lambda _: None)
    if error := flag_value_error(cfg):
        parser.error(error)
    return with_init_flags(cfg)  # --init sd:FOLDER's text tower; the flags it decides refused (train/finetune.py)


def sigma_data(cfg: Config, codec) -> float:
    """--sigma_data, else the codec's: 0.5 for images in [-1, 1], 1.0 for scaled VAE latents."""
    return cfg.sigma_data or codec.sigma_data


def training_schedule(cfg: Config):
    """--schedule, the edm one with the run's training p(σ): ln σ ~ N(--edm_p_mean, --edm_p_std²); only training
    draws σ from it, sampling reads the σ range."""
    if cfg.schedule == "edm":
        return EDMSchedule(p_mean=cfg.edm_p_mean, p_std=cfg.edm_p_std)
    return schedule_by_name(cfg.schedule)


def train_objective(cfg: Config, codec, condition, schedule, parameterization, repa=None) -> tuple:
    """(prepare, loss_fn) of --objective: `prepare` and `loss_fn`, or MeanFlow's `prepare_meanflow` and
    `meanflow_loss_fn`, with the run's codec, condition and flags; `repa` (train/repa_flags.py): REPA's term."""
    dropout = getattr(cfg, condition.dropout_flag)
    if cfg.objective == "meanflow":
        return (
            functools.partial(
                prepare_meanflow,
                codec=codec,
                condition=condition,
                cond_dropout=dropout,
                p_mean=cfg.meanflow_p_mean,
                p_std=cfg.meanflow_p_std,
                r_neq_t=cfg.meanflow_r_neq_t,
            ),
            functools.partial(
                meanflow_loss_fn,
                omega=cfg.meanflow_omega,
                kappa=cfg.meanflow_kappa,
                norm_p=cfg.meanflow_norm_p,
                norm_eps=cfg.meanflow_norm_eps,
            ),
        )
    repa_side, repa_weight = (repa.side, repa.weight) if repa else (0, 0.0)
    return (
        functools.partial(
            prepare, codec=codec, condition=condition, schedule=schedule, cond_dropout=dropout, repa_side=repa_side
        ),
        functools.partial(loss_fn, schedule=schedule, parameterization=parameterization, repa_weight=repa_weight),
    )


def checkpoint_config(
    cfg: Config,
    image_shape: tuple,
    num_classes: int,
    args: dict,
    codec,
    condition,
    latent_config: dict,
    class_names: list | None,
    repa=None,
) -> dict:
    """What each checkpoint stores beside the state, enough to rebuild the run from its directory alone: the
    flags, the data's shape and classes, the network's constructor arguments (`model_args`), the codec and
    condition (`to_config`), what latents were encoded from (`latent_config`) and REPA's projector (`repa`), if any."""
    return dict(
        dataclasses.asdict(cfg),
        image_shape=list(image_shape),
        num_classes=num_classes,
        model_args=args,
        codec=codec.to_config(),
        condition=condition.to_config(),
        **latent_config,
        **({"class_names": list(class_names)} if class_names else {}),
        **({"repa": repa.to_config()} if repa else {}),
    )


def main(cfg: Config, features_fn=None) -> None:
    """`features_fn`: --eval_every's feature network, a stand-in (tests); default InceptionV3 from --inception."""
    cfg = cfg if cfg.run_dir else dataclasses.replace(cfg, run_dir=default_run_dir(cfg.dataset, cfg.model))
    saved = checkpoint_steps(cfg.run_dir)
    resume = cfg.resume_step if cfg.resume_step >= 0 else (saved[-1] if saved else None)
    if resume is not None and resume >= cfg.steps:  # before JAX, wandb or the data start
        if cfg.process_id == 0:
            tqdm.write(
                f"{cfg.run_dir} is already at step {resume} of --steps {cfg.steps}: nothing to train. To "
                f"train longer, run it again with a larger --steps, e.g. --steps {2 * cfg.steps} (the "
                f"learning rate's cosine then stretches to it)."
            )
        return
    if cfg.process_id == 0:  # which of the two a command does, first: a mistyped --run_dir shows here
        network = f"the UNet of {cfg.init}" if cfg.init.startswith("sd:") else cfg.model  # sd: the folder's
        network += f" from {cfg.init}'s EMA" if cfg.init and not cfg.init.startswith("sd:") else ""
        network += f" with LoRA rank {cfg.lora_rank} adapters" if cfg.lora_rank else ""
        tqdm.write(
            f"new run in {cfg.run_dir}: {network} on {cfg.dataset}"
            if resume is None
            else f"resuming {cfg.run_dir} from step {resume}"
        )
    start_jax(cfg)
    if cfg.objective == "meanflow":  # its loss takes jax.jvp through the network: no custom_vjp workarounds
        xla_cpu.enable(xla_cpu.switched_on() - xla_cpu.NO_FORWARD_MODE, process_flags=False)
    run_dir = as_path(cfg.run_dir)  # a local folder or gs://BUCKET/PREFIX (eqxdiff/paths.py)
    is_main = jax.process_index() == 0

    try:
        mesh = make_mesh(data=-1, fsdp=cfg.fsdp_size)
    except ValueError as e:  # more chips asked for than the job has
        cpu = " (on a CPU, --cpu_devices N simulates N devices)" if jax.default_backend() == "cpu" else ""
        raise SystemExit(f"--fsdp_size {cfg.fsdp_size}: {e}{cpu}") from e
    check_batch(cfg, mesh.size)
    check_eval(cfg)
    check_schedule(cfg)
    check_objective(cfg)
    check_text_folders_exist(cfg)
    check_writable(run_dir, "--run_dir", folder=True, create=False)  # made when the run starts: a refusal leaves none
    source = open_dataset(cfg, tqdm.write if is_main else lambda _: None)
    # Where the weights come from and what trains (eqxdiff/run/finetune.py): --model drawn from --seed (Scratch) or
    # from --init RUN_DIR's EMA (FromRun), or --init sd:'s UNet, trained whole (Pretrained) or frozen under LoRA
    # adapters (LoRA); --init's data checked
    tune = open_init(cfg, mesh, cfg.fsdp_min_param_size, SHARDING_RULES, source)
    if cfg.hflip and not getattr(source, "hflip_keeps_meaning", True):
        raise SystemExit(f"--hflip would swap what {cfg.dataset}'s captions place left and right.")
    condition = run_condition(cfg, source, mesh, SHARDING_RULES)  # what the network sees (eqxdiff/run/conditions.py)
    check_eval_condition(cfg, condition)
    image_shape, num_classes = source.image_shape, source.num_classes  # latents: the latent shape
    class_names = getattr(source, "class_names", None)  # folder: the sub-folders, each grid row's label
    sample_rows, row_labels = sample_grid_rows(
        cfg, condition, source
    )  # the sample grids' labels or prompts, a row each
    # What x0 is: pixels, or latents (eqxdiff/run/codecs.py) of a VAE laid out by the run's rules.
    codec, latent_config = run_codec(source, mesh, min_size=cfg.fsdp_min_param_size, rules=SHARDING_RULES)
    # EDM's preconditioning assumes the data's std is --sigma_data (--init: the folder's scheduler, no sigma_data)
    if isinstance(codec, Latents) and is_main and not cfg.init.startswith("sd:"):
        std, sigma = scaled_latent_std(source, codec.scaling_factor, codec.shift_factor), sigma_data(cfg, codec)
        if not 0.5 <= std / sigma <= 2:
            tqdm.write(
                f"warning: the latents, scaled by meta.json's factors, have std {std:.3g} (from a sample of "
                f"records), far from --sigma_data {sigma:g}: pass --sigma_data {std:.2g}, or check the VAE's "
                f"scaling_factor."
            )
    source = condition.records(source)  # captions -> token ids as records are read, on the host
    schedule = training_schedule(cfg)
    parameterization = parameterization_by_name(cfg.parameterization, sigma_data(cfg, codec))
    # The network's constructor arguments, sharding rules and noise: as above, or what --init's folder decides
    net = tune.network(model_args(cfg.model, image_shape, condition), schedule, parameterization, SHARDING_RULES)
    args, rules, schedule, parameterization = net.args, net.rules, net.schedule, net.parameterization
    args = with_two_times(cfg, args)  # --objective meanflow: a network of t and t - r (eqxdiff/nn/unet.py, dit.py)
    # How the EMA is sampled for the grids and FID (train/ema_samples.py): by --sample_method, --sample_steps,
    # --guidance and --guidance_interval (eqxdiff/run/sampling.py), with the run's codec, condition and noise.
    ema_sampling = dict(
        cfg=cfg,
        sampling=run_sampling(cfg),
        codec=codec,
        condition=condition,
        schedule=schedule,
        parameterization=parameterization,
        sample_shape=image_shape,
        mesh=mesh,
    )
    write_samples = functools.partial(write_sample_grid, **ema_sampling, rows=sample_rows, row_labels=row_labels)
    evaluate = None
    if cfg.eval_every > 0:  # FID's network and reference, checked against each other before anything compiles
        fid_images = codec.image_shape(image_shape)  # FID sees images: a latent run's samples decoded
        image_dataset = latent_config.get("image_dataset", cfg.dataset)
        fid_network, fid_reference = open_eval_fid(cfg, fid_images, image_dataset, features_fn)
        evaluate = functools.partial(
            evaluate_fid,
            **ema_sampling,
            num_classes=num_classes,
            network=fid_network,
            reference=fid_reference,
            fd_dinov2=open_eval_fd_dinov2(cfg, fid_images, image_dataset),  # --dinov2: the same samples' FD-DINOv2
        )

    if resume is not None:
        check_model_args(cfg.run_dir, cfg.model, resume, args)
    set_remat_policy(cfg.remat_policy)  # read as the step traces each block
    # --repa_weight: the network beside REPA's projector (its block, DINOv2's side) and the frozen DINOv2, or None
    make_network = functools.partial(build_model, args, cfg.remat, condition=condition)
    repa = open_repa(cfg, args, make_network, codec, source)
    frozen = condition.frozen()
    if repa:  # the grids and FID sample the network alone; the step reads the tower as frozen["repa_encoder"]
        make_network, frozen = repa.make_model(make_network), {**(frozen or {}), **repa.frozen()} or None
        write_samples, evaluate = (fn and sampled_network(fn) for fn in (write_samples, evaluate))
    # What the step trains (the network, or LoRA's adapters), its frozen argument (a text tower, its null, LoRA's
    # base) and a new run's state
    training = tune.training(make_network, frozen)
    make_model, frozen = training.make_model, training.frozen

    warmup = cfg.warmup_steps if cfg.warmup_steps < cfg.steps else cfg.steps // 10
    if warmup != cfg.warmup_steps and is_main:
        tqdm.write(f"--warmup_steps {cfg.warmup_steps} >= --steps {cfg.steps}: warming up for {warmup} steps")
    optimizer, lr_schedule = run_optimizer(cfg.lr, cfg.steps, warmup, cfg.weight_decay, cfg.lr_ref_steps)

    sigma_rels = parse_sigma_rels(cfg.phema_sigma_rels)  # post-hoc EMA's tracked profiles (eqxdiff/training/phema.py)
    try:  # a spec that does not fit its leaf, or a rule that matches none of the modules the run placed (a typo)
        # The state's shapes and FSDP layout, nothing allocated: the step compiles from these.
        abstract, shardings = abstract_train_state(
            make_model,
            optimizer,
            mesh,
            cfg.fsdp_min_param_size,
            rules=rules,
            strict=False,
            num_phema=len(sigma_rels),
        )
        frozen_shardings = (
            None
            if frozen is None
            else state_shardings(frozen, mesh, cfg.fsdp_min_param_size, rules=rules, strict=False)
        )
        check_rules_match(SHARDING_RULES, [abstract, frozen, condition.pretrained() | codec.pretrained()])
    except RuleError as e:
        raise SystemExit(f"SHARDING_RULES in train/main.py: {e}") from e
    frozen = None if frozen is None else jax.device_put(frozen, frozen_shardings)
    data_sharding = batch_sharding(mesh)
    prepare_fn, loss = train_objective(cfg, codec, condition, schedule, parameterization, repa)  # --objective, REPA
    build_step = functools.partial(
        make_train_step,
        prepare=prepare_fn,
        loss_fn=loss,
        optimizer=optimizer,
        lr_schedule=lr_schedule,
        ema_decay=ema_warmup(cfg.ema_decay) if cfg.ema_warmup else cfg.ema_decay,
        state_shardings=shardings,
        batch_sharding=data_sharding,
        seed=cfg.seed,
        grad_accum_steps=cfg.grad_accum_steps,
        precision=cfg.precision,
        frozen_shardings=frozen_shardings,
        phema_gammas=tuple(sigma_rel_to_gamma(s) for s in sigma_rels),
        model_of=training.model_of,  # LoRA: adapters + base
        after_update=force_weight_normalization,  # EDM2's MPConv weights back on the unit sphere (others: unchanged)
    )
    spec = batch_spec(source, cfg.batch_size)
    # --xla_cpu auto on a CPU mesh: this machine's stored choice for this step, else timed once the state exists.
    auto = xla_cpu_auto.target(cfg, abstract, spec, frozen, mesh) if cfg.xla_cpu == "auto" else None
    timed = auto is not None and xla_cpu_auto.cached(*auto) is None
    train_step = build_step()

    # A fresh state, or the newest checkpoint restored onto this run's mesh, while the step
    # compiles in a thread (it needs only shapes; XLA's compiler releases the GIL).
    checkpoints = Checkpoints(run_dir / "checkpoints", keep=cfg.keep_checkpoints)
    snapshots = EmaSnapshots(run_dir / "phema") if sigma_rels else None  # post-hoc EMA's, each process its shards
    with ThreadPoolExecutor(1) as pool:
        compiling = pool.submit(train_step.compile, abstract, spec, frozen)
        if resume is None:
            state = training.start(optimizer, shardings)  # drawn from --seed, or --init's folder's (or adapters)
            start_step, start_example = 0, 0
        else:
            try:
                state, position, _ = checkpoints.restore(resume, abstract, shardings)
                check_position(position, cfg.seed, source, allow_dataset_change=cfg.allow_dataset_change)
            except (CheckpointError, ValueError) as e:  # the files, or the data they continue, do not fit
                raise SystemExit(str(e)) from e
            start_step, start_example = resume, position["examples_consumed"]
            tqdm.write(f"resumed from {checkpoints.directory / str(resume)} ({start_example} examples consumed)")
        tqdm.write(f"mesh {dict(mesh.shape)}; " + sharding_summary(state, shardings))
        compiling.result()  # a compile error surfaces here
    if timed:
        _, train_step = xla_cpu_auto.choose(build_step, train_step, state, spec, frozen, *auto)

    ckpt_config = checkpoint_config(
        cfg, image_shape, num_classes, args, codec, condition, latent_config, class_names, repa
    )
    stream = batch_stream(
        source,
        cfg.batch_size,
        cfg.seed,
        start_example=start_example,
        hflip=cfg.hflip,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    peak, peak_source = peak_flops_per_device(dtype="fp32" if cfg.precision == "fp32" else "bf16")
    flops_per_device = step_flops(train_step, abstract, spec, frozen) / mesh.size  # XLA's cost analysis of the step
    with (
        Prefetch(stream, functools.partial(global_batch, data_sharding), depth=2) as batches,
        MetricsLogger(run_dir, wandb_mode=cfg.wandb, config=dataclasses.asdict(cfg), enabled=is_main) as logger,
        checkpoints,
        snapshots or contextlib.nullcontext(),
        StopRequest() as stop,
    ):
        # The grids, checkpoints and FID as the kind writes them (LoRA: of base + EMA adapters; its file beside)
        write_grids, save, measure = tune.outputs(
            write_samples,
            functools.partial(
                save_checkpoint,
                checkpoints=checkpoints,
                source=source,
                config=ckpt_config,
                batches=batches,
                start_example=start_example,
            ),
            evaluate,
        )
        logger.truncate_after(start_step)  # a resumed run logs each step once
        logger.log_once(
            {
                "startup/step_flops_per_device": flops_per_device,
                "startup/peak_flops_per_device": peak,
                "startup/peak_source": peak_source,
            }
        )
        train_loop(
            cfg,
            state,
            functools.partial(train_step, frozen=frozen),
            batches,
            logger,
            start_step=start_step,
            log_window=LogWindow(cfg.batch_size, flops_per_device, peak),
            profile=ProfileWindow(cfg.profile_steps, run_dir / "profile"),
            write_samples=write_grids,
            stop=stop,
            evaluate=measure,
            save_checkpoint=save,
            save_snapshot=snapshots and functools.partial(save_snapshot, snapshots=snapshots, sigma_rels=sigma_rels),
        )
        checkpoints.wait()  # the final save is on disk before the process exits


def run_script() -> None:
    """main(flags), where a Ctrl-C the loop does not catch (during start-up, or a second one) stops with
    one line, status 130 (a shell's for SIGINT), rather than a traceback."""
    try:
        main(parse_config())
    except KeyboardInterrupt:
        tqdm.write(
            "SIGINT received: stopped without saving; the same command starts again (or resumes from "
            "the newest checkpoint, if any)"
        )
        raise SystemExit(130) from None


if __name__ == "__main__":
    exit_on_user_error(run_script)
