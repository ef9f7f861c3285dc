"""Tests of the ``shardckpt`` command line: inspect, verify, demo.

Most tests run :func:`shardckpt.cli.main.main` in-process (capsys); a few run the
installed console script through ``subprocess`` to check the real entry point,
exit codes and that bad input never prints a traceback.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import ml_dtypes
import numpy as np
import pytest
from helpers.files import flip_byte

import shardckpt
from shardckpt import io
from shardckpt.checkpoint.state import update_checkpoint_state
from shardckpt.cli.demo_clients import WEIGHTS, expected
from shardckpt.cli.main import main
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.format.ordered_code import encode_tensor_name_slice
from shardckpt.format.protos import tensor_bundle_pb2 as pb
from shardckpt.format.sstable import TableWriter, read_table
from shardckpt.storage.location import Location

FIXTURES = Path(__file__).parent / "data" / "tf_fixtures"
CASES = sorted(p.name for p in FIXTURES.glob("0*") if (p / "case.json").exists())
SCRIPT = Path(sys.executable).parent / "shardckpt"

RNG = np.random.default_rng(42)
KERNEL = RNG.standard_normal((8, 4)).astype(np.float32)
BIG = RNG.standard_normal((50, 50)).astype(np.float32)  # 2500 elements: more than the default limit
WITH_NAN = np.array([1.0, np.nan, np.inf, -2.5, -np.inf, 4.0], dtype=np.float64)
EMB = RNG.standard_normal((3, 5)).astype(ml_dtypes.bfloat16)
FLAGS = np.array([True, False, True, True, False])
Z = np.array([3 + 4j, -1j, 0.5], dtype=np.complex64)
WORDS = np.array([b"hello", "caf\u00e9".encode(), b"\xff\xfe raw", b""], dtype=object)
STEP = np.array(7, dtype=np.int64)

# (key, shape_and_slice, value) in write order; "model/kernel" is stored as two row slices.
ITEMS: List[Tuple[str, str, np.ndarray]] = [
    ("model/kernel", "8 4 0,4:-", KERNEL[:4]),
    ("model/kernel", "8 4 4,4:-", KERNEL[4:]),
    ("big", "", BIG),
    ("with_nan", "", WITH_NAN),
    ("emb", "", EMB),
    ("flags", "", FLAGS),
    ("z", "", Z),
    ("words", "", WORDS),
    ("step", "", STEP),
]
KEYS = sorted({k for k, _, _ in ITEMS})


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> Tuple[int, str, str]:
    """Run the CLI in-process; returns (exit status, stdout, stderr)."""
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Dict[str, Any]:
    rc, out, err = run(capsys, *argv, "--json")
    assert rc == 0, err
    doc: Dict[str, Any] = json.loads(out)
    return doc


@pytest.fixture
def ckpt(tmp_path: Path) -> str:
    """A checkpoint written with save_v2: a sliced tensor, strings, bfloat16, bool, complex..."""
    prefix = str(tmp_path / "ckpt")
    io.save_v2(prefix, [k for k, _, _ in ITEMS], [s for _, s, _ in ITEMS], [v for _, _, v in ITEMS])
    return prefix


def data_file(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


# -- inspect: listing -----------------------------------------------------------------------------

def table_rows(out: str) -> Dict[str, List[str]]:
    """Cells of the listing table by their first cell (columns are 2+ spaces apart).

    Tensor rows: [dtype, shape, bytes, size, location]; slice rows ('slice <spec>'):
    [bytes, size, location].
    """
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("KEY"))
    rows = {}
    for line in lines[start + 1:]:
        if not line.strip():
            break
        cells = re.split(r"\s{2,}", line.strip())
        rows[cells[0]] = cells[1:]
    return rows


def test_inspect_table(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    rc, out, err = run(capsys, "inspect", ckpt)
    assert rc == 0, err
    total = os.path.getsize(data_file(ckpt))
    assert f"checkpoint: {ckpt}" in out
    assert f"shards: 1  tensors: {len(KEYS)}  total: {total} bytes" in out
    assert f"ckpt.data-00000-of-00001  {total} bytes" in out
    rows = table_rows(out)
    with BundleReader(Location.of(ckpt)) as reader:
        for key in KEYS:
            assert key in rows, out
            dtype = reader.dtype(key).name
            assert rows[key][0] == dtype
        bias = reader.entry("big")
        assert rows["big"] == ["float32", "[50, 50]", "10000", "9.8 KiB", f"shard 0 @ {bias.offset}"]
        first, second = reader.pieces("model/kernel")
    assert rows["emb"][:2] == ["bfloat16", "[3, 5]"]
    assert rows["words"][:3] == ["string", "[4]", str(os.path.getsize(data_file(ckpt)) - sum(
        int(r[2]) for k, r in rows.items() if k not in ("words",) and not k.startswith("slice ")))]
    assert rows["step"] == ["int64", "[]", "8", "8 B", rows["step"][4]]
    assert rows["model/kernel"] == ["float32", "[8, 4]", "128", "128 B", "2 slices in shards {0}"]
    assert rows["slice 0,4:-"] == ["64", "64 B", f"shard 0 @ {first.entry.offset}"]
    assert rows["slice 4,4:-"] == ["64", "64 B", f"shard 0 @ {second.entry.offset}"]
    # one row per plain key, sorted, and the slice rows directly under their tensor
    order = [name for name in table_rows(out)]
    assert [n for n in order if not n.startswith("slice ")] == KEYS
    assert order[order.index("model/kernel") + 1:order.index("model/kernel") + 3] == ["slice 0,4:-", "slice 4,4:-"]


def test_inspect_directory_with_state_file(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    directory = os.path.dirname(ckpt)
    update_checkpoint_state(directory, ckpt, fsync=False)
    rc, out, _ = run(capsys, "inspect", directory)
    assert rc == 0
    assert f"checkpoint: {ckpt}" in out


def test_inspect_json_listing(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt)
    assert doc["checkpoint"] == ckpt
    assert doc["num_shards"] == 1 and doc["num_tensors"] == len(KEYS)
    assert doc["total_bytes"] == os.path.getsize(data_file(ckpt))
    assert doc["data_files"] == [{"shard": 0, "path": data_file(ckpt), "size": doc["total_bytes"], "exists": True}]
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert [t["key"] for t in doc["tensors"]] == KEYS
    kernel = tensors["model/kernel"]
    assert kernel["dtype"] == "float32" and kernel["shape"] == [8, 4] and kernel["sliced"]
    assert [p["spec"] for p in kernel["pieces"]] == ["0,4:-", "4,4:-"]
    assert [p["size"] for p in kernel["pieces"]] == [64, 64] and kernel["bytes"] == 128
    assert kernel["location"] == "2 slices in shards {0}"
    with BundleReader(Location.of(ckpt)) as reader:
        for key in KEYS:
            t = tensors[key]
            assert t["dtype"] == reader.dtype(key).name
            assert t["shape"] == list(reader.shape(key))
            if not t["sliced"]:
                entry = reader.entry(key)
                assert t["pieces"] == [{"spec": None, "shard": 0, "offset": entry.offset, "size": entry.size,
                                        "file": data_file(ckpt)}]
                assert t["location"] == f"shard 0 @ {entry.offset}"
    assert tensors["step"]["shape"] == [] and tensors["step"]["bytes"] == 8


# -- inspect --key ---------------------------------------------------------------------------------

def expect_stats(stats: Dict[str, Any], values: np.ndarray) -> None:
    v = values.astype(np.float64).reshape(-1)
    assert stats["count"] == v.size
    assert stats["min"] == pytest.approx(v.min())
    assert stats["max"] == pytest.approx(v.max())
    assert stats["mean"] == pytest.approx(v.mean())
    assert stats["std"] == pytest.approx(v.std())


def test_inspect_key_text(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    rc, out, _ = run(capsys, "inspect", ckpt, "--key", "model/kernel")
    assert rc == 0
    assert "dtype:    float32" in out and "shape:    [8, 4]" in out
    assert "location: 2 slices in shards {0}" in out
    assert "0,4:-" in out and "4,4:-" in out
    stats_line = next(line for line in out.splitlines() if line.startswith("stats:"))
    fields = dict(item.split("=") for item in stats_line.split()[1:])
    assert int(fields["count"]) == 32
    assert float(fields["min"]) == pytest.approx(float(KERNEL.min()), rel=1e-5)
    assert float(fields["max"]) == pytest.approx(float(KERNEL.max()), rel=1e-5)
    assert float(fields["mean"]) == pytest.approx(float(KERNEL.astype(np.float64).mean()), rel=1e-5)
    assert fields["nan"] == "0" and fields["inf"] == "0"
    values_text = out.split("values:\n", 1)[1]
    assert np.array2string(KERNEL, threshold=1000, edgeitems=3, max_line_width=100) in values_text


def test_inspect_key_json_values_and_stats(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt, "--key", "model/kernel")
    assert doc["values_included"] is True
    np.testing.assert_array_equal(np.array(doc["values"], dtype=np.float32), KERNEL)
    assert doc["stats"]["kind"] == "float" and doc["stats"]["nan"] == 0
    expect_stats(doc["stats"], KERNEL)

    doc = run_json(capsys, "inspect", ckpt, "--key", "step")
    assert doc["values"] == 7 and doc["shape"] == []
    assert doc["stats"]["kind"] == "int" and doc["stats"]["min"] == 7


def test_inspect_key_nan_inf(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt, "--key", "with_nan")
    stats = doc["stats"]
    assert stats["nan"] == 1 and stats["inf"] == 2
    assert stats["min"] == "-Infinity" and stats["max"] == "Infinity"
    finite = WITH_NAN[np.isfinite(WITH_NAN)]
    assert stats["mean"] == pytest.approx(finite.mean()) and stats["std"] == pytest.approx(finite.std())
    assert doc["values"] == [1.0, "NaN", "Infinity", -2.5, "-Infinity", 4.0]


def test_inspect_key_bfloat16_bool_complex(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt, "--key", "emb")
    assert doc["dtype"] == "bfloat16"
    expect_stats(doc["stats"], EMB.astype(np.float32))
    np.testing.assert_array_equal(np.array(doc["values"], dtype=np.float32), EMB.astype(np.float32))

    doc = run_json(capsys, "inspect", ckpt, "--key", "flags")
    assert doc["stats"] == {"kind": "bool", "count": 5, "true": 3, "false": 2}
    assert doc["values"] == FLAGS.tolist()

    doc = run_json(capsys, "inspect", ckpt, "--key", "z")
    assert doc["stats"]["kind"] == "complex"
    expect_stats(doc["stats"], np.abs(Z.astype(np.complex128)))
    assert doc["values"] == [[3.0, 4.0], [0.0, -1.0], [0.5, 0.0]]


def test_inspect_key_strings(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt, "--key", "words")
    assert doc["dtype"] == "string" and doc["shape"] == [4]
    assert [base64.b64decode(b) for b in doc["values"]["base64"]] == list(WORDS)
    assert doc["values"]["utf8"] == ["hello", "caf\u00e9", None, ""]
    assert doc["stats"]["count"] == 4 and doc["stats"]["non_utf8"] == 1
    assert doc["stats"]["total_bytes"] == sum(len(w) for w in WORDS)

    rc, out, _ = run(capsys, "inspect", ckpt, "--key", "words")
    assert rc == 0
    assert "b'hello'" in out and repr(b"\xff\xfe raw") in out


def test_inspect_key_limit(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    doc = run_json(capsys, "inspect", ckpt, "--key", "big")
    assert doc["values_included"] is False and "values" not in doc
    expect_stats(doc["stats"], BIG)
    doc = run_json(capsys, "inspect", ckpt, "--key", "big", "--limit", "2500")
    np.testing.assert_array_equal(np.array(doc["values"], dtype=np.float32), BIG)

    rc, out, _ = run(capsys, "inspect", ckpt, "--key", "big")
    assert rc == 0
    values_text = out.split("values:\n", 1)[1]
    assert "..." in values_text and len(values_text.splitlines()) < 20  # summarised


def test_inspect_unknown_key(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    rc, out, err = run(capsys, "inspect", ckpt, "--key", "model/kernl")
    assert rc == 1 and out == ""
    assert err.startswith("error: ")
    assert "model/kernl" in err and ckpt in err and "model/kernel" in err  # suggestion
    assert "Traceback" not in err


def test_inspect_slice_key_is_not_a_tensor(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    slice_key = encode_tensor_name_slice(b"model/kernel", [(0, 4), (0, -1)])
    with BundleReader(Location.of(ckpt)) as reader:
        assert slice_key in reader
    for name in (slice_key.decode("utf-8", "surrogateescape"), ""):
        rc, _, err = run(capsys, "inspect", ckpt, "--key", name)
        assert rc == 1 and err.startswith("error: ") and "no such tensor" in err


# -- inspect on TensorFlow-written fixtures --------------------------------------------------------

def load_case(case: str) -> Tuple[Dict[str, Any], str]:
    meta = json.loads((FIXTURES / case / "case.json").read_text())
    return meta, str(FIXTURES / case / meta["prefix"])


@pytest.mark.parametrize("case", CASES)
def test_inspect_tf_fixture_listing(capsys: pytest.CaptureFixture[str], case: str) -> None:
    meta, prefix = load_case(case)
    doc = run_json(capsys, "inspect", prefix)
    assert doc["num_shards"] == meta["num_shards"]
    assert doc["num_tensors"] == len(meta["keys"])
    assert [os.path.basename(f["path"]) for f in doc["data_files"]] == meta["data_files"]
    sizes = {f["path"]: f["bytes"] for f in meta["files"]}
    for f in doc["data_files"]:
        assert f["size"] == sizes[os.path.basename(f["path"])]
    assert doc["total_bytes"] == sum(f["size"] for f in doc["data_files"])  # TF packs data files
    tensors = {t["key"]: t for t in doc["tensors"]}
    assert list(tensors) == [k["key"] for k in meta["keys"]]
    for k in meta["keys"]:
        t = tensors[k["key"]]
        assert t["dtype"] == k["dtype"], k["key"]
        assert t["shape"] == k["shape"], k["key"]
        if "slices" in k:
            assert t["sliced"] and t["location"].startswith(f"{len(k['slices'])} slices in shards")
            assert [p["shard"] for p in t["pieces"]] == [s["shard"] for s in k["slices"]]
            assert [p["spec"] for p in t["pieces"]] == [s["spec"].split(" ")[-1] for s in k["slices"]]
        else:
            assert not t["sliced"] and t["pieces"][0]["shard"] == k["shard"]
    # the text form lists every key too
    rc, out, _ = run(capsys, "inspect", prefix)
    assert rc == 0
    for k in meta["keys"]:
        assert k["key"] in out


@pytest.mark.parametrize("case", CASES)
def test_inspect_tf_fixture_values(capsys: pytest.CaptureFixture[str], case: str) -> None:
    meta, prefix = load_case(case)
    npz = np.load(FIXTURES / case / meta["expected_npz"], allow_pickle=False)
    strings = json.loads((FIXTURES / case / meta["expected_json"]).read_text())["tensors"] \
        if meta.get("expected_json") else {}
    for k in meta["keys"]:
        doc = run_json(capsys, "inspect", prefix, "--key", k["key"])
        if k["dtype"] == "string":
            assert doc["values"]["base64"] == strings[k["key"]]["base64"], k["key"]
            continue
        expected = npz[k["key"]]
        if k["dtype"] == "bool":
            assert doc["stats"]["true"] == int(np.count_nonzero(expected))
            assert doc["values"] == expected.tolist()
            continue
        stats = doc["stats"]
        assert stats["count"] == expected.size
        if np.iscomplexobj(expected):
            continue  # magnitude stats are checked on a written checkpoint
        if np.issubdtype(expected.dtype, np.floating):
            nan = np.isnan(expected)
            assert stats["nan"] == int(nan.sum()) and stats["inf"] == int(np.isinf(expected).sum())
            finite = expected[np.isfinite(expected)].astype(np.float64)
            with np.errstate(over="ignore"):
                std = finite.std() if finite.size else np.nan
            if np.isfinite(std):
                assert stats["mean"] == pytest.approx(finite.mean())
                assert stats["std"] == pytest.approx(std)
        elif expected.size:
            assert stats["min"] == int(expected.min()) and stats["max"] == int(expected.max())
            assert doc["values"] == expected.tolist()


@pytest.mark.parametrize("case", CASES)
def test_verify_tf_fixture(capsys: pytest.CaptureFixture[str], case: str) -> None:
    meta, prefix = load_case(case)
    rc, out, err = run(capsys, "verify", prefix)
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1].startswith(f"OK: {len(meta['keys'])} tensors, ")


# -- verify ------------------------------------------------------------------------------------------

def test_verify_ok(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    rc, out, _ = run(capsys, "verify", ckpt)
    assert rc == 0
    total = os.path.getsize(data_file(ckpt))
    assert out.startswith(f"OK: {len(KEYS)} tensors, {total} bytes verified")
    doc = run_json(capsys, "verify", ckpt)
    assert doc["ok"] is True and doc["problems"] == [] and doc["bytes_verified"] == total


def test_verify_flipped_byte(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    with BundleReader(Location.of(ckpt)) as reader:
        offset = reader.entry("with_nan").offset + 3
    flip_byte(data_file(ckpt), offset)
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1
    assert "'with_nan'" in bad[0] and data_file(ckpt) in bad[0] and "checksum" in bad[0]
    assert out.strip().splitlines()[-1].startswith(f"FAILED: 1 of {len(KEYS)} entries bad")
    assert "Traceback" not in err


def test_verify_flipped_byte_in_slice(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    with BundleReader(Location.of(ckpt)) as reader:
        second = reader.pieces("model/kernel")[1]
        offset = second.entry.offset + 5
    flip_byte(data_file(ckpt), offset)
    rc, out, _ = run(capsys, "verify", ckpt)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert bad == [line for line in bad if "'model/kernel' slice 4,4:-" in line] and len(bad) == 1
    doc = json.loads(run(capsys, "verify", ckpt, "--json")[1])
    assert doc["ok"] is False and doc["bad_entries"] == 1
    assert doc["problems"][0]["key"] == "model/kernel" and doc["problems"][0]["slice"] == "4,4:-"
    assert doc["problems"][0]["file"] == data_file(ckpt)
    # inspect --key names the slice too, not its encoded key
    rc, _, err = run(capsys, "inspect", ckpt, "--key", "model/kernel")
    assert rc == 1 and "'model/kernel' slice 4,4:-" in err and "\\x00" not in err


def test_verify_missing_data_file(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    os.remove(data_file(ckpt))
    rc, out, _ = run(capsys, "verify", ckpt)
    assert rc == 1
    assert f"MISSING data file {data_file(ckpt)}" in out
    assert "data file missing" in out.strip().splitlines()[-1]
    rc, out, _ = run(capsys, "inspect", ckpt)
    assert "MISSING" in out


def test_verify_missing_one_of_several_shards(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    case = "06_multi_device_sharded"
    assert case in CASES, "the TF fixture case is part of the test data"
    meta, _ = load_case(case)
    copy = tmp_path / case
    copy.mkdir()
    for name in [meta["index_file"]] + meta["data_files"]:
        (copy / name).write_bytes((FIXTURES / case / name).read_bytes())
    missing = copy / meta["data_files"][2]
    missing.unlink()
    rc, out, _ = run(capsys, "verify", str(copy / meta["prefix"]))
    assert rc == 1
    assert f"MISSING data file {missing}" in out
    in_shard_2 = [k["key"] for k in meta["keys"] if k.get("shard") == 2]
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == len(in_shard_2) and all(str(missing) in line for line in bad)


def rewrite_entry(prefix: str, key: bytes, **fields: int) -> None:
    """Rewrite the index with some fields of ``key``'s entry changed."""
    index = prefix + ".index"
    with open(index, "rb") as f:
        table = list(read_table(f.read(), index))
    writer = TableWriter()
    for k, value in table:
        if k == key:
            entry = pb.BundleEntryProto()
            entry.ParseFromString(value)
            for name, v in fields.items():
                setattr(entry, name, v)
            value = entry.SerializeToString()
        writer.add(k, value)
    with open(index, "wb") as f:
        f.write(writer.finish())


