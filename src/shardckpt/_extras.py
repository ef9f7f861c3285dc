"""Optional dependencies: one way to import them and one message when they are missing.

The core needs only what ``pyproject.toml`` lists under ``dependencies``. The faces and
backends that need more (``shardckpt.torch``, ``shardckpt.jax``, the MPI coordinator,
object stores) import it through :func:`require`, which raises
:class:`~shardckpt.errors.MissingExtraError` (an ``ImportError``) naming the extra that
installs it, e.g.::

    MissingExtraError: shardckpt.torch needs PyTorch (No module named 'torch'):
    install the [torch] extra: pip install '.[torch]' in a shardckpt checkout
"""

from __future__ import annotations

import importlib
from types import ModuleType

from .errors import MissingExtraError

__all__ = ["install_hint", "require"]


def install_hint(extra: str) -> str:
    """The command that installs ``extra`` (shardckpt is installed from a checkout, not from an index)."""
    return f"install the [{extra}] extra: pip install '.[{extra}]' in a shardckpt checkout"


def require(module: str, *, extra: str, what: str, needs: str) -> ModuleType:
    """Import ``module`` or raise :class:`MissingExtraError` saying that ``what`` needs ``needs``, from ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(f"{what} needs {needs} ({exc}): {install_hint(extra)}") from exc
