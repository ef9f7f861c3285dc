"""Benchmark the tensor-bundle format: shardckpt's save_v2 / restore_v2 against TensorFlow's
SaveV2 / RestoreV2 and the raw disk, in one run, as ratios.

Run with the project's interpreter (see README.md)::

    .venv/bin/python benchmarks/bench_bundle.py                  # 1 GiB states, 5 repeats
    .venv/bin/python benchmarks/bench_bundle.py --size 64MiB --repeats 1   # a quick look
    .venv/bin/python benchmarks/bench_bundle.py --smoke                    # smoke run (what the suite runs)

Every measurement runs in its own fresh process (``--worker SYSTEM``, printing one
JSON line); systems are interleaved across repeats and medians reported. TensorFlow
workers run under $SHARDCKPT_TF_PYTHON (default ``<repo>/.venv-tf/bin/python``).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Dict, List, Optional, Tuple

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# system -> (interpreter "py" or "tf", setup worker writing the file it reads, or None).
SYSTEMS: Dict[str, Tuple[str, Optional[str]]] = {
    "raw_write": ("py", None),
    "raw_write_fsync": ("py", None),
    "raw_write_fsync_parallel": ("py", None),
    "raw_read": ("py", "setup_raw"),
    "shardckpt_save": ("py", None),
    "shardckpt_save_fsync": ("py", None),
    "shardckpt_write_fsync": ("py", None),
    "shardckpt_restore": ("py", "setup_shardckpt"),
    "shardckpt_restore_into": ("py", "setup_shardckpt"),
    "shardckpt_checkpoint_read": ("py", "setup_checkpoint"),
    "tf_save": ("tf", None),
    "tf_restore": ("tf", "setup_tf"),
}
COLD_SYSTEMS = ["raw_read", "shardckpt_restore", "shardckpt_restore_into", "tf_restore"]
ONE_SYSTEMS = {"one_read": "py", "one_get_tensor": "py", "tf_one_get_tensor": "tf"}

# (label, numerator figure, denominator figure): ratio of GB/s, > 1 means the numerator is faster.
RATIOS = [
    ("shardckpt save / TF SaveV2", "shardckpt_save", "tf_save"),
    ("shardckpt restore_v2 / TF RestoreV2+numpy", "shardckpt_restore", "tf_restore_numpy"),
    ("shardckpt restore_v2 / TF RestoreV2 (op only)", "shardckpt_restore", "tf_restore"),
    ("shardckpt restore into arrays / TF RestoreV2+numpy", "shardckpt_restore_into", "tf_restore_numpy"),
    ("shardckpt save / raw write", "shardckpt_save", "raw_write"),
    ("shardckpt save fsync / raw write fsync", "shardckpt_save_fsync", "raw_write_fsync"),
    ("Checkpoint.write fsync / raw write fsync", "shardckpt_write_fsync", "raw_write_fsync"),
    ("Checkpoint.write fsync / parallel raw write fsync", "shardckpt_write_fsync", "raw_write_fsync_parallel"),
    ("save_v2 fsync / parallel raw write fsync", "shardckpt_save_fsync", "raw_write_fsync_parallel"),
    ("shardckpt restore into arrays / raw readinto", "shardckpt_restore_into", "raw_read"),
    ("shardckpt restore_v2 / raw readinto", "shardckpt_restore", "raw_read"),
    ("Checkpoint.read / raw readinto", "shardckpt_checkpoint_read", "raw_read"),
    ("cold: shardckpt restore_v2 / TF RestoreV2+numpy", "shardckpt_restore_cold", "tf_restore_numpy_cold"),
    ("cold: shardckpt restore into arrays / raw readinto", "shardckpt_restore_into_cold", "raw_read_cold"),
]


# =====================================================================================
# Workers: each runs in a fresh process and prints one JSON line.
# =====================================================================================
class Ctx:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.spec = C.state_spec(args.state, args.size)
        self.names = [name for name, _ in self.spec]
        self.n = len(self.spec)
        self.prefix = os.path.join(args.dir, "ckpt")
        self.raw_path = self.prefix + ".raw"
        self.nbytes = C.spec_bytes(self.spec)
        self.cold_ok: Optional[bool] = None
        self.primed = 0

    def before_timing(self, arrays: List[np.ndarray], allocates: float) -> None:
        """Settle the disk (and drop the page cache for cold figures), prime free memory for
        what the phase allocates (``allocates`` states' worth, plus the page cache of a cold
        read), then touch the arrays."""
        if self.args.cold:
            self.cold_ok = C.drop_page_cache()
            allocates += 1
        else:
            os.sync()
        self.primed = int(allocates * self.nbytes) + (64 << 20) if self.args.prime else 0
        C.prime_free_memory(self.primed)
        C.warm(arrays)

    def timed_save(self, figure: str, arrays: List[np.ndarray], save: Callable[[str], object],
                   read_back: Callable[[str], List[np.ndarray]]) -> Dict:
        """Rehearse ``save`` once in full (untimed) and delete what it wrote, then time it; after
        timing, ``read_back(prefix)`` reads what it wrote, checked value for value (``ok``).

        The timed save is the second of a long-lived process, as in training, where
        checkpoints are saved periodically: first-call costs are paid and the page
        cache recycles the pages of a deleted checkpoint (as with ``max_to_keep``).
        """
        if self.args.rehearse:
            scratch = os.path.join(self.args.dir, "rehearsal")
            os.makedirs(scratch)
            save(os.path.join(scratch, "ckpt"))
            shutil.rmtree(scratch)
        self.before_timing(arrays, 1)
        p = C.Probe().start()
        save(self.prefix)
        fig = p.sample()
        return {figure: dict(fig, ok=C.verify(self.spec, read_back(self.prefix)))}

    def warmup_dir(self) -> str:
        path = os.path.join(self.args.dir, "warmup")
        os.makedirs(path, exist_ok=True)
        return os.path.join(path, "ckpt")


def _write_raw(path: str, arrays: List[np.ndarray], fsync: bool) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for a in arrays:
            buf = C.byte_view(a)
            done = 0
            while done < len(buf):
                done += os.write(fd, buf[done:])
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)


def _file_groups(arrays: List[np.ndarray], files: int) -> List[List[int]]:
    """Indices of ``arrays`` in ``files`` groups of about equal bytes (largest tensors first)."""
    groups: List[List[int]] = [[] for _ in range(files)]
    sizes = [0] * files
    for i in sorted(range(len(arrays)), key=lambda i: -arrays[i].nbytes):
        g = sizes.index(min(sizes))
        groups[g].append(i)
        sizes[g] += arrays[i].nbytes
    return groups


def _write_raw_parallel(path: str, arrays: List[np.ndarray], files: int) -> None:
    """The same bytes as ``files`` files of about equal bytes (largest tensors first), written and
    fsynced by one thread each, then the folder fsynced: the parallel raw baseline of a durable save."""
    groups = [[arrays[i] for i in g] for g in _file_groups(arrays, files)]
    with ThreadPoolExecutor(max_workers=files) as pool:
        list(pool.map(lambda ig: _write_raw(f"{path}-{ig[0]}", ig[1], True), enumerate(groups)))
    fd = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_raw(path: str, arrays: List[np.ndarray]) -> None:
    with open(path, "rb", buffering=0) as f:
        for a in arrays:
            buf = C.byte_view(a)
            done = 0
            while done < len(buf):
                n = f.readinto(buf[done:])
                if not n:
                    raise EOFError(path)
                done += n


def _read_raw_back(ctx: Ctx, path: str) -> List[np.ndarray]:
    dest = C.alloc(ctx.spec)
    _read_raw(path, dest)
    return dest


def _read_raw_parallel_back(ctx: Ctx, path: str) -> List[np.ndarray]:
    dest = C.alloc(ctx.spec)
    for f, group in enumerate(_file_groups(dest, ctx.args.raw_files)):
        _read_raw(f"{path}-{f}", [dest[i] for i in group])
    return dest


def w_raw_write(ctx: Ctx, fsync: bool = False) -> Dict:
    arrays = C.make_state(ctx.spec)
    return ctx.timed_save("raw_write_fsync" if fsync else "raw_write", arrays,
                          lambda prefix: _write_raw(prefix + ".raw", arrays, fsync),
                          lambda prefix: _read_raw_back(ctx, prefix + ".raw"))


def w_raw_write_parallel(ctx: Ctx) -> Dict:
    arrays = C.make_state(ctx.spec)
    return ctx.timed_save("raw_write_fsync_parallel", arrays,
                          lambda prefix: _write_raw_parallel(prefix + ".raw", arrays, ctx.args.raw_files),
                          lambda prefix: _read_raw_parallel_back(ctx, prefix + ".raw"))


def w_raw_read(ctx: Ctx) -> Dict:
    dest = C.alloc(ctx.spec)
    ctx.before_timing(dest, 0)
    p = C.Probe().start()
    _read_raw(ctx.raw_path, dest)
    return {"raw_read": dict(p.sample(), ok=C.verify(ctx.spec, dest))}


def _sc_warmup(ctx: Ctx) -> None:
    from shardckpt.io import restore_v2, save_v2
    prefix = ctx.warmup_dir()
    save_v2(prefix, ["w"], [""], [np.arange(1 << 20, dtype=np.float32)])
    restore_v2(prefix, ["w"], [""], [np.float32])


def _restore_v2_back(ctx: Ctx, prefix: str, names: Optional[List[str]] = None) -> List[np.ndarray]:
    from shardckpt.io import restore_v2
    return restore_v2(prefix, names or ctx.names, [""] * ctx.n, [np.float32] * ctx.n)


def w_shardckpt_save(ctx: Ctx, fsync: bool = False) -> Dict:
    from shardckpt.io import save_v2
    arrays = C.make_state(ctx.spec)
    return ctx.timed_save("shardckpt_save_fsync" if fsync else "shardckpt_save", arrays,
                          lambda prefix: save_v2(prefix, ctx.names, [""] * ctx.n, arrays, fsync=fsync),
                          lambda prefix: _restore_v2_back(ctx, prefix))


def w_shardckpt_write(ctx: Ctx) -> Dict:
    """``Checkpoint.write`` of a ``Module`` of ``Variable``s holding the state (fsync: always)."""
    import shardckpt
    arrays = C.make_state(ctx.spec)
    model = shardckpt.Module()
    model.tensors = [shardckpt.Variable(a) for a in arrays]
    ckpt = shardckpt.Checkpoint(model=model)
    keys = [f"model/tensors/{i}/.ATTRIBUTES/VARIABLE_VALUE" for i in range(ctx.n)]
    return ctx.timed_save("shardckpt_write_fsync", arrays, lambda prefix: ckpt.write(prefix),
                          lambda prefix: _restore_v2_back(ctx, prefix, keys))


def w_shardckpt_restore(ctx: Ctx) -> Dict:
    from shardckpt.io import restore_v2
    _sc_warmup(ctx)
    ctx.before_timing([], 1)
    p = C.Probe().start()
    out = restore_v2(ctx.prefix, ctx.names, [""] * ctx.n, [np.float32] * ctx.n)
    s = p.sample()
    return {"shardckpt_restore": dict(s, output_bytes=C.spec_bytes(ctx.spec), ok=C.verify(ctx.spec, out))}


def w_shardckpt_restore_into(ctx: Ctx) -> Dict:
    """``restore_tensors`` into existing arrays: the engine's restore (checksums verified)."""
    from shardckpt import RestoreRequest, restore_tensors
    _sc_warmup(ctx)
    dest = C.alloc(ctx.spec)
    ctx.before_timing(dest, 0)
    p = C.Probe().start()
    restore_tensors(ctx.prefix, [RestoreRequest(name, out=a) for name, a in zip(ctx.names, dest)])
    return {"shardckpt_restore_into": dict(p.sample(), ok=C.verify(ctx.spec, dest))}


