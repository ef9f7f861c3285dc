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
                   its shard count and the io client's Setup (or why it has
                   none): clients running different saves fail; shard i of
                   client r gets the id first + sum(counts[:r]) + i;
                   committer.plan(total)
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
                   committed (a single client whose pieces are whole tensors
                   under distinct keys has nothing to check and skips this).
                   With funnelling (the io client first receives everyone's
                   values) the counts come with this step and the writes follow it
    agree     all  barrier (a dead client is named), then one all-gather of every
                   client's success and Written parts: any failure fails the save
                   everywhere, nothing committed, committer.abort() on the io client
    commit    io   committer.commit(): the commit point; then committer.finish()
                   and the request's on_commit (the state file)   -> broadcast
                   (with a SharedCommitStep's result)
    after     all  a SharedCommitStep's adopt (a manager's state), then write
                   callbacks, on every client once the commit is known

Each collective step is a round of :mod:`.rounds` (all-gather; gather, judge on the io
client, broadcast; the io client's announcement; every client's success) carrying the typed
messages of :mod:`.messages` as JSON. When a step fails on some client, every client raises the same
:class:`~shardckpt.distributed.CoordinationError` naming the client(s) and their errors
(on a failing client it is chained to the original error); a single client raises
its original error; any failure before the commit runs ``committer.abort()`` on the io
client (:meth:`.rounds.Rounds.undoing`). Which store is written
(rename-commit or index-last, or their incremental forms that link or copy reused
data files) is the committer's business; the engine never asks.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..distributed.coordinator import CoordinationError, CoordinationTimeout, Coordinator
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
from .messages import Funnelled, HeldList, Hello, Parts, Pieces, Problem, Verdict
from .plan import SavePlan, ShardPlan, TensorsToSave, make_save_plan
from .request import SaveRequest, SharedCommitStep, default_workers
from .rounds import Json, Outcome, Rounds, describe

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
    prefix, io = request.prefix, request.io_rank
    committer = committer_for(request.location, fsync=request.fsync, incremental=request.options.incremental)
    rounds = Rounds(coordinator, io, request.timeout)
    # Without funnelling every client knows its shard count now: it travels with the identity, so the
    # shard ids are known after this round and the writes overlap the io client's check of the pieces.
    early = not request.funnel and coordinator.size > 1
    with rounds.undoing(committer.abort):  # failing anywhere before the commit leaves nothing of this save
        # prepare [io] -> everyone checks it runs the same save, and adopts the io client's decisions
        setup = rounds.on_root(lambda: committer.prepare(request.extra_bundles))
        number = save_identity(coordinator, prefix)[1]
        hello = rounds.all_gather(Hello((prefix, number), setup, len(plan.shards) if early else None))
        problem = identity_problem([list(h.identity) for h in hello], io)
        if problem is not None:
            raise CoordinationError(f"the save of {prefix}: {problem}")
        committer.adopt(rounds.settle(hello[io].setup or Outcome(error="it sent none"),
                                      f"client {io} could not prepare the save of {prefix}", setup))
        # write [all], the pieces checked meanwhile -> every client's success and what it wrote
        written = _write(plan, request, rounds, committer, [h.shards or 0 for h in hello] if early else None)
        parts = rounds.agree(written, Parts, barrier=f"shards of {prefix} written")
    # commit [io] -> everyone learns the outcome; write callbacks everywhere
    shared = rounds.announce(_commit(committer, request, parts) if rounds.is_root else None, Json,
                             f"the save of {prefix} failed on client {io}")
    if isinstance(request.on_commit, SharedCommitStep):
        request.on_commit.adopt(prefix, shared.value)
    request.options.run_write_callbacks(prefix)
    mine = written.value.written if written.value is not None else ()
    return SaveStats(prefix, committer.num_shards, sum(w.bytes for w in mine), time.perf_counter() - started,
                     sum(w.reused for w in mine))


def _commit(committer: Committer, request: SaveRequest, parts: List[Parts]) -> Outcome[Json]:
    """[io client] The commit point, then the clean-up and the front door's step (the state file); the
    value: a :class:`SharedCommitStep`'s result. A commit that fails is aborted; nothing after it is."""
    try:
        committer.commit([w for client in parts for w in client.written])
    except BaseException as exc:  # Ctrl-C too: leave nothing claimed, maybe committed (the index says)
        committer.abort()
        if not isinstance(exc, Exception):
            raise
        return Outcome.failed(exc)
    committer.finish()
    step = request.on_commit
    if step is None:
        return Outcome(Json())

    def record() -> Json:
        recorded = step(request.prefix)
        return Json(recorded if isinstance(step, SharedCommitStep) else None)

    return Outcome.of(record, label="after the commit: ")


