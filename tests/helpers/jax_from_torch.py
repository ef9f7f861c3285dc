"""Restore a checkpoint written by shardckpt's PyTorch backend into a JAX pytree (tests/test_torch_dcp.py).

    python jax_from_torch.py PREFIX SAVED_NPZ OUT_JSON

``PREFIX`` was written by ``dcp.save`` with ``TFBundleWriter`` from DTensors on a 2x2 mesh
(its keys are DCP's FQNs, ``model.layers.0.q``; sharded tensors are TF slices).
``SAVED_NPZ`` holds each tensor's global value as bytes. Every tensor key becomes a leaf
of a nested pytree (``params/layers/0/q``, ``opt/state/emb/exp_avg``) restored with
``shardckpt.jax.restore`` and a ``key_map`` onto a (2, 4) mesh of 8 CPU devices with
other PartitionSpecs; each leaf must equal the saved bytes and have the target's
sharding. Writes ``OUT_JSON``: the checks, and the counts of sliced and restored keys.
"""

from __future__ import annotations

import os

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import json  # noqa: E402
import sys  # noqa: E402
from typing import Any, Dict  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import shardckpt.jax as sj  # noqa: E402
from shardckpt.format.bundle_reader import BundleReader  # noqa: E402
from shardckpt.storage.location import Location

jax.config.update("jax_enable_x64", True)
ROOTS = {"model": "params", "optim": "opt"}  # checkpoint FQN root -> pytree root


def spec(shape: tuple) -> Any:
    """Another layout than the 2x2 save's: rows over x (2), columns over y (4) where they divide."""
    if len(shape) == 2:
        return P("x" if shape[0] % 2 == 0 else None, "y" if shape[1] % 4 == 0 else None)
    if len(shape) == 1 and shape[0] % 8 == 0:
        return P(("y", "x"))
    return P()


def to_ckpt_key(path_key: str) -> str:
    root, _, rest = path_key.partition("/")
    return {v: k for k, v in ROOTS.items()}[root] + "." + rest.replace("/", ".")


def main() -> None:
    prefix, saved_npz, out = sys.argv[1], sys.argv[2], sys.argv[3]
    saved = dict(np.load(saved_npz))
    mesh = jax.make_mesh((2, 4), ("x", "y"), devices=jax.devices()[:8])
    target: Dict[str, Any] = {}
    sliced = 0
    with BundleReader(Location.of(prefix)) as reader:
        for key in saved:
            shape, dtype = tuple(reader.shape(key)), np.dtype(reader.dtype(key).as_numpy_dtype)
            sliced += any(p.slice is not None for p in reader.pieces(key))
            root, *names = key.split(".")
            node = target.setdefault(ROOTS[root], {})
            for name in names[:-1]:
                node = node.setdefault(name, {})
            node[names[-1]] = jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec(shape)))
    restored = sj.restore(prefix, target, key_map=to_ckpt_key)
    checks: Dict[str, bool] = {}
    leaves = jax.tree_util.tree_leaves_with_path(restored)
    wanted = dict(jax.tree_util.tree_leaves_with_path(target))
    for path, leaf in leaves:
        key = to_ckpt_key("/".join(str(getattr(k, "key", k)) for k in path))
        exact = np.ascontiguousarray(np.asarray(leaf)).view(np.uint8).reshape(-1).tobytes() == saved[key].tobytes()
        checks[key] = bool(exact and leaf.sharding == wanted[path].sharding and leaf.dtype == wanted[path].dtype)
    with open(out, "w") as f:
        json.dump({"checks": checks, "sliced": sliced, "restored": len(leaves)}, f)


if __name__ == "__main__":
    main()
