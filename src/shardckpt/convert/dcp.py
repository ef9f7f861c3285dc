"""PyTorch Distributed Checkpoint (DCP) folders, through the optional ``[torch]`` extra.

A DCP folder holds ``.metadata`` and ``__N_M.distcp`` data files. ``.metadata`` is
a Python **pickle**: loading it can run arbitrary code, so reading a DCP folder
requires ``trust_pickle=True`` (``--trust-pickle`` on the command line) and should
only be done for folders from a trusted source. Values are then loaded one tensor
at a time with ``torch.distributed.checkpoint.load`` (``no_dist=True``). Non-tensor
entries (pickled Python objects) are skipped with a warning. A damaged folder (a
``.metadata`` that does not unpickle, a data file missing or cut short, a shape no
array can have) is a :class:`~shardckpt.errors.DataLossError` naming the folder and
the tensor, whatever torch raised.

Writing uses ``torch.distributed.checkpoint.save`` (``no_dist=True``) into a temporary
sibling folder (claimed while the conversion lives; dead conversions' folders are
removed first, see :mod:`.atomic`) that is renamed into place when complete. DCP's API takes the whole
state dict at once, so it is given placeholders (tensors on torch's ``meta`` device: a shape and a
dtype, no values) to plan the save from, and a planner whose ``resolve_data`` fetches each value
only when torch writes it. Each tensor goes to its own ``__0_N.distcp`` data file (torch holds every
tensor of one data file until that file is closed), so at most about two tensors are in memory at a
time, as for the other destinations. Local paths only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import warnings
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np

from ..errors import DataLossError, InvalidArgumentError, NotFoundError, ShardckptError, UnsupportedError
from ..format.dtypes import DType, as_dtype
from ..storage import get_fs, is_local_path
from .atomic import temp_folder
from .model import NO_PROGRESS, Fetch, Progress, Sink, Source, TensorInfo
from .safetensors import check_array_shape, check_value

__all__ = ["DCPSource", "DCPSink", "is_dcp_folder", "PICKLE_WARNING"]

_log = logging.getLogger("shardckpt")

PICKLE_WARNING = ("a PyTorch DCP folder's .metadata file is a Python pickle: loading it can run arbitrary code. "
                  "Read DCP folders only from sources you trust, and say so with --trust-pickle "
                  "(trust_pickle=True).")

_SINGLE_PROCESS = ".*torch.distributed is disabled.*"  # expected: no_dist=True is a one-process save/load

# TF dtype name -> torch dtype attribute name
_TORCH = {"bool": "bool", "uint8": "uint8", "int8": "int8", "int16": "int16", "int32": "int32", "int64": "int64",
          "uint16": "uint16", "uint32": "uint32", "uint64": "uint64", "float16": "float16", "bfloat16": "bfloat16",
          "float32": "float32", "float64": "float64", "complex64": "complex64", "complex128": "complex128",
          "float8_e5m2": "float8_e5m2", "float8_e4m3fn": "float8_e4m3fn"}


def _torch() -> Any:
    try:
        import torch
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        raise UnsupportedError("PyTorch DCP needs torch: pip install 'shardckpt[torch]'") from None
    return torch


@contextlib.contextmanager
def _torch_errors(path: str, key: Optional[str], what: str) -> Iterator[None]:
    """What torch raises on a damaged folder (a truncated pickle, a missing or cut data file: its
    ``CheckpointException`` is not even an ``Exception``) as a :class:`DataLossError` naming it."""
    torch = _torch()
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except ShardckptError:
        raise
    except (Exception, CheckpointException) as exc:
        if isinstance(exc, (MemoryError, torch.cuda.OutOfMemoryError)):
            raise
        failures = getattr(exc, "failures", None)  # CheckpointException: {rank: (exception, traceback)}
        inner = next(iter(failures.values())) if isinstance(failures, dict) and failures else exc
        inner = inner[0] if isinstance(inner, tuple) and inner else inner
        detail = f"{type(inner).__name__}: {' '.join(str(inner).split())[:300]}"
        raise DataLossError(f"damaged PyTorch DCP folder: {what}: {detail}",
                            path=path, key=key) from None


def is_dcp_folder(path: str) -> bool:
    return is_local_path(path) and os.path.isfile(os.path.join(path, ".metadata"))


def _local(path: str) -> str:
    if not is_local_path(path):
        raise UnsupportedError("PyTorch DCP folders are supported on local paths only", path=path)
    return path[len("file://"):] if path.startswith("file://") else path


def to_numpy(tensor: Any, dtype: DType) -> np.ndarray:
    """A CPU torch tensor as a NumPy array of ``dtype`` (bit patterns kept)."""
    torch = _torch()
    t = tensor.detach().cpu().contiguous()
    if dtype.name in ("bfloat16", "float8_e5m2", "float8_e4m3fn", "uint16", "uint32", "uint64"):
        width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.numpy.itemsize]
        return t.view(width).numpy().view(dtype.numpy)
    return t.numpy()


def to_torch(value: np.ndarray, dtype: DType) -> Any:
    """A NumPy array as a torch tensor of the matching dtype (bit patterns kept)."""
    torch = _torch()
    target = getattr(torch, _TORCH[dtype.name])
    value = np.require(value, requirements="C")
    if dtype.name in ("bfloat16", "float8_e5m2", "float8_e4m3fn", "uint16", "uint32", "uint64"):
        width = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}[dtype.numpy.itemsize]
        return torch.from_numpy(value.view(width).copy()).view(target)
    return torch.from_numpy(value.copy() if not value.flags.writeable else value)


class DCPSource(Source):
    """A DCP folder; ``trust_pickle`` must be given (see the module docstring)."""

    format = "dcp"

    def __init__(self, path: str, trust_pickle: bool = False) -> None:
        if not trust_pickle:
            raise InvalidArgumentError("refusing to read: " + PICKLE_WARNING, path=path)
        self.path = _local(path)
        torch = _torch()
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        if not os.path.isfile(os.path.join(self.path, ".metadata")):
            raise NotFoundError("not a PyTorch DCP folder (no .metadata)", path=path)
        _log.warning(PICKLE_WARNING)
        with _torch_errors(self.path, None, "cannot read .metadata"):
            metadata = FileSystemReader(self.path).read_metadata()
            items = dict(metadata.state_dict_metadata)
        self.infos: Dict[str, TensorInfo] = {}
        self.torch_dtypes: Dict[str, Any] = {}
        self.cache: Dict[str, np.ndarray] = {}
        inverse = {getattr(torch, v): k for k, v in _TORCH.items()}
        for name, md in items.items():
            if not isinstance(md, TensorStorageMetadata):
                _log.warning("%s: %s is not a tensor (a pickled object); left out", self.path, name)
                continue
            with _torch_errors(self.path, str(name), "damaged .metadata entry"):
                tf_name = inverse.get(md.properties.dtype)
                if tf_name is None:
                    raise UnsupportedError(f"unsupported torch dtype {md.properties.dtype}", path=path, key=name)
                shape = tuple(int(d) for d in md.size)
                if any(d < 0 for d in shape):
                    raise DataLossError(f"negative size in shape {list(shape)}", path=self.path, key=name)
                dtype = as_dtype(tf_name)
                check_array_shape(shape, dtype.itemsize or 1, self.path, str(name))
            self.infos[name] = TensorInfo(name, dtype, shape)
            self.torch_dtypes[name] = md.properties.dtype

    def tensors(self) -> List[TensorInfo]:
        return list(self.infos.values())

    def read(self, name: str) -> np.ndarray:
        info = self.infos.get(name)
        if info is None:
            raise NotFoundError("no such tensor", path=self.path, key=name)
        if name not in self.cache:
            self.cache = {}  # read out of order: drop what was loaded ahead, memory stays bounded
            self._load_batch(name)
        return self.cache.pop(name)

    def _load_batch(self, name: str) -> None:
        """Load ``name`` and the tensors after it, up to the largest tensor's size in all (one ``dcp.load``)."""
        torch = _torch()
        import torch.distributed.checkpoint as dcp

        names = list(self.infos)
        budget = max((i.nbytes for i in self.infos.values()), default=0)
        batch: List[str] = []
        total = 0
        for n in names[names.index(name):]:
            if batch and total + self.infos[n].nbytes > budget:
                break
            batch.append(n)
            total += self.infos[n].nbytes
        holder = {n: torch.empty(self.infos[n].shape, dtype=self.torch_dtypes[n]) for n in batch}
        with warnings.catch_warnings(), _torch_errors(self.path, name, "cannot load its values"):
            warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
            dcp.load(holder, storage_reader=dcp.FileSystemReader(self.path), no_dist=True)
        self.cache = {n: to_numpy(holder[n], self.infos[n].dtype) for n in batch}


