"""Fuzz the object-graph parser: an input is the serialized ``TrackableObjectGraph``.

The harness stores the input as the ``_CHECKPOINTABLE_OBJECT_GRAPH`` string of a small
checkpoint that also holds a variable, then parses the graph (``load_object_graph``)
and restores a small object tree from the checkpoint (matching the graph to objects).
Outcome rule: a restore, or ``shardckpt.errors``.
"""

from __future__ import annotations

import os

import _common
import atheris
import numpy as np

with atheris.instrument_imports(include=["shardckpt"]):
    import shardckpt
    from shardckpt.checkpoint.restore import load_object_graph
    from shardckpt.format.bundle_reader import BundleReader
    from shardckpt.io import save_v2
    from shardckpt.storage.location import Location

_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
_VAR = "v/.ATTRIBUTES/VARIABLE_VALUE"


def _restore(prefix: str) -> None:
    with BundleReader(Location.of(prefix)) as reader:
        load_object_graph(reader)
    root = shardckpt.Checkpoint(v=shardckpt.Variable(np.zeros(3, np.float32)))
    root.restore(prefix).expect_partial()


def test_one_input(data: bytes) -> None:
    prefix = os.path.join(_common.scratch(), "graph")
    save_v2(prefix, [_KEY, _VAR], ["", ""], [np.array(data, dtype=object), np.arange(3, dtype=np.float32)])
    _common.allowed(lambda: _restore(prefix))


if __name__ == "__main__":
    _common.main(test_one_input)
