"""The save engine: the one path every save takes, on one client or many.

A save is collective over a :class:`~shardckpt.distributed.Coordinator`; a
single-process save runs the same path over
:class:`~shardckpt.distributed.single.SingleProcessCoordinator`, where every collective
is trivial. Steps (``io``: the request's io client; ``all``: every client)::

    plan      all  the values become a SavePlan (sharding callback, validation)
    arrange   all  incremental saves: each client compares its pieces with the
                   previous checkpoint (versions, else xxh3-128 hashes) and turns
                   the data files mostly still in use (their unchanged pieces)
                   into shards to reuse (saving/incremental.py); before staging,
                   so unchanged values are never copied
    stage     all  with enable_async: values are copied to host buffers; the rest
                   runs on a background thread over a clone of the coordinator
    prepare   io   committer.prepare(): leftovers removed, scratch area made,
                   registered savers' bundles written
    identity  all  all-gather of every client's save identity (prefix, number),
                   its shard count and the io client's setup: clients running
                   different saves fail; shard i of client r gets the id
                   first + sum(counts[:r]) + i; committer.plan(total)
    write     all  committer.write_shard() per own shard, in parallel, on a helper
                   thread, while on this thread:
    number    all  gather of piece descriptions (and a digest of the list of every
                   variable the client holds, written or not) to the io client,
                   which checks that the pieces tile each tensor and the digests
                   are one (agreement.py) and broadcasts its verdict; only when the
                   digests differ, one more gather brings one list per digest to
                   the io client, which names the clients and variables that
                   differ (one more broadcast); a disagreement fails every client
                   alike once all writes ended (a barrier), before anything is
                   committed.
                   With funnelling (the io client first receives everyone's
                   values) the counts come with this step and the writes follow it
    agree     all  barrier (a dead client is named), then one all-gather of every
                   client's success and written parts: any failure fails the save
                   everywhere, nothing committed, committer.abort() on the io client
    commit    io   committer.commit(): the commit point; then committer.finish()
                   and the request's on_commit (the state file)   -> broadcast
                   (with a SharedCommitStep's result)
    after     all  a SharedCommitStep's adopt (a manager's state), then write
                   callbacks, on every client once the commit is known

When a step fails on some client, every client raises the same
:class:`~shardckpt.distributed.CoordinationError` naming the client(s) and their errors
(on a failing client it is chained to the original error); a single client raises
its original error. Which store is written
(rename-commit or index-last, or their incremental forms that link or copy reused
data files) is the committer's business; the engine never asks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..distributed.coordinator import CoordinationError, CoordinationTimeout, Coordinator, raise_failures
from ..runtime import ThreadPool
from .agreement import (
    check_pieces,
    describe_pieces,
    held_digest,
    held_problem,
    held_representatives,
    identity_problem,
    pack_pieces,
    save_identity,
)
from .async_save import AsyncSaver
from .commit import Committer, committer_for
from .commit.base import Written
from .context import default_context
from .funnel import describe_plan, receive_plan, send_plan
from .incremental import arrange, load_previous
from .plan import SavePlan, ShardPlan, TensorsToSave, make_save_plan
from .request import SaveRequest, SharedCommitStep, default_workers

__all__ = ["save", "run_save", "SaveStats"]

_log = logging.getLogger("shardckpt")


@dataclass(frozen=True)
class SaveStats:
    """What one client's part of a save did."""

    prefix: str
    num_shards: int
    bytes_written: int
    seconds: float
    #: bytes of data files reused from the previous checkpoint (linked or copied, not written)
    bytes_reused: int = 0


def save(tensors: TensorsToSave, request: SaveRequest, coordinator: Coordinator,
         saver: Optional[AsyncSaver] = None) -> str:
    """Save this client's ``tensors`` (arrays or :class:`~shardckpt.ShardableTensor`) as part of one
    checkpoint at ``request.location``; collective over ``coordinator``. Returns the prefix.

    With ``request.options.enable_async`` the values are staged and the call returns;
    the rest runs on ``saver``'s thread (default: the process's) over a clone of
    ``coordinator``; errors surface at the next save, ``sync()`` or exit.
    """
    options = request.options
    if tensors or coordinator.size == 1:
        plan = make_save_plan(tensors, options.sharding_callback)
    else:
        plan = SavePlan.empty()  # others may have values; the save fails if nobody has any
    if options.incremental:
        plan = _arrange(plan, request, saver)
    if options.enable_async:
        context = default_context()
        background = context.background(coordinator)
        current = getattr(coordinator, "timeout", None)  # engine-backed coordinators have one
        if request.timeout is None and isinstance(current, float):
            # the clone was made once; the caller's coordinator's timeout now is the one that counts
            request = dataclasses.replace(request, timeout=current)
        saver = saver or context.saver()
        saver.set_budget(options.async_staging_bytes)
        saver.submit(request.prefix, plan, lambda staged: _log_stats(run_save(staged, request, background)),
                     request.on_failure)
    else:
        if saver is not None:
            saver.wait()  # never interleave with a save in flight
        _log_stats(run_save(plan, request, coordinator))
    return request.prefix


