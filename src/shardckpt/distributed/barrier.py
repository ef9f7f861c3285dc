"""The arrival barrier of the engine-backed coordinators, written once over three transport primitives.

No engine offers a barrier with a timeout that tells *every* rank who is missing:
gloo's ``monitored_barrier`` names them on rank 0 only (and its failure closes the
group's connections), MPI has no barrier with a timeout, JAX's ``wait_at_barrier``
names nobody. So every engine-backed coordinator runs this protocol of small JSON
notices, over a channel of its own that a failed collective does not break: the
job's key-value store (torch), a duplicate communicator (MPI), the distributed
runtime's key-value store (JAX).

Notices
-------
Each barrier call has a sequence number ``seq``: the coordinator's count of barrier
calls, alike on every rank that makes the same calls (the barrier's *name* is what
tells whether they did). A notice is a JSON object ``{"k": kind, "from": rank, ...}``;
per barrier, a rank posts each kind at most once, so ``(seq, from, k)`` names a notice:

    kind       posted by                     to                carries
    arrive     every rank but 0              rank 0            "name": the barrier's name on that rank
    withdraw   a rank but 0 that waited      rank 0            nothing: it gave up on rank 0
               in vain for rank 0
    here       rank 0, on arriving           every other rank  nothing: rank 0 is judging
    verdict    rank 0                        every other rank  "ok"; "missing"; or "names" (rank -> the
                                                               name of its barrier) and "expected";
                                                               "withdrawn": who gave up on rank 0

Rank 0, the judge: posts ``here``; takes ``arrive`` and ``withdraw`` notices until every
rank has arrived or its deadline passes; takes a last look for withdrawals; posts the
verdict, then concludes from it like everyone else. The verdict is, in this order:

1. some rank withdrew: fail, ``missing`` = the ranks that did not arrive and rank 0
   (rank 0 came too late for someone, so nobody may pass);
2. some rank did not arrive: fail, ``missing`` = those ranks;
3. some rank arrived at a barrier of another name: fail, ``names`` = those ranks' names;
4. pass.

Every other rank: posts ``arrive``, then takes notices from rank 0:

* ``verdict``: concludes from it. A rank that arrives after the verdict finds it
  waiting and raises at once, naming itself ("this rank arrived too late").
* ``here`` (rank 0 is judging by its own deadline, at most ``timeout`` from now): waits
  for the verdict until then plus a grace period, else concludes that rank 0 is missing
  ("rank 0 arrived but gave no verdict": it died or hung while judging).
* nothing by its own deadline: posts ``withdraw`` and waits a grace period for a verdict.
  One that comes is obeyed (rank 0 arrived just now and either saw the withdrawal — then
  everyone fails naming rank 0 — or judged before it, and everyone passes); otherwise it
  concludes that rank 0 is missing ("rank 0 did not arrive").

What each rank concludes: pass; :class:`CoordinationTimeout` with ``missing`` (the
message says who decided and, on a missing rank that arrived late, "this rank arrived
too late"); or :class:`CoordinationError` with ``elsewhere`` (rank -> name) for ranks at
barriers of other names. Either every rank passes or every rank raises with the same
``missing`` list, except where rank 0 itself is gone or later than the grace period:
then the ranks that gave up on it raise naming rank 0. A barrier that fails leaves
nothing pending: the coordinator stays usable.

The grace period is ``max(1 s, 10 % of the timeout)``.

Transport primitives (each engine-backed coordinator implements them)
--------------------------------------------------------------------
* ``_post(seq, notice, to)``: deliver ``notice`` of barrier ``seq`` to rank ``to``, or
  with ``to=None`` to every rank but this one. The protocol only posts to rank 0 (from the
  others) and to everyone (from rank 0). Never waits for the receiver.
* ``_take(seq)``: the notices of barrier ``seq`` for this rank not returned before
  (a sender's in the order it posted them); never waits. A notice may arrive before its
  receiver reaches the barrier (kept until then) or after it left it (never taken).
* ``_retire(seq)``: called by rank 0 once barrier ``seq`` passed, when every rank is done
  with the barriers before it: drop what they left behind (notices posted too late
  included). Optional (a transport that drops stale notices itself need not).

Errors a primitive raises (other than :class:`CoordinationError`) fail the barrier with a
:class:`CoordinationError` naming the channel (``_channel``).

How the backends carry notices: the torch store keeps a box per barrier and receiver
(``b<seq>/to0``: rank 0's; ``b<seq>/all``: everyone else's) of numbered slots (``add``
on the box's counter, then ``set`` the slot; a reader takes slots in order and waits
for a counted slot not yet set). MPI sends JSON bytes with ``Isend`` on the barrier
communicator (one tag; stale notices dropped, early ones kept). A key-value store that
lists a directory (JAX's ``key_value_dir_get``) can key each notice by
``b<seq>/to0/<from>.<k>`` or ``b<seq>/all/<k>``, since ``(seq, from, k)`` is unique.
"""

