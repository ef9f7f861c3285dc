"""Property tests (hypothesis) for the format building blocks and whole bundles.

SSTable round trips over random keys/values/block sizes/restart intervals, the
index-key shortening rules, OrderedCode (order preservation and slice-key round
trips), tensor-slice parsing and geometry, string-tensor encoding, and
save/restore of random tensors, whole and as random grids of slices.
"""

from __future__ import annotations

import itertools
import os
import struct
import tempfile
from typing import List, Sequence, Tuple

import numpy as np
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.bundle_writer import BundleWriter
from shardckpt.format.dtypes import ALL_DTYPES, DType
from shardckpt.format.ordered_code import (
    decode_tensor_name_slice,
    encode_tensor_name_slice,
    write_num_increasing,
    write_signed_num_increasing,
)
from shardckpt.format.sstable import TableWriter, _short_successor, _shortest_separator, read_table
from shardckpt.format.strings import decode_strings, encode_strings
from shardckpt.format.tensor_slice import (
    TensorSlice,
    box_volume,
    boxes_tile,
    format_shape_and_slice,
    intersect,
    parse_shape_and_slice,
)
from shardckpt.io import restore_v2, save_v2
from shardckpt.storage.location import Location

FAST = settings(max_examples=300, deadline=None)
MEDIUM = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=100, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
UINT64_MAX = (1 << 64) - 1


def cmp(a: object, b: object) -> int:
    return (a > b) - (a < b)  # type: ignore[operator]


# ---------------------------------------------------------------------------
# SSTable
# ---------------------------------------------------------------------------

_EDGE_BYTES = st.sampled_from([0x00, 0x01, 0x61, 0x62, 0x7F, 0x80, 0xFE, 0xFF])
short_keys = st.one_of(
    st.binary(max_size=12),
    st.lists(_EDGE_BYTES, max_size=16).map(bytes),  # lots of shared prefixes and 0x00 / 0xff runs
)


