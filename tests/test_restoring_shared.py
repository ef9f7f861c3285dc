"""Shared pieces (``shardckpt.restoring.sharing``): a stored piece that several reads of one batch cut
across is read once, whole and checksummed, and cut into every read's destination.

Real bundles written by ``save_v2`` in many slicings, read back by sets of regions in other
arrangements (tilings, duplicates, a region that is a stored piece, reads naming their piece,
strided destinations, regions that leave pieces partly unread), on every engine mode; a
damaged piece is now caught by its checksum; a streaming plan counts the piece buffers in its
budget."""

from __future__ import annotations

import itertools
import threading
import time
from pathlib import Path
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np
import pytest

from shardckpt.errors import DataLossError
from shardckpt.io import save_v2
from shardckpt.restoring import BundleSource, Read, ReadGroup, RestorePlan, run
from shardckpt.restoring.sharing import PieceCut, Scratch, share

Box = Tuple[Tuple[int, int], ...]


def _spec(shape: Sequence[int], box: Box) -> str:
    extents = ":".join("-" if (a, b) == (0, d) else f"{a},{b - a}" for (a, b), d in zip(box, shape))
    return " ".join(str(d) for d in shape) + " " + extents


def _grid(shape: Sequence[int], cuts: Sequence[Sequence[int]]) -> List[Box]:
    """The boxes of the grid that ``cuts`` (inner cut points per dimension) make of ``shape``."""
    edges = [[0, *sorted(set(c)), d] for c, d in zip(cuts, shape)]
    spans = [list(zip(e[:-1], e[1:])) for e in edges]
    return [tuple(box) for box in itertools.product(*spans)]


def _random_cuts(rng: np.random.Generator, shape: Sequence[int]) -> List[List[int]]:
    return [sorted({int(x) for x in rng.integers(1, d, size=int(rng.integers(0, 3)))}) if d > 1 else []
            for d in shape]


def _save(tmp_path: Path, name: str, value: np.ndarray, pieces: List[Box]) -> str:
    prefix = str(tmp_path / name)
    shape = value.shape
    if len(pieces) == 1:
        save_v2(prefix, ["t", "other"], ["", ""], [value, np.arange(7, dtype=np.int32)])
    else:
        save_v2(prefix, ["t"] * len(pieces) + ["other"], [_spec(shape, b) for b in pieces] + [""],
                [value[tuple(slice(a, b) for a, b in box)] for box in pieces] + [np.arange(7, dtype=np.int32)])
    return prefix


def _index(box: Box) -> Tuple[slice, ...]:
    return tuple(slice(a, b) for a, b in box)


class _Counting(BundleSource):
    """A real bundle whose reads are recorded (key, region, named piece's box)."""

    def __init__(self, prefix: str) -> None:
        super().__init__(BundleSource.open(prefix).reader)
        self.lock = threading.Lock()
        self.reads: List[Tuple[Any, Any, Any]] = []

    def read(self, read: Read, session: Any, *, verify: bool) -> np.ndarray:
        with self.lock:
            self.reads.append((read.key, read.region, None if read.piece is None else read.piece.box))
        return super().read(read, session, verify=verify)


ARRANGEMENTS = [  # (shape, stored cuts, read cuts): the stored grid and a grid of regions that tiles it
    ((16, 12), [[4, 8, 12], []], [[], [3, 6, 9]]),  # row blocks read as columns (the transposed restore)
    ((16, 12), [[8], [6]], [[], [4, 8]]),  # a 2x2 grid read as three column stripes
    ((16, 12), [[], [6]], [[4, 8, 12], [3]]),  # column blocks read as a finer grid
    ((8, 6, 10), [[4], [], []], [[], [3], [5]]),  # rank 3: a leading split read by the inner two
    ((8, 6, 10), [[], [2, 4], []], [[2, 6], [], [3, 7]]),
    ((9, 7), [[3, 5], [4]], [[2, 7], [1, 5]]),  # uneven, nothing aligned
]