def _module_of(arrays: List[np.ndarray]) -> Any:
    """A ``Module`` of ``Variable``s holding ``arrays`` (the object graph ``Checkpoint.write`` saves)."""
    import shardckpt
    model = shardckpt.Module()
    model.tensors = [shardckpt.Variable(a) for a in arrays]
    return model


def w_shardckpt_checkpoint_read(ctx: Ctx) -> Dict:
    """``Checkpoint.read`` of what ``Checkpoint.write`` wrote, into the variables of a live object graph
    (matched, checked, then read in place): the per-variable cost above the bytes."""
    import shardckpt
    dest = C.alloc(ctx.spec)
    model = _module_of(dest)
    ckpt = shardckpt.Checkpoint(model=model)
    _sc_warmup(ctx)
    ctx.before_timing(dest, 0)
    p = C.Probe().start()
    ckpt.read(ctx.prefix).assert_consumed()
    fig = p.sample()
    values = [v.numpy() for v in model.tensors]
    return {"shardckpt_checkpoint_read": dict(fig, ok=C.verify(ctx.spec, values))}


def _tf():
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    return tf


def _tf_warmup(ctx: Ctx) -> None:
    tf = _tf()
    prefix = ctx.warmup_dir()
    tf.raw_ops.SaveV2(prefix=prefix, tensor_names=["w"], shape_and_slices=[""],
                      tensors=[tf.constant(np.arange(1 << 20, dtype=np.float32))])
    tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=["w"], shape_and_slices=[""], dtypes=[tf.float32])


