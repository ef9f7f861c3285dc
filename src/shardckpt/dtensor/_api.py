"""DTensor values: this client's components of a tensor laid out over a mesh.

``pack`` / ``unpack`` convert between a :class:`DTensor` and its local components
(one NumPy array per local device, in the mesh's local device order);
``from_global`` cuts this client's pieces out of a full array; ``to_global``
gathers the full array from every client.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from ..format.bundle_reader import BundleReader
from ..format.bundle_writer import byte_view
from ..format.tensor_slice import Box, box_shape
from .layout import Layout

__all__ = ["DTensor", "pack", "unpack", "from_global", "to_global", "fetch_layout"]


class DTensor:
    """A tensor of global ``shape`` laid out by ``layout``; holds this client's components.

    ``components[device_id]`` is the local array of that device. Replicas of one
    piece on this client share no memory (each device has its own copy, as on
    real devices).
    """

    def __init__(self, layout: Layout, shape: Sequence[int], components: Dict[int, np.ndarray]) -> None:
        self.layout = layout
        self.shape: Tuple[int, ...] = tuple(int(d) for d in shape)
        local = layout.mesh.local_device_ids()
        if sorted(components) != sorted(local):
            raise InvalidArgumentError(f"components for devices {sorted(components)}, but this client's devices "
                                       f"are {local}")
        dtypes = {c.dtype for c in components.values()}
        if len(dtypes) != 1:
            raise InvalidArgumentError(f"components have different dtypes: {dtypes}")
        self.dtype: np.dtype = dtypes.pop()
        for device, component in components.items():
            want = box_shape(layout.box(device, self.shape))
            if tuple(component.shape) != want:
                raise InvalidArgumentError(f"component of device {device} has shape {list(component.shape)}, "
                                           f"layout {layout.sharding_specs} needs {list(want)}")
        self.components = components

    def box(self, device_id: int) -> Box:
        return self.layout.box(device_id, self.shape)

    def local_pieces(self) -> Dict[Box, List[int]]:
        """Distinct pieces held by this client -> its devices holding them."""
        out: Dict[Box, List[int]] = {}
        for device in self.layout.mesh.local_device_ids():
            out.setdefault(self.box(device), []).append(device)
        return out

    def shardable_pieces(self, key: str, replica_writer: str = "lowest") -> List[Any]:
        """The pieces this client writes when saved under ``key`` by a single-client ``Checkpoint``."""
        if self.layout.mesh.num_clients != 1:
            raise InvalidArgumentError(f"{key!r} lies on a mesh of several clients: save it with "
                                       "dtensor.DTensorCheckpoint or dtensor.sharded_save")
        from .save import dtensor_pieces

        return dtensor_pieces(key, self, replica_writer)

    def restore_from(self, reader: BundleReader, key: str) -> None:
        """Fill the components from checkpoint ``key``: each distinct local piece is read once
        (only the bytes overlapping it), then copied to the other local replicas."""
        for box, devices in self.local_pieces().items():
            first = self.components[devices[0]]
            reader.read_region(key, box, out=first)
            for other in devices[1:]:
                np.copyto(self.components[other], first)

    def __repr__(self) -> str:
        return f"DTensor(shape={list(self.shape)}, dtype={self.dtype}, layout={self.layout.sharding_specs})"


def pack(components: Sequence[Any], layout: Layout) -> DTensor:
    """A DTensor from one array per local device (in the mesh's local device order)."""
    local = layout.mesh.local_device_ids()
    if len(components) != len(local):
        raise InvalidArgumentError(f"pack needs {len(local)} components (one per local device), got {len(components)}")
    arrays = [np.array(c, copy=True, order="C") for c in components]
    global_shape = layout.global_shape(arrays[0].shape)
    return DTensor(layout, global_shape, dict(zip(local, arrays)))


def unpack(tensor: DTensor) -> List[np.ndarray]:
    """The local components, in the mesh's local device order."""
    return [tensor.components[d] for d in tensor.layout.mesh.local_device_ids()]


def from_global(array: Any, layout: Layout) -> DTensor:
    """This client's pieces of the full ``array`` (copies)."""
    full = np.asarray(array)
    components = {}
    for device in layout.mesh.local_device_ids():
        box = layout.box(device, full.shape)
        components[device] = np.array(full[tuple(slice(a, b) for a, b in box)], copy=True, order="C")
    return DTensor(layout, full.shape, components)


def fetch_layout(tensor: DTensor) -> Layout:
    return tensor.layout


def to_global(tensor: DTensor, coordinator: Optional[Any] = None) -> np.ndarray:
    """The full array on every client, gathered from the clients' components."""
    from ..distributed import get_coordinator

    coordinator = coordinator or get_coordinator()
    if tensor.layout.mesh.num_clients != coordinator.size:
        raise InvalidArgumentError(f"the tensor lies on a mesh of {tensor.layout.mesh.num_clients} clients, "
                                   f"but the coordinator has {coordinator.size}")
    out = np.empty(tensor.shape, dtype=tensor.dtype)
    mesh = tensor.layout.mesh
    holders = tensor.layout.distinct_boxes(tensor.shape)
    mine = set(mesh.local_device_ids())
    if out.dtype == object:
        raise InvalidArgumentError("to_global of string tensors is not supported")
    for box, devices in holders.items():  # the same order on every client
        owner = devices[0]
        index = tuple(slice(a, b) for a, b in box)
        source = mesh.client_of(owner)
        if owner in mine:
            out[index] = tensor.components[owner]
        if coordinator.size == 1:
            continue
        for peer in range(coordinator.size):  # the owner sends its piece to every other client
            if peer == source:
                continue
            if coordinator.rank == source:
                coordinator.send_bytes(byte_view(np.ascontiguousarray(tensor.components[owner])), peer)
            elif coordinator.rank == peer:
                piece = np.empty(box_shape(box), dtype=tensor.dtype)
                coordinator.recv_bytes(source, piece.nbytes, byte_view(piece))
                out[index] = piece
    return out
