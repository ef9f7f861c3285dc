"""A streaming reader for the JSON documents of other formats (safetensors headers, HF index files).

``json.loads`` builds a whole document before anything can be checked, and some JSON
costs far more memory as Python objects than as text: ``[]`` is 2 bytes of text and
about 64 bytes of list, so a 100 MB safetensors header of empty lists took 3 GB
before it was refused. :class:`JsonScanner` walks the raw bytes instead (no decoded
copy is made) and builds only the values the caller asks for, one member at a time:

* :meth:`~JsonScanner.members` steps through an object, yielding each member's name;
  the caller then takes the member's value with one of the methods below;
* :meth:`~JsonScanner.scalar` takes a string, a number, ``true``/``false``/``null``, or
  a list of at most :data:`MAX_LIST` of these (not nested), each built with
  ``json.loads`` on its own text: a few times that text's size;
* :meth:`~JsonScanner.skip` passes over such a value, or an object of them, keeping nothing.

Anything else where a scalar is expected (a nested list or object, a longer list) is
refused at once. Every problem is a :class:`~shardckpt.errors.DataLossError` naming
the file, the key and the byte offset in the document. Memory used: the raw bytes
plus what the caller keeps; time: linear in the bytes (each token is matched by one
regular expression, in C).
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator, Optional, Union

from ..errors import DataLossError

__all__ = ["JsonScanner", "MAX_LIST", "WS", "STRING", "decode_string"]

#: The longest list :meth:`JsonScanner.scalar` builds (a shape of rank 64, data offsets, ...).
MAX_LIST = 1024

#: Regular expressions (bytes) of JSON whitespace and strings, for callers' fast-path patterns.
WS = _WS = rb"[ \t\n\r]*"
STRING = _STRING = rb'"[^"\\\x00-\x1f]*(?:\\(?:["\\/bfnrt]|u[0-9a-fA-F]{4})[^"\\\x00-\x1f]*)*"'
_NUMBER = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_SCALAR = rb"(?:" + _STRING + rb"|" + _NUMBER + rb"|true|false|null)"
_LIST = (rb"\[" + _WS + rb"(?:" + _SCALAR + _WS + rb"(?:," + _WS + _SCALAR + _WS + rb"){0,%d})?\]" % (MAX_LIST - 1))

_SPACE = re.compile(_WS)
_SPACES = b" \t\n\r"
_STRING_RE = re.compile(_STRING)
_VALUE_RE = re.compile(rb"(?:" + _SCALAR + rb"|" + _LIST + rb")")
_LITERALS = {b"true": True, b"false": False, b"null": None}

Data = Union[bytes, bytearray, memoryview]


class JsonScanner:
    """A cursor over one JSON document (see the module docstring); ``what`` names it in errors."""

    def __init__(self, data: Data, path: str, what: str = "JSON") -> None:
        self.data = data
        self.path = path
        self.what = what
        self.pos = 0

    def error(self, problem: str, key: Optional[str] = None, at: Optional[int] = None) -> DataLossError:
        where = self.pos if at is None else at
        return DataLossError(f"{self.what} is not valid JSON of the expected form: {problem} (at byte {where})",
                             path=self.path, key=key)

    def _next(self) -> int:
        """The next byte after any whitespace (-1 at the end), which stays unconsumed."""
        data, pos = self.data, self.pos
        if pos < len(data) and data[pos] in _SPACES:
            pos = self.pos = _SPACE.match(data, pos).end()  # type: ignore[union-attr]
        return data[pos] if pos < len(data) else -1

    def match(self, pattern: "re.Pattern[bytes]") -> "Optional[re.Match[bytes]]":
        """``pattern`` matched at the cursor (after whitespace), consumed when it matches: a caller's
        fast path for a value of a form it knows."""
        self._next()
        m = pattern.match(self.data, self.pos)
        if m is not None:
            self.pos = m.end()
        return m

    def _take(self, char: bytes, key: Optional[str], expected: str) -> None:
        if self._next() != char[0]:
            raise self.error(f"expected {expected}", key)
        self.pos += 1

    def at_object(self) -> bool:
        """Whether an object starts at the cursor."""
        return self._next() == ord("{")

    def members(self, key: Optional[str] = None) -> Iterator[str]:
        """Enter the object at the cursor and yield each member's name; consume its value before the next."""
        self._take(b"{", key, "an object")
        if self._next() == ord("}"):
            self.pos += 1
            return
        while True:
            name = self.string(key)
            self._take(b":", name, "':' after a member's name")
            yield name
            follow = self._next()
            self.pos += 1
            if follow == ord("}"):
                return
            if follow != ord(","):
                raise self.error("expected ',' or '}' after a member", name, self.pos - 1)

    def string(self, key: Optional[str] = None) -> str:
        """The string at the cursor."""
        m = self.match(_STRING_RE)
        if m is None:
            raise self.error("expected a string", key)
        return _decode(m.group(), self, key, m.start())

    def scalar(self, key: Optional[str] = None) -> Any:
        """The string, number, literal or short flat list at the cursor (see the module docstring)."""
        m = self.match(_VALUE_RE)
        if m is None:
            raise self.error(f"expected a string, a number or a flat list of at most {MAX_LIST} of them "
                             "(nested values are refused)", key)
        return _decode(m.group(), self, key, m.start())

    def skip(self, key: Optional[str] = None) -> None:
        """Pass over a scalar (as :meth:`scalar` takes them) or an object of them, keeping nothing."""
        if not self.at_object():
            self.scalar(key)
            return
        for name in self.members(key):
            self.scalar(name)

    def end(self) -> None:
        """Only whitespace may follow the document."""
        if self._next() != -1:
            raise self.error("unexpected data after the end of the document")


def decode_string(token: bytes, scanner: JsonScanner, key: Optional[str] = None) -> str:
    """The text of a string token (quotes included) matched by :data:`STRING`."""
    if b"\\" not in token:
        try:
            return token[1:-1].decode("utf-8")
        except ValueError as exc:
            raise scanner.error(str(exc), key) from None
    return str(_decode(token, scanner, key, scanner.pos))


def _decode(token: Data, scanner: JsonScanner, key: Optional[str], at: int) -> Any:
    raw = bytes(token)
    if raw in _LITERALS:
        return _LITERALS[raw]
    try:
        if raw[:1] == b'"' and b"\\" not in raw:
            return raw[1:-1].decode("utf-8")
        value: Any = json.loads(raw.decode("utf-8"))
    except ValueError as exc:  # bad UTF-8, an integer of thousands of digits, ...
        raise scanner.error(str(exc), key, at) from None
    return value

