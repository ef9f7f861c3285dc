"""Moving a node's bundle to another node over the coordinator: every client of both nodes at once.

A bundle of node ``K`` in the tier of node ``S`` (its own, or a replica it holds) goes to
node ``T`` over *lanes*: lane ``k`` pairs the ``k``-th client of ``S`` (sender) with the
``k``-th client of ``T`` (receiver), ``min(clients of S, clients of T)`` lanes; the bundle's
files (data files sorted, index last: :func:`~.tier.bundle_files`) are dealt to the lanes
in turn (file ``j`` on lane ``j mod lanes``), so a node of two clients moves its two data
files (one per client's part) on two streams at once. On the wire of each lane, one
message after another on :data:`TAG`::

    8 bytes       little-endian length L of the manifest
    L bytes       manifest (JSON): {"files": [[name, size], ...]}: this lane's files
    per file      its bytes, in messages of at most ``chunk`` bytes

A sender that cannot read a file sends zeros for what is left of it (its receiver is
never left waiting) and reports its error; a receiver that cannot write keeps receiving
and drops the bytes, and reports. Each receiver writes its files under their final
names in ``T``'s tier, fsyncs them and the folder. No marker is written here: the bundle
counts once the caller's agreement says every file of every move arrived
(:mod:`.save`, :mod:`.restore`). Only one buffer of ``chunk`` bytes is in flight per
lane and side.

Several moves run in the order of ``moves`` (every client passes the same list), each
client doing its own lanes' sends and receives in that order: lanes with no client in
common run at once, and the order is the same everywhere, so no client waits on one
that waits on it. Whoever calls :func:`move_bundles` has cleared the targets' old files of
those bundles (marker first) before any client starts moving (a round in between).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

import numpy as np

from ..distributed.coordinator import Coordinator
from ..format.bundle_writer import byte_view
from ..runtime import ThreadPool
from .tier import bundle_files, fsync_dir

if TYPE_CHECKING:
    from .nodes import NodeMap
    from .tier import LocalTier

__all__ = ["send_files", "receive_files", "move_bundles", "lanes", "Moved", "TAG"]

TAG = 28


def lanes(nodes: "NodeMap", source: str, target: str) -> List[Tuple[int, int]]:
    """The ``(sender rank, receiver rank)`` lanes of a move from node ``source`` to node ``target``."""
    senders, receivers = nodes.ranks_of(source), nodes.ranks_of(target)
    return list(zip(senders, receivers))


def send_files(coordinator: Coordinator, dst: int, folder: str, files: Sequence[Tuple[str, int]],
               chunk: int) -> Tuple[int, Optional[str]]:
    """Send ``files`` (``(name, size)`` in ``folder``) to rank ``dst``; return ``(bytes sent, error)``.

    Each file is mapped and its pages sent as they are (no copy into a buffer of ours), in
    messages of at most ``chunk`` bytes. A file that cannot be read, or whose size is not
    the expected one, is sent as zeros so that the receiver gets every byte it expects; the
    first such error is returned, never raised."""
    manifest = json.dumps({"files": [[n, int(z)] for n, z in files]}).encode("utf-8")
    coordinator.send_bytes(memoryview(struct.pack("<Q", len(manifest))), dst, tag=TAG)
    coordinator.send_bytes(memoryview(manifest), dst, tag=TAG)
    sent = 0
    error: Optional[str] = None
    zeros: Optional[memoryview] = None
    for name, size in files:
        path = os.path.join(folder, name)
        mapped: Optional[mmap.mmap] = None
        try:
            with open(path, "rb", buffering=0) as handle:
                actual = os.fstat(handle.fileno()).st_size
                if actual != size:
                    raise OSError(f"holds {actual} bytes, {size} expected")
                if size:
                    mapped = mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ)
        except OSError as e:
            error = error or f"{path}: {e}"
            mapped = None
        view = memoryview(mapped) if mapped is not None else None
        try:
            for at in range(0, size, chunk):
                n = min(chunk, size - at)
                if view is not None:
                    coordinator.send_bytes(view[at:at + n], dst, tag=TAG)
                else:  # the receiver still gets every byte it expects
                    if zeros is None or len(zeros) < n:
                        zeros = memoryview(bytes(min(chunk, max(z for _, z in files))))
                    coordinator.send_bytes(zeros[:n], dst, tag=TAG)
                sent += n
        finally:
            if view is not None:
                view.release()
            if mapped is not None:
                mapped.close()
    return sent, error


class _FileOut:
    """One file being received: its handle (``None`` once it failed) and the first error. Written in order by
    the receiver's one writer thread."""

    def __init__(self, target: str, error: Optional[str]) -> None:
        self.target = target
        self.error = error
        self.handle: Any = None
        if error is None:
            try:
                self.handle = open(target, "wb", buffering=0)
            except OSError as e:
                self.error = f"{target}: {e}"

    def write(self, data: np.ndarray) -> None:
        if self.handle is None:
            return
        try:
            view = byte_view(data)
            while len(view):
                view = view[self.handle.write(view):]
        except OSError as e:
            self.error = f"{self.target}: {e}"
            _close_quietly(self.handle)
            self.handle = None

    def close(self) -> None:
        if self.handle is None:
            return
        try:
            os.fsync(self.handle.fileno())
            self.handle.close()
        except OSError as e:
            self.error = f"{self.target}: {e}"
        self.handle = None


