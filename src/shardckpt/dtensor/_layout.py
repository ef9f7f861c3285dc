"""``Layout``: how each dimension of a tensor is split over a mesh (``dtensor.Layout``).

String form (TensorFlow's)::

    sharding_specs:<spec>,<spec>,..., mesh:<mesh string>

each spec followed by a comma (a scalar's layout: ``sharding_specs: mesh:...``).
Only static layouts exist here (no single-device or parted layouts).
"""

from __future__ import annotations

from typing import Any, Dict, List, Sequence, Tuple

from ..errors import InvalidArgumentError
from ..format.tensor_slice import Box
from ._mesh import Mesh

__all__ = ["Layout", "UNSHARDED", "MATCH"]

UNSHARDED = "unsharded"
MATCH = "match"


class Layout:
    """One sharding spec per tensor dimension: a mesh dimension name, or ``UNSHARDED``.

    A tensor dimension sharded over mesh dimension ``x`` of size ``k`` is cut into
    ``k`` equal blocks; device ``d`` holds block ``coords(d)[x]``. Devices that differ
    only along mesh dimensions the layout does not use hold the same piece (replicas).
    """

    def __init__(self, sharding_specs: Sequence[str], mesh: Mesh) -> None:
        specs = [str(s) for s in sharding_specs]
        used = [s for s in specs if s != UNSHARDED]
        for s in used:
            if s not in mesh.dim_names:
                raise InvalidArgumentError(f"layout {specs} uses {s!r}, which is not a dimension of {mesh}")
        if len(set(used)) != len(used):
            raise InvalidArgumentError(f"layout {specs} shards two tensor dimensions over one mesh dimension")
        self.sharding_specs: List[str] = specs
        self.mesh = mesh

    @property
    def rank(self) -> int:
        """Number of tensor dimensions the layout describes."""
        return len(self.sharding_specs)

    @classmethod
    def replicated(cls, mesh: Mesh, rank: int) -> "Layout":
        """Every dimension unsharded: each device holds the whole tensor."""
        return cls([UNSHARDED] * rank, mesh)

    @classmethod
    def batch_sharded(cls, mesh: Mesh, batch_dim: str, rank: int, axis: int = 0) -> "Layout":
        """Tensor dimension ``axis`` sharded over mesh dimension ``batch_dim``, the others unsharded."""
        specs = [UNSHARDED] * rank
        specs[axis] = batch_dim
        return cls(specs, mesh)

    @classmethod
    def inner_sharded(cls, mesh: Mesh, inner_dim: str, rank: int) -> "Layout":
        """The last tensor dimension sharded over ``inner_dim``, the others unsharded."""
        return cls.batch_sharded(mesh, inner_dim, rank, axis=rank - 1)

    @property
    def shape(self) -> List[int]:
        """The mesh's shape (TF's ``Layout.shape`` is its mesh's shape, not the tensor's)."""
        return list(self.mesh.shape)

    def delete(self, dims: Any) -> "Layout":
        """This layout without the tensor dimensions ``dims`` (a list of indices, or one index), as TF's:
        indices that name no dimension are ignored. ``Layout([x, y], m).delete([0])`` is ``Layout([y], m)``."""
        if not isinstance(dims, list):
            dims = [dims]
        return Layout([spec for i, spec in enumerate(self.sharding_specs) if i not in dims], self.mesh)

    def num_shards(self, dim: int) -> int:
        """Number of pieces tensor dimension ``dim`` is cut into."""
        spec = self.sharding_specs[dim]
        return 1 if spec == UNSHARDED else self.mesh.dim_size(spec)

    def is_fully_replicated(self) -> bool:
        """Whether no dimension is sharded."""
        return all(s == UNSHARDED for s in self.sharding_specs)

    def _check_shape(self, shape: Sequence[int]) -> None:
        if len(shape) != self.rank:
            raise InvalidArgumentError(f"layout {self.sharding_specs} has rank {self.rank}, tensor shape {list(shape)}")
        for d, n in enumerate(shape):
            if n % self.num_shards(d):
                raise InvalidArgumentError(f"dimension {d} of shape {list(shape)} ({n}) is not divisible by the "
                                           f"{self.num_shards(d)} shards of mesh dimension {self.sharding_specs[d]!r}")

    def global_shape(self, local_shape: Sequence[int]) -> Tuple[int, ...]:
        """The global shape of a tensor whose per-device pieces have ``local_shape``."""
        return tuple(int(n) * self.num_shards(d) for d, n in enumerate(local_shape))

    def local_shape(self, global_shape: Sequence[int]) -> Tuple[int, ...]:
        """The shape of each device's piece of a tensor of ``global_shape``."""
        self._check_shape(global_shape)
        return tuple(int(n) // self.num_shards(d) for d, n in enumerate(global_shape))

    def box(self, device_id: int, global_shape: Sequence[int]) -> Box:
        """The region of the global tensor that ``device_id`` holds."""
        self._check_shape(global_shape)
        coords = self.mesh.coords(device_id)
        out = []
        for d, (spec, n) in enumerate(zip(self.sharding_specs, global_shape)):
            if spec == UNSHARDED:
                out.append((0, int(n)))
            else:
                block = int(n) // self.num_shards(d)
                i = coords[spec]
                out.append((i * block, (i + 1) * block))
        return tuple(out)

    def distinct_boxes(self, global_shape: Sequence[int]) -> Dict[Box, List[int]]:
        """Each distinct piece -> the devices holding it, lowest id first (in box order of first holder).

        Computed once per global shape and specs (every save of a training loop asks again);
        each call returns a new dict of new lists."""
        shape = tuple(int(n) for n in global_shape)
        key = (shape, tuple(self.sharding_specs))
        cache: Dict[Any, Tuple[Tuple[Box, Tuple[int, ...]], ...]] = self.__dict__.setdefault("_distinct", {})
        known = cache.get(key)
        if known is None:
            holders: Dict[Box, List[int]] = {}
            for device in sorted(int(i) for i in self.mesh.global_device_ids().reshape(-1)):
                holders.setdefault(self.box(device, shape), []).append(device)
            known = cache[key] = tuple((box, tuple(devices)) for box, devices in holders.items())
        return {box: list(devices) for box, devices in known}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and self.sharding_specs == other.sharding_specs and self.mesh == other.mesh

    def __hash__(self) -> int:
        return hash(tuple(self.sharding_specs))

    def __repr__(self) -> str:
        return f"Layout.from_string({self.to_string()})"

    __str__ = __repr__

    def to_string(self) -> str:
        """The layout in TensorFlow's string form (``Layout.from_string`` in either library reads it)."""
        return "sharding_specs:" + "".join(f"{s}," for s in self.sharding_specs) + " mesh:" + self.mesh.to_string()

    @classmethod
    def from_string(cls, layout_str: str) -> "Layout":
        """Parse TensorFlow's string form of a (static) layout."""
        text = str(layout_str)
        head = "sharding_specs:"
        specs_text, sep, mesh_text = text[len(head):].partition(" mesh:") if text.startswith(head) else ("", "", "")
        if not sep:
            raise InvalidArgumentError(f"invalid layout string {layout_str!r}: expected "
                                       "'sharding_specs:<spec>,..., mesh:<mesh>' (only static layouts are supported)")
        specs = [s for s in specs_text.split(",") if s]
        return cls(specs, Mesh.from_string(mesh_text))

    def as_proto(self) -> Any:
        """The layout as TensorFlow's ``LayoutProto`` (a static layout; TF's class parses its bytes)."""
        from ._proto import LayoutProto

        proto = LayoutProto(type=1)  # STATIC
        for spec in self.sharding_specs:
            proto.sharding_specs.add(sharding_spec=spec)
        proto.mesh_config.CopyFrom(self.mesh.as_proto())
        return proto

    @classmethod
    def from_proto(cls, layout_proto: Any) -> "Layout":
        """A layout from a ``LayoutProto`` (ours or TensorFlow's); only static layouts exist here."""
        if layout_proto.type not in (0, 1):
            raise InvalidArgumentError(f"only static layouts are supported, got layout type {layout_proto.type}")
        return cls([s.sharding_spec for s in layout_proto.sharding_specs], Mesh.from_proto(layout_proto.mesh_config))
