"""Where a compiled step's time goes: its HLO instructions by kind and by phase, and a `jax.profiler`
trace's op events summed over them (benchmarks/profile_steps.py).

- `instructions(hlo_text)`: every instruction of a compiled module (`compiled.as_text()`), by name:
  its opcode, `kind` and `phase`.
  kind: `conv fwd`, `conv input-grad`, `conv weight-grad` (a conv whose window is larger than its
  output's spatial size, as XLA writes the weight gradient: the window spans the feature map; or a conv
  without metadata: XLA's rewrite of the weight gradient drops it, the others keep JAX's),
  `conv weight-grad (as matmuls)` (a backward dot from a conv contracting over positions, not channels:
  eqxdiff's `conv_grad_matmul`, or a 1×1 conv XLA wrote as a dot; other conv dots are `conv fwd` or
  `conv input-grad`), `channel sum (as matmul)` (eqxdiff's `channel_sum_matmul`: a bias gradient as a
  matvec with ones, found by its ones operand; one inside a fusion, whose operands are the fusion's
  parameters, reads as `matmul`), `matmul`, `fusion/elementwise`, `reduce`, `copy/transpose`, `rng`,
  `control` (conditional, while, call: containers whose bodies' ops are events of their own), `other`. A
  fusion takes the kind of the heaviest op inside it (a convolution, then a dot, then a reduce; else
  elementwise, or copy/transpose when it only moves data).
  phase (from the instruction's metadata, as JAX writes it): `backward` (op_name has `transpose(`, and
  XLA's weight-gradient convs), `forward` (`jvp(`), `optimizer` (innermost source file in optax, or
  eqx.apply_updates), `prepare/other` (the rest: the noise draw, EMA, NaN guard, metrics; `step_files`
  moves ops whose innermost source is the step's own file to `EMA/guard/metrics`). An instruction XLA
  added without metadata (a layout transpose, a copy) takes the phase of the op it feeds.
- `op_events(xplane_path, module)`: (hlo_op, duration ns) of the trace's op events of one compiled
  module (XLA:CPU tags each thunk's event with `hlo_op` and `hlo_module`).
- `summarise(events, table, steps)`: per kind, per phase, per innermost source file and the top ops, as ms per step and shares.
"""

import re
from collections import defaultdict

INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>[a-z][\w\-]*)\((?P<rest>.*)$")
CONTROL = {"conditional", "while", "call", "async-start", "async-done", "async-update"}
MOVES = {
    "copy",
    "transpose",
    "bitcast",
    "reshape",
    "broadcast",
    "slice",
    "dynamic-slice",
    "dynamic-update-slice",
    "concatenate",
    "pad",
    "parameter",
    "constant",
    "tuple",
    "get-tuple-element",
    "copy-start",
    "copy-done",
    "reverse",
}
RNG = {"rng-bit-generator", "rng", "rng-get-and-update-state"}
CONV_FILES = ("eqxdiff/nn/conv.py", "eqxdiff/xla_cpu.py")  # eqxdiff's conv layer and its conv_grad_matmul rule


def _attr(rest: str, key: str) -> str:
    quoted = key in ("op_name", "source_file")
    found = re.search(rf'(?<!\w){key}="((?:[^"\\]|\\.)*)"' if quoted else rf"(?<!\w){key}=([^\s,}}]+)", rest)
    return found.group(1) if found else ""


def _dims(shape: str) -> list[int]:
    found = re.search(r"\[([\d,]*)\]", shape)
    return [int(d) for d in found.group(1).split(",") if d] if found else []


def _conv_kind(shape: str, rest: str, op_name: str) -> str:
    window = [int(d) for d in re.findall(r"\d+", _attr(rest, "size"))] or [1]
    labels = _attr(rest, "dim_labels")  # e.g. b01f_01io->b01f: the output's spatial dims are its digits
    out = labels.split("->")[-1] if "->" in labels else ""
    dims = _dims(shape)
    spatial = [dims[i] for i, c in enumerate(out) if c.isdigit() and i < len(dims)] or [1]
    # XLA's weight gradient: its window spans the feature map, and XLA's rewrite of it drops the metadata
    if _prod(window) > _prod(spatial) or not op_name:
        return "conv weight-grad"
    return "conv input-grad" if "transpose(" in op_name else "conv fwd"


def _prod(values) -> int:
    out = 1
    for v in values:
        out *= v
    return out


def _frames(hlo_text: str) -> dict[int, str]:
    """stack_frame_id -> the innermost frame's file (the module's FileNames/FileLocations/StackFrames tables)."""
    tables, section = defaultdict(dict), None
    for line in hlo_text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif not line.strip():
            section = None
        elif section and (found := re.match(r"(\d+) (.*)$", line)):
            tables[section][int(found[1])] = found[2]
    files = {i: v.strip('"') for i, v in tables["FileNames"].items()}
    location_file = {i: files.get(int(_attr(v, "file_name_id") or 0), "") for i, v in tables["FileLocations"].items()}
    return {i: location_file.get(int(_attr(v, "file_location_id") or 0), "") for i, v in tables["StackFrames"].items()}


def _parse(hlo_text: str) -> tuple[dict, dict]:
    """({computation: [instruction dict]}, {instruction name: its dict}), in the module's (scheduled) order."""
    frames = _frames(hlo_text)
    computations, by_name, current = defaultdict(list), {}, None
    for line in hlo_text.splitlines():
        if line and not line[0].isspace() and line.rstrip().endswith("{"):
            current = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
            continue
        found = INSTRUCTION.match(line)
        if found and current is not None:
            rest = found["rest"]
            frame = _attr(rest, "stack_frame_id")
            entry = {
                "name": found["name"],
                "op": found["op"],
                "shape": found["shape"],
                "rest": rest,
                "op_name": _attr(rest, "op_name"),
                "source_file": frames.get(int(frame), "") if frame else "",
                "calls": re.findall(r"calls=%?([\w.\-]+)", rest),
                "operands": re.findall(r"%([\w.\-]+)", rest),
                "computation": current,
            }
            computations[current].append(entry)
            by_name[entry["name"]] = entry
    for entry in by_name.values():  # a fusion without metadata of its own: its body's first
        inner = [e for c in entry["calls"] for e in computations.get(c, []) if e["op_name"]]
        if not entry["op_name"] and inner:
            entry["op_name"], entry["source_file"] = inner[0]["op_name"], inner[0]["source_file"]
    return computations, by_name


def _dot_kind(entry: dict, by_name: dict) -> str:
    """A dot from a conv (XLA rewrites 1×1 convs as dots; eqxdiff's conv_grad_matmul computes the weight
    gradient as one dot per kernel offset) takes the conv's kind: in the backward, a weight gradient
    contracts over the positions, an input gradient over the channels. eqxdiff's channel_sum_matmul (a bias
    gradient as a matvec with ones) is its own kind. Any other dot is a matmul."""
    # xla_cpu.sum_to's named scope; XLA drops the dot's own metadata but keeps its ones operand's.
    operands = [by_name[name] for name in entry["operands"] if name in by_name]
    if any("channel_sum_matmul" in e["op_name"] for e in [entry, *operands]):
        return "channel sum (as matmul)"
    from_conv = "conv_general_dilated" in entry["op_name"].split("/")[-1] or entry["source_file"].endswith(CONV_FILES)
    if not from_conv:
        return "matmul"
    if "transpose(" not in entry["op_name"]:
        return "conv fwd"
    lhs = by_name.get(entry["operands"][0]) if entry["operands"] else None
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", entry["rest"])
    if lhs is None or contracting is None:
        return "conv input-grad"
    rank = len(_dims(lhs["shape"]))  # the weight gradient sums over positions, not over lhs's channels (its last dim)
    return "conv input-grad" if str(rank - 1) in contracting[1].split(",") else "conv weight-grad (as matmuls)"


def _kind(entry: dict, computations: dict, by_name: dict) -> str:
    op = entry["op"]
    if op == "convolution":
        return _conv_kind(entry["shape"], entry["rest"], entry["op_name"])
    if op == "dot":
        return _dot_kind(entry, by_name)
    if op == "fusion" or (op == "custom-call" and entry["calls"]):
        inner = [e for c in entry["calls"] for e in computations.get(c, [])]
        for wanted in ("convolution", "dot", "reduce"):
            heaviest = next((e for e in inner if e["op"] == wanted), None)
            if heaviest is not None:
                return _kind(heaviest, computations, by_name) if wanted != "reduce" else "reduce"
        return "copy/transpose" if inner and all(e["op"] in MOVES for e in inner) else "fusion/elementwise"
    if op in ("reduce", "reduce-window", "select-and-scatter", "all-reduce"):
        return "reduce"
    if op in CONTROL:
        return "control"
    if op in MOVES:
        return "copy/transpose"
    if op in RNG:
        return "rng"
    return "other" if op == "custom-call" else "fusion/elementwise"


def _phase(entry: dict, kind: str, step_files: tuple[str, ...]) -> str | None:
    """The instruction's phase from its metadata; None without any (then its users' phase is taken)."""
    if "transpose(" in entry["op_name"] or kind.startswith("conv weight-grad"):
        return "backward"
    if "jvp(" in entry["op_name"]:
        return "forward"
    source = entry["source_file"]
    if not entry["op_name"] and not source:
        return None
    if "optax" in source or source.endswith("equinox/_update.py"):  # the transform, eqx.apply_updates
        return "optimizer"
    if step_files and source.endswith(step_files):
        return "EMA/guard/metrics"
    return "prepare/other"


def instructions(hlo_text: str, step_files: tuple[str, ...] = ()) -> dict[str, dict]:
    """Every instruction of a compiled module's text by name: opcode, kind, phase, op_name (see the module doc)."""
    computations, by_name = _parse(hlo_text)
    table = {}
    for name, e in by_name.items():
        kind = _kind(e, computations, by_name)
        table[name] = {
            "op": e["op"],
            "kind": kind,
            "phase": _phase(e, kind, step_files),
            "op_name": e["op_name"][-120:],
            "source": "/".join(e["source_file"].split("/")[-2:]),
            "computation": e["computation"],
        }
    users = defaultdict(list)
    for name, e in by_name.items():
        for operand in e["operands"]:
            users[operand].append(name)
    # Without metadata (layout copies, transposes XLA inserted): the phase of the op it feeds, else of its input.
    for name in reversed(by_name):  # scheduled order reversed: users before their operands
        if table[name]["phase"] is None:
            table[name]["phase"] = next((table[u]["phase"] for u in users[name] if table[u]["phase"]), None)
    for name in by_name:
        if table[name]["phase"] is None:
            known = [table[o]["phase"] for o in by_name[name]["operands"] if o in table and table[o]["phase"]]
            table[name]["phase"] = known[0] if known else "prepare/other"
    return table


def module_name(hlo_text: str) -> str:
    """The compiled module's name (`HloModule NAME, ...`): the trace's events carry it as `hlo_module`."""
    return hlo_text.split(None, 2)[1].rstrip(",")


def op_events(xplane_path, module: str) -> tuple[list[tuple[str, int]], dict[str, int]]:
    """(hlo_op, duration ns) of the trace's op events of `module`, and the summed ns of every other module's op
    events by module. XLA:CPU tags each thunk's event (on every thread) with `hlo_op` and `hlo_module`; a TPU's
    device plane has an "XLA Modules" line (events named `MODULE(id)`) over an "XLA Ops" line (events named by
    the op), so there an op belongs to the module whose event spans it."""
    from jax.profiler import ProfileData

    matched, others = [], defaultdict(int)
    for plane in ProfileData.from_file(str(xplane_path)).planes:
        lines = {line.name: line for line in plane.lines}
        if "XLA Ops" in lines and "XLA Modules" in lines:
            spans = sorted(
                (e.start_ns, e.start_ns + e.duration_ns, e.name.split("(")[0]) for e in lines["XLA Modules"].events
            )
            for event in lines["XLA Ops"].events:
                owner = next((name for start, end, name in spans if start <= event.start_ns < end), "")
                if owner == module:
                    matched.append((event.name.lstrip("%").split(" ")[0], int(event.duration_ns)))
                else:
                    others[owner or "(none)"] += int(event.duration_ns)
            continue
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" not in stats:
                    continue
                if stats.get("hlo_module") == module:
                    matched.append((stats["hlo_op"], int(event.duration_ns)))
                else:
                    others[str(stats.get("hlo_module"))] += int(event.duration_ns)
    return matched, dict(others)


def trace_layout(xplane_path, events_per_line: int = 3) -> dict:
    """Each plane's lines with their event count, first event names and stat keys: what a trace holds when
    `op_events` finds nothing of the module (a runtime that names its lines otherwise)."""
    from jax.profiler import ProfileData

    layout = {}
    for plane in ProfileData.from_file(str(xplane_path)).planes:
        layout[plane.name] = {
            line.name: {
                "events": len(events := list(line.events)),
                "first": [e.name[:80] for e in events[:events_per_line]],
                "stats": sorted({k for e in events[:events_per_line] for k, _ in e.stats}),
            }
            for line in plane.lines
        }
    return layout


def summarise(events: list[tuple[str, int]], table: dict[str, dict], steps: int, top: int = 15) -> dict:
    """ms per step and share of the summed op time: per kind, per phase, per (phase, kind), and the `top` ops.
    Containers (`control`) are left out of the sums: their bodies' ops are counted themselves."""
    per_op, unknown_ns = defaultdict(int), 0
    for name, ns in events:
        if name not in table:
            unknown_ns += ns
        elif table[name]["kind"] != "control":
            per_op[name] += ns
    total = sum(per_op.values()) or 1

    def grouped(key) -> dict:
        sums = defaultdict(int)
        for name, ns in per_op.items():
            sums[key(table[name])] += ns
        return {
            k: {"ms_per_step": round(ns / 1e6 / steps, 2), "share": round(ns / total, 3)}
            for k, ns in sorted(sums.items(), key=lambda kv: -kv[1])
        }

    ops = sorted(per_op.items(), key=lambda kv: -kv[1])[:top]
    return {
        "op_ms_per_step": round(total / 1e6 / steps, 2),
        "ops_not_in_the_module_text_ms_per_step": round(unknown_ns / 1e6 / steps, 2),
        "by_kind": grouped(lambda e: e["kind"]),
        "by_phase": grouped(lambda e: e["phase"]),
        "by_phase_and_kind": grouped(lambda e: f"{e['phase']} | {e['kind']}"),
        "by_source": grouped(lambda e: e["source"] or "(none)"),
        "by_source_and_kind": dict(list(grouped(lambda e: f"{e['source'] or '(none)'} | {e['kind']}").items())[:20]),
        "top_ops": [
            {
                "name": n,
                "kind": table[n]["kind"],
                "phase": table[n]["phase"],
                "ms_per_step": round(ns / 1e6 / steps, 2),
                "share": round(ns / total, 3),
                "op_name": table[n]["op_name"],
            }
            for n, ns in ops
        ],
    }
