"""Choosing the coordinator: explicitly, or from the launcher's environment."""

from __future__ import annotations

import os
from typing import Optional

from ..errors import InvalidArgumentError
from .coordinator import Coordinator, check_timeout
from .engine import EngineCoordinator
from .single import SingleProcessCoordinator

__all__ = ["get_coordinator", "set_coordinator", "detect_backend"]

_CURRENT: Optional[Coordinator] = None


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
    global _CURRENT
    seconds = None if timeout is None else check_timeout(timeout)
    if _CURRENT is not None and backend is None:
        if seconds is not None:
            _set_timeout(_CURRENT, seconds)
        return _CURRENT
    name = backend or detect_backend()
    if name == "single":
        coordinator: Coordinator = SingleProcessCoordinator()
    elif name == "torch":
        from .torch_backend import TorchCoordinator

        coordinator = TorchCoordinator(timeout=seconds)
    elif name == "mpi":
        from .mpi_backend import MPICoordinator

        coordinator = MPICoordinator(timeout=seconds)
    elif name == "jax":
        from .jax_backend import JaxCoordinator

        coordinator = JaxCoordinator(timeout=seconds)
    else:
        raise InvalidArgumentError(f"unknown coordination backend {name!r} (torch, mpi, jax, single)")
    _CURRENT = coordinator
    return coordinator


def _set_timeout(coordinator: Coordinator, seconds: float) -> None:
    if isinstance(coordinator, EngineCoordinator):
        coordinator.timeout = seconds
    elif not isinstance(coordinator, SingleProcessCoordinator):
        raise InvalidArgumentError(f"get_coordinator(timeout=...): the current coordinator "
                                   f"({type(coordinator).__name__}) takes its timeout when it is made")


def set_coordinator(coordinator: Optional[Coordinator]) -> None:
    """Use ``coordinator`` for every following checkpoint operation (``None``: detect again)."""
    global _CURRENT
    _CURRENT = coordinator
