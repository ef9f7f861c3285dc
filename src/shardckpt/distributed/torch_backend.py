"""``TorchCoordinator``: the coordinator over ``torch.distributed``.

The coordinator never uses the user's process groups for its own traffic. It
creates a gloo group of its own (``dist.new_group(backend="gloo")``) over the
same ranks, so a checkpoint's collectives cannot interleave with a training
step's (which may run on NCCL, or on the default group) and a failed
checkpoint collective does not poison the training group.

* ``all_gather`` / ``gather`` / ``broadcast``: the object is JSON-encoded (never
  pickled); the lengths are exchanged first (all-gathered: gloo gathers tensors of
  one size, so every rank needs the widest), then padded ``uint8`` tensors, on the
  coordinator's gloo group (``gather``: to the root only).
* ``send_bytes`` / ``recv_bytes``: ``dist.send`` / ``dist.irecv`` of ``uint8``
  tensors that wrap the caller's buffer (``torch.frombuffer``, no copy).
* ``barrier``: the arrival protocol of :mod:`.barrier`, carried by the job's
  key-value store (the ``TCPStore`` that ``torchrun`` / ``init_process_group`` set
  up, under a prefix of the coordinator's group), not by gloo, so it still works
  after a gloo collective failed (the probe that names a missing rank relies on
  that). Notices go into numbered slots of a box per barrier and receiver:
  ``b<seq>/to0/<i>`` (rank 0's) and ``b<seq>/all/<i>`` (every other rank's); a
  sender takes the next number with ``add`` on ``<box>/n``, then writes the slot
  with ``set``; a reader takes slots in order (a counted slot not yet set is taken next
  time). Rank 0 deletes the keys of the earlier barriers once a barrier passes
  (every rank is done with them then).

  ``dist.monitored_barrier`` is not used: it names the missing ranks on rank 0
  only, and the other ranks then wait for the *group's* timeout (not the
  barrier's) and learn only that rank 0 failed; its failure also closes the
  group's connections.

Timeouts: the gloo group is created with the coordinator's ``timeout``; a
per-call ``timeout`` (``None``: the coordinator's) bounds each call; a longer one
becomes the gloo group's own timeout for that call (gloo ends an operation at its
group's timeout, so a call could otherwise not wait longer than the default). A
collective or receive that fails or times out leaves gloo work in flight that
cannot be cancelled, so the coordinator is then marked unusable: every later
call raises :class:`CoordinationError` (create a new coordinator; the user's
own groups are unaffected).
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import threading
import time
import warnings
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

from .._extras import install_hint
from ..errors import InvalidArgumentError
from .coordinator import CoordinationError, CoordinationTimeout, check_timeout, decode, encode
from .engine import IN_FLIGHT, EngineCoordinator, keep_posted

__all__ = ["TorchCoordinator"]

_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")
_LIVE: List["TorchCoordinator"] = []  # in creation order; closed in reverse at exit
_LIVE_LOCK = threading.Lock()
_MAX_TAG = 2**31 - 1


def _import_dist():
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:  # pragma: no cover - exercised only without torch
        raise CoordinationError(f"the torch coordinator needs PyTorch ({install_hint('torch')}): {e}") from e
    if not dist.is_available():  # pragma: no cover
        raise CoordinationError("this PyTorch build has no torch.distributed")
    return torch, dist


class _Done:
    """The work of an empty message: nothing to wait for."""

    def wait(self, timeout: Any = None) -> bool:
        return True


def _seconds(timeout: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(float(timeout), 0.001))


def _engine_text(err: BaseException) -> str:
    """The gist of a torch/gloo error: its first sentence, without gloo's source location."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    text = re.sub(r"^\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", text)
    return text.split(". ")[0]


