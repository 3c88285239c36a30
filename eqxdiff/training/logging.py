"""Run logging: one JSON line per log step in `run_dir/metrics.jsonl`, plus Weights & Biases.

The jsonl file is the record of truth (plain text, no account, survives without wandb); wandb
is a viewer. A non-finite value is written as `null`. Call `log` at the logging cadence only: values are read to the host here.
"""

import json
import math
import os
import secrets
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from eqxdiff.paths import append_text, as_path, is_url, write_whole

WANDB_MODES = ("online", "offline", "disabled")

Scalar = float | int | str | np.generic | np.ndarray | jax.Array  # 0-d arrays are read to host


def _host(value: Scalar) -> float | int | str | bool:
    """A plain Python value: str/bool/int as is, any other number (incl. 0-d arrays) as float."""
    if isinstance(value, (str, bool, np.bool_)):
        return value if isinstance(value, str) else bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    return float(value)


def _jsonable(value: float | int | str | bool) -> float | int | str | bool | None:
    """Non-finite floats (NaN, ±inf) as JSON null, so every line stays valid JSON and every field a
    number or null (a "nan" string would read as text to a JSON or pandas reader)."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


class MetricsLogger:
    """Append metrics to `run_dir/metrics.jsonl` and to a wandb run.

    `wandb_mode`: "offline" (files under `run_dir/wandb/`, no network or account; sync later with
    `wandb sync`), "online", or "disabled" (wandb is never imported). `enabled=False` is for
    processes other than 0 in multi-host runs: nothing is written and wandb is never imported.
    Use as a context manager or call `close()`.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        wandb_mode: str = "offline",
        config: Mapping[str, Any] | None = None,
        enabled: bool = True,
        project: str = "eqxdiff",
    ):
        if wandb_mode not in WANDB_MODES:
            raise ValueError(f"Unknown wandb_mode {wandb_mode!r}; choose one of {WANDB_MODES}.")
        self.run_dir = as_path(run_dir)  # a local folder or a bucket's prefix (eqxdiff/paths.py)
        self.enabled = enabled
        self.wandb_mode = wandb_mode
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.run_json_path = self.run_dir / "run.json"
        self._run = None
        if not enabled:
            return
        if not is_url(self.run_dir):  # a bucket has no folders to make
            self.run_dir.mkdir(parents=True, exist_ok=True)
        if wandb_mode != "disabled":
            import wandb  # lazy: a heavy import, and absent where wandb is not installed

            self._run = wandb.init(
                project=project,
                dir=None if is_url(self.run_dir) else str(self.run_dir),  # wandb writes local files: $WANDB_DIR
                mode=wandb_mode,
                name=self.run_dir.name,
                config=dict(config or {}),
                id=self.wandb_run_id(),
                # Online, the same id continues the run (a resume may change flags, e.g. --lr: they
                # overwrite its config); offline, each resume is a folder with that id (wandb resumes
                # only online; `wandb sync --id ID --append` joins the folders).
                **({"resume": "allow", "allow_val_change": True} if wandb_mode == "online" else {}),
                # offline: no history and summary printed at the end (~30 lines: metrics.jsonl has them)
                **({"settings": wandb.Settings(quiet=True)} if wandb_mode == "offline" else {}),
            )

    def wandb_run_id(self) -> str:
        """The run directory's wandb id, made on its first start and kept in RUN_DIR/wandb_run_id: one
        training run is one wandb run across resumes."""
        path = self.run_dir / "wandb_run_id"
        if not path.exists():
            write_whole(path, secrets.token_hex(4) + "\n")  # wandb's own ids: 8 of [a-z0-9]
        return path.read_text().strip()

    def log(self, step: int, metrics: Mapping[str, Scalar]) -> None:
        """Append `{"step": step, **metrics}` to metrics.jsonl (flushed) and log it to wandb at `step`."""
        if not self.enabled:
            return
        values = {k: _host(v) for k, v in metrics.items()}
        row = {"step": int(step), **{k: _jsonable(v) for k, v in values.items()}}
        # Reopened per call: survives truncate_after. In a bucket the object is written again whole.
        append_text(self.metrics_path, json.dumps(row, allow_nan=False) + "\n")
        if self._run is not None:
            self._run.log(values, step=int(step))

    def log_once(self, metrics: Mapping[str, Scalar]) -> None:
        """Merge start-up facts (e.g. "startup/time_to_first_step_s") into run.json and wandb's summary."""
        if not self.enabled:
            return
        facts = {k: _host(v) for k, v in metrics.items()}
        merged = json.loads(self.run_json_path.read_text()) if self.run_json_path.exists() else {}
        merged.update({k: _jsonable(v) for k, v in facts.items()})
        write_whole(self.run_json_path, json.dumps(merged, indent=2, allow_nan=False) + "\n")
        if self._run is not None:
            self._run.summary.update(facts)

    def truncate_after(self, step: int) -> None:
        """Drop metrics.jsonl rows with step > `step` (and a torn last line), e.g. on resume."""
        if not self.enabled or not self.metrics_path.exists():
            return
        kept = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (json.JSONDecodeError, KeyError, TypeError):
                continue  # a line cut short by a crash
        write_whole(self.metrics_path, "".join(kept))

    def close(self) -> None:
        """Finish the wandb run; safe to call more than once."""
        if self._run is not None:
            self._run.finish()
            self._run = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
