"""``restore_tensors``: requested regions of tensors, read into arrays (TF's ``restore_v2``).

A :class:`RestoreRequest` names a key, a region of the global tensor (or all of it), and
optionally the array to fill and the dtype expected. Every request's dtype is checked
before anything is read; then the requests become one :class:`~.plan.RestorePlan` served by
the engine (:func:`~.engine.run`): each request reads only the stored pieces that overlap its
region, straight into the destination; whole tensors are read and checksummed by the
reader's helpers while regions are read on a few threads, and every read and checksum is
complete and checked before the results return.

With ``CheckpointOptions(io_device=...)`` and several clients, :func:`restore_tensors` is
collective and funnelled: only the io client reads (:mod:`.funnel`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union

import numpy as np

from ..distributed import get_coordinator
from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError
from ..format.bundle_reader import BundleReader, region_box
from ..format.dtypes import as_dtype
from ..format.tensor_slice import Box, TensorSlice
from ..saving.options import CheckpointOptions
from .engine import collective_call, run
from .funnel import funnelled_reader
from .plan import Read, RestorePlan
from .source import BundleSource, PieceSource

__all__ = ["RestoreRequest", "restore_tensors"]

Region = Union[None, Box, TensorSlice, str]


@dataclass
class RestoreRequest:
    """Read ``region`` (``None``: all) of tensor ``key`` into ``out`` (allocated when ``None``).

    ``dtype``, when given, must equal the stored dtype.
    """

    key: str
    region: Region = None
    out: Optional[np.ndarray] = None
    dtype: Any = None


def _read_of(source: PieceSource, request: RestoreRequest) -> Read:
    """The request checked against the source's metadata, as a :class:`~.plan.Read`."""
    if request.dtype is not None:
        stored = source.dtype(request.key)
        if as_dtype(request.dtype).enum != stored.enum:
            raise InvalidArgumentError(f"expected dtype {as_dtype(request.dtype).name} does not equal the "
                                       f"stored dtype {stored.name}", path=source.prefix, key=request.key)
    region = request.region
    if region is not None and not (isinstance(region, tuple) and all(isinstance(p, tuple) for p in region)):
        region = region_box(region, source.shape(request.key), source.prefix, request.key)
    return Read(request.key, region, request.out)


def restore_tensors(prefix: str, requests: Sequence[Union[RestoreRequest, str]], *, verify: bool = True,
                    max_workers: int = 2, reader: Optional[BundleReader] = None,
                    options: Optional[CheckpointOptions] = None,
                    coordinator: Optional[Coordinator] = None) -> List[np.ndarray]:
    """Serve ``requests`` (or plain keys) from the checkpoint at ``prefix``; results in order.

    With ``options.io_device`` naming a client and several clients (``coordinator``, default
    the process-wide one), the call is collective: each client passes its own requests, only
    the io client reads, and sends every other client its regions.
    """
    reqs = [r if isinstance(r, RestoreRequest) else RestoreRequest(r) for r in requests]
    source: Optional[PieceSource] = None
    if options is not None and options.io_device is not None and reader is None:
        source = funnelled_reader(prefix, options, coordinator or get_coordinator())
    if source is None:
        source = BundleSource(reader, owned=False) if reader is not None else BundleSource.open(prefix)
    try:
        with collective_call(source):
            plan = RestorePlan.of(source, [_read_of(source, r) for r in reqs], verify=verify,
                                  workers=max(1, int(max_workers)))
            values = run(plan)
        return values
    finally:
        source.close()
