"""The ``shardckpt`` command line on an object store (issue 27): every command on ``s3://``.

Each test runs the real command (``python -m shardckpt.cli.main``) in a subprocess pointed at
the test S3 server (moto, tests/helpers/s3_moto.py) the way README's "Object stores" tells a
user to: the standard AWS variables (``AWS_ENDPOINT_URL``, credentials) in its environment.
Checkpoints are written to the server with the library, damaged with boto3 (the store's own
client, not shardckpt's), and read back with each command: ``inspect`` (listing, ``--json``,
``--key``, ``--tree``, ``--map``), ``verify`` (healthy, a flipped byte, a truncated object, a
missing object), ``diff`` and ``convert`` (to and from a local safetensors file).

The last tests are about a data file shorter than its index says (local and on S3):
``inspect`` (listing and ``--map``) knows the files' sizes without reading a byte of
tensor data, so it names the file and exits 1 instead of drawing a map of bytes that are gone.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import numpy as np
import pytest
from helpers.launchers import clean_env

from shardckpt import io
from shardckpt.checkpoint.state import update_checkpoint_state
from shardckpt.convert import open_source
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.location import Location

RNG = np.random.default_rng(27)
KERNEL = RNG.standard_normal((8, 4)).astype(np.float32)
BIAS = RNG.standard_normal(16).astype(np.float32)
EMB = RNG.standard_normal((64, 32)).astype(np.float32)
STEP = np.array(12, dtype=np.int64)
# (key, shape_and_slice, value); "model/kernel" is stored as two row slices
ITEMS: List[Tuple[str, str, np.ndarray]] = [
    ("model/kernel", "8 4 0,4:-", KERNEL[:4]),
    ("model/kernel", "8 4 4,4:-", KERNEL[4:]),
    ("model/bias", "", BIAS),
    ("model/emb", "", EMB),
    ("step", "", STEP),
]
KEYS = sorted({k for k, _, _ in ITEMS})


def _save(prefix: str, items: List[Tuple[str, str, np.ndarray]] = ITEMS) -> str:
    io.save_v2(prefix, [k for k, _, _ in items], [s for _, s, _ in items], [v for _, _, v in items])
    return prefix


def _cli(s3_server: Any, *argv: str, cwd: "Path | None" = None) -> "subprocess.CompletedProcess[str]":
    """The command as a user runs it: a fresh process, the store named by the AWS variables."""
    env = {**clean_env(), **s3_server.env, "SHARDCKPT_PROGRESS": "never"}
    return subprocess.run([sys.executable, "-m", "shardckpt.cli.main", *argv], capture_output=True, text=True,
                          env=env, timeout=300, cwd=cwd)


def _data(prefix: str) -> str:
    return prefix + ".data-00000-of-00001"


# -- boto3: the store's own client ---------------------------------------------------------------

def _client(s3_server: Any) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.endpoint, aws_access_key_id="testing",
                        aws_secret_access_key="testing", region_name="us-east-1")


def _bucket_key(url: str) -> Tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def _get(s3_server: Any, url: str) -> bytes:
    bucket, key = _bucket_key(url)
    body: bytes = _client(s3_server).get_object(Bucket=bucket, Key=key)["Body"].read()
    return body


def _put(s3_server: Any, url: str, data: bytes) -> None:
    bucket, key = _bucket_key(url)
    _client(s3_server).put_object(Bucket=bucket, Key=key, Body=data)


def _delete(s3_server: Any, url: str) -> None:
    bucket, key = _bucket_key(url)
    _client(s3_server).delete_object(Bucket=bucket, Key=key)


def _entry_span(prefix: str, key: str) -> Tuple[int, int]:
    with BundleReader(Location.of(prefix)) as reader:
        entry = reader.entry(key)
        return int(entry.offset), int(entry.size)


def _needed(prefix: str) -> int:
    """The size the index says the data file has: the end of its last entry."""
    with BundleReader(Location.of(prefix)) as reader:
        return max(int(reader.entry(k).offset) + int(reader.entry(k).size) for k in reader.keys(include_slices=True)
                   if reader.entry(k).size)


def _read_all(path: str) -> Dict[str, np.ndarray]:
    with open_source(path) as source:
        return {info.name: source.read(info.name) for info in source.tensors()}


# -- inspect -------------------------------------------------------------------------------------

def test_inspect_lists_a_checkpoint_on_s3(s3_server: Any, s3dir: str) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    size = len(_get(s3_server, _data(prefix)))
    done = _cli(s3_server, "inspect", prefix)
    assert done.returncode == 0, done.stderr
    assert "MISSING" not in done.stdout
    assert f"ckpt.data-00000-of-00001  {size} bytes" in done.stdout
    for key in KEYS:
        assert key in done.stdout
    done = _cli(s3_server, "inspect", prefix, "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["data_files"] == [{"shard": 0, "path": _data(prefix), "size": size, "exists": True}]
    assert [t["key"] for t in doc["tensors"]] == KEYS
    # a folder without a checkpoint is an error naming it, as locally
    done = _cli(s3_server, "inspect", s3dir)
    assert done.returncode == 1 and "error:" in done.stderr and s3dir in done.stderr
    assert "Traceback" not in done.stderr
    # a folder whose state file names the checkpoint is read as that checkpoint
    update_checkpoint_state(s3dir, prefix)
    for command in ("inspect", "verify"):
        done = _cli(s3_server, command, s3dir)
        assert done.returncode == 0, done.stdout + done.stderr
        assert prefix in done.stdout and "MISSING" not in done.stdout


def test_inspect_key_and_tree_on_s3(s3_server: Any, s3dir: str) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    done = _cli(s3_server, "inspect", prefix, "--key", "model/kernel", "--json")
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["sliced"] and np.array_equal(np.array(doc["values"], np.float32), KERNEL)
    done = _cli(s3_server, "inspect", prefix, "--tree", "--json")
    assert done.returncode == 0, done.stderr
    tree = json.loads(done.stdout)
    assert tree["tensors"] == len(KEYS) and sorted(c["name"] for c in tree["children"]) == ["model", "step"]


def test_inspect_map_on_s3_to_a_local_file_and_to_an_object(s3_server: Any, s3dir: str, tmp_path: Path) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    out = tmp_path / "map.svg"
    done = _cli(s3_server, "inspect", prefix, "--map", str(out))
    assert done.returncode == 0, done.stderr
    svg = out.read_text()
    assert svg.count('class="piece" data-key="model/kernel"') == 2 and 'class="hole"' not in svg
    assert "ckpt.data-00000-of-00001" in svg
    url = f"{s3dir}/maps/map.html"
    done = _cli(s3_server, "inspect", prefix, "--map", url)
    assert done.returncode == 0, done.stderr
    page = _get(s3_server, url).decode()
    assert page.startswith("<!DOCTYPE html>") and page.count('class="piece" data-key="model/kernel"') == 2


# -- verify --------------------------------------------------------------------------------------

def test_verify_a_healthy_checkpoint_on_s3(s3_server: Any, s3dir: str) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    done = _cli(s3_server, "verify", prefix)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "MISSING" not in done.stdout
    assert done.stdout.strip().splitlines()[-1].startswith(f"OK: {len(KEYS)} tensors")
    done = _cli(s3_server, "verify", prefix, "--json")
    assert done.returncode == 0 and json.loads(done.stdout)["ok"] is True, done.stdout


def test_verify_names_a_flipped_byte_in_an_s3_object(s3_server: Any, s3dir: str) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    offset, size = _entry_span(prefix, "model/emb")
    data = bytearray(_get(s3_server, _data(prefix)))
    data[offset + size // 2] ^= 0x10
    _put(s3_server, _data(prefix), bytes(data))
    done = _cli(s3_server, "verify", prefix)
    assert done.returncode == 1, done.stdout
    assert "MISSING" not in done.stdout
    bad = [line for line in done.stdout.splitlines() if line.startswith("BAD")]
    assert len(bad) == 1 and "'model/emb'" in bad[0] and _data(prefix) in bad[0] and "checksum" in bad[0], bad
    assert done.stdout.strip().splitlines()[-1].startswith(f"FAILED: 1 of {len(KEYS)} entries bad")


def test_verify_names_a_truncated_and_a_missing_s3_object(s3_server: Any, s3dir: str) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    offset, size = _entry_span(prefix, "model/emb")
    data = _get(s3_server, _data(prefix))
    _put(s3_server, _data(prefix), data[:offset + size - 1])
    done = _cli(s3_server, "verify", prefix)
    assert done.returncode == 1, done.stdout
    bad = [line for line in done.stdout.splitlines() if line.startswith("BAD")]
    assert bad and any("'model/emb'" in line and _data(prefix) in line for line in bad), done.stdout
    assert "MISSING" not in done.stdout
    _delete(s3_server, _data(prefix))
    done = _cli(s3_server, "verify", prefix)
    assert done.returncode == 1
    assert f"MISSING data file {_data(prefix)}" in done.stdout


# -- diff and convert ----------------------------------------------------------------------------

def test_diff_two_checkpoints_on_s3(s3_server: Any, s3dir: str, tmp_path: Path) -> None:
    a = _save(f"{s3dir}/a")
    b = _save(f"{s3dir}/b")
    done = _cli(s3_server, "diff", a, b)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().endswith("EQUAL")
    changed = [(k, s, v + np.float32(1) if k == "model/bias" else v) for k, s, v in ITEMS]
    c = _save(f"{s3dir}/c", changed)
    done = _cli(s3_server, "diff", a, c, "--json")
    assert done.returncode == 1, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert [t["name"] for t in doc["tensors"] if not t["equal"]] == ["model/bias"]
    done = _cli(s3_server, "diff", a, f"{s3dir}/nothing")
    assert done.returncode == 2 and "error:" in done.stderr and "Traceback" not in done.stderr


def test_convert_to_and_from_a_local_safetensors_file(s3_server: Any, s3dir: str, tmp_path: Path) -> None:
    prefix = _save(f"{s3dir}/ckpt")
    local = tmp_path / "model.safetensors"
    done = _cli(s3_server, "convert", prefix, str(local))
    assert done.returncode == 0, done.stderr
    values = _read_all(str(local))
    assert sorted(values) == KEYS and np.array_equal(values["model/kernel"], KERNEL)
    back = f"{s3dir}/back/model.ckpt"
    done = _cli(s3_server, "convert", str(local), back, "--to", "tf")
    assert done.returncode == 0, done.stderr
    done = _cli(s3_server, "verify", back)
    assert done.returncode == 0, done.stdout + done.stderr
    done = _cli(s3_server, "diff", prefix, back)
    assert done.returncode == 0, done.stdout + done.stderr
    # a name map read from the store, and a safetensors object inspected as a tree
    names = f"{s3dir}/names.json"
    _put(s3_server, names, json.dumps({"model/bias": "renamed/bias"}).encode())
    st = f"{s3dir}/renamed.safetensors"
    done = _cli(s3_server, "convert", prefix, st, "--map", names)
    assert done.returncode == 0, done.stderr
    done = _cli(s3_server, "inspect", st, "--tree")
    assert done.returncode == 0, done.stderr
    assert "renamed" in done.stdout and "bias" in done.stdout


# -- a data file shorter than the index says: inspect knows it without reading tensor bytes ----------

def _truncate_local(prefix: str, by: int) -> int:
    path = _data(prefix)
    size = os.path.getsize(path) - by
    with open(path, "r+b") as f:
        f.truncate(size)
    return size


def _check_short_reported(done: "subprocess.CompletedProcess[str]", data: str, size: int, needed: int) -> None:
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if data in line]
    assert lines and re.search(rf"{size} bytes.*{needed}", lines[0]), done.stderr


@pytest.mark.parametrize("store", ["local", "s3"])
def test_inspect_map_and_listing_name_a_truncated_data_file(s3_server: Any, s3dir: str, tmp_path: Path,
                                                            store: str) -> None:
    prefix = _save(f"{s3dir}/ckpt" if store == "s3" else str(tmp_path / "ckpt"))
    needed = _needed(prefix)
    if store == "s3":
        data = _get(s3_server, _data(prefix))
        assert len(data) == needed
        short = needed - 100
        _put(s3_server, _data(prefix), data[:short])
    else:
        short = _truncate_local(prefix, 100)
    out = tmp_path / "map.svg"
    done = _cli(s3_server, "inspect", prefix, "--map", str(out))
    _check_short_reported(done, _data(prefix), short, needed)
    done = _cli(s3_server, "inspect", prefix)
    _check_short_reported(done, _data(prefix), short, needed)
    assert f"{short} bytes" in done.stdout  # the listing is still printed
    done = _cli(s3_server, "inspect", prefix, "--json")
    assert done.returncode == 1
    doc: Dict[str, Any] = json.loads(done.stdout)
    assert doc["data_files"][0]["size"] == short
    done = _cli(s3_server, "inspect", prefix, "--tree")
    _check_short_reported(done, _data(prefix), short, needed)
    # a tensor whose bytes are all there is still shown with --key
    done = _cli(s3_server, "inspect", prefix, "--key", "model/bias")
    assert done.returncode == 0, done.stderr


# -- demo ----------------------------------------------------------------------------------------

def test_demo_writes_and_resumes_its_checkpoints_on_s3(s3_server: Any, s3dir: str, tmp_path: Path) -> None:
    done = _cli(s3_server, "demo", "--dir", s3dir, "--clients", "2", "--resume-clients", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []  # nothing written to a local folder named "s3:"
    assert "all checks passed" in done.stdout and "MISSING" not in done.stdout
    assert f"checkpoint: {s3dir}/train/ckpt-" in done.stdout
    keys = _client(s3_server).list_objects_v2(Bucket=s3_server.bucket, Prefix=_bucket_key(s3dir)[1] + "/")
    names = {item["Key"].rsplit("/", 1)[-1] for item in keys.get("Contents", [])}
    assert "checkpoint" in names and any(n.endswith(".index") for n in names), names
    assert {"client-first-0.json", "client-first-1.json", "client-second-0.json"} <= names, names


def test_inspect_map_and_tree_name_a_bad_entry(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A bad index entry makes ``--map`` and ``--tree`` exit 1 as before, and now says which one (stderr)."""
    from test_cli import rewrite_entry

    from shardckpt.cli.main import main

    prefix = _save(str(tmp_path / "ckpt"))
    rewrite_entry(prefix, b"model/bias", shard_id=3)  # the bundle has one shard
    for argv in (["--map", str(tmp_path / "map.svg")], ["--tree"]):
        assert main(["inspect", prefix, *argv]) == 1
        err = capsys.readouterr().err
        assert "error: " in err and "'model/bias'" in err and "shard_id=3" in err, (argv, err)
