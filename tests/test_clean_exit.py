"""Scripts that save and simply end exit with the right code (issue 10), under torchrun and mpiexec.

tests/helpers/exit_script.py is what a user writes: build a mesh, save a
``DTensorCheckpoint``, end — by falling off the end, by ``sys.exit(0)``, by an exception in
user code, or with an asynchronous save still in flight; no close method is called.
Every case runs several times (the old failure, a SIGABRT from C++ threads torn down
during interpreter finalisation, was timing-dependent): the launcher's exit code is 0
(1 for the user's exception, whose traceback is printed), nothing prints "terminate
called", and the checkpoint is committed and readable every time.
"""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

import shardckpt

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "helpers" / "exit_script.py"
if str(HERE / "helpers") not in sys.path:
    sys.path.insert(0, str(HERE / "helpers"))

from launchers import clean_env, launch_command, run_launched  # noqa: E402  (tests/helpers)

MODES = ["fall-off", "sys-exit", "user-error", "async-pending"]
RUNS = 3


def _launch(backend: str, mode: str, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True)
    cmd = launch_command(backend, 4, SCRIPT)
    return run_launched(cmd + [mode, str(folder)], env=clean_env(), cwd=str(HERE.parent), timeout=240)


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_scripts_that_simply_end_exit_cleanly(tmp_path: Path, backend: str) -> None:
    cases = [(mode, run) for mode in MODES for run in range(RUNS)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        done = list(pool.map(lambda c: (c, _launch(backend, c[0], tmp_path / f"{c[0]}-{c[1]}")), cases))
    for (mode, run), proc in done:
        out = proc.stdout + proc.stderr
        assert "terminate called" not in out, f"{backend} {mode} run {run}: C++ abort at exit\n{out[-3000:]}"
        if mode == "user-error":
            assert proc.returncode != 0, f"{backend} {mode} run {run}: a failing script exited 0"
            assert "user code failed after the save" in out, out[-3000:]
            assert "SIGABRT" not in out and "Signal 6" not in out, out[-3000:]
        else:
            assert proc.returncode == 0, f"{backend} {mode} run {run}: exit {proc.returncode}\n{out[-3000:]}"
        prefix = tmp_path / f"{mode}-{run}" / "ck-1"
        with shardckpt.load_checkpoint(str(prefix)) as reader:
            value = reader.get_tensor("v/.ATTRIBUTES/VARIABLE_VALUE")
        np.testing.assert_array_equal(value, np.arange(4096, dtype=np.float32).reshape(64, 64))
