"""``shardckpt verify`` / ``inspect`` of a tier folder (or of one node bundle in it).

A *tier folder* is a node's tier root (it holds ``node-<K>/`` folders), one ``node-<K>/``
folder, or a bundle prefix there with a ``.committed`` marker. A node bundle holds a partial
set of slices (the pieces one node's clients hold), so ``verify`` checks every stored
piece's CRC32C and size and the marker's file list, but not that slices tile their tensors;
bundles without a marker are listed as leftovers (not committed) and not read. ``inspect``
lists the steps, the bundles held for each node, committed or not, their sizes and tensor
counts (one bundle's prefix is inspected as any TF-format bundle). Exit status 0 only when
every committed bundle is whole.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from ..errors import ShardckptError
from ..format.bundle_reader import BundleReader
from ..storage.local import LocalFileSystem
from .tier import MARKER, NAME, load_marker

__all__ = ["tier_bundles", "tier_command"]

_INDEX = re.compile(r"^" + NAME + r"-(\d+)\.index$")
_ANY = re.compile(r"^" + NAME + r"-(\d+)(\.index|\.data-\d+-of-\d+|" + re.escape(MARKER) + r")$")


def tier_bundles(path: str) -> Optional[List[Tuple[str, int, str]]]:
    """``(owner, step, prefix)`` of every bundle (any file of it present) under the tier folder ``path``;
    ``None`` when ``path`` is not a tier folder."""
    path = os.path.abspath(path)
    if os.path.isfile(path + MARKER):  # one committed bundle
        owner = os.path.basename(os.path.dirname(path))
        m = re.fullmatch(NAME + r"-(\d+)", os.path.basename(path))
        if owner.startswith("node-") and m:
            return [(owner[len("node-"):], int(m.group(1)), path)]
        return None
    if not os.path.isdir(path):
        return None
    if os.path.basename(path).startswith("node-"):
        folders = [path]
    else:
        folders = [os.path.join(path, d) for d in sorted(os.listdir(path))
                   if d.startswith("node-") and os.path.isdir(os.path.join(path, d))]
    if not folders:
        return None
    out = []
    for folder in folders:
        steps = {int(m.group(1)) for m in map(_ANY.match, os.listdir(folder)) if m}
        out += [(os.path.basename(folder)[len("node-"):], s, os.path.join(folder, f"{NAME}-{s}")) for s in steps]
    return sorted(out, key=lambda b: (b[1], b[0]))


def _examine(prefix: str, verify: bool) -> Dict[str, Any]:
    marker, malformed = load_marker(prefix)
    out: Dict[str, Any] = {"prefix": prefix, "committed": marker is not None or malformed is not None, "problems": []}
    if malformed is not None:  # a marker that does not count: the bundle is not whole, and verify says so
        out["problems"].append(malformed)
    if marker is None:
        return out
    folder = os.path.dirname(prefix)
    out["nodes"] = marker.get("nodes")
    out["bytes"] = 0
    for name, size in marker["files"]:
        try:
            got = os.path.getsize(os.path.join(folder, str(name)))
        except OSError:
            out["problems"].append(f"MISSING {name}")
            continue
        out["bytes"] += got
        if got != int(size):
            out["problems"].append(f"{name}: {got} bytes, the marker says {size}")
    if out["problems"]:
        return out
    try:
        with BundleReader(prefix, fs=LocalFileSystem()) as reader:
            keys = sorted(reader.keys())
            out["tensors"] = len(keys)
            if verify:
                for key in keys:
                    try:
                        reader.verify(key)
                    except ShardckptError as exc:
                        out["problems"].append(f"BAD key {key.decode(errors='replace')!r}: {exc}")
    except ShardckptError as exc:
        out["problems"].append(f"cannot read the bundle: {exc}")
    return out


def tier_command(command: str, args: Any) -> Optional[int]:
    """Run ``verify`` or ``inspect`` on ``args.path`` when it is a tier folder; ``None`` when it is not."""
    path = os.fspath(args.path)
    if command == "inspect" and os.path.isfile(os.path.abspath(path) + MARKER):
        return None  # one bundle: a TF-format bundle, inspected as any other
    bundles = tier_bundles(path)
    if bundles is None:
        return None
    verify = command == "verify"
    report = [dict(_examine(prefix, verify), owner=owner, step=step) for owner, step, prefix in bundles]
    bad = [r for r in report if r["problems"]]
    if getattr(args, "json", False):
        print(json.dumps({"tier": os.path.abspath(args.path), "ok": not bad, "bundles": report}, indent=2))
        return 1 if bad else 0
    lines = []
    for r in report:
        state = "committed" if r["committed"] else "not committed (a leftover)"
        size = f", {r.get('bytes', '?')} bytes, {r.get('tensors', '?')} tensors" if r["committed"] else ""
        lines.append(f"step {r['step']} node {r['owner']}: {state}{size}  {r['prefix']}")
        lines += [f"  {p}" for p in r["problems"]]
    committed = [r for r in report if r["committed"]]
    if bad:
        lines.append(f"FAILED: {len(bad)} of {len(committed)} committed bundles bad")
    else:
        what = "verified" if verify else "committed"
        lines.append(f"OK: {len(committed)} bundles {what}, {sum(r['bytes'] for r in committed)} bytes "
                     f"in {os.path.abspath(args.path)}")
    print("\n".join(lines))
    return 1 if bad else 0
