"""The merge of serialized index entries against the protobuf merge it replaces.

:func:`shardckpt.format.merge.plan_merge` and :func:`merge_entries` edit serialized
``BundleEntryProto`` bytes (the ``shard_id`` field replaced, slice records appended)
instead of parsing, editing and serializing every entry. Checked here, over random
bundles (hypothesis): for entries protobuf wrote, the merged index is byte for byte what
the protobuf merge (the reference below: TensorFlow's ``MergeV2Checkpoints`` rules on
messages) writes, and the same errors are raised; for entries laid out otherwise (fields
out of order, explicit zeros, unknown fields, negative ids) every merged entry parses to
the same message; and any bytes the fast path accepts parse with protobuf to the fields it
reported.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from shardckpt.errors import AlreadyExistsError, CorruptIndexError, InvalidArgumentError, ShardckptError
from shardckpt.format.bundle_writer import make_header
from shardckpt.format.merge import _Layouts, index_bytes, merge_entries, plan_merge
from shardckpt.format.naming import data_filename, index_filename
from shardckpt.format.protos import tensor_bundle_pb2 as pb
from shardckpt.format.sstable import TableWriter, read_table

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

Items = List[Tuple[bytes, bytes]]
Input = Tuple[str, pb.BundleHeaderProto, Items]


# ---------------------------------------------------------------------------
# the reference: every entry a message (the merge before entries stayed serialized)
# ---------------------------------------------------------------------------

def _reference_combine(merged: Dict[bytes, pb.BundleEntryProto], key: bytes, entry: pb.BundleEntryProto,
                       source: str) -> None:
    existing = merged[key]
    if not existing.slices or not entry.slices:
        raise AlreadyExistsError(f"duplicate tensor encountered when merging prefix {source}", key=key)
    if existing.dtype != entry.dtype or existing.shape != entry.shape:
        raise InvalidArgumentError("slices of one tensor disagree on dtype or shape", key=key)
    existing.slices.extend(entry.slices)


def reference_plan(inputs: Sequence[Input]) -> Tuple[Dict[bytes, pb.BundleEntryProto], List[str]]:
    merged: Dict[bytes, pb.BundleEntryProto] = {}
    new_ids: Dict[str, int] = {}
    for prefix, header, items in inputs:
        for key, value in items:
            entry = pb.BundleEntryProto()
            try:
                entry.ParseFromString(value)
            except Exception:
                raise CorruptIndexError("unparsable entry", key=key) from None
            if key in merged:
                _reference_combine(merged, key, entry, prefix)
                continue
            if not 0 <= entry.shard_id < header.num_shards:
                raise CorruptIndexError("shard_id out of range", key=key)
            source = data_filename(prefix, entry.shard_id, header.num_shards)
            entry.shard_id = new_ids.setdefault(source, len(new_ids))
            merged[key] = entry
    return merged, list(new_ids)


def reference_entries(parts: Sequence[Tuple[str, Items]]) -> Dict[bytes, pb.BundleEntryProto]:
    merged: Dict[bytes, pb.BundleEntryProto] = {}
    for name, items in parts:
        for key, value in items:
            entry = pb.BundleEntryProto.FromString(value)
            if key in merged:
                _reference_combine(merged, key, entry, name)
            else:
                merged[key] = entry
    return merged


def _outcome(run):  # type: ignore[no-untyped-def]
    try:
        return run(), None
    except ShardckptError as exc:
        return None, type(exc)


# ---------------------------------------------------------------------------
# random entries and bundles
# ---------------------------------------------------------------------------

dims = st.lists(st.one_of(st.integers(0, 9), st.integers(0, 1 << 62), st.just(-1)), max_size=4)
extents = st.lists(st.tuples(st.one_of(st.just(0), st.integers(0, 1 << 40)),
                             st.one_of(st.none(), st.integers(1, 1 << 40))), min_size=0, max_size=3)


def _slice(spec: List[Tuple[int, Optional[int]]]) -> pb.TensorSliceProto:
    proto = pb.TensorSliceProto()
    for start, length in spec:
        extent = proto.extent.add(start=start)
        if length is not None:
            extent.length = length
    return proto


@st.composite
def entries(draw, sliced: Optional[bool] = None, dtype: Optional[int] = None,  # type: ignore[no-untyped-def]
            shape: Optional[List[int]] = None, num_shards: int = 300) -> pb.BundleEntryProto:
    entry = pb.BundleEntryProto(
        dtype=draw(st.one_of(st.integers(0, 40), st.sampled_from([127, 128, 20000]))) if dtype is None else dtype,
        shard_id=draw(st.integers(0, num_shards - 1)),
        offset=draw(st.one_of(st.just(0), st.integers(0, 1 << 45))),
        size=draw(st.one_of(st.just(0), st.integers(0, 1 << 45))),
        crc32c=draw(st.one_of(st.just(0), st.integers(0, (1 << 32) - 1))))
    for size in (draw(dims) if shape is None else shape):
        entry.shape.dim.add(size=size)
    if sliced is None:
        sliced = draw(st.booleans())
    if sliced:
        for spec in draw(st.lists(extents, min_size=1, max_size=2)):
            entry.slices.append(_slice(spec))
    return entry


def _fields(entry: pb.BundleEntryProto) -> List[bytes]:
    """The serialized fields of ``entry``, one by one, in number order."""
    out = []
    for name in ("dtype", "shape", "shard_id", "offset", "size", "crc32c"):
        part = pb.BundleEntryProto()
        if name == "shape":
            part.shape.CopyFrom(entry.shape)
        else:
            setattr(part, name, getattr(entry, name))
        out.append(part.SerializeToString())
    for proto in entry.slices:
        part = pb.BundleEntryProto()
        part.slices.append(proto)
        out.append(part.SerializeToString())
    return [f for f in out if f]


def _unusual(entry: pb.BundleEntryProto, how: int) -> bytes:
    """``entry`` serialized as protobuf would not: same message, other bytes."""
    fields = _fields(entry)
    if how == 0:  # fields in reverse order
        return b"".join(reversed(fields))
    if how == 1:  # an explicit zero offset after the crc
        return entry.SerializeToString() + b"\x20\x00"
    if how == 2:  # an unknown field
        return entry.SerializeToString() + b"\x40\x07"
    if how == 3:  # the shard id written twice (the last one counts)
        return b"\x18\x05" + entry.SerializeToString() if entry.shard_id else entry.SerializeToString() + b"\x18\x00"
    # a dim with a name
    named = pb.BundleEntryProto()
    named.CopyFrom(entry)
    named.shape.dim.add(size=3, name="d")
    return named.SerializeToString()


NAMES = [b"a", b"b", b"b/c", b"\x00slice", b"z" * 40]


@st.composite
def bundles(draw, unusual: bool = False) -> List[Input]:  # type: ignore[no-untyped-def]
    # tensors shared by the bundles: (dtype, shape), sometimes disagreeing on purpose
    tensors = {name: (draw(st.integers(0, 3)), draw(st.lists(st.integers(0, 300), max_size=3)))
               for name in NAMES}
    out: List[Input] = []
    for b in range(draw(st.integers(1, 4))):
        num_shards = draw(st.integers(1, 3))
        header = pb.BundleHeaderProto.FromString(make_header(num_shards))
        items: Items = []
        for name in draw(st.lists(st.sampled_from(NAMES), unique=True)):
            dtype, shape = tensors[name]
            if draw(st.integers(0, 9)) == 0:  # a bundle that disagrees on the shape
                shape = shape + [1]
            entry = draw(entries(dtype=dtype, shape=shape, num_shards=num_shards + (draw(st.integers(0, 20)) == 0)))
            value = entry.SerializeToString()
            if unusual and draw(st.booleans()):
                value = _unusual(entry, draw(st.integers(0, 4)))
            if draw(st.integers(0, 30)) == 0:
                value = value[:-1] if value else b"\xff"  # does not parse (usually)
            items.append((name, value))
        out.append((f"/tmp/in{b}/part", header, sorted(items)))
    return out


def _parsed(entries: Dict[bytes, bytes]) -> Dict[bytes, pb.BundleEntryProto]:
    return {k: pb.BundleEntryProto.FromString(bytes(v)) for k, v in entries.items()}


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------

@SETTINGS
@given(bundles())
def test_plan_merge_writes_the_bytes_of_the_protobuf_merge(inputs: List[Input]) -> None:
    got, got_error = _outcome(lambda: plan_merge(inputs))
    want, want_error = _outcome(lambda: reference_plan(inputs))
    assert got_error == want_error
    if want is not None:
        merged, sources = want
        assert got.sources == sources
        reference = index_bytes({k: v.SerializeToString() for k, v in merged.items()}, max(1, len(sources)))
        assert got.index(max(1, len(sources))) == reference


@SETTINGS
@given(bundles(unusual=True))
def test_plan_merge_of_unusual_bytes_gives_the_same_messages(inputs: List[Input]) -> None:
    got, got_error = _outcome(lambda: plan_merge(inputs))
    want, want_error = _outcome(lambda: reference_plan(inputs))
    assert got_error == want_error
    if want is not None:
        merged, sources = want
        assert got.sources == sources
        assert _parsed(got.entries) == merged


@SETTINGS
@given(bundles(unusual=True))
def test_merge_entries_gives_the_protobuf_merge(inputs: List[Input]) -> None:
    parts = [(prefix, items) for prefix, _, items in inputs]
    try:
        want = reference_entries(parts)
    except ShardckptError as exc:
        with pytest.raises(type(exc)):
            merge_entries(parts)
        return
    except Exception:  # bytes that do not parse: gathered entries are always protobuf's own
        return
    assert _parsed(merge_entries(parts)) == want


@SETTINGS
@given(entries(), st.integers(0, 4), st.binary(max_size=3), st.integers(0, 100))
@example(pb.BundleEntryProto(dtype=1, shard_id=7), 0, b"\x12\x05", 2)  # a shape longer than the entry
@example(pb.BundleEntryProto(dtype=1, shard_id=7), 0, b"\x12\x02\x12\x00", 2)  # a shape with an empty dim
def test_layout_reports_what_protobuf_parses(entry: pb.BundleEntryProto, how: int, junk: bytes, at: int) -> None:
    """Whatever bytes the fast path accepts parse with protobuf, to the fields it reported."""
    layouts = _Layouts()
    canonical = entry.SerializeToString()
    laid = layouts.of(canonical)
    if _usual(entry):
        assert laid == _expected(entry), canonical
    else:
        assert laid is None or laid == _expected(entry)
    for value in (_unusual(entry, how), canonical[:at] + junk + canonical[at:]):
        laid = layouts.of(value)
        if laid is None:
            continue
        parsed = pb.BundleEntryProto.FromString(value)
        head, shard, end, slices = laid
        assert parsed.shard_id == shard
        assert pb.BundleEntryProto.FromString(value[:head] + value[end:]).shard_id == 0
        assert not pb.BundleEntryProto.FromString(value[:slices]).slices
        only_slices = pb.BundleEntryProto.FromString(value[slices:])
        assert [f.name for f, _ in only_slices.ListFields()] in ([], ["slices"])
        assert list(only_slices.slices) == list(parsed.slices)
        known = only_slices.SerializeToString()
        only_slices.DiscardUnknownFields()
        assert only_slices.SerializeToString() == known  # slice records only


def _usual(entry: pb.BundleEntryProto) -> bool:
    """What the fast path takes: small dtypes, shapes below 128 bytes with non-negative dims."""
    return entry.dtype < 1 << 14 and entry.shape.ByteSize() < 128 and all(d.size >= 0 for d in entry.shape.dim)


def _expected(entry: pb.BundleEntryProto) -> Tuple[int, int, int, int]:
    def size(*kept: str) -> int:
        part = pb.BundleEntryProto()
        part.CopyFrom(entry)
        for name in ("dtype", "shape", "shard_id", "offset", "size", "crc32c", "slices"):
            if name not in kept:
                part.ClearField(name)
        return part.ByteSize()

    return (size("dtype", "shape"), entry.shard_id, size("dtype", "shape", "shard_id"),
            size("dtype", "shape", "shard_id", "offset", "size", "crc32c"))


def test_merged_index_reads_back(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sliced tensor split over three bundles: one full entry listing the three slices, in input order."""
    inputs: List[Input] = []
    for r in range(3):
        full = pb.BundleEntryProto(dtype=pb.DT_FLOAT)
        full.shape.dim.add(size=6)
        full.slices.append(_slice([(2 * r, 2)]))
        piece = pb.BundleEntryProto(dtype=pb.DT_FLOAT, offset=0, size=8, crc32c=r + 1)
        piece.shape.dim.add(size=2)
        header = pb.BundleHeaderProto.FromString(make_header(1))
        items = sorted([(b"w", full.SerializeToString()), (b"\x00w%d" % r, piece.SerializeToString())])
        inputs.append((str(tmp_path / f"p{r}"), header, items))
    plan = plan_merge(inputs)
    assert plan.sources == [data_filename(str(tmp_path / f"p{r}"), 0, 1) for r in range(3)]
    table = dict(read_table(plan.index(3), index_filename("merged")))
    full = pb.BundleEntryProto.FromString(table[b"w"])
    assert [(s.extent[0].start, s.extent[0].length) for s in full.slices] == [(0, 2), (2, 2), (4, 2)]
    assert [pb.BundleEntryProto.FromString(table[b"\x00w%d" % r]).shard_id for r in range(3)] == [0, 1, 2]


