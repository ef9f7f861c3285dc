"""A coordinator for client processes started on one machine with :mod:`multiprocessing`.

Needs no engine beyond the standard library, so ``shardckpt demo`` and tests can
run several clients anywhere. Create the shared state in the parent with
:func:`local_group` and give each child its :class:`LocalGroup` and rank::

    group = local_group(4)
    procs = [ctx.Process(target=work, args=(group, r)) for r in range(4)]
    ...
    def work(group, rank):
        coordinator = LocalProcessCoordinator(group, rank)

Messages are JSON (objects) or raw bytes; ``multiprocessing`` carries them in memory.
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Deque, Dict, List, Optional, Tuple

from ..errors import InvalidArgumentError
from .coordinator import CoordinationError, CoordinationTimeout, Coordinator, check_timeout, decode, encode

__all__ = ["LocalGroup", "local_group", "LocalProcessCoordinator"]


@dataclass
class LocalGroup:
    """What the clients of one local group share: a mailbox per rank and channel, and arrival counters.

    Channel 0 serves the coordinators made directly, channel ``c`` their ``c``-th clone.
    """

    size: int
    mailboxes: List[List[Any]]  # [channel][rank] -> multiprocessing queue
    arrivals: List[Any]  # [channel] -> multiprocessing Array of per-rank barrier counters


def local_group(size: int, context: Optional[Any] = None, channels: int = 2) -> LocalGroup:
    ctx = context or multiprocessing.get_context("spawn")
    return LocalGroup(size, [[ctx.Queue() for _ in range(size)] for _ in range(channels)],
                      [ctx.Array("q", size, lock=False) for _ in range(channels)])


class LocalProcessCoordinator(Coordinator):
    """Rank ``rank`` of a :class:`LocalGroup`."""

    def __init__(self, group: LocalGroup, rank: int, timeout: Optional[float] = None, channel: int = 0) -> None:
        self._group = group
        self._rank = rank
        self._channel = channel
        self._clones = 0
        self._mailboxes = group.mailboxes[channel]
        self._arrivals = group.arrivals[channel]
        self._timeout = check_timeout(timeout)
        self._seq = 0
        self._stash: Dict[Tuple[str, int, int], Deque[Any]] = {}  # messages that came early, in order

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._group.size

    @property
    def backend(self) -> str:
        return "local"

    def _send(self, dst: int, kind: str, seq: int, payload: Any) -> None:
        self._mailboxes[dst].put((kind, seq, self._rank, payload))

    def _recv(self, kind: str, seq: int, src: int, deadline: float, what: str) -> Any:
        key = (kind, seq, src)
        while not self._stash.get(key):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinationTimeout(f"{what}: rank {self._rank} heard nothing from rank {src} in time",
                                          missing=[src])
            try:
                k, s, r, payload = self._mailboxes[self._rank].get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            self._stash.setdefault((k, s, r), deque()).append(payload)
        return self._stash[key].popleft()

    def _deadline(self, timeout: Optional[float]) -> float:
        return time.monotonic() + (self._timeout if timeout is None else timeout)

    def clone(self) -> "LocalProcessCoordinator":
        self._clones += 1
        channel = self._channel + self._clones
        if channel >= len(self._group.mailboxes):
            raise CoordinationError(f"the local group has {len(self._group.mailboxes)} channels; make it with "
                                    "local_group(..., channels=more)")
        return LocalProcessCoordinator(self._group, self._rank, self._timeout, channel)

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        self._seq += 1
        seq = self._seq
        arrivals = self._arrivals
        arrivals[self._rank] = seq
        deadline = self._deadline(timeout)
        while True:
            missing = [r for r in range(self.size) if arrivals[r] < seq]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise CoordinationTimeout(f"barrier {name!r} timed out on rank {self._rank}: ranks {missing} did "
                                          "not arrive", missing=missing)
            time.sleep(0.002)

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        self._seq += 1
        data = encode(obj)
        for dst in range(self.size):
            if dst != self._rank:
                self._send(dst, "gather", self._seq, data)
        deadline = self._deadline(timeout)
        out = []
        for src in range(self.size):
            out.append(decode(data if src == self._rank else self._recv("gather", self._seq, src, deadline,
                                                                          "all_gather")))
        return out

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        if not isinstance(root, int) or not 0 <= root < self.size:
            raise InvalidArgumentError(f"gather root {root!r} out of range for {self.size} clients")
        self._seq += 1
        data = encode(obj)
        if self._rank != root:
            self._send(root, "gather1", self._seq, data)
            return None
        deadline = self._deadline(timeout)
        return [decode(data if src == root else self._recv("gather1", self._seq, src, deadline, "gather"))
                for src in range(self.size)]

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        self._seq += 1
        if self._rank == root:
            data = encode(obj)
            for dst in range(self.size):
                if dst != root:
                    self._send(dst, "bcast", self._seq, data)
            return decode(data)
        return decode(self._recv("bcast", self._seq, root, self._deadline(timeout), "broadcast"))

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        self._send(dst, f"bytes{tag}", 0, bytes(data))

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        payload = self._recv(f"bytes{tag}", 0, src, self._deadline(timeout), "recv_bytes")
        if len(payload) != nbytes:
            raise CoordinationTimeout(f"expected {nbytes} bytes from rank {src}, got {len(payload)}")
        if out is None:
            return memoryview(bytearray(payload))
        out[:] = payload
        return out
