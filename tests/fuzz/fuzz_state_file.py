"""Fuzz the ``checkpoint`` state-file parser (text-format ``CheckpointState``).

An input is the whole state file; the harness parses it (``get_checkpoint_state``) and
asks for the latest checkpoint. Outcome rule: a state (or ``None``), or ``shardckpt.errors``.
"""

from __future__ import annotations

import os

import _common
import atheris

with atheris.instrument_imports(include=["shardckpt"]):
    from shardckpt.checkpoint.state import get_checkpoint_state, latest_checkpoint


def test_one_input(data: bytes) -> None:
    directory = os.path.join(_common.scratch(), "state")
    os.makedirs(directory, exist_ok=True)
    _common.write(os.path.join(directory, "checkpoint"), data)
    _common.allowed(lambda: get_checkpoint_state(directory))
    _common.allowed(lambda: latest_checkpoint(directory))


if __name__ == "__main__":
    _common.main(test_one_input)
