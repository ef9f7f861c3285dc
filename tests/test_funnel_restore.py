"""Funnelled restores in real processes: 4 clients under torchrun (gloo) and under mpiexec (Open MPI).

One launch per backend runs tests/helpers/funnel_restore_worker.py: the clients save (each its
own pieces), then clients 1-3 lose access to the folder (their storage layer and their
``os.open``/``os.stat``/``open`` refuse it and record any attempt), and every restore below
goes through ``CheckpointOptions(io_device=<task 0>)``:

* ``DTensorCheckpoint.restore`` onto other layouts (a 64 KiB in-flight budget, so the 2 MiB
  variable travels in chunks), ``DTensorCheckpoint.read`` of the checkpoint's directory onto an
  8-device 1-D mesh, ``name_based_restore`` of a ``sharded_save`` bundle with a 4 KiB budget
  (rows of 32 KiB are cut further), and ``restore_tensors`` of different regions per client
  plus a string tensor: all bit-exact, ``save_counter`` and the plain variable included;
* the io client reads each byte of the 2 MiB variable once; every other client receives
  exactly the bytes of its distinct local pieces;
* a key missing on one client fails the restore on every client (that client: ``NotFoundError``),
  a corrupt data byte found by the io client's running checksum fails it on every client (the
  io client: ``DataLossError``), quickly; the coordinator works afterwards;
* clients 1-3 never tried to touch the folder.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Dict

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "funnel_restore_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import clean_env, launch_command  # noqa: E402  (tests/helpers)

BIG_BYTES = 64 * 8192 * 4
FAILURE_S = 10.0  # a failed funnelled restore ends this fast on every client (no timeout waited for)


def _launch(backend: str, tmp: Path) -> Dict[int, dict]:
    out, data = tmp / "out", tmp / "data"
    data.mkdir()
    cmd = launch_command(backend, 4, WORKER)
    env = clean_env()
    env["PYTHONPATH"] = str(HERE.parent / "src")
    proc = subprocess.run(cmd + [str(out), str(data)], capture_output=True, text=True, env=env, cwd=str(HERE.parent),
                          timeout=240)
    results = {}
    for r in range(4):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}" \
                              f"\n{proc.stderr[-3000:]}"
        results[r] = json.loads(path.read_text())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return results


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_funnelled_restores(backend: str, tmp_path: Path) -> None:
    results = _launch(backend, tmp_path)
    for rank, res in results.items():
        assert "fatal" not in res, res.get("fatal")
        assert res["done"] and res["size"] == 4
        phases = res["phases"]
        for name in ("restore_ckpt", "read_ckpt_dir", "named", "tensor_level", "big_once", "after"):
            assert phases[name]["ok"], (rank, name, phases[name].get("traceback"))
        for name in ("restore_ckpt", "read_ckpt_dir", "named"):
            assert phases[name]["value"]["mismatches"] == {n: [] for n in phases[name]["value"]["mismatches"]}, \
                (rank, name)
            assert len(phases[name]["value"]["mismatches"]) == 7
        assert phases["restore_ckpt"]["value"]["plain"] and phases["restore_ckpt"]["value"]["save_counter"] == 1
        assert phases["tensor_level"]["value"]["exact"] == [True] * 4
        assert phases["after"]["value"]["exact"]
        big = phases["big_once"]["value"]
        assert big["mismatches"] == {"big": []}
        if rank == 0:
            assert big["read"] == BIG_BYTES and big["received"] == 0
        else:
            assert big["read"] == 0 and big["received"] == big["needed"] > 0
            assert res["attempts"] == [], f"client {rank} tried to touch the folder: {res['attempts'][:5]}"
        missing = phases["missing_on_client_2"]
        assert not missing["ok"] and missing["elapsed"] < FAILURE_S
        assert missing["type"] == ("NotFoundError" if rank == 2 else "CoordinationError"), missing
        assert "no such key" in missing["message"]
        corrupt = phases["corrupt_on_io"]
        assert not corrupt["ok"] and corrupt["elapsed"] < FAILURE_S
        assert corrupt["type"] == ("DataLossError" if rank == 0 else "CoordinationError"), corrupt
        if rank == 0:
            assert "checksum" in corrupt["message"] and "t.data-00000-of-00001" in corrupt["message"]
