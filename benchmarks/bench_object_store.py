"""Object stores: shardckpt against plain s3fs on the same local S3 server (moto's standalone server).

Three numbers, as ratios (the server is the same for both sides, so its own speed cancels):

* upload: ``save_tensors`` to ``s3://`` (one PUT per data object up to the multipart
  threshold, checksums, the listing before and the check and index PUT after: the
  commit) vs plain ``s3fs`` ``put`` of the same data files from local disk (throughput
  ratio, target >= 0.95);
* download: ``restore_tensors`` of every tensor (one listing + the index in one round
  trip, then the ranges of all tensors planned together into few large ranged GETs sent
  at once, read into the arrays, CRC checks) vs plain ``s3fs`` ``cat`` of the same
  objects (target >= 0.9);
* ``Checkpoint.restore`` of the same tensors as variables of a ``Module`` (written by
  ``Checkpoint.write``, restored into existing variables: the object graph, then every
  variable's bytes announced and fetched in few large GETs) vs the same plain ``cat``;
* the S3 requests of one save, one full restore and one ``Checkpoint.restore``, by operation (botocore's
  ``before-call`` event on the client: what was sent, retries aside);
* resharded restore: a tensor saved in row blocks by 4 clients read back in column
  blocks by 2, in one process (both halves: every byte is needed) and by one client
  (its half only): time against a plain sequential ``s3fs`` download of the same data
  objects (target <= 2x), GET count, and bytes fetched / needed (target <= 1.25 when
  every byte is needed; the one-client case shows what the cost model trades);
* the store's cost model: per-request latency (median of small GETs) and bandwidth
  (one large GET), and the gap the read planner merges over at those values.

The machine's CPU is shared with the server (and, on a shared box, with other work):
ratios are what to compare, not absolute speeds.

    .venv/bin/python benchmarks/bench_object_store.py --size 64MiB [--repeat 3]

Needs the test extra (``moto[server]``, ``s3fs``). Results: a table on stdout and
``benchmarks/results/object-store-<size>-<time>.json``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from typing import Any, Dict

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common as C  # noqa: E402
from common import fmt_size, parse_size  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto() -> "tuple[subprocess.Popen, str]":
    port = _free_port()
    endpoint = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=2).read()
            return proc, endpoint
        except Exception:
            if proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.2)


def _ops(counts: Dict[str, int]) -> str:
    return ", ".join(f"{n} {op}" for op, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="64MiB", help="bytes of the checkpoint (default 64MiB)")
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--shards", type=int, default=4, help="data files of the checkpoint")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dir", default=None, help="folder for the local copies of the data files (default: /tmp)")
    ap.add_argument("--out", default=None, help="folder of the results file (default: benchmarks/results, or "
                                                  f"${C.RESULTS_ENV})")
    # smoke: tensors of 2 MiB (large entries: they start at the page phase, the data files hold padding)
    args = C.parse_args(ap, size="8MiB", tensors=4, repeat=1)
    nbytes = parse_size(args.size)

    local_dir = ""
    proc, endpoint = start_moto()
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint})
    try:
        import shardckpt
        from shardckpt.storage import get_fs
        from shardckpt.storage.fsspec_fs import FsspecFileSystem
        from shardckpt.storage.registry import mounted

        store = get_fs("s3://bench/x")
        s3 = store.fs  # the plain s3fs filesystem, same client settings
        bucket = "bench"
        s3.mkdir(bucket)
        rng = np.random.default_rng(0)
        each = nbytes // args.tensors // 4
        tensors = {f"t{i}": rng.standard_normal(each).astype(np.float32) for i in range(args.tensors)}
        total = sum(t.nbytes for t in tensors.values())
        policy = shardckpt.CheckpointOptions(
            sharding_callback=shardckpt.MaxShardSizePolicy(max(1, total // args.shards)))

        # local copies of the same data files, for the plain s3fs put
        local_dir = tempfile.mkdtemp(prefix="bench-os-", dir=args.dir)
        shardckpt.save_tensors(os.path.join(local_dir, "ck"), tensors, policy)
        local_files = sorted(os.path.join(local_dir, n) for n in os.listdir(local_dir) if ".data-" in n)
        num_files = len(local_files)

        calls: "collections.Counter[str]" = collections.Counter()

        def count_call(model: Any, **_: Any) -> None:
            calls[model.name] += 1

        # Checkpoint.restore of the same tensors as variables of a Module, into existing variables
        source = shardckpt.Module()
        source.tensors = [shardckpt.Variable(t) for t in tensors.values()]
        target = shardckpt.Module()
        target.tensors = [shardckpt.Variable(np.zeros_like(t)) for t in tensors.values()]

        up_ours, up_plain, down_ours, down_plain, down_ckpt = [], [], [], [], []
        save_calls: Dict[str, int] = {}
        restore_calls: Dict[str, int] = {}
        ckpt_calls: Dict[str, int] = {}
        for rep in range(args.repeat + 1):  # the first round warms both clients up and is not counted
            if rep == 1:
                s3.s3.meta.events.register("before-call.s3", count_call)
            calls.clear()
            prefix = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/ck"
            t0 = time.perf_counter()
            shardckpt.save_tensors(prefix, tensors, policy)
            up_ours.append(time.perf_counter() - t0)
            save_calls = dict(calls)

            plain_dir = f"s3://{bucket}/{uuid.uuid4().hex[:8]}"
            remote = [f"{plain_dir}/{os.path.basename(f)}" for f in local_files]
            t0 = time.perf_counter()
            s3.put(local_files, remote)
            up_plain.append(time.perf_counter() - t0)

            keys = list(tensors)
            store.reset_stats()
            calls.clear()
            t0 = time.perf_counter()
            out = shardckpt.restore_tensors(prefix, keys, max_workers=8)
            down_ours.append(time.perf_counter() - t0)
            restore_calls = dict(calls)
            full_restore_gets = store.stats["read_requests"]
            assert all(np.array_equal(a, tensors[k]) for a, k in zip(out, keys))

            t0 = time.perf_counter()
            got = s3.cat(remote)
            down_plain.append(time.perf_counter() - t0)
            downloaded = {os.path.basename(k): v for k, v in got.items()}
            assert sorted(downloaded) == sorted(map(os.path.basename, local_files)), sorted(downloaded)
            for path in local_files:  # the data objects' own bytes (padding included), not the tensors'
                with open(path, "rb") as f:
                    assert downloaded[os.path.basename(path)] == f.read(), f"plain download of {path} differs"

            ckpt_prefix = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/ckpt"
            shardckpt.Checkpoint(model=source).write(ckpt_prefix, policy)
            for v in target.tensors:
                v.assign(np.zeros(v.shape, np.float32))
            store.reset_stats()
            calls.clear()
            t0 = time.perf_counter()
            shardckpt.Checkpoint(model=target).read(ckpt_prefix).assert_consumed()  # write()/read(): no save_counter
            down_ckpt.append(time.perf_counter() - t0)
            ckpt_calls = dict(calls)
            ckpt_gets = store.stats["read_requests"]
            assert all(np.array_equal(v.numpy(), t) for v, t in zip(target.tensors, tensors.values()))
            del got, out
            s3.rm([prefix.rsplit("/", 1)[0], plain_dir, ckpt_prefix.rsplit("/", 1)[0]], recursive=True)
            if rep == 0:  # keep the server's memory flat (above); the warm-up round is not counted
                up_ours, up_plain, down_ours, down_plain, down_ckpt = [], [], [], [], []
        s3.s3.meta.events.unregister("before-call.s3", count_call)

        # resharded restore: saved in 4 row blocks (4 "clients"), read in 2 column blocks
        side = int((nbytes // 4) ** 0.5)
        full = rng.standard_normal((side, side)).astype(np.float32)
        rows = side // 4
        pieces = [shardckpt.ShardableTensor.from_value(
            "w", full[r * rows:(r + 1) * rows if r < 3 else side],
            slice_spec=f"{side} {side} {r * rows},{(rows if r < 3 else side - 3 * rows)}:-",
            device=f"/job:w/task:{r}/device:CPU:0") for r in range(4)]
        prefix = f"s3://{bucket}/{uuid.uuid4().hex[:8]}/resharded"
        shardckpt.save_tensors(prefix, pieces)
        half = side // 2
        requests = [shardckpt.RestoreRequest("w", f"0,{side}:0,{half}"),
                    shardckpt.RestoreRequest("w", f"0,{side}:{half},{side - half}")]
        index_size = store.size(prefix + ".index")
        data_objects = sorted(f"{prefix.rsplit('/', 1)[0]}/{n}" for n in store.listdir(prefix.rsplit("/", 1)[0])
                              if ".data-" in n)
        # the cost model's inputs, measured on this server: the time of a 1-byte ranged GET of an
        # object as large as the checkpoint's data objects (a request's cost), and one stream's bandwidth
        data_size = store.size(data_objects[0])
        lat = []
        for _ in range(20):
            t0 = time.perf_counter()
            s3.cat_file(data_objects[0], start=0, end=1)
            lat.append(time.perf_counter() - t0)
        latency = statistics.median(lat)
        bw = []
        for _ in range(3):
            t0 = time.perf_counter()
            s3.cat_file(data_objects[0])
            bw.append(data_size / (time.perf_counter() - t0))
        bandwidth = statistics.median(bw)
        full_runs = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            for path in data_objects:  # a full sequential download of the same objects
                s3.cat_file(path)
            full_runs.append(time.perf_counter() - t0)
        full_s = statistics.median(full_runs)
        reshard = {}
        measured = FsspecFileSystem(s3, "s3", read_latency=latency, read_bandwidth=bandwidth)
        for model, fs_used in (("defaults", store), ("measured", measured)):
            for case, reqs, needed in (("both halves", requests, full.nbytes),
                                       ("one half", requests[:1], full[:, :half].nbytes)):
                runs = []
                with mounted(fs_used, "s3"):
                    for _ in range(args.repeat):
                        fs_used.reset_stats()
                        t0 = time.perf_counter()
                        parts = shardckpt.restore_tensors(prefix, reqs)
                        runs.append(time.perf_counter() - t0)
                seconds = statistics.median(runs)
                expect = full if len(reqs) == 2 else full[:, :half]
                assert np.array_equal(np.concatenate(parts, axis=1), expect)
                fetched = fs_used.stats["bytes_read"] - index_size
                reshard[f"{case}, {model} cost model"] = {
                    "seconds": seconds, "vs_full_download": seconds / full_s, "fetched": fetched, "needed": needed,
                    "ratio": fetched / needed, "requests": fs_used.stats["read_requests"] - 1,
                    "cache_hits": fs_used.stats["cache_hits"], "gap_limit": fs_used.gap_limit()}

        def mb_s(seconds: float) -> float:
            return total / seconds / 1e6

        result = {
            "size": total, "tensors": args.tensors, "data_files": num_files, "repeat": args.repeat,
            "upload_s": {"shardckpt": statistics.median(up_ours), "s3fs_put": statistics.median(up_plain)},
            "download_s": {"shardckpt": statistics.median(down_ours), "s3fs_cat": statistics.median(down_plain)},
            "upload_ratio": statistics.median(up_plain) / statistics.median(up_ours),
            "download_ratio": statistics.median(down_plain) / statistics.median(down_ours),
            "checkpoint_restore_s": statistics.median(down_ckpt),
            "checkpoint_restore_ratio": statistics.median(down_plain) / statistics.median(down_ckpt),
            "full_restore_gets": full_restore_gets,
            "checkpoint_restore_gets": ckpt_gets,
            "requests": {"save": save_calls, "full_restore": restore_calls, "checkpoint_restore": ckpt_calls},
            "resharded": {"shape": [side, side], "full_download_s": full_s, **reshard},
            "cost_model": {"latency_s": latency, "bandwidth_Bps": bandwidth, "gap_limit": store.gap_limit(),
                           "defaults": {"read_latency": store.read_latency, "read_bandwidth": store.read_bandwidth}},
            "server": "moto (standalone server, loopback)",
            "samples_s": {"upload": [up_ours, up_plain], "download": [down_ours, down_plain]},
        }
        print(f"object store, {fmt_size(total)} in {args.tensors} tensors, {num_files} data files, "
              f"median of {args.repeat} (moto on loopback)")
        print(f"{'':28}{'shardckpt':>12}{'plain s3fs':>12}{'ratio':>8}{'target':>9}")
        print(f"{'upload (MB/s)':28}{mb_s(result['upload_s']['shardckpt']):12.1f}"
              f"{mb_s(result['upload_s']['s3fs_put']):12.1f}{result['upload_ratio']:8.2f}{'>= 0.95':>9}")
        print(f"{'download (MB/s)':28}{mb_s(result['download_s']['shardckpt']):12.1f}"
              f"{mb_s(result['download_s']['s3fs_cat']):12.1f}{result['download_ratio']:8.2f}{'>= 0.9':>9}"
              f"  ({full_restore_gets} GETs incl. the index)")
        print(f"{'Checkpoint.restore (MB/s)':28}{mb_s(result['checkpoint_restore_s']):12.1f}"
              f"{mb_s(result['download_s']['s3fs_cat']):12.1f}{result['checkpoint_restore_ratio']:8.2f}{'>= 0.9':>9}"
              f"  ({ckpt_gets} GETs incl. the index and the object graph)")
        print(f"requests of one save: {sum(save_calls.values())} ({_ops(save_calls)}); of one full restore: "
              f"{sum(restore_calls.values())} ({_ops(restore_calls)}); of one Checkpoint.restore: "
              f"{sum(ckpt_calls.values())} ({_ops(ckpt_calls)})")
        print(f"resharded restore of a {side}x{side} float32 tensor (4 row blocks -> 2 column blocks), medians of "
              f"{args.repeat}; full sequential download of its data objects: {full_s:.3f} s")
        for case, r in reshard.items():
            print(f"  {case:33} {r['seconds']:7.3f} s ({r['vs_full_download']:.2f}x the download, target <= 2)  "
                  f"{r['requests']} GETs, {r['cache_hits']} served from merged GETs, fetched "
                  f"{fmt_size(r['fetched'])} / needed {fmt_size(r['needed'])} = {r['ratio']:.3f}")
        print(f"cost model measured here: {latency * 1e3:.2f} ms per request on a {fmt_size(data_size)} object, "
              f"{bandwidth / 1e6:.0f} MB/s -> break-even gap {fmt_size(measured.gap_limit())} (defaults: "
              f"{store.read_latency * 1e3:.0f} ms, {store.read_bandwidth / 1e6:.0f} MB/s -> "
              f"{fmt_size(store.gap_limit())}). moto reads a whole object for every ranged GET, so a "
              f"request's cost there grows with the object's size.")
        folder = args.out or C.results_dir()
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"object-store-{args.size}-{time.strftime('%Y%m%d-%H%M%S')}.json")
        with open(path, "w") as f:
            json.dump(result, f, indent=2)
        print(f"results: {path}")
    finally:
        proc.terminate()
        proc.wait(10)
        if local_dir:
            shutil.rmtree(local_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
