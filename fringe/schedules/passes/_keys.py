"""Numpy helpers on integer keys, shared by every pass: runs of a sorted array, sorted
distinct values (by marking where the values are dense, else by a sort), lookups and
membership by binary search or a dense table, minima per key, and one int64 key per row of
int columns. No fringe imports: plain numpy on int arrays."""
from __future__ import annotations

import numpy as np


def _runs(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values and start indices of the runs of equal values in a sorted array."""
    if len(x) == 0:
        return x, np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], x[1:] != x[:-1])))
    return x[starts], starts


def _spans(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The indices ``lo[0]..hi[0]-1, lo[1]..hi[1]-1, ...`` as one array."""
    n = hi - lo
    if not len(n):
        return np.zeros(0, np.int64)
    return np.repeat(lo - np.cumsum(n) + n, n) + np.arange(int(n.sum()))


def _uniq(x: np.ndarray) -> np.ndarray:
    """Sorted unique values (by sorting: numpy's hashing unique is slower on these keys)."""
    return _runs(np.sort(x))[0]


def _by_step(s: np.ndarray, *, descending: bool = False) -> np.ndarray:
    """A stable argsort of step numbers (a radix sort when they fit 16 bits)."""
    if not len(s):
        return np.zeros(0, np.int64)
    lo, hi = int(s.min()), int(s.max())
    key = hi - s if descending else s - lo
    if hi - lo < 1 << 16:
        key = key.astype(np.uint16)
    return np.argsort(key, kind="stable")


def _assign_min(arr: np.ndarray, idx: np.ndarray, val: np.ndarray) -> None:
    """``arr[idx] = min(arr[idx], val)`` over repeated indices: ``np.minimum.at``, which
    NumPy 2 runs as a 1-D loop (0.4 s on 16.8M random indices, where an assignment, a
    check and a sorted retry took 2.8-12 s). ``val`` is cast to ``arr``'s dtype first: with
    two dtypes ``ufunc.at`` leaves its fast loop (18x slower: 4.4 s against 0.25 s on 16.8M
    int64 values into an int32 array); values past ``arr``'s dtype raise (no silent wrap)."""
    val = np.asarray(val)
    if val.dtype != arr.dtype and len(val):
        info = np.iinfo(arr.dtype)
        if int(val.min()) < info.min or int(val.max()) > info.max:
            raise OverflowError(f"_assign_min: values in [{int(val.min())}, {int(val.max())}] "
                                f"do not fit the {arr.dtype} array (internal error)")
    np.minimum.at(arr, idx, val.astype(arr.dtype, copy=False))


def _unique(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sorted distinct values of int array ``x`` and each entry's index among them: by
    marking the values that occur when they span at most a few times ``len(x)`` (no sort),
    else by a sort (numpy's hashed ``unique`` measured 1 s on a million keys)."""
    lo, hi = (int(x.min()), int(x.max())) if len(x) else (0, 0)
    if hi - lo <= 4 * len(x):
        used = np.zeros(hi - lo + 1, dtype=bool)
        at = x - lo
        used[at] = True
        return np.flatnonzero(used) + lo, (np.cumsum(used) - 1)[at]
    o = np.argsort(x, kind="stable")
    xs = x[o]
    new = np.ones(len(xs), dtype=bool)
    new[1:] = xs[1:] != xs[:-1]
    inv = np.empty(len(x), dtype=np.int64)
    inv[o] = np.cumsum(new) - 1
    return xs[new], inv


def _member(x: np.ndarray, sorted_keys: np.ndarray) -> np.ndarray:
    """``np.isin(x, sorted_keys)`` by binary search (``isin`` hashes: slow on int64)."""
    return _lookup(x, sorted_keys, sorted_keys, 0)[1]


def _min_by_key(keys: np.ndarray, vals: np.ndarray, reduce=np.minimum):
    """Sorted distinct keys and the ``reduce`` (min) of their values."""
    if not len(keys):
        return keys, vals
    o = np.argsort(keys, kind="stable")
    k, v = keys[o], vals[o]
    uk, starts = _runs(k)
    return uk, reduce.reduceat(v, starts)


def _lookup(keys: np.ndarray, table_keys: np.ndarray, values: np.ndarray, default: int):
    """``values`` at ``keys`` in sorted ``table_keys`` (``default`` where absent), hit mask."""
    if values.dtype.kind in "iu":           # int64 answers: a default such as int64 max must
        default = np.int64(default)         # not wrap into int32 values
    if not len(table_keys):
        return np.full(len(keys), default, dtype=np.int64), np.zeros(len(keys), dtype=bool)
    lo, span = int(table_keys[0]), int(table_keys[-1]) - int(table_keys[0]) + 1
    if span <= len(keys) // 4:              # a dense table over the keys' span: no search
        where = np.full(span, -1, dtype=np.int64)
        where[table_keys - lo] = np.arange(len(table_keys))
        at = keys - lo
        at = where[np.where((at >= 0) & (at < span), at, 0)]
        hit = (at >= 0) & (table_keys[at] == keys)
        return np.where(hit, values[at], default), hit
    at = np.minimum(np.searchsorted(table_keys, keys), len(table_keys) - 1)
    hit = table_keys[at] == keys
    return np.where(hit, values[at], default), hit


def _outside(col: np.ndarray, lo: int, hi: int) -> np.ndarray | None:
    """Bool mask of the entries of ``col`` outside ``[lo, hi)``; None when there are none
    (decided by the column's min and max: no mask on the accept path)."""
    if not len(col) or (int(col.min()) >= lo and int(col.max()) < hi):
        return None
    return (col < lo) | (col >= hi)


def _row_keys(*cols: np.ndarray) -> np.ndarray:
    """One int64 key per row of the equal-length int columns ``cols``, equal for equal rows
    and increasing with the rows in lexicographic order: mixed radix where the spans fit in
    int64, else compact ids column by column (a sort each)."""
    n = len(cols[0])
    if not n:
        return np.zeros(0, np.int64)
    lo = [int(c.min()) for c in cols]
    span = [int(c.max()) - m + 1 for c, m in zip(cols, lo)]
    if np.prod([float(w) for w in span]) < 2.0 ** 62:
        key = np.asarray(cols[0], dtype=np.int64) - lo[0]     # int64 from here (int32 columns)
        for c, m, w in zip(cols[1:], lo[1:], span[1:]):
            key = key * w + (c - m)
        return key
    key = _unique(cols[0])[1]
    for c in cols[1:]:
        cid = _unique(c)[1]
        key = _unique(key * (int(cid.max()) + 1) + cid)[1]
    return key
