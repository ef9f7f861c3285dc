"""The one restore loop: :func:`run` serves a :class:`~.plan.RestorePlan` from its source.

Every front door (``Checkpoint.restore``/``read``, ``dtensor`` restores, ``shardckpt.jax.restore``,
DCP's ``TFBundleReader``, ``restore_tensors``) plans against a :class:`~.source.PieceSource`'s
metadata, checking every target before anything is read, and hands the plan here. Steps:

1. **share** (:mod:`.sharing`, metadata only): the region reads of a batch (a deferring
   plan's, or one group of a streaming plan) are planned together: a stored piece that their
   parts cover and cut across (columns of row blocks: a resharded restore) is to be read
   once, whole and checksummed, and cut into every read's destination (a
   :class:`~.sharing.PieceCut`); the reads' other parts, and every read that shares nothing,
   are read as they are. A batch's destinations are allocated when it is admitted.
2. **announce** (once): every read the plan will make (shared pieces whole), so object stores
   fetch the byte ranges in few large requests ahead of the reads, and local files whose
   reads leave gaps get a guide (a plan of one read is not announced: its read fetches its
   own ranges, and a guide would map the file for nothing).
3. **read**, on one pool of ``plan.workers`` threads (none when ``workers == 1``):

   * a *deferring* plan (the default) opens one read session: whole-tensor reads are planned
     in one pass on the calling thread and read and checksummed by the source's helpers;
     the jobs of its region reads run on the pool meanwhile (a shared piece is complete and
     checked before it is cut). Leaving the session waits for every read and raises the
     first failure (a read error, a checksum mismatch, a replaced file).
   * a *streaming* plan (``defer=False``) admits groups in order while their bytes in flight
     (the group's ``nbytes`` and its shared pieces' buffers) stay within ``plan.budget``; each
     group is complete and checked when its ``done`` runs, so a front door builds each value
     (a ``jax.Array``) and drops its buffers as it goes (the destinations of groups with a
     ``done`` are not kept, nor returned).

   Piece buffers come from one :class:`~.sharing.Scratch` per run, reused by the next piece
   (at most one per reading thread at a time).

   A read with ``then`` is read and checked at once, and ``then`` runs on its thread.
4. **report**: groups' ``done`` run on the calling thread, in order (after the session's
   checks for a deferring plan); :func:`run` returns every read's destination, in order.

A *collective* source (a funnelled restore) records the reads instead; its bytes move when the
front door's :func:`collective_call` block ends (every client), and the follow-ups (``then``,
``done``) run then. Nothing here writes to storage; a failed restore raises on the caller.
"""

from __future__ import annotations

import contextlib
import functools
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

import numpy as np

from .plan import Read, ReadGroup, RestorePlan
from .sharing import Batch, Job, Scratch, Sharing, share
from .source import PieceSource

__all__ = ["run", "read_one", "collective_call"]


def run(plan: RestorePlan) -> List[np.ndarray]:
    """Serve ``plan`` (see the module docstring); every read's destination, in the plan's order."""
    source: PieceSource = plan.source
    if source.collective:
        return _record(plan)
    reads = plan.reads
    if plan.defer:
        shared = [share(source, [r for r in reads if not r.whole])]
        announced = [r for r in reads if r.whole] + shared[0].reads()
    else:
        shared = [share(source, group.reads, limit=plan.budget) for group in plan.groups]
        announced = [r for sharing in shared for r in sharing.reads()]
    if len(reads) > 1:  # one read fetches its own ranges: announcing it would only guide (map) the file
        source.announce(announced)
    if plan.defer:
        return _run_deferred(plan, shared[0])
    return _run_streaming(plan, shared)


def read_one(source: PieceSource, read: Read, *, verify: bool = True) -> np.ndarray:
    """A plan of one read, on the calling thread, complete and checked when it returns (streaming
    consumers: a conversion, a tool; no read session, so no read-ahead helpers or their buffers)."""
    return run(RestorePlan.of(source, [read], verify=verify, workers=1, defer=False))[0]


@contextlib.contextmanager
def collective_call(source: PieceSource) -> Iterator[PieceSource]:
    """One restore call on ``source``: for a collective source, leaving the block moves the bytes of
    every read recorded in it (every client, in the same order) and runs their follow-ups; a
    failure inside the block is told to the other clients (they raise) and re-raised here."""
    if not source.collective:
        yield source
        return
    try:
        yield source
    except BaseException as exc:
        source.finish(exc)
        raise
    source.finish()


