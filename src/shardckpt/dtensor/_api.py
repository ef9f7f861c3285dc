"""DTensor values: this client's components of a tensor laid out over a mesh.

``pack`` / ``unpack`` convert between a :class:`DTensor` and its local components
(one NumPy array per local device, in the mesh's local device order);
``from_global`` cuts this client's pieces out of a full array; ``to_global``
gathers the full array from every client; ``relayout`` / ``copy_to_mesh`` move a
value onto another layout or mesh. Every function that takes a DTensor also takes
a :class:`~shardckpt.dtensor.DVariable` (its current value is used).

Collective functions (``to_global`` on several clients, ``relayout``,
``copy_to_mesh`` of a DTensor, ``barrier``) must be called by every client in the
same order, as TensorFlow's SPMD ops are.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..checkpoint.convert import convert_python_value
from ..errors import InvalidArgumentError
from ..format.bundle_writer import byte_view
from ..format.tensor_slice import Box, box_shape
from ..restoring import Read, RestorePlan, as_source, run
from ..sharding.shardable import canonical_device
from ._layout import Layout
from ._mesh import Mesh

__all__ = ["DTensor", "pack", "unpack", "from_global", "to_global", "fetch_layout", "relayout", "copy_to_mesh",
           "is_dtensor", "num_clients", "client_id", "barrier", "default_mesh", "get_default_mesh", "as_dtensor"]


def as_dtensor(tensor: Any, what: str = "tensor") -> "DTensor":
    """``tensor`` itself when it is a DTensor, a DVariable's current value, else ``TypeError``."""
    if isinstance(tensor, DTensor):
        return tensor
    value = getattr(tensor, "_shardckpt_dtensor", None)
    if value is not None:
        return value()  # type: ignore[no-any-return]
    raise TypeError(f"{what} must be a DTensor or a DVariable, got {type(tensor).__name__}")


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
        """The region of the global tensor that device ``device_id`` holds."""
        return self.layout.box(device_id, self.shape)

    def local_pieces(self) -> Dict[Box, List[int]]:
        """Distinct pieces held by this client -> its devices holding them."""
        out: Dict[Box, List[int]] = {}
        for device in self.layout.mesh.local_device_ids():
            out.setdefault(self.box(device), []).append(device)
        return out

    @property
    def spanned_clients(self) -> int:
        """How many clients hold pieces of this value (its mesh's clients): a ``Checkpoint`` holding a
        value of several clients saves collectively."""
        return self.layout.mesh.num_clients

    def device_of_client(self, rank: int) -> str:
        """The device through which client ``rank`` writes the values that are not laid out (the
        lowest device of this value's mesh on that client) in a collective save."""
        return client_device(self.layout.mesh, rank)

    def shardable_pieces(self, key: str, *, clients: int = 1, replica_writer: str = "lowest") -> List[Any]:
        """The distinct pieces this client writes under ``key`` when ``clients`` clients save together
        (:class:`~shardckpt.saving.pieces.DistributedValue`)."""
        if self.layout.mesh.num_clients != clients:
            if clients == 1:
                raise InvalidArgumentError(f"{key!r} lies on a mesh of {self.layout.mesh.num_clients} clients: "
                                           "every client must save it together (Checkpoint.save, "
                                           "dtensor.sharded_save), not one client alone")
            raise InvalidArgumentError(f"{key!r} lies on a mesh of {self.layout.mesh.num_clients} clients, "
                                       f"but {clients} clients are saving")
        from ._save import dtensor_pieces

        return dtensor_pieces(key, self, replica_writer)

    def held_layout(self) -> Tuple[str, str]:
        """How this value lies, as clients of a collective save compare it: its sharding specs, and its
        mesh's dimensions with a digest of its device ids, their clients and type (not its name)."""
        layout = self.layout
        told = layout.__dict__.get("_held_layout")  # once per layout object (layouts are not changed in place)
        if told is None or told[0] != layout.sharding_specs:
            told = layout.__dict__["_held_layout"] = (list(layout.sharding_specs), ",".join(layout.sharding_specs),
                                                      _mesh_signature(layout.mesh))
        return told[1], told[2]

    def restore_reads(self, key: str) -> List[Read]:
        """What fills the components from checkpoint ``key``: each distinct local piece read once
        (only the bytes overlapping it), then copied to the other local replicas."""
        reads = []
        for box, devices in self.local_pieces().items():
            first = self.components[devices[0]]
            others = [self.components[d] for d in devices[1:]]
            reads.append(Read(key, box, first, then=_copy_to(others) if others else None))
        return reads

    def restore_from(self, reader: Any, key: str) -> None:
        """Fill the components from checkpoint ``key`` of ``reader`` (a ``BundleReader`` or a restore
        source; a funnelled one fills them when its call ends)."""
        run(RestorePlan.of(as_source(reader), self.restore_reads(key)))

    @property
    def rank(self) -> int:
        """Number of dimensions."""
        return len(self.shape)

    def numpy(self) -> np.ndarray:
        """The global value, on a single client (several clients: use ``to_global``, a collective)."""
        if self.layout.mesh.num_clients != 1:
            raise InvalidArgumentError(f"numpy() of a DTensor on a mesh of {self.layout.mesh.num_clients} clients "
                                       "would need the other clients' pieces: call dtensor.to_global(tensor) on "
                                       "every client")
        return to_global(self)

    def __repr__(self) -> str:
        return f"DTensor(shape={list(self.shape)}, dtype={self.dtype}, layout={self.layout.sharding_specs})"


