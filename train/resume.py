"""The run a command names: its directory and, once that holds a checkpoint, the flags saved with it.

A run is its --run_dir, by default runs/DATASET-MODEL, so a run on other data or with another model
is never silently an old one. Resuming, flags left off the command line come from the checkpoint's
saved config, so the same command (or a shorter one) continues the run; the flags that define what
is trained (FIXED) must equal the saved ones, and a change to any other is echoed. The config is
read as plain JSON, before JAX starts: flags like --cpu_devices must be set before its backend is.
"""

import dataclasses
import re
from pathlib import Path

from eqxdiff.paths import is_url, url_error
from eqxdiff.run.models import changed_args
from eqxdiff.run.run_dir import checkpoint_steps, close_runs, saved_config

# What a checkpoint's arrays and data order were made for (lr_ref_steps: Adam's state or AdamW's): a change is a
# different run.
FIXED = ("dataset", "image_size", "model", "schedule", "parameterization", "sigma_data", "seed", "text_encoder", "init",
         "tokenizer", "null_text", "phema_sigma_rels", "lr_ref_steps", "lora_rank", "lora_targets", "lora_alpha",
         "finetune", "repa_weight", "repa_block", "repa_projector_dim")  # fmt: skip
# How this one command starts, not what the run is: never taken from a checkpoint.
PER_COMMAND = ("run_dir", "resume_step", "allow_dataset_change", "coordinator", "num_processes", "process_id",
               "xla_cpu")  # fmt: skip


def dataset_name(spec: str) -> str:
    """A short name for a --dataset spec: digits; folder:~/data/pets -> pets; npz:a/b.npz -> b;
    arrayrecord:~/data/pets/*.arrayrecord -> pets."""
    kind, _, arg = spec.partition(":")
    if not arg:
        return re.sub(r"[^\w.-]", "_", spec)
    path = Path(arg.rstrip("/"))
    while any(c in path.name for c in "*?[") and path.name:
        path = path.parent  # a glob: the folder that holds the files
    name = path.stem or kind
    return re.sub(r"[^\w.-]", "_", name)


def default_run_dir(dataset: str, model: str) -> str:
    return f"runs/{dataset_name(dataset)}-{model}"


def saved_run(run_dir: str, step: int = -1) -> tuple[int, dict] | None:
    """`saved_config`, where a bucket that cannot be read (no credentials, no access, a server's error) is one
    line naming it: the run's first request to its bucket."""
    if not is_url(run_dir):
        return saved_config(run_dir, step)
    try:
        return saved_config(run_dir, step)
    except (SystemExit, KeyboardInterrupt):
        raise
    except Exception as e:  # the client libraries raise many kinds (HTTP, credentials, network)
        raise SystemExit(f"--run_dir {run_dir}: cannot read the bucket: {type(e).__name__}: {e}; check the bucket "
                         f"and the credentials, or pass another --run_dir.") from e  # fmt: skip


def refuse_mistyped_run_dir(run_dir: str, given: dict) -> None:
    """The short resume form (`--run_dir X` and no flag that defines a run) on a folder that does not
    exist, beside a run of a close name, is most likely a typo: refused in one line, not a fresh
    default run. A new run starts there with its --dataset (or any defining flag) given, or once the
    folder exists."""
    if is_url(run_dir) or Path(run_dir).expanduser().exists() or any(k in given for k in FIXED):
        return
    close = close_runs(run_dir)
    if close:
        named = " or ".join(f"{d} (a run at step {(checkpoint_steps(d) or [0])[-1]})" for d in close)
        raise SystemExit(f"--run_dir {run_dir} does not exist; did you mean {named}? To start a new run there "
                         f"anyway, give its --dataset (or make the folder first: mkdir -p {run_dir}).")  # fmt: skip


def resolved(name: str, value):
    """A flag's value as compared on resume: --dataset's path and the text tower's folders with `~`,
    relative parts and a trailing slash resolved (the same data written another way is no change)."""
    if name == "dataset" and ":" in value and not is_url(value.partition(":")[2]):
        kind, _, arg = value.partition(":")
        return f"{kind}:{Path(arg).expanduser().resolve()}"
    if name in ("text_encoder", "tokenizer") and value not in ("", "scratch") and not is_url(value):
        return str(Path(value).expanduser().resolve())
    return value


def run_config(config_type, given: dict, say=print):
    """The command's config: `given` (the flags on its command line, by name) over the config saved
    with the run's checkpoint over `config_type`'s defaults. Refuses (SystemExit, one line) a given
    FIXED flag that differs from the saved one; `say`s each other change as `--lr 0.002 -> 0.001`."""
    defaults = config_type()
    run_dir = given.get("run_dir") or default_run_dir(given.get("dataset", defaults.dataset),
                                                      given.get("model", defaults.model))  # fmt: skip
    if is_url(run_dir) and not str(run_dir).startswith("gs://"):  # orbax 0.12's OCDBT spec: gs:// or a local path
        raise SystemExit(f"--run_dir {run_dir}: orbax writes checkpoints to gs:// and local paths only (s3://: "
                         f"google/orbax#359); pass a gs:// or a local --run_dir.")  # fmt: skip
    if is_url(run_dir) and (error := url_error(run_dir)):  # before any request to the bucket
        raise SystemExit(f"--run_dir {error}; pass another --run_dir.")
    found = saved_run(run_dir, given.get("resume_step", -1))
    if found is None and "run_dir" in given:
        refuse_mistyped_run_dir(run_dir, given)
    if found is None:
        return dataclasses.replace(defaults, **{**given, "run_dir": run_dir})
    step, saved = found
    names = {f.name for f in dataclasses.fields(config_type)} - set(PER_COMMAND)
    inherited = {k: v for k, v in saved.items() if k in names}
    changed = {k: (inherited[k], v) for k, v in given.items()
               if k in inherited and resolved(k, inherited[k]) != resolved(k, v)}  # fmt: skip
    if "dataset" in changed and given.get("allow_dataset_change"):
        say(f"--dataset {changed['dataset'][0]} -> {changed['dataset'][1]}")
        del changed["dataset"]
    refused = [f"--{k} {new} (saved: {old})" for k, (old, new) in changed.items() if k in FIXED]
    if refused:
        other_data = " (other data: --allow_dataset_change)" if "dataset" in changed else ""
        raise SystemExit(f"{run_dir} is a run of step {step} whose {', '.join(refused)} cannot change: leave "
                         f"{'it' if len(refused) == 1 else 'them'} off to continue that run{other_data}, or pass a "
                         f"new --run_dir to start another.")  # fmt: skip
    for k, (old, new) in changed.items():
        say(f"--{k} {old} -> {new}")
    return dataclasses.replace(defaults, **{**inherited, **given, "run_dir": run_dir})


def check_model_args(run_dir: str, model: str, step: int, args: dict) -> None:
    """A resumed run's network must be the one it trained: its `MODELS` entry may not have changed since."""
    saved = saved_config(run_dir, step)[1].get("model_args")  # None: a checkpoint from before they were stored
    changed = [] if saved is None else changed_args(saved, args)
    if changed:
        raise SystemExit(f"{run_dir} trained --model {model} with other arguments than its entry in "
                         f"eqxdiff/run/models.py gives now ({', '.join(changed)}): restore the entry to continue the run, "
                         f"or pass a new --run_dir to train the edited model.")  # fmt: skip
