"""A real RAM disk of a chosen size for a test: a tmpfs mounted on a folder (a container's small
``/dev/shm`` is one). Mounting needs root, as the suite runs on this project's machines; where it is
refused, the test is skipped and says why."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path
from typing import Iterator

import pytest


@contextlib.contextmanager
def ramdisk(folder: Path, size: str) -> Iterator[Path]:
    """``folder`` (made if missing) as a tmpfs of ``size`` (``"3m"``, ``"3584k"``) while the block runs."""
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode(errors='replace').strip()}")
    try:
        yield folder
    finally:
        if subprocess.run(["umount", str(folder)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(folder)], check=True)  # a descriptor still open in it: detached
