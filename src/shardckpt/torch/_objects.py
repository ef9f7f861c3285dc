"""Non-tensor values of a state dict (step counters, learning rates, param groups) as JSON.

DCP hands non-tensors to storage as ``torch.save`` pickles; shardckpt stores them as
a scalar ``DT_STRING`` entry holding ``MAGIC`` followed by JSON, so nothing on disk
is a pickle and TensorFlow reads the entry as an ordinary string tensor.

Values round-trip with their exact type: ``None``, ``bool``, ``int``, ``float`` (NaN
and infinities included), ``str``, ``bytes``, lists, tuples, dicts (keys of those
scalar types) and ``OrderedDict``; ``torch.Size``, ``torch.dtype`` (its name),
``io.BytesIO`` (its bytes), NumPy scalars and arrays of numeric, bool, bytes or str
dtypes (dtype, shape, bytes). JSON has no tuple, int key, bytes or non-finite float,
so those, and the others above, are tagged: a one-key object whose key is one of
:data:`_TAGS` (``{"__tuple__": [...]}``, ``{"__dict__": [[k, v], ...]}``,
``{"__ndarray__": [dtype, shape, hex]}``, ...). Anything else is an
:class:`~shardckpt.errors.UnsupportedError` naming the key and the place inside the
value, never a silent change of type: subclasses of those types (a namedtuple, an
``IntEnum``, a ``defaultdict``), sets, modules, tensors inside a value, custom objects.

:data:`NESTING_KEY` holds, for loads without a target, DCP's ``planner_data``: each
flattened key's path in the nested state dict (``{"model.w": ["model", "w"]}``).
"""

from __future__ import annotations

import io
import json
import math
from collections import OrderedDict
from typing import Any, Dict, Tuple

import numpy as np
import torch

from ..errors import DataLossError, UnsupportedError

__all__ = ["MAGIC", "NESTING_KEY", "encode_object", "decode_object", "is_object_entry", "encode_nesting",
           "decode_nesting"]

MAGIC = b"shardckpt.torch/json\n"
NESTING_KEY = "_DCP_NESTING"
_TAGS = ("__tuple__", "__dict__", "__bytes__", "__float__", "__ordered__", "__size__", "__dtype__", "__bytesio__",
         "__npscalar__", "__ndarray__")
_NUMPY_KINDS = "biufcSU"  # bool, integers, floats, complex, fixed bytes and str: their bytes are the values


def _refuse(value: Any, key: str, where: str, why: str = "") -> UnsupportedError:
    return UnsupportedError(f"a value of type {type(value).__module__}.{type(value).__qualname__} at "
                            f"{where or 'the top'} cannot be stored without pickle{why} (None, bool, int, float, "
                            "str, bytes, list, tuple, dict, OrderedDict, torch.Size, torch.dtype, io.BytesIO and "
                            "NumPy scalars and arrays can; tensors must be state dict entries)", key=key)


def _numpy(value: Any, key: str, where: str) -> Any:
    array = np.asarray(value)
    if array.dtype.kind not in _NUMPY_KINDS or array.dtype.fields is not None:
        raise _refuse(value, key, where, f" (NumPy dtype {array.dtype})")
    raw = np.ascontiguousarray(array).tobytes()
    if isinstance(value, np.generic):
        return {"__npscalar__": [array.dtype.str, raw.hex()]}
    return {"__ndarray__": [array.dtype.str, list(array.shape), raw.hex()]}


def _plain(value: Any, key: str, where: str) -> Any:
    kind = type(value)
    if value is None or kind in (bool, str):
        return value
    if kind is int:
        return value
    if kind is float:
        return value if math.isfinite(value) else {"__float__": repr(value)}  # JSON cannot spell nan / inf
    if kind is bytes:
        return {"__bytes__": value.hex()}
    if isinstance(value, (np.generic, np.ndarray)):
        return _numpy(value, key, where)
    if kind is torch.Size:
        return {"__size__": [int(d) for d in value]}
    if kind is torch.dtype:
        return {"__dtype__": str(value).replace("torch.", "")}
    if kind is io.BytesIO:
        return {"__bytesio__": value.getvalue().hex()}
    if kind is list:
        return [_plain(v, key, f"{where}[{i}]") for i, v in enumerate(value)]
    if kind is tuple:
        return {"__tuple__": [_plain(v, key, f"{where}[{i}]") for i, v in enumerate(value)]}
    if kind is OrderedDict:
        return {"__ordered__": _pairs(value, key, where)}
    if kind is dict:
        if all(type(k) is str for k in value) and not any(k in _TAGS for k in value):
            return {k: _plain(v, key, f"{where}[{k!r}]") for k, v in value.items()}
        return {"__dict__": _pairs(value, key, where)}
    raise _refuse(value, key, where)


