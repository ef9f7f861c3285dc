"""Object stores: checkpoints on a real S3-protocol server (moto's standalone server on loopback).

The server is a separate process started by the ``s3_server`` session fixture
(conftest.py); clients reach it through the standard AWS environment variables.
A small HTTP proxy in front of it injects 503 errors for the retry tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from typing import Any

import numpy as np
import pytest
import s3fs  # noqa: E402,F401 - the optional extra; the test extra installs it (missing = failure, not a skip)

import shardckpt
from shardckpt import dtensor
from shardckpt.errors import NotFoundError, ShardckptError, StorageError
from shardckpt.format.bundle_reader import BundleReader
from shardckpt.restoring import RestoreRequest
from shardckpt.storage import configure
from shardckpt.storage.fsspec_fs import FsspecFileSystem
from shardckpt.storage.location import Location

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "helpers"))
from s3_faults import FaultProxy, configured, s3_fs  # noqa: E402  (tests/helpers)


def _names(directory: str) -> list:
    return s3_fs().listdir(directory)


def _arrays(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((256, 384)).astype(np.float32),
        "b": rng.standard_normal(384).astype(np.float64),
        "i": np.arange(1000, dtype=np.int64),
        "s": np.array([b"alpha", b"", b"gamma"], dtype=object),
        "scalar": np.float32(3.5),
    }


def _check(reader: Any, expected: dict) -> None:
    for key, value in expected.items():
        got = reader.get_tensor(key)
        assert got.dtype == np.asarray(value).dtype, key
        np.testing.assert_array_equal(got, value)


# -- saving and restoring -------------------------------------------------------------------


def test_save_and_restore_sync(s3dir: str) -> None:
    arrays = _arrays()
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, arrays)
    assert _names(s3dir) == ["ck.data-00000-of-00001", "ck.index"]
    with shardckpt.load_checkpoint(prefix) as reader:
        _check(reader, arrays)
    out = shardckpt.restore_tensors(prefix, ["w", RestoreRequest("i", "10,20")])
    np.testing.assert_array_equal(out[0], arrays["w"])
    np.testing.assert_array_equal(out[1], arrays["i"][10:30])


def test_sharded_save_and_overwrite_keeps_old_until_commit(s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    policy = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(100_000))
    first = _arrays(1)
    shardckpt.save_tensors(prefix, first, policy)
    names = _names(s3dir)
    n = int(names[0].split("-of-")[1])
    assert n > 2 and names == [f"ck.data-{i:05d}-of-{n:05d}" for i in range(n)] + ["ck.index"]
    second = _arrays(2)
    shardckpt.save_tensors(prefix, second, policy)  # same shard count: one empty padding object
    names = _names(s3dir)
    assert names == [f"ck.data-{i:05d}-of-{n + 1:05d}" for i in range(n + 1)] + ["ck.index"]
    assert s3_fs().size(f"{prefix}.data-{n:05d}-of-{n + 1:05d}") == 0
    with shardckpt.load_checkpoint(prefix) as reader:
        _check(reader, second)


def test_async_save(s3dir: str) -> None:
    model = shardckpt.Module()
    model.w = shardckpt.Variable(np.arange(100_000, dtype=np.float32))
    ckpt = shardckpt.Checkpoint(model=model)
    path = ckpt.save(f"{s3dir}/ckpt", options=shardckpt.CheckpointOptions(enable_async=True))
    model.w.assign(np.zeros(100_000, dtype=np.float32))  # after the snapshot: not in the checkpoint
    ckpt.sync()
    assert shardckpt.latest_checkpoint(s3dir) == path == f"{s3dir}/ckpt-1"
    other = shardckpt.Module()
    other.w = shardckpt.Variable(np.ones(100_000, dtype=np.float32))
    shardckpt.Checkpoint(model=other).restore(s3dir).assert_consumed()
    np.testing.assert_array_equal(other.w.numpy(), np.arange(100_000, dtype=np.float32))


def test_checkpoint_manager_retention(s3dir: str) -> None:
    v = shardckpt.Variable(np.zeros(10, dtype=np.float32))
    ckpt = shardckpt.Checkpoint(v=v)
    manager = shardckpt.CheckpointManager(ckpt, s3dir, max_to_keep=2)
    for step in range(4):
        v.assign(np.full(10, step, dtype=np.float32))
        manager.save()
    assert _names(s3dir) == ["checkpoint", "ckpt-3.data-00000-of-00001", "ckpt-3.index",
                             "ckpt-4.data-00000-of-00001", "ckpt-4.index"]
    # data objects without an index: young ones may be a live writer's and stay; once older than
    # the store's grace period (stale_after) they are a dead save's, removed by the manager's next save
    fs = s3_fs()
    fs.write_atomic(f"{s3dir}/ckpt-9.data-00000-of-00001", b"partial")
    v.assign(np.full(10, 3, dtype=np.float32))
    manager.save(checkpoint_number=4)
    assert "ckpt-9.data-00000-of-00001" in _names(s3dir)
    from shardckpt.storage import configure

    try:
        configure("s3", stale_after=0)
        manager.save(checkpoint_number=4)
    finally:
        configure("s3")
    assert "ckpt-9.data-00000-of-00001" not in _names(s3dir)
    state = shardckpt.get_checkpoint_state(s3dir)
    assert list(state.all_model_checkpoint_paths) == [f"{s3dir}/ckpt-3", f"{s3dir}/ckpt-4"]
    again = shardckpt.CheckpointManager(shardckpt.Checkpoint(v=shardckpt.Variable(np.ones(10, np.float32))),
                                        s3dir, max_to_keep=2)
    assert again.latest_checkpoint == f"{s3dir}/ckpt-4"
    restored = shardckpt.Variable(np.ones(10, np.float32))
    shardckpt.Checkpoint(v=restored).restore(again.latest_checkpoint).assert_consumed()
    np.testing.assert_array_equal(restored.numpy(), np.full(10, 3, np.float32))


def test_partial_region_reads_follow_the_cost_model(s3dir: str) -> None:
    a = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, {"a": a})
    fs = s3_fs()
    region = ((100, 300), (64, 192))  # 200 rows of 512 bytes, 1,536-byte gaps
    with BundleReader(Location.of(prefix)) as reader:
        fs.reset_stats()
        got = reader.read_region("a", region)
        np.testing.assert_array_equal(got, a[100:300, 64:192])
        # gaps cost far less than a request: one GET of the rows' span instead of 200
        assert fs.stats["read_requests"] == 1 and fs.stats["bytes_read"] == 199 * 2048 + 512, fs.stats
    try:
        configure("s3", read_latency=0.0)  # requests free: fetch exactly the region, one GET per row
        fs = s3_fs()
        with BundleReader(Location.of(prefix)) as reader:
            fs.reset_stats()
            np.testing.assert_array_equal(reader.read_region("a", region), a[100:300, 64:192])
            assert fs.stats["bytes_read"] == got.nbytes and fs.stats["read_requests"] == 200, fs.stats
    finally:
        configure("s3")


def test_gap_bytes_of_a_merged_read_serve_the_next_region(s3dir: str) -> None:
    a = np.arange(256 * 256, dtype=np.float32).reshape(256, 256)
    prefix = f"{s3dir}/ck"
    shardckpt.save_tensors(prefix, {"a": a})
    fs = s3_fs()
    with BundleReader(Location.of(prefix)) as reader:
        fs.reset_stats()
        left = reader.read_region("a", ((0, 256), (0, 128)))
        right = reader.read_region("a", ((0, 256), (128, 256)))  # inside the first GET's span, bar the last row
        np.testing.assert_array_equal(np.concatenate([left, right], axis=1), a)
        assert fs.stats["bytes_read"] <= a.nbytes + 512 and fs.stats["read_requests"] <= 2, fs.stats
        assert fs.stats["cache_hits"] >= 255


def test_resharded_dtensor_restore(s3dir: str) -> None:
    full = np.arange(128 * 96, dtype=np.float32).reshape(128, 96)
    mesh24 = dtensor.create_mesh([("x", 2), ("y", 4)])
    saved = dtensor.DVariable.from_global(full, dtensor.Layout(["x", "y"], mesh24))
    prefix = dtensor.DTensorCheckpoint(mesh24, v=saved).save(f"{s3dir}/dt")
    assert shardckpt.latest_checkpoint(s3dir) == prefix
    mesh4 = dtensor.create_mesh([("a", 4)])
    for spec in (["unsharded", "a"], ["a", "unsharded"]):
        target = dtensor.DVariable.from_global(np.zeros_like(full), dtensor.Layout(spec, mesh4))
        fs = s3_fs()
        fs.reset_stats()
        dtensor.DTensorCheckpoint(mesh4, v=target).restore(prefix).assert_consumed()
        np.testing.assert_array_equal(dtensor.to_global(target.value()), full)
        index = fs.size(prefix + ".index")
        assert fs.stats["bytes_read"] - index <= 1.1 * full.nbytes + 64, fs.stats


def test_missing_checkpoint_and_bucket_are_clear_errors(s3_server: Any) -> None:
    with pytest.raises(NotFoundError, match="no checkpoint at this prefix"):
        shardckpt.load_checkpoint(s3_server.url("nothing-here", "ck"))
    with pytest.raises(NotFoundError, match="bucket does not exist") as info:
        shardckpt.save_tensors("s3://no-such-bucket-shardckpt/ck", {"a": np.arange(3)})
    assert "s3://no-such-bucket-shardckpt" in str(info.value)
    assert shardckpt.latest_checkpoint(s3_server.url("nothing-here")) is None


def test_bad_credentials_are_a_clear_error(s3_server: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # moto checks no signatures; an unknown access key is refused only by real S3. Emulate the
    # answer with the fault proxy instead (403 InvalidAccessKeyId): never retried.
    with FaultProxy(s3_server.endpoint, status=403, code="InvalidAccessKeyId") as proxy:
        proxy.fail_next(10**9)
        with configured(proxy.endpoint, retries=5):
            with pytest.raises(StorageError, match="access denied") as info:
                shardckpt.save_tensors(f"s3://{s3_server.bucket}/creds/ck", {"a": np.arange(3)})
            assert f"s3://{s3_server.bucket}/creds" in str(info.value)
        assert proxy.failed >= 1 and len(proxy.requests) == len(set(proxy.requests)), proxy.requests  # no retry


# -- faults ------------------------------------------------------------------------------------


def test_transient_errors_are_retried(s3_server: Any, s3dir: str) -> None:
    arrays = _arrays(3)
    big = np.random.default_rng(0).standard_normal(3 << 20).astype(np.float32)  # 12 MiB: a multipart upload
    arrays["big"] = big
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint, retries=6, backoff=0.01,
                                                                 part_size=5 << 20, multipart_threshold=5 << 20):
        prefix = f"{s3dir}/ck"
        for n in (1, 3):  # every request kind: listings, HEADs, part uploads, the index PUT
            proxy.fail_next(n)
            shardckpt.save_tensors(prefix, arrays)
        # fail every part upload's first attempts
        proxy.match = lambda method, path: method == "PUT" and "partNumber" in path
        proxy.fail_next(4)
        shardckpt.save_tensors(prefix, arrays)
        assert proxy.failed == 1 + 3 + 4
        proxy.match = lambda method, path: True
        proxy.fail_next(2)
        with shardckpt.load_checkpoint(prefix) as reader:
            _check(reader, arrays)
        assert s3_fs().stats["retries"] >= 2


def test_persistent_errors_fail_clearly_and_commit_nothing(s3_server: Any, s3dir: str) -> None:
    prefix = f"{s3dir}/ck"
    old = {"a": np.arange(10.0)}
    shardckpt.save_tensors(prefix, old)
    big = {"a": np.random.default_rng(1).standard_normal(2 << 20)}  # 16 MiB: multipart
    with FaultProxy(s3_server.endpoint, match=lambda m, p: m == "PUT" and "partNumber=2" in p) as proxy, \
            configured(proxy.endpoint, retries=3, backoff=0.01, part_size=5 << 20, multipart_threshold=5 << 20):
        proxy.fail_next(10**9)
        started = time.monotonic()
        with pytest.raises(StorageError, match="after 3 attempts") as info:
            shardckpt.save_tensors(prefix, big)
        assert time.monotonic() - started < 30
        assert "ck.data-00000-of-00002" in str(info.value)
        assert proxy.failed == 3
    assert _names(s3dir) == ["ck.data-00000-of-00001", "ck.index"]
    with shardckpt.load_checkpoint(prefix) as reader:
        _check(reader, old)
    uploads = s3_fs().fs.list_multipart_uploads(s3_server.bucket)
    assert not [u for u in uploads if u["Key"].startswith(s3dir.split("/", 3)[3])]  # aborted


_KILLED_SAVE = textwrap.dedent("""
    import sys, numpy as np, shardckpt
    from shardckpt.storage import configure
    configure("s3", part_size=5 << 20, multipart_threshold=5 << 20, max_concurrency=2)
    prefix = sys.argv[1]
    rng = np.random.default_rng(7)
    values = {f"w{i}": rng.standard_normal(4 << 20).astype(np.float32) for i in range(6)}  # 6 x 16 MiB
    print("saving", flush=True)
    shardckpt.save_tensors(prefix, values, shardckpt.CheckpointOptions(
        sharding_callback=shardckpt.MaxShardSizePolicy(16 << 20)), max_workers=2)
    print("committed", flush=True)
