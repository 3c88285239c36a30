"""The side-by-side benchmarks' link to PyTorch: a peer process in the torch venv, one JSON command
per line on its stdin and one JSON answer per line on its stdout (torch is never a dependency of
eqxdiff, so it never shares a process with it).

Driver side (bench_vae.py, bench_clip_text.py, bench_inception.py): `TorchPeer(python, script)`,
then `peer("cmd", **kwargs) -> dict` and `peer.close()`. Peer side (*_torch_peer.py): `serve(peer)`,
where each command name is a method of `peer` returning a dict; `TimedCalls` gives a peer its warm-up
call and its `time` command. Only the standard library here: the torch venv imports this file too.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

TORCH_PYTHON = str(Path(__file__).resolve().parent.parent / "tools" / ".venv" / "bin" / "python")  # tools/README.md


class TorchPeer:
    """`script` run by `python` (the torch venv's), driven one command at a time."""

    def __init__(self, python: str, script: Path):
        self.process = subprocess.Popen(
            [python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    def __call__(self, cmd: str, **kwargs) -> dict:
        self.process.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch peer exited (code {self.process.wait()}); its stderr is above")
        answer = json.loads(line)
        if not answer.pop("ok"):
            raise RuntimeError(f"torch peer, {cmd}: {answer['error']}")
        return answer

    def close(self) -> None:
        self.process.stdin.write(json.dumps({"cmd": "exit"}) + "\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)


def serve(peer) -> None:
    """Answer the driver's commands with `peer`'s methods until "exit" (or stdin closes). Errors go
    back as answers (the driver stops); library prints go to stderr, off the protocol stream."""
    answers = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        command = json.loads(line)
        name = command.pop("cmd")
        if name == "exit":
            break
        try:
            answer = {"ok": True, **getattr(peer, name)(**command)}
        except Exception as error:  # reported to the driver, which stops
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        answers.write(json.dumps(answer) + "\n")
        answers.flush()


class TimedCalls:
    """Peer side: `first_call()` and `time(calls)` run the prepared `self.call` under `self.no_grad()`
    (set by the peer: `torch.inference_mode` or, as pytorch-fid calls its network, `torch.no_grad`)."""

    call = None

    def first_call(self):
        """(the warm-up call's output, its seconds)."""
        with self.no_grad():
            start = time.perf_counter()
            out = self.call()
            return out, time.perf_counter() - start

    def time(self, calls: int) -> dict:
        with self.no_grad():
            start = time.perf_counter()
            for _ in range(calls):
                self.call()
            return {"seconds": time.perf_counter() - start}
