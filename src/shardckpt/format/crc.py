"""CRC-32C (Castagnoli) and the masking that every checksum on disk uses.

The computation itself is done by the ``crc32c`` package (hardware accelerated,
and it releases the GIL, so checksums overlap with I/O on another thread).
:func:`combine` joins the CRCs of two adjacent pieces into the CRC of their
concatenation (the standard CRC combine, in GF(2) polynomial arithmetic), so the
pieces of one large entry can be checksummed on several cores at once.

Helper threads belong to a :class:`ChecksumContext`; :func:`default_context` is the
process's one, a slot of the process's :mod:`~shardckpt.runtime` (created on first use
under its lock; new after a reset and in a forked child). Its pool is a
:class:`~shardckpt.runtime.ThreadPool`: a background save still checksums while the
interpreter shuts down.
"""

from __future__ import annotations

import os
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Tuple, Union

import crc32c as _crc32c

from ..runtime import Slot, ThreadPool

Buffer = Union[bytes, bytearray, memoryview]

_MASK_DELTA = 0xA282EAD8
_U32 = 0xFFFFFFFF


def value(data: Buffer) -> int:
    """CRC-32C of ``data``."""
    return _crc32c.crc32c(data)


def extend(crc: int, data: Buffer) -> int:
    """CRC-32C of the concatenation of the bytes behind ``crc`` and ``data``."""
    return _crc32c.crc32c(data, crc)


def mask(crc: int) -> int:
    """Mask a CRC as TensorFlow and LevelDB store it (rotate right 15, add a constant)."""
    return ((((crc >> 15) | (crc << 17)) & _U32) + _MASK_DELTA) & _U32


def unmask(masked: int) -> int:
    """Inverse of :func:`mask`."""
    rot = (masked - _MASK_DELTA) & _U32
    return ((rot >> 17) | (rot << 15)) & _U32


class RunningCrc:
    """A CRC-32C over a stream of buffers, computed on a helper thread.

    ``update`` hands a buffer to the helper and returns at once, so the caller can
    write (or read) the next bytes while the checksum of these is computed; the
    helper keeps the order. Small buffers are summed inline. The buffer must not
    change until :meth:`value` returns.
    """

    _INLINE_BELOW = 256 << 10

    def __init__(self, executor: "Optional[ThreadPoolExecutor]" = None) -> None:
        self._crc = 0
        self._executor = executor
        self._pending: "Optional[Future[None]]" = None

    def _add(self, data: Buffer, digest: Any = None) -> None:
        self._crc = _crc32c.crc32c(data, self._crc)
        if digest is not None:
            digest.update(data)

    def update(self, data: Buffer, digest: Any = None) -> None:
        """Add ``data``; with ``digest`` (an object with ``update(bytes)``, fed in order, on the
        helper too: a content hash costs the writer nothing) also ``digest.update(data)``. The
        digest is complete once :meth:`value` returns."""
        if self._executor is None or len(data) < self._INLINE_BELOW:
            self._wait()
            self._add(data, digest)
            return
        previous = self._pending

        def task() -> None:
            if previous is not None:
                previous.result()
            self._add(data, digest)

        self._pending = self._executor.submit(task)

    def _wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()

    def value(self) -> int:
        """The CRC-32C of everything passed to :meth:`update` (waits for the helper)."""
        self._wait()
        return self._crc


# -- combine ---------------------------------------------------------------------
_POLY = 0x82F63B78  # the Castagnoli polynomial, bit-reflected


