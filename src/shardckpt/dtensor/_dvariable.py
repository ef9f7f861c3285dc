"""``DVariable``: a variable whose value is a :class:`DTensor` (``tf.experimental.dtensor.DVariable``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ..checkpoint.trackable import VARIABLE_VALUE, Trackable
from ..errors import InvalidArgumentError
from ..format.dtypes import DType, as_dtype
from ._api import DTensor, as_dtensor, from_global, is_dtensor, relayout, to_global, unpack
from ._layout import Layout

__all__ = ["DVariable"]


class DVariable(Trackable):
    """A named DTensor, saved as slices of one checkpoint key and restored onto its own layout.

    The initial value is copied, as TensorFlow copies it. The value's arrays are
    live: ``assign*`` and restores write into them in place, so the layout never
    changes. ``assign`` takes what TF's takes: a DTensor (or DVariable) on the
    variable's mesh, of its shape and dtype, in any layout (the value is relaid out
    to the variable's: a collective on several clients); a value on another mesh is
    refused. As an extension it also takes the global NumPy value, or a scalar that
    fills the variable.
    Everything that takes a DTensor takes a DVariable too.
    """

    _shardckpt_is_variable = True  # what Module.variables collects

    def __init__(self, initial_value: Any, name: Optional[str] = None, *, layout: Optional[Layout] = None,
                 trainable: bool = True) -> None:
        if is_dtensor(initial_value):
            value = as_dtensor(initial_value)
            if layout is not None and layout != value.layout:
                raise InvalidArgumentError(f"initial value laid out as {value.layout.sharding_specs}, but "
                                           f"layout={layout.sharding_specs} was given (relayout it first)")
            value = _copy(value)
        elif layout is not None:
            value = from_global(initial_value, layout)
        else:
            raise TypeError("DVariable needs a DTensor (use dtensor.from_global or dtensor.pack), or a global "
                            "value and layout=")
        self._value = value
        self._name = name or "Variable"
        self.trainable = trainable

    @classmethod
    def from_global(cls, array: Any, layout: Layout, name: Optional[str] = None) -> "DVariable":
        """A variable holding this client's pieces of the full ``array`` laid out by ``layout``."""
        variable = cls.__new__(cls)  # from_global already made fresh arrays: no second copy
        variable._value = from_global(array, layout)
        variable._name = name or "Variable"
        variable.trainable = True
        return variable

    def _shardckpt_dtensor(self) -> DTensor:
        return self._value

    @property
    def name(self) -> str:
        """The variable's name (recorded as the checkpoint entry's ``full_name``)."""
        return self._name

    def value(self) -> DTensor:
        """The current value (live: later assignments show in it), as ``tf.Variable.value()``."""
        return self._value

    def read_value(self) -> DTensor:
        """A copy of the current value."""
        return _copy(self._value)

    def numpy(self) -> np.ndarray:
        """The global value as one NumPy array; on several clients use ``dtensor.to_global`` (a collective)."""
        if self.layout.mesh.num_clients != 1:
            raise InvalidArgumentError(f"DVariable {self._name!r} lies on a mesh of {self.layout.mesh.num_clients} "
                                       "clients: numpy() would need the other clients' pieces; call "
                                       "dtensor.to_global(variable) on every client")
        return to_global(self._value)

    @property
    def layout(self) -> Layout:
        """The value's layout."""
        return self._value.layout

    @property
    def shape(self) -> Tuple[int, ...]:
        """The global shape."""
        return self._value.shape

    @property
    def dtype(self) -> DType:
        """The value's dtype (TensorFlow's names; ``dtype.numpy`` is the NumPy dtype)."""
        return as_dtype(self._value.dtype)

    def components(self) -> List[np.ndarray]:
        """The local components (live arrays), in local device order."""
        return unpack(self._value)

    def _as_value(self, value: Any) -> DTensor:
        """A DTensor laid out as this variable from a DTensor, DVariable or global NumPy value."""
        if is_dtensor(value):
            return as_dtensor(value)
        array = np.asarray(value)
        if array.shape == ():
            return DTensor(self.layout, self.shape, {d: np.full(c.shape, array, dtype=c.dtype)
                                                     for d, c in self._value.components.items()})
        if array.shape != self.shape:
            raise InvalidArgumentError(f"cannot use a value of shape {list(array.shape)} with variable "
                                       f"{self._name!r} of shape {list(self.shape)}")
        return from_global(array.astype(self._value.dtype, copy=False), self.layout)

    def assign(self, value: Any) -> "DVariable":
        """Write ``value`` in place (see the class docstring for what it may be); the layout stays."""
        if is_dtensor(value):
            new = self._same_mesh_value(as_dtensor(value))
        else:
            new = self._as_value(value)
        if new.shape != self._value.shape:
            raise InvalidArgumentError(f"cannot assign shape {list(new.shape)} to {list(self._value.shape)}")
        if sorted(new.components) != sorted(self._value.components) or any(
                new.box(d) != self._value.box(d) for d in self._value.components):
            raise InvalidArgumentError(f"cannot assign a value laid out as {new.layout.sharding_specs} to a "
                                       f"variable laid out as {self.layout.sharding_specs} (relayout it first)")
        for device, component in new.components.items():
            np.copyto(self._value.components[device], component, casting="same_kind")
        return self

    def _same_mesh_value(self, value: DTensor) -> DTensor:
        """A DTensor to assign, as TF takes it: the same mesh (its name included), shape and dtype; relaid out to
        this variable's layout when it has another."""
        mesh, own = value.layout.mesh, self.layout.mesh
        if mesh != own:
            raise InvalidArgumentError(f"cannot assign to variable {self._name!r} a value on another mesh "
                                       f"({mesh.to_string()!r}; the variable's is {own.to_string()!r}): "
                                       "dtensor.copy_to_mesh or relayout it first")
        if value.shape != self.shape:
            raise InvalidArgumentError(f"cannot assign a value of shape {list(value.shape)} to variable "
                                       f"{self._name!r} of shape {list(self.shape)}")
        if value.dtype != self._value.dtype:
            raise InvalidArgumentError(f"cannot assign a {as_dtype(value.dtype).name} value to the "
                                       f"{self.dtype.name} variable {self._name!r}")
        if value.layout != self.layout:
            value = relayout(value, self.layout)
        return value

    def assign_add(self, delta: Any) -> "DVariable":
        """Add ``delta`` (a DTensor/DVariable on this layout, a global NumPy value or a scalar) in place."""
        d = self._as_value(delta)
        self._check_same_pieces(d)
        for device, component in self._value.components.items():
            np.add(component, d.components[device], out=component, casting="same_kind")
        return self

    def assign_sub(self, delta: Any) -> "DVariable":
        """Subtract ``delta`` (as :meth:`assign_add`) in place."""
        d = self._as_value(delta)
        self._check_same_pieces(d)
        for device, component in self._value.components.items():
            np.subtract(component, d.components[device], out=component, casting="same_kind")
        return self

    def _check_same_pieces(self, other: DTensor) -> None:
        if other.shape != self.shape or any(other.box(d) != self._value.box(d) for d in self._value.components):
            raise InvalidArgumentError(f"the value is laid out as {other.layout.sharding_specs} with shape "
                                       f"{list(other.shape)}; variable {self._name!r} is "
                                       f"{self.layout.sharding_specs} {list(self.shape)} (relayout it first)")

    def _serialize_to_tensors(self) -> Dict[str, Any]:
        return {VARIABLE_VALUE: self._value}

    def _full_name(self, attribute: str) -> str:
        return self._name

    def __repr__(self) -> str:
        return (f"<shardckpt.dtensor.DVariable {self._name!r} shape={list(self.shape)} "
                f"layout={self.layout.sharding_specs}>")


def _copy(value: DTensor) -> DTensor:
    return DTensor(value.layout, value.shape, {d: c.copy() for d, c in value.components.items()})
