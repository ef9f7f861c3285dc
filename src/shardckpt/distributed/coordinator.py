"""``Coordinator``: what a multi-client checkpoint needs from the processes' engine.

A coordinator knows this client's rank and the world size, and offers a barrier
with a timeout that names the ranks that did not arrive, all-gather, gather
(to one root) and broadcast of small JSON-serializable objects, and
point-to-point transfer of bytes. Backends wrap existing engines (``torch.distributed``, MPI) on a
communicator of their own, never the one the user's training uses, so a
checkpoint's collectives cannot interleave with a training step's.

The engine-backed coordinators derive from ``engine.EngineCoordinator``, whose
barrier is the one arrival protocol of ``barrier.py`` over three transport
primitives per backend (``_post``, ``_take``, ``_retire``).

Objects travel as JSON (never pickle): dicts, lists, strings, numbers, booleans
and ``None``.
"""

from __future__ import annotations

import abc
import json
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import InvalidArgumentError, ShardckptError

__all__ = ["Coordinator", "CoordinationError", "CoordinationTimeout", "DEFAULT_TIMEOUT", "TIMEOUT_ENV",
           "default_timeout", "check_timeout",
           "encode", "decode", "raise_failures"]

DEFAULT_TIMEOUT = 600.0  # seconds
TIMEOUT_ENV = "SHARDCKPT_TIMEOUT"


