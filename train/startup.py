"""What every script in train/ does first: flags from a dataclass (grouped in its sections; the launch
flags, `Launch`, shared by every script), then JAX's start (simulated devices, the persistent compile
cache, jax.distributed, the XLA:CPU workarounds), before the backend exists."""

import argparse
import dataclasses
import inspect
import json
import logging
import re
import sys
import types
import typing
import warnings
from pathlib import Path

from flags import HelpFormatter, Parser  # noqa: F401 — train/flags.py: every script's parser

import jax

import eqxdiff
from eqxdiff import xla_cpu

EQXDIFF = Path(eqxdiff.__file__).parent  # the library's files: whose warnings are one line


# A table the formatter leaves as written: each field's comment is its flag's --help line.
# fmt: off
@dataclasses.dataclass(frozen=True)
class Launch:
    """How a script's JAX starts (`start_jax`): the flags every script in train/ takes, each Config
    there a subclass of this one. Frozen, as each script's flags are: a value resolved once, never assigned to."""

    # launch: the devices, the compile cache and the processes of a jax.distributed job
    cpu_devices: int = 0  # >0: simulate this many CPU devices
    compilation_cache_dir: str = ""  # JAX's persistent compile cache: a rerun loads its compiled programs
    coordinator: str = ""  # HOST:PORT of process 0 joins a jax.distributed job (train/launch_local.py); "auto": cluster env
    num_processes: int = 1  # with --coordinator: processes in the job
    process_id: int = 0  # with --coordinator: this process's index
    xla_cpu: str = "on"  # XLA:CPU workarounds (eqxdiff/xla_cpu.py): on (its DEFAULT), off, a comma list of names; auto: timed
# fmt: on


def _dataclasses(config_type) -> list[type]:
    """`config_type` and the dataclasses it derives from, itself first: each holds the source of its own fields."""
    return [c for c in config_type.__mro__ if dataclasses.is_dataclass(c)]


def field_comments(config_type) -> dict[str, str]:
    """The `# ...` comment on each field's line of a dataclass's source (and its bases'): that flag's --help text."""
    comments = {}
    for cls in reversed(_dataclasses(config_type)):
        for line in inspect.getsource(cls).splitlines():
            if match := re.match(r"\s+(\w+): [^#]*?#\s*(.*)$", line):
                comments[match[1]] = match[2]
    return comments


def field_sections(config_type) -> dict[str, tuple[str, str]]:
    """`{field: (section, its description)}` from a dataclass's source (and its bases'): a comment on a line
    of its own, `# name: what the section holds`, opens a section, holding the fields below it up to the
    next; a field above the first is in none (absent here). --help shows each section as a group of flags."""
    sections = {}
    for cls in _dataclasses(config_type):
        own = set(cls.__annotations__)
        section = None
        for line in inspect.getsource(cls).splitlines():
            if match := re.match(r"\s+#\s*(\w+)(?::\s*(.*))?$", line):
                section = (match[1], match[2] or "")
            elif (match := re.match(r"\s+(\w+):", line)) and match[1] in own and section:
                sections.setdefault(match[1], section)
    return sections


def flag_type(field: dataclasses.Field) -> tuple[type, dict]:
    """(what argparse converts a value with, the other add_argument keywords) of a field's annotation: `X | None`
    a flag of X whose absence is None (the help says what None means), `tuple[X, ...]` one or more values."""
    kind = field.type
    if isinstance(kind, types.UnionType) and type(None) in typing.get_args(kind):
        (kind,) = [a for a in typing.get_args(kind) if a is not type(None)]
    if typing.get_origin(kind) is tuple:
        return typing.get_args(kind)[0], {"nargs": "+"}
    return kind, {}


