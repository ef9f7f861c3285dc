"""Which timeout a multi-client save waits (issue 16, defect 4), first that is set:
``CheckpointOptions(timeout=)`` > ``get_coordinator(timeout=)`` > ``$SHARDCKPT_TIMEOUT`` > 600 s.

The precedence is shown by two real clients under torchrun (tests/helpers/timeout_worker.py):
client 0 saves alone and its error says how long its first collective waited; a save whose
option is longer than the coordinator's timeout waits for a client that comes after the
coordinator's timeout (gloo's own group timeout follows the call's). The checks of the
values themselves run here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardckpt.distributed import get_coordinator, set_coordinator
from shardckpt.distributed.coordinator import DEFAULT_TIMEOUT, TIMEOUT_ENV, check_timeout, default_timeout
from shardckpt.errors import InvalidArgumentError

HERE = Path(__file__).resolve().parent
WORKER = HERE / "helpers" / "timeout_worker.py"
if str(HERE / "helpers") not in sys.path:
    sys.path.insert(0, str(HERE / "helpers"))

from launchers import clean_env, tool  # noqa: E402  (tests/helpers)

ENV_TIMEOUT = 1.5
SLACK = 4.0  # two processes on shared cores


def test_default_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert default_timeout() == DEFAULT_TIMEOUT == 600.0
    assert check_timeout(None) == 600.0
    monkeypatch.setenv(TIMEOUT_ENV, " 42.5 ")
    assert default_timeout() == 42.5 and check_timeout(None) == 42.5
    assert check_timeout(7) == 7.0  # an argument wins over the environment


@pytest.mark.parametrize("raw", ["ten", "0", "-3", "inf", "nan"])
def test_a_bad_environment_value_is_named(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(TIMEOUT_ENV, raw)
    with pytest.raises(InvalidArgumentError, match=f"{TIMEOUT_ENV}='{raw}'"):
        default_timeout()


@pytest.mark.parametrize("bad", [0, -1, float("inf"), float("nan"), "soon"])
def test_a_bad_timeout_argument_is_refused(bad: object) -> None:
    with pytest.raises(InvalidArgumentError, match="timeout"):
        check_timeout(bad)  # type: ignore[arg-type]
    set_coordinator(None)
    try:
        with pytest.raises(InvalidArgumentError, match="timeout"):
            get_coordinator("single", timeout=bad)  # type: ignore[arg-type]
    finally:
        set_coordinator(None)


def test_precedence_across_real_clients(tmp_path: Path) -> None:
    out, data = tmp_path / "out", tmp_path / "data"
    out.mkdir()
    data.mkdir()
    env = clean_env()
    env[TIMEOUT_ENV] = str(ENV_TIMEOUT)
    done = subprocess.run([str(tool("torchrun")), "--standalone", "--nproc-per-node=2", str(WORKER), str(out),
                           str(data)], capture_output=True, text=True, env=env, cwd=str(HERE.parent), timeout=300)
    log = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"launcher exit {done.returncode}:\n{log}"
    results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for r, res in enumerate(results):
        assert "fatal" not in res and res.get("done"), f"rank {r}: {res.get('fatal')}\n{log}"
    steps = results[0]["steps"]
    for step, coordinator_timeout, waited in (("env", ENV_TIMEOUT, ENV_TIMEOUT), ("argument", 2.5, 2.5),
                                              ("option", 2.5, 1.0)):
        entry = steps[step]
        assert entry["coordinator_timeout"] == coordinator_timeout, (step, entry)
        assert results[1]["steps"][step]["coordinator_timeout"] == coordinator_timeout
        assert not entry["ok"] and entry["type"] == "CoordinationTimeout", (step, entry)
        assert f"did not complete within {waited:g} s" in entry["message"], (step, entry["message"])
        assert entry["message"].startswith(f"the save of {data / step} failed"), entry["message"]
        # the collective's timeout, then the probe that names the missing client (as long again + grace)
        assert waited <= entry["elapsed"] <= 2 * waited + 1.0 + SLACK, (step, entry)
    for r, res in enumerate(results):
        longer = res["steps"]["longer"]
        assert longer["ok"], (r, longer)
        assert longer["coordinator_timeout"] == 1.0
        assert res["steps"]["existing"] == {"same": True, "timeout": 2.0}
    assert (data / "longer.index").exists()
