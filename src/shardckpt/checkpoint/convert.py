"""TensorFlow's dtype rules for Python values (``tf.constant`` / ``tf.Variable`` without a dtype).

* NumPy arrays and NumPy scalars keep their dtype.
* Python ``bool`` -> bool; ``int`` -> int32, or int64 when a value is outside int32's
  range (outside int64's range: ``ValueError``, as in TF); ``float`` -> float32;
  ``complex`` -> complex128; ``str`` / ``bytes`` -> string (an object array of ``bytes``/``str``).
* Nested lists and tuples follow the same rules over all their elements: any float
  makes the whole float32, ints alone give int32 (int64 when one is out of range).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

__all__ = ["convert_python_value"]

_INT32 = np.iinfo(np.int32)
_INT64 = np.iinfo(np.int64)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    else:
        yield value


def convert_python_value(value: Any) -> np.ndarray:
    """``value`` as a NumPy array with the dtype TensorFlow would give it (a copy)."""
    if isinstance(value, (np.ndarray, np.generic)):
        return np.array(value, copy=True, order="C")
    leaves = list(_leaves(value)) if isinstance(value, (list, tuple)) else [value]
    if leaves and all(isinstance(x, (str, bytes)) for x in leaves):
        return np.array(value, dtype=object)
    python_numbers = leaves and all(type(x) in (bool, int, float, complex) for x in leaves)
    if not python_numbers:  # NumPy scalars inside lists, array-likes: NumPy's rules
        array = np.array(value, copy=True, order="C")
        return array.astype(object) if array.dtype.kind in "SU" else array
    kinds = {type(x) for x in leaves}
    if kinds == {bool}:
        return np.array(value, dtype=np.bool_)
    if complex in kinds:
        return np.array(value, dtype=np.complex128)
    if float in kinds:
        return np.array(value, dtype=np.float32)
    ints = [int(x) for x in leaves]
    if any(not _INT64.min <= x <= _INT64.max for x in ints):
        raise ValueError("Can't convert Python sequence with out-of-range integer to int64 (as TensorFlow)")
    fits32 = all(_INT32.min <= x <= _INT32.max for x in ints)
    return np.array(value, dtype=np.int32 if fits32 else np.int64)