def receive_files(coordinator: Coordinator, src: int, folder: str, chunk: int,
                  timeout: Optional[float] = None) -> Tuple[int, Optional[str]]:
    """Receive the files rank ``src`` sends into ``folder`` (made when missing); return ``(bytes received,
    error)``: a write error is returned after every byte was received, never raised.

    Two buffers of ``chunk`` bytes: one writer thread writes a message's bytes while the
    next message is received into the other buffer, so the sender is never held up by the
    receiver's writes (files are written in order; each is fsynced, then the folder)."""
    head = coordinator.recv_bytes(src, 8, tag=TAG, timeout=timeout)
    (length,) = struct.unpack("<Q", bytes(head))
    manifest = json.loads(bytes(coordinator.recv_bytes(src, length, tag=TAG, timeout=timeout)).decode("utf-8"))
    files: List[Tuple[str, int]] = [(os.path.basename(str(n)), int(s)) for n, s in manifest["files"]]
    error: Optional[str] = None
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as e:
        error = f"{folder}: {e}"
    size = min(chunk, max((z for _, z in files), default=0)) or 1
    buffers = [np.empty(size, np.uint8) for _ in range(2)]  # NumPy's large pages: cheap to fault in
    in_use: List[Optional["Future[None]"]] = [None, None]  # the write still reading each buffer
    outs: List[_FileOut] = []
    received = turn = 0
    with ThreadPool(1, "shardckpt-tier-write") as writer:
        for name, total in files:
            out = _FileOut(os.path.join(folder, name), error)
            outs.append(out)
            left = total
            while left:
                n = min(left, size)
                busy = in_use[turn]
                if busy is not None:
                    busy.result()  # its bytes are written: the buffer is free
                buffer = buffers[turn][:n]
                coordinator.recv_bytes(src, n, out=byte_view(buffer), tag=TAG, timeout=timeout)
                in_use[turn] = writer.submit(out.write, buffer)
                turn ^= 1
                left -= n
                received += n
            writer.submit(out.close)
    for out in outs:
        error = error or out.error
    if error is None and files:
        try:
            fsync_dir(folder)
        except OSError as e:
            error = f"{folder}: {e}"
    return received, error


def _close_quietly(handle: Any) -> None:
    try:
        handle.close()
    except OSError:
        pass


@dataclass
class Moved:
    """What :func:`move_bundles` did on this client: bytes sent and received, and the first error
    (``None``: none)."""

    sent: int = 0
    received: int = 0
    error: Optional[str] = None


def move_bundles(coordinator: Coordinator, tier: "LocalTier", nodes: "NodeMap", step: int,
                 moves: Sequence[Tuple[str, str, str]], timeout: Optional[float] = None) -> Moved:
    """Copy bundles of ``step`` between nodes (see the module docstring): ``(source node, target node,
    owner)`` sends ``owner``'s bundle from the source node's tier to the target node's, on every lane
    at once; every client passes the same ``moves``. Errors are returned, never raised, so that
    every client goes on to the caller's agreement round."""
    from .save import describe_error

    rank = coordinator.rank
    moved = Moved()
    for source, target, owner in moves:
        paths = lanes(nodes, source, target)
        for k, (src, dst) in enumerate(paths):
            if rank == src:
                what = f"sending {owner}'s bundle of step {step} to node {target}"
                prefix = tier.prefix(source, owner, step)
                problem: Optional[str] = None
                try:
                    files = bundle_files(prefix)[k::len(paths)]
                except Exception as exc:  # noqa: BLE001 - its receiver gets an empty manifest
                    files, problem = [], f"{prefix}: {describe_error(exc)}"
                try:
                    sent, unread = send_files(coordinator, dst, os.path.dirname(prefix), files, tier.chunk_bytes)
                except Exception as exc:  # noqa: BLE001 - told to every client by the caller's round
                    sent, unread = 0, describe_error(exc)
                problem = problem or unread
                moved.sent += sent
                if problem is not None:
                    moved.error = moved.error or f"{what}: {problem}"
            elif rank == dst:
                got, problem = receive_files(coordinator, src, tier.folder(target, owner), tier.chunk_bytes,
                                             timeout=timeout)
                moved.received += got
                moved.error = moved.error or problem
    return moved
