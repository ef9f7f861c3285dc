"""``Mesh``: a named grid of devices spread over clients (``tf.experimental.dtensor.Mesh``)."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError

__all__ = ["Mesh", "create_mesh", "create_distributed_mesh", "device_name"]


def device_name(client: int, index: int, device_type: str = "CPU", job: str = "localhost") -> str:
    return f"/job:{job}/replica:0/task:{client}/device:{device_type}:{index}"


class Mesh:
    """Devices arranged in a grid with named dimensions; each client holds some of them.

    ``global_device_ids`` is an integer array whose shape is the mesh shape (row-major
    ids, usually ``arange``); ``local_device_ids`` are this client's devices, in the
    order components are packed; ``client_of`` maps every device id to its client.
    """

    def __init__(self, dim_names: Sequence[str], global_device_ids: np.ndarray, local_device_ids: Sequence[int],
                 local_devices: Sequence[str], mesh_name: str = "", client_of: Optional[Dict[int, int]] = None,
                 device_type: str = "CPU") -> None:
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
        self.name = mesh_name
        self.device_type_name = device_type
        self._client_of = dict(client_of) if client_of is not None else {i: 0 for i in range(ids.size)}
        self._coords = {int(ids[idx]): idx for idx in np.ndindex(*ids.shape)}

    # -- shape -------------------------------------------------------------
    @property
    def shape(self) -> Tuple[int, ...]:
        return tuple(int(s) for s in self._ids.shape)

    @property
    def size(self) -> int:
        return int(self._ids.size)

    def dim_size(self, name: str) -> int:
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
        return self._ids.copy()

    def local_device_ids(self) -> List[int]:
        return list(self._local)

    def local_devices(self) -> List[str]:
        return list(self._local_devices)

    def num_local_devices(self) -> int:
        return len(self._local)

    def device_type(self) -> str:
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
        return len(set(self._client_of.values()))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.dim_names == other.dim_names and \
            np.array_equal(self._ids, other._ids) and self._client_of == other._client_of

    def __hash__(self) -> int:
        return hash((tuple(self.dim_names), self.shape))

    def __repr__(self) -> str:
        dims = ", ".join(f"{n}={s}" for n, s in zip(self.dim_names, self.shape))
        return f"Mesh({dims}; {self.num_clients} clients, local devices {self._local})"


def _check_dims(mesh_dims: Sequence[Tuple[str, int]]) -> Tuple[List[str], List[int]]:
    names = [str(n) for n, _ in mesh_dims]
    sizes = [int(s) for _, s in mesh_dims]
    if any(s <= 0 for s in sizes):
        raise InvalidArgumentError(f"mesh dimension sizes must be positive: {list(mesh_dims)}")
    return names, sizes


def create_mesh(mesh_dims: Sequence[Tuple[str, int]], mesh_name: str = "", devices: Optional[Sequence[str]] = None,
                device_type: str = "CPU") -> Mesh:
    """A single-client mesh: every device is local (``dtensor.create_mesh``)."""
    names, sizes = _check_dims(mesh_dims)
    n = int(np.prod(sizes))
    if devices is not None and len(devices) != n:
        raise InvalidArgumentError(f"a mesh of shape {sizes} needs {n} devices, got {len(devices)}")
    local = list(devices) if devices is not None else [device_name(0, i, device_type) for i in range(n)]
    return Mesh(names, np.arange(n).reshape(sizes), list(range(n)), local, mesh_name, None, device_type)


def create_distributed_mesh(mesh_dims: Sequence[Tuple[str, int]], mesh_name: str = "",
                            num_local_devices: Optional[int] = None, device_type: str = "CPU",
                            client_id: Optional[int] = None, num_clients: Optional[int] = None) -> Mesh:
    """A mesh over all clients: client ``i`` owns devices ``[i*k, (i+1)*k)`` (``dtensor.create_distributed_mesh``).

    ``client_id`` and ``num_clients`` default to the coordinator's rank and size;
    ``num_local_devices`` defaults to the mesh size divided evenly among the clients.
    """
    names, sizes = _check_dims(mesh_dims)
    if client_id is None or num_clients is None:
        from ..distributed import get_coordinator

        coordinator = get_coordinator()
        client_id = coordinator.rank if client_id is None else client_id
        num_clients = coordinator.size if num_clients is None else num_clients
    n = int(np.prod(sizes))
    k = num_local_devices if num_local_devices is not None else n // num_clients
    if k * num_clients != n:
        raise InvalidArgumentError(f"{n} devices cannot be split into {num_clients} clients of {k} devices")
    if not 0 <= client_id < num_clients:
        raise InvalidArgumentError(f"client_id {client_id} out of range for {num_clients} clients")
    local = list(range(client_id * k, (client_id + 1) * k))
    job = "localhost" if num_clients == 1 else "worker"
    names_on_client = [device_name(client_id, i, device_type, job) for i in range(k)]
    return Mesh(names, np.arange(n).reshape(sizes), local, names_on_client, mesh_name,
                {d: d // k for d in range(n)}, device_type)
