"""Optional extras: importing a face without its dependency names the extra that installs it.

Each case runs in a fresh interpreter in which the dependency cannot be imported (a
meta-path finder refuses it, as Python does for a package that is not installed).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = r"""
import importlib.abc, sys
class NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == {missing!r} or name.startswith({missing!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
        return None
sys.meta_path.insert(0, NotInstalled())
from shardckpt.errors import MissingExtraError, ShardckptError
try:
    import {module}
except ImportError as exc:
    assert isinstance(exc, MissingExtraError) and isinstance(exc, ShardckptError), type(exc)
    print(exc)
else:
    raise SystemExit("imported without " + {missing!r})
"""


@pytest.mark.parametrize("module,missing,extra", [
    ("shardckpt.torch", "torch", "torch"),
    ("shardckpt.jax", "jax", "jax"),
])
def test_a_face_without_its_extra_raises_an_import_error_naming_the_extra(module: str, missing: str,
                                                                         extra: str) -> None:
    out = subprocess.run([sys.executable, "-c", _PROBE.format(module=module, missing=missing)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr + out.stdout
    assert f"pip install '.[{extra}]'" in out.stdout, out.stdout
    assert module in out.stdout and missing in out.stdout


def test_the_core_imports_without_any_extra() -> None:
    probe = _PROBE.split("from shardckpt.errors")[0] + "import shardckpt, shardckpt.dtensor, shardckpt.convert\n"
    for missing in ("torch", "jax", "mpi4py", "fsspec"):
        out = subprocess.run([sys.executable, "-c", probe.format(missing=missing)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"without {missing}: {out.stderr}"
