"""What every client of a collective save must agree on, checked before a byte is written.

1. **The save's identity.** Each client numbers its saves over a coordinator; the
   first collective of a save all-gathers every client's ``(prefix, number)``. A client
   that skipped a save, or saves to another prefix, makes every client fail this save
   at once, naming it (instead of pairing later saves off by one).
2. **The pieces.** Every client describes its pieces (key, dtype, global shape, box)
   and sends them with its shard count to the io client only (a gather; a packed table
   of columns, :mod:`.piece_table`: a few bytes a piece where the JSON takes ~84). The io
   client checks the union (:func:`check_pieces`, streaming over the clients' tables and
   vectorized, :mod:`.piece_check`): per key one dtype, one global shape, and boxes that
   tile the tensor exactly (no gap, no overlap); then it broadcasts the verdict with the
   shard counts. Any disagreement fails the save on every client with the same error
   naming the disagreeing clients and keys; nothing is written, nothing committed, the
   previous checkpoint stays latest.
3. **What every client holds, written or not.** A replicated piece is written by one
   client only, so step 2 cannot see a client that lacks a variable (or names it
   otherwise) when another client writes it. Front doors that save several clients'
   values list, per client, every variable it holds: ``(name, dtype, global shape,
   layout, mesh)`` (:func:`describe_held`; a :class:`~.pieces.DistributedValue` may tell
   its layout and mesh with ``held_layout()``, any other value is written whole by the
   io client). Each client sends only a digest of its sorted list with its pieces
   (:func:`held_digest`: 32 hex characters); when the io client sees more than one
   digest, one client of each digest (:func:`held_representatives`) sends its whole
   list in one more gather, and :func:`held_problem` names, per variable, the clients
   that hold it otherwise or not at all. The verdict travels with step 2's; a
   disagreement fails the save like step 2's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from ..distributed.coordinator import Coordinator
from ..errors import ShardingValidationError
from ..format.dtypes import as_dtype
from ..format.tensor_slice import Box, full_box, parse_shape_and_slice
from ..runtime import runtime
from .piece_check import check_packed
from .piece_table import pack_table, table_as_dict, unpack_table
from .plan import SavePlan

__all__ = ["save_identity", "identity_problem", "describe_pieces", "pack_pieces", "unpack_pieces",
           "check_pieces", "problems_message", "Held", "describe_held", "held_digest", "held_representatives",
           "held_problem"]

#: One holder of a key: ``(rank, dtype enum, global shape, boxes)``.
Holder = Tuple[int, int, Tuple[int, ...], List[Box]]

#: One variable a client holds: ``[name, dtype name, global shape, layout, mesh]`` (JSON-able: it may travel).
Held = List[Any]

#: The layout of a value that is not distributed: written whole, by the io client.
WHOLE = "whole (written by the io client)"

#: The key of a coordinator's save counter in the runtime's keyed cache (anchored on the coordinator).
SAVE_NUMBERS = "save numbers"


def save_identity(coordinator: Coordinator, prefix: str) -> List[Any]:
    """This client's identity of its next save over ``coordinator``: ``[prefix, number]`` (numbers 1, 2, ...
    per coordinator, kept by the process's :mod:`~shardckpt.runtime` as long as the coordinator lives)."""
    return [prefix, runtime().count(SAVE_NUMBERS, anchor=coordinator)]


def identity_problem(identities: List[List[Any]], io: int) -> Optional[str]:
    """``None`` when every client runs the same save as the io client, else who does not."""
    expected = identities[io]
    odd = [r for r, ident in enumerate(identities) if ident != expected]
    if not odd:
        return None
    detail = "; ".join(f"rank {r}: save #{identities[r][1]} of {identities[r][0]}" for r in odd)
    return (f"clients disagree on which save this is (client {io}: save #{expected[1]} of {expected[0]}; "
            f"{detail}) — did a client skip a save or save to another path?")


