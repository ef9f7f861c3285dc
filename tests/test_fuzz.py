"""Run each coverage-guided fuzz harness (tests/fuzz/) briefly: a fixed number of runs from its seeds.

Each harness runs in its own process under atheris/libFuzzer with a fixed seed, a per-input
timeout and an RSS limit; any exception outside ``shardckpt.errors``, a hang or memory
beyond the limit fails the test with libFuzzer's report. ``scripts/fuzz.sh`` runs the
same harnesses for as long as asked.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).parent / "fuzz"
sys.path.insert(0, str(FUZZ))
from harnesses import HARNESSES  # noqa: E402

RUNS = {"sstable": 1500, "bundle": 600, "bundle_entries": 2000, "object_graph": 1500, "state_file": 3000,
        "safetensors": 800, "npz": 500, "hf_index": 800}
RSS_LIMIT_MB = 512  # the interpreter, NumPy and protobuf take ~80 MB; inputs are a few KB
TIMEOUT_S = 10
# libFuzzer measures memory as the peak RSS (getrusage), which Linux carries across fork + exec:
# a harness started straight from a pytest process of 1 GB would start "at" 1 GB and trip the
# limit. A small launcher process in between gives the harness a fresh peak (a forked child
# starts a new count, from its parent's current, small, size).
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.call(sys.argv[1:]))"


@pytest.mark.parametrize("name", sorted(HARNESSES))
def test_fuzz_harness_briefly(name: str, tmp_path: Path) -> None:
    seeds = FUZZ / "corpus" / name
    assert seeds.is_dir() and any(seeds.iterdir()), f"no seed corpus for {name}"
    runs = RUNS.get(name, 1000)
    cmd = [sys.executable, "-c", LAUNCHER,
           sys.executable, str(FUZZ / HARNESSES[name]), f"-runs={runs}", "-seed=1", f"-timeout={TIMEOUT_S}",
           f"-rss_limit_mb={RSS_LIMIT_MB}", f"-artifact_prefix={tmp_path}/", str(tmp_path / "corpus"), str(seeds)]
    (tmp_path / "corpus").mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent.parent / "src"), env.get("PYTHONPATH", "")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name}: libFuzzer found a problem (rc {proc.returncode}):\n{output[-6000:]}"
    assert f"Done {runs} runs" in output, output[-3000:]
    assert not list(tmp_path.glob("crash-*")) and not list(tmp_path.glob("timeout-*"))
