"""Every benchmark runs: ``benchmarks/bench_*.py --smoke`` (and ``compare_revisions.py --smoke``), each a real run.

A smoke run is the benchmark's smallest: smallest sizes, one repeat, every phase, every system
(TensorFlow ones under ``$SHARDCKPT_TF_PYTHON``; a missing TF interpreter is a failure) and every
value check; its figures mean nothing. Each runs as a subprocess into a scratch folder of the
test (``--dir``), its results file into another (``$SHARDCKPT_BENCH_RESULTS``: nothing lands in
``benchmarks/results``). A benchmark passes when it exits 0 (a benchmark exits non-zero when a
measurement failed or read back values that are not exactly the state's), printed its table
and wrote one results file. The list is a glob: a new benchmark without a smoke mode, or whose
table is not listed in :data:`TABLES`, fails here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launchers import clean_env
from tf_oracle.client import find_tf_python

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"
SCRIPTS = sorted(BENCH.glob("bench_*.py"))

# A line of each benchmark's table (what its smoke run must print on stdout).
TABLES = {
    "bench_async.py": "(c) async save to commit / sync save",
    "bench_bundle.py": "shardckpt restore_v2 / TF RestoreV2+numpy",
    "bench_convert.py": "sliced/sc_hf",
    "bench_dtensor.py": "resharded restore (shardckpt)",
    "bench_funnel_restore.py": "funnelled_resharded",
    "bench_incremental.py": "incremental / full: time",
    "bench_jax.py": "resharded restore",
    "bench_object_store.py": "Checkpoint.restore (MB/s)",
    "bench_restore_cpu.py": "restore_tensors, checksummed",
    "bench_scale.py": "merge mem s",
    "bench_sharded.py": "shardckpt GB/s",
    "bench_tiers.py": "cold persistent restore / recovery (1 node wiped)",
    "bench_torch.py": "resharded load (4 -> 2), map_reads=False",
    "bench_torch_cuda.py": "async checkpoint bit-exact",
    "compare_revisions.py": "async Checkpoint.save",
}


def run_smoke(script: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    env = clean_env()
    env.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), str(BENCH)]), SHARDCKPT_TF_PYTHON=find_tf_python(),
               SHARDCKPT_BENCH_RESULTS=str(tmp_path / "results"))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    proc = subprocess.run([sys.executable, str(script), "--smoke", "--dir", str(scratch)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, (f"{script.name} --smoke exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
                                  f"\n--- stderr\n{proc.stderr[-6000:]}")
    assert script.name in TABLES, f"add a line of {script.name}'s table to TABLES"
    assert TABLES[script.name] in proc.stdout, f"{script.name} printed no table:\n{proc.stdout[-4000:]}"
    assert "WRONG VALUES" not in proc.stdout + proc.stderr
    return proc


def _results() -> set:
    folder = BENCH / "results"
    return set(folder.iterdir()) if folder.is_dir() else set()


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_benchmark_smoke(script: Path, tmp_path: Path) -> None:
    before = _results()
    run_smoke(script, tmp_path)
    written = list((tmp_path / "results").iterdir())
    assert len(written) == 1, f"{script.name} wrote {written}, not one results file"
    assert json.loads(written[0].read_text())
    assert _results() == before, f"{script.name} wrote into benchmarks/results"


@pytest.mark.slow
def test_compare_revisions_smoke(tmp_path: Path) -> None:
    """Every case of the before/after tool, this tree against its own ``src`` (no git worktree)."""
    proc = run_smoke(BENCH / "compare_revisions.py", tmp_path)
    for label in ("save_v2 + fsync, 485 tensors", "restore into arrays, 485 tensors", "sharded save, 4 shards"):
        assert label in proc.stdout
