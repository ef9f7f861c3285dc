"""Restoring an object graph: match checkpoint nodes to live objects, read values in place.

A restore walks the saved ``TrackableObjectGraph`` from node 0 alongside the live
objects, matching children by name and attributes by name; values are read by
checkpoint key straight into the objects' arrays. Every match is checked (key
present, dtype and shape equal) before the first value is written, so a restore
that fails on such a problem changes nothing. Children that do not exist yet are
restored when they are attached later (deferred restoration), as are optimizer
slots created later.

Values of the checkpoint that nothing restored are reported (a logged warning,
unless ``expect_partial()``) when the restore's session ends, as TF does: the status
and every deferred restoration still waiting hold the session, so values restored
later by deferred restoration are never reported.

The values of one restore are read together (:func:`read_values`), as one plan of the restore
engine (:mod:`shardckpt.restoring`): on object stores their byte ranges are announced first,
so a full restore is a few large GETs fetched in parallel, not one request per variable; the
arrays are read and checksummed by the reader's helpers in one deferring session, all checked
before the restore returns.
"""

from __future__ import annotations

import abc
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np

from ..errors import CorruptIndexError, InvalidArgumentError, NotFoundError
from ..format.bundle_reader import BundleReader
from ..format.dtypes import as_dtype
from ..format.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from ..restoring import Read, RestorePlan, as_source, run
from .graph import OBJECT_GRAPH_KEY, build_graph, slot_variables_of, walk
from .registration import get_saver
from .trackable import Trackable, Variable

__all__ = ["RestoreSession", "read_values", "LoadStatus", "CheckpointLoadStatus", "NameBasedSaverStatus",
           "InitializationOnlyStatus", "load_object_graph"]

_log = logging.getLogger("shardckpt")


def load_object_graph(reader: BundleReader) -> TrackableObjectGraph:
    """Parse ``_CHECKPOINTABLE_OBJECT_GRAPH``; a damaged graph is a clear error."""
    raw = reader.read(OBJECT_GRAPH_KEY)
    proto = TrackableObjectGraph()
    try:
        if raw.shape != ():
            raise ValueError(f"shape {list(raw.shape)}")
        proto.ParseFromString(raw.item())
    except Exception as exc:
        raise CorruptIndexError(f"corrupt object graph ({exc})", path=reader.prefix, key=OBJECT_GRAPH_KEY) from None
    n = len(proto.nodes)
    if n == 0:
        raise CorruptIndexError("the object graph has no nodes", path=reader.prefix, key=OBJECT_GRAPH_KEY)
    for i, node in enumerate(proto.nodes):
        refs = [c.node_id for c in node.children]
        refs += [s.original_variable_node_id for s in node.slot_variables]
        refs += [s.slot_variable_node_id for s in node.slot_variables]
        if any(not 0 <= r < n for r in refs):
            raise CorruptIndexError(f"object graph node {i} refers to a node that does not exist",
                                    path=reader.prefix, key=OBJECT_GRAPH_KEY)
    return proto


def read_values(reader: Any, targets: List[Tuple[str, Any]]) -> None:
    """Read checkpoint key -> target (an array filled in place, or a ``DistributedValue`` whose
    ``restore_reads(key)`` says what it reads) for every pair, as one plan of the restore
    engine (:func:`shardckpt.restoring.run`: announced once, arrays read whole and checksummed
    by the reader's helpers, regions on its threads); all values are read and checked when this
    returns — for a funnelled restore, when its call ends.
    """
    items: List[Any] = []
    for key, target in targets:
        if isinstance(target, np.ndarray):
            items.append(Read(key, None, target))
        else:
            items.extend(target.restore_reads(key))
    run(RestorePlan.of(as_source(reader), items))


@dataclass
class _Read:
    """One value to read: checkpoint key -> the target array of an object's attribute."""

    obj: Trackable
    attribute: str
    key: str
    target: np.ndarray
    node_id: int


