"""Restore planning and reading: requested regions of tensors, read into arrays.

A request names a key, a region of the global tensor (or all of it), and
optionally the array to fill. Each request reads only the stored pieces that
overlap its region, straight into the destination; requests are served by a
few threads in parallel, all inside one deferring
:class:`~shardckpt.format.bundle_reader.ReadSession`: whole entries are read and
checksummed by the reader's helper threads while the next requests are planned,
and every read and checksum is complete and checked before the results return.

With ``CheckpointOptions(io_device=...)`` and several clients, :func:`restore_tensors` is
collective and funnelled: only the io client reads (:mod:`.funnel_restore`).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Union, cast

import numpy as np

from ..distributed import get_coordinator
from ..distributed.coordinator import Coordinator
from ..errors import InvalidArgumentError
from ..format.bundle_reader import BundleReader, ReadSession
from ..format.dtypes import as_dtype
from ..format.tensor_slice import Box, TensorSlice
from ..storage.location import Location
from .funnel_restore import funnelled_reader, run_funnelled
from .options import CheckpointOptions

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


def _check_dtype(reader: Any, request: RestoreRequest) -> None:
    if request.dtype is not None:
        stored = reader.dtype(request.key)
        if as_dtype(request.dtype).enum != stored.enum:
            raise InvalidArgumentError(f"expected dtype {as_dtype(request.dtype).name} does not equal the "
                                       f"stored dtype {stored.name}", path=reader.prefix, key=request.key)


def _serve(reader: BundleReader, session: ReadSession, request: RestoreRequest, verify: bool) -> np.ndarray:
    return session.read_region(request.key, request.region, request.out, verify=verify)


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
    if options is not None and options.io_device is not None and reader is None:
        funnel = funnelled_reader(prefix, options, coordinator or get_coordinator())
        if funnel is not None:
            def plan(funnelled: Any) -> List[np.ndarray]:
                out = []
                for r in reqs:
                    _check_dtype(funnelled, r)
                    out.append(funnelled.read_region(r.key, r.region, r.out))
                return out

            results: List[np.ndarray] = run_funnelled(funnel, plan)
            return results
    own = reader is None
    bundle = reader or BundleReader(Location.of(prefix))
    try:
        bundle.prefetch([(r.key, r.region) for r in reqs])  # object stores: few large GETs, ahead of the reads
        with bundle.session(defer=True) as session:  # reads overlap; all checked before the block ends
            # Whole tensors are only queued on the session's pump (its helpers read them), so they are
            # planned on this thread, in one pass (read_many); regions (synchronous run reads) are
            # served by a few threads.
            for r in reqs:
                if r.dtype is not None:
                    _check_dtype(bundle, r)
            wholes = [i for i, r in enumerate(reqs) if r.region is None]
            parts = [i for i, r in enumerate(reqs) if r.region is not None]
            out: List[Optional[np.ndarray]] = [None] * len(reqs)
            futures = {}
            pool = None
            if max_workers > 1 and len(parts) > 1:
                pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="shardckpt-read")
                futures = {i: pool.submit(_serve, bundle, session, reqs[i], verify) for i in parts}
            try:
                for i, value in zip(wholes, session.read_many([reqs[i].key for i in wholes],
                                                              [reqs[i].out for i in wholes], verify=verify)):
                    out[i] = value
                for i in parts:
                    out[i] = futures[i].result() if i in futures else _serve(bundle, session, reqs[i], verify)
            finally:
                if pool is not None:
                    pool.shutdown(wait=True)
            results = cast(List[np.ndarray], out)  # every slot filled above
        return results
    finally:
        if own:
            bundle.close()
