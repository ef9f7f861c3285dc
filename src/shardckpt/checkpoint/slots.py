"""Optimizer slots: per-variable state (Adam's ``m`` and ``v``) saved under ``.OPTIMIZER_SLOT`` keys.

:class:`Optimizer` is a minimal optimizer-like base implementing the protocol the
object graph uses (``get_slot_names``, ``get_slot``): subclasses call
:meth:`Optimizer.add_slot` for each variable they keep state for. A slot saved in
a checkpoint but created after the restore is filled from the checkpoint when
:meth:`add_slot` creates it (restore-on-create), as TensorFlow does.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from .trackable import Module, Trackable, Variable

__all__ = ["Optimizer"]


class Optimizer(Module):
    """Holds slot variables keyed by (variable, slot name)."""

    _slots: Dict[Tuple[int, str], Variable]
    _slot_names: List[str]
    _pending_slots: Dict[Tuple[int, str], List[Callable[[Trackable], None]]]

    def __init__(self) -> None:
        # bookkeeping, not checkpoint dependencies (Module tracks '_' attributes, as TF does)
        object.__setattr__(self, "_slots", {})
        object.__setattr__(self, "_slot_names", [])
        object.__setattr__(self, "_pending_slots", {})

    def add_slot(self, variable: Trackable, slot_name: str, initial_value: Any = None) -> Variable:
        """The slot ``slot_name`` of ``variable``, created (zeros like it by default) if missing."""
        key = (variable._identity(), slot_name)
        slot = self._slots.get(key)
        if slot is not None:
            return slot
        if initial_value is None:
            like = variable._peek() if isinstance(variable, Variable) else np.asarray(variable)
            initial_value = np.full(like.shape, b"", dtype=object) if like.dtype == object else np.zeros_like(like)
        base = getattr(variable, "name", "Variable")
        slot = Variable(initial_value, name=f"{base}/{type(self).__name__}/{slot_name}")
        self._slots[key] = slot
        if slot_name not in self._slot_names:
            self._slot_names.append(slot_name)
        for restore in self._pending_slots.pop(key, []):
            restore(slot)
        return slot

    def get_slot_names(self) -> List[str]:
        """Names of the slots this optimizer creates (``"m"``, ``"v"``, ...)."""
        return list(self._slot_names)

    def get_slot(self, variable: Trackable, slot_name: str) -> Optional[Variable]:
        """The slot ``slot_name`` of ``variable``, or ``None`` when it was not created yet."""
        return self._slots.get((variable._identity(), slot_name))

    def _defer_slot_restore(self, variable: Trackable, slot_name: str, restore: Callable[[Trackable], None]) -> None:
        self._pending_slots.setdefault((variable._identity(), slot_name), []).append(restore)
