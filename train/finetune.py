"""train/main.py's fine-tuning flags (--init RUN_DIR or sd:FOLDER, --lora_*), and what the folder decides of the others
before JAX starts. The fine-tune itself (a run's EMA, the folder's UNet, its noise, a LoRA's adapters and base) is
eqxdiff/run/finetune.py's."""

import dataclasses
from pathlib import Path

from eqxdiff.run.finetune import PREFIX, parts, source_run
from eqxdiff.run.sdxl_condition import is_sdxl_folder


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclasses.dataclass(frozen=True)
class FineTuneFlags:
    """train/main.py's fine-tuning flags (its Config derives from this; train/startup.py reads these comments)."""

    # finetune: a run's network (docs/meanflow.md), or a Stable Diffusion UNet, whole or with LoRA (docs/stable-diffusion.md)
    init: str = ""  # RUN_DIR: start from a run's EMA (the same --model; a flow run -> MeanFlow) | sd:FOLDER: a diffusers SD UNet (its folder decides model, text tower, latents, noise)
    lora_rank: int = 0  # --init: train rank-R adapters only (LoRA), the UNet frozen; 0: train the whole UNet
    lora_targets: str = ""  # a regex on the adapted layers' names (default: attention's to_q/to_k/to_v/to_out.0)
    lora_alpha: float = 0.0  # the adapters' scale is alpha/rank (0: alpha = rank)
    finetune: str = ""  # a fine-tuning kind by its FINETUNE_KINDS name, eqxdiff/run/finetune.py (default: --init's, --lora_rank's)
# fmt: on


def with_init_flags(cfg):
    """`cfg` (train/main.py's Config) with what --init's folder decides (before JAX starts): --text_encoder its
    text_encoder/; a flag the folder contradicts, or a LoRA flag without --init, is a SystemExit naming the fix."""
    defaults = type(cfg)()
    if not cfg.init:
        if cfg.lora_rank or cfg.lora_targets or cfg.lora_alpha:
            raise SystemExit("--lora_rank/--lora_targets/--lora_alpha adapt a pretrained UNet: add --init sd:FOLDER.")
        if is_sdxl_folder(cfg.text_encoder):
            raise SystemExit(
                f"--text_encoder {cfg.text_encoder}: an SDXL pipeline's two towers condition its own "
                "UNet: pass --init sd:FOLDER instead."
            )
        return cfg
    if not cfg.init.startswith(PREFIX):  # a train/main.py run: this run's flags give the network, checked against it
        if cfg.lora_rank or cfg.lora_targets or cfg.lora_alpha:
            raise SystemExit(
                f"--lora_rank/--lora_targets/--lora_alpha adapt a diffusers UNet (--init sd:FOLDER); --init "
                f"{cfg.init} trains the whole network: drop them."
            )
        source_run(cfg.init, cfg)
        return cfg
    folders = parts(cfg.init)
    given = [
        f"--{name}"
        for name in ("model", "schedule", "parameterization", "edm_p_mean", "sigma_data")
        if getattr(cfg, name) != getattr(defaults, name)
    ]
    if given:
        raise SystemExit(
            f"--init {cfg.init} decides the network and its noise (the folder's unet/ and scheduler "
            f"config): drop {', '.join(given)}."
        )
    if cfg.lora_rank < 0 or (not cfg.lora_rank and (cfg.lora_targets or cfg.lora_alpha)):
        raise SystemExit("--lora_targets and --lora_alpha need --lora_rank R >= 1 (0: fine-tune the whole UNet).")
    tower = folders["text_encoder"]
    if cfg.text_encoder and tower and Path(cfg.text_encoder).expanduser().resolve() != tower:
        raise SystemExit(
            f"--text_encoder {cfg.text_encoder}: --init {cfg.init} conditions on its own {tower}; drop --text_encoder."
        )
    if not cfg.text_encoder and not tower:
        raise SystemExit(
            f"--init {cfg.init} has no text_encoder/ beside its unet/: pass --text_encoder FOLDER, the "
            "CLIP text tower it was trained with."
        )
    return dataclasses.replace(cfg, text_encoder=cfg.text_encoder or str(tower))
