"""``diff``: compare two checkpoints of any formats, one tensor pair at a time.

For each name: present on one side only, a different dtype or shape, or the
elements that differ. Two comparisons:

* **bit for bit** (the default): two tensors are equal when every element has the same
  bytes, so ``0.0`` and ``-0.0`` differ, and so do NaNs with other payloads — what a
  checkpoint round trip must preserve. For a numeric tensor that differs, the largest
  absolute and relative difference of the values are reported too (zero when only the
  bits differ).
* **by value** (``numeric=True``, or any tolerance): elements are equal when
  ``|a - b| <= atol + rtol * |b|`` (NumPy's ``allclose`` rule); NaNs equal NaNs at the
  same places, infinities must match exactly. Integers and booleans compare exactly
  unless a tolerance is given; strings always compare exactly.

Values are compared in chunks of :data:`_CHUNK` elements (as float64, complex128 for
complex), so memory stays at one tensor per side plus a chunk. A ``keys`` pattern that
is not a regular expression raises :class:`~shardckpt.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np

from ..errors import InvalidArgumentError
from ..format.strings import as_bytes_elements
from .api import open_source
from .model import NO_PROGRESS, Progress

__all__ = ["diff", "DiffResult", "TensorDiff"]

_CHUNK = 1 << 20


@dataclass
class TensorDiff:
    name: str
    equal: bool
    max_abs: Optional[float] = None
    max_rel: Optional[float] = None
    mismatched: int = 0
    problem: str = ""
    bits_only: bool = False  #: bitwise comparison: every differing element has the same value (``-0.0``, NaN payloads)


@dataclass
class DiffResult:
    a: str
    b: str
    only_a: List[str] = field(default_factory=list)
    only_b: List[str] = field(default_factory=list)
    tensors: List[TensorDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """True when both sides hold the same keys and every tensor compared equal."""
        return not self.only_a and not self.only_b and all(t.equal for t in self.tensors)

    def as_dict(self) -> Dict[str, Any]:
        """The comparison as a plain dict (what ``shardckpt diff --json`` prints)."""
        return {"a": self.a, "b": self.b, "equal": self.equal, "only_a": self.only_a, "only_b": self.only_b,
                "tensors": [t.__dict__ for t in self.tensors]}


def _compare_numeric(a: np.ndarray, b: np.ndarray, atol: float, rtol: float, out: TensorDiff) -> None:
    kind = np.complex128 if a.dtype.kind == "c" or b.dtype.kind == "c" else np.float64
    fa, fb = a.reshape(-1), b.reshape(-1)
    max_abs = 0.0
    max_rel = 0.0
    bad = 0
    for start in range(0, fa.size, _CHUNK):
        with np.errstate(all="ignore"):
            x = fa[start:start + _CHUNK].astype(kind)
            y = fb[start:start + _CHUNK].astype(kind)
            same = (x == y) | (np.isnan(x) & np.isnan(y))
            d = np.abs(x - y)
            d = np.where(same, 0.0, np.where(np.isnan(d), np.inf, d))
            ay = np.abs(y)
            rel = np.where(d == 0, 0.0, np.where(ay > 0, d / np.where(ay > 0, ay, 1), np.inf))
            ok = same | (d <= atol + rtol * ay)
        if d.size:
            max_abs = max(max_abs, float(d.max()))
            max_rel = max(max_rel, float(rel.max()))
        bad += int(d.size - np.count_nonzero(ok))
    out.max_abs, out.max_rel, out.mismatched = max_abs, max_rel, bad
    out.equal = bad == 0


def _compare_bits(a: np.ndarray, b: np.ndarray, out: TensorDiff) -> None:
    """Element-wise byte equality; for numeric dtypes also the value differences of what differs."""
    n = a.size
    width = a.dtype.itemsize
    fa = np.ascontiguousarray(a).reshape(-1).view(np.uint8).reshape(n, width)
    fb = np.ascontiguousarray(b).reshape(-1).view(np.uint8).reshape(n, width)
    bad = 0
    for start in range(0, n, _CHUNK):
        bad += int(np.count_nonzero((fa[start:start + _CHUNK] != fb[start:start + _CHUNK]).any(axis=1)))
    out.mismatched, out.equal = bad, bad == 0
    if bad and a.dtype.kind not in "bOSU":  # numbers (bfloat16, float8 included): how far apart the values are
        values = TensorDiff(out.name, True)
        try:
            _compare_numeric(a, b, 0.0, 0.0, values)
        except (TypeError, ValueError):  # a dtype NumPy cannot widen: bytes only
            return
        out.max_abs, out.max_rel = values.max_abs, values.max_rel
        out.bits_only = values.mismatched == 0


def diff(a: str, b: str, *, atol: float = 0.0, rtol: float = 0.0, keys: Optional[str] = None,
         a_format: Optional[str] = None, b_format: Optional[str] = None, trust_pickle: bool = False,
         numeric: bool = False, progress: Progress = NO_PROGRESS) -> DiffResult:
    """Compare the checkpoints at ``a`` and ``b`` (see the module docstring).

    Bit for bit unless ``numeric`` is true or a tolerance (``atol``, ``rtol``) is given.
    """
    try:
        pattern = re.compile(keys) if keys else None
    except re.error as exc:
        raise InvalidArgumentError(f"keys {keys!r} is not a regular expression: {exc}") from None
    by_value = numeric or atol != 0 or rtol != 0
    result = DiffResult(a, b)
    with open_source(a, a_format, trust_pickle=trust_pickle) as sa, \
            open_source(b, b_format, trust_pickle=trust_pickle) as sb:
        ia = {i.name: i for i in sa.tensors() if pattern is None or pattern.search(i.name)}
        ib = {i.name: i for i in sb.tensors() if pattern is None or pattern.search(i.name)}
        result.only_a = sorted(set(ia) - set(ib))
        result.only_b = sorted(set(ib) - set(ia))
        set_total = getattr(progress, "set_total", None)
        if set_total is not None:
            set_total(sum(ia[n].nbytes for n in set(ia) & set(ib)))
        for name in sorted(set(ia) & set(ib)):
            x, y = ia[name], ib[name]
            td = TensorDiff(name, True)
            result.tensors.append(td)
            if x.dtype.name != y.dtype.name or x.shape != y.shape:
                td.equal = False
                td.problem = f"{x.dtype.name}{list(x.shape)} vs {y.dtype.name}{list(y.shape)}"
                continue
            va, vb = sa.read(name), sb.read(name)
            if not by_value and not (x.dtype.is_string or x.dtype.is_variant):
                _compare_bits(va, vb, td)
            elif x.dtype.is_string or x.dtype.is_variant:
                ea, eb = as_bytes_elements(va), as_bytes_elements(vb)
                td.mismatched = sum(p != q for p, q in zip(ea, eb))
                td.equal = td.mismatched == 0
            elif x.dtype.name == "bool" or (atol == 0 and rtol == 0 and x.dtype.numpy.kind in "iub"):
                ne = va.reshape(-1).view(np.uint8) != vb.reshape(-1).view(np.uint8) if x.dtype.name == "bool" \
                    else va != vb
                td.mismatched = int(np.count_nonzero(ne))
                td.equal = td.mismatched == 0
                if x.dtype.name != "bool":
                    _compare_numeric(va, vb, atol, rtol, td)
            else:
                _compare_numeric(va, vb, atol, rtol, td)
            progress(name, x.nbytes)
            del va, vb
    return result
