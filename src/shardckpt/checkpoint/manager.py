"""``CheckpointManager``: numbered saves in a directory, keeping the newest few (``tf.train.CheckpointManager``).

The ``checkpoint`` state file carries what TensorFlow's manager writes: the kept
paths oldest first, their timestamps and ``last_preserved_timestamp``, so either
library can continue the other's directory. Old checkpoints are deleted only
after the new one has committed and the state file names it.

At each moment of recording a save (locally under the folder's ``flock``; on object stores
too, where each step is one request):
an empty ``<old>.deleting`` marker per checkpoint beyond ``max_to_keep``; the state file
(naming the new checkpoint and the kept ones, never the doomed); the doomed checkpoints
deleted (index first) and their markers removed; markers a dead process left finished
(their checkpoints deleted unless named again); what dead saves left removed. Every
deletion is :mod:`shardckpt.saving.commit.deletion`'s (the committers' own), through the
folder's ``FileSystem``.

Several clients (a checkpoint saved collectively: DVariables on a mesh of several
clients, a ``DTensorCheckpoint``): every client runs the same manager calls. Only the
io client touches the folder: at construction it reads the state file and broadcasts
what it found; at each save it records the commit (the steps above) and its new state
(the kept checkpoints, their timestamps, the latest) travels with the save's outcome, so
every client adopts the same state once it knows the save committed (an asynchronous
save: on its background thread). ``restore_or_initialize`` takes the io client's choice,
so every client restores, or every client initializes.
"""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..distributed.coordinator import CoordinationError, Coordinator
from ..errors import InvalidArgumentError, NotFoundError
from ..format.naming import index_filename
from ..saving.commit.deletion import DELETING, clean_directory, delete_marked, finish_deletions, mark_deleting
from ..saving.incremental import retained_for_damage
from ..saving.options import CheckpointOptions
from ..saving.request import SharedCommitStep
from ..storage.base import normalize
from ..storage.object_store import ObjectStore
from ..storage.registry import get_fs
from .state import STATE_FILENAME, CheckpointState, clean_path, get_checkpoint_state, update_checkpoint_state

__all__ = ["CheckpointManager", "DELETING"]


def _value(counter: Any) -> int:
    return int(np.asarray(counter))


