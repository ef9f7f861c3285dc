"""Small file edits the tests make to damage a checkpoint on purpose, and files of random bytes."""

from __future__ import annotations

from pathlib import Path
from typing import Tuple

import numpy as np


def random_file(folder: Path, size: int, seed: int) -> Tuple[str, np.ndarray]:
    """A file of ``size`` random bytes (reproducible from ``seed``) under ``folder``: its path and bytes."""
    raw = np.random.default_rng(seed).integers(0, 256, size=size, dtype=np.uint8)
    path = folder / "data"
    raw.tofile(path)
    return str(path), raw


def flip_byte(path: str, offset: int) -> None:
    """Flip one bit (0x10) of the byte at ``offset`` of the file at ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
