"""``shardckpt inspect PATH [--key K] [--json] [--limit N]``: what a checkpoint holds.

Without ``--key``: a header (prefix, shard count, tensor count, total bytes, data
files with their sizes) and one row per tensor: key, dtype, shape, stored bytes
and where the bytes live (``shard 0 @ 128`` or ``2 slices in shards {0,1}``,
followed by one line per slice). With ``--key``: that tensor's layout, summary
statistics and values (summarised beyond ``--limit`` elements).

``--tree`` shows the key hierarchy (names split at ``/``) with the tensor count and
bytes under each level; it also reads safetensors files, Hugging Face folders and
``.npz`` archives (names split at ``.`` when none has a ``/``).

A checkpoint written by an incremental save also shows, per data file, whether it
was written by that save or linked / copied from the previous checkpoint (and from
which file), and the bytes actually written.

``--map FILE.svg`` (or ``FILE.html``) draws where every stored slice of the largest tensors
lies, coloured by data file, holes and overlaps in red (:mod:`shardckpt.cli.shard_map`);
``--keys REGEX`` chooses the tensors drawn.

``--json`` prints the same information as one JSON document. Values are included
when the tensor has at most ``--limit`` elements; strings as base64 plus UTF-8
(``null`` where not UTF-8), flattened row-major.

Listing a TF checkpoint describes every entry from the index (no tensor bytes are
read) and asks the store for each data file's size; a data file that is missing, or
shorter than the index's entries in it need (cut short), is named on stderr and the exit
status is 1, as for a bad entry, with the listing, tree or map still printed. ``PATH`` (and
the ``--map`` output) may be local or on an object store (``s3://...``). On a terminal a
progress bar counts the tensors described (on stderr, erased before the listing is
printed), which matters for checkpoints of many thousands of keys or on object stores;
off a terminal and with ``--json`` nothing else is printed.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

import numpy as np

from ..convert.api import open_source
from ..convert.detect import source_format
from ..errors import NotFoundError, ShardckptError
from ..format.bundle_reader import BundleReader
from ..format.ordered_code import is_slice_key
from ..saving.incremental import data_file_origins
from . import shard_map
from ._layout import DataFile, TensorLayout, data_files, file_problems, locate, open_bundle, tensor_layout
from ._text import bare_message, description_of, error_text, human_size, key_text, render_table, shape_text
from ._values import format_stats, format_values, json_number, numeric_stats, string_stats, strings_json, values_json
from .progress import Advance, progress_bar
from .tree import build_tree, render_tree, tree_json

__all__ = ["add_parser", "run", "BadTensor", "list_tensors", "render_listing", "listing_json",
           "TensorDetail", "load_tensor", "render_tensor", "tensor_json"]

DEFAULT_LIMIT = 1000


@dataclass(frozen=True)
class BadTensor:
    """A key whose index entry could not be described."""

    key: bytes
    error: ShardckptError

    @property
    def name(self) -> str:
        return key_text(self.key)


Row = Union[TensorLayout, BadTensor]


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``inspect`` subcommand."""
    parser = subparsers.add_parser(
        "inspect", help="list a checkpoint's tensors, or show one tensor's values",
        description=description_of(__doc__))
    parser.add_argument("path", metavar="PATH", help="checkpoint prefix, checkpoint directory or SavedModel directory "
                        "(with --tree also .safetensors, a Hugging Face folder or .npz)")
    parser.add_argument("--key", metavar="K", help="show this tensor's values and statistics")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--tree", action="store_true", help="show the key hierarchy (split at '/') with sizes")
    parser.add_argument("--limit", metavar="N", type=_non_negative, default=DEFAULT_LIMIT,
                        help=f"show all values of tensors with at most N elements (default {DEFAULT_LIMIT})")
    parser.add_argument("--map", metavar="FILE", help="draw the shard map of the tensors into FILE (.svg or .html)")
    parser.add_argument("--keys", metavar="REGEX", help=f"with --map: draw the tensors whose name matches REGEX "
                        f"(default: the {shard_map.DEFAULT_TENSORS} largest)")
    parser.set_defaults(func=run)


