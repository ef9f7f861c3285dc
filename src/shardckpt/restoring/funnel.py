"""Funnelled restores (``CheckpointOptions(io_device=...)`` on a multi-client restore): only the io
client touches storage; it reads each needed region once and sends every other client exactly
its own regions over the coordinator.

Protocol (collective: every client calls it, in the same order; nothing is written anywhere):

1. **open** (broadcast from the io client): the io client resolves the path, opens the
   checkpoint and sends what a restore plans with: the prefix, every tensor's dtype and shape,
   the values of a few small tensors asked for up front (the object graph), and the in-flight
   budget. A failure to open is raised on every client.
2. **plan** (local, no communication): the front door runs its usual restore against a
   :class:`FunnelledSource`, which answers the metadata and *records* each read (key, region,
   destination array) instead of reading; the destinations are filled in step 4.
3. **exchange** (all-gather): each client's distinct reads, sorted by (key, region), and
   whether its planning succeeded; a failed client makes every client raise.
4. **serve**: the io client goes key by key (in order) over the stored pieces the wanted
   regions touch. A piece the regions tile exactly is read once, whole, and its checksum
   verified (larger than the budget: in sub-boxes, in storage order, with a running CRC32C
   compared after the last), then cut for every region; the parts of other pieces are read
   per region, as a region read reads them (no checksum covers a part). Reads land in buffers
   of at most the budget, on a helper thread that reads ahead of the sends while the buffers
   held stay within the budget; the io client's own regions are filled from them too. Every
   other client that asked for a region receives each part of it as a record: a header
   (status, payload bytes, inline or not, the number of the client's region of that key, the
   part's box: int64s) and the payload (the part's C-order bytes; string tensors: the whole
   region as base64 strings in JSON, read whole), until its regions of the key are full.
   Records travel in batches per client (a message with the batch's length, then the batch;
   at most a quarter of the budget shared by all clients' batches), so small parts cost few
   messages; a payload too large for a batch follows the batch that holds its header in
   messages of its own, received straight into the destination. After a failure (a read, a
   checksum) each client's next header says "failed", so no client waits for bytes that will
   not come; a checksum found wrong after its bytes went out fails the restore at step 5.
5. **agree**: every client reports success; any failure is raised on every client.

Values are only valid once :meth:`FunnelledSource.finish` returns (the engine's
:func:`~.engine.collective_call` calls it when the front door's restore call ends); the reads'
follow-ups (copies to replicas, values built from regions) run then. Reads asked for after it
(deferred restoration of objects attached later) need storage and are refused.
"""

from __future__ import annotations

import base64
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np

from .. import errors as _errors
from ..distributed.coordinator import CoordinationError, Coordinator
from ..errors import DataLossError, InvalidArgumentError, NotFoundError, ShardckptError, UnsupportedError
from ..format import crc
from ..format.bundle_reader import BundleReader, region_box
from ..format.bundle_writer import byte_view
from ..format.dtypes import DType, from_enum
from ..format.tensor_slice import Box, TensorSlice, box_shape, box_volume, boxes_tile, intersect
from ..saving.distributed import io_rank_of
from ..storage.registry import get_fs
from .engine import collective_call
from .plan import Read
from .source import PieceSource

__all__ = ["FunnelledSource", "FunnelledReader", "DEFAULT_INFLIGHT_BYTES", "chunk_boxes", "funnelled_reader",
           "run_funnelled"]

DEFAULT_INFLIGHT_BYTES = 64 << 20
_OK, _FAILED = 0, 1
_TAG = 0
Region = Union[None, Box, TensorSlice, str]
ReadKey = Tuple[str, Box]


