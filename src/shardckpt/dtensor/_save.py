"""Collective saves of DTensors: ``sharded_save``, ``name_based_save`` / ``name_based_restore`` and
``DTensorCheckpoint`` (the compatible name: a ``Checkpoint`` holding multi-client DVariables
saves collectively by itself, :mod:`shardckpt.checkpoint.collective`).

Each distinct piece of a DTensor is written once, by the client holding its
writer device: the lowest device id that holds it (as TensorFlow DTensor does)
or, with ``replica_writer="balanced"``, the replicas take turns piece by piece.
Pieces go to one shard per device (TF DTensor's layout of files); values that
are not DTensors are written by the io client. Every client also lists every value
it holds, written by it or not (name, dtype, global shape, layout, mesh): the save
commits only when those lists are the same on every client
(:mod:`shardckpt.saving.agreement`, step 3), so a replicated variable that one client
lacks or names otherwise fails the save on every client instead of vanishing.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..checkpoint.checkpoint import Checkpoint
from ..checkpoint.collective import Collective, collective_options
from ..checkpoint.graph import SaveableGraph
from ..distributed import get_coordinator
from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError, NotFoundError
from ..format.dtypes import as_dtype
from ..format.tensor_slice import FULL, TensorSlice, format_shape_and_slice, full_box
from ..restoring import BundleSource, PieceSource, RestorePlan, collective_call, funnelled_reader, run
from ..saving.agreement import Held, describe_held
from ..saving.distributed import io_rank_of, save_tensors_distributed
from ..saving.options import CheckpointOptions
from ..saving.pieces import pieces_of
from ..sharding.shardable import ShardableTensor
from ._api import DTensor, as_dtensor, client_device, get_default_mesh, is_dtensor
from ._layout import UNSHARDED
from ._mesh import Mesh

__all__ = ["sharded_save", "name_based_save", "name_based_restore", "DTensorCheckpoint", "dtensor_pieces"]


def dtensor_pieces(key: str, value: DTensor, replica_writer: str = "lowest") -> List[ShardableTensor]:
    """The pieces of ``value`` this client writes, as :class:`ShardableTensor` on their writer devices."""
    if replica_writer not in ("lowest", "balanced"):
        raise InvalidArgumentError(f"replica_writer must be 'lowest' or 'balanced', got {replica_writer!r}")
    mesh = value.layout.mesh
    local = set(mesh.local_device_ids())
    out = []
    for index, (box, holders) in enumerate(value.layout.distinct_boxes(value.shape).items()):
        writer = holders[0] if replica_writer == "lowest" else holders[index % len(holders)]
        if writer not in local:
            continue
        if box == full_box(value.shape):
            spec = ""
        else:  # as TF DTensor: an unsharded dimension is '-', a sharded one 'start,length'
            extents = tuple((0, FULL) if s == UNSHARDED else (a, b - a)
                            for s, (a, b) in zip(value.layout.sharding_specs, box))
            spec = format_shape_and_slice(value.shape, TensorSlice(extents))
        out.append(ShardableTensor.from_value(key, value.components[writer], slice_spec=spec,
                                              device=mesh.device_name(writer)))
    return out


def sharded_save(mesh: Mesh, file_prefix: str, tensor_names: Sequence[str], shape_and_slices: Sequence[str],
                 tensors: Sequence[Any], options: Optional[CheckpointOptions] = None, *,
                 coordinator: Optional[Coordinator] = None, replica_writer: str = "lowest",
                 timeout: Optional[float] = None) -> str:
    """Collectively save DTensors (and plain arrays, written once by the io client) at ``file_prefix``.

    Every client calls it with the same names. As in TensorFlow, ``shape_and_slices``
    must be empty strings: the layouts say where each piece lies.
    """
    if not (len(tensor_names) == len(shape_and_slices) == len(tensors)):
        raise InvalidArgumentError("tensor_names, shape_and_slices and tensors must have the same length")
    if any(s for s in shape_and_slices):
        raise InvalidArgumentError("sharded_save takes only empty shape_and_slices (layouts place the pieces)")
    coordinator = coordinator or get_coordinator()
    options = collective_options(options)
    io = io_rank_of(options, coordinator.size)
    local: List[ShardableTensor] = []
    values = [(name, as_dtensor(value) if is_dtensor(value) else value) for name, value in zip(tensor_names, tensors)]
    for name, value in values:
        local += pieces_of(name, value, clients=coordinator.size, writes_whole=coordinator.rank == io,
                           device=client_device(mesh, io), replica_writer=replica_writer)
    return save_tensors_distributed(os.fspath(file_prefix), local, options, coordinator, io_rank=io,
                                    timeout=timeout, held=_held(values, coordinator))


def name_based_save(mesh: Mesh, checkpoint_prefix: str, name_tensor_dict: Mapping[str, Any],
                    options: Optional[CheckpointOptions] = None) -> str:
    """Collectively save ``{name: DTensor or DVariable}`` under those names (``dtensor.name_based_save``).

    Every client calls it with the same names. Unlike TensorFlow (one mesh for every
    tensor), each value may lie on its own mesh, as long as the meshes span the
    same clients; plain NumPy values are written once, by the io client.
    """
    names = list(name_tensor_dict)
    return sharded_save(mesh, checkpoint_prefix, names, [""] * len(names), [name_tensor_dict[n] for n in names],
                        options)


def name_based_restore(mesh: Mesh, checkpoint_prefix: str, name_tensor_dict: Mapping[str, Any], *,
                       options: Optional[CheckpointOptions] = None,
                       coordinator: Optional[Coordinator] = None) -> "OrderedDict[str, DTensor]":
    """Read ``{name: DTensor or DVariable}`` from ``checkpoint_prefix`` onto their own layouts
    (``dtensor.name_based_restore``): returns new DTensors, name -> value, in the given order.

    Each client reads only the bytes of its own pieces; the checkpoint may have been
    written with any layout, mesh or number of clients. Dtypes and shapes must match
    the checkpoint's (checked for every name before any value is read). Unlike
    TensorFlow, the values may lie on different meshes. ``mesh`` is accepted for
    TensorFlow's signature (the values' layouts carry their meshes). With
    ``options.io_device`` naming a client (and several clients), only that client reads:
    the call is then collective (``coordinator``: default the process-wide one).
    """
    del mesh
    source = (funnelled_reader(os.fspath(checkpoint_prefix), options, coordinator or get_coordinator())
              or BundleSource.open(os.fspath(checkpoint_prefix)))
    try:
        with collective_call(source):
            targets = _targets(source, checkpoint_prefix, name_tensor_dict)
            run(RestorePlan.of(source, [read for name, target in targets.items()
                                        for read in target.restore_reads(name)]))
        return targets
    finally:
        source.close()


def _targets(reader: PieceSource, checkpoint_prefix: str,
             name_tensor_dict: Mapping[str, Any]) -> "OrderedDict[str, DTensor]":
    """A new DTensor for every name, on the given value's layout, each checked against the checkpoint."""
    targets: "OrderedDict[str, DTensor]" = OrderedDict()
    for name, tensor in name_tensor_dict.items():
        if not is_dtensor(tensor):
            raise InvalidArgumentError(f"name_based_restore: {name!r} must be a DTensor or DVariable, got "
                                       f"{type(tensor).__name__}")
        like = as_dtensor(tensor)
        if name not in reader:
            raise NotFoundError("no such tensor in the checkpoint", path=checkpoint_prefix, key=name)
        stored, shape = reader.dtype(name), tuple(reader.shape(name))
        if stored.enum != as_dtype(like.dtype).enum or shape != like.shape:
            raise InvalidArgumentError(f"the checkpoint holds {stored.name}{list(shape)}, the tensor is "
                                       f"{as_dtype(like.dtype).name}{list(like.shape)}",
                                       path=checkpoint_prefix, key=name)
        targets[name] = DTensor(like.layout, like.shape,
                                {d: np.empty_like(c) for d, c in like.components.items()})
    return targets