def w_tf_save(ctx: Ctx) -> Dict:
    tf = _tf()
    tensors = [tf.constant(a) for a in C.make_state(ctx.spec)]  # the state, in TF's memory
    views = [np.asarray(memoryview(t)) for t in tensors]  # to warm them (numpy() would copy)
    return ctx.timed_save("tf_save", views, lambda prefix: tf.raw_ops.SaveV2(
        prefix=prefix, tensor_names=ctx.names, shape_and_slices=[""] * ctx.n, tensors=tensors),
        lambda prefix: [t.numpy() for t in tf.raw_ops.RestoreV2(
            prefix=prefix, tensor_names=ctx.names, shape_and_slices=[""] * ctx.n, dtypes=[tf.float32] * ctx.n)])


def w_tf_restore(ctx: Ctx) -> Dict:
    tf = _tf()
    _tf_warmup(ctx)
    ctx.before_timing([], 2)
    p = C.Probe().start()
    tensors = tf.raw_ops.RestoreV2(prefix=ctx.prefix, tensor_names=ctx.names, shape_and_slices=[""] * ctx.n,
                                   dtypes=[tf.float32] * ctx.n)
    op_only = p.sample()
    arrays = [t.numpy() for t in tensors]
    with_numpy = p.sample()
    ok = C.verify(ctx.spec, arrays)
    out = C.spec_bytes(ctx.spec)
    shares = bool(np.shares_memory(arrays[0], np.asarray(memoryview(tensors[0]))))  # does numpy() copy?
    return {"tf_restore": dict(op_only, output_bytes=out, ok=ok),
            "tf_restore_numpy": dict(with_numpy, output_bytes=out, ok=ok,
                                     numpy_shares_memory=shares)}


