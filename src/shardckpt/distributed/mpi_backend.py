"""``MPICoordinator``: the coordinator over MPI (mpi4py).

The coordinator duplicates the communicator it is given (``COMM_WORLD`` by
default) twice: one duplicate carries the collectives and ``send_bytes`` /
``recv_bytes``, the other the barrier protocol, so neither can match a message
of the user's (or of each other). Only mpi4py's buffer-based (upper-case)
methods are used: the lower-case ones pickle.

* ``all_gather``: JSON bytes; ``Iallgather`` of the lengths, then
  ``Iallgatherv`` of the bytes. ``gather``: ``Igather`` of the lengths to the
  root, then ``Igatherv`` of the bytes. ``broadcast``: ``Ibcast`` of the length, then
  of the bytes. Both poll their requests (``Test``, short sleeps) until the
  deadline. A collective request cannot be cancelled, so a collective that
  times out marks the coordinator unusable (later calls raise
  :class:`CoordinationError`).
* ``send_bytes`` / ``recv_bytes``: ``Send`` / ``Irecv`` on the caller's buffer
  (no copy), in chunks of at most 1 GiB (MPI counts are C ints). A receive
  that times out is cancelled (``MPI_Cancel``) and the coordinator stays
  usable, unless part of a chunked message had already arrived.
* ``send_many`` / ``recv_many``: the same messages, up to four posted at once
  (``Isend`` / ``Irecv``; MPI matches the receives in the order they are posted),
  so that a stream of messages does not pay a round trip for each one. A
  ``recv_many`` that times out cancels what it posted; the coordinator stays
  usable when nothing of the call had arrived yet.
* ``barrier``: MPI has no barrier with a timeout, so the arrival protocol of
  :mod:`.barrier`, its notices carried as JSON bytes (with the barrier's sequence
  number) by ``Isend`` on the barrier communicator, one tag; the sends are never
  waited for (their buffers are kept until they complete). A rank probes
  (``Iprobe`` from any source) and receives what is there: notices of a later
  barrier are kept until this rank reaches it, those of an earlier one (a failed
  barrier's, arriving late) are dropped. A barrier that times out leaves the
  coordinator usable.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .._extras import install_hint
from ..errors import InvalidArgumentError
from .coordinator import CoordinationError, CoordinationTimeout, check_timeout, decode, encode
from .engine import IN_FLIGHT, EngineCoordinator, keep_posted

__all__ = ["MPICoordinator"]

_CHUNK = 1 << 30  # bytes per MPI message (MPI counts are C ints)
_TAG_BARRIER = 1  # the barrier communicator's one tag
_LEFTOVERS: List[Tuple[Any, Any]] = []


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - exercised only without mpi4py
        raise CoordinationError(f"the MPI coordinator needs mpi4py and an MPI library "
                                f"({install_hint('mpi')}): {e}") from e
    return MPI


def _byte_view(data: Any) -> memoryview:
    mv = memoryview(data)
    if not mv.contiguous:
        raise InvalidArgumentError("buffer must be contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class MPICoordinator(EngineCoordinator):
    """Coordinate the ranks of ``comm`` (default: ``MPI.COMM_WORLD``) over MPI.

    ``comm``: an mpi4py intracommunicator of the user's; the coordinator works
    on duplicates of it (``Dup`` is collective: every rank of ``comm`` must
    construct the coordinator). ``timeout`` (seconds): the default of every call
    (``None``: ``$SHARDCKPT_TIMEOUT``, else 600 s).
    """

    _engine = "MPI"
    _channel = "the barrier communicator"

    def __init__(self, comm: Any = None, timeout: Optional[float] = None) -> None:
        MPI = _import_mpi()
        self._MPI = MPI
        self._timeout = check_timeout(timeout)
        base = MPI.COMM_WORLD if comm is None else comm
        try:
            self._comm = base.Dup()
            self._ctl = base.Dup()
        except Exception as e:
            raise CoordinationError(f"could not duplicate the MPI communicator: {e}") from e
        self._rank = self._comm.Get_rank()
        self._size = self._comm.Get_size()
        self._tag_ub = int(self._comm.Get_attr(MPI.TAG_UB) or 32767)
        self._failed: Optional[str] = None
        self._collectives = 0  # collectives waited for, counted alike on every client (names a failed one)
        self._barrier_seq = 0
        # Requests (and their buffers) that must outlive the call that started them.
        self._inflight: List[Tuple[Any, Any]] = []
        # Barrier notices that arrived ahead of their barrier: seq -> notices, in arrival order.
        self._early: Dict[int, List[Dict[str, Any]]] = {}

    # -- properties -------------------------------------------------------------------------------------------



    @property
    def backend(self) -> str:
        return "mpi"


    @property
    def comm(self) -> Any:
        """The coordinator's own communicator (a duplicate, never the user's)."""
        return self._comm

    def clone(self) -> "MPICoordinator":
        """The same ranks on duplicates of this communicator (collective)."""
        return MPICoordinator(comm=self._comm, timeout=self._timeout)

    # -- helpers ----------------------------------------------------------------------------------------------




    def _check_tag(self, tag: int) -> None:
        if not isinstance(tag, int) or not 0 <= tag <= self._tag_ub:
            raise InvalidArgumentError(f"tag {tag!r} out of range [0, {self._tag_ub}]")

    def _prune(self) -> None:
        self._inflight = [(req, buf) for req, buf in self._inflight if not req.Test()]

    def _poll(self, req: Any, deadline: float, status: Any = None) -> bool:
        """Drive ``req`` until it completes (True) or ``deadline`` passes (False)."""
        delay = 0.0001
        while not req.Test(status):
            if time.monotonic() >= deadline:
                return req.Test(status)
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
        return True

    def _collective(self, req: Any, bufs: Any, deadline: float, what: str, timeout: Optional[float]) -> None:
        self._collectives += 1
        number = self._collectives
        try:
            done = self._poll(req, deadline)
        except self._MPI.Exception as e:
            self._failed = f"{what} failed"
            raise CoordinationError(f"rank {self._rank}: {what} failed: {e}") from e
        if not done:
            self._inflight.append((req, bufs))  # cannot be cancelled: keep its buffers alive
            shown = self._timeout if timeout is None else timeout
            # a barrier on the barrier communicator, not the stuck one
            missing, late = self._probe(shown, number)
            self._failed = f"{what} timed out"
            if late:
                raise CoordinationTimeout(f"rank {self._rank}: {what} did not complete within {shown:g} s: this "
                                          "rank arrived after the other clients had given up waiting for it "
                                          "(they timed out)", missing=sorted({self._rank, *missing}))
            who = (f"rank(s) {missing} did not take part" if missing
                   else "some client did not take part, or is too slow")
            raise CoordinationTimeout(f"rank {self._rank}: {what} did not complete within {shown:g} s ({who})",
                                      missing=missing)

    # -- collectives ------------------------------------------------------------------------------------------

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        self._check()
        MPI = self._MPI
        deadline = self._deadline(timeout)
        payload = encode(obj)
        if self._size == 1:
            return [decode(payload)]
        mine = np.array([len(payload)], dtype=np.int64)
        lengths = np.zeros(self._size, dtype=np.int64)
        req = self._comm.Iallgather([mine, MPI.INT64_T], [lengths, MPI.INT64_T])
        self._collective(req, (mine, lengths), deadline, "all_gather (lengths)", timeout)
        if int(lengths.sum()) > 2**31 - 1:
            raise InvalidArgumentError(f"all_gather of {int(lengths.sum())} bytes: objects are too large")
        counts, displs = _counts_and_displacements(lengths)
        send = np.frombuffer(payload, dtype=np.uint8)
        recv = np.empty(sum(counts), dtype=np.uint8)
        req = self._comm.Iallgatherv([send, MPI.BYTE], [recv, counts, displs, MPI.BYTE])
        self._collective(req, (send, recv), deadline, "all_gather", timeout)
        return _decode_parts(recv, counts, displs, "all_gather")

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        self._check()
        self._check_peer(root, "gather root")
        MPI = self._MPI
        deadline = self._deadline(timeout)
        payload = encode(obj)
        if self._size == 1:
            return [decode(payload)]
        is_root = self._rank == root
        mine = np.array([len(payload)], dtype=np.int64)
        lengths = np.zeros(self._size, dtype=np.int64) if is_root else None
        req = self._comm.Igather([mine, MPI.INT64_T], [lengths, MPI.INT64_T] if is_root else None, root=root)
        self._collective(req, (mine, lengths), deadline, f"gather to rank {root} (lengths)", timeout)
        send = np.frombuffer(payload, dtype=np.uint8)
        if not is_root:
            req = self._comm.Igatherv([send, MPI.BYTE], None, root=root)
            self._collective(req, send, deadline, f"gather to rank {root}", timeout)
            return None
        assert lengths is not None
        if int(lengths.sum()) > 2**31 - 1:  # the others' Igatherv then waits until its timeout
            self._failed = "gather of too many bytes"
            raise InvalidArgumentError(f"gather of {int(lengths.sum())} bytes: objects are too large")
        counts, displs = _counts_and_displacements(lengths)
        recv = np.empty(sum(counts), dtype=np.uint8)
        req = self._comm.Igatherv([send, MPI.BYTE], [recv, counts, displs, MPI.BYTE], root=root)
        self._collective(req, (send, recv), deadline, f"gather to rank {root}", timeout)
        return _decode_parts(recv, counts, displs, "gather")

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        self._check()
        self._check_peer(root, "broadcast root")
        MPI = self._MPI
        deadline = self._deadline(timeout)
        if self._size == 1:
            return decode(encode(obj))
        payload = encode(obj) if self._rank == root else b""
        length = np.array([len(payload)], dtype=np.int64)
        req = self._comm.Ibcast([length, MPI.INT64_T], root=root)
        self._collective(req, length, deadline, f"broadcast from rank {root} (length)", timeout)
        n = int(length[0])
        if n > 2**31 - 1:
            raise InvalidArgumentError(f"broadcast of {n} bytes: object is too large")
        buf = bytearray(payload) if self._rank == root else bytearray(n)
        req = self._comm.Ibcast([buf, MPI.BYTE], root=root)
        self._collective(req, buf, deadline, f"broadcast from rank {root}", timeout)
        try:
            return decode(bytes(buf))
        except ValueError as e:
            raise CoordinationError(f"broadcast: rank {root} sent data that is not JSON: {e}") from e

    # -- point to point ---------------------------------------------------------------------------------------

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        self._check()
        self._check_peer(dst, "send destination")
        self._check_tag(tag)
        mv = _byte_view(data)
        MPI = self._MPI
        try:
            for start in range(0, mv.nbytes, _CHUNK):
                self._comm.Send([mv[start:start + _CHUNK], MPI.BYTE], dst, tag)
        except MPI.Exception as e:
            self._failed = f"send to rank {dst} failed"
            raise CoordinationError(f"rank {self._rank}: sending {mv.nbytes} bytes to rank {dst} failed: {e}") from e

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        self._check()
        self._check_peer(src, "receive source")
        self._check_tag(tag)
        if nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes}")
        MPI = self._MPI
        deadline = self._deadline(timeout)
        mv = _byte_view(bytearray(nbytes) if out is None else out)
        if mv.readonly:
            raise InvalidArgumentError("receive buffer is read-only")
        if mv.nbytes < nbytes:
            raise InvalidArgumentError(f"receive buffer holds {mv.nbytes} bytes, {nbytes} expected")
        mv = mv[:nbytes]
        for start in range(0, nbytes, _CHUNK):
            piece = mv[start:start + _CHUNK]
            status = MPI.Status()
            try:
                req = self._comm.Irecv([piece, MPI.BYTE], src, tag)
                done = self._poll(req, deadline, status)
                if not done:
                    req.Cancel()
                    req.Wait(status)
                    done = not status.Is_cancelled()
            except MPI.Exception as e:
                self._failed = f"receive from rank {src} failed"
                raise CoordinationError(f"rank {self._rank}: receiving {nbytes} bytes from rank {src} "
                                        f"failed: {e}") from e
            if not done:
                if start:
                    self._failed = f"receive from rank {src} timed out mid-message"
                shown = self._timeout if timeout is None else timeout
                raise CoordinationTimeout(f"rank {self._rank}: no message of {nbytes} bytes (tag {tag}) from "
                                          f"rank {src} within {shown:g} s", missing=[src])
            got = status.Get_count(MPI.BYTE)
            if got != piece.nbytes:
                self._failed = f"short message from rank {src}"
                raise CoordinationError(f"rank {self._rank}: rank {src} sent {got} bytes where "
                                        f"{piece.nbytes} were expected (tag {tag})")
        return mv

    def send_many(self, buffers: Sequence[memoryview], dst: int, tag: int = 0) -> None:
        """Up to :data:`IN_FLIGHT` messages posted at once (``Isend``), in order."""
        self._check()
        self._check_peer(dst, "send destination")
        self._check_tag(tag)
        MPI = self._MPI
        views = [_byte_view(buffer) for buffer in buffers]
        try:
            keep_posted((self._comm.Isend([mv[start:start + _CHUNK], MPI.BYTE], dst, tag)
                         for mv in views for start in range(0, mv.nbytes, _CHUNK)), lambda request: request.Wait())
        except MPI.Exception as e:
            self._failed = f"send to rank {dst} failed"
            raise CoordinationError(f"rank {self._rank}: sending to rank {dst} failed: {e}") from e

    def recv_many(self, src: int, outs: Sequence[memoryview], tag: int = 0, timeout: Optional[float] = None,
                  landed: Optional[Callable[[int], None]] = None) -> None:
        """Up to :data:`IN_FLIGHT` receives posted ahead (``Irecv``); ``landed(i)`` as message ``i`` completes."""
        self._check()
        self._check_peer(src, "receive source")
        self._check_tag(tag)
        MPI = self._MPI
        deadline = self._deadline(timeout)
        pieces: List[Tuple[int, memoryview, bool]] = []  # (message, piece, last piece of the message)
        for i, out in enumerate(outs):
            mv = _byte_view(out)
            if mv.readonly:
                raise InvalidArgumentError(f"receive buffer {i} is read-only")
            starts = range(0, mv.nbytes, _CHUNK) or range(1)  # an empty message: nothing travels
            pieces.extend((i, mv[start:start + _CHUNK], start == starts[-1]) for start in starts)
        posted: Deque[Tuple[int, memoryview, bool, Any, Any]] = deque()
        arrived = 0  # pieces of this call that completed

        def give_up() -> None:
            nonlocal arrived
            for _, _, _, req, status in posted:
                if req is None:
                    continue
                req.Cancel()
                req.Wait(status)
                if not status.Is_cancelled():
                    arrived += 1
            if arrived:
                self._failed = f"receive from rank {src} timed out mid-stream"
            shown = self._timeout if timeout is None else timeout
            raise CoordinationTimeout(f"rank {self._rank}: the stream of {len(outs)} messages (tag {tag}) from "
                                      f"rank {src} stopped within {shown:g} s", missing=[src])

        def complete() -> None:
            nonlocal arrived
            i, piece, last, req, status = posted[0]
            if req is not None:
                if not self._poll(req, deadline, status):
                    give_up()
                got = status.Get_count(MPI.BYTE)
                arrived += 1
                if got != piece.nbytes:
                    self._failed = f"short message from rank {src}"
                    raise CoordinationError(f"rank {self._rank}: rank {src} sent {got} bytes where "
                                            f"{piece.nbytes} were expected (message {i}, tag {tag})")
            posted.popleft()
            if last and landed is not None:
                landed(i)

        try:
            for i, piece, last in pieces:
                if piece.nbytes:
                    status = MPI.Status()
                    posted.append((i, piece, last, self._comm.Irecv([piece, MPI.BYTE], src, tag), status))
                else:
                    posted.append((i, piece, last, None, None))
                if len(posted) >= IN_FLIGHT:
                    complete()
            while posted:
                complete()
        except MPI.Exception as e:
            self._failed = f"receive from rank {src} failed"
            raise CoordinationError(f"rank {self._rank}: receiving from rank {src} failed: {e}") from e

    # -- barrier transport (the protocol is in .barrier) ------------------------------------------------------

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        self._prune()  # sends of earlier barriers' notices that have completed
        super().barrier(name, timeout)

    def _post(self, seq: int, notice: Dict[str, Any], to: Optional[int]) -> None:
        buf = bytearray(encode(dict(notice, seq=seq)))
        for dst in ([to] if to is not None else [r for r in range(self._size) if r != self._rank]):
            req = self._ctl.Isend([buf, self._MPI.BYTE], dst, _TAG_BARRIER)
            self._inflight.append((req, buf))

    def _take(self, seq: int) -> List[Dict[str, Any]]:
        MPI = self._MPI
        notices = self._early.pop(seq, [])
        status = MPI.Status()
        while self._ctl.Iprobe(MPI.ANY_SOURCE, _TAG_BARRIER, status):
            buf = bytearray(status.Get_count(MPI.BYTE))
            self._ctl.Recv([buf, MPI.BYTE], status.Get_source(), _TAG_BARRIER)
            try:
                notice = decode(bytes(buf))
                nseq = int(notice["seq"])
            except (ValueError, KeyError, TypeError):
                continue
            if nseq == seq:
                notices.append(notice)
            elif nseq > seq:  # a barrier this rank has not reached yet
                self._early.setdefault(nseq, []).append(notice)
            # nseq < seq: left over from a barrier that failed; dropped
        return notices

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the coordinator's communicators (collective: every rank calls it)."""
        if self._failed is None:
            self._failed = "closed"
        self._prune()
        # Requests still pending (a verdict for a rank that never came, a collective that timed out) cannot
        # all be cancelled; their buffers must stay alive until the process ends.
        _LEFTOVERS.extend(self._inflight)
        self._inflight = []
        for comm in (getattr(self, "_comm", None), getattr(self, "_ctl", None)):
            if comm is not None:
                try:
                    comm.Free()
                except Exception:  # pragma: no cover
                    pass
        self._comm = self._ctl = None


def _counts_and_displacements(lengths: Any) -> Tuple[List[int], List[int]]:
    """Per-rank byte counts and their start offsets in the received buffer."""
    counts = [int(n) for n in lengths]
    displs = [0] * len(counts)
    for r in range(1, len(counts)):
        displs[r] = displs[r - 1] + counts[r - 1]
    return counts, displs


def _decode_parts(recv: Any, counts: List[int], displs: List[int], what: str) -> List[Any]:
    """Each rank's part of ``recv``, decoded, in rank order."""
    result = []
    for r, (start, n) in enumerate(zip(displs, counts)):
        try:
            result.append(decode(recv[start:start + n].tobytes()))
        except ValueError as e:
            raise CoordinationError(f"{what}: rank {r} sent data that is not JSON: {e}") from e
    return result
