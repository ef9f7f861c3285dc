"""shardckpt reads the checkpoints TensorFlow 2.21 wrote in tests/data/tf_fixtures bit-exactly.

Every case (and its ``additional_checkpoints``) is read through the public API
(``shardckpt.load_checkpoint(...).get_tensor`` and ``shardckpt.io.restore_v2``) and
through :class:`BundleReader` for the physical layout recorded in ``layout.json``.
See tests/data/tf_fixtures/README.md for the fixture format.
"""

from __future__ import annotations

import base64
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tf_oracle.client import TFOracle

import shardckpt
from shardckpt import io as sio
from shardckpt.errors import DataLossError, NotFoundError
from shardckpt.format import sstable
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.dtypes import as_dtype, from_enum
from shardckpt.format.ordered_code import encode_tensor_name_slice
from shardckpt.format.tensor_slice import TensorSlice, box_shape, box_volume, intersect
from shardckpt.storage.local import LocalFileSystem
from shardckpt.storage.location import Location

FIXTURES = Path(__file__).parent / "data" / "tf_fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())

# layout.json spells dtypes as DataType enum names.
_DT_NAME_EXCEPTIONS = {"float32": "DT_FLOAT", "float64": "DT_DOUBLE", "float16": "DT_HALF"}


def dt_enum_name(tf_name: str) -> str:
    return _DT_NAME_EXCEPTIONS.get(tf_name, "DT_" + tf_name.upper())


def load_case(name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / name / "case.json").read_text(encoding="utf-8"))


