"""``shardckpt inspect PREFIX --map FILE.svg`` (or ``.html``): a picture of where every slice is stored.

For each chosen tensor (the largest first; ``--keys REGEX`` picks them) the global shape is
drawn as a frame and every stored piece as a rectangle at its place, filled with the colour of
the data file that holds it (one file per writing client in a DTensor or DCP save), with a
legend of the files. Regions no piece covers (holes) and regions stored more than once
(overlaps) are drawn in red over the pieces, and the tensor's caption says so.

How a shape becomes a picture:

* rank 2: rows down, columns across, one scale for both axes (480 pixels across a wide tensor,
  320 down a tall one; the aspect ratio is kept
  within 1:16 so that an embedding of 30522 x 768 stays visible: beyond that the long side
  is shortened, and the caption says "not to scale");
* rank 1: a bar, the pieces along it;
* rank 0: a square;
* rank 3 and more: the two axes along which the pieces are cut (the first two if none is)
  against each other; pieces that differ only along the other axes overlap in the picture,
  so holes and overlaps are computed on the whole shape and drawn where they project.

Holes and overlaps are exact: the pieces' boundaries cut every axis into intervals, and each
cell of that grid is counted (up to ``MAX_CELLS`` cells per tensor; beyond that a tensor's
coverage is judged by volumes only and nothing is drawn in red). Every rectangle carries
``data-key``, ``data-shard`` and ``data-box`` attributes, so the picture can be checked by
a program too. The ``.html`` form is one self-contained page (the SVG inline, no scripts,
nothing fetched), which opens offline.
"""

from __future__ import annotations

import html
import math
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import InvalidArgumentError
from ..format.tensor_slice import Box
from ..storage.base import FileSystem
from ..storage.registry import get_fs
from ._layout import DataFile, TensorLayout
from ._text import human_size, shape_text

__all__ = ["Coverage", "coverage", "choose_tensors", "render_svg", "render_html", "write_map", "DEFAULT_TENSORS"]

DEFAULT_TENSORS = 24  #: tensors drawn when ``--keys`` is not given (the largest)
MAX_CELLS = 1 << 22  #: grid cells per tensor beyond which holes and overlaps are judged by volume only
WIDTH = 480  #: pixels across a tensor wider than tall
TALL = 320  #: pixels down a tensor taller than wide
MAX_ASPECT = 16  #: a drawn tensor is at most this many times longer than it is wide
BAR = 18  #: height of a rank-1 bar
MARGIN = 16
CAPTION = 34
LEGEND_ROW = 18
# Colour-blind-safe qualitative colours (Okabe-Ito, then Tol's muted), cycled; red is kept for holes.
PALETTE = ["#0072B2", "#E69F00", "#009E73", "#56B4E9", "#F0E442", "#CC79A7", "#332288", "#88CCEE",
           "#117733", "#999933", "#AA4499", "#44AA99", "#DDCC77", "#882255", "#6699CC", "#997700"]
PROBLEM = "#D00000"


@dataclass(frozen=True)
class Coverage:
    """How the stored pieces cover a tensor: boxes of holes and of overlaps (in the tensor's coordinates)."""

    holes: List[Box]
    overlaps: List[Box]
    exact: bool  #: False when the grid was too large and only volumes were compared

    @property
    def ok(self) -> bool:
        return not self.holes and not self.overlaps


def _volume(box: Box) -> int:
    return math.prod(stop - start for start, stop in box)


def coverage(shape: Sequence[int], boxes: Sequence[Box]) -> Coverage:
    """The holes and overlaps of ``boxes`` over a tensor of ``shape`` (each a list of grid-cell boxes)."""
    rank = len(shape)
    if rank == 0:
        count = len(boxes)
        return Coverage([()] if count == 0 else [], [()] if count > 1 else [], True)
    if any(d == 0 for d in shape):
        return Coverage([], [], True)
    cuts = [sorted({0, int(shape[a])} | {b[a][0] for b in boxes} | {b[a][1] for b in boxes}) for a in range(rank)]
    cells = math.prod(len(c) - 1 for c in cuts)
    if cells > MAX_CELLS:
        stored = sum(_volume(b) for b in boxes)
        total = math.prod(int(d) for d in shape)
        return Coverage([tuple((0, int(d)) for d in shape)] if stored < total else [],
                        [tuple((0, int(d)) for d in shape)] if stored > total else [], False)
    counts = np.zeros([len(c) - 1 for c in cuts], np.int32)
    for box in boxes:
        index = tuple(slice(cuts[a].index(box[a][0]), cuts[a].index(box[a][1])) for a in range(rank))
        counts[index] += 1

    def boxes_where(mask: np.ndarray) -> List[Box]:
        return [tuple((cuts[a][i], cuts[a][i + 1]) for a, i in enumerate(cell)) for cell in zip(*np.nonzero(mask))]

    return Coverage(boxes_where(counts == 0), boxes_where(counts > 1), True)


