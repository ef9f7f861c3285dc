"""Trackable objects: what the object graph is made of.

* :class:`Trackable` — the base: named children, named attribute values, and a
  place for restorations waiting for a child that does not exist yet.
* :class:`Variable` — a NumPy array with a name, restored in place; number-like as
  ``tf.Variable`` (``int(v)``, ``v + 1``, comparisons: NumPy values).
* :class:`AutoTrackable` — tracks trackable attributes in assignment order; lists, tuples
  and dicts assigned to it are tracked too (lists and dicts become
  :class:`TrackedList` / :class:`TrackedDict`, which notice later additions).
  ``Checkpoint`` is one, as in TensorFlow.
* :class:`Module` — an ``AutoTrackable`` with ``tf.Module``'s surface: ``name``,
  ``name_scope``, ``variables``, ``trainable_variables``, ``non_trainable_variables``,
  ``submodules`` (TF's order: attributes sorted by name, a module's own leaves before
  its submodules').
* Plain NumPy arrays reachable from a module or checkpoint are saved like
  variables and restored in place (:class:`ArrayRef`).
"""

from __future__ import annotations

import itertools
import os
import re
import threading
import uuid
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from ..format.dtypes import DType, as_dtype
from .convert import convert_python_value

__all__ = ["Trackable", "Variable", "AutoTrackable", "Module", "TrackedList", "TrackedDict", "ArrayRef",
           "as_trackable", "VARIABLE_VALUE"]

VARIABLE_VALUE = "VARIABLE_VALUE"

# Variables' change stamps: a new one at every write, unique within this process (copies of a
# variable share a stamp only while they share the bytes), never equal to another process's (a
# forked child draws a new process id).
_PROCESS = uuid.uuid4().hex[:16]
_STAMPS = itertools.count()


def _new_process_id() -> None:
    global _PROCESS
    _PROCESS = uuid.uuid4().hex[:16]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_new_process_id)


def _stamp() -> str:
    return f"{_PROCESS}:{next(_STAMPS)}"

# A restoration waiting for a child: called with the child once it is attached.
PendingRestore = Callable[["Trackable"], None]


class Trackable:
    """Base of everything the object graph can hold."""

    def _trackable_children(self) -> Dict[str, "Trackable"]:
        """Named children, in a stable order."""
        return {}

    def _serialize_to_tensors(self) -> Dict[str, np.ndarray]:
        """Attribute name -> value to save (the live array: the writer reads it directly)."""
        return {}

    def _full_name(self, attribute: str) -> str:
        """The ``full_name`` recorded for an attribute (TF: the variable's name)."""
        return ""

    def _restore_targets(self) -> Dict[str, np.ndarray]:
        """Attribute name -> array to read into (same shape and dtype as saved)."""
        return self._serialize_to_tensors()

    def _after_restore(self, attributes: Iterable[str]) -> None:
        """Hook run after attributes were read in place."""

    def _identity(self) -> int:
        """Objects with the same identity are one node of the graph."""
        return id(self)

    # -- deferred restoration ------------------------------------------------
    def _pending_restores(self) -> Dict[str, List[PendingRestore]]:
        pending = self.__dict__.get("_shardckpt_pending")
        if pending is None:
            pending = {}
            object.__setattr__(self, "_shardckpt_pending", pending)
        return pending

    def _defer_child_restore(self, name: str, restore: PendingRestore) -> None:
        self._pending_restores().setdefault(name, []).append(restore)

    def _child_attached(self, name: str, value: Any) -> None:
        pending = self.__dict__.get("_shardckpt_pending")
        if not pending or name not in pending:
            return
        child = as_trackable(value)
        if child is None:
            return
        for restore in pending.pop(name):
            restore(child)


