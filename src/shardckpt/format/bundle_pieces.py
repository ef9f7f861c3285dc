"""Where a tensor's values are stored: its pieces (the whole entry, or one per slice) and their boxes.

A tensor saved whole has one piece, its own entry. A sliced tensor's entry lists its
slices; each slice's bytes are under its own key (the tensor's key and the slice,
encoded by :func:`~shardckpt.format.ordered_code.encode_tensor_name_slice`). A
:class:`PieceLookup` finds the pieces of a key, or only those overlapping a region, and
checks each slice entry it looks up against the tensor's (same dtype, a whole entry,
the slice's shape): a rank that reads one chunk of a tensor sliced many ways looks up one
slice entry, not all of them. Nothing is read beyond the index.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ..errors import CorruptIndexError, InvalidArgumentError, NotFoundError
from .bundle_index import BundleIndex, KeyLike, key_bytes
from .ordered_code import encode_tensor_name_slice
from .protos import tensor_bundle_pb2 as pb
from .tensor_slice import Box, TensorSlice, box_shape, full_box, intersect

__all__ = ["StoredPiece", "PieceLookup", "region_box"]


def region_box(region: Any, shape: Tuple[int, ...], prefix: str, key: Union[str, bytes]) -> Box:
    """The box of ``region`` of a tensor of ``shape``: the whole tensor for ``None``, a
    :class:`TensorSlice` or its text form, or ``(start, stop)`` pairs (checked to fit)."""
    if region is None:
        return full_box(shape)
    if isinstance(region, (TensorSlice, str)):
        tslice = TensorSlice.parse(region, rank=len(shape)) if isinstance(region, str) else region
        return tslice.box(shape)
    box = tuple((int(a), int(b)) for a, b in region)
    if len(box) != len(shape) or any(not 0 <= a <= b <= d for (a, b), d in zip(box, shape)):
        raise InvalidArgumentError(f"region {list(box)} does not fit shape {list(shape)}", path=prefix, key=key)
    return box


class StoredPiece:
    """One stored block of a tensor: the whole tensor, or one slice of it.

    ``key`` is the index key holding the bytes (the encoded slice key for a
    slice), ``tensor_key`` the tensor's own key, ``slice`` the slice (``None`` for
    a whole entry) and ``box`` where the piece lies in the tensor.
    """

    __slots__ = ("box", "key", "entry", "tensor_key", "slice")

    def __init__(self, box: Box, key: bytes, entry: pb.BundleEntryProto, tensor_key: bytes,
                 tensor_slice: Optional[TensorSlice] = None) -> None:
        self.box = box
        self.key = key
        self.entry = entry
        self.tensor_key = tensor_key
        self.slice = tensor_slice

    @property
    def slice_spec(self) -> Optional[str]:
        """The slice in TF's text form (``"0,4:-"``), or ``None`` for a whole entry."""
        return None if self.slice is None else str(self.slice)

    def where(self) -> dict:
        """Keyword arguments naming this piece in an error: ``key`` and ``slice_spec``."""
        return {"key": self.tensor_key, "slice_spec": self.slice_spec}


