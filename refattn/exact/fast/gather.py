"""Fast exact attention forward on sparse keys by gather: each query row visits only its listed
keys (the host side; the kernels are :mod:`refattn.exact.fast.gather_kernels`).

With ``key_indices`` or ``key_block_indices`` read as a set, query row i of plane (b, h) may
attend to ``I_{b,g,i} = {idx[b, g, i, t] : 0 <= idx[b, g, i, t] < S}`` (g = kv_head[h];
duplicates count once, -1 and out-of-range entries are ignored; :mod:`refattn.sparse_indices`)
intersected with every other restriction. :func:`refattn.exact.fast.fast_exact_forward` reads
that set from a dense (B, H, L, S) mask and walks every key of each row's interval; this
engine never builds an (L, S) plane:

* the validated (B, K, L, T) indices (block indices already expanded to tokens) become, per
  row, the distinct positions ascending (:func:`~refattn.exact.fast.gather_kernels.compact_lists`);
* the keys listed by some row of kv-head plane (b, g) -- U of them, ``U <= min(S, L T)``; one
  decode row lists T -- are gathered once: their float64 rows, norms, ranges and exactness
  scales (no float64 copy or range check of the unlisted keys: their values never enter);
* the first steps (the double-precision one for targets of at most 24 bits, then the
  double-double one, the referee for the rest) walk each row's listed keys inside its
  structural interval; the mask, bias and dropout keep-mask are read per listed key, as in
  :mod:`refattn.exact.fast.allowed_set`;
* the referee (:func:`refattn.exact.attention.exact_forward`) gets the undecided rows alone,
  with the listed set of those rows as a mask (:func:`gather_row_spec`).

Memory for a decode step (L = 1) is O(H T + U (D + E)); the weights, when asked for, are the
(B, H, L, S) output (+0 at every key not listed). Every element is the exact result rounded
once: the results are bit-identical to those of the dense-mask engine
(``config.EXACT_SPARSE_KEYS = "mask"``). The bounds are those of
:mod:`refattn.exact.fast.forward`, with the counts of listed keys (``min(T, S)``) in place of
S in the sums' gammas; in the double-precision step, each dot product's error bounded by the
magnitudes of its rounded partial sums (:func:`~refattn.exact.fast.gather_kernels.dot_error`)
and ``A_e = sum_j e_j |v_je|`` (``|N - N^| <= (gamma + rho)(1 + gamma)(1 + rho) A_e``),
so that most rows are decided by the double-precision step. A float32 target's outputs are
decided from one-word quotients N^/Z^ with the cruder ``A_e <= vmax_e Z^ / ((1 - rho)(1 -
gamma))`` first and A_e summed only for the features that leaves undecided
(:func:`~refattn.exact.fast.gather_kernels.float32_outputs`); the exponentials' error is
``rho = rel + d (1 + d)`` for a score error d (:func:`~refattn.exact.fast.gather_kernels.exp_rel`).
A work item takes up to HEAD_BLOCK query heads of one kv head, so that a decode step reads
its gathered keys and values once per item. A decode step of SERIAL_WORK to SERIAL_ITEMS
multiply-adds first forms every head's dot products, the keys' facts and the gathered values
in one parallel pass by spans of keys (:meth:`_Gathered._decode`), which its items (in
parallel too) then read.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import threading
import time

import numba
import numpy as np

from ..._arrays import read_only
from ...sparse_indices import index_mask
from ...spec import AttentionSpec
from ..rounding import format_of
from . import doubledouble as D
from ._params import P_GAMMA_DIM, P_GAMMA_SUM, P_SUM_REL, frozen
from .allowed_set import allowed_rule
from .facts import row_facts, row_facts_serial
from .forward import finish_forward, kernel_params, referee_runs, row_spec
from .forward_kernels import OK, SUM_BLOCK, UNDECIDED
from .gather_dd import dd_step
from .gather_kernels import (
    DOT_BLOCK,
    HEAD_BLOCK,
    compact_lists,
    compact_lists_serial,
    decode_dots,
    decode_dots_serial,
    gather_d,
    gather_d_serial,
)
from .gather_lanes import key_facts, value_rows

__all__ = ["gather_forward", "gather_row_spec", "SERIAL_ITEMS", "SERIAL_WORK"]

#: Setup passes over fewer elements than this, and double-precision steps over fewer
#: multiply-adds (query rows x listed keys x (D + E)), run on the calling thread alone (the
#: step in a thread-free compile, as one item per kv head). The bits never depend on it.
SERIAL_WORK = 1 << 22

#: Gathered columns per task of a decode step's first pass (:func:`_Gathered._decode`).
DECODE_SPAN = 128

#: Whether a decode step whose keys' facts the double-precision step forms, of at least
#: SERIAL_WORK and under SERIAL_ITEMS multiply-adds (e.g. a DeepSeek Sparse Attention step
#: of 16 heads), runs a first pass by spans of keys in parallel (:func:`_Gathered._decode`:
#: each key's panel formed once whatever the items, the values gathered in parallel) and
#: then its items, read from that pass; else each item forms its own keys' panels and
#: facts (once per item: twice for two items of one plane) and the host gathers the values
#: (at 128 heads, two items of 64 heads, that measured faster than the pass by spans). The
#: same bits either way.
DECODE_PASS = True

#: The decode steps under this many multiply-adds (and of at least SERIAL_WORK) run the first
#: pass by spans (DECODE_PASS). Their items (scores, sums, outputs: about a third of the
#: step's work) then run in parallel too, by blocks of heads (two items of 8 heads on two
#: threads): on a 2-core machine under load 3.7 a 16-head step measured 1.22 ms so against
#: 1.47 ms with the items on the calling thread after the pass (one parallel region, not two)
#: and 1.90 ms with no parallel region (Numba's float32 kernel: 0.25 ms). With one Numba
#: thread, or while the other core is busy (:class:`_Pace`), the pass is its thread-free
#: compile and the items run on the calling thread. The bits never depend on it.
SERIAL_ITEMS = 1 << 24

#: Seconds a decode step runs its pass and items on the calling thread alone (the pass's
#: thread-free compile) after a parallel pass took longer than the thread-free pass does
#: (:class:`_Pace`): the other core was busy, and a parallel region waits for it. Short, so
#: that the parallel route is tried again soon: on 2 cores under load 3.4, same run, a
#: 16-head step measured min 1.06 ms, median 2.5 ms with 0.1 s; min 1.58, median 2.4 with
#: 1 s; min 1.10, median 13.9 with 0 (always parallel after the first pass).
CONTENDED_HOLD = 0.1


class _Pace:
    """The route of the decode steps' pass by spans (:meth:`_Gathered._decode`) on this
    machine now: in parallel, unless Numba runs one thread or a parallel pass lately took
    longer per multiply-add than the fastest thread-free pass seen (a loaded machine: on 2
    cores under load 4.3 a 16-head step measured 1.75 ms on the calling thread alone against
    2.5 ms with its parallel regions; under load 1.5-3.7, 1.1-1.2 ms in parallel against
    1.6-1.9 ms). The first pass of a process runs thread-free, to time it. The bits never
    depend on the route."""

    def __init__(self):
        self.best = math.inf  # seconds per multiply-add of the fastest thread-free pass
        self.until = 0.0  # time.monotonic() before which the passes run thread-free

    def serial(self) -> bool:
        """Whether the next pass runs on the calling thread alone."""
        if numba.get_num_threads() == 1 or self.best == math.inf:
            return True
        return time.monotonic() < self.until

    def record(self, serial: bool, rate: float) -> None:
        """A pass's seconds per multiply-add ``rate``, thread-free or in parallel."""
        if serial:
            self.best = min(self.best, rate)
        elif rate > self.best:
            self.until = time.monotonic() + CONTENDED_HOLD