class TorchCoordinator(EngineCoordinator):
    """Coordinate the ranks of ``group`` (default: all ranks) over ``torch.distributed``.

    ``group``: a process group of the user's whose ranks take part; the
    coordinator creates its own gloo group over the same ranks (collectively:
    for ``group=None`` every rank of the job must construct the coordinator, as
    with ``dist.new_group``; for a subgroup, only its members). ``timeout``
    (seconds): the default of every call (``None``:
    ``$SHARDCKPT_TIMEOUT``, else 600 s).

    If ``torch.distributed`` is not initialized yet, the default process group
    is initialized with gloo from the ``env://`` variables that ``torchrun``
    sets (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``).
    """

    _engine = "torch"
    _channel = "the job's key-value store"
    _poll_first = 0.0005  # each look at the store is a round trip
    _poll_max = 0.002  # a save's barrier after the writes waits ~0.1-0.3 s for the slowest client: see it quickly
    _poll_max_late = 0.01

    def __init__(self, group: Any = None, timeout: Optional[float] = None) -> None:
        torch, dist = _import_dist()
        self._torch = torch
        self._dist = dist
        self._timeout = check_timeout(timeout)
        self._failed: Optional[str] = None
        self._collectives = 0  # collectives waited for, counted alike on every client (names a failed one)
        self._barrier_seq = 0
        self._taken = (-1, 0)  # (barrier, notices of it taken so far)
        self._cleaned = 0  # rank 0: the barrier keys before this sequence number are deleted
        self._initialized_default = False
        if not dist.is_initialized():
            missing = [k for k in _ENV_VARS if k not in os.environ]
            if missing:
                raise CoordinationError(
                    "torch.distributed is not initialized and the env:// variables "
                    f"{', '.join(missing)} are not set: launch with torchrun, or call "
                    "torch.distributed.init_process_group() first")
            try:
                dist.init_process_group(backend="gloo", init_method="env://", timeout=_seconds(self._timeout))
            except Exception as e:
                raise CoordinationError(f"could not initialize torch.distributed from env://: {e}") from e
            self._initialized_default = True
        try:
            if group is None:
                self._group = dist.new_group(backend="gloo", timeout=_seconds(self._timeout))
            else:
                ranks = dist.get_process_group_ranks(group)
                self._group = dist.new_group(ranks=ranks, backend="gloo", timeout=_seconds(self._timeout),
                                             use_local_synchronization=True)
        except Exception as e:
            raise CoordinationError(f"could not create the coordinator's gloo group: {e}") from e
        self._group_timeout = self._timeout  # the gloo group's own timeout, set per call (_gloo_timeout)
        self._rank = dist.get_rank(self._group)
        self._size = dist.get_world_size(self._group)
        if self._rank < 0:
            raise CoordinationError("this process is not a member of the coordinator's group")
        self._store = self._make_store()
        with _LIVE_LOCK:
            _LIVE.append(self)

    def clone(self) -> "TorchCoordinator":
        """The same ranks on a new gloo group of its own (collective over those ranks)."""
        return TorchCoordinator(group=self._group, timeout=self._timeout)

    def _make_store(self):
        dist = self._dist
        try:
            base = dist.distributed_c10d._get_default_store()
        except Exception as e:  # pragma: no cover - every initialized default group has a store
            raise CoordinationError(f"torch.distributed has no key-value store for the barrier: {e}") from e
        name = getattr(self._group, "group_name", None) or dist.distributed_c10d._get_process_group_name(self._group)
        return dist.PrefixStore(f"shardckpt/coord/{name}/", base)

    # -- properties -------------------------------------------------------------------------------------------



    @property
    def backend(self) -> str:
        return "torch"


    @property
    def group(self) -> Any:
        """The coordinator's own gloo process group (not the user's, not the default group)."""
        return self._group

    # -- helpers ----------------------------------------------------------------------------------------------




    def _gloo_timeout(self, timeout: Optional[float]) -> None:
        """Make the gloo group's own timeout the call's when that is longer than the coordinator's, so a call may
        wait longer than the default (gloo ends an operation at its group's timeout, whatever the wait allows).

        Never shorter than the coordinator's: an operation the caller stopped waiting for stays in flight
        (a client a little late still completes it), rather than gloo closing the connections at once.
        """
        seconds = max(self._timeout, self._timeout if timeout is None else float(timeout))
        if seconds == self._group_timeout:
            return
        try:
            self._group._get_backend(self._torch.device("cpu"))._set_default_timeout(_seconds(seconds))
            self._group_timeout = seconds
        except Exception:  # noqa: BLE001 - a torch without it: calls are capped at the group's timeout
            pass

    def _wait(self, work: Any, deadline: float, what: str, timeout: Optional[float]) -> None:
        """Wait for gloo ``work`` until ``deadline``; on failure, mark the coordinator unusable and raise."""
        self._collectives += 1
        number = self._collectives
        try:
            work.wait(timeout=_seconds(deadline - time.monotonic()))
            return
        except Exception as e:
            err = e
        shown = self._timeout if timeout is None else timeout
        text = _engine_text(err)
        missing, late = self._probe(shown, number)  # a barrier on the key-value store: works without gloo
        self._failed = f"{what} failed"
        if late:  # the others timed out waiting for this rank, and may be gone: gloo's error says little
            raise CoordinationTimeout(
                f"rank {self._rank}: {what} failed: this rank arrived after the other clients had given up "
                f"waiting for it (they timed out); the engine said: {text}",
                missing=sorted({self._rank, *missing})) from err
        who = f"rank(s) {missing} did not reach a barrier after it" if missing else "could not tell which client"
        if "timed out" in str(err).lower() or time.monotonic() >= deadline:
            raise CoordinationTimeout(
                f"rank {self._rank}: {what} did not complete within {shown:g} s ({who}): {text}",
                missing=missing) from err
        raise CoordinationError(f"rank {self._rank}: {what} failed (a client may have died; {who}): {text}",
                                missing=missing) from err

    def _as_bytes_tensor(self, data: Any, writable: bool):
        mv = memoryview(data)
        if not mv.contiguous:
            raise InvalidArgumentError("buffer must be contiguous")
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if writable and mv.readonly:
            raise InvalidArgumentError("receive buffer is read-only")
        if mv.nbytes == 0:  # frombuffer refuses an empty buffer; nothing travels for it
            return mv, self._torch.empty(0, dtype=self._torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # frombuffer warns on read-only buffers; gloo only reads a send's
            return mv, self._torch.frombuffer(mv, dtype=self._torch.uint8)

    # -- collectives ------------------------------------------------------------------------------------------

    def _padded_payload(self, payload: bytes, deadline: float, what: str,
                        timeout: Optional[float]) -> Tuple[List[int], Any]:
        """Every rank's payload length (all-gathered: gloo moves only equal-sized tensors) and this
        rank's payload padded to the longest."""
        torch, dist = self._torch, self._dist
        lengths = torch.zeros(self._size, dtype=torch.int64)
        work = dist.all_gather(list(lengths.split(1)), torch.tensor([len(payload)], dtype=torch.int64),
                               group=self._group, async_op=True)
        self._wait(work, deadline, f"{what} (lengths)", timeout)
        sizes = [int(n) for n in lengths.tolist()]
        send = torch.zeros(max(sizes), dtype=torch.uint8)
        send[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return sizes, send

    def _decode_rows(self, out: Any, sizes: List[int], what: str) -> List[Any]:
        """Row ``r`` of ``out``, cut to ``sizes[r]`` bytes, decoded; undecodable data fails the coordinator."""
        raw = out.numpy()
        result = []
        for r, n in enumerate(sizes):
            try:
                result.append(decode(raw[r, :n].tobytes()))
            except ValueError as e:
                self._failed = f"{what} received undecodable data"
                raise CoordinationError(f"{what}: rank {r} sent data that is not JSON: {e}") from e
        return result

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        self._check()
        torch, dist = self._torch, self._dist
        deadline = self._deadline(timeout)
        self._gloo_timeout(timeout)
        payload = encode(obj)
        if self._size == 1:
            return [decode(payload)]
        sizes, send = self._padded_payload(payload, deadline, "all_gather", timeout)
        out = torch.empty((self._size, send.numel()), dtype=torch.uint8)
        work = dist.all_gather(list(out.unbind(0)), send, group=self._group, async_op=True)
        self._wait(work, deadline, "all_gather", timeout)
        return self._decode_rows(out, sizes, "all_gather")

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        self._check()
        self._check_peer(root, "gather root")
        torch, dist = self._torch, self._dist
        deadline = self._deadline(timeout)
        self._gloo_timeout(timeout)
        payload = encode(obj)
        if self._size == 1:
            return [decode(payload)]
        sizes, send = self._padded_payload(payload, deadline, "gather", timeout)
        out = torch.empty((self._size, send.numel()), dtype=torch.uint8) if self._rank == root else None
        work = dist.gather(send, list(out.unbind(0)) if out is not None else None, group=self._group,
                           group_dst=root, async_op=True)
        self._wait(work, deadline, f"gather to rank {root}", timeout)
        if out is None:
            return None
        return self._decode_rows(out, sizes, "gather")

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        self._check()
        self._check_peer(root, "broadcast root")
        torch, dist = self._torch, self._dist
        deadline = self._deadline(timeout)
        self._gloo_timeout(timeout)
        if self._size == 1:
            return decode(encode(obj))
        payload = encode(obj) if self._rank == root else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        work = dist.broadcast(length, group=self._group, group_src=root, async_op=True)
        self._wait(work, deadline, f"broadcast from rank {root} (length)", timeout)
        n = int(length.item())
        if self._rank == root:
            buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        else:
            buf = torch.empty(n, dtype=torch.uint8)
        work = dist.broadcast(buf, group=self._group, group_src=root, async_op=True)
        self._wait(work, deadline, f"broadcast from rank {root}", timeout)
        if self._rank == root:
            return decode(payload)
        try:
            return decode(buf.numpy().tobytes())
        except ValueError as e:
            self._failed = "broadcast received undecodable data"
            raise CoordinationError(f"broadcast: rank {root} sent data that is not JSON: {e}") from e

    # -- point to point ---------------------------------------------------------------------------------------

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        self._check()
        self._check_peer(dst, "send destination")
        if not 0 <= tag <= _MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} out of range [0, {_MAX_TAG}]")
        mv, tensor = self._as_bytes_tensor(data, writable=False)
        if mv.nbytes == 0:
            return
        try:
            self._dist.send(tensor, group=self._group, group_dst=dst, tag=tag)
        except Exception as e:
            self._failed = f"send to rank {dst} failed"
            raise CoordinationError(f"rank {self._rank}: sending {mv.nbytes} bytes to rank {dst} failed: {e}") from e

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        self._check()
        self._check_peer(src, "receive source")
        if not 0 <= tag <= _MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} out of range [0, {_MAX_TAG}]")
        if nbytes < 0:
            raise InvalidArgumentError(f"nbytes must be >= 0, got {nbytes}")
        deadline = self._deadline(timeout)
        self._gloo_timeout(timeout)
        if out is None:
            out = memoryview(bytearray(nbytes))
        mv = memoryview(out)
        if mv.format != "B" or mv.ndim != 1:
            mv = mv.cast("B")
        if mv.nbytes < nbytes:
            raise InvalidArgumentError(f"receive buffer holds {mv.nbytes} bytes, {nbytes} expected")
        mv = mv[:nbytes]
        if nbytes == 0:
            return mv
        mv, tensor = self._as_bytes_tensor(mv, writable=True)
        work = self._dist.irecv(tensor, group=self._group, group_src=src, tag=tag)
        self._wait(work, deadline, f"receive of {nbytes} bytes from rank {src}", timeout)
        return mv

    def send_many(self, buffers: Sequence[memoryview], dst: int, tag: int = 0) -> None:
        """Gloo pays a round between the peers for each message: up to :data:`IN_FLIGHT` sends are kept in
        flight, so that a stream of messages moves at the link's rate."""
        self._check()
        self._check_peer(dst, "send destination")
        if not 0 <= tag <= _MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} out of range [0, {_MAX_TAG}]")
        tensors = [tensor for mv, tensor in (self._as_bytes_tensor(buffer, writable=False) for buffer in buffers)
                   if mv.nbytes]
        try:
            keep_posted((self._dist.isend(tensor, group=self._group, group_dst=dst, tag=tag) for tensor in tensors),
                        lambda work: work.wait(), IN_FLIGHT)
        except Exception as e:
            self._failed = f"send to rank {dst} failed"
            raise CoordinationError(f"rank {self._rank}: sending to rank {dst} failed: {e}") from e

    def recv_many(self, src: int, outs: Sequence[memoryview], tag: int = 0, timeout: Optional[float] = None,
                  landed: Optional[Callable[[int], None]] = None) -> None:
        """Up to :data:`IN_FLIGHT` receives posted ahead (see :meth:`send_many`); ``landed(i)`` as each completes."""
        self._check()
        self._check_peer(src, "receive source")
        if not 0 <= tag <= _MAX_TAG:
            raise InvalidArgumentError(f"tag {tag} out of range [0, {_MAX_TAG}]")
        deadline = self._deadline(timeout)
        self._gloo_timeout(timeout)
        posted: Deque[Tuple[int, Any]] = deque()

        def complete() -> None:
            i, work = posted.popleft()
            self._wait(work, deadline, f"receive of message {i} from rank {src}", timeout)
            if landed is not None:
                landed(i)

        for i, out in enumerate(outs):
            mv, tensor = self._as_bytes_tensor(out, writable=True)
            if mv.nbytes == 0:
                posted.append((i, _Done()))
            else:
                posted.append((i, self._dist.irecv(tensor, group=self._group, group_src=src, tag=tag)))
            if len(posted) >= IN_FLIGHT:
                complete()
        while posted:
            complete()

    # -- barrier transport (the protocol is in .barrier) ------------------------------------------------------

    def _post(self, seq: int, notice: Dict[str, Any], to: Optional[int]) -> None:
        box = f"b{seq}/all" if to is None else f"b{seq}/to{to}"
        slot = self._store.add(f"{box}/n", 1)
        self._store.set(f"{box}/{slot}", encode(notice))

    def _take(self, seq: int) -> List[Dict[str, Any]]:
        # The protocol posts only to rank 0 and to everyone: rank 0 reads its box, the others the shared one.
        box = f"b{seq}/to0" if self._rank == 0 else f"b{seq}/all"
        store = self._store
        read = self._taken[1] if self._taken[0] == seq else 0
        count = store.add(f"{box}/n", 0)
        notices = []
        while read < count:
            key = f"{box}/{read + 1}"
            if not store.check([key]):  # counted, not yet set: taken next time
                break
            notices.append(decode(store.get(key)))
            read += 1
        self._taken = (seq, read)
        return notices

    def _retire(self, seq: int) -> None:
        store = self._store
        for old in range(self._cleaned, seq):
            for box in (f"b{old}/to0", f"b{old}/all"):
                count = store.add(f"{box}/n", 0)
                for slot in range(1, count + 1):
                    store.delete_key(f"{box}/{slot}")
                store.delete_key(f"{box}/n")
        self._cleaned = seq

    # -- lifetime ---------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Destroy the coordinator's own group (and the default group, if this coordinator created it)."""
        dist = self._dist
        group, self._group = getattr(self, "_group", None), None
        if self._failed is None:
            self._failed = "closed"
        if group is None or not dist.is_initialized():
            return
        try:
            dist.destroy_process_group(group)
        except Exception:  # pragma: no cover - best effort
            pass
        if self._initialized_default:
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover
                pass


@atexit.register
def _close_at_exit() -> None:
    """Tear down every coordinator's gloo group (clones first), then the default group if a coordinator
    created it, before the interpreter finalises.

    A script that simply ends (no close call) would otherwise leave the groups and the
    key-value store to be destroyed during interpreter teardown, while their C++ threads
    may still be alive: the process then aborts ("terminate called without an active
    exception") after the checkpoint committed, and the launcher reports a failure.
    Background saves were already waited for (``saving.async_save`` joins them before
    atexit handlers run).
    """
    with _LIVE_LOCK:
        live = list(reversed(_LIVE))
        _LIVE.clear()
    default_owner = None
    for coordinator in live:
        if coordinator._initialized_default:
            default_owner = coordinator
            coordinator._initialized_default = False  # destroyed last, once
        try:
            coordinator.close()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    if default_owner is not None:
        try:
            if default_owner._dist.is_initialized():
                default_owner._dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