def _copy_to(others: List[np.ndarray]) -> Callable[[np.ndarray], None]:
    def copy(first: np.ndarray) -> None:
        for other in others:
            np.copyto(other, first)
    return copy


def client_device(mesh: Mesh, rank: int) -> str:
    """The name of client ``rank``'s lowest device of ``mesh`` (a task's CPU when it holds none)."""
    devices = [d for d in mesh.global_device_ids().reshape(-1).tolist() if mesh.client_of(d) == rank]
    return mesh.device_name(min(devices)) if devices else canonical_device(f"/task:{rank}")


def _mesh_signature(mesh: Mesh) -> str:
    """``x=2,y=4 #<digest>``: the same on every client of one mesh (computed once per mesh object)."""
    cached = mesh.__dict__.get("_held_signature")
    if cached is None:
        ids = mesh.global_device_ids().reshape(-1).tolist()
        what = [mesh.device_type(), mesh.dim_names, list(mesh.shape), ids, [mesh.client_of(d) for d in ids]]
        digest = hashlib.blake2b(json.dumps(what).encode(), digest_size=4).hexdigest()
        cached = mesh.__dict__["_held_signature"] = ",".join(f"{n}={s}" for n, s in zip(mesh.dim_names, mesh.shape)) \
            + f" #{digest}"
    return str(cached)


def pack(components: Sequence[Any], layout: Layout) -> DTensor:
    """A DTensor from one array per local device (in the mesh's local device order)."""
    local = layout.mesh.local_device_ids()
    if len(components) != len(local):
        raise InvalidArgumentError(f"pack needs {len(local)} components (one per local device), got {len(components)}")
    arrays = [convert_python_value(c) for c in components]
    global_shape = layout.global_shape(arrays[0].shape)
    return DTensor(layout, global_shape, dict(zip(local, arrays)))


def unpack(tensor: Any) -> List[np.ndarray]:
    """The local components of a DTensor or DVariable, in the mesh's local device order (live arrays)."""
    tensor = as_dtensor(tensor)
    return [tensor.components[d] for d in tensor.layout.mesh.local_device_ids()]


def from_global(array: Any, layout: Layout) -> DTensor:
    """This client's pieces of the full ``array`` (copies)."""
    full = array if isinstance(array, np.ndarray) else convert_python_value(array)
    components = {}
    for device in layout.mesh.local_device_ids():
        box = layout.box(device, full.shape)
        components[device] = np.array(full[tuple(slice(a, b) for a, b in box)], copy=True, order="C")
    return DTensor(layout, full.shape, components)


def fetch_layout(tensor: Any) -> Layout:
    """The layout of a DTensor or DVariable."""
    return as_dtensor(tensor).layout


