"""Tests that fork, run where forking is safe.

The pytest process may have loaded multithreaded libraries by the time a fork test runs
(JAX warns "os.fork() was called ... will likely lead to a deadlock" and may really
deadlock). :func:`fork_and_check` therefore runs the whole scenario in a fresh *spawned*
interpreter, in which only what the scenario imports is loaded: there the scenario sets
up shardckpt's own threads, forks, runs ``child`` in the child and reports its exit code.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from typing import Any, Callable, Tuple


def _scenario(parent: Callable[..., Any], child: Callable[..., int], args: Tuple[Any, ...], timeout: float) -> None:
    parent(*args)  # the parent's pools and helper threads start here
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = child(*args)
        finally:
            os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            raise SystemExit(os.waitstatus_to_exitcode(status))
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    raise SystemExit(124)  # the child hung


def fork_and_check(parent: Callable[..., Any], child: Callable[..., int], *args: Any, timeout: float = 60) -> int:
    """Run ``parent(*args)``, fork, ``child(*args)`` in the child, all in a spawned interpreter.

    ``parent`` and ``child`` must be module-level functions (the spawned interpreter imports
    them by name). Returns the child's exit code: 0 for success, 124 if it hung past
    ``timeout`` seconds (it is killed then).
    """
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_scenario, args=(parent, child, args, timeout))
    proc.start()
    proc.join(timeout + 60)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise AssertionError("the forking scenario did not end")
    return proc.exitcode
