"""Run a multi-process (multi-host) training job on this machine: N processes on 127.0.0.1.

    python train/launch_local.py --num_processes 2 -- --cpu_devices 4 --steps 200

Everything after `--` goes to every `train/main.py` process (or `--script`'s: sample.py,
fid_stats.py, encode.py take the same), plus `--coordinator`, `--num_processes` and `--process_id`.
Output is streamed with a `[pI]` prefix; if one process
fails, the others are stopped and the launcher exits with its code. This is how a user tries the
multi-host path without a cluster, and how the tests exercise it: on one CPU machine several
processes are slower than one (they split the same cores and add collectives between them); they
show that the multi-host code path works, not a speed-up. The collective backend's per-rank
connection messages are left out of the output.
"""

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from flags import Parser  # train/flags.py: one-line mistakes, no abbreviations

MAIN = Path(__file__).with_name("main.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Gloo (XLA:CPU's collectives) prints every rank's connection to stdout from C++ threads, once per
# collective group, in pieces: two threads' pieces can interleave and split a report over lines.
CHATTER = re.compile(
    r"\[Gloo\] Rank \d+ is connected to \d+ peer ranks\. "
    r"Expected number of connected peer ranks is : ?\d*"
)
CHATTER_PIECES = ("[Gloo]", "is connected to", "peer ranks")


def _stream(pipe, prefix: str, out) -> None:
    """Each line of a process's `pipe` to `out` with `prefix`, less the collective backend's chatter
    (on stdout, which the scripts use for whole lines only: a line holding a piece of it, or a bare
    count after one, is chatter)."""
    after_chatter = False
    for line in pipe:
        line, reports = CHATTER.subn("", line)
        chatter = any(piece in line for piece in CHATTER_PIECES) or (after_chatter and line.strip().isdigit())
        if line.strip() and not chatter:
            out.write(f"{prefix} {line}")
            out.flush()
        after_chatter = chatter or reports > 0


def launch(num_processes: int, main_args: list[str], script: Path = MAIN, port: int | None = None) -> int:
    """Start the processes, wait for all; the first non-zero exit code stops the rest and is returned."""
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-u", str(script), *main_args,
               "--coordinator", coordinator, "--num_processes", str(num_processes), "--process_id", str(i)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1))
    # stdout and stderr apart: the progress bar's redraws (stderr) never land inside the chatter (stdout)
    threads = [threading.Thread(target=_stream, args=(pipe, f"[p{i}]", out), daemon=True)
               for i, p in enumerate(procs) for pipe, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr))]  # fmt: skip
    for t in threads:
        t.start()

    def forward(signum, frame):  # SIGTERM/SIGINT to the launcher: every process saves and exits
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                for p in procs:
                    if p.poll() is None:
                        p.kill()  # a peer is gone: the others would wait for it in a collective forever
                code = failed[0] if failed[0] > 0 else 128 - failed[0]  # killed by signal N: 128+N, as a shell says
                break
            if all(c == 0 for c in codes):
                code = 0
                break
            time.sleep(0.1)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        for p in procs:
            p.wait()
        for t in threads:
            t.join(timeout=5)
    return code


def main() -> None:
    parser = Parser(description=__doc__)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
    parser.add_argument("--script", default="main.py",
                        help="what every process runs: a train/ script (sample.py, fid_stats.py, encode.py) or a path")  # fmt: skip
    parser.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then the script's flags")
    args = parser.parse_args()
    main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
    if args.num_processes < 1:
        parser.error("--num_processes must be >= 1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    script = MAIN.parent / args.script if (MAIN.parent / args.script).is_file() else Path(args.script)
    if not script.is_file():
        parser.error(f"--script {args.script}: neither a script in {MAIN.parent} nor a file")
    sys.exit(launch(args.num_processes, main_args, script=script, port=args.port or None))


if __name__ == "__main__":
    main()
