"""A real S3-protocol server for tests and the soak: moto's standalone server on a free loopback port.

Used by the ``s3_server`` fixture (tests/conftest.py) and the kill soak (tests/helpers/soak.py).
Clients are pointed at it the way users point theirs: the standard AWS variables (:func:`client_env`),
which client subprocesses inherit.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from typing import IO, Dict, Tuple


def client_env(endpoint: str) -> Dict[str, str]:
    """The AWS variables that point S3 clients (boto, s3fs, shardckpt) at ``endpoint``."""
    return {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing",
            "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint}


def start_moto(log: IO[bytes], limit: float = 60.0) -> Tuple[subprocess.Popen, str]:
    """Start ``python -m moto.server`` (its output to ``log``); return it and its endpoint once it answers.

    Raises ``RuntimeError`` (after stopping it) when it does not answer within ``limit`` seconds.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + limit
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).read()
            return proc, endpoint
        except Exception:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise RuntimeError(f"moto server did not start (exit code {proc.poll()}); see {log.name}") from None
            time.sleep(0.2)