class CheckpointManager:
    """Manage numbered checkpoints of one :class:`~shardckpt.Checkpoint` in ``directory``.

    ``max_to_keep`` is required, as in TensorFlow (``None`` keeps every checkpoint).
    With ``checkpoint_interval``, ``save`` writes only when ``step_counter`` advanced
    that many steps since ``last_checkpoint_step`` (initially the argument, then the
    step of the last save or restore).

    With ``incremental`` every save is incremental (``CheckpointOptions(incremental=True)``
    is added to the options of each ``save``): values unchanged since the latest checkpoint
    are linked (or copied server-side) instead of written, and every checkpoint stays
    complete, so retention deletes old ones safely; it keeps the newest checkpoint not known
    damaged while every newer one shares a damaged data file
    (:func:`~shardckpt.saving.incremental.retained_for_damage`).

    With ``local`` (a :class:`~shardckpt.LocalTier`) every save first goes to each node's local
    tier, with replicas on other nodes (:mod:`shardckpt.tiers`), and only every
    ``persist_every``-th (every one when ``None``) also to ``directory``; a save that is local
    only returns the node's bundle prefix. ``restore_or_initialize`` restores the newest step
    complete across the tiers unless the persistent latest is newer.
    """

    def __init__(self, checkpoint: Any, directory: str, max_to_keep: Optional[int],
                 keep_checkpoint_every_n_hours: Optional[float] = None, checkpoint_name: str = "ckpt",
                 step_counter: Any = None, checkpoint_interval: Optional[int] = None,
                 init_fn: Optional[Callable[[], Any]] = None, last_checkpoint_step: Optional[int] = None,
                 incremental: bool = False, local: Any = None, persist_every: Optional[int] = None) -> None:
        if max_to_keep is not None and max_to_keep <= 0:
            raise InvalidArgumentError(f"Expected a positive integer or `None` for `max_to_keep`, got {max_to_keep}")
        if checkpoint_interval is not None and step_counter is None:
            raise InvalidArgumentError("checkpoint_interval needs a step_counter")
        self._checkpoint = checkpoint
        self._incremental = bool(incremental)
        self._directory = normalize(os.fspath(directory))
        self._max_to_keep = max_to_keep
        self._keep_every_hours = keep_checkpoint_every_n_hours
        self._prefix = get_fs(self._directory).join(self._directory, checkpoint_name)
        self._step_counter = step_counter
        self._checkpoint_interval = checkpoint_interval
        self._init_fn = init_fn
        self._last_checkpoint_step: Optional[int] = None if last_checkpoint_step is None \
            else _value(last_checkpoint_step)
        self._maybe_delete: "OrderedDict[str, float]" = OrderedDict()
        self._tiered = self._tiered_setup(local, persist_every)
        now = time.time()
        # TF: one second back, so that a manager re-created at once does not race the last one.
        self._last_preserved_timestamp = now - 1.0
        self._latest_checkpoint: Optional[str] = None
        state = self._shared(lambda: _recovered(get_checkpoint_state(self._directory)),
                             f"read the state file of {self._directory}")
        if state is not None:
            self._latest_checkpoint = state["latest"]
            self._last_preserved_timestamp = _clock_checked(state["preserved"], now)
            paths = state["paths"]
            stamps = state["stamps"] or [self._last_preserved_timestamp] * len(paths)
            for path, stamp in zip(paths, stamps):
                stamp = min(stamp, now)
                if stamp > self._last_preserved_timestamp:
                    self._maybe_delete[path] = stamp

    # -- several clients ----------------------------------------------------------
    def _coordinator(self) -> Optional[Coordinator]:
        """The clients' coordinator when the checkpoint is saved by several clients together, else ``None``."""
        find = getattr(self._checkpoint, "_collective", None)
        collective = find() if find is not None else None
        if collective is None or int(collective.coordinator.size) == 1:
            return None
        return collective.coordinator  # type: ignore[no-any-return]

    # -- tiered checkpoints (issue 28: ``local=``, ``persist_every=``; see shardckpt.tiers) ----------------
    def _tiered_setup(self, local: Any, persist_every: Optional[int]) -> Any:
        """The manager's :class:`~shardckpt.tiers.checkpoints.Tiered` for ``local`` (``None``: no tier)."""
        if persist_every is not None and (local is None or int(persist_every) < 1):
            raise InvalidArgumentError(f"persist_every={persist_every!r} needs local= (a LocalTier) and a "
                                       "positive number of saves")
        self._persist_every = None if persist_every is None else int(persist_every)
        if local is None:
            return None
        if not callable(getattr(self._checkpoint, "_tier_pieces", None)):
            raise InvalidArgumentError(f"local= tiers a shardckpt.Checkpoint or a shardckpt.jax.PyTreeCheckpoint, "
                                       f"not a {type(self._checkpoint).__name__}")
        from ..tiers.checkpoints import Tiered

        return Tiered(local, self._checkpoint, self._coordinator)

    @property
    def local(self) -> Any:
        """The manager's :class:`~shardckpt.LocalTier` (``None``: no local tier)."""
        return None if self._tiered is None else self._tiered.tier

    def _shared(self, decide: Callable[[], Any], what: str) -> Any:
        """``decide()`` on this client alone, or, with several clients, on the io client (client 0), whose
        result (or error) every client receives."""
        coordinator = self._coordinator()
        if coordinator is None:
            return decide()
        error: Optional[Exception] = None
        reply: Any = None
        if coordinator.rank == 0:
            try:
                reply = {"ok": True, "value": decide()}
            except Exception as exc:
                error = exc
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        reply = coordinator.broadcast(reply, root=0)
        if error is not None:
            raise error
        if not reply["ok"]:
            raise CoordinationError(f"client 0 could not {what}: {reply['error']}")
        return reply["value"]

    @property
    def directory(self) -> str:
        """The directory holding the checkpoints and the ``checkpoint`` state file."""
        return self._directory

    @property
    def checkpoint(self) -> Any:
        """The managed :class:`~shardckpt.Checkpoint`."""
        return self._checkpoint

    @property
    def latest_checkpoint(self) -> Optional[str]:
        """The newest checkpoint this manager knows of (``None`` before the first save)."""
        return self._latest_checkpoint

    @property
    def checkpoints(self) -> List[str]:
        """Checkpoints that are kept and may later be deleted, oldest first."""
        return list(self._maybe_delete)

    @property
    def checkpoint_interval(self) -> Optional[int]:
        """Minimum number of steps between saves (``None``: every ``save`` call writes)."""
        return self._checkpoint_interval

    @property
    def last_checkpoint_step(self) -> Optional[int]:
        """The step counter's value at the last save or restore (``checkpoint_interval`` only; else ``None``)."""
        return self._last_checkpoint_step

    def sync(self) -> None:
        """Wait until the save in flight (``enable_async``) has committed; raise its error if it failed."""
        self._checkpoint.sync()

    def save(self, checkpoint_number: Optional[int] = None, check_interval: bool = True,
             options: Optional[CheckpointOptions] = None) -> Optional[str]:
        """Save ``<directory>/<checkpoint_name>-<n>``; return its path, or ``None`` if the interval says wait.

        ``n`` is ``checkpoint_number`` if given, else the checkpoint's ``save_counter``
        after incrementing it (it is incremented either way).
        """
        if self._checkpoint_interval is not None:
            step = _value(self._step_counter)
            if self._last_checkpoint_step is not None:
                if step == self._last_checkpoint_step:
                    return None
                if check_interval and step < self._last_checkpoint_step + self._checkpoint_interval:
                    return None
        if self._incremental:
            options = (options or CheckpointOptions()).replace(incremental=True)
        self._checkpoint._wait_for_pending()  # a failed background save rolls its number back first
        counter = self._checkpoint.save_counter
        previous = int(np.asarray(counter.array))
        counter.assign(previous + 1)
        number = previous + 1 if checkpoint_number is None else _value(checkpoint_number)
        prefix = f"{self._prefix}-{number}"

        def rollback() -> None:  # a failed (background) save does not use up a number
            if int(np.asarray(counter.array)) == previous + 1:
                counter.assign(previous)

        object.__setattr__(self._checkpoint, "_pending_rollback", rollback)
        try:
            behind = None
            if self._tiered is not None:  # tiered checkpoints: every save to the local tier
                timeout = options.timeout if options else None
                if self._persist_every and number % self._persist_every:  # this step goes to the tiers only
                    local = self._tiered.save(number, timeout=timeout,
                                              saver=self._checkpoint._async_saver(options)
                                              if options is not None and options.enable_async else None,
                                              on_failure=rollback)
                    if self._checkpoint_interval is not None:
                        self._last_checkpoint_step = _value(self._step_counter)
                    return local
                # a step that also persists: into the tiers behind the persistent save, read back from it
                behind = self._tiered.stage(number, timeout=timeout, persisted=prefix)
            # The state file is recorded (and old checkpoints deleted) right after the
            # commit, before the write callbacks run; every client adopts the io client's
            # new state once it knows the save committed.
            try:
                self._checkpoint._write(prefix, options,
                                        SharedCommitStep(lambda _written: self._record(prefix), self._adopt))
            finally:
                copy = behind.job() if behind is not None else None  # the tier copy's work, for after the commit
            if copy is not None:
                self._checkpoint._background().then(copy, name=f"tier copy of step {number}")
        except BaseException:
            counter.assign(previous)
            raise
        finally:
            object.__setattr__(self._checkpoint, "_pending_rollback", None)
        if self._checkpoint_interval is not None:
            self._last_checkpoint_step = _value(self._step_counter)
        return prefix

    def _record(self, path: str) -> Dict[str, Any]:
        """Note the committed checkpoint ``path`` (as this manager spells it; on the io client): state
        file first, then delete what is beyond ``max_to_keep`` and what dead saves left in the folder.
        Returns the new state, which every client adopts (:meth:`_adopt`).

        Runs under the folder's exclusive lock (``FileSystem.exclusive``), so that two managers
        (or processes) sharing a folder never name a checkpoint the other is deleting: the state
        file is written only while the checkpoints it names are there (locally, kept checkpoints
        another manager deleted are dropped from the list first). Two managers sharing a folder: the
        last to record names its checkpoint latest (last record wins), and each deletes only
        what its own list holds. The manager's own state changes only once the state file names it.
        """
        fs = get_fs(self._directory)
        folder = clean_path(self._directory)  # paths are kept as spelled (as TF); files are reached cleaned
        with fs.exclusive(folder):
            if not fs.exists(index_filename(clean_path(path))):
                raise NotFoundError("the checkpoint just committed is gone (removed by another process "
                                    "sharing this folder?); the state file was not changed", path=path)
            now = time.time()
            kept = OrderedDict(self._maybe_delete)
            if not isinstance(fs, ObjectStore):  # local: another manager sharing this folder may have deleted some
                for other in [p for p in kept if p != path]:
                    if not fs.exists(index_filename(clean_path(other))):
                        del kept[other]
            kept.pop(path, None)
            kept[path] = now
            stamps = dict(kept)
            doomed, preserved = _sweep(kept, self._max_to_keep, self._keep_every_hours,
                                       self._last_preserved_timestamp)
            # incremental: the newest checkpoint not known damaged stays while every newer one is (issue 24)
            for old in retained_for_damage(doomed, list(kept), fs) if self._incremental else []:
                doomed.remove(old)
                kept[old] = stamps[old]
                kept.move_to_end(old, last=False)
            # a marker per doomed checkpoint (every store), so a death below is finished later
            mark_deleting(fs, [clean_path(old) for old in doomed])
            update_checkpoint_state(self._directory, path, list(kept),
                                    all_model_checkpoint_timestamps=list(kept.values()),
                                    last_preserved_timestamp=preserved)
            state = {"latest": path, "kept": [[p, t] for p, t in kept.items()], "preserved": preserved}
            self._adopt(path, state)
            delete_marked(fs, [clean_path(old) for old in doomed])
            tracked = [clean_path(p) for p in kept]
            finish_deletions(fs, folder, fs.basename(self._prefix), set(tracked))
            # Other complete checkpoints the state file does not name are left alone, as TensorFlow's
            # manager leaves them (a save killed between its commit and this point leaves one; the
            # next save with the restored counter reuses its number and replaces it).
            clean_directory(fs, folder, fs.basename(self._prefix), tracked,
                            remove_untracked=False, state_file=STATE_FILENAME)
        return state

    def _adopt(self, path: str, state: Optional[Dict[str, Any]]) -> None:
        """Take the state the io client recorded for the save of ``path`` (every client, once the commit
        is known; the attributes are replaced, never changed in place, so readers on other threads
        see the old state or the new one)."""
        if state is None:
            return
        self._maybe_delete = OrderedDict((str(p), float(t)) for p, t in state["kept"])
        self._last_preserved_timestamp = float(state["preserved"])
        self._latest_checkpoint = str(state["latest"])

    def restore_or_initialize(self) -> Optional[str]:
        """Restore the latest checkpoint and return its path; else run ``init_fn`` and return ``None``.

        With several clients the io client's latest checkpoint is every client's choice: every
        client restores it, or every client initializes."""
        if self._tiered is not None:  # tiered checkpoints: the newest complete local step, if not older
            self._checkpoint._wait_for_pending()  # a save in flight commits (or fails) before the tiers are read
            # client 0's persistent latest travels in the tiers' report round (one round, not two)
            restored = self._tiered.restore(lambda: self._latest_checkpoint)
            if restored.prefix is not None:
                if self._checkpoint_interval is not None:
                    self._last_checkpoint_step = _value(self._step_counter)
                return restored.prefix
            latest = restored.persistent
        else:
            latest = self._shared(lambda: self._latest_checkpoint, "choose between restoring and initializing")
        if latest is not None:
            self._checkpoint.restore(latest)
            if self._checkpoint_interval is not None:
                self._last_checkpoint_step = _value(self._step_counter)
            return latest  # type: ignore[no-any-return]
        if self._init_fn is not None:
            self._init_fn()
        return None


