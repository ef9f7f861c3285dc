"""Benchmark incremental saves: time and bytes written when 1%, 10% or 100% of a state changed.

A uniform float32 state (default 256 MiB in 256 tensors) is set up once per fraction, each
way below saving it once (the incremental ones record hashes). Then ``--rounds`` rounds
follow: in each, a fraction of the tensors changes (every element of them, or with
``--change tail`` only their last element, so that their first bytes stay the same and change
detection must hash them whole) and every system saves the state once, into places of its own:

* ``full``         -- ``save_tensors(p, arrays)``: a plain full save (the baseline of ``incremental``);
* ``incremental``  -- ``save_tensors(p, arrays, CheckpointOptions(incremental=True), previous=<its last>)``:
                      plain arrays have no versions, so they are always hashed;
* ``vfull``        -- a ``CheckpointManager`` (not incremental) saving the same state as
                      ``shardckpt.Variable``s: the full save of the object-graph front door (the
                      baseline of ``variables`` and ``hashed``);
* ``variables``    -- ``CheckpointManager(..., incremental=True)`` of ``Variable``s changed
                      through the API (``assign_add``), default options: what a user of the
                      manager does. Unchanged variables are known by their version stamps (they
                      never handed out their live buffer), so no byte of them is read;
* ``hashed``       -- the same manager and options, but every variable's ``.array`` was taken
                      (as code that writes into it directly does): every variable is hashed
                      (xxh3-128, on the checksum helpers) to find the unchanged ones;
* ``dcp``          -- ``torch.distributed.checkpoint.save`` of the same state (reference; off with ``--no-dcp``).

Every save is durable (fsync, commit; the managers also write their state file and apply
``max_to_keep=2`` inside the timed save, as users see it). What makes the figures comparable
on a shared VM:

* the systems take turns: within a round they run in an order rotated by one every second round
  and reversed every other round, so none is always first or right after another's write;
* before *each* timed save (not timed): older plain checkpoints are deleted (an arrays
  system keeps only its last checkpoint, the previous of the next incremental save),
  ``os.sync()`` writes every dirty page back (no writeback of an earlier save competes), the
  page cache of every file of the benchmark is dropped (``posix_fadvise(DONTNEED)``: each save
  starts with the same free memory and a cold previous checkpoint), and then memory for the
  page cache the save will fill is primed (``common.prime_free_memory`` of ``--prime`` (2.5)
  times the state's bytes: these VMs hand freed memory back to the host, and first touching
  it again costs ~2.5 s/GiB of kernel time. That is where full saves of identical bytes
  varying 1.0-3.8 s came from: with no priming, or priming only 1.25x the bytes written, 3 of
  10 full saves of 1 GiB here took 0.9-1.1 s more kernel time, none did with 2.3x);
* ratios are medians of the per-round ratios (each system against its baseline in the same
  round), shown with a distribution-free 95 % confidence interval of that median (order
  statistics), their quartiles and range.

For each save its wall seconds, CPU seconds (all threads, ``getrusage``) and bytes written
(``/proc/self/io`` ``wchar``: every byte through ``write``; links write none) are recorded,
and for the incremental ones what change detection itself cost (probes around the library's
functions, no other change to it): the *arrange* step (reading the previous checkpoint's
index and sidecar, change detection, the layout; wall and CPU seconds, the CPU of all
threads, as it hashes on the checksum helpers) and the CPU seconds of the xxh3-128 hashing
done while bytes stream to disk (on the checksum helper, beside the CRC-32C, overlapping the
writes). After the rounds, the last ``full`` and ``incremental`` checkpoints are restored in
turns (``--restore-rounds`` each; every tensor, through ``restore_tensors`` as
``Checkpoint.restore`` does), from a cold page cache (dropped first where allowed) and then
warm: medians of the times and of the per-round ratios, and each checkpoint's number of data files.
Where the library has the background scrub of linked files (``saving/scrub.py``), what it read and
the seconds it ran during the rounds are printed too: it runs on its own thread, during and between
the timed saves, so whatever it costs the saves is in their times.

    .venv/bin/python benchmarks/bench_incremental.py                       # 256 MiB, 7 rounds
    .venv/bin/python benchmarks/bench_incremental.py --size 1GiB --rounds 9 --fractions 1.0 --no-dcp

Results: a table on stdout, everything in ``benchmarks/results/incremental-<time>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "src"))

import shardckpt  # noqa: E402
from shardckpt import CheckpointOptions  # noqa: E402

#: every system, in the order of the tables; each ratio is a system against its baseline of the same round
SYSTEMS = ("full", "incremental", "vfull", "variables", "hashed", "dcp")
BASELINE = {"incremental": "full", "variables": "vfull", "hashed": "vfull", "dcp": "full"}
INCREMENTAL = ("incremental", "variables", "hashed")


def _cpu_seconds() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


class DetectionProbe:
    """What change detection costs inside real saves: probes around the library's arrange step
    (``saving.engine._arrange``: previous checkpoint read, detection, layout) and its content
    digests (``saving.incremental.new_digest``), installed by :meth:`install`; nothing else of
    the library changes. A digest created while the arrange step runs counts as detection
    hashing, any other as hashing while the bytes stream to disk (on the checksum helper).
    The probes cost two ``thread_time`` calls per digest update (one per tensor chunk)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._arranging = False
        self.reset()

    def reset(self) -> None:
        self.arrange_s = 0.0
        self.arrange_cpu_s = 0.0
        self.arrange_hash_cpu_s = 0.0
        self.stream_hash_cpu_s = 0.0

    def sample(self) -> Dict[str, float]:
        return {"arrange_s": self.arrange_s, "arrange_cpu_s": self.arrange_cpu_s,
                "arrange_hash_cpu_s": self.arrange_hash_cpu_s, "stream_hash_cpu_s": self.stream_hash_cpu_s}

    def _add(self, field: str, seconds: float) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + seconds)

    def install(self) -> "DetectionProbe":
        from shardckpt.saving import engine, incremental

        arrange, new_digest, probe = engine._arrange, incremental.new_digest, self

        def timed_arrange(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), _cpu_seconds()
            probe._arranging = True
            try:
                return arrange(*args, **kwargs)
            finally:
                probe._arranging = False
                probe._add("arrange_s", time.perf_counter() - t0)
                probe._add("arrange_cpu_s", _cpu_seconds() - c0)

        class TimedDigest:
            __slots__ = ("_digest", "_field")

            def __init__(self) -> None:
                self._digest = new_digest()
                self._field = "arrange_hash_cpu_s" if probe._arranging else "stream_hash_cpu_s"

            def update(self, data: Any) -> None:
                t0 = time.thread_time()
                self._digest.update(data)
                probe._add(self._field, time.thread_time() - t0)

            def hexdigest(self) -> str:
                return str(self._digest.hexdigest())

        engine._arrange = timed_arrange  # type: ignore[assignment]
        incremental.new_digest = TimedDigest  # type: ignore[assignment]
        return self