@st.composite
def tables(draw: st.DrawFn) -> Tuple[int, int, List[Tuple[bytes, bytes]]]:
    block_size = draw(st.integers(64, 4096))
    restart_interval = draw(st.integers(1, 32))
    long_keys = st.builds(lambda seed, n: (seed * n)[:n], st.binary(min_size=1, max_size=4),
                          st.integers(block_size // 2, 3 * block_size))
    keys = draw(st.lists(st.one_of(short_keys, short_keys, short_keys, long_keys), unique=True, max_size=120))
    values = st.one_of(st.binary(max_size=64), st.binary(max_size=64),
                       st.builds(lambda seed, n: (seed * n)[:n], st.binary(min_size=1, max_size=3),
                                 st.integers(0, 3 * block_size)))
    vals = draw(st.lists(values, min_size=len(keys), max_size=len(keys)))
    return block_size, restart_interval, list(zip(sorted(keys), vals))


def _build(pairs: Sequence[Tuple[bytes, bytes]], **kwargs: int) -> bytes:
    writer = TableWriter(**kwargs)
    for k, v in pairs:
        writer.add(k, v)
    return writer.finish()


@MEDIUM
@given(tables())
def test_sstable_round_trip(table: Tuple[int, int, List[Tuple[bytes, bytes]]]) -> None:
    block_size, restart_interval, pairs = table
    data = _build(pairs, block_size=block_size, restart_interval=restart_interval)
    assert list(read_table(data)) == pairs


@settings(max_examples=6, deadline=None)
@given(st.integers(2000, 4000), st.integers(0, 2 ** 32 - 1))
def test_sstable_round_trip_default_params(count: int, seed: int) -> None:
    """A few thousand entries, several 256 KiB blocks, TF's parameters."""
    rnd = np.random.default_rng(seed)
    numbers = np.unique(rnd.integers(0, 2 ** 40, size=count))
    keys = sorted(struct.pack(">Q", int(n))[2:] + b"/var" * int(rnd.integers(0, 4)) for n in numbers)
    pairs = [(k, bytes([int(rnd.integers(256))]) * int(rnd.integers(0, 300))) for k in keys]
    data = _build(pairs)
    assert list(read_table(data)) == pairs


@FAST
@given(short_keys, short_keys)
@example(b"a", b"xxx")
@example(b"k05705/", b"k05706/")
@example(b"ab", b"abc")
@example(b"a\xff", b"b")
@example(b"", b"\x00")
def test_shortest_separator(a: bytes, b: bytes) -> None:
    assume(a != b)
    a, b = min(a, b), max(a, b)
    sep = _shortest_separator(a, b)
    assert a <= sep < b
    assert len(sep) <= len(a) or sep == a


@FAST
@given(short_keys)
@example(b"")
@example(b"\xff\xff")
@example(b"\xff\xfe\xff")
def test_short_successor(k: bytes) -> None:
    succ = _short_successor(k)
    assert succ >= k
    assert len(succ) <= len(k)


# ---------------------------------------------------------------------------
# OrderedCode and slice keys
# ---------------------------------------------------------------------------

_BOUNDARIES = sorted({s * ((1 << e) + d) for e in range(64) for d in (-1, 0, 1) for s in (1, -1)
                      if INT64_MIN <= s * ((1 << e) + d) <= INT64_MAX} | {0, INT64_MIN, INT64_MAX})
int64s = st.one_of(st.integers(INT64_MIN, INT64_MAX), st.sampled_from(_BOUNDARIES), st.integers(-300, 300))
uint64s = st.one_of(st.integers(0, UINT64_MAX), st.sampled_from([b for b in _BOUNDARIES if b >= 0] + [UINT64_MAX]),
                    st.integers(0, 70000))


@FAST
@given(int64s, int64s)
@example(INT64_MIN, INT64_MAX)
@example(-1, 0)
@example(63, 64)
@example(-64, -65)
def test_signed_num_increasing_preserves_order(a: int, b: int) -> None:
    assert cmp(write_signed_num_increasing(a), write_signed_num_increasing(b)) == cmp(a, b)


def test_signed_num_increasing_boundaries_sorted() -> None:
    encoded = [write_signed_num_increasing(v) for v in _BOUNDARIES]
    assert encoded == sorted(encoded)
    assert len(set(encoded)) == len(encoded)


def test_signed_num_increasing_spec_vectors() -> None:
    vectors = {0: "80", 1: "81", 2: "82", 63: "bf", 64: "c040", 100: "c064", 8191: "dfff", 8192: "e02000",
               -1: "7f", -64: "40", -65: "3fbf", 0x424242: "f0424242", -2048: "3800"}
    for value, hexed in vectors.items():
        assert write_signed_num_increasing(value).hex() == hexed, value


@FAST
@given(uint64s, uint64s)
@example(0, UINT64_MAX)
@example(255, 256)
def test_num_increasing_preserves_order(a: int, b: int) -> None:
    assert cmp(write_num_increasing(a), write_num_increasing(b)) == cmp(a, b)


extents_st = st.lists(st.tuples(int64s, int64s), max_size=6)


@FAST
@given(st.binary(max_size=40), extents_st)
@example(b"a\x00\xffz", [(100, 100), (0, -1)])
@example(b"", [])
@example(b"\x00\x01", [(INT64_MIN, INT64_MAX)])
def test_slice_key_round_trip(name: bytes, extents: List[Tuple[int, int]]) -> None:
    key = encode_tensor_name_slice(name, extents)
    assert key[:1] == b"\x00"
    assert decode_tensor_name_slice(key) == (name, extents)


@FAST
@given(st.binary(max_size=12), st.integers(0, 4), st.data())
def test_slice_key_order_matches_extent_order(name: bytes, rank: int, data: st.DataObject) -> None:
    one = data.draw(st.lists(st.tuples(int64s, int64s), min_size=rank, max_size=rank))
    two = data.draw(st.lists(st.tuples(int64s, int64s), min_size=rank, max_size=rank))
    k1, k2 = encode_tensor_name_slice(name, one), encode_tensor_name_slice(name, two)
    assert cmp(k1, k2) == cmp(tuple(one), tuple(two))


def test_slice_key_spec_vectors() -> None:
    assert encode_tensor_name_slice(b"emb", [(4, 3), (0, 4)]).hex() == "00656d62000101028483" + "8084"
    assert encode_tensor_name_slice(b"t", [(0, 2), (0, -1)]).hex() == "0074000101028082807f"
    assert encode_tensor_name_slice(b"a\x00\xffz", [(100, 100), (0, -1)]).hex() == \
        "006100ffff007a00010102c064c064807f"


# ---------------------------------------------------------------------------
# tensor slices
# ---------------------------------------------------------------------------

@st.composite
def shapes_and_slices(draw: st.DrawFn, min_rank: int = 1, max_rank: int = 5,
                      max_dim: int = 1 << 40) -> Tuple[Tuple[int, ...], TensorSlice]:
    rank = draw(st.integers(min_rank, max_rank))
    shape = tuple(draw(st.lists(st.one_of(st.integers(0, 12), st.integers(0, max_dim)), min_size=rank,
                                max_size=rank)))
    extents = []
    for dim in shape:
        if draw(st.booleans()):
            extents.append((0, -1))
        else:
            start = draw(st.integers(0, dim))
            extents.append((start, draw(st.integers(0, dim - start))))
    return shape, TensorSlice(tuple(extents))


@FAST
@given(shapes_and_slices())
def test_tensor_slice_text_round_trip(shape_slice: Tuple[Tuple[int, ...], TensorSlice]) -> None:
    _, tslice = shape_slice
    assert TensorSlice.parse(str(tslice)) == tslice
    assert TensorSlice.parse(str(tslice), rank=tslice.rank) == tslice
    assert TensorSlice.from_proto(tslice.to_proto()) == tslice


@FAST
@given(shapes_and_slices())
@example(((10, 20), TensorSlice(((0, 5), (0, -1)))))
def test_shape_and_slice_round_trip(shape_slice: Tuple[Tuple[int, ...], TensorSlice]) -> None:
    shape, tslice = shape_slice
    spec = format_shape_and_slice(shape, tslice)
    assert parse_shape_and_slice(spec) == (shape, tslice)
    box = tslice.box(shape)
    assert all(0 <= a <= b <= d for (a, b), d in zip(box, shape))
    assert TensorSlice.from_box(box).box(shape) == box


@st.composite
def box_pairs(draw: st.DrawFn) -> Tuple[tuple, tuple]:
    rank = draw(st.integers(1, 4))

    def box() -> tuple:
        out = []
        for _ in range(rank):
            a = draw(st.integers(0, 20))
            out.append((a, a + draw(st.integers(0, 20))))
        return tuple(out)
    return box(), box()


def _contains(outer: tuple, inner: tuple) -> bool:
    return all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


@FAST
@given(box_pairs())
def test_intersect(pair: Tuple[tuple, tuple]) -> None:
    a, b = pair
    ab, ba = intersect(a, b), intersect(b, a)
    assert ab == ba
    if ab is not None:
        assert _contains(a, ab) and _contains(b, ab)
        assert box_volume(ab) > 0
        assert intersect(ab, a) == ab
    else:  # really disjoint (or touching / empty): no cell in common
        cells_a = set(itertools.product(*(range(x, y) for x, y in a)))
        cells_b = set(itertools.product(*(range(x, y) for x, y in b)))
        assert not cells_a & cells_b


@st.composite
def grids(draw: st.DrawFn, max_rank: int = 3, max_dim: int = 9) -> Tuple[Tuple[int, ...], List[tuple]]:
    """A shape and a random axis-aligned grid partition of it into boxes."""
    rank = draw(st.integers(1, max_rank))
    shape = tuple(draw(st.lists(st.integers(1, max_dim), min_size=rank, max_size=rank)))
    intervals = []
    for dim in shape:
        cuts = sorted(draw(st.sets(st.integers(1, dim - 1), max_size=dim - 1)) if dim > 1 else [])
        bounds = [0] + cuts + [dim]
        intervals.append(list(zip(bounds[:-1], bounds[1:])))
    boxes = [tuple(combo) for combo in itertools.product(*intervals)]
    return shape, draw(st.permutations(boxes))


@FAST
@given(grids(), st.data())
def test_boxes_tile_grid(grid: Tuple[Tuple[int, ...], List[tuple]], data: st.DataObject) -> None:
    shape, boxes = grid
    region = tuple((0, d) for d in shape)
    assert boxes_tile(boxes, region) is None
    i = data.draw(st.integers(0, len(boxes) - 1))
    assert boxes_tile(boxes[:i] + boxes[i + 1:], region) is not None  # a gap
    assert boxes_tile(boxes + [boxes[i]], region) is not None  # an overlap
    j = data.draw(st.integers(0, len(boxes)))
    assert boxes_tile(boxes[:j] + [boxes[i]] + boxes[j:], region) is not None


# ---------------------------------------------------------------------------
# string tensors
# ---------------------------------------------------------------------------

@FAST
@given(st.lists(st.one_of(st.binary(max_size=20), st.binary(min_size=120, max_size=400)), max_size=30))
def test_strings_round_trip(items: List[bytes]) -> None:
    data, crc = encode_strings(items)
    assert decode_strings(data, len(items), crc) == items
    assert len(data) >= len(items) + 4


# ---------------------------------------------------------------------------
# whole bundles
# ---------------------------------------------------------------------------

NUMERIC = [d for d in ALL_DTYPES if d.is_numeric]
PLAIN_NUMERIC = [d for d in NUMERIC if not d.name.startswith("q")]  # what save_v2 infers from NumPy


@st.composite
def numeric_arrays(draw: st.DrawFn, dtypes: Sequence[DType] = NUMERIC) -> Tuple[DType, np.ndarray]:
    dt = draw(st.sampled_from(list(dtypes)))
    shape = tuple(draw(st.lists(st.integers(0, 4), max_size=3)))
    n = int(np.prod(shape, dtype=np.int64))
    raw = draw(st.binary(min_size=n * dt.itemsize, max_size=n * dt.itemsize))  # NaN payloads and all
    return dt, np.frombuffer(raw, dtype=dt.numpy).reshape(shape)


@st.composite
def string_arrays(draw: st.DrawFn) -> np.ndarray:
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    n = int(np.prod(shape, dtype=np.int64))
    items = draw(st.lists(st.binary(max_size=30), min_size=n, max_size=n))
    out = np.empty(n, dtype=object)
    out[:] = items
    return out.reshape(shape)


bundle_keys = st.binary(min_size=1, max_size=20).filter(lambda k: k[:1] != b"\x00")


def _same_bytes(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    if want.dtype == object:
        assert list(got.reshape(-1)) == list(want.reshape(-1))
    else:
        assert got.dtype == want.dtype
        assert got.tobytes() == want.tobytes()


@SLOW
@given(st.dictionaries(bundle_keys, st.one_of(numeric_arrays(), numeric_arrays(), string_arrays().map(
    lambda a: (None, a))), min_size=1, max_size=8), st.booleans())
def test_bundle_round_trip_all_dtypes(items: dict, big_endian: bool) -> None:
    """BundleWriter with explicit dtypes (quantized ones included), little- and big-endian."""
    if big_endian:
        items = {k: v for k, v in items.items() if v[0] is not None}  # strings: see test_hostile_input
        assume(items)
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ck")
        with BundleWriter(Location.of(prefix), big_endian=big_endian) as w:
            for key, (dt, value) in items.items():
                w.add(key, value, dtype=dt)
        with BundleReader(Location.of(prefix)) as reader:
            assert reader.keys() == sorted(items)
            for key, (dt, value) in items.items():
                if dt is not None:
                    assert reader.dtype(key).enum == dt.enum
                _same_bytes(reader.read(key), value)
                reader.verify(key)


@SLOW
@given(st.dictionaries(bundle_keys, st.one_of(numeric_arrays(PLAIN_NUMERIC).map(lambda t: t[1]),
                                              string_arrays()), min_size=1, max_size=8))
def test_save_v2_round_trip(items: dict) -> None:
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ck")
        keys = list(items)
        save_v2(prefix, keys, [""] * len(keys), [items[k] for k in keys])
        with BundleReader(Location.of(prefix)) as reader:
            assert reader.keys() == sorted(keys)
            for key in keys:
                _same_bytes(reader.read(key), items[key])
        dtypes = ["string" if items[k].dtype == object else items[k].dtype for k in keys]
        for key, got in zip(keys, restore_v2(prefix, keys, [""] * len(keys), dtypes)):
            _same_bytes(got, items[key])


SLICE_DTYPES = ["float32", "int64", "bool", "complex128", "uint16", "int8", "float16", "string"]


def _random_values(rnd: np.random.Generator, shape: Tuple[int, ...], dtype: str) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "string":
        out = np.empty(n, dtype=object)
        out[:] = [bytes(rnd.integers(0, 256, size=rnd.integers(0, 6), dtype=np.uint8)) for _ in range(n)]
        return out.reshape(shape)
    raw = rnd.integers(0, 256, size=n * np.dtype(dtype).itemsize, dtype=np.uint8).tobytes()
    return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()


def _spec(shape: Sequence[int], box: Sequence[Tuple[int, int]], full_dash: Sequence[bool]) -> str:
    parts = []
    for (a, b), d, dash in zip(box, shape, full_dash):
        parts.append("-" if dash and (a, b) == (0, d) else f"{a},{b - a}")
    return " ".join(str(d) for d in shape) + " " + ":".join(parts)


@st.composite
def regions(draw: st.DrawFn, shape: Tuple[int, ...]) -> List[Tuple[int, int]]:
    out = []
    for d in shape:
        a = draw(st.integers(0, d))
        out.append((a, a + draw(st.integers(0, d - a))))
    return out


@SLOW
@given(grids(max_rank=3, max_dim=7).filter(lambda g: len(g[0]) >= 2), st.sampled_from(SLICE_DTYPES),
       st.integers(0, 2 ** 32 - 1), st.data())
def test_sliced_save_and_region_reads(grid: Tuple[Tuple[int, ...], List[tuple]], dtype: str, seed: int,
                                      data: st.DataObject) -> None:
    shape, boxes = grid
    value = _random_values(np.random.default_rng(seed), shape, dtype)
    dash = data.draw(st.lists(st.booleans(), min_size=len(shape), max_size=len(shape)))
    specs = [_spec(shape, box, dash) for box in boxes]
    pieces = [value[tuple(slice(a, b) for a, b in box)] for box in boxes]
    np_dtype = "string" if dtype == "string" else dtype
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ck")
        save_v2(prefix, ["v"] * len(boxes), specs, pieces)
        (full,) = restore_v2(prefix, ["v"], [""], [np_dtype])
        _same_bytes(full, value)
        with BundleReader(Location.of(prefix)) as reader:
            assert reader.keys() == [b"v"]
            assert len(reader.pieces("v")) == (len(boxes) if len(boxes) > 1 else 1)
            for _ in range(4):
                region = data.draw(regions(shape))
                want = value[tuple(slice(a, b) for a, b in region)]
                (got,) = restore_v2(prefix, ["v"], [_spec(shape, region, dash)], [np_dtype])
                _same_bytes(got, want)
                _same_bytes(reader.read_region("v", tuple(region)), want)


@SLOW
@given(st.integers(1, 5), st.integers(1, 300), st.sampled_from(["float32", "int16", "complex64", "float64"]),
       st.booleans(), st.data())
def test_region_reads_of_whole_tensors(rows: int, cols: int, dtype: str, big_endian: bool,
                                       data: st.DataObject) -> None:
    """Region reads of an unsliced tensor take the positional-read paths (tiny runs, long runs)."""
    shape = (rows, 3, cols)
    value = _random_values(np.random.default_rng(rows * 1000 + cols), shape, dtype)
    with tempfile.TemporaryDirectory() as d:
        prefix = os.path.join(d, "ck")
        with BundleWriter(Location.of(prefix), big_endian=big_endian) as w:
            w.add("v", value)
        with BundleReader(Location.of(prefix)) as reader:
            for _ in range(5):
                region = data.draw(regions(shape))
                want = value[tuple(slice(a, b) for a, b in region)]
                _same_bytes(reader.read_region("v", tuple(region)), want)
