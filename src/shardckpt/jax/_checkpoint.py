"""``PyTreeCheckpoint``: a pytree as the object a :class:`~shardckpt.CheckpointManager` saves and restores.

``CheckpointManager(PyTreeCheckpoint(state), directory, max_to_keep=3)`` numbers
the saves (``ckpt-1``, ``ckpt-2``, ...), keeps the newest few, records them in the
``checkpoint`` state file and restores the latest (``restore_or_initialize``),
exactly as for a :class:`~shardckpt.Checkpoint`. The saved object is
``checkpoint.state``, a pytree (see :func:`~shardckpt.jax.save`); a restore reads
onto the current ``state`` (its shardings) and replaces it. The save counter travels
in the pytree metadata (field ``save_counter``), so a manager re-created after a
restart continues the numbering once it has restored.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import numpy as np

from ..checkpoint.checkpoint import _update_state
from ..checkpoint.reader import resolve_prefix
from ..checkpoint.trackable import Variable
from ..distributed.coordinator import Coordinator
from ..format.bundle_reader import BundleReader
from ..saving.async_save import AsyncSaver
from ..saving.options import CheckpointOptions
from ..storage.location import Location
from ._restore import KeyMap, restore
from ._save import save_pytree
from ._tree import METADATA_KEY, decode_metadata

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
        saver = None
        if options.enable_async:
            if self._saver is None:
                self._saver = AsyncSaver(options.async_staging_bytes)
            saver = self._saver
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
            if METADATA_KEY in reader:
                counter = decode_metadata(reader.read(METADATA_KEY), prefix).get("save_counter")
                if counter is not None:
                    self._save_counter.assign(int(counter))
        return self.state

    def _wait_for_pending(self) -> None:
        if self._saver is not None:
            self._saver.wait()

    def sync(self) -> None:
        """Wait until the save in flight (``enable_async``) has committed; raise its error if it failed."""
        self._wait_for_pending()
