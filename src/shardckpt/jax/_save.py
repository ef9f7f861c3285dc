"""``save``: a pytree of (sharded) ``jax.Array``s and plain values, collectively, through the one engine.

Every process calls ``save(path, pytree)`` with the same structure. Each lists
what it writes: of every ``jax.Array`` the shards it holds with
``replica_id == 0`` (so each distinct piece is written once in the whole job);
the non-array leaves and the structure (:data:`~shardckpt.jax._tree.METADATA_KEY`)
are written by the io process. Every process also lists every leaf it holds (key,
dtype, global shape, sharding): the save commits only when those lists agree on every
process (:mod:`shardckpt.saving.agreement`), so a replicated leaf that one process lacks
or names otherwise fails the save everywhere instead of vanishing. The pieces go to
:func:`~shardckpt.saving.save_tensors_distributed`, the engine every front door
shares: one shard (one data file) per device by default, written in parallel,
merged and committed atomically by the io process (see
:mod:`shardckpt.saving.engine` for what is on disk at each step). The collectives
run over :func:`default_coordinator`: one process needs none; several use JAX's
own distributed runtime (:class:`~shardckpt.distributed.jax_backend.JaxCoordinator`).

With ``CheckpointOptions(enable_async=True)`` the device data is snapshotted, the
call returns, and the write and commit run in the background;
:func:`wait_until_finished` waits for them and raises their error. The snapshot of
a shard on a CPU device is a zero-copy hold of its buffer (JAX neither frees nor
donates a buffer while it is held, see :class:`~shardckpt.jax._values.ShardBytes`),
released once written; other shards are copied to the saver's reused host staging
buffers (device-to-host copies are started for all shards first). What the caller
waits for is then planning plus those copies.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import jax

from ..distributed.coordinator import Coordinator
from ..distributed.single import SingleProcessCoordinator
from ..errors import InvalidArgumentError
from ..runtime import runtime
from ..saving.agreement import describe_held
from ..saving.async_save import AsyncSaver
from ..saving.context import default_context
from ..saving.distributed import io_rank_of, save_tensors_distributed
from ..saving.options import CheckpointOptions
from ..saving.pieces import pieces_of
from ..sharding.callback import ShardByDevicePolicy
from ..sharding.shardable import ShardableTensor, canonical_device
from ._tree import METADATA_KEY, encode_metadata, host_value, leaf_kind, leaves_with_keys
from ._values import JaxValue

__all__ = ["save", "default_coordinator", "wait_until_finished"]

#: The key of JAX's coordinator in the runtime's keyed cache: ``(JAX_WORLD, jax.process_count())``.
JAX_WORLD = "jax world"


def default_coordinator() -> Coordinator:
    """The process's coordinator for JAX saves: single-process, or over JAX's distributed runtime
    when ``jax.process_count() > 1`` (made once per process count and kept by the process's
    :mod:`~shardckpt.runtime`, so async saves reuse its background clone)."""
    count = jax.process_count()

    def make() -> Coordinator:
        if count == 1:
            return SingleProcessCoordinator()
        from ..distributed.jax_backend import JaxCoordinator

        return JaxCoordinator()

    return runtime().keep((JAX_WORLD, count), make)


def wait_until_finished() -> None:
    """Wait for the asynchronous save in flight (if any) to commit; raise its error if it failed."""
    default_context().saver().wait()


def save(path: "str | os.PathLike[str]", pytree: Any, *, options: Optional[CheckpointOptions] = None,
         coordinator: Optional[Coordinator] = None, timeout: Optional[float] = None) -> str:
    """Save ``pytree`` as a checkpoint at prefix ``path`` (``<path>.index`` + ``<path>.data-*``); return ``path``.

    Collective: every process calls it with the same structure. Leaves may be
    ``jax.Array`` (any sharding, on any processes), NumPy arrays, ``bool``, ``int``,
    ``float``, ``str`` and ``bytes``; ``None`` and empty containers keep their place
    in the saved structure. Keys are the leaves' paths (``params/dense/kernel``).
    ``options`` are :class:`~shardckpt.CheckpointOptions` (default sharding: one shard
    per device); ``timeout`` bounds each collective step (a process that does not
    arrive is named).
    """
    return save_pytree(os.fspath(path), pytree, options, coordinator=coordinator, timeout=timeout)


def save_pytree(path: str, pytree: Any, options: Optional[CheckpointOptions], *,
                coordinator: Optional[Coordinator] = None, timeout: Optional[float] = None,
                extra_metadata: Optional[Dict[str, Any]] = None,
                on_commit: Optional[Callable[[str], None]] = None, saver: Optional[AsyncSaver] = None,
                on_failure: Optional[Callable[[], None]] = None) -> str:
    """:func:`save` with a front door's hooks (the state file, its own async saver, metadata fields)."""
    coordinator = coordinator or default_coordinator()
    if coordinator.size != jax.process_count() or coordinator.rank != jax.process_index():
        raise InvalidArgumentError(f"the coordinator is rank {coordinator.rank} of {coordinator.size}, JAX is "
                                   f"process {jax.process_index()} of {jax.process_count()}")
    options = options or CheckpointOptions()
    if options.sharding_callback is None:
        options = options.replace(sharding_callback=ShardByDevicePolicy())
    io = io_rank_of(options, coordinator.size)
    is_io = coordinator.rank == io
    io_device = canonical_device(f"/task:{io}")
    pieces: List[ShardableTensor] = []
    kinds: Dict[str, str] = {}
    arrays: List[jax.Array] = []
    values: List[Tuple[str, Any]] = []  # what this process holds, for the processes to agree on
    for key, leaf in leaves_with_keys(pytree):
        kind = leaf_kind(key, leaf)
        kinds[key] = kind
        if kind == "jax":
            arrays.append(leaf)
            values.append((key, JaxValue(leaf)))
            pieces += pieces_of(key, values[-1][1], clients=coordinator.size)
        else:
            values.append((key, host_value(key, kind, leaf)))
            pieces += pieces_of(key, values[-1][1], clients=coordinator.size, writes_whole=is_io, device=io_device)
    if is_io:
        pieces.append(ShardableTensor.from_value(METADATA_KEY, encode_metadata(pytree, kinds, extra_metadata),
                                                 device=io_device))
    if options.enable_async:  # start every device-to-host copy before staging waits on the first
        for array in arrays:
            for shard in array.addressable_shards:
                if shard.replica_id == 0:
                    shard.data.copy_to_host_async()
    return save_tensors_distributed(path, pieces, options, coordinator, io_rank=io, timeout=timeout,
                                    on_commit=on_commit, saver=saver, on_failure=on_failure,
                                    held=describe_held(values) if coordinator.size > 1 else None)