class RestoreSession:
    """The state of one restore, alive while deferred restorations may still happen."""

    def __init__(self, reader: BundleReader, proto: TrackableObjectGraph, *, skip_slot_variables: bool = False) -> None:
        self.reader = reader
        self.proto = proto
        self.skip_slots = skip_slot_variables
        self.bound: Dict[int, Trackable] = {}
        self.restored_keys: Set[str] = set()
        self.restored_objects: Set[int] = set()  # identities
        self.deferred: Set[int] = set()  # node ids waiting for an object
        self.slot_nodes = {s.slot_variable_node_id for n in proto.nodes for s in n.slot_variables}
        self.expect_partial = False  # set by the status: no warning about unrestored values

    def __del__(self) -> None:
        """The session ends (its status and every waiting deferred restoration are gone): report
        what was never restored, as TF does when its restore coordinator is deleted."""
        try:
            if not self.expect_partial:
                unmatched = self.unmatched_keys()
                if unmatched:
                    _log.warning("%d value(s) in checkpoint %s were not restored: %s. Call expect_partial() on "
                                 "the status if this is intended.", len(unmatched), self.reader.prefix,
                                 _some(unmatched))
        except Exception:  # pragma: no cover - interpreter shutdown
            pass

    # -- matching --------------------------------------------------------------
    def restore(self, node_id: int, obj: Trackable, extra_root_children: Optional[Dict[str, Trackable]] = None) -> None:
        """Match the subtree at ``node_id`` to ``obj``; check everything, then read in place."""
        reads: List[_Read] = []
        registered: List[Tuple[str, str, Trackable]] = []
        deferrals: List[Callable[[], None]] = []
        bound_before = dict(self.bound)
        try:
            self._collect(node_id, obj, reads, registered, deferrals, extra_root_children)
            self._check(reads)
        except BaseException:
            self.bound = bound_before  # a failed restore changes nothing
            raise
        for defer in deferrals:
            defer()
        read_values(self.reader, [(read.key, read.target) for read in reads])
        touched: Dict[int, Tuple[Trackable, List[str]]] = {}
        for read in reads:
            self.restored_keys.add(read.key)
            self.restored_objects.add(read.obj._identity())
            touched.setdefault(read.obj._identity(), (read.obj, []))[1].append(read.attribute)
        for obj_, attributes in touched.values():
            obj_._after_restore(attributes)
        by_saver: Dict[str, Dict[str, Trackable]] = {}
        for saver_name, object_name, target in registered:
            by_saver.setdefault(saver_name, {})[object_name] = target
        for saver_name, trackables in by_saver.items():
            saver = get_saver(saver_name)
            if saver is None:
                raise NotFoundError(f"the checkpoint uses registered saver {saver_name!r}, which is not "
                                    "registered in this process", path=self.reader.prefix)
            saver.restore_fn(trackables, self.reader.prefix)
            for target in trackables.values():
                self.restored_objects.add(target._identity())

    def _collect(self, root_id: int, root: Trackable, reads: List[_Read],
                 registered: List[Tuple[str, str, Trackable]], deferrals: List[Callable[[], None]],
                 extra_root_children: Optional[Dict[str, Trackable]]) -> None:
        queue = [(root_id, root)]
        while queue:
            node_id, obj = queue.pop(0)
            if node_id in self.bound and self.bound[node_id]._identity() != obj._identity():
                continue  # bound earlier to another object (first match wins, as in TF)
            self.bound[node_id] = obj
            self.deferred.discard(node_id)
            node = self.proto.nodes[node_id]
            if node.HasField("registered_saver") and node.registered_saver.name:
                registered.append((node.registered_saver.name, node.registered_saver.object_name, obj))
            targets = obj._restore_targets() if node.attributes else {}
            for attribute in node.attributes:
                target = targets.get(attribute.name)
                if target is not None:
                    reads.append(_Read(obj, attribute.name, attribute.checkpoint_key, target, node_id))
            children = obj._trackable_children()
            if node_id == root_id and extra_root_children:
                children = {**children, **{k: v for k, v in extra_root_children.items() if k not in children}}
            for ref in node.children:
                child = children.get(ref.local_name)
                if child is not None:
                    if ref.node_id not in self.bound:
                        queue.append((ref.node_id, child))
                elif ref.node_id not in self.bound:
                    deferrals.append(self._defer_child(obj, ref.local_name, ref.node_id))
        # every bound optimizer: a variable bound now may have slots of an optimizer bound earlier
        optimizers = [(i, self.bound[i]) for i, n in enumerate(self.proto.nodes)
                      if n.slot_variables and not self.skip_slots and i in self.bound
                      and slot_variables_of(self.bound[i]) is not None]
        for node_id, optimizer in optimizers:
            for slot_ref in self.proto.nodes[node_id].slot_variables:
                variable = self.bound.get(slot_ref.original_variable_node_id)
                if variable is None or slot_ref.slot_variable_node_id in self.bound \
                        or slot_ref.slot_variable_node_id in self.deferred:
                    continue
                slot = optimizer.get_slot(variable, slot_ref.slot_name)  # type: ignore[attr-defined]
                if slot is not None:
                    self._collect(slot_ref.slot_variable_node_id, slot, reads, registered, deferrals, None)
                elif hasattr(optimizer, "_defer_slot_restore"):
                    deferrals.append(self._defer_slot(optimizer, variable, slot_ref.slot_name,
                                                      slot_ref.slot_variable_node_id))

    def _defer_child(self, parent: Trackable, name: str, node_id: int) -> Callable[[], None]:
        def register() -> None:
            self.deferred.add(node_id)
            parent._defer_child_restore(name, self._deferred_restore(node_id))
        return register

    def _defer_slot(self, optimizer: Any, variable: Trackable, slot_name: str, node_id: int) -> Callable[[], None]:
        def register() -> None:
            self.deferred.add(node_id)
            optimizer._defer_slot_restore(variable, slot_name, self._deferred_restore(node_id))
        return register

    def _deferred_restore(self, node_id: int) -> Callable[[Trackable], None]:
        def restore(obj: Trackable) -> None:  # holds the session, as TF's deferred positions do
            if node_id not in self.bound:
                self.restore(node_id, obj)

        return restore

    def _check(self, reads: List[_Read]) -> None:
        for read in reads:
            if read.key not in self.reader:
                raise NotFoundError("the object graph refers to a value that is not in the checkpoint",
                                    path=self.reader.prefix, key=read.key)
            stored_dtype = self.reader.dtype(read.key)
            stored_shape = self.reader.shape(read.key)
            target_dtype = as_dtype(read.target.dtype)
            if stored_dtype.enum != target_dtype.enum:
                raise InvalidArgumentError(f"dtype mismatch: the checkpoint holds {stored_dtype.name}, the object "
                                           f"({_describe(read.obj)}) has {target_dtype.name}",
                                           path=self.reader.prefix, key=read.key)
            if tuple(stored_shape) != tuple(read.target.shape):
                raise InvalidArgumentError(f"shape mismatch: the checkpoint holds {list(stored_shape)}, the object "
                                           f"({_describe(read.obj)}) has {list(read.target.shape)}",
                                           path=self.reader.prefix, key=read.key)

    # -- reporting ---------------------------------------------------------------
    def value_nodes(self) -> List[int]:
        return [i for i, n in enumerate(self.proto.nodes)
                if n.attributes and not (self.skip_slots and i in self.slot_nodes)]

    def unmatched_keys(self) -> List[str]:
        out = []
        for i in self.value_nodes():
            for attribute in self.proto.nodes[i].attributes:
                if attribute.checkpoint_key not in self.restored_keys:
                    out.append(attribute.checkpoint_key)
        return out


