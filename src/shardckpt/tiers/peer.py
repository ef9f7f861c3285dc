"""Restoring a lost node's clients straight from a peer's replica: :class:`PeerFileSystem` (the reading
side) and :func:`serve_bundle` (the holding side).

A client whose node lost its bundle of the step being restored reads that bundle from the node
holding its replica, over the coordinator, through the one restore engine unchanged: a
:class:`~shardckpt.format.bundle_reader.BundleReader` over a :class:`PeerFileSystem`, whose
positional reads are requests to one client of the holding node (its *server*), answered
straight into the reader's buffers: whole pieces land in their destinations and are checked
against the index's CRC32C as from a local file. Nothing is written on either side: the lost
node's tier is repopulated afterwards, behind the restore (:mod:`.restore`).

Pairs (:func:`peer_pairs`): the clients of a lost node spread over the nodes holding its bundle
and over their clients, the least loaded first: with one holder of ``s`` clients, the ``k``-th
client of the lost node is served by the holder's client ``k mod s``; with two holders (``replicas=2``),
every other client by each. A server with several clients serves them at once, each on a thread
of its own (:mod:`.restore`), each until that client says it is done; the engines match a
pair's messages by its two ranks. On the wire of a
pair, on :data:`TAG`::

    server -> client   8 bytes L, then L bytes of JSON: {"files": [[name, size], ...],
                       "chunk": c}: the bundle's files (data files, then the index)
    then, until the client is done:
    client -> server   8 bytes: n, the number of ranges asked for (0: done, the server returns)
                       n x 3 little-endian int64: (file number, offset, length)
    server -> client   8 bytes: E, the length of an error (0: none), then E bytes of it (UTF-8)
                       when E == 0: each range's bytes, in messages of at most c bytes

A range outside its file, or a file the server cannot map, is answered with an error (no
bytes follow), which the client raises as a :class:`~shardckpt.errors.StorageError` naming
the file: the restore fails on that client and, through the restore's agreement round, every
client falls back together. The server never raises: it returns its first error.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..distributed.coordinator import Coordinator
from ..errors import DataLossError, NotFoundError, StorageError, UnsupportedError
from ..format import crc
from ..format.buffers import aligned_empty
from ..format.bundle_pieces import StoredPiece, region_box
from ..format.bundle_reader import BundleReader
from ..format.bundle_writer import byte_view
from ..restoring.plan import Read
from ..restoring.source import BundleSource
from ..storage.base import FileSystem, Identity, ReadHandle
from ..storage.local import LocalFileSystem
from ..storage.wrappers import FileSystemWrapper

if TYPE_CHECKING:
    from .nodes import NodeMap

__all__ = ["PeerFileSystem", "PeerSource", "serve_bundle", "peer_pairs", "TAG"]

TAG = 29
_HEAD = struct.Struct("<Q")


def peer_pairs(nodes: "NodeMap", moves: Sequence[Tuple[str, str, str]],
               holders: Optional[Dict[str, List[str]]] = None) -> List[Tuple[int, int, str, str, str]]:
    """``(server rank, client rank, source node, target node, owner)`` for each client of each move's target,
    in the moves' order, then the target's clients'.

    The ``k``-th client of a target is served by a client of one of the nodes holding the owner's bundle
    (``holders[owner]``, in node order, less every move's target; without ``holders``: the move's
    source): the least loaded of them so far, the holders tried from the ``k``-th on (round the list),
    each holder's clients in order. So a lost node's clients spread over every node holding its
    bundle (with ``replicas=2``, half of them read from each), and with one holder of ``s`` clients,
    client ``k`` is served by the holder's client ``k mod s``. Every client computes the same pairs."""
    targets = {target for _, target, _ in moves}
    load: Dict[int, int] = {}
    out: List[Tuple[int, int, str, str, str]] = []
    for source, target, owner in moves:
        sources = [node for node in (holders or {}).get(owner, [source]) if node not in targets] or [source]
        for k, client in enumerate(nodes.ranks_of(target)):
            turn = k % len(sources)
            candidates = [(node, rank) for node in sources[turn:] + sources[:turn] for rank in nodes.ranks_of(node)]
            node, server = min(candidates, key=lambda candidate: load.get(candidate[1], 0))  # the first least loaded
            load[server] = load.get(server, 0) + 1
            out.append((server, client, node, target, owner))
    return out


