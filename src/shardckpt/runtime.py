"""The process's runtime: the one owner of shardckpt's process-wide state, and its lifetime.

Everything shardckpt keeps in a process between calls lives in one :class:`Runtime`
(:func:`runtime`), never in a module-level variable of the room that uses it. A room
*declares* what it keeps as a module-level :class:`Slot` (a name, how to make the value,
and what happens to it at :func:`reset` and in a forked child); the value itself is the
runtime's. What is kept, by whom:

* the process-wide coordinator (``distributed.select``);
* coordinators made once, in the keyed cache below: JAX's world (``jax._save``), one per
  torch process group (``torch._call``), each coordinator's background clone
  (``saving.context``);
* save numbers per coordinator (``saving.agreement``);
* the default async saver (``saving.context``) and the savers alive, whose uncollected
  errors are reported at exit (``saving.async_save``);
* torch's host stager of ``dcp.async_save`` (``torch._staging``);
* the scrubber of reused bytes (``saving.scrub``);
* the default checksum context and its helper threads (``format.crc``);
* stagers and holders registered by type (``saving.staging``).

After :func:`reset` all of them are new except the registrations and the savers alive;
in a forked child all are new except the registrations.

**Made lazily, once, under one lock.** A value is made the first time it is asked for.
The runtime's lock decides who makes it: the first caller marks the key as being made
and makes the value *outside* the lock (making a coordinator or a background clone is a
collective that may wait for other processes: holding one lock over it would stall
every other piece of state); callers asking for the same key meanwhile wait for that
value, callers asking for any other key do not wait. A maker that fails leaves nothing
behind (the next caller tries again).

**The keyed cache** (:meth:`Runtime.keep`) holds what is made once per key, with one
lifetime: a value lives until :func:`reset`, or in a forked child until the fork; a
value kept with an ``anchor`` (an object, held weakly) also ends when its anchor is
collected. The coordinator caches are this one cache: the JAX world's coordinator
under ``("jax", process count)``; a torch group's under its group name, anchored on
the default group it belongs to (a re-initialized world gets new ones); a
coordinator's background clone under ``"background"``, anchored on that coordinator.

**Reset** (:func:`reset`, for tests): a new, empty runtime replaces the current one;
slots declared ``keep_on_reset`` (registrations, which imports make only once; the
savers alive) move over. Nothing is closed or waited for: a save in flight finishes on
its own thread. Use the ``fresh_runtime`` fixture of ``tests/conftest.py``.

**Fork.** A forked child has none of its parent's threads, and its parent's
coordinators and staging buffers are not its own: the child starts with a new runtime
(slots declared ``keep_in_child`` move over; a slot's ``in_child`` hook runs on the value
left behind, e.g. the scrubber closes the files it had queued). The parent's runtime
stays referenced in the child, so nothing the parent made is finalized there (a CUDA
buffer's unregistration, a transport's teardown).

**Exit.** Work of a background save may still be running when the main thread ends:
the interpreter joins the save's thread (not a daemon), then runs ``atexit`` hooks.
But ``concurrent.futures`` shuts every executor down *before* joining non-daemon
threads (its exit hook runs first, as its documentation says), so a plain
``ThreadPoolExecutor.submit`` then raises ``RuntimeError``. The pools of shardckpt's
save path are :class:`ThreadPool` objects: when an executor refuses work although nobody
shut it down, the work runs on a new non-daemon thread of its own (threads may start
while the interpreter joins non-daemon threads, and it joins those too; CPython
3.12.0-3.12.2 refused that, gh-113964: there the work runs on the submitting thread),
so the pending save completes and commits. Only documented behaviour is used:
non-daemon threads are joined at exit, ``submit`` raises ``RuntimeError`` once its
executor is shut down, ``atexit`` hooks run after the joins. No interpreter hook runs
before ``concurrent.futures``' own (``threading._register_atexit`` is private), so
this is how work handed to a pool survives it. An object store's event loop hands
blocking calls (DNS lookups of new connections) to its default executor: the loops
shardckpt's stores run on get a :class:`ThreadPool` too (:func:`adopt_event_loop`).
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import BrokenExecutor, Future, ThreadPoolExecutor
from typing import Any, Callable, Dict, Generic, Hashable, List, Optional, TypeVar

__all__ = ["Runtime", "Slot", "ThreadPool", "runtime", "reset", "adopt_event_loop"]

T = TypeVar("T")


class Slot(Generic[T]):
    """One piece of process state, declared by the module that uses it; its value is the runtime's.

    ``make``: how the value is made on first use (``None``: only :meth:`put` sets it).
    ``keep_on_reset`` / ``keep_in_child``: the value moves to the runtime that
    :func:`reset` / a fork makes (else that runtime starts without it). ``in_child``:
    called in a forked child with the value the child leaves behind.
    """

    def __init__(self, name: str, make: Optional[Callable[[], T]] = None, *, keep_on_reset: bool = False,
                 keep_in_child: bool = False, in_child: Optional[Callable[[T], None]] = None) -> None:
        self.name = name
        self.make = make
        self.keep_on_reset = keep_on_reset
        self.keep_in_child = keep_in_child
        self.in_child = in_child

    def get(self) -> T:
        """The value in the current runtime (made now if it is the first use)."""
        if self.make is None:
            raise RuntimeError(f"{self.name}: nothing set and no way to make it")
        return runtime().keep(self, self.make)

    def peek(self) -> Optional[T]:
        """The value in the current runtime, or ``None`` when none was made (nothing is made)."""
        return runtime().peek(self)

    def put(self, value: Optional[T]) -> None:
        """Set the value in the current runtime (``None``: forget it; the next :meth:`get` makes one)."""
        runtime().put(self, value)

    def __repr__(self) -> str:
        return f"Slot({self.name!r})"


class _Making:
    """A key whose value one thread is making: the others wait for ``done``."""

    __slots__ = ("thread", "done")

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.done = threading.Event()


class Runtime:
    """All of shardckpt's process-wide state (see the module docstring): one lock, one keyed cache."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: Dict[Hashable, Any] = {}  # slots and process-lifetime keys -> value (or _Making)
        self._anchored: "weakref.WeakKeyDictionary[Any, Dict[Hashable, Any]]" = weakref.WeakKeyDictionary()

    def _table(self, anchor: Any) -> Dict[Hashable, Any]:
        """The values kept for ``anchor`` (``None``: for the runtime's life); holding the lock."""
        if anchor is None:
            return self._kept
        table = self._anchored.get(anchor)
        if table is None:
            table = self._anchored[anchor] = {}
        return table

    def keep(self, key: Hashable, make: Callable[[], T], *, anchor: Any = None) -> T:
        """The value kept under ``key`` (for ``anchor``'s life, when given), made by ``make()`` the first time.

        ``make`` runs without the lock (it may be a collective); concurrent callers for the
        same key wait for its value. A ``make`` that raises leaves nothing kept.
        """
        table: Dict[Hashable, Any]
        while True:
            with self._lock:
                table = self._table(anchor)
                entry = table.get(key)
                if entry is None:
                    mine = _Making()
                    table[key] = mine
                    break
                if not isinstance(entry, _Making):
                    return entry  # type: ignore[no-any-return]
                if entry.thread == threading.get_ident():
                    raise RuntimeError(f"{key!r} is asked for while this thread is making it")
            entry.done.wait()  # made (or failed: then ask again)
        try:
            value = make()
        except BaseException:
            with self._lock:
                if table.get(key) is mine:
                    del table[key]
            mine.done.set()
            raise
        with self._lock:
            if table.get(key) is mine:
                table[key] = value
        mine.done.set()
        return value

    def peek(self, key: Hashable, *, anchor: Any = None) -> Any:
        """The value kept under ``key`` (for ``anchor``), or ``None`` when there is none yet."""
        with self._lock:
            table = self._kept if anchor is None else self._anchored.get(anchor, {})
            entry = table.get(key)
        return None if isinstance(entry, _Making) else entry

    def put(self, key: Hashable, value: Any, *, anchor: Any = None) -> None:
        """Keep ``value`` under ``key`` from now on (``None``: forget the key)."""
        with self._lock:
            table = self._table(anchor)
            if value is None:
                table.pop(key, None)
            else:
                table[key] = value

    def count(self, key: Hashable, *, anchor: Any = None) -> int:
        """The next number (1, 2, ...) of the counter kept under ``key`` (for ``anchor``)."""
        with self._lock:
            table = self._table(anchor)
            number = int(table.get(key, 0)) + 1
            table[key] = number
            return number

    def _successor(self, child: bool) -> "Runtime":
        """A new runtime with the slots that outlive a reset (``child=False``) or a fork (``child=True``)."""
        new = Runtime()
        for key, value in list(self._kept.items()):
            if isinstance(value, _Making) or not isinstance(key, Slot):
                continue
            if key.keep_in_child if child else key.keep_on_reset:
                new._kept[key] = value
            elif child and key.in_child is not None:
                key.in_child(value)
        return new