@pytest.mark.parametrize("shape,stored,wanted", ARRANGEMENTS)
@pytest.mark.parametrize("mode", ["deferred-1", "deferred-3", "streaming-1", "streaming-3"])
def test_regions_that_tile_a_tensor_get_exactly_their_values(tmp_path: Path, shape: Tuple[int, ...],
                                                             stored: List[List[int]], wanted: List[List[int]],
                                                             mode: str) -> None:
    value = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 3 + 1
    pieces = _grid(shape, stored)
    regions = _grid(shape, wanted)
    defer, workers = mode.split("-")[0] == "deferred", int(mode.split("-")[1])
    source = _Counting(_save(tmp_path, "b", value, pieces))
    with source:
        plan = RestorePlan.of(source, [ReadGroup(tuple(Read("t", r) for r in regions))], workers=workers,
                              defer=defer)
        got = run(plan) if defer else _streamed(plan)
    for region, array in zip(regions, got):
        np.testing.assert_array_equal(array, value[_index(region)])
    # every piece the regions cut across (not by whole trailing dimensions) is read once, whole
    cut_across = [p for p in pieces if sum(_overlaps(p, r) for r in regions) > 1 and
                  any(_overlaps(p, r) and any(c != q for c, q in zip(_common(p, r)[1:], p[1:])) for r in regions)]
    whole_reads = [region for key, region, _ in source.reads if key == "t" and region in pieces]
    for piece in cut_across:
        assert whole_reads.count(piece) == 1, (piece, source.reads)
    assert cut_across  # every arrangement here has some


def _streamed(plan: RestorePlan) -> List[np.ndarray]:
    got: List[np.ndarray] = []
    plan = RestorePlan(plan.source, tuple(ReadGroup(g.reads, got.extend, g.nbytes) for g in plan.groups),
                       plan.verify, plan.workers, plan.budget, False)
    assert run(plan) == []
    return got


def _overlaps(a: Box, b: Box) -> bool:
    return all(max(x0, y0) < min(x1, y1) for (x0, x1), (y0, y1) in zip(a, b))


def _common(a: Box, b: Box) -> Box:
    return tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))


@pytest.mark.parametrize("seed", range(12))
def test_random_arrangements_with_duplicates_pieces_and_strided_destinations(tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rank = int(rng.integers(2, 4))
    shape = tuple(int(d) for d in rng.integers(2, 9, size=rank))
    dtype = [np.float32, np.int16, np.float64, np.uint8][seed % 4]
    value = (np.arange(int(np.prod(shape))) % 251).astype(dtype).reshape(shape)
    pieces = _grid(shape, _random_cuts(rng, shape))
    regions = _grid(shape, _random_cuts(rng, shape))
    regions += [regions[int(i)] for i in rng.integers(0, len(regions), size=2)]  # asked twice
    regions += [pieces[int(rng.integers(0, len(pieces)))]]  # a region that is a stored piece
    lo = tuple(int(rng.integers(0, d)) for d in shape)
    regions += [tuple((a, int(rng.integers(a + 1, d + 1))) for a, d in zip(lo, shape))]  # any box
    with BundleSource.open(_save(tmp_path, "b", value, pieces)) as source:
        reads: List[Read] = []
        outs: List[Optional[np.ndarray]] = []
        for k, region in enumerate(regions):
            inside = [p for p in pieces if _common(p, region) == region]
            rshape = tuple(b - a for a, b in region)
            out = None
            if k % 3 == 1:  # a strided destination: every other element of a larger array
                big = np.zeros(tuple(2 * d for d in rshape), dtype)
                out = big[tuple(slice(None, None, 2) for _ in rshape)]
            if inside and k % 2:  # a read naming its stored piece, the region relative to it
                piece = source.piece_at("t", [a for a, _ in inside[0]])
                local = tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(region, inside[0]))
                reads.append(Read("t", local, out, piece))
            else:
                reads.append(Read("t", region, out))
            outs.append(out)
        reads.append(Read("other"))  # and a whole read of another tensor
        for defer, workers in ((True, 1), (True, 4), (False, 4)):
            for out in outs:
                if out is not None:
                    out[...] = 0
            plan = RestorePlan.of(source, [ReadGroup(tuple(reads))], workers=workers, defer=defer)
            got = run(plan) if defer else _streamed(plan)
            for region, out, array in zip(regions, outs, got):
                np.testing.assert_array_equal(array, value[_index(region)])
                if out is not None:
                    assert array is out
            np.testing.assert_array_equal(got[-1], np.arange(7, dtype=np.int32))