def test_bad_entry_is_named(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    rewrite_entry(ckpt, b"flags", shard_id=3)  # the bundle has one shard
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "'flags'" in bad[0] and ckpt + ".index" in bad[0] and "shard_id=3" in bad[0]
    assert out.strip().splitlines()[-1].startswith(f"FAILED: 1 of {len(KEYS)} entries bad")
    # inspect still lists everything else, flags the entry and exits 1
    rc, out, err = run(capsys, "inspect", ckpt)
    assert rc == 1
    assert table_rows(out)["flags"][-1] == "ERROR (see below)"
    assert "error: " in out and "'flags'" in out.split("ERROR (see below)")[1]
    assert table_rows(out)["big"][0] == "float32"


def test_verify_entry_past_end_of_file(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    with BundleReader(Location.of(ckpt)) as reader:
        last = max(KEYS, key=lambda k: reader.pieces(k)[-1].entry.offset)
        entry = reader.pieces(last)[-1].entry
    with open(data_file(ckpt), "r+b") as f:
        f.truncate(entry.offset + entry.size - 1)
    rc, out, _ = run(capsys, "verify", ckpt)
    assert rc == 1
    bad = [line for line in out.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and f"'{last}'" in bad[0] and "past the end" in bad[0]


@pytest.mark.parametrize("size", [0, 20, 100])
def test_verify_truncated_index(capsys: pytest.CaptureFixture[str], ckpt: str, size: int) -> None:
    index = ckpt + ".index"
    with open(index, "r+b") as f:
        f.truncate(size)
    rc, out, err = run(capsys, "verify", ckpt)
    assert rc == 1 and out == ""
    assert err.startswith("error: cannot read the checkpoint index") and index in err
    assert "Traceback" not in err
    rc, _, err = run(capsys, "inspect", ckpt)
    assert rc == 1 and err.startswith("error: ") and index in err


def test_missing_checkpoint(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for command in ("inspect", "verify"):
        rc, _, err = run(capsys, command, str(tmp_path / "nothing"))
        assert rc == 1 and "error:" in err and "nothing" in err


def test_usage_errors_exit_2(capsys: pytest.CaptureFixture[str], ckpt: str) -> None:
    assert run(capsys, "inspect")[0] == 2
    assert run(capsys, "inspect", ckpt, "--limit", "-3")[0] == 2
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys)[0] == 2
    assert run(capsys, "--help")[0] == 0


# -- demo --------------------------------------------------------------------------------------------

def test_demo_runs_the_multi_client_story(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    directory = tmp_path / "demo"
    rc, out, err = run(capsys, "demo", "--dir", str(directory))
    assert rc == 0, out + err
    assert "1. 4 clients, mesh x=2 x y=4" in out and "2. 2 clients, mesh a=4" in out
    assert "restore ckpt-3   step  12" in out and "save ckpt-5" in out
    assert "OK: 7 tensors" in out and out.strip().endswith("s") and "all checks passed" in out
    final = shardckpt.latest_checkpoint(str(directory / "train"))
    assert final is not None and final.endswith("ckpt-5")
    with shardckpt.load_checkpoint(final) as reader:
        assert int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE")) == 18
        for name in WEIGHTS:
            key = f"model/{name.replace('/', '_')}/.ATTRIBUTES/VARIABLE_VALUE"
            np.testing.assert_array_equal(reader.get_tensor(key), expected(name, 18))


def test_demo_other_client_counts(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc, out, err = run(capsys, "demo", "--dir", str(tmp_path / "d"), "--clients", "2", "--resume-clients", "4")
    assert rc == 0, out + err
    assert "1. 2 clients" in out and "2. 4 clients" in out and "all checks passed" in out


@pytest.mark.parametrize("argv", [["--clients", "3"], ["--clients", "0"], ["--resume-clients", "8"]])
def test_demo_refuses_client_counts_that_do_not_share_the_mesh(capsys: pytest.CaptureFixture[str],
                                                               argv: List[str]) -> None:
    rc, out, err = run(capsys, "demo", *argv)
    assert rc == 2 and "invalid choice" in err and "Traceback" not in out + err
    assert "choose from 1, 2, 4" in err


def test_demo_without_dir_removes_its_temporary_folder(tmp_path: Path) -> None:
    env = dict(os.environ, TMPDIR=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", "demo", "--clients", "2",
                           "--resume-clients", "1"], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "removed " in proc.stdout and list(tmp_path.iterdir()) == []


# -- the installed console script ------------------------------------------------------------------

def script(*argv: str) -> "subprocess.CompletedProcess[str]":
    if not SCRIPT.exists():
        pytest.fail(f"console script not installed at {SCRIPT} (run the test command: bash scripts/test.sh)")
    return subprocess.run([str(SCRIPT), *argv], capture_output=True, text=True, timeout=120)


def test_console_script_inspect_and_verify(ckpt: str) -> None:
    proc = script("inspect", ckpt, "--json")
    assert proc.returncode == 0, proc.stderr
    assert [t["key"] for t in json.loads(proc.stdout)["tensors"]] == KEYS
    proc = script("verify", ckpt)
    assert proc.returncode == 0 and proc.stdout.startswith("OK: ")


def test_console_script_bad_input(ckpt: str) -> None:
    with BundleReader(Location.of(ckpt)) as reader:
        offset = reader.entry("big").offset + 100
    flip_byte(data_file(ckpt), offset)
    proc = script("verify", ckpt)
    assert proc.returncode == 1
    assert "'big'" in proc.stdout and "FAILED: 1 of" in proc.stdout
    proc = script("inspect", ckpt, "--key", "nope")
    assert proc.returncode == 1 and "error:" in proc.stderr and "'nope'" in proc.stderr
    with open(ckpt + ".index", "wb") as f:
        f.write(b"not an index at all" * 5)
    for command in ("inspect", "verify"):
        proc = script(command, ckpt)
        assert proc.returncode == 1 and "Traceback" not in proc.stderr and "error:" in proc.stderr
    proc = script("inspect")
    assert proc.returncode == 2


def test_console_script_demo(tmp_path: Path) -> None:
    proc = script("demo", "--dir", str(tmp_path / "d"))
    assert proc.returncode == 0, proc.stderr
    assert "all checks passed" in proc.stdout


def test_inspect_and_verify_of_another_format_say_what_it_is(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    from shardckpt.convert import convert

    src = str(tmp_path / "tf" / "ckpt")
    shardckpt.save_tensors(src, {"a": np.ones(3, np.float32)})
    outs = {"safetensors file": str(tmp_path / "m.safetensors"), "NumPy .npz archive": str(tmp_path / "m.npz"),
            "Hugging Face folder": str(tmp_path / "hf")}
    for what, path in outs.items():
        convert(src, path, dst_format="hf" if what.startswith("Hugging") else None)
        for command in ("inspect", "verify"):
            rc, out, err = run(capsys, command, path)
            assert rc == 1 and f"this is a {what}" in err and "inspect --tree" in err, err
            assert ".index file is missing" not in err
