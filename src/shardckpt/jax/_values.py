"""A ``jax.Array`` as a :class:`~shardckpt.saving.pieces.DistributedValue`.

Saving: the distinct pieces of the array are its shards with ``replica_id == 0``
(exactly one device in the whole job holds each such shard); a process lists the
ones among its ``addressable_shards``, each as a :class:`ShardableTensor` on its
device (``/job:localhost/replica:0/task:<process>/device:<PLATFORM>:<id>``) with
the shard's slice of the global shape (``""`` when one shard holds everything).
The bytes are taken (``np.asarray`` of the shard's data) only when the engine
writes or stages them. An async save of a shard on a CPU device stages no copy: it
holds the zero-copy NumPy view of the shard's buffer (see :class:`ShardBytes`).

Restoring: :func:`array_reads` is the restore engine's group of reads for a new array of
the wanted shape, dtype and sharding: each distinct region among this process's devices
is read once from the checkpoint (only the overlapping stored bytes; a stored piece that
several regions cut across, as columns cut row blocks, is read once, whole and checksummed,
and cut into them: the restore engine's shared pieces); once they are in,
``jax.make_array_from_callback`` places each on every local device that holds it.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import jax
import numpy as np

from ..errors import InvalidArgumentError
from ..format.dtypes import as_dtype
from ..format.tensor_slice import FULL, Box, TensorSlice, box_shape, box_volume, format_shape_and_slice, full_box
from ..restoring import Read, ReadGroup
from ..saving.staging import register_holder
from ..sharding.shardable import ShardableTensor

__all__ = ["JaxValue", "ShardBytes", "device_name", "box_of", "distinct_boxes", "array_reads"]


def device_name(device: Any) -> str:
    """A JAX device as a full device string (its process is the task)."""
    platform = str(getattr(device, "platform", "cpu")).upper()
    return f"/job:localhost/replica:0/task:{int(device.process_index)}/device:{platform}:{int(device.id)}"


def box_of(index: Tuple[slice, ...], shape: Sequence[int]) -> Box:
    """The box of a shard index (a tuple of slices, ``None`` bounds for whole dimensions)."""
    box = []
    for s, dim in zip(index, shape):
        start, stop, step = s.indices(int(dim))
        if step != 1:
            raise InvalidArgumentError(f"a shard index with step {step} is not a box")
        box.append((start, stop))
    return tuple(box) + full_box(shape[len(index):])


def distinct_boxes(sharding: Any, shape: Tuple[int, ...]) -> Dict[Box, List[Any]]:
    """This process's distinct regions of an array of ``shape`` laid out by ``sharding`` -> its devices holding it."""
    out: Dict[Box, List[Any]] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        out.setdefault(box_of(index, shape), []).append(device)
    return out


class JaxValue:
    """A ``jax.Array`` offered to the engine (:class:`~shardckpt.saving.pieces.DistributedValue`)."""

    def __init__(self, array: jax.Array) -> None:
        self.array = array

    def shardable_pieces(self, key: str, *, clients: int = 1, replica_writer: str = "lowest"
                         ) -> List[ShardableTensor]:
        """The shards with ``replica_id == 0`` that this process holds (``replica_writer`` is ignored:
        JAX's replica numbering decides)."""
        del replica_writer
        count = jax.process_count()
        if clients != count:
            raise InvalidArgumentError(f"the array lies on {count} processes, but {clients} clients are saving",
                                       key=key)
        shape = tuple(int(d) for d in self.array.shape)
        dtype = as_dtype(self.array.dtype)
        out = []
        for shard in self.array.addressable_shards:
            if shard.replica_id != 0:
                continue
            box = box_of(shard.index, shape)
            if box == full_box(shape):
                spec = ""
            else:
                extents = tuple((0, FULL) if (a, b) == (0, d) else (a, b - a) for (a, b), d in zip(box, shape))
                spec = format_shape_and_slice(shape, TensorSlice(extents))
            out.append(ShardableTensor(checkpoint_key=key, tensor=ShardBytes(shard.data), dtype=dtype,
                                       shape=box_shape(box), slice_spec=spec, device=device_name(shard.device)))
        return out

    @property
    def dtype(self) -> Any:
        """The array's dtype."""
        return self.array.dtype

    @property
    def shape(self) -> Tuple[int, ...]:
        """The array's global shape."""
        return tuple(int(d) for d in self.array.shape)

    def held_layout(self) -> Tuple[str, str]:
        """How the array lies, as the processes of a collective save compare it
        (:func:`~shardckpt.saving.agreement.describe_held`): its partition spec (else its sharding's
        type) and its mesh's axes (else its device count) with a digest of which device, on which
        process, holds which region."""
        return _held_sharding(self.array.sharding, self.shape)

    def restore_reads(self, key: str) -> List[ReadGroup]:
        """What replaces ``array`` with checkpoint ``key`` read onto the same sharding (JAX arrays are
        immutable): this process's distinct regions, the new array made once they are in."""
        shape, sharding = tuple(int(d) for d in self.array.shape), self.array.sharding
        return [array_reads(key, shape, self.array.dtype, sharding, self._replace)]

    def _replace(self, array: jax.Array) -> None:
        self.array = array


