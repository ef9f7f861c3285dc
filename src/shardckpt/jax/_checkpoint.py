"""``PyTreeCheckpoint``: a pytree as the object a :class:`~shardckpt.CheckpointManager` saves and restores.

``CheckpointManager(PyTreeCheckpoint(state), directory, max_to_keep=3)`` numbers
the saves (``ckpt-1``, ``ckpt-2``, ...), keeps the newest few, records them in the
``checkpoint`` state file and restores the latest (``restore_or_initialize``),
exactly as for a :class:`~shardckpt.Checkpoint`. The saved object is
``checkpoint.state``, a pytree (see :func:`~shardckpt.jax.save`); a restore reads
onto the current ``state`` (its shardings) and replaces it. The save counter travels
in the pytree metadata (field ``save_counter``), so a manager re-created after a
restart continues the numbering once it has restored.

With ``local=LocalTier(...)`` the manager saves the pytree into each node's tier too (see
:mod:`shardckpt.tiers`): each process writes its node's pieces of the arrays
(:mod:`._tier`), and a restore reads them back onto the current ``state``, from its node's
tier, from a peer's replica (the one restore engine over a collective source), or from a
merged view of every node's bundle (another mesh or layout). Several processes share one
coordinator (:func:`~shardckpt.jax.default_coordinator`: JAX's distributed runtime, unless
one is given), which the manager uses too: the state file is read and written by process 0.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

import jax
import numpy as np

from ..checkpoint.checkpoint import _update_state
from ..checkpoint.reader import resolve_prefix
from ..checkpoint.trackable import Variable
from ..distributed.coordinator import Coordinator
from ..format.bundle_reader import BundleReader
from ..restoring import collective_call
from ..saving.async_save import AsyncSaver
from ..saving.options import CheckpointOptions
from ..storage.location import Location
from ._restore import KeyMap, restore, restore_through
from ._save import default_coordinator, save_pytree
from ._tier import tier_missing, tier_pieces
from ._tree import METADATA_KEY, decode_metadata

if TYPE_CHECKING:
    from ..tiers.nodes import NodeMap
    from ..tiers.save import TierPiece

__all__ = ["PyTreeCheckpoint"]


class PyTreeCheckpoint:
    """A pytree (``state``) saved and restored as a whole; ``save``/``restore``/``sync`` as ``Checkpoint``'s."""

    def __init__(self, state: Any, *, coordinator: Optional[Coordinator] = None, key_map: KeyMap = None) -> None:
        self.state = state
        self._coordinator = coordinator
        self._key_map = key_map
        self._save_counter = Variable(np.int64(0), name="save_counter")
        self._pending_rollback: Optional[Callable[[], None]] = None
        self._saver: Optional[AsyncSaver] = None

    @property
    def save_counter(self) -> Variable:
        """The number of saves (an int64 variable, restored from the checkpoint's metadata)."""
        return self._save_counter

    def write(self, file_prefix: "str | os.PathLike[str]", options: Optional[CheckpointOptions] = None) -> str:
        """Save ``state`` at exactly ``file_prefix``; no counter, no state file."""
        return self._write(os.fspath(file_prefix), options, None)

    def save(self, file_prefix: "str | os.PathLike[str]", options: Optional[CheckpointOptions] = None) -> str:
        """Increment ``save_counter``, save ``<file_prefix>-<n>``, name it in the ``checkpoint`` file."""
        self._wait_for_pending()
        number = int(self._save_counter.array) + 1
        self._save_counter.assign(number)

        def rollback() -> None:
            if int(self._save_counter.array) == number:
                self._save_counter.assign(number - 1)

        self._pending_rollback = rollback
        try:
            return self._write(f"{os.fspath(file_prefix)}-{number}", options, _update_state)
        except BaseException:
            rollback()
            raise
        finally:
            self._pending_rollback = None

    def _write(self, path: str, options: Optional[CheckpointOptions], on_commit: Any) -> str:
        options = options or CheckpointOptions()
        saver = self._async_saver(options) if options.enable_async else None
        save_pytree(path, self.state, options, coordinator=self._coordinator,
                    extra_metadata={"save_counter": int(self._save_counter.array)}, on_commit=on_commit,
                    saver=saver, on_failure=self._pending_rollback, timeout=options.timeout)
        return path

    def restore(self, save_path: "str | os.PathLike[str]", options: Optional[CheckpointOptions] = None) -> Any:
        """Read ``save_path`` onto the current ``state`` (its shardings), replace ``state``, and return it."""
        del options
        self._wait_for_pending()
        prefix = resolve_prefix(os.fspath(save_path))
        self.state = restore(prefix, self.state, key_map=self._key_map)
        with BundleReader(Location.of(prefix)) as reader:
            self._restore_counter(reader.read(METADATA_KEY) if METADATA_KEY in reader else None, prefix)
        return self.state

    def _restore_through(self, source: Any) -> Any:
        """``restore`` through an open source (a tiered restore's peer replica: a collective source whose
        bytes move when the call ends); the caller closes it."""
        self._wait_for_pending()
        reader = source.reader
        with collective_call(source):
            build = restore_through(source, reader, self.state, self._key_map)
            raw = reader.read(METADATA_KEY) if METADATA_KEY in reader else None
        self.state = build()
        self._restore_counter(raw, reader.prefix)
        return self.state

    def _restore_counter(self, raw: Any, prefix: str) -> None:
        if raw is not None:
            counter = decode_metadata(raw, prefix).get("save_counter")
            if counter is not None:
                self._save_counter.assign(int(counter))

    # -- what a CheckpointManager asks of the object it manages ------------------------------------
    def _collective(self) -> Optional[Any]:
        """The processes' coordinator (``.coordinator``) when the job has several (``None``: one)."""
        if self._coordinator is None and jax.process_count() == 1:
            return None
        return SimpleNamespace(coordinator=self._coordinator or default_coordinator())

    def _async_saver(self, options: CheckpointOptions) -> Optional[AsyncSaver]:
        """The checkpoint's saver: made on the first asynchronous save, its staging budget that save's."""
        if options.enable_async:
            if self._saver is None:
                self._saver = AsyncSaver(options.async_staging_bytes)
            else:
                self._saver.set_budget(options.async_staging_bytes)
        return self._saver

    def _background(self) -> AsyncSaver:
        """The checkpoint's saver (made when it has none yet): its thread runs the work that follows a save."""
        if self._saver is None:
            self._saver = AsyncSaver()
        return self._saver

    def _tier_pieces(self, nodes: "NodeMap", rank: int, leader: bool) -> List["TierPiece"]:
        """This process's pieces of ``state`` for its node's tier bundle (:func:`._tier.tier_pieces`)."""
        extra: Dict[str, Any] = {"save_counter": int(self._save_counter.array)}
        return tier_pieces(self.state, extra, nodes, rank, leader)

    def _tier_missing(self, reader: Any) -> Optional[str]:
        """What of ``state`` (on this process's devices) ``reader``'s bundle lacks (:func:`._tier.tier_missing`)."""
        return tier_missing(self.state, self._key_map, reader)

    def _wait_for_pending(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def sync(self) -> None:
        """Wait until the save in flight (``enable_async``) has committed; raise its error if it failed."""
        self._wait_for_pending()
