"""torch dtypes <-> tensor-bundle dtypes, and zero-copy NumPy views of CPU tensors.

Every torch dtype that has a TensorFlow ``DataType`` maps to exactly that one
(``float8_e4m3fn`` -> ``DT_FLOAT8_E4M3FN``, ``bfloat16`` -> ``DT_BFLOAT16``, ...);
any other (``uint16``/``uint32``/``uint64`` are kept off because torch supports
them only partially, quantized and bit types, ``float8_e8m0fnu``, ...) is an
:class:`~shardckpt.errors.UnsupportedError` naming the key.

:func:`numpy_view` gives the bytes of a CPU tensor as a NumPy array *without
copying* (dtypes NumPy lacks go through a same-width integer view and are re-viewed
as their ``ml_dtypes`` type); the writer reads values through it and the reader
fills destination tensors through it in place.
"""

from __future__ import annotations

from typing import Dict, Optional

import numpy as np
import torch

from ..errors import UnsupportedError
from ..format.dtypes import DType, as_dtype

__all__ = ["to_bundle_dtype", "to_torch_dtype", "numpy_view", "carrier_dtype", "SUPPORTED"]

# torch dtype -> TF dtype name. Exactly one TF dtype each; nothing converted.
_NAMES: Dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float64: "float64", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.int8: "int8", torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8",
    torch.bool: "bool", torch.complex64: "complex64", torch.complex128: "complex128",
}
for _attr, _name in (("float8_e4m3fn", "float8_e4m3fn"), ("float8_e5m2", "float8_e5m2"),
                     ("float8_e4m3fnuz", "float8_e4m3fnuz"), ("float8_e5m2fnuz", "float8_e5m2fnuz")):
    if hasattr(torch, _attr):  # older torch builds lack some float8 variants
        _NAMES[getattr(torch, _attr)] = _name

SUPPORTED = tuple(_NAMES)
_BY_ENUM: Dict[int, torch.dtype] = {as_dtype(name).enum: dt for dt, name in _NAMES.items()}
# Same-width integer types through which NumPy sees dtypes it does not know.
_CARRIER = {1: torch.uint8, 2: torch.int16}


def to_bundle_dtype(dtype: torch.dtype, key: str = "", path: Optional[str] = None) -> DType:
    """The bundle dtype of a torch dtype; an unsupported one is an error naming ``key``."""
    name = _NAMES.get(dtype)
    if name is None:
        raise UnsupportedError(f"torch dtype {dtype} has no TensorFlow dtype (supported: "
                               f"{', '.join(str(d).replace('torch.', '') for d in SUPPORTED)})",
                               path=path, key=key or None)
    return as_dtype(name)


def to_torch_dtype(dtype: DType) -> Optional[torch.dtype]:
    """The torch dtype of a bundle dtype, or ``None`` when torch has none."""
    return _BY_ENUM.get(dtype.enum)


def numpy_view(tensor: torch.Tensor, dtype: DType, *, contiguous: bool = True) -> np.ndarray:
    """The values of a CPU tensor as a NumPy array of ``dtype``, sharing the tensor's memory.

    With ``contiguous`` (what the writer needs) a strided tensor is copied first;
    without, the array keeps the tensor's strides (the reader fills it in place).
    """
    t = tensor.detach()
    if t.device.type != "cpu":
        raise UnsupportedError(f"numpy_view needs a CPU tensor, got one on {t.device}")
    if t.is_conj():
        t = t.resolve_conj()
    if contiguous and not t.is_contiguous():
        t = t.contiguous()
    carrier = carrier_dtype(t.dtype)
    if carrier is not t.dtype:
        return np.asarray(t.view(carrier).numpy()).view(dtype.numpy)
    return np.asarray(t.numpy())


def carrier_dtype(dtype: torch.dtype) -> torch.dtype:
    """The torch dtype whose NumPy view carries ``dtype``'s bytes (itself when NumPy knows it)."""
    if dtype is torch.bfloat16 or (dtype.is_floating_point and dtype.itemsize == 1):
        return _CARRIER[dtype.itemsize]
    return dtype