def _held_sharding(sharding: Any, shape: Tuple[int, ...]) -> Tuple[str, str]:
    try:
        return _held_sharding_cached(sharding, shape)
    except TypeError:  # a sharding that is not hashable
        return _held_sharding_cached.__wrapped__(sharding, shape)


@functools.lru_cache(maxsize=256)
def _held_sharding_cached(sharding: Any, shape: Tuple[int, ...]) -> Tuple[str, str]:
    spec = getattr(sharding, "spec", None)
    layout = str(tuple(spec)) if spec is not None else type(sharding).__name__
    placed = sorted((int(d.id), int(d.process_index), box_of(index, shape))
                    for d, index in sharding.devices_indices_map(shape).items())
    digest = hashlib.blake2b(json.dumps(placed).encode(), digest_size=4).hexdigest()
    mesh = getattr(sharding, "mesh", None)
    axes = getattr(mesh, "shape", None)
    where = ",".join(f"{n}={k}" for n, k in axes.items()) if isinstance(axes, Mapping) else f"{len(placed)} devices"
    return layout, f"{where} #{digest}"


class ShardBytes:
    """The bytes of one shard (a single-device ``jax.Array``), taken when called.

    Staging an async save holds, instead of copying, the bytes of a shard on a CPU
    device: there ``np.asarray`` is a read-only view of the device buffer that carries
    an external reference, and while such a reference lives JAX neither frees the
    buffer (``delete()``, garbage collection) nor donates it (a ``jit`` with
    ``donate_argnums`` then leaves the input alive and writes a new buffer), and
    ``jax.Array``s are otherwise immutable. On other platforms ``np.asarray`` is a
    fresh device-to-host copy, which staging copies into its reused buffers.
    """

    __slots__ = ("data",)

    def __init__(self, data: jax.Array) -> None:
        self.data = data

    def __call__(self) -> np.ndarray:
        return np.asarray(self.data)

    def held(self) -> Optional[np.ndarray]:
        """The bytes without a copy when they cannot change while referenced (CPU devices), else ``None``."""
        if self.data.is_deleted() or any(d.platform != "cpu" for d in self.data.devices()):
            return None
        return np.asarray(self.data)


register_holder(ShardBytes, ShardBytes.held)


def array_reads(key: str, shape: Tuple[int, ...], dtype: Any, sharding: Any,
                into: Callable[[jax.Array], Any]) -> ReadGroup:
    """The reads of checkpoint ``key`` onto ``sharding`` (this process's distinct regions, each once
    however many local devices replicate it); ``into(array)`` gets the new array once they are in
    (its host buffers are then dropped)."""
    boxes = list(distinct_boxes(sharding, shape))
    itemsize = int(np.dtype(dtype).itemsize)

    def made(regions: List[np.ndarray]) -> None:
        into(jax.make_array_from_callback(shape, sharding, _fetch_from(dict(zip(boxes, regions)), shape)))

    return ReadGroup(tuple(Read(key, box) for box in boxes), made, sum(region_bytes(b, itemsize) for b in boxes))


def _fetch_from(host: Dict[Box, np.ndarray], shape: Tuple[int, ...]) -> Callable[[Any], np.ndarray]:
    def fetch(index: Optional[Tuple[slice, ...]]) -> np.ndarray:
        return host[box_of(index or (), shape)]
    return fetch


def region_bytes(box: Box, itemsize: int) -> int:
    """Bytes of one region."""
    return box_volume(box) * itemsize