def _arrange(plan: SavePlan, request: SaveRequest, saver: Optional[AsyncSaver]) -> SavePlan:
    """The arrange step of an incremental save (see :mod:`shardckpt.saving.incremental`)."""
    if request.funnel:
        _log.info("incremental save of %s: values funnelled to the io client are written in full", request.prefix)
        return plan
    if request.options.enable_async:  # the previous save's sidecar must be there
        (saver or default_context().saver()).wait()
    elif saver is not None:
        saver.wait()
    fs = request.location.fs
    previous = load_previous(request.previous or request.prefix, fs)
    if previous is None and request.previous is not None and request.previous != request.prefix:
        previous = load_previous(request.prefix, fs)
    return arrange(plan, previous, trust_versions=request.options.trust_versions)


def _log_stats(stats: SaveStats) -> None:
    _log.info("saved %s: %d shards, %d bytes written, %d reused in %.3f s", stats.prefix, stats.num_shards,
              stats.bytes_written, stats.bytes_reused, stats.seconds)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def run_save(plan: SavePlan, request: SaveRequest, coordinator: Coordinator) -> SaveStats:
    """Write ``plan`` (this client's shards) and commit the checkpoint, collectively (see the module docstring).

    A :class:`CoordinationError` (or timeout) of the coordinator's names the save it failed
    (``the save of <prefix>: ...``), with the same type, ``missing`` and ``elsewhere``.
    """
    try:
        return _run_save(plan, request, coordinator)
    except CoordinationError as exc:
        named = _naming_save(exc, request.prefix)
        if named is exc:
            raise
        raise named from exc


def _naming_save(exc: CoordinationError, prefix: str) -> CoordinationError:
    """``exc``, or the same error whose message starts with the save's name when it does not name it."""
    if f"the save of {prefix}" in str(exc) or type(exc) not in (CoordinationError, CoordinationTimeout):
        return exc
    return type(exc)(f"the save of {prefix} failed: {exc}", missing=exc.missing, elsewhere=exc.elsewhere)


def _run_save(plan: SavePlan, request: SaveRequest, coordinator: Coordinator) -> SaveStats:
    started = time.perf_counter()
    prefix, io, timeout = request.prefix, request.io_rank, request.timeout
    is_io = coordinator.rank == io
    committer = committer_for(request.location, fsync=request.fsync, incremental=request.options.incremental)

    # prepare [io] -> everyone checks it runs the same save, and adopts the io client's decisions
    identity = save_identity(coordinator, prefix)
    setup: Dict[str, Any] = {}
    prepare_error: Optional[Exception] = None
    if is_io:
        try:
            setup = committer.prepare(request.extra_bundles)
        except Exception as exc:  # reported to everyone below
            prepare_error = exc
            setup = {"error": _describe(exc)}
            committer.abort()
        except BaseException:
            committer.abort()
            raise
    # Without funnelling every client knows its shard count now: it travels with the identity, so the
    # shard ids are known after this round and the writes overlap the io client's check of the pieces.
    early = not request.funnel and coordinator.size > 1
    try:
        first_round = coordinator.all_gather({"id": identity, "setup": setup,
                                              "shards": len(plan.shards) if early else None}, timeout=timeout)
        problem = identity_problem([r["id"] for r in first_round], io)
        if problem is not None:
            raise CoordinationError(f"the save of {prefix}: {problem}")
    except BaseException:
        if is_io:  # a client missing or running another save: nothing of ours may stay
            committer.abort()
        raise
    setup = first_round[io]["setup"]
    if "error" in setup:
        _fail(coordinator, prepare_error,
              CoordinationError(f"client {io} could not prepare the save of {prefix}: {setup['error']}"))
    committer.adopt(setup)

    own_error: Optional[Exception] = None
    written: List[Written] = []
    failure: Optional[BaseException] = None
    try:
        if early:
            written, own_error = _write_checking_pieces(plan, request, coordinator, committer,
                                                        [int(r["shards"]) for r in first_round])
        else:
            shards, total, offset, disagreement = _number_shards(plan, request, coordinator)
            if disagreement is not None:
                raise CoordinationError(f"the save of {prefix} was not committed: {disagreement}")
            first = committer.first_shard_id
            committer.plan(first + total)
            if total == 0:
                own_error = CoordinationError(f"nothing to save on any client for {prefix}")
            else:
                try:
                    written = _write_shards(committer, shards, first + offset, request.max_workers)
                except Exception as exc:
                    own_error = exc
        coordinator.barrier(f"shards of {prefix} written", timeout=timeout)
        # one round: every client's success (Coordinator.agree's check) and what it wrote
        results = coordinator.all_gather({"ok": own_error is None, "written": written,
                                          "error": _describe(own_error) if own_error is not None else ""},
                                         timeout=timeout)
        raise_failures(results)
        gathered = [r["written"] for r in results]
    except BaseException as exc:
        failure = exc
        if is_io:
            committer.abort()
    if failure is not None:
        _fail(coordinator, own_error, failure)

    # commit [io] -> everyone learns the outcome; write callbacks everywhere
    commit_error: Optional[Exception] = None
    outcome: Dict[str, Any] = {"ok": True}
    if is_io:
        try:
            committer.commit([w for client in gathered for w in client])
        except Exception as exc:
            commit_error = exc
            committer.abort()
            outcome = {"ok": False, "error": _describe(exc)}
        except BaseException:  # Ctrl-C: leave nothing claimed, maybe committed (the index says)
            committer.abort()
            raise
        else:
            committer.finish()
            if request.on_commit is not None:
                try:
                    recorded = request.on_commit(prefix)
                    if isinstance(request.on_commit, SharedCommitStep):
                        outcome["shared"] = recorded
                except Exception as exc:
                    commit_error = exc
                    outcome = {"ok": False, "error": f"after the commit: {_describe(exc)}"}
    outcome = coordinator.broadcast(outcome, root=io, timeout=timeout)
    if not outcome["ok"]:
        _fail(coordinator, commit_error,
              CoordinationError(f"the save of {prefix} failed on client {io}: {outcome['error']}"))
    if isinstance(request.on_commit, SharedCommitStep):
        request.on_commit.adopt(prefix, outcome.get("shared"))
    request.options.run_write_callbacks(prefix)
    return SaveStats(prefix, committer.num_shards, sum(int(w["bytes"]) for w in written),
                     time.perf_counter() - started, sum(int(w.get("reused", 0)) for w in written))