def describe_pieces(plan: SavePlan) -> Dict[str, List[Any]]:
    """``{key: [dtype enum, global shape, [box, ...]]}`` of this client's pieces (JSON)."""
    out: Dict[str, List[Any]] = {}
    for item in plan.items:
        if item.slice_spec:
            full_shape, _ = parse_shape_and_slice(item.slice_spec)
        else:
            full_shape = item.shape
        entry = out.setdefault(item.key, [item.dtype.enum, list(full_shape), []])
        entry[2].append([list(b) for b in item.box])
    return out


def pack_pieces(described: Dict[str, List[Any]]) -> str:
    """:func:`describe_pieces`'s result as it travels to the io client: a packed table of columns
    (:mod:`.piece_table`; zlib'd, base64), ~4-5 bytes a piece for parameters sliced alike (~84 as JSON)."""
    if not isinstance(described, dict):
        raise ShardingValidationError("piece descriptions are not a mapping")
    return pack_table(described)


def unpack_pieces(packed: str) -> Dict[str, List[Any]]:
    """What :func:`pack_pieces` packed, as Python objects (the io client's check reads the columns instead)."""
    return table_as_dict(unpack_table(packed))


def check_pieces(packed: Sequence[str]) -> Optional[str]:
    """The io client's check of every client's packed pieces (``packed[r]``: client ``r``'s), streaming and
    vectorized (:mod:`.piece_check`): ``None`` when they tile every tensor, else what
    what is wrong, naming ranks and keys (:func:`problems_message`)."""
    return check_packed(packed)


def problems_message(by_key: Dict[str, List[Holder]], nonempty: Sequence[bool]) -> Optional[str]:
    """What is wrong with the pieces of the keys in ``by_key`` (``None``: nothing).

    ``by_key[key]``: every holder's ``(rank, dtype enum, global shape, boxes)``, in rank order;
    ``nonempty[r]``: whether rank ``r`` described any piece (those holding none of a key that
    does not tile are named). At most 8 problems are told, in key order.
    """
    from ..format.tensor_slice import boxes_tile

    problems = []
    verdicts: Dict[Tuple[Tuple[int, ...], Tuple[Box, ...]], Optional[str]] = {}
    for key in sorted(by_key):
        holders = by_key[key]
        if not holders:
            continue
        # The reference is what most clients save (ties: the lowest rank's), so the odd one is named,
        # whichever rank it is.
        dtype = _majority([d for _, d, _, _ in holders])
        shape = _majority([s for _, _, s, _ in holders])
        wrong_dtype = [r for r, d, _, _ in holders if d != dtype]
        wrong_shape = [r for r, _, s, _ in holders if s != shape]
        if wrong_dtype:
            first_rank = min(r for r, d, _, _ in holders if d == dtype)
            names = sorted({_dtype_name(d) for r, d, _, _ in holders if r in wrong_dtype})
            problems.append(f"key {key!r}: rank(s) {wrong_dtype} save it as {', '.join(names)}, rank {first_rank} "
                            f"as {_dtype_name(dtype)}")
            continue
        if wrong_shape:
            first_rank = min(r for r, _, s, _ in holders if s == shape)
            problems.append(f"key {key!r}: rank(s) {wrong_shape} save global shape "
                            f"{[list(s) for r, _, s, _ in holders if r in wrong_shape]}, rank {first_rank} saves "
                            f"{list(shape)}")
            continue
        boxes = [(r, b) for r, _, _, bs in holders for b in bs]
        signature = (shape, tuple(sorted(b for _, b in boxes)))  # keys sliced alike are checked once
        if signature not in verdicts:
            verdicts[signature] = boxes_tile(list(signature[1]), full_box(shape))
        problem = verdicts[signature]
        if problem is not None:
            holding = sorted({r for r, _ in boxes})
            overlapping = _most_overlapping_ranks(boxes)
            if overlapping:
                problems.append(f"key {key!r} (global shape {list(shape)}): the slices of rank(s) {overlapping} "
                                f"overlap those of other ranks ({problem})")
            else:
                absent = [r for r in range(len(nonempty)) if r not in holding and nonempty[r]]
                who = f"rank(s) {absent} hold no piece of it" if absent else f"held by rank(s) {holding}"
                problems.append(f"key {key!r} (global shape {list(shape)}): the slices do not tile the tensor "
                                f"({problem}); {who}")
        if len(problems) >= 8:
            break
    if not problems:
        return None
    return "clients' pieces disagree: " + "; ".join(problems)


