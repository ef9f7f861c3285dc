"""Asynchronous saves: snapshot on the caller's thread, write and commit in the background.

An :class:`AsyncSaver` runs at most one save at a time. ``submit`` first waits for
the previous save to commit (raising its error, if it failed), then starts a thread
that writes the shards, commits, updates the state file and runs the write
callbacks, in that order, and stages the new save's values into reused host buffers
(or holds values whose bytes cannot change, see
:func:`~shardckpt.saving.staging.register_holder`) — the only part the caller waits
for. Where the process has cores to spare (:data:`OVERLAP_MIN_CORES`), or the staging
has a budget, the writer starts first and takes each value once its copy is made
(``StagedValue.get`` waits for it), so writing overlaps the copy and the save commits
about when a synchronous one would; with fewer cores the writer would take them from
the caller's copy (the call returns later), so the copy is made first. Either way
nothing is committed before every value is copied and written.

An error in the background is kept and raised, chained to the original, by the
next ``submit``, by ``wait()`` (``Checkpoint.sync()``), or at interpreter exit.

**Priority.** The background thread lowers its own CPU priority (nice
:data:`BACKGROUND_NICE`, inherited by the threads it starts): while the caller trains on,
its threads, and the other clients' on the same machine, are scheduled first, so an
asynchronous save costs the training loop its host copy, not cores.

**Follow-ups.** :meth:`AsyncSaver.then` queues work that runs on the same thread after the
save in flight commits (skipped if it fails), or at once on a thread of its own when no
save is in flight (a synchronous save just committed): a tiered manager copies a step that
also persisted into the node-local tiers this way. The next ``submit`` and ``wait()``
wait for it too; it reports its own errors and never fails the next save.

**At exit.** The thread is not a daemon: when the main thread ends (a script that falls
off its end with a save in flight and never waits, under torchrun or mpiexec too), the
interpreter joins it, so the save completes and commits before the process exits. Its
work on helper threads keeps running although ``concurrent.futures`` refuses new work
by then: the save path's pools are :class:`~shardckpt.runtime.ThreadPool` objects (see
:mod:`shardckpt.runtime`). Then an ``atexit`` hook (run after non-daemon threads are
joined) reports the error of a save nobody waited for. No private interpreter hook is
used.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import weakref
from typing import Callable, List, Optional

from ..errors import AsyncSaveError
from ..runtime import Slot
from .plan import SavePlan
from .staging import StagingPool

__all__ = ["AsyncSaver", "AsyncSaveError"]

_log = logging.getLogger("shardckpt")

#: The savers alive, whose uncollected errors are reported at exit (kept across a runtime reset; a
#: forked child starts without its parent's).
_LIVE: "Slot[weakref.WeakSet[AsyncSaver]]" = Slot("the async savers alive", weakref.WeakSet, keep_on_reset=True)

#: The cores a process needs before the background writer runs beside the snapshot copy.
OVERLAP_MIN_CORES = 4


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class AsyncSaver:
    """One background save at a time, with reusable staging buffers."""

    def __init__(self, budget_bytes: Optional[int] = None) -> None:
        self.pool = StagingPool(budget_bytes)
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._failed_prefix = ""
        self._on_failure: Optional[Callable[[], None]] = None
        self._follow_ups: List[Callable[[], None]] = []
        self._accepting: Optional[threading.Thread] = None  # the save's thread, until it takes no more follow-ups
        self._lock = threading.Lock()
        _LIVE.get().add(self)

    @property
    def pending(self) -> bool:
        """Whether a background save is in flight."""
        return self._thread is not None and self._thread.is_alive()

    def set_budget(self, budget_bytes: Optional[int]) -> None:
        """Use a staging pool bounded by ``budget_bytes`` (waits for the save in flight when it changes)."""
        if budget_bytes != self.pool.budget:
            self.wait()
            self.pool = StagingPool(budget_bytes)

    def submit(self, prefix: str, plan: SavePlan, write: Callable[[SavePlan], None],
               on_failure: Optional[Callable[[], None]] = None) -> None:
        """Wait for the previous save, snapshot ``plan``'s values, and write it in the background."""
        self.wait()
        staged, fill = self.pool.stage_plan(plan)
        # the writer first where cores are to spare; with a budget always (it drains only while the writer runs)
        overlap = _usable_cores() >= OVERLAP_MIN_CORES or self.pool.budget is not None
        if not overlap:
            fill()  # the snapshot: after this the caller may change its arrays
        thread = threading.Thread(target=self._run, args=(prefix, staged, write, on_failure),
                                  name=f"shardckpt-async-save {prefix}", daemon=False)
        with self._lock:
            self._thread = self._accepting = thread
        thread.start()
        if not overlap:
            return
        try:
            # The snapshot: after it the caller may change its arrays. The writer runs meanwhile
            # (prepare, numbering, then each value's bytes as soon as its copy is made; with a
            # budget it also frees room for the next copies), so the save commits about when a
            # synchronous one would, not a whole copy later.
            fill()
        except BaseException as exc:
            try:
                self.wait()  # the writer stops: the values it waits for will not come
            except AsyncSaveError:
                if self.pool._failed is not exc:
                    raise  # the writer failed first: its error is the one to raise
            raise

    def then(self, follow_up: Callable[[], None], name: str = "follow-up") -> None:
        """Run ``follow_up`` in the background once the save in flight has committed (now, on a thread of
        its own, when none is in flight); it is skipped if that save fails. The caller does not wait.

        ``follow_up`` handles its own errors (it is work beside a save that already committed, such
        as copying it to a node-local tier: it must not fail the next save); :meth:`wait` and the
        next :meth:`submit` wait for it like for a save.
        """
        with self._lock:
            if self._accepting is not None and self._accepting is self._thread and self._error is None:
                self._follow_ups.append(follow_up)  # the save's thread runs it before it ends
                return
        self.wait()  # the save before it ended: its error, if any, is raised here, and nothing follows it
        thread = threading.Thread(target=self._follow, args=(follow_up, True), name=f"shardckpt-async-save {name}",
                                  daemon=False)
        with self._lock:
            self._thread = thread
        thread.start()

    def _run(self, prefix: str, plan: SavePlan, write: Callable[[SavePlan], None],
             on_failure: Optional[Callable[[], None]]) -> None:
        _yield_to_training()
        try:
            write(plan)
        except BaseException as exc:  # kept for the next call; never swallowed
            with self._lock:
                self._error = exc
                self._failed_prefix = prefix
                self._on_failure = on_failure
                self._follow_ups.clear()  # they follow a save that committed
            _log.error("background save of %s failed: %s", prefix, exc)
        while True:
            with self._lock:
                if not self._follow_ups:
                    self._accepting = None  # a follow-up queued from now on gets a thread of its own
                    return
                follow_up = self._follow_ups.pop(0)
            self._follow(follow_up)

    @staticmethod
    def _follow(follow_up: Callable[[], None], alone: bool = False) -> None:
        if alone:
            _yield_to_training()
        try:
            follow_up()
        except BaseException as exc:  # noqa: BLE001 - a follow-up handles its errors; this is a last resort
            _log.error("background work after a save failed: %s: %s", type(exc).__name__, exc)

    def wait(self) -> None:
        """Wait for the save in flight; raise :class:`AsyncSaveError` if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join()
            with self._lock:
                if self._thread is thread:
                    self._thread = None
        with self._lock:
            error, self._error = self._error, None
            prefix, on_failure = self._failed_prefix, self._on_failure
            self._on_failure = None
        if error is not None:
            if on_failure is not None:
                on_failure()
            raise AsyncSaveError(f"the background save of {prefix} failed: {type(error).__name__}: {error}",
                                 path=prefix) from error


#: The nice value of a background save's thread (and of the threads it starts): the training
#: threads of this process and of the other clients on the machine get the cores first.
BACKGROUND_NICE = 10


def _yield_to_training() -> None:
    """Lower the calling thread's CPU priority to :data:`BACKGROUND_NICE` (Linux: per thread; best effort)."""
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), BACKGROUND_NICE))
    except (AttributeError, OSError):  # not on Linux, or not allowed: it runs at the caller's priority
        pass


@atexit.register
def _wait_at_exit() -> None:
    """Non-daemon threads (the saves in flight) are joined before this runs; report errors nobody collected."""
    for saver in list(_LIVE.get()):
        try:
            saver.wait()
        except AsyncSaveError as exc:
            _log.error("%s", exc)
            raise