def _held(values: Sequence[Tuple[str, Any]], coordinator: Coordinator) -> Optional[List[Held]]:
    """What this client holds, for the clients to agree on before the save commits (several clients only)."""
    return describe_held(values) if coordinator.size > 1 else None


class DTensorCheckpoint(Checkpoint):
    """``Checkpoint`` over DVariables and ordinary variables, saved collectively by every client.

    The compatible name TensorFlow deprecates in favour of ``tf.train.Checkpoint``: a
    :class:`~shardckpt.Checkpoint` holding DVariables of a mesh of several clients saves
    them collectively too, with the same guarantees (agreement on the pieces, atomic
    commit, ``enable_async``; see :mod:`shardckpt.checkpoint.collective`). This class adds
    a ``mesh`` (whose io client's first device writes the values that are not laid out), an
    explicit ``coordinator`` and ``replica_writer``, and is collective even on one client.

    All clients build the same object graph and call ``save``/``write``/``restore``
    together; each writes its own pieces, the io client commits and updates the
    ``checkpoint`` file. A restore reads on each client only the bytes of its own
    components, whatever mesh and layout wrote the checkpoint.
    """

    def __init__(self, mesh: Optional[Mesh] = None, root: Optional[Any] = None, *,
                 coordinator: Optional[Coordinator] = None, replica_writer: str = "lowest", **kwargs: Any) -> None:
        mesh = mesh if mesh is not None else get_default_mesh()
        if mesh is None:
            raise InvalidArgumentError("DTensorCheckpoint needs a mesh (or a dtensor.default_mesh block)")
        object.__setattr__(self, "_mesh", mesh)
        object.__setattr__(self, "_coordinator", coordinator)
        object.__setattr__(self, "_replica_writer", replica_writer)
        super().__init__(root, **kwargs)

    @property
    def mesh(self) -> Mesh:
        """The mesh given at construction (its io client's first device writes the non-DTensor values)."""
        return self._mesh  # type: ignore[attr-defined, no-any-return]

    def _collective(self, graph: Optional[SaveableGraph] = None) -> Collective:
        """Always collective: over the given coordinator (else the process's), through ``mesh``'s devices."""
        mesh = self.mesh
        return Collective(self._coordinator or get_coordinator(),  # type: ignore[attr-defined]
                          lambda rank: client_device(mesh, rank), self._replica_writer)  # type: ignore[attr-defined]