def is_dtensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a DTensor or a DVariable (TF: a tensor placed on the DTensor device)."""
    return isinstance(tensor, DTensor) or getattr(tensor, "_shardckpt_dtensor", None) is not None


def _coordinator(coordinator: Optional[Any]) -> Any:
    from ..distributed import get_coordinator

    return coordinator or get_coordinator()


def num_clients() -> int:
    """Number of client processes (the coordinator's size: ``torchrun``/``mpiexec`` world, else 1)."""
    return int(_coordinator(None).size)


def client_id() -> int:
    """This client's id (the coordinator's rank)."""
    return int(_coordinator(None).rank)


def barrier(mesh: Mesh, barrier_name: Optional[str] = None, timeout_in_ms: Optional[int] = None) -> None:
    """Wait until every client reached this barrier (``dtensor.barrier``); a timeout raises
    :class:`~shardckpt.distributed.coordinator.CoordinationTimeout`."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"barrier needs a Mesh, got {type(mesh).__name__}")
    coordinator = _coordinator(None)
    if mesh.num_clients != coordinator.size:
        raise InvalidArgumentError(f"the mesh spans {mesh.num_clients} clients, but the coordinator has "
                                   f"{coordinator.size}")
    timeout = None if timeout_in_ms is None else timeout_in_ms / 1000.0
    coordinator.barrier(barrier_name or "dtensor.barrier", timeout=timeout)


_DEFAULT = threading.local()


@contextlib.contextmanager
def default_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Within the block, ``get_default_mesh()`` is ``mesh`` (and ``DTensorCheckpoint()`` without a mesh uses it)."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"Expect `mesh` to be `Mesh`, got {type(mesh).__name__}")
    stack = _DEFAULT.__dict__.setdefault("stack", [])
    stack.append(mesh)
    try:
        yield mesh
    finally:
        stack.pop()


def get_default_mesh() -> Optional[Mesh]:
    """The mesh of the innermost ``default_mesh`` block of this thread, or ``None``."""
    stack = _DEFAULT.__dict__.get("stack")
    return stack[-1] if stack else None


def relayout(tensor: Any, layout: Layout, name: Optional[str] = None,
             coordinator: Optional[Any] = None) -> DTensor:
    """The same value laid out by ``layout`` (a new DTensor; collective on several clients).

    The target mesh may differ from the source mesh (TF requires the same mesh; this
    is ``copy_to_mesh`` there) as long as both span the same clients. On several
    clients the full value is gathered on each client first (simple, not memory-lean).
    """
    source = as_dtensor(tensor)
    if not isinstance(layout, Layout):
        raise TypeError(f"relayout needs a Layout, got {type(layout).__name__}")
    if layout.mesh.num_clients != source.layout.mesh.num_clients:
        raise InvalidArgumentError(f"cannot relayout from a mesh of {source.layout.mesh.num_clients} clients to one "
                                   f"of {layout.mesh.num_clients}")
    if source.layout.mesh.num_clients == 1:
        full = np.empty(source.shape, dtype=source.dtype)
        for box, devices in source.local_pieces().items():
            full[tuple(slice(a, b) for a, b in box)] = source.components[devices[0]]
    else:
        full = to_global(source, coordinator)
    return from_global(full, layout)


def copy_to_mesh(tensor: Any, layout: Layout, source_layout: Optional[Layout] = None) -> DTensor:
    """Put a value onto ``layout``'s mesh: a NumPy value (the global value, on every client) is cut
    into this client's pieces; a DTensor or DVariable is relaid out (collective on several clients).

    TensorFlow accepts only replicated target layouts for regular tensors; any layout works here.
    """
    if is_dtensor(tensor):
        return relayout(tensor, layout)
    if source_layout is not None and not source_layout.is_fully_replicated():
        raise InvalidArgumentError("a non-DTensor value can only come from a replicated source_layout")
    return from_global(tensor, layout)


def to_global(tensor: Any, coordinator: Optional[Any] = None) -> np.ndarray:
    """The full array on every client, gathered from the clients' components (a DTensor or DVariable)."""
    tensor = as_dtensor(tensor)
    coordinator = _coordinator(coordinator)
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