def _majority(values: List[Any]) -> Any:
    """The most common of ``values``; on a tie, the one that comes first."""
    counts: Dict[Any, int] = {}
    for v in values:
        counts[v] = counts.get(v, 0) + 1
    return max(counts, key=lambda v: (counts[v], -values.index(v)))


def _dtype_name(enum: int) -> str:
    try:
        return as_dtype(enum).name
    except Exception:  # noqa: BLE001 - only for the message
        return f"dtype enum {enum}"


def _most_overlapping_ranks(boxes: List[Tuple[int, Box]], limit: int = 4096) -> List[int]:
    """The ranks whose boxes overlap the most other ranks' boxes (pairwise: only run once a problem is
    known); ``[]`` when no two boxes of different ranks overlap."""
    from ..format.tensor_slice import intersect

    boxes = boxes[:limit]
    count: Dict[int, int] = {}
    for i, (ra, a) in enumerate(boxes):
        for rb, b in boxes[i + 1:]:
            if intersect(a, b) is not None:
                count[ra] = count.get(ra, 0) + 1
                if rb != ra:
                    count[rb] = count.get(rb, 0) + 1
    if not count:
        return []
    top = max(count.values())
    return sorted(r for r, c in count.items() if c == top)


# -- what every client holds (step 3) --------------------------------------------------------------------------


def describe_held(named_values: Iterable[Tuple[str, Any]]) -> List[Held]:
    """What this client holds: ``[name, dtype, global shape, layout, mesh]`` per ``(name, value)``, sorted by name.

    A value with ``held_layout()`` (a DTensor: its sharding specs and a digest of its mesh)
    tells its own ``dtype``, ``shape`` and layout; any other value is written whole by the io
    client (its dtype and shape, unless it is a callable, which is not called here).
    """
    names: Dict[Any, str] = {}  # dtype -> its name, looked up once per dtype

    def dtype_text(dtype: Any) -> str:
        text = names.get(dtype)
        if text is None:
            try:
                text = str(as_dtype(dtype).name)
            except Exception:  # noqa: BLE001 - a dtype the format does not know still has a name to compare
                text = str(dtype)
            names[dtype] = text
        return text

    out: List[Held] = []
    for name, value in named_values:
        tell = getattr(value, "held_layout", None)
        if tell is not None:
            layout, mesh = tell()
            out.append([name, dtype_text(value.dtype), list(map(int, value.shape)), layout, mesh])
        elif callable(value):
            out.append([name, "", [], WHOLE, ""])
        else:
            array = value if hasattr(value, "dtype") and hasattr(value, "shape") else np.asarray(value)
            out.append([name, dtype_text(array.dtype), list(map(int, array.shape)), WHOLE, ""])
    out.sort(key=lambda e: e[0])
    return out


