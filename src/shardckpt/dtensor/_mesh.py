"""``Mesh``: a named grid of devices spread over clients (``tf.experimental.dtensor.Mesh``).

String form (TensorFlow's, so that strings cross between the libraries)::

    <name>|<dim>=<size>,...|<global ids>|<local ids>|<local devices>[|<global devices>][|use_xla_spmd]

ids and devices are comma-separated; ``global devices`` (full device names of every
device, in id order) is written only when it was given or when the clients do not
own equal consecutive blocks of ids. Reading a string without it, device ``d``
belongs to client ``d // k`` where ``k`` is the number of local devices (the layout
``create_distributed_mesh`` makes); the local devices' task names this client.
"""

from __future__ import annotations

import os
import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["Mesh", "create_mesh", "create_distributed_mesh", "device_name", "job_name", "num_local_devices",
           "local_devices"]


def device_name(client: int, index: int, device_type: str = "CPU", job: str = "localhost") -> str:
    """The full name of device ``index`` of ``client``: ``/job:<job>/replica:0/task:<client>/device:<type>:<index>``."""
    return f"/job:{job}/replica:0/task:{client}/device:{device_type}:{index}"


class Mesh:
    """Devices arranged in a grid with named dimensions; each client holds some of them.

    ``global_device_ids`` is an integer array whose shape is the mesh shape (row-major
    ids, usually ``arange``); ``local_device_ids`` are this client's devices, in the
    order components are packed; ``client_of`` maps every device id to its client.
    """

    def __init__(self, dim_names: Sequence[str], global_device_ids: np.ndarray, local_device_ids: Sequence[int],
                 local_devices: Sequence[str], mesh_name: str = "", client_of: Optional[Dict[int, int]] = None,
                 device_type: Optional[str] = None, *, global_devices: Optional[Sequence[str]] = None,
                 use_xla_spmd: bool = False) -> None:
        ids = np.asarray(global_device_ids, dtype=np.int64)
        if ids.ndim != len(dim_names):
            raise InvalidArgumentError(f"mesh has {len(dim_names)} dimension names but device ids of rank {ids.ndim}")
        if len(set(dim_names)) != len(dim_names):
            raise InvalidArgumentError(f"mesh dimension names must be unique: {list(dim_names)}")
        if sorted(ids.reshape(-1).tolist()) != list(range(ids.size)):
            raise InvalidArgumentError("global device ids must be a permutation of 0..N-1")
        if len(local_device_ids) != len(local_devices):
            raise InvalidArgumentError("local_device_ids and local_devices must have the same length")
        self.dim_names: List[str] = list(dim_names)
        self._ids = ids
        self._local = [int(i) for i in local_device_ids]
        self._local_devices = list(local_devices)
        if device_type is None:
            found = _DEVICE_TYPE.search(local_devices[0]) if len(local_devices) else None
            device_type = found.group(1).upper() if found else "CPU"
        self.name = mesh_name
        self.device_type_name = device_type
        self._global_devices = list(global_devices) if global_devices is not None else None
        if self._global_devices is not None and len(self._global_devices) != ids.size:
            raise InvalidArgumentError(f"global_devices names {len(self._global_devices)} devices, the mesh has "
                                       f"{ids.size}")
        self._use_xla_spmd = bool(use_xla_spmd)
        if client_of is None and self._global_devices is not None:
            client_of = {i: _task(name) for i, name in enumerate(self._global_devices)}
        self._client_of = dict(client_of) if client_of is not None else {i: 0 for i in range(ids.size)}
        self._coords = {int(ids[idx]): idx for idx in np.ndindex(*ids.shape)}

    # -- shape -------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        """Size of each mesh dimension (a tuple; TF's ``Mesh.shape()`` is a method returning a list)."""
        return tuple(int(s) for s in self._ids.shape)

    @property
    def size(self) -> int:
        """Number of devices in the mesh."""
        return int(self._ids.size)

    def dim_size(self, name: str) -> int:
        """Size of mesh dimension ``name``."""
        try:
            return int(self._ids.shape[self.dim_names.index(name)])
        except ValueError:
            raise InvalidArgumentError(f"mesh has no dimension {name!r} (dimensions: {self.dim_names})") from None

    def coords(self, device_id: int) -> Dict[str, int]:
        """Position of ``device_id`` along each named dimension."""
        idx = self._coords[int(device_id)]
        return {name: int(i) for name, i in zip(self.dim_names, idx)}

    # -- devices -------------------------------------------------------------
    def global_device_ids(self) -> np.ndarray:
        """Device ids arranged in the mesh's shape (a copy)."""
        return self._ids.copy()

    def local_device_ids(self) -> List[int]:
        """This client's device ids, in the order components are packed."""
        return list(self._local)

    def local_devices(self) -> List[str]:
        """Full names of this client's devices (same order as :meth:`local_device_ids`)."""
        return list(self._local_devices)

    def num_local_devices(self) -> int:
        """Number of devices on this client."""
        return len(self._local)

    def local_device_locations(self) -> List[Dict[str, int]]:
        """Where each of this client's devices sits: ``{dim name: index}``, in local device order (as TF)."""
        return [self.coords(d) for d in self._local]

    def device_location(self, device_id: int) -> List[int]:
        """The position of ``device_id`` along each mesh dimension, in mesh order (as TF)."""
        return [int(i) for i in self._coords[int(device_id)]]

    def device_type(self) -> str:
        """The devices' type (``"CPU"``, ``"GPU"``, ``"TPU"``); shardckpt only names devices."""
        return self.device_type_name

    def client_of(self, device_id: int) -> int:
        """The client (rank) that holds ``device_id``."""
        return self._client_of[int(device_id)]

    def device_name(self, device_id: int) -> str:
        """The device's name on its client: ``/job:../task:<client>/device:CPU:<index on that client>``."""
        client = self.client_of(device_id)
        index = sorted(d for d, c in self._client_of.items() if c == client).index(int(device_id))
        return device_name(client, index, self.device_type_name,
                           "localhost" if len(set(self._client_of.values())) == 1 else "worker")

    @property
    def num_clients(self) -> int:
        """Number of clients holding devices of this mesh."""
        return len(set(self._client_of.values()))

    def __eq__(self, other: object) -> bool:
        # the name counts, as in TF (a mesh of another name is another mesh)
        return isinstance(other, Mesh) and self.name == other.name and self.dim_names == other.dim_names and \
            np.array_equal(self._ids, other._ids) and self._client_of == other._client_of

    def __hash__(self) -> int:
        return hash((tuple(self.dim_names), self.shape))

    def __repr__(self) -> str:
        return f"Mesh.from_string({self.to_string()})"

    __str__ = __repr__

    # -- TensorFlow's string form -------------------------------------------------
    def dim_names_and_sizes(self) -> List[Tuple[str, int]]:
        """``[(name, size), ...]`` in mesh order."""
        return list(zip(self.dim_names, self.shape))

    def use_xla_spmd(self) -> bool:
        """Whether the mesh was created with ``use_xla_spmd`` (recorded and written; no effect here)."""
        return self._use_xla_spmd

    def global_devices(self) -> List[str]:
        """Full names of every device in id order, when they were given (``[]`` otherwise, as TF)."""
        return list(self._global_devices or [])

    def _contiguous_clients(self) -> bool:
        k = len(self._local)
        return k > 0 and all(c == d // k for d, c in self._client_of.items())

    def to_string(self) -> str:
        """The mesh in TensorFlow's string form (``Mesh.from_string`` in either library reads it)."""
        dims = ",".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        parts = [self.name, dims, ",".join(str(int(i)) for i in self._ids.reshape(-1)),
                 ",".join(str(i) for i in self._local), ",".join(self._local_devices)]
        global_devices = self._global_devices
        if global_devices is None and self.num_clients > 1 and not self._contiguous_clients():
            global_devices = [self.device_name(d) for d in range(self.size)]
        if global_devices:
            parts.append(",".join(global_devices))
        if self._use_xla_spmd:
            parts.append("use_xla_spmd")
        return "|".join(parts)

    @classmethod
    def from_string(cls, mesh_str: str) -> "Mesh":
        """Parse TensorFlow's string form of a mesh (see the module docstring)."""
        return _parse_mesh(mesh_str)

    def as_proto(self) -> Any:
        """The mesh as TensorFlow's ``MeshProto`` (same field numbers; TF's class parses its bytes)."""
        from ._proto import MeshProto

        proto = MeshProto(name=self.name, use_xla_spmd=self._use_xla_spmd)
        for name, size in zip(self.dim_names, self.shape):
            proto.mesh_dimensions.add(name=name, size=size)
        proto.global_device_ids.extend(int(i) for i in self._ids.reshape(-1))
        proto.local_device_ids.extend(self._local)
        proto.local_devices.extend(self._local_devices)
        proto.global_devices.extend(self._global_devices or [])
        return proto

    @classmethod
    def from_proto(cls, proto: Any) -> "Mesh":
        """A mesh from a ``MeshProto`` (ours or TensorFlow's: read through its string form)."""
        parts = [proto.name, ",".join(f"{d.name}={d.size}" for d in proto.mesh_dimensions),
                 ",".join(str(i) for i in proto.global_device_ids), ",".join(str(i) for i in proto.local_device_ids),
                 ",".join(proto.local_devices)]
        if len(proto.global_devices):
            parts.append(",".join(proto.global_devices))
        if proto.use_xla_spmd:
            parts.append("use_xla_spmd")
        return _parse_mesh("|".join(parts))

_DEVICE_TYPE = re.compile(r"device:([A-Za-z_]+):\d+")
_TASK = re.compile(r"/task:(\d+)")
_DEVICE = re.compile(r"^(?:/job:([^/]+))?(?:/replica:(\d+))?(?:/task:(\d+))?/?(?:device:)?([A-Za-z_]+):(\d+)$")


def _task(device: str) -> int:
    found = _TASK.search(device)
    return int(found.group(1)) if found else 0


def canonical_device_name(device: str, client: int = 0, job: str = "localhost") -> str:
    """``"CPU:1"`` or ``"/device:CPU:1"`` -> ``"/job:localhost/replica:0/task:0/device:CPU:1"`` (as TF spells it)."""
    found = _DEVICE.match(str(device).strip())
    if found is None:
        raise InvalidArgumentError(f"not a device name: {device!r} (expected e.g. 'CPU:0' or "
                                   "'/job:localhost/replica:0/task:0/device:CPU:0')")
    job_, replica, task, kind, index = found.groups()
    return (f"/job:{job_ or job}/replica:{replica or 0}/task:{task if task is not None else client}"
            f"/device:{kind.upper()}:{index}")


def _ints(text: str, what: str, mesh_str: str) -> List[int]:
    try:
        return [int(x) for x in text.split(",")] if text else []
    except ValueError:
        raise InvalidArgumentError(f"mesh string {mesh_str!r}: {what} must be comma-separated integers") from None


def _parse_mesh(mesh_str: str) -> Mesh:
    parts = str(mesh_str).split("|")
    use_xla_spmd = False
    if len(parts) in (6, 7) and parts[-1] == "use_xla_spmd":
        use_xla_spmd = True
        parts = parts[:-1]
    if len(parts) not in (5, 6):
        raise InvalidArgumentError(f"invalid mesh string {mesh_str!r}: expected "
                                   "'name|dim=size,...|global ids|local ids|local devices[|global devices]'")
    name, dims_text, global_text, local_text, devices_text = parts[:5]
    names: List[str] = []
    sizes: List[int] = []
    for item in dims_text.split(",") if dims_text else []:
        dim, eq, size = item.partition("=")
        if not eq or not dim:
            raise InvalidArgumentError(f"mesh string {mesh_str!r}: dimension {item!r} is not 'name=size'")
        names.append(dim)
        sizes.extend(_ints(size, "dimension sizes", mesh_str))
    global_ids = _ints(global_text, "global device ids", mesh_str)
    local_ids = _ints(local_text, "local device ids", mesh_str)
    local_devices = devices_text.split(",") if devices_text else []
    global_devices = parts[5].split(",") if len(parts) == 6 and parts[5] else None
    n = int(np.prod(sizes)) if sizes else 1
    if len(global_ids) != n:
        raise InvalidArgumentError(f"mesh string {mesh_str!r}: {len(global_ids)} global device ids for a mesh of "
                                   f"shape {sizes}")
    client_of: Optional[Dict[int, int]] = None
    if global_devices is None and local_ids and len(local_ids) < n:
        k = len(local_ids)
        if n % k:
            raise InvalidArgumentError(f"mesh string {mesh_str!r}: {n} devices cannot be split into clients of "
                                       f"{k} local devices")
        client_of = {d: d // k for d in range(n)}
    device_type = None
    if not local_devices and global_devices:
        found = _DEVICE_TYPE.search(global_devices[0])
        device_type = found.group(1).upper() if found else None
    return Mesh(names, np.array(global_ids, dtype=np.int64).reshape(sizes), local_ids, local_devices, name,
                client_of, device_type, global_devices=global_devices, use_xla_spmd=use_xla_spmd)


MeshDims = Union[Sequence[Tuple[str, int]], Mapping[str, int]]


def _check_dims(mesh_dims: MeshDims) -> Tuple[List[str], List[int]]:
    items = list(mesh_dims.items()) if isinstance(mesh_dims, Mapping) else list(mesh_dims)
    names = [str(n) for n, _ in items]
    sizes = [int(s) for _, s in items]
    if any(s <= 0 for s in sizes):
        raise InvalidArgumentError(f"mesh dimension sizes must be positive: {items}")
    return names, sizes


def _check_xla(device_type: str, use_xla_spmd: bool) -> None:
    if use_xla_spmd and device_type.upper() == "CPU":
        raise InvalidArgumentError("XLA SPMD is not currently not supported for CPU mesh.")  # TF's words


def create_mesh(mesh_dims: Optional[MeshDims] = None, mesh_name: str = "", devices: Optional[Sequence[str]] = None,
                device_type: Optional[str] = None, use_xla_spmd: bool = False) -> Mesh:
    """A single-client mesh: every device is local (``dtensor.create_mesh``).

    ``mesh_dims`` is ``[("x", 2), ("y", 4)]`` or ``{"x": 2, "y": 4}``; ``None`` makes a
    one-dimensional mesh ``x`` over ``devices``. ``devices`` may be spelled short
    (``"CPU:0"``); they are stored fully spelled, as TF does. Without ``devices``,
    the mesh gets devices ``/job:localhost/replica:0/task:0/device:<type>:<i>`` (there
    are no real devices here: their names only label files and pieces).
    """
    if mesh_dims is None:
        if devices is None:
            raise InvalidArgumentError("create_mesh needs mesh_dims or devices")
        mesh_dims = [("x", len(devices))]
    names, sizes = _check_dims(mesh_dims)
    n = int(np.prod(sizes))
    if devices is not None:
        if len(devices) != n:
            raise InvalidArgumentError(f"length of devices ({len(devices)}) must be equal to total size of the "
                                       f"mesh of shape {sizes}")
        local = [canonical_device_name(d) for d in devices]
        if device_type is None:
            device_type = _DEVICE_TYPE.search(local[0]).group(1)  # type: ignore[union-attr]
    else:
        device_type = (device_type or "CPU").upper()
        local = [device_name(0, i, device_type) for i in range(n)]
    _check_xla(device_type, use_xla_spmd)
    return Mesh(names, np.arange(n).reshape(sizes), list(range(n)), local, mesh_name, None, device_type.upper(),
                use_xla_spmd=use_xla_spmd)


def create_distributed_mesh(mesh_dims: MeshDims, mesh_name: str = "", local_devices: Optional[Sequence[str]] = None,
                            device_type: Optional[str] = None, use_xla_spmd: bool = False, *,
                            num_local_devices: Optional[int] = None, client_id: Optional[int] = None,
                            num_clients: Optional[int] = None) -> Mesh:
    """A mesh over all clients: client ``i`` owns devices ``[i*k, (i+1)*k)`` (``dtensor.create_distributed_mesh``).

    TensorFlow's parameters come first. ``local_devices`` (e.g. ``["CPU:0", "CPU:1"]``)
    names this client's devices and sets ``k``; else ``num_local_devices`` sets ``k``,
    else the mesh size is divided evenly among the clients. ``client_id`` and
    ``num_clients`` default to the coordinator's rank and size (``torchrun``/``mpiexec``).
    """
    names, sizes = _check_dims(mesh_dims)
    if client_id is None or num_clients is None:
        from ..distributed import get_coordinator

        coordinator = get_coordinator()
        client_id = coordinator.rank if client_id is None else client_id
        num_clients = coordinator.size if num_clients is None else num_clients
    n = int(np.prod(sizes))
    if local_devices is not None:
        if num_local_devices is not None and num_local_devices != len(local_devices):
            raise InvalidArgumentError(f"num_local_devices={num_local_devices} but {len(local_devices)} "
                                       "local_devices were given")
        num_local_devices = len(local_devices)
    k = num_local_devices if num_local_devices is not None else n // num_clients
    if k * num_clients != n:
        raise InvalidArgumentError(f"{n} devices cannot be split into {num_clients} clients of {k} devices")
    if not 0 <= client_id < num_clients:
        raise InvalidArgumentError(f"client_id {client_id} out of range for {num_clients} clients")
    local = list(range(client_id * k, (client_id + 1) * k))
    job = "localhost" if num_clients == 1 else "worker"
    if local_devices is not None:
        names_on_client = [canonical_device_name(d, client_id, job) for d in local_devices]
        if device_type is None:
            device_type = _DEVICE_TYPE.search(names_on_client[0]).group(1)  # type: ignore[union-attr]
    else:
        device_type = (device_type or "CPU").upper()
        names_on_client = [device_name(client_id, i, device_type, job) for i in range(k)]
    _check_xla(device_type, use_xla_spmd)
    return Mesh(names, np.arange(n).reshape(sizes), local, names_on_client, mesh_name,
                {d: d // k for d in range(n)}, device_type.upper(), use_xla_spmd=use_xla_spmd)


# -- the client's devices (TF's dtensor.job_name / num_local_devices / local_devices) ---------------------------
_DEVICE_TYPES = ("CPU", "GPU", "TPU")


def _check_device_type(device_type: str) -> str:
    kind = str(device_type).upper()
    if kind not in _DEVICE_TYPES:
        raise InvalidArgumentError(f"Device type {device_type} is not CPU, GPU, or TPU.")  # TF's words
    return kind


def _clients() -> Tuple[int, int]:
    """(this client's id, number of clients), from the coordinator (``torchrun``/``mpiexec``, else one)."""
    from ..distributed import get_coordinator

    coordinator = get_coordinator()
    return int(coordinator.rank), int(coordinator.size)


def job_name() -> str:
    """The job name of every client (TF's rule): ``$DTENSOR_JOB_NAME``, else ``"localhost"`` on one client
    and ``"worker"`` on several."""
    return os.environ.get("DTENSOR_JOB_NAME", "localhost" if _clients()[1] == 1 else "worker")


def num_local_devices(device_type: str) -> int:
    """Devices of ``device_type`` on this client. There are no real devices here: the count is the
    default mesh's local devices of that type (``dtensor.default_mesh``), else what TF reports with no
    device configured: one CPU, no other device (any type name is accepted, as in TF)."""
    kind = str(device_type).upper()
    from ._api import get_default_mesh

    mesh = get_default_mesh()
    if mesh is not None and mesh.device_type() == kind:
        return mesh.num_local_devices()
    return 1 if kind == "CPU" else 0


def local_devices(device_type: str, for_client_id: Optional[int] = None) -> List[str]:
    """Full names of the :func:`num_local_devices` devices of ``for_client_id`` (default: this client),
    by increasing index (TF returns ``DeviceSpec`` objects; device names are strings here)."""
    kind = _check_device_type(device_type)
    client = _clients()[0] if for_client_id is None else int(for_client_id)
    return [device_name(client, i, kind, job_name()) for i in range(num_local_devices(kind))]
