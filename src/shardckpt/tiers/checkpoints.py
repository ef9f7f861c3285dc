"""``Tiered``: what a :class:`~shardckpt.CheckpointManager` with ``local=`` does through its tier.

The manager keeps one ``Tiered`` and calls :meth:`Tiered.save` on every ``save`` (with the
number the save uses) and :meth:`Tiered.restore` first in ``restore_or_initialize``. It asks
the checkpoint for this client's pieces of its node's bundle and for what a bundle lacks (its
``_tier_pieces`` and ``_tier_missing``: ``checkpoint/_tier.py`` for an object graph, a DTensor's
distinct pieces once per node, replicated copies included, whole values and the object graph
by each node's leader; ``jax/_tier.py`` for a pytree) and runs the collective steps of
:mod:`.save` and :mod:`.restore` over the checkpoint's coordinator (a one-process coordinator
when this client saves alone). The node map is gathered once, on first use.

A step that also persists (every ``persist_every``-th) is saved to the persistent directory
as the caller asked (synchronously or not) and, in the background once that save committed,
on the checkpoint's saver thread (``AsyncSaver.then``), read back from the committed
checkpoint (the page cache its save just filled; checksums verified) into host buffers
reused from save to save and saved into the tiers (:meth:`Tiered.stage`, :class:`TierCopy`):
the persistent step costs what a save without a tier costs (nothing of the tier copy runs
before it returns). A persistent directory in an object store is not read back (that would
download the step): its values are copied to host buffers on a thread of its own beside the
persistent save instead. A failure of the tier copy never fails the step (it is committed
persistently; logged, and kept as the tier's ``last_save_error``).

An asynchronous save of a step that goes to the tiers only
(``CheckpointOptions(enable_async=True)``) blocks for the host copy of this client's pieces
only (into buffers reused from save to save); the tiered save (write, merge, replicas,
markers) runs on the checkpoint's ``AsyncSaver`` thread over a clone of the
coordinator, one save at a time, starting once every client's host copy is made (a
barrier there: a client done first would slow the others' copies, which their callers
wait for), with the checkpoint's ``sync()`` semantics: the next save,
``sync()`` or exit waits for it and raises its error (its number given back).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, List, Optional

import numpy as np

from ..distributed.coordinator import Coordinator
from ..distributed.single import SingleProcessCoordinator
from ..saving.async_save import AsyncSaver
from ..saving.context import default_context
from ..saving.plan import SavePlan
from ..storage.object_store import ObjectStore
from ..storage.registry import get_fs
from .nodes import NodeMap
from .restore import TierRestore, restore_from_tier
from .save import TierPiece, describe_error, save_to_tier
from .tier import LocalTier

__all__ = ["Tiered", "TierCopy"]

_log = logging.getLogger("shardckpt")


class Tiered:
    """A checkpoint's saves into, and restores from, ``tier`` (``coordinator()``: the clients' coordinator,
    ``None`` when this client saves alone)."""

    def __init__(self, tier: LocalTier, checkpoint: Any, coordinator: Callable[[], Optional[Coordinator]]) -> None:
        self.tier = tier
        self._checkpoint = checkpoint
        self._find = coordinator
        self._nodes: Optional[NodeMap] = None
        self._coordinator: Optional[Coordinator] = None
        self._buffers: Dict[Any, np.ndarray] = {}

    def _setup(self) -> Coordinator:
        if self._coordinator is None:
            self._coordinator = self._find() or SingleProcessCoordinator()
        if self._nodes is None:
            self._nodes = NodeMap.gather(self._coordinator)
        return self._coordinator

    @property
    def nodes(self) -> NodeMap:
        """The job's nodes (gathered on first use)."""
        self._setup()
        assert self._nodes is not None
        return self._nodes

    def pieces(self) -> List[TierPiece]:
        """This client's pieces of the checkpoint's current values, for its node's bundle (the checkpoint's
        ``_tier_pieces``: ``checkpoint/_tier.py`` for an object graph, ``jax/_tier.py`` for a pytree)."""
        coordinator = self._setup()
        nodes = self.nodes
        leader = nodes.leader(nodes.node_of_rank[coordinator.rank]) == coordinator.rank
        return self._checkpoint._tier_pieces(nodes, coordinator.rank, leader)  # type: ignore[no-any-return]

    def save(self, step: int, timeout: Optional[float] = None, saver: Optional[AsyncSaver] = None,
             on_failure: Optional[Callable[[], None]] = None) -> str:
        """Save the checkpoint's values as local step ``step`` (collective); return this node's bundle prefix.

        With ``saver`` (an asynchronous save) the values are copied to host buffers (reused from
        save to save) and the call returns; the tiered save runs on ``saver``'s thread over a
        clone of the coordinator, its error raised by the next save or ``sync()`` (``on_failure``
        then runs)."""
        coordinator = self._setup()
        nodes = self.nodes
        me = nodes.node_of_rank[coordinator.rank]
        if saver is None:  # the removal of older steps runs behind the save, on the checkpoint's saver thread
            return save_to_tier(self.tier, step, self.pieces(), coordinator, nodes, timeout=timeout,
                                later=lambda work: self._checkpoint._background().then(
                                    work, name=f"tier retention after step {step}")).prefix
        saver.wait()  # the buffers are the previous save's until it ended
        staged = self._stage(self.pieces())
        background = default_context().background(coordinator)

        def write(_plan: SavePlan) -> None:
            # the clients of a node share its memory bandwidth: the writes start once every client's host copy
            # is made, so that a client done first never slows the copy another one's training waits for
            background.barrier(f"tier save of step {step}: every host copy made", timeout=timeout)
            save_to_tier(self.tier, step, staged, background, nodes, timeout=timeout)

        saver.submit(self.tier.prefix(me, me, step), SavePlan.empty(), write, on_failure)
        return self.tier.prefix(me, me, step)

    def stage(self, step: int, timeout: Optional[float] = None, persisted: Optional[str] = None) -> "TierCopy":
        """For a step that also persists (as ``persisted``, the prefix the caller saves next): the
        :class:`TierCopy` whose :meth:`~TierCopy.job` saves this client's pieces as local step ``step``.
        Their values come from the committed persistent checkpoint, read back behind it, when it is
        not in an object store; else (or without ``persisted``) they are copied to host buffers now,
        on a thread, beside the persistent save the caller runs meanwhile. Collective on first use
        (the node map, the background coordinator), on the calling thread."""
        coordinator = self._setup()
        nodes = self.nodes
        background = default_context().background(coordinator)
        if persisted is not None and isinstance(get_fs(persisted), ObjectStore):
            persisted = None  # reading the step back would download it: copied on the host instead
        return TierCopy(self, step, self.pieces(), lambda staged: save_to_tier(
            self.tier, step, staged, background, nodes, timeout=timeout), persisted=persisted)

    def _stage(self, pieces: List[TierPiece]) -> List[TierPiece]:
        """Host copies of ``pieces``' values, into buffers kept from the last save where they fit."""
        from ..sharding.shardable import ShardableTensor

        buffers: Dict[Any, np.ndarray] = {}
        out: List[TierPiece] = []
        for key, shape, box, value in pieces:
            array = np.asarray(value) if box is not None else ShardableTensor.from_value(key, value).value()
            name = (key, None if box is None else tuple(box))
            buffer = self._buffers.get(name)
            if buffer is None or buffer.shape != array.shape or buffer.dtype != array.dtype:
                buffer = np.empty_like(array)
            np.copyto(buffer, array)
            buffers[name] = buffer
            out.append((key, shape, box, buffer))
        self._buffers = buffers
        return out

    def _read_back(self, pieces: List[TierPiece], prefix: str) -> List[TierPiece]:
        """``pieces``' values read from the committed checkpoint ``prefix`` (checksums verified), into
        the buffers kept from the last save where they fit; the object graph's as ``pieces`` hold it."""
        from ..checkpoint.graph import OBJECT_GRAPH_KEY
        from ..checkpoint.state import clean_path
        from ..format.bundle_reader import BundleReader
        from ..storage.location import Location

        buffers: Dict[Any, np.ndarray] = {}
        out: List[TierPiece] = []
        reader = BundleReader(Location.of(clean_path(prefix)))
        try:
            for key, shape, box, value in pieces:
                if key == OBJECT_GRAPH_KEY:
                    out.append((key, shape, box, value))
                    continue
                name = (key, None if box is None else tuple(box))
                stored = reader.dtype(key).numpy
                want = reader.shape(key) if box is None else tuple(int(b) - int(a) for a, b in box)
                buffer = self._buffers.get(name)
                if stored == np.dtype(object):
                    buffer = None  # not a reusable buffer: the reader makes the array
                elif buffer is None or buffer.shape != tuple(want) or buffer.dtype != stored:
                    buffer = np.empty(want, dtype=stored)
                array = reader.read_region(key, None if box is None else tuple(tuple(b) for b in box), out=buffer)
                buffers[name] = array
                out.append((key, shape, box, array))
        finally:
            reader.close()
        self._buffers = buffers
        return out

    def missing_from(self, bundle: Any) -> Optional[str]:
        """The first value or region this client restores that ``bundle`` (a local bundle's prefix, or an
        open ``BundleReader``: a peer's replica) does not hold (``None``: it holds them all): its index
        only, no data read. A restore onto the layout of the save finds nothing missing; onto another
        mesh or layout, its node may not have saved a client's new pieces (then :mod:`.restore` reads a
        merged view of every node's bundle)."""
        from ..format.bundle_reader import BundleReader
        from ..storage.location import Location

        opened = isinstance(bundle, str)
        reader = BundleReader(Location.of(bundle)) if opened else bundle
        try:
            return self._checkpoint._tier_missing(reader)  # type: ignore[no-any-return]
        finally:
            if opened:
                reader.close()

    def restore(self, persistent: Callable[[], Optional[str]], timeout: Optional[float] = None) -> TierRestore:
        """Restore the newest complete local step unless the persistent latest (``persistent()``, asked on client 0)
        is newer (collective); a result whose ``step`` is ``None`` leaves the restore of its ``persistent``
        (every client's answer) to the caller."""
        if self._coordinator is None:
            self._coordinator = self._find() or SingleProcessCoordinator()

        coordinator = self._coordinator
        checkpoint = self._checkpoint

        def found(nodes: NodeMap) -> None:
            self._nodes = nodes

        def read(where: Any) -> None:  # a local bundle's prefix, or a reader of a peer's replica
            if isinstance(where, str):
                checkpoint.restore(where)
            else:
                checkpoint.save_counter  # noqa: B018 - created so that it is restored too, as by restore()
                checkpoint._restore_through(where)

        def behind(work: Callable[[Coordinator], None]) -> None:
            background = default_context().background(coordinator)  # collective on first use: every client, here
            checkpoint._background().then(lambda: work(background), name="repopulating the tiers")

        return restore_from_tier(self.tier, coordinator, self._nodes, persistent, read, timeout=timeout,
                                 found=found, behind=behind, missing=self.missing_from)


