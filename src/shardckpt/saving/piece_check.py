"""The io client's check of every client's pieces: streaming over the clients' tables, vectorized.

Input: each client's packed :class:`~.piece_table.PieceTable`, in rank order (what the
io client gathered). Output: ``None`` when, per key, every holder names one dtype and
one global shape and the (non-empty) boxes of all holders tile the tensor exactly (no
gap, no overlap, none outside); else the message of
:func:`shardckpt.saving.agreement.problems_message` for the keys that fail, naming ranks
and keys (the same text as the tests' reference check, which holds every piece as a
Python object).

How, so that 10^6 pieces cost well under a second and a few MiB:

1. **One table at a time** (:meth:`PieceCheck.add`), in rank order: a client's table is
   decoded into column arrays; its keys become integer ids (a client whose compressed key
   stream is byte for byte one seen before reuses its ids without decoding it: under FSDP
   every client holds the same keys); its dtypes and shapes are compared with the first
   holder's, per key, as arrays (a mismatch makes the key *suspect*). Its boxes (dims past
   a key's rank padded as ``[0, 1)`` of a dim of extent 1) then extend, per key, a run
   along one axis: a box that spans the tensor but along axis ``a`` and starts where the
   key's run ends (0 at first) extends it to its stop; a box that spans everything
   completes a key nothing covered yet. Per key only the run's axis and end are kept, so
   slices along one dimension dealt to clients in rank order (FSDP, TP, ZeRO) are checked
   in O(keys) memory, whatever the number of clients. A box inside a key already
   complete overlaps (suspect); anything else (a client with several boxes of a key, boxes
   cut along several axes, out of rank order) sends the key to step 2. The table is then
   dropped.
2. **Keys that need their boxes together** (only if there are any): every table is read
   once more for just those keys' boxes. Per key, when every box spans the tensor but
   along one axis, the boxes sorted by their start must run ``0 = start_0, stop_i =
   start_{i+1}, stop_last = dim``: checked for every such key at once. Any other key
   (boxes cut along several axes) is painted on the grid its box edges make (coverage
   counted with a corner-sum array: every cell covered exactly once), once per distinct
   (shape, sorted boxes): keys sliced alike are checked once.
3. **Only suspect keys** are described in words: the tables are read once more and only
   those keys' entries become Python objects, for the reference message code.

Boxes outside their tensor make a key suspect; empty boxes cover nothing and are
skipped; a key whose run does not reach the end of its tensor (and has elements) is
suspect. A key is declared fine only by the exact checks above; whatever is suspect is
judged by the reference code, so a suspect that turns out fine costs time, never a wrong
verdict.
"""

from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import ShardingValidationError
from ..format.tensor_slice import boxes_tile, full_box
from .piece_table import PieceTable, unpack_table

__all__ = ["PieceCheck", "check_packed"]

_SECTION_CACHE = 64  # distinct key sections remembered (clients of one pipeline stage share theirs)
Holder = Tuple[int, int, Tuple[int, ...], List[Tuple[Tuple[int, int], ...]]]


def check_packed(packed: Sequence[str]) -> Optional[str]:
    """Check every client's packed pieces (``packed[r]``: client ``r``'s); ``None`` when they agree.

    Raises :class:`ShardingValidationError` naming the client whose table does not decode.
    """
    check = PieceCheck()
    for rank, text in enumerate(packed):
        table = _decode(rank, text)
        try:
            check.add(table)
        except ShardingValidationError as exc:
            raise ShardingValidationError(f"client {rank}'s {exc}") from None
    return check.finish(lambda rank: _decode(rank, packed[rank]))


def _decode(rank: int, text: str) -> PieceTable:
    try:
        return unpack_table(text)
    except ShardingValidationError as exc:
        raise ShardingValidationError(f"client {rank}'s {exc}") from None


