"""``shardckpt.jax`` across real processes: ``jax.distributed.initialize`` on loopback, 2 CPU devices each.

Each test launches its processes with tests/helpers/jax_worker.py (see its docstring)
and reads the JSON each one writes.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import List

import numpy as np
from helpers.launchers import clean_env

from shardckpt.format.bundle_reader import BundleReader
from shardckpt.storage.location import Location

WORKER = Path(__file__).parent / "helpers" / "jax_worker.py"
SRC = Path(__file__).resolve().parents[1] / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(mode: str, size: int, folder: Path, timeout: float = 150) -> List[dict]:
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(rank), str(size), str(port), str(folder)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(size)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = []
    for rank, p in enumerate(procs):
        path = folder / f"result-{rank}.json"
        results.append(json.loads(path.read_text()) if path.exists() else {"rank": rank, "missing_result": True})
        results[-1]["returncode"] = p.returncode
        results[-1]["output"] = outputs[rank][-3000:] if rank < len(outputs) else ""
        if path.exists():
            path.unlink()
    return results


def test_four_processes_save_and_two_restore_onto_another_mesh(tmp_path: Path) -> None:
    saved = launch("save", 4, tmp_path)
    assert all(r.get("ok") and r["returncode"] == 0 for r in saved), saved
    assert saved[0]["devices"] == 8 and saved[0]["local"] == 2
    with BundleReader(Location.of(str(tmp_path / "ck"))) as reader:
        # w on P("x", "y") over (2, 4): 8 pieces written by 4 processes; r replicated: written once
        assert len(reader.pieces("params/w")) == 8 and len(reader.pieces("params/r")) == 1
    assert len(list(tmp_path.glob("ck.data-*"))) == 8
    with BundleReader(Location.of(str(tmp_path / "ck"))) as reader:
        for other in ("ck_funnel", "ck_async"):  # the same values, whichever way they were written
            with BundleReader(Location.of(str(tmp_path / other))) as copy:
                assert sorted(copy.keys()) == sorted(reader.keys())
                for key in reader.keys():
                    a, b = copy.read(key), reader.read(key)
                    assert (a.tolist() == b.tolist()) if a.dtype == object else a.tobytes() == b.tobytes(), key
    restored = launch("restore", 2, tmp_path)
    assert all(r.get("ok") and r["returncode"] == 0 for r in restored), restored
    for r in restored:
        assert r["step"] == 5 and r["name"] == "run"
        assert r["bytes_needed"] <= r["bytes_read"] <= 1.1 * r["bytes_needed"], r
        assert r["bytes_needed"] < 0.6 * r["bytes_total"]  # each of the 2 processes needs about half


def test_the_jax_coordinator_over_three_processes(tmp_path: Path) -> None:
    results = launch("coord", 3, tmp_path)
    assert all(r.get("ok") and r["returncode"] == 0 for r in results), results
    for r in results:
        assert r["gathered"] == [{"rank": i, "text": "é" * i} for i in range(3)]
        assert r["broadcast"] == {"from": "root"}
    assert [r["gather"] for r in results] == [None, None, [{"rank": i, "text": "é" * i} for i in range(3)]]
    assert results[0]["received"] is True
    by_case = [{o["case"]: o for o in r["outcomes"]} for r in results]
    for rank, outcome in enumerate(by_case):
        late_last, late_root, other = outcome["late last"], outcome["late root"], outcome["other name"]
        assert late_last["ok"] is False and late_last["missing"] == [2], (rank, late_last)
        assert ("arrived too late" in late_last["error"]) == (rank == 2), (rank, late_last)
        assert late_root["ok"] is False and 0 in late_root["missing"], (rank, late_root)
        assert other["ok"] is False and other["elsewhere"] == {"1": "elsewhere"}, (rank, other)


def test_a_process_that_does_not_arrive_is_named_and_nothing_is_committed(tmp_path: Path) -> None:
    results = launch("hang", 3, tmp_path)
    for r in results[:2]:
        assert r.get("ok") is False and r["returncode"] == 0, r
        assert r["missing"] == [2], r
        assert "2" in r["error"] and r["seconds"] < 30, r
        assert r["latest"] == str(tmp_path / "ckpt-1")  # the previous checkpoint stays latest
    assert results[2].get("ok") and results[2]["returncode"] == 0, results[2]
    assert not (tmp_path / "ckpt-2.index").exists()
    assert (tmp_path / "ckpt-1.index").exists()


def test_a_killed_process_is_named_and_nothing_is_committed(tmp_path: Path) -> None:
    """Rank 2 exits (``os._exit``) while the others save ckpt-2. They name it within their 4 s timeout and
    commit nothing. (At exit, JAX's own runtime then aborts the survivors' shutdown, since a task of its job
    is gone: their exit status is JAX's, so only the results they wrote before are checked.)"""
    results = launch("die", 3, tmp_path)
    assert results[2]["returncode"] == 3 and results[2].get("missing_result"), results[2]
    for r in results[:2]:
        assert r.get("ok") is False and r["missing"] == [2] and r["seconds"] < 30, r
        assert "[2]" in r["error"], r
        assert r["latest"] == str(tmp_path / "ckpt-1")
    assert not (tmp_path / "ckpt-2.index").exists() and (tmp_path / "ckpt-1.index").exists()


def test_a_replicated_leaf_not_every_process_holds_fails_the_save_on_every_process(tmp_path: Path) -> None:
    """Issue 24, section 1, through shardckpt.jax: a replicated leaf (written by process 0 alone) that only
    process 0 holds, only process 1 holds, or that process 1 names otherwise: every process raises the same
    CoordinationError naming the processes and the leaf; nothing is left; ``good-1`` stays latest."""
    results = launch("replicated", 2, tmp_path)
    assert all(r.get("ok") and r["returncode"] == 0 for r in results), results
    expected = {"only0": ["'params/extra' (float32[12], layout [()] on mesh x=2,y=2 #",
                          "is held by rank(s) [0] but not by rank(s) [1]"],
                "only1": ["'params/extra' (float32[12], layout [()] on mesh x=2,y=2 #",
                          "is held by rank(s) [1] but not by rank(s) [0]"],
                "renamed": ["'params/extra' (float32[12]", "is held by rank(s) [0] but not by rank(s) [1]",
                            "'params/extra2' (float32[12]", "is held by rank(s) [1] but not by rank(s) [0]"]}
    for case, texts in expected.items():
        messages = set()
        for r in results:
            outcome = r["outcomes"][case]
            assert not outcome["ok"] and outcome["type"] == "CoordinationError", (case, r["rank"], outcome)
            assert "not committed" in outcome["message"], outcome
            for text in texts:
                assert text in outcome["message"], (case, text, outcome["message"])
            messages.add(outcome["message"])
        assert len(messages) == 1, messages
        assert not list((tmp_path / "mgr").glob(f"{case}*")), case  # nothing committed, nothing left
    good = str(tmp_path / "mgr" / "good-1")
    assert all(r["outcomes"]["good"]["ok"] and r["latest"] == good for r in results), results
    with BundleReader(Location.of(good)) as reader:
        assert reader.read("params/extra").tolist() == (np.arange(12, dtype=np.float32) / 4).tolist()


def test_tiered_checkpoints_of_a_pytree_across_two_processes_as_two_nodes(tmp_path: Path) -> None:
    """``CheckpointManager(PyTreeCheckpoint(state), ..., local=LocalTier(...))`` under JAX's runtime: each
    process a node (``jax.process_index()``); six saves with ``persist_every=5`` (see the worker)."""
    results = launch("tiered", 2, tmp_path, timeout=240)
    assert all(r.get("ok") and r["returncode"] == 0 for r in results), results
    for rank, r in enumerate(results):
        phases = r["phases"]
        # nothing lost: step 6 (in the tiers only), from each node's own bundle
        assert phases["intact"]["step"] == phases["intact"]["tier_step"] == 6, (rank, phases)
        assert phases["intact"]["exact"] and phases["intact"]["counter"] == 6, (rank, phases)
        assert phases["intact"]["received"] == phases["intact"]["sent"] == 0, (rank, phases)
        # node 1's tier lost: step 6 again, node 1's process reading node 0's replica over the runtime
        lost = phases["lost"]
        assert lost["step"] == lost["tier_step"] == 6 and lost["exact"] and lost["counter"] == 6, (rank, lost)
        assert (lost["received"] > 0) == (rank == 1) and (lost["sent"] > 0) == (rank == 0), (rank, lost)
        assert lost["node1"] == ["node-0", "node-1"], (rank, lost)  # repopulated and restocked behind it
        # another mesh and layout: step 6 from a merged view of both nodes' bundles
        assert phases["resharded"]["step"] == phases["resharded"]["tier_step"] == 6, (rank, phases)
        assert phases["resharded"]["exact"], (rank, phases)
        # both tiers lost: the persistent step 5
        both = phases["both_lost"]
        assert both["tier_step"] is None and both["step"] == 5 and both["exact"] and both["counter"] == 5, (rank, both)


def test_tiered_pytree_checkpoints_move_their_bytes_over_mpi_when_given_an_mpi_coordinator(tmp_path: Path) -> None:
    """The README's advice for large JAX states: ``PyTreeCheckpoint(state, coordinator=MPICoordinator())``
    under mpiexec; a lost node's replica then travels over MPI (tests/helpers/jax_mpi_tier_worker.py)."""
    from helpers.launchers import run_launched, tool

    worker = Path(__file__).parent / "helpers" / "jax_mpi_tier_worker.py"
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")])
    env.pop("XLA_FLAGS", None)
    proc = run_launched([str(tool("mpiexec")), "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable,
                         str(worker), str(tmp_path), str(free_port())], env=env, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in range(2)]
    for rank, r in enumerate(results):
        assert r["backend"] == "mpi" and r["tier_step"] == 3 and r["step"] == 3 and r["exact"], (rank, r)
    assert results[1]["received"] > 0 and results[0]["sent"] == results[1]["received"], results
    assert results[0]["received"] == 0 and results[1]["sent"] == 0, results