def _scrub_figures() -> Dict[str, float]:
    """What the library's background scrub of linked files (``saving/scrub.py``) has read and spent so
    far in this process (empty where the library has no scrub: an older revision)."""
    try:
        from shardckpt.saving.scrub import default_scrubber
    except ImportError:
        return {}
    scrubber = default_scrubber()
    return {"scrub_bytes": float(scrubber.bytes_read), "scrub_s": scrubber.seconds}


def _remove_checkpoint(prefix: str) -> None:
    """Delete the checkpoint at ``prefix`` (its files ``<prefix>.*``; a DCP checkpoint is a folder)."""
    if os.path.isdir(prefix):
        shutil.rmtree(prefix)
        return
    folder, base = os.path.split(prefix)
    for name in os.listdir(folder):
        if name.startswith(base + "."):
            os.remove(os.path.join(folder, name))


def _rename_checkpoint(prefix: str, new_prefix: str) -> None:
    """Give the checkpoint at ``prefix`` the prefix ``new_prefix`` (an index names its data files by
    their shard numbers only, so renaming every ``<prefix>.*`` file is enough)."""
    folder, base = os.path.split(prefix)
    for name in os.listdir(folder):
        if name.startswith(base + "."):
            os.rename(os.path.join(folder, name), new_prefix + name[len(base):])