def w_setup(ctx: Ctx, how: str) -> Dict:
    """Untimed: write the file a read benchmark reads, and make it clean in the page cache."""
    arrays = C.make_state(ctx.spec)
    if how == "setup_raw":
        _write_raw(ctx.raw_path, arrays, fsync=False)
    elif how == "setup_shardckpt":
        from shardckpt.io import save_v2
        save_v2(ctx.prefix, ctx.names, [""] * ctx.n, arrays)
    elif how == "setup_checkpoint":
        import shardckpt
        shardckpt.Checkpoint(model=_module_of(arrays)).write(ctx.prefix)
    else:
        tf = _tf()
        tf.raw_ops.SaveV2(prefix=ctx.prefix, tensor_names=ctx.names, shape_and_slices=[""] * ctx.n,
                          tensors=[tf.constant(a) for a in arrays])
    os.sync()
    return {}


def w_one(ctx: Ctx, system: str) -> Dict:
    """Read one tensor (the middle one) of a large checkpoint; count the bytes read."""
    i = ctx.n // 2
    key = ctx.names[i]
    if system == "tf_one_get_tensor":
        tf = _tf()
        _tf_warmup(ctx)
        open_fn: Callable = tf.train.load_checkpoint
    else:
        from shardckpt import load_checkpoint
        from shardckpt.format.bundle_reader import BundleReader
        from shardckpt.storage.registry import get_fs
        _sc_warmup(ctx)
        open_fn = (lambda p: BundleReader(p, fs=get_fs(p))) if system == "one_read" else load_checkpoint
    ctx.before_timing([], 2 / ctx.n)
    p = C.Probe().start()
    reader = open_fn(ctx.prefix)
    opened = p.sample()
    value = reader.read(key) if system == "one_read" else reader.get_tensor(key)
    s = p.sample()
    data_file = ctx.prefix + ".data-00000-of-00001"
    return {system: dict(s, open_s=opened["seconds"], open_rchar=opened["rchar"],
                         tensor_bytes=int(value.nbytes), file_bytes=os.path.getsize(data_file),
                         index_bytes=os.path.getsize(ctx.prefix + ".index"),
                         ok=C.verify(ctx.spec, [value], indices=[i]))}


