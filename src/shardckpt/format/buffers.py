"""Destination arrays the reader allocates: C-contiguous, their first byte 64-byte aligned.

NumPy's allocator gives 16-byte aligned memory (malloc's guarantee). Consumers that want
more copy such arrays instead of sharing them: JAX on CPU takes a host array without a
copy only when its data is 64-byte aligned (a fully replicated restore of 8 devices
copied every leaf: 2.93 s, against 0.48 s aligned). :func:`aligned_empty` allocates 63
bytes more than the array needs and starts the array at the first 64-byte boundary;
the array is a view of that buffer (``.base`` holds it), writable and C-contiguous like
``np.empty``'s. Arrays under :data:`ALIGN_FROM` bytes (a copy of them costs less than
finding the address) and arrays of Python objects are plain ``np.empty`` arrays.
"""

from __future__ import annotations

import math
from typing import Any, Tuple

import numpy as np

__all__ = ["ALIGNMENT", "ALIGN_FROM", "aligned_empty", "is_aligned"]

ALIGNMENT = 64  # bytes; what XLA's CPU client needs to share a host buffer
ALIGN_FROM = 4096  # arrays of at least this many bytes are aligned


def aligned_empty(shape: Tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialised C-contiguous array of ``shape`` and ``dtype`` whose data is 64-byte aligned
    (arrays under :data:`ALIGN_FROM` bytes and object arrays: whatever ``np.empty`` gives)."""
    dt = np.dtype(dtype)
    nbytes = math.prod(shape) * dt.itemsize
    if nbytes < ALIGN_FROM or dt.hasobject:
        return np.empty(shape, dtype=dt)
    raw = np.empty(nbytes + ALIGNMENT - 1, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return np.ndarray(shape, dt, raw, start)


def is_aligned(array: np.ndarray) -> bool:
    """Whether ``array``'s first byte lies on a 64-byte boundary."""
    return array.ctypes.data % ALIGNMENT == 0
