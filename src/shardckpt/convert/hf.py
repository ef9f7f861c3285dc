"""Hugging Face sharded safetensors folders.

On disk::

    model-00001-of-0000N.safetensors ... model-0000N-of-0000N.safetensors
    model.safetensors.index.json   {"metadata": {"total_size": BYTES}, "weight_map": {NAME: SHARD_FILE}}

Shards are packed in tensor order, a new shard starting when the next tensor would
push the current one past ``max_shard_size`` (a tensor larger than the limit gets a
shard of its own, as ``transformers`` does). The index is written last: a folder
without its index is not a checkpoint. A folder holding only ``model.safetensors``
is read as that file. Metadata (e.g. string tensors kept with ``--strings metadata``) is
written once, in the index's ``metadata``; each shard's ``__metadata__`` is ``{"format": "pt"}``.

Converting into an existing folder (:mod:`.atomic`): the new shards are written in a
temporary folder beside the old ones, and only at the commit is the old index removed,
the shards renamed into place and the new index written; a conversion that fails
before that leaves the previous folder as it was (index included). Shards of the old
folder that the new index does not name are removed after the commit.

The index is read as a stream (:class:`~shardckpt.convert.jsonscan.JsonScanner`), never
as one ``json.loads``: at most 64 MiB; ``weight_map`` an object of strings, at most
:data:`~shardckpt.convert.safetensors.MAX_ENTRIES` (2**20) of them; ``metadata`` and
any other member strings, numbers, flat lists of them, or objects of those (deeper
nesting is refused). Refusing a hostile index costs its bytes and no more.
"""

from __future__ import annotations

import json
import re
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import DataLossError, InvalidArgumentError, NotFoundError
from ..storage import get_fs
from .atomic import StagedFiles
from .jsonscan import JsonScanner
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo
from .safetensors import MAX_ENTRIES, SafetensorsSink, SafetensorsSource, write_safetensors

__all__ = ["HFSource", "HFSink", "INDEX_NAME", "DEFAULT_MAX_SHARD_SIZE", "parse_size"]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_MAX_INDEX_BYTES = 64 << 20
_OLD_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_SHARD_FILE = re.compile(r"^[^/\\]+\.safetensors$")
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40}


def parse_size(text: str) -> int:
    """``"5GB"`` -> 5e9, ``"512MiB"`` -> 512 * 2**20, ``"1000"`` -> 1000."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise InvalidArgumentError(f"not a size: {text!r} (examples: 5GB, 512MiB, 1000000)")
    size = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if size <= 0:
        raise InvalidArgumentError(f"size must be positive: {text!r}")
    return size


def is_hf_folder(path: str) -> bool:
    fs = get_fs(path)
    return fs.isfile(fs.join(path, INDEX_NAME)) or fs.isfile(fs.join(path, SINGLE_NAME))


def _read_index(raw: bytes, path: str) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``(weight_map, metadata)`` of an index file, read as a stream (see the module docstring)."""
    scanner = JsonScanner(raw, path, "index")
    weight_map: Optional[Dict[str, str]] = None
    meta: Dict[str, str] = {}
    for top in scanner.members():
        if top == "weight_map":
            if not scanner.at_object():
                break
            weight_map = {}
            shards: Dict[str, str] = {}
            for name in scanner.members(top):
                shard = scanner.scalar(name)
                if not isinstance(shard, str):
                    raise DataLossError("index has no weight_map of tensor names to shard files", path=path, key=name)
                if len(weight_map) >= MAX_ENTRIES:
                    raise DataLossError(f"weight_map names more than {MAX_ENTRIES} tensors", path=path)
                weight_map[name] = shards.setdefault(shard, shard)  # one string per shard file
        elif top == "metadata" and scanner.at_object():
            for key in scanner.members(top):
                value = scanner.scalar(key)
                if len(meta) >= MAX_ENTRIES:
                    raise DataLossError(f"metadata holds more than {MAX_ENTRIES} entries", path=path)
                if key != "total_size":
                    meta[key] = value if isinstance(value, str) else json.dumps(value)
        else:
            scanner.skip(top)
    else:
        scanner.end()
    if weight_map is None:
        raise DataLossError("index has no weight_map of tensor names to shard files", path=path)
    return weight_map, meta


