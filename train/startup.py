"""What every script in train/ does first: flags from a dataclass, then JAX's start (simulated
devices, the persistent compile cache, jax.distributed, the XLA:CPU workarounds), before the
backend exists."""

import argparse
import dataclasses

import jax

from eqxdiff import xla_cpu


def dataclass_parser(config_type, description: str, choices: dict | None = None, required: tuple = ()) -> argparse.ArgumentParser:
    """A flag `--name value` per field of the dataclass `config_type`; booleans are `--name` /
    `--no-name`."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for field in dataclasses.fields(config_type):
        if field.type is bool:
            parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction, default=field.default)
        else:
            parser.add_argument(f"--{field.name}", type=field.type, default=field.default,
                                choices=(choices or {}).get(field.name), required=field.name in required)  # fmt: skip
    return parser


def start_jax(cfg) -> None:
    """Device simulation, the compile cache, jax.distributed and the XLA:CPU workarounds: all
    before the backend starts. `cfg`: any config with the fields cpu_devices,
    compilation_cache_dir, coordinator, num_processes and process_id (train/main.py's Config)."""
    if cfg.cpu_devices:
        jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
    if cfg.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", cfg.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if cfg.coordinator == "auto":  # SLURM, Open MPI, TPU pods, ...: jax reads the cluster's env
        jax.distributed.initialize()
    elif cfg.coordinator:
        jax.distributed.initialize(cfg.coordinator, num_processes=cfg.num_processes, process_id=cfg.process_id)
    xla_cpu.enable()  # XLA:CPU workarounds; same results, on CPU faster (eqxdiff/xla_cpu.py says why)
