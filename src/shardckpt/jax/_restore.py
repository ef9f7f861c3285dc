"""``restore``: a checkpoint read onto a target pytree's shardings, reading only the needed bytes.

The target decides everything about the result: its structure, and for each leaf
what comes back. A ``jax.Array`` or ``jax.ShapeDtypeStruct(shape, dtype,
sharding=...)`` leaf comes back as a new ``jax.Array`` with exactly that sharding
(a struct without one: on this process's first device), built with
``jax.make_array_from_callback``; a NumPy leaf as a NumPy array; a ``bool``,
``int``, ``float``, ``str`` or ``bytes`` leaf as a value of that type. ``None`` and
empty containers stay as they are; a target holding a sub-tree of what was saved
restores just that sub-tree.

Steps, as one streaming plan of the restore engine (:mod:`shardckpt.restoring`):

1. Every leaf's checkpoint key is found (its path key, through ``key_map`` when
   given; a key written by ``Checkpoint``/``DTensorCheckpoint``'s object graph,
   ``<key>/.ATTRIBUTES/VARIABLE_VALUE``, is found too) and its stored dtype and
   shape are checked against the target's, for every leaf before anything is read.
   On object stores every read below is then announced (the engine's first step:
   few large GETs, fetched ahead within the store's read budget).
2. Scalars and NumPy leaves are read whole.
3. For each array leaf, this process's distinct regions (each region of the
   target sharding's addressable devices, once however many local devices
   replicate it) are read by the engine's threads, straight from the overlapping
   stored bytes, into 64-byte aligned buffers (a stored piece that the leaf's regions
   cut across, as a resharded restore's columns cut row blocks, is read once, whole
   and checksummed, and cut into them). Leaves are read ahead in order
   while the host bytes in flight stay within ``memory_budget`` (a leaf larger
   than the budget is read alone); each leaf's array is made as soon as its
   regions are in, and its host buffers are dropped.

Nothing is written; a failed restore returns nothing and leaves the target alone.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import jax
import numpy as np

from ..checkpoint.reader import open_bundle
from ..errors import InvalidArgumentError, NotFoundError, ShardckptError
from ..format.bundle_reader import BundleReader
from ..format.dtypes import as_dtype
from ..restoring import BundleSource, PieceSource, Read, ReadGroup, RestorePlan, run
from ..storage.base import FileSystem
from ._tree import METADATA_KEY, decode_metadata, leaves_with_keys, python_value, rebuild
from ._values import array_reads

__all__ = ["restore", "DEFAULT_MEMORY_BUDGET"]

DEFAULT_MEMORY_BUDGET = 1 << 30  # host bytes read ahead of the array being made
_OBJECT_GRAPH_SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"

KeyMap = Union[None, Mapping[str, str], Callable[[str], str]]


def _checkpoint_key(reader: BundleReader, key: str, key_map: KeyMap) -> str:
    if key_map is None:
        mapped = key
    elif callable(key_map):
        mapped = key_map(key)
    else:
        mapped = key_map.get(key, key)
    if mapped in reader:
        return mapped
    if mapped + _OBJECT_GRAPH_SUFFIX in reader:
        return mapped + _OBJECT_GRAPH_SUFFIX
    via = f" (mapped to {mapped!r})" if mapped != key else ""
    raise NotFoundError(f"the target's leaf {key!r}{via} is not in the checkpoint", path=reader.prefix, key=mapped)


def _check(reader: BundleReader, key: str, shape: Tuple[int, ...], dtype: Any) -> None:
    stored_dtype, stored_shape = reader.dtype(key), tuple(reader.shape(key))
    try:
        want = as_dtype(dtype)
    except ShardckptError as exc:  # a target dtype no checkpoint holds (datetime64, float0, ...)
        raise InvalidArgumentError(f"dtype mismatch: the checkpoint holds {stored_dtype.name}; {exc.message}",
                                   path=reader.prefix, key=key) from None
    if stored_dtype.enum != want.enum:
        raise InvalidArgumentError(f"dtype mismatch: the checkpoint holds {stored_dtype.name}, the target has "
                                   f"{want.name}", path=reader.prefix, key=key)
    if stored_shape != tuple(shape):
        raise InvalidArgumentError(f"shape mismatch: the checkpoint holds {list(stored_shape)}, the target has "
                                   f"{list(shape)}", path=reader.prefix, key=key)


_SCALAR_SOURCES = {  # the stored dtypes a Python scalar leaf takes (complex and strings fit no number)
    "bool": lambda dt: dt.name == "bool",
    "int": lambda dt: dt.name == "bool" or dt.name.startswith(("int", "uint", "float", "bfloat")),
    "float": lambda dt: dt.name == "bool" or dt.name.startswith(("int", "uint", "float", "bfloat")),
    "str": lambda dt: dt.is_string,
    "bytes": lambda dt: dt.is_string,
}


def _check_scalar(reader: BundleReader, key: str, kind: str) -> None:
    """A Python scalar leaf of ``kind`` can hold the stored dtype (checked before anything is read)."""
    stored = reader.dtype(key)
    if not _SCALAR_SOURCES[kind](stored):
        raise InvalidArgumentError(f"dtype mismatch: the checkpoint holds {stored.name}, the target is a Python "
                                   f"{kind}", path=reader.prefix, key=key)


def _scalar_value(reader: BundleReader, key: str, kind: str, array: np.ndarray) -> Any:
    """The stored scalar as the leaf's Python type; a float with a fraction never becomes an int."""
    if kind == "int" and array.shape == () and array.dtype.kind not in "biu" and not float(array).is_integer():
        raise InvalidArgumentError(f"the checkpoint holds {array.item()!r}, which a Python int target cannot hold "
                                   "exactly", path=reader.prefix, key=key)
    try:
        return python_value(key, kind, array)
    except InvalidArgumentError as exc:  # name the checkpoint too
        raise InvalidArgumentError(exc.message, path=reader.prefix, key=key) from None