class PieceLookup:
    """The stored pieces of the tensors of one :class:`BundleIndex` (checked slice entries are kept)."""

    def __init__(self, index: BundleIndex) -> None:
        self._index = index
        self._pieces: Dict[bytes, List[StoredPiece]] = {}  # sliced tensors' pieces, once checked
        self._starts: Dict[bytes, Dict[Tuple[int, ...], Any]] = {}  # piece_at: box start -> slice (or its piece)

    def pieces(self, key: KeyLike) -> List[StoredPiece]:
        """Where the tensor's values are stored: one piece, or one per slice."""
        kb = key_bytes(key)
        cached = self._pieces.get(kb)
        if cached is not None:
            return list(cached)
        index = self._index
        entry = index.entry(kb)
        shape = index.shape(kb)
        if not entry.slices:
            return [StoredPiece(full_box(shape), kb, entry, kb)]
        out = [self._slice_piece(kb, entry, tslice, box) for tslice, box in self._slice_boxes(kb, entry, shape)]
        self._pieces[kb] = out
        return list(out)

    def piece_at(self, key: KeyLike, start: Sequence[int]) -> Optional[StoredPiece]:
        """The stored piece of ``key`` whose box starts at ``start`` (``None``: no such piece).

        Only that piece's slice entry is looked up and checked (a rank that reads one
        chunk of a tensor sliced many ways looks up one entry, not all of them).
        """
        kb = key_bytes(key)
        start = tuple(int(a) for a in start)
        index = self._index
        starts = self._starts.get(kb)
        if starts is None:
            entry = index.entry(kb)
            shape = index.shape(kb)
            if not entry.slices:
                starts = {tuple(0 for _ in shape): StoredPiece(full_box(shape), kb, entry, kb)}
            else:
                starts = {tuple(a for a, _ in box): (tslice, box)
                          for tslice, box in self._slice_boxes(kb, entry, shape)}
            self._starts[kb] = starts  # two threads may both build it: the same dict either way
        found = starts.get(start)
        if found is None or isinstance(found, StoredPiece):
            return found
        piece = self._slice_piece(kb, index.entry(kb), found[0], found[1])
        starts[start] = piece
        return piece

    def piece_boxes(self, key: KeyLike) -> List[Box]:
        """Where the tensor's stored pieces lie (as :meth:`pieces` gives them), from its own entry
        only: the slice entries are looked up (and checked) when :meth:`pieces` is called."""
        kb = key_bytes(key)
        cached = self._pieces.get(kb)
        if cached is not None:
            return [p.box for p in cached]
        entry = self._index.entry(kb)
        shape = self._index.shape(kb)
        if not entry.slices:
            return [full_box(shape)]
        return [box for _, box in self._slice_boxes(kb, entry, shape)]

    def _slice_boxes(self, kb: bytes, entry: pb.BundleEntryProto,
                     shape: Tuple[int, ...]) -> Iterator[Tuple[TensorSlice, Box]]:
        for proto in entry.slices:
            tslice = TensorSlice.from_proto(proto)
            try:
                box = tslice.box(shape)
            except InvalidArgumentError as exc:
                raise CorruptIndexError(f"bad slice: {exc}", path=self._index.index_path, key=kb) from None
            yield tslice, box

    def _slice_piece(self, kb: bytes, entry: pb.BundleEntryProto, tslice: TensorSlice, box: Box) -> StoredPiece:
        """The stored piece of one listed slice (its entry looked up and checked against the tensor's)."""
        slice_key = encode_tensor_name_slice(kb, tslice.extents)
        index_path = self._index.index_path
        try:
            slice_entry = self._index.entry(slice_key)
        except NotFoundError:
            raise CorruptIndexError(f"slice {tslice} listed but its entry is missing",
                                    path=index_path, key=kb) from None
        if slice_entry.dtype != entry.dtype or slice_entry.slices or \
                tuple(int(d.size) for d in slice_entry.shape.dim) != box_shape(box):
            raise CorruptIndexError(f"slice {tslice} entry disagrees with the tensor's dtype or shape",
                                    path=index_path, key=kb)
        return StoredPiece(box, slice_key, slice_entry, kb, tslice)

    def overlapping(self, kb: bytes, box: Box) -> List[Tuple[StoredPiece, Box]]:
        """The stored pieces of ``kb`` that overlap ``box``, with the common part: only their slice
        entries are looked up (a region of a tensor sliced many ways costs a few lookups)."""
        entry = self._index.entry(kb)
        shape = self._index.shape(kb)
        if not entry.slices or kb in self._pieces or box == full_box(shape):
            pairs = [(p, intersect(p.box, box)) for p in self.pieces(kb)]
        else:
            pairs = [(self._slice_piece(kb, entry, tslice, pbox), intersect(pbox, box))
                     for tslice, pbox in self._slice_boxes(kb, entry, shape) if intersect(pbox, box) is not None]
        return [(p, c) for p, c in pairs if c is not None]


def relative(common: Box, piece: StoredPiece) -> Box:
    """``common`` (a box of the tensor inside ``piece``) relative to the piece's own start."""
    return tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, piece.box))