class Variable(Trackable):
    """A named NumPy array, saved under ``VARIABLE_VALUE`` and restored in place.

    Mirrors ``tf.Variable``: ``numpy()``, ``value()``, ``read_value()``, ``assign*()``,
    ``shape``, ``dtype``, ``name``, ``trainable``; and it is number-like as TF's is:
    ``int(v)``, ``float(v)``, ``bool(v)``, ``v + 1`` and the other arithmetic,
    bitwise and comparison operators (NumPy values: a NumPy scalar for a scalar
    variable, as TF returns a scalar tensor), ``v[i]`` (a copy), ``np.asarray(v)``.
    Comparisons are elementwise as in TF; unlike TF (which raises), a variable stays
    hashable by identity.

    Without ``dtype``, Python values take TensorFlow's dtypes (``Variable(1.0)`` is
    float32, ``Variable(3)`` int32, ``Variable([1.0, 2.0])`` float32, ``Variable(True)``
    bool, ``Variable("s")`` string; ints outside int32's range make int64), so a
    checkpoint of it restores into the equivalent ``tf.Variable``. NumPy arrays and
    scalars keep their dtype (see :mod:`shardckpt.checkpoint.convert`).

    A version counter goes up at every write through the API (``assign*``, restores,
    :meth:`mark_changed`), and every such write draws a new change stamp. Incremental
    saves (``CheckpointOptions(incremental=True)``) take a variable whose stamp did not
    move since the previous save as unchanged *without hashing its bytes* as long as
    the variable never handed out its live buffer: :attr:`array` and ``np.asarray(var)``
    hand it out, and from then on the variable's bytes are hashed at every incremental
    save (a direct write through a kept reference is then always caught), unless
    ``CheckpointOptions(trust_versions=True)`` says that every direct write is followed
    by :meth:`mark_changed`. Reads that copy (:meth:`numpy`, :meth:`read_value`,
    ``np.array(var)``) hand nothing out.
    """

    _shardckpt_is_variable = True  # what Module.variables collects

    def __init__(self, initial_value: Any, name: Optional[str] = None, dtype: Any = None,
                 trainable: bool = True) -> None:
        value = initial_value() if callable(initial_value) else initial_value
        if dtype is None:
            array = convert_python_value(value)
        else:
            array = np.array(value, dtype=as_dtype(dtype).numpy, copy=True, order="C")
            if array.dtype.kind in "SU":
                array = array.astype(object)
        as_dtype(array.dtype)  # rejects dtypes a checkpoint cannot hold
        self._value = array
        self._name = _scoped(name or "Variable")
        self.trainable = trainable
        self._version = 0
        self._stamp = _stamp()
        self._handed_out = False  # whether a reference to the live buffer left the variable

    @property
    def name(self) -> str:
        """The variable's name (recorded as ``full_name`` in the checkpoint; TF1 checkpoints match by it)."""
        return self._name

    @property
    def shape(self) -> Tuple[int, ...]:
        """The value's shape."""
        return tuple(self._value.shape)

    @property
    def dtype(self) -> DType:
        """The value's dtype (TensorFlow's names; ``dtype.numpy`` is the NumPy dtype)."""
        return as_dtype(self._value.dtype)

    def numpy(self) -> Any:
        """A copy of the value (as ``tf.Variable.numpy``): an array, or a NumPy scalar (``numpy.int32``;
        ``bytes`` for a string) when the variable is a scalar."""
        return _copy_out(self._value)

    def value(self) -> Any:
        """The current value (a copy, as :meth:`numpy`; TF returns a tensor)."""
        return self.numpy()

    @property
    def array(self) -> np.ndarray:
        """The live array (no copy); restores write into it. Writing into it bypasses the version
        counter: incremental saves hash this variable from now on (see the class docstring)."""
        self._handed_out = True
        return self._value

    def _peek(self) -> np.ndarray:
        """The live array for the library's own reads, and writes followed by :meth:`mark_changed`."""
        return self._value

    def assign(self, value: Any) -> "Variable":
        """Write ``value`` into the variable in place (same shape; cast within its kind)."""
        new = np.asarray(value)
        if new.shape != self._value.shape:
            raise InvalidArgumentError(f"cannot assign a value of shape {list(new.shape)} to variable "
                                       f"{self._name!r} of shape {list(self._value.shape)}")
        np.copyto(self._value, new, casting="same_kind" if self._value.dtype != object else "unsafe")
        self._changed()
        return self

    def _changed(self) -> None:
        self._version += 1
        self._stamp = _stamp()

    def mark_changed(self) -> None:
        """Say that :attr:`array` was written directly (incremental saves trusting versions then save it)."""
        self._changed()

    @property
    def version(self) -> int:
        """How many writes through the API (and :meth:`mark_changed` calls) this variable has seen."""
        return self._version

    def _change_token(self) -> str:
        """Equal at two saves exactly when no API write happened between them (in this process)."""
        return self._stamp

    def _token_proves_unchanged(self) -> bool:
        """Whether an unchanged :meth:`_change_token` alone proves the bytes unchanged: no reference
        to the live buffer was ever handed out, so every write went through the API."""
        return not self._handed_out

    def __copy__(self) -> "Variable":
        """The variable itself, as ``copy.copy`` of a ``tf.Variable`` is: a second object sharing the live
        buffer would write it without moving this one's change stamp (``copy.deepcopy`` copies the value)."""
        return self

    def _after_restore(self, attributes: Iterable[str]) -> None:
        self._changed()
        super()._after_restore(attributes)

    def assign_add(self, delta: Any) -> "Variable":
        """Add ``delta`` in place."""
        return self.assign(self._value + delta)

    def assign_sub(self, delta: Any) -> "Variable":
        """Subtract ``delta`` in place."""
        return self.assign(self._value - delta)

    def read_value(self) -> Any:
        """A copy of the value (as :meth:`numpy`)."""
        return self.numpy()

    # -- number-like, as tf.Variable (the operators are installed below the class) -------------
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        """NumPy's functions read the value without taking the live buffer (``out=`` a variable writes it)."""
        args = [x._value if isinstance(x, Variable) else x for x in inputs]
        outs = kwargs.get("out")
        written = [x for x in (outs or ()) if isinstance(x, Variable)]
        if outs:
            kwargs["out"] = tuple(x._value if isinstance(x, Variable) else x for x in outs)
        result = getattr(ufunc, method)(*args, **kwargs)
        for var in written:
            var._changed()
        return result

    def __bool__(self) -> bool:
        return bool(self._value)

    def __int__(self) -> int:
        return int(self._value)

    def __float__(self) -> float:
        return float(self._value)

    def __complex__(self) -> complex:
        return complex(self._value)

    def __getitem__(self, index: Any) -> Any:
        return _copy_out(self._value[index])

    def __iter__(self) -> Any:
        if self._value.ndim == 0:
            raise TypeError(f"iteration over the scalar variable {self._name!r}")
        return (_copy_out(row) for row in self._value)

    __hash__ = Trackable.__hash__  # identity (TF raises; see the class docstring)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        if dtype is not None:
            return self._value.astype(dtype)
        if copy:
            return self._value.copy()
        self._handed_out = True  # np.asarray(var): the live buffer (see the class docstring)
        return self._value

    def _serialize_to_tensors(self) -> Dict[str, np.ndarray]:
        return {VARIABLE_VALUE: self._value}

    def _full_name(self, attribute: str) -> str:
        return self._name

    def __repr__(self) -> str:
        return f"<shardckpt.Variable {self._name!r} shape={list(self.shape)} dtype={self.dtype.name}>"