def _multmodp(a: int, b: int) -> int:
    """``a(x) * b(x) mod P(x)`` for bit-reflected 32-bit polynomials."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if a & (m - 1) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
        if m == 0:
            return p


def _x2n_table() -> list:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()
_SHIFTS: Dict[int, int] = {}


def _shift_operator(nbytes: int) -> int:
    """``x^(8 * nbytes) mod P``: what multiplying a CRC by shifts it past ``nbytes`` zero bytes."""
    op = _SHIFTS.get(nbytes)
    if op is None:
        op = 1 << 31  # x^0
        n, k = nbytes, 3
        while n:
            if n & 1:
                op = _multmodp(_X2N[k & 31], op)
            n >>= 1
            k += 1
        if len(_SHIFTS) < 1024:
            _SHIFTS[nbytes] = op
    return op


_TABLE_AFTER = 8  # a shift used this many times gets byte tables (the pieces of a restore share a few lengths)
_USES: Dict[int, int] = {}
_TABLES: Dict[int, Tuple[List[int], List[int], List[int], List[int]]] = {}


def _byte_tables(op: int) -> Tuple[List[int], List[int], List[int], List[int]]:
    """``op * c mod P`` for every ``c`` with one byte set, per byte position: multiplying by a fixed
    ``op`` is linear in ``c``, so four lookups and three XORs replace the bit loop of :func:`_multmodp`."""
    basis = [_multmodp(op, 1 << bit) for bit in range(32)]
    tables = []
    for byte in range(4):
        table = [0] * 256
        for v in range(1, 256):
            low = v & -v
            table[v] = table[v ^ low] ^ basis[8 * byte + low.bit_length() - 1]
        tables.append(table)
    return tables[0], tables[1], tables[2], tables[3]


def combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32C of ``A + B`` from ``crc1 = value(A)``, ``crc2 = value(B)`` and ``len2 = len(B)``."""
    if len2 <= 0:
        return crc1
    tables = _TABLES.get(len2)
    if tables is not None:
        t0, t1, t2, t3 = tables
        return t0[crc1 & 0xFF] ^ t1[(crc1 >> 8) & 0xFF] ^ t2[(crc1 >> 16) & 0xFF] ^ t3[crc1 >> 24] ^ crc2
    op = _shift_operator(len2)
    if len2 in _SHIFTS:  # a length seen before: count its uses (the tables pay off after a few)
        uses = _USES.get(len2, 0) + 1
        _USES[len2] = uses
        if uses >= _TABLE_AFTER and len(_TABLES) < 64:
            _TABLES[len2] = _byte_tables(op)
    return _multmodp(op, crc1) ^ crc2


crc32c_combine = combine


# -- helper threads ----------------------------------------------------------------
class ChecksumContext:
    """Owns the helper threads that checksum (and, on reads, fetch) bytes for shardckpt.

    The pool is created on first use under the context's lock and lives until
    :meth:`shutdown`. Pass one to :class:`~shardckpt.format.bundle_reader.BundleReader`
    to keep its threads separate from the process default.
    """

    def __init__(self, workers: Optional[int] = None) -> None:
        # workers=0: no helper threads, the calling thread does all the work (for processes that
        # already share the cores with others, e.g. several ranks on one host)
        self.workers = max(0, int(workers)) if workers is not None else max(1, os.cpu_count() or 1)
        self._lock = threading.Lock()
        self._executor: Optional[ThreadPoolExecutor] = None
        _CONTEXTS.add(self)

    @property
    def executor(self) -> ThreadPoolExecutor:
        if self.workers == 0:
            raise RuntimeError("this ChecksumContext has no helper threads (workers=0)")
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPool(max_workers=self.workers, thread_name_prefix="shardckpt-crc")
            return self._executor

    def shutdown(self) -> None:
        """Stop the helper threads (after the work already handed to them)."""
        with self._lock:
            executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True)


#: The process's default context (its helper threads: one per CPU).
_DEFAULT: "Slot[ChecksumContext]" = Slot("the default checksum context", ChecksumContext)
_CONTEXTS: "weakref.WeakSet[ChecksumContext]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    """A forked child has none of its parent's threads: every context (the default one is new in the
    child's runtime; contexts made by callers live on) starts a new pool when next used (work handed to
    the parent's pool would wait forever)."""
    for context in list(_CONTEXTS):
        context._lock = threading.Lock()
        context._executor = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_context() -> ChecksumContext:
    """The process's default :class:`ChecksumContext` (one helper per CPU), created under the runtime's lock."""
    return _DEFAULT.get()


def shared_executor() -> ThreadPoolExecutor:
    """The default context's pool of checksum helpers."""
    return default_context().executor