def add_flags(
    parser: argparse.ArgumentParser,
    config_type,
    choices: dict | None = None,
    required: tuple = (),
    given_only: bool = False,
    parsers: dict | None = None,
) -> argparse.ArgumentParser:
    """A flag `--name value` per field of the dataclass `config_type` on `parser`, its help the field's
    comment and its default the field's, grouped by the source's sections (`field_sections`: the
    class's own, in order, then its bases'); booleans are `--name` / `--no-name`, `tuple[X, ...]` fields take one
    or more values (`flag_type`). `parsers`: a field's own parser of its text (an `argparse.ArgumentTypeError` is
    the one-line error). `given_only`: flags left off the command line are absent from the parsed namespace
    (which flags a command gives)."""
    helps, sections = field_comments(config_type), field_sections(config_type)
    groups = {}
    for title, description in sections.values():  # in the order the sections come
        if title not in groups:
            groups[title] = parser.add_argument_group(title, description or None)
    title = lambda field: sections[field.name][0] if field.name in sections else None  # noqa: E731
    order = {name: i for i, name in enumerate(groups)}  # usage lists the flags as --help does: a stable sort
    for field in sorted(dataclasses.fields(config_type), key=lambda field: order.get(title(field), -1)):
        where = parser if title(field) is None else groups[title(field)]
        default = argparse.SUPPRESS if given_only else field.default
        help_text = helps.get(field.name, "").replace("%", "%%")
        if field.type is bool:
            where.add_argument(
                f"--{field.name}", action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
        else:
            kind, more = flag_type(field)
            where.add_argument(
                f"--{field.name}",
                type=(parsers or {}).get(field.name, kind),
                default=default,
                help=help_text,
                choices=(choices or {}).get(field.name),
                required=field.name in required,
                **more,
            )
    return parser


def parsed_flags(config_type, namespace: argparse.Namespace):
    """The frozen flags value of a parsed command line: `config_type`, a tuple field's values as a tuple."""
    values = {f.name: getattr(namespace, f.name) for f in dataclasses.fields(config_type)}
    return config_type(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def dataclass_parser(
    config_type,
    description: str,
    choices: dict | None = None,
    required: tuple = (),
    given_only: bool = False,
    parsers: dict | None = None,
    moved: dict | None = None,
) -> argparse.ArgumentParser:
    """A parser of `config_type`'s flags (`add_flags`), `description` atop its --help; `moved`: Parser's."""
    return add_flags(Parser(description=description, moved=moved), config_type, choices, required, given_only, parsers)


class LeftoverAsyncErrors(logging.Filter):
    """Drops asyncio's reports of failures nobody awaited: when one of a restore's concurrent reads fails, orbax
    raises that one (the run's error) and its other reads fail alike as its event loop closes; asyncio would print
    each of those with a traceback ("Future exception was never retrieved", a callback on the closed loop), before
    or after the error's one line, as garbage collection happens to run."""

    def filter(self, record: logging.LogRecord) -> bool:
        leftover = "exception was never retrieved" in record.getMessage()
        error = record.exc_info[1] if record.exc_info else None
        closed = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        return not (leftover or closed)


def one_line_warning(message, category, filename, lineno, line=None, _default=warnings.formatwarning) -> str:
    """eqxdiff's warnings as a user reads them, `warning: MESSAGE` on one line (they say what was chosen or what to
    check, as errors say the fix); any other library's as Python writes them (the file and line that warned)."""
    if issubclass(category, UserWarning) and Path(filename).is_relative_to(EQXDIFF):
        return f"warning: {message}\n"
    return _default(message, category, filename, lineno, line)


def exit_on_user_error(fn) -> None:
    """`fn()`, where an expected user error — a `SystemExit` with a message: a missing or bad
    dataset, a checkpoint that does not fit, a flag argparse could not check — prints that one line
    and exits with status 2 (argparse's own status), without a traceback."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, LeftoverAsyncErrors) for f in asyncio_log.filters):
        asyncio_log.addFilter(LeftoverAsyncErrors())
    warnings.formatwarning = one_line_warning
    try:
        fn()
    except SystemExit as e:
        if isinstance(e.code, str):
            print(f"error: {e.code}", file=sys.stderr)
            # What the failed work leaves unfinished (a failed restore's other concurrent reads in orbax) is
            # finalised at exit, and Python would print each one's traceback ("Exception ignored in:
            # <coroutine ...>") after the line that says what to fix: the error is that line alone.
            sys.unraisablehook = lambda _: None
            sys.exit(2)
        raise


def start_jax(launch: Launch | argparse.Namespace) -> None:
    """Device simulation, the compile cache, jax.distributed and the XLA:CPU workarounds: all
    before the backend starts. `launch`: the flags of `Launch` (a Config of train/ is one; train/sample.py
    passes its parsed flags)."""
    remat = getattr(launch, "remat", False)  # train/main.py's: the memory-optimized scheduler comes with it
    launch = Launch(**{f.name: getattr(launch, f.name) for f in dataclasses.fields(Launch)})
    if launch.cpu_devices:
        jax.config.update("jax_num_cpu_devices", launch.cpu_devices)
    if launch.compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", launch.compilation_cache_dir)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    if launch.coordinator == "auto":  # SLURM, Open MPI, TPU pods, ...: jax reads the cluster's env
        jax.distributed.initialize()
    elif launch.coordinator:
        jax.distributed.initialize(launch.coordinator, num_processes=launch.num_processes, process_id=launch.process_id)
    # Same results; which pay off depends on the CPU (BENCHMARKS.md). "auto" starts with the shipped set but
    # YNNPACK's process flag, and train/main.py times its step under each candidate (train/xla_cpu_auto.py).
    auto = launch.xla_cpu == "auto"
    xla_cpu.enable(xla_cpu.named_switches(launch.xla_cpu, remat), process_flags=not auto)