def test_a_region_that_is_a_stored_piece_receives_it_straight(tmp_path: Path) -> None:
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    pieces = [((0, 4), (0, 6)), ((4, 8), (0, 6))]
    with BundleSource.open(_save(tmp_path, "b", value, pieces)) as source:
        reads = [Read("t", ((0, 4), (0, 6))), Read("t", ((0, 8), (0, 3))), Read("t", ((0, 8), (3, 6)))]
        batch = share(source, reads).batch()
        cuts = [job for job in batch.jobs if isinstance(job, PieceCut)]
        assert len(cuts) == 2 and sum(job.nbytes for job in cuts) == 4 * 6 * 4  # the first piece: no buffer
        got = run(RestorePlan.of(source, reads, workers=2))
    for read, array in zip(reads, got):
        np.testing.assert_array_equal(array, value[_index(read.region)])


def test_parts_that_are_contiguous_ranges_are_read_straight_into_place(tmp_path: Path) -> None:
    value = np.arange(8 * 6, dtype=np.float32).reshape(8, 6)
    with BundleSource.open(_save(tmp_path, "b", value, [((0, 8), (0, 6))])) as source:
        rows = [Read("t", ((r, r + 2), (0, 6))) for r in range(0, 8, 2)]  # leading rows: one range each
        assert share(source, rows).batch().jobs == tuple(rows)
        cols = [Read("t", ((0, 8), (c, c + 3))) for c in (0, 3)]
        assert [type(job) for job in share(source, cols).batch().jobs] == [PieceCut]
        half = [Read("t", ((0, 8), (0, 3))), Read("t", ((0, 4), (3, 6)))]  # leaves part of the piece unread
        assert share(source, half).batch().jobs == tuple(half)


