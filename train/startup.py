"""What every script in train/ does first: flags from a dataclass, then JAX's start (simulated
devices, the persistent compile cache, jax.distributed, the XLA:CPU workarounds), before the
backend exists."""

import argparse
import dataclasses
import inspect
import re
import sys

import jax

from eqxdiff import xla_cpu


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each flag's default after its help, unless the help
    already says it or there is none ("" or None: unset, the help says what that means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, "", argparse.SUPPRESS) or action.option_strings == []:
            return text
        return f"{text} (default: %(default)s)"


def field_comments(config_type) -> dict[str, str]:
    """The `# ...` comment on each field's line of a dataclass's source: that flag's --help text."""
    comments = {}
    for line in inspect.getsource(config_type).splitlines():
        if match := re.match(r"\s+(\w+): [^#]*?#\s*(.*)$", line):
            comments[match[1]] = match[2]
    return comments


def dataclass_parser(config_type, description: str, choices: dict | None = None, required: tuple = (),
                     given_only: bool = False) -> argparse.ArgumentParser:  # fmt: skip
    """A flag `--name value` per field of the dataclass `config_type`, its help the field's comment
    and its default the field's; booleans are `--name` / `--no-name`. `given_only`: flags left off
    the command line are absent from the parsed namespace (which flags a command gives)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=HelpFormatter)
    helps = field_comments(config_type)
    for field in dataclasses.fields(config_type):
        default = argparse.SUPPRESS if given_only else field.default
        help_text = helps.get(field.name, "").replace("%", "%%")
        if field.type is bool:
            parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction, default=default,
                                help=help_text)  # fmt: skip
        else:
            parser.add_argument(f"--{field.name}", type=field.type, default=default, help=help_text,
                                choices=(choices or {}).get(field.name), required=field.name in required)  # fmt: skip
    return parser


def exit_on_user_error(fn) -> None:
    """`fn()`, where an expected user error — a `SystemExit` with a message: a missing or bad
    dataset, a checkpoint that does not fit, a flag argparse could not check — prints that one line
    and exits with status 2 (argparse's own status), without a traceback."""
    try:
        fn()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"error: {e.code}", file=sys.stderr)
            sys.exit(2)
        raise


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
