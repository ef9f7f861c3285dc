"""JAX's face: pytrees of sharded ``jax.Array``s saved and restored with shardckpt (extra ``[jax]``).

::

    import shardckpt.jax as sj

    sj.save("/ckpt/step-100", {"params": params, "opt_state": opt_state, "step": 100})
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=new_sharding), ...)
    state = sj.restore("/ckpt/step-100", target)

* :func:`save` — collective over the job's processes; each writes only the shards it
  holds with ``replica_id == 0``, through the one save engine (:mod:`shardckpt.saving`);
  across processes over JAX's distributed runtime
  (:class:`~shardckpt.distributed.jax_backend.JaxCoordinator`).
* :func:`restore` — onto exactly the target's shardings, reading only the bytes each
  process's devices need; also checkpoints written by ``Checkpoint``,
  ``DTensorCheckpoint``, the PyTorch adapter or TensorFlow (``key_map``).
* :class:`PyTreeCheckpoint` — a pytree for :class:`~shardckpt.CheckpointManager`
  (numbering, retention, ``latest_checkpoint``, ``restore_or_initialize``).

Keys are the leaves' pytree paths (``params/dense/kernel``); the files are a
TensorFlow checkpoint (``tf.train.load_checkpoint`` reads them). Without the ``[jax]``
extra, importing this module raises :class:`~shardckpt.errors.MissingExtraError` (an
``ImportError``) that says so.
"""

# ruff: noqa: E402  (the extra is checked before the modules that import it)
from .._extras import require

require("jax", extra="jax", what="shardckpt.jax", needs="JAX")

from ._checkpoint import PyTreeCheckpoint
from ._restore import DEFAULT_MEMORY_BUDGET, restore
from ._save import default_coordinator, save, wait_until_finished
from ._tree import METADATA_KEY, key_of

__all__ = ["save", "restore", "wait_until_finished", "PyTreeCheckpoint", "default_coordinator", "key_of",
           "METADATA_KEY", "DEFAULT_MEMORY_BUDGET"]