WORKERS: Dict[str, Callable[[Ctx], Dict]] = {
    "raw_write": w_raw_write,
    "raw_write_fsync": lambda ctx: w_raw_write(ctx, fsync=True),
    "raw_write_fsync_parallel": w_raw_write_parallel,
    "raw_read": w_raw_read,
    "shardckpt_save": w_shardckpt_save,
    "shardckpt_save_fsync": lambda ctx: w_shardckpt_save(ctx, fsync=True),
    "shardckpt_write_fsync": w_shardckpt_write,
    "shardckpt_restore": w_shardckpt_restore,
    "shardckpt_restore_into": w_shardckpt_restore_into,
    "shardckpt_checkpoint_read": w_shardckpt_checkpoint_read,
    "tf_save": w_tf_save,
    "tf_restore": w_tf_restore,
    **{s: (lambda ctx, s=s: w_setup(ctx, s)) for s in ("setup_raw", "setup_shardckpt", "setup_checkpoint", "setup_tf")},
    **{s: (lambda ctx, s=s: w_one(ctx, s)) for s in ONE_SYSTEMS},
}


def run_worker(args: argparse.Namespace) -> None:
    ctx = Ctx(args)
    figures = WORKERS[args.worker](ctx)
    if args.cold:
        figures = {f"{name}_cold": dict(fig, cold_ok=ctx.cold_ok) for name, fig in figures.items()}
    versions = {m: getattr(sys.modules[m], "__version__", "?") + " " + sys.modules[m].__file__
                for m in ("shardckpt", "tensorflow") if m in sys.modules}
    C.emit({"system": args.worker, "state": args.state, "state_bytes": ctx.nbytes, "tensors": ctx.n,
            "cold": args.cold, "primed": ctx.primed, "python": sys.executable, "versions": versions,
            "figures": figures})


