"""String tensors (and the TF object graph) in safetensors ``__metadata__``.

safetensors holds only numeric tensors. With ``--strings metadata`` a string tensor
is stored as one ``__metadata__`` entry under its name, whose value is the JSON text
``{"dtype": "string", "shape": [...], "base64": [...]}`` (elements flattened in
row-major order, each base64-encoded so arbitrary bytes survive). Converting such a
file back to a TF checkpoint turns these entries into string tensors again.
"""

from __future__ import annotations

import base64
import json
from typing import Dict, Optional

import numpy as np

from ..format.strings import as_bytes_elements

__all__ = ["encode_string_tensor", "decode_string_tensor"]


def encode_string_tensor(value: np.ndarray) -> str:
    elements = as_bytes_elements(value)
    return json.dumps({"dtype": "string", "shape": list(value.shape),
                       "base64": [base64.b64encode(b).decode("ascii") for b in elements]})


def decode_string_tensor(text: str) -> Optional[np.ndarray]:
    """The string tensor a metadata value encodes, or None when it is not one of ours."""
    if not text.startswith("{"):
        return None
    try:
        rec = json.loads(text)
    except ValueError:
        return None
    if not (isinstance(rec, dict) and set(rec) == {"dtype", "shape", "base64"} and rec["dtype"] == "string"):
        return None
    shape, items = rec["shape"], rec["base64"]
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)
            and isinstance(items, list) and len(items) == int(np.prod(shape, dtype=np.int64))):
        return None
    try:
        elements = [base64.b64decode(s, validate=True) for s in items]
    except (ValueError, TypeError):
        return None
    out = np.empty(len(elements), dtype=object)
    out[:] = elements
    return out.reshape(shape)


def string_entries(metadata: Dict[str, str]) -> Dict[str, np.ndarray]:
    found = {}
    for k, v in metadata.items():
        value = decode_string_tensor(v)
        if value is not None:
            found[k] = value
    return found