def _copy_out(value: Any) -> Any:
    """A copy of an array the caller may keep: 0-d arrays come out as NumPy scalars (``bytes`` for strings)."""
    if isinstance(value, np.ndarray):
        if value.dtype == object:  # strings come out as bytes, as TF's
            items = [x.encode("utf-8") if isinstance(x, str) else x for x in value.flat]
            out = np.empty(len(items), dtype=object)
            out[:] = items
            value = out.reshape(value.shape)
        return value[()] if value.ndim == 0 else value.copy()
    return value.encode("utf-8") if isinstance(value, str) else value


def _binary(ufunc: Any, reflected: bool = False) -> Callable[[Variable, Any], Any]:
    if reflected:
        return lambda self, other: ufunc(other, self._value)
    return lambda self, other: ufunc(self._value, other)


for _name, _ufunc in [("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                      ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power),
                      ("matmul", np.matmul), ("and", np.bitwise_and), ("or", np.bitwise_or),
                      ("xor", np.bitwise_xor), ("lshift", np.left_shift), ("rshift", np.right_shift)]:
    setattr(Variable, f"__{_name}__", _binary(_ufunc))
    setattr(Variable, f"__r{_name}__", _binary(_ufunc, reflected=True))
for _name, _ufunc in [("lt", np.less), ("le", np.less_equal), ("gt", np.greater), ("ge", np.greater_equal),
                      ("eq", np.equal), ("ne", np.not_equal)]:
    setattr(Variable, f"__{_name}__", _binary(_ufunc))
for _name, _ufunc in [("neg", np.negative), ("pos", np.positive), ("abs", np.absolute), ("invert", np.invert)]:
    setattr(Variable, f"__{_name}__", lambda self, _f=_ufunc: _f(self._value))
del _name, _ufunc


class ArrayRef(Trackable):
    """A plain NumPy array in the graph: saved like a variable, restored in place."""

    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def _serialize_to_tensors(self) -> Dict[str, np.ndarray]:
        return {VARIABLE_VALUE: self.array}

    def _restore_targets(self) -> Dict[str, np.ndarray]:
        if not self.array.flags.writeable:
            raise InvalidArgumentError("cannot restore into a read-only array")
        return {VARIABLE_VALUE: self.array}

    def _identity(self) -> int:
        return id(self.array)


class TrackedList(list):
    """A list whose trackable items are children named ``"0"``, ``"1"``, ..."""

    def _trackable_children(self) -> Dict[str, Trackable]:
        return _children_of_items((str(i), v) for i, v in enumerate(self))

    def _node(self) -> "_ContainerNode":
        return _container_node(self)

    def append(self, value: Any) -> None:
        super().append(_wrap(value))
        self._node()._child_attached(str(len(self) - 1), self[-1])

    def extend(self, values: Iterable[Any]) -> None:
        for v in values:
            self.append(v)

    def __iadd__(self, values: Iterable[Any]) -> "TrackedList":  # type: ignore[override,misc]
        self.extend(values)
        return self

    def __repr__(self) -> str:
        return f"ListWrapper({list.__repr__(self)})"  # as TF prints its tracked lists

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, _wrap(value) if not isinstance(index, slice) else [_wrap(v) for v in value])
        if isinstance(index, int):
            self._node()._child_attached(str(index % len(self)), self[index])