class HFSource(Source):
    """A folder with ``model.safetensors.index.json`` and its shards (or a lone ``model.safetensors``)."""

    format = "hf"

    def __init__(self, path: str) -> None:
        self.path = path
        fs = get_fs(path)
        index_path = fs.join(path, INDEX_NAME)
        self.files: Dict[str, SafetensorsSource] = {}
        self.where: Dict[str, str] = {}
        self.meta: Dict[str, str] = {}
        if not fs.isfile(index_path):
            single = fs.join(path, SINGLE_NAME)
            if not fs.isfile(single):
                raise NotFoundError(f"neither {INDEX_NAME} nor {SINGLE_NAME} in this folder", path=path)
            src = SafetensorsSource(single)
            self.files[SINGLE_NAME] = src
            self.where = {info.name: SINGLE_NAME for info in src.tensors()}
            self.meta = src.metadata()
            return
        if fs.size(index_path) > _MAX_INDEX_BYTES:
            raise DataLossError(f"index is larger than {_MAX_INDEX_BYTES} bytes", path=index_path)
        weight_map, self.meta = _read_index(fs.read_bytes(index_path), index_path)
        shard_names = sorted(set(weight_map.values()))
        bad = [n for n in shard_names if not _SHARD_FILE.match(n) or n.startswith("..")]
        if bad:
            raise DataLossError(f"weight_map names shard files outside the folder: {bad[:3]}", path=index_path)
        missing = [n for n in shard_names if not fs.isfile(fs.join(path, n))]
        if missing:
            raise NotFoundError(f"weight_map names shard files that do not exist: {missing}", path=index_path)
        try:
            for n in shard_names:
                self.files[n] = SafetensorsSource(fs.join(path, n))
            for name, shard in weight_map.items():
                if name not in self.files[shard].infos:
                    raise DataLossError(f"weight_map puts this tensor in {shard}, which does not hold it",
                                        path=index_path, key=name)
            for shard, src in self.files.items():
                for info in src.tensors():
                    if weight_map.get(info.name) != shard:
                        raise DataLossError(f"{shard} holds this tensor but weight_map does not name it there",
                                            path=index_path, key=info.name)
        except BaseException:
            self.close()
            raise
        self.where = weight_map

    def tensors(self) -> List[TensorInfo]:
        out = []
        for shard in sorted(self.files):
            out.extend(self.files[shard].tensors())
        return out

    def read(self, name: str) -> np.ndarray:
        shard = self.where.get(name)
        if shard is None:
            raise NotFoundError("no such tensor", path=self.path, key=name)
        return self.files[shard].read(name)

    def read_rows(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.files[self.where[name]].read_rows(name, start, stop)

    def read_into(self, name: str, out: np.ndarray) -> Optional[np.ndarray]:
        return self.files[self.where[name]].read_into(name, out)

    def metadata(self) -> Dict[str, str]:
        return dict(self.meta)

    def close(self) -> None:
        for src in self.files.values():
            src.close()


def plan_shards(infos: Sequence[TensorInfo], max_shard_size: int) -> List[List[int]]:
    """Tensor indices per shard, in order, each shard at most ``max_shard_size`` bytes unless one tensor is."""
    shards: List[List[int]] = [[]]
    size = 0
    for i, info in enumerate(infos):
        if shards[-1] and size + info.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(i)
        size += info.nbytes
    return shards


class HFSink(Sink):
    """A Hugging Face sharded folder; ``config`` (a dict) is written as ``config.json`` beside it."""

    format = "hf"
    consumes_each_value = True

    def __init__(self, path: str, max_shard_size: Optional[int] = None,
                 extra_files: Optional[Dict[str, bytes]] = None) -> None:
        super().__init__(path)
        self.max_shard_size = max_shard_size or DEFAULT_MAX_SHARD_SIZE
        self.extra_files = dict(extra_files or {})

    def check(self, infos: Sequence[TensorInfo]) -> None:
        SafetensorsSink(self.path).check(infos)

    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        fs = get_fs(self.path)
        old_index = fs.join(self.path, INDEX_NAME)
        retire = [old_index] if fs.isfile(old_index) else []  # at the commit: the old folder stops looking complete
        shards = plan_shards(infos, self.max_shard_size)
        n = len(shards)
        staged = StagedFiles(self.path, INDEX_NAME, retire)
        weight_map: Dict[str, str] = {}
        meta = {"format": "pt"}  # what transformers checks; other metadata goes to the index once
        try:
            for k, indices in enumerate(shards, 1):
                name = f"model-{k:05d}-of-{n:05d}.safetensors"
                out = staged.open(name)
                write_safetensors(out, infos, fetch, indices, meta, progress)
                weight_map.update({infos[i].name: name for i in indices})
            index = {"metadata": {"total_size": sum(info.nbytes for info in infos), **metadata},
                     "weight_map": dict(sorted(weight_map.items()))}
            last = [(name, data) for name, data in self.extra_files.items()]
            last.append((INDEX_NAME, (json.dumps(index, indent=2) + "\n").encode()))
            written = staged.commit(last)
        except BaseException:
            staged.abort()
            raise
        for name in fs.listdir(self.path):  # shards of an earlier conversion into this folder
            base = name.rsplit("/", 1)[-1]
            if _OLD_SHARD.match(base) and base not in weight_map.values():
                fs.remove(fs.join(self.path, base))
        return written
