"""Writing one shard's values into a bundle writer: what every committer's ``write_shard`` does."""

from __future__ import annotations

from ...format.bundle_writer import BundleWriter
from ...format.tensor_slice import parse_shape_and_slice
from ..plan import ShardPlan

__all__ = ["fill_bundle"]


def fill_bundle(writer: BundleWriter, shard: ShardPlan) -> None:
    """Append every item of ``shard`` to ``writer``, in order; release each source once its bytes are written.

    On failure every source of the shard is told (a streaming snapshot must not wait
    for this writer any more), and the error propagates.
    """
    try:
        for item in shard.items:
            value = item.source.get()
            if item.slice_spec == "":
                writer.add(item.key, value)
            else:
                full_shape, tslice = parse_shape_and_slice(item.slice_spec)
                assert tslice is not None
                writer.add_slice(item.key, full_shape, tslice, value)
            item.source.release()
    except BaseException as exc:
        for item in shard.items:
            item.source.fail(exc)
        raise