""")


def test_save_killed_mid_upload_leaves_previous_checkpoint_and_next_save_aborts_stale_uploads(
        s3_server: Any, s3dir: str, tmp_path: Any) -> None:
    v = shardckpt.Variable(np.arange(1000, dtype=np.float32))
    ckpt = shardckpt.Checkpoint(v=v)
    first = ckpt.save(f"{s3dir}/ckpt")
    script = tmp_path / "killed_save.py"
    script.write_text(_KILLED_SAVE)
    proc = subprocess.Popen([sys.executable, str(script), first], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    fs = s3_fs()
    key = first.split("/", 3)[3]
    deadline = time.monotonic() + 120
    try:
        # kill once some data objects are complete and another upload is under way
        while time.monotonic() < deadline:
            done = [n for n in _names(s3dir) if n.startswith("ckpt-1.data-") and not n.endswith("-of-00001")]
            uploading = [u for u in fs.fs.list_multipart_uploads(s3_server.bucket) if u["Key"].startswith(key)
                         and fs.upload_activity(f"s3://{s3_server.bucket}/{u['Key']}", u["UploadId"]) > 0]
            if done and uploading:  # (moto reports a fixed start time: wait for a part to date the upload)
                break
            assert proc.poll() is None, "the save finished before it could be interrupted"
            time.sleep(0.02)
        else:
            pytest.fail("no upload was seen in progress")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert shardckpt.latest_checkpoint(s3dir) == first
    restored = shardckpt.Variable(np.zeros(1000, np.float32))
    shardckpt.Checkpoint(v=restored).restore(shardckpt.latest_checkpoint(s3dir)).assert_consumed()
    np.testing.assert_array_equal(restored.numpy(), np.arange(1000, dtype=np.float32))
    leftovers = [n for n in _names(s3dir) if n.startswith("ckpt-1.data-") and not n.endswith("-of-00001")]
    assert leftovers  # the dead save's complete objects and its incomplete upload(s) ...

    def uploads() -> list:
        return [u for u in s3_fs().fs.list_multipart_uploads(s3_server.bucket) if u["Key"].startswith(key)]

    # a live writer's upload beside them (a part sent just now): never touched
    live_key = f"{key.rsplit('/', 1)[0]}/ckpt-1.data-00000-of-00009"
    live = fs.fs.call_s3("create_multipart_upload", Bucket=s3_server.bucket, Key=live_key)["UploadId"]
    fs.fs.call_s3("upload_part", Bucket=s3_server.bucket, Key=live_key, UploadId=live, PartNumber=1,
                  Body=b"x" * (5 << 20))
    ckpt.write(first)  # ... are young: they could be a live writer's, so the next save keeps (and avoids) them
    names = _names(s3dir)
    assert set(leftovers) <= set(names)
    assert live in [u["UploadId"] for u in uploads()]
    try:
        configure("s3", stale_after=0)  # older than the grace period: a dead save's, removed and aborted
        ckpt.write(first)
        assert uploads() == []
        names = _names(s3dir)
        counts = {x.split("-of-")[1] for x in names if ".data-" in x}
        assert len(counts) == 1 and [x for x in names if ".data-" not in x] == ["checkpoint", "ckpt-1.index"]
    finally:
        configure("s3")
    restored = shardckpt.Variable(np.zeros(1000, np.float32))
    shardckpt.Checkpoint(v=restored).restore(first).assert_consumed()


# -- multi-client ------------------------------------------------------------------------------

_CLIENT = textwrap.dedent("""
    import json, sys
    import numpy as np

    def work(group, rank, prefix, out):
        import shardckpt
        from shardckpt.distributed.local import LocalProcessCoordinator
        from shardckpt.saving.distributed import save_tensors_distributed
        coord = LocalProcessCoordinator(group, rank)
        full = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
        size = coord.size
        rows = 64 // size
        pieces = [shardckpt.ShardableTensor.from_value(
            "w", full[rank * rows:(rank + 1) * rows],
            slice_spec=f"64 48 {rank * rows},{rows}:-", device=f"/job:worker/task:{rank}/device:CPU:0")]
        if rank == 0:
            pieces.append(shardckpt.ShardableTensor.from_value("step", np.int64(5),
                                                               device="/job:worker/task:0/device:CPU:0"))
        for asynchronous in (False, True):
            save_tensors_distributed(prefix + ("-async" if asynchronous else ""), pieces,
                                     shardckpt.CheckpointOptions(enable_async=asynchronous), coord, timeout=120)
        from shardckpt.saving.context import default_saver
        default_saver().wait()
        coord.barrier("done", timeout=120)
        json.dump({"rank": rank}, open(f"{out}/client-{rank}.json", "w"))

    if __name__ == "__main__":
        import multiprocessing as mp
        from shardckpt.distributed.local import local_group
        prefix, out, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
        ctx = mp.get_context("spawn")
        group = local_group(n, ctx)
        procs = [ctx.Process(target=work, args=(group, r, prefix, out)) for r in range(n)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
        sys.exit(max(abs(p.exitcode or 0) for p in procs))
""")


def test_multi_client_save(s3_server: Any, s3dir: str, tmp_path: Any) -> None:
    script = tmp_path / "clients.py"
    script.write_text(_CLIENT)
    prefix = f"{s3dir}/mc"
    result = subprocess.run([sys.executable, str(script), prefix, str(tmp_path), "2"], capture_output=True,
                            text=True, timeout=300, env={**os.environ, "PYTHONPATH": os.path.join(REPO, "src")})
    assert result.returncode == 0, result.stderr[-3000:]
    full = np.arange(64 * 48, dtype=np.float32).reshape(64, 48)
    for p in (prefix, prefix + "-async"):
        with shardckpt.load_checkpoint(p) as reader:
            np.testing.assert_array_equal(reader.get_tensor("w"), full)
            assert reader.get_tensor("step") == 5
        assert [n for n in _names(s3dir) if n.startswith(p.rsplit("/", 1)[1] + ".")] == \
            [f"{p.rsplit('/', 1)[1]}.data-{i:05d}-of-00002" for i in range(2)] + [p.rsplit("/", 1)[1] + ".index"]
    # a resharded restore: two row blocks of the other layout, straight from the store
    out = shardckpt.restore_tensors(prefix, [RestoreRequest("w", "0,64:0,24"), RestoreRequest("w", "0,64:24,24")])
    np.testing.assert_array_equal(np.concatenate(out, axis=1), full)


# -- TensorFlow reads it -----------------------------------------------------------------------


def test_tensorflow_reads_a_checkpoint_from_the_store(s3dir: str, tmp_path: Any, tf_oracle: Any) -> None:
    arrays = _arrays(5)
    arrays["bf"] = np.arange(12, dtype=np.float32).reshape(3, 4)
    prefix = f"{s3dir}/ck"
    policy = shardckpt.CheckpointOptions(sharding_callback=shardckpt.MaxShardSizePolicy(50_000))
    shardckpt.save_tensors(prefix, _arrays(4), policy)
    shardckpt.save_tensors(prefix, arrays, policy)  # with padding objects
    fs = s3_fs()
    local = tmp_path / "copy"
    local.mkdir()
    for name in _names(s3dir):
        (local / name).write_bytes(fs.read_bytes(f"{s3dir}/{name}"))
    tensors, errors, dtypes = tf_oracle.load_checkpoint(str(local / "ck"))
    assert not errors, errors
    for key, value in arrays.items():
        got = tensors[key]
        expected = np.asarray(value)
        if expected.dtype == object:
            assert list(np.asarray(got).reshape(-1)) == list(expected.reshape(-1)), key
        else:
            assert np.asarray(got).tobytes() == expected.tobytes(), key


def test_memory_filesystem_roundtrip() -> None:
    arrays = _arrays(6)
    prefix = f"memory://shardckpt-{uuid.uuid4().hex[:8]}/ck"
    shardckpt.save_tensors(prefix, arrays, shardckpt.CheckpointOptions(
        sharding_callback=shardckpt.MaxShardSizePolicy(100_000)))
    with shardckpt.load_checkpoint(prefix) as reader:
        _check(reader, arrays)


def test_shardckpt_error_family() -> None:
    assert issubclass(StorageError, ShardckptError)


def test_read_planner_merges_gaps_cheaper_than_a_request() -> None:
    import fsspec

    fs = FsspecFileSystem(fsspec.filesystem("memory"), "memory", read_latency=0.01, read_bandwidth=1e6,
                          read_part_size=1 << 20)
    assert fs.gap_limit() == 10_000  # 10 ms at 1 MB/s: a gap under 10 kB is cheaper to download
    rows = [(i * 20_000, 8_000) for i in range(10)]  # 12 kB gaps: dearer than a request
    assert [g[2] for g in fs.plan_reads(rows)] == [[i] for i in range(10)]
    rows = [(i * 16_000, 8_000) for i in range(10)][::-1]  # 8 kB gaps, unsorted: one GET
    assert fs.plan_reads(rows) == [(0, 152_000, list(range(9, -1, -1)))]
    big = [(i * 1_000_000, 1_000_000) for i in range(5)]  # contiguous 5 MB: split at max(1 MiB, 4 gap limits)
    assert [(s, e) for s, e, _ in fs.plan_reads(big)] == [(i * 1_000_000, (i + 1) * 1_000_000) for i in range(5)]


def test_objects_up_to_the_multipart_threshold_are_one_put(s3_server: Any, s3dir: str) -> None:
    rng = np.random.default_rng(9)
    small = {"a": rng.standard_normal(10 << 20 >> 3)}  # 10 MiB data object
    large = {"a": rng.standard_normal(23 << 20 >> 3)}  # 23 MiB: past the threshold, parts of 5 MiB
    with FaultProxy(s3_server.endpoint) as proxy, configured(proxy.endpoint, part_size=5 << 20,
                                                              multipart_threshold=12 << 20):
        for name, values, parts in (("small", small, 0), ("large", large, 5)):
            proxy.requests.clear()
            shardckpt.save_tensors(f"{s3dir}/{name}", values)
            data = [r for r in proxy.requests if ".data-" in r]
            assert len([r for r in data if "partNumber=" in r]) == parts, data
            assert len([r for r in data if r.startswith("PUT") and "partNumber=" not in r]) == (parts == 0), data
            with shardckpt.load_checkpoint(f"{s3dir}/{name}") as reader:
                np.testing.assert_array_equal(reader.get_tensor("a"), values["a"])
