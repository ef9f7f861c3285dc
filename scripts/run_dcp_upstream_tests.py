"""Run PyTorch's own DCP tests twice: with DCP's stock storage, and with shardckpt's swapped in.

    python scripts/run_dcp_upstream_tests.py TESTS_DIR [FILE ...] [--timeout S] [--jobs N]

``TESTS_DIR`` is a copy of PyTorch's ``test/distributed/checkpoint/`` for the torch version
installed here (taken from PyTorch's public repository; it is never committed to this
one, and CI has no network to get it). ``FILE``s (paths relative to ``TESTS_DIR``) pick
some of its test files; by default: ``test_file_system_checkpoint_cpu.py``,
``test_dtensor_resharding.py``, ``test_dtensor_checkpoint.py``, ``test_format_utils.py``
and ``e2e/test_e2e_save_and_load.py``, those present.

Each run copies ``TESTS_DIR`` to a scratch folder (the input is never changed). For the
swapped run, a module ``_shardckpt_swap`` is written there and one import line,
``import _shardckpt_swap``, is put at the top of every test file (after the gates' line
below): it replaces
``FileSystemWriter`` / ``FileSystemReader`` everywhere DCP and the tests look them up
(``torch.distributed.checkpoint``, its ``filesystem``, ``_storage_utils`` (the storage
``dcp.save(checkpoint_id=...)`` picks when none is given) and ``format_utils``) by thin
subclasses of :class:`~shardckpt.torch.TFBundleWriter` / ``TFBundleReader`` that take
``FileSystemWriter``'s arguments, its ``path`` always a directory. What cannot apply is
refused by them with a clear error: ``_extensions`` (DCP's stream transforms, e.g.
compression: a tensor bundle stores each tensor's bytes as they are, with a CRC32C) and
serialization formats other than DCP's default. Without a GPU, both runs lift the
``skip_if_lt_x_gpu`` gates (``import _dcp_upstream_gates``, also put at the top of every
test file, as every rank of a multi-process test imports the file again): DTensor tests
then run on CPU with gloo, as torch allows; tests that move tensors to CUDA fail in both.

The tests of each file run with ``python -m pytest -rA`` (PyTorch's multi-process tests
spawn their own ranks), ``--jobs`` files at once (default 1: one file at a time); the script
prints, per file, passed / failed / skipped stock and swapped, then every test whose outcome
differs, with the last line of its error, and the tests that failed in both runs.
Exit status: 0 when every test that passed stock passed swapped.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_FILES = ["test_file_system_checkpoint_cpu.py", "test_dtensor_resharding.py", "test_dtensor_checkpoint.py",
                 "test_format_utils.py", "e2e/test_e2e_save_and_load.py"]
SWAP_LINE = "import _shardckpt_swap  # noqa: F401,E402  (shardckpt's storage in place of DCP's)\n"

SWAP_MODULE = '''"""DCP's FileSystemWriter / FileSystemReader replaced by shardckpt's (run_dcp_upstream_tests.py)."""
import os

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import _storage_utils, filesystem, format_utils

from shardckpt.errors import UnsupportedError
from shardckpt.torch import TFBundleReader, TFBundleWriter


def _directory(path):
    return None if path is None else os.fspath(path).rstrip("/") + "/"


class FileSystemWriter(TFBundleWriter):
    """TFBundleWriter taking FileSystemWriter's arguments; ``path`` is a checkpoint directory."""

    def __init__(self, path, single_file_per_rank=True, sync_files=True, thread_count=1,
                 per_thread_copy_ahead=10_000_000, cache_staged_state_dict=False, overwrite=True,
                 _extensions=None, serialization_format=None):
        if _extensions:
            raise UnsupportedError("DCP's stream extensions (" + ", ".join(type(e).__name__ for e in _extensions)
                                   + ") do not apply to a tensor bundle: its entries are stored as they are")
        if serialization_format is not None and getattr(serialization_format, "name", "") != "TORCH_SAVE":
            raise UnsupportedError(f"serialization format {serialization_format} does not apply to a tensor bundle")
        super().__init__(_directory(path), single_file_per_rank=single_file_per_rank, sync_files=sync_files,
                         thread_count=thread_count, per_thread_copy_ahead=per_thread_copy_ahead,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite)


class FileSystemReader(TFBundleReader):
    """TFBundleReader taking FileSystemReader's arguments."""

    def __init__(self, path, _extension_registry=None):
        super().__init__(path)


for _module in (dcp, filesystem, _storage_utils, format_utils):
    _module.FileSystemWriter = FileSystemWriter
    _module.FileSystemReader = FileSystemReader
'''

GATES_LINE = "import _dcp_upstream_gates  # noqa: F401,E402  (GPU gates lifted on CPU-only hosts)\n"
GATES_MODULE = '''"""GPU gates lifted where torch runs the test on CPU (run_dcp_upstream_tests.py writes it, both runs).

Imported by each test file itself: PyTorch's multi-process tests re-import it in every rank.
"""
import torch

if not torch.cuda.is_available():
    from torch.testing._internal import common_distributed
    from torch.testing._internal.distributed._tensor import common_dtensor

    def _no_gate(*args, **kwargs):
        return lambda func: func

    common_distributed.skip_if_lt_x_gpu = _no_gate
    common_dtensor.skip_if_lt_x_gpu = _no_gate
