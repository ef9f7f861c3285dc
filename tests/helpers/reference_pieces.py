"""The reference agreement check the tests hold the io client's streaming check to: every piece
as a Python object, then the library's own message builder (``problems_message``)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from shardckpt.saving.agreement import Holder, problems_message


def pieces_problem(described: List[Dict[str, List[Any]]]) -> Optional[str]:
    """``None`` when the clients' pieces (``described[r]``: client ``r``'s ``{key: [dtype, shape, boxes]}``)
    make whole tensors, else what is wrong, naming ranks and keys."""
    by_key: Dict[str, List[Holder]] = {}
    for rank, pieces in enumerate(described):
        for key, (dtype, shape, boxes) in pieces.items():
            by_key.setdefault(key, []).append(
                (rank, int(dtype), tuple(int(d) for d in shape),
                 [tuple((int(a), int(b)) for a, b in box) for box in boxes]))
    return problems_message(by_key, [bool(d) for d in described])
