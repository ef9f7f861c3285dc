"""Benchmark ``shardckpt.jax`` against Orbax's ``StandardCheckpointer`` on the same pytree, 8 CPU devices.

The state: ``--size`` bytes of float32 in 16 arrays of ``(rows, 1024)`` on a (2, 4) mesh
(``XLA_FLAGS=--xla_force_host_platform_device_count=8``), alternating
``PartitionSpec("x", "y")`` and ``PartitionSpec("y", None)`` (the latter replicated twice: each
distinct piece is written once by both systems). Every measurement is a fresh worker
process; per system and repeat:

* ``save`` worker: builds the state, then times a save to a new path until it is committed
  (shardckpt: ``save`` returns committed, fsynced; Orbax: ``save`` + ``wait_until_finished``),
  then two async saves: the blocking part (shardckpt: ``CheckpointOptions(enable_async=True)``;
  Orbax: ``save``, async by default) and the time until committed. The first allocates
  shardckpt's staging buffers; the second reuses them, as every later save of a training
  loop does (both are reported).
* ``restore`` worker (state not in memory): restores the first checkpoint onto the saved
  shardings (``ShapeDtypeStruct`` targets), then deletes it and restores onto a (4, 2) mesh
  with transposed specs (resharded), then fully replicated on all 8 devices; each phase
  until ``block_until_ready``, with its peak extra resident memory (``VmHWM`` after
  ``clear_refs``, see ``common.Probe``). Values are checked after timing. The files are
  hot in the page cache for both systems.

Medians over ``--repeats``; each repeat starts with the next system in turn (the first to run
in a repeat is slower in every phase on these machines), so use a multiple of the number of
systems. Ratios are Orbax time / shardckpt time (> 1: shardckpt faster).

    .venv/bin/python benchmarks/bench_jax.py --size 256MiB --repeats 3
    .venv/bin/python benchmarks/bench_jax.py --size 64MiB --repeats 1     # a quick look
    .venv/bin/python benchmarks/bench_jax.py --smoke                      # smoke run (what the suite runs)

``--processes 2`` runs every worker as 2 processes of 4 CPU devices each over
``jax.distributed.initialize`` on loopback (the same global mesh); each phase counts
its slowest process (peak memory: the largest process's).

``--baseline-src DIR`` adds a third system, shardckpt run from another source tree
(e.g. ``git archive main src | tar -x -C /tmp/base``), interleaved with the other two:
before/after numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import common as C  # noqa: E402
from common import MIB, Probe, emit, fmt_size, median, parse_result, parse_size  # noqa: E402

COUNT = 16
COLS = 1024


def _state(size: int, reshard: bool = False, replicated: bool = False) -> Any:
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    rows = max(8, (size // (COUNT * COLS * 4)) // 8 * 8)
    if replicated:  # every device holds every array whole
        mesh = jax.make_mesh((8,), ("d",))
        specs = [P(), P()]
    elif reshard:
        mesh = jax.make_mesh((4, 2), ("a", "b"))
        specs = [P("b", "a"), P(None, "a")]
    else:
        mesh = jax.make_mesh((2, 4), ("x", "y"))
        specs = [P("x", "y"), P("y", None)]
    return {f"layer{i:02d}": {"w": jax.ShapeDtypeStruct((rows, COLS), np.float32,
                                                         sharding=NamedSharding(mesh, specs[i % 2]))}
            for i in range(COUNT)}


def _values(target: Any) -> Any:
    import jax
    import numpy as np

    def make(path: Any, s: Any) -> Any:
        seed = int(jax.tree_util.keystr(path).split("layer")[1][:2])
        value = np.random.default_rng(seed).standard_normal(s.shape, dtype=np.float32)
        return jax.make_array_from_callback(s.shape, s.sharding, lambda index: value[index])

    return jax.tree_util.tree_map_with_path(make, target)


def _check(restored: Any, target: Any) -> bool:
    import jax
    import numpy as np

    ok = True
    for (path, got), tgt in zip(jax.tree_util.tree_flatten_with_path(restored)[0], jax.tree.leaves(target)):
        seed = int(jax.tree_util.keystr(path).split("layer")[1][:2])
        value = np.random.default_rng(seed).standard_normal(tgt.shape, dtype=np.float32)
        ok = ok and got.sharding == tgt.sharding and all(np.array_equal(np.asarray(shard.data), value[shard.index])
                                                         for shard in got.addressable_shards)
    return ok


def worker(args: argparse.Namespace) -> None:
    import jax

    if args.processes > 1:  # the same 8 devices, 8 / processes per process, over JAX's distributed runtime
        jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes,
                                   process_id=args.rank, initialization_timeout=120)
    system, op, folder = args.system, args.op, Path(args.folder)
    out: Dict[str, Any] = {"system": system, "op": op, "devices": len(jax.devices()), "rank": args.rank}
    if system == "orbax":
        import orbax.checkpoint as ocp

        checkpointer = ocp.StandardCheckpointer()
    else:  # imported before any timing, as Orbax is (shardckpt or the baseline tree)
        import shardckpt
        import shardckpt.jax as sj
    if op == "save":
        state = _values(_state(args.size))
        jax.block_until_ready(state)
        # the first async save allocates its staging buffers; the second (timed as "async") reuses them,
        # as every later save of a training loop does
        for phase, path in (("save", folder / "a"), ("async_first", folder / "b"), ("async", folder / "c")):
            probe = Probe().start()
            if system != "orbax":
                opts = shardckpt.CheckpointOptions(enable_async=phase != "save")
                sj.save(str(path), state, options=opts)
                blocking = probe.sample()["seconds"]
                sj.wait_until_finished()
            else:
                checkpointer.save(path, state)
                blocking = probe.sample()["seconds"]
                checkpointer.wait_until_finished()
            sample = probe.sample()
            out[phase] = {"seconds": sample["seconds"], "blocking": blocking, "peak_extra": sample["peak_extra"]}
    else:
        for phase, reshard, replicated in (("restore", False, False), ("reshard", True, False),
                                           ("replicated", False, True)):
            target = _state(args.size, reshard, replicated)
            probe = Probe().start()
            if system != "orbax":
                restored = sj.restore(str(folder / "a"), target)
            else:
                restored = checkpointer.restore(folder / "a", target)
            jax.block_until_ready(restored)
            sample = probe.sample()
            out[phase] = {"seconds": sample["seconds"], "peak_extra": sample["peak_extra"],
                          "ok": _check(restored, target)}
            del restored
    if system == "orbax":
        checkpointer.close()
    emit(out)


def launch(system: str, op: str, size: int, folder: Path, src: str, processes: int = 1) -> Dict[str, Any]:
    """Run one worker (or ``processes`` of them); with several, each phase's slowest process counts."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // processes}"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([src, env.get("PYTHONPATH", "")])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = int(sock.getsockname()[1])
    cmds = [[sys.executable, __file__, "--worker", "--system", system, "--op", op, "--size", str(size),
             "--folder", str(folder), "--processes", str(processes), "--rank", str(rank), "--port", str(port)]
            for rank in range(processes)]
    procs = [subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for cmd in cmds]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1200)
            if proc.returncode != 0:
                raise RuntimeError(f"{system} {op} worker failed:\n{stdout[-3000:]}\n{stderr[-3000:]}")
            results.append(parse_result(stdout))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    merged = dict(results[0])
    for phase, value in merged.items():
        if isinstance(value, dict):
            merged[phase] = {k: (all(r[phase][k] for r in results) if isinstance(v, bool) else
                                 max(r[phase][k] or 0 for r in results)) for k, v in value.items()}
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="256MiB")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the medians as JSON")
    parser.add_argument("--baseline-src", default=None,
                        help="also run shardckpt from this source tree (its src/ folder or the tree holding it)")
    parser.add_argument("--processes", type=int, default=1, choices=(1, 2, 4, 8),
                        help="processes sharing the 8 CPU devices (jax.distributed on loopback)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--system", help=argparse.SUPPRESS)
    parser.add_argument("--op", help=argparse.SUPPRESS)
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    # smoke: 8 rows per array (the least the meshes divide)
    args = C.parse_args(parser, size="512KiB", repeats=1)
    args.size = parse_size(str(args.size))
    if args.worker:
        worker(args)
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench_jax_"))
    srcs = {"shardckpt": str(HERE.parent / "src"), "orbax": str(HERE.parent / "src")}
    if args.baseline_src:
        base_src = Path(args.baseline_src)
        srcs["baseline"] = str(base_src / "src" if (base_src / "src").is_dir() else base_src)
    runs: Dict[str, List[Dict[str, Any]]] = {name: [] for name in srcs}
    try:
        names = list(runs)
        for r in range(args.repeats):
            # interleaved, so that all see the same machine, and each repeat starts with the next system
            # (whichever runs first in a repeat is slower in every phase here)
            for system in names[r % len(names):] + names[:r % len(names)]:
                folder = base / f"{system}-{r}"
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir(parents=True)
                saved = launch(system, "save", args.size, folder, srcs[system], args.processes)
                restored = launch(system, "restore", args.size, folder, srcs[system], args.processes)
                if not all(restored[p]["ok"] for p in ("restore", "reshard", "replicated")):
                    raise RuntimeError(f"{system}: restored values differ")
                runs[system].append({**saved, **restored})
                shutil.rmtree(folder, ignore_errors=True)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    table: Dict[str, Dict[str, float]] = {}
    for system, results in runs.items():
        table[system] = {
            "save_s": median([x["save"]["seconds"] for x in results]),
            "async_blocking_s": median([x["async"]["blocking"] for x in results]),
            "async_first_blocking_s": median([x["async_first"]["blocking"] for x in results]),
            "async_total_s": median([x["async"]["seconds"] for x in results]),
            "restore_s": median([x["restore"]["seconds"] for x in results]),
            "reshard_s": median([x["reshard"]["seconds"] for x in results]),
            "replicated_s": median([x["replicated"]["seconds"] for x in results]),
            "restore_peak_extra": median([x["restore"]["peak_extra"] or 0 for x in results]),
            "reshard_peak_extra": median([x["reshard"]["peak_extra"] or 0 for x in results]),
        }
    ours, theirs = table["shardckpt"], table["orbax"]
    result = {"size": args.size, "repeats": args.repeats, "processes": args.processes, "table": table, "runs": runs}
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
        C.write_results("jax", result)
        return
    size = args.size
    base = table.get("baseline")
    where = "one process" if args.processes == 1 else f"{args.processes} processes"
    print(f"pytree of {fmt_size(size)} (16 float32 arrays), {where}, 8 CPU devices; "
          f"medians of {args.repeats}; ratio = Orbax / shardckpt")
    print(f"{'':28}{'shardckpt':>14}{'Orbax':>14}{'ratio':>8}" + (f"{'baseline':>14}" if base else ""))
    for label, key in (("save (committed)", "save_s"), ("async: blocking (first)", "async_first_blocking_s"),
                       ("async: blocking (later)", "async_blocking_s"),
                       ("async: until committed", "async_total_s"), ("restore", "restore_s"),
                       ("resharded restore", "reshard_s"), ("fully replicated restore", "replicated_s")):
        a, b = ours[key], theirs[key]
        print(f"{label:28}{a:>11.3f} s {b:>11.3f} s {b / a:>7.2f}x" + (f"{base[key]:>11.3f} s" if base else "")
              + f"   ({size / MIB / a:.0f} vs {size / MIB / b:.0f} MiB/s)")
    for label, key in (("restore peak extra RSS", "restore_peak_extra"),
                       ("reshard peak extra RSS", "reshard_peak_extra")):
        a, b = ours[key], theirs[key]
        print(f"{label:28}{fmt_size(a):>14}{fmt_size(b):>14}{(b / a if a else float('nan')):>7.2f}x"
              + (f"{fmt_size(base[key]):>14}" if base else ""))
    C.write_results("jax", result)


if __name__ == "__main__":
    main()