def _write(plan: SavePlan, request: SaveRequest, rounds: Rounds, committer: Committer,
           counts: Optional[List[int]]) -> Outcome[Parts]:
    """[all] Write this client's shards, numbered from every client's shard count: ``counts`` when they
    came with the identity round (the writes then overlap the io client's check of the pieces), else
    the check's (funnelling: the io client first receives everyone's values; or one client).

    The writes start before the verdict: a disagreement is rare, and the save then fails on every
    client alike (with the verdict's error) once every client's writes ended (a barrier), so nothing
    is committed and the io client's ``abort`` removes what was written. Collectives stay on this thread.
    """
    rank, prefix = rounds.coordinator.rank, request.prefix
    verdict: Optional[Verdict] = None
    if counts is None:
        shards = _funnel(plan, request, rounds)
        verdict = _pieces_verdict(rounds, request, plan, len(shards), with_counts=True)
        if verdict.problem is not None:
            raise _not_committed(prefix, verdict.problem)
        counts = list(verdict.counts or ())
    else:
        shards = list(plan.shards)
    nothing = _nothing(committer, counts, prefix)
    first = committer.first_shard_id + sum(counts[:rank])
    if nothing is not None or verdict is not None:  # nobody has anything, or checked already: no overlap
        return nothing or Outcome.of(lambda: _write_shards(committer, shards, first, request.max_workers))
    pool = ThreadPool(max_workers=1, thread_name_prefix="shardckpt-save")
    writes = pool.submit(Outcome.of, lambda: _write_shards(committer, shards, first, request.max_workers))
    try:
        verdict = _pieces_verdict(rounds, request, plan, len(plan.shards), with_counts=False)
    finally:  # never leave a write running behind a failed collective (the io client's abort removes its files)
        written = writes.result()
        pool.shutdown()
    if verdict.problem is not None:
        # every client stopped writing before the io client's abort removes the scratch area
        rounds.coordinator.barrier(f"shards of {prefix} written", timeout=request.timeout)
        raise _not_committed(prefix, verdict.problem)
    return written


def _not_committed(prefix: str, problem: str) -> CoordinationError:
    return CoordinationError(f"the save of {prefix} was not committed: {problem}")


def _nothing(committer: Committer, counts: List[int], prefix: str) -> Optional[Outcome[Parts]]:
    """Fix the shard count from every client's (``counts``); a failed outcome when nobody has anything to save."""
    committer.plan(committer.first_shard_id + sum(counts))
    if sum(counts) == 0:
        return Outcome.failed(CoordinationError(f"nothing to save on any client for {prefix}"))
    return None


def _funnel(plan: SavePlan, request: SaveRequest, rounds: Rounds) -> List[ShardPlan]:
    """The shards this client writes: its own, or with funnelling, every client's on the io client
    (received now) and none elsewhere."""
    if not request.funnel or rounds.coordinator.size == 1:
        return list(plan.shards)
    described = rounds.gather(Funnelled(describe_plan(plan) if not rounds.is_root else []))
    if described is None:
        send_plan(plan, rounds.coordinator, rounds.root)
        return []
    return list(plan.shards) + [shard for source, d in enumerate(described) if source != rounds.root
                                for shard in receive_plan(d.description, rounds.coordinator, source)]


def _pieces_verdict(rounds: Rounds, request: SaveRequest, plan: SavePlan, shards: int, *,
                    with_counts: bool) -> Verdict:
    """Every client's shard count, packed pieces and digest of what it holds go to the io client, which
    checks them; its verdict, on every client (``counts`` only ``with_counts``). Only when the digests
    differ, one client of each digest sends its whole list in one more round (:func:`_held_verdict`)."""
    io = rounds.root
    if rounds.coordinator.size == 1 and _whole_and_distinct(plan):  # nothing to learn: skip describing them
        return Verdict(None, (shards,) if with_counts else None)
    digests: List[Optional[str]] = []  # every client's, on the io client

    def judge(gathered: List[Pieces]) -> Verdict:
        digests.extend(g.held for g in gathered)
        ask = held_representatives(digests)
        try:
            problem = check_pieces([g.pieces for g in gathered])
        except Exception as exc:  # a table that does not decode: every client fails alike
            problem = f"client {io} could not check the clients' pieces: {describe(exc)}"
        return Verdict(problem, tuple(g.shards for g in gathered) if with_counts else None,
                       None if ask is None else tuple(ask))

    held = request.held if rounds.coordinator.size > 1 else None
    mine = Pieces(shards, pack_pieces(describe_pieces(plan)), held_digest(held))
    verdict = rounds.decide(mine, judge, Verdict, str(_not_committed(request.prefix, "the check failed")))
    if verdict.held_from is not None:
        said = _held_verdict(rounds, request, verdict.held_from, digests)
        if said is not None:
            verdict = dataclasses.replace(verdict, problem="; ".join(p for p in (verdict.problem, said) if p))
    return verdict


def _whole_and_distinct(plan: SavePlan) -> bool:
    """Whether every piece of ``plan`` is a whole tensor under a key of its own: such pieces tile their
    tensors by themselves (one dtype and shape per key, no gap, no overlap)."""
    keys = set()
    for item in plan.items:
        if item.slice_spec or item.key in keys:
            return False
        keys.add(item.key)
    return True


def _held_verdict(rounds: Rounds, request: SaveRequest, ask: Sequence[int],
                  digests: List[Optional[str]]) -> Optional[str]:
    """The clients in ``ask`` send the io client their lists of what they hold; it names what differs
    (:func:`~.agreement.held_problem`), on every client (``digests``: every client's, on the io client)."""
    io = rounds.root

    def judge(lists: List[HeldList]) -> Problem:
        try:
            return Problem(held_problem(digests, {r: lists[r].held for r in ask}))
        except Exception as exc:  # a list that does not parse: every client fails alike
            return Problem(f"client {io} could not compare what the clients hold: {describe(exc)}")

    mine = HeldList(request.held if request.held is not None and rounds.coordinator.rank in ask else None)
    return rounds.decide(mine, judge, Problem, str(_not_committed(request.prefix, "the check failed"))).text


def _write_shards(committer: Committer, shards: Sequence[ShardPlan], first_id: int,
                  max_workers: Optional[int]) -> Parts:
    """Write this client's shards as ids ``first_id, first_id + 1, ...``, in parallel."""
    if not shards:
        return Parts()
    workers = max_workers or default_workers(len(shards))
    if workers == 1 or len(shards) == 1:
        return Parts(tuple(committer.write_shard(s, first_id + i) for i, s in enumerate(shards)))

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
    return Parts(tuple(w for w in out if w is not None))
