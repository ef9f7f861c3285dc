"""The object graph: walking trackables breadth-first, naming them, serializing the graph.

Node 0 is the root; nodes are numbered breadth-first, children in the order
their parent lists them; an object reachable several ways is one node, named by
its first (shortest) path. Slot variables come after all ordinary nodes, per
optimizer, grouped by slot name. Keys are ``<escaped path>/.ATTRIBUTES/<name>``
with each path element escaped (``.`` -> ``..``, ``/`` -> ``.S``), exactly as
TensorFlow names them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..format.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from .registration import saver_for
from .trackable import Trackable

__all__ = ["escape", "attribute_key", "slot_path", "walk", "build_graph", "SaveableGraph", "SavedTensor",
           "OBJECT_GRAPH_KEY", "ATTRIBUTES", "OPTIMIZER_SLOT"]

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
ATTRIBUTES = ".ATTRIBUTES"
OPTIMIZER_SLOT = ".OPTIMIZER_SLOT"


def escape(name: str) -> str:
    """Escape one path element: ``.`` -> ``..`` then ``/`` -> ``.S``."""
    return name.replace(".", "..").replace("/", ".S")


def join_path(names: Sequence[str]) -> str:
    return "/".join(escape(n) for n in names)


def attribute_key(path: str, attribute: str) -> str:
    """``<path>/.ATTRIBUTES/<attribute>``; ``path`` is already escaped and joined."""
    return f"{path}/{ATTRIBUTES}/{escape(attribute)}"


def slot_path(variable_path: str, optimizer_path: str, slot_name: str) -> str:
    return f"{variable_path}/{OPTIMIZER_SLOT}/{optimizer_path}/{escape(slot_name)}"


def _children(obj: Trackable, extra: Optional[Dict[str, Trackable]]) -> Dict[str, Trackable]:
    children = obj._trackable_children()
    if extra:
        children = dict(children)
        for name, child in extra.items():
            children.setdefault(name, child)
    return children


def walk(root: Trackable, extra_root_children: Optional[Dict[str, Trackable]] = None
         ) -> Iterator[Tuple[Trackable, List[str]]]:
    """Every object reachable from ``root``, breadth-first, once each, with its path."""
    seen = {root._identity()}
    queue: "deque[Tuple[Trackable, List[str]]]" = deque([(root, [])])
    first = True
    while queue:
        obj, path = queue.popleft()
        yield obj, path
        for name, child in _children(obj, extra_root_children if first else None).items():
            if child._identity() not in seen:
                seen.add(child._identity())
                queue.append((child, path + [name]))
        first = False


def slot_variables_of(obj: Trackable) -> Optional[Any]:
    """The optimizer protocol: ``get_slot_names()`` and ``get_slot(variable, name)``."""
    if hasattr(obj, "get_slot_names") and hasattr(obj, "get_slot"):
        return obj
    return None


@dataclass
class SavedTensor:
    """One value to save: its key, the live array, and the object it belongs to."""

    key: str
    value: np.ndarray
    obj: Trackable
    attribute: str


@dataclass
class SaveableGraph:
    """The serialized object graph and the values to save, in TF's order."""

    proto: TrackableObjectGraph
    objects: List[Trackable]
    paths: List[str]
    tensors: List[SavedTensor] = field(default_factory=list)
    #: registered saver name -> {object path: object}
    registered: Dict[str, Dict[str, Trackable]] = field(default_factory=dict)


def build_graph(root: Trackable, extra_root_children: Optional[Dict[str, Trackable]] = None) -> SaveableGraph:
    """Number the objects, name their values, and build the ``TrackableObjectGraph``."""
    objects: List[Trackable] = []
    paths: List[str] = []
    ids: Dict[int, int] = {}
    for obj, path in walk(root, extra_root_children):
        ids[obj._identity()] = len(objects)
        objects.append(obj)
        paths.append(join_path(path))
    proto = TrackableObjectGraph()
    graph = SaveableGraph(proto, objects, paths)
    for node_id, obj in enumerate(objects):
        node = proto.nodes.add()
        for name, child in _children(obj, extra_root_children if node_id == 0 else None).items():
            ref = node.children.add()
            ref.node_id = ids[child._identity()]
            ref.local_name = name
        saver = saver_for(obj)
        if saver is not None and node_id != 0:
            node.registered_saver.name = saver.name
            node.registered_saver.object_name = paths[node_id]
            graph.registered.setdefault(saver.name, {})[paths[node_id]] = obj
            continue
        _add_attributes(graph, node, obj, paths[node_id])
    # Slot variables, after every ordinary node: per optimizer, per slot name, per variable.
    non_slot = list(objects)
    for opt_id, obj in enumerate(non_slot):
        optimizer = slot_variables_of(obj)
        if optimizer is None:
            continue
        for slot_name in optimizer.get_slot_names():
            for var_id, variable in enumerate(non_slot):
                slot = optimizer.get_slot(variable, slot_name)
                if slot is None:
                    continue
                slot_ref = proto.nodes[opt_id].slot_variables.add()
                slot_ref.original_variable_node_id = var_id
                slot_ref.slot_name = slot_name
                if slot._identity() in ids:
                    slot_ref.slot_variable_node_id = ids[slot._identity()]
                    continue
                slot_ref.slot_variable_node_id = len(objects)
                ids[slot._identity()] = len(objects)
                objects.append(slot)
                key_path = slot_path(paths[var_id], paths[opt_id], slot_name)
                paths.append(key_path)
                _add_attributes(graph, proto.nodes.add(), slot, key_path)
    _mark_values(proto)
    return graph


def _add_attributes(graph: SaveableGraph, node: Any, obj: Trackable, path: str) -> None:
    for attribute, value in obj._serialize_to_tensors().items():
        key = attribute_key(path, attribute)
        tensor = node.attributes.add()
        tensor.name = attribute
        tensor.full_name = obj._full_name(attribute)
        tensor.checkpoint_key = key
        graph.tensors.append(SavedTensor(key, value, obj, attribute))


def _mark_values(proto: TrackableObjectGraph) -> None:
    """``has_checkpoint_values``: nodes owning values, and all their ancestors."""
    has = [bool(n.attributes) or bool(n.slot_variables) or n.HasField("registered_saver") for n in proto.nodes]
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(proto.nodes):
            if not has[i] and any(has[c.node_id] for c in node.children):
                has[i] = True
                changed = True
    for node, value in zip(proto.nodes, has):
        node.has_checkpoint_values.value = value
