"""Tensor slices: TF's ``shape_and_slices`` strings, ``TensorSliceProto`` and boxes.

A :class:`TensorSlice` keeps TensorFlow's representation, one ``(start, length)``
extent per dimension where length ``-1`` means "the whole dimension". Geometry is
done on *boxes*: tuples of concrete ``(start, stop)`` pairs, obtained with
:meth:`TensorSlice.box` once the full shape is known.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from functools import lru_cache
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from .protos import tensor_bundle_pb2 as pb

__all__ = ["TensorSlice", "Box", "parse_shape_and_slice", "format_shape_and_slice",
           "full_box", "box_shape", "intersect", "box_volume", "boxes_tile"]

Box = Tuple[Tuple[int, int], ...]
FULL = -1


@dataclass(frozen=True)
class TensorSlice:
    """One slice of a tensor: ``extents[d] = (start, length)``, length -1 = whole dim."""

    extents: Tuple[Tuple[int, int], ...]

    @property
    def rank(self) -> int:
        return len(self.extents)

    @classmethod
    def full(cls, rank: int) -> "TensorSlice":
        return cls(tuple((0, FULL) for _ in range(rank)))

    @classmethod
    def from_box(cls, box: Box) -> "TensorSlice":
        return cls(tuple((start, stop - start) for start, stop in box))

    @classmethod
    def parse(cls, text: str, rank: Optional[int] = None) -> "TensorSlice":
        """Parse TF's slice syntax: ``"0,5:-"`` (``start,length`` or ``-`` per dim)."""
        if text == "":
            raise InvalidArgumentError("empty slice string")
        extents = []
        for item in text.split(":"):
            if item == "-":
                extents.append((0, FULL))
                continue
            fields = item.split(",")
            if len(fields) != 2:
                raise InvalidArgumentError(f"bad slice {text!r}: expected 'start,length' or '-', got {item!r}")
            try:
                start, length = int(fields[0]), int(fields[1])
            except ValueError:
                raise InvalidArgumentError(f"bad slice {text!r}: {item!r} is not two integers") from None
            if start < 0 or length < 0:
                raise InvalidArgumentError(f"bad slice {text!r}: negative start or length in {item!r}")
            extents.append((start, length))
        if rank is not None and len(extents) != rank:
            raise InvalidArgumentError(f"slice {text!r} has {len(extents)} dims, expected {rank}")
        return cls(tuple(extents))

    def __str__(self) -> str:
        return ":".join("-" if length == FULL else f"{start},{length}" for start, length in self.extents)

    @classmethod
    def from_proto(cls, proto: "pb.TensorSliceProto") -> "TensorSlice":
        extents = []
        for ext in proto.extent:
            if ext.HasField("length"):
                extents.append((int(ext.start), int(ext.length)))
            else:
                extents.append((int(ext.start), FULL))
        return cls(tuple(extents))

    def to_proto(self) -> "pb.TensorSliceProto":
        proto = pb.TensorSliceProto()
        for start, length in self.extents:
            ext = proto.extent.add()
            if length != FULL:
                ext.start = start
                ext.length = length
        return proto

    def is_full(self) -> bool:
        return all(length == FULL for _, length in self.extents)

    def box(self, shape: Sequence[int]) -> Box:
        """The concrete ``(start, stop)`` box of this slice in a tensor of ``shape``."""
        if len(shape) != self.rank:
            raise InvalidArgumentError(f"slice {self} has rank {self.rank}, tensor has shape {list(shape)}")
        out = []
        for (start, length), dim in zip(self.extents, shape):
            if length == FULL:
                if start != 0:
                    raise InvalidArgumentError(f"slice {self}: a whole-dimension extent must start at 0")
                out.append((0, dim))
            else:
                if start < 0 or length < 0 or start + length > dim:
                    raise InvalidArgumentError(f"slice {self} does not fit in shape {list(shape)}")
                out.append((start, start + length))
        return tuple(out)


@lru_cache(maxsize=1 << 14)  # a save parses each piece's spec several times (plan, validation, writing)
def parse_shape_and_slice(spec: str) -> Tuple[Tuple[int, ...], Optional[TensorSlice]]:
    """Parse a ``shape_and_slices`` entry like ``"10 20 0,5:-"``.

    Returns the full shape and the slice (both immutable: results are cached). An empty
    ``spec`` means "the whole tensor" and returns ``((), None)``; callers then use the
    tensor's own shape.
    """
    if spec == "":
        return (), None
    fields = spec.split(" ")
    if len(fields) < 2:
        raise InvalidArgumentError(f"bad shape_and_slice {spec!r}: expected '<dims...> <slice>'")
    try:
        shape = tuple(int(f) for f in fields[:-1])
    except ValueError:
        raise InvalidArgumentError(f"bad shape_and_slice {spec!r}: dims must be integers") from None
    if any(d < 0 for d in shape):
        raise InvalidArgumentError(f"bad shape_and_slice {spec!r}: negative dimension")
    tslice = TensorSlice.parse(fields[-1], rank=len(shape))
    tslice.box(shape)  # validates that it fits
    return shape, tslice


def format_shape_and_slice(shape: Sequence[int], tslice: TensorSlice) -> str:
    return " ".join(str(int(d)) for d in shape) + " " + str(tslice)


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(d)) for d in shape)


def box_shape(box: Box) -> Tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_volume(box: Box) -> int:
    n = 1
    for start, stop in box:
        n *= stop - start
    return n


def intersect(a: Box, b: Box) -> Optional[Box]:
    """The common part of two boxes, or ``None`` when they do not overlap (or it is empty)."""
    out = []
    for (a0, a1), (b0, b1) in zip(a, b):
        lo, hi = max(a0, b0), min(a1, b1)
        if lo >= hi:
            return None
        out.append((lo, hi))
    return tuple(out)


def boxes_tile(boxes: Iterable[Box], region: Box) -> Optional[str]:
    """Check that ``boxes`` cover ``region`` exactly once.

    Returns ``None`` when they do, else a short description of the first problem
    (a box outside the region, an overlap, or a gap). Runs in about linear time:
    the boxes are painted on the grid their own edges make, falling back to
    pairwise checks only when that grid would be huge.
    """
    boxes = [b for b in boxes if box_volume(b) > 0]
    if len(boxes) == 1 and boxes[0] == region:  # the common case (one piece per region): nothing to paint
        return None
    for box in boxes:
        if intersect(box, region) != box:
            return f"slice {list(box)} lies outside {list(region)}"
    total = sum(box_volume(b) for b in boxes)
    rank = len(region)
    edges = [sorted({region[d][0], region[d][1]} | {b[d][0] for b in boxes} | {b[d][1] for b in boxes})
             for d in range(rank)]
    cells = 1
    for e in edges:
        cells *= len(e) - 1
    if rank and cells <= 4 * len(boxes) + 65536:
        counts = np.zeros([len(e) - 1 for e in edges], dtype=np.int32)
        for box in boxes:
            counts[tuple(slice(bisect.bisect_left(e, a), bisect.bisect_left(e, b))
                          for e, (a, b) in zip(edges, box))] += 1
        if (counts > 1).any():
            return "slices overlap"
        if (counts == 0).any():
            return f"slices cover {total} of {box_volume(region)} elements (gap)"
        return None
    for i, box in enumerate(boxes):
        for other in boxes[:i]:
            if intersect(box, other) is not None:
                return f"slices {list(other)} and {list(box)} overlap"
    if total != box_volume(region):
        return f"slices cover {total} of {box_volume(region)} elements (gap)"
    return None
