"""The tensor-bundle format, checked in both directions against real TensorFlow 2.21.

* BYTE IDENTITY: ``shardckpt.io.save_v2`` writes the same ``.index`` and ``.data`` bytes as
  ``tf.raw_ops.SaveV2`` for the same inputs.
* TF READS OURS: ``tf.train.load_checkpoint`` / ``RestoreV2`` read what shardckpt wrote
  (including slices merged from several bundles by ``shardckpt.io.merge_v2_checkpoints``).
* WE READ TF'S: random checkpoints written (and merged) by TF read bit-exactly here.
* MERGE PARITY: ``merge_v2_checkpoints`` and ``MergeV2Checkpoints`` leave identical files.

All random data comes from fixed seeds. Float inputs are raw random bytes viewed as the
dtype, so NaN payloads, signalling NaNs, -0.0 and subnormals go through unchanged.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tf_oracle.client import OracleError, TFOracle
from tf_oracle.tensorfile import TF_DTYPE_NAMES, np_dtype

import shardckpt
from shardckpt import io as sio
from shardckpt.errors import AlreadyExistsError
from shardckpt.format import sstable
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.tensor_slice import TensorSlice
from shardckpt.storage.local import LocalFileSystem
from shardckpt.storage.location import Location

NUMERIC = [n for n in TF_DTYPE_NAMES if n != "string"]
SUB_BYTE_BITS = {"int4": 4, "uint4": 4, "float4_e2m1fn": 4, "int2": 2, "uint2": 2}
# Spec §6.4: TF 2.21 cannot build these dtypes from slices (nor cut a region out of a
# stored piece): "Dtype ... not supported". The bytes are fine; an exact stored slice
# restores. For int2/uint2, float4_e2m1fn and the float8 types TF behaves the same
# (see tests/test_tf_oracle.py).
UNSLICEABLE = {
    "float16", "uint16", "uint32", "uint64", "string", "int2", "uint2", "float4_e2m1fn",
    "float8_e5m2", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e4m3b11fnuz", "float8_e5m2fnuz",
}
ALPHABET = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789/._-") + ["é", "ß", "鍵", "🎉"]


# -- helpers -------------------------------------------------------------------------------


def random_array(rng: np.random.Generator, name: str, shape: Sequence[int]) -> np.ndarray:
    """Random contents of a TF dtype; every bit pattern for full-byte types."""
    shape = tuple(int(d) for d in shape)
    n = int(np.prod(shape, dtype=np.int64))
    if name == "string":
        lengths = rng.choice([0, 1, 3, 17, 130], size=n)
        out = np.empty(n, dtype=object)
        out[:] = [rng.bytes(int(k)) for k in lengths]
        return out.reshape(shape)
    if name == "bool":
        return rng.integers(0, 2, n).astype(bool).reshape(shape)
    dt = np_dtype(name)
    if name in SUB_BYTE_BITS:
        return rng.integers(0, 1 << SUB_BYTE_BITS[name], n, dtype=np.uint8).view(dt).reshape(shape)
    return np.frombuffer(rng.bytes(n * dt.itemsize), dtype=dt).reshape(shape).copy()


def random_name(rng: np.random.Generator, lo: int = 1, hi: int = 40) -> str:
    return "".join(rng.choice(ALPHABET, size=int(rng.integers(lo, hi + 1))))


def assert_same(got: np.ndarray, want: np.ndarray, what: Any = "") -> None:
    """Same dtype, shape and bits (strings: same bytes elements)."""
    if isinstance(got, bytes):  # a scalar string, as the readers return it (as TF's)
        scalar = np.empty((), dtype=object)
        scalar[()] = got
        got = scalar
    got = np.asarray(got)  # numeric scalars come back as NumPy scalars
    assert got.shape == want.shape, what
    if want.dtype == object or want.dtype.kind in "SU":
        assert got.dtype == object, what
        norm = [w.encode() if isinstance(w, str) else bytes(w) for w in want.reshape(-1).tolist()]
        assert got.reshape(-1).tolist() == norm, what
        return
    assert got.dtype == want.dtype, what
    assert got.tobytes() == np.ascontiguousarray(want).astype(want.dtype.newbyteorder("<")).tobytes(), what


def tf_dtype_name(arr: np.ndarray) -> str:
    return shardckpt.as_dtype(arr.dtype).name


def files_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


def tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` (relative), with file contents; directories map to None."""
    out: dict[str, bytes | None] = {}
    for path in sorted(root.rglob("*")):
        out[str(path.relative_to(root))] = path.read_bytes() if path.is_file() else None
    return out


def count_index_data_blocks(index: bytes) -> int:
    footer = len(index) - sstable.FOOTER_SIZE
    _, _, pos = sstable._decode_handle(index, footer, footer + 40, "idx")
    offset, size, _ = sstable._decode_handle(index, pos, footer + 40, "idx")
    block = sstable._read_block(index, offset, size, "idx", "index")
    return sum(1 for _ in sstable._iter_block(block, "idx", "index"))


