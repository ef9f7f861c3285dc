"""A client that arrives after the others timed out gets the library's timeout naming the save (issue 16, defect 3).

Four clients under torchrun (gloo) and under mpiexec run tests/helpers/late_worker.py:
client 2 starts a save only after the other three have given up on it. Under torch the
others either end (``gone``: the late client's gloo collective meets "Connection closed by
peer") or stay alive (``stay``: its collective times out); under MPI they stay (one process
ending ends an MPI job). Every client raises :class:`CoordinationTimeout` whose message
starts with "the save of <prefix>" and whose ``missing`` is ``[2]``; the late client's says
that it arrived after the others had given up on it, not only what the engine said.
Nothing is committed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
HELPERS = HERE / "helpers"
WORKER = HELPERS / "late_worker.py"
if str(HELPERS) not in sys.path:
    sys.path.insert(0, str(HELPERS))

import late_worker as W  # noqa: E402  (tests/helpers)
from launchers import clean_env, launch_command  # noqa: E402  (tests/helpers)

GRACE = 1.0  # the barrier's grace period: max(1 s, 10 % of the timeout)
SLACK = 4.0  # four processes on two shared cores


@pytest.mark.parametrize("backend,mode", [("torch", "gone"), ("torch", "stay"), ("mpi", "stay")])
def test_a_client_arriving_after_the_others_timed_out_gets_a_timeout_naming_the_save(
        tmp_path: Path, backend: str, mode: str) -> None:
    out, data = tmp_path / "out", tmp_path / "data"
    out.mkdir()
    data.mkdir()
    cmd = launch_command(backend, 4, WORKER)
    done = subprocess.run(cmd + [mode, str(out), str(data)], capture_output=True, text=True, env=clean_env(),
                          cwd=str(HERE.parent), timeout=240)
    log = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"launcher exit {done.returncode}:\n{log}"
    prefix = str(data / "second")
    for r in range(4):
        res = json.loads((out / f"rank{r}.json").read_text())
        assert "fatal" not in res and res.get("done"), f"rank {r}: {res.get('fatal')}\n{log}"
        outcome = res["outcome"]
        assert not outcome["ok"], f"rank {r}: the save succeeded without client {W.LATE}"
        assert outcome["type"] == "CoordinationTimeout", (r, outcome["type"], outcome["message"])
        assert outcome["message"].startswith(f"the save of {prefix} failed: rank {r}: "), (r, outcome["message"])
        assert outcome["missing"] == [W.LATE], (r, outcome)
        if r == W.LATE:
            assert "arrived after the other clients had given up waiting for it" in outcome["message"], outcome
            assert "GLHF" not in outcome["message"] and ".cc:" not in outcome["message"], outcome["message"]
            assert outcome["elapsed"] <= W.TIMEOUT + SLACK, outcome
        else:
            assert f"[{W.LATE}]" in outcome["message"], outcome["message"]
            # the collective's timeout, then the probe that names the missing client
            assert outcome["elapsed"] <= 2 * W.TIMEOUT + GRACE + SLACK, outcome
    assert (data / "first.index").exists()
    assert not list(data.glob("second*")), sorted(p.name for p in data.iterdir())