def _streaming_planner(infos: Sequence[TensorInfo], fetch: Fetch, path: str, progress: Progress) -> Any:
    """A ``DefaultSavePlanner`` that hands ``dcp.save`` each value when it writes it (see the module
    docstring); the class is made here so that torch stays an optional import."""
    _torch()
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import WriteItemType

    class Planner(DefaultSavePlanner):
        def __init__(self) -> None:
            super().__init__()
            self.index = {info.name: i for i, info in enumerate(infos)}
            self.pending: Optional[TensorInfo] = None  # resolved, being written
            self.error: Optional[BaseException] = None  # what fetching a value raised (torch wraps it)

        def placeholders(self) -> Dict[str, Any]:
            torch = _torch()
            return {info.name: torch.empty(info.shape, dtype=getattr(torch, _TORCH[info.dtype.name]),
                                           device="meta") for info in infos}

        def resolve_data(self, write_item: Any) -> Any:
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            self.done()  # the one resolved before is written by now
            i = self.index[write_item.index.fqn]
            try:
                value = fetch(i)
                check_value(value, infos[i], path)
            except BaseException as exc:
                self.error = exc
                raise
            self.pending = infos[i]
            return to_torch(value, infos[i].dtype)

        def done(self) -> None:
            if self.pending is not None:
                progress(self.pending.name, self.pending.nbytes)
                self.pending = None

    return Planner()


