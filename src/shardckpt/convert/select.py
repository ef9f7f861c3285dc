"""Which tensors a conversion keeps, what they are called, and how they are changed.

Order of the rules, for each source tensor:

1. ``keep`` (if given, the name must match one of them) and ``drop`` (it must match none)
   select tensors by their **source** name (``re.search``);
2. a preset (e.g. ``bert``) renames, transposes or drops;
3. ``name_map`` (``--map FILE``: a JSON object of exact old -> new names) renames;
4. each ``rename`` pair (``REGEX=REPL``, ``re.sub``) is applied in turn;
5. ``transpose`` regexes (matched against the source name) reverse the axes;
6. ``casts`` (``--dtype DTYPE`` for every floating-point tensor, or ``REGEX=DTYPE``) convert
   values explicitly. Nothing is ever cast otherwise.

Two tensors ending with one name is an error naming both.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Pattern, Sequence, Tuple

from ..errors import InvalidArgumentError
from ..format.dtypes import DType, as_dtype
from .model import TensorInfo

__all__ = ["Rules", "Planned", "plan", "parse_rename", "parse_cast", "load_name_map"]

#: A preset maps a source name to ``(new name, transpose)`` or ``None`` (left out).
Preset = Callable[[str], Optional[Tuple[str, bool]]]

_FLOATS = {"float16", "bfloat16", "float32", "float64", "float8_e5m2", "float8_e4m3fn"}


def _compile(pattern: str, what: str) -> Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise InvalidArgumentError(f"{what}: not a regular expression {pattern!r}: {exc}") from None


def parse_rename(text: str) -> Tuple[Pattern[str], str]:
    """``'REGEX=REPL'`` -> (compiled REGEX, REPL); the first ``=`` separates them."""
    if "=" not in text:
        raise InvalidArgumentError(f"--rename wants REGEX=REPLACEMENT, got {text!r}")
    pattern, repl = text.split("=", 1)
    return _compile(pattern, "--rename"), repl


def parse_cast(text: str) -> Tuple[Optional[Pattern[str]], DType]:
    """``'bfloat16'`` (every floating-point tensor) or ``'REGEX=bfloat16'``."""
    pattern, _, name = text.rpartition("=")
    try:
        dtype = as_dtype(name)
    except Exception:
        raise InvalidArgumentError(f"--dtype: unknown dtype {name!r}") from None
    if not dtype.is_numeric:
        raise InvalidArgumentError(f"--dtype: cannot cast to {dtype.name}")
    return (_compile(pattern, "--dtype") if pattern else None), dtype


def load_name_map(text: str, path: str = "") -> Dict[str, str]:
    try:
        mapping = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
        raise InvalidArgumentError(f"--map file is not JSON: {exc}", path=path or None) from None
    if not isinstance(mapping, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in mapping.items()):
        raise InvalidArgumentError("--map file must be a JSON object of names to names", path=path or None)
    return mapping


@dataclass
class Rules:
    keep: List[str] = field(default_factory=list)
    drop: List[str] = field(default_factory=list)
    rename: List[str] = field(default_factory=list)
    name_map: Dict[str, str] = field(default_factory=dict)
    transpose: List[str] = field(default_factory=list)
    casts: List[str] = field(default_factory=list)
    preset: Optional[Preset] = None


@dataclass(frozen=True)
class Planned:
    """One output tensor: where it comes from and what is done to it."""

    source: TensorInfo
    out: TensorInfo
    transpose: bool
    cast: Optional[DType]


def plan(infos: Sequence[TensorInfo], rules: Rules) -> Tuple[List[Planned], List[str]]:
    """Apply ``rules`` to the source tensors: ``(outputs, names left out)``."""
    keep = [_compile(p, "--keep") for p in rules.keep]
    drop = [_compile(p, "--drop") for p in rules.drop]
    renames = [parse_rename(r) for r in rules.rename]
    transpose = [_compile(p, "--transpose") for p in rules.transpose]
    casts = [parse_cast(c) for c in rules.casts]
    out: List[Planned] = []
    left: List[str] = []
    taken: Dict[str, str] = {}
    for info in infos:
        name = info.name
        if (keep and not any(p.search(name) for p in keep)) or any(p.search(name) for p in drop):
            left.append(name)
            continue
        flip = False
        if rules.preset is not None:
            mapped = rules.preset(name)
            if mapped is None:
                left.append(name)
                continue
            name, flip = mapped
        name = rules.name_map.get(name, name)
        for pattern, repl in renames:
            name = pattern.sub(repl, name)
        if any(p.search(info.name) for p in transpose):
            flip = not flip
        if flip and len(info.shape) < 2:
            flip = False
        cast: Optional[DType] = None
        for cast_pattern, dtype in casts:
            if (info.dtype.name in _FLOATS if cast_pattern is None else cast_pattern.search(info.name)):
                cast = dtype
        if cast is not None and not info.dtype.is_numeric:
            raise InvalidArgumentError(f"--dtype cannot cast a {info.dtype.name} tensor", key=info.name)
        if cast is not None and cast.name == info.dtype.name:
            cast = None
        if name in taken:
            raise InvalidArgumentError(f"both {taken[name]!r} and {info.name!r} would be written as {name!r}")
        taken[name] = info.name
        shape = tuple(reversed(info.shape)) if flip else info.shape
        out.append(Planned(info, TensorInfo(name, cast or info.dtype, shape), flip, cast))
    return out, left