def _one(source: PieceSource, read: Read, session: Any, verify: bool) -> np.ndarray:
    if read.then is not None:  # read and checked now, followed up on this thread
        value = source.read(read, None, verify=verify)
        read.then(value)
        return value
    return source.read(read, session, verify=verify)


def _job(source: PieceSource, job: Job, session: Any, verify: bool, scratch: Scratch) -> Optional[np.ndarray]:
    """One job of a batch: a read (its value), or a shared piece read whole and cut, or a part of a read
    with a follow-up (nothing: they fill destinations the batch holds)."""
    if isinstance(job, Read):
        return _one(source, job, session, verify)
    job.run(source, verify, scratch)
    return None


@contextlib.contextmanager
def _pool(workers: int, jobs: int) -> Iterator[Optional[ThreadPoolExecutor]]:
    if workers <= 1 or jobs <= 1:
        yield None
        return
    pool = ThreadPoolExecutor(max_workers=min(workers, jobs), thread_name_prefix="shardckpt-read")
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def _finish_groups(groups: Tuple[ReadGroup, ...], values: List[np.ndarray]) -> None:
    at = 0
    for group in groups:
        n = len(group.reads)
        if group.done is not None:
            group.done(values[at:at + n])
        at += n


def _run_deferred(plan: RestorePlan, shared: Sharing) -> List[np.ndarray]:
    source, verify = plan.source, plan.verify
    reads = plan.reads
    out: List[Optional[np.ndarray]] = [None] * len(reads)
    wholes = [i for i, r in enumerate(reads) if r.whole]
    others = [i for i, r in enumerate(reads) if not r.whole]
    batch = shared.batch()
    jobs = batch.jobs
    scratch = Scratch(plan.workers)
    with source.reading(defer=True) as session:
        with _pool(plan.workers, len(jobs)) as pool:
            futures = [pool.submit(_job, source, job, session, verify, scratch) for job in jobs] if pool else []
            for i, value in zip(wholes, source.read_whole([reads[i] for i in wholes], session, verify=verify)):
                out[i] = value
            results = [f.result() for f in futures] if pool else \
                [_job(source, job, session, verify, scratch) for job in jobs]
    for i, value in zip(others, batch.values(results)):
        out[i] = value
    values: List[np.ndarray] = [v for v in out if v is not None]
    _finish_groups(plan.groups, values)
    return values


def _run_streaming(plan: RestorePlan, shared: List[Sharing]) -> List[np.ndarray]:
    source, verify = plan.source, plan.verify
    budget = plan.budget
    values: List[np.ndarray] = []
    pending: Deque[Tuple[ReadGroup, Batch, int, List["Future[Optional[np.ndarray]]"]]] = deque()
    upcoming = iter(zip(plan.groups, shared))
    following = next(upcoming, None)
    in_flight = 0
    scratch = Scratch(plan.workers)
    with _pool(plan.workers, len(plan.reads)) as pool:
        def submit(job: Job) -> "Future[Optional[np.ndarray]]":
            if pool is not None:
                return pool.submit(_job, source, job, None, verify, scratch)
            done: "Future[Optional[np.ndarray]]" = Future()
            done.set_result(_job(source, job, None, verify, scratch))
            return done

        while following is not None or pending:
            while following is not None:
                group, sharing = following
                held = group.nbytes + sharing.extra  # the group's shared pieces' buffers count too
                if pending and budget is not None and in_flight + held > budget:
                    break
                batch = sharing.batch()
                pending.append((group, batch, held, [submit(job) for job in batch.jobs]))
                in_flight += held
                following = next(upcoming, None)
            done_group, served, done_held, futures = pending.popleft()
            got = served.values([f.result() for f in futures])
            if done_group.done is not None:
                done_group.done(got)  # the group's buffers are the front door's now (dropped once it built its value)
            else:
                values.extend(got)
            in_flight -= done_held
            del got, futures, served
    return values


def _record(plan: RestorePlan) -> List[np.ndarray]:
    """A collective source: record every read; the follow-ups run once its bytes are in."""
    source = plan.source
    values = [source.read(r, None, verify=plan.verify) for r in plan.reads]
    follow_ups: List[Callable[[], None]] = []
    for read, value in zip(plan.reads, values):
        if read.then is not None:
            follow_ups.append(functools.partial(read.then, value))
    if any(g.done is not None for g in plan.groups):
        follow_ups.append(lambda: _finish_groups(plan.groups, values))
    for follow_up in follow_ups:
        source.after(follow_up)
    return values