def _non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def run(args: argparse.Namespace) -> int:
    """Run ``inspect``; returns the exit status."""
    from ..tiers.report import tier_command  # a tier folder (issue 28): its node bundles

    tiered = tier_command("inspect", args)
    if tiered is not None:
        return tiered
    location = locate(args.path)
    if getattr(args, "tree", False) and source_format(location.prefix) != "tf":
        with open_source(location.prefix) as source:  # safetensors, HF folders, npz: the tree of their names
            infos = source.tensors()
        sep = "/" if any("/" in i.name for i in infos) else "."
        root = build_tree([(i.name, i.dtype.name, i.shape, i.nbytes) for i in infos], sep)
        print(json.dumps(tree_json(root), indent=2) if args.json else render_tree(root, sep))
        return 0
    with open_bundle(location) as reader:
        if args.key is not None:
            detail = load_tensor(reader, args.key)
            print(json.dumps(tensor_json(detail, args.limit), indent=2) if args.json
                  else render_tensor(detail, args.limit))
            return 0
        with progress_bar("inspect", None, enabled=not args.json, unit="items") as advance:
            rows = list_tensors(reader, advance)
        files = data_files(reader, location.fs, rows)
        if getattr(args, "tree", False):
            root = build_tree([(r.name, r.dtype.name, tuple(r.shape), r.nbytes) for r in rows
                               if isinstance(r, TensorLayout)])
            print(json.dumps(tree_json(root), indent=2) if args.json else render_tree(root))
        elif getattr(args, "map", None):
            chosen = shard_map.choose_tensors([r for r in rows if isinstance(r, TensorLayout)], args.keys)
            counts = shard_map.write_map(args.map, reader.prefix, chosen, files, fs=locate(args.map).fs)
            print(f"shard map of {counts['tensors']} tensors ({counts['pieces']} pieces) written to {args.map}"
                  + (f"; {counts['with_problems']} with holes or overlaps" if counts["with_problems"] else ""))
        else:
            origins = data_file_origins(reader.prefix, location.fs)
            print(json.dumps(listing_json(reader.prefix, files, rows, origins), indent=2) if args.json
                  else render_listing(reader.prefix, files, rows, origins))
        return _trouble(rows, files, listed=not (getattr(args, "tree", False) or getattr(args, "map", None)))


def _trouble(rows: List[Row], files: List[DataFile], listed: bool) -> int:
    """The exit status of a listing, a tree or a map: 1 when an entry is bad or a data file is missing
    or cut short. Each such file is named on stderr, and so is each bad entry where no listing named it."""
    problems = file_problems(files)
    bad = [r for r in rows if isinstance(r, BadTensor)]
    for problem in problems + ([] if listed else [r.error for r in bad]):
        print(f"error: {error_text(problem)}", file=sys.stderr)
    return 1 if problems or bad else 0


# -- the listing ---------------------------------------------------------------------------------

def _no_progress(name: str, count: int) -> None:
    return None


def list_tensors(reader: BundleReader, progress: Advance = _no_progress) -> List[Row]:
    """The layout of every tensor (plain keys, sorted); bad entries become :class:`BadTensor`.

    ``progress(key, 1)`` is called after each tensor is described (and ``progress.set_total(n)``,
    where it has one, once before the first).
    """
    rows: List[Row] = []
    keys = sorted(reader.keys())
    set_total = getattr(progress, "set_total", None)
    if set_total is not None:
        set_total(len(keys))
    for key in keys:
        try:
            rows.append(tensor_layout(reader, key))
        except ShardckptError as exc:
            rows.append(BadTensor(key, exc))
        progress(rows[-1].name, 1)
    return rows


def _total_bytes(rows: List[Row]) -> int:
    return sum(r.nbytes for r in rows if isinstance(r, TensorLayout))


Origins = Optional[Dict[int, Dict[str, Any]]]


def _origin_text(origin: Dict[str, Any]) -> str:
    how = origin["how"]
    if how == "written":
        return "written"
    verb = {"link": "linked", "reflink": "reflinked", "copy": "copied", "server-copy": "copied server-side"}
    return f"{verb.get(how, how)} from {origin['reused_from']}"


def _written_bytes(files: List[DataFile], origins: Dict[int, Dict[str, Any]]) -> int:
    return sum(f.size or 0 for f in files if origins.get(f.shard, {"how": "written"})["how"] == "written")


def render_listing(prefix: str, files: List[DataFile], rows: List[Row], origins: Origins = None) -> str:
    """The text listing: header lines, the table, then any entry errors."""
    total = _total_bytes(rows)
    lines = [f"checkpoint: {prefix}",
             f"shards: {len(files)}  tensors: {len(rows)}  total: {total} bytes ({human_size(total)})"]
    if origins is not None:
        written = _written_bytes(files, origins)
        shared = sum(1 for o in origins.values() if o["how"] != "written")
        lines.append(f"incremental: {shared} of {len(files)} data files shared with the previous checkpoint; "
                     f"{written} bytes ({human_size(written)}) written")
    lines.append("data files:")
    for f in files:
        size = "MISSING" if f.size is None else f"{f.size} bytes ({human_size(f.size)})"
        if f.size is not None and f.problem() is not None:
            size += f"  CUT SHORT (entries up to byte {f.needed})"
        origin = "" if origins is None else "  " + _origin_text(origins.get(f.shard, {"how": "written"}))
        lines.append(f"  {f.name}  {size}{origin}")
    table: List[List[str]] = []
    for row in rows:
        if isinstance(row, BadTensor):
            table.append([row.name, "?", "?", "?", "?", "ERROR (see below)"])
            continue
        table.append([row.name, row.dtype.name, shape_text(row.shape), str(row.nbytes),
                      human_size(row.nbytes), row.location()])
        if row.sliced:
            for piece in row.pieces:
                table.append([f"  slice {piece.spec}", "", "", str(piece.size), human_size(piece.size),
                              f"shard {piece.shard} @ {piece.offset}"])
    lines.append("")
    lines.append(render_table(["KEY", "DTYPE", "SHAPE", "BYTES", "SIZE", "LOCATION"], table, right=[3, 4]))
    bad = [r for r in rows if isinstance(r, BadTensor)]
    if bad:
        lines.append("")
        lines.extend(f"error: {error_text(r.error)}" for r in bad)
    return "\n".join(lines)