_PACE = _Pace()

#: The ``formed`` arrays that end :func:`~refattn.exact.fast.gather_kernels.gather_d`'s
#: ``source`` when the dot products are its own (no decode pass formed them).
_NOT_FORMED = (
    frozen(np.zeros((0, 0, 0, 0))),
    frozen(np.zeros((0, 0, 0, 0))),
    frozen(np.zeros((0, 0, 0))),
    frozen(np.zeros(0, np.int64)),
)


def _rows_cover(rule, used) -> bool:
    """Whether the structural interval of each batch row's query row 0 holds every key its
    kv-head planes list (``used``: per (b, g) the listed positions, ascending)."""
    lo, hi = rule.rows_lo, rule.rows_hi
    return all(
        u.size == 0 or (lo[b, 0] <= u[0] and u[-1] < hi[b, 0])
        for b, row in enumerate(used)
        for u, _ in row
    )


def _key_source(k: np.ndarray, keys_of: np.ndarray, used) -> tuple:
    """(rows, row index of each gathered column) the double-precision step reads the listed
    keys from: ``k`` (B, K, S, D) itself when float32 or float64 (widened exactly in the
    step) with ``keys_of``; else (float16, bfloat16, float8) the listed rows converted to
    float32 (exact) into (B, K, U, D), column c at row c."""
    if k.dtype in (np.float32, np.float64):
        return read_only(k), frozen(keys_of)
    out = np.zeros(keys_of.shape + k.shape[-1:], np.float32)
    for b, row in enumerate(used):
        for g, (u, _) in enumerate(row):
            out[b, g, : u.size] = k[b, g][u]
    columns = np.broadcast_to(np.arange(keys_of.shape[-1], dtype=np.int64), keys_of.shape)
    return read_only(out), frozen(columns)


