"""A short kill -9 soak in the suite (issue 16): ``scripts/soak.sh`` runs the same driver for >= 200 trials.

tests/helpers/soak.py kills, at random moments, ``CheckpointManager`` saves (retention
``max_to_keep=2``) of one local process and of 2 clients under ``mpiexec`` and ``torchrun``,
sync and async (under ``mpiexec`` every third save is first tried with a client that
disagrees on a tensor's shape, or skips it and saves the next: it must fail on every client and
commit nothing); after every
kill the latest checkpoint must restore bit-exactly to a saved generation (on the resuming
clients, and read back here with every checksum verified), never be older than a save
reported committed, every leftover of a dead save must be gone after the next committed
save, a job with one killed client must end by itself, and a final uninterrupted run must
leave nothing but the state file and the kept checkpoints.
The S3 test runs the same on the test S3 server (moto): one process per job, killed during
uploads, the index PUT, the state file and retention deletions; every leftover object (an old
checkpoint whose deletion a kill cut short included) must be gone after the next committed save.
The seed of the random moments is printed; ``SHARDCKPT_SOAK_SEED=<seed>`` replays it.
The last test shows that the checks catch a torn, stale or missing checkpoint.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HELPERS = Path(__file__).resolve().parent / "helpers"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

import soak  # noqa: E402  (tests/helpers)

# local saves are cheap: they get most trials; every launcher and mode is killed (a torchrun start is the dearest)
CONFIGS = ["local-sync", "local-async", "mpi-disagree", "local-sync", "local-async", "torch-async"] \
    + ["local-sync", "local-async", "mpi-skip", "local-sync", "local-async", "local-sync"]


def _ended(cmd: list) -> "soak._Job":
    job = soak._Job(cmd)
    assert job.end(60)
    return job


def _replayable(table: str, seed: int) -> str:
    return f"{table}\nseed {seed}: replay with SHARDCKPT_SOAK_SEED={seed}"


def test_short_kill_soak_leaves_a_whole_latest_checkpoint_every_time(tmp_path: Path) -> None:
    seed = soak.draw_seed()  # printed by soak(); SHARDCKPT_SOAK_SEED replays it
    stats = soak.soak(12, CONFIGS, clients=2, saves=3, seed=seed, root=str(tmp_path), log=False)
    table = _replayable(soak.summary(stats), seed)
    print("\n" + table)
    assert soak.ok(stats), table
    assert sum(s.trials for s in stats.values()) == 12
    assert {name: s.trials for name, s in stats.items()} == {"local-sync": 5, "local-async": 4, "mpi-disagree": 1,
                                                             "mpi-skip": 1, "torch-async": 1}
    assert stats["mpi-disagree"].refused >= 1, table  # the final run's third save, at least
    assert stats["mpi-skip"].refused >= 1, table
    assert sum(s.commits_reported for s in stats.values()) >= 12, table  # the runs saved, not only started
    killed = sum(s.killed_whole_job + s.killed_one_client for s in stats.values())
    assert killed >= 6, table  # most trials were killed mid-run, not after their end


def test_short_s3_kill_soak_leaves_a_whole_latest_checkpoint_and_no_leftover_objects(s3_server: Any,
                                                                                     tmp_path: Path) -> None:
    """The same on the test S3 server (moto): kills during uploads, the index PUT, the state file and the
    retention deletions (a deletion cut short leaves a ``.deleting`` marker the next save finishes)."""
    seed = soak.draw_seed()
    stats = soak.soak(6, ["s3-sync", "s3-async"], clients=1, saves=3, seed=seed, root=str(tmp_path), log=False,
                      s3_root=s3_server.url(f"soak-{seed}"))
    table = _replayable(soak.summary(stats), seed)
    print("\n" + table)
    assert soak.ok(stats), table
    assert {name: s.trials for name, s in stats.items()} == {"s3-sync": 3, "s3-async": 3}
    assert sum(s.commits_reported for s in stats.values()) >= 6, table
    assert sum(s.killed_whole_job for s in stats.values()) >= 3, table


def test_the_soak_checks_catch_torn_stale_and_missing_checkpoints(tmp_path: Path) -> None:
    directory = str(tmp_path / "local-sync")
    s = soak.ConfigSoak("local-sync", str(tmp_path), 1, 2, random.Random(0))
    s.run_to_end()
    assert not s.stats.failures, s.stats.failures
    latest, kept, leftovers = soak.inspect_directory(directory)
    assert latest is not None and latest.endswith("ckpt-2") and len(kept) == 2 and not leftovers
    assert soak.check_checkpoint(latest) is None

    # a stale checkpoint: ckpt-1's files under the name ckpt-2 hold generation 1, not 2
    for suffix in (".index", ".data-00000-of-00001"):
        os.replace(os.path.join(directory, "ckpt-1" + suffix), os.path.join(directory, "ckpt-3" + suffix))
    problem = soak.check_checkpoint(os.path.join(directory, "ckpt-3"))
    assert problem is not None and "is not generation 3" in problem, problem
    problem = soak.check_checkpoint(os.path.join(directory, "ckpt-3"), "skip")  # a skipped generation committed
    assert problem is not None and "a client skipped" in problem, problem

    # a torn data file: one flipped byte is a checksum failure
    data = os.path.join(directory, "ckpt-2.data-00000-of-00001")
    with open(data, "r+b") as f:
        f.seek(os.path.getsize(data) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))
    problem = soak.check_checkpoint(latest)
    assert problem is not None and "DataLossError" in problem, problem

    # the next trial's checks count it, and a missing latest after a reported commit
    s.newest_reported = 2
    s._after(_ended([sys.executable, "-c", "print('COMMITTED 2')"]), committed_in_run=False)
    assert s.stats.corrupt >= 1 and not soak.ok({"x": s.stats})
    for name in os.listdir(directory):
        if name.startswith("ckpt-2"):
            os.remove(os.path.join(directory, name))
    s.stats = soak.ConfigStats()
    s._after(_ended([sys.executable, "-c", "pass"]), committed_in_run=False)
    assert s.stats.missing_latest == 1, s.stats


def test_a_whole_job_kill_of_torchrun_kills_its_clients_too(tmp_path: Path) -> None:
    """torchrun starts each client in a session of its own, and a client outlives a SIGKILLed torchrun:
    the driver's whole-job kill must reach the clients, else a "killed" job saves on beside the next trial.
    The clients here only sleep (a soak worker stops at its next use of the dead launcher's store)."""
    sleeper = tmp_path / soak.WORKER.name  # the driver knows a job's processes by the worker's name
    sleeper.write_text("import os, sys, time\n"
                       "print('PID', os.environ['RANK'], os.getpid(), flush=True)\n"
                       "print('READY', flush=True)\n"
                       "time.sleep(120)\n")
    job = soak._Job([str(soak.tool("torchrun")), "--standalone", "--nproc-per-node=2", str(sleeper)])
    clients = {}
    try:
        deadline = time.monotonic() + soak.START_LIMIT
        while len(clients) < 2 and time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.05)
            clients = job.pids()
        assert sorted(clients) == [0, 1], job.output()
        assert all(os.getsid(pid) != job.proc.pid for pid in clients.values())  # not in the launcher's session
        job.kill_all()
        job.end(30)
        alive = [pid for pid in clients.values() if os.path.exists(f"/proc/{pid}")
                 and open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        assert not alive, f"clients alive after the job was killed: {alive}"
        assert job.survivors == 0  # killed with the launcher, not found orphaned after it
    finally:
        for pid in clients.values():
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
