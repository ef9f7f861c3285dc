"""Fuzz the bundle reader past the index's checksums: entries are built from the input, the index is valid.

Random bytes rarely get past the SSTable's block CRCs, so this harness builds a well-formed
index whose *contents* come from the input (via ``atheris.FuzzedDataProvider``): header
(shard count, endianness, version), entries with any dtype enum, rank (up to 70), sizes
(zero, huge, negative), shard ids, offsets, slices (with or without their slice entries),
checksums that match the data or not; then a data file of fuzzed bytes. The reads are those
of ``fuzz_bundle.py``, then ``convert`` to ``.npz`` (the converter lists every entry and sizes
its reused read buffer from the declared shapes: a shape the stored bytes do not justify must
be refused first). Outcome rule: values, or ``shardckpt.errors``.
"""

from __future__ import annotations

import os

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    import fuzz_bundle

    from shardckpt.convert import convert
    from shardckpt.format import crc
    from shardckpt.format.ordered_code import encode_tensor_name_slice
    from shardckpt.format.protos import tensor_bundle_pb2 as pb
    from shardckpt.format.sstable import TableWriter

_DTYPES = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 14, 17, 18, 19, 21, 22, 23, 0, 20, 99, 101]
_SIZES = [0, 1, 2, 3, 4, 7, 16, 2 ** 31, 2 ** 62, -1, 2 ** 63 - 1]


def _dim(fdp: atheris.FuzzedDataProvider) -> int:
    return fdp.PickValueInList(_SIZES) if fdp.ConsumeBool() else fdp.ConsumeIntInRange(0, 40)


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    header = pb.BundleHeaderProto(num_shards=fdp.ConsumeIntInRange(0, 3),
                                  endianness=fdp.ConsumeIntInRange(0, 2))
    header.version.producer = 1
    header.version.min_consumer = fdp.ConsumeIntInRange(0, 2)
    pairs = {b"": header.SerializeToString()}
    shard = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 2048))
    for _ in range(fdp.ConsumeIntInRange(0, 5)):
        key = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 6))
        entry = pb.BundleEntryProto(dtype=fdp.PickValueInList(_DTYPES))
        rank = fdp.ConsumeIntInRange(0, 70) if fdp.ConsumeProbability() < 0.1 else fdp.ConsumeIntInRange(0, 3)
        dims = [_dim(fdp) for _ in range(rank)]
        for d in dims:
            entry.shape.dim.add().size = d
        if rank and fdp.ConsumeBool():  # a sliced tensor: slices, and (usually) their entries
            for _ in range(fdp.ConsumeIntInRange(1, 3)):
                extents = [(fdp.ConsumeIntInRange(0, 5), fdp.PickValueInList([-1, 1, 2, 3, 0])) for _ in dims]
                proto = entry.slices.add()
                for start, length in extents:
                    ext = proto.extent.add()
                    ext.start = start
                    if length >= 0:
                        ext.length = length
                if fdp.ConsumeProbability() < 0.8:
                    piece = _located(fdp, pb.BundleEntryProto(dtype=entry.dtype), shard)
                    for _, length in extents:
                        piece.shape.dim.add().size = length if length >= 0 else 2
                    pairs[encode_tensor_name_slice(key, extents)] = piece.SerializeToString()
        else:
            _located(fdp, entry, shard)
        pairs[key] = entry.SerializeToString()
    table = TableWriter()
    for k in sorted(pairs):
        table.add(k, pairs[k])
    prefix = os.path.join(_common.scratch(), "entries")
    _common.write(prefix + ".index", table.finish())
    for i in range(max(1, min(header.num_shards, 3))):
        name = f"{prefix}.data-{i:05d}-of-{max(1, header.num_shards):05d}"
        _common.write(name, shard)
    _common.allowed(fuzz_bundle._exercise, prefix)
    out = os.path.join(_common.scratch(), "entries-out.npz")
    _common.allowed(convert, prefix, out, src_format="tf", dst_format="npz")
    if os.path.exists(out):
        os.remove(out)


def _located(fdp: atheris.FuzzedDataProvider, entry: pb.BundleEntryProto, shard: bytes) -> pb.BundleEntryProto:
    entry.shard_id = fdp.ConsumeIntInRange(0, 3)
    entry.offset = fdp.ConsumeIntInRange(0, len(shard) + 2) if fdp.ConsumeBool() else fdp.PickValueInList(_SIZES)
    entry.size = fdp.ConsumeIntInRange(0, 64) if fdp.ConsumeBool() else fdp.PickValueInList(_SIZES)
    piece = shard[max(0, entry.offset):max(0, entry.offset) + max(0, entry.size)]
    right = crc.mask(crc.value(piece))
    entry.crc32c = right if fdp.ConsumeProbability() < 0.7 else fdp.ConsumeIntInRange(0, 2 ** 32 - 1)
    return entry


if __name__ == "__main__":
    _common.main(test_one_input)
