"""Hostile safetensors files and HF folders: clear errors from shardckpt.errors, nothing written."""

from __future__ import annotations

import json
import os
import struct
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
