"""``JaxCoordinator``: the coordinator over JAX's own distributed runtime.

After ``jax.distributed.initialize(...)`` every process holds a client of JAX's
coordination service, with a key-value store (``key_value_set``,
``blocking_key_value_get``, ``key_value_dir_get``, ``key_value_delete``). Everything
this coordinator does is written on that store, under a namespace of its own:
``shardckpt/jax/<n>/``, where ``n`` counts the coordinators a process has made
(constructing one, or a :meth:`~JaxCoordinator.clone`, is collective: every process
does it in the same order). Collectives are numbered in call order, alike on every
process; collective ``s`` uses the keys under ``<namespace><s>/``:

* ``all_gather``: every rank sets ``<s>/g/<rank>`` to its JSON value, then reads
  every rank's (``blocking_key_value_get`` until the deadline). A rank whose key
  is missing at the deadline is named (:class:`CoordinationTimeout`, ``missing``).
* ``gather``: as ``all_gather``, but only the root reads the keys (the others return
  once theirs is set).
* ``broadcast``: the root sets ``<s>/c``; the others read it until the deadline
  (a timeout names the root).
* ``barrier``: the arrival protocol of :mod:`.barrier` (written once, in
  :class:`~.engine.EngineCoordinator`); this backend only carries its notices, each
  under a key of its own, since a notice is named by ``(barrier, sender, kind)``:
  ``b<seq>/to0/<from>.<kind>`` (to rank 0) and ``b<seq>/all/<kind>`` (from rank 0 to
  everyone). ``_take`` lists the receiver's folder (``key_value_dir_get``) and returns
  the notices it has not returned before, in key order (a sender's ``arrive`` sorts
  before its ``withdraw``, ``here`` before ``verdict``). JAX's own ``wait_at_barrier``
  is not used: it names nobody.
* ``send_bytes`` / ``recv_bytes``: the bytes as one value ``p/<src>-<dst>-<tag>/<k>``
  (the k-th message on that channel), deleted by the receiver. Funnelled saves
  (``io_device``) move every value this way; meant for small data.

After each barrier, rank 0 deletes the keys of every barrier and collective before
it (every rank arrived, so every rank is done with them). A failed collective other
than a barrier leaves the numbering unsure, so the coordinator is then unusable (later
calls raise :class:`CoordinationError`; make a new one).

JAX's runtime watches its processes too: once a process has died (and at the
latest after ``jax.distributed.initialize(heartbeat_timeout_seconds=...)``, 100 s by
default) it ends the others, at the latest when they shut down. A save's timeout
(``CheckpointOptions(timeout=...)``) shorter than that names the dead process and
leaves nothing committed first; a process that is alive but does not arrive is
named by these timeouts whatever their length.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from .._extras import install_hint
from ..errors import InvalidArgumentError
from .coordinator import CoordinationError, CoordinationTimeout, check_timeout, decode, encode
from .engine import EngineCoordinator

__all__ = ["JaxCoordinator"]

_NAMESPACES = itertools.count()
_NAMESPACE_LOCK = threading.Lock()


def _client() -> Any:
    try:
        import jax
        from jax._src import distributed
    except ImportError as e:  # pragma: no cover - exercised only without jax
        raise CoordinationError(f"the JAX coordinator needs JAX ({install_hint('jax')}): {e}") from e
    client = distributed.global_state.client
    if client is None:
        raise CoordinationError("JAX's distributed runtime is not initialized: call jax.distributed.initialize() "
                                "in every process first")
    return jax, client


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class JaxCoordinator(EngineCoordinator):
    """Coordinate the processes of a JAX job over its distributed runtime's key-value store.

    ``timeout`` (seconds): the default of every call (``None``: ``$SHARDCKPT_TIMEOUT``, else
    600 s). Collective: every process constructs its coordinators (and clones) in the same order.
    """

    _engine = "jax"

    def __init__(self, timeout: Optional[float] = None) -> None:
        jax, client = _client()
        self._client = client
        self._timeout = check_timeout(timeout)
        self._failed: Optional[str] = None
        self._rank = int(jax.process_index())
        self._size = int(jax.process_count())
        with _NAMESPACE_LOCK:
            self._namespace = f"shardckpt/jax/{next(_NAMESPACES)}/"
        self._seq = 0  # collectives other than barriers, alike on every rank
        self._cleaned = 0  # collectives whose keys are deleted
        self._barriers_cleaned = 0
        self._taken: Tuple[int, Set[str]] = (-1, set())  # (barrier, names of the notices taken so far)
        self._sent: Dict[Tuple[int, int], int] = {}
        self._received: Dict[Tuple[int, int], int] = {}

    @property
    def backend(self) -> str:
        return "jax"

    def clone(self) -> "JaxCoordinator":
        """The same processes under a namespace of their own (collective: same order everywhere)."""
        return JaxCoordinator(timeout=self._timeout)

    # -- store helpers ----------------------------------------------------------------------------------------

    def _next(self) -> str:
        seq = self._seq
        self._seq += 1
        return f"{self._namespace}{seq}/"

    def _get(self, key: str, deadline: float) -> Optional[str]:
        """The value of ``key`` once it is set, or ``None`` at the deadline."""
        try:
            return str(self._client.blocking_key_value_get(key, _ms(deadline - time.monotonic())))
        except Exception as e:  # the runtime raises one error type for every failure; tell a timeout apart
            text = str(e)
            if "DEADLINE_EXCEEDED" in text or "timed out" in text.lower() or time.monotonic() >= deadline:
                return None
            raise CoordinationError(f"rank {self._rank}: JAX's key-value store failed reading {key!r}: "
                                    f"{text.strip().splitlines()[0] if text.strip() else type(e).__name__}") from e

    def _dir(self, directory: str) -> Dict[str, str]:
        return {k.rsplit("/", 1)[-1]: v for k, v in self._client.key_value_dir_get(directory)}

    def _fail(self, what: str) -> None:
        self._failed = what

    # -- collectives ------------------------------------------------------------------------------------------

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        self._check()
        deadline = self._deadline(timeout)
        payload = encode(obj).decode("ascii")
        if self._size == 1:
            return [decode(payload.encode("ascii"))]
        base = self._next() + "g/"
        self._client.key_value_set(base + str(self._rank), payload)
        return self._collect(base, payload, deadline, timeout, "all_gather")

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        self._check()
        self._check_peer(root, "gather root")
        deadline = self._deadline(timeout)
        payload = encode(obj).decode("ascii")
        if self._size == 1:
            return [decode(payload.encode("ascii"))]
        base = self._next() + "g/"
        self._client.key_value_set(base + str(self._rank), payload)
        if self._rank != root:
            return None
        return self._collect(base, payload, deadline, timeout, "gather")

    def _collect(self, base: str, payload: str, deadline: float, timeout: Optional[float], what: str) -> List[Any]:
        """Every rank's value under ``base`` (this rank's is ``payload``), decoded, in rank order; a rank
        missing at ``deadline`` is named in a timeout, undecodable data fails the coordinator."""
        out = []
        for r in range(self._size):
            text = payload if r == self._rank else self._get(base + str(r), deadline)
            if text is None:
                present = self._dir(base)
                missing = [m for m in range(self._size) if str(m) not in present]
                shown = self._timeout if timeout is None else float(timeout)
                self._fail(f"{what} timed out")
                raise CoordinationTimeout(f"rank {self._rank}: {what} did not complete within {shown:g} s: "
                                          f"rank(s) {missing} did not arrive", missing=missing)
            try:
                out.append(decode(str(text).encode("utf-8")))
            except ValueError as e:
                self._fail(f"{what} received undecodable data")
                raise CoordinationError(f"{what}: rank {r} sent data that is not JSON: {e}") from e
        return out

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        self._check()
        self._check_peer(root, "broadcast root")
        deadline = self._deadline(timeout)
        if self._size == 1:
            return decode(encode(obj))
        key = self._next() + "c"
        if self._rank == root:
            payload = encode(obj)
            self._client.key_value_set(key, payload.decode("ascii"))
            return decode(payload)
        text = self._get(key, deadline)
        if text is None:
            shown = self._timeout if timeout is None else float(timeout)
            self._fail(f"broadcast from rank {root} timed out")
            raise CoordinationTimeout(f"rank {self._rank}: broadcast from rank {root} did not arrive within "
                                      f"{shown:g} s: rank(s) [{root}] did not arrive", missing=[root])
        try:
            return decode(text.encode("utf-8"))
        except ValueError as e:
            self._fail("broadcast received undecodable data")
            raise CoordinationError(f"broadcast: rank {root} sent data that is not JSON: {e}") from e

    # -- point to point ---------------------------------------------------------------------------------------

    def _p2p_key(self, src: int, dst: int, tag: int) -> str:
        return f"{self._namespace}p/{src}-{dst}-{tag}/"

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        self._check()
        self._check_peer(dst, "send destination")
        mv = memoryview(data).cast("B") if memoryview(data).format != "B" else memoryview(data)
        n = self._sent.get((dst, tag), 0)
        self._sent[(dst, tag)] = n + 1
        if mv.nbytes == 0:
            return
        try:
            self._client.key_value_set_bytes(self._p2p_key(self._rank, dst, tag) + str(n), bytes(mv))
        except Exception as e:
            self._fail(f"send to rank {dst} failed")
            raise CoordinationError(f"rank {self._rank}: sending {mv.nbytes} bytes to rank {dst} failed: {e}") from e

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        self._check()
        self._check_peer(src, "receive source")
        if nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes}")
        deadline = self._deadline(timeout)
        mv = memoryview(out if out is not None else bytearray(nbytes))
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes < nbytes:
            raise InvalidArgumentError(f"receive buffer holds {mv.nbytes} bytes, {nbytes} expected")
        mv = mv[:nbytes]
        n = self._received.get((src, tag), 0)
        self._received[(src, tag)] = n + 1
        if nbytes == 0:
            return mv
        key = self._p2p_key(src, self._rank, tag) + str(n)
        try:
            data = self._client.blocking_key_value_get_bytes(key, _ms(deadline - time.monotonic()))
        except Exception as e:
            shown = self._timeout if timeout is None else float(timeout)
            self._fail(f"receive from rank {src} failed")
            raise CoordinationTimeout(f"rank {self._rank}: {nbytes} bytes from rank {src} did not arrive within "
                                      f"{shown:g} s", missing=[src]) from e
        if len(data) != nbytes:
            self._fail(f"receive from rank {src} failed")
            raise CoordinationError(f"rank {self._rank}: rank {src} sent {len(data)} bytes, {nbytes} expected")
        mv[:] = data
        try:
            self._client.key_value_delete(key)
        except Exception:  # pragma: no cover - cleanup only
            pass
        return mv

    # -- barrier transport (the protocol is in .barrier) ------------------------------------------------------

    _channel = "JAX's key-value store"

    def _post(self, seq: int, notice: Dict[str, Any], to: Optional[int]) -> None:
        kind = str(notice["k"])
        key = f"{self._namespace}b{seq}/all/{kind}" if to is None else \
            f"{self._namespace}b{seq}/to{to}/{self._rank}.{kind}"
        self._client.key_value_set(key, encode(notice).decode("ascii"))

    def _take(self, seq: int) -> List[Dict[str, Any]]:
        # The protocol posts only to rank 0 and to everyone: rank 0 reads its folder, the others the shared one.
        folder = f"{self._namespace}b{seq}/" + ("to0/" if self._rank == 0 else "all/")
        seen = self._taken[1] if self._taken[0] == seq else set()
        notices = []
        for name, text in sorted(self._dir(folder).items()):
            if name not in seen:
                seen.add(name)
                notices.append(dict(decode(text.encode("utf-8"))))
        self._taken = (seq, seen)
        return notices

    def _retire(self, seq: int) -> None:
        for old in range(self._barriers_cleaned, seq):
            self._client.key_value_delete(f"{self._namespace}b{old}")
        self._barriers_cleaned = seq
        for old in range(self._cleaned, self._seq):  # every rank made these collectives before this barrier
            self._client.key_value_delete(f"{self._namespace}{old}")
        self._cleaned = self._seq
