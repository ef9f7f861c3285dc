"""Choosing the coordinator: explicitly, or from the launcher's environment.

The process-wide coordinator is a slot of the process's :mod:`~shardckpt.runtime` (made on
first use; :func:`~shardckpt.runtime.reset` and a fork start without it).
"""

from __future__ import annotations

import os
from typing import List, Optional

from ..errors import InvalidArgumentError
from ..runtime import Slot, runtime
from .coordinator import Coordinator, check_timeout
from .engine import EngineCoordinator
from .single import SingleProcessCoordinator

__all__ = ["get_coordinator", "set_coordinator", "current_coordinator", "detect_backend"]

#: The process-wide coordinator (set by :func:`set_coordinator`, else made by :func:`get_coordinator`).
_PROCESS: "Slot[Coordinator]" = Slot("the process-wide coordinator")


def detect_backend() -> str:
    """``"torch"`` under torchrun (or an initialized torch.distributed), ``"mpi"`` under mpiexec, else ``"single"``."""
    env = os.environ
    if env.get("SHARDCKPT_BACKEND"):
        return env["SHARDCKPT_BACKEND"]
    if "TORCHELASTIC_RUN_ID" in env or ("MASTER_ADDR" in env and "WORLD_SIZE" in env and "RANK" in env):
        return "torch"
    if any(k in env for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MV2_COMM_WORLD_SIZE")):
        return "mpi"
    return "single"


def get_coordinator(backend: Optional[str] = None, timeout: Optional[float] = None) -> Coordinator:
    """The process-wide coordinator, created on first use (``backend``: torch, mpi, jax, single, or detected).

    ``timeout`` (seconds): the coordinator's default timeout for every collective step, used
    where a save's ``CheckpointOptions(timeout=)`` is not set; given for a coordinator that
    exists already, it replaces that one's default. ``None``: a new coordinator takes
    ``$SHARDCKPT_TIMEOUT``, else 600 s (:func:`~shardckpt.distributed.coordinator.default_timeout`).
    A single process never waits, so its coordinator has no timeout.
    """
    seconds = None if timeout is None else check_timeout(timeout)
    if backend is not None:
        coordinator = _make(backend, seconds)
        _PROCESS.put(coordinator)
        return coordinator
    made: List[Coordinator] = []

    def make() -> Coordinator:
        made.append(_make(detect_backend(), seconds))
        return made[0]

    coordinator = runtime().keep(_PROCESS, make)
    if seconds is not None and not made:
        _set_timeout(coordinator, seconds)
    return coordinator


def _make(name: str, seconds: Optional[float]) -> Coordinator:
    if name == "single":
        return SingleProcessCoordinator()
    if name == "torch":
        from .torch_backend import TorchCoordinator

        return TorchCoordinator(timeout=seconds)
    if name == "mpi":
        from .mpi_backend import MPICoordinator

        return MPICoordinator(timeout=seconds)
    if name == "jax":
        from .jax_backend import JaxCoordinator

        return JaxCoordinator(timeout=seconds)
    raise InvalidArgumentError(f"unknown coordination backend {name!r} (torch, mpi, jax, single)")


def _set_timeout(coordinator: Coordinator, seconds: float) -> None:
    if isinstance(coordinator, EngineCoordinator):
        coordinator.timeout = seconds
    elif not isinstance(coordinator, SingleProcessCoordinator):
        raise InvalidArgumentError(f"get_coordinator(timeout=...): the current coordinator "
                                   f"({type(coordinator).__name__}) takes its timeout when it is made")


def set_coordinator(coordinator: Optional[Coordinator]) -> None:
    """Use ``coordinator`` for every following checkpoint operation (``None``: detect again)."""
    _PROCESS.put(coordinator)


def current_coordinator() -> Optional[Coordinator]:
    """The process-wide coordinator if one was set or made, else ``None`` (nothing is made)."""
    return _PROCESS.peek()
