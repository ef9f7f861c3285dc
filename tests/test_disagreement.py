"""Clients that disagree never commit (issue 16, defects 1 and 2), in real processes.

Four clients under torchrun (gloo) and under mpiexec run tests/helpers/disagree_worker.py:
client 2 names a variable differently, lays it out differently, builds another mesh,
saves another dtype or global shape, or skips a save. Every time every client raises the
same error naming client 2 (and only the disagreeing client when it is client 0, the io
client), nothing is committed at that prefix, and ``shardckpt verify`` of the
last good checkpoint passes; after the skipped save, the clients resynchronise.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest

import shardckpt

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "disagree_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

from launchers import clean_env, launch_command  # noqa: E402  (tests/helpers)

DISAGREEING = ["rename", "layout", "mesh", "dtype", "shape"]


@pytest.fixture(scope="module", params=["torch", "mpi"])
def run(request, tmp_path_factory) -> Dict[str, Any]:
    backend = request.param
    tmp = tmp_path_factory.mktemp(f"disagree-{backend}")
    out, data = tmp / "out", tmp / "data"
    out.mkdir()
    data.mkdir()
    cmd = launch_command(backend, 4, WORKER)
    done = subprocess.run(cmd + [str(out), str(data)], capture_output=True, text=True, env=clean_env(),
                          cwd=str(HERE.parent), timeout=300)
    log = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"launcher exit {done.returncode}:\n{log}"
    results = {}
    for r in range(4):
        res = json.loads((out / f"rank{r}.json").read_text())
        assert "fatal" not in res and res.get("done"), f"rank {r}: {res.get('fatal')}\n{log}"
        results[r] = res["phases"]
    return {"results": results, "data": data, "backend": backend}


def test_clients_that_agree_commit(run) -> None:
    for r, phases in run["results"].items():
        assert phases["agree"]["ok"], (r, phases["agree"])
    with shardckpt.load_checkpoint(str(run["data"] / "agree")) as reader:
        np.testing.assert_array_equal(reader.get_tensor("w"), np.arange(128, dtype=np.float32).reshape(8, 16))


@pytest.mark.parametrize("phase", DISAGREEING)
def test_a_disagreeing_client_fails_the_save_on_every_client_naming_it(run, phase: str) -> None:
    messages = set()
    for r, phases in run["results"].items():
        entry = phases[phase]
        assert not entry["ok"], f"rank {r} reported success for a save client 2 disagreed with"
        assert entry["type"] == "CoordinationError", (r, entry["type"], entry["message"])
        assert "not committed" in entry["message"], (r, entry["message"])
        # client 2 is named (for an overlap, beside the client whose slices it overlaps)
        assert re.search(r"rank\(s\) \[(\d+, )*2(, \d+)*\]", entry["message"]), (r, entry["message"])
        messages.add(entry["message"])
    assert len(messages) == 1, messages  # the same verdict everywhere
    assert not (run["data"] / f"{phase}.index").exists()  # nothing committed
    assert not list(run["data"].glob(f"{phase}.data-*"))  # nothing left behind
    assert not list(run["data"].glob(f"{phase}_temp_*"))


def test_a_shape_mismatch_names_the_disagreeing_client_even_when_it_is_the_io_client(run) -> None:
    messages = set()
    for r, phases in run["results"].items():
        for phase, odd in (("shape", 2), ("root_shape", 0)):
            entry = phases[phase]
            assert not entry["ok"] and entry["type"] == "CoordinationError", (r, phase, entry)
            assert f"rank(s) [{odd}] save global shape [[8, 32]]" in entry["message"], (r, phase, entry["message"])
            assert "failed on client" not in entry["message"], entry["message"]
            messages.add((phase, entry["message"]))
        assert not (run["data"] / "root_shape.index").exists()
    assert len(messages) == 2, messages  # one verdict per phase, the same on every client


def test_a_client_that_skips_a_save_fails_it_where_it_first_happens_then_resyncs(run) -> None:
    for r, phases in run["results"].items():
        entry = phases["skip"]
        assert not entry["ok"] and entry["type"] == "CoordinationError", (r, entry)
        assert "disagree on which save" in entry["message"] and "rank 2" in entry["message"], (r, entry["message"])
        assert phases["resync"]["ok"], (r, phases["resync"])
    assert not (run["data"] / "skip_a.index").exists()
    with shardckpt.load_checkpoint(str(run["data"] / "skip_b")) as reader:
        np.testing.assert_array_equal(reader.get_tensor("w"), np.arange(128, dtype=np.float32).reshape(8, 16))
