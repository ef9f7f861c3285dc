"""``convert``: one checkpoint to another format, streaming, with selection and renaming.

The steps: open the source (listing tensors, reading no values); apply the
:class:`~shardckpt.convert.select.Rules`; settle string tensors (kept in TF output;
put in safetensors ``__metadata__`` with ``strings="metadata"``; otherwise left out
with a warning); let the sink refuse any dtype it cannot hold, naming the tensor,
**before anything is written**; check that the stored bytes of every output justify
its declared shape (``Source.check_stored``) before any buffer is sized from it; then
stream the values, one tensor at a time, into the sink, which commits atomically.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np

from ..errors import InvalidArgumentError
from ..format.dtypes import STRING
from ..storage import get_fs, is_local_path
from .dcp import DCPSink, DCPSource
from .detect import dest_format, source_format
from .hf import HFSink, HFSource
from .model import NO_PROGRESS, Progress, Sink, Source, TensorInfo
from .npz import NpzSink, NpzSource
from .presets import PRESETS, model_config, unrecognised
from .safetensors import SafetensorsSink, SafetensorsSource
from .select import Planned, Rules, plan
from .strings import encode_string_tensor, string_entries
from .tf import OBJECT_GRAPH_KEY, TFSink, TFSource

__all__ = ["convert", "open_source", "make_sink", "ConvertResult"]

_log = logging.getLogger("shardckpt")


@dataclass
class ConvertResult:
    """What a conversion did."""

    source: str
    source_format: str
    dest: str
    dest_format: str
    tensors: int = 0
    bytes: int = 0
    left_out: List[str] = field(default_factory=list)
    #: string tensors kept as ``__metadata__`` entries (``strings="metadata"``), by source name
    in_metadata: List[str] = field(default_factory=list)
    warnings: List[str] = field(default_factory=list)
    files: List[str] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> Dict[str, object]:
        """The result as a plain dict (what ``shardckpt convert --json`` prints)."""
        return dict(self.__dict__)


def open_source(path: str, fmt: Optional[str] = None, *, trust_pickle: bool = False) -> Source:
    """Open ``path`` as a stream of tensors (format detected unless ``fmt`` is given)."""
    fmt = source_format(path, fmt)
    if fmt == "tf":
        return TFSource(path)
    if fmt == "safetensors":
        return SafetensorsSource(path)
    if fmt == "hf":
        return HFSource(path)
    if fmt == "npz":
        return NpzSource(path)
    return DCPSource(path, trust_pickle=trust_pickle)


def make_sink(path: str, fmt: str, *, max_shard_size: Optional[int] = None,
              extra_files: Optional[Dict[str, bytes]] = None) -> Sink:
    """The writer of format ``fmt`` (``tf``, ``safetensors``, ``hf``, ``npz``, ``dcp``) at ``path``.

    ``max_shard_size`` splits outputs that have shards (HF folders); ``extra_files`` are
    written beside the output (an HF folder's ``config.json``, ...).
    """
    if fmt == "tf":
        return TFSink(path, max_shard_size)
    if fmt == "safetensors":
        return SafetensorsSink(path)
    if fmt == "hf":
        return HFSink(path, max_shard_size, extra_files)
    if fmt == "npz":
        return NpzSink(path)
    return DCPSink(path)


def _preset_config(source: Source, preset: str) -> Optional[bytes]:
    """``config.json`` from the preset's config file (``bert_config.json``, ``albert_config.json``)
    beside the source checkpoint, if there is one."""
    fs = get_fs(source.path)
    chosen = PRESETS[preset]
    if chosen.config_file is None:
        return None
    directory = source.path if fs.isdir(source.path) else fs.dirname(source.path)
    candidate = fs.join(directory, chosen.config_file) if directory else chosen.config_file
    if not fs.isfile(candidate):
        return None
    config = model_config(chosen, fs.read_bytes(candidate).decode("utf-8"))
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()


def _warn_unrecognised(result: ConvertResult, preset: str, names: List[str]) -> None:
    """A warning when ``preset`` does not recognise some of ``names`` (kept as they are)."""
    chosen = PRESETS[preset]
    missed = unrecognised(chosen.rule, names)
    if not missed:
        return
    examples = ", ".join(repr(n) for n in missed[:3]) + (", ..." if len(missed) > 3 else "")
    text = (f"--preset {preset} does not recognise {len(missed)} of {len(names)} tensor names, kept as they are "
            f"({examples})")
    if chosen.reverse is not None and len(missed) == len(names):
        text += f"; --preset {chosen.reverse} goes the other way"
    result.warnings.append(text)


def convert(src: str, dst: str, *, src_format: Optional[str] = None, dst_format: Optional[str] = None,
            rules: Optional[Rules] = None, preset: Optional[str] = None, strings: str = "skip",
            max_shard_size: Optional[int] = None, trust_pickle: bool = False,
            progress: Progress = NO_PROGRESS) -> ConvertResult:
    """Convert the checkpoint at ``src`` into ``dst``; see the module docstring.

    Formats: ``tf``, ``safetensors``, ``hf``, ``npz``, ``dcp`` (detected from the paths
    unless given). ``preset`` is ``"bert"``, ``"electra"``, ``"albert"`` (google-research TF names to
    transformers') or ``"bert-tf"`` (transformers' BERT names to google-research's); names it does not
    recognise are kept as they are, with a warning. ``strings`` is ``"skip"``
    or ``"metadata"``. ``max_shard_size`` (bytes) shards ``tf`` and ``hf`` output.
    ``progress(name, nbytes)`` is called after each tensor is written (and
    ``progress.set_total(nbytes)``, if it has that attribute, once before the first).
    """
    started = time.perf_counter()
    if strings not in ("skip", "metadata"):
        raise InvalidArgumentError(f"strings must be 'skip' or 'metadata', got {strings!r}")
    rules = rules or Rules()
    if preset is not None:
        if preset not in PRESETS:
            raise InvalidArgumentError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
        rules = dataclasses.replace(rules, preset=PRESETS[preset].rule)
    dfmt = dest_format(dst, dst_format)
    with open_source(src, src_format, trust_pickle=trust_pickle) as source:
        result = ConvertResult(source.path, source.format, dst, dfmt)
        metadata = source.metadata()
        extras: Dict[str, np.ndarray] = {}
        if dfmt == "tf":  # string tensors kept in __metadata__ become tensors again
            extras = string_entries(metadata, source.path)
            metadata = {}
        infos = source.tensors() + [TensorInfo(k, STRING, tuple(v.shape)) for k, v in extras.items()]
        planned, result.left_out = plan(infos, rules)
        if preset is not None:
            _warn_unrecognised(result, preset, [p.source.name for p in planned])
        outputs: List[Planned] = []
        for p in planned:
            if p.out.dtype.is_variant:
                result.warnings.append(f"{p.source.name}: variant tensors cannot be converted; left out")
            elif p.out.dtype.is_string and dfmt != "tf":
                if strings == "metadata" and dfmt in ("safetensors", "hf"):
                    value = extras[p.source.name] if p.source.name in extras else source.read(p.source.name)
                    metadata[p.out.name] = encode_string_tensor(value)
                    result.in_metadata.append(p.source.name)
                    continue
                else:
                    how = "; --strings metadata keeps it in __metadata__" if dfmt in ("safetensors", "hf") else ""
                    result.warnings.append(f"{p.source.name}: {dfmt} cannot hold string tensors; left out{how}")
            else:
                outputs.append(p)
                continue
            result.left_out.append(p.source.name)
        renamed = any(p.out.name != p.source.name for p in outputs)
        if dfmt == "tf" and renamed and any(p.out.name == OBJECT_GRAPH_KEY for p in outputs):
            result.warnings.append(f"{OBJECT_GRAPH_KEY} still names the original keys: tf.train.Checkpoint restores "
                                   "will not find renamed variables (tf.train.load_checkpoint reads them by name); "
                                   f"--drop {OBJECT_GRAPH_KEY} leaves it out")
        for w in result.warnings:
            _log.warning("%s", w)
        extra_files: Dict[str, bytes] = {}
        if preset is not None and dfmt == "hf":
            config = _preset_config(source, preset)
            if config is not None:
                extra_files["config.json"] = config
        sink = make_sink(dst, dfmt, max_shard_size=max_shard_size, extra_files=extra_files)
        out_infos = [p.out for p in outputs]
        sink.check(out_infos)
        if not out_infos:
            raise InvalidArgumentError("nothing to convert: every tensor was left out", path=src)
        for p in outputs:  # declared shapes are held by stored bytes before anything is sized from them
            if p.source.name not in extras:
                source.check_stored(p.source.name)

        # A sink that writes each value out before the next fetch, to a local file (an object
        # store's upload may still hold the bytes), gets values read into one reused buffer:
        # no fresh pages to fault in per tensor, and one tensor's worth of memory. Its size
        # comes from declared shapes, each checked against its stored bytes just above.
        reuse = sink.consumes_each_value and is_local_path(dst)
        buffer: List[np.ndarray] = []

        def read(p: Planned) -> np.ndarray:
            info = p.source
            if reuse and info.dtype.is_numeric:
                if not buffer:
                    buffer.append(np.empty(max(o.source.nbytes for o in outputs), np.uint8))
                out = buffer[0][:info.nbytes].view(info.dtype.numpy).reshape(info.shape)
                got = source.read_into(info.name, out)
                if got is not None:
                    return got
            return source.read(info.name)

        def fetch(i: int) -> np.ndarray:
            p = outputs[i]
            value = extras[p.source.name] if p.source.name in extras else read(p)
            if p.transpose:
                value = value.T
            if p.cast is not None:
                value = value.astype(p.cast.numpy)
            return value

        read_rows = getattr(source, "read_rows", None)
        last: Dict[int, np.ndarray] = {}  # the whole value slabs were last cut from (sources without row reads)

        def rows(i: int, start: int, stop: int) -> np.ndarray:
            p = outputs[i]
            if read_rows is not None and not (p.transpose or p.cast is not None or p.source.name in extras):
                return read_rows(p.source.name, start, stop)
            if i not in last:
                last.clear()
                last[i] = fetch(i)
            part = np.array(last[i][start:stop])
            if stop >= p.out.shape[0]:  # the tensor's last slab: let the whole value go
                last.clear()
            return part

        if isinstance(sink, TFSink):
            sink.read_rows = rows
        set_total = getattr(progress, "set_total", None)
        if set_total is not None:
            set_total(sum(i.nbytes for i in out_infos))
        result.files = sink.write(out_infos, fetch, metadata, progress)
        result.tensors = len(out_infos)
        result.bytes = sum(i.nbytes for i in out_infos)
    result.seconds = time.perf_counter() - started
    return result
