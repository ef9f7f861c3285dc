"""``shardckpt verify PATH [--json]``: read every stored byte and check it.

Checks that every data file the header announces exists, that every entry fits
in its file and has the size its dtype and shape need, that every sliced
tensor's slices tile it exactly (no gap, no overlap, dtype and shape agree), and
that every stored piece (whole entries and each slice) matches its CRC32C. It carries on after a
problem, prints one line per bad entry (key, slice, file, problem), then a
summary: ``OK: N tensors, M bytes verified`` or ``FAILED: k of N entries bad``.
Exit status 0 only when everything is fine.

On a terminal a progress bar (bytes read out of the data files' total) is drawn on
stderr while the entries are read, and erased before the report is printed; off a
terminal and with ``--json`` nothing but the report is printed (:mod:`.progress`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set

from ..errors import ShardckptError
from ..format.bundle_reader import BundleReader
from ..format.ordered_code import decode_tensor_name_slice
from ..format.tiling import check_tiling
from ..storage.base import FileSystem
from ._layout import TensorLayout, data_files, locate, open_bundle, tensor_layout
from ._text import bare_message, description_of, error_text, human_size, key_text, piece_key_text
from .progress import Advance, progress_bar

__all__ = ["add_parser", "run", "Problem", "VerifyReport", "verify_bundle", "render_report", "report_json"]


@dataclass(frozen=True)
class Problem:
    """One bad stored entry: which tensor (and slice), which file, what is wrong."""

    key: str
    slice: Optional[str]
    file: Optional[str]
    message: str

    def line(self) -> str:
        where = f"key {self.key!r}" + (f" slice {self.slice}" if self.slice is not None else "")
        in_file = f" in {self.file}" if self.file else ""
        return f"BAD {where}{in_file}: {self.message}"


@dataclass
class VerifyReport:
    """Everything ``verify`` found."""

    prefix: str
    entries: int = 0  #: tensors (plus any orphan slice entries) checked
    bad_entries: int = 0
    bytes_verified: int = 0
    problems: List[Problem] = field(default_factory=list)
    missing_files: List[str] = field(default_factory=list)
    orphan_slices: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.bad_entries == 0 and not self.missing_files


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``verify`` subcommand."""
    parser = subparsers.add_parser("verify", help="check every stored tensor's size and checksum",
                                   description=description_of(__doc__))
    parser.add_argument("path", metavar="PATH", help="checkpoint prefix, checkpoint directory or SavedModel directory")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Run ``verify``; returns the exit status."""
    from ..tiers.report import tier_command  # a tier folder (issue 28): its node bundles

    tiered = tier_command("verify", args)
    if tiered is not None:
        return tiered
    location = locate(args.path)
    try:
        reader = open_bundle(location)
    except ShardckptError as exc:
        message = f"cannot read the checkpoint index: {error_text(exc)}"
        if args.json:
            print(json.dumps({"checkpoint": os.fspath(args.path), "ok": False, "error": message}, indent=2))
        print(f"error: {message}", file=sys.stderr)
        return 1
    with reader:
        with progress_bar("verify", None, enabled=not args.json) as advance:
            report = verify_bundle(reader, advance, fs=location.fs)
    print(json.dumps(report_json(report), indent=2) if args.json else render_report(report))
    return 0 if report.ok else 1


def _problem(name: str, spec: Optional[str], exc: ShardckptError) -> Problem:
    return Problem(key=name, slice=spec, file=exc.path, message=bare_message(exc))


def _piece_problems(reader: BundleReader, layout: TensorLayout, first: ShardckptError) -> List[Problem]:
    """After ``verify`` failed on a sliced tensor, check each slice on its own to name every bad one."""
    if not layout.sliced:
        return [_problem(layout.name, None, first)]
    problems = []
    for piece in layout.pieces:
        try:
            reader.read_region(layout.key, piece.box)
        except ShardckptError as exc:
            problems.append(_problem(layout.name, piece.spec, exc))
    if problems:
        return problems
    spec = layout.slice_spec(first.key) if isinstance(first.key, bytes) else None
    return [_problem(layout.name, spec, first)]


def _slice_owner(key: bytes) -> Optional[bytes]:
    """The tensor name inside an encoded slice key (``None`` if it does not decode)."""
    try:
        return decode_tensor_name_slice(key)[0]
    except Exception:  # an undecodable key belongs to no tensor
        return None


def _no_progress(name: str, nbytes: int) -> None:
    return None


def verify_bundle(reader: BundleReader, progress: Advance = _no_progress, *,
                  fs: Optional[FileSystem] = None) -> VerifyReport:
    """Check every data file, entry and stored piece of ``reader``'s bundle (its data files' sizes
    asked of ``fs``, default the store serving its prefix).

    ``progress(key, nbytes)`` is called after each tensor (or orphan slice entry) is checked,
    and ``progress.set_total(nbytes)`` (where it has one) once, with the data files' total size.
    """
    report = VerifyReport(prefix=reader.prefix)
    files = data_files(reader, fs if fs is not None else locate(reader.prefix).fs)
    report.missing_files = [f.path for f in files if f.size is None]
    set_total = getattr(progress, "set_total", None)
    if set_total is not None:
        set_total(sum(f.size or 0 for f in files))
    listed: Set[bytes] = set()
    undescribed: Set[bytes] = set()  # tensors whose entry is bad: their slices are no orphans
    for key in sorted(reader.keys()):
        report.entries += 1
        name = key_text(key)
        try:
            layout = tensor_layout(reader, key)
        except ShardckptError as exc:
            report.bad_entries += 1
            report.problems.append(_problem(name, None, exc))
            undescribed.add(key)
            continue
        listed.update(p.key for p in layout.pieces)
        bad = False
        if layout.sliced:
            try:
                check_tiling(reader, key)
            except ShardckptError as exc:
                bad = True
                report.problems.append(_problem(name, None, exc))
        try:
            reader.verify(key)
        except ShardckptError as exc:
            bad = True
            report.problems.extend(_piece_problems(reader, layout, exc))
        progress(name, layout.nbytes)
        if bad:
            report.bad_entries += 1
            continue
        report.bytes_verified += layout.nbytes
    # Slice entries that no tensor lists: still stored bytes, so still checked.
    plain = set(reader.keys())
    for key in reader.keys(include_slices=True):
        if key in listed or key in plain or _slice_owner(key) in undescribed:
            continue
        report.entries += 1
        pretty = piece_key_text(key)
        report.orphan_slices.append(pretty)
        try:
            reader.verify(key)
            size = int(reader.entry(key).size)
            report.bytes_verified += size
            progress(pretty, size)
        except ShardckptError as exc:
            report.bad_entries += 1
            name, sep, spec = pretty.partition(" slice ")
            report.problems.append(_problem(name, spec if sep else None, exc))
    return report


def render_report(report: VerifyReport) -> str:
    """Text: one line per missing file and bad entry, notes, then the summary line."""
    lines = [f"MISSING data file {path}" for path in report.missing_files]
    lines += [p.line() for p in report.problems]
    if report.orphan_slices:
        lines.append(f"note: {len(report.orphan_slices)} slice entries are listed by no tensor: "
                     + ", ".join(report.orphan_slices))
    if report.ok:
        lines.append(f"OK: {report.entries} tensors, {report.bytes_verified} bytes verified "
                     f"({human_size(report.bytes_verified)}) in {report.prefix}")
    else:
        summary = f"FAILED: {report.bad_entries} of {report.entries} entries bad"
        if report.missing_files:
            count = len(report.missing_files)
            summary += f", {count} data file{'s' if count != 1 else ''} missing"
        lines.append(f"{summary} in {report.prefix}")
    return "\n".join(lines)


def report_json(report: VerifyReport) -> Dict[str, Any]:
    """The report as a JSON-ready dict."""
    return {"checkpoint": report.prefix, "ok": report.ok, "entries": report.entries,
            "bad_entries": report.bad_entries, "bytes_verified": report.bytes_verified,
            "missing_files": report.missing_files, "orphan_slices": report.orphan_slices,
            "problems": [{"key": p.key, "slice": p.slice, "file": p.file, "problem": p.message}
                         for p in report.problems]}