def _send_head(coordinator: Coordinator, dst: int, n: int) -> None:
    coordinator.send_bytes(memoryview(_HEAD.pack(n)), dst, tag=TAG)


def _recv_head(coordinator: Coordinator, src: int, timeout: Optional[float]) -> int:
    return int(_HEAD.unpack(bytes(coordinator.recv_bytes(src, _HEAD.size, tag=TAG, timeout=timeout)))[0])


def serve_bundle(coordinator: Coordinator, client: int, folder: str, files: Sequence[Tuple[str, int]], chunk: int,
                 timeout: Optional[float] = None, streaming: Optional[Callable[[], None]] = None
                 ) -> Tuple[int, Optional[str]]:
    """Serve ``files`` (``(name, size)`` in ``folder``: a bundle this node holds whole) to rank ``client``
    until it is done (see the module docstring); return ``(bytes sent, first error)``, never raise for
    what the files or the requests hold (a failed transport raises, as any collective). ``streaming()``
    runs before the bytes of the first request of more than ``chunk`` bytes are sent (the client's
    planning reads are over: its destinations' bytes follow)."""
    manifest = json.dumps({"files": [[n, int(z)] for n, z in files], "chunk": int(chunk)}).encode("utf-8")
    _send_head(coordinator, client, len(manifest))
    coordinator.send_bytes(memoryview(manifest), client, tag=TAG)
    mapped: Dict[int, Any] = {}
    sent = 0
    first: Optional[str] = None
    try:
        while True:
            n = _recv_head(coordinator, client, timeout)
            if n == 0:
                return sent, first
            ranges = np.empty((n, 3), "<i8")
            coordinator.recv_bytes(client, ranges.nbytes, out=byte_view(ranges), tag=TAG, timeout=timeout)
            views, error = _ranges_of(ranges.tolist(), folder, files, mapped)
            if error is not None:
                for view in views:
                    view.release()
                views.clear()
                first = first or error
                text = error.encode("utf-8")
                _send_head(coordinator, client, len(text))
                coordinator.send_bytes(memoryview(text), client, tag=TAG)
                continue
            _send_head(coordinator, client, 0)
            if streaming is not None and sum(len(view) for view in views) > chunk:
                streaming()
                streaming = None
            sent += _send_ranges(coordinator, client, views, chunk)
            views.clear()
    finally:
        _unmap_behind(list(mapped.values()))


def _ranges_of(ranges: List[List[int]], folder: str, files: Sequence[Tuple[str, int]], mapped: Dict[int, memoryview]
               ) -> Tuple[List[memoryview], Optional[str]]:
    """The views of the files' pages that ``ranges`` ask for (files mapped into ``mapped`` on first use), or
    what is wrong with the first range that cannot be served."""
    views: List[memoryview] = []
    for number, offset, length in ranges:
        if not 0 <= number < len(files):
            return views, f"no file number {number} in a bundle of {len(files)} files"
        name, size = files[number]
        path = os.path.join(folder, name)
        if offset < 0 or length < 0 or offset + length > size:
            return views, f"{path}: bytes [{offset}, {offset + length}) asked for, the file holds {size}"
        try:
            if number not in mapped:
                mapped[number] = _map(path, size)
        except OSError as e:
            return views, f"{path}: {e}"
        views.append(mapped[number][offset:offset + length])
    return views, None


def _send_ranges(coordinator: Coordinator, client: int, views: List[memoryview], chunk: int) -> int:
    """Send each view's bytes in messages of at most ``chunk`` bytes, several in flight
    (:meth:`~shardckpt.distributed.coordinator.Coordinator.send_many`); every slice is released
    before the files are unmapped. Returns the bytes sent."""
    parts = [view[at:at + chunk] for view in views for at in range(0, len(view), chunk)]
    try:
        coordinator.send_many(parts, client, tag=TAG)
        return sum(len(p) for p in parts)
    finally:
        for part in parts:
            part.release()
        for view in views:
            view.release()