def _sweep(kept: "OrderedDict[str, float]", max_to_keep: Optional[int], keep_every_hours: Optional[float],
           preserved: float) -> Tuple[List[str], float]:
    """Drop checkpoints beyond ``max_to_keep`` from ``kept`` (keeping one every N hours, which moves the
    last preserved timestamp); return those to delete and the new last preserved timestamp."""
    doomed: List[str] = []
    if not max_to_keep:
        return doomed, preserved
    while len(kept) > max_to_keep:
        path, stamp = kept.popitem(last=False)
        if keep_every_hours and stamp - keep_every_hours * 3600.0 >= preserved:
            preserved = stamp
            continue
        doomed.append(path)
    return doomed, preserved


def _recovered(state: Optional[CheckpointState]) -> Optional[Dict[str, Any]]:
    """What a manager takes from a parsed state file, as JSON (``None``: no state file)."""
    if state is None:
        return None
    return {"latest": state.model_checkpoint_path, "paths": list(state.all_model_checkpoint_paths),
            "stamps": list(state.all_model_checkpoint_timestamps),
            "preserved": float(state.last_preserved_timestamp)}


def _clock_checked(last_preserved: float, now: float) -> float:
    """The recovered ``last_preserved_timestamp``, never in the future: a clock that went back is logged,
    as TF logs it (and saved timestamps are capped at ``now``, so no old checkpoint is deleted early)."""
    if now < last_preserved:
        import logging

        logging.getLogger("shardckpt").warning(
            "time.time() returned a value %f seconds behind the last preserved checkpoint timestamp.",
            last_preserved - now)
        return now
    return last_preserved
