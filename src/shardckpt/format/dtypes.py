"""TensorFlow ``DataType`` values and their NumPy equivalents.

Every dtype TensorFlow stores in checkpoints maps to a NumPy dtype: the usual
ones, ``ml_dtypes`` for bfloat16, the float8 family and the 4/2-bit integers
(one value per byte, exactly as TensorFlow stores them), and ``object`` for
strings (elements are ``bytes``) and variants.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Union

import ml_dtypes
import numpy as np

from ..errors import InvalidArgumentError, UnsupportedError

__all__ = ["DType", "as_dtype", "from_enum", "STRING", "VARIANT", "ALL_DTYPES"]


@dataclass(frozen=True)
class DType:
    """One TensorFlow dtype: its ``DataType`` enum, TF name and NumPy dtype."""

    enum: int
    name: str
    numpy: np.dtype
    #: Bytes per element on disk; ``None`` for variable-length strings and variants.
    itemsize: Optional[int]
    #: Width of the units to byte-swap when reading a big-endian bundle (0: none).
    swap_unit: int

    @property
    def is_string(self) -> bool:
        """Whether this is TensorFlow's ``string``."""
        return self.enum == 7

    @property
    def is_variant(self) -> bool:
        """Whether this is TensorFlow's ``variant``."""
        return self.enum == 21

    @property
    def is_numeric(self) -> bool:
        """Whether elements have a fixed size (not a string or variant)."""
        return self.itemsize is not None

    @property
    def size(self) -> int:
        """Bytes per element as TensorFlow's ``DType.size`` reports it (0 for strings and variants)."""
        return int(self.itemsize) if self.itemsize is not None else 0

    @property
    def as_numpy_dtype(self) -> Any:
        """The NumPy scalar type (TensorFlow's ``DType.as_numpy_dtype``)."""
        return self.numpy.type

    def __repr__(self) -> str:
        return f"shardckpt.{self.name}"


def _numeric(enum: int, name: str, dtype: Any, swap_unit: Optional[int] = None) -> DType:
    np_dtype = np.dtype(dtype)
    unit = np_dtype.itemsize if swap_unit is None else swap_unit
    return DType(enum, name, np_dtype, np_dtype.itemsize, unit if unit > 1 else 0)


_OBJECT = np.dtype(object)
STRING = DType(7, "string", _OBJECT, None, 0)
VARIANT = DType(21, "variant", _OBJECT, None, 0)

ALL_DTYPES = (
    _numeric(1, "float32", np.float32),
    _numeric(2, "float64", np.float64),
    _numeric(3, "int32", np.int32),
    _numeric(4, "uint8", np.uint8),
    _numeric(5, "int16", np.int16),
    _numeric(6, "int8", np.int8),
    STRING,
    _numeric(8, "complex64", np.complex64, 4),
    _numeric(9, "int64", np.int64),
    _numeric(10, "bool", np.bool_),
    _numeric(11, "qint8", np.int8),
    _numeric(12, "quint8", np.uint8),
    _numeric(13, "qint32", np.int32),
    _numeric(14, "bfloat16", ml_dtypes.bfloat16),
    _numeric(15, "qint16", np.int16),
    _numeric(16, "quint16", np.uint16),
    _numeric(17, "uint16", np.uint16),
    _numeric(18, "complex128", np.complex128, 8),
    _numeric(19, "float16", np.float16),
    VARIANT,
    _numeric(22, "uint32", np.uint32),
    _numeric(23, "uint64", np.uint64),
    _numeric(24, "float8_e5m2", ml_dtypes.float8_e5m2),
    _numeric(25, "float8_e4m3fn", ml_dtypes.float8_e4m3fn),
    _numeric(26, "float8_e4m3fnuz", ml_dtypes.float8_e4m3fnuz),
    _numeric(27, "float8_e4m3b11fnuz", ml_dtypes.float8_e4m3b11fnuz),
    _numeric(28, "float8_e5m2fnuz", ml_dtypes.float8_e5m2fnuz),
    _numeric(29, "int4", ml_dtypes.int4),
    _numeric(30, "uint4", ml_dtypes.uint4),
    _numeric(31, "int2", ml_dtypes.int2),
    _numeric(32, "uint2", ml_dtypes.uint2),
    _numeric(33, "float4_e2m1fn", ml_dtypes.float4_e2m1fn),
)

_BY_ENUM: Dict[int, DType] = {d.enum: d for d in ALL_DTYPES}
_BY_NAME: Dict[str, DType] = {d.name: d for d in ALL_DTYPES}
_BY_NAME.update({"half": _BY_ENUM[19], "float": _BY_ENUM[1], "double": _BY_ENUM[2],
                 "bytes": STRING, "str": STRING, "object": STRING})
# NumPy -> TF. Quantized types share NumPy dtypes with plain ints; the plain one wins.
_BY_NUMPY: Dict[np.dtype, DType] = {}
for _d in ALL_DTYPES:
    if _d.is_numeric and not _d.name.startswith(("q", "qu")):
        _BY_NUMPY.setdefault(_d.numpy, _d)


def from_enum(enum: int, path: Optional[str] = None, key: Optional[str] = None) -> DType:
    """The :class:`DType` of a ``DataType`` enum value; unknown values are an error."""
    try:
        return _BY_ENUM[enum]
    except KeyError:
        if enum == 20:
            raise UnsupportedError("DT_RESOURCE values cannot be stored in a checkpoint",
                                   path=path, key=key) from None
        raise UnsupportedError(f"unknown dtype enum {enum}", path=path, key=key) from None


DTypeLike = Union[DType, str, int, np.dtype, type]


def as_dtype(value: Any) -> DType:
    """Convert a :class:`DType`, TF dtype name, enum value or NumPy dtype to a :class:`DType`.

    NumPy string dtypes (``S``/``U``) and ``object`` map to ``string``.
    """
    if isinstance(value, DType):
        return value
    if isinstance(value, np.dtype) and value.byteorder in "=|" and value.kind not in "SUO":
        found = _BY_NUMPY.get(value)  # the common case, once per tensor: no name lookup
        if found is not None:
            return found
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return from_enum(int(value))
    if isinstance(value, str) and value in _BY_NAME:
        return _BY_NAME[value]
    tf_name = getattr(value, "name", None)  # a tf.DType, or anything else named like one
    if isinstance(tf_name, str) and tf_name in _BY_NAME and not isinstance(value, np.dtype):
        return _BY_NAME[tf_name]
    try:
        np_dtype = np.dtype(value)
    except TypeError:
        raise InvalidArgumentError(f"not a dtype: {value!r}") from None
    if np_dtype.kind in "SUO":
        return STRING
    found = _BY_NUMPY.get(np_dtype.newbyteorder("=")) if np_dtype.byteorder not in "=|" else _BY_NUMPY.get(np_dtype)
    if found is None:
        raise InvalidArgumentError(f"NumPy dtype {np_dtype} has no TensorFlow equivalent")
    return found