def checkpoints(case: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The case's main checkpoint, then each of its ``additional_checkpoints``."""
    yield case
    yield from case.get("additional_checkpoints", [])


def all_checkpoint_params() -> list[Any]:
    out = []
    for name in CASES:
        for ck in checkpoints(load_case(name)):
            out.append(pytest.param(name, ck["prefix"], id=f"{name}/{ck['prefix']}"))
    return out


def find_checkpoint(case_name: str, prefix: str) -> dict[str, Any]:
    for ck in checkpoints(load_case(case_name)):
        if ck["prefix"] == prefix:
            return ck
    raise KeyError(prefix)


def expected_values(case_dir: Path, ck: dict[str, Any]) -> dict[str, np.ndarray]:
    """``key -> expected array``; widened npz dtypes are left as they are in the npz."""
    out: dict[str, np.ndarray] = {}
    if ck.get("expected_npz"):
        with np.load(case_dir / ck["expected_npz"], allow_pickle=False) as npz:
            out.update({k: npz[k] for k in npz.files})
    if ck.get("expected_json"):
        doc = json.loads((case_dir / ck["expected_json"]).read_text(encoding="utf-8"))
        for key, rec in doc["tensors"].items():
            assert rec["dtype"] == "string"
            arr = np.empty(len(rec["base64"]), dtype=object)
            arr[:] = [base64.b64decode(s) for s in rec["base64"]]
            out[key] = arr.reshape(rec["shape"])
    return out


def assert_matches(got: np.ndarray, rec: dict[str, Any], want: np.ndarray) -> None:
    """``got`` (our value) has the record's dtype/shape and equals ``want`` bit for bit."""
    if isinstance(got, bytes):  # scalars come back as bytes / NumPy scalars, as from TF's reader
        scalar = np.empty((), dtype=object)
        scalar[()] = got
        got = scalar
    got = np.asarray(got)
    real = as_dtype(rec["dtype"])
    assert real.enum == rec["dtype_enum"]
    assert got.dtype == real.numpy, rec["key"]
    assert list(got.shape) == rec["shape"] == list(want.shape), rec["key"]
    if rec["dtype"] == "string":
        assert got.dtype == object and want.dtype == object
        assert [type(v) for v in got.reshape(-1)] == [bytes] * got.size
        assert got.reshape(-1).tolist() == want.reshape(-1).tolist(), rec["key"]
        return
    if "npz_dtype" in rec:
        # bfloat16/float8 -> float32 and int4/uint4 -> int8/uint8 are exact widenings.
        assert want.dtype == np.dtype(rec["npz_dtype"])
        assert got.astype(want.dtype).tobytes() == want.tobytes(), rec["key"]
        # and back: every expected value is representable in the stored dtype
        assert np.array_equal(want.astype(real.numpy).astype(want.dtype), want, equal_nan=True)
    else:
        assert want.dtype == real.numpy
        assert got.tobytes() == want.tobytes(), rec["key"]


# -- values -------------------------------------------------------------------------------


@pytest.mark.parametrize(("case_name", "prefix"), all_checkpoint_params())
def test_load_checkpoint_reads_every_key(case_name: str, prefix: str) -> None:
    case_dir = FIXTURES / case_name
    ck = find_checkpoint(case_name, prefix)
    expected = expected_values(case_dir, ck)
    records = ck["keys"]
    assert len(records) == ck["num_keys"]
    assert set(expected) == {r["key"] for r in records}
    with shardckpt.load_checkpoint(str(case_dir / prefix)) as reader:
        # only plain keys are listed (no slice keys), with their full shapes
        assert reader.get_variable_to_shape_map() == {r["key"]: r["shape"] for r in records}
        tf_dtypes = reader.get_variable_to_tf_dtype_map()
        assert {k: d.name for k, d in tf_dtypes.items()} == {r["key"]: r["dtype"] for r in records}
        assert {k: d.enum for k, d in tf_dtypes.items()} == {r["key"]: r["dtype_enum"] for r in records}
        np_dtypes = reader.get_variable_to_dtype_map()
        for rec in records:
            key = rec["key"]
            assert reader.has_tensor(key)
            assert np_dtypes[key] == as_dtype(rec["dtype"]).numpy
            assert_matches(reader.get_tensor(key), rec, expected[key])
    # list_variables / load_variable, as in tf.train
    assert shardckpt.list_variables(str(case_dir / prefix)) == sorted((r["key"], r["shape"]) for r in records)
    last = records[-1]
    assert_matches(shardckpt.load_variable(str(case_dir / prefix), last["key"] + ":0"), last, expected[last["key"]])


@pytest.mark.parametrize(("case_name", "prefix"), all_checkpoint_params())
def test_restore_v2_reads_every_key(case_name: str, prefix: str) -> None:
    case_dir = FIXTURES / case_name
    ck = find_checkpoint(case_name, prefix)
    expected = expected_values(case_dir, ck)
    records = ck["keys"]
    names = [r["key"] for r in records]
    values = sio.restore_v2(str(case_dir / prefix), names, [""] * len(names), [r["dtype"] for r in records])
    assert len(values) == len(records)
    for rec, got in zip(records, values, strict=True):
        assert_matches(got, rec, expected[rec["key"]])
    # dtypes may also be given as enums or NumPy dtypes
    values = sio.restore_v2(str(case_dir / prefix), names, [""] * len(names),
                            [as_dtype(r["dtype"]).numpy if r["dtype"] != "string" else r["dtype_enum"]
                             for r in records])
    for rec, got in zip(records, values, strict=True):
        assert_matches(got, rec, expected[rec["key"]])


def test_fixture_set_is_complete(tf_fixtures_dir: Path) -> None:
    assert tf_fixtures_dir == FIXTURES
    assert CASES == [
        "01_basic_float32_int64",
        "02_all_numeric_dtypes",
        "03_string_tensors",
        "04_nested_object_graph_save",
        "05_optimizer_slots_v1_adam",
        "06_multi_device_sharded",
        "07_max_shard_size_policy",
        "08_tf1_saver_partitioned",
        "09_extra_dtypes_float8_int4",
    ]


# -- physical layout ------------------------------------------------------------------------


def count_index_data_blocks(index: bytes) -> int:
    footer = len(index) - sstable.FOOTER_SIZE
    _, _, pos = sstable._decode_handle(index, footer, footer + 40, "idx")
    offset, size, _ = sstable._decode_handle(index, pos, footer + 40, "idx")
    block = sstable._read_block(index, offset, size, "idx", "index")
    return sum(1 for _ in sstable._iter_block(block, "idx", "index"))


@pytest.mark.parametrize(("case_name", "prefix"), all_checkpoint_params())
def test_layout_matches_bundle_entries(case_name: str, prefix: str) -> None:
    case_dir = FIXTURES / case_name
    ck = find_checkpoint(case_name, prefix)
    layout = json.loads((case_dir / "layout.json").read_text(encoding="utf-8"))["checkpoints"][prefix]
    index_bytes = (case_dir / ck["index_file"]).read_bytes()
    assert count_index_data_blocks(index_bytes) == layout["index_data_blocks"]
    records = {r["key"]: r for r in ck["keys"]}
    with BundleReader(Location.of(str(case_dir / prefix))) as reader:
        header = layout["header"]
        assert reader.num_shards == header["num_shards"] == ck["num_shards"]
        assert not reader.big_endian and header["endianness"] == "LITTLE"
        assert reader.header.version.producer == header["version_producer"]
        assert reader.header.version.min_consumer == header["version_min_consumer"]
        assert [reader.data_path(i) for i in range(reader.num_shards)] == [
            str(case_dir / f) for f in ck["data_files"]
        ]
        slice_keys = []
        for t in layout["tensors"]:
            entry = reader.entry(t["key"])
            assert from_enum(entry.dtype).name == records[t["key"]]["dtype"]
            assert dt_enum_name(records[t["key"]]["dtype"]) == t["dtype"]
            assert [d.size for d in entry.shape.dim] == t["shape"]
            assert (entry.shard_id, entry.offset, entry.size, entry.crc32c) == (
                t["shard_id"], t["offset"], t["size"], t["crc32c_masked"])
            got_slices = [[list(e) for e in TensorSlice.from_proto(p).extents] for p in entry.slices]
            assert got_slices == t.get("slices", [])
            rec = records[t["key"]]
            if "slices" in rec:  # case.json: resolved lengths and the data file of each slice
                pieces = reader.pieces(t["key"])
                assert [[a for a, _ in p.box] for p in pieces] == [s["start"] for s in rec["slices"]]
                assert [list(box_shape(p.box)) for p in pieces] == [s["length"] for s in rec["slices"]]
                assert [p.entry.shard_id for p in pieces] == [s["shard"] for s in rec["slices"]]
            else:
                assert entry.shard_id == rec["shard"]
        for s in layout["slice_entries"]:
            key = encode_tensor_name_slice(s["slice_of"].encode(), [tuple(e) for e in s["extents"]])
            slice_keys.append(key)
            entry = reader.entry(key)
            assert dt_enum_name(from_enum(entry.dtype).name) == s["dtype"]
            assert [d.size for d in entry.shape.dim] == s["shape"]
            assert not entry.slices
            assert (entry.shard_id, entry.offset, entry.size, entry.crc32c) == (
                s["shard_id"], s["offset"], s["size"], s["crc32c_masked"])
        # the index holds exactly these entries; slice keys sort before plain keys
        assert reader.keys(include_slices=True) == sorted(slice_keys) + [t["key"].encode() for t in layout["tensors"]]
        assert reader.keys() == [t["key"].encode() for t in layout["tensors"]]


# -- the `checkpoint` state file -----------------------------------------------------------


def test_latest_checkpoint_case_04(tf_oracle: TFOracle) -> None:
    case_dir = FIXTURES / "04_nested_object_graph_save"
    case = load_case(case_dir.name)
    assert (case_dir / "checkpoint").read_text() == (
        'model_checkpoint_path: "ckpt-2"\nall_model_checkpoint_paths: "ckpt-2"\n')
    want = str(case_dir / case["latest_checkpoint"])
    assert shardckpt.latest_checkpoint(str(case_dir)) == want
    assert tf_oracle.exec(f"result = tf.train.latest_checkpoint({str(case_dir)!r})") == want
    state = shardckpt.get_checkpoint_state(str(case_dir))
    assert state is not None
    assert state.model_checkpoint_path == want
    assert list(state.all_model_checkpoint_paths) == [want]
    # load_checkpoint(<dir>) opens ckpt-2 (not ckpt-1, whose values differ)
    expected = expected_values(case_dir, case)
    with shardckpt.load_checkpoint(str(case_dir)) as reader:
        assert reader.prefix == want
        for rec in case["keys"]:
            assert_matches(reader.get_tensor(rec["key"]), rec, expected[rec["key"]])
    assert shardckpt.load_variable(str(case_dir), "save_counter/.ATTRIBUTES/VARIABLE_VALUE") == 2
    ck1 = expected_values(case_dir, case["additional_checkpoints"][0])
    assert any(not np.array_equal(ck1[k], expected[k]) for k in expected if k != "_CHECKPOINTABLE_OBJECT_GRAPH")


def test_latest_checkpoint_case_08(tf_oracle: TFOracle, tmp_path: Path) -> None:
    case_dir = FIXTURES / "08_tf1_saver_partitioned"
    case = load_case(case_dir.name)
    # Saved with save_relative_paths=True: the fixture's state file holds a relative path.
    assert (case_dir / "checkpoint").read_text() == (
        'model_checkpoint_path: "model.ckpt-100"\nall_model_checkpoint_paths: "model.ckpt-100"\n')
    want = str(case_dir / case["latest_checkpoint"])
    assert shardckpt.latest_checkpoint(str(case_dir)) == want
    assert tf_oracle.exec(f"result = tf.train.latest_checkpoint({str(case_dir)!r})") == want

    # A TF1 Saver without save_relative_paths writes absolute paths; moved elsewhere, such a
    # file names a path that does not exist here. TF then reports no checkpoint (it does not
    # fall back to the directory holding the state file), and so do we.
    copy = tmp_path / "moved"
    shutil.copytree(case_dir, copy)
    gone = "/nonexistent/generator/machine/model.ckpt-100"
    (copy / "checkpoint").write_text(
        f'model_checkpoint_path: "{gone}"\nall_model_checkpoint_paths: "{gone}"\n')
    assert tf_oracle.exec(f"result = tf.train.latest_checkpoint({str(copy)!r})") is None
    assert shardckpt.latest_checkpoint(str(copy)) is None
    state = shardckpt.get_checkpoint_state(str(copy))
    assert state is not None and state.model_checkpoint_path == gone  # absolute paths are kept
    with pytest.raises(NotFoundError):
        shardckpt.load_checkpoint(str(copy))
    # the prefix itself still opens
    assert shardckpt.load_checkpoint(str(copy / "model.ckpt-100")).get_tensor("global_step") == 100

    # An absolute path that exists is returned as it is.
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "checkpoint").write_text(f'model_checkpoint_path: "{copy / "model.ckpt-100"}"\n')
    assert shardckpt.latest_checkpoint(str(other)) == str(copy / "model.ckpt-100")
    assert tf_oracle.exec(f"result = tf.train.latest_checkpoint({str(other)!r})") == str(copy / "model.ckpt-100")
    with shardckpt.load_checkpoint(str(other)) as reader:
        assert reader.get_tensor("global_step") == 100


