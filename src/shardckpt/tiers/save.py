"""A tiered save: every client's pieces into its node's tier, replicas onto other nodes, one commit.

Every client runs :func:`save_to_tier` with the same step, in the same order (the
manager's ``save``); ``nodes`` is the job's :class:`~.nodes.NodeMap`. Steps, and what is on
disk after each (``K``: a node, ``L``: its leader, its lowest rank)::

    1 parts    all  each client writes the pieces its node writes through it into
                    node-K/ckpt-N_parts/part-R (a bundle, fsynced): a laid-out value's
                    distinct pieces, each once per node (by the node's lowest device
                    holding it), replicated copies included; the whole values and the
                    object graph by L. all-gather of every client's outcome: a failure
                    anywhere removes the parts and fails the save on every client
    2 merge    L    any older node-K/ckpt-N (marker first) removed, and what an earlier
                    save of step N left of the replicas this node receives; the parts merged by
                    renaming into node-K/ckpt-N.data-*, index last (fsynced).
                    all-gather of the outcome
    3 replicas all  for each (node, replica node) of the placement, in one fixed order:
                    the node's clients stream its bundle's files to the replica node's
                    clients, one lane per pair of clients, all lanes at once; they write
                    them into node-<node>/ckpt-N in their tier (:mod:`.transfer`; bounded
                    memory, a receiver that cannot write drains the stream and reports;
                    step 2 removed what an earlier save of step N left there)
    4 agree    all  all-gather: every bundle and every replica in place? If not, the
                    leaders remove step N's unmarked files and every client raises
                    CoordinationError naming the failures (nothing was committed)
    5 markers  L    node-<owner>/ckpt-N.committed for every bundle of step N the node
                    holds (its own and the replicas it received); all-gather of the
                    outcome (a marker that failed fails the save everywhere; the step may
                    still be complete through its other copies)
    6 retain   L    bundles of steps older than the newest ``keep`` committed ones removed
                    (a synchronous save returns first: the removal runs behind it)

Until step 5 begins nothing of step N counts; the markers are written only after the
agreement of step 4, so step N counts (at restore: every node's bundle marked on some live
node) only if every bundle and replica was whole. The previous ``keep - 1`` steps are never
touched by a save of step N, so a kill at any moment leaves them usable.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import numpy as np

from ..distributed.coordinator import CoordinationError, Coordinator, raise_failures
from ..errors import InvalidArgumentError
from ..format.bundle_writer import BundleWriter
from ..format.tensor_slice import TensorSlice
from ..saving.commit.rename import merge_bundles
from ..storage.local import LocalFileSystem
from .nodes import NodeMap
from .tier import LocalTier, bundle_files, remove_bundle, retain, write_marker
from .transfer import move_bundles

__all__ = ["TierPiece", "TierSave", "save_to_tier", "describe_error"]

#: ``(key, full shape or None for a whole value, box or None, array)``
TierPiece = Tuple[str, Optional[Tuple[int, ...]], Any, Any]


@dataclass(frozen=True)
class TierSave:
    """What a tiered save did on this client: the node bundle's prefix, and the bytes this client sent to
    and received from other nodes (replicas; 0 on clients that are not their node's leader)."""

    prefix: str
    step: int
    bytes_sent: int
    bytes_received: int


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def room_hint(tier: LocalTier, exc: Union[BaseException, str]) -> str:
    """What to do about ``exc`` (an error, or its description) when it is a full tier (``ENOSPC``, also
    named in a message from another client or node); else nothing."""
    if getattr(exc, "errno", None) != errno.ENOSPC and os.strerror(errno.ENOSPC) not in str(exc):
        return ""
    return (f" (the tier is full: it keeps keep={tier.keep} steps and writes the next one before it removes "
            f"the oldest, so it needs room for {tier.keep + 1} x (1 + replicas={tier.replicas}) x this node's "
            f"share of the state; give LocalTier a larger folder or a smaller keep)")


def _remove_if_empty(folder: str) -> None:
    try:
        os.rmdir(folder)
    except OSError:  # not empty (another client's part is still there), or gone
        pass


def _write_part(prefix: str, pieces: List[TierPiece]) -> None:
    from ..sharding.shardable import ShardableTensor

    with BundleWriter(prefix, fsync=True, fs=LocalFileSystem()) as writer:
        for key, shape, box, value in pieces:
            array = ShardableTensor.from_value(key, value).value() if box is None else np.asarray(value)
            if box is None:
                writer.add(key, array)
            else:
                extents = TensorSlice(tuple((a, b - a) for a, b in box))
                writer.add_slice(key, shape, extents, array)  # type: ignore[arg-type]


def _round(coordinator: Coordinator, error: Optional[str], timeout: Optional[float], **extra: Any
           ) -> List[Dict[str, Any]]:
    """One agreement round: every client's outcome (and ``extra``); raises on every client if one failed."""
    results = coordinator.all_gather(dict(extra, ok=error is None, error=error or ""), timeout=timeout)
    raise_failures(results)
    return results


def save_to_tier(tier: LocalTier, step: int, pieces: List[TierPiece], coordinator: Coordinator, nodes: NodeMap,
                 timeout: Optional[float] = None, later: Optional[Callable[[Callable[[], None]], None]] = None
                 ) -> TierSave:
    """This client's part of the tiered save of ``step`` (see the module docstring). Collective.

    ``later``: where step 6 (the removal of older steps, after the commit) goes instead of
    running before the call returns (a synchronous save hands it to the background)."""
    rank = coordinator.rank
    me = nodes.node_of_rank[rank]
    leader = nodes.leader(me) == rank
    own = tier.prefix(me, me, step)
    parts = own + "_parts"
    part = os.path.join(parts, f"part-{rank}")
    error: Optional[str] = None
    try:  # 1 parts
        os.makedirs(parts, exist_ok=True)
        remove_bundle(part)
        if pieces:
            _write_part(part, pieces)
    except Exception as exc:  # noqa: BLE001 - told to every client
        error = f"{part}: {describe_error(exc)}{room_hint(tier, exc)}"
    try:
        wrote = _round(coordinator, error, timeout, part=bool(pieces) and error is None)
    except CoordinationError:
        remove_bundle(part)
        _remove_if_empty(parts)  # the node's last client to get here removes the folder
        raise
    held: List[str] = []  # bundles of this step in this node's tier (leaders)
    sent = received = 0
    try:
        error = None
        moves = [(owner, target, owner) for owner in nodes.nodes for target in nodes.replicas_of(owner, tier.replicas)]
        receives = [owner for _, target, owner in moves if target == me]
        if leader:  # 2 merge
            try:
                remove_bundle(own, parts=False)
                for owner in receives:  # what an earlier save of this step left of the replicas to come
                    remove_bundle(tier.prefix(me, owner, step))
                inputs = [os.path.join(parts, f"part-{r}") for r in nodes.ranks_of(me) if wrote[r]["part"]]
                if not inputs:
                    raise InvalidArgumentError(f"node {me!r} has nothing to save", path=own)
                merge_bundles(inputs, own, fsync=True, synced=inputs, fs=LocalFileSystem())
                shutil.rmtree(parts, ignore_errors=True)
                held.append(me)
            except Exception as exc:  # noqa: BLE001
                error = f"{own}: {describe_error(exc)}{room_hint(tier, exc)}"
        _round(coordinator, error, timeout)
        if leader:
            held += receives  # whatever arrives of them is removed if the save fails
        moved = move_bundles(coordinator, tier, nodes, step, moves, timeout=timeout)  # 3 replicas
        sent, received = moved.sent, moved.received
        error = error or (None if moved.error is None else moved.error + room_hint(tier, moved.error))
        _round(coordinator, error, timeout)  # 4 agree
    except BaseException:
        for owner in held:  # unmarked: they never counted; removed (best effort) so that no leftover lingers
            try:
                remove_bundle(tier.prefix(me, owner, step))
            except OSError:
                pass
        shutil.rmtree(parts, ignore_errors=True)
        raise
    error = None
    try:  # 5 markers
        for owner in held:
            prefix = tier.prefix(me, owner, step)
            write_marker(prefix, {"step": int(step), "owner": owner, "nodes": list(nodes.nodes),
                                  "files": bundle_files(prefix)})
    except Exception as exc:  # noqa: BLE001
        error = f"{tier.root(me)}: writing the markers of step {step}: {describe_error(exc)}"
    _round(coordinator, error, timeout)
    if leader:  # 6 retain
        def drop_older() -> None:
            steps = sorted(s for s, owners in tier.committed(me).items() if me in owners)
            retain(tier, me, steps[-tier.keep:])

        if later is not None:
            later(drop_older)
        else:
            drop_older()
    return TierSave(own, int(step), sent, received)