def choose_tensors(rows: Sequence[TensorLayout], keys: Optional[str], count: int = DEFAULT_TENSORS
                   ) -> List[TensorLayout]:
    """The tensors to draw: those whose name matches ``keys`` (a regex; all if ``None``), largest first."""
    if keys is not None:
        try:
            pattern = re.compile(keys)
        except re.error as exc:
            raise InvalidArgumentError(f"--keys {keys!r} is not a regular expression: {exc}") from None
        rows = [r for r in rows if pattern.search(r.name)]
        return sorted(rows, key=lambda r: (-r.nbytes, r.name))
    return sorted(rows, key=lambda r: (-r.nbytes, r.name))[:count]


def _axes(layout: TensorLayout) -> Tuple[int, ...]:
    """The axes drawn: all of a rank <= 2 tensor; else the two along which most pieces are cut."""
    rank = len(layout.shape)
    if rank <= 2:
        return tuple(range(rank))
    cut = [len({p.box[a] for p in layout.pieces}) for a in range(rank)]
    order = sorted(range(rank), key=lambda a: (-cut[a], a))
    return tuple(sorted(order[:2]))


def _frame(layout: TensorLayout, axes: Tuple[int, ...]) -> Tuple[float, float, bool]:
    """Width and height in pixels of the drawn tensor, and whether it is drawn to scale."""
    if len(axes) == 0:
        return BAR, BAR, True
    if len(axes) == 1:
        return WIDTH, BAR, True
    rows, cols = (max(1, int(layout.shape[a])) for a in axes)
    if rows >= cols:
        height: float = TALL
        width = TALL * cols / rows
    else:
        width = WIDTH
        height = WIDTH * rows / cols
    to_scale = max(width, height) / min(width, height) <= MAX_ASPECT
    return max(width, TALL / MAX_ASPECT), max(height, TALL / MAX_ASPECT), to_scale


def _place(box: Box, shape: Sequence[int], axes: Tuple[int, ...], width: float, height: float
           ) -> Tuple[float, float, float, float]:
    """``x, y, w, h`` of ``box`` inside a frame of ``width`` x ``height``."""
    if len(axes) == 0:
        return 0.0, 0.0, width, height
    if len(axes) == 1:
        (a,) = axes
        n = max(1, int(shape[a]))
        return width * box[a][0] / n, 0.0, width * (box[a][1] - box[a][0]) / n, height
    r, c = axes
    nr, nc = max(1, int(shape[r])), max(1, int(shape[c]))
    return (width * box[c][0] / nc, height * box[r][0] / nr,
            width * (box[c][1] - box[c][0]) / nc, height * (box[r][1] - box[r][0]) / nr)


def _box_text(box: Box) -> str:
    return ",".join(f"{a}:{b}" for a, b in box) if box else "scalar"


def _colour(shard: int) -> str:
    return PALETTE[shard % len(PALETTE)]


def _coverages(layouts: Sequence[TensorLayout]) -> List[Coverage]:
    return [coverage(t.shape, [p.box for p in t.pieces]) for t in layouts]


