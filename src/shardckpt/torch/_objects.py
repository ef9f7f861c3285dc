"""Non-tensor values of a state dict (step counters, learning rates, param groups) as JSON.

DCP hands non-tensors to storage as ``torch.save`` pickles; shardckpt stores them as
a scalar ``DT_STRING`` entry holding ``MAGIC`` followed by JSON, so nothing on disk
is a pickle and TensorFlow reads the entry as an ordinary string tensor.

Plain values round-trip exactly: ``None``, ``bool``, ``int``, ``float`` (NaN and
infinities included), ``str``, ``bytes``, lists, tuples and dicts with keys of
those scalar types. JSON cannot tell a tuple from a list or an int key from a
string key, so those are tagged (``{"__tuple__": [...]}``, ``{"__dict__": [[k, v],
...]}``, ``{"__bytes__": "<hex>"}``). Anything else (a module, a tensor inside a
list, a custom object) is an :class:`~shardckpt.errors.UnsupportedError` naming
the key and the path inside the value.
"""

from __future__ import annotations

import json
import math
from typing import Any

from ..errors import DataLossError, UnsupportedError

__all__ = ["MAGIC", "encode_object", "decode_object", "is_object_entry"]

MAGIC = b"shardckpt.torch/json\n"
_TAGS = ("__tuple__", "__dict__", "__bytes__", "__float__")


def _plain(value: Any, key: str, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return {"__float__": repr(value)}  # 'nan', 'inf', '-inf': JSON has no spelling for them
    if isinstance(value, bytes):
        return {"__bytes__": value.hex()}
    if isinstance(value, list):
        return [_plain(v, key, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {"__tuple__": [_plain(v, key, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k in _TAGS for k in value):
            return {k: _plain(v, key, f"{where}[{k!r}]") for k, v in value.items()}
        pairs = []
        for k, v in value.items():
            if k is not None and not isinstance(k, (bool, int, float, str, tuple)):
                raise UnsupportedError(f"a dict key of type {type(k).__name__} at {where or 'the value'} cannot "
                                       "be stored without pickle", key=key)
            pairs.append([_plain(k, key, f"{where} key"), _plain(v, key, f"{where}[{k!r}]")])
        return {"__dict__": pairs}
    raise UnsupportedError(f"a value of type {type(value).__module__}.{type(value).__qualname__} at "
                           f"{where or 'the top'} cannot be stored without pickle (plain Python scalars, "
                           "strings, bytes, lists, tuples and dicts can; tensors must be state dict entries)",
                           key=key)


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
            if tag == "__bytes__":
                return bytes.fromhex(inner)
            if tag == "__float__":
                return float(inner)
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
    except (ValueError, TypeError) as exc:
        raise DataLossError(f"unreadable encoded object: {exc}", path=path or None, key=key or None) from None
