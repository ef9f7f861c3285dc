"""``EngineCoordinator``: the base of the coordinators over an engine (torch.distributed, MPI, JAX's runtime).

What they share: rank, size and the default timeout; argument checks; the
"unusable after a failed collective" state (an engine cannot cancel a collective
in flight, so after one fails every later call raises until a new coordinator is
made); and the barrier, which is the arrival protocol of :mod:`.barrier` over the
transport primitives (``_post``, ``_take``, ``_retire``) each backend implements on a
channel that a failed collective does not break.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Iterable, Optional

from ..errors import InvalidArgumentError
from .barrier import ArrivalBarrier
from .coordinator import CoordinationError, Coordinator, check_timeout

__all__ = ["EngineCoordinator", "keep_posted"]

IN_FLIGHT = 4  # messages an engine's send_many / recv_many keep posted


def keep_posted(requests: Iterable[Any], wait: Callable[[Any], None], depth: int = IN_FLIGHT) -> None:
    """Drive a stream of point-to-point requests: each is posted as ``requests`` yields it (the iterator
    starts it), and once ``depth`` are in flight the oldest is waited for (``wait``) before the next is
    posted; then the rest, in order."""
    posted: Deque[Any] = deque()
    for request in requests:
        posted.append(request)
        if len(posted) >= depth:
            wait(posted.popleft())
    while posted:
        wait(posted.popleft())


class EngineCoordinator(ArrivalBarrier, Coordinator):
    """Rank, size, timeout, argument checks, the failed state, and the barrier protocol of :mod:`.barrier`."""

    _rank: int
    _size: int
    _timeout: float
    _failed: Optional[str]
    _barrier_seq: int = 0  # barriers called so far (the next one's sequence number), alike on every rank
    _engine = "engine"

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    @property
    def timeout(self) -> float:
        """The default timeout of every call, in seconds (settable; a call's ``timeout`` argument wins)."""
        return self._timeout

    @timeout.setter
    def timeout(self, seconds: float) -> None:
        self._timeout = check_timeout(seconds)

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        self._check()
        deadline = self._deadline(timeout)
        shown = self._timeout if timeout is None else float(timeout)
        seq = self._barrier_seq
        self._barrier_seq += 1
        if self._size == 1:
            return
        self._arrival_barrier(seq, name, deadline, shown)

    def _check(self) -> None:
        if self._failed is not None:
            raise CoordinationError(f"the {self._engine} coordinator is unusable after an earlier failure "
                                    f"({self._failed}); create a new coordinator")

    def _deadline(self, timeout: Optional[float]) -> float:
        t = self._timeout if timeout is None else float(timeout)
        if t <= 0:
            raise InvalidArgumentError(f"timeout must be positive, got {timeout!r}")
        return time.monotonic() + t

    def _check_peer(self, peer: int, what: str) -> None:
        if not isinstance(peer, int) or not 0 <= peer < self._size:
            raise InvalidArgumentError(f"{what} {peer!r} out of range for {self._size} clients")