# =====================================================================================
# Driver
# =====================================================================================
class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.tf = C.tf_python(args.tf_python, REPO, required=args.smoke)
        self.work = os.path.join(args.dir, f"run-{os.getpid()}")
        self.runs: List[Dict] = []
        self.failures: List[Dict] = []

    def clean(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)
        os.makedirs(self.work)

    def spawn(self, system: str, interp: str, state: str, size: int, cold: bool = False) -> Dict:
        python = self.tf if interp == "tf" else sys.executable
        cmd = [python, os.path.abspath(__file__), "--worker", system, "--state", state, "--size", str(size),
               "--dir", self.work, "--cold" if cold else "--no-cold", "--prime" if self.args.prime else "--no-prime",
               "--rehearse" if self.args.rehearse else "--no-rehearse", "--raw-files", str(self.args.raw_files)]
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
        if interp == "tf":
            env.pop("PYTHONPATH", None)  # the TF side sees only this folder (the script's own)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=self.args.timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"worker {system} ({state}) failed with {proc.returncode}:\n{proc.stderr[-4000:]}")
        return C.parse_result(proc.stdout)

    def attempt(self, label: str, *spawn_args) -> Optional[Dict]:
        """``spawn`` that records a failure and carries on with the run."""
        try:
            return self.spawn(*spawn_args)
        except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
            log(f"  {label}: FAILED\n{exc}")
            self.failures.append({"label": label, "error": str(exc)})
            return None

    def measure(self, system: str, state: str, size: int, cold: bool, rep: int) -> None:
        interp, setup = SYSTEMS[system]
        label = f"[{rep + 1}] {state} {system}{'_cold' if cold else ''}"
        self.clean()
        result = None
        if not setup or self.attempt(label + " (setup)", setup, interp, state, size) is not None:
            result = self.attempt(label, system, interp, state, size, cold)
        self.clean()
        if result is None:
            return
        result["repeat"] = rep
        self.runs.append(result)
        for name, fig in result["figures"].items():
            log(f"  [{rep + 1}] {state:<11} {name:<28} {fig['seconds']:8.3f} s "
                f"{result['state_bytes'] / fig['seconds'] / 1e9:7.2f} GB/s" + _wrong(fig))

    def run(self) -> Dict:
        a = self.args
        systems = [s for s in a.systems if self.tf or SYSTEMS[s][0] != "tf"]
        if not self.tf:
            log("TensorFlow interpreter not found (set SHARDCKPT_TF_PYTHON): skipping TF systems")
        cold = a.cold and C.can_drop_caches()
        self.cold_note = "on" if cold else "off (--no-cold)" if not a.cold else "unavailable (drop_caches not writable)"
        if a.cold and not cold:
            log("cannot write /proc/sys/vm/drop_caches: reporting page-cache (warm) figures only")
        plan = [(s, False) for s in systems] + [(s, True) for s in systems if cold and s in COLD_SYSTEMS]
        try:
            for rep in range(a.repeats):
                for state in a.states:
                    for system, is_cold in plan:
                        self.measure(system, state, a.size, is_cold, rep)
            one = self.one_tensor(cold) if a.one_tensor else []
        finally:
            shutil.rmtree(self.work, ignore_errors=True)
        return {"meta": self.meta(), "runs": self.runs, "one_tensor_runs": one, "failures": self.failures}

    def one_tensor(self, cold: bool) -> List[Dict]:
        a = self.args
        size = a.one_tensor_size
        systems = [s for s, interp in ONE_SYSTEMS.items() if self.tf or interp != "tf"]
        log(f"one tensor of a {C.fmt_size(size)} checkpoint (64 tensors)")
        self.clean()
        runs: List[Dict] = []
        if self.attempt("one-tensor setup", "setup_shardckpt", "py", "uniform", size) is None:
            return runs
        for rep in range(a.repeats):
            for is_cold in ([False, True] if cold else [False]):
                for system in systems:
                    r = self.attempt(f"[{rep + 1}] {system}", system, ONE_SYSTEMS[system], "uniform", size, is_cold)
                    if r is None:
                        continue
                    r["repeat"] = rep
                    runs.append(r)
                    for name, fig in r["figures"].items():
                        log(f"  [{rep + 1}] {name:<28} {fig['seconds'] * 1e3:8.1f} ms  read "
                            f"{C.fmt_size(fig['rchar'] or 0)}" + _wrong(fig))
        self.clean()
        return runs

    def meta(self) -> Dict:
        def git(*cmd: str) -> str:
            try:
                return subprocess.run(["git", "-C", REPO, *cmd], capture_output=True, text=True).stdout.strip()
            except OSError:
                return ""
        a = self.args
        return {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "size": a.size, "repeats": a.repeats,
                "states": a.states, "dir": a.dir, "cold_figures": self.cold_note, "prime": a.prime,
                "rehearse": a.rehearse, "python": sys.executable,
                "tf_python": self.tf, "numpy": np.__version__, "git": git("rev-parse", "HEAD"),
                "git_dirty": bool(git("status", "--porcelain", "--", "src")), "cpus": os.cpu_count(),
                "platform": platform.platform(), "mem_total": _mem_total()}


def _mem_total() -> int:
    with open("/proc/meminfo") as f:
        return int(f.readline().split()[1]) * 1024


def _wrong(fig: Dict) -> str:
    return "" if fig.get("ok", True) else "  WRONG VALUES"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# -- summary --------------------------------------------------------------------------
