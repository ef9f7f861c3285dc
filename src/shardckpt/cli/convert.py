"""``shardckpt convert SRC DST``: one checkpoint to another format, streaming.

Formats (detected from the paths, or given with ``--from``/``--to``): ``tf``
(prefix, checkpoint directory, SavedModel directory), ``safetensors`` (one file),
``hf`` (a Hugging Face sharded folder), ``npz`` and ``dcp`` (PyTorch Distributed
Checkpoint, needs torch; its ``.metadata`` is a pickle, so reading one needs
``--trust-pickle``). Local paths and ``s3://``. One tensor is in memory at a
time; the output is committed atomically. A dtype the output cannot hold is an
error naming the tensor before anything is written; ``--dtype`` casts explicitly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from typing import Iterator

from ..convert import ConvertResult, Rules, convert, parse_size
from ..convert.detect import FORMATS
from ..convert.presets import PRESETS
from ..convert.select import load_name_map
from ._layout import locate
from ._text import description_of
from .progress import progress_bar

__all__ = ["add_parser", "run"]


def add_parser(subparsers: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """Register the ``convert`` subcommand."""
    p = subparsers.add_parser("convert", help="convert a checkpoint to another format (tf, safetensors, hf, npz, dcp)",
                              description=description_of(__doc__))
    p.add_argument("src", metavar="SRC")
    p.add_argument("dst", metavar="DST")
    p.add_argument("--from", dest="src_format", choices=FORMATS, help="format of SRC (default: detected)")
    p.add_argument("--to", dest="dst_format", choices=FORMATS,
                   help="format of DST (default: from its suffix, .safetensors or .npz)")
    p.add_argument("--keep", action="append", default=[], metavar="REGEX", help="convert only matching tensors")
    p.add_argument("--drop", action="append", default=[], metavar="REGEX", help="leave matching tensors out")
    p.add_argument("--rename", action="append", default=[], metavar="REGEX=REPL", help="rename (re.sub), repeatable")
    p.add_argument("--map", metavar="FILE", help="JSON object of exact old -> new names")
    p.add_argument("--transpose", action="append", default=[], metavar="REGEX",
                   help="reverse the axes of matching tensors")
    p.add_argument("--dtype", action="append", default=[], metavar="[REGEX=]DTYPE",
                   help="cast floating-point tensors (or those matching REGEX) to DTYPE; nothing is cast otherwise")
    p.add_argument("--preset", choices=sorted(PRESETS),
                   help="rename for transformers: bert, electra, albert take google-research TF names to "
                        "transformers'; bert-tf takes transformers' BERT names back to google-research's")
    p.add_argument("--strings", choices=("skip", "metadata"), default="skip",
                   help="string tensors into safetensors __metadata__ (default: left out with a warning)")
    p.add_argument("--max-shard-size", metavar="SIZE", type=parse_size,
                   help="largest shard for tf and hf output, e.g. 5GB, 512MiB (hf default 5GB)")
    p.add_argument("--trust-pickle", action="store_true",
                   help="allow reading a PyTorch DCP folder, whose .metadata is a pickle that can run code")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(func=run)


@contextlib.contextmanager
def _warnings_on_stderr() -> Iterator[None]:
    """Every warning the library logs while converting, once, as ``warning: ...`` on stderr.

    The library logs each warning (``ConvertResult.warnings`` and the ones only a source knows, such as
    a DCP folder's pickle) on the ``shardckpt`` logger; this handler is the one place they are printed.
    """
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("warning: %(message)s"))
    logger = logging.getLogger("shardckpt")
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)


def _summary(result: ConvertResult) -> str:
    text = (f"converted {result.tensors} tensors ({result.bytes} bytes) from {result.source_format} "
            f"{result.source} to {result.dest_format} {result.dest} in {result.seconds:.2f} s")
    if result.in_metadata:
        text += f"; {len(result.in_metadata)} string tensors kept in __metadata__"
    if result.left_out:
        text += f"; {len(result.left_out)} left out"
    return text


def run(args: argparse.Namespace) -> int:
    name_map = {}
    if args.map:
        name_map = load_name_map(locate(args.map).fs.read_bytes(args.map).decode("utf-8"), args.map)
    rules = Rules(keep=args.keep, drop=args.drop, rename=args.rename, name_map=name_map, transpose=args.transpose,
                  casts=args.dtype)
    # the handler takes sys.stderr as the bar leaves it (rich's proxy prints above the bar)
    with progress_bar("convert", None, enabled=not args.json) as advance, _warnings_on_stderr():
        result = convert(args.src, args.dst, src_format=args.src_format, dst_format=args.dst_format, rules=rules,
                         preset=args.preset, strings=args.strings, max_shard_size=args.max_shard_size,
                         trust_pickle=args.trust_pickle, progress=advance)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(_summary(result))
    return 0
