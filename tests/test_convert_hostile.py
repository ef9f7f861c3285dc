"""Hostile safetensors files and HF folders: clear errors from shardckpt.errors, nothing written."""

from __future__ import annotations

import json
import os
import re
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from shardckpt.convert import convert
from shardckpt.convert.safetensors import MAX_HEADER_BYTES
from shardckpt.errors import DataLossError, NotFoundError, ShardckptError, UnsupportedError


def st_file(path: Path, header: object, data: bytes = b"", raw_header: bytes | None = None,
            length: int | None = None) -> str:
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text) if length is None else length) + text + data)
    return str(path)


def good_header() -> dict:
    return {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
            "b": {"dtype": "I64", "shape": [1], "data_offsets": [8, 16]}}


CASES = {
    "empty file": (lambda p: st_file(p, None, raw_header=b"", length=0) and p.write_bytes(b"\x01\x02") and str(p),
                   DataLossError, "too short"),
    "truncated header": (lambda p: st_file(p, None, raw_header=b'{"a": {"dtype"', length=200), DataLossError,
                         "truncated"),
    "json bomb length": (lambda p: st_file(p, None, raw_header=b"{}", length=MAX_HEADER_BYTES + 1), DataLossError,
                         "limit"),
    "deep nesting": (lambda p: st_file(p, None, raw_header=b'{"a":' + b"[" * 100000 + b"]" * 100000 + b"}"),
                     DataLossError, "JSON"),
    "nested bomb": (lambda p: st_file(p, None, raw_header=json.dumps(
        {"a": {"dtype": "F32", "shape": [[[[1]]]], "data_offsets": [0, 4]}}).encode(), data=b"\0" * 4),
        DataLossError, "nested values are refused"),
    "not json": (lambda p: st_file(p, None, raw_header=b"{not json", data=b""), DataLossError, "not valid JSON"),
    "offsets past end": (lambda p: st_file(p, good_header(), b"\0" * 12), DataLossError, "outside"),
    "overlapping offsets": (lambda p: st_file(p, {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, b"\0" * 12), DataLossError, "overlap"),
    "size mismatch": (lambda p: st_file(p, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}},
                                        b"\0" * 8), DataLossError, "need 12"),
    "negative offset": (lambda p: st_file(p, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [-8, 0]}},
                                          b"\0" * 8), DataLossError, "data_offsets"),
    "bad dtype": (lambda p: st_file(p, {"a": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
                  UnsupportedError, "Q7"),
    "duplicate names": (lambda p: st_file(p, None, raw_header=b'{"a": {"dtype": "U8", "shape": [1], '
                                          b'"data_offsets": [0, 1]}, "a": {"dtype": "U8", "shape": [1], '
                                          b'"data_offsets": [0, 1]}}', data=b"\0"), DataLossError, "duplicate"),
    "bad metadata": (lambda p: st_file(p, {"__metadata__": {"x": 1}}), DataLossError, "__metadata__"),
    # issue 24: a dtype that is not a string escaped as a TypeError
    "dtype list": (lambda p: st_file(p, {"a": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8),
                   UnsupportedError, "'a'.*unsupported safetensors dtype \\['F32'\\]"),
    "dtype object": (lambda p: st_file(p, {"a": {"dtype": {"F32": 1}, "shape": [2], "data_offsets": [0, 8]}},
                                       b"\0" * 8), DataLossError, "'a'.*nested values are refused"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_safetensors(tmp_path: Path, case: str) -> None:
    make, error, text = CASES[case]
    src_dir = tmp_path / "in"
    src_dir.mkdir()
    src = make(src_dir / "x.safetensors")
    out = tmp_path / "out"
    out.mkdir()
    for dst, fmt in ((out / "y.npz", "npz"), (out / "tf", "tf"), (out / "hf", "hf")):
        with pytest.raises(error, match=text) as info:
            convert(src, str(dst), dst_format=fmt)
        assert isinstance(info.value, ShardckptError) and "x.safetensors" in str(info.value)
    assert os.listdir(out) == []


def test_hf_index_naming_missing_shards(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    st_file(folder / "model-00001-of-00002.safetensors", good_header(), b"\0" * 16)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(NotFoundError, match="model-00002-of-00002.safetensors"):
        convert(str(folder), str(tmp_path / "o.npz"))
    assert not (tmp_path / "o.npz").exists()


@pytest.mark.parametrize("weight_map,text", [
    ({"a": "../../etc/passwd.safetensors"}, "outside the folder"),
    ({"a": "model-00001-of-00001.safetensors"}, "weight_map does not name it"),
    ({"a": "model-00001-of-00001.safetensors", "b": "model-00001-of-00001.safetensors",
      "zz": "model-00001-of-00001.safetensors"}, "does not hold it"),
    ("nope", "no weight_map"),
])
def test_hf_index_lies(tmp_path: Path, weight_map: object, text: str) -> None:
    folder = tmp_path / "hf"
    folder.mkdir()
    st_file(folder / "model-00001-of-00001.safetensors", good_header(), b"\0" * 16)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ShardckptError, match=text):
        convert(str(folder), str(tmp_path / "o.npz"))
    assert not (tmp_path / "o.npz").exists()


def test_npz_with_pickled_objects_is_refused(tmp_path: Path) -> None:
    src = tmp_path / "p.npz"
    np.savez(src, ok=np.ones(2), obj=np.array([{"x": 1}], dtype=object))
    with pytest.raises(UnsupportedError, match="pickle"):
        convert(str(src), str(tmp_path / "o.safetensors"))
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("damage", ["truncated", "flipped"])
def test_damaged_npz(tmp_path: Path, damage: str) -> None:
    src = tmp_path / "d.npz"
    np.savez(src, a=np.arange(1000, dtype=np.float32), b=np.ones(10))
    raw = bytearray(src.read_bytes())
    if damage == "truncated":
        raw = raw[: len(raw) // 2]
    else:
        raw[200] ^= 0xFF  # inside a's data: the member's CRC-32 no longer matches
    src.write_bytes(bytes(raw))
    with pytest.raises(DataLossError):
        convert(str(src), str(tmp_path / "o.safetensors"))
    assert not (tmp_path / "o.safetensors").exists()


# Found or foreseen by the fuzz harnesses (tests/fuzz/fuzz_safetensors.py, fuzz_npz.py): each input reads
# or raises from shardckpt.errors, and nothing allocates more than the file justifies.

@pytest.mark.parametrize("shape", [[0, 2 ** 62, 2 ** 31], [0] + [2] * 64, [1] * 65])
def test_safetensors_shape_no_array_can_have(tmp_path: Path, shape: list) -> None:
    src = st_file(tmp_path / "x.safetensors", {"a": {"dtype": "U8", "shape": shape, "data_offsets": [0, 0]}})
    with pytest.raises(DataLossError, match="'a'.*(too large|rank)"):
        convert(src, str(tmp_path / "o.npz"))
    assert not (tmp_path / "o.npz").exists()


def _npz_member(tmp_path: Path, npy: bytes, method: int = 0) -> str:
    import zipfile

    path = tmp_path / "x.npz"
    with zipfile.ZipFile(path, "w", compression=method) as zf:
        zf.writestr("a.npy", npy)
    return str(path)


def test_npz_shorter_than_a_zip_trailer(tmp_path: Path) -> None:
    """A file of a few bytes made zipfile seek before the start: an OSError escaped (fuzz finding)."""
    src = tmp_path / "x.npz"
    src.write_bytes(b"PK\x05")
    with pytest.raises(DataLossError, match="x.npz.*not a valid"):
        convert(str(src), str(tmp_path / "o.safetensors"))


def test_npz_header_declaring_more_than_the_member_holds(tmp_path: Path) -> None:
    """NumPy allocates the header's shape before reading: a 1 TB claim in a tiny member must fail first."""
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<f4", "fortran_order": False, "shape": (1 << 38,)})
    src = _npz_member(tmp_path, buf.getvalue() + b"\0" * 16)
    with pytest.raises(DataLossError, match="'a'.*declares 1099511627776 bytes"):
        convert(src, str(tmp_path / "o.safetensors"))


@pytest.mark.parametrize("shape", [(0, 2 ** 62, 2 ** 31), (1,) * 65])
def test_npz_shape_no_array_can_have(tmp_path: Path, shape: tuple) -> None:
    import io

    buf = io.BytesIO()
    np.lib.format.write_array_header_2_0(buf, {"descr": "|u1", "fortran_order": False, "shape": shape})
    src = _npz_member(tmp_path, buf.getvalue() + (b"\0" if len(shape) == 65 else b""))
    with pytest.raises(DataLossError, match="'a'.*(too large|rank)"):
        convert(src, str(tmp_path / "o.safetensors"))


def test_npz_member_claiming_more_than_deflate_can_inflate(tmp_path: Path) -> None:
    """A zip directory claiming 1 GB from a few hundred deflated bytes is refused before anything is inflated."""
    import zipfile

    src = _npz_member(tmp_path, _npy(np.zeros(1000, np.uint8)),
                      zipfile.ZIP_DEFLATED)
    raw = bytearray(Path(src).read_bytes())
    with zipfile.ZipFile(src) as zf:
        info = zf.getinfo("a.npy")
    central = raw.rindex(b"PK\x01\x02")
    struct.pack_into("<I", raw, central + 24, 1 << 30)  # the central directory's uncompressed size
    Path(src).write_bytes(bytes(raw))
    assert info.compress_size < 200
    with pytest.raises(DataLossError, match="'a'.*claims 1073741824 bytes"):
        convert(src, str(tmp_path / "o.safetensors"))


def _npy(value: np.ndarray) -> bytes:
    import io

    buf = io.BytesIO()
    np.save(buf, value)
    return buf.getvalue()


# -- issue 24, section 4 --------------------------------------------------------------------------------------------

def _string_tensor_file(path: Path, value: str) -> str:
    """A safetensors file with one float tensor and ``value`` as the metadata entry ``s``."""
    return st_file(path, {"__metadata__": {"s": value}, "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}},
                   b"\0" * 8)


@pytest.mark.parametrize("shape,items,text", [
    ([2 ** 62, 2 ** 62, 0], [], "too large"),  # NumPy: "array is too big" (ValueError)
    ([2 ** 32, 2 ** 32, 1], [], "too large"),  # np.prod wrapped to 0 and matched the empty list
    ([10 ** 30], [], "too large"),  # OverflowError in np.prod
    ([1] * 70, ["eA=="], "rank 70"),
    ([-1], [], "negative"),
    ([3], ["eA=="], "1 elements for shape \\[3\\]"),  # silently dropped before
    ([1], ["e!=="], "base64"),  # silently dropped before
])
def test_string_tensor_in_metadata_with_a_hostile_shape(tmp_path: Path, shape: list, items: list, text: str) -> None:
    """A string tensor kept in ``__metadata__`` (``--strings metadata``) whose shape no array can have, or that
    does not match its elements: a DataLossError naming the file and the entry, nothing written."""
    src = _string_tensor_file(tmp_path / "x.safetensors",
                              json.dumps({"dtype": "string", "shape": shape, "base64": items}))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(DataLossError, match="x.safetensors: key 's': .*" + text):
        convert(src, str(out / "tf"), dst_format="tf")
    assert os.listdir(out) == []


def test_string_tensor_in_metadata_round_trips(tmp_path: Path) -> None:
    """The check refuses nothing good: strings through safetensors __metadata__ and back to TF."""
    import shardckpt

    values = {"w": np.arange(3, dtype=np.float32), "s": np.array([[b"a", b""], [b"\xff\x00", b"xyz"]], dtype=object)}
    shardckpt.save_tensors(str(tmp_path / "ck"), values)
    convert(str(tmp_path / "ck"), str(tmp_path / "x.safetensors"), strings="metadata")
    convert(str(tmp_path / "x.safetensors"), str(tmp_path / "back"), dst_format="tf")
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.storage.location import Location

    with BundleReader(Location.of(str(tmp_path / "back"))) as reader:
        np.testing.assert_array_equal(reader.read("s"), values["s"])


def _dcp_folder(tmp_path: Path) -> str:
    src = tmp_path / "s.npz"
    np.savez(src, a=np.arange(1000, dtype=np.float32), b=np.ones((3, 4)))
    folder = str(tmp_path / "dcp")
    convert(str(src), folder, dst_format="dcp")
    return folder


def _distcp(folder: str) -> str:
    """The data file that holds tensor ``a`` (each tensor has its own)."""
    from torch.distributed.checkpoint import FileSystemReader

    storage = FileSystemReader(folder).read_metadata().storage_data
    (name,) = {info.relative_path for index, info in storage.items() if index.fqn == "a"}
    return os.path.join(folder, name)


DCP_DAMAGE = {
    "metadata truncated": (lambda d: open(os.path.join(d, ".metadata"), "r+b").truncate(20), None, "truncated"),
    "metadata garbage": (lambda d: Path(d, ".metadata").write_bytes(b"hello world"), None, ".metadata"),
    "metadata empty": (lambda d: Path(d, ".metadata").write_bytes(b""), None, "EOFError"),
    "data file missing": (lambda d: os.remove(_distcp(d)), "a", "FileNotFoundError"),
    "data file cut": (lambda d: open(_distcp(d), "r+b").truncate(100), "a", "cannot load its values"),
    "data file empty": (lambda d: open(_distcp(d), "r+b").truncate(0), "a", "cannot load its values"),
}


@pytest.mark.parametrize("case", sorted(DCP_DAMAGE))
def test_damaged_dcp_folder_read_with_trust_pickle(tmp_path: Path, case: str) -> None:
    """What torch raises on a damaged DCP folder (UnpicklingError, EOFError, its CheckpointException, which
    is not even an Exception) is a DataLossError naming the folder and the tensor; nothing is written."""
    damage, key, text = DCP_DAMAGE[case]
    folder = _dcp_folder(tmp_path)
    damage(folder)
    out = tmp_path / "out"
    out.mkdir()
    where = f"{folder}: key '{key}': " if key else f"{folder}: "
    with pytest.raises(DataLossError, match=re.escape(where) + "damaged PyTorch DCP folder: .*" + re.escape(text)):
        convert(folder, str(out / "o.npz"), trust_pickle=True)
    assert os.listdir(out) == []


def _flipped_second_member(path: Path) -> str:
    """An .npz whose first member reads and whose second has a flipped data byte (found when read)."""
    np.savez(path, a=np.full(100_000, 7, np.float32), b=np.full(100_000, 9, np.float32))
    raw = bytearray(path.read_bytes())
    import zipfile

    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo("b.npy")
    raw[info.header_offset + 200_000] ^= 0xFF  # inside b's values, far past its .npy header
    path.write_bytes(bytes(raw))
    return str(path)


@pytest.mark.parametrize("fmt,name", [("hf", "hf"), ("safetensors", "o.safetensors"), ("npz", "o.npz"),
                                      ("tf", "tf/ckpt")])
def test_a_failed_conversion_leaves_the_previous_output_as_it_was(tmp_path: Path, fmt: str, name: str) -> None:
    """A conversion into an existing output that fails half-way (the second tensor is damaged) leaves the
    previous output byte for byte (a Hugging Face folder used to lose its index.json first)."""
    good = tmp_path / "good.npz"
    np.savez(good, a=np.full(100_000, 1, np.float32), b=np.full(100_000, 2, np.float32))
    dst = str(tmp_path / name)
    convert(str(good), dst, dst_format=fmt, max_shard_size=500_000)
    before = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    bad = _flipped_second_member(tmp_path / "bad.npz")
    before = {k: v for k, v in before.items() if k.name != "bad.npz"}
    with pytest.raises(DataLossError, match="bad.npz: key 'b'"):
        convert(bad, dst, dst_format=fmt, max_shard_size=500_000)
    after = {p.relative_to(tmp_path): p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()
             and p.name != "bad.npz"}
    assert after == before
    from shardckpt.convert import diff

    assert diff(str(good), dst, b_format=fmt).equal


KILL_AFTER_FIRST = r"""
import os, signal, sys
from shardckpt.convert import convert
src, dst, fmt = sys.argv[1:4]
convert(src, dst, dst_format=fmt, max_shard_size=5000,
        progress=lambda name, nbytes: os.kill(os.getpid(), signal.SIGKILL))  # dies after the first tensor
"""

PAUSE_AFTER_FIRST = r"""
import os, sys, time
from shardckpt.convert import convert
src, dst, fmt, flag, go = sys.argv[1:6]
def progress(name, nbytes):
    if not os.path.exists(flag):
        open(flag, "w").close()  # one tensor written into this conversion's temporaries
        while not os.path.exists(go):
            time.sleep(0.05)
convert(src, dst, dst_format=fmt, max_shard_size=5000, progress=progress)
"""


def _temporaries(directory: Path) -> list:
    return sorted(n for n in os.listdir(directory) if ".tmp-" in n)


@pytest.mark.parametrize("fmt,name", [("safetensors", "o.safetensors"), ("npz", "o.npz"), ("hf", "hf"),
                                      ("dcp", "dcp")])
def test_the_next_conversion_removes_dead_temporaries_and_spares_live_ones(tmp_path: Path, fmt: str,
                                                                          name: str) -> None:
    """Killed conversions left hidden temporaries (a whole output each) that nothing removed: the next
    conversion to that destination removes them, but never those of a conversion still running."""
    import subprocess
    import sys

    src = tmp_path / "s.npz"
    values = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    np.savez(src, **values)
    out = tmp_path / "out"
    out.mkdir()
    dst = str(out / name)
    where = Path(dst) if fmt == "hf" else out  # where the temporaries live
    proc = subprocess.run([sys.executable, "-c", KILL_AFTER_FIRST, str(src), dst, fmt], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    assert len(_temporaries(where)) == 1  # what the killed conversion left
    flag, go = tmp_path / "flag", tmp_path / "go"
    live = subprocess.Popen([sys.executable, "-c", PAUSE_AFTER_FIRST, str(src), dst, fmt, str(flag), str(go)],
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1200):
            if flag.exists() or live.poll() is not None:
                break
            time.sleep(0.05)
        assert flag.exists(), live.stderr.read() if live.stderr else ""
        (live_temp,) = [n for n in _temporaries(where) if (where / n).is_dir() and _claimed(where / n)]
        convert(str(src), dst, dst_format=fmt, max_shard_size=5000)
        assert _temporaries(where) == [live_temp]  # the dead ones are gone, the live one is untouched
    finally:
        go.touch()
        assert live.wait(timeout=120) == 0, live.stderr.read() if live.stderr else ""
    assert _temporaries(where) == []
    from shardckpt.convert import diff

    assert diff(str(src), dst, b_format=fmt, trust_pickle=True).equal


def _claimed(path: Path) -> bool:
    from shardckpt.storage import get_fs

    return get_fs(str(path)).claimed(str(path))


def test_header_with_more_entries_than_any_real_file_is_refused(tmp_path: Path) -> None:
    """The stated cap: at most MAX_ENTRIES (2**20) tensors and metadata entries per header, refused as the
    entry past it is read (what the reader keeps stays bounded however the 100 MB are spent)."""
    from shardckpt.convert.safetensors import MAX_ENTRIES

    entries = b",".join(b'"%x":""' % i for i in range(MAX_ENTRIES + 1))
    src = st_file(tmp_path / "x.safetensors", None, raw_header=b'{"__metadata__":{' + entries + b"}}")
    with pytest.raises(DataLossError, match=f"x.safetensors: header holds more than {MAX_ENTRIES} tensors"):
        convert(src, str(tmp_path / "o.npz"))
    assert not (tmp_path / "o.npz").exists()


def test_a_name_map_or_bert_config_nested_too_deep_is_a_clear_error() -> None:
    from shardckpt.convert.presets import bert_config
    from shardckpt.convert.select import load_name_map

    with pytest.raises(ShardckptError, match="--map file is not JSON"):
        load_name_map("[" * 200_000)
    with pytest.raises(ShardckptError, match="bert_config.json is not JSON"):
        bert_config("{\"a\": " * 200_000)