def _map(path: str, size: int) -> memoryview:
    """The file's pages, read-only (an empty view for an empty file); its size checked first."""
    with open(path, "rb", buffering=0) as handle:
        actual = os.fstat(handle.fileno()).st_size
        if actual != size:
            raise OSError(f"holds {actual} bytes, {size} expected")
        if not size:
            return memoryview(b"")
        return memoryview(mmap.mmap(handle.fileno(), size, access=mmap.ACCESS_READ))


def _unmap_behind(views: List[memoryview]) -> None:
    """Unmap ``views`` on a thread of their own: tearing down the map of a bundle whose pages were all
    sent takes ~50 ms a GiB, which the restore's agreement round need not wait for."""
    def unmap() -> None:
        for view in views:
            _unmap(view)

    if views:
        threading.Thread(target=unmap, name="shardckpt-tier-unmap", daemon=True).start()


def _unmap(view: memoryview) -> None:
    owner = view.obj
    view.release()
    if isinstance(owner, mmap.mmap):
        try:
            owner.close()
        except BufferError:  # a view the transport still holds: unmapped when it lets go
            pass


def _bytes_of(buf: Any) -> memoryview:
    view = memoryview(buf)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


class PeerFileSystem(FileSystemWrapper):
    """A read-only view of a bundle that a client of another node (rank ``server``) holds in ``folder``
    of its tier: paths are that folder's (they name the replica in errors); reads are requests to the
    server (see the module docstring), received straight into the caller's buffers.

    Made by the client, after which the server runs :func:`serve_bundle`: the constructor receives
    the manifest. Reads are serialised (one request in flight). :meth:`done` (exactly once, also
    after a failure) releases the server. Every write, and every read of a file the bundle does
    not have, raises.
    """

    def __init__(self, coordinator: Coordinator, server: int, folder: str, timeout: Optional[float] = None) -> None:
        super().__init__(LocalFileSystem())
        self._coordinator = coordinator
        self.server = server
        self.folder = os.path.abspath(folder)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._broken = False
        self._done = False
        length = _recv_head(coordinator, server, timeout)
        manifest = json.loads(bytes(coordinator.recv_bytes(server, length, tag=TAG, timeout=timeout)).decode("utf-8"))
        self._chunk = max(1, int(manifest["chunk"]))
        self._files: Dict[str, Tuple[int, int]] = {
            str(name): (number, int(size)) for number, (name, size) in enumerate(manifest["files"])}
        #: bytes received so far
        self.received = 0

    def path(self, name: str) -> str:
        """Where ``name`` is in the server's tier."""
        return os.path.join(self.folder, name)

    def _file(self, path: str) -> Tuple[int, int]:
        folder, name = os.path.split(os.path.abspath(path))
        found = self._files.get(name) if folder == self.folder else None
        if found is None:
            raise NotFoundError(f"not a file of the bundle rank {self.server} serves from {self.folder}", path=path)
        return found

    def before(self, op: str, path: str) -> None:
        raise UnsupportedError(f"{op}: a peer's replica is read-only here", path=path)

    def done(self) -> None:
        """Release the server (once; nothing when the exchange broke: the server then times out)."""
        with self._lock:
            if self._done or self._broken:
                self._done = True
                return
            self._done = True
            _send_head(self._coordinator, self.server, 0)

    def fetch(self, parts: Sequence[Tuple[int, int, memoryview]], path: str = "",
              landed: Optional[Callable[[int], None]] = None) -> None:
        """Fill each ``(handle, offset, buffer)`` of ``parts`` from its file, in one request (the server
        streams every range back to back); ``landed(i)`` runs as soon as part ``i`` is in."""
        coordinator, server = self._coordinator, self.server
        with self._lock:
            if self._done or self._broken:
                raise StorageError(f"the exchange with rank {self.server} is over", path=path)
            try:
                views = [_bytes_of(buf) for _, _, buf in parts]
                ranges = np.array([(handle, offset, view.nbytes) for (handle, offset, _), view in zip(parts, views)],
                                  "<i8").reshape(-1, 3)
                _send_head(coordinator, server, len(ranges))
                coordinator.send_bytes(byte_view(ranges), server, tag=TAG)
                length = _recv_head(coordinator, server, self._timeout)
                if length:
                    error = bytes(coordinator.recv_bytes(server, length, tag=TAG, timeout=self._timeout))
                    raise StorageError(f"rank {server} could not serve it: {error.decode('utf-8', 'replace')}",
                                       path=path)
                chunk = self._chunk
                messages: List[memoryview] = []
                last: Dict[int, int] = {}  # message number -> the part it completes
                for i, view in enumerate(views):
                    if view.nbytes:
                        messages += [view[at:at + chunk] for at in range(0, view.nbytes, chunk)]
                        last[len(messages) - 1] = i
                ends = [] if landed is None else [i for i, view in enumerate(views) if not view.nbytes]

                def arrived(m: int) -> None:
                    self.received += messages[m].nbytes
                    if landed is not None and m in last:
                        landed(last[m])

                for i in ends:  # empty parts: nothing to wait for
                    landed(i)  # type: ignore[misc]
                coordinator.recv_many(server, messages, tag=TAG, timeout=self._timeout, landed=arrived)
            except StorageError:
                raise
            except BaseException:
                self._broken = True
                raise

    # -- reading -----------------------------------------------------------------------------------
    def open_read(self, path: str) -> ReadHandle:
        return self._file(path)[0]

    def pread_into(self, handle: ReadHandle, buf: memoryview, offset: int, path: str = "") -> None:
        self.fetch([(int(handle), offset, buf)], path)

    def pread_batch(self, handle: ReadHandle, requests: Sequence[Tuple[int, memoryview]], path: str = "") -> None:
        parts = [(int(handle), offset, buf) for offset, buf in requests]
        if parts:
            self.fetch(parts, path)

    def size(self, path: str) -> int:
        return self._file(path)[1]

    def read_bytes(self, path: str) -> bytes:
        number, size = self._file(path)
        out = bytearray(size)
        if size:
            self.fetch([(number, 0, memoryview(out))], path)
        return bytes(out)

    def identity(self, path: str, handle: Optional[ReadHandle] = None) -> Identity:
        number, size = self._file(path)
        return (size, "peer", self.server, number)

    def identities(self, paths: Sequence[str]) -> "dict[str, Optional[Identity]]":
        return FileSystem.identities(self, paths)  # one identity() each: the manifest answers

    @property
    def prefetches(self) -> bool:
        return False

    def prefetch(self, handle: ReadHandle, starts: Any, ends: Any, path: str = "") -> int:
        return 0

    def close(self, handle: ReadHandle) -> None:
        pass

    def exists(self, path: str) -> bool:
        try:
            self._file(path)
        except NotFoundError:
            return False
        return True

    def isfile(self, path: str) -> bool:
        return self.exists(path)

    def isdir(self, path: str) -> bool:
        return os.path.abspath(path) == self.folder

    def listdir(self, path: str) -> List[str]:
        if os.path.abspath(path) != self.folder:
            raise NotFoundError("not the folder of the bundle served", path=path)
        return sorted(self._files)


