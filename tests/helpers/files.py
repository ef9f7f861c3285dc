"""Small file edits the tests make to damage a checkpoint on purpose."""

from __future__ import annotations


def flip_byte(path: str, offset: int) -> None:
    """Flip one bit (0x10) of the byte at ``offset`` of the file at ``path``, in place."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x10]))