_PACKED_SAVE = """
import base64
from tensorfile import np_dtype
with open(os.path.join(exchange, "meta.json"), encoding="utf-8") as f:
    meta = json.load(f)
with open(os.path.join(exchange, "blob.bin"), "rb") as f:
    blob = f.read()
tensors = []
for m in meta:
    shape = tuple(m["shape"])
    if m["dtype"] == "string":
        arr = np.empty(len(m["b64"]), dtype=object)
        arr[:] = [base64.b64decode(s) for s in m["b64"]]
        arr = arr.reshape(shape)
    elif m["size"] == 0:
        arr = np.empty(shape, dtype=np_dtype(m["dtype"]))
    else:
        dt = np_dtype(m["dtype"])
        arr = np.frombuffer(blob, dtype=dt, count=m["size"] // dt.itemsize, offset=m["offset"]).reshape(shape)
    tensors.append(tf.constant(arr, dtype=tf.dtypes.as_dtype(m["dtype"])))
tf.raw_ops.SaveV2(prefix=prefix, tensor_names=[m["name"] for m in meta],
                  shape_and_slices=[m["spec"] for m in meta], tensors=tensors)
"""


def tf_save_packed(oracle: TFOracle, exchange: Path, prefix: Path, names: Sequence[str], specs: Sequence[str],
                   arrays: Sequence[np.ndarray]) -> None:
    """``SaveV2`` through one blob file: the oracle's one-file-per-tensor exchange is slow for thousands."""
    exchange.mkdir(parents=True)
    meta, blob, offset = [], [], 0
    for name, spec, arr in zip(names, specs, arrays, strict=True):
        m: dict[str, Any] = {"name": name, "spec": spec, "dtype": tf_dtype_name(arr), "shape": list(arr.shape)}
        if m["dtype"] == "string":
            m["b64"] = [base64.b64encode(bytes(b)).decode("ascii") for b in arr.reshape(-1).tolist()]
        else:
            raw = np.ascontiguousarray(arr).tobytes()
            m.update(offset=offset, size=len(raw))
            blob.append(raw)
            offset += len(raw)
        meta.append(m)
    (exchange / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
    (exchange / "blob.bin").write_bytes(b"".join(blob))
    oracle.exec(f"exchange = {str(exchange)!r}\nprefix = {str(prefix)!r}\n" + _PACKED_SAVE)
    shutil.rmtree(exchange)


def save_both(oracle: TFOracle, root: Path, names: Sequence[str], specs: Sequence[str],
              arrays: Sequence[Any], ours_arrays: Sequence[Any] | None = None,
              packed: bool = False) -> tuple[Path, Path]:
    """Save with shardckpt into ``root/ours`` and with TF's SaveV2 into ``root/tf``; return the dirs.

    ``ours_arrays`` (same values, other memory layouts) go to shardckpt when given.
    """
    ours, theirs = root / "ours", root / "tf"
    ours.mkdir(parents=True)
    theirs.mkdir(parents=True)
    sio.save_v2(str(ours / "ck"), list(names), list(specs), list(ours_arrays or arrays))
    if packed:
        tf_save_packed(oracle, root / "exchange", theirs / "ck", names, specs, arrays)
    else:
        oracle.save_v2(theirs / "ck", list(names), list(specs), list(arrays))
    return ours, theirs


def assert_byte_identical(ours: Path, theirs: Path) -> dict[str, bytes]:
    a, b = files_of(ours), files_of(theirs)
    assert sorted(a) == sorted(b) == ["ck.data-00000-of-00001", "ck.index"]
    for name in a:
        x, y = a[name], b[name]
        if x != y:
            first = next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
            pytest.fail(f"{name} differs from TF's: {len(x)} vs {len(y)} bytes, first difference at {first}")
    return a


# -- BYTE IDENTITY -------------------------------------------------------------------------


def test_identical_bytes_every_dtype(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    entries = []
    for name in NUMERIC:
        for suffix, shape in (("m", (3, 5)), ("s", ()), ("e0", (0,)), ("e", (2, 0, 3)), ("v", (257,))):
            entries.append((f"{name}/{suffix}", random_array(rng, name, shape)))
    order = rng.permutation(len(entries))
    names = [entries[i][0] for i in order]
    arrays = [entries[i][1] for i in order]
    ours, theirs = save_both(tf_oracle, tmp_path, names, [""] * len(names), arrays)
    assert_byte_identical(ours, theirs)


def test_identical_bytes_memory_layouts_and_large_tensor(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """Non-contiguous, Fortran-order and big-endian inputs; a tensor above the 16 MiB write chunk."""
    rng = np.random.default_rng(2)
    base = random_array(rng, "float64", (40, 30))
    big = random_array(rng, "float32", (4_500_001,))  # 18 MB: several write/CRC chunks
    cplx = random_array(rng, "complex128", (7, 3))
    bf = random_array(rng, "bfloat16", (64, 64))
    names = ["strided", "fortran", "big_endian", "big", "cplx_be", "bf_t"]
    arrays = [base[::3, 1::2].copy(), base.T.copy(), base.copy(), big, cplx, bf.T.copy()]
    ours_arrays = [base[::3, 1::2], np.asfortranarray(base.T), base.astype(">f8"), big, cplx.astype(">c16"), bf.T]
    ours, theirs = save_both(tf_oracle, tmp_path, names, [""] * len(names), arrays, ours_arrays)
    assert_byte_identical(ours, theirs)


def test_identical_bytes_strings(tf_oracle: TFOracle, tmp_path: Path) -> None:
    def obj(items: list[bytes], shape: tuple[int, ...]) -> np.ndarray:
        out = np.empty(len(items), dtype=object)
        out[:] = items
        return out.reshape(shape)

    rng = np.random.default_rng(3)
    tensors = {
        "unicode": obj(["héllo".encode(), "日本語".encode(), "🎉".encode(), b""], (2, 2)),
        "nul": obj([b"\x00", b"a\x00b\x00", b"\x00" * 300, b"\xff\xfe\x00"], (4,)),
        "long": obj([b"x" * 300, rng.bytes(70_000), b"y" * 127, b"z" * 128, b"w" * 16_384], (5,)),
        "scalar": obj([b"a scalar string"], ()),
        "empty_scalar": obj([b""], ()),
        "empty_vec": obj([], (0,)),
        "empty_2d": obj([], (2, 0)),
        "all_empty": obj([b""] * 6, (3, 2)),
        "random": random_array(rng, "string", (5, 7)),
    }
    names = list(tensors)
    ours, theirs = save_both(tf_oracle, tmp_path, names, [""] * len(names), list(tensors.values()))
    files = assert_byte_identical(ours, theirs)
    with BundleReader(Location.of(str(ours / "ck"))) as reader:
        assert reader.entry("empty_vec").size == 4  # just the length checksum
        for name, want in tensors.items():
            assert_same(reader.read(name), want, name)
    assert len(files["ck.data-00000-of-00001"]) > 70_000
    # the same strings given as a NumPy unicode array are stored as UTF-8
    (tmp_path / "u").mkdir()
    sio.save_v2(str(tmp_path / "u" / "ck"), ["unicode"], [""], [np.array([["héllo", "日本語"], ["🎉", ""]])])
    (tmp_path / "u2").mkdir()
    sio.save_v2(str(tmp_path / "u2" / "ck"), ["unicode"], [""], [tensors["unicode"]])
    assert files_of(tmp_path / "u") == files_of(tmp_path / "u2")


def test_identical_bytes_slices(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    emb = random_array(rng, "float32", (10, 4))
    t = random_array(rng, "int64", (4, 6))
    cube = random_array(rng, "float64", (4, 5, 6))
    wide = random_array(rng, "int8", (20_000,))
    bf = random_array(rng, "bfloat16", (6, 2))
    i4 = random_array(rng, "int4", (8, 3))
    s = random_array(rng, "string", (4, 2))
    nul = random_array(rng, "float32", (200, 7))
    small = random_array(rng, "int32", (5,))
    whole = random_array(rng, "uint8", (3, 4))
    entries = [
        # TF1 partitioned variables spell full dims explicitly
        ("emb", "10 4 0,4:0,4", emb[0:4]),
        ("plain_a", "", random_array(rng, "float32", (3,))),
        ("emb", "10 4 4,3:0,4", emb[4:7]),
        ("t", "4 6 2,2:-", t[2:4]),
        ("emb", "10 4 7,3:0,4", emb[7:10]),
        ("t", "4 6 0,2:-", t[0:2]),
        ("cube", "4 5 6 0,4:0,2:0,6", cube[:, 0:2]),
        ("cube", "4 5 6 -:2,3:-", cube[:, 2:5]),
        # starts/lengths needing multi-byte SignedNumIncreasing encodings
        ("wide", "20000 0,8192", wide[:8192]),
        ("wide", "20000 8192,11808", wide[8192:]),
        ("bf", "6 2 0,1:-", bf[0:1]),
        ("bf", "6 2 1,5:-", bf[1:6]),
        ("i4", "8 3 -:0,1", i4[:, 0:1]),
        ("i4", "8 3 -:1,2", i4[:, 1:3]),
        ("s", "4 2 0,3:-", s[0:3]),  # TF writes sliced strings (it just cannot reassemble them)
        ("s", "4 2 3,1:-", s[3:4]),
        ("a\x00ÿz", "200 7 100,100:-", nul[100:200]),  # NUL in a name is escaped in the slice key
        ("a\x00ÿz", "200 7 0,100:-", nul[0:100]),
        # a slice covering the whole tensor is stored as a plain entry
        ("small", "5 0,5", small),
        ("whole", "3 4 -:-", whole),
        ("plain_b", "", random_array(rng, "complex64", (2, 2))),
    ]
    names, specs, arrays = zip(*entries, strict=True)
    ours, theirs = save_both(tf_oracle, tmp_path, names, specs, arrays)
    assert_byte_identical(ours, theirs)
    with BundleReader(Location.of(str(ours / "ck"))) as reader:
        assert not reader.entry("small").slices and not reader.entry("whole").slices
        assert len(reader.entry("emb").slices) == 3
        assert [str(TensorSlice.from_proto(p)) for p in reader.entry("cube").slices] == ["0,4:0,2:0,6", "-:2,3:-"]
        for key, full in (("emb", emb), ("t", t), ("cube", cube), ("wide", wide), ("bf", bf), ("i4", i4),
                          ("s", s), ("a\x00ÿz", nul), ("small", small), ("whole", whole)):
            assert_same(reader.read(key), full, key)


def test_identical_bytes_keys(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    keys = [
        "k" * 600_000,  # larger than 2 x the 256 KiB block: ends up alone in its own block
        "a",
        "a/b.c",
        "a/b/.ATTRIBUTES/VARIABLE_VALUE",
        "we..ird.Sname/.ATTRIBUTES/VARIABLE_VALUE",
        "..",
        ".",
        "/",
        "a.",
        "ключ/δ/鍵/🎉",
        "\x7f",
        "\U0010ffff",
        "k05705/x",
        "k05706/x",
        "z" * 300_000 + "/tail",
        "zz",
        " spaces and\ttabs ",
    ]
    order = rng.permutation(len(keys))
    names = [keys[i] for i in order]
    arrays = [random_array(rng, "float32", (int(rng.integers(0, 4)),)) for _ in names]
    ours, theirs = save_both(tf_oracle, tmp_path, names, [""] * len(names), arrays)
    files = assert_byte_identical(ours, theirs)
    assert count_index_data_blocks(files["ck.index"]) >= 3
    with shardckpt.load_checkpoint(str(ours / "ck")) as reader:
        assert sorted(reader.get_variable_to_shape_map()) == sorted(keys)
        for name, arr in zip(names, arrays, strict=True):
            assert_same(reader.get_tensor(name), arr)


def test_identical_bytes_5000_tensors(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """Thousands of random keys in random order: a multi-block index; data in input order."""
    rng = np.random.default_rng(6)
    names: set[str] = set()
    while len(names) < 5000:
        names.add(random_name(rng, 40, 200))
    ordered = list(names)
    rng.shuffle(ordered)
    kinds = ["float32", "int64", "bfloat16", "uint8", "bool", "float16", "string"]
    arrays = []
    for _ in ordered:
        kind = kinds[int(rng.integers(len(kinds)))]
        shape = [(), (1,), (3,), (2, 2), (0,)][int(rng.integers(5))]
        arrays.append(random_array(rng, kind, shape))
    ours, theirs = save_both(tf_oracle, tmp_path, ordered, [""] * len(ordered), arrays, packed=True)
    files = assert_byte_identical(ours, theirs)
    assert len(files["ck.index"]) > 2 * (256 << 10)
    assert count_index_data_blocks(files["ck.index"]) >= 3
    with BundleReader(Location.of(str(ours / "ck"))) as reader:
        offsets = [reader.entry(n).offset for n in ordered]
        assert offsets == sorted(offsets)  # data order follows input order, not key order
        for i in rng.choice(len(ordered), 50, replace=False):
            assert_same(reader.read(ordered[i]), arrays[i])


# -- TF READS OURS -------------------------------------------------------------------------


def test_tf_reads_whole_tensors_of_every_dtype(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    tensors: dict[str, np.ndarray] = {}
    for name in TF_DTYPE_NAMES:
        for suffix, shape in (("m", (4, 3)), ("s", ()), ("e", (0, 2)), ("r3", (2, 3, 2))):
            tensors[f"{name}/{suffix}"] = random_array(rng, name, shape)
    prefix = tmp_path / "ck"
    names = list(tensors)
    sio.save_v2(str(prefix), names, [""] * len(names), list(tensors.values()))
    got, errors, dtypes = tf_oracle.load_checkpoint(prefix)
    assert errors == {}
    assert dtypes == {k: k.split("/")[0] for k in tensors}
    for key, want in tensors.items():
        assert_same(got[key], want, key)
    restored = tf_oracle.restore_v2(prefix, names, [""] * len(names), [k.split("/")[0] for k in names])
    for key, arr in zip(names, restored, strict=True):
        assert_same(arr, tensors[key], key)


def test_tf_reads_slices_merged_from_several_bundles(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """A [12, 6] tensor per dtype, saved as 3 slices in 3 bundles, merged by shardckpt."""
    rng = np.random.default_rng(8)
    layout = [("12 6 0,4:-", np.s_[0:4, :]), ("12 6 4,8:0,3", np.s_[4:12, 0:3]), ("12 6 4,8:3,3", np.s_[4:12, 3:6])]
    full = {name: random_array(rng, name, (12, 6)) for name in TF_DTYPE_NAMES}
    plain = {f"plain{i}": random_array(rng, "float64", (i + 1,)) for i in range(3)}
    prefixes = []
    for i, (spec, index) in enumerate(layout):
        names = [f"x/{n}" for n in full] + [f"plain{i}"]
        specs = [spec] * len(full) + [""]
        arrays = [full[n][index] for n in full] + [plain[f"plain{i}"]]
        order = rng.permutation(len(names))
        bundle = tmp_path / "ck_temp" / f"part-{i:05d}-of-00003"
        sio.save_v2(str(bundle), [names[j] for j in order], [specs[j] for j in order], [arrays[j] for j in order])
        prefixes.append(str(bundle))
    dest = tmp_path / "ck"
    sio.merge_v2_checkpoints(prefixes, str(dest))
    assert sorted(os.listdir(tmp_path)) == ["ck.data-00000-of-00003", "ck.data-00001-of-00003",
                                           "ck.data-00002-of-00003", "ck.index"]
    got, errors, dtypes = tf_oracle.load_checkpoint(dest)
    assert dtypes == {**{f"x/{n}": n for n in full}, **{k: "float64" for k in plain}}
    for key, want in plain.items():
        assert_same(got[key], want, key)
    for name, want in full.items():
        if name in UNSLICEABLE:
            # spec §6.4: TF cannot reassemble these dtypes from slices; the stored slices restore exactly
            assert "not supported" in errors[f"x/{name}"]
            parts = tf_oracle.restore_v2(dest, [f"x/{name}"] * 3, [s for s, _ in layout], [name] * 3)
            for (_, index), part in zip(layout, parts, strict=True):
                assert_same(part, want[index], name)
            continue
        assert f"x/{name}" not in errors
        assert_same(got[f"x/{name}"], want, name)
        regions = ["12 6 2,5:1,4", "12 6 3,2:-", "12 6 -:2,2", "12 6 11,1:5,1", "12 6 0,12:0,6"]
        parts = tf_oracle.restore_v2(dest, [f"x/{name}"] * len(regions), regions, [name] * len(regions))
        for region, part in zip(regions, parts, strict=True):
            box = TensorSlice.parse(region.split(" ")[-1], rank=2).box((12, 6))
            assert_same(part, want[tuple(slice(a, b) for a, b in box)], (name, region))
    assert set(errors) == {f"x/{n}" for n in UNSLICEABLE}
    # and shardckpt reads the merged result too, every dtype
    with shardckpt.load_checkpoint(str(dest)) as reader:
        for name, want in full.items():
            assert_same(reader.get_tensor(f"x/{name}"), want, name)


# -- WE READ TF'S RANDOM CHECKPOINTS ----------------------------------------------------------


def random_grid(rng: np.random.Generator, shape: tuple[int, ...]) -> list[tuple[str, tuple[slice, ...]]]:
    """Split ``shape`` into a grid of slices; return ``(shape_and_slice spec, numpy index)`` per cell."""
    cuts = []
    for d in shape:
        k = int(rng.integers(0, min(3, d - 1) + 1)) if d > 1 else 0
        inner = sorted(rng.choice(np.arange(1, d), size=k, replace=False).tolist()) if k else []
        cuts.append([0, *inner, d])
    cells = [()]
    for dim_cuts in cuts:
        cells = [c + ((a, b),) for c in cells for a, b in itertools.pairwise(dim_cuts)]
    out = []
    for cell in cells:
        items = []
        for (a, b), d in zip(cell, shape, strict=True):
            if a == 0 and b == d and rng.random() < 0.5:
                items.append("-")
            else:
                items.append(f"{a},{b - a}")
        spec = " ".join(map(str, shape)) + " " + ":".join(items)
        out.append((spec, tuple(slice(a, b) for a, b in cell)))
    return out


def random_box(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    box = []
    for d in shape:
        a = int(rng.integers(0, d + 1))
        b = int(rng.integers(a, d + 1))
        box.append((a, b))
    return tuple(box)


Piece = tuple[str, str, np.ndarray]  # (name, shape_and_slice spec, value)


def random_checkpoint_plan(seed: int) -> tuple[dict[str, np.ndarray], list[list[Piece]]]:
    """Random tensors (any dtype TF saves, scalars and empty ones included), some cut into a
    grid of slices, dealt in random order into 1 bundle, or (every third seed) 2-3 bundles."""
    rng = np.random.default_rng(1000 + seed)
    n_bundles = 1 if seed % 3 else int(rng.integers(2, 4))
    n_tensors = int(rng.integers(2, 10))
    tensors: dict[str, np.ndarray] = {}
    pieces: list[Piece] = []
    while len(tensors) < n_tensors:
        name = random_name(rng)
        if name in tensors:
            continue
        k = len(tensors)  # the first three dtypes of each plan rotate so that the plans cover all
        n = len(TF_DTYPE_NAMES)
        dtype = TF_DTYPE_NAMES[(5 * seed + k) % n if k < 3 else int(rng.integers(n))]
        rank = int(rng.integers(0, 4))
        shape = tuple(int(rng.choice([0, 1, 2, 3, 5, 7], p=[0.08, 0.15, 0.2, 0.2, 0.2, 0.17])) for _ in range(rank))
        value = random_array(rng, dtype, shape)
        tensors[name] = value
        if rank and 0 not in shape and rng.random() < 0.6:
            for spec, index in random_grid(rng, shape):
                pieces.append((name, spec, value[index]))
        else:
            pieces.append((name, "", value))
    n_bundles = min(n_bundles, len(pieces))
    order = rng.permutation(len(pieces))
    bundles: list[list[Piece]] = [[] for _ in range(n_bundles)]
    for position, i in enumerate(order):
        b = position if position < n_bundles else int(rng.integers(n_bundles))
        bundles[b].append(pieces[i])
    return tensors, bundles


def test_random_checkpoint_plans_cover_the_cases() -> None:
    plans = [random_checkpoint_plan(seed) for seed in range(20)]
    values = [v for tensors, _ in plans for v in tensors.values()]
    specs = [(spec, arr) for _, bundles in plans for bundle in bundles for _, spec, arr in bundle]
    assert {tf_dtype_name(v) for v in values} == set(TF_DTYPE_NAMES)
    assert sum(v.ndim == 0 for v in values) >= 5 and sum(v.size == 0 and v.ndim > 0 for v in values) >= 3
    sliced = [arr for spec, arr in specs if spec]
    assert len(sliced) >= 40 and sum(arr.dtype == object for arr in sliced) >= 2
    assert any(" -" in spec or ":-" in spec for spec, _ in specs)
    assert sum(len(bundles) > 1 for _, bundles in plans) >= 6


@pytest.mark.parametrize("seed", range(20))
def test_we_read_random_tf_checkpoints(tf_oracle: TFOracle, tmp_path: Path, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors, bundles = random_checkpoint_plan(seed)
    n_bundles = len(bundles)
    if n_bundles == 1:
        prefix = tmp_path / "ck"
        names, specs, arrays = zip(*bundles[0], strict=True)
        tf_oracle.save_v2(prefix, names, specs, arrays)
    else:
        parts = []
        for b, content in enumerate(bundles):
            part = tmp_path / "ck_temp" / f"part-{b:05d}-of-{n_bundles:05d}"
            part.parent.mkdir(exist_ok=True)
            names, specs, arrays = zip(*content, strict=True)
            tf_oracle.save_v2(part, names, specs, arrays)
            parts.append(part)
        prefix = tmp_path / "ck"
        tf_oracle.merge_v2(parts, prefix)
        assert not (tmp_path / "ck_temp").exists()

    with shardckpt.load_checkpoint(str(prefix)) as reader:
        assert reader.get_variable_to_shape_map() == {k: list(v.shape) for k, v in tensors.items()}
        assert {k: d.name for k, d in reader.get_variable_to_tf_dtype_map().items()} == {
            k: tf_dtype_name(v) for k, v in tensors.items()}
        assert reader.bundle.num_shards == n_bundles
        for key, want in tensors.items():
            assert_same(reader.get_tensor(key), want, key)
    names, specs, dtypes, wants = [], [], [], []
    for key, value in tensors.items():
        names.append(key)
        specs.append("")
        dtypes.append(tf_dtype_name(value))
        wants.append(value)
        if value.ndim:
            for _ in range(3):
                box = random_box(rng, value.shape)
                names.append(key)
                specs.append(" ".join(map(str, value.shape)) + " " + ":".join(f"{a},{b - a}" for a, b in box))
                dtypes.append(tf_dtype_name(value))
                wants.append(value[tuple(slice(a, b) for a, b in box)])
    got = sio.restore_v2(str(prefix), names, specs, dtypes)
    for name, spec, arr, want in zip(names, specs, got, wants, strict=True):
        assert_same(arr, want, (name, spec))


def test_region_reads_of_large_runs_read_only_the_region(tf_oracle: TFOracle, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """With runs of at least a page, a region read of a TF checkpoint costs exactly the region's bytes."""
    rng = np.random.default_rng(9)
    value = random_array(rng, "float32", (64, 8, 2048))  # one [2048] run is 8 KiB
    specs = ["64 8 2048 0,20:-:-", "64 8 2048 20,44:0,4:-", "64 8 2048 20,44:4,4:-"]
    index = [np.s_[0:20], np.s_[20:64, 0:4], np.s_[20:64, 4:8]]
    tf_oracle.save_v2(tmp_path / "ck", ["v"] * 3, specs, [value[i] for i in index])
    log: list[tuple[int, int]] = []
    original = LocalFileSystem.pread_into

    def recording(self: LocalFileSystem, fd: int, buf: memoryview, offset: int, path: str = "") -> None:
        log.append((offset, len(buf)))
        original(self, fd, buf, offset, path)

    monkeypatch.setattr(LocalFileSystem, "pread_into", recording)
    boxes = [((10, 30), (2, 7), (0, 2048)), ((5, 60), (0, 8), (100, 2000)), ((19, 21), (3, 5), (0, 2048)),
             ((3, 9), (0, 8), (0, 2048)), ((0, 64), (0, 8), (0, 2048)), ((30, 31), (5, 6), (7, 1031))]
    for box in boxes:
        log.clear()
        spec = "64 8 2048 " + ":".join(f"{a},{b - a}" for a, b in box)
        [got] = sio.restore_v2(str(tmp_path / "ck"), ["v"], [spec], ["float32"])
        want = value[tuple(slice(a, b) for a, b in box)]
        assert_same(got, want, box)
        assert sum(n for _, n in log) == want.nbytes, box
        assert len(set(log)) == len(log), box  # nothing is read twice


# -- MERGE PARITY ------------------------------------------------------------------------------


def merge_both(oracle: TFOracle, root: Path, inputs: Sequence[str], dest: str, **kwargs: Any) -> tuple[Path, Path]:
    """Run shardckpt's merge on ``root/A`` and TF's on a copy ``root/B``; paths are relative."""
    a, b = root / "A", root / "B"
    shutil.copytree(a, b)
    errors = []
    try:
        sio.merge_v2_checkpoints([str(a / p) for p in inputs], str(a / dest), **kwargs)
    except Exception as exc:  # noqa: BLE001
        errors.append(type(exc).__name__)
    try:
        oracle.merge_v2([b / p for p in inputs], b / dest, **kwargs)
    except OracleError as exc:
        errors.append(exc.error_type)
    assert len(errors) in (0, 2), errors
    return a, b


def assert_same_tree(a: Path, b: Path) -> None:
    ta, tb = tree(a), tree(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        assert ta[name] == tb[name], f"{name} differs"


def write_inputs(root: Path, bundles: dict[str, list[tuple[str, str, np.ndarray]]]) -> None:
    for prefix, content in bundles.items():
        path = root / "A" / prefix
        path.parent.mkdir(parents=True, exist_ok=True)
        names, specs, arrays = zip(*content, strict=True)
        sio.save_v2(str(path), names, specs, arrays)


def test_merge_parity_plain_tensors(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    bundles = {
        f"ck_temp/part-{i:05d}-of-00003": [
            (random_name(rng), "", random_array(rng, NUMERIC[(3 * i + j) % len(NUMERIC)], (3, j))) for j in range(4)
        ]
        for i in range(3)
    }
    write_inputs(tmp_path, bundles)
    a, b = merge_both(tf_oracle, tmp_path, list(bundles), "ck")
    assert sorted(os.listdir(a)) == ["ck.data-00000-of-00003", "ck.data-00001-of-00003", "ck.data-00002-of-00003",
                                     "ck.index"]
    assert_same_tree(a, b)


def test_merge_parity_slices_first_seen_in_a_later_input(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """The full entry of a sliced tensor keeps the (meaningless) shard id TF gives it (spec §6.1, §7.2)."""
    rng = np.random.default_rng(11)
    x = random_array(rng, "float32", (12, 6))
    y = random_array(rng, "int32", (4, 4))
    bundles = {
        "ck_temp/part-00000-of-00004": [("a", "", random_array(rng, "int64", ()))],
        "ck_temp/part-00001-of-00004": [("x", "12 6 0,6:-", x[:6]), ("y", "4 4 -:0,2", y[:, :2])],
        "ck_temp/part-00002-of-00004": [("b", "", random_array(rng, "string", (3,))), ("x", "12 6 6,6:-", x[6:])],
        "ck_temp/part-00003-of-00004": [("y", "4 4 -:2,2", y[:, 2:])],
    }
    write_inputs(tmp_path, bundles)
    a, b = merge_both(tf_oracle, tmp_path, list(bundles), "ck")
    with BundleReader(Location.of(str(b / "ck"))) as tf_reader:
        assert tf_reader.entry("x").shard_id == 1 and tf_reader.entry("y").shard_id == 1
    with shardckpt.load_checkpoint(str(a / "ck")) as reader:
        assert_same(reader.get_tensor("x"), x)
        assert_same(reader.get_tensor("y"), y)
    assert_same_tree(a, b)


def test_merge_parity_multi_shard_inputs_and_options(tf_oracle: TFOracle, tmp_path: Path) -> None:
    """An input that is itself a 2-shard merged bundle; a missing input; inputs next to the destination."""
    rng = np.random.default_rng(12)
    root = tmp_path / "A"
    s = random_array(rng, "bfloat16", (10, 2))
    t = random_array(rng, "int32", (4,))
    write_inputs(tmp_path, {
        "pre/p0": [("m/a", "", random_array(rng, "float64", (2,))), ("m/c", "", random_array(rng, "bfloat16", (5, 2))),
                   ("m/s", "10 2 0,5:-", s[:5])],
        "pre/p1": [("m/z", "", random_array(rng, "int8", (3,))), ("m/b", "", random_array(rng, "string", (2,))),
                   ("m/s", "10 2 5,5:-", s[5:])],
        "ck.part-00001-of-00003": [("n", "", random_array(rng, "uint8", (4,))), ("m/t", "4 0,2", t[:2])],
        "ck.part-00003-of-00003": [("m/t", "4 2,2", t[2:])],
    })
    # A 2-shard input: p1's data becomes file 0, p0's file 1, so in key order the second
    # merge meets data file 1 (m/a) before file 0 (m/b) and renumbers them.
    sio.merge_v2_checkpoints([str(root / "pre/p1"), str(root / "pre/p0")], str(root / "ck.part-00000-of-00003"))
    with BundleReader(Location.of(str(root / "ck.part-00000-of-00003"))) as reader:
        assert reader.num_shards == 2
        assert [reader.entry(k).shard_id for k in ("m/a", "m/b", "m/c", "m/z")] == [1, 0, 1, 0]
        assert_same(reader.read("m/s"), s)
    a, b = merge_both(tf_oracle, tmp_path,
                      ["ck.part-00000-of-00003", "ck.part-00001-of-00003", "ck.part-00002-of-00003",
                       "ck.part-00003-of-00003"], "ck", allow_missing_files=True)
    # num_shards = 2 + 1 + 1 (the missing input counts nothing)
    assert sorted(os.listdir(a)) == ["ck.data-00000-of-00004", "ck.data-00001-of-00004", "ck.data-00002-of-00004",
                                     "ck.data-00003-of-00004", "ck.index"]
    with shardckpt.load_checkpoint(str(a / "ck")) as reader:
        assert_same(reader.get_tensor("m/s"), s)
        assert_same(reader.get_tensor("m/t"), t)
    assert_same_tree(a, b)


def test_merge_parity_keeps_input_dirs_without_delete_old_dirs(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(13)
    write_inputs(tmp_path, {
        "t1/p": [("a", "", random_array(rng, "float32", (2,)))],
        "t2/p": [("b", "", random_array(rng, "complex64", (2,)))],
    })
    (tmp_path / "A" / "t2" / "other.txt").write_bytes(b"keep me")
    a, b = merge_both(tf_oracle, tmp_path, ["t1/p", "t2/p"], "out/ck", delete_old_dirs=False)
    assert sorted(os.listdir(a)) == ["out", "t1", "t2"]
    assert_same_tree(a, b)


def test_merge_parity_duplicate_key_fails_and_leaves_inputs(tf_oracle: TFOracle, tmp_path: Path) -> None:
    rng = np.random.default_rng(14)
    write_inputs(tmp_path, {
        "ck_temp/part-00000-of-00002": [("dup", "", random_array(rng, "float32", (2,)))],
        "ck_temp/part-00001-of-00002": [("dup", "", random_array(rng, "float32", (2,)))],
    })
    before = tree(tmp_path / "A")
    with pytest.raises(AlreadyExistsError):
        sio.merge_v2_checkpoints([str(tmp_path / "A" / "ck_temp" / f"part-0000{i}-of-00002") for i in range(2)],
                                 str(tmp_path / "A" / "ck"))
    shutil.copytree(tmp_path / "A", tmp_path / "B")
    with pytest.raises(OracleError, match="Duplicate tensor keyed by dup") as exc:
        tf_oracle.merge_v2([tmp_path / "B" / "ck_temp" / f"part-0000{i}-of-00002" for i in range(2)],
                           tmp_path / "B" / "ck")
    assert exc.value.error_type == "InvalidArgumentError"
    assert tree(tmp_path / "A") == before
    assert_same_tree(tmp_path / "A", tmp_path / "B")
