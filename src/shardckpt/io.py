"""TensorFlow's checkpoint ops, without TensorFlow.

=========================================  ==========================================
TensorFlow                                 shardckpt
=========================================  ==========================================
``tf.raw_ops.SaveV2``                      :func:`save_v2`
``tf.raw_ops.RestoreV2``                   :func:`restore_v2`
``tf.raw_ops.MergeV2Checkpoints``          :func:`merge_v2_checkpoints`
``tf.raw_ops.ShardedFilename``             :func:`sharded_filename`
=========================================  ==========================================

For the same inputs, :func:`save_v2` writes files byte-identical to ``SaveV2``.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Union

import numpy as np

from .errors import InvalidArgumentError
from .format.bundle_reader import region_box
from .format.bundle_writer import BundleWriter
from .format.crc import shared_executor
from .format.dtypes import as_dtype
from .format.naming import sharded_filename
from .format.tensor_slice import Box, parse_shape_and_slice
from .restoring import BundleSource, Read, RestorePlan, run
from .saving.commit import merge_bundles
from .storage.location import Location

__all__ = ["save_v2", "restore_v2", "merge_v2_checkpoints", "sharded_filename"]


def _check_lengths(names: Sequence[Any], specs: Sequence[str], other: Sequence[Any], what: str) -> None:
    if not (len(names) == len(specs) == len(other)):
        raise InvalidArgumentError(f"tensor_names ({len(names)}), shape_and_slices ({len(specs)}) and "
                                   f"{what} ({len(other)}) must have the same length")


def save_v2(prefix: str, tensor_names: Sequence[Union[str, bytes]], shape_and_slices: Sequence[str],
            tensors: Sequence[Any], *, fsync: bool = False) -> None:
    """Save ``tensors`` under ``tensor_names`` into the bundle at ``prefix``.

    ``shape_and_slices[i]`` is ``""`` for a whole tensor, or ``"<full shape> <slice>"``
    (e.g. ``"10 4 0,5:-"``) when ``tensors[i]`` is that slice of a larger tensor.
    Values are written in the given order; the data file is
    ``<prefix>.data-00000-of-00001``.
    """
    _check_lengths(tensor_names, shape_and_slices, tensors, "tensors")
    if not tensor_names:
        raise InvalidArgumentError("save_v2 needs at least one tensor")
    with BundleWriter(Location.of(prefix), fsync=fsync, checksum_executor=shared_executor()) as writer:
        for name, spec, value in zip(tensor_names, shape_and_slices, tensors):
            if spec == "":
                writer.add(name, value)
            else:
                full_shape, tslice = parse_shape_and_slice(spec)
                assert tslice is not None
                writer.add_slice(name, full_shape, tslice, value)


def restore_v2(prefix: str, tensor_names: Sequence[Union[str, bytes]], shape_and_slices: Sequence[str],
               dtypes: Sequence[Any]) -> List[np.ndarray]:
    """Read tensors (or regions of them) from the bundle at ``prefix``.

    ``shape_and_slices[i]`` is ``""`` for the whole tensor or ``"<full shape> <slice>"``
    for a region; the full shape must match the stored one. ``dtypes[i]`` must be
    the stored dtype (a TF name such as ``"float32"``, a NumPy dtype or a
    :class:`~shardckpt.format.dtypes.DType`). Only the bytes of the requested
    regions are read.
    """
    _check_lengths(tensor_names, shape_and_slices, dtypes, "dtypes")
    with BundleSource.open(prefix) as source:  # every request checked first, then one plan of the restore engine
        reads = []
        for name, spec, dtype in zip(tensor_names, shape_and_slices, dtypes):
            key = name
            stored = source.dtype(key)
            wanted = as_dtype(dtype)
            if wanted.enum != stored.enum:
                raise InvalidArgumentError(f"expected dtype {wanted.name} does not equal the stored "
                                           f"dtype {stored.name}", path=prefix, key=key)
            region: Optional[Box] = None
            if spec != "":
                full_shape, tslice = parse_shape_and_slice(spec)
                if full_shape != source.shape(key):
                    raise InvalidArgumentError(f"requested full shape {list(full_shape)} does not equal the "
                                               f"stored shape {list(source.shape(key))}", path=prefix, key=key)
                region = region_box(tslice, full_shape, prefix, key)
            reads.append(Read(key, region))
        return run(RestorePlan.of(source, reads))


def merge_v2_checkpoints(checkpoint_prefixes: Sequence[str], destination_prefix: str,
                         delete_old_dirs: bool = True, allow_missing_files: bool = False) -> None:
    """Merge bundles into ``destination_prefix`` (TensorFlow's ``MergeV2Checkpoints``).

    Data files are renamed, not copied; the merged index is written last. A key
    stored whole in two inputs raises :class:`~shardckpt.errors.AlreadyExistsError`
    before anything is moved.
    """
    if isinstance(checkpoint_prefixes, str):
        checkpoint_prefixes = [checkpoint_prefixes]
    merge_bundles(list(checkpoint_prefixes), destination_prefix, delete_old_dirs=delete_old_dirs,
                  allow_missing_files=allow_missing_files)