def render_svg(prefix: str, layouts: Sequence[TensorLayout], files: Sequence[DataFile],
               covers: Optional[Sequence[Coverage]] = None) -> str:
    """The SVG document of ``layouts`` (stacked top to bottom), with a legend of ``files``
    (``covers``: their :func:`coverage`, computed here when not given)."""
    covers = _coverages(layouts) if covers is None else covers
    parts: List[str] = []
    used = sorted({p.shard for t in layouts for p in t.pieces})
    y: float = MARGIN + 22 + LEGEND_ROW * len(used) + MARGIN
    width_total = WIDTH + 2 * MARGIN + 200
    for layout, cover in zip(layouts, covers):
        axes = _axes(layout)
        width, height, to_scale = _frame(layout, axes)
        notes = [] if to_scale else ["not to scale"]
        if len(layout.shape) > 2:
            notes.append(f"axes {axes[0]} x {axes[1]} of {len(layout.shape)}")
        if cover.holes:
            notes.append("HOLES")
        if cover.overlaps:
            notes.append("OVERLAPS")
        caption = (f"{layout.name}  {layout.dtype.name}{shape_text(layout.shape)}  {human_size(layout.nbytes)}  "
                   f"{len(layout.pieces)} piece{'s' if len(layout.pieces) != 1 else ''}"
                   + (f"  ({', '.join(notes)})" if notes else ""))
        parts.append(f'<g class="tensor" data-key="{html.escape(layout.name)}" '
                     f'data-shape="{",".join(str(d) for d in layout.shape)}" '
                     f'data-ok="{str(cover.ok).lower()}" transform="translate({MARGIN},{y:.1f})">')
        parts.append(f'<text x="0" y="14" class="caption">{html.escape(caption)}</text>')
        parts.append(f'<g transform="translate(0,{CAPTION - 12})">')
        for piece in layout.pieces:
            x, yy, w, h = _place(piece.box, layout.shape, axes, width, height)
            title = f"{layout.name} [{_box_text(piece.box)}] in {piece.file} @ {piece.offset}, {piece.size} bytes"
            parts.append(f'<rect class="piece" data-key="{html.escape(layout.name)}" data-shard="{piece.shard}" '
                         f'data-box="{_box_text(piece.box)}" x="{x:.2f}" y="{yy:.2f}" width="{w:.2f}" '
                         f'height="{h:.2f}" fill="{_colour(piece.shard)}" fill-opacity="0.85" stroke="#ffffff" '
                         f'stroke-width="1"><title>{html.escape(title)}</title></rect>')
        for kind, boxes in (("hole", cover.holes), ("overlap", cover.overlaps)):
            for box in boxes:
                x, yy, w, h = _place(box, layout.shape, axes, width, height)
                parts.append(f'<rect class="{kind}" data-key="{html.escape(layout.name)}" '
                             f'data-box="{_box_text(box)}" x="{x:.2f}" y="{yy:.2f}" width="{w:.2f}" '
                             f'height="{h:.2f}" fill="{PROBLEM}" fill-opacity="{0.9 if kind == "hole" else 0.5}" '
                             f'stroke="{PROBLEM}" stroke-width="2"><title>{kind} '
                             f'[{_box_text(box)}]</title></rect>')
        parts.append(f'<rect class="frame" x="0" y="0" width="{width:.2f}" height="{height:.2f}" fill="none" '
                     f'stroke="#333333" stroke-width="1"/>')
        parts.append("</g></g>")
        y += CAPTION + height + MARGIN
    legend = [f'<text x="{MARGIN}" y="{MARGIN + 12}" class="title">{html.escape(prefix)}: '
              f'{len(layouts)} tensor{"s" if len(layouts) != 1 else ""}, {len(files)} data '
              f'file{"s" if len(files) != 1 else ""}</text>']
    by_shard = {f.shard: f for f in files}
    for i, shard in enumerate(used):
        ly = MARGIN + 22 + LEGEND_ROW * i
        name = by_shard[shard].name if shard in by_shard else f"shard {shard}"
        legend.append(f'<g class="legend" data-shard="{shard}"><rect x="{MARGIN}" y="{ly}" width="12" height="12" '
                      f'fill="{_colour(shard)}"/><text x="{MARGIN + 18}" y="{ly + 11}">{html.escape(name)}</text></g>')
    height_total = y + MARGIN
    style = ("<style>text{font-family:ui-monospace,Menlo,Consolas,monospace;font-size:12px;fill:#222}"
             ".title{font-weight:bold;font-size:13px}</style>")
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width_total}" height="{height_total:.0f}" '
            f'viewBox="0 0 {width_total} {height_total:.0f}">{style}'
            f'<rect width="100%" height="100%" fill="#ffffff"/>' + "".join(legend) + "".join(parts) + "</svg>\n")


def render_html(prefix: str, layouts: Sequence[TensorLayout], files: Sequence[DataFile],
                covers: Optional[Sequence[Coverage]] = None) -> str:
    """One self-contained HTML page holding :func:`render_svg`'s picture (no scripts, nothing fetched)."""
    svg = render_svg(prefix, layouts, files, covers)
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f"<title>shard map: {html.escape(prefix)}</title></head>"
            "<body style=\"margin:0;background:#f6f6f6\">" + svg + "</body></html>\n")


def write_map(path: str, prefix: str, layouts: Sequence[TensorLayout], files: Sequence[DataFile], *,
              fs: Optional[FileSystem] = None) -> Dict[str, int]:
    """Write the picture to ``path`` (``.svg`` or ``.html``) on ``fs`` (default: the store serving ``path``,
    local or an object store), whole or not at all; returns counts for the command's summary line."""
    lower = path.lower()
    covers = _coverages(layouts)  # once: for the picture and for the count
    if lower.endswith(".svg"):
        text = render_svg(prefix, layouts, files, covers)
    elif lower.endswith((".html", ".htm")):
        text = render_html(prefix, layouts, files, covers)
    else:
        raise InvalidArgumentError(f"--map {path!r}: the file name must end in .svg or .html")
    (fs if fs is not None else get_fs(path)).write_atomic(path, text.encode("utf-8"))
    problems = sum(1 for c in covers if not c.ok)
    return {"tensors": len(layouts), "pieces": sum(len(t.pieces) for t in layouts), "with_problems": problems}
