"""``Checkpoint``: save and restore an object graph, as ``tf.train.Checkpoint``.

::

    ckpt = shardckpt.Checkpoint(model=model, optimizer=opt)
    path = ckpt.save("/train/ckpt")          # /train/ckpt-1, and the `checkpoint` state file
    ckpt.restore(shardckpt.latest_checkpoint("/train")).assert_consumed()

A graph holding values laid out over several clients (DVariables on a mesh of several
clients) is saved by every client together (:mod:`shardckpt.checkpoint.collective`):
each client calls ``save``/``write``/``restore`` with the same graph.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ..errors import DataLossError, InvalidArgumentError, NotFoundError
from ..restoring import as_source, collective_call, funnelled_reader
from ..saving.async_save import AsyncSaver
from ..saving.options import CheckpointOptions
from ..saving.pieces import pieces_of
from ..saving.save import save_tensors
from ..sharding.shardable import ShardableTensor
from ..storage.base import is_local_path, normalize
from ..storage.registry import get_fs
from .collective import Collective, find_collective, save_collective
from .graph import OBJECT_GRAPH_KEY, SaveableGraph, build_graph
from .reader import open_bundle, resolve_prefix
from .registration import get_saver
from .restore import (
    CheckpointLoadStatus,
    InitializationOnlyStatus,
    NameBasedSaverStatus,
    RestoreSession,
    load_object_graph,
)
from .state import clean_path, latest_checkpoint, update_checkpoint_state
from .trackable import AutoTrackable, Trackable, Variable, as_trackable

__all__ = ["Checkpoint"]

_log = logging.getLogger("shardckpt")

SAVE_COUNTER = "save_counter"


class Checkpoint(AutoTrackable):
    """Groups trackable objects and saves them as one checkpoint in TensorFlow's format.

    ``Checkpoint(model=m, optimizer=o)`` makes the checkpoint the root of the graph
    with children ``model`` and ``optimizer`` (sorted by name) and, once it exists,
    ``save_counter``. ``Checkpoint(root=obj, **kwargs)`` makes ``obj`` the root and
    attaches ``kwargs`` to it as extra children.

    Values must be trackable (modules, variables, lists/tuples/dicts of them), as in
    TensorFlow; anything else raises :class:`~shardckpt.errors.InvalidArgumentError`
    (a ``ValueError``, as TF's). Extension: NumPy arrays are accepted too, saved like
    variables and restored in place.

    Unlike TensorFlow, a ``save`` that fails gives its number back (``save_counter``
    is what it was before the call), so the next save reuses the number.
    """

    _root: Optional[Trackable]
    _attached: Dict[str, Any]
    _save_counter: Optional[Variable]
    _pending_rollback: Optional[Callable[[], None]]

    def __init__(self, root: Optional[Any] = None, **kwargs: Any) -> None:
        object.__setattr__(self, "_pending_rollback", None)
        object.__setattr__(self, "_root", None)
        object.__setattr__(self, "_attached", {})
        object.__setattr__(self, "_save_counter", None)
        if root is not None:
            root_node = as_trackable(root)
            if root_node is None:
                raise InvalidArgumentError(f"root must be trackable (a Module, Variable, array, list or dict), "
                                           f"got {type(root).__name__}")
            object.__setattr__(self, "_root", root_node)
        for name in sorted(kwargs):
            value = kwargs[name]
            if as_trackable(value) is None:
                raise InvalidArgumentError(f"`Checkpoint` was expecting {name} to be a trackable object (a Module, "
                                           f"Variable, NumPy array, list or dict), got {value!r}")
            if name == SAVE_COUNTER:
                raise InvalidArgumentError("'save_counter' is reserved by Checkpoint")
            setattr(self, name, value)

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if self._root is not None and not name.startswith("_shardckpt") \
                and as_trackable(getattr(self, name)) is not None:
            self._attached[name] = getattr(self, name)
            self._root._child_attached(name, getattr(self, name))

    # -- the graph -------------------------------------------------------------
    def _graph_root(self) -> Tuple[Trackable, Dict[str, Trackable]]:
        """(root node, extra children of the root node)."""
        extra: Dict[str, Trackable] = {}
        if self._root is None:
            if self._save_counter is not None:
                extra[SAVE_COUNTER] = self._save_counter
            return self, extra
        for name, value in self._attached.items():
            node = as_trackable(value)
            if node is not None:
                extra[name] = node
        extra.setdefault("root", self._root)  # TF's self-edge of the root (the files are then TF's bytes)
        if self._save_counter is not None:
            extra[SAVE_COUNTER] = self._save_counter
        return self._root, extra

    @property
    def save_counter(self) -> Variable:
        """The number of ``save()`` calls, an int64 variable saved as ``save_counter`` (created on first use)."""
        counter = self._save_counter
        if counter is None:
            counter = Variable(np.int64(0), name="save_counter")
            object.__setattr__(self, "_save_counter", counter)
        return counter

    # -- saving ------------------------------------------------------------------
    def write(self, file_prefix: str, options: Optional[CheckpointOptions] = None) -> str:
        """Write a checkpoint at exactly ``file_prefix``; no counter, no state file."""
        return self._write(os.fspath(file_prefix), options, None)

    def save(self, file_prefix: str, options: Optional[CheckpointOptions] = None) -> str:
        """Increment ``save_counter``, write ``<file_prefix>-<n>``, update the ``checkpoint`` file; return the path.

        The state file is updated right after the commit, before the write callbacks
        run (TensorFlow runs the callbacks first; here a callback sees the new state).
        """
        self._wait_for_pending()  # a failed background save rolls its number back first
        counter = self.save_counter
        number = int(counter.array) + 1
        counter.assign(number)
        path = f"{os.fspath(file_prefix)}-{number}"

        def rollback() -> None:  # a failed save does not use up a number
            if int(counter.array) == number:
                counter.assign(number - 1)

        object.__setattr__(self, "_pending_rollback", rollback)
        try:
            return self._write(path, options, _update_state)
        except BaseException:
            rollback()
            raise
        finally:
            object.__setattr__(self, "_pending_rollback", None)

    def _write(self, path: str, options: Optional[CheckpointOptions], on_commit: Any) -> str:
        options = options or CheckpointOptions()
        root, extra = self._graph_root()
        graph = build_graph(root, extra)
        graph_tensor = ShardableTensor.from_value(OBJECT_GRAPH_KEY,
                                                  np.array(graph.proto.SerializeToString(), dtype=object))
        previous = _previous_checkpoint(path) if options.incremental and on_commit is not None else None
        # written at the lexically cleaned path (``a/../d/ck-1`` in ``d``, as TF); the spelling is returned
        self._save_graph(clean_path(path), graph, graph_tensor, options, on_commit, previous)
        return path

    def _collective(self, graph: Optional[SaveableGraph] = None) -> Optional[Collective]:
        """How the clients save this checkpoint together (``None``: this client saves alone): when
        ``graph`` (default: the current one) holds a value laid out over several clients."""
        if graph is None:
            root, extra = self._graph_root()
            graph = build_graph(root, extra)
        return find_collective(graph)

    def _save_graph(self, path: str, graph: SaveableGraph, graph_tensor: ShardableTensor,
                    options: CheckpointOptions, on_commit: Any, previous: Optional[str] = None) -> None:
        """Save the graph's values (in graph order) and then the graph itself."""
        collective = self._collective(graph)
        if collective is not None:
            save_collective(collective, path, graph, graph_tensor, options, on_commit=on_commit,
                            saver=self._async_saver(options), on_failure=self._pending_rollback, previous=previous)
            return
        tensors: List[ShardableTensor] = []
        for t in graph.tensors:  # a distributed value (a DVariable's DTensor) lists its distinct pieces
            tensors += pieces_of(t.key, t.value, trackable=t.obj)
        tensors.append(graph_tensor)
        extra = _registered_bundles(graph)
        if extra is not None and options.enable_async:
            # registered savers read their objects when they run: keep the snapshot honest
            _log.warning("registered savers in the graph: saving %s synchronously", path)
            options = options.replace(enable_async=False)
        save_tensors(path, tensors, options, extra_bundles=extra, on_commit=on_commit,
                     saver=self._async_saver(options), on_failure=self._pending_rollback, previous=previous)

    # -- tiered checkpoints (a CheckpointManager with local=; see shardckpt.tiers) -------
    def _tier_pieces(self, nodes: Any, rank: int, leader: bool) -> List[Any]:
        """Client ``rank``'s pieces of the graph for its node's tier bundle (:func:`._tier.tier_pieces`)."""
        from ._tier import tier_pieces

        root, extra = self._graph_root()
        return tier_pieces(root, extra, nodes, rank, leader)

    def _tier_missing(self, reader: Any) -> Optional[str]:
        """What of the graph (this client's regions) ``reader``'s bundle lacks (:func:`._tier.tier_missing`)."""
        from ._tier import tier_missing

        root, extra = self._graph_root()
        return tier_missing(root, extra, reader)

    # -- restoring ---------------------------------------------------------------
    def read(self, save_path: str, options: Optional[CheckpointOptions] = None) -> Any:
        """Restore from the checkpoint prefix ``save_path`` without creating ``save_counter``."""
        return self._restore(save_path, options)

    def restore(self, save_path: Optional[str], options: Optional[CheckpointOptions] = None) -> Any:
        """Restore from the checkpoint prefix ``save_path``, or a SavedModel directory's variables; another
        directory raises ``DataLossError``, as in TF (``latest_checkpoint(directory)`` names its latest).

        Returns a status (``assert_consumed()``, ``assert_existing_objects_matched()``,
        ``assert_nontrivial_match()``, ``expect_partial()``). ``None`` restores nothing and
        returns an ``InitializationOnlyStatus`` whose asserts and ``run_restore_ops`` fail, as TF's.
        Checkpoints without an object graph (TF1 ``Saver``) are matched by variable name.
        """
        if save_path is None:
            return InitializationOnlyStatus()
        self.save_counter  # noqa: B018 - created so that it is restored too
        return self._restore(os.fspath(save_path), options, saved_model=True)

    def _restore(self, save_path: str, options: Optional[CheckpointOptions], saved_model: bool = False) -> Any:
        options = options or CheckpointOptions()
        self._wait_for_pending()  # never restore around a save in flight
        reader = self._open_for_restore(os.fspath(save_path), options, saved_model)
        return self._restore_through(reader, options)

    def _restore_through(self, reader: Any, options: Optional[CheckpointOptions] = None) -> Any:
        """``restore`` from an open reader (a ``BundleReader`` over any store, or a ``PieceSource``: a
        tiered restore reads a peer's replica through one); the caller closes it."""
        options = options or CheckpointOptions()
        self._wait_for_pending()
        with collective_call(as_source(reader)):  # a funnelled restore's exchange when the call ends
            status = self._restore_from(reader, options)
        return status

    def _open_for_restore(self, save_path: str, options: CheckpointOptions, saved_model: bool = False) -> Any:
        """What a restore reads through: a :class:`BundleReader`; with ``options.io_device`` in a collective
        checkpoint of several clients, a funnelled reader (only the io client reads; collective).

        The path is looked at only where it is opened (the io client of a funnelled restore): a
        SavedModel directory becomes its variables' prefix when ``saved_model``, another directory
        raises, as in TF."""

        def checked(path: str) -> str:
            path = _saved_model_variables(path) if saved_model else path
            _refuse_directory(path)
            return path

        if options.io_device is not None:
            collective = self._collective()
            if collective is not None:
                funnel = funnelled_reader(save_path, options, collective.coordinator,
                                          resolve=lambda path: resolve_prefix(checked(path)),
                                          preload=[OBJECT_GRAPH_KEY])
                if funnel is not None:
                    return funnel
        return open_bundle(checked(save_path))

    def _restore_from(self, reader: Any, options: CheckpointOptions) -> Any:
        root, extra = self._graph_root()
        if OBJECT_GRAPH_KEY not in reader:
            optional = {self._save_counter._identity()} if self._save_counter is not None else set()
            return NameBasedSaverStatus(reader, root, extra, optional)
        proto = load_object_graph(reader)
        session = RestoreSession(reader, proto, skip_slot_variables=options.skip_slot_variables)
        session.restore(0, root, extra)
        # a save_counter the checkpoint lacks (written by write()) fails the asserts, as in TF
        return CheckpointLoadStatus(session, root, extra, set())

    # -- asynchronous saves -------------------------------------------------------
    def _async_saver(self, options: CheckpointOptions) -> Optional[AsyncSaver]:
        saver = self.__dict__.get("_shardckpt_saver")
        if options.enable_async:
            if saver is None:
                saver = AsyncSaver(options.async_staging_bytes)
                object.__setattr__(self, "_shardckpt_saver", saver)
            else:
                saver.set_budget(options.async_staging_bytes)
        return saver

    def _background(self) -> AsyncSaver:
        """The checkpoint's saver (made without a staging budget when it has none yet): its thread also
        runs the work that follows a save (:meth:`AsyncSaver.then`)."""
        saver = self.__dict__.get("_shardckpt_saver")
        if saver is None:
            saver = AsyncSaver()
            object.__setattr__(self, "_shardckpt_saver", saver)
        return saver

    def _wait_for_pending(self) -> None:
        saver = self.__dict__.get("_shardckpt_saver")
        if saver is not None:
            saver.wait()

    def sync(self) -> None:
        """Wait until the save in flight (``enable_async``) has committed; raise its error if it failed."""
        self._wait_for_pending()


def _previous_checkpoint(path: str) -> Optional[str]:
    """For an incremental save to ``path``: the latest checkpoint its folder's state file names, if any."""
    try:
        return latest_checkpoint(get_fs(path).dirname(path) or ".")
    except Exception:  # an unreadable state file: the save is then a full one
        return None


def _saved_model_variables(save_path: str) -> str:
    """A (local) SavedModel directory -> its variables' prefix, as TF's ``restore`` takes it; else ``save_path``."""
    if is_local_path(save_path) and os.path.isdir(normalize(save_path)):
        folder = normalize(save_path)
        if any(os.path.exists(os.path.join(folder, name)) for name in ("saved_model.pb", "saved_model.pbtxt")):
            return os.path.join(folder, "variables", "variables")
    return save_path


def _refuse_directory(save_path: str) -> None:
    """TF's restore takes prefixes only: a (local) directory is a ``DataLossError``, as TF's table open fails."""
    if is_local_path(save_path) and os.path.isdir(normalize(save_path)):
        raise DataLossError("Unable to open table file: it is a directory, not a checkpoint prefix (pass "
                            "latest_checkpoint(directory) to restore its latest checkpoint)", path=save_path)


def _update_state(path: str) -> None:
    fs = get_fs(path)
    directory = fs.dirname(path) or "."
    # Under the folder's lock, as the manager writes it: a manager's cleaning (which removes
    # dead state-file writes' .tempstate files under that lock) never takes this one's.
    with fs.exclusive(directory):
        update_checkpoint_state(directory, path, [path])


def _registered_bundles(graph: SaveableGraph) -> Any:
    if not graph.registered:
        return None

    def write(temp_dir: str) -> List[str]:
        prefixes: List[str] = []
        for name, trackables in graph.registered.items():
            saver = get_saver(name)
            if saver is None:  # pragma: no cover - the graph only names registered savers
                raise NotFoundError(f"registered saver {name!r} disappeared")
            returned = saver.save_fn(dict(trackables), os.path.join(temp_dir, f"registered-{name}"))
            prefixes.extend([returned] if isinstance(returned, str) else list(returned))
        return prefixes

    return write