def _describe(obj: Trackable) -> str:
    return repr(obj) if isinstance(obj, Variable) else type(obj).__name__


def _unrestored_live_values(root: Trackable, extra: Optional[Dict[str, Trackable]],
                            restored: Set[int], skip_slots: bool = False) -> List[str]:
    graph = build_graph(root, extra)
    skipped: Set[int] = set()
    if skip_slots:
        skipped = {graph.objects[ref.slot_variable_node_id]._identity()
                   for node in graph.proto.nodes for ref in node.slot_variables}
    return [t.key for t in graph.tensors if t.obj._identity() not in restored | skipped]


class LoadStatus(abc.ABC):
    """Base of the statuses ``Checkpoint.restore`` returns (TensorFlow's ``_LoadStatus``).

    Values are restored eagerly, so ``run_restore_ops`` and ``initialize_or_restore``
    have nothing left to run; ``expect_partial`` silences the warning about values
    left unrestored.
    """

    @abc.abstractmethod
    def assert_consumed(self) -> "LoadStatus":
        """Raise ``AssertionError`` unless everything in the checkpoint and every object matched."""

    @abc.abstractmethod
    def assert_existing_objects_matched(self) -> "LoadStatus":
        """Raise ``AssertionError`` unless every object that exists now got its value."""

    @abc.abstractmethod
    def assert_nontrivial_match(self) -> "LoadStatus":
        """Raise ``AssertionError`` if nothing besides the root matched."""

    def run_restore_ops(self, session: Any = None) -> None:  # noqa: B027 - a no-op default, as TF eager
        """Values are restored eagerly; nothing to run (``session`` is accepted for TF's signature)."""

    def initialize_or_restore(self, session: Any = None) -> None:  # noqa: B027 - a no-op default
        """Values are restored (or left as initialized) eagerly; nothing to run."""

    def expect_partial(self) -> "LoadStatus":
        """Silence warnings about values of the checkpoint left unrestored."""
        return self


