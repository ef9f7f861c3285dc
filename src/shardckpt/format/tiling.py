"""Do a sliced tensor's stored slices tile it exactly?

A tensor saved in slices has one index entry listing its slices (``BundleEntryProto.slices``)
and one entry per slice holding the bytes. The slices must cover the tensor's box
exactly once — no gap (some elements stored nowhere), no overlap (some stored twice,
possibly with different values) — and every slice entry must have the tensor's
dtype and the slice's shape. :func:`tiling_problem` says what is wrong, or ``None``;
:func:`check_tiling` raises :class:`~shardckpt.errors.CorruptIndexError` naming the
index file and the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from ..errors import CorruptIndexError, ShardckptError
from .tensor_slice import boxes_tile, full_box

if TYPE_CHECKING:  # pragma: no cover
    from .bundle_reader import BundleReader

__all__ = ["tiling_problem", "check_tiling"]


def tiling_problem(reader: "BundleReader", key: Union[str, bytes]) -> Optional[str]:
    """What is wrong with how ``key``'s slices cover it (``None``: fine, or not sliced).

    Slice entries whose dtype or shape disagree with the tensor are reported too.
    """
    try:
        pieces = reader.pieces(key)  # checks each slice entry's dtype and shape against the tensor
    except ShardckptError as exc:
        return exc.message
    if len(pieces) == 1 and pieces[0].slice is None:
        return None
    region = full_box(reader.shape(key))
    problem = boxes_tile([p.box for p in pieces], region)
    if problem is None:
        seen = set()
        for p in pieces:  # the same slice listed twice is an overlap boxes_tile may not see
            if p.box in seen and all(b > a for a, b in p.box):
                return f"slice {p.slice_spec} is listed twice (slices overlap)"
            seen.add(p.box)
    return problem


def check_tiling(reader: "BundleReader", key: Union[str, bytes]) -> None:
    """Raise :class:`CorruptIndexError` unless ``key``'s slices tile it exactly."""
    problem = tiling_problem(reader, key)
    if problem is not None:
        raise CorruptIndexError(f"stored slices do not tile the tensor exactly: {problem}",
                                path=reader.index_path, key=key)
