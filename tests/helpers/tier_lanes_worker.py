"""One client of tests/test_tier_lanes.py, started by torchrun or mpiexec (3 clients).

    tier_lanes_worker.py OUTDIR DATADIR

Three clients as two simulated nodes of unequal size: clients 0 and 1 on node ``a``, client 2 on
node ``b``. Node ``a``'s tier holds a bundle of step 1 (three data files and an index) written
before the phases; ``tier.prefix(node, owner, step)`` is where each node keeps it. Phases (every
client, :func:`shardckpt.tiers.transfer.move_bundles` with the same moves):

* ``a_to_b``: node ``a``'s bundle moves to node ``b``: one lane (client 0 -> client 2), every file
  on it; the receiver's files are byte for byte the sender's;
* ``b_to_a``: and back to node ``a`` under another owner name: one lane (client 2 -> client 0);
* ``peer``: client 0 serves node ``a``'s bundle to client 2, which reads it through a
  ``PeerFileSystem``/``PeerSource`` (tiers/peer.py): a request past a file's end is refused with
  an error naming the file, and the server serves on; a whole stored piece, a region cutting
  every piece and the whole tensor come back exact;
* ``peer_damaged``: the same from node ``a``'s copy ``b`` whose data file 2 holds a flipped byte:
  the piece read from it fails its checksum, named by file, key and slice;
* ``sender_fault``: client 0's data file 1 is cut short before it moves to ``b`` again: client 0
  sends zeros for what is missing and reports the error; client 2 still receives every byte it
  was promised (nobody waits for bytes that never come) and reports nothing.

Each phase records what ``move_bundles`` returned (bytes, error) and, on the receiver, the
files received with their sizes and whether their bytes equal the sender's.
"""

from __future__ import annotations

import hashlib
import os
import sys
from typing import Any, Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dtensor_worker as W  # noqa: E402  (tests/helpers)


def digests(folder: str, base: str) -> Dict[str, Any]:
    out = {}
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.startswith(base + "."):
            with open(os.path.join(folder, name), "rb") as f:
                data = f.read()
            out[name] = [len(data), hashlib.sha256(data).hexdigest()]
    return out


def peer(coord, tier, owner: str, damaged) -> Dict[str, Any]:
    """Client 0 serves node a's copy of ``owner``'s bundle to client 2 (tiers/peer.py), which asks for bytes
    past a file's end, then restores through a PeerSource: a whole stored piece (fetched when the call
    ends, checksummed), a region cutting every piece (served at once) and, after the call, the whole
    tensor through the reader. With ``damaged``: only that piece, whose file holds a flipped byte."""
    from shardckpt.errors import ShardckptError
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.restoring import Read, RestorePlan, collective_call, run
    from shardckpt.tiers.peer import PeerFileSystem, PeerSource, serve_bundle
    from shardckpt.tiers.tier import bundle_files

    prefix = tier.prefix("a", owner, 1)
    if coord.rank == 0:
        streamed: List[int] = []  # streaming(): once, before the first request of more than chunk_bytes
        sent, error = serve_bundle(coord, 2, os.path.dirname(prefix), bundle_files(prefix), tier.chunk_bytes,
                                   timeout=120, streaming=lambda: streamed.append(1))
        return {"sent": sent, "error": error, "streaming": len(streamed)}
    if coord.rank != 2:
        return {}
    fs = PeerFileSystem(coord, 0, os.path.dirname(prefix), timeout=120)
    out: Dict[str, Any] = {}
    try:
        try:
            fs.fetch([(0, 1 << 40, memoryview(bytearray(8)))], "past the end")
        except ShardckptError as e:
            out["past_the_end"] = [type(e).__name__, str(e)]
        source = PeerSource(BundleReader(prefix, fs=fs), fs)
        reads = [Read("w", damaged)] if damaged else [Read("w", ((1, 2), (0, 50000))), Read("w", ((0, 3), (5, 9)))]
        try:
            with collective_call(source):
                values = run(RestorePlan.of(source, reads))
            out["values"] = [v.tolist() if v.size < 100 else sorted(set(v.reshape(-1).tolist())) for v in values]
            out["whole"] = source.reader.read("w")[:, ::10000].tolist()
        except ShardckptError as e:
            out["failed"] = [type(e).__name__, str(e)]
        out["received"] = fs.received
    finally:
        fs.done()
    return out