class PieceCheck:
    """The state of the check between tables: key ids, each key's first dtype and shape, its run."""

    def __init__(self) -> None:
        self._names: List[str] = []
        self._ids: Dict[str, int] = {}
        self._sections: Dict[bytes, np.ndarray] = {}
        self._dims = 1  # D: the widest rank seen (at least 1)
        self._dtype = np.zeros(0, np.int32)
        self._ndim = np.zeros(0, np.int16)
        self._shape = np.ones((0, 1), np.int64)
        self._suspect = np.zeros(0, bool)
        self._later = np.zeros(0, bool)  # keys checked in step 2
        self._axis = np.zeros(0, np.int16)  # the axis of a key's run (-1: none yet)
        self._end = np.zeros(0, np.int64)  # where a key's run ends along it
        self._done = np.zeros(0, bool)  # the run covers the whole tensor
        self._nonempty: List[bool] = []  # per rank: described any piece

    @property
    def ranks(self) -> int:
        return len(self._nonempty)

    # -- step 1: one table at a time --------------------------------------------------------------------------

    def add(self, table: PieceTable) -> None:
        """Fold in the next rank's table (ranks in order)."""
        self._nonempty.append(len(table) > 0)
        if not len(table):
            return
        before = len(self._names)
        ids = self._key_ids(table)
        nd = table.ndims.astype(np.int64)
        width = max(1, int(nd.max()))
        if width > self._dims:
            pad = np.ones((self._shape.shape[0], width - self._dims), np.int64)
            self._shape = np.concatenate([self._shape, pad], axis=1)
            self._dims = width
        if len(self._names) > self._dtype.shape[0]:
            self._grow(len(self._names))
        shapes = _padded(table.shapes, nd, self._dims, 1)
        new = ids >= before
        if new.all():
            self._dtype[ids] = table.dtypes
            self._ndim[ids] = nd
            self._shape[ids] = shapes
        else:
            if new.any():
                fresh = ids[new]
                self._dtype[fresh] = table.dtypes[new]
                self._ndim[fresh] = nd[new]
                self._shape[fresh] = shapes[new]
            differ = ((self._dtype[ids] != table.dtypes) | (self._ndim[ids] != nd)
                      | (self._shape[ids] != shapes).any(axis=1))
            self._suspect[ids[differ]] = True
        nb = table.nboxes.astype(np.int64)
        self._later[ids[nb > 1]] = True
        keys, lo, hi = _rows(table, ids, nd, nb, self._dims, nb == 1)
        skip = self._suspect[keys] | self._later[keys]
        if skip.any():
            keep = ~skip
            keys, lo, hi = keys[keep], lo[keep], hi[keep]
        self._extend(keys, lo, hi)

    def _extend(self, keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Extend each key's run by its one box of this client (``keys`` distinct)."""
        bound = self._shape[keys]
        bad = ((hi < lo) | (lo < 0) | (hi > bound)).any(axis=1)
        self._suspect[keys[bad]] = True
        live = ~(bad | (hi == lo).any(axis=1))  # empty boxes cover nothing
        if not live.all():
            keys, lo, hi, bound = keys[live], lo[live], hi[live], bound[live]
        full = (lo == 0) & (hi == bound)
        cut = self._dims - full.sum(axis=1)
        self._later[keys[cut > 1]] = True
        done = self._done[keys]
        self._suspect[keys[done]] = True  # inside a tensor its run covers already: an overlap
        whole = (cut == 0) & ~done
        started = self._end[keys] > 0
        self._suspect[keys[whole & started]] = True
        self._done[keys[whole & ~started]] = True
        one = (cut == 1) & ~done
        if not one.any():
            return
        keys, lo, hi, bound = keys[one], lo[one], hi[one], bound[one]
        axis = np.argmin(full[one], axis=1)
        at = np.arange(keys.shape[0])
        start, stop = lo[at, axis], hi[at, axis]
        current = self._axis[keys]
        follows = ((current < 0) | (current == axis)) & (start == self._end[keys])
        self._later[keys[~follows]] = True  # out of order, or along another axis: told in step 2
        keys, axis, stop, bound = keys[follows], axis[follows], stop[follows], bound[follows]
        self._axis[keys] = axis
        self._end[keys] = stop
        self._done[keys] = stop == bound[np.arange(keys.shape[0]), axis]

    def _key_ids(self, table: PieceTable) -> np.ndarray:
        section = table.key_section
        cached = self._sections.get(section)
        if cached is not None:
            return cached
        names = table.keys()
        if len(set(names)) != len(names):
            seen: set = set()
            twice = next(n for n in names if n in seen or seen.add(n))  # type: ignore[func-returns-value]
            raise ShardingValidationError(f"piece descriptions name key {twice!r} twice")
        ids = np.empty(len(names), np.int64)
        for i, name in enumerate(names):
            key_id = self._ids.get(name)
            if key_id is None:
                key_id = self._ids[name] = len(self._names)
                self._names.append(name)
            ids[i] = key_id
        if len(self._sections) < _SECTION_CACHE:
            self._sections[section] = ids
        return ids

    def _grow(self, need: int) -> None:
        cap = max(need, 2 * self._dtype.shape[0], 64)
        extra = cap - self._dtype.shape[0]

        def more(a: np.ndarray, fill: int) -> np.ndarray:
            return np.concatenate([a, np.full((extra,) + a.shape[1:], fill, a.dtype)])

        self._dtype, self._ndim, self._shape = more(self._dtype, 0), more(self._ndim, 0), more(self._shape, 1)
        self._suspect, self._later, self._done = more(self._suspect, 0), more(self._later, 0), more(self._done, 0)
        self._axis, self._end = more(self._axis, -1), more(self._end, 0)

    # -- steps 2 and 3 ----------------------------------------------------------------------------------------

    def finish(self, reload: Callable[[int], PieceTable]) -> Optional[str]:
        """The verdict; ``reload(rank)`` gives a rank's table again (only when some key needs it)."""
        n = len(self._names)
        if n == 0:
            return None
        suspect = self._suspect[:n]
        later = self._later[:n] & ~suspect
        has_elements = (self._shape[:n] > 0).all(axis=1)
        suspect[~later & ~self._done[:n] & has_elements] = True  # a run that stops short: a gap
        if later.any():
            chunks = []
            for rank in range(self.ranks):
                if self._nonempty[rank]:
                    table = reload(rank)
                    ids = self._key_ids(table)
                    nd, nb = table.ndims.astype(np.int64), table.nboxes.astype(np.int64)
                    chunks.append(_rows(table, ids, nd, nb, self._dims, later[ids]))
            if chunks:
                keys, lo, hi = (np.concatenate(c) for c in zip(*chunks))
                self._tile(later, keys, lo, hi)
        if not suspect.any():
            return None
        return self._describe(np.flatnonzero(suspect), reload)

    def _tile(self, among: np.ndarray, keys: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
        """Of the keys in ``among``, mark those whose boxes (rows ``keys, lo, hi``) do not tile them suspect."""
        dims = self._dims
        n = among.shape[0]
        suspect = self._suspect[:n]
        shape = self._shape[:n]
        bound = shape[keys]
        bad = ((hi < lo) | (lo < 0) | (hi > bound)).any(axis=1)
        suspect[keys[bad]] = True
        keep = ~(bad | (hi == lo).any(axis=1))  # empty boxes cover nothing
        if not keep.all():
            keys, lo, hi, bound = keys[keep], lo[keep], hi[keep], bound[keep]
        held = np.bincount(keys, minlength=n) > 0
        suspect[among & ~held & (shape > 0).all(axis=1)] = True  # nothing covers a tensor that has elements
        if not keys.shape[0]:
            return
        order = np.argsort(keys, kind="stable")
        keys, lo, hi, bound = keys[order], lo[order], hi[order], bound[order]
        del order
        starts = np.flatnonzero(np.concatenate(([True], keys[1:] != keys[:-1])))
        seg_key = keys[starts]
        lengths = np.diff(np.append(starts, keys.shape[0]))
        full = (lo == 0) & (hi == bound)
        cut = dims - full.sum(axis=1)  # axes a box does not span whole
        axis = np.where(cut == 1, np.argmin(full, axis=1), -1)
        del full
        seg_top = np.maximum.reduceat(axis, starts)
        seg_low = np.minimum.reduceat(np.where(axis >= 0, axis, dims), starts)
        general = np.logical_or.reduceat(cut > 1, starts) | ((seg_top >= 0) & (seg_low != seg_top))
        seg_axis = np.where(seg_top >= 0, seg_top, 0)
        segment = np.repeat(np.arange(starts.shape[0]), lengths)
        along = seg_axis[segment]
        first = lo[np.arange(keys.shape[0]), along]
        last = hi[np.arange(keys.shape[0]), along]
        by_start = np.lexsort((first, segment))
        first, last = first[by_start], last[by_start]
        ends = starts + lengths - 1
        ok = np.ones(keys.shape[0], bool)
        ok[:-1] = last[:-1] == first[1:]
        ok[ends] = True
        runs = np.logical_and.reduceat(ok, starts) & (first[starts] == 0) & (last[ends] == shape[seg_key, seg_axis])
        suspect[seg_key[~runs & ~general]] = True
        del by_start, first, last, ok, segment, along
        verdicts: Dict[Tuple[Tuple[int, ...], bytes], bool] = {}
        for s in np.flatnonzero(general):
            key = int(seg_key[s])
            if suspect[key]:
                continue
            a, b = int(starts[s]), int(starts[s]) + int(lengths[s])
            rank = int(self._ndim[key])
            block = np.concatenate([lo[a:b, :rank], hi[a:b, :rank]], axis=1)
            block = block[np.lexsort(block.T[::-1])]
            dims_of = tuple(int(v) for v in shape[key, :rank])
            signature = (dims_of, block.tobytes())
            verdict = verdicts.get(signature)
            if verdict is None:
                verdict = verdicts[signature] = _grid_tiles(block[:, :rank], block[:, rank:], dims_of)
            if not verdict:
                suspect[key] = True

    def _describe(self, keys: np.ndarray, reload: Callable[[int], PieceTable]) -> Optional[str]:
        """The reference message for the suspect ``keys``, from their entries in every rank's table."""
        from .agreement import problems_message

        wanted = np.zeros(len(self._names), bool)
        wanted[keys] = True
        holders: Dict[str, List[Holder]] = {self._names[k]: [] for k in keys.tolist()}
        for rank in range(self.ranks):
            if not self._nonempty[rank]:
                continue
            table = reload(rank)
            ids = self._key_ids(table)
            positions = np.flatnonzero(wanted[ids]).tolist()
            for pos, (dtype, shape, boxes) in zip(positions, table.entries(positions)):
                holders[self._names[int(ids[pos])]].append((rank, dtype, shape, boxes))
        return problems_message(holders, self._nonempty)


def _rows(table: PieceTable, ids: np.ndarray, nd: np.ndarray, nb: np.ndarray, dims: int,
          wanted: np.ndarray) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The boxes of the keys at the ``wanted`` positions of ``table``: ``(key ids, starts, stops)``, one row a box,
    ``dims`` columns (dims past a key's rank: ``[0, 1)``)."""
    if nd.shape[0] and nd.min() == nd.max() and (nb == 1).all():  # the common case: a row per key, one rank
        rank = int(nd[0])
        pairs = table.boxes.reshape(-1, 2 * rank) if rank else np.zeros((nd.shape[0], 0), table.boxes.dtype)
        keys = ids
        if not wanted.all():
            keys, pairs = keys[wanted], pairs[wanted]
        lo = np.zeros((keys.shape[0], dims), np.int64)
        hi = np.ones((keys.shape[0], dims), np.int64)
        lo[:, :rank] = pairs[:, 0::2]
        hi[:, :rank] = pairs[:, 1::2]
        return keys, lo, hi
    row_nd = np.repeat(nd, nb)
    pairs = _padded(table.boxes, 2 * row_nd, 2 * dims, 0)
    keys = np.repeat(ids, nb)
    take = np.repeat(wanted, nb)
    if not take.all():
        keys, pairs, row_nd = keys[take], pairs[take], row_nd[take]
    lo = np.ascontiguousarray(pairs[:, 0::2])
    hi = np.where(np.arange(dims) < row_nd[:, None], pairs[:, 1::2], 1)
    return keys, lo, hi


def _padded(flat: np.ndarray, counts: np.ndarray, width: int, fill: int) -> np.ndarray:
    """``flat`` cut into rows of ``counts[i]`` values, each padded with ``fill`` to ``width`` columns."""
    rows = counts.shape[0]
    out = np.full((rows, width), fill, np.int64)
    if rows and counts.min() == counts.max():  # every row as long: a reshape
        step = int(counts[0])
        out[:, :step] = flat.reshape(rows, step)
        return out
    if not flat.shape[0]:
        return out
    offsets = np.cumsum(counts) - counts
    col = np.arange(width)
    mask = col < counts[:, None]
    out[mask] = flat[(offsets[:, None] + col)[mask]]
    return out


def _grid_tiles(lo: np.ndarray, hi: np.ndarray, shape: Tuple[int, ...]) -> bool:
    """Whether the boxes ``[lo, hi)`` (inside ``shape``, none empty) cover it exactly once.

    The boxes are painted on the grid their edges make: +-1 at each box's 2^rank corners of a
    corner-sum array, whose running sums along every axis count each cell's coverage. A grid
    far larger than the boxes (edges that do not line up) goes to the reference check.
    """
    rank = len(shape)
    edges = [np.unique(np.concatenate(([0, shape[d]], lo[:, d], hi[:, d]))) for d in range(rank)]
    cells = 1
    for e in edges:
        cells *= e.shape[0] - 1
    if cells > 4 * lo.shape[0] + 65536 or rank > 12:
        boxes = [tuple((int(a), int(b)) for a, b in zip(x, y)) for x, y in zip(lo.tolist(), hi.tolist())]
        return boxes_tile(boxes, full_box(shape)) is None
    at_lo = [np.searchsorted(edges[d], lo[:, d]) for d in range(rank)]
    at_hi = [np.searchsorted(edges[d], hi[:, d]) for d in range(rank)]
    corners = np.zeros([e.shape[0] for e in edges], np.int64)
    for corner in itertools.product((0, 1), repeat=rank):
        index = tuple(at_hi[d] if c else at_lo[d] for d, c in enumerate(corner))
        np.add.at(corners, index, -1 if sum(corner) % 2 else 1)
    for d in range(rank):
        corners = np.cumsum(corners, axis=d)
    cover = corners[tuple(slice(0, -1) for _ in range(rank))]
    return bool((cover == 1).all())
