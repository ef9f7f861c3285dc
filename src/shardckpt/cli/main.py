"""Entry point of the ``shardckpt`` command: argument parsing and error handling.

Exit status: 0 success, 1 a problem with the checkpoint (or a failed check),
2 bad command-line usage. A command may state its own status for an error
(``trouble_status``: ``diff`` follows ``diff``/``cmp``: 1 means "different", 2 "trouble").
Errors from :mod:`shardckpt.errors` (and operating-system errors) are printed as
``error: <message>`` on stderr, never as a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from .. import __version__
from ..errors import ShardckptError
from . import convert, demo, diff, inspect, verify
from ._text import error_text

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The ``shardckpt`` parser with one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="shardckpt",
        description="Inspect, check, convert and compare checkpoints (TensorFlow V2 bundles, safetensors, "
                    "Hugging Face folders, npz, PyTorch DCP) without TensorFlow.")
    parser.add_argument("--version", action="version", version=f"shardckpt {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for command in (inspect, verify, convert, diff, demo):
        command.add_parser(subparsers)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    parser = build_parser()
    args_list: List[str] = list(sys.argv[1:] if argv is None else argv)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, usage errors (2)
        return exc.code if isinstance(exc.code, int) else 2
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    trouble = int(getattr(args, "trouble_status", 1))
    try:
        return int(args.func(args))
    except ShardckptError as exc:
        print(f"error: {error_text(exc)}", file=sys.stderr)
        return trouble
    except BrokenPipeError:  # e.g. `shardckpt inspect ... | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return trouble
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return trouble
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
