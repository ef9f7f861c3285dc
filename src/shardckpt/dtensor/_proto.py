"""``MeshProto`` / ``LayoutProto``: TensorFlow DTensor's messages, built at import time.

The messages have TensorFlow's field numbers and types (``tensorflow/dtensor/proto/layout.proto``),
so ``SerializeToString()`` of ours parses with TF's classes and the other way. They live in
the proto package ``shardckpt.dtensor`` so they never clash with TF's in one process. No
generated code: the file descriptor is assembled here from a short table.
"""

from __future__ import annotations

from typing import Any, List, Tuple

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

__all__ = ["MeshProto", "LayoutProto", "ShardingSpec", "MeshDimensionProto"]

_F = descriptor_pb2.FieldDescriptorProto
_PACKAGE = "shardckpt.dtensor"

# message -> [(field, number, type, repeated, message/enum type name)]
_MESSAGES: List[Tuple[str, List[Tuple[str, int, int, bool, str]]]] = [
    ("ShardingSpec", [("sharding_spec", 2, _F.TYPE_STRING, False, "")]),
    ("MeshDimensionProto", [("name", 1, _F.TYPE_STRING, False, ""), ("size", 2, _F.TYPE_INT64, False, "")]),
    ("MeshProto", [("mesh_dimensions", 1, _F.TYPE_MESSAGE, True, "MeshDimensionProto"),
                   ("global_device_ids", 2, _F.TYPE_INT64, True, ""),
                   ("local_device_ids", 4, _F.TYPE_INT64, True, ""),
                   ("local_devices", 5, _F.TYPE_STRING, True, ""),
                   ("global_devices", 6, _F.TYPE_STRING, True, ""),
                   ("name", 3, _F.TYPE_STRING, False, ""),
                   ("use_xla_spmd", 7, _F.TYPE_BOOL, False, ""),
                   ("single_device", 8, _F.TYPE_STRING, False, "")]),
    ("LayoutProto", [("sharding_specs", 1, _F.TYPE_MESSAGE, True, "ShardingSpec"),
                     ("mesh_config", 2, _F.TYPE_MESSAGE, False, "MeshProto"),
                     ("type", 3, _F.TYPE_ENUM, False, "LayoutProto.LayoutType")]),
]
_LAYOUT_TYPES = [("UNKNOWN", 0), ("STATIC", 1), ("PARTED", 2), ("SINGLE_DEVICE", 3)]


def _classes() -> Tuple[Any, Any, Any, Any]:
    pool = descriptor_pool.DescriptorPool()
    file = descriptor_pb2.FileDescriptorProto(name="shardckpt/dtensor/layout.proto", package=_PACKAGE,
                                              syntax="proto3")
    for name, fields in _MESSAGES:
        message = file.message_type.add(name=name)
        for field, number, kind, repeated, type_name in fields:
            entry = message.field.add(name=field, number=number, type=kind,
                                      label=_F.LABEL_REPEATED if repeated else _F.LABEL_OPTIONAL)
            if type_name:
                entry.type_name = f".{_PACKAGE}.{type_name}"
        if name == "LayoutProto":
            enum = message.enum_type.add(name="LayoutType")
            for value, number in _LAYOUT_TYPES:
                enum.value.add(name=value, number=number)
    pool.Add(file)
    get = message_factory.GetMessageClass
    return tuple(get(pool.FindMessageTypeByName(f"{_PACKAGE}.{n}"))  # type: ignore[return-value]
                 for n in ("ShardingSpec", "MeshDimensionProto", "MeshProto", "LayoutProto"))


ShardingSpec, MeshDimensionProto, MeshProto, LayoutProto = _classes()
