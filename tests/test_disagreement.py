"""Clients that disagree never commit (issue 16, defects 1 and 2), in real processes.

Four clients under torchrun (gloo) and under mpiexec run tests/helpers/disagree_worker.py:
client 2 names a variable differently, lays it out differently, builds another mesh,
saves another dtype or global shape, or skips a save. Every time every client raises the
same error naming client 2 (and only the disagreeing client when it is client 0, the io
client), nothing is committed at that prefix, and ``shardckpt verify`` of the
last good checkpoint passes; after the skipped save, the clients resynchronise.

Then (issue 24, section 1) a replicated variable ``b`` that only client 0 holds, only
client 1 holds, or that client 1 names ``b2``, saved through ``dtensor.sharded_save``,
``DTensorCheckpoint.save`` and a ``CheckpointManager``: its pieces tile (client 0 alone
writes a replicated piece), so only the agreement on every client's full list of what it
holds catches it. Every client raises the same ``CoordinationError`` naming the clients
and the variable, nothing of that save is left, and the good checkpoint saved before stays
latest and restores exactly.
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
    results, records = {}, {}
    for r in range(4):
        res = json.loads((out / f"rank{r}.json").read_text())
        assert "fatal" not in res and res.get("done"), f"rank {r}: {res.get('fatal')}\n{log}"
        results[r] = res["phases"]
        records[r] = res
    return {"results": results, "records": records, "data": data, "backend": backend}


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


# -- a replicated variable that not every client holds (issue 24, section 1) ---------------------------------------

DOORS = {"rep": "sharded_save", "ck": "DTensorCheckpoint.save", "mgr": "CheckpointManager.save"}
B_VALUE = np.array([1.5, -2.0, 3.25, 4.0], np.float32)
W_VALUE = np.arange(128, dtype=np.float32).reshape(8, 16)


def _key(door: str, name: str) -> str:
    return name if door == "rep" else f"{name}/.ATTRIBUTES/VARIABLE_VALUE"


def _leftovers(run: Dict[str, Any], door: str, case: str) -> list:
    """What a save of ``case`` through ``door`` left in its folder (index, data files, scratch)."""
    if door == "rep":
        return sorted(p.name for p in run["data"].glob(f"rep_{case}*"))
    return sorted(p.name for p in (run["data"] / door).glob(f"{case}*"))


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("case,expected", [
    ("only0", ["variable '{b}' (float32[4], layout [unsharded] on mesh x=2,y=4 #",
               "is held by rank(s) [0] but not by rank(s) [1-3]"]),
    ("only1", ["variable '{b}' (float32[4], layout [unsharded] on mesh x=2,y=4 #",
               "is held by rank(s) [1] but not by rank(s) [0, 2, 3]"]),
    ("renamed", ["variable '{b}' (float32[4], layout [unsharded] on mesh x=2,y=4 #",
                 "is held by rank(s) [0, 2, 3] but not by rank(s) [1]",
                 "variable '{b2}' (float32[4], layout [unsharded] on mesh x=2,y=4 #",
                 "is held by rank(s) [1] but not by rank(s) [0, 2, 3]"]),
])
def test_a_replicated_variable_not_every_client_holds_fails_the_save_everywhere_naming_clients_and_variable(
        run, door: str, case: str, expected: list) -> None:
    messages = set()
    for r, phases in run["results"].items():
        entry = phases[f"{door}_{case}"]
        assert not entry["ok"], f"rank {r}: {DOORS[door]} committed although clients hold different variables"
        assert entry["type"] == "CoordinationError", (r, entry["type"], entry["message"])
        assert "not committed" in entry["message"] and "clients disagree on the variables they hold" in \
            entry["message"], (r, entry["message"])
        for text in expected:
            assert text.format(b=_key(door, "b"), b2=_key(door, "b2")) in entry["message"], (r, text, entry["message"])
        messages.add(entry["message"])
    assert len(messages) == 1, messages  # the same verdict on every client
    assert _leftovers(run, door, case) == []  # nothing committed, nothing left behind


def test_clients_that_hold_the_same_replicated_variable_commit(run) -> None:
    for r, phases in run["results"].items():
        for name in ("rep_agree", "ck_good", "mgr_good"):
            assert phases[name]["ok"], (r, name, phases[name])
    with shardckpt.load_checkpoint(str(run["data"] / "rep_agree")) as reader:
        np.testing.assert_array_equal(reader.get_tensor("b"), B_VALUE)
        np.testing.assert_array_equal(reader.get_tensor("w"), W_VALUE)
        assert int(reader.get_tensor("step")) == 7


@pytest.mark.parametrize("door", ["ck", "mgr"])
def test_after_replicated_disagreements_the_good_checkpoint_stays_latest_and_restores_exactly(run, door: str) -> None:
    folder = run["data"] / door
    good = str(folder / "good-1")
    assert shardckpt.latest_checkpoint(str(folder)) == good
    for r, record in run["records"].items():
        assert record[f"{door}_latest"] == good, (r, record[f"{door}_latest"])
        assert record[f"{door}_restored"] is True, (r, record[f"{door}_restored"])
        if door == "mgr":
            assert record["mgr_manager_latest"] == good, (r, record["mgr_manager_latest"])
    with shardckpt.load_checkpoint(good) as reader:
        np.testing.assert_array_equal(reader.get_tensor(_key(door, "b")), B_VALUE)
        np.testing.assert_array_equal(reader.get_tensor(_key(door, "w")), W_VALUE)
    done = subprocess.run([sys.executable, "-m", "shardckpt.cli.main", "verify", good], capture_output=True, text=True,
                          env=clean_env(), cwd=str(HERE.parent), timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