class DCPSink(Sink):
    format = "dcp"

    def check(self, infos: Sequence[TensorInfo]) -> None:
        _local(self.path)
        for info in infos:
            if info.dtype.name not in _TORCH:
                raise UnsupportedError(f"PyTorch DCP cannot hold dtype {info.dtype.name} (cast it with --dtype, or "
                                       "leave it out with --drop)", path=self.path, key=info.name)

    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        _torch()
        import torch.distributed.checkpoint as dcp

        final = _local(self.path).rstrip("/")
        parent = os.path.dirname(os.path.abspath(final))
        os.makedirs(parent, exist_ok=True)
        fs = get_fs(parent)
        temp, claim = temp_folder(fs, parent, os.path.basename(final))  # dead conversions' folders removed
        try:
            streaming = _streaming_planner(infos, fetch, final, progress)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
                # one data file per tensor: torch keeps every tensor of a data file until the file is done
                writer = dcp.FileSystemWriter(temp, single_file_per_rank=False)
                try:
                    dcp.save(streaming.placeholders(), storage_writer=writer, planner=streaming, no_dist=True)
                except BaseException:
                    if streaming.error is not None:  # the source's own error, not torch's wrapper of it
                        raise streaming.error from None
                    raise
            streaming.done()
            if os.path.isdir(final):
                if not os.path.isfile(os.path.join(final, ".metadata")) and os.listdir(final):
                    raise InvalidArgumentError("destination is a non-empty folder that is not a DCP checkpoint",
                                               path=final)
                shutil.rmtree(final)
            os.rename(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        finally:
            fs.release(claim)
        return [final]