# -- partial reads of sliced tensors ------------------------------------------------------


def region_spec(shape: tuple[int, ...], box: tuple[tuple[int, int], ...]) -> str:
    return " ".join(map(str, shape)) + " " + ":".join(f"{a},{b - a}" for a, b in box)


def random_boxes(rng: np.random.Generator, shape: tuple[int, ...], n: int) -> list[tuple[tuple[int, int], ...]]:
    out = []
    for _ in range(n):
        box = []
        for d in shape:
            a = int(rng.integers(0, d))
            b = int(rng.integers(a + 1, d + 1))
            box.append((a, b))
        out.append(tuple(box))
    return out


SLICED = {
    "07_max_shard_size_policy": {
        "big/.ATTRIBUTES/VARIABLE_VALUE": [((5, 16), (0, 3)), ((6, 8), (0, 12)), ((0, 20), (0, 12)),
                                           ((13, 17), (2, 5)), ((7, 14), (1, 12)), ((0, 1), (11, 12))],
        "cube/.ATTRIBUTES/VARIABLE_VALUE": [((1, 3), (1, 4), (2, 5)), ((0, 4), (0, 5), (0, 6)),
                                            ((3, 4), (2, 5), (0, 6))],
        "wide/.ATTRIBUTES/VARIABLE_VALUE": [((0, 3), (2, 9)), ((1, 2), (0, 50)), ((0, 3), (3, 4))],
    },
    "08_tf1_saver_partitioned": {
        "embedding/table": [((3, 8), (1, 3)), ((2, 9), (0, 4)), ((4, 7), (0, 4)), ((9, 10), (3, 4))],
        "lookup/ids": [((2, 5), (0, 2)), ((0, 7), (1, 2)), ((6, 7), (0, 2))],
    },
}