def held_digest(held: Optional[Sequence[Held]]) -> Optional[str]:
    """A digest of :func:`describe_held`'s list, in name order (``None`` for ``None``: the front door lists
    nothing): 32 hex characters of BLAKE2b over its JSON."""
    if held is None:
        return None
    text = json.dumps(sorted(held, key=lambda e: str(e[0])), separators=(",", ":"), ensure_ascii=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def held_representatives(digests: Sequence[Optional[str]]) -> Optional[List[int]]:
    """``None`` when every client sent the same digest; else the lowest rank of each distinct digest."""
    first: Dict[Optional[str], int] = {}
    for rank, digest in enumerate(digests):
        first.setdefault(digest, rank)
    return None if len(first) == 1 else sorted(first.values())


def held_problem(digests: Sequence[Optional[str]], lists: Mapping[int, Optional[Sequence[Held]]]) -> Optional[str]:
    """What differs between the clients' lists of what they hold (``None``: nothing).

    ``digests[r]``: client ``r``'s :func:`held_digest`; ``lists[r]``: the list of each
    representative ``r`` (:func:`held_representatives`), standing for every client with its
    digest. Per variable: the clients that lack it, and those that hold it otherwise than
    most (ties: the lowest rank's). At most 8 problems are told, in name order.
    """
    ranks_of: Dict[Optional[str], List[int]] = {}
    for rank, digest in enumerate(digests):
        ranks_of.setdefault(digest, []).append(rank)
    silent: List[int] = []
    groups: List[List[int]] = []  # the ranks of each digest whose list was sent
    by_name: Dict[str, Dict[Tuple[Any, ...], List[int]]] = {}  # name -> kind -> groups holding it so
    for ranks in ranks_of.values():
        held = lists.get(ranks[0])
        if held is None:
            silent += ranks
            continue
        group = len(groups)
        groups.append(ranks)
        for name, dtype, shape, layout, mesh in held:
            by_name.setdefault(str(name), {}).setdefault((dtype, tuple(shape), layout, mesh), []).append(group)
    listed = sum(len(g) for g in groups)
    problems = []
    if silent:
        problems.append(f"rank(s) {_ranks(sorted(silent))} did not list what they hold")
    for name in sorted(by_name):
        by_kind = by_name[name]
        if len(by_kind) == 1 and sum(len(groups[g]) for kinds in by_kind.values() for g in kinds) == listed:
            continue  # every client that listed anything holds it alike: the work stays linear in the lists
        kinds = {kind: sorted({r for g in gs for r in groups[g]}) for kind, gs in by_kind.items()}
        holding = sorted({r for ranks in kinds.values() for r in ranks})
        reference = max(kinds, key=lambda k: (len(kinds[k]), -kinds[k][0]))
        if len(holding) < listed:
            held_by = set(holding)
            missing = sorted(r for g in groups for r in g if r not in held_by)
            problems.append(f"variable {name!r} ({_held_text(reference)}) is held by rank(s) {_ranks(holding)} but "
                            f"not by rank(s) {_ranks(missing)}")
        for kind, ranks in sorted(kinds.items(), key=lambda kv: kv[1][0]):
            if kind != reference:
                problems.append(f"variable {name!r}: rank(s) {_ranks(ranks)} hold it as {_held_text(kind)}, "
                                f"rank(s) {_ranks(kinds[reference])} as {_held_text(reference)}")
        if len(problems) >= 8:
            break
    if not problems and len(groups) > 1:  # the same variables, listed otherwise (one named twice, say)
        problems.append("the lists of " + ", ".join(f"rank(s) {_ranks(g)}" for g in groups) + " differ")
    if not problems:
        return None
    return "clients disagree on the variables they hold: " + "; ".join(problems[:8])


def _held_text(kind: Tuple[Any, ...]) -> str:
    dtype, shape, layout, mesh = kind
    where = f"layout [{layout}]" + (f" on mesh {mesh}" if mesh else "")
    return f"{dtype or '?'}{list(shape)}, {where}"


def _ranks(ranks: Sequence[int]) -> str:
    """``[0, 1, 3-1023]``: ranks in order, runs of three or more as ``first-last``."""
    parts: List[str] = []
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{ranks[i]}-{ranks[j]}")
        else:
            parts.extend(str(r) for r in ranks[i:j + 1])
        i = j + 1
    return "[" + ", ".join(parts) + "]"