'''

_OUTCOME = re.compile(r"^(PASSED|FAILED|ERROR|XFAIL|XPASS)\s+(\S+)(?:\s+-\s+(.*))?$")
_SKIPPED = re.compile(r"^SKIPPED \[(\d+)\] (\S+?):\d+: (.*)$")


def _prepare(source: Path, scratch: Path, files: List[str], swapped: bool) -> None:
    shutil.copytree(source, scratch, ignore=shutil.ignore_patterns("__pycache__"))
    (scratch / "_dcp_upstream_gates.py").write_text(GATES_MODULE)
    if swapped:
        (scratch / "_shardckpt_swap.py").write_text(SWAP_MODULE)
    for name in files:
        path = scratch / name
        lines = path.read_text().splitlines(keepends=True)
        at = 0  # after the __future__ imports, if any: before every other import
        for i, line in enumerate(lines):
            if line.startswith("from __future__"):
                at = i + 1
        lines[at:at] = [GATES_LINE] + ([SWAP_LINE] if swapped else [])
        path.write_text("".join(lines))


def _run(scratch: Path, name: str, timeout: float, swapped: bool) -> Dict[str, Tuple[str, str]]:
    env = dict(os.environ)
    paths = [str(scratch), str((scratch / name).parent)]
    if swapped:
        paths.append(str(ROOT / "src"))
    env["PYTHONPATH"] = os.pathsep.join(paths + [env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["COLUMNS"] = "400"  # pytest's summary lines keep their error text (cut to the terminal's width)
    cmd = [sys.executable, "-m", "pytest", "-rA", "-q", "-p", "no:cacheprovider", str(scratch / name)]
    try:
        proc = subprocess.run(cmd, cwd=str(scratch), env=env, capture_output=True, text=True, timeout=timeout)
        text = proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return {f"{name}::<file>": ("TIMEOUT", f"over {timeout:.0f} s; {out[-300:]}")}
    outcomes: Dict[str, Tuple[str, str]] = {}
    for line in text.splitlines():
        match = _OUTCOME.match(line.strip())
        if match:
            test = match.group(2).split("::", 1)[-1]
            outcomes[f"{name}::{test}"] = (match.group(1), (match.group(3) or "")[:300])
        skipped = _SKIPPED.match(line.strip())
        if skipped:  # -rA names no skipped test, only how many skipped for one reason
            for i in range(int(skipped.group(1))):
                outcomes[f"{name}::<skipped {len(outcomes)} {i}>"] = ("SKIPPED", skipped.group(3)[:300])
    if not outcomes:
        outcomes[f"{name}::<file>"] = ("ERROR", text.strip().splitlines()[-1][:300] if text.strip() else "no output")
    return outcomes


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests_dir", type=Path, help="a copy of PyTorch's test/distributed/checkpoint/")
    parser.add_argument("files", nargs="*", help="test files relative to TESTS_DIR (default: the five named above)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per test file and run")
    parser.add_argument("--jobs", type=int, default=1, help="test files run at once (default 1)")
    args = parser.parse_args(argv)
    source = args.tests_dir.resolve()
    files = args.files or [f for f in DEFAULT_FILES if (source / f).is_file()]
    if not files:
        parser.error(f"no test files found in {source}")
    results: Dict[str, Dict[str, Tuple[str, str]]] = {}
    for mode in ("stock", "swapped"):
        with tempfile.TemporaryDirectory(prefix=f"dcp-upstream-{mode}-") as tmp:
            scratch = Path(tmp) / "checkpoint"
            _prepare(source, scratch, files, swapped=mode == "swapped")
            results[mode] = {}

            def one(name: str, mode: str = mode, scratch: Path = scratch) -> Dict[str, Tuple[str, str]]:
                print(f"[{mode}] {name} ...", flush=True)
                return _run(scratch, name, args.timeout, swapped=mode == "swapped")

            with ThreadPoolExecutor(max(1, args.jobs)) as pool:
                for outcomes in pool.map(one, files):
                    results[mode].update(outcomes)
    print(f"\n{'file':45} {'stock pass/fail/skip':>22} {'swapped pass/fail/skip':>24}")
    totals = {"stock": [0, 0, 0], "swapped": [0, 0, 0]}
    for name in files:
        row = []
        for mode in ("stock", "swapped"):
            got = [v[0] for k, v in results[mode].items() if k.startswith(name + "::")]
            counts = [got.count("PASSED"), sum(got.count(x) for x in ("FAILED", "ERROR", "TIMEOUT")),
                      got.count("SKIPPED")]
            totals[mode] = [a + b for a, b in zip(totals[mode], counts)]
            row.append("/".join(map(str, counts)))
        print(f"{name:45} {row[0]:>22} {row[1]:>24}")
    print(f"{'total':45} {'/'.join(map(str, totals['stock'])):>22} {'/'.join(map(str, totals['swapped'])):>24}")
    differ = sorted(k for k in set(results["stock"]) | set(results["swapped"])
                    if results["stock"].get(k, ("-", ""))[0] != results["swapped"].get(k, ("-", ""))[0])
    if differ:
        print("\ndifferences (stock -> swapped):")
        for key in differ:
            stock, swapped = results["stock"].get(key, ("-", "")), results["swapped"].get(key, ("-", ""))
            print(f"  {key}: {stock[0]} -> {swapped[0]}  {swapped[1]}")
    both = sorted(k for k, (outcome, _) in results["stock"].items()
                  if outcome != "PASSED" and results["swapped"].get(k, ("",))[0] == outcome and "<" not in k)
    if both:
        print("\nnot passed in both runs (stock's reason):")
        for key in both:
            print(f"  {key}: {results['stock'][key][0]}  {results['stock'][key][1]}")
    for mode in ("stock", "swapped"):
        for key, (outcome, why) in sorted(results[mode].items()):
            if key.endswith("::<file>"):
                print(f"  [{mode}] {key}: {outcome}  {why}")
    lost = [k for k in differ if results["stock"].get(k, ("",))[0] == "PASSED"]
    return 1 if lost else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