@pytest.mark.parametrize("case_name", sorted(SLICED))
def test_restore_v2_regions_of_sliced_tensors(case_name: str, tf_oracle: TFOracle) -> None:
    case_dir = FIXTURES / case_name
    case = load_case(case_name)
    expected = expected_values(case_dir, case)
    records = {r["key"]: r for r in case["keys"]}
    prefix = str(case_dir / case["prefix"])
    rng = np.random.default_rng(7)
    for key, boxes in SLICED[case_name].items():
        rec = records[key]
        assert "slices" in rec
        shape = tuple(rec["shape"])
        boxes = boxes + random_boxes(rng, shape, 12)
        specs = [region_spec(shape, b) for b in boxes]
        got = sio.restore_v2(prefix, [key] * len(specs), specs, [rec["dtype"]] * len(specs))
        tf_got = tf_oracle.restore_v2(prefix, [key] * len(specs), specs, [rec["dtype"]] * len(specs))
        for box, ours, theirs in zip(boxes, got, tf_got, strict=True):
            want = expected[key][tuple(slice(a, b) for a, b in box)]
            assert ours.dtype == want.dtype and ours.shape == want.shape
            assert ours.tobytes() == want.tobytes(), (key, box)
            assert theirs.tobytes() == want.tobytes(), (key, box)
        # also straight through BundleReader.read_region with a box / TensorSlice / text form
        with BundleReader(Location.of(prefix)) as reader:
            box = boxes[0]
            want = expected[key][tuple(slice(a, b) for a, b in box)]
            assert reader.read_region(key, box).tobytes() == want.tobytes()
            assert reader.read_region(key, TensorSlice.from_box(box)).tobytes() == want.tobytes()
            assert reader.read_region(key, str(TensorSlice.from_box(box))).tobytes() == want.tobytes()