def gather_row_spec(spec: AttentionSpec, b: int, h: int, start: int, stop: int) -> AttentionSpec:
    """:func:`refattn.exact.fast.row_spec` of a gather spec: the rows ``start:stop`` of plane
    (b, h) with their listed set ANDed into the mask (an (n, S) plane of those rows only), as
    the referee reads it.

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((2, 2)), np.zeros((3, 2)), np.zeros((3, 1)))
    >>> spec = gather_spec(spec, np.array([[2, -1], [0, 0]]))
    >>> gather_row_spec(spec, 0, 0, 1, 2).mask[0, 0].tolist()
    [[True, False, False]]
    """
    plain = dataclasses.replace(spec, key_indices=None, index_reading="set")
    sub = row_spec(plain, b, h, start, stop)
    g = int(spec.kv_head[h])
    listed = index_mask(spec.key_indices[b : b + 1, g : g + 1, start:stop], spec.k.shape[-2])
    return dataclasses.replace(sub, mask=listed if sub.mask is None else sub.mask & listed)


def _union(lists: np.ndarray, counts: np.ndarray, keys: int):
    """(U,) the positions listed by some row of one kv-head plane (``lists`` (L, T), ``counts``
    (L,)) and each list entry's column among them (L, T) (0 past a row's count)."""
    if lists.shape[0] == 1:  # a decode row: its list is already its distinct keys, ascending
        count = int(counts[0])
        local = np.arange(lists.shape[1])
        local[count:] = 0
        return lists[0, :count].copy(), local[None, :]
    valid = np.arange(lists.shape[1]) < counts[:, None]
    entries = lists[valid]
    if entries.size > keys:  # a prefill: a presence vector, O(S + L T), no sort of L T entries
        present = np.zeros(keys, bool)
        present[entries] = True
        used = np.flatnonzero(present)
        column = np.cumsum(present) - 1
        local = np.where(valid, column[np.where(valid, lists, 0)], 0)
    else:
        used = np.unique(entries)
        local = np.where(valid, np.searchsorted(used, lists), 0)
    return used, local


