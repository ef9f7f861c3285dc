"""``shardckpt.convert``: every format to every other, bit-exact; oracles read what we write.

Formats: tf (tensor bundles), safetensors, hf (sharded folders), npz, dcp (PyTorch).
Oracles: the ``safetensors`` library reads our safetensors files and HF folders (and
writes files we read); TensorFlow (the ``tf_oracle`` fixture) reads our TF output;
``torch.distributed.checkpoint.load`` reads our DCP output.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Dict

import ml_dtypes
import numpy as np
import pytest

import shardckpt
from shardckpt.convert import Rules, convert, diff, open_source
from shardckpt.errors import InvalidArgumentError, UnsupportedError
from shardckpt.storage.location import Location

FORMATS = ["tf", "safetensors", "hf", "npz", "dcp"]
#: TF dtype names each format holds exactly.
HOLDS = {
    "tf": None,  # everything
    "safetensors": {"bool", "uint8", "int8", "int16", "uint16", "float16", "bfloat16", "int32", "uint32", "float32",
                    "float64", "int64", "uint64", "float8_e5m2", "float8_e4m3fn"},
    "npz": {"bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64", "float16", "float32",
            "float64", "complex64", "complex128"},
    "dcp": {"bool", "uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64", "float16", "bfloat16",
            "float32", "float64", "complex64", "complex128", "float8_e5m2", "float8_e4m3fn"},
}
HOLDS["hf"] = HOLDS["safetensors"]
FIXTURES = Path(__file__).parent / "data" / "tf_fixtures"
CASES = sorted(p.name for p in FIXTURES.iterdir() if (p / "case.json").is_file())


def dest(tmp: Path, fmt: str, name: str = "out") -> str:
    return str(tmp / {"tf": f"{name}_tf/", "safetensors": f"{name}.safetensors", "hf": f"{name}_hf",
                      "npz": f"{name}.npz", "dcp": f"{name}_dcp"}[fmt])


def read_all(path: str, fmt: str | None = None) -> Dict[str, np.ndarray]:
    with open_source(path, fmt, trust_pickle=True) as src:
        return {info.name: src.read(info.name) for info in src.tensors()}


def assert_bit_equal(got: Dict[str, np.ndarray], want: Dict[str, np.ndarray]) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        g = got[k]
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.dtype, w.dtype, g.shape, w.shape)
        if w.dtype == object:
            assert [bytes(x) for x in g.reshape(-1)] == [bytes(x) for x in w.reshape(-1)], k
        else:
            assert g.tobytes() == w.tobytes(), k


def holdable(fmt: str, dtype_name: str) -> bool:
    return HOLDS[fmt] is None or dtype_name in HOLDS[fmt]


def drop_rules(src: str, *fmts: str) -> tuple[Rules, Dict[str, np.ndarray]]:
    """Rules leaving out what any of ``fmts`` cannot hold, and the values that remain."""
    values = read_all(src)
    with open_source(src) as s:
        infos = {i.name: i for i in s.tensors()}
    gone = [k for k, i in infos.items() if not all(holdable(f, i.dtype.name) for f in fmts)]
    import re
    rules = Rules(drop=["^" + re.escape(k) + "$" for k in gone])
    return rules, {k: v for k, v in values.items() if k not in gone}


# -- the TF fixtures through every format and back ------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("case", CASES)
def test_fixture_round_trip(tmp_path: Path, case: str, fmt: str) -> None:
    info = json.loads((FIXTURES / case / "case.json").read_text())
    src = str(FIXTURES / case / info["prefix"])
    rules, want = drop_rules(src, fmt)
    mid = dest(tmp_path, fmt)
    if not [v for v in want.values() if v.dtype != object or fmt in ("tf", "safetensors", "hf")]:
        with pytest.raises(UnsupportedError):  # nothing this format can hold: refused, nothing written
            convert(src, mid, dst_format=fmt)
        assert os.listdir(tmp_path) == []
        return
    convert(src, mid, dst_format=fmt, rules=rules, strings="metadata")
    back = str(tmp_path / "back" / "ckpt")
    convert(mid, back, src_format=fmt, dst_format="tf", trust_pickle=True)
    got = read_all(back)
    if fmt in ("npz", "dcp"):  # string tensors are left out there (with a warning)
        want = {k: v for k, v in want.items() if v.dtype != object}
    assert_bit_equal(got, want)


def test_strings_left_out_with_a_warning(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = str(FIXTURES / "03_string_tensors" / "ckpt")
    result = convert(src, str(tmp_path / "a.safetensors"))
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in result.left_out
    assert any("cannot hold string tensors" in w for w in result.warnings)
    assert read_all(str(tmp_path / "a.safetensors")).keys() == {"count/.ATTRIBUTES/VARIABLE_VALUE"}


# -- random checkpoints with every dtype each format holds: every pair of formats -----------------

def random_values(seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out: Dict[str, np.ndarray] = {}
    names = sorted(set().union(*[h for h in HOLDS.values() if h]))
    for i, name in enumerate(names):
        dt = shardckpt.as_dtype(name).numpy
        shape = [(3, 5), (7,), (), (2, 3, 4), (0, 3)][i % 5]
        raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
        if name == "bool":
            raw = raw % 2
        value = raw.view(dt).reshape(shape)
        out[f"layer_{i}/{name}/w"] = value
    out["big/kernel"] = rng.standard_normal((64, 33)).astype(np.float32)
    return out


@pytest.fixture(scope="module")
def random_tf(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Dict[str, np.ndarray]]:
    values = random_values(1)
    prefix = str(tmp_path_factory.mktemp("rand") / "ckpt")
    # Small shards: the big tensor and others are stored as slices that the reader assembles.
    shardckpt.save_tensors(prefix, values, shardckpt.CheckpointOptions(
        sharding_callback=shardckpt.MaxShardSizePolicy(2000)))
    with shardckpt.format.bundle_reader.BundleReader(Location.of(prefix)) as reader:
        assert len(reader.pieces("big/kernel")) > 1  # stored as slices
    return prefix, values


@pytest.mark.parametrize("a", FORMATS)
@pytest.mark.parametrize("b", FORMATS)
def test_every_pair(tmp_path: Path, random_tf: tuple[str, Dict[str, np.ndarray]], a: str, b: str) -> None:
    prefix, values = random_tf
    rules, want = drop_rules(prefix, a, b)
    first = dest(tmp_path, a, "first")
    convert(prefix, first, dst_format=a, rules=rules)
    second = dest(tmp_path, b, "second")
    convert(first, second, src_format=a, dst_format=b, trust_pickle=True)
    assert_bit_equal(read_all(second, b), want)
    assert diff(prefix, second, keys="|".join(f"^{k}$" for k in want), trust_pickle=True).only_b == []


# -- oracles ---------------------------------------------------------------------------------------

def test_safetensors_library_reads_ours(tmp_path: Path, random_tf: tuple[str, Dict[str, np.ndarray]]) -> None:
    from safetensors import safe_open
    from safetensors.numpy import load_file

    from shardckpt.convert.dcp import to_numpy

    prefix, _ = random_tf
    rules, want = drop_rules(prefix, "safetensors")
    out = str(tmp_path / "m.safetensors")
    convert(prefix, out, rules=rules)
    with safe_open(out, framework="pt") as f:  # every dtype, through torch
        assert sorted(f.keys()) == sorted(want)
        for k, v in want.items():
            got = to_numpy(f.get_tensor(k), shardckpt.as_dtype(v.dtype))
            assert got.shape == v.shape and got.tobytes() == v.tobytes(), k
    # the library's numpy loader has no bfloat16/float8: a file of the other dtypes through load_file
    numpy_kinds = {k: v for k, v in want.items() if v.dtype.kind in "biuf"
                   and v.dtype.name not in ("bfloat16", "float8_e5m2", "float8_e4m3fn")}
    plain = str(tmp_path / "plain.safetensors")
    convert(prefix, plain, rules=Rules(keep=["^" + k + "$" for k in numpy_kinds]))
    assert_bit_equal(load_file(plain), numpy_kinds)
    assert len(numpy_kinds) >= 10


def test_safetensors_library_reads_our_hf_folder(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    values = {f"layer.{i}.weight": np.arange(i * 100, i * 100 + 250, dtype=np.float32).reshape(25, 10)
              for i in range(6)}
    src = str(tmp_path / "src.npz")
    np.savez(src, **values)
    out = str(tmp_path / "hf")
    convert(src, out, dst_format="hf", max_shard_size=2500)
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 3 and shards[0] == "model-00001-of-00003.safetensors"
    assert index["metadata"]["total_size"] == 6 * 1000
    got: Dict[str, np.ndarray] = {}
    for shard in shards:
        part = load_file(str(tmp_path / "hf" / shard))
        assert all(index["weight_map"][k] == shard for k in part)
        got.update(part)
    assert_bit_equal(got, values)
    assert sorted(os.listdir(out)) == shards + ["model.safetensors.index.json"]


def test_we_read_what_the_safetensors_library_writes(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    tensors = {"a": torch.arange(12, dtype=torch.bfloat16).reshape(3, 4), "b": torch.ones(2, dtype=torch.int64),
               "c": torch.tensor(True), "d": torch.zeros(0, 5, dtype=torch.float16)}
    path = str(tmp_path / "lib.safetensors")
    save_file(tensors, path, metadata={"format": "pt"})
    got = read_all(path)
    for k, t in tensors.items():
        from shardckpt.convert.dcp import to_numpy
        assert_bit_equal({k: got[k]}, {k: to_numpy(t, shardckpt.as_dtype(str(t.dtype).split(".")[1]))})
    with open_source(path) as s:
        assert s.metadata() == {"format": "pt"}


@pytest.mark.parametrize("source", ["safetensors", "hf", "npz", "dcp"])
def test_tensorflow_reads_our_tf_output(tmp_path: Path, tf_oracle, random_tf, source: str) -> None:  # type: ignore[no-untyped-def]
    prefix, values = random_tf
    rules, want = drop_rules(prefix, source)
    mid = dest(tmp_path, source, "mid")
    convert(prefix, mid, dst_format=source, rules=rules)
    for max_shard in (None, 700):  # one data file; many, with the big tensor cut into slices
        out = str(tmp_path / f"tf_{max_shard}" / "model.ckpt")
        convert(mid, out, src_format=source, dst_format="tf", max_shard_size=max_shard, trust_pickle=True)
        got, errors, _ = tf_oracle.load_checkpoint(out)
        assert errors == {}
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            g = got[k].astype(v.dtype)  # the oracle widens dtypes .npy cannot hold (exactly)
            assert g.shape == v.shape and g.tobytes() == v.tobytes(), k
    files = os.listdir(tmp_path / "tf_700")
    assert sum(".data-" in f for f in files) > 3


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_load_reads_our_dcp_output(tmp_path: Path, random_tf) -> None:  # type: ignore[no-untyped-def]
    import torch
    import torch.distributed.checkpoint as dcp

    from shardckpt.convert.dcp import to_numpy

    prefix, _ = random_tf
    rules, want = drop_rules(prefix, "dcp")
    out = str(tmp_path / "dcp")
    convert(prefix, out, dst_format="dcp", rules=rules)
    state = {}
    for k, v in want.items():
        dt = shardckpt.as_dtype(v.dtype)
        state[k] = torch.empty(v.shape, dtype=getattr(torch, {"float8_e4m3fn": "float8_e4m3fn"}.get(dt.name,
                                                                                                 dt.name)))
    dcp.load(state, checkpoint_id=out, no_dist=True)
    for k, v in want.items():
        assert to_numpy(state[k], shardckpt.as_dtype(v.dtype)).tobytes() == v.tobytes(), k


def test_dcp_needs_trust_pickle(tmp_path: Path) -> None:
    src = str(tmp_path / "x.npz")
    np.savez(src, w=np.ones(3, np.float32))
    convert(src, str(tmp_path / "dcp"), dst_format="dcp")
    with pytest.raises(InvalidArgumentError, match="pickle"):
        convert(str(tmp_path / "dcp"), str(tmp_path / "y.npz"))
    convert(str(tmp_path / "dcp"), str(tmp_path / "y.npz"), trust_pickle=True)
    assert_bit_equal(read_all(str(tmp_path / "y.npz")), {"w": np.ones(3, np.float32)})


# -- selection, naming, casts ----------------------------------------------------------------------

def test_keep_drop_rename_map_transpose_cast(tmp_path: Path) -> None:
    src = str(tmp_path / "src.npz")
    k = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.savez(src, **{"enc/k": k, "enc/b": np.ones(3, np.float64), "opt/m": np.zeros(2), "step": np.int64(5)})
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"enc/b": "encoder/bias"}))
    out = str(tmp_path / "o.safetensors")
    from shardckpt.convert.select import load_name_map
    result = convert(src, out, rules=Rules(keep=["^enc/", "step"], drop=["^step$"], rename=["^enc/k$=encoder/kernel"],
                                           name_map=load_name_map(mapping.read_text()), transpose=["/k$"],
                                           casts=["bfloat16", "step=int32"]))
    got = read_all(out)
    assert sorted(result.left_out) == ["opt/m", "step"]
    assert sorted(got) == ["encoder/bias", "encoder/kernel"]
    assert got["encoder/kernel"].dtype == ml_dtypes.bfloat16
    assert np.array_equal(got["encoder/kernel"].astype(np.float32), k.T)
    assert got["encoder/bias"].dtype == ml_dtypes.bfloat16


def test_two_names_colliding_is_an_error(tmp_path: Path) -> None:
    src = str(tmp_path / "src.npz")
    np.savez(src, a=np.ones(1), b=np.ones(1))
    with pytest.raises(InvalidArgumentError, match="would be written as"):
        convert(src, str(tmp_path / "o.npz"), rules=Rules(rename=["^[ab]$=c"]))
    assert not os.path.exists(tmp_path / "o.npz")


@pytest.mark.parametrize("fmt,dtype", [("safetensors", "complex128"), ("hf", "complex64"), ("safetensors", "int4"),
                                       ("npz", "bfloat16"), ("dcp", "int4")])
def test_unholdable_dtype_is_an_error_before_writing(tmp_path: Path, fmt: str, dtype: str) -> None:
    prefix = str(tmp_path / "src" / "ckpt")
    shardckpt.save_tensors(prefix, {"ok": np.ones(4, np.float32),
                                    "bad/key": np.zeros(3, dtype=shardckpt.as_dtype(dtype).numpy)})
    out = dest(tmp_path, fmt)
    with pytest.raises(UnsupportedError) as info:
        convert(prefix, out, dst_format=fmt)
    assert info.value.key == "bad/key" and dtype in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["src"]  # nothing written, not even a folder
    # an explicit cast makes it convertible
    if dtype not in ("complex128", "complex64"):
        convert(prefix, out, dst_format=fmt, rules=Rules(casts=["bad=float32" if dtype != "bfloat16" else
                                                                "float32"]))
        assert read_all(out, fmt)["bad/key"].dtype == np.float32


def test_strings_to_metadata_and_back(tmp_path: Path) -> None:
    src = str(FIXTURES / "03_string_tensors" / "ckpt")
    st = str(tmp_path / "s.safetensors")
    convert(src, st, strings="metadata")
    from safetensors import safe_open
    with safe_open(st, framework="np") as f:
        meta = f.metadata()
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in meta and json.loads(meta["scalar/.ATTRIBUTES/VARIABLE_VALUE"])
    back = str(tmp_path / "back" / "ckpt")
    convert(st, back, dst_format="tf")
    assert_bit_equal(read_all(back), read_all(src))


# -- atomic commits ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failure_midway_leaves_nothing(tmp_path: Path, fmt: str) -> None:
    prefix = str(tmp_path / "src" / "ckpt")
    shardckpt.save_tensors(prefix, {"a": np.ones(1000, np.float32), "b": np.arange(1000, dtype=np.float32)})
    with open_source(prefix) as s:
        entry = s.bundle.entry("b")  # type: ignore[attr-defined]
    data = tmp_path / "src" / "ckpt.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[entry.offset + 10] ^= 0xFF  # b's checksum no longer matches: reading b fails
    data.write_bytes(bytes(raw))
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(shardckpt.errors.DataLossError):
        convert(prefix, dest(out, fmt), dst_format=fmt)
    assert [p for p in out.rglob("*")] == [] or fmt in ("tf", "hf") and [
        p for p in out.rglob("*") if p.is_file()] == []


# -- object stores -----------------------------------------------------------------------------------

def test_s3_both_ways(tmp_path: Path, s3_server, random_tf) -> None:  # type: ignore[no-untyped-def]
    prefix, _ = random_tf
    rules, want = drop_rules(prefix, "safetensors")
    st = s3_server.url("conv", "m.safetensors")
    hf = s3_server.url("conv", "hf")
    convert(prefix, st, rules=rules)
    convert(st, hf, dst_format="hf", max_shard_size=1000)
    tf = s3_server.url("conv", "tf", "model.ckpt")
    convert(hf, tf, dst_format="tf")
    local = str(tmp_path / "local.npz")
    npz_rules, npz_want = drop_rules(prefix, "safetensors", "npz")
    convert(tf, local, rules=npz_rules)
    assert_bit_equal(read_all(local), npz_want)
    assert_bit_equal(read_all(tf), want)
    assert diff(st, hf).equal


KILL = r"""
import os, signal, sys
from shardckpt.convert import convert
src, dst, fmt = sys.argv[1:4]
convert(src, dst, dst_format=fmt, max_shard_size=5000,
        progress=lambda name, nbytes: os.kill(os.getpid(), signal.SIGKILL))  # dies after the first tensor