def run(data: str) -> None:
    import shardckpt
    from shardckpt.format.bundle_writer import BundleWriter
    from shardckpt.format.tensor_slice import TensorSlice
    from shardckpt.storage.local import LocalFileSystem
    from shardckpt.tiers import NodeMap
    from shardckpt.tiers.transfer import move_bundles

    coord = W.result["coordinator"]
    rank = coord.rank
    nodes = NodeMap.gather(coord)
    tier = shardckpt.LocalTier(os.path.join(data, "tier", "{node}"), chunk_bytes=1 << 16)
    source = tier.prefix("a", "a", 1)
    if rank == 0:  # a bundle of three data files (as merged parts), written by node a's leader
        os.makedirs(os.path.dirname(source), exist_ok=True)
        for shard in range(3):
            with BundleWriter(f"{source}_p{shard}", fs=LocalFileSystem()) as writer:
                writer.add_slice("w", (3, 50000), TensorSlice(((shard, 1), (0, 50000))),
                                 np.full((1, 50000), shard + 1, np.float32))
        from shardckpt.saving.commit.rename import merge_bundles

        merge_bundles([f"{source}_p{s}" for s in range(3)], source, fs=LocalFileSystem())
    coord.barrier("written")
    W.result["nodes"] = nodes.as_json()

    def move(moves, look):
        moved = move_bundles(coord, tier, nodes, 1, moves, timeout=120)
        out = {"sent": moved.sent, "received": moved.received, "error": moved.error}
        if rank == 0:
            out["source"] = digests(os.path.dirname(source), "ckpt-1")
        if look is not None:
            out["received_files"] = digests(*look)
        return out

    b_folder = tier.folder("b", "a")
    W.phase("a_to_b", lambda: move([("a", "b", "a")], (b_folder, "ckpt-1") if rank == 2 else None))
    a_back = tier.folder("a", "b")
    import shutil

    if rank == 2:  # node b holds it as owner "b" too, to send back
        os.makedirs(tier.folder("b", "b"), exist_ok=True)
        for name in os.listdir(b_folder):
            shutil.copy(os.path.join(b_folder, name), os.path.join(tier.folder("b", "b"), name))
    coord.barrier("copied")
    W.phase("b_to_a", lambda: move([("b", "a", "b")], (a_back, "ckpt-1") if rank == 0 else None))
    W.phase("peer", lambda: peer(coord, tier, "a", None))
    if rank == 0:  # one byte of data file 2 of the copy node a got back, flipped
        name = [n for n in sorted(os.listdir(a_back)) if ".data-00002-" in n][0]
        with open(os.path.join(a_back, name), "r+b") as f:
            f.seek(1234)
            byte = f.read(1)
            f.seek(1234)
            f.write(bytes([byte[0] ^ 0x40]))
    coord.barrier("flipped")
    W.phase("peer_damaged", lambda: peer(coord, tier, "b", ((2, 3), (0, 50000))))
    if rank == 0:
        data1 = [n for n in sorted(os.listdir(os.path.dirname(source))) if ".data-00001-" in n][0]
        with open(os.path.join(os.path.dirname(source), data1), "r+b") as f:
            f.truncate(1000)  # cut short after the sizes were listed: the sender must still send them all
    coord.barrier("cut")
    import shardckpt.tiers.transfer as T

    listed = T.bundle_files
    sizes_before = {n: s for n, s in listed(tier.prefix("b", "a", 1))} if rank == 2 else {}

    def as_before(prefix):  # the sizes a moment before the cut (what a sender lists, then finds shorter)
        files = listed(prefix)
        return [(n, W.result.get("sizes", {}).get(n, s)) for n, s in files]

    W.result["sizes"] = coord.broadcast(sizes_before, root=2)
    T.bundle_files = as_before
    try:
        W.phase("sender_fault", lambda: move([("a", "b", "a")], (b_folder, "ckpt-1") if rank == 2 else None))
    finally:
        T.bundle_files = listed


if __name__ == "__main__":
    W.launched(run, node_of_rank=lambda rank: "a" if rank < 2 else "b")
