"""Run a multi-process (multi-host) training job on this machine: N processes on 127.0.0.1.

    python train/launch_local.py --num_processes 2 -- --cpu_devices 4 --steps 200

Everything after `--` goes to every `train/main.py` process, plus `--coordinator`,
`--num_processes` and `--process_id`. Output is streamed with a `[pI]` prefix; if one process
fails, the others are stopped and the launcher exits with its code. This is how a user tries the
multi-host path without a cluster, and how the tests exercise it.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

MAIN = Path(__file__).with_name("main.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stream(proc: subprocess.Popen, prefix: str) -> None:
    for line in proc.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def launch(num_processes: int, main_args: list[str], script: Path = MAIN, port: int | None = None) -> int:
    """Start the processes, wait for all; the first non-zero exit code stops the rest and is returned."""
    coordinator = f"127.0.0.1:{port or free_port()}"
    procs = []
    for i in range(num_processes):
        cmd = [sys.executable, "-u", str(script), *main_args,
               "--coordinator", coordinator, "--num_processes", str(num_processes), "--process_id", str(i)]  # fmt: skip
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1))
    threads = [threading.Thread(target=_stream, args=(p, f"[p{i}]"), daemon=True) for i, p in enumerate(procs)]
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num_processes", type=int, default=2)
    parser.add_argument("--port", type=int, default=0, help="coordinator port on 127.0.0.1 (0: a free one)")
    parser.add_argument("main_args", nargs=argparse.REMAINDER, help="-- then train/main.py flags")
    args = parser.parse_args()
    main_args = args.main_args[1:] if args.main_args[:1] == ["--"] else args.main_args
    if args.num_processes < 1:
        parser.error("--num_processes must be >= 1")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(launch(args.num_processes, main_args, port=args.port or None))


if __name__ == "__main__":
    main()
