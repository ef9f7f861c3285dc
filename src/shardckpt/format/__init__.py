"""Bytes on disk, nothing else: TensorFlow's tensor-bundle format.

``sstable`` (the ``.index`` table), ``protos`` (header, entries, slices),
``dtypes``, ``tensor_slice`` and ``ordered_code`` (slices and their keys),
``strings``, ``bundle_writer`` / ``bundle_reader`` (a face over ``bundle_index``,
``bundle_pieces``, ``bundle_files``, ``region_reads``, ``whole_reads``,
``read_session``, ``announce`` and ``buffers``), ``merge`` and ``naming``.
Nothing here looks a store up: readers and writers get a
:class:`~shardckpt.storage.location.Location` (or a prefix and its ``fs``) from their caller.
"""

from .bundle_reader import BundleReader
from .bundle_writer import BundleWriter
from .dtypes import DType, as_dtype
from .merge import plan_merge
from .naming import data_filename, index_filename, sharded_filename
from .tensor_slice import TensorSlice, parse_shape_and_slice

__all__ = ["BundleReader", "BundleWriter", "DType", "as_dtype", "plan_merge", "data_filename",
           "index_filename", "sharded_filename", "TensorSlice", "parse_shape_and_slice"]
