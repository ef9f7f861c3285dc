"""PyTorch's face: shardckpt as a storage backend of ``torch.distributed.checkpoint`` (DCP).

::

    import torch.distributed.checkpoint as dcp
    from shardckpt.torch import TFBundleWriter, TFBundleReader
    dcp.save(state_dict, checkpoint_id="/ckpt/step-100", storage_writer=TFBundleWriter())
    dcp.load(state_dict, checkpoint_id="/ckpt/step-100", storage_reader=TFBundleReader())  # any world size

A ``checkpoint_id`` is a directory, as in DCP: the TensorFlow tensor bundle
(``ckpt.index`` + ``ckpt.data-*``) and its ``checkpoint`` state file go inside it
(:mod:`._layout`); ``TFBundleWriter(prefix)`` / ``TFBundleReader(prefix)`` keep
TensorFlow's prefix spelling. TensorFlow (``tf.train.load_checkpoint(dir)``),
``shardckpt inspect`` / ``verify`` read it without PyTorch; no pickle is written.
DCP's ``process_group`` and ``no_dist`` decide which ranks take part (:mod:`._call`).
The writer only translates DCP's write items into the save engine's plan
(:mod:`shardckpt.saving.engine`); the reader translates read items into region reads
(:mod:`shardckpt.format.bundle_reader`).
:class:`TFBundleLoadPlanner` plans resharded loads in time linear in the chunks read.
``dcp.async_save`` keeps its staged copy's host buffers for the next save;
:func:`release_staging_buffers` frees them.
Needs the ``[torch]`` extra; without it, importing this module raises
:class:`~shardckpt.errors.MissingExtraError` (an ``ImportError``) that says so.
"""

# ruff: noqa: E402  (the extra is checked before the modules that import it)
from .._extras import require

require("torch.distributed.checkpoint", extra="torch", what="shardckpt.torch", needs="PyTorch")

from ._planner import TFBundleLoadPlanner, read_items_for_chunks
from ._reader import KeyMap, TFBundleReader
from ._staging import release_staging_buffers
from ._writer import TFBundleWriter

__all__ = ["TFBundleWriter", "TFBundleReader", "TFBundleLoadPlanner", "KeyMap", "read_items_for_chunks",
           "release_staging_buffers"]