"""


@pytest.mark.parametrize("fmt", ["safetensors", "hf", "npz", "tf"])
def test_a_killed_conversion_leaves_nothing_that_looks_complete(tmp_path: Path, fmt: str) -> None:
    import subprocess
    import sys

    prefix = str(tmp_path / "src" / "ckpt")
    values = {f"t{i}": np.full(1000, i, np.float32) for i in range(4)}
    shardckpt.save_tensors(prefix, values)
    out = tmp_path / "out"
    out.mkdir()
    dst = dest(out, fmt)
    proc = subprocess.run([sys.executable, "-c", KILL, prefix, dst, fmt], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    with pytest.raises(shardckpt.errors.ShardckptError):
        open_source(dst, fmt).close()  # nothing readable at the destination
    names = [p.name for p in out.rglob("*") if p.is_file()]
    assert not [n for n in names if n.endswith((".safetensors", ".npz", ".index", ".json")) and not n.startswith(".")]
    convert(prefix, dst, dst_format=fmt, max_shard_size=5000)  # leftovers do not stand in the way
    assert_bit_equal(read_all(dst, fmt), values)


def test_checkpoint_directory_and_savedmodel_sources(tmp_path: Path) -> None:
    values = {"w": np.arange(4, dtype=np.float32)}
    shardckpt.save_tensors(str(tmp_path / "sm" / "variables" / "variables"), values)
    convert(str(tmp_path / "sm"), str(tmp_path / "a.npz"))
    assert_bit_equal(read_all(str(tmp_path / "a.npz")), values)
    convert(str(tmp_path / "a.npz"), str(tmp_path / "run") + "/", dst_format="tf")
    assert shardckpt.latest_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "ckpt")
    assert_bit_equal(read_all(str(tmp_path / "run")), values)


def test_hf_folder_reconverted_in_place_keeps_no_stale_shards(tmp_path: Path) -> None:
    src = str(tmp_path / "s.npz")
    np.savez(src, **{f"w{i}": np.full(100, i, np.float32) for i in range(4)})
    out = str(tmp_path / "hf")
    convert(src, out, dst_format="hf", max_shard_size=400)
    assert len(os.listdir(out)) == 5
    convert(src, out, dst_format="hf", max_shard_size=800, rules=Rules(drop=["w3"]))
    assert sorted(os.listdir(out)) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                       "model.safetensors.index.json"]
    assert sorted(read_all(out)) == ["w0", "w1", "w2"]


def test_strings_in_hf_metadata_are_written_once(tmp_path: Path) -> None:
    src = str(FIXTURES / "03_string_tensors" / "ckpt")
    out = tmp_path / "hf"
    convert(src, str(out), dst_format="hf", strings="metadata")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" in index["metadata"]
    back = str(tmp_path / "back" / "ckpt")
    convert(str(out), back, dst_format="tf")
    assert_bit_equal(read_all(back), read_all(src))


def test_safetensors_tensors_are_aligned(tmp_path: Path) -> None:
    from shardckpt.convert.safetensors import SafetensorsSource

    src = str(tmp_path / "s.npz")
    np.savez(src, a=np.ones(3, np.bool_), b=np.ones(3, np.float64), c=np.ones(5, np.int8), d=np.ones(2, np.float32))
    out = str(tmp_path / "o.safetensors")
    convert(src, out)
    with SafetensorsSource(out) as s:
        assert s.data_start % 8 == 0
        for name, info in s.infos.items():
            assert (s.data_start + s.ranges[name][0]) % info.dtype.itemsize == 0, name
        assert list(s.infos) == ["b", "d", "a", "c"]


def test_renaming_an_object_graph_checkpoint_warns(tmp_path: Path) -> None:
    src = str(FIXTURES / "01_basic_float32_int64" / "ckpt")
    rules = Rules(rename=["/.ATTRIBUTES/VARIABLE_VALUE$="])
    result = convert(src, str(tmp_path / "tf") + "/", dst_format="tf", rules=rules)
    assert any("still names the original keys" in w for w in result.warnings)
    assert rules.preset is None  # the caller's rules are not changed
    result = convert(src, str(tmp_path / "tf2") + "/", dst_format="tf", preset="bert", rules=rules)
    assert rules.preset is None and "_CHECKPOINTABLE_OBJECT_GRAPH" in result.left_out


@pytest.mark.parametrize("source", ["npz", "safetensors"])
def test_tf_output_cuts_large_tensors_into_slabs(tmp_path: Path, source: str) -> None:
    values = {"big": np.arange(4000, dtype=np.float32).reshape(100, 40), "t": np.ones((40, 3), np.float32),
              "small": np.arange(3, dtype=np.int64)}
    src = str(tmp_path / ("s.npz" if source == "npz" else "s.safetensors"))
    np.savez(str(tmp_path / "s.npz"), **values)
    if source != "npz":
        convert(str(tmp_path / "s.npz"), src)
    out = str(tmp_path / "tf" / "ckpt")
    convert(src, out, dst_format="tf", max_shard_size=1000, rules=Rules(transpose=["^t$"]))
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.storage.location import Location
    with BundleReader(Location.of(out)) as reader:
        assert len(reader.pieces("big")) == 17  # 6 rows (960 bytes) per slab
    got = read_all(out)
    assert_bit_equal(got, {"big": values["big"], "t": np.ascontiguousarray(values["t"].T), "small": values["small"]})