class CheckpointLoadStatus(LoadStatus):
    """What ``Checkpoint.restore`` returns: how well the checkpoint and the objects matched."""

    def __init__(self, session: RestoreSession, root: Trackable,
                 extra_root_children: Optional[Dict[str, Trackable]], ignore_live: Set[int]) -> None:
        self._session = session
        self._root = root
        self._extra = extra_root_children
        self._ignore_live = ignore_live

    def assert_consumed(self) -> "CheckpointLoadStatus":
        """Every value in the checkpoint was restored, and every object got a value."""
        unmatched = self._session.unmatched_keys()
        if unmatched:
            raise AssertionError(f"{len(unmatched)} value(s) in checkpoint {self._session.reader.prefix} were not "
                                 f"restored (no matching object): {_some(unmatched)}")
        self.assert_existing_objects_matched()
        return self

    def assert_existing_objects_matched(self) -> "CheckpointLoadStatus":
        """Every object that exists now got its value from the checkpoint."""
        missing = [k for k in _unrestored_live_values(self._root, self._extra,
                                                      self._session.restored_objects | self._ignore_live,
                                                      self._session.skip_slots)]
        if missing:
            raise AssertionError(f"{len(missing)} object value(s) were not found in checkpoint "
                                 f"{self._session.reader.prefix}: {_some(missing)}")
        return self

    def assert_nontrivial_match(self) -> "CheckpointLoadStatus":
        """Something besides the root matched."""
        if len(self._session.bound) <= 1 and not self._session.restored_keys:
            raise AssertionError(f"nothing in checkpoint {self._session.reader.prefix} matched the objects")
        return self

    def expect_partial(self) -> "CheckpointLoadStatus":
        """Silence the warning about values left unrestored."""
        self._session.expect_partial = True
        return self


def _some(keys: List[str], n: int = 5) -> str:
    shown = ", ".join(repr(k) for k in keys[:n])
    return shown + (f" and {len(keys) - n} more" if len(keys) > n else "")


class NameBasedSaverStatus(LoadStatus):
    """Status of restoring a name-based (TF1 ``Saver``) checkpoint: variables matched by name."""

    def __init__(self, reader: BundleReader, root: Trackable, extra: Optional[Dict[str, Trackable]],
                 optional: Optional[Set[int]] = None) -> None:
        self._reader = reader
        optional = optional or set()
        variables = [obj for obj, _ in walk(root, extra) if isinstance(obj, Variable)]
        self._matched: List[Variable] = []
        self._missing: List[str] = []
        reads = []
        for var in variables:
            name = var.name[:-2] if var.name.endswith(":0") else var.name
            if name in reader and not name.startswith("_"):
                reads.append((var, name))
            elif var._identity() not in optional:
                self._missing.append(name)
        for var, name in reads:  # check all, then read
            stored_dtype, stored_shape = reader.dtype(name), reader.shape(name)
            if stored_dtype.enum != var.dtype.enum or tuple(stored_shape) != var.shape:
                raise InvalidArgumentError(f"variable {var.name!r} has {var.dtype.name}{list(var.shape)}, the "
                                           f"checkpoint holds {stored_dtype.name}{list(stored_shape)}",
                                           path=reader.prefix, key=name)
        read_values(reader, [(name, var._peek()) for var, name in reads])
        for var, _ in reads:
            var.mark_changed()
            self._matched.append(var)

    def assert_consumed(self) -> "NameBasedSaverStatus":
        """Every variable found its value by name (as TF, values nobody asked for are allowed)."""
        return self.assert_existing_objects_matched()

    def assert_existing_objects_matched(self) -> "NameBasedSaverStatus":
        """Every variable found a value by its name."""
        if self._missing:
            raise AssertionError(f"variables not found by name in checkpoint {self._reader.prefix}: "
                                 f"{_some(self._missing)}")
        return self

    def assert_nontrivial_match(self) -> "NameBasedSaverStatus":
        """At least one variable matched by name."""
        if not self._matched:
            raise AssertionError(f"no variable matched by name in checkpoint {self._reader.prefix}")
        return self


_NOTHING = "No checkpoint specified (save_path=None); nothing is being restored."


class InitializationOnlyStatus(LoadStatus):
    """Status of ``restore(None)``: nothing was restored; the asserts and ``run_restore_ops`` fail (as TF)."""

    def assert_consumed(self) -> "InitializationOnlyStatus":
        """Always fails: nothing is being restored."""
        raise AssertionError(_NOTHING)

    def assert_existing_objects_matched(self) -> "InitializationOnlyStatus":
        """Always fails: nothing is being restored."""
        raise AssertionError(_NOTHING)

    def assert_nontrivial_match(self) -> "InitializationOnlyStatus":
        """Always fails: nothing is being restored."""
        raise AssertionError(_NOTHING)

    def run_restore_ops(self, session: Any = None) -> None:
        """Always fails: there are no restore ops (use ``initialize_or_restore``)."""
        raise AssertionError("No checkpoint specified, so no restore ops are available "
                             "(save_path=None to Saver.restore).")