@SETTINGS
@given(st.lists(st.tuples(st.binary(max_size=300), st.binary(max_size=300)), max_size=200),
       st.integers(1, 600), st.integers(1, 20), st.integers(0, 200))
def test_table_extend_writes_what_add_writes(pairs: List[Tuple[bytes, bytes]], block_size: int, restart: int,
                                             split: int) -> None:
    """:meth:`TableWriter.extend` (the merged index's writer) against :meth:`TableWriter.add`, entry by entry."""
    items = sorted(dict(pairs).items())
    one, other = TableWriter(block_size, restart), TableWriter(block_size, restart)
    for key, value in items:
        one.add(key, value)
    other.extend(items[:split])  # in two calls, with add between them
    if split < len(items):
        other.add(*items[split])
    other.extend(items[split + 1:])
    assert other.finish() == one.finish()
    with pytest.raises(InvalidArgumentError, match="strictly increasing"):
        TableWriter().extend([(b"b", b""), (b"a", b"")])


def test_entries_the_fast_path_leaves_to_protobuf() -> None:
    """A shard id as a 5-byte varint (protobuf keeps its low 32 bits), a huge dtype, a bare dtype, nothing."""
    header = pb.BundleHeaderProto.FromString(make_header(2))
    shape = pb.BundleEntryProto()
    shape.shape.dim.add(size=3)
    wrapped = shape.SerializeToString() + b"\x18" + bytes([0x81, 0x80, 0x80, 0x80, 0x10])  # 2^32 + 1 -> 1
    assert pb.BundleEntryProto.FromString(wrapped).shard_id == 1
    items = sorted([(b"a", wrapped), (b"b", pb.BundleEntryProto(dtype=20000).SerializeToString()),
                    (b"c", pb.BundleEntryProto(dtype=1).SerializeToString()), (b"d", b"")])
    inputs: List[Input] = [("/tmp/x/part", header, items)]
    merged, sources = reference_plan(inputs)
    plan = plan_merge(inputs)
    assert plan.sources == sources == [data_filename("/tmp/x/part", 1, 2), data_filename("/tmp/x/part", 0, 2)]
    assert plan.index(2) == index_bytes({k: v.SerializeToString() for k, v in merged.items()}, 2)
