"""Writing one shard's values into a bundle writer: what every committer's ``write_shard`` does."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

from ...format.bundle_writer import BundleWriter
from ...format.tensor_slice import parse_shape_and_slice
from ..plan import ShardPlan

__all__ = ["fill_bundle"]


def _digest() -> Any:
    from ..incremental import new_digest  # the hash of incremental saves
    return new_digest()


def _sample(value: Any, dtype: Any) -> Optional[str]:
    from ..incremental import sample_hash
    return sample_hash(value, dtype)


class _PieceDigest:
    """One piece's content hash, fed its bytes as they stream out (on the checksum helper, beside the
    CRC-32C); once its last byte went in, its sample hash is computed there too, off the writer's
    thread. The writer's ``add`` returns only after the helper is done with the piece."""

    __slots__ = ("_digest", "_value", "_dtype", "_left", "sample")

    def __init__(self, value: Any, dtype: Any, nbytes: int) -> None:
        self._digest = _digest()
        self._value: Any = value
        self._dtype = dtype
        self._left = nbytes
        self.sample: Optional[str] = None

    def update(self, data: Any) -> None:
        self._digest.update(data)
        self._left -= len(data)
        if self._left <= 0 and self._value is not None:
            value, self._value = self._value, None
            self.sample = _sample(value, self._dtype)

    def hexdigest(self) -> str:
        return str(self._digest.hexdigest())


def fill_bundle(writer: BundleWriter, shard: ShardPlan) -> Optional[Tuple[List[Any], List[Any]]]:
    """Append every item of ``shard`` to ``writer``, in order; release each source once its bytes are written.

    For a shard of an incremental save (``shard.hashes`` set) return each item's content
    hash and sample hash: the ones already known, else computed on this pass (the hash
    while its bytes stream out, the sample right after; ``None`` for strings); otherwise
    return ``None``.

    On failure every source of the shard is told (a streaming snapshot must not wait
    for this writer any more), and the error propagates.
    """
    hashes: Optional[List[Any]] = None if shard.hashes is None else list(shard.hashes)
    samples: List[Any] = list(shard.samples or (None,) * len(shard.items))
    try:
        for n, item in enumerate(shard.items):
            value = item.source.get()
            digest = _PieceDigest(value, item.dtype.enum, item.nbytes) \
                if hashes is not None and hashes[n] is None and not item.dtype.is_string else None
            if item.slice_spec == "":
                writer.add(item.key, value, digest=digest)
            else:
                full_shape, tslice = parse_shape_and_slice(item.slice_spec)
                assert tslice is not None
                writer.add_slice(item.key, full_shape, tslice, value, digest=digest)
            if digest is not None and hashes is not None:
                hashes[n] = digest.hexdigest()
                samples[n] = samples[n] or digest.sample
            if hashes is not None and samples[n] is None and not item.dtype.is_string:  # not computed above
                samples[n] = _sample(value, item.dtype.enum)
            item.source.release()
    except BaseException as exc:
        for item in shard.items:
            item.source.fail(exc)
        raise
    return None if hashes is None else (hashes, samples)
