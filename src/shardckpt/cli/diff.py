"""``shardckpt diff A B``: compare two checkpoints of any formats, tensor by tensor.

Reports names only in one side, dtype or shape changes and, per tensor, the elements that
differ and the largest absolute and relative difference. Tensors are compared bit for bit
(``0.0`` and ``-0.0`` differ, as do NaN payloads); ``--numeric`` compares values instead,
``--atol``/``--rtol`` with a tolerance (``|a - b| <= atol + rtol * |b|``; either implies
``--numeric``). Exit status as ``diff`` and ``cmp``: 0 the same, 1 different, 2 trouble
(a file that cannot be read, a bad argument), so a script can tell a difference from a
failure.
"""

from __future__ import annotations

import argparse
import json

from ..convert import diff
from ..convert.detect import FORMATS
from ._text import description_of, render_table
from .progress import progress_bar

__all__ = ["add_parser", "run", "SAME", "DIFFERENT", "TROUBLE"]

SAME, DIFFERENT, TROUBLE = 0, 1, 2  #: exit statuses, as diff(1) and cmp(1) have them


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``diff`` subcommand."""
    p = subparsers.add_parser("diff", help="compare two checkpoints (any formats); exit 0 same, 1 different, 2 trouble",
                              description=description_of(__doc__))
    p.add_argument("a", metavar="A")
    p.add_argument("b", metavar="B")
    p.add_argument("--numeric", action="store_true",
                   help="compare values, not bits (-0.0 equals 0.0, NaN equals NaN)")
    p.add_argument("--atol", "--tolerance", type=float, default=0.0,
                   help="absolute tolerance (default 0; implies --numeric)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance (default 0; implies --numeric)")
    p.add_argument("--keys", metavar="REGEX", help="compare only tensors whose names match")
    p.add_argument("--a-format", choices=FORMATS, help="format of A (default: detected)")
    p.add_argument("--b-format", choices=FORMATS, help="format of B (default: detected)")
    p.add_argument("--trust-pickle", action="store_true", help="allow reading PyTorch DCP folders (pickled metadata)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run, trouble_status=TROUBLE)


def _num(x: object) -> str:
    return "-" if x is None else f"{x:.6g}"


def run(args: argparse.Namespace) -> int:
    with progress_bar("diff", None, enabled=not args.json) as advance:
        result = diff(args.a, args.b, atol=args.atol, rtol=args.rtol, keys=args.keys, a_format=args.a_format,
                      b_format=args.b_format, trust_pickle=args.trust_pickle, numeric=args.numeric,
                      progress=advance)
    status = SAME if result.equal else DIFFERENT
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
        return status
    lines = []
    lines += [f"only in A: {name}" for name in result.only_a]
    lines += [f"only in B: {name}" for name in result.only_b]
    rows = [[t.name, "equal" if t.equal else "DIFFERENT",
             t.problem or f"{t.mismatched} elements" + (" (bits only: equal values)" if t.bits_only else ""),
             _num(t.max_abs), _num(t.max_rel)] for t in result.tensors if not t.equal]
    if rows:
        lines.append(render_table(["KEY", "STATUS", "WHAT", "MAX ABS", "MAX REL"], rows))
    same = sum(t.equal for t in result.tensors)
    how = (f"within atol={args.atol} rtol={args.rtol}" if args.numeric or args.atol or args.rtol
           else "bit for bit")
    lines.append(f"{same} of {len(result.tensors)} common tensors equal {how}; "
                 f"{len(result.only_a)} only in A, {len(result.only_b)} only in B: "
                 + ("EQUAL" if result.equal else "DIFFERENT"))
    print("\n".join(lines))
    return status