def settle(folder: str, stale: List[str], prime_bytes: int) -> None:
    """Before a timed save: delete ``stale`` checkpoints, write every dirty page back, drop the page
    cache of the benchmark's files and prime the memory the save's page cache will take."""
    for prefix in stale:
        _remove_checkpoint(prefix)
    stale.clear()
    gc.collect()
    os.sync()
    C.uncache(folder)
    C.prime_free_memory(prime_bytes)


def measure(fn: Callable[[], Any], probe: DetectionProbe) -> Dict[str, float]:
    """Wall and CPU seconds, bytes written and the detection probes' figures of one call of ``fn``."""
    probe.reset()
    out = C.Probe().start()
    fn()
    got = out.sample()
    return {"seconds": got["seconds"], "cpu_s": got["cpu_s"], "sys_s": got["sys_s"], "wchar": float(got["wchar"] or 0),
            **probe.sample()}


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as fh:
            return " ".join(fh.read().split()[:3])
    except OSError:
        return "n/a"


def _restore_seconds(prefix: str, names: List[str], out: List[np.ndarray]) -> Tuple[float, float]:
    """Seconds to restore every tensor into ``out`` (``restore_tensors``: the path ``Checkpoint.restore``
    takes) from a cold page cache (dropped first, where allowed), then again warm."""
    requests = [shardckpt.RestoreRequest(name, out=dest) for name, dest in zip(names, out)]
    times = []
    for cold in (True, False):
        if cold:
            C.drop_page_cache()
        t0 = time.perf_counter()
        shardckpt.restore_tensors(prefix, requests)
        times.append(time.perf_counter() - t0)
    return times[0], times[1]


def _restores(folder: str, names: List[str], state: List[np.ndarray], rounds: int) -> Dict[str, Any]:
    """The full and the incremental checkpoint restored in turns (which goes first alternates), ``rounds``
    times each, cold then warm; every restore checked. Per-round ratios and each one's data files."""
    out = [np.empty_like(a) for a in state]
    res: Dict[str, Any] = {k: [] for k in ("restore_full_s", "restore_full_warm_s", "restore_incremental_s",
                                           "restore_incremental_warm_s")}
    for n in range(rounds):
        for name, base in (("full", "full"), ("incremental", "inc"))[::1 if n % 2 == 0 else -1]:
            for a in out:
                a.fill(0)
            cold, warm = _restore_seconds(os.path.join(folder, base), names, out)
            assert all(np.array_equal(a, b) for a, b in zip(out, state)), f"the {name} checkpoint restored wrong"
            res[f"restore_{name}_s"].append(cold)
            res[f"restore_{name}_warm_s"].append(warm)
    for name, base in (("full", "full"), ("incremental", "inc")):
        res[f"{name}_files"] = sum(1 for e in os.listdir(folder) if e.startswith(base + ".data-"))
    return res


def _manager(folder: str, name: str, state: List[np.ndarray], incremental: bool,
             hand_out: bool = False) -> Tuple[Any, List[Any]]:
    """A manager of the state as Variables (copies) in ``folder/name``; ``hand_out``: take every ``.array``."""
    model = shardckpt.Module()
    model.v = [shardckpt.Variable(a) for a in state]  # copies
    if hand_out:
        for v in model.v:
            _ = v.array  # as code writing into the live buffer does: these variables are hashed
    manager = shardckpt.CheckpointManager(shardckpt.Checkpoint(model=model), os.path.join(folder, name),
                                          max_to_keep=2, incremental=incremental)
    return manager, list(model.v)


