"""Pytree paths as checkpoint keys, leaf kinds, and the saved structure.

A leaf's checkpoint key is its pytree path, each element written as text and
escaped as object-graph names are (``.`` -> ``..``, ``/`` -> ``.S``), joined by
``/``: ``{"params": {"dense": {"kernel": w}}}`` puts ``w`` under
``params/dense/kernel``; list and tuple entries are their indices, attributes of
registered classes (dataclasses, NamedTuples such as optax's states) their names.
A pytree that is a single leaf is saved under :data:`ROOT_KEY`.

Besides the values, a save writes one scalar string tensor, :data:`METADATA_KEY`,
holding JSON (never pickle)::

    {"format": "shardckpt.jax.pytree", "version": 1,
     "kinds": {key: "jax" | "numpy" | "int" | "float" | "bool" | "str" | "bytes"},
     "tree": <structure>, ...front-door fields (e.g. "save_counter")}

``<structure>`` is ``null`` (``None``), ``{"leaf": key}``, ``{"dict": [[k, s], ...]}``
(keys are strings or integers), ``{"list": [s, ...]}``, ``{"tuple": [s, ...]}`` or
``{"node": type name, "children": [[name, s], ...]}`` for any other registered
node. It lets a checkpoint be restored without a target (as NumPy values, custom
nodes as dicts) and keeps ``None`` and empty containers.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Sequence, Tuple

import jax
import numpy as np

from ..checkpoint.graph import escape
from ..errors import InvalidArgumentError

__all__ = ["METADATA_KEY", "ROOT_KEY", "FORMAT", "key_of", "leaves_with_keys", "leaf_kind", "describe",
           "rebuild", "encode_metadata", "decode_metadata"]

METADATA_KEY = "_SHARDCKPT_PYTREE"
ROOT_KEY = "root"
FORMAT = "shardckpt.jax.pytree"
VERSION = 1

_SCALAR_KINDS = ("bool", "int", "float", "str", "bytes")


def _element(entry: Any) -> str:
    """One path element as text."""
    tu = jax.tree_util
    if isinstance(entry, tu.DictKey):
        return str(entry.key)
    if isinstance(entry, tu.SequenceKey):
        return str(entry.idx)
    if isinstance(entry, tu.GetAttrKey):
        return str(entry.name)
    if isinstance(entry, tu.FlattenedIndexKey):
        return str(entry.key)
    return str(entry)  # pragma: no cover - a key type added by a later JAX


def key_of(path: Sequence[Any]) -> str:
    """The checkpoint key of a leaf at ``path`` (a sequence of JAX key entries)."""
    if not path:
        return ROOT_KEY
    return "/".join(escape(_element(e)) for e in path)


def leaves_with_keys(tree: Any) -> List[Tuple[str, Any]]:
    """``(key, leaf)`` for every leaf of ``tree`` in JAX's flattening order; two leaves with one key are an error."""
    out: List[Tuple[str, Any]] = []
    seen: Dict[str, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = key_of(path)
        where = jax.tree_util.keystr(path)
        if key in seen:
            raise InvalidArgumentError(f"pytree paths {seen[key]} and {where} both become checkpoint key {key!r}")
        if key == METADATA_KEY:
            raise InvalidArgumentError(f"pytree path {where} becomes the reserved key {METADATA_KEY!r}")
        seen[key] = where
        out.append((key, leaf))
    return out


def leaf_kind(key: str, leaf: Any) -> str:
    """What a leaf is: ``"jax"`` (a jax.Array), ``"numpy"`` or a Python scalar kind; else an error naming ``key``."""
    if isinstance(leaf, jax.Array):
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    if isinstance(leaf, bool):
        return "bool"
    if isinstance(leaf, int):
        return "int"
    if isinstance(leaf, float):
        return "float"
    if isinstance(leaf, str):
        return "str"
    if isinstance(leaf, bytes):
        return "bytes"
    raise InvalidArgumentError(f"cannot save a leaf of type {type(leaf).__name__} (jax.Array, NumPy arrays, "
                               "bool, int, float, str and bytes can be saved)", key=key)


def host_value(key: str, kind: str, leaf: Any) -> np.ndarray:
    """A non-jax leaf as the array stored for it."""
    if kind == "numpy":
        return np.asarray(leaf)
    if kind == "bool":
        return np.asarray(leaf, dtype=np.bool_)
    if kind == "int":
        if not -(2**63) <= leaf < 2**63:
            raise InvalidArgumentError(f"int {leaf} does not fit int64", key=key)
        return np.asarray(leaf, dtype=np.int64)
    if kind == "float":
        return np.asarray(leaf, dtype=np.float64)
    data = leaf.encode("utf-8") if kind == "str" else bytes(leaf)
    out = np.empty((), dtype=object)
    out[()] = data
    return out


def python_value(key: str, kind: str, array: np.ndarray) -> Any:
    """The Python value of a stored scalar of ``kind``."""
    if array.shape != ():
        raise InvalidArgumentError(f"a {kind} leaf needs a scalar, the checkpoint holds shape {list(array.shape)}",
                                   key=key)
    item = array.item()
    if kind == "bool":
        return bool(item)
    if kind == "int":
        return int(item)
    if kind == "float":
        return float(item)
    if isinstance(item, bytes):
        return item.decode("utf-8") if kind == "str" else item
    raise InvalidArgumentError(f"a {kind} leaf needs a string tensor, the checkpoint holds {array.dtype}", key=key)


def _children(node: Any) -> List[Tuple[Any, Any]]:
    """``(key entry, child)`` one level down (``[]`` for a leaf, ``None`` children kept)."""
    flat = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)[0]
    return [(path[0], child) for path, child in flat if path]


