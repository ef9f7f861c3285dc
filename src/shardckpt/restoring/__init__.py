"""Restoring: ONE restore path, for every front door.

A front door opens a :class:`PieceSource` (:class:`BundleSource`: the checkpoint's files on
local disk or an object store; :class:`FunnelledSource`: a funnelled restore, where only the
io client reads), plans against its metadata (checking every target first), builds a
:class:`RestorePlan` of :class:`Read`\\ s (grouped in :class:`ReadGroup`\\ s) and hands it to
:func:`run`, the one read loop (stored pieces that several reads cut across planned to be read
once, whole: :mod:`.sharing`; announce once, one pool, reads into destinations, verify,
report). See :mod:`.engine` for the steps and :mod:`.source` for the source's call sequence.

Front doors: ``restore_tensors`` (:mod:`.tensors`), ``Checkpoint.restore``/``read``
(``checkpoint.restore``), DTensor restores, ``shardckpt.jax.restore``, DCP's
``TFBundleReader``.
"""

from .engine import collective_call, read_one, run
from .funnel import FunnelledSource, funnelled_reader
from .plan import Read, ReadGroup, RestorePlan
from .source import BundleSource, PieceSource, as_source
from .tensors import RestoreRequest, restore_tensors

__all__ = ["Read", "ReadGroup", "RestorePlan", "PieceSource", "BundleSource", "FunnelledSource", "as_source",
           "run", "read_one", "collective_call", "funnelled_reader", "RestoreRequest", "restore_tensors"]