def _fail(coordinator: Coordinator, own: Optional[BaseException], agreed: BaseException) -> None:
    """Raise a failed save's error: a single client's own error, else the agreed one (chained to ours)."""
    if own is not None and (coordinator.size == 1 or agreed is own):
        raise own
    if own is not None:
        raise agreed from own
    raise agreed


def _number_shards(plan: SavePlan, request: SaveRequest, coordinator: Coordinator
                   ) -> Tuple[List[ShardPlan], int, int, Optional[str]]:
    """The shards this client writes (all of them on the io client when funnelling), the total over
    all clients, this client's first shard number among them, and what is wrong with the union
    of all clients' pieces (``None``: they tile every tensor)."""
    rank, io, timeout = coordinator.rank, request.io_rank, request.timeout
    pieces = describe_pieces(plan)
    shards: List[ShardPlan] = list(plan.shards)
    if request.funnel and coordinator.size > 1:
        described = coordinator.gather(describe_plan(plan) if rank != io else [], root=io, timeout=timeout)
        if described is not None:
            for source in range(coordinator.size):
                if source != io:
                    shards += receive_plan(described[source], coordinator, source)
        else:
            send_plan(plan, coordinator, io)
            shards = []
    # Only the io client receives and checks every client's pieces; everyone learns its verdict.
    verdict = _pieces_verdict(coordinator, request, len(shards), pack_pieces(pieces), with_counts=True)
    counts = verdict["counts"]
    return shards, sum(counts), sum(counts[:rank]), verdict["problem"]


def _pieces_verdict(coordinator: Coordinator, request: SaveRequest, shards: int, packed: str, *,
                    with_counts: bool) -> Dict[str, Any]:
    """Gather every client's shard count, packed pieces and digest of what it holds to the io client,
    which checks them; return its verdict, broadcast to all: ``{"problem": message or None}`` and,
    ``with_counts``, ``"counts"`` (every client's shard count). Only when the digests differ, one
    client of each digest sends its whole list in one more gather (:func:`_held_verdict`)."""
    io, timeout = request.io_rank, request.timeout
    held = request.held if coordinator.size > 1 else None
    gathered = coordinator.gather({"shards": shards, "pieces": packed, "held": held_digest(held)}, root=io,
                                  timeout=timeout)
    verdict: Dict[str, Any] = {}
    digests: List[Optional[str]] = []
    if gathered is not None:
        if with_counts:
            verdict["counts"] = [int(g["shards"]) for g in gathered]
        digests = [g.get("held") for g in gathered]
        ask = held_representatives(digests)
        if ask is not None:
            verdict["held_from"] = ask
        try:
            verdict["problem"] = check_pieces([g["pieces"] for g in gathered])
        except Exception as exc:  # a table that does not decode: every client fails alike
            verdict["problem"] = f"client {io} could not check the clients' pieces: {_describe(exc)}"
        del gathered
    verdict = dict(coordinator.broadcast(verdict, root=io, timeout=timeout))
    if verdict.get("held_from") is not None:
        held_said = _held_verdict(coordinator, request, verdict["held_from"], digests)
        if held_said is not None:
            verdict["problem"] = "; ".join(p for p in (verdict["problem"], held_said) if p)
    return verdict