#: :func:`refattn.exact.fast.doubledouble.gamma_up` and ``dot_bound`` of a count (exact
#: rational arithmetic, then rounded up: pure functions of the count, kept per count).
_gamma_up = functools.lru_cache(maxsize=256)(D.gamma_up)
_dot_bound = functools.lru_cache(maxsize=256)(D.dot_bound)

_PARAMS: dict = {}

#: No rows left for the double-double step.
_NO_ROWS = frozen(np.zeros((0, 3), np.int64))


@functools.lru_cache(maxsize=8)
def _max_finite(fmt) -> float:
    """The largest finite number of the target format ``fmt`` as a float64 (exact)."""
    return float(fmt.max_finite)


_RULES: dict = {}


def _memo(table: dict, key, make):
    """``table[key]``, made by ``make()`` on first use (at most 64 kept)."""
    found = table.get(key)
    if found is None:
        if len(table) >= 64:
            table.clear()
        found = table[key] = make()
    return found


def _allowed_rule(spec: AttentionSpec):
    """:func:`refattn.exact.fast.allowed_set.allowed_rule` of ``spec``, kept per shape and
    structure when no array enters it (no mask, bias, dropout keep-mask or key lengths: the
    rule is then a pure function of B, L, S, causal, window and the offset; the kernels only
    read it)."""
    if any(a is not None for a in (spec.mask, spec.bias, spec.dropout_mask, spec.kv_lengths)):
        return allowed_rule(spec)
    batch, _, _, length, keys, _, _ = spec.dims
    key = (batch, length, keys, spec.causal, spec.window, spec.offset)
    try:
        return _memo(_RULES, key, lambda: allowed_rule(spec))
    except TypeError:  # a field that is not hashable: no memo
        return allowed_rule(spec)


def _kernel_params(spec: AttentionSpec):
    """:func:`refattn.exact.fast.forward.kernel_params` of ``spec`` (a copy), kept per value of
    the fields it reads when the spec has no ALiBi slopes and no sinks (its rational scale
    and keep scale then cost more than a decode step's setup): the dims, the exact scale,
    softcap, keep scale, ALiBi key count and each batch row's offset."""
    if spec.alibi_slopes is not None or spec.sinks is not None:
        return kernel_params(spec)
    batch = spec.dims[0]
    # the exact scale and keep scale are pure functions of the scale (and D) and dropout_p
    fields = (spec.scale, spec.softcap, spec.dropout_p, spec.alibi_keys)
    offsets = (spec.offset,) if spec.kv_lengths is None and spec.alibi_offsets is None else ()
    key = (spec.dims, fields, offsets or tuple(spec.alibi_offset(b) for b in range(batch)))
    try:
        found = _memo(_PARAMS, key, lambda: kernel_params(spec))
    except TypeError:  # a field that is not hashable: no memo
        return kernel_params(spec)
    return found[0].copy(), np.array(found[1])


_SCRATCH = threading.local()


def _scratch(name: str, shape: tuple) -> np.ndarray:
    """A float64 work array of ``shape`` (uninitialised) kept for the calling thread's next
    call of the same shape: a decode loop then writes its gathered keys and values into pages
    it already holds instead of faulting in fresh ones on every step. Only the columns of the
    listed keys are written and only those are read, so no stale entry is ever read."""
    arrays = getattr(_SCRATCH, "arrays", None)
    if arrays is None:
        arrays = _SCRATCH.arrays = {}
    array = arrays.get(name)
    if array is None or array.shape != shape:
        array = arrays[name] = np.empty(shape)
    return array


@contextlib.contextmanager
def _serial_below(work: int):
    """Run the compiled kernels called inside on the calling thread alone when ``work``
    (elements) is below :data:`SERIAL_WORK`: waking the worker threads costs more than such
    a pass (and, on a loaded machine, waits for a free core). The bits never depend on it."""
    threads = numba.get_num_threads()
    serial = work < SERIAL_WORK and threads > 1
    if serial:
        numba.set_num_threads(1)
    try:
        yield
    finally:
        if serial:
            numba.set_num_threads(threads)


