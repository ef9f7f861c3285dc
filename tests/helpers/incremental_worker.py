"""One client of tests/test_incremental.py's multi-client test, started by torchrun (or mpiexec).

    incremental_worker.py CKPT_DIR OUTDIR

Two collective saves of a tensor sliced over the clients plus one tensor per client:
``ck-1`` in full, then ``ck-2`` incremental from it after client 0 changed its slice.
Each client records, through ``RecordingFileSystem``, the data bytes it wrote and the
data files it linked during the second save into ``OUTDIR/rank<R>.json``; client 0
writes the expected values to ``OUTDIR/expected.npz``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import numpy as np

from shardckpt import CheckpointOptions, ShardableTensor
from shardckpt.distributed import get_coordinator
from shardckpt.saving.distributed import save_tensors_distributed
from shardckpt.storage.local import local_fs
from shardckpt.storage.registry import mounted
from shardckpt.storage.wrappers import RecordingFileSystem

CKPT, OUT = sys.argv[1], sys.argv[2]
ROWS, COLS = 64, 1024


def main() -> dict:
    coord = get_coordinator()
    rank, size = coord.rank, coord.size
    rng = np.random.default_rng(0)
    big = rng.standard_normal((ROWS, COLS)).astype(np.float32)  # the same on every client
    own = [rng.standard_normal(5000).astype(np.float32) for _ in range(size)]
    per = ROWS // size
    start = rank * per
    device = f"/job:localhost/replica:0/task:{rank}/device:CPU:0"

    def pieces() -> list:
        return [ShardableTensor.from_value("big", big[start:start + per], slice_spec=f"{ROWS} {COLS} {start},{per}:-",
                                           device=device),
                ShardableTensor.from_value(f"own{rank}", own[rank], device=device)]

    opts = CheckpointOptions(incremental=True, timeout=120)
    os.makedirs(CKPT, exist_ok=True)
    save_tensors_distributed(os.path.join(CKPT, "ck-1"), pieces(), opts, coord)
    if rank == 0:
        big[0, :5] += 1.0  # client 0's slice changes; client 1's pieces do not
    recording = RecordingFileSystem(local_fs)
    with mounted(recording):
        save_tensors_distributed(os.path.join(CKPT, "ck-2"), pieces(), opts, coord,
                                 previous=os.path.join(CKPT, "ck-1"))
    written = sum(len(e) for k, p, e in recording.ops if k == "write" and ".data-" in os.path.basename(p))
    reused = sum(os.stat(p).st_size for k, p, e in recording.ops if k == "link")
    if rank == 0:
        expected = {"big": big}
        expected.update({f"own{r}": own[r] for r in range(size)})
        np.savez(os.path.join(OUT, "expected.npz"), **expected)
    coord.barrier("incremental worker done", timeout=120)
    return {"bytes_written": written, "bytes_reused": reused, "done": True}


if __name__ == "__main__":
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    try:
        result = main()
    except Exception:
        result = {"fatal": traceback.format_exc()}
    with open(os.path.join(OUT, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    sys.exit(0 if "fatal" not in result else 1)
