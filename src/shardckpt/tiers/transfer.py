"""Moving a node's bundle to another node over the coordinator (point-to-point, bounded memory).

The sending leader streams the bundle's files; the receiving leader writes them into its
own tier under the sender's node folder. On the wire, one message after another on
:data:`TAG`::

    8 bytes       little-endian length L of the manifest
    L bytes       manifest (JSON): {"files": [[name, size], ...]}: data files first, index last
    per file      its bytes, in messages of at most ``chunk`` bytes

The receiver removes what its tier held of that bundle (marker first), then writes each
file under its final name, fsyncs it, and the folder at the end; the index is written
last. No marker is written here: the bundle counts once the save's agreement says every
replica arrived (:mod:`.save`). A receiver that cannot write (a full or read-only tier)
keeps receiving and drops the bytes, so the sender is never left blocked, and reports its
error; the caller fails the save on every client. Only one buffer of ``chunk`` bytes is
in flight per side.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Sequence, Tuple

from ..distributed.coordinator import Coordinator
from .tier import bundle_files, fsync_dir, remove_bundle

if TYPE_CHECKING:
    from .nodes import NodeMap
    from .tier import LocalTier

__all__ = ["send_bundle", "receive_bundle", "move_bundles", "Moved", "TAG"]

TAG = 28


def send_bundle(coordinator: Coordinator, dst: int, prefix: str, chunk: int) -> int:
    """Send the bundle at ``prefix`` to rank ``dst``; return the bytes of its files sent."""
    files = bundle_files(prefix)
    manifest = json.dumps({"files": files}).encode("utf-8")
    coordinator.send_bytes(memoryview(struct.pack("<Q", len(manifest))), dst, tag=TAG)
    coordinator.send_bytes(memoryview(manifest), dst, tag=TAG)
    folder = os.path.dirname(prefix)
    buffer = bytearray(min(chunk, max((size for _, size in files), default=0)) or 1)
    view = memoryview(buffer)
    sent = 0
    for name, size in files:
        with open(os.path.join(folder, name), "rb", buffering=0) as f:
            left = size
            while left:
                n = f.readinto(view[:min(left, len(buffer))])
                if not n:
                    raise OSError(f"{os.path.join(folder, name)}: ended {left} bytes before its size {size}")
                coordinator.send_bytes(view[:n], dst, tag=TAG)
                left -= n
                sent += n
    return sent


def receive_bundle(coordinator: Coordinator, src: int, prefix: str, chunk: int,
                   timeout: Optional[float] = None) -> Tuple[int, Optional[str]]:
    """Receive a bundle from rank ``src`` into ``prefix`` (its folder is made); return ``(bytes received,
    error)``: a write error is returned after every byte was received, never raised."""
    head = coordinator.recv_bytes(src, 8, tag=TAG, timeout=timeout)
    (length,) = struct.unpack("<Q", bytes(head))
    manifest = json.loads(bytes(coordinator.recv_bytes(src, length, tag=TAG, timeout=timeout)).decode("utf-8"))
    files: List[Tuple[str, int]] = [(str(n), int(s)) for n, s in manifest["files"]]
    error: Optional[str] = None
    folder, base = os.path.split(prefix)
    try:
        os.makedirs(folder, exist_ok=True)
        remove_bundle(prefix)
    except OSError as e:
        error = f"{folder}: {e}"
    buffer = bytearray(min(chunk, max((size for _, size in files), default=0)) or 1)
    view = memoryview(buffer)
    received = 0
    for name, size in files:
        target = os.path.join(folder, base + name[name.index("."):]) if "." in name else prefix
        out = None
        if error is None:
            try:
                out = open(target, "wb", buffering=0)
            except OSError as e:
                error = f"{target}: {e}"
        left = size
        while left:
            n = min(left, len(buffer))
            coordinator.recv_bytes(src, n, out=view[:n], tag=TAG, timeout=timeout)
            left -= n
            received += n
            if out is not None:
                try:
                    out.write(view[:n])
                except OSError as e:
                    error = f"{target}: {e}"
                    _close_quietly(out)
                    out = None
        if out is not None:
            try:
                os.fsync(out.fileno())
                out.close()
            except OSError as e:
                error = f"{target}: {e}"
    if error is None:
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
    """What :func:`move_bundles` did on this client: bytes sent and received, the owners of the bundles it
    received (into its node's tier), and the first error (``None``: none)."""

    sent: int = 0
    received: int = 0
    owners: List[str] = field(default_factory=list)
    error: Optional[str] = None


def move_bundles(coordinator: Coordinator, tier: "LocalTier", nodes: "NodeMap", step: int,
                 moves: Sequence[Tuple[str, str, str]], timeout: Optional[float] = None) -> Moved:
    """Copy bundles of ``step`` between nodes, one at a time in the order of ``moves`` (every client passes
    the same list): ``(source node, target node, owner)`` sends ``owner``'s bundle from the source
    node's tier (its leader) to the target node's (its leader). Errors are returned, never raised, so
    that every client goes on to the caller's agreement round."""
    from .save import describe_error

    rank = coordinator.rank
    moved = Moved()
    for source, target, owner in moves:
        src, dst = nodes.leader(source), nodes.leader(target)
        if rank == src:
            try:
                moved.sent += send_bundle(coordinator, dst, tier.prefix(source, owner, step), tier.chunk_bytes)
            except Exception as exc:  # noqa: BLE001 - told to every client by the caller's round
                moved.error = moved.error or f"sending {owner}'s bundle of step {step} to node {target}: " \
                                             f"{describe_error(exc)}"
        elif rank == dst:
            moved.owners.append(owner)
            got, problem = receive_bundle(coordinator, src, tier.prefix(target, owner, step), tier.chunk_bytes,
                                          timeout=timeout)
            moved.received += got
            moved.error = moved.error or problem
    return moved
