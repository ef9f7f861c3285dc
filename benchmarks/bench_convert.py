"""Benchmark ``shardckpt convert``: throughput against a raw copy of the same bytes, peak memory,
beside the same conversions done with TensorFlow / PyTorch and the ``safetensors`` library.

Run with the project's interpreter (see README.md)::

    .venv/bin/python benchmarks/bench_convert.py                          # 1 GiB, 3 repeats
    .venv/bin/python benchmarks/bench_convert.py --size 256MiB --repeats 1  # a quick look
    .venv/bin/python benchmarks/bench_convert.py --smoke                    # smoke run (what the suite runs)

The source is the 485-tensor ``transformer`` state of ``common.py`` (float32), saved as a
TF checkpoint twice: ``plain`` (one data file) and ``sliced`` (``MaxShardSizePolicy`` of
size/16, so the large tensors are stored as slices that the converter assembles), and
once as a PyTorch DCP folder. Systems, each in its own fresh process (``--worker``):

* ``raw_copy``: read the data file(s) and write the same bytes to one new file, fsynced
  (the ceiling for a conversion that reads and writes every byte once);
* ``sc_safetensors`` / ``sc_hf``: ``shardckpt.convert`` TF -> one .safetensors / an HF
  folder with shards of size/4;
* ``tf_safetensors``: ``tf.train.load_checkpoint`` + ``get_tensor`` of every key +
  ``safetensors.numpy.save_file`` (in the TensorFlow side environment);
* ``sc_dcp_safetensors``: ``shardckpt.convert`` DCP -> .safetensors;
* ``torch_dcp_safetensors``: ``dcp_to_torch_save`` + ``torch.load`` +
  ``safetensors.torch.save_file``;
* ``sc_safetensors_tf``: the reverse direction, .safetensors -> TF checkpoint through
  ``save_tensors`` (which reads each value twice: validation, then the write).

Reported per system: median seconds, GB/s, throughput relative to ``raw_copy`` and peak
extra resident memory (``common.Probe``). The issue's memory figure (2 GiB with a
256 MiB largest tensor) is ``--size 2GiB --largest 256MiB``: the state then gets one
extra tensor of that size, and the peak is compared with twice it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from typing import Dict, List, Optional

import common as C
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

SYSTEMS = {  # name -> (interpreter, source kind)
    "raw_copy": ("py", "tf"),
    "sc_safetensors": ("py", "tf"),
    "sc_hf": ("py", "tf"),
    "tf_safetensors": ("tf", "tf"),
    "sc_dcp_safetensors": ("py", "dcp"),
    "torch_dcp_safetensors": ("py", "dcp"),
    "sc_safetensors_tf": ("py", "st"),
}


def spec_of(args: argparse.Namespace) -> C.Spec:
    spec = C.state_spec("transformer", args.size - (args.largest or 0))
    if args.largest:
        spec.append(("largest/kernel", (args.largest // 4 // 1024, 1024)))
    return spec


def paths(args: argparse.Namespace, layout: str) -> Dict[str, str]:
    base = os.path.join(args.dir, layout)
    return {"tf": os.path.join(base, "tf", "ckpt"), "dcp": os.path.join(base, "dcp"),
            "st": os.path.join(base, "src.safetensors"), "out": os.path.join(base, "out")}


# -- setup (once per layout) ------------------------------------------------------------
def setup(args: argparse.Namespace, layout: str) -> None:
    import shardckpt

    spec = spec_of(args)
    p = paths(args, layout)
    shutil.rmtree(os.path.dirname(p["tf"]), ignore_errors=True)

    def lazy(i: int, shape):  # type: ignore[no-untyped-def]
        return lambda: C.fill_tensor(i, np.empty(shape, dtype=C.DTYPE))

    tensors = [shardckpt.ShardableTensor(name, lazy(i, shape), shardckpt.as_dtype("float32"), shape)
               for i, (name, shape) in enumerate(spec)]
    policy = shardckpt.MaxShardSizePolicy(max(1 << 20, args.size // 16)) if layout == "sliced" else None
    shardckpt.save_tensors(p["tf"], tensors, shardckpt.CheckpointOptions(sharding_callback=policy), max_workers=1)
    if layout == "plain":
        from shardckpt.convert import convert

        convert(p["tf"], p["st"])
        import torch
        import torch.distributed.checkpoint as dcp

        shutil.rmtree(p["dcp"], ignore_errors=True)
        state = {name: torch.from_numpy(C.fill_tensor(i, np.empty(shape, dtype=C.DTYPE)))
                 for i, (name, shape) in enumerate(spec)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(p["dcp"]), no_dist=True)


# -- workers ------------------------------------------------------------------------------
def data_files(prefix: str) -> List[str]:
    d = os.path.dirname(prefix)
    return sorted(os.path.join(d, f) for f in os.listdir(d) if ".data-" in f)


def w_raw_copy(p: Dict[str, str], args: argparse.Namespace) -> None:
    out = os.path.join(p["out"], "raw.bin")
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with open(out, "wb", buffering=0) as dst:
        for path in data_files(p["tf"]):
            with open(path, "rb", buffering=0) as src:
                while True:
                    n = src.readinto(buf)
                    if not n:
                        break
                    dst.write(view[:n])
        os.fsync(dst.fileno())


def w_sc(p: Dict[str, str], args: argparse.Namespace, fmt: str, source: str = "tf") -> None:
    from shardckpt.convert import convert

    dst = os.path.join(p["out"], "m.safetensors" if fmt == "safetensors" else "hf")
    convert(p[source], dst, dst_format=fmt, max_shard_size=max(1 << 20, args.size // 4) if fmt == "hf" else None,
            trust_pickle=True)


def w_tf_safetensors(p: Dict[str, str], args: argparse.Namespace) -> None:
    import tensorflow as tf
    from safetensors.numpy import save_file

    reader = tf.train.load_checkpoint(p["tf"])
    keys = [k for k in reader.get_variable_to_shape_map() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    tensors = {k: reader.get_tensor(k) for k in keys}
    out = os.path.join(p["out"], "tf.safetensors")
    save_file(tensors, out)
    with open(out, "rb+") as f:
        os.fsync(f.fileno())


def w_torch_dcp_safetensors(p: Dict[str, str], args: argparse.Namespace) -> None:
    import torch
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    pt = os.path.join(p["out"], "tmp.pt")
    dcp_to_torch_save(p["dcp"], pt)
    state = torch.load(pt, weights_only=True)
    out = os.path.join(p["out"], "torch.safetensors")
    save_file(state, out)
    with open(out, "rb+") as f:
        os.fsync(f.fileno())


def _same_files(written: str, sources: List[str]) -> bool:
    """Whether ``written`` holds the bytes of ``sources``, one after the other."""
    with open(written, "rb") as out:
        for path in sources:
            with open(path, "rb") as src:
                while True:
                    chunk = src.read(16 << 20)
                    if not chunk:
                        break
                    if out.read(len(chunk)) != chunk:
                        return False
        return not out.read(1)


def _output_tensors(system: str, p: Dict[str, str]) -> Dict[str, np.ndarray]:
    """The tensors a conversion wrote, by name (safetensors files, an HF folder or a TF checkpoint)."""
    if system == "sc_safetensors_tf":
        import shardckpt

        prefix = os.path.join(p["out"], "tf", "ckpt")
        with shardckpt.load_checkpoint(prefix) as reader:
            return {k: reader.get_tensor(k) for k in reader.get_variable_to_shape_map()}
    from safetensors.numpy import load_file

    out: Dict[str, np.ndarray] = {}
    for root, _, files in os.walk(p["out"]):
        for name in sorted(files):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(root, name)))
    return out


def check_output(system: str, p: Dict[str, str], spec: C.Spec) -> bool:
    """Whether the conversion wrote every tensor of the state with exactly its values (after timing)."""
    if system == "raw_copy":
        return _same_files(os.path.join(p["out"], "raw.bin"), data_files(p["tf"]))
    got = _output_tensors(system, p)
    if sorted(got) != sorted(name for name, _ in spec):
        return False
    return all(C.verify(spec, [got[name]], indices=[i]) for i, (name, _) in enumerate(spec))


def run_worker(args: argparse.Namespace) -> None:
    p = paths(args, args.layout)
    shutil.rmtree(p["out"], ignore_errors=True)
    os.makedirs(p["out"])
    system = args.worker
    import safetensors.numpy  # noqa: F401  (imports outside the timed phase; the check reads with it)
    if system == "tf_safetensors":
        import tensorflow  # noqa: F401
    elif system != "raw_copy":
        if SYSTEMS[system][1] == "dcp":  # the other conversions import no torch
            import torch  # noqa: F401
            import torch.distributed.checkpoint  # noqa: F401
            from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: F401

        import shardckpt.convert  # noqa: F401
    os.sync()  # no earlier step's write-back competes with this one's
    probe = C.Probe().start()
    if system == "raw_copy":
        w_raw_copy(p, args)
    elif system == "sc_safetensors":
        w_sc(p, args, "safetensors")
    elif system == "sc_hf":
        w_sc(p, args, "hf")
    elif system == "tf_safetensors":
        w_tf_safetensors(p, args)
    elif system == "sc_dcp_safetensors":
        w_sc(p, args, "safetensors", "dcp")
    elif system == "torch_dcp_safetensors":
        w_torch_dcp_safetensors(p, args)
    elif system == "sc_safetensors_tf":
        from shardckpt.convert import convert

        convert(p["st"], os.path.join(p["out"], "tf", "ckpt"), dst_format="tf")
    fig = probe.sample()
    written = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p["out"]) for f in fs)
    ok = check_output(system, p, spec_of(args))
    shutil.rmtree(p["out"], ignore_errors=True)
    C.emit({"system": system, "layout": args.layout, "bytes": C.spec_bytes(spec_of(args)), "written": written,
            "ok": ok, **fig})


# -- driver -------------------------------------------------------------------------------
def spawn(args: argparse.Namespace, interp: str, extra: List[str]) -> Dict:
    cmd = [interp, os.path.abspath(__file__), "--size", str(args.size), "--largest", str(args.largest or 0),
           "--dir", args.dir, *extra]
    env = dict(os.environ)
    if interp != sys.executable:  # the TF env has no shardckpt: it sees only this folder
        env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr[-2000:])
    return C.parse_result(proc.stdout) if "--setup" not in extra else {}


def main(argv: Optional[List[str]] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=C.parse_size, default=C.GIB)
    ap.add_argument("--largest", type=C.parse_size, default=0, help="add one tensor of this size (memory figure)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layouts", type=lambda s: s.split(","), default=["plain", "sliced"])
    ap.add_argument("--systems", type=lambda s: s.split(","), default=list(SYSTEMS))
    ap.add_argument("--dir", default=os.path.join("/tmp", "shardckpt-bench-convert"))
    ap.add_argument("--tf-python")
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--setup", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--layout", default="plain", help=argparse.SUPPRESS)
    # smoke: a 2 MiB tensor beside a 2 MiB transformer, so that the sliced layout (shards of 1 MiB) slices it
    args = C.parse_args(ap, argv, size="4MiB", largest="2MiB", repeats=1, timeout=300)
    if args.setup:
        setup(args, args.layout)
        return
    if args.worker:
        run_worker(args)
        return
    tf = C.tf_python(args.tf_python, REPO, required=args.smoke)
    runs: List[Dict] = []
    failures: List[Dict] = []
    for layout in args.layouts:
        spawn(args, sys.executable, ["--setup", "--layout", layout])
        for _ in range(args.repeats):
            for system in args.systems:
                interp, source = SYSTEMS[system]
                if source in ("dcp", "st") and layout != "plain":
                    continue
                exe = tf if interp == "tf" else sys.executable
                if exe is None:
                    failures.append({"system": system, "error": "no TensorFlow interpreter"})
                    continue
                try:
                    runs.append(spawn(args, exe, ["--worker", system, "--layout", layout]))
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    failures.append({"system": system, "layout": layout, "error": str(exc)[-500:]})
    summary: Dict[str, Dict] = {}
    for layout in args.layouts:
        for system in args.systems:
            mine = [r for r in runs if r["system"] == system and r["layout"] == layout]
            if mine:
                secs = C.median([r["seconds"] for r in mine])
                peak = C.median([r["peak_extra"] or 0 for r in mine])
                summary[f"{layout}/{system}"] = {"seconds": secs, "gb_s": mine[0]["bytes"] / secs / 1e9,
                                                  "peak_extra": peak, "runs": len(mine),
                                                  "values_ok": all(r["ok"] for r in mine)}
    for key, s in summary.items():
        raw = summary.get(key.split("/")[0] + "/raw_copy") or summary.get("plain/raw_copy")
        s["vs_raw_copy"] = raw["seconds"] / s["seconds"] if raw else None
    spec = spec_of(args)
    largest = max(int(np.prod(shape)) for _, shape in spec) * 4
    print(f"state: {len(spec)} tensors, {C.fmt_size(C.spec_bytes(spec))}, largest {C.fmt_size(largest)}")
    print(f"{'layout/system':34} {'seconds':>8} {'GB/s':>6} {'vs raw':>7} {'peak extra':>11} {'/largest':>8}")
    for key, s in summary.items():
        vs = "-" if s["vs_raw_copy"] is None else f"{s['vs_raw_copy']:.2f}"
        print(f"{key:34} {s['seconds']:8.2f} {s['gb_s']:6.2f} {vs:>7} {C.fmt_size(s['peak_extra']):>11} "
              f"{s['peak_extra'] / largest:8.2f}" + ("" if s["values_ok"] else "  WRONG VALUES"))
    for f in failures:
        print("FAILED", f)
    for layout in args.layouts:
        shutil.rmtree(os.path.join(args.dir, layout), ignore_errors=True)
    C.write_results("convert", {"summary": summary, "runs": runs, "failures": failures, "largest": largest,
                                "tensors": len(spec)}, sort_keys=True)
    C.finish(wrong=[f"{r['layout']}/{r['system']}" for r in runs if not r["ok"]],
             failed=[f"{f.get('layout', '')}/{f['system']}: {f['error'][-300:]}" for f in failures])


if __name__ == "__main__":
    main()
