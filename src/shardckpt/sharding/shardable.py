"""``ShardableTensor``: one tensor (or pre-sliced piece) offered to a sharding callback.

Mirrors ``tf.train.experimental.ShardableTensor``: the callback sees the
checkpoint key, dtype, shape, slice spec, device and the value, and returns
shards built from them. The fields answer what a callback written for TensorFlow
reads: ``shape`` is a :class:`TensorShape` (a tuple with ``rank``,
``num_elements()``, ``as_list()``), ``device`` a :class:`DeviceSpec` (the full
device string with ``job``, ``replica``, ``task``, ``device_type``,
``device_index``), ``dtype`` a :class:`~shardckpt.DType` (``size``, ``name``,
``as_numpy_dtype``), ``slice_spec`` the ``shape_and_slices`` string (``""`` for a
whole tensor). ``tensor`` is a NumPy array (TF: a ``tf.Tensor``) or a zero-argument
callable producing it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Any, Callable, List, Optional, Tuple, Union

import numpy as np

from ..format.dtypes import DType, as_dtype
from ..format.tensor_slice import Box, full_box, parse_shape_and_slice

__all__ = ["ShardableTensor", "TensorShape", "DeviceSpec", "DEFAULT_DEVICE", "task_of", "canonical_device"]

DEFAULT_DEVICE = "/job:localhost/replica:0/task:0/device:CPU:0"
_DEVICE_FIELD = re.compile(r"/(job|replica|task|device):([^/]*)")


class TensorShape(tuple):
    """A shape: a tuple of ints with TensorFlow's ``TensorShape`` accessors."""

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self)

    @property
    def dims(self) -> List[int]:
        """The dimensions as a list."""
        return list(self)

    def as_list(self) -> List[int]:
        """The dimensions as a list."""
        return list(self)

    def num_elements(self) -> int:
        """Number of elements (1 for a scalar)."""
        n = 1
        for d in self:
            n *= int(d)
        return n


class DeviceSpec(str):
    """A full device string (``/job:localhost/replica:0/task:0/device:CPU:0``) with TF's ``DeviceSpec`` fields."""

    @property
    def job(self) -> str:
        """The job name."""
        return str(_fields(self)["job"])

    @property
    def replica(self) -> int:
        """The replica index."""
        return int(_fields(self)["replica"])

    @property
    def task(self) -> int:
        """The task index."""
        return int(_fields(self)["task"])

    @property
    def device_type(self) -> str:
        """The device type (``"CPU"``, ``"GPU"``, ...)."""
        return str(_fields(self)["device"]).rsplit(":", 1)[0]

    @property
    def device_index(self) -> int:
        """The device index on its task."""
        return int(str(_fields(self)["device"]).rsplit(":", 1)[-1])

    def to_string(self) -> str:
        """The device string."""
        return str(self)


def _fields(device: str) -> dict:
    found = dict(_DEVICE_FIELD.findall(device or ""))
    found.setdefault("job", "localhost")
    found.setdefault("replica", "0")
    found.setdefault("task", "0")
    found.setdefault("device", "CPU:0")
    return found


@lru_cache(maxsize=4096)  # device strings repeat on every save: parse each once
def canonical_device(device: Optional[str]) -> str:
    """Spell a device string fully: ``"/task:1/device:CPU:2"`` -> ``"/job:localhost/replica:0/task:1/device:CPU:2"``."""
    if not device:
        return DEFAULT_DEVICE
    f = _fields(device)
    return f"/job:{f['job']}/replica:{f['replica']}/task:{f['task']}/device:{f['device']}"


@lru_cache(maxsize=4096)
def task_of(device: Optional[str]) -> str:
    """The task a device belongs to, as TF groups saves: the device with its type/index set to ``CPU:0``."""
    f = _fields(device or "")
    return f"/job:{f['job']}/replica:{f['replica']}/task:{f['task']}/device:CPU:0"


@dataclass(frozen=True, eq=False)
class ShardableTensor:
    """A tensor to be saved, as a sharding callback sees it.

    ``tensor`` is the value: a NumPy array (or anything ``np.asarray`` accepts),
    or a zero-argument callable returning one, called when the bytes are needed.
    ``shape`` is the value's shape (the slice's shape when ``slice_spec`` is set);
    ``slice_spec`` is ``""`` for a whole tensor or a ``shape_and_slices`` string
    such as ``"10 4 0,5:-"`` when the value is a piece of a larger tensor.
    """

    checkpoint_key: str
    tensor: Any
    dtype: DType
    shape: Tuple[int, ...]
    slice_spec: str = ""
    device: str = DEFAULT_DEVICE
    name: str = ""
    trackable: Any = field(default=None, repr=False)

    @classmethod
    def from_value(cls, checkpoint_key: str, value: Any, *, slice_spec: str = "",
                   device: Optional[str] = None, trackable: Any = None,
                   dtype: Any = None) -> "ShardableTensor":
        """Describe an array (or a callable producing one, with ``dtype`` and shape from ``value()``)."""
        array = value() if callable(value) else value
        array = np.asarray(array)
        dt = as_dtype(dtype if dtype is not None else array.dtype)
        return cls(checkpoint_key=checkpoint_key, tensor=value, dtype=dt, shape=tuple(array.shape),
                   slice_spec=slice_spec, device=canonical_device(device), name=checkpoint_key,
                   trackable=trackable)

    def __post_init__(self) -> None:
        if not self.name:
            object.__setattr__(self, "name", self.checkpoint_key)
        object.__setattr__(self, "device", DeviceSpec(canonical_device(self.device)))
        object.__setattr__(self, "shape", TensorShape(int(d) for d in self.shape))

    def __hash__(self) -> int:
        return hash((self.name, self.dtype.enum, self.device, self.checkpoint_key))

    def value(self) -> np.ndarray:
        """The value as a NumPy array (calls ``tensor`` when it is a callable)."""
        return np.asarray(self.tensor() if callable(self.tensor) else self.tensor)

    @property
    def task(self) -> str:
        """The task this tensor is saved by (its device with ``CPU:0``); callbacks run once per task."""
        return task_of(self.device)

    @cached_property
    def full_shape(self) -> Tuple[int, ...]:
        """Shape of the whole tensor this value belongs to."""
        if not self.slice_spec:
            return self.shape
        return parse_shape_and_slice(self.slice_spec)[0]

    @cached_property
    def box(self) -> Box:  # parsed once: validation asks for every piece's box once per item of its key
        """Where this value lies in the whole tensor."""
        if not self.slice_spec:
            return full_box(self.shape)
        shape, tslice = parse_shape_and_slice(self.slice_spec)
        assert tslice is not None
        return tslice.box(shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the value (strings: the sum of the element lengths)."""
        if self.dtype.is_numeric:
            assert self.dtype.itemsize is not None
            n = 1
            for d in self.shape:
                n *= d
            return n * self.dtype.itemsize
        from ..format.strings import as_bytes_elements
        return sum(len(b) for b in as_bytes_elements(self.value()))


ValueOrCallable = Union[np.ndarray, Callable[[], np.ndarray]]
