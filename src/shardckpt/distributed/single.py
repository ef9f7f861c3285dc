"""The coordinator of a single process: every collective is trivial."""

from __future__ import annotations

from typing import Any, List, Optional

from ..errors import InvalidArgumentError
from .coordinator import Coordinator, decode, encode

__all__ = ["SingleProcessCoordinator"]


class SingleProcessCoordinator(Coordinator):
    """One client, rank 0 of 1."""

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    @property
    def backend(self) -> str:
        """``"single"``: no engine, one process."""
        return "single"

    def barrier(self, name: str = "barrier", timeout: Optional[float] = None) -> None:
        return None

    def clone(self) -> "SingleProcessCoordinator":
        return SingleProcessCoordinator()

    def all_gather(self, obj: Any, timeout: Optional[float] = None) -> List[Any]:
        return [decode(encode(obj))]

    def gather(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Optional[List[Any]]:
        if root != 0:
            raise InvalidArgumentError(f"gather root {root} out of range for 1 client")
        return [decode(encode(obj))]

    def broadcast(self, obj: Any, root: int = 0, timeout: Optional[float] = None) -> Any:
        if root != 0:
            raise InvalidArgumentError(f"broadcast root {root} out of range for 1 client")
        return decode(encode(obj))

    def send_bytes(self, data: memoryview, dst: int, tag: int = 0) -> None:
        raise InvalidArgumentError("a single client has no peer to send to")

    def recv_bytes(self, src: int, nbytes: int, out: Optional[memoryview] = None, tag: int = 0,
                   timeout: Optional[float] = None) -> memoryview:
        raise InvalidArgumentError("a single client has no peer to receive from")
