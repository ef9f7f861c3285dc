"""Shared harness of the benchmarks: states, warming, timing, memory and I/O probes, JSON output.

Only the standard library and NumPy, so that this module is importable both from the
project's environment and from the TensorFlow side environment (which does not have
shardckpt installed; its workers see only this folder on ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

GIB = 1 << 30
MIB = 1 << 20
DTYPE = np.float32
PAGE = 4096
RESULT_PREFIX = "BENCH-RESULT "  # marks the one JSON line a worker prints

Spec = List[Tuple[str, Tuple[int, ...]]]


# -- sizes -------------------------------------------------------------------
def parse_size(text: str) -> int:
    """``"64MiB"``, ``"1GiB"``, ``"1.5GiB"``, ``"500MB"`` or a plain byte count."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]i?B?|B)?\s*", text, re.IGNORECASE)
    if not m:
        raise ValueError(f"bad size {text!r}")
    unit = (m.group(2) or "B").upper().rstrip("B")
    scale = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
             "KI": 1 << 10, "MI": 1 << 20, "GI": 1 << 30, "TI": 1 << 40}[unit]
    return int(float(m.group(1)) * scale)


def fmt_size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{int(n)} B"


# -- states --------------------------------------------------------------------
def state_spec(kind: str, nbytes: int, count: int = 64) -> Spec:
    """``(name, shape)`` of every float32 tensor of a state of about ``nbytes`` bytes.

    ``uniform``: ``count`` equal tensors. ``transformer``: 485 tensors, a 40-layer
    transformer (token and position embeddings, attention q/k/v/o kernels, MLP
    in/out kernels and biases, two layer norms per layer, a final norm and an output
    bias); the model width is picked so the total is ``nbytes`` within one row.
    """
    floats = nbytes // DTYPE().itemsize
    if kind == "uniform":
        each = floats // count
        if each == 0:
            raise ValueError(f"{fmt_size(nbytes)} is too small for {count} tensors")
        shape = (each // 1024, 1024) if each % 1024 == 0 else (each,)
        return [(f"tensor_{i:03d}", shape) for i in range(count)]
    if kind == "transformer":
        layers = 40

        def fixed(d: int) -> int:  # everything but the token embedding and output bias
            return layers * (12 * d * d + 9 * d) + d * d + 2 * d

        d = max(16, int((floats / 489) ** 0.5) // 16 * 16)
        while d > 16 and fixed(d) + 8 * d * (d + 1) > floats:
            d -= 16
        vocab = (floats - fixed(d)) // (d + 1)
        if vocab < 1:
            raise ValueError(f"{fmt_size(nbytes)} is too small for the transformer state")
        spec: Spec = [("embeddings/token", (vocab, d)), ("embeddings/position", (d, d))]
        for i in range(layers):
            p = f"layer_{i:02d}"
            spec += [(f"{p}/attention/{w}/kernel", (d, d)) for w in "qkvo"]
            spec += [(f"{p}/attention_norm/gamma", (d,)), (f"{p}/attention_norm/beta", (d,)),
                     (f"{p}/mlp/in/kernel", (d, 4 * d)), (f"{p}/mlp/in/bias", (4 * d,)),
                     (f"{p}/mlp/out/kernel", (4 * d, d)), (f"{p}/mlp/out/bias", (d,)),
                     (f"{p}/mlp_norm/gamma", (d,)), (f"{p}/mlp_norm/beta", (d,))]
        spec += [("final_norm/gamma", (d,)), ("final_norm/beta", (d,)), ("output/bias", (vocab,))]
        return spec
    raise ValueError(f"unknown state kind {kind!r} (uniform, transformer)")


def spec_bytes(spec: Spec) -> int:
    return sum(int(np.prod(shape)) for _, shape in spec) * DTYPE().itemsize


def fill_tensor(i: int, out: np.ndarray, seed: int = 0) -> np.ndarray:
    """Deterministic values of tensor ``i`` (uniform in [0, 1)), written into ``out``."""
    np.random.default_rng([seed, i]).random(out=out.reshape(-1), dtype=DTYPE)
    return out


def alloc(spec: Spec) -> List[np.ndarray]:
    """Zeroed arrays of the spec's shapes, every page touched (NumPy memory, huge pages where it can)."""
    arrays = []
    for _, shape in spec:
        a = np.empty(shape, dtype=DTYPE)
        a.fill(0)
        arrays.append(a)
    return arrays


def make_state(spec: Spec, seed: int = 0) -> List[np.ndarray]:
    return [fill_tensor(i, np.empty(shape, dtype=DTYPE), seed) for i, (_, shape) in enumerate(spec)]


def verify(spec: Spec, arrays: Sequence[np.ndarray], seed: int = 0, indices: Sequence[int] = ()) -> bool:
    """Whether ``arrays`` hold the state's values (tensor by tensor, so little extra memory)."""
    indices = list(indices) or list(range(len(spec)))
    if len(arrays) != len(indices):
        return False
    for i, got in zip(indices, arrays):
        got = np.asarray(got)
        if got.shape != tuple(spec[i][1]) or got.dtype != DTYPE:
            return False
        if not np.array_equal(got, fill_tensor(i, np.empty(spec[i][1], dtype=DTYPE), seed)):
            return False
    return True


def byte_view(a: np.ndarray) -> memoryview:
    return memoryview(a.reshape(-1).view(np.uint8))


# -- warming and the page cache ------------------------------------------------------
def warm(arrays: Sequence[np.ndarray]) -> None:
    """Touch every page of ``arrays`` (adds 0 to one byte per page; values do not change).

    Call right before a timed phase: on these machines memory left untouched for a few
    seconds goes back to the host and costs ~2.5 s/GiB to touch again.
    """
    for a in arrays:
        if a.size == 0:
            continue
        flat = a.reshape(-1).view(np.uint8)
        pages = flat[::PAGE]
        if flat.flags.writeable:
            np.add(pages, 0, out=pages)
        else:
            int(pages.sum())


def prime_free_memory(nbytes: int) -> None:
    """Touch ``nbytes`` of fresh memory and free it again, right before a timed phase.

    These VMs hand free memory back to the host (free page reporting, ~2 s after it is
    freed); the first touch of such memory costs ~2.5 s/GiB, which would dominate any
    phase that allocates (page cache for writes and cold reads, fresh result arrays).
    Pages freed a moment ago are handed out first and cost nothing extra, as memory does
    on a machine that owns its RAM. Prime with what the phase will allocate.
    """
    if nbytes > 0:
        buf = np.empty(nbytes, dtype=np.uint8)
        buf[::PAGE] = 1
        del buf


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


def drop_page_cache() -> bool:
    """Write dirty pages back and drop the page cache (needs root); False when not allowed."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError:
        return False


def uncache(folder: "str | Path") -> None:
    """Drop the page cache of every file under ``folder`` only (``POSIX_FADV_DONTNEED`` after an fsync of
    each): a cold read of those files, without :func:`drop_page_cache`'s side effect on this VM: dropping
    the whole page cache frees gigabytes at once, which the VM then hands back to the host for seconds
    on its own cores (free page reporting), slowing whatever runs next (a restore from a peer over
    loopback: 0.32 s right after priming, 0.47 s within 10 ms of a whole drop, 0.41 s 3 s after)."""
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            except OSError:
                pass
            finally:
                os.close(fd)


def cache_files(folder: Path) -> None:
    """Read the files under ``folder`` into the page cache where memory pressure pushed parts out (at
    4 GiB of state on a 24 GiB machine, the files a save just wrote do not always stay cached)."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb", buffering=0) as f:
                buf = bytearray(16 << 20)
                while f.readinto(buf):
                    pass


# -- probes ---------------------------------------------------------------------------
def status_bytes(field: str) -> int:
    """A memory field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``...) in bytes; 0 where absent."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _io_counters() -> Dict[str, int]:
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f if ": " in line)}
    except OSError:
        return {}


def reset_peak_rss() -> bool:
    """Start a new peak-RSS window (Linux: writing 5 to ``clear_refs`` resets ``VmHWM``); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Probe:
    """Time, CPU time, peak extra resident memory and syscall bytes of one phase.

    ``start()`` resets the peak-RSS mark (``clear_refs`` 5) and notes RSS and
    ``/proc/self/io``; ``sample()`` reports everything since ``start()``:
    ``seconds``, ``cpu_s`` and ``sys_s`` (all threads; kernel time is where page faults
    and page-cache copies show), ``peak_extra`` (VmHWM - RSS before),
    ``rchar`` / ``wchar`` (bytes through read/write syscalls, page cache or not).
    """

    def start(self) -> "Probe":
        self.hwm_reset = reset_peak_rss()
        self.rss0 = status_bytes("VmRSS")
        self.io0 = _io_counters()
        self.ru0 = resource.getrusage(resource.RUSAGE_SELF)
        self.t0 = time.perf_counter()
        return self

    def sample(self) -> Dict[str, float]:
        seconds = time.perf_counter() - self.t0
        ru = resource.getrusage(resource.RUSAGE_SELF)
        sys_s = ru.ru_stime - self.ru0.ru_stime
        io = _io_counters()
        out = {"seconds": seconds, "cpu_s": ru.ru_utime - self.ru0.ru_utime + sys_s, "sys_s": sys_s,
               "rss_before": self.rss0,
               "peak_extra": max(0, status_bytes("VmHWM") - self.rss0) if self.hwm_reset else None}
        for k in ("rchar", "wchar"):
            out[k] = io[k] - self.io0[k] if k in io and k in self.io0 else None
        return out


# -- output ----------------------------------------------------------------------------
def emit(result: Dict) -> None:
    """Print the worker's result as one JSON line (the driver looks for ``RESULT_PREFIX``)."""
    sys.stdout.write(RESULT_PREFIX + json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> Dict:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise ValueError("worker printed no result line")


def median(values: Sequence[float]) -> float:
    s = sorted(values)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# -- smoke runs, results files and the verdict ------------------------------------------
RESULTS_ENV = "SHARDCKPT_BENCH_RESULTS"  # where results files go instead of benchmarks/results
SMOKE_HELP = ("the smallest run: smallest sizes, one repeat, every phase and every value check, in "
              "seconds (what tests/test_benchmarks_smoke.py runs; the figures mean nothing)")


def parse_args(ap: argparse.ArgumentParser, argv: Optional[Sequence[str]] = None,
               **smoke: Any) -> argparse.Namespace:
    """Add ``--smoke`` to ``ap`` and parse ``argv``; with ``--smoke`` the options default to ``smoke``
    (strings are parsed as on the command line) and options given explicitly still win."""
    ap.add_argument("--smoke", action="store_true", help=SMOKE_HELP)
    known, _ = ap.parse_known_args(argv)
    if known.smoke:
        ap.set_defaults(**smoke)
    return ap.parse_args(argv)


def results_dir() -> str:
    """The folder of results files: ``$SHARDCKPT_BENCH_RESULTS``, else ``benchmarks/results`` (created)."""
    folder = os.environ.get(RESULTS_ENV) or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(folder, exist_ok=True)
    return folder


def results_path(stem: str) -> str:
    """``<results_dir()>/<stem>-<time>.json``."""
    return os.path.join(results_dir(), f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def write_results(stem: str, result: Any, **dump: Any) -> str:
    """Write ``result`` as JSON to :func:`results_path` and print where it went; returns the path."""
    path = results_path(stem)
    with open(path, "w") as f:
        json.dump(result, f, **({"indent": 1} | dump))
    print(f"results: {path}")
    return path


def finish(wrong: Sequence[str] = (), failed: Sequence[str] = ()) -> None:
    """End a run whose report is printed and saved: exit non-zero when a measurement restored or
    converted values that are not exactly the state's (``wrong``: a fast wrong answer is no speed)
    or failed (``failed``), naming each."""
    for what in wrong:
        print(f"WRONG VALUES: {what}", file=sys.stderr)
    for what in failed:
        print(f"FAILED: {what}", file=sys.stderr)
    if wrong or failed:
        sys.exit(f"{len(wrong)} measurement(s) with wrong values, {len(failed)} failed")


def tf_python(explicit: Optional[str], repo: str, required: bool) -> Optional[str]:
    """The TensorFlow interpreter: ``explicit``, else ``$SHARDCKPT_TF_PYTHON``, else ``<repo>/.venv-tf``;
    None where it does not exist, unless ``required`` (a smoke run exercises every system): then exit."""
    path = explicit or os.environ.get("SHARDCKPT_TF_PYTHON") or os.path.join(repo, ".venv-tf", "bin", "python")
    if os.path.isfile(path):
        return path
    if required:
        sys.exit(f"TensorFlow interpreter {path} not found (set SHARDCKPT_TF_PYTHON or --tf-python): "
                 "a smoke run exercises every system")
    return None