def _damage_piece(prefix: str, source: BundleSource, box: Box) -> None:
    """Flip one byte in the middle of the stored piece of ``t`` at ``box``."""
    piece = source.piece_at("t", [a for a, _ in box])
    assert piece is not None and piece.box == box
    data = Path(f"{prefix}.data-{piece.entry.shard_id:05d}-of-00001")
    raw = bytearray(data.read_bytes())
    raw[piece.entry.offset + piece.entry.size // 2] ^= 0x5A
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("defer", [True, False])
def test_a_damaged_piece_cut_by_several_regions_is_caught_by_its_checksum(tmp_path: Path, defer: bool) -> None:
    value = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    pieces = _grid(value.shape, [[4, 8, 12], []])
    prefix = _save(tmp_path, "b", value, pieces)
    with BundleSource.open(prefix) as source:
        _damage_piece(prefix, source, pieces[2])
    with BundleSource.open(prefix) as source:
        columns = [Read("t", ((0, 16), (c, c + 3))) for c in range(0, 12, 3)]
        plan = RestorePlan.of(source, [ReadGroup(tuple(columns))], workers=3, defer=defer)
        with pytest.raises(DataLossError) as caught:
            run(plan) if defer else _streamed(plan)
    assert "b.data-00000-of-00001" in str(caught.value) and "t" in str(caught.value)


def test_a_streaming_plan_counts_piece_buffers_in_its_budget(tmp_path: Path) -> None:
    value = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    pieces = _grid(value.shape, [[8], []])  # two pieces of 8 x 12 float32: 384 bytes each
    prefix = str(tmp_path / "b")
    names = [f"t{k}" for k in range(4)]
    save_v2(prefix, [n for n in names for _ in pieces], [_spec(value.shape, b) for _ in names for b in pieces],
            [value[_index(b)] for _ in names for b in pieces])
    events: List[str] = []
    lock = threading.Lock()

    class Recording(BundleSource):
        def read(self, read: Read, session: Any, *, verify: bool) -> np.ndarray:
            with lock:
                events.append(f"read {read.key}")
            time.sleep(0.05)  # long enough for the other threads to start any group admitted beside this one
            return super().read(read, session, verify=verify)

    def group(name: str) -> ReadGroup:
        columns = tuple(Read(name, ((0, 16), (c, c + 6))) for c in (0, 6))
        return ReadGroup(columns, lambda values: events.append(f"done {name}"), value.nbytes)

    for budget, alone in ((2 * value.nbytes, True), (8 * value.nbytes, False)):
        events.clear()
        with Recording(BundleSource.open(prefix).reader) as source:
            run(RestorePlan.of(source, [group(n) for n in names], workers=4, budget=budget, defer=False))
        # with the piece buffers (2 x 384 bytes a group) counted, a budget of two groups' values holds one group
        started = [int(e[-1]) for e in events if e.startswith("read")]
        finished = [int(e[-1]) for e in events if e.startswith("done")]
        assert finished == [0, 1, 2, 3]
        overlapped = any(events.index(f"done t{k}") > min(i for i, e in enumerate(events) if e == f"read t{k + 1}")
                         for k in range(3))
        assert overlapped is not alone, events
        assert sorted(started) == sorted(k for k in range(4) for _ in pieces)  # each piece once


@pytest.mark.parametrize("defer", [True, False])
def test_the_announcement_names_what_is_read_a_shared_piece_whole(tmp_path: Path, defer: bool) -> None:
    value = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    pieces = _grid(value.shape, [[8], []])
    announced: List[List[Tuple[Any, Any]]] = []

    class Announced(BundleSource):
        def announce(self, reads: Sequence[Read]) -> None:
            announced.append([(r.key, r.region) for r in reads])
            super().announce(reads)

    with Announced(BundleSource.open(_save(tmp_path, "b", value, pieces)).reader) as source:
        columns = tuple(Read("t", ((0, 16), (c, c + 4))) for c in (0, 4, 8))
        plan = RestorePlan.of(source, [ReadGroup(columns), Read("other")], workers=2, defer=defer)
        got = run(plan)
    assert sorted(announced[0], key=repr) == sorted([("t", p) for p in pieces] + [("other", None)], key=repr)
    for read, array in zip(columns, got):
        np.testing.assert_array_equal(array, value[_index(read.region)])


def test_a_run_reuses_piece_buffers_and_holds_one_per_running_job() -> None:
    scratch = Scratch(2)
    a, b = scratch.take(5000), scratch.take(9000)  # two jobs at once
    assert a.nbytes >= 5000 and b.nbytes >= 9000 and a.ctypes.data % 64 == 0 and b.ctypes.data % 64 == 0
    scratch.give(a)
    scratch.give(b)
    assert scratch.take(6000) is b  # the smallest that fits
    c = scratch.take(20000)  # none fits: the one left (a) is dropped for it
    assert scratch._free == [] and c.nbytes >= 20000
    for buf in (b, c, scratch.take(100)):
        scratch.give(buf)
    assert len(scratch._free) == 2 and {x.nbytes for x in scratch._free} == {b.nbytes, c.nbytes}  # the largest


@pytest.mark.parametrize("defer", [True, False])
def test_follow_ups_of_shared_reads_see_their_whole_region_once(tmp_path: Path, defer: bool) -> None:
    value = np.arange(16 * 12, dtype=np.float32).reshape(16, 12)
    pieces = _grid(value.shape, [[4, 8, 12], [6]])
    seen: List[Tuple[Box, np.ndarray]] = []
    lock = threading.Lock()

    def keep(region: Box) -> Any:
        def then(array: np.ndarray) -> None:
            with lock:
                seen.append((region, array.copy()))
        return then

    regions = _grid(value.shape, [[], [3, 6, 9]]) + [((5, 7), (0, 12)), ((1, 3), (1, 2))]  # the last: one piece
    done: List[int] = []
    with BundleSource.open(_save(tmp_path, "b", value, pieces)) as source:
        reads = tuple(Read("t", r, then=keep(r)) for r in regions)
        assert any(isinstance(job, PieceCut) for job in share(source, reads).batch().jobs)
        group = ReadGroup(reads, lambda values: done.append(len(seen)))
        got = run(RestorePlan.of(source, [group], workers=3, defer=defer))
    assert done == [len(regions)]  # every follow-up ran before the group was done
    assert sorted(r for r, _ in seen) == sorted(regions)
    for region, array in seen:
        np.testing.assert_array_equal(array, value[_index(region)])
    for region, array in zip(regions, got):
        np.testing.assert_array_equal(array, value[_index(region)])