def describe(tree: Any, prefix: Tuple[Any, ...] = ()) -> Any:
    """The JSON structure of ``tree`` (see the module docstring)."""
    if tree is None:
        return None
    treedef: Any = jax.tree_util.tree_structure(tree)
    if treedef.num_nodes == 1 and treedef.num_leaves == 1:
        return {"leaf": key_of(prefix)}
    children = _children(tree)
    if isinstance(tree, dict):
        return {"dict": [[_json_key(e.key), describe(c, prefix + (e,))] for e, c in children]}
    if isinstance(tree, list):
        return {"list": [describe(c, prefix + (e,)) for e, c in children]}
    if type(tree) is tuple:
        return {"tuple": [describe(c, prefix + (e,)) for e, c in children]}
    return {"node": type(tree).__name__, "children": [[_element(e), describe(c, prefix + (e,))] for e, c in children]}


def _json_key(key: Any) -> Any:
    if isinstance(key, (str, int)) and not isinstance(key, bool):
        return key
    return str(key)


def rebuild(structure: Any, value_of: Any) -> Any:
    """The pytree of ``structure`` with each leaf ``value_of(key)``."""
    if structure is None:
        return None
    if "leaf" in structure:
        return value_of(structure["leaf"])
    if "dict" in structure:
        return {k: rebuild(s, value_of) for k, s in structure["dict"]}
    if "list" in structure:
        return [rebuild(s, value_of) for s in structure["list"]]
    if "tuple" in structure:
        return tuple(rebuild(s, value_of) for s in structure["tuple"])
    return {name: rebuild(s, value_of) for name, s in structure["children"]}


def encode_metadata(tree: Any, kinds: Dict[str, str], extra: Optional[Dict[str, Any]] = None) -> np.ndarray:
    """The metadata tensor of a save of ``tree``."""
    doc: Dict[str, Any] = {"format": FORMAT, "version": VERSION, "kinds": kinds, "tree": describe(tree)}
    doc.update(extra or {})
    out = np.empty((), dtype=object)
    out[()] = json.dumps(doc, separators=(",", ":")).encode("utf-8")
    return out


def decode_metadata(raw: np.ndarray, prefix: str) -> Dict[str, Any]:
    """Parse the metadata tensor; damage is an error naming the checkpoint."""
    try:
        doc = json.loads(raw.item())
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("kinds"), dict):
            raise ValueError("not a shardckpt pytree description")
        if int(doc.get("version", 0)) > VERSION:
            raise ValueError(f"version {doc['version']} is newer than this shardckpt reads ({VERSION})")
    except Exception as exc:
        raise InvalidArgumentError(f"unreadable pytree metadata ({exc})", path=prefix, key=METADATA_KEY) from None
    return doc
