"""The saving room's face on the process's runtime: the default saver and background clones.

A :class:`SaveContext` gives, over one :class:`~shardckpt.runtime.Runtime` (the process's,
:func:`default_context`), the default :class:`~shardckpt.saving.async_save.AsyncSaver`
(for asynchronous saves whose front door names none, e.g. ``save_tensors``) and the
coordinators' clones that background saves coordinate on (one clone per coordinator,
made collectively the first time a client saves asynchronously with it). Both are the
runtime's: made lazily under its lock, kept in its one keyed cache (a clone lives as
long as its coordinator), new after :func:`~shardckpt.runtime.reset` and in a forked
child. ``Checkpoint`` objects own their own saver.
"""

from __future__ import annotations

from typing import Optional

from ..distributed.coordinator import Coordinator
from ..runtime import Runtime, Slot, runtime
from .async_save import AsyncSaver

__all__ = ["SaveContext", "default_context", "default_saver"]

#: The saver of async saves that name none.
_SAVER: "Slot[AsyncSaver]" = Slot("the default async saver", AsyncSaver)

#: The key of a coordinator's background clone in the runtime's keyed cache (anchored on the coordinator).
BACKGROUND = "background"


class SaveContext:
    """The default async saver and the background clones of coordinators, kept by ``owner`` (a runtime)."""

    def __init__(self, owner: Optional[Runtime] = None) -> None:
        self._runtime = owner if owner is not None else runtime()

    def saver(self) -> AsyncSaver:
        """The saver of async saves that name none."""
        return self._runtime.keep(_SAVER, AsyncSaver)

    def background(self, coordinator: Coordinator) -> Coordinator:
        """``coordinator``'s clone for background saves (made once; collective the first time)."""
        return self._runtime.keep(BACKGROUND, coordinator.clone, anchor=coordinator)


def default_context() -> SaveContext:
    """The context of the process's runtime."""
    return SaveContext(runtime())


def default_saver() -> AsyncSaver:
    """The default context's saver (async ``save_tensors`` calls that name none)."""
    return default_context().saver()