def default_timeout() -> float:
    """The default timeout of a new coordinator, in seconds: ``$SHARDCKPT_TIMEOUT``, else 600.

    Which timeout a collective step of a save waits, first that is set: the save's
    ``CheckpointOptions(timeout=)``, the coordinator's (``get_coordinator(timeout=)``, or a
    backend's ``timeout=`` argument), ``$SHARDCKPT_TIMEOUT``, 600 s.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        raise InvalidArgumentError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds") from None
    if not 0 < value < float("inf"):
        raise InvalidArgumentError(f"{TIMEOUT_ENV}={raw!r}: expected a positive, finite number of seconds")
    return value


def check_timeout(timeout: Optional[float], what: str = "coordinator timeout") -> float:
    """``timeout`` as seconds (``None``: :func:`default_timeout`); positive and finite, else InvalidArgumentError."""
    if timeout is None:
        return default_timeout()
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {timeout!r}") from None
    if not 0 < value < float("inf"):
        raise InvalidArgumentError(f"{what} must be positive and finite, got {timeout!r}")
    return value


class CoordinationError(ShardckptError, RuntimeError):
    """A collective failed: a client reported an error, or the engine did.

    ``missing``: the ranks found gone (dead or hung), when the backend could tell.
    ``elsewhere``: for clients found at different barriers, each such rank and the barrier it was
    at (the barrier's judge, rank 0, being at the expected one).
    """

    def __init__(self, message: str, missing: Optional[List[int]] = None,
                 elsewhere: Optional[Dict[int, str]] = None) -> None:
        self.missing = list(missing or [])
        self.elsewhere = dict(elsewhere or {})
        super().__init__(message)


class CoordinationTimeout(CoordinationError, TimeoutError):
    """A barrier or collective did not complete in time; ``missing`` lists the ranks that did not arrive."""


def raise_failures(results: List[Dict[str, Any]]) -> None:
    """What :meth:`Coordinator.agree` raises: ``results`` are every client's ``{"ok", "error"}`` (all-gathered,
    possibly beside other fields); if any client failed, a :class:`CoordinationError` naming each."""
    failed = [(r, res["error"]) for r, res in enumerate(results) if not res["ok"]]
    if failed:
        detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise CoordinationError(f"{len(failed)} of {len(results)} clients failed: {detail}")


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=True).encode("utf-8")


def decode(data: bytes) -> Any:
    return json.loads(data.decode("utf-8"))


class Coordinator(abc.ABC):
    """The collective operations of one group of clients."""

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This client's index, ``0 <= rank < size``."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """Number of clients."""

    @property
    def backend(self) -> str:
        """The engine underneath (``"torch"``, ``"mpi"``, ``"local"``, ``"single"``, ...)."""
        return type(self).__name__

    @abc.abstractmethod
    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        """Wait until every client arrives; raise :class:`CoordinationTimeout` naming the missing ranks."""

    @abc.abstractmethod
    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        """Every client's ``obj``, in rank order."""

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        """Every client's ``obj``, in rank order, on ``root``; ``None`` on the other clients.

        What the io client alone needs (every client's piece descriptions, say) travels
        to it only: the other clients neither receive nor decode the others' objects. A
        client other than ``root`` may return as soon as its object is on its way.
        The default is :meth:`all_gather` (every client receives everything); the
        backends override it with a real gather.
        """
        gathered = self.all_gather(obj, timeout=timeout)
        if not 0 <= root < self.size:
            raise InvalidArgumentError(f"gather root {root!r} out of range for {self.size} clients")
        return gathered if self.rank == root else None

    @abc.abstractmethod
    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        """``root``'s ``obj`` on every client."""

    @abc.abstractmethod
    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        """Send a buffer to ``dst`` (blocks until it can be reused)."""

    @abc.abstractmethod
    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        """Receive ``nbytes`` from ``src`` into ``out`` (allocated when ``None``)."""

    def send_many(self, buffers: Sequence[memoryview], dst: int, tag: int = 0) -> None:
        """Send ``buffers`` to ``dst``, one message each, in order (the receiver calls :meth:`recv_many` or
        :meth:`recv_bytes` for each, with the same sizes). Engines whose messages each cost a
        round of their own override it to keep several in flight; default: :meth:`send_bytes` each."""
        for buffer in buffers:
            self.send_bytes(buffer, dst, tag=tag)

    def recv_many(self, src: int, outs: Sequence[memoryview], tag: int = 0, timeout: Optional[float] = None,
                  landed: Optional[Callable[[int], None]] = None) -> None:
        """Receive one message from ``src`` into each of ``outs`` (its size: the buffer's), in order;
        ``landed(i)`` runs as soon as message ``i`` is in (while later ones may still be arriving).
        Default: :meth:`recv_bytes` each."""
        for i, out in enumerate(outs):
            self.recv_bytes(src, memoryview(out).nbytes, out=out, tag=tag, timeout=timeout)
            if landed is not None:
                landed(i)

    def agree(self, ok: bool, error: str = "", timeout: Optional[float] = None) -> None:
        """All-gather success flags; if any client failed, raise on every client naming it."""
        raise_failures(self.all_gather({"ok": bool(ok), "error": error}, timeout=timeout))

    def _probe_missing(self, timeout: float, failed: int) -> List[int]:
        """After collective number ``failed`` failed on this client: the other ranks that were not in it."""
        return self._probe(timeout, failed)[0]

    def _probe(self, timeout: float, failed: int) -> Tuple[List[int], bool]:
        """After collective number ``failed`` failed on this client: ``(other ranks that were not in it,
        whether this rank itself came too late)``.

        Every client whose collective failed calls it, so a dead or hung client is named. The
        barrier is named after the failed collective's number: a client that was late, and
        whose own failure came in a later collective (its late arrival completed the first part
        of a two-part collective, say), arrives at a barrier of another name and is named as
        well, whenever it arrives. The others may notice the failure up to ``timeout`` (the failed
        call's) later than this client, so the probe waits that long plus a grace period. When
        clients disagree on the collective, the largest group is the one that was "here".
        A client that reaches the probe after the others' verdict is among its ``missing``: it
        arrived after the others had given up on it (the second value). Best effort:
        ``([], False)`` when it cannot tell.
        """
        wait = timeout + max(1.0, 0.1 * timeout)
        try:
            self.barrier(f"shardckpt: who was in collective #{failed}", timeout=wait)
        except CoordinationTimeout as e:
            return [r for r in e.missing if r != self.rank], self.rank in e.missing
        except CoordinationError as e:
            if not e.elsewhere:
                return [], False
            here = self.size - len(e.elsewhere)  # rank 0 and those at its barrier
            groups: Dict[str, List[int]] = {}
            for r, n in e.elsewhere.items():
                groups.setdefault(n, []).append(int(r))
            biggest = max(groups.values(), key=len)
            if len(biggest) > here:  # rank 0 was the odd one out
                return sorted(r for r in range(self.size) if r not in biggest and r != self.rank), False
            return sorted(r for r in e.elsewhere if r != self.rank), False
        except Exception:  # noqa: BLE001 - only a diagnosis
            return [], False
        return [], False

    def clone(self) -> "Coordinator":
        """A coordinator of the same clients on a communicator of its own.

        Background (asynchronous) saves coordinate on a clone, so their collectives
        never interleave with ones the caller's thread runs meanwhile. Collective:
        every client must call it, in the same order.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot make an independent communicator")

    def close(self) -> None:  # noqa: B027 - optional for backends
        """Release the backend's resources (the coordinator's own communicator)."""