def _source(plane: np.ndarray, used: np.ndarray):
    """(rows, indices) the setup passes read the listed rows ``used`` of a kv-head plane (S, X)
    from: the plane itself when float32 or float64 (widened exactly inside the pass), else
    (float16, bfloat16, float8) the listed rows converted to float32 (exact) first."""
    if plane.dtype in (np.float32, np.float64):
        return plane, used
    return np.asarray(plane[used], dtype=np.float32), np.arange(used.size)


def _facts(a: np.ndarray):
    """(ok, norms, scales) of the rows of a (..., N, X) float64 array
    (:func:`refattn.exact.fast.facts.row_facts`)."""
    flat = frozen(a.reshape(-1, a.shape[-1]))
    out = [np.empty(flat.shape[0], dtype) for dtype in (np.bool_, np.float64, np.float64)]
    if flat.shape[0]:
        facts = row_facts if flat.size >= SERIAL_WORK else row_facts_serial
        facts(flat, flat.view(np.int64), out[1], out[2], out[0])
    return [o.reshape(a.shape[:-1]) for o in out]


_LAYOUTS: dict = {}


def _decode_layout(kv_head: np.ndarray, kv_heads: int, sizes: tuple) -> tuple:
    """(group, place, tasks, starts) of a decode pass (:meth:`_Gathered._decode`), kept per
    head map and plane sizes: ``group`` (K, G) the query heads of each kv head (-1 after
    them), ``place`` (H,) each head's row in its group, ``tasks`` (n, 5) the spans of
    DECODE_SPAN gathered columns (b, g, first column, end column, task number) of the planes
    ``sizes`` (per (b, g), in order, their listed-key counts) and ``starts`` the first task of
    each plane that has any."""

    def make():
        heads = [np.flatnonzero(kv_head == g) for g in range(kv_heads)]
        group = np.full((kv_heads, max([1] + [h.size for h in heads])), -1, np.int64)
        place = np.zeros(kv_head.shape[0], np.int64)
        for g, h in enumerate(heads):
            group[g, : h.size] = h
            place[h] = np.arange(h.size)
        spans = [
            (n // kv_heads, n % kv_heads, c0, min(size, c0 + DECODE_SPAN))
            for n, size in enumerate(sizes)
            for c0 in range(0, size, DECODE_SPAN)
        ]
        tasks = np.array([span + (t,) for t, span in enumerate(spans)], np.int64).reshape(-1, 5)
        plane = tasks[:, 0] * kv_heads + tasks[:, 1]
        starts = np.flatnonzero(np.diff(plane, prepend=-1))
        return group, frozen(place), tasks, starts  # (the kernels only read them)

    return _memo(_LAYOUTS, (kv_head.tobytes(), kv_heads, sizes), make)


class _Gathered:
    """Each row's listed columns, the gathered float64 keys and values of every kv-head plane
    with their facts, the kernel parameters and the planes the first steps take."""

    def __init__(self, spec: AttentionSpec, fused: bool = False):
        batch, heads, kv_heads, length, keys, dim, vdim = spec.dims
        idx = np.ascontiguousarray(spec.key_indices, dtype=np.int64)
        count = idx.shape[-1]
        flat = idx.reshape(math.prod(idx.shape[:3]), count)
        lists = np.zeros_like(flat)
        counts = np.zeros(flat.shape[0], np.int64)
        if flat.size:
            compact = compact_lists if flat.size >= SERIAL_WORK else compact_lists_serial
            compact(flat, lists, counts)
        lists = lists.reshape(idx.shape)
        counts = counts.reshape(idx.shape[:3])
        used = [
            [_union(lists[b, g], counts[b, g], keys) for g in range(kv_heads)] for b in range(batch)
        ]
        rule = _allowed_rule(spec)  # the caller's mask: the listed set is not in it
        # the keys' facts formed by the double-precision step itself: each decode row's
        # interval holds all of its plane's listed keys (so its items check every one)
        self.fused = fused and length == 1 and _rows_cover(rule, used)
        width = max([1] + [u.size for row in used for u, _ in row])
        # a mid-sized parallel decode step: its first pass by spans (each key's panel once)
        work = heads * width * (dim + vdim)
        self.decode = self.fused and DECODE_PASS and SERIAL_WORK <= work < SERIAL_ITEMS
        self.serial = self.decode and _PACE.serial()  # the pass's thread-free compile
        self.work = work
        self.keys_of = np.zeros((batch, kv_heads, width), np.int64)
        self.local = np.zeros_like(lists)
        self.kT = _scratch("kT", (batch, kv_heads, dim, width))
        self.kn = np.zeros((batch, kv_heads, width))
        self.ks = np.zeros((batch, kv_heads, width))
        self.v = _scratch("v", (batch, kv_heads, width, vdim))
        self.vmax = np.zeros((batch, kv_heads, vdim))
        k_ok = np.ones((batch, kv_heads), bool)
        v_ok = np.ones((batch, kv_heads), bool)
        for b in range(batch):  # the keys' pass sets its own threads; value_rows is serial
            for g in range(kv_heads):
                u, self.local[b, g] = used[b][g]
                self.keys_of[b, g, : u.size] = u
                if not self.fused:
                    k_ok[b, g] = self._keys(spec.k[b, g], u, (b, g))
                if not self.decode:
                    src, rows = _source(spec.v[b, g], u)
                    v_ok[b, g] = value_rows(src, rows, self.v[b, g], self.vmax[b, g])
        self.source = (
            _key_source(spec.k, self.keys_of, used)
            + (
                np.zeros((batch, kv_heads), bool),
                self.fused,
            )
            + _NOT_FORMED
        )
        self._spec, self._used = spec, used
        self.counts = counts
        self.q = np.ascontiguousarray(spec.q, dtype=np.float64)
        self.kvh = np.ascontiguousarray(spec.kv_head, dtype=np.int64)
        q_ok, self.qn, self.qs = _facts(self.q)
        if self.decode:
            self._decode(k_ok, v_ok)
        self.prm, ok = _kernel_params(spec)
        listed = min(count, keys)  # the keys a row sums over: at most min(T, S)
        sink = spec.sinks is not None
        # the relative error of the dot products' magnitude sums (gather_kernels.dot_error)
        self.prm[:, :, P_GAMMA_DIM] = _gamma_up(DOT_BLOCK + dim // DOT_BLOCK + 4)
        self.prm[:, :, P_GAMMA_SUM] = _gamma_up(SUM_BLOCK + listed // SUM_BLOCK + 2 + sink)
        self.prm[:, :, P_SUM_REL] = _dot_bound(2 * (listed + sink))
        kv_ok = k_ok & v_ok
        self.ok = ok & q_ok.all(axis=2) & kv_ok[:, self.kvh] & (length > 0) & (keys > 0)
        self.rule = rule

    def _decode(self, k_ok: np.ndarray, v_ok: np.ndarray) -> None:
        """A decode step's first pass (:func:`~refattn.exact.fast.gather_kernels.decode_dots`)
        by spans of DECODE_SPAN gathered columns of each kv-head plane: the dot products of
        every query head with each listed key (each key's panel built once, whatever the
        head blocks of the items that read them), the keys' range checks and exactness
        scales, and the gathered values with their check and maxima, into ``k_ok``, ``v_ok``
        (B, K) and the ``formed`` record of the double-precision step's ``source``."""
        batch, kv_heads, width = self.keys_of.shape
        sizes = tuple(u.size for row in self._used for u, _ in row)
        group, place, tasks, starts = _decode_layout(self.kvh, kv_heads, sizes)
        fs = _scratch("fs", (batch, kv_heads, group.shape[1], width))
        fab = _scratch("fab", fs.shape)
        fks = np.zeros((batch, kv_heads, width))
        fok = np.ones((batch, kv_heads, width), bool)  # the columns past a plane's keys: True
        vmax = np.zeros((tasks.shape[0], self.v.shape[-1]))
        vok = np.ones(tasks.shape[0], bool)
        vsrc, vrows = _key_source(self._spec.v, self.keys_of, self._used)
        if tasks.shape[0]:
            values = (vsrc, vrows, self.v, vmax, vok)
            decode = decode_dots_serial if self.serial else decode_dots
            start = time.perf_counter()
            decode(tasks, frozen(self.q), group, self.source, values, (fs, fab, fks, fok))
            _PACE.record(self.serial, (time.perf_counter() - start) / self.work)
            # each plane's tasks are consecutive: its maxima (of magnitudes, NaN skipped as
            # value_rows does: >= +0, a maximum in any order; the setup left vmax +0 here)
            # and checks over them
            ends = starts[1:].tolist() + [tasks.shape[0]]
            for t0, t1 in zip(starts.tolist(), ends, strict=True):
                b, g = tasks[t0, 0], tasks[t0, 1]
                self.vmax[b, g] = vmax[t0] if t1 == t0 + 1 else vmax[t0:t1].max(axis=0)
                v_ok[b, g] = vok[t0:t1].all()
            k_ok &= fok.all(axis=2)
        self.source = self.source[:4] + tuple(frozen(a) for a in (fs, fab, fks, place))

    def key_flags(self) -> None:
        """After the double-precision step: the kv-head planes whose items found a listed key
        out of range (``fused``: the step formed the keys' facts) leave the first steps (the
        referee takes their rows, as when the setup's check fails)."""
        if self.fused:
            self.ok &= ~self.source[2][:, self.kvh]

    def _keys(self, plane: np.ndarray, used: np.ndarray, bg) -> bool:
        """The keys ``used`` of a kv-head plane (S, D) into the transposed table ``kT[bg]``
        with their norms, exactness scales and range check in one compiled pass
        (:func:`refattn.exact.fast.gather_lanes.key_facts`: the bits of
        :func:`refattn.exact.fast.facts.row_facts`); returns whether all are in the
        first steps' range."""
        ok = np.ones(used.size, bool)
        if used.size:
            src, rows = _source(plane, used)
            with _serial_below(used.size * plane.shape[-1]):
                key_facts(src, rows, self.kT[bg], self.kn[bg], self.ks[bg], ok)
        return bool(ok.all())

    def inputs(self) -> tuple:
        """The kernels' ``inputs`` record (:func:`refattn.exact.fast.gather_kernels.gather_d`)."""
        return tuple(
            frozen(a)
            for a in (
                self.q,
                self.kT,
                self.v,
                self.qn,
                self.kn,
                self.qs,
                self.ks,
                self.vmax,
                self.keys_of,
                self.prm,
                self.kvh,
            )
        )

    def items(self, length: int, threads: int) -> np.ndarray:
        """Work items of the double-precision step: (b, i, head count, heads ...) for every
        query row i and every block of query heads of one kv head whose planes the first
        steps take: up to HEAD_BLOCK heads, fewer (whole multiples of 8) when there are fewer
        rows than ``threads`` to share out (which rows share an item changes no bit)."""
        blocks = []
        rows = np.arange(length, dtype=np.int64)
        for b in range(self.ok.shape[0]):
            for g in range(self.kT.shape[1]):
                heads = np.flatnonzero((self.kvh == g) & self.ok[b])
                share = -(-heads.size // max(1, threads // max(1, length)))
                size = min(HEAD_BLOCK, max(8, -(-share // 8) * 8))
                for start in range(0, heads.size, size):
                    chunk = heads[start : start + size]
                    block = np.zeros((length, 3 + HEAD_BLOCK), np.int64)
                    block[:, 0] = b
                    block[:, 1] = rows
                    block[:, 2] = chunk.size
                    block[:, 3 : 3 + chunk.size] = chunk
                    blocks.append(block)
        return np.concatenate(blocks) if blocks else np.zeros((0, 3 + HEAD_BLOCK), np.int64)


def gather_forward(spec: AttentionSpec, out_dtype, *, return_lse=False, return_weights=False):
    """Correctly rounded (out, lse, weights) of a gather spec (set-read key indices kept as
    lists, see the module docstring) in the flat (B, H, ...) layout, bit-identical to
    :func:`refattn.exact.fast.fast_exact_forward` on the spec with the listed set as a mask.

    Examples
    --------
    >>> from refattn.kernels import gather_spec
    >>> from refattn.spec import canonicalize
    >>> spec = canonicalize(np.zeros((1, 2)), np.zeros((3, 2)), np.array([[1.0], [2.0], [4.0]]))
    >>> out, _, _ = gather_forward(gather_spec(spec, np.array([[2, 0, 2, -1, 7]])), np.float64)
    >>> out.tolist()
    [[[[2.5]]]]
    """
    fmt = format_of(out_dtype)
    batch, heads, _, length, keys, _, vdim = spec.dims
    out = np.zeros((batch, heads, length, vdim))
    lse = np.zeros((batch, heads, length))
    weights = np.zeros((batch, heads, length, keys) if return_weights else (1, 1, 1, 1))
    status = np.full((batch, heads, length), UNDECIDED, dtype=np.int8)
    step_rows = {"double": 0, "double-double": 0}
    if out.size or lse.size:
        x = _Gathered(spec, fused=fmt.p <= 24)
        inputs = x.inputs()
        lists = (frozen(x.local), frozen(x.counts))
        rule = x.rule.kernel_args()
        target = (return_lse, return_weights, fmt.p, fmt.emin, _max_finite(fmt))
        results = (out, lse, weights, status)
        per_row = int(x.counts.max(initial=0)) * (spec.q.shape[-1] + vdim)  # work of a row
        if fmt.p <= 24:
            work = int(x.ok.sum()) * length * per_row
            serial = work < SERIAL_WORK or x.serial  # after a parallel pass, items by head blocks
            items = x.items(length, 1 if serial else numba.get_num_threads())
            if items.size:
                step = gather_d_serial if serial else gather_d
                step(items, inputs, lists, rule, target, results, x.source)
            x.key_flags()
            step_rows["double"] = int(x.ok.sum()) * length
            redo = x.ok[:, :, None] & (status == UNDECIDED)
        else:
            redo = np.broadcast_to(x.ok[:, :, None], status.shape)
        rows = np.ascontiguousarray(np.argwhere(redo)) if redo.any() else _NO_ROWS
        if rows.size:
            with _serial_below(rows.shape[0] * per_row * 4):  # Dot2: ~4 fma chains' work
                dd_step(rows, inputs, lists, rule, target, results, x.source)
        step_rows["double-double"] = rows.shape[0]
    referee_rows = _referee(
        spec, status, out_dtype, (out, lse, weights), return_lse, return_weights
    )
    rows = batch * heads * length, vdim + return_lse + keys * return_weights
    asked = (out, lse if return_lse else None, weights if return_weights else None)
    return finish_forward(asked, fmt.dtype, rows, step_rows, referee_rows)


def _referee(spec, status, out_dtype, results, return_lse, return_weights) -> int:
    """The rows the first steps left (status not OK) by the referee, run by run of rows of
    each plane with their listed set as a mask; returns their count."""
    if (status == OK).all():  # every row decided
        return 0
    return referee_runs(
        spec, status, out_dtype, results, (return_lse, return_weights), gather_row_spec
    )
