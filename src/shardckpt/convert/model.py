"""What the converters pass around: tensor descriptions, sources and sinks.

A conversion is a stream. A :class:`Source` lists its tensors (:class:`TensorInfo`:
name, dtype, shape) without reading values, and reads one tensor on demand. A
:class:`Sink` is told every output tensor first (so it can plan headers, shards
and refuse what it cannot hold before writing a byte), then pulls the values one
at a time through a ``fetch(i)`` callable and commits its output atomically.
At most one tensor (plus one converted copy) is held at a time.
"""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..format.dtypes import DType

__all__ = ["TensorInfo", "Source", "Sink", "Fetch", "Progress", "NO_PROGRESS"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor as a source or sink sees it: its name, TensorFlow-named dtype and shape."""

    name: str
    dtype: DType
    shape: Tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the value (strings and variants: 0, their size is unknown until read)."""
        return self.size * (self.dtype.itemsize or 0)


Fetch = Callable[[int], np.ndarray]
#: ``progress(name, nbytes)`` is called after each tensor is written.
Progress = Callable[[str, int], None]


def NO_PROGRESS(name: str, nbytes: int) -> None:  # noqa: N802 - a constant-like default
    """The progress callback that does nothing."""


class Source(abc.ABC):
    """A checkpoint read as a stream of tensors."""

    #: Short format name (``tf``, ``safetensors``, ``hf``, ``npz``, ``dcp``).
    format: str = ""
    path: str = ""

    @abc.abstractmethod
    def tensors(self) -> List[TensorInfo]:
        """Every tensor, in a stable order, without reading values."""

    @abc.abstractmethod
    def read(self, name: str) -> np.ndarray:
        """The whole value of tensor ``name`` (its dtype is ``info.dtype.numpy``)."""

    def read_into(self, name: str, out: np.ndarray) -> Optional[np.ndarray]:
        """Read numeric tensor ``name`` into ``out`` (its dtype and shape); None where not supported."""
        return None

    def check_stored(self, name: str) -> None:
        """Raise a :mod:`shardckpt.errors` error naming tensor ``name`` if its stored bytes do not justify
        its declared dtype and shape. Called for every output before anything is sized from them;
        sources that check every tensor when they are opened have nothing left to do here."""
        return None

    def metadata(self) -> Dict[str, str]:
        """Free-form string metadata the format carries (safetensors ``__metadata__``)."""
        return {}

    def close(self) -> None:
        """Release open files."""
        return None

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Sink(abc.ABC):
    """A destination written from a stream of tensors and committed atomically."""

    format: str = ""
    #: Whether every fetched value is written out (and no reference kept) before the
    #: next fetch, so the converter may read each value into one reused buffer.
    consumes_each_value: bool = False

    def __init__(self, path: str) -> None:
        self.path = path

    def check(self, infos: Sequence[TensorInfo]) -> None:
        """Raise a :mod:`shardckpt.errors` error naming the first tensor this format cannot hold."""
        return None

    @abc.abstractmethod
    def write(self, infos: Sequence[TensorInfo], fetch: Fetch, metadata: Dict[str, str],
              progress: Progress = NO_PROGRESS) -> List[str]:
        """Write every tensor (``fetch(i)`` is the value of ``infos[i]``), commit, return the files written."""
