"""Process-wide state of saves, owned in one place.

A :class:`SaveContext` owns the default :class:`~shardckpt.saving.async_save.AsyncSaver`
(for asynchronous saves whose front door names none, e.g. ``save_tensors``) and the
coordinators' clones that background saves coordinate on (one clone per coordinator,
made collectively the first time a client saves asynchronously with it). Both are
created lazily under the context's lock. :func:`default_context` is the module's
context, itself created under a lock. ``Checkpoint`` objects own their own saver.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional

from ..distributed.coordinator import Coordinator
from .async_save import AsyncSaver

__all__ = ["SaveContext", "default_context", "default_saver"]


class SaveContext:
    """The default async saver and the background clones of coordinators."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._saver: Optional[AsyncSaver] = None
        self._clones: "weakref.WeakKeyDictionary[Coordinator, Coordinator]" = weakref.WeakKeyDictionary()

    def saver(self) -> AsyncSaver:
        """The saver of async saves that name none."""
        with self._lock:
            if self._saver is None:
                self._saver = AsyncSaver()
            return self._saver

    def background(self, coordinator: Coordinator) -> Coordinator:
        """``coordinator``'s clone for background saves (made once; collective the first time)."""
        with self._lock:
            clone = self._clones.get(coordinator)
            if clone is None:
                clone = coordinator.clone()
                self._clones[coordinator] = clone
            return clone


_LOCK = threading.Lock()
_DEFAULT: Optional[SaveContext] = None


def default_context() -> SaveContext:
    """The process's default context."""
    global _DEFAULT
    with _LOCK:
        if _DEFAULT is None:
            _DEFAULT = SaveContext()
        return _DEFAULT


def default_saver() -> AsyncSaver:
    """The default context's saver (async ``save_tensors`` calls that name none)."""
    return default_context().saver()