_RUNTIME = Runtime()
_INHERITED: List[Runtime] = []  # in a forked child: the parent's runtimes, never finalized here


def runtime() -> Runtime:
    """The process's runtime."""
    return _RUNTIME


def reset() -> Runtime:
    """Start a new, empty runtime (for tests; see the module docstring) and return it.

    Everything made so far is forgotten, not closed: the next use makes new coordinators,
    savers, stagers and scrubbers. Registrations and the savers alive are kept.
    """
    global _RUNTIME
    _RUNTIME = _RUNTIME._successor(child=False)
    return _RUNTIME


def _after_fork_in_child() -> None:
    global _RUNTIME
    parent = _RUNTIME
    _INHERITED.append(parent)
    _RUNTIME = parent._successor(child=True)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class ThreadPool(ThreadPoolExecutor):
    """A ``ThreadPoolExecutor`` that still runs work while the interpreter shuts down (see the module docstring).

    When ``concurrent.futures`` refuses new work (its exit hook ran) although this pool
    was not shut down, each submitted call runs on a new non-daemon thread (or, where
    the interpreter refuses new threads, on the caller's); the returned future behaves
    as usual.
    """

    def __init__(self, max_workers: Optional[int] = None, thread_name_prefix: str = "") -> None:
        super().__init__(max_workers=max_workers, thread_name_prefix=thread_name_prefix)
        self._closed = False
        self._prefix = thread_name_prefix or "shardckpt-pool"

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> "Future[T]":
        """``fn(*args, **kwargs)`` on a pool thread (on a thread of its own at interpreter shutdown)."""
        try:
            return super().submit(fn, *args, **kwargs)
        except BrokenExecutor:
            raise
        except RuntimeError:
            if self._closed:
                raise  # shut down by its owner: refusing is right
        future: "Future[T]" = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                result = fn(*args, **kwargs)
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)

        try:
            threading.Thread(target=run, name=f"{self._prefix}-at-exit", daemon=False).start()
        except RuntimeError:  # CPython 3.12.0-3.12.2 refuse new threads then (gh-113964): run it here
            run()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As ``ThreadPoolExecutor.shutdown``; later submits raise ``RuntimeError``."""
        self._closed = True
        super().shutdown(wait=wait, cancel_futures=cancel_futures)


#: The key of an event loop's default executor in the keyed cache (anchored on the loop).
_LOOP_EXECUTOR = "default executor"


def adopt_event_loop(loop: Any) -> None:
    """Give the asyncio event ``loop`` (running on another thread) a :class:`ThreadPool` as its default
    executor, once per loop: its blocking calls (``run_in_executor(None, ...)``, e.g. an HTTP client's DNS
    lookups) then still run while the interpreter shuts down. ``None``: nothing to do."""
    if loop is None:
        return

    def make() -> ThreadPool:
        pool = ThreadPool(thread_name_prefix="shardckpt-loop")
        loop.call_soon_threadsafe(loop.set_default_executor, pool)  # before any call queued after this one
        return pool

    runtime().keep(_LOOP_EXECUTOR, make, anchor=loop)
