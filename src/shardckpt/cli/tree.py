"""The key hierarchy of a checkpoint (``inspect --tree``): names split at ``/`` (or ``.``), sizes summed per level."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Tuple

from ._text import human_size, shape_text

__all__ = ["Node", "build_tree", "render_tree", "tree_json"]


@dataclass
class Node:
    name: str
    nbytes: int = 0
    count: int = 0
    children: Dict[str, "Node"] = field(default_factory=dict)
    leaf: Optional[Tuple[str, Tuple[int, ...]]] = None  # (dtype, shape) of a tensor ending here


def build_tree(items: Sequence[Tuple[str, str, Tuple[int, ...], int]], sep: str = "/") -> Node:
    """A tree from ``(name, dtype name, shape, nbytes)`` records, names split at ``sep``."""
    root = Node("")
    for name, dtype, shape, nbytes in items:
        node = root
        node.nbytes += nbytes
        node.count += 1
        for part in name.split(sep):
            node = node.children.setdefault(part, Node(part))
            node.nbytes += nbytes
            node.count += 1
        node.leaf = (dtype, tuple(shape))
    return root


def render_tree(root: Node, sep: str = "/") -> str:
    lines = [f"{root.count} tensors, {root.nbytes} bytes ({human_size(root.nbytes)})"]

    def walk(node: Node, indent: str) -> None:
        kids = sorted(node.children.values(), key=lambda n: n.name)
        for i, child in enumerate(kids):
            last = i == len(kids) - 1
            label = child.name
            while child.leaf is None and len(child.children) == 1:  # a chain like .ATTRIBUTES/VARIABLE_VALUE
                child = next(iter(child.children.values()))
                label += sep + child.name
            branch = "└── " if last else "├── "
            if child.leaf is not None and not child.children:
                dtype, shape = child.leaf
                lines.append(f"{indent}{branch}{label}  {dtype}{shape_text(shape)}  {human_size(child.nbytes)}")
            else:
                lines.append(f"{indent}{branch}{label}{sep}  {child.count} tensors  {human_size(child.nbytes)}")
            walk(child, indent + ("    " if last else "│   "))

    walk(root, "")
    return "\n".join(lines)


def tree_json(node: Node) -> Dict[str, Any]:
    out: Dict[str, Any] = {"name": node.name, "bytes": node.nbytes, "tensors": node.count}
    if node.leaf is not None:
        out["dtype"], out["shape"] = node.leaf[0], list(node.leaf[1])
    if node.children:
        out["children"] = [tree_json(c) for c in sorted(node.children.values(), key=lambda n: n.name)]
    return out