def _order(systems: Sequence[str], round_: int) -> List[str]:
    """The order of the systems in round ``round_``: rotated by one every second round and reversed in
    every other round (two systems: A B, B A, B A, A B, ...), so that each goes first, last and after
    each other about equally often."""
    k = (round_ // 2) % len(systems)
    order = list(systems[k:]) + list(systems[:k])
    return order[::-1] if round_ % 2 else order


def _change(state: List[np.ndarray], variables: Sequence[List[Any]], changed: Sequence[int], where: str) -> None:
    """Change the tensors ``changed`` of the state and of every manager's variables alike: every element
    (``where="all"``) or only the last one (``"tail"``: the first bytes stay the same)."""
    for i in changed:
        if where == "all":
            state[i] += 1.0
            delta: Any = np.float32(1.0)
        else:
            delta = np.zeros_like(state[i])
            delta.reshape(-1)[-1] = 1.0
            state[i] += delta
        for vs in variables:
            vs[i].assign_add(delta)


def run_fraction(work: str, fraction: float, state: List[np.ndarray], names: List[str], systems: Sequence[str],
                 probe: DetectionProbe, rounds: int = 7, restore_rounds: int = 3, where: str = "all",
                 prime_factor: float = 2.5) -> Dict[str, Any]:
    """``rounds`` rounds of changing ``fraction`` of the tensors and saving with every system in turns."""
    folder = tempfile.mkdtemp(prefix="inc-", dir=work)
    try:
        values = dict(zip(names, state))
        prime = int(C.spec_bytes([(n, a.shape) for n, a in zip(names, state)]) * prime_factor)
        managed = {name: _manager(folder, name, state, name != "vfull", hand_out=name == "hashed")
                   for name in ("vfull", "variables", "hashed") if name in systems}
        history: Dict[str, List[str]] = {}  # arrays systems (and DCP): their checkpoints, oldest first
        stale: List[str] = []

        def save_arrays(name: str, label: str) -> Callable[[], Any]:
            prefix = os.path.join(folder, f"{name}-{label}")
            kept = history.setdefault(name, [])
            keep = 1 if name == "incremental" else 0  # the previous of the next incremental save
            while len(kept) > keep:  # deleted before this save
                stale.append(kept.pop(0))
            previous = kept[-1] if kept else None
            kept.append(prefix)
            if name == "full":
                return lambda: shardckpt.save_tensors(prefix, values)
            if name == "incremental":
                return lambda: shardckpt.save_tensors(prefix, values, CheckpointOptions(incremental=True),
                                                      previous=previous)
            import torch
            import torch.distributed.checkpoint as dcp

            tstate = {n: torch.from_numpy(a) for n, a in values.items()}
            return lambda: dcp.save(tstate, checkpoint_id=prefix)

        def save_of(name: str, label: str) -> Callable[[], Any]:
            return managed[name][0].save if name in managed else save_arrays(name, label)

        for name in systems:  # setup: each system's first checkpoint (the previous of an incremental save)
            fn = save_of(name, "setup")
            settle(folder, stale, prime)
            fn()
        count = max(1, round(fraction * len(state)))
        step = len(state) / count
        changed = sorted({int(i * step) for i in range(count)})
        res: Dict[str, Any] = {"fraction": fraction, "changed_tensors": len(changed), "change": where,
                               "changed_bytes": sum(state[i].nbytes for i in changed), "rounds": []}
        scrub_before = _scrub_figures()
        for round_ in range(rounds):
            _change(state, [vs for _, vs in managed.values()], changed, where)
            got: Dict[str, Any] = {"order": _order(systems, round_)}
            for name in got["order"]:
                fn = save_of(name, str(round_))
                settle(folder, stale, prime)
                got[name] = measure(fn, probe)
            res["rounds"].append(got)
        scrub_after = _scrub_figures()  # scrubs still running go on: their figures count in the next fraction
        res.update({k: scrub_after[k] - scrub_before[k] for k in scrub_after})
        if "full" in history and "incremental" in history:  # the restores read <folder>/full and <folder>/inc
            _rename_checkpoint(history["full"][-1], os.path.join(folder, "full"))
            _rename_checkpoint(history["incremental"][-1], os.path.join(folder, "inc"))
            res.update(_restores(folder, names, state, restore_rounds))
        for name in ("variables", "hashed"):  # the managers' latest checkpoints hold the new state
            if name not in managed:
                continue
            latest = managed[name][0].latest_checkpoint
            with shardckpt.load_checkpoint(latest) as reader:
                keys = sorted(k for k in reader.get_variable_to_shape_map() if k.startswith("model/v/"))
                assert len(keys) == len(state), (name, len(keys))
                for i in changed[:3] + [j for j in (0, len(state) - 1) if j not in changed]:
                    got_value = reader.get_tensor(f"model/v/{i}/.ATTRIBUTES/VARIABLE_VALUE")
                    assert np.array_equal(got_value, state[i]), f"the {name} checkpoint holds wrong values ({i})"
        return res
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _quartiles(values: Sequence[float]) -> Tuple[float, float]:
    if len(values) < 2:
        return values[0], values[0]
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], q[2]


