"""Shared by the fuzz harnesses: the allowed-exception rule, scratch files, running under atheris.

Every harness feeds one input to the code under test and accepts exactly two outcomes:
it reads, or it raises an exception from :mod:`shardckpt.errors`. Anything else (another
exception, a crash, a hang past libFuzzer's ``-timeout``, memory past ``-rss_limit_mb``)
is a finding. Harnesses are scripts: ``python tests/fuzz/fuzz_sstable.py [libFuzzer flags]
[corpus dirs]`` (see ``scripts/fuzz.sh``); each also exposes ``test_one_input(data)``.
"""

from __future__ import annotations

import atexit
import os
import shutil
import struct
import sys
import tempfile
from typing import Any, Callable, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
CORPUS = os.path.join(HERE, "corpus")
REPO = os.path.dirname(os.path.dirname(HERE))
if os.path.join(REPO, "src") not in sys.path:
    sys.path.insert(0, os.path.join(REPO, "src"))

_SCRATCH = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def scratch() -> str:
    """A private scratch directory for this process (on tmpfs when there is one), named by its pid.

    libFuzzer ends the process without Python's exit handlers, so the directories of earlier
    harness processes that are gone are removed here (tmpfs is memory)."""
    global _SCRATCH
    if _SCRATCH is None:
        base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        for name in os.listdir(base):
            parts = name.split("-")
            if name.startswith("shardckpt-fuzz-") and len(parts) == 4 and parts[2].isdigit() \
                    and not _alive(int(parts[2])):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        _SCRATCH = tempfile.mkdtemp(prefix=f"shardckpt-fuzz-{os.getpid()}-", dir=base)
        atexit.register(shutil.rmtree, _SCRATCH, True)
    return _SCRATCH


def write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def pack_files(*parts: bytes) -> bytes:
    """Several files in one fuzz input: each but the last as a 4-byte little-endian length, then its
    bytes; the last is the rest of the input."""
    return b"".join(struct.pack("<I", len(p)) + p for p in parts[:-1]) + (parts[-1] if parts else b"")


def unpack_files(data: bytes, count: int) -> Tuple[bytes, ...]:
    """Inverse of :func:`pack_files`; missing parts are empty, the last takes the rest."""
    out = []
    pos = 0
    for i in range(count):
        if i == count - 1:
            out.append(data[pos:])
            break
        if pos + 4 > len(data):
            out.append(b"")
            continue
        (n,) = struct.unpack_from("<I", data, pos)
        pos += 4
        out.append(data[pos:pos + n])
        pos += n
    while len(out) < count:
        out.append(b"")
    return tuple(out)


def allowed(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)``: its result, or ``None`` after a :class:`~shardckpt.errors.ShardckptError`.

    Any other exception propagates (to libFuzzer, which reports it as a finding).
    """
    from shardckpt.errors import ShardckptError

    try:
        return fn(*args, **kwargs)
    except ShardckptError:
        return None


def main(test_one_input: Callable[[bytes], None]) -> None:
    """Run ``test_one_input`` under atheris with the command line's libFuzzer flags and corpus dirs."""
    import logging

    import atheris

    logging.disable(logging.CRITICAL)  # warnings about hostile inputs are expected; findings are exceptions
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
