"""Helper of tests/test_async.py: async saves in a process of their own, to be killed or to exit.

    python async_kill.py DIR MODE

Every mode first saves generation 1 of :func:`make_model` synchronously with
``Checkpoint.save(DIR/ckpt)`` (``DIR/ckpt-1``), prints ``SAVED 1``, changes the values
in place to generation 2, and then saves asynchronously (``DIR/ckpt-2``):

* ``kill-write`` / ``kill-fsync`` / ``kill-commit`` / ``kill-state``: the background
  save stops (prints ``AT <stage>`` and sleeps) at its first data write, its first
  fsync, right before the index of ``ckpt-2`` is written (the commit) or right before
  the state file is rewritten (after the commit). The test SIGKILLs the process there.
* ``exit``: every write of the background save is slowed down (``SLOW_WRITE`` s per
  call); the main thread prints ``RETURNED <seconds>`` as soon as ``save`` returns and
  then *exits at once* (falls off the end of the script): the interpreter must wait for
  the save.
* ``exit-error`` / ``exit-error-dropped``: every write fails with ``ENOSPC``; nobody calls
  ``sync()``; the process exits. ``-dropped`` makes the save inside a function, so that
  the ``Checkpoint`` (and its saver) is garbage by the time the process exits.
* ``sync-error``: as ``exit-error`` but the main thread calls ``sync()`` and reports the
  error itself (the control case: the error is collected, nothing is left for exit).

Values: element ``j`` of variable ``i`` in generation ``g`` is ``g * 1000 + i + j / 4096``
(float32, exact), plus an int64 and a string variable.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
import time
from typing import Any, Dict

import numpy as np

SLOW_WRITE = 0.05
NUM_VARS = 6
ELEMENTS = 64 * 1024  # 256 KiB per float32 variable


def values(generation: int) -> Dict[str, np.ndarray]:
    out = {f"w{i}": (np.float32(generation * 1000 + i) + np.arange(ELEMENTS, dtype=np.float32) % 4096 / 4096)
           .astype(np.float32) for i in range(NUM_VARS)}
    out["step"] = np.array(generation * 10, np.int64)
    out["names"] = np.array([f"gen{generation}-{k}".encode() for k in range(5)], dtype=object)
    return out


def make_model(generation: int) -> Any:
    import shardckpt

    model = shardckpt.Module()
    for name, value in values(generation).items():
        setattr(model, name, shardckpt.Variable(value, name=name))
    return model


def set_generation(model: Any, generation: int) -> None:
    for name, value in values(generation).items():
        getattr(model, name).assign(value)


def say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _stop_here(stage: str) -> None:
    say(f"AT {stage}")
    time.sleep(120)  # the test kills us meanwhile
    os._exit(3)  # pragma: no cover - not killed: fail loudly


def _in_background() -> bool:
    return threading.current_thread() is not threading.main_thread()


_MOUNTS: list = []


def patch(mode: str, directory: str) -> None:
    """Serve local paths, for the rest of this process, through a wrapper that acts on background operations."""
    from shardckpt.storage.local import local_fs
    from shardckpt.storage.registry import mounted
    from shardckpt.storage.wrappers import FileSystemWrapper

    index = os.path.join(directory, "ckpt-2.index")
    state = os.path.join(directory, "checkpoint")
    if mode not in ("kill-write", "kill-fsync", "kill-commit", "kill-state", "exit") \
            and not mode.startswith(("exit-error", "sync-error")):
        raise SystemExit(f"unknown mode {mode!r}")

    class Hooked(FileSystemWrapper):
        def before(self, op: str, path: str) -> None:
            if not _in_background():
                return
            if mode == "kill-write" and op == "write_all" and ".data-" in path:
                _stop_here("write")
            elif mode == "kill-fsync" and op == "fsync":
                _stop_here("fsync")
            elif mode in ("kill-commit", "kill-state") and op == "write_atomic" \
                    and path == (index if mode == "kill-commit" else state):
                _stop_here(mode[5:])
            elif mode == "exit" and op == "write_all":
                time.sleep(SLOW_WRITE)
            elif mode.startswith(("exit-error", "sync-error")) and op == "write_all":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

    _MOUNTS.append(mounted(Hooked(local_fs)))  # kept referenced: for the life of the process
    _MOUNTS[-1].__enter__()


def main(directory: str, mode: str) -> None:
    import shardckpt

    model = make_model(1)
    ckpt = shardckpt.Checkpoint(model=model)
    ckpt.save(os.path.join(directory, "ckpt"))
    say("SAVED 1")
    set_generation(model, 2)
    patch(mode, directory)
    options = shardckpt.CheckpointOptions(enable_async=True)
    if mode == "exit-error-dropped":
        def save_and_forget() -> None:
            local = shardckpt.Checkpoint(model=make_model(2))
            local.save(os.path.join(directory, "dropped"), options=options)  # dropped-1
        save_and_forget()
        say("RETURNED")
        return
    started = time.perf_counter()
    path = ckpt.save(os.path.join(directory, "ckpt"), options=options)
    say(f"RETURNED {time.perf_counter() - started:.3f} {path}")
    set_generation(model, 3)  # must not leak into ckpt-2
    if mode == "sync-error":
        from shardckpt.saving.async_save import AsyncSaveError

        try:
            ckpt.sync()
        except AsyncSaveError as exc:
            say(f"COLLECTED {type(exc.__cause__).__name__}")
        return
    if mode.startswith("kill"):
        ckpt.sync()  # the patched stage sleeps; the test kills us before this returns
        say("NOT KILLED")
        os._exit(4)
    # "exit" and "exit-error": fall off the end; the interpreter waits for the save


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