def _layout_json(layout: TensorLayout) -> Dict[str, Any]:
    out: Dict[str, Any] = {"key": layout.name, "dtype": layout.dtype.name, "shape": list(layout.shape),
                           "bytes": layout.nbytes, "location": layout.location(), "sliced": layout.sliced,
                           "pieces": [{"spec": p.spec, "shard": p.shard, "offset": p.offset, "size": p.size,
                                       "file": p.file} for p in layout.pieces]}
    return out


def listing_json(prefix: str, files: List[DataFile], rows: List[Row], origins: Origins = None) -> Dict[str, Any]:
    """The listing as a JSON-ready dict."""
    tensors = []
    for row in rows:
        if isinstance(row, BadTensor):
            tensors.append({"key": row.name, "error": error_text(row.error)})
        else:
            tensors.append(_layout_json(row))
    out: Dict[str, Any] = {
        "checkpoint": prefix, "num_shards": len(files), "num_tensors": len(rows), "total_bytes": _total_bytes(rows),
        "data_files": [{"shard": f.shard, "path": f.path, "size": f.size, "exists": f.size is not None}
                       for f in files],
        "data_file_problems": [{"path": problem.path, "problem": bare_message(problem)}
                               for problem in file_problems(files)],
        "tensors": tensors}
    if origins is not None:
        for f, described in zip(files, out["data_files"]):
            described.update(origins.get(f.shard, {"how": "written", "reused_from": None}))
        out["bytes_written"] = _written_bytes(files, origins)
    return out


# -- one tensor ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorDetail:
    """One tensor's layout, values and statistics."""

    layout: TensorLayout
    values: np.ndarray
    stats: Dict[str, Any]


def _find_key(reader: BundleReader, name: str) -> bytes:
    key = name.encode("utf-8", "surrogateescape")
    if key in reader and not is_slice_key(key):
        return key
    names = [key_text(k) for k in reader.keys()]
    close = difflib.get_close_matches(name, names, n=3)
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
    raise NotFoundError(f"no such tensor in this checkpoint ({len(names)} tensors){hint}",
                        path=reader.prefix, key=name)


def load_tensor(reader: BundleReader, name: str) -> TensorDetail:
    """Read tensor ``name`` whole (checksums verified) and compute its statistics."""
    key = _find_key(reader, name)
    layout = tensor_layout(reader, key)
    values = reader.read(key)
    stats = string_stats(values) if values.dtype == object else numeric_stats(values)
    return TensorDetail(layout, values, stats)


def render_tensor(detail: TensorDetail, limit: int) -> str:
    """Text for ``inspect --key``: layout, statistics, values."""
    layout = detail.layout
    lines = [f"key:      {layout.name}",
             f"dtype:    {layout.dtype.name}",
             f"shape:    {shape_text(layout.shape)}",
             f"bytes:    {layout.nbytes} ({human_size(layout.nbytes)})",
             f"location: {layout.location()}"]
    if layout.sliced:
        rows = [[str(p.spec), f"shard {p.shard} @ {p.offset}", str(p.size), human_size(p.size)]
                for p in layout.pieces]
        table = render_table(["SLICE", "LOCATION", "BYTES", "SIZE"], rows, right=[2, 3])
        lines.extend("  " + line for line in table.split("\n"))
    lines.append(f"stats:    {format_stats(detail.stats)}")
    lines.append("values:")
    lines.append(format_values(detail.values, limit))
    return "\n".join(lines)


def tensor_json(detail: TensorDetail, limit: int) -> Dict[str, Any]:
    """``inspect --key --json``: the layout, statistics, and values when at most ``limit`` elements."""
    out = _layout_json(detail.layout)
    out["stats"] = {k: json_number(v) for k, v in detail.stats.items()}
    included = detail.values.size <= limit
    out["values_included"] = included
    if included:
        out["values"] = strings_json(detail.values) if detail.values.dtype == object else values_json(detail.values)
    return out