def median_interval(values: Sequence[float], level: float = 0.95) -> Tuple[float, float]:
    """A distribution-free confidence interval of the median of ``values`` (order statistics: the
    count of values below the true median is binomial(n, 1/2)); covers at least ``level``."""
    s = sorted(values)
    n = len(s)
    k = 0  # the interval is s[k], s[n - 1 - k]: the widest k whose two tails together stay within 1 - level
    while k + 1 < n - k - 1 and 2 * sum(math.comb(n, i) for i in range(k + 2)) / 2 ** n <= 1 - level:
        k += 1
    return s[k], s[n - 1 - k]


def summarize(res: Dict[str, Any], systems: Sequence[str]) -> List[Dict[str, Any]]:
    """Per system: medians (seconds, CPU, bytes, detection), the seconds' quartiles and range, and the
    median of its per-round ratios to its baseline (time, CPU, bytes) with their quartiles and range."""
    rows = []
    for s in systems:
        per = [r[s] for r in res["rounds"]]
        seconds = [p["seconds"] for p in per]
        row: Dict[str, Any] = {"fraction": res["fraction"], "system": s, "rounds": len(per),
                               "q1_seconds": _quartiles(seconds)[0], "q3_seconds": _quartiles(seconds)[1],
                               "min_seconds": min(seconds), "max_seconds": max(seconds)}
        for key in ("seconds", "cpu_s", "wchar", "arrange_s", "arrange_cpu_s", "arrange_hash_cpu_s",
                    "stream_hash_cpu_s"):
            row[key] = C.median([p[key] for p in per])
        base = BASELINE.get(s)
        if base in systems:
            ratios = [r[s]["seconds"] / r[base]["seconds"] for r in res["rounds"]]
            row.update({"baseline": base, "ratio": C.median(ratios), "ratio_ci95": median_interval(ratios),
                        "ratio_q1": _quartiles(ratios)[0],
                        "ratio_q3": _quartiles(ratios)[1], "ratio_min": min(ratios), "ratio_max": max(ratios),
                        "cpu_ratio": C.median([r[s]["cpu_s"] / r[base]["cpu_s"] for r in res["rounds"]]),
                        "bytes_ratio": C.median([r[s]["wchar"] / r[base]["wchar"] for r in res["rounds"]
                                                 if r[base]["wchar"]] or [0.0]),
                        # detection's own cost against the baseline's median time
                        "arrange_share": row["arrange_s"] / C.median([r[base]["seconds"] for r in res["rounds"]])})
        rows.append(row)
    return rows