class PeerSource(BundleSource):
    """The restore engine's source for a bundle read from a peer (:class:`PeerFileSystem` under a
    ``BundleReader``): a collective source whose recorded reads of whole stored pieces are fetched in
    one request when the restore call ends (:meth:`finish`), streamed straight into their
    destinations and checked against the index's CRC32C as each lands (on the checksum helpers);
    every other read (a region cutting a piece, strings, a strided destination) and every value
    read while planning is served at once, one request each. Follow-ups run after the fetch.

    Keeps a ``BundleReader``'s face for the restore's planning (``read(key)``, ``read_region``).
    Reads asked for after :meth:`finish` go through the reader (the server may be gone by then:
    they fail with a :class:`~shardckpt.errors.StorageError`)."""

    collective = True

    def __init__(self, reader: BundleReader, fs: PeerFileSystem) -> None:
        super().__init__(reader, owned=True)
        self._fs = fs
        self._wanted: List[Tuple[StoredPiece, np.ndarray]] = []
        self._follow_ups: List[Callable[[], None]] = []
        self._finished = False

    def read(self, read: Any, session: Any = None, *, verify: bool = True) -> np.ndarray:  # type: ignore[override]
        if not isinstance(read, Read):  # the reader's face: a whole value, now
            return self.reader.read(read, verify=verify)
        whole = None if self._finished or not verify else self._whole_piece(read)
        if whole is None:
            return super().read(read, None, verify=verify)
        self._wanted.append(whole)
        return whole[1]

    def read_region(self, key: Any, region: Any = None, out: Optional[np.ndarray] = None, *, verify: bool = True,
                    session: Any = None) -> np.ndarray:
        return self.read(Read(key, region, out), verify=verify)

    def reading(self, *, defer: bool) -> ContextManager[Any]:
        return contextlib.nullcontext(None)

    def after(self, follow_up: Callable[[], None]) -> None:
        if self._finished:
            follow_up()
        else:
            self._follow_ups.append(follow_up)

    def _whole_piece(self, read: Read) -> Optional[Tuple[StoredPiece, np.ndarray]]:
        """``read`` as a whole stored piece of a numeric dtype and the C-contiguous destination its bytes go to
        as stored; ``None`` when it is anything else."""
        reader = self.reader
        dt = reader.dtype(read.key)
        if dt.itemsize is None or (dt.swap_unit and reader.big_endian):
            return None
        if read.piece is not None:
            piece = read.piece
            if read.region is not None and tuple(read.region) != tuple((0, b - a) for a, b in piece.box):
                return None
        else:
            shape = reader.shape(read.key)
            box = region_box(read.region, shape, self.prefix, read.key)
            found = reader.piece_at(read.key, [a for a, _ in box]) if any(box) or not shape else None
            if found is None or tuple(found.box) != tuple(box):
                return None
            piece = found
        reader.check_piece(piece, dt)  # inside its file, exactly its box's bytes
        shape = tuple(b - a for a, b in piece.box)
        out = read.out
        if out is None:
            out = aligned_empty(shape, dt.numpy)
        elif tuple(out.shape) != shape or out.dtype != dt.numpy or not out.flags.c_contiguous:
            return None
        return piece, out

    def finish(self, error: Optional[BaseException] = None) -> None:
        """Fetch every recorded whole piece (one request, checked as they land), then run the follow-ups."""
        wanted, self._wanted = self._wanted, []
        follow_ups, self._follow_ups = self._follow_ups, []
        self._finished = True
        if error is not None or not wanted:
            if error is None:
                for follow_up in follow_ups:
                    follow_up()
            return
        reader, fs = self.reader, self._fs
        paths = {int(p.entry.shard_id): reader.data_path(int(p.entry.shard_id)) for p, _ in wanted}
        handles = {shard: fs.open_read(path) for shard, path in paths.items()}
        pool = crc.shared_executor()
        checks: Dict[int, "Future[Optional[str]]"] = {}

        def check(i: int) -> Optional[str]:
            piece, out = wanted[i]
            computed = crc.value(byte_view(out))
            expected = crc.unmask(int(piece.entry.crc32c))
            if computed == expected:
                return None
            return f"checksum does not match: stored 0x{expected:08x}, computed 0x{computed:08x}"

        fs.fetch([(handles[int(p.entry.shard_id)], int(p.entry.offset), byte_view(out)) for p, out in wanted],
                 self.prefix, landed=lambda i: checks.__setitem__(i, pool.submit(check, i)))
        for i, (piece, _) in enumerate(wanted):
            problem = checks[i].result()
            if problem is not None:
                raise DataLossError(problem, path=paths[int(piece.entry.shard_id)], **piece.where())
        for follow_up in follow_ups:
            follow_up()

    def close(self) -> None:
        self._wanted.clear()
        self._follow_ups.clear()
        super().close()