def summarize(runs: List[Dict]) -> Dict[str, Dict[str, Dict]]:
    """state -> figure -> medians (seconds, GB/s, peak extra, rchar, wchar, cpu) over repeats."""
    groups: Dict[Tuple[str, str], List[Tuple[int, Dict]]] = {}
    for r in runs:
        for name, fig in r["figures"].items():
            groups.setdefault((r["state"], name), []).append((r["state_bytes"], fig))
    out: Dict[str, Dict[str, Dict]] = {}
    for (state, name), items in groups.items():
        nbytes = items[0][0]
        figs = [f for _, f in items]

        def med(key: str) -> Optional[float]:
            vals = [f[key] for f in figs if f.get(key) is not None]  # noqa: B023 - called at once
            return C.median(vals) if vals else None
        s = med("seconds")
        extra = med("peak_extra")
        overhead = None if extra is None else extra - figs[0].get("output_bytes", 0)
        out.setdefault(state, {})[name] = {
            "n": len(figs), "seconds": s, "gbps": nbytes / s / 1e9, "state_bytes": nbytes,
            "peak_extra": extra, "overhead_frac": None if overhead is None else overhead / nbytes,
            "rchar": med("rchar"), "wchar": med("wchar"), "cpu_s": med("cpu_s"), "sys_s": med("sys_s"),
            "all_ok": all(f.get("ok", True) for f in figs),
            **({k: C.median([f[k] for f in figs]) for k in ("open_s", "tensor_bytes", "file_bytes", "index_bytes")
                if all(k in f for f in figs)}),
        }
    return out


def ratios(summary: Dict[str, Dict[str, Dict]]) -> Dict[str, Dict[str, Optional[float]]]:
    out: Dict[str, Dict[str, Optional[float]]] = {}
    for label, num, den in RATIOS:
        row = {}
        for state, figs in summary.items():
            row[state] = figs[den]["seconds"] / figs[num]["seconds"] if num in figs and den in figs else None
        if any(v is not None for v in row.values()):
            out[label] = row
    return out


def print_report(summary: Dict, ratio_table: Dict, one: Dict, meta: Dict) -> None:
    states = list(summary)
    print(f"\nshardckpt tensor-bundle benchmark  (medians of {meta['repeats']}; GB = 1e9 bytes; "
          f"peak+ = peak extra RSS beyond the state and any returned arrays, % of state)")
    print("figures named *_cold read after dropping the page cache; the others read from the page cache"
          if meta["cold_figures"] == "on" else f"page-cache figures only: cold figures {meta['cold_figures']}")
    for state in states:
        figs = summary[state]
        nbytes = next(iter(figs.values()))["state_bytes"]
        print(f"\n{state}: {C.fmt_size(nbytes)} ({nbytes / 1e9:.3f} GB)")
        print(f"  {'figure':<28}{'seconds':>9}{'GB/s':>8}{'peak+ %':>9}{'read MB':>9}{'write MB':>9}"
              f"{'cpu s':>7}{'sys s':>7}")
        for name in sorted(figs, key=_order):
            f = figs[name]
            pk = "" if f["overhead_frac"] is None else f"{100 * f['overhead_frac']:.1f}"
            rd = "" if f["rchar"] is None else f"{f['rchar'] / 1e6:.0f}"
            wr = "" if f["wchar"] is None else f"{f['wchar'] / 1e6:.0f}"
            bad = "" if f["all_ok"] else "  WRONG VALUES"
            print(f"  {name:<28}{f['seconds']:9.3f}{f['gbps']:8.2f}{pk:>9}{rd:>9}{wr:>9}"
                  f"{f['cpu_s']:7.2f}{f['sys_s']:7.2f}{bad}")
    if ratio_table:
        print("\nratios of GB/s (> 1: shardckpt faster)")
        print(f"  {'':<52}" + "".join(f"{s:>13}" for s in states))
        for label, row in ratio_table.items():
            print(f"  {label:<52}" + "".join(f"{'' if row.get(s) is None else format(row[s], '.2f'):>13}"
                                             for s in states))
    print("\npeak extra memory of shardckpt, % of the state (target < 10%)")
    for state in states:
        for name in sorted(summary[state], key=_order):
            f = summary[state][name]
            if name.startswith("shardckpt") and f["overhead_frac"] is not None:
                pct = 100 * f["overhead_frac"]
                print(f"  {state:<12}{name:<30}{pct:6.1f}%  {'ok' if pct < 10 else 'OVER TARGET'}")
    if one:
        print("\none tensor of a large checkpoint (uniform, 64 tensors)")
        print(f"  {'figure':<28}{'total ms':>9}{'open ms':>9}{'read MB':>9}{'tensor MB':>10}{'file MB':>9}")
        for name in sorted(one, key=_order):
            f = one[name]
            bad = "" if f["all_ok"] else "  WRONG VALUES"
            print(f"  {name:<28}{f['seconds'] * 1e3:9.1f}{f['open_s'] * 1e3:9.1f}{(f['rchar'] or 0) / 1e6:9.1f}"
                  f"{f['tensor_bytes'] / 1e6:10.1f}{f['file_bytes'] / 1e6:9.0f}{bad}")