def _print_fraction(res: Dict[str, Any], rows: List[Dict[str, Any]]) -> None:
    f = res["fraction"]
    change = "every element" if res["change"] == "all" else "last element only"
    print(f"\n{f:.0%} of the tensors changed ({res['changed_tensors']}, {change}), {rows[0]['rounds']} rounds")
    print(f"{'system':>12} {'median s':>9} {'q1-q3 s':>13} {'min-max s':>13} {'cpu s':>6} {'written':>10} "
          f"{'arrange ms':>10} {'(cpu)':>6} {'hash ms':>7} {'stream':>7}")
    for r in rows:
        print(f"{r['system']:>12} {r['seconds']:>9.3f} {r['q1_seconds']:>6.3f}-{r['q3_seconds']:<6.3f} "
              f"{r['min_seconds']:>6.3f}-{r['max_seconds']:<6.3f} {r['cpu_s']:>6.2f} {C.fmt_size(r['wchar']):>10} "
              f"{r['arrange_s'] * 1e3:>10.1f} {r['arrange_cpu_s'] * 1e3:>6.1f} {r['arrange_hash_cpu_s'] * 1e3:>7.1f} "
              f"{r['stream_hash_cpu_s'] * 1e3:>7.1f}")
    for r in rows:
        if "ratio" in r:
            lo, hi = r["ratio_ci95"]
            print(f"{r['system'] + ' / ' + r['baseline']:>24}: time {r['ratio']:.3f}x (95% interval of the median "
                  f"{lo:.3f}-{hi:.3f}, quartiles {r['ratio_q1']:.3f}-"
                  f"{r['ratio_q3']:.3f}, range {r['ratio_min']:.3f}-{r['ratio_max']:.3f}), cpu {r['cpu_ratio']:.3f}x, "
                  f"bytes {r['bytes_ratio']:.4f}x" + (f"; arrange step {r['arrange_share']:.2%} of the baseline's time"
                                                      if r["system"] in INCREMENTAL else ""))
    if "scrub_bytes" in res:
        saves = sum(1 for r in res["rounds"] for s in r if s in INCREMENTAL)
        print(f"{'background scrub':>24}: {C.fmt_size(res['scrub_bytes'])} of linked files read and CRC-checked "
              f"in {res['scrub_s']:.2f} s (its own thread, nice 19) over {saves} incremental saves")
    if "restore_full_s" in res:
        for kind, suffix in (("cold", ""), ("warm", "_warm")):
            full_s, inc_s = res[f"restore_full{suffix}_s"], res[f"restore_incremental{suffix}_s"]
            rf, ri = C.median(full_s), C.median(inc_s)
            ratio = C.median([b / a for a, b in zip(full_s, inc_s)])
            print(f"{'restore ' + kind:>24}: full {rf:.3f} s, incremental {ri:.3f} s ({ri / rf:.2f}x; median of "
                  f"per-round ratios {ratio:.2f}x); data files: full {res['full_files']}, "
                  f"incremental {res['incremental_files']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--tensors", type=int, default=256)
    ap.add_argument("--fractions", default="0.01,0.1,1.0")
    ap.add_argument("--rounds", type=int, default=7, help="rounds of saves, every system once per round")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help="which systems save (comma-separated)")
    ap.add_argument("--no-dcp", action="store_true", help="leave out the dcp system")
    ap.add_argument("--change", choices=("all", "tail"), default="all",
                    help="what changes in a changed tensor: every element, or only the last one")
    ap.add_argument("--restore-rounds", type=int, default=3,
                    help="after the rounds, the full and the incremental checkpoint are each restored this often")
    ap.add_argument("--prime", type=float, default=2.5,
                    help="before each save, this many times the state's bytes of memory are touched and freed")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder)")
    args = C.parse_args(ap, size="4MiB", tensors=16, fractions="0.25", rounds=1, restore_rounds=1)
    systems = [s for s in args.systems.split(",") if s and not (s == "dcp" and args.no_dcp)]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; known: {', '.join(SYSTEMS)}")
    nbytes = C.parse_size(args.size)
    spec = C.state_spec("uniform", nbytes, args.tensors)
    names = [n for n, _ in spec]
    fractions = [float(f) for f in args.fractions.split(",")]
    work = tempfile.mkdtemp(prefix="bench-incremental-", dir=args.dir)
    probe = DetectionProbe().install()
    load_before = _loadavg()
    runs: Dict[float, Dict[str, Any]] = {}
    rows: List[Dict[str, Any]] = []
    print(f"state: {C.fmt_size(C.spec_bytes(spec))} in {len(spec)} float32 tensors; {args.rounds} rounds; "
          f"load average {load_before} before")
    try:
        for f in fractions:
            runs[f] = run_fraction(work, f, C.make_state(spec), names, systems, probe, rounds=args.rounds,
                                   restore_rounds=args.restore_rounds, where=args.change,
                                   prime_factor=args.prime)
            fraction_rows = summarize(runs[f], systems)
            rows += fraction_rows
            _print_fraction(runs[f], fraction_rows)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load_after = _loadavg()
    print(f"load average {load_before} before, {load_after} after")
    path = C.results_path("incremental")
    with open(path, "w") as fh:
        json.dump({"size": C.spec_bytes(spec), "tensors": len(spec), "rounds": args.rounds, "change": args.change,
                   "systems": systems, "machine": platform.platform(), "cpus": os.cpu_count(), "rows": rows,
                   "loadavg_before": load_before, "loadavg_after": load_after,
                   "runs": {str(f): runs[f] for f in fractions}}, fh, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
