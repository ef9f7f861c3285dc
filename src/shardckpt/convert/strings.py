"""String tensors (and the TF object graph) in safetensors ``__metadata__``.

safetensors holds only numeric tensors. With ``--strings metadata`` a string tensor
is stored as one ``__metadata__`` entry under its name, whose value is the JSON text
``{"dtype": "string", "shape": [...], "base64": [...]}`` (elements flattened in
row-major order, each base64-encoded so arbitrary bytes survive). Converting such a
file back to a TF checkpoint turns these entries into string tensors again. A
value of that form is checked before its elements are built: its shape must be one
an array can have and hold as many elements as it lists; otherwise the conversion
fails with a :class:`~shardckpt.errors.DataLossError` naming the file and the entry.
"""

from __future__ import annotations

import base64
import json
import math
import re
from typing import Dict, Optional

import numpy as np

from ..errors import DataLossError
from ..format.strings import as_bytes_elements
from .jsonscan import STRING, WS
from .safetensors import check_array_shape

__all__ = ["encode_string_tensor", "decode_string_tensor"]


def encode_string_tensor(value: np.ndarray) -> str:
    elements = as_bytes_elements(value)
    return json.dumps({"dtype": "string", "shape": list(value.shape),
                       "base64": [base64.b64encode(b).decode("ascii") for b in elements]})


_INT = rb"-?[0-9]+"
_OURS = re.compile(  # what encode_string_tensor writes (any JSON whitespace between tokens)
    WS + rb'\{' + WS + rb'"dtype"' + WS + rb":" + WS + rb'"string"' + WS + rb"," + WS + rb'"shape"' + WS + rb":" + WS
    + rb"\[((?:" + WS + _INT + WS + rb"(?:," + WS + _INT + WS + rb")*)?)\]" + WS + rb"," + WS + rb'"base64"' + WS
    + rb":" + WS
    + rb"(\[" + WS + rb"(?:" + STRING + WS + rb"(?:," + WS + STRING + WS + rb")*)?\])" + WS + rb"\}" + WS)


def decode_string_tensor(text: str, path: str = "", key: str = "") -> Optional[np.ndarray]:
    """The string tensor a metadata value encodes, or None when it is not one of ours.

    A value of our form whose shape no array can have, or that does not match its
    elements, is a :class:`~shardckpt.errors.DataLossError` naming ``path`` and ``key``;
    the elements are built only once their count matches the shape.
    """
    if not text.startswith("{"):
        return None
    raw = text.encode("utf-8")
    m = _OURS.fullmatch(raw)
    if m is None:
        return None
    try:
        shape = [int(d) for d in m.group(1).split(b",")] if m.group(1).strip() else []
    except ValueError:
        raise DataLossError(f"string tensor shape [{m.group(1).decode()}] is not a list of integers",
                            path=path or None, key=key) from None
    if any(d < 0 for d in shape):
        raise DataLossError(f"string tensor shape {shape} has a negative size", path=path or None, key=key)
    check_array_shape(shape, np.dtype(object).itemsize, path, key)
    count = math.prod(shape)
    if count > len(m.group(2)) // 2:  # each element takes at least two bytes of text ("")
        raise DataLossError(f"string tensor of shape {shape} ({count} elements) in a "
                            f"{len(raw)}-byte value: elements are missing", path=path or None, key=key)
    try:
        items = json.loads(m.group(2).decode("utf-8"))
        if len(items) != count:
            raise ValueError(f"{len(items)} elements for shape {shape}")
        elements = [base64.b64decode(item, validate=True) for item in items]
    except ValueError as exc:  # bad UTF-8, bad base64, a count that does not match
        raise DataLossError(f"string tensor in metadata is damaged: {exc}", path=path or None, key=key) from None
    out = np.empty(len(elements), dtype=object)
    out[:] = elements
    return out.reshape(shape)


def string_entries(metadata: Dict[str, str], path: str = "") -> Dict[str, np.ndarray]:
    """The string tensors kept in ``metadata`` (a source's, at ``path``), by name."""
    found = {}
    for k, v in metadata.items():
        value = decode_string_tensor(v, path, k)
        if value is not None:
            found[k] = value
    return found