def _kind_of_target(leaf: Any) -> str:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)):
        return "jax"
    if isinstance(leaf, (np.ndarray, np.generic)):
        return "numpy"
    for kind, types in (("bool", bool), ("int", int), ("float", float), ("str", str), ("bytes", bytes)):
        if isinstance(leaf, types):
            return kind
    raise InvalidArgumentError(f"cannot restore into a target leaf of type {type(leaf).__name__} (jax.Array, "
                               "jax.ShapeDtypeStruct, NumPy arrays, bool, int, float, str, bytes)")


def restore(path: "str | os.PathLike[str]", target: Any = None, *, key_map: KeyMap = None,
            memory_budget: int = DEFAULT_MEMORY_BUDGET, max_workers: Optional[int] = None,
            fs: Optional[FileSystem] = None) -> Any:
    """Read the checkpoint at ``path`` (a prefix, or a folder with a ``checkpoint`` file) onto ``target``.

    See the module docstring. ``key_map`` maps a leaf's path key (``params/dense/kernel``) to
    the checkpoint's key (a mapping, or a function), for checkpoints written under other
    names (TensorFlow, ``Checkpoint``). Without a ``target``, a checkpoint saved by
    :func:`~shardckpt.jax.save` comes back in its saved structure with NumPy arrays
    (registered pytree nodes as dicts). ``memory_budget`` bounds the host bytes read
    ahead; ``max_workers`` the reading threads; ``fs`` the store (default: from the path).
    """
    if int(memory_budget) <= 0:
        raise InvalidArgumentError(f"memory_budget must be positive, got {memory_budget!r}")
    with open_bundle(os.fspath(path), fs=fs) as reader:
        if target is None:
            return _restore_saved_structure(reader)
        return _restore_onto(reader, target, key_map, int(memory_budget), max_workers)


def _restore_saved_structure(reader: BundleReader) -> Any:
    if METADATA_KEY not in reader:
        raise InvalidArgumentError("the checkpoint was not saved by shardckpt.jax.save: pass a target pytree "
                                   "(and a key_map for other names)", path=reader.prefix)
    meta = decode_metadata(reader.read(METADATA_KEY), reader.prefix)
    kinds: Dict[str, str] = meta["kinds"]
    keys: List[str] = []
    rebuild(meta["tree"], keys.append)  # the keys the structure names, in order
    for key in keys:
        if key not in reader:
            raise NotFoundError("the saved structure names a value that is not in the checkpoint",
                                path=reader.prefix, key=key)
    arrays = dict(zip(keys, run(RestorePlan.of(BundleSource(reader, owned=False), [Read(k) for k in keys]))))

    def value_of(key: str) -> Any:
        array = arrays[key]
        kind = kinds.get(key, "numpy")
        return array if kind in ("jax", "numpy") else python_value(key, kind, array)

    return rebuild(meta["tree"], value_of)


def _restore_onto(reader: BundleReader, target: Any, key_map: KeyMap, budget: int,
                  max_workers: Optional[int]) -> Any:
    return restore_through(BundleSource(reader, owned=False), reader, target, key_map, budget, max_workers)()


def restore_through(source: PieceSource, reader: BundleReader, target: Any, key_map: KeyMap,
                    budget: int = DEFAULT_MEMORY_BUDGET, max_workers: Optional[int] = None) -> Callable[[], Any]:
    """Read ``target``'s leaves through ``source`` (the engine's source over ``reader``, whose index the
    plan reads); returns what builds the restored pytree once the reads are in: at once for a file's
    source, when the restore call ends for a collective one (``collective_call``: a peer's replica)."""
    leaves = leaves_with_keys(target)
    treedef = jax.tree_util.tree_structure(target)
    values: List[Any] = [None] * len(leaves)
    small: List[ReadGroup] = []
    arrays: List[ReadGroup] = []
    for i, (path_key, leaf) in enumerate(leaves):  # 1. find and check everything first
        kind = _kind_of_target(leaf)
        key = _checkpoint_key(reader, path_key, key_map)
        if kind == "jax":
            shape = tuple(int(d) for d in leaf.shape)
            _check(reader, key, shape, leaf.dtype)
            sharding = getattr(leaf, "sharding", None)
            if sharding is None:
                sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
            arrays.append(array_reads(key, shape, leaf.dtype, sharding, _setter(values, i)))
        elif kind == "numpy":
            _check(reader, key, tuple(np.shape(leaf)), np.asarray(leaf).dtype)
            small.append(ReadGroup((Read(key),), _setter(values, i, lambda got: got[0])))
        else:
            _check_scalar(reader, key, kind)
            small.append(ReadGroup((Read(key),), _setter(values, i, _scalar_of(reader, key, kind))))
    # 2. the small ones, then 3. the arrays, read ahead within the budget, each made as soon as its regions are in
    workers = max_workers or max(2, min(16, 2 * (os.cpu_count() or 1)))
    run(RestorePlan.of(source, small + arrays, workers=workers, budget=budget, defer=False))
    return lambda: jax.tree_util.tree_unflatten(treedef, values)


def _setter(values: List[Any], i: int, convert: Callable[[Any], Any] = lambda value: value) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        values[i] = convert(value)
    return put


def _scalar_of(reader: BundleReader, key: str, kind: str) -> Callable[[List[np.ndarray]], Any]:
    return lambda got: _scalar_value(reader, key, kind, got[0])