def _order(name: str) -> Tuple[int, str]:
    base = name[:-5] if name.endswith("_cold") else name
    keys = list(SYSTEMS) + ["tf_restore_numpy"] + list(ONE_SYSTEMS)
    return (keys.index(base) if base in keys else len(keys), name)


# -- command line -------------------------------------------------------------------------
def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=C.parse_size, default=C.GIB, help="bytes per state (default 1GiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--states", type=lambda s: s.split(","), default=["uniform", "transformer"])
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS),
                    help="comma list of: " + ", ".join(SYSTEMS))
    ap.add_argument("--dir", default=os.path.join("/tmp", "shardckpt-bench"),
                    help="scratch folder for checkpoints (same disk as real ones)")
    ap.add_argument("--cold", action=argparse.BooleanOptionalAction, default=True,
                    help="also measure reads after dropping the page cache (needs root)")
    ap.add_argument("--prime", action=argparse.BooleanOptionalAction, default=True,
                    help="touch and free the memory a phase allocates right before it (see README)")
    ap.add_argument("--rehearse", action=argparse.BooleanOptionalAction, default=True,
                    help="each save worker saves once in full (untimed, deleted) before the timed save")
    ap.add_argument("--raw-files", type=int, default=2,
                    help="files written in parallel by raw_write_fsync_parallel (default 2)")
    ap.add_argument("--one-tensor", action=argparse.BooleanOptionalAction, default=True,
                    help="read one tensor of a large checkpoint and count the bytes read")
    ap.add_argument("--one-tensor-size", type=C.parse_size, default=2 * C.GIB)
    ap.add_argument("--tf-python", help="TensorFlow interpreter (default $SHARDCKPT_TF_PYTHON or .venv-tf)")
    ap.add_argument("--name", default="bundle", help="results file name stem")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per worker process")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--state", default="uniform", help=argparse.SUPPRESS)
    # smoke: uniform state only (the transformer's differs in shapes, not in phases), no cold figures
    # (dropping the page cache of a machine the suite shares)
    args = C.parse_args(ap, argv, size="2MiB", repeats=1, states="uniform", cold=False, one_tensor_size="2MiB",
                        timeout=300)

    if args.worker:
        run_worker(args)
        return
    unknown = [s for s in args.systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}")
    driver = Driver(args)
    result = driver.run()
    summary = summarize(result["runs"])
    one = summarize(result["one_tensor_runs"]).get("uniform", {})
    result.update(summary=summary, ratios=ratios(summary), one_tensor=one)
    path = C.results_path(args.name)
    with open(path, "w") as f:
        json.dump(result, f, indent=1, sort_keys=True)
    print_report(summary, result["ratios"], one, result["meta"])
    if result["failures"]:
        print(f"\n{len(result['failures'])} measurement(s) FAILED; see 'failures' in the results file")
    print(f"\nresults: {path}")
    C.finish(wrong=[f"[{r['repeat'] + 1}] {r['state']} {name}" for r in result["runs"] + result["one_tensor_runs"]
                    for name, fig in r["figures"].items() if not fig.get("ok", True)],
             failed=[f["label"] for f in result["failures"]])


if __name__ == "__main__":
    main()
