"""Plain-text helpers for the CLI: keys, shapes, byte sizes, error messages, aligned tables."""

from __future__ import annotations

import re
from typing import Optional, Sequence, Union

from ..errors import ShardckptError, describe
from ..format.ordered_code import decode_tensor_name_slice, is_slice_key
from ..format.tensor_slice import TensorSlice

__all__ = ["key_text", "piece_key_text", "bare_message", "error_text", "shape_text", "human_size",
           "render_table"]


def key_text(key: Union[bytes, str]) -> str:
    """A checkpoint key for display: UTF-8, with undecodable bytes as ``\\xNN``."""
    return key if isinstance(key, str) else key.decode("utf-8", "backslashreplace")


def piece_key_text(key: Union[bytes, str]) -> str:
    """Like :func:`key_text`, but an encoded slice key reads ``name slice 0,4:-``."""
    if isinstance(key, bytes) and is_slice_key(key):
        try:
            name, extents = decode_tensor_name_slice(key)
            return f"{key_text(name)} slice {TensorSlice(tuple(extents))}"
        except Exception:  # display only: an undecodable key is shown as it is
            pass
    return key_text(key)


def bare_message(exc: ShardckptError) -> str:
    """The error's message without its ``"<file>: key '<key>': "`` prefix."""
    text = str(exc)
    prefix = describe(exc.path, exc.key)
    return text[len(prefix):] if prefix and text.startswith(prefix) else text


def error_text(exc: ShardckptError) -> str:
    """The error's message, with an encoded slice key shown as ``key 'name' slice 0,4:-``."""
    if not (isinstance(exc.key, bytes) and is_slice_key(exc.key)):
        return str(exc)
    pretty = piece_key_text(exc.key)
    name, sep, spec = pretty.partition(" slice ")
    where = f"key {name!r}" + (f" slice {spec}" if sep else "")
    return f"{describe(exc.path)}{where}: {bare_message(exc)}"


def shape_text(shape: Sequence[int]) -> str:
    """``[8, 4]``; a scalar is ``[]``."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


_UNITS = ("KiB", "MiB", "GiB", "TiB", "PiB")


def human_size(nbytes: int) -> str:
    """``943 B``, ``1.2 KiB``, ``3.0 GiB`` (binary units)."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes) / 1024.0
    index = 0
    while value >= 1024.0 and index < len(_UNITS) - 1:
        value /= 1024.0
        index += 1
    return f"{value:.1f} {_UNITS[index]}"


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], right: Sequence[int] = ()) -> str:
    """Align ``rows`` under ``headers`` in columns two spaces apart.

    Columns whose index is in ``right`` are right-aligned; the last column is
    never padded, so lines carry no trailing spaces.
    """
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in [list(headers)] + [list(r) for r in rows]:
        cells = []
        for i, cell in enumerate(row):
            if i == len(row) - 1 and i not in right:
                cells.append(cell)
            elif i in right:
                cells.append(cell.rjust(widths[i]))
            else:
                cells.append(cell.ljust(widths[i]))
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")
_LITERAL = re.compile(r"``([^`]+)``")


def plain_text(text: str) -> str:
    r"""``text`` with reST markup taken out (``\`\`x\`\``` and ``:func:`x``` become ``x``), for ``--help``."""
    return _LITERAL.sub(r"\1", _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text))


def description_of(doc: Optional[str]) -> Optional[str]:
    """A command's ``--help`` description: the second paragraph of its module docstring, as plain text."""
    if not doc or "\n\n" not in doc:
        return None
    return plain_text(doc.split("\n\n")[1])