class TierCopy:
    """The copy of a step that also persists into the tiers (see :meth:`Tiered.stage`).

    From the persistent checkpoint (``persisted``): nothing happens until :meth:`job`, called
    once the caller's save returned, returns the work that reads the pieces back from the
    committed checkpoint (from the page cache its save just filled) and saves them into the
    tiers, for the background (``AsyncSaver.then``, which runs it only after the commit). Else
    the host copy of the pieces starts at once on a thread of its own (the caller's persistent
    save reads the same values meanwhile; neither writes them) and :meth:`job` waits for it.
    That work never raises: the persistent checkpoint of the step is committed whatever
    happens to its copy (a restore then finds the persistent step newer than the tiers'
    newest); a failure is logged and kept as the tier's ``last_save_error``.
    """

    def __init__(self, tiered: Tiered, step: int, pieces: List[TierPiece],
                 save: Callable[[List[TierPiece]], Any], persisted: Optional[str] = None) -> None:
        self._tiered, self._step, self._save, self._persisted = tiered, step, save, persisted
        self._pieces: Optional[List[TierPiece]] = pieces if persisted is not None else None
        self._staged: Optional[List[TierPiece]] = None
        self._error: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        if persisted is None:
            self._thread = threading.Thread(target=self._copy, args=(pieces,), name=f"shardckpt-tier-copy {step}",
                                            daemon=True)
            self._thread.start()

    def _copy(self, pieces: List[TierPiece]) -> None:
        try:
            self._staged = self._tiered._stage(pieces)
        except BaseException as exc:  # noqa: BLE001 - reported by job()
            self._error = exc

    def _failed(self, why: str) -> None:
        tier = self._tiered.tier
        tier.last_save_error = f"step {self._step}: {why}"
        _log.warning("the copy of step %s into the local tiers failed (the persistent checkpoint holds it): %s",
                     self._step, tier.last_save_error)

    def job(self) -> Optional[Callable[[], None]]:
        """The work that saves the step into the tiers, once the persistent save committed (waits for a
        host copy first; ``None``: it failed, logged)."""
        persisted, pieces = self._persisted, self._pieces
        if self._thread is not None:
            self._thread.join()
            if self._staged is None:
                self._failed(f"the host copy failed: {describe_error(self._error or RuntimeError('no copy'))}")
                return None
        staged = self._staged

        def save() -> None:
            try:
                if persisted is not None and pieces is not None:
                    try:
                        values = self._tiered._read_back(pieces, persisted)
                    except Exception as exc:  # noqa: BLE001 - as a failed host copy
                        self._failed(f"reading it back from {persisted} failed: {describe_error(exc)}")
                        return
                else:
                    assert staged is not None
                    values = staged
                self._save(values)
                self._tiered.tier.last_save_error = None
            except Exception as exc:  # noqa: BLE001 - the step is committed in the persistent directory
                self._failed(describe_error(exc))

        return save
