"""Scale, simulated: what a save costs besides the data bytes, for N clients x T tensors, in one process.

The real code runs for every simulated client; only the data bytes and the transport are
left out (a simulated coordinator hands each "client" its share of what an all-gather
would give it). Every tensor is sliced across all clients along its first dimension (as
FSDP shards parameters), so the merged index holds ``T`` full entries and ``N x T`` slice
entries. Phases, each timed:

* ``client``: what every client other than the io client does for the save's metadata:
  ``make_save_plan`` of its ``T`` pieces (``plan`` alone also reported), the description
  of its pieces packed for the io client (``describe_pieces`` + ``pack_pieces``), the
  digest of the list of every variable it holds (``describe_held`` of its ``T`` DTensors +
  ``held_digest``; ``held`` alone also reported); its
  process's peak RSS then ("client peak": such a client only sends its table and receives
  the verdict);
* ``gather``: the bytes a client contributes to the save's gathers (packed piece
  descriptions for the agreement check; index entries on object stores), per entry;
* ``agree``: the io client's agreement check: the gathered JSON of every client decoded,
  as the coordinator's ``gather`` does, into the engine's ``Pieces`` messages, then
  ``check_pieces`` of all clients' packed tables (streaming, vectorized) and the comparison
  of their digests of what they hold (``held_representatives``), and the ``Verdict`` with
  the shard counts encoded for the broadcast; its peak RSS alone ("agree peak", where the
  peak can be reset);
* ``merge_mem``: the io client's merge of all clients' entries held in memory and the
  index bytes (the object-store commit: each client's gathered entries decoded,
  ``merge_entries`` + ``index_bytes``);
* ``merge_files``: the local commit's merge: ``read_index`` of the ``N`` part indexes
  (one at a time, as ``merge_bundles`` reads them), ``plan_merge``, index bytes, index written;
* ``open_read``: open the merged index (``BundleReader``) and read one whole tensor
  (its ``N`` slices, from ``N`` sparse data files; checksums verified);
* ``open_read_part``: open it again and read one client's rows of another tensor (what each
  client of a restore does: one of the ``N`` slices).

Each (N, T) runs in a fresh process, which plays the io client after the first phase;
peak RSS is reported for the whole run ("io peak": the process's ``ru_maxrss``, absolute,
and above the baseline it had after its imports) and, where Linux lets the peak be reset
(``/proc/self/clear_refs``), for the agreement check and each merge phase alone ("peak
mem/files": the most the process holds while the io client merges and writes the index,
above its baseline: the gathered entries and whatever RSS earlier phases left included;
"+added": above the RSS at the phase's start).

    .venv/bin/python benchmarks/bench_scale.py                       # N = 1..1024, T = 1000, 10000 (<= 2e6 entries)
    .venv/bin/python benchmarks/bench_scale.py --clients 8 --tensors 100   # smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List

import common as C

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ROWS, COLS = 2, 4  # rows of each tensor per client, columns: 32 bytes per slice


def _rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def _hwm_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _status_kib(field: str) -> int:
    return C.status_bytes(field) // 1024


def worker(n: int, t: int, folder: str) -> Dict[str, Any]:
    import numpy as np

    from shardckpt.dtensor import DTensor, Layout, Mesh
    from shardckpt.format import crc
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.format.bundle_writer import make_header  # noqa: F401 - imported by merge
    from shardckpt.format.merge import index_bytes, merge_entries, plan_merge, read_index
    from shardckpt.format.naming import data_filename, index_filename, sharded_filename
    from shardckpt.format.ordered_code import encode_tensor_name_slice
    from shardckpt.format.protos import tensor_bundle_pb2 as pb
    from shardckpt.format.tensor_slice import TensorSlice
    from shardckpt.saving.agreement import (
        check_pieces,
        describe_held,
        describe_pieces,
        held_digest,
        held_representatives,
        pack_pieces,
    )
    from shardckpt.saving.commit.index_last import _decode_entries, _encode_entries
    from shardckpt.saving.messages import Pieces, Verdict
    from shardckpt.saving.plan import make_save_plan
    from shardckpt.saving.rounds import Outcome
    from shardckpt.sharding.shardable import ShardableTensor
    from shardckpt.storage.local import local_fs

    base_rss = _rss_kib()
    out: Dict[str, Any] = {"clients": n, "tensors": t, "entries": n * t + t}
    rows = ROWS * n
    slice_bytes = ROWS * COLS * 4
    zero_crc = crc.mask(crc.value(bytes(slice_bytes)))
    keys = [f"model/layer_{i // 16}/w{i % 16}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(t)]

    # plan: one client's pieces (every client plans the same amount, in parallel)
    piece = np.zeros((ROWS, COLS), np.float32)
    pieces = [ShardableTensor.from_value(k, piece, slice_spec=f"{rows} {COLS} 0,{ROWS}:-",
                                         device="/job:worker/replica:0/task:0/device:CPU:0") for k in keys]
    t0 = time.perf_counter()
    plan = make_save_plan(pieces)
    out["plan_s"] = time.perf_counter() - t0
    described = describe_pieces(plan)
    packed = pack_pieces(described)
    pieces_s = time.perf_counter() - t0
    # what it holds: T DTensors sliced along rows over a mesh of N clients (one device each); made untimed
    mesh = Mesh(["x"], np.arange(n), [0], ["/job:worker/replica:0/task:0/device:CPU:0"],
                client_of={i: i for i in range(n)})
    layout = Layout(["x", "unsharded"], mesh)
    values = [(k, DTensor(layout, (rows, COLS), {0: piece})) for k in keys]
    t0 = time.perf_counter()
    digest = held_digest(describe_held(values))
    out["held_s"] = time.perf_counter() - t0
    mine = json.dumps(Pieces(1, packed, digest).to_json())  # what it sends the io client
    out["client_s"] = pieces_s + time.perf_counter() - t0
    out["client_peak_mib"] = _status_kib("VmHWM") / 1024
    out["gather_pieces_json_bytes_per_entry"] = len(json.dumps(described)) / t
    out["gather_pieces_bytes_per_entry"] = len(mine) / t
    del mine

    # agreement, on the io client: every client's descriptions (client r's boxes: its rows), gathered
    gathered_pieces = [json.dumps(Pieces(1, pack_pieces(
        {k: [d, s, [[[r * ROWS, (r + 1) * ROWS], [0, COLS]]]] for k, (d, s, _) in described.items()}),
        digest).to_json()) for r in range(n)]
    peak_before = _status_kib("VmHWM")
    windowed = C.reset_peak_rss()
    start_rss = _rss_kib()
    t0 = time.perf_counter()
    received = [Pieces.from_json(json.loads(g)) for g in gathered_pieces]  # the coordinator's decoding
    ask = held_representatives([g.held for g in received])
    verdict = Verdict(check_pieces([g.pieces for g in received]), tuple(g.shards for g in received),
                      None if ask is None else tuple(ask))
    json.dumps(Outcome(verdict).to_json())  # the broadcast
    out["agree_s"] = time.perf_counter() - t0
    out["agree_peak_mib"] = _status_kib("VmHWM") / 1024 if windowed else None
    out["agree_added_mib"] = (_status_kib("VmHWM") - start_rss) / 1024 if windowed else None
    assert verdict.problem is None and verdict.held_from is None, verdict
    del gathered_pieces, received
    peak_before = max(peak_before, _status_kib("VmHWM"))

    # each client's entries, as its writer would produce them (shard id = client)
    def client_entries(r: int) -> Dict[bytes, Any]:
        entries: Dict[bytes, Any] = {}
        extents = ((r * ROWS, ROWS), (0, -1))
        proto = TensorSlice(extents).to_proto()
        for i, k in enumerate(keys):
            key = k.encode()
            full = pb.BundleEntryProto(dtype=pb.DT_FLOAT, shard_id=r)
            full.shape.dim.add(size=rows)
            full.shape.dim.add(size=COLS)
            full.slices.append(proto)
            entries[key] = full
            piece_entry = pb.BundleEntryProto(dtype=pb.DT_FLOAT, shard_id=r, offset=i * slice_bytes,
                                              size=slice_bytes, crc32c=zero_crc)
            piece_entry.shape.dim.add(size=ROWS)
            piece_entry.shape.dim.add(size=COLS)
            entries[encode_tensor_name_slice(key, extents)] = piece_entry
        return entries

    # object-store commit: entries gathered as JSON, merged in memory, index bytes
    sample = _encode_entries(client_entries(0))
    out["gather_entries_bytes_per_entry"] = len(json.dumps(sample)) / (2 * t)
    gathered = [_encode_entries(client_entries(r)) for r in range(n)]
    out["gathered_entries_mib"] = sum(map(len, gathered)) / 2**20
    peak_before = max(peak_before, _status_kib("VmHWM"))
    windowed = C.reset_peak_rss()
    start_rss = _rss_kib()
    t0 = time.perf_counter()
    merged = merge_entries((f"part{r}", _decode_entries(g)) for r, g in enumerate(gathered))
    index = index_bytes(merged, n)
    out["merge_mem_s"] = time.perf_counter() - t0
    out["merge_mem_peak_mib"] = (_status_kib("VmHWM") - base_rss) / 1024 if windowed else None
    out["merge_mem_added_mib"] = (_status_kib("VmHWM") - start_rss) / 1024 if windowed else None
    out["index_bytes"] = len(index)
    del gathered, merged, index

    # local commit: N part indexes on disk, read back, merged, index written
    prefix = os.path.join(folder, "model")
    parts_dir = os.path.join(folder, "parts")
    os.makedirs(parts_dir, exist_ok=True)
    part_prefixes = []
    for r in range(n):
        part = sharded_filename(os.path.join(parts_dir, "part"), r, n)
        entries = client_entries(r)
        for e in entries.values():
            e.shard_id = 0
        with open(index_filename(part), "wb") as f:
            f.write(index_bytes({k: e.SerializeToString() for k, e in entries.items()}, 1))
        part_prefixes.append(part)
    peak_before = max(peak_before, _status_kib("VmHWM"))
    windowed = C.reset_peak_rss()
    start_rss = _rss_kib()
    t0 = time.perf_counter()
    inputs = ((part,) + read_index(part, local_fs) for part in part_prefixes)  # as merge_bundles reads them
    merged_plan = plan_merge(inputs)
    index = merged_plan.index(n)
    local_fs.write_atomic(index_filename(prefix), index)
    out["merge_files_s"] = time.perf_counter() - t0
    out["merge_files_peak_mib"] = (_status_kib("VmHWM") - base_rss) / 1024 if windowed else None
    out["merge_files_added_mib"] = (_status_kib("VmHWM") - start_rss) / 1024 if windowed else None
    del merged_plan, index
    shutil.rmtree(parts_dir)
    for r in range(n):  # sparse data files of the right size (zeros)
        with open(data_filename(prefix, r, n), "wb") as f:
            f.truncate(t * slice_bytes)
    peak = max(peak_before, _status_kib("VmHWM"), _hwm_kib())
    out["peak_extra_mib"] = (peak - base_rss) / 1024
    out["io_peak_mib"] = peak / 1024
    out["base_mib"] = base_rss / 1024

    t0 = time.perf_counter()
    with BundleReader(prefix, fs=local_fs) as reader:
        out["open_s"] = time.perf_counter() - t0
        value = reader.read(keys[t // 2])
    out["open_read_s"] = time.perf_counter() - t0
    assert value.shape == (rows, COLS) and not value.any()
    # what one client restores: its own rows of one tensor (one slice of N), from a fresh reader
    r = n // 2
    t0 = time.perf_counter()
    with BundleReader(prefix, fs=local_fs) as reader:
        part = reader.read_region(keys[t // 3], ((r * ROWS, (r + 1) * ROWS), (0, COLS)))
    out["open_read_part_s"] = time.perf_counter() - t0
    assert part.shape == (ROWS, COLS) and not part.any()
    return out


def _mib(value: Any) -> str:
    return "?" if value is None else f"{value:.0f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--clients", default="1,8,64,256,1024")
    p.add_argument("--tensors", default="1000,10000")
    p.add_argument("--max-entries", type=float, default=2e6)
    p.add_argument("--dir", default=tempfile.gettempdir())
    p.add_argument("--worker", nargs=2, type=int, help=argparse.SUPPRESS)
    p.add_argument("--json", help="also write the results to this file")
    args = C.parse_args(p, clients="1,8", tensors="100")
    if args.smoke and not args.json:
        args.json = C.results_path("scale")
    failed: List[str] = []
    if args.worker:
        folder = tempfile.mkdtemp(dir=args.dir, prefix="scale-")
        try:
            print("RESULT " + json.dumps(worker(args.worker[0], args.worker[1], folder)))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return
    rows: List[Dict[str, Any]] = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "src"), os.environ.get("PYTHONPATH", "")]))
    print(f"{'clients':>7} {'tensors':>7} {'entries':>9} {'plan s':>7} {'held s':>7} {'client s':>8} "
          f"{'client peak MiB':>15} "
          f"{'agree s':>8} {'agree peak MiB (+added)':>23} "
          f"{'merge mem s':>11} {'merge files s':>13} {'open s':>7} {'open+read s':>11} {'open+part s':>11} "
          f"{'index MB':>8} {'io peak MiB (+above base)':>25} {'peak mem/files MiB (+added)':>27} "
          f"{'B/entry pieces':>14} {'B/entry entries':>15}")
    for t in [int(x) for x in args.tensors.split(",")]:
        for n in [int(x) for x in args.clients.split(",")]:
            if n * t > args.max_entries:
                continue
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", str(n), str(t),
                                   "--dir", args.dir], capture_output=True, text=True, env=env, timeout=3600)
            if proc.returncode != 0:
                print(f"{n:>7} {t:>7} FAILED:\n{proc.stderr[-2000:]}")
                failed.append(f"{n} clients x {t} tensors")
                continue
            r = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1][7:])
            rows.append(r)
            print(f"{n:>7} {t:>7} {r['entries']:>9} {r['plan_s']:>7.3f} {r['held_s']:>7.3f} {r['client_s']:>8.3f} "
                  f"{r['client_peak_mib']:>15.0f} {r['agree_s']:>8.3f} "
                  f"{_mib(r['agree_peak_mib']):>15} (+{_mib(r['agree_added_mib'])}) "
                  f"{r['merge_mem_s']:>11.3f} "
                  f"{r['merge_files_s']:>13.3f} {r['open_s']:>7.3f} {r['open_read_s']:>11.3f} "
                  f"{r['open_read_part_s']:>11.3f} "
                  f"{r['index_bytes'] / 1e6:>8.1f} {r['io_peak_mib']:>17.0f} (+{r['peak_extra_mib']:.0f}) "
                  f"{_mib(r['merge_mem_peak_mib']):>5} (+{_mib(r['merge_mem_added_mib'])})/"
                  f"{_mib(r['merge_files_peak_mib']):>5} (+{_mib(r['merge_files_added_mib'])}) "
                  f"{r['gather_pieces_bytes_per_entry']:>14.1f} {r['gather_entries_bytes_per_entry']:>15.1f}",
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    C.finish(failed=failed)


if __name__ == "__main__":
    main()