def _held_verdict(coordinator: Coordinator, request: SaveRequest, ask: List[int],
                  digests: List[Optional[str]]) -> Optional[str]:
    """The clients in ``ask`` send the io client their lists of what they hold; it names what differs
    (:func:`~.agreement.held_problem`), broadcast to all (``digests``: every client's, on the io client)."""
    io, timeout = request.io_rank, request.timeout
    mine = list(request.held) if request.held is not None and coordinator.rank in ask else None
    lists = coordinator.gather(mine, root=io, timeout=timeout)
    said: Optional[str] = None
    if lists is not None:
        try:
            said = held_problem(digests, {r: lists[r] for r in ask})
        except Exception as exc:  # a list that does not parse: every client fails alike
            said = f"client {io} could not compare what the clients hold: {_describe(exc)}"
    result: Optional[str] = coordinator.broadcast(said, root=io, timeout=timeout)
    return result


def _write_checking_pieces(plan: SavePlan, request: SaveRequest, coordinator: Coordinator, committer: Committer,
                           counts: List[int]) -> Tuple[List[Written], Optional[Exception]]:
    """Write this client's shards (numbered from ``counts``, every client's shard count) while the io
    client checks every client's pieces; return what was written and this client's own error.

    The writes start before the verdict: a disagreement is rare, and the save then fails on every
    client alike (with the verdict's error) once every client's writes ended (a barrier), so nothing
    is committed and the io client's ``abort`` removes what was written. Collectives stay on this thread.
    """
    rank, timeout, prefix = coordinator.rank, request.timeout, request.prefix
    total, first = sum(counts), committer.first_shard_id
    committer.plan(first + total)
    if total == 0:
        return [], CoordinationError(f"nothing to save on any client for {prefix}")
    pool: Optional[ThreadPoolExecutor] = None
    writes: "Optional[Future[List[Written]]]" = None
    if plan.shards:
        pool = ThreadPool(max_workers=1, thread_name_prefix="shardckpt-save")
        writes = pool.submit(_write_shards, committer, plan.shards, first + sum(counts[:rank]), request.max_workers)
    try:
        verdict = _pieces_verdict(coordinator, request, len(plan.shards), pack_pieces(describe_pieces(plan)),
                                  with_counts=False)
    finally:  # never leave a write running behind a failed collective (the io client's abort removes its files)
        written: List[Written] = []
        own_error: Optional[Exception] = None
        if writes is not None and pool is not None:
            try:
                written = writes.result()
            except Exception as exc:
                own_error = exc
            pool.shutdown()
    if verdict["problem"] is not None:
        # every client stopped writing before the io client's abort removes the scratch area
        coordinator.barrier(f"shards of {prefix} written", timeout=timeout)
        raise CoordinationError(f"the save of {prefix} was not committed: {verdict['problem']}")
    return written, own_error


def _write_shards(committer: Committer, shards: Sequence[ShardPlan], first_id: int,
                  max_workers: Optional[int]) -> List[Written]:
    """Write this client's shards as ids ``first_id, first_id + 1, ...``, in parallel."""
    if not shards:
        return []
    workers = max_workers or default_workers(len(shards))
    if workers == 1 or len(shards) == 1:
        return [committer.write_shard(s, first_id + i) for i, s in enumerate(shards)]

    def run(batch: List[int]) -> List[Written]:
        return [committer.write_shard(shards[i], first_id + i) for i in batch]

    # Shards to write go one per task, first; reused ones (a link or a server-side copy each: quick,
    # and a previous checkpoint may have had hundreds) are spread over ``workers`` tasks, not one each.
    fresh = [[i] for i, s in enumerate(shards) if s.reuse is None]
    reused = [i for i, s in enumerate(shards) if s.reuse is not None]
    step = max(1, -(-len(reused) // workers))
    tasks = fresh + [reused[n:n + step] for n in range(0, len(reused), step)]
    out: List[Optional[Written]] = [None] * len(shards)
    with ThreadPool(max_workers=workers, thread_name_prefix="shardckpt-write") as pool:
        futures = [(batch, pool.submit(run, batch)) for batch in tasks]
        for batch, future in futures:
            for i, w in zip(batch, future.result()):
                out[i] = w
    return [w for w in out if w is not None]

