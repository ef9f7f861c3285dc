"""``shardckpt demo``: the whole story of a multi-client checkpoint, on one machine.

1. Four client processes hold a small model sharded over a 2x4 device mesh (two
   devices each) and train it, checkpointing collectively every few steps.
2. They stop. Two new clients, on a 1-D mesh of four devices with other layouts,
   resume from the latest checkpoint (each reading only its own pieces), check
   the values, train on, and checkpoint again.
3. The final checkpoint is inspected and verified; its values are compared with a
   replay of the training on full arrays.

Clients are coordinated by the standard library alone (no torch or MPI needed). The
first mesh has 8 devices and the second 4, so ``--clients`` is one of 1, 2, 4, 8 and
``--resume-clients`` one of 1, 2, 4. Without ``--dir`` the demo works in a new temporary
folder, removes it when every check passed, and keeps it (saying where) when one failed.
``--dir`` may be on an object store (``s3://bucket/demo``): the checkpoints and the
clients' reports are written there, through the store, as into a local folder.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from typing import Any, Dict, List

import numpy as np

from ..checkpoint.reader import load_checkpoint
from ..checkpoint.state import latest_checkpoint
from ._layout import data_files, locate, open_bundle
from ._text import description_of
from .demo_clients import WEIGHTS, expected, launch
from .inspect import list_tensors, render_listing
from .verify import render_report, verify_bundle

__all__ = ["add_parser", "run", "run_story"]

KEY = "model/{}/.ATTRIBUTES/VARIABLE_VALUE"
FIRST_CLIENTS = (1, 2, 4, 8)  #: client counts that share the first mesh's 8 devices evenly
RESUME_CLIENTS = (1, 2, 4)  #: client counts that share the second mesh's 4 devices evenly


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    parser = subparsers.add_parser("demo", help="train a sharded model on several local clients, checkpoint, "
                                                "resume on another mesh, verify",
                                   description=description_of(__doc__))
    parser.add_argument("--dir", metavar="D", help="directory to write into (default: a new temporary directory)")
    parser.add_argument("--clients", type=int, default=4, choices=FIRST_CLIENTS,
                        help="clients of the first run, sharing its 8 devices (default 4)")
    parser.add_argument("--resume-clients", type=int, default=2, choices=RESUME_CLIENTS,
                        help="clients of the resumed run, sharing its 4 devices (default 2)")
    parser.set_defaults(func=run)


def _print_events(reports: List[Dict[str, Any]]) -> None:
    by_path: Dict[str, List[Dict[str, Any]]] = {}
    for report in reports:
        for event in report["events"]:
            by_path.setdefault(f"{event['event']} {event['path']}", []).append(event)
    for label, events in by_path.items():
        slowest = max(e["seconds"] for e in events)
        print(f"  {label:<16} step {events[0]['step']:>3}   {1000 * slowest:7.1f} ms (slowest client)")


def run_story(directory: str, clients: int = 4, resume_clients: int = 2) -> bool:
    """Run the story in ``directory`` (local or on an object store); return whether every check passed."""
    fs = locate(directory).fs
    ckpt_dir = fs.join(directory, "train")
    reports_dir = fs.join(directory, "reports")
    fs.makedirs(reports_dir)
    total = sum(int(np.prod(shape)) * 4 for shape, _, _ in WEIGHTS.values())
    first = {"name": "first", "mesh": [("x", 2), ("y", 4)], "which": 0, "resume": False, "steps": 12, "every": 4,
             "directory": ckpt_dir}
    second = {"name": "second", "mesh": [("a", 4)], "which": 1, "resume": True, "steps": 6, "every": 3,
              "directory": ckpt_dir}
    print(f"shardckpt demo in {directory}")
    print(f"model: {len(WEIGHTS)} weight matrices, {total / 1e6:.1f} MB of float32")
    for name, (shape, a, b) in WEIGHTS.items():
        print(f"  {name:<14} {str(list(shape)):<12} layout {a} on mesh x=2,y=4; {b} on mesh a=4")
    started = time.perf_counter()
    print(f"\n1. {clients} clients, mesh x=2 x y=4 ({8 // clients} devices each): train 12 steps, checkpoint every 4")
    _print_events(launch(clients, first, reports_dir))
    print(f"   stopped; latest checkpoint: {fs.basename(latest_checkpoint(ckpt_dir) or '-')}")
    print(f"\n2. {resume_clients} clients, mesh a=4 ({4 // resume_clients} devices each), other layouts: "
          "resume, train 6 more steps, checkpoint every 3")
    _print_events(launch(resume_clients, second, reports_dir))
    final = latest_checkpoint(ckpt_dir)
    print(f"\n3. verify {fs.basename(final or '-')}")
    ok = final is not None
    if final is not None:
        location = locate(final)
        with open_bundle(location) as reader:
            rows = list_tensors(reader)
            print(render_listing(reader.prefix, data_files(reader, location.fs, rows), rows))
            report = verify_bundle(reader, fs=location.fs)
        print(render_report(report))
        ok = report.ok
        with load_checkpoint(final) as reader:
            step = int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"))
            for name in WEIGHTS:
                same = np.array_equal(reader.get_tensor(KEY.format(name.replace("/", "_"))), expected(name, step))
                ok = ok and same
                print(f"  {name:<14} equals {step} replayed training steps: {'yes' if same else 'NO'}")
    print(f"\n{'all checks passed' if ok else 'CHECKS FAILED'} in {time.perf_counter() - started:.1f} s")
    return ok


def run(args: argparse.Namespace) -> int:
    """Run ``demo``; returns the exit status."""
    if args.dir is not None:
        return 0 if run_story(args.dir, args.clients, args.resume_clients) else 1
    directory = tempfile.mkdtemp(prefix="shardckpt-demo-")
    ok = False
    try:
        ok = run_story(directory, args.clients, args.resume_clients)
    finally:
        if ok:
            shutil.rmtree(directory, ignore_errors=True)
            print(f"removed {directory} (use --dir to keep the checkpoints)")
        else:
            print(f"the checkpoints and client reports are left in {directory}")
    return 0 if ok else 1