_SMALL_RUN = 4096  # BundleReader reads runs below a page as whole row blocks of the piece


def expected_reads(reader: BundleReader, key: str, box: tuple[tuple[int, int], ...]) -> dict[tuple[int, int], int]:
    """Per overlapping piece ``(shard_id, offset)``: how many bytes ``_read_box``'s rule reads.

    A piece read whole reads its ``size``; a contiguous part (every dim after the first
    taken whole) reads exactly its bytes; otherwise runs of at least a page read exactly
    the region's bytes, and smaller runs read the covering rows of the piece.
    """
    itemsize = reader.dtype(key).itemsize
    assert itemsize is not None
    out = {}
    for piece in reader.pieces(key):
        common = intersect(piece.box, box)
        if common is None:
            continue
        pshape = box_shape(piece.box)
        local = tuple((a - p0, b - p0) for (a, b), (p0, _) in zip(common, piece.box, strict=True))
        whole = all(lo == 0 and hi == d for (lo, hi), d in zip(local, pshape, strict=True))
        region_bytes = box_volume(local) * itemsize
        if whole:
            n = piece.entry.size
        elif all(lo == 0 and hi == d for (lo, hi), d in zip(local[1:], pshape[1:], strict=True)):
            n = region_bytes
        else:
            j = len(pshape)
            while j > 0 and local[j - 1] == (0, pshape[j - 1]):
                j -= 1
            run_bytes = (local[j - 1][1] - local[j - 1][0]) * int(np.prod(pshape[j:], dtype=np.int64)) * itemsize
            row_bytes = int(np.prod(pshape[1:], dtype=np.int64)) * itemsize
            n = region_bytes if run_bytes >= _SMALL_RUN else (local[0][1] - local[0][0]) * row_bytes
        out[(piece.entry.shard_id, piece.entry.offset)] = n
    return out