class TrackedDict(dict):
    """A dict whose trackable values are children named by their (string) keys."""

    def _trackable_children(self) -> Dict[str, Trackable]:
        for key in self:
            if not isinstance(key, str):
                raise InvalidArgumentError(f"dict keys must be strings to be checkpointed, got {key!r}")
        return _children_of_items(self.items())

    def _node(self) -> "_ContainerNode":
        return _container_node(self)

    def __repr__(self) -> str:
        return f"DictWrapper({dict.__repr__(self)})"  # as TF's repr (its str is the plain dict's)

    def __str__(self) -> str:
        return dict.__repr__(self)

    def __setitem__(self, key: Any, value: Any) -> None:
        super().__setitem__(key, _wrap(value))
        if isinstance(key, str):
            self._node()._child_attached(key, self[key])

    def update(self, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        for key, value in dict(*args, **kwargs).items():
            self[key] = value

    def setdefault(self, key: Any, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]


class _ContainerNode(Trackable):
    """The graph node of a list, tuple or dict (they cannot carry attributes themselves)."""

    def __init__(self, container: Any) -> None:
        self.container = container

    def _trackable_children(self) -> Dict[str, Trackable]:
        if isinstance(self.container, (TrackedList, TrackedDict)):
            return self.container._trackable_children()
        if isinstance(self.container, dict):
            return TrackedDict._trackable_children(self.container)  # type: ignore[arg-type]
        return _children_of_items(_tuple_items(self.container))

    def _identity(self) -> int:
        return id(self.container)


def _tuple_items(container: Any) -> Iterable[Tuple[str, Any]]:
    """A list's or tuple's items named as TF names them: by index; a namedtuple's by field first (the keys),
    then by index too (aliases of the same nodes)."""
    by_index = [(str(i), v) for i, v in enumerate(container)]
    fields = getattr(container, "_fields", None) if isinstance(container, tuple) else None
    if isinstance(fields, tuple) and len(fields) == len(container):
        return list(zip(fields, container)) + by_index
    return by_index


def _container_node(container: Any) -> _ContainerNode:
    """The node of a container; tracked containers keep theirs (pending restores live on it)."""
    if isinstance(container, (TrackedList, TrackedDict)):
        node = container.__dict__.get("_shardckpt_node")
        if node is None:
            node = _ContainerNode(container)
            container.__dict__["_shardckpt_node"] = node
        return node
    return _ContainerNode(container)


def _wrap(value: Any) -> Any:
    """Lists and dicts assigned to modules become tracked containers (as TF wraps them)."""
    if type(value) is list:
        return TrackedList(_wrap(v) for v in value)
    if type(value) is dict:
        out = TrackedDict()
        for k, v in value.items():
            dict.__setitem__(out, k, _wrap(v))
        return out
    return value


def _children_of_items(items: Iterable[Tuple[str, Any]]) -> Dict[str, Trackable]:
    out: Dict[str, Trackable] = {}
    for name, value in items:
        child = as_trackable(value)
        if child is not None:
            out[name] = child
    return out


def as_trackable(value: Any) -> Optional[Trackable]:
    """The graph node for ``value``: itself, a wrapper for arrays and containers, or ``None``."""
    if isinstance(value, Trackable):
        return value
    if isinstance(value, np.ndarray):
        return ArrayRef(value)
    if isinstance(value, (list, tuple, dict)):
        return _container_node(value)
    return None


class AutoTrackable(Trackable):
    """Tracks its trackable attributes as children (TF's ``AutoTrackable``; ``Checkpoint`` is one).

    Children are listed in the order attributes were first assigned. Assigning a
    value to a name that a pending restore is waiting for restores it at once.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        value = _wrap(value)
        object.__setattr__(self, name, value)
        if not name.startswith("_shardckpt") and as_trackable(value) is not None:
            order = self.__dict__.setdefault("_shardckpt_order", [])
            if name not in order:
                order.append(name)
            self._child_attached(name, value)

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        order = self.__dict__.get("_shardckpt_order", [])
        if name in order:
            order.remove(name)

    def _trackable_children(self) -> Dict[str, Trackable]:
        out: Dict[str, Trackable] = {}
        for name in self.__dict__.get("_shardckpt_order", []):
            child = as_trackable(self.__dict__.get(name))
            if child is not None:
                out[name] = child
        return out


# -- name scopes (tf.name_scope, as far as names go: a Module's variables are named "<module>/<name>") --------
_SCOPES = threading.local()
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _current_scope() -> str:
    stack: List[str] = getattr(_SCOPES, "stack", [])
    return stack[-1] if stack else ""


def _scoped(name: str) -> str:
    return _current_scope() + name


class NameScope:
    """A module's name scope (``Module.name_scope``): variables created inside it are named ``<scope>/<name>``.

    ``name`` is the absolute scope (``"outer/my_module/"``); ``with scope as s`` gives it.
    """

    def __init__(self, name: str) -> None:
        self.name = name

    def __enter__(self) -> str:
        stack = getattr(_SCOPES, "stack", None)
        if stack is None:
            stack = _SCOPES.stack = []
        stack.append(self.name)
        return self.name

    def __exit__(self, *_: object) -> None:
        _SCOPES.stack.pop()

    def __repr__(self) -> str:
        return f"<shardckpt NameScope {self.name!r}>"


def _camel_to_snake(name: str) -> str:
    """``MyHTTPModule`` -> ``my_http_module`` (TF's default module names)."""
    name = re.sub(r"(.)([A-Z][a-z0-9]+)", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def _is_variable(obj: Any) -> bool:
    return isinstance(obj, Trackable) and getattr(obj, "_shardckpt_is_variable", False)


def _leaves(value: Any) -> Iterator[Any]:
    """``value`` flattened as TF's ``nest`` does: dicts by sorted key, lists and tuples in order."""
    if isinstance(value, dict):
        try:
            keys = sorted(value)
        except TypeError:
            keys = list(value)
        for key in keys:
            yield from _leaves(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


class Module(AutoTrackable):
    """A container of state, like ``tf.Module``: trackable attributes are its children.

    ``Module(name=None)``: ``name`` must be a Python identifier; by default the class
    name in snake case (``MyModule`` -> ``my_module``). ``name_scope`` names the
    variables created inside it ``<module>/<name>`` (recorded in checkpoints as TF
    records them). ``variables``, ``trainable_variables``, ``non_trainable_variables``
    and ``submodules`` are tuples in TF's order: this module's attributes sorted by
    name (lists and tuples in order, dicts by sorted key), each object once, then
    each submodule's in turn, depth first. Subclasses need not call
    ``super().__init__()`` (the default name is then used).
    """

    def __init__(self, name: Optional[str] = None) -> None:
        if name is None:
            name = _camel_to_snake(type(self).__name__)
        elif not _IDENTIFIER.match(str(name)):
            raise InvalidArgumentError(f"{name!r} is not a valid module name. Module names must be valid Python "
                                       "identifiers (e.g. a valid class name).")
        object.__setattr__(self, "_shardckpt_name", str(name))
        object.__setattr__(self, "_shardckpt_scope", NameScope(f"{_current_scope()}{name}/"))

    @property
    def name(self) -> str:
        """The module's name (a Python identifier)."""
        if "_shardckpt_name" not in self.__dict__:
            Module.__init__(self)
        return self.__dict__["_shardckpt_name"]  # type: ignore[no-any-return]

    @property
    def name_scope(self) -> NameScope:
        """The module's name scope (``with module.name_scope:`` names new variables ``<module>/<name>``)."""
        if "_shardckpt_scope" not in self.__dict__:
            Module.__init__(self)
        return self.__dict__["_shardckpt_scope"]  # type: ignore[no-any-return]

    @property
    def variables(self) -> Tuple[Trackable, ...]:
        """Every variable reachable from this module's attributes (each once, in TF's order)."""
        return tuple(self._flatten(_is_variable))

    @property
    def trainable_variables(self) -> Tuple[Trackable, ...]:
        """The variables with ``trainable=True``."""
        return tuple(self._flatten(lambda obj: _is_variable(obj) and bool(getattr(obj, "trainable", True))))

    @property
    def non_trainable_variables(self) -> Tuple[Trackable, ...]:
        """The variables with ``trainable=False``."""
        return tuple(self._flatten(lambda obj: _is_variable(obj) and not getattr(obj, "trainable", True)))

    @property
    def submodules(self) -> Tuple["Module", ...]:
        """Every module reachable from this one (not itself), in TF's order."""
        return tuple(self._flatten(lambda obj: isinstance(obj, Module)))

    def _flatten(self, predicate: Callable[[Any], bool]) -> Iterator[Any]:
        return _flatten_module(self, predicate, {id(self)})


def _flatten_module(module: Module, predicate: Callable[[Any], bool], seen: Set[int]) -> Iterator[Any]:
    """TF's walk of a module: its attributes by sorted name (the library's own left out), every leaf
    once; after this module's leaves, each submodule found among them, in turn."""
    submodules: List[Module] = []
    attributes = vars(module)
    for key in sorted(attributes):
        if key.startswith("_shardckpt"):
            continue
        for leaf in _leaves(attributes[key]):
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
            if predicate(leaf):
                yield leaf
            if isinstance(leaf, Module):
                submodules.append(leaf)
    for submodule in submodules:
        yield from _flatten_module(submodule, predicate, seen)
