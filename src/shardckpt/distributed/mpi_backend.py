"""``MPICoordinator``: the coordinator over MPI (mpi4py).

The coordinator duplicates the communicator it is given (``COMM_WORLD`` by
default) twice: one duplicate carries the collectives and ``send_bytes`` /
``recv_bytes``, the other the barrier protocol, so neither can match a message
of the user's (or of each other). Only mpi4py's buffer-based (upper-case)
methods are used: the lower-case ones pickle.

* ``all_gather``: JSON bytes; ``Iallgather`` of the lengths, then
  ``Iallgatherv`` of the bytes. ``broadcast``: ``Ibcast`` of the length, then
  of the bytes. Both poll their requests (``Test``, short sleeps) until the
  deadline. A collective request cannot be cancelled, so a collective that
  times out marks the coordinator unusable (later calls raise
  :class:`CoordinationError`).
* ``send_bytes`` / ``recv_bytes``: ``Send`` / ``Irecv`` on the caller's buffer
  (no copy), in chunks of at most 1 GiB (MPI counts are C ints). A receive
  that times out is cancelled (``MPI_Cancel``) and the coordinator stays
  usable, unless part of a chunked message had already arrived.
* ``barrier``: MPI has no barrier with a timeout, so an arrival protocol on the
  barrier communicator, every message JSON bytes carrying the barrier's
  sequence number (stale ones are dropped):

  1. every non-root rank sends ``arrive`` (with the barrier's name) to rank 0;
  2. rank 0, on arriving, sends ``here`` to every rank, then collects
     ``arrive`` messages until every rank has arrived or its deadline passes;
  3. rank 0 sends every rank the verdict: ok, the missing ranks, or the ranks
     that are at a barrier of another name;
  4. a non-root rank waits for ``here`` until its deadline, then (rank 0 has
     arrived) for the verdict until rank 0's deadline plus a grace period.
     If ``here`` never comes it sends ``withdraw`` to rank 0 and waits a grace
     period for a verdict: one that comes is obeyed (a rank 0 that was only a
     little late has either seen the withdrawal, so everyone fails naming rank
     0, or not, so everyone passes); otherwise it raises naming rank 0.

  The verdict goes to late ranks as well, so a rank that arrives after the
  deadline raises at once, naming itself. Either every rank passes or every
  rank raises, with the same ``missing`` list (unless rank 0 itself is
  missing, or much later than the grace period). A barrier that times out
  leaves the coordinator usable.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from .coordinator import (
    DEFAULT_TIMEOUT,
    CoordinationError,
    CoordinationTimeout,
    EngineCoordinator,
    decode,
    encode,
)

__all__ = ["MPICoordinator"]

_CHUNK = 1 << 30  # bytes per MPI message (MPI counts are C ints)
_TAG_TO_ROOT = 1  # barrier communicator: arrive / withdraw
_TAG_FROM_ROOT = 2  # barrier communicator: here / verdict
_GRACE_MIN = 1.0
_GRACE_FRACTION = 0.1
_LEFTOVERS: List[Tuple[Any, Any]] = []


def _import_mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - exercised only without mpi4py
        raise CoordinationError(f"the MPI coordinator needs mpi4py and an MPI library "
                                f"(pip install 'shardckpt[mpi]'): {e}") from e
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
    construct the coordinator). ``timeout`` (seconds): the default of every call.
    """

    _engine = "MPI"

    def __init__(self, comm: Any = None, timeout: float = DEFAULT_TIMEOUT) -> None:
        MPI = _import_mpi()
        self._MPI = MPI
        if not timeout or timeout <= 0:
            raise InvalidArgumentError(f"coordinator timeout must be positive, got {timeout!r}")
        self._timeout = float(timeout)
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
        # Barrier messages that arrived ahead of their barrier: (src, seq) -> message.
        self._early: Dict[Tuple[int, int], List[Dict[str, Any]]] = {}

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
            missing = self._probe_missing(shown, number)
            self._failed = f"{what} timed out"
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
        counts = [int(n) for n in lengths]
        displs = [0] * self._size
        for r in range(1, self._size):
            displs[r] = displs[r - 1] + counts[r - 1]
        send = np.frombuffer(payload, dtype=np.uint8)
        recv = np.empty(sum(counts), dtype=np.uint8)
        req = self._comm.Iallgatherv([send, MPI.BYTE], [recv, counts, displs, MPI.BYTE])
        self._collective(req, (send, recv), deadline, "all_gather", timeout)
        result = []
        for r in range(self._size):
            try:
                result.append(decode(recv[displs[r]:displs[r] + counts[r]].tobytes()))
            except ValueError as e:
                raise CoordinationError(f"all_gather: rank {r} sent data that is not JSON: {e}") from e
        return result

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

    # -- barrier ----------------------------------------------------------------------------------------------

    def _post(self, msg: Dict[str, Any], dst: int, tag: int) -> None:
        buf = bytearray(encode(msg))
        req = self._ctl.Isend([buf, self._MPI.BYTE], dst, tag)
        self._inflight.append((req, buf))

    def _take(self, src: int, tag: int, seq: int) -> Optional[Tuple[int, Dict[str, Any]]]:
        """One barrier message of barrier ``seq`` (from ``src``, or any source), if one is waiting."""
        MPI = self._MPI
        for key in list(self._early):
            if key[1] == seq and (src == MPI.ANY_SOURCE or key[0] == src) and self._early[key]:
                msg = self._early[key].pop(0)
                if not self._early[key]:
                    del self._early[key]
                return key[0], msg
        status = MPI.Status()
        while self._ctl.Iprobe(src, tag, status):
            n = status.Get_count(MPI.BYTE)
            origin = status.Get_source()
            buf = bytearray(n)
            self._ctl.Recv([buf, MPI.BYTE], origin, tag)
            try:
                msg = decode(bytes(buf))
                mseq = int(msg["seq"])
            except (ValueError, KeyError, TypeError):
                continue
            if mseq == seq:
                return origin, msg
            if mseq > seq:
                self._early.setdefault((origin, mseq), []).append(msg)
            # mseq < seq: left over from a barrier that failed; dropped
        return None

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        self._check()
        deadline = self._deadline(timeout)
        shown = self._timeout if timeout is None else float(timeout)
        seq = self._barrier_seq
        self._barrier_seq += 1
        if self._size == 1:
            return
        self._prune()
        try:
            if self._rank == 0:
                verdict = self._judge(seq, name, deadline)
            else:
                verdict = self._follow(seq, name, deadline, shown)
        except self._MPI.Exception as e:
            raise CoordinationError(f"rank {self._rank}: barrier {name!r} failed: {e}") from e
        self._raise_verdict(verdict, name, seq, shown)

    def _judge(self, seq: int, name: str, deadline: float) -> Dict[str, Any]:
        MPI = self._MPI
        for r in range(1, self._size):
            self._post({"k": "here", "seq": seq}, r, _TAG_FROM_ROOT)
        arrived: Dict[int, str] = {0: name}
        withdrawn: List[int] = []
        delay = 0.0001

        def drain() -> bool:
            got = False
            while True:
                item = self._take(MPI.ANY_SOURCE, _TAG_TO_ROOT, seq)
                if item is None:
                    return got
                got = True
                src, msg = item
                if msg.get("k") == "arrive":
                    arrived[src] = str(msg.get("name"))
                elif msg.get("k") == "withdraw":
                    withdrawn.append(src)

        while len(arrived) < self._size and time.monotonic() < deadline:
            if drain():
                delay = 0.0001
                continue
            time.sleep(delay)
            delay = min(delay * 2, 0.002)
        drain()  # a last look, for withdrawals
        missing = [r for r in range(self._size) if r not in arrived]
        if withdrawn:
            verdict: Dict[str, Any] = {"ok": False, "missing": sorted(set(missing) | {0}),
                                       "withdrawn": sorted(set(withdrawn))}
        elif missing:
            verdict = {"ok": False, "missing": missing}
        else:
            wrong = {str(r): n for r, n in sorted(arrived.items()) if n != name}
            verdict = {"ok": True} if not wrong else {"ok": False, "missing": [], "names": wrong, "expected": name}
        verdict.update(k="verdict", seq=seq)
        for r in range(1, self._size):
            self._post(verdict, r, _TAG_FROM_ROOT)
        return verdict

    def _follow(self, seq: int, name: str, deadline: float, timeout: float) -> Dict[str, Any]:
        self._post({"k": "arrive", "seq": seq, "name": name}, 0, _TAG_TO_ROOT)
        grace = max(_GRACE_MIN, _GRACE_FRACTION * timeout)
        limit = deadline
        here = False
        withdrawn = False
        delay = 0.0001
        while True:
            item = self._take(0, _TAG_FROM_ROOT, seq)
            if item is not None:
                msg = item[1]
                if msg.get("k") == "verdict":
                    return msg
                if msg.get("k") == "here" and not here:
                    here = True
                    # Rank 0 decides by its own deadline, at most `timeout` from now.
                    limit = time.monotonic() + timeout + grace
                delay = 0.0001
                continue
            if time.monotonic() >= limit:
                if here:
                    return {"ok": False, "missing": [0], "stalled": True}
                if withdrawn:
                    return {"ok": False, "missing": [0], "by": self._rank}
                self._post({"k": "withdraw", "seq": seq}, 0, _TAG_TO_ROOT)
                withdrawn = True
                limit = time.monotonic() + grace
                continue
            time.sleep(delay)
            delay = min(delay * 2, 0.002)

    def _raise_verdict(self, verdict: Dict[str, Any], name: str, seq: int, timeout: float) -> None:
        if verdict.get("ok"):
            return
        if verdict.get("names"):
            names = sorted(verdict["names"].items(), key=lambda x: int(x[0]))
            detail = ", ".join(f"rank {r} at {n!r}" for r, n in names)
            raise CoordinationError(f"barrier #{seq}: clients are at different barriers: expected "
                                    f"{verdict.get('expected')!r}, but {detail}",
                                    elsewhere={int(r): str(n) for r, n in names})
        missing = [int(r) for r in verdict.get("missing", [])]
        if verdict.get("stalled"):
            why = "rank 0 arrived but gave no verdict"
        elif "by" in verdict:
            why = f"rank 0 did not arrive within {timeout:g} s (no verdict from it)"
        elif verdict.get("withdrawn"):
            why = (f"rank 0 arrived too late: rank(s) {verdict['withdrawn']} had given up on it"
                   + (f"; rank(s) {[r for r in missing if r]} did not arrive" if len(missing) > 1 else ""))
        else:
            why = f"rank(s) {missing} did not arrive within {timeout:g} s (decided by rank 0)"
        if self._rank in missing:
            why += "; this rank arrived too late"
        raise CoordinationTimeout(f"barrier {name!r} (#{seq}) timed out: {why}", missing=missing)

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