from __future__ import annotations

import abc
import time
from typing import Any, Dict, List, Optional

from .coordinator import CoordinationError, CoordinationTimeout

__all__ = ["ArrivalBarrier", "grace_period"]

Notice = Dict[str, Any]

_GRACE_MIN = 1.0
_GRACE_FRACTION = 0.1


def grace_period(timeout: float) -> float:
    """How long a rank waits for rank 0 beyond its own deadline: ``max(1 s, 10 % of timeout)``."""
    return max(_GRACE_MIN, _GRACE_FRACTION * timeout)


class ArrivalBarrier(abc.ABC):
    """The protocol above, for a coordinator that implements ``_post``, ``_take`` (and ``_retire``)."""

    _rank: int
    _size: int
    _channel = "the barrier channel"  # named in errors of the transport
    _poll_first = 0.0001  # seconds between looks for notices, doubling up to _poll_max
    _poll_max = 0.002
    #: after this many seconds of one barrier's wait, looks are at most _poll_max_late apart (None: _poll_max)
    _poll_patience = 1.0
    _poll_max_late: Optional[float] = None
    _poll_since = 0.0

    # -- transport primitives ---------------------------------------------------------------------------------

    @abc.abstractmethod
    def _post(self, seq: int, notice: Notice, to: Optional[int]) -> None:
        """Deliver ``notice`` of barrier ``seq`` to rank ``to`` (``None``: every rank but this one)."""

    @abc.abstractmethod
    def _take(self, seq: int) -> List[Notice]:
        """The notices of barrier ``seq`` for this rank that were not returned before; never waits."""

    def _retire(self, seq: int) -> None:  # noqa: B027 - optional for transports
        """Rank 0, after barrier ``seq`` passed: every rank is done with the barriers before ``seq``."""

    # -- the protocol -----------------------------------------------------------------------------------------

    def _arrival_barrier(self, seq: int, name: str, deadline: float, timeout: float) -> None:
        """Run barrier number ``seq`` called ``name`` until ``deadline`` (``timeout``: the call's, for messages)."""
        self._poll_since = time.monotonic()
        try:
            if self._rank == 0:
                verdict = self._judge(seq, name, deadline)
            else:
                verdict = self._follow(seq, name, deadline, timeout)
        except CoordinationError:
            raise
        except Exception as e:
            raise CoordinationError(f"rank {self._rank}: barrier {name!r} (#{seq}) failed on {self._channel}: "
                                    f"{e}") from e
        self._conclude(verdict, name, seq, timeout)
        if self._rank == 0:
            try:
                self._retire(seq)
            except Exception:  # noqa: BLE001 - cleanup only
                pass

    def _sleep(self, delay: float) -> float:
        """Wait ``delay``; return the next delay. A rank that waits for others (the usual case: clients end
        their writes at different times) sees the last notice at most ``_poll_max`` late; a wait that lasts
        (a slow or dead client) looks less often, ``_poll_max_late``."""
        time.sleep(delay)
        cap = self._poll_max
        if self._poll_max_late is not None and time.monotonic() - self._poll_since > self._poll_patience:
            cap = self._poll_max_late
        return min(delay * 2, cap)

    def _judge(self, seq: int, name: str, deadline: float) -> Notice:
        """Rank 0: announce, collect arrivals until ``deadline``, post and return the verdict."""
        self._post(seq, {"k": "here", "from": 0}, None)
        arrived: Dict[int, str] = {0: name}
        withdrawn: List[int] = []

        def take() -> bool:
            notices = self._take(seq)
            for notice in notices:
                sender = int(notice.get("from", -1))
                if not 0 < sender < self._size:
                    continue
                if notice.get("k") == "arrive":
                    arrived[sender] = str(notice.get("name"))
                elif notice.get("k") == "withdraw":
                    withdrawn.append(sender)
            return bool(notices)

        delay = self._poll_first
        while len(arrived) < self._size and time.monotonic() < deadline:
            if take():
                delay = self._poll_first
            else:
                delay = self._sleep(delay)
        take()  # a last look, for withdrawals
        missing = [r for r in range(self._size) if r not in arrived]
        verdict: Notice
        if withdrawn:
            verdict = {"ok": False, "missing": sorted(set(missing) | {0}), "withdrawn": sorted(set(withdrawn))}
        elif missing:
            verdict = {"ok": False, "missing": missing}
        else:
            wrong = {str(r): n for r, n in sorted(arrived.items()) if n != name}
            verdict = {"ok": True} if not wrong else {"ok": False, "missing": [], "names": wrong, "expected": name}
        verdict.update(k="verdict", **{"from": 0})
        self._post(seq, verdict, None)
        return verdict

    def _follow(self, seq: int, name: str, deadline: float, timeout: float) -> Notice:
        """Every rank but 0: announce, then wait for rank 0's verdict (or conclude that rank 0 is missing)."""
        self._post(seq, {"k": "arrive", "from": self._rank, "name": name}, 0)
        grace = grace_period(timeout)
        limit = deadline
        here = withdrawn = False
        delay = self._poll_first
        while True:
            notices = self._take(seq)
            for notice in notices:
                if notice.get("k") == "verdict":
                    return notice
                if notice.get("k") == "here" and not here:
                    here = True
                    limit = time.monotonic() + timeout + grace  # rank 0's deadline is at most `timeout` away
            if notices:
                delay = self._poll_first
                continue
            if time.monotonic() >= limit:
                if here:
                    return {"ok": False, "missing": [0], "stalled": True, "by": self._rank}
                if withdrawn:
                    return {"ok": False, "missing": [0], "by": self._rank}
                self._post(seq, {"k": "withdraw", "from": self._rank}, 0)
                withdrawn = True
                limit = time.monotonic() + grace
                continue
            delay = self._sleep(delay)

    def _conclude(self, verdict: Notice, name: str, seq: int, timeout: float) -> None:
        """Pass, or raise what ``verdict`` says (the same error on every rank that got the same verdict)."""
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
            why = f"rank 0 arrived but gave no verdict (reported by rank {verdict.get('by')})"
        elif "by" in verdict:
            why = f"rank 0 did not arrive within {timeout:g} s (no verdict from it; decided by rank {verdict['by']})"
        elif verdict.get("withdrawn"):
            why = (f"rank 0 arrived too late: rank(s) {verdict['withdrawn']} had given up on it"
                   + (f"; rank(s) {[r for r in missing if r]} did not arrive" if len(missing) > 1 else ""))
        else:
            why = f"rank(s) {missing} did not arrive within {timeout:g} s (decided by rank 0)"
        if self._rank in missing:
            why += "; this rank arrived too late"
        raise CoordinationTimeout(f"barrier {name!r} (#{seq}) timed out: {why}", missing=missing)