@pytest.fixture
def pread_log(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, int, int]]:
    """Record every ``(path, offset, length)`` positional read of the local filesystem."""
    log: list[tuple[str, int, int]] = []
    original = LocalFileSystem.pread_into

    def recording(self: LocalFileSystem, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
        log.append((path, offset, len(buf)))
        original(self, fd, buf, offset, path)

    monkeypatch.setattr(LocalFileSystem, "pread_into", recording)
    return log


def test_region_reads_touch_only_overlapping_slices(pread_log: list[tuple[str, int, int]]) -> None:
    case_dir = FIXTURES / "07_max_shard_size_policy"
    case = load_case(case_dir.name)
    expected = expected_values(case_dir, case)
    records = {r["key"]: r for r in case["keys"]}
    prefix = str(case_dir / case["prefix"])
    rng = np.random.default_rng(11)
    checked_partial = 0
    with BundleReader(Location.of(prefix)) as reader:
        for key, boxes in SLICED["07_max_shard_size_policy"].items():
            shape = tuple(records[key]["shape"])
            for box in boxes + random_boxes(rng, shape, 20):
                want_reads = expected_reads(reader, key, box)
                pread_log.clear()
                [got] = sio.restore_v2(prefix, [key], [region_spec(shape, box)], [records[key]["dtype"]])
                assert got.tobytes() == expected[key][tuple(slice(a, b) for a, b in box)].tobytes()
                # every read falls inside one overlapping piece; per piece, the bytes follow the rule
                per_piece: dict[tuple[int, int], int] = {}
                pieces = {(p.entry.shard_id, p.entry.offset): p for p in reader.pieces(key)}
                for path, offset, length in pread_log:
                    owners = [k for k, p in pieces.items()
                              if reader.data_path(p.entry.shard_id) == path
                              and p.entry.offset <= offset and offset + length <= p.entry.offset + p.entry.size]
                    assert len(owners) == 1, (path, offset, length)
                    per_piece[owners[0]] = per_piece.get(owners[0], 0) + length
                assert per_piece == want_reads, (key, box)
                region_bytes = box_volume(box) * reader.dtype(key).itemsize
                assert sum(per_piece.values()) >= region_bytes
                checked_partial += sum(1 for k, n in want_reads.items() if n < pieces[k].entry.size)
    assert checked_partial > 10  # the boxes really cut through slices


def test_whole_reads_verify_checksums_of_every_slice(tmp_path: Path) -> None:
    """A flipped byte in one slice is caught when that slice is read whole, not when another is."""
    case_dir = FIXTURES / "08_tf1_saver_partitioned"
    copy = tmp_path / "c"
    shutil.copytree(case_dir, copy)
    layout = json.loads((case_dir / "layout.json").read_text())["checkpoints"]["model.ckpt-100"]
    victim = next(s for s in layout["slice_entries"] if s["slice_of"] == "embedding/table"
                  and s["extents"] == [[4, 3], [0, 4]])
    data = copy / "model.ckpt-100.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[victim["offset"] + 5] ^= 0x40
    data.write_bytes(bytes(raw))
    prefix = str(copy / "model.ckpt-100")
    with BundleReader(Location.of(prefix)) as reader:
        assert reader.read_region("embedding/table", ((0, 4), (0, 4))).shape == (4, 4)
        with pytest.raises(DataLossError, match="checksum"):
            reader.read("embedding/table")
