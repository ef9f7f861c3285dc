"""Restoring from the tiers: agree on the newest complete step, repopulate lost bundles, read locally.

Every client runs :func:`restore_from_tier` (the manager's ``restore_or_initialize``), in the
same order. Steps::

    1 report   all  each leader lists the bundles its node's tier holds whole (marker present,
                    every file it names there with its size) with the nodes of the job that
                    saved each; all-gather (which also gathers every client's node id when the
                    node map is not known yet: every client lists, the leaders' lists count)
    2 choose   all  the newest step S for which every node's bundle is held by some node
                    (its own or a replica holder); if the newest persistent checkpoint
                    (client 0's, gathered in step 1) is newer, or no step is complete,
                    nothing here: the caller restores the persistent checkpoint (never a
                    mix of steps). A newer step that a job on other nodes saved, held whole
                    between this job's nodes, goes first (:func:`_from_other_job`: every
                    node gets the bundles of it that it lacks, as in step 3, then every
                    client reads a merged view, as in step 5b)
    3 repopulate    for each node that lacks its own bundle of S: its leader removes what
                    a save that died left of it (all-gather of the outcome); the first
                    holder (in node order) streams it to that node, every client of both
                    at once (:mod:`.transfer`: one lane per pair of clients); all-gather
                    of the outcome; that node's leader writes the marker. With nothing
                    lost, this step moves no byte and has no round. The replicas of S
                    that a lost node held for others are not needed to restore: they are
                    sent back behind the restore (step 6)
    4 drop     L    bundles of steps newer than S are removed from every tier (marker
                    first), so that later saves of those numbers never meet them
    5 read     all  each client restores from its own node's bundle of S through the one
                    restore engine (a BundleSource over a local file: no byte from another
                    node or from persistent storage), once its index shows every value
                    and region the client restores (``missing``; else a NotFoundError
                    before any read); all-gather of the outcome: if any client failed,
                    every client says so and the caller restores the persistent
                    checkpoint; unless each failure is of pieces its node did not save (a
                    restore onto another mesh or layout):
    5b merged  all  every node gets the bundles of S it lacks (as in step 3; none with two
                    nodes and a replica each); each client that failed restores from a
                    merged view of all of them (:mod:`.merged`: hard links and one merged
                    index, removed after); all-gather of the outcome (a failure: the
                    persistent checkpoint). A node lost *and* another layout: the lost
                    node's clients check their replica's index on the peer before reading
                    it (:func:`_from_peers`); then every node gets every bundle it lacks,
                    the lost node all of them, and nothing is left to restock
    6 restock  all  behind the restore (on the checkpoint's saver thread, over the
                    background coordinator): every replica of S that the placement puts on a
                    node lacking it (what a lost node held for others) is sent from the
                    first other node holding that bundle, as in step 3, then marked; so a
                    second node lost before the next save still finds S whole. A failure
                    is logged and kept as the tier's ``last_save_error``: the next save
                    writes every bundle and replica of its step afresh

With nothing lost, steps 3 and 6 move no byte. :class:`TierRestore` (kept as the tier's
``last_restore``) says what was restored and how many bytes each client moved.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..distributed.coordinator import Coordinator
from ..errors import NotFoundError
from .merged import merged_view, remove_view, stale_views
from .nodes import NodeMap, checked_node_id
from .peer import PeerFileSystem, PeerSource, peer_pairs, serve_bundle
from .save import describe_error
from .tier import LocalTier, bundle_files, read_marker, remove_bundle, write_marker
from .transfer import Moved, move_bundles

__all__ = ["TierRestore", "Reports", "restore_from_tier", "choose_step", "choose_other_job", "replica_moves"]

_log = logging.getLogger("shardckpt")

#: Schedules work behind a restore: called (on every client, in the same order) with a function of the
#: background coordinator, which it runs on the checkpoint's saver thread
Behind = Callable[[Callable[[Coordinator], None]], None]


@dataclass(frozen=True)
class TierRestore:
    """What a restore through the tiers did on this client.

    ``step``: the local step restored, or ``None`` when the persistent tier is to be used
    (``reason`` says why); ``prefix``: the bundle read; ``bytes_sent`` / ``bytes_received``: this
    client's bytes of bundles moved between nodes (repopulation); ``persistent``: the newest persistent
    checkpoint (client 0's, every client's answer); ``newest_saved``: the newest step any tier has a marker
    of (committed there by a tiered save), restorable or not. When the step restored (local or persistent)
    is older, client 0 logs a warning naming both steps and why: saved steps are never passed over
    silently."""

    step: Optional[int]
    prefix: Optional[str]
    bytes_sent: int = 0
    bytes_received: int = 0
    reason: str = ""
    persistent: Optional[str] = None
    newest_saved: Optional[int] = None


def _holdings(tier: LocalTier, node: str) -> Dict[str, List[Tuple[str, Any]]]:
    """Step (as text) -> ``(owner, the job's nodes its marker names)`` of the bundles ``node`` holds whole."""
    out: Dict[str, List[Tuple[str, Any]]] = {}
    for step, owners in tier.committed(node).items():
        out[str(step)] = sorted((o, (read_marker(tier.prefix(node, o, step)) or {}).get("nodes")) for o in owners)
    return out


def _of_this_job(held: Dict[str, List[Any]], nodes: NodeMap) -> Dict[str, List[str]]:
    """Step -> owners of the bundles held that a job of the same nodes wrote."""
    out: Dict[str, List[str]] = {}
    for step, owners in held.items():
        same = [str(o) for o, written_by in owners if written_by == list(nodes.nodes)]
        if same:
            out[step] = same
    return out


@dataclass(frozen=True)
class Reports:
    """What step 1 gathered: the job's node map; per node, step -> owners held whole there that this job
    wrote (``by_node``) and step -> ``(owner, the nodes of the job that wrote it)`` of every bundle held
    whole there (``held``); client 0's persistent latest checkpoint; the newest step any tier has a marker
    of."""

    nodes: NodeMap
    by_node: Dict[str, Dict[str, List[str]]]
    held: Dict[str, Dict[str, List[Any]]]
    latest: Optional[str]
    newest: Optional[int]


def report(tier: LocalTier, coordinator: Coordinator, nodes: Optional[NodeMap], timeout: Optional[float] = None,
           persistent: Callable[[], Optional[str]] = lambda: None) -> Reports:
    """Step 1 (collective, one all-gather): the job's node map (gathered here when ``nodes`` is ``None``),
    what each node holds whole (its leader's listing), client 0's ``persistent()`` (the persistent
    latest checkpoint every client goes by) and the newest step any tier has a marker of
    (:meth:`LocalTier.newest_marked`)."""
    me = checked_node_id(coordinator) if nodes is None else nodes.node_of_rank[coordinator.rank]
    leads = nodes is None or nodes.leader(me) == coordinator.rank
    if leads:  # merged views a killed restore left (no client of this node makes one before the round)
        for folder in stale_views(tier, me):
            shutil.rmtree(folder, ignore_errors=True)
    held = _holdings(tier, me) if leads else None
    marked = tier.newest_marked(me) if leads else None
    latest = persistent() if coordinator.rank == 0 else None
    reports = coordinator.all_gather({"node": me, "held": held, "marked": marked, "latest": latest},
                                     timeout=timeout)
    if nodes is None:
        nodes = NodeMap.of([str(r["node"]) for r in reports])
    held_by = {node: reports[nodes.leader(node)]["held"] for node in nodes.nodes}
    by_node = {node: _of_this_job(held_by[node], nodes) for node in nodes.nodes}
    newest = max((int(reports[nodes.leader(node)]["marked"]) for node in nodes.nodes
                  if reports[nodes.leader(node)]["marked"] is not None), default=None)
    return Reports(nodes, by_node, held_by, reports[0]["latest"], newest)


def choose_other_job(held: Dict[str, Dict[str, List[Any]]], nodes: NodeMap
                     ) -> Tuple[Optional[int], List[str], Dict[str, List[str]]]:
    """The newest step that a job on *other* nodes saved and this job's nodes hold whole between them:
    ``(step, that job's nodes, owner -> holders among this job's nodes)``; ``(None, [], {})`` when none.
    ``held[node]``: step -> ``(owner, writer's nodes)`` (:class:`Reports`)."""
    bundles = {(int(step), str(owner), tuple(map(str, writer)), node)
               for node, steps in held.items() for step, owners in steps.items() for owner, writer in owners
               if isinstance(writer, list) and writer != list(nodes.nodes)}
    for step, writer in sorted({(step, writer) for step, _, writer, _ in bundles}, reverse=True):
        holders = {owner: [n for n in nodes.nodes if (step, owner, writer, n) in bundles] for owner in writer}
        if all(holders.values()):
            return step, list(writer), holders
    return None, [], {}


def choose_step(reports: Dict[str, Dict[str, List[str]]], nodes: NodeMap
                ) -> Tuple[Optional[int], Dict[str, List[str]]]:
    """The newest step every node's bundle of which is held somewhere, and for it, owner -> holders (in node
    order); ``(None, {})`` when no step is complete. ``reports[node]``: step -> owners held there."""
    steps = sorted({int(s) for held in reports.values() for s in held}, reverse=True)
    for step in steps:
        holders = {owner: [n for n in nodes.nodes if owner in reports.get(n, {}).get(str(step), [])]
                   for owner in nodes.nodes}
        if all(holders.values()):
            return step, holders
    return None, {}


def restore_from_tier(tier: LocalTier, coordinator: Coordinator, nodes: Optional[NodeMap],
                      persistent: Callable[[], Optional[str]], read: Callable[[str], Any],
                      timeout: Optional[float] = None, found: Optional[Callable[[NodeMap], None]] = None,
                      behind: Optional[Behind] = None,
                      missing: Optional[Callable[[str], Optional[str]]] = None) -> TierRestore:
    """This client's part of a restore through the tiers (see the module docstring). Collective.

    ``persistent()`` (called on client 0 only) is the newest persistent checkpoint's path (``None``:
    none); every client gets client 0's answer as the result's ``persistent``. ``read(prefix)``
    restores this client's values from a bundle. ``nodes``: the job's node map, or ``None`` to
    gather it in step 1 (``found`` gets it). ``missing(prefix)``: what this client restores that the
    bundle does not hold (``None``: nothing), asked before step 5 reads it. Returns what was done; a
    ``step`` of ``None`` means: restore ``persistent`` instead (every client gets the same answer)."""
    rank = coordinator.rank
    gathered = report(tier, coordinator, nodes, timeout=timeout, persistent=persistent)
    nodes, by_node, latest, newest = gathered.nodes, gathered.by_node, gathered.latest, gathered.newest
    if found is not None:
        found(nodes)
    persistent_step = number_of(latest)
    done = functools.partial(_done, tier, latest, newest, rank == 0, functools.partial(_missing, by_node, nodes))
    me = nodes.node_of_rank[rank]
    leader = nodes.leader(me) == rank
    step, holders = choose_step(by_node, nodes)
    other, writer, other_holders = choose_other_job(gathered.held, nodes)
    if other is not None and (step is None or other > step):  # saved by a job on other nodes
        if persistent_step is not None and persistent_step > other:
            return done(TierRestore(None, None, reason=f"the persistent step {persistent_step} is newer than "
                                                               f"the newest complete local step {other}"))
        return done(_from_other_job(tier, coordinator, nodes, other, writer, other_holders, read, timeout))
    if step is None:
        return done(TierRestore(None, None, reason="no local step is complete across the nodes"))
    if persistent_step is not None and persistent_step > step:
        return done(TierRestore(None, None, reason=f"the persistent step {persistent_step} is newer than "
                                                           f"the newest complete local step {step}"))
    # 3 repopulate: each node's own bundle; 6 restock: the replicas lost with a node, behind the restore
    moves = [(holders[owner][0], owner, owner) for owner in nodes.nodes if owner not in holders[owner]]
    restock = replica_moves(by_node, holders, nodes, step, tier.replicas) if behind is not None else []
    if moves and behind is not None and not {s for s, _, _ in moves} & {t for _, t, _ in moves}:
        return done(_from_peers(tier, coordinator, nodes, step, holders, moves + restock, read, behind, timeout,
                                missing))
    got = [owner for _, target, owner in moves if target == me] if leader else []
    sent = received = 0
    failed: List[str] = []
    if moves:
        failed, moved = _repopulate(tier, coordinator, nodes, step, moves, timeout)
        sent, received = moved.sent, moved.received
    if not failed:
        error = None
        elsewhere = False
        try:
            _mark(tier, nodes, me, step, got)
            if leader:  # 4 drop newer steps
                _drop_newer(tier, me, step)
            own = tier.prefix(me, me, step)
            _covered(missing, own, own)  # the index only: no byte read in vain
            read(own)  # 5 read
        except Exception as exc:  # noqa: BLE001
            error = describe_error(exc)
            elsewhere = isinstance(exc, NotFoundError)  # pieces (a key) its node did not save: another layout
        results = coordinator.all_gather({"ok": error is None, "error": error or "", "elsewhere": elsewhere},
                                         timeout=timeout)
        failed = _failures(results)
        if failed and all(r["ok"] or r["elsewhere"] for r in results):  # 5b read all nodes' bundles, merged
            failed, more_sent, more_received = _read_merged(tier, coordinator, nodes, step, holders, moves,
                                                            read if error is not None else None, timeout)
            sent, received = sent + more_sent, received + more_received
    if failed:
        return done(TierRestore(None, None, sent, received,
                                reason=f"restoring local step {step} failed: " + "; ".join(failed)))
    if restock and behind is not None:  # 6 restock
        behind(functools.partial(_repopulate_behind, tier, nodes, step, restock, timeout))
    return done(TierRestore(step, tier.prefix(me, me, step), sent, received))


def replica_moves(reports: Dict[str, Dict[str, List[str]]], holders: Dict[str, List[str]], nodes: NodeMap,
                  step: int, replicas: int) -> List[Tuple[str, str, str]]:
    """Step 6's moves ``(source, target, owner)``: each replica of ``step`` that the placement
    (:meth:`NodeMap.replicas_of`) puts on a node whose report lacks it, from the first other node holding
    that bundle (``holders``: owner -> nodes holding it, in node order, as :func:`choose_step` gives)."""
    out = []
    for owner in nodes.nodes:
        for target in nodes.replicas_of(owner, replicas):
            if owner in reports.get(target, {}).get(str(step), []):
                continue
            sources = [node for node in holders[owner] if node != target]
            if sources:
                out.append((sources[0], target, owner))
    return out


def _covered(missing: Optional[Callable[[Any], Optional[str]]], bundle: Any, path: str) -> None:
    """Raise :class:`NotFoundError` when ``bundle`` (a prefix, or a peer's reader) lacks a value or region this
    client restores (``missing``; its index only): pieces its node did not save (another mesh or layout)."""
    gap = missing(bundle) if missing is not None else None
    if gap is not None:
        raise NotFoundError(f"{gap}: not saved by this node (another mesh or layout)", path=path)


def _from_peers(tier: LocalTier, coordinator: Coordinator, nodes: NodeMap, step: int, holders: Dict[str, List[str]],
                moves: List[Tuple[str, str, str]], read: Callable[[Any], Any], behind: Behind,
                timeout: Optional[float], missing: Optional[Callable[[Any], Optional[str]]] = None) -> TierRestore:
    """Steps 3-6 when the nodes that lost their bundle hold none that others lack: each client of such a
    node restores straight from the holder's replica (:mod:`.peer`); the others restore from their own
    tier, the holders serving meanwhile (on a thread); the lost bundles (``moves`` with ``target == owner``) and the
    replicas to restock (the others) are moved into their nodes' tiers behind the restore, once every
    client restored (``behind``). When every failure is of pieces a bundle does not hold (``missing``,
    asked before any read: another mesh or layout), step 5b runs instead: every node gets every bundle
    of ``step`` it lacks (``holders``: owner -> nodes holding it), the lost ones included, then reads a
    merged view; nothing is left to restock."""
    from ..format.bundle_reader import BundleReader

    rank = coordinator.rank
    me = nodes.node_of_rank[rank]
    pairs = peer_pairs(nodes, [move for move in moves if move[1] == move[2]], holders)
    sent = received = 0
    error: Optional[str] = None
    try:
        if nodes.leader(me) == rank:  # 4 drop newer steps
            _drop_newer(tier, me, step)
    except Exception as exc:  # noqa: BLE001 - told to every client by the round below
        error = describe_error(exc)
    served: List[Tuple[int, Optional[str]]] = []  # (bytes sent, first error) of this client's serving

    def serve_one(client: int, source: str, owner: str) -> Tuple[int, Optional[str]]:
        prefix = tier.prefix(source, owner, step)
        problem = None
        try:
            files = bundle_files(prefix)
        except Exception as exc:  # noqa: BLE001 - its client gets an empty manifest, and fails
            files, problem = [], f"{prefix}: {describe_error(exc)}"
        try:
            done, unserved = serve_bundle(coordinator, client, os.path.dirname(prefix), files,
                                          tier.chunk_bytes, timeout=timeout, streaming=streaming.set)
        except Exception as exc:  # noqa: BLE001 - told to every client by the round below
            done, unserved = 0, describe_error(exc)
        return done, problem or (None if unserved is None else f"serving {owner}'s bundle of step {step}: {unserved}")

    def serve() -> None:  # the clients this client serves: each on a thread of its own, at once
        mine = [(client, source, owner) for server, client, source, _target, owner in pairs if server == rank]
        outcomes: List[Tuple[int, Optional[str]]] = []
        try:
            if len(mine) == 1:
                outcomes.append(serve_one(*mine[0]))
            else:
                with ThreadPoolExecutor(len(mine), thread_name_prefix="shardckpt-tier-serve") as pool:
                    outcomes += pool.map(lambda job: serve_one(*job), mine)
            served.append((sum(n for n, _ in outcomes), next((p for _, p in outcomes if p is not None), None)))
        finally:
            streaming.set()

    # a holder serves on a thread of its own and reads its own bundle (a local read, which uses no
    # coordinator) once the bulk of a client's pieces streams: the read overlaps the transfer instead
    # of following it, and never delays the client's planning reads (the index, small values)
    streaming = threading.Event()
    serving: Optional[threading.Thread] = None
    if any(server == rank for server, *_ in pairs):
        serving = threading.Thread(target=serve, name="shardckpt-tier-serve", daemon=True)
        serving.start()
    else:
        served.append((0, None))
        streaming.set()
    mine = [p for p in pairs if p[1] == rank]
    elsewhere = False
    try:
        if mine:  # 5 read, from the peer
            server, _, source, _, owner = mine[0]
            fs = PeerFileSystem(coordinator, server, tier.folder(source, owner), timeout=timeout)
            try:
                prefix = tier.prefix(source, owner, step)
                reader = BundleReader(prefix, fs=fs)
                with PeerSource(reader, fs) as peer:
                    _covered(missing, reader, prefix)
                    read(peer)
            finally:
                received = fs.received
                fs.done()
        elif error is None:  # 5 read, locally
            own = tier.prefix(me, me, step)
            _covered(missing, own, own)
            streaming.wait()
            read(own)
    except Exception as exc:  # noqa: BLE001
        elsewhere = error is None and isinstance(exc, NotFoundError)
        error = error or describe_error(exc)
    if serving is not None:
        serving.join()
    sent, problem = served[0] if served else (0, "serving ended without a result")
    if problem is not None:
        elsewhere, error = False, error or problem
    results = coordinator.all_gather({"ok": error is None, "error": error or "", "elsewhere": elsewhere},
                                     timeout=timeout)
    failed = _failures(results)
    if failed and all(r["ok"] or r["elsewhere"] for r in results):  # 5b: every bundle on every node, merged
        failed, more_sent, more_received = _read_merged(tier, coordinator, nodes, step, holders, [],
                                                        read if error is not None else None, timeout)
        if not failed:
            return TierRestore(step, tier.prefix(me, me, step), sent + more_sent, received + more_received)
    if failed:
        return TierRestore(None, None, sent, received,
                           reason=f"restoring local step {step} failed: " + "; ".join(failed))
    behind(functools.partial(_repopulate_behind, tier, nodes, step, moves, timeout))
    return TierRestore(step, tier.prefix(me, me, step), sent, received)


def _read_merged(tier: LocalTier, coordinator: Coordinator, nodes: NodeMap, step: int,
                 holders: Dict[str, List[str]], moved: List[Tuple[str, str, str]],
                 read: Optional[Callable[[Any], Any]], timeout: Optional[float]) -> Tuple[List[str], int, int]:
    """Step 5b (collective), when some client's node did not save pieces it restores now (another mesh or
    layout): every node gets the bundles of ``step`` it lacks (as step 3, from the first holder; with
    two nodes and a replica each, none), then every client whose step 5 failed restores from a merged
    view of all of them (:mod:`.merged`: its own node's first; ``read`` ``None``: this client's step 5
    restored it all). ``holders``: owner -> nodes holding its bundle (:func:`choose_step`); ``moved``: step
    3's moves. Returns the failures (every client's answer) and this client's bytes sent and received."""
    gather = [(holders[owner][0], node, owner) for node in nodes.nodes for owner in nodes.nodes
              if node not in holders[owner] and (holders[owner][0], node, owner) not in moved]
    return _gather_and_read(tier, coordinator, nodes, step, list(nodes.nodes), gather, read, None, timeout)


def _gather_and_read(tier: LocalTier, coordinator: Coordinator, nodes: NodeMap, step: int, owners: List[str],
                     gather: List[Tuple[str, str, str]], read: Optional[Callable[[Any], Any]], error: Optional[str],
                     timeout: Optional[float], writer: Optional[List[str]] = None) -> Tuple[List[str], int, int]:
    """The moves ``gather`` (as step 3: every client, with their rounds), their markers (naming ``writer``'s
    nodes, default this job's), then ``read`` of a merged view of ``owners``' bundles of ``step`` (this
    node's first; ``None``: no read here) and an all-gather of the outcome (``error``: this client's
    failure so far). Returns the failures (every client's answer) and this client's bytes moved."""
    rank = coordinator.rank
    me = nodes.node_of_rank[rank]
    sent = received = 0
    if gather:
        failed, moved = _repopulate(tier, coordinator, nodes, step, gather, timeout)
        sent, received = moved.sent, moved.received
        if failed:
            return failed, sent, received
    try:
        if error is None:
            _mark(tier, nodes, me, step, [o for _, t, o in gather if t == me] if nodes.leader(me) == rank else [],
                  writer=writer)
        if error is None and read is not None:
            view = merged_view(tier, me, ([me] if me in owners else []) + [o for o in owners if o != me], step, rank)
            try:
                read(view)
            finally:
                remove_view(view)
    except Exception as exc:  # noqa: BLE001
        error = describe_error(exc)
    return _failures(coordinator.all_gather({"ok": error is None, "error": error or ""}, timeout=timeout)), \
        sent, received


def _from_other_job(tier: LocalTier, coordinator: Coordinator, nodes: NodeMap, step: int, writer: List[str],
                    holders: Dict[str, List[str]], read: Callable[[Any], Any],
                    timeout: Optional[float]) -> TierRestore:
    """Steps 3-5 for a step a job on other nodes (``writer``) saved, which this job's nodes hold whole between
    them (``holders``: owner -> holders): every node gets the bundles of it that it lacks (as step 3;
    their markers keep naming ``writer``), then every client restores from a merged view of them
    (:mod:`.merged`, as step 5b); one all-gather of the outcome."""
    me = nodes.node_of_rank[coordinator.rank]
    gather = [(holders[owner][0], node, owner) for node in nodes.nodes for owner in writer
              if node not in holders[owner]]
    error: Optional[str] = None
    try:
        if nodes.leader(me) == coordinator.rank:  # 4 drop newer steps
            _drop_newer(tier, me, step)
    except Exception as exc:  # noqa: BLE001 - told to every client by the outcome round
        error = describe_error(exc)
    failed, sent, received = _gather_and_read(tier, coordinator, nodes, step, writer, gather, read, error, timeout,
                                              writer=writer)
    if failed:
        return TierRestore(None, None, sent, received, reason=f"restoring local step {step} (saved by a job on "
                                                              f"nodes {writer}) failed: " + "; ".join(failed))
    return TierRestore(step, tier.prefix(me, me if me in writer else writer[0], step), sent, received)


def _repopulate(tier: LocalTier, coordinator: Coordinator, nodes: NodeMap, step: int,
                moves: List[Tuple[str, str, str]], timeout: Optional[float]) -> Tuple[List[str], Moved]:
    """Each node of ``moves`` that lacks its own bundle of ``step``: its leader removes what a save that died
    left of it (a round), the holder moves it over the lanes, a round; returns the failures (every
    client's answer) and what this client moved. The caller marks the bundles (:func:`_mark`)."""
    rank = coordinator.rank
    me = nodes.node_of_rank[rank]
    got = [owner for _, target, owner in moves if target == me] if nodes.leader(me) == rank else []
    error: Optional[str] = None
    try:
        for owner in got:  # what a save that died left of it (marker first)
            remove_bundle(tier.prefix(me, owner, step))
    except Exception as exc:  # noqa: BLE001
        error = describe_error(exc)
    failed = _failures(coordinator.all_gather({"ok": error is None, "error": error or ""}, timeout=timeout))
    if failed:
        return failed, Moved()
    moved = move_bundles(coordinator, tier, nodes, step, moves, timeout=timeout)
    return _failures(coordinator.all_gather({"ok": moved.error is None, "error": moved.error or ""},
                                            timeout=timeout)), moved


def _repopulate_behind(tier: LocalTier, nodes: NodeMap, step: int, moves: List[Tuple[str, str, str]],
                       timeout: Optional[float], coordinator: Coordinator) -> None:
    """:func:`_repopulate` and the markers, in the background after a restore from peers (``coordinator``:
    the background clone). Never raises: the restore is done; a failure is logged and kept as the tier's
    ``last_save_error`` (the next save writes every bundle of its step afresh)."""
    me = nodes.node_of_rank[coordinator.rank]
    leader = nodes.leader(me) == coordinator.rank
    try:
        failed, _ = _repopulate(tier, coordinator, nodes, step, moves, timeout)
        if not failed:
            error: Optional[str] = None
            try:
                _mark(tier, nodes, me, step, [o for _, t, o in moves if t == me] if leader else [])
            except Exception as exc:  # noqa: BLE001
                error = describe_error(exc)
            failed = _failures(coordinator.all_gather({"ok": error is None, "error": error or ""}, timeout=timeout))
        if failed:
            raise RuntimeError("; ".join(failed))
    except Exception as exc:  # noqa: BLE001 - the restore is done; logged and kept
        tier.last_save_error = f"repopulating the tiers with step {step}: {describe_error(exc)}"
        _log.warning("%s", tier.last_save_error)


def _mark(tier: LocalTier, nodes: NodeMap, me: str, step: int, owners: List[str],
          writer: Optional[List[str]] = None) -> None:
    """Markers of ``owners``' bundles of ``step`` in ``me``'s tier, naming the nodes of the job that saved
    them (``writer``; default this job's)."""
    for owner in owners:
        prefix = tier.prefix(me, owner, step)
        write_marker(prefix, {"step": step, "owner": owner, "nodes": list(writer or nodes.nodes),
                              "files": bundle_files(prefix)})


def _drop_newer(tier: LocalTier, me: str, step: int) -> None:
    for owner, steps in tier.steps_on_disk(me).items():
        for newer in [s for s in steps if s > step]:
            remove_bundle(tier.prefix(me, owner, newer))


def _failures(results: List[Dict[str, Any]]) -> List[str]:
    return [f"rank {r}: {res['error']}" for r, res in enumerate(results) if not res["ok"]]


def _done(tier: LocalTier, latest: Optional[str], newest: Optional[int], warn: bool, missing: Callable[[int], str],
          outcome: TierRestore) -> TierRestore:
    """Record the outcome as the tier's ``last_restore``; on client 0 (``warn``), a warning when a newer
    step than the one restored was saved (``newest``)."""
    outcome = dataclasses.replace(outcome, persistent=latest, newest_saved=newest)
    tier.last_restore = outcome
    restored = outcome.step if outcome.step is not None else number_of(latest)
    if warn and newest is not None and (restored is None or newest > restored):
        what = f"local step {restored}" if outcome.step is not None else \
            (f"the persistent checkpoint {latest}" if latest is not None else "nothing")
        why = outcome.reason if outcome.step is None and outcome.reason else missing(newest)
        _log.warning("restoring %s: the local tiers hold a newer step, %s, that cannot be restored (%s)",
                     what, newest, why)
    return outcome


def _missing(by_node: Dict[str, Dict[str, List[str]]], nodes: NodeMap, step: int) -> str:
    """Why ``step`` is not complete across the tiers of this job's nodes."""
    lacking = [owner for owner in nodes.nodes if not any(owner in held.get(str(step), []) for held in by_node.values())]
    if not lacking:
        return f"step {step} is whole but a newer complete step was not found"
    return "no tier holds whole " + ", ".join(f"node {owner}'s bundle" for owner in lacking) + \
        f" of step {step} (lost, damaged, or written by a job of other nodes)"


def number_of(path: Optional[str]) -> Optional[int]:
    """The number of checkpoint ``<prefix>-<N>`` (``None``: no path, or no number)."""
    tail = None if path is None else str(path).rsplit("-", 1)[-1]
    return int(tail) if tail is not None and tail.isdigit() else None