def chunk_boxes(box: Box, itemsize: int, budget: int) -> List[Box]:
    """``box`` cut into sub-boxes of at most ``budget`` bytes (one element at least), in C order.

    Each sub-box's elements are one contiguous run of the box's C-order bytes (only the first
    dimension with more than one index is cut, the dimensions after it are whole), so a
    receiver fills a C-contiguous destination chunk by chunk.
    """
    volume = box_volume(box)
    if volume * itemsize <= budget or volume <= 1:
        return [box]
    d = next(i for i, (a, b) in enumerate(box) if b - a > 1)
    inner = box_volume(box[d + 1:]) * itemsize
    a, b = box[d]
    if inner <= budget:
        step = max(1, budget // inner)
        return [box[:d] + ((s, min(b, s + step)),) + box[d + 1:] for s in range(a, b, step)]
    out: List[Box] = []
    for s in range(a, b):
        out += chunk_boxes(box[:d] + ((s, s + 1),) + box[d + 1:], itemsize, budget)
    return out


def _local(sub: Box, box: Box) -> Tuple[slice, ...]:
    return tuple(slice(a - r0, b - r0) for (a, b), (r0, _) in zip(sub, box))


def _encode_strings(values: np.ndarray) -> bytes:
    return json.dumps([base64.b64encode(bytes(v)).decode("ascii") for v in values.reshape(-1)]).encode("ascii")


def _decode_strings(payload: bytes, shape: Tuple[int, ...]) -> np.ndarray:
    items = [base64.b64decode(s) for s in json.loads(payload.decode("ascii"))]
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


def _error_of(info: Dict[str, Any]) -> ShardckptError:
    """The io client's error, as the same shardckpt error class where there is one."""
    cls = getattr(_errors, str(info.get("type", "")), None)
    message = f"on the io client (rank {info.get('rank')}): {info.get('error')}"
    if isinstance(cls, type) and issubclass(cls, ShardckptError) and cls is not ShardckptError:
        try:
            return cls(message)
        except TypeError:
            pass
    return CoordinationError(message)


class FunnelledSource(PieceSource):
    """The :class:`~.source.PieceSource` a restore plans with on every client of a funnelled restore
    (see the module docstring): metadata from the io client; reads recorded, their bytes moved by
    :meth:`finish` (the engine's :func:`~.engine.collective_call` calls it), then the reads'
    follow-ups run (:meth:`after`). It keeps a ``BundleReader``'s face too (``read``,
    ``read_region`` of keys).

    Collective: every client constructs it (step 1) and calls :meth:`finish` (steps 3-5) in the
    same order. ``save_path`` is resolved on the io client only, by ``resolve`` (default: the
    path is the prefix). ``preload``: keys whose values every client receives up front (small
    tensors read during planning, e.g. the object graph). ``budget``: bytes of read-ahead
    buffers the io client holds at most (also the largest message).
    """

    collective = True  # reads are recorded; destinations are filled by finish()

    def __init__(self, save_path: str, coordinator: Coordinator, io_rank: int, *,
                 budget: Optional[int] = None, timeout: Optional[float] = None,
                 resolve: Optional[Callable[[str], str]] = None, preload: Sequence[str] = ()) -> None:
        if not 0 <= io_rank < coordinator.size:
            raise InvalidArgumentError(f"io client {io_rank} out of range for {coordinator.size} clients")
        if budget is not None and int(budget) <= 0:
            raise InvalidArgumentError(f"in-flight budget must be positive, got {budget}")
        self._coord = coordinator
        self.io_rank = io_rank
        self._timeout = timeout
        self._bundle: Optional[BundleReader] = None
        self._reads: Dict[ReadKey, List[np.ndarray]] = {}
        self._follow_ups: List[Callable[[], None]] = []
        self._done = False
        self.received = 0  # payload bytes this client received (not the io client)
        info: Dict[str, Any] = {}
        if coordinator.rank == io_rank:
            try:
                prefix = resolve(save_path) if resolve is not None else save_path
                bundle = BundleReader(prefix, fs=get_fs(prefix))
                self._bundle = bundle
                keys = {k.decode("utf-8", "backslashreplace"): [bundle.dtype(k).enum, list(bundle.shape(k))]
                        for k in bundle.keys()}
                values = {}
                for key in preload:
                    if key in bundle:
                        value = bundle.read(key)
                        values[key] = (_encode_strings(value).decode("ascii") if value.dtype == object
                                       else base64.b64encode(value.tobytes()).decode("ascii"))
                info = {"prefix": prefix, "keys": keys, "values": values,
                        "budget": int(budget or DEFAULT_INFLIGHT_BYTES)}
            except Exception as exc:  # every client learns of it (the others would wait otherwise)
                info = {"error": str(exc), "type": type(exc).__name__, "rank": io_rank}
                coordinator.broadcast(info, root=io_rank, timeout=timeout)
                self.close()
                raise
        info = coordinator.broadcast(info, root=io_rank, timeout=timeout)
        if "error" in info:
            raise _error_of(info)
        self.prefix: str = info["prefix"]
        self.index_path = self.prefix + ".index"
        self.budget: int = int(info["budget"])
        self._meta: Dict[str, Tuple[DType, Tuple[int, ...]]] = {
            k: (from_enum(int(d)), tuple(int(x) for x in s)) for k, (d, s) in info["keys"].items()}
        self._values: Dict[str, np.ndarray] = {}
        for key, text in info["values"].items():
            dt, shape = self._meta[key]
            if dt.is_numeric:
                self._values[key] = np.frombuffer(base64.b64decode(text), dtype=dt.numpy).reshape(shape).copy()
            else:
                self._values[key] = _decode_strings(text.encode("ascii"), shape)

    # -- metadata, as BundleReader ---------------------------------------------------------------
    @staticmethod
    def _name(key: Union[str, bytes]) -> str:
        return key.decode("utf-8", "backslashreplace") if isinstance(key, bytes) else key

    def _lookup(self, key: Union[str, bytes]) -> Tuple[DType, Tuple[int, ...]]:
        found = self._meta.get(self._name(key))
        if found is None:
            raise NotFoundError("key not found in checkpoint", path=self.prefix, key=key)
        return found

    def __contains__(self, key: Union[str, bytes]) -> bool:
        return self._name(key) in self._meta

    def keys(self, include_slices: bool = False) -> List[bytes]:
        """The tensors' keys (slice entries are not sent to the other clients)."""
        return [k.encode("utf-8") for k in sorted(self._meta)]

    def dtype(self, key: Union[str, bytes]) -> DType:
        return self._lookup(key)[0]

    def shape(self, key: Union[str, bytes]) -> Tuple[int, ...]:
        return self._lookup(key)[1]

    @contextmanager
    def deferred_verification(self) -> Iterator["FunnelledSource"]:
        yield self  # every check happens on the io client, before finish() returns

    def value(self, key: Union[str, bytes]) -> np.ndarray:
        """A preloaded value now; any other tensor is recorded and filled by :meth:`finish`."""
        value = self._values.get(self._name(key))
        if value is not None:
            return value.copy()
        return self.read_region(key)

    # -- reads: recorded ---------------------------------------------------------------------
    def reading(self, *, defer: bool) -> Any:
        return nullcontext(None)

    def read(self, read: Union[Read, str, bytes], session: Any = None, *, verify: bool = True) -> np.ndarray:
        """Record ``read`` (a :class:`~.plan.Read`; or a key: :meth:`value`); returns its destination,
        valid once :meth:`finish` has returned."""
        if not isinstance(read, Read):
            return self.value(read)
        if read.piece is not None:
            raise UnsupportedError("a funnelled restore reads regions of tensors, not stored pieces",
                                   path=self.prefix, key=read.key)
        return self.read_region(read.key, read.region, read.out)

    def after(self, follow_up: Callable[[], None]) -> None:
        """Run ``follow_up`` once :meth:`finish` has moved every recorded read's bytes (in order)."""
        self._follow_ups.append(follow_up)

    def read_region(self, key: Union[str, bytes], region: Region = None, out: Optional[np.ndarray] = None, *,
                    verify: bool = True, session: Any = None) -> np.ndarray:
        """Record a read of ``region`` of ``key`` into ``out`` (allocated when ``None``); returns ``out``,
        whose values are valid once :meth:`finish` has returned."""
        if self._done:
            raise UnsupportedError("this funnelled restore is complete; a value asked for later (e.g. an object "
                                   "attached after restore()) would need storage access: restore again",
                                   path=self.prefix, key=key)
        name = self._name(key)
        dt, shape = self._lookup(name)
        box = region_box(region, shape, self.prefix, name)
        region_shape = box_shape(box)
        if out is None:
            out = np.empty(region_shape, dtype=dt.numpy)
        elif tuple(out.shape) != region_shape or out.dtype != dt.numpy:
            raise InvalidArgumentError(f"destination has shape {list(out.shape)} and dtype {out.dtype}; "
                                       f"expected {list(region_shape)} and {dt.numpy}", path=self.prefix, key=name)
        self._reads.setdefault((name, box), []).append(out)
        return out

    # -- the exchange ------------------------------------------------------------------------
    def finish(self, error: Optional[BaseException] = None) -> None:
        """Steps 3-5: exchange the recorded reads, serve or receive them, agree on the outcome.

        ``error``: this client's planning failed (the others are told and raise; this call then
        returns without raising, so the caller re-raises its own error).
        """
        if self._done:
            return
        self._done = True
        coord = self._coord
        mine = sorted(self._reads)
        wire = [[k, [list(p) for p in box]] for k, box in mine]
        gathered = coord.all_gather({"ok": error is None, "error": "" if error is None else str(error),
                                     "reads": wire if error is None else []}, timeout=self._timeout)
        failed = [(r, g["error"]) for r, g in enumerate(gathered) if not g["ok"]]
        if failed:
            self.close()
            if error is not None:
                return
            detail = "; ".join(f"rank {r}: {e}" for r, e in failed)
            raise CoordinationError(f"funnelled restore of {self.prefix}: {len(failed)} of {coord.size} clients "
                                    f"failed while planning: {detail}")
        problem: Optional[BaseException] = None
        try:
            if coord.rank == self.io_rank:
                wanted: Dict[ReadKey, List[int]] = {}
                for rank, g in enumerate(gathered):
                    for key, box in g["reads"]:
                        wanted.setdefault((key, tuple((int(a), int(b)) for a, b in box)), []).append(rank)
                self._serve(wanted)
            else:
                self._receive(mine)
        except ShardckptError as exc:
            problem = exc
        finally:
            self.close()
        try:
            coord.agree(problem is None, "" if problem is None else f"{type(problem).__name__}: {problem}",
                        timeout=self._timeout)
        except CoordinationError:
            if problem is not None:
                raise problem from None
            raise
        follow_ups, self._follow_ups = self._follow_ups, []
        for follow_up in follow_ups:
            follow_up()

    def _copy_replicas(self, read: ReadKey) -> None:
        outs = self._reads[read]
        for other in outs[1:]:
            np.copyto(other, outs[0])

    def _header(self, key: str) -> np.ndarray:
        """A record header: status, payload bytes, inline (1) or in messages of its own (0), the index
        of the receiver's region of ``key`` it belongs to, the chunk's box (start, stop per dimension)."""
        return np.zeros(4 + 2 * len(self._meta[key][1]), dtype="<i8")

    def _receive(self, reads: List[ReadKey]) -> None:
        """[other clients] Key by key (in order): records until every region of the key is full."""
        inbox = _Inbox(self._coord, self.io_rank, self._timeout)
        by_key: Dict[str, List[ReadKey]] = {}
        for read in reads:
            by_key.setdefault(read[0], []).append(read)
        for key in sorted(by_key):
            regions = by_key[key]
            dt, _ = self._meta[key]
            left = [box_volume(box) for _, box in regions]
            while any(left):
                header = np.frombuffer(inbox.take(self._header(key).nbytes), dtype="<i8")
                if int(header[0]) != _OK:
                    raise CoordinationError(f"the io client (rank {self.io_rank}) failed to read {key!r} "
                                            "(its error is reported by every client)")
                size, inline, index = int(header[1]), bool(header[2]), int(header[3])
                if not 0 <= index < len(regions):
                    raise CoordinationError(f"funnelled restore: record for region {index} of {key!r}, "
                                            f"this client has {len(regions)}")
                box = regions[index][1]
                dest = self._reads[regions[index]][0]
                sub = tuple((int(header[4 + 2 * d]), int(header[5 + 2 * d])) for d in range(len(box)))
                if not dt.is_numeric:
                    payload = inbox.take(size) if inline else inbox.receive(size, None, self.budget)
                    dest[...] = _decode_strings(bytes(payload), dest.shape)
                    left[index] = 0
                    self.received += size
                    continue
                part = _view(dest, sub, box)
                if size != part.nbytes or box_volume(sub) > left[index] or sub != _clip(sub, box):
                    raise CoordinationError(f"funnelled restore: chunk {list(sub)} of {key!r} does not fit region "
                                            f"{list(box)}")
                if inline:
                    part[...] = np.frombuffer(inbox.take(size), dtype=part.dtype).reshape(part.shape)
                else:
                    target = part if part.flags.c_contiguous else np.empty(part.shape, dtype=part.dtype)
                    inbox.receive(size, byte_view(target), self.budget)
                    if target is not part:
                        part[...] = target
                left[index] -= box_volume(sub)
                self.received += size
            for read in regions:
                self._copy_replicas(read)

    def _plan_key(self, key: str, regions: List[Box]) -> Iterator["_Job"]:
        """[io client] The reads of one key: each stored piece that the wanted regions cover exactly is
        read whole and verified (in sub-boxes with a running CRC when larger than the budget) and
        cut for every region; the parts of the other pieces are read per region, as region reads."""
        bundle = self._bundle
        assert bundle is not None
        dt, _ = self._meta[key]
        if not dt.is_numeric:
            for box in regions:
                yield _Job(key, box, np.empty(box_shape(box), dtype=object), 0, [box], None)
            return
        assert dt.itemsize is not None
        pieces = bundle.pieces(key)
        for box in regions:
            parts = [c for c in (intersect(p.box, box) for p in pieces) if c is not None]
            if box_volume(box) > 0:
                problem = boxes_tile(parts, box)
                if problem is not None:
                    raise NotFoundError(f"does not have sufficient slices for region {list(box)}: {problem}",
                                        path=self.prefix, key=key)
        for piece in pieces:
            commons = sorted({c for c in (intersect(piece.box, box) for box in regions) if c is not None})
            if not commons:
                continue
            if boxes_tile(commons, piece.box) is None:  # needed whole, each byte once: read it whole
                chunks = chunk_boxes(piece.box, dt.itemsize, self.budget)
                check = _Check(piece, bundle.big_endian, chunks[-1]) if len(chunks) > 1 else None
                for sub in chunks:
                    buffer = np.empty(box_shape(sub), dtype=dt.numpy)
                    yield _Job(key, sub, buffer, buffer.nbytes, regions, check)
                continue
            for common in commons:  # each for the regions whose part of the piece it is
                takers = [box for box in regions if intersect(piece.box, box) == common]
                for sub in chunk_boxes(common, dt.itemsize, self.budget):
                    buffer = np.empty(box_shape(sub), dtype=dt.numpy)
                    yield _Job(key, sub, buffer, buffer.nbytes, takers, None)

    def _serve(self, wanted: Dict[ReadKey, List[int]]) -> None:
        """[io client] Read what the wanted regions need once; send every other client its parts."""
        bundle = self._bundle
        assert bundle is not None
        coord, me = self._coord, self._coord.rank
        told: set = set()  # clients told that the io client failed (they stop receiving)
        state: Dict[str, Any] = {"problem": None, "held": 0}
        keys: Dict[str, List[Box]] = {}
        index: Dict[Tuple[int, str, Box], int] = {}  # (rank, key, box) -> the rank's region number in the key
        for read in sorted(wanted):
            keys.setdefault(read[0], []).append(read[1])
        for r in range(coord.size):
            counts: Dict[str, int] = {}
            for key, box in sorted(read for read, ranks in wanted.items() if r in ranks):
                index[(r, key, box)] = counts.get(key, 0)
                counts[key] = counts.get(key, 0) + 1
        receivers = sorted({r for ranks in wanted.values() for r in ranks if r != me})
        outboxes = {r: _Outbox(coord, r, max(1, self.budget // (4 * max(1, len(receivers)))), self.budget)
                    for r in receivers}

        def fail(exc: BaseException) -> None:
            if state["problem"] is None:
                state["problem"] = exc

        def jobs() -> Iterator[_Job]:
            for key in sorted(keys):
                try:
                    yield from self._plan_key(key, keys[key])
                except ShardckptError as exc:  # e.g. a corrupt entry: the others are told below
                    fail(exc)
                    yield _Job(key, keys[key][0], np.empty(0), 0, keys[key], None)

        def read_job(job: _Job) -> None:
            bundle.read_region(job.key, job.sub, out=job.into)

        def send(job: _Job, future: "Future[None]") -> None:
            if state["problem"] is None:
                try:
                    future.result()
                    if job.check is not None:
                        job.check.add(job.into, job.sub, bundle.data_path(job.check.piece.entry.shard_id))
                except ShardckptError as exc:
                    fail(exc)
            if state["problem"] is not None:
                header = self._header(job.key)
                header[0] = _FAILED
                for box in job.regions:
                    for r in wanted[(job.key, box)]:
                        if r != me and r not in told:
                            outboxes[r].add(header, None)
                            outboxes[r].flush()
                            told.add(r)
                return
            numeric = self._meta[job.key][0].is_numeric
            for box in job.regions:
                common = intersect(job.sub, box) if numeric else box
                if common is None:
                    continue
                data = job.into[_local(common, job.sub)] if numeric else job.into
                ranks = wanted[(job.key, box)]
                if me in ranks:
                    own = self._reads[(job.key, box)][0]
                    _view(own, common, box)[...] = data
                others = [r for r in ranks if r != me and r not in told]
                if not others:
                    continue
                payload = byte_view(np.ascontiguousarray(data)) if numeric else memoryview(_encode_strings(data))
                header = self._header(job.key)
                header[1] = len(payload)
                header[4:] = np.asarray(common, dtype="<i8").reshape(-1)
                for r in others:
                    header[3] = index[(r, job.key, box)]
                    outboxes[r].add(header, payload)

        pending: Deque[Tuple[_Job, "Future[None]"]] = deque()
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardckpt-funnel") as pool:
            for job in jobs():
                while pending and state["held"] + job.size > self.budget:
                    done, future = pending.popleft()
                    state["held"] -= done.size
                    send(done, future)
                if state["problem"] is not None:
                    future = Future()
                    future.set_result(None)  # nothing more is read: "failed" headers go out
                else:
                    future = pool.submit(read_job, job)
                pending.append((job, future))
                state["held"] += job.size
            while pending:
                done, future = pending.popleft()
                state["held"] -= done.size
                send(done, future)
        for outbox in outboxes.values():
            outbox.flush()
        for (key, box), ranks in wanted.items():
            if me in ranks and state["problem"] is None:
                self._copy_replicas((key, box))
        if state["problem"] is not None:
            raise state["problem"]

    def close(self) -> None:
        if self._bundle is not None:
            self._bundle.close()
            self._bundle = None


class _Outbox:
    """[io client] Records for one client, sent in batches: small payloads ride in the batch (one
    message for its length, one for the batch), a payload over ``cap`` follows the batch that holds
    its header as messages of its own (of at most ``piece`` bytes), received in place."""

    def __init__(self, coord: Coordinator, dst: int, cap: int, piece: int) -> None:
        self.coord, self.dst, self.cap, self.piece = coord, dst, cap, piece
        self.parts: List[bytes] = []
        self.size = 0

    def add(self, header: np.ndarray, payload: Optional[memoryview]) -> None:
        inline = payload is None or len(payload) <= self.cap
        header[2] = 1 if inline else 0
        self.parts.append(header.tobytes())
        self.size += header.nbytes
        if payload is not None and inline:
            self.parts.append(bytes(payload))
            self.size += len(payload)
        if not inline:
            assert payload is not None
            self.flush()
            for a in range(0, len(payload), self.piece):
                self.coord.send_bytes(payload[a:a + self.piece], self.dst, tag=_TAG)
        elif self.size >= self.cap:
            self.flush()

    def flush(self) -> None:
        if not self.parts:
            return
        blob = b"".join(self.parts)
        self.parts, self.size = [], 0
        self.coord.send_bytes(memoryview(np.array([len(blob)], dtype="<i8").tobytes()), self.dst, tag=_TAG)
        self.coord.send_bytes(memoryview(blob), self.dst, tag=_TAG)


class _Inbox:
    """[other clients] The batches of :class:`_Outbox`, taken record by record."""

    def __init__(self, coord: Coordinator, src: int, timeout: Optional[float]) -> None:
        self.coord, self.src, self.timeout = coord, src, timeout
        self.batch = memoryview(b"")
        self.pos = 0

    def take(self, n: int) -> memoryview:
        """The next ``n`` bytes of the current batch (a new batch is received when it is used up)."""
        if self.pos >= len(self.batch):
            length = np.zeros(1, dtype="<i8")
            self.coord.recv_bytes(self.src, 8, byte_view(length), tag=_TAG, timeout=self.timeout)
            size = int(length[0])
            if not 0 < size <= 1 << 40:
                raise CoordinationError(f"funnelled restore: bad batch length {size} from the io client")
            self.batch = self.coord.recv_bytes(self.src, size, None, tag=_TAG, timeout=self.timeout)
            self.pos = 0
        if self.pos + n > len(self.batch):
            raise CoordinationError("funnelled restore: a record runs past its batch")
        out = self.batch[self.pos:self.pos + n]
        self.pos += n
        return out

    def receive(self, size: int, into: Optional[memoryview], piece: int) -> memoryview:
        """A payload sent in messages of its own (after the batch holding its header was used up)."""
        if self.pos != len(self.batch):
            raise CoordinationError("funnelled restore: a payload of its own before the batch was used up")
        buf = into if into is not None else memoryview(bytearray(size))
        for a in range(0, size, piece):
            view = buf[a:a + piece]
            self.coord.recv_bytes(self.src, len(view), view, tag=_TAG, timeout=self.timeout)
        return buf


def _clip(sub: Box, box: Box) -> Box:
    return tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(sub, box))


class _Job:
    """[io client] One read: the key, the box read, the array it lands in, the bytes of buffer it
    holds, the wanted regions of the key (each gets its part), its piece's running check."""

    __slots__ = ("key", "sub", "into", "size", "regions", "check")

    def __init__(self, key: str, sub: Box, into: np.ndarray, size: int, regions: List[Box],
                 check: Optional["_Check"]) -> None:
        self.key, self.sub, self.into, self.size, self.regions, self.check = key, sub, into, size, regions, check


class _Check:
    """The CRC32C of a stored piece read in sub-boxes (in storage order), compared after the last one."""

    def __init__(self, piece: Any, big_endian: bool, last: Box) -> None:
        self.piece = piece
        self.big_endian = big_endian
        self.value = 0
        self.last = last

    def add(self, values: np.ndarray, sub: Box, path: str) -> None:
        stored = values.byteswap() if self.big_endian and values.dtype.itemsize > 1 else values
        self.value = crc.extend(self.value, byte_view(np.ascontiguousarray(stored)))
        if sub == self.last:
            expected = crc.unmask(self.piece.entry.crc32c)
            if self.value != expected:
                raise DataLossError(f"checksum does not match: stored 0x{expected:08x}, computed "
                                    f"0x{self.value:08x}", path=path, **self.piece.where())


def _view(arr: np.ndarray, sub: Box, box: Box) -> np.ndarray:
    """The part of ``arr`` (which holds ``box``) that holds ``sub`` (a view, also for 0-d arrays)."""
    index = _local(sub, box)
    return arr[index] if index else arr[...]


FunnelledReader = FunnelledSource  # the name it had as a reader's face


def funnelled_reader(save_path: str, options: Any, coordinator: Coordinator, *,
                     resolve: Optional[Callable[[str], str]] = None,
                     preload: Sequence[str] = ()) -> Optional[FunnelledSource]:
    """A :class:`FunnelledSource` when ``options.io_device`` is set and there are several clients, else ``None``.

    ``options`` is a :class:`~shardckpt.saving.options.CheckpointOptions`; collective when it
    returns a reader.
    """
    if options is None or options.io_device is None or coordinator.size == 1:
        return None
    return FunnelledSource(save_path, coordinator, io_rank_of(options, coordinator.size),
                           budget=options.funnel_inflight_bytes, timeout=options.timeout, resolve=resolve,
                           preload=preload)


def run_funnelled(reader: FunnelledSource, plan: Callable[[FunnelledSource], Any]) -> Any:
    """Run ``plan(reader)`` (which records reads), then the exchange; ``plan``'s result once values are in.

    A failure in ``plan`` is told to the other clients (which raise) and re-raised here.
    """
    with collective_call(reader):
        result = plan(reader)
    return result