def _pairs(value: Dict[Any, Any], key: str, where: str) -> Any:
    pairs = []
    for k, v in value.items():
        if k is not None and type(k) not in (bool, int, float, str, tuple):
            raise UnsupportedError(f"a dict key of type {type(k).__name__} at {where or 'the value'} cannot "
                                   "be stored without pickle", key=key)
        pairs.append([_plain(k, key, f"{where} key"), _plain(v, key, f"{where}[{k!r}]")])
    return pairs


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"no torch dtype {name!r}")
    return dtype


def _array(spec: str, shape: Any, hexed: str) -> np.ndarray:
    dtype = np.dtype(spec)
    if dtype.kind not in _NUMPY_KINDS or dtype.fields is not None:
        raise ValueError(f"NumPy dtype {spec!r} is not stored")
    return np.frombuffer(bytes.fromhex(hexed), dtype=dtype).reshape([int(d) for d in shape]).copy()


def _python(value: Any) -> Any:
    if isinstance(value, list):
        return [_python(v) for v in value]
    if isinstance(value, dict):
        if len(value) == 1:
            (tag, inner), = value.items()
            if tag == "__tuple__":
                return tuple(_python(v) for v in inner)
            if tag == "__dict__":
                return {_hashable(_python(k)): _python(v) for k, v in inner}
            if tag == "__ordered__":
                return OrderedDict((_hashable(_python(k)), _python(v)) for k, v in inner)
            if tag == "__bytes__":
                return bytes.fromhex(inner)
            if tag == "__float__":
                return float(inner)
            if tag == "__size__":
                return torch.Size(int(d) for d in inner)
            if tag == "__dtype__":
                return _dtype(inner)
            if tag == "__bytesio__":
                return io.BytesIO(bytes.fromhex(inner))
            if tag == "__npscalar__":
                return _array(inner[0], (), inner[1])[()]
            if tag == "__ndarray__":
                return _array(*inner)
        return {k: _python(v) for k, v in value.items()}
    return value


def _hashable(value: Any) -> Any:
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def encode_object(value: Any, key: str) -> bytes:
    """``MAGIC`` + the JSON of ``value``; an unsupported value is an error naming ``key``."""
    return MAGIC + json.dumps(_plain(value, key, ""), ensure_ascii=False, allow_nan=False,
                              separators=(",", ":")).encode("utf-8")


def is_object_entry(data: bytes) -> bool:
    """Whether a string scalar's bytes are an encoded object."""
    return data.startswith(MAGIC)


def decode_object(data: bytes, key: str = "", path: str = "") -> Any:
    """The value :func:`encode_object` stored."""
    if not is_object_entry(data):
        raise DataLossError("not an encoded object", path=path or None, key=key or None)
    try:
        return _python(json.loads(data[len(MAGIC):].decode("utf-8")))
    except (ValueError, TypeError, IndexError, RecursionError) as exc:  # RecursionError: nested too deep
        raise DataLossError(f"unreadable encoded object: {str(exc)[:200]}", path=path or None,
                            key=key or None) from None


def encode_nesting(nesting: Dict[str, Any]) -> bytes:
    """The :data:`NESTING_KEY` entry of DCP's ``planner_data`` (key -> path of str and int parts)."""
    paths = {}
    for fqn, path in nesting.items():
        parts = list(path) if isinstance(path, (list, tuple)) else [path]
        if not all(type(p) in (str, int) for p in parts):
            raise UnsupportedError(f"DCP's nesting path {parts!r} has parts other than str and int", key=fqn)
        paths[str(fqn)] = parts
    return encode_object(paths, NESTING_KEY)


def decode_nesting(data: bytes, path: str = "") -> Dict[str, Tuple[Any, ...]]:
    """DCP's ``planner_data`` from the :data:`NESTING_KEY` entry."""
    paths = decode_object(data, NESTING_KEY, path)
    if not isinstance(paths, dict) or not all(isinstance(v, list) for v in paths.values()):
        raise DataLossError("the nesting entry is not a map of key -> path", path=path or None, key=NESTING_KEY)
    return {str(k): tuple(v) for k, v in paths.items()}
