"""Which format a path holds (a source) or should hold (a destination)."""

from __future__ import annotations

from typing import Optional

from ..errors import InvalidArgumentError
from ..storage import get_fs
from .dcp import is_dcp_folder
from .hf import INDEX_NAME, SINGLE_NAME

__all__ = ["FORMATS", "source_format", "dest_format"]

FORMATS = ("tf", "safetensors", "hf", "npz", "dcp")


def _check(fmt: str) -> str:
    if fmt not in FORMATS:
        raise InvalidArgumentError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    return fmt


def source_format(path: str, given: Optional[str] = None) -> str:
    """``given``, or the format the path holds: by suffix, then by the files in a folder, else ``tf``."""
    if given:
        return _check(given)
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(".npz"):
        return "npz"
    fs = get_fs(path)
    if fs.isdir(path):
        if fs.isfile(fs.join(path, INDEX_NAME)) or fs.isfile(fs.join(path, SINGLE_NAME)):
            return "hf"
        if is_dcp_folder(path):
            return "dcp"
    return "tf"


def dest_format(path: str, given: Optional[str] = None) -> str:
    """``given``, or ``safetensors`` / ``npz`` by suffix; anything else must be named with ``--to``."""
    if given:
        return _check(given)
    if path.endswith(".safetensors"):
        return "safetensors"
    if path.endswith(".npz"):
        return "npz"
    raise InvalidArgumentError(f"cannot tell the output format of {path!r} from its name; give --to "
                               f"({', '.join(FORMATS)})")
