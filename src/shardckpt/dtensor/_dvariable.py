"""``DVariable``: a variable whose value is a :class:`DTensor`."""

from __future__ import annotations

from typing import Any, Dict, Optional

import numpy as np

from ..checkpoint.trackable import VARIABLE_VALUE, Trackable
from ..errors import InvalidArgumentError
from ..format.dtypes import DType, as_dtype
from .api import DTensor, from_global, unpack
from .layout import Layout

__all__ = ["DVariable"]


class DVariable(Trackable):
    """A named DTensor, saved as slices of one checkpoint key and restored onto its own layout."""

    def __init__(self, initial_value: DTensor, name: Optional[str] = None) -> None:
        if not isinstance(initial_value, DTensor):
            raise TypeError("DVariable needs a DTensor (use dtensor.from_global or dtensor.pack)")
        self._value = initial_value
        self._name = name or "Variable"

    @classmethod
    def from_global(cls, array: Any, layout: Layout, name: Optional[str] = None) -> "DVariable":
        return cls(from_global(array, layout), name)

    @property
    def name(self) -> str:
        return self._name

    @property
    def value(self) -> DTensor:
        return self._value

    @property
    def layout(self) -> Layout:
        return self._value.layout

    @property
    def shape(self) -> tuple:
        return self._value.shape

    @property
    def dtype(self) -> DType:
        return as_dtype(self._value.dtype)

    def components(self) -> list:
        """The local components (live arrays), in local device order."""
        return unpack(self._value)

    def assign(self, value: DTensor) -> "DVariable":
        if value.shape != self._value.shape:
            raise ValueError(f"cannot assign shape {list(value.shape)} to {list(self._value.shape)}")
        if sorted(value.components) != sorted(self._value.components) or any(
                value.box(d) != self._value.box(d) for d in self._value.components):
            raise InvalidArgumentError(f"cannot assign a value laid out as {value.layout.sharding_specs} to a "
                                       f"variable laid out as {self.layout.sharding_specs} (relayout it first)")
        for device, component in value.components.items():
            np.copyto(self._value.components[device], component)
        return self

    def _serialize_to_tensors(self) -> Dict[str, Any]:
        return {VARIABLE_VALUE: self._value}

    def _full_name(self, attribute: str) -> str:
        return self._name

    def __repr__(self) -> str:
        return (f"<shardckpt.dtensor.DVariable {self._name!r} shape={list(self.shape)} "
                f"layout={self.layout.sharding_specs}>")
