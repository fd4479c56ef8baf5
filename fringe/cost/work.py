"""The tile work model: per tile, the kernel calls and the (q, kv) pairs by kind, and their cost.

Per tile, the block map is split into dense sub-problems by the rules of the one call planner,
:mod:`fringe.ops.calls` (``fused=True``, the block pattern deciding): what
:func:`fringe.ops.tile.tile_forward` runs for the fused ``sdpa`` kernel. The cost model
applies them to the row runs of the block map's rectangles (:func:`_runs_work`: memory and
time grow with the rectangles, never with (L / block)^2: a document mask at S = 4M, P = 8 has
8,192^2 blocks a tile); the planner on dense maps is its oracle in the tests
(``tests/test_cost_sparse_work.py``), and the column cuts of a small row group are the
planner's own (:func:`fringe.ops.calls.split_cols` on the painted group). Each sub-problem
costs ``call_s + pairs * unit``, where ``unit`` is the seconds per (q, kv) pair for its kind:
FULL (no mask), masked (a PARTIAL or EMPTY block inside: a float mask), or causal (the whole
square, at the ``causal`` factor). A per-tile overhead (merging the partial output,
accumulating dq) scales with the q rows. (Costing a causal diagonal as masked row groups
over-predicted measured causal steps by 17-33%.)

The bottom layer of the cost model with :mod:`fringe.cost.hardware`: it reads a plan's
``world_size``, ``local_len``, ``block_size``, ``mask_mod``, ``tiles`` and ``block_map`` (and
:func:`dense_tile_work` a dense block map), and imports nothing of fringe above ``ops``.

Legend: L tokens per rank · P ranks · n blocks per rank (L / block).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from ..masks import BlockKind
from ..ops.calls import GROUP_SLACK, column_runs, group_spans, split_cols
from .hardware import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, Hardware, Shape, get_hardware

__all__ = ["TILE_WORK_BYTES_PER_RUN", "TILE_WORK_BYTES_PER_TILE", "dense_tile_work",
           "distinct_partial_maps", "live_tile_work", "tile_costs", "tile_work",
           "tile_work_bytes"]

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)
_CHUNK = 1 << 15          # tiles whose block maps are packed at once in tile_work
_BAND_BLOCKS = 1 << 24    # blocks of the block map made dense at once in tile_work
_RECT_CHUNK = 1 << 16     # rectangles hashed at once in _distinct_maps_from_rects (in cache)
_SPLIT_DENSE = 1 << 14    # blocks of a row group painted to cut its columns (the planner's own)


def _maps_work(maps, *, L: int, block_size: int, masked_ok: bool) -> np.ndarray:
    """``[N, 4]`` (calls, full pairs, masked pairs, causal pairs) of N block maps ``[N, n, n]``.

    The sub-problems are the ``sdpa`` kernel's, from the one planner's rules
    (:func:`fringe.ops.calls.fused_pieces`, which :func:`fringe.ops.tile._plan` runs on one
    tile): square causal-aligned diagonal runs as one ``is_causal`` call each, the rest
    grouped by rows and cut where columns switch between all-FULL (no mask) and mixed,
    whichever makes no more calls than the plain grouping, map by map (the block pattern
    decides: the cost model sees block maps only); a piece is FULL when every block it covers
    is FULL (no mask). Counted on the maps' row runs (:func:`_runs_work`), as
    :func:`tile_work` counts a plan's tiles from its rectangles.
    """
    m = torch.as_tensor(maps).to(torch.int8).numpy()
    N, n, _ = m.shape
    if L != n * block_size:
        raise ValueError(f"_maps_work: L={L} is not n * block_size = {n} * {block_size}; "
                         f"the cost model's tiles hold whole blocks")
    uid, rects, codes = _rects_of_dense(m)
    return _runs_work(uid, rects, codes, N, n=n, block_size=block_size, masked_ok=masked_ok)


def tile_work(plan) -> np.ndarray:
    """Per tile: ``[P, P, 4]`` (calls, full, masked, causal pairs); zero for EMPTY tiles
    (:func:`live_tile_work` painted on the ``P x P`` grid).

    Tiles with the same block map share one evaluation, so this costs the number of
    *distinct* maps, all planned in one pass of the sparse planner (:func:`_runs_work`, on
    row runs: memory and time grow with the rectangles, not with (L / block)^2). A plan's
    maps are read from the rectangles of its sparse ``block_map`` (never painted), or painted
    from its dense rows when rectangles cross tiles.
    """
    P = plan.world_size
    keys, work = live_tile_work(plan)
    out = np.zeros((P, P, 4), dtype=np.float64)
    out.reshape(P * P, 4)[keys] = work
    return out


def live_tile_work(plan) -> tuple[np.ndarray, np.ndarray]:
    """``(keys, work)``: the non-EMPTY tiles ``i * P + j`` (sorted) and their ``[K, 4]``
    (calls, full, masked, causal pairs): :func:`tile_work` without the ``P x P`` grid (the
    simulator's; at P = 4096 the grid is 512 MiB, and documents leave most tiles EMPTY)."""
    P, n = plan.world_size, plan.local_len // plan.block_size
    bm = plan.block_map

    def distinct(part, tiles_flat):
        found = _distinct_maps_from_rects(bm, tiles_flat, part, P, n)
        if found is None:
            found = _distinct_maps_dense(lambda r0, r1: bm.dense(rows=(r0, r1), limit=None),
                                         part, P, n)
        return found
    return _live_tile_work(plan.tiles, distinct, P=P, L=plan.local_len,
                           block_size=plan.block_size, masked_ok=plan.mask_mod is not None)


def dense_tile_work(tiles: torch.Tensor, blocks: torch.Tensor, *, block_size: int,
                    masked_ok: bool = True) -> np.ndarray:
    """:func:`tile_work` of a dense block map ``blocks`` int8 ``[P * n, P * n]`` (rank-major)
    with tile kinds ``tiles`` ``[P, P]`` (the balanced layout's solver, before any plan)."""
    P = tiles.shape[0]
    n = blocks.shape[0] // P

    def distinct(part, tiles_flat):
        return _distinct_maps_dense(lambda r0, r1: blocks[r0:r1], part, P, n)
    keys, work = _live_tile_work(tiles, distinct, P=P, L=n * block_size, block_size=block_size,
                                 masked_ok=masked_ok)
    out = np.zeros((P, P, 4), dtype=np.float64)
    out.reshape(P * P, 4)[keys] = work
    return out


def _live_tile_work(tiles, distinct, *, P: int, L: int, block_size: int,
                    masked_ok: bool) -> tuple[np.ndarray, np.ndarray]:
    """:func:`live_tile_work` with ``distinct(part, tiles_flat) -> _Distinct``: the distinct
    maps of the PARTIAL tiles ``part`` (keys ``i * P + j``) and which one each tile has."""
    bs = block_size
    n = L // bs
    t = torch.as_tensor(tiles)
    tiles_flat = (t if t.dtype in (torch.int8, torch.int64) else t.to(torch.int64)).numpy()
    tiles_flat = tiles_flat.reshape(-1)
    keys = np.flatnonzero(tiles_flat != _EMPTY)               # tile keys i * P + j, sorted
    kinds = tiles_flat[keys]
    work = np.zeros((len(keys), 4), dtype=np.float64)
    full_tiles = kinds == _FULL
    if full_tiles.any():
        work[full_tiles] = _runs_work(np.zeros(1, np.int64), np.array([[0, n, 0, n]]),
                                      np.array([_FULL], np.int8), 1, n=n, block_size=bs,
                                      masked_ok=masked_ok)[0]
    at = np.flatnonzero(kinds == _PARTIAL)
    if len(at):
        d = distinct(keys[at], tiles_flat)
        per_map = _runs_work(d.uid, d.rects, d.codes, d.U, n=n, block_size=bs,
                             masked_ok=masked_ok)
        work[at] = per_map[d.inv]
    return keys, work


def _signed(n: int) -> bool:
    """Whether tiles of n x n blocks are grouped by their rectangles' packed signatures (else
    their maps are painted: :func:`_distinct_maps_dense`)."""
    return n + 1 <= 1 << 14


class _Distinct(NamedTuple):
    """The distinct block maps of a plan's PARTIAL tiles, as rectangles: ``U`` maps, ``inv``
    which one each tile has, and the rectangles ``rects`` (block rows and columns local to
    their tile, ``[r0, r1, c0, c1]``) of map ``uid`` with ``codes``."""

    U: int
    inv: np.ndarray
    uid: np.ndarray
    rects: np.ndarray
    codes: np.ndarray

    def paint(self, n: int) -> torch.Tensor:
        """The maps, int8 ``[U, n, n]`` (for tests and pictures: the cost model never paints)."""
        maps = torch.zeros(self.U, n, n, dtype=torch.int8)
        for u, (r0, r1, c0, c1), c in zip(self.uid.tolist(), self.rects.tolist(),
                                          self.codes.tolist()):
            maps[u, r0:r1, c0:c1] = c
        return maps


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread uint64 hash of each element (wrapping)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _distinct_maps_from_rects(bm, tiles_flat: np.ndarray, part: np.ndarray, P: int, n: int):
    """``(maps [U, n, n] int8, inv [len(part)])``: the distinct block maps of the PARTIAL
    tiles ``part`` and which one each tile has, from the block map's rectangles.

    A rectangle's signature is its position inside its tile, its size and its code; a tile's
    signature is the (order-free) sum of its rectangles' hashed signatures and their count.
    Tiles are grouped by signature, and then checked exactly: a tile has as many rectangles
    as its group's representative and every one of them is one of the representative's
    (rectangles of one tile are disjoint, so the two sets, and maps, are equal). Equal maps
    cut into different rectangles land in different groups (an evaluation more, the same
    work). A few passes over the rectangles, no sort of them.
    Returns None when a rectangle crosses a tile boundary (the caller paints densely).
    """
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = (bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes))
    if not len(R) or not _signed(n):
        return None
    m = n + 1
    # int32 where the packed signature fits (n <= 126: 4 coordinates < m and a 2-bit code)
    it = np.int32 if m ** 4 * 4 < 1 << 31 and max(R.shape[0], P * P) < 1 << 31 else np.int64
    N = len(R)
    key = np.empty(N, dtype=it)                       # tile i * P + j of every rectangle
    enc = np.empty(N, dtype=it)                       # (row, height, col, width, code) packed
    # a tile's signature: the sums of two 24-bit hashes of its rectangles (float64 sums of
    # integers below 2**53 are exact and order-free) and its count, by bincount, per PARTIAL
    # tile (``part``, sorted: its positions index every per-tile array; no P x P array,
    # 0.4 GB at P=4,096 where a few thousand tiles are PARTIAL)
    nP = len(part)

    def at_part(keys):
        """Each tile key's position in ``part``, and whether it is there (PARTIAL)."""
        t = np.minimum(np.searchsorted(part, keys), nP - 1)
        return t, part[t] == keys
    lo = np.zeros(nP)
    hi = np.zeros(nP)
    cnt = np.zeros(nP, dtype=np.int64)
    mask24 = np.uint32((1 << 24) - 1)
    for a in range(0, N, _RECT_CHUNK):                # a chunk at a time: arrays stay in cache
        Rc = R[a:a + _RECT_CHUNK]
        r0, r1, c0, c1 = (Rc[:, k].astype(it) for k in range(4))
        if n & (n - 1) == 0:                          # shifts and masks for a power of two
            sh = it(n.bit_length() - 1)
            ti, lr, tj, lc = r0 >> sh, r0 & it(n - 1), c0 >> sh, c0 & it(n - 1)
        else:
            (ti, lr), (tj, lc) = np.divmod(r0, it(n)), np.divmod(c0, it(n))
        r1 -= r0                                       # height
        c1 -= c0                                       # width
        if (lr + r1).max() > n or (lc + c1).max() > n:
            return None                               # rectangles across tiles: paint densely
        k = key[a:a + _RECT_CHUNK]
        np.multiply(ti, it(P), out=k)
        k += tj
        e = enc[a:a + _RECT_CHUNK]
        np.multiply(lr, it(m), out=e)
        e += r1
        e *= it(m)
        e += lc
        e *= it(m)
        e += c1
        e *= it(4)
        e += C[a:a + _RECT_CHUNK].astype(it)          # injective
        t, hit = at_part(k)                           # (rectangles of other tiles: not
        t = t[hit]                                    # counted, as no PARTIAL tile's)
        if not len(t):
            continue
        t0, t1 = int(t.min()), int(t.max()) + 1       # the chunk's tiles (rows: a few)
        t -= t0
        with np.errstate(over="ignore"):
            for acc, mul in ((lo, 0x9E3779B1), (hi, 0x85EBCA77)):
                x = e[hit].astype(np.uint32)
                x *= np.uint32(mul)
                x ^= x >> np.uint32(15)
                x *= np.uint32(0xC2B2AE3D)
                x ^= x >> np.uint32(13)
                x &= mask24
                acc[t0:t1] += np.bincount(t, weights=x, minlength=t1 - t0)
        cnt[t0:t1] += np.bincount(t, minlength=t1 - t0)
    del r0, r1, c0, c1, ti, tj, lr, lc
    with np.errstate(over="ignore"):
        sig = _mix64(lo.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
                     + hi.astype(np.uint64) * np.uint64(0x94D049BB133111EB)
                     + cnt.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    _, first, inv = np.unique(sig.view(np.int64), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    U = len(first)

    def uid(keys):
        """Each tile key's group (U: not a PARTIAL tile, not checked)."""
        t, hit = at_part(keys)
        return np.where(hit, inv[t], U).astype(it)
    is_rep = np.zeros(nP, dtype=bool)                 # each group's representative tile
    is_rep[first] = True
    E = m ** 4 * 4
    ok = bool((cnt == cnt[first][inv]).all())
    # the representatives' rectangles, and then every rectangle checked against them, a chunk
    # at a time (gathers from small tables, temporaries in cache)
    def rep_rows(a):
        t, hit = at_part(key[a:a + _RECT_CHUNK])
        return a + np.flatnonzero(hit & is_rep[t])
    keep = np.concatenate([rep_rows(a) for a in range(0, N, _RECT_CHUNK)])
    if ok:
        ref_u, ref_e = uid(key[keep]).astype(np.int64), enc[keep].astype(np.int64)
        if (U + 1) * E <= 1 << 26:                    # membership by a table
            table = np.zeros((U + 1) * E, dtype=bool)
            table[ref_u * E + ref_e] = True
            table[U * E:] = True
            for a in range(0, N, _RECT_CHUNK):
                look = uid(key[a:a + _RECT_CHUNK])
                look *= it(E)
                look += enc[a:a + _RECT_CHUNK]
                if not table[look].all():
                    ok = False
                    break
        else:                                         # membership by a search
            u = uid(key)
            ref = np.unique(ref_u * E + ref_e)
            cand = u.astype(np.int64) * E + enc
            chk = cand[u < U]
            at = np.minimum(np.searchsorted(ref, chk), len(ref) - 1)
            ok = bool((ref[at] == chk).all())
    if not ok:                                        # a hash collision: sort and compare
        return _distinct_maps_sorted(bm, tiles_flat, part, P, n)
    rr = R[keep].astype(np.int64)
    kt = key[keep].astype(np.int64)
    ti_, tj_ = kt // P, kt % P
    local = np.stack([rr[:, 0] - ti_ * n, rr[:, 1] - ti_ * n, rr[:, 2] - tj_ * n,
                      rr[:, 3] - tj_ * n], axis=1)
    return _Distinct(U, inv, uid(kt).astype(np.int64), local, C[keep].astype(np.int8))


def _distinct_maps_sorted(bm, tiles_flat: np.ndarray, part: np.ndarray, P: int, n: int):
    """As :func:`_distinct_maps_from_rects` (its fallback on a hash collision), exactly: the
    rectangles sorted by tile, tiles grouped by (count, hash of the ordered signature), every
    group checked element by element against its first tile, and grouped by content if not.
    Returns None when a rectangle crosses a tile boundary (the caller paints densely).
    """
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = (bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes))
    R = R.astype(np.int64, copy=False)
    if not len(R) or not _signed(n):
        return None
    ti, tj = R[:, 0] // n, R[:, 2] // n
    if ((R[:, 1] - 1) // n != ti).any() or ((R[:, 3] - 1) // n != tj).any():
        return None                                   # rectangles across tiles: paint densely
    key = ti * P + tj
    sel = tiles_flat[key] == _PARTIAL
    key, R, C, ti, tj = key[sel], R[sel], C[sel].astype(np.int64), ti[sel], tj[sel]
    order = np.argsort(key, kind="stable")            # keeps the (r0, c0) order inside a tile
    key, R, C, ti, tj = key[order], R[order], C[order], ti[order], tj[order]
    tile = np.searchsorted(part, key)                 # index into part of each rectangle
    m = n + 1
    enc = ((((R[:, 0] - ti * n) * m + (R[:, 1] - ti * n)) * m + (R[:, 2] - tj * n)) * m
           + (R[:, 3] - tj * n)) * 4 + C
    cnt = np.bincount(tile, minlength=len(part))
    start = np.cumsum(cnt) - cnt
    k = np.arange(len(tile)) - start[tile]
    h = _mix64(enc * np.int64(1 << 20) + k)           # position-dependent: order matters
    tile_hash = np.zeros(len(part), dtype=np.uint64)
    nz = cnt > 0
    if nz.any():
        with np.errstate(over="ignore"):
            tile_hash[nz] = np.add.reduceat(h, start[nz])
    with np.errstate(over="ignore"):
        sig = _mix64(tile_hash + cnt.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    _, first, inv = np.unique(sig.view(np.int64), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = first[inv]                                  # each tile's representative tile
    same = (cnt == cnt[rep]).all() and (enc == enc[np.minimum(start[rep[tile]] + k,
                                                               len(enc) - 1)]).all()
    if not same:                                      # a hash collision: group by content
        width = int(cnt.max())
        pad = np.full((len(part), width), -1, dtype=np.int64)
        pad[tile, k] = enc
        _, first, inv = np.unique(np.concatenate([cnt[:, None], pad], axis=1), axis=0,
                                  return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    U = len(first)
    uid = np.full(len(part), -1, dtype=np.int64)
    uid[first] = np.arange(U)
    keep = uid[tile] >= 0                             # the representatives' rectangles
    u, rr, cc = uid[tile[keep]], R[keep], C[keep].astype(np.int8)
    local = np.stack([rr[:, 0] - ti[keep] * n, rr[:, 1] - ti[keep] * n,
                      rr[:, 2] - tj[keep] * n, rr[:, 3] - tj[keep] * n], axis=1)
    return _Distinct(U, inv, u, local, cc)


def _distinct_maps_dense(rows, part: np.ndarray, P: int, n: int):
    """As :func:`_distinct_maps_from_rects`, from dense block rows (``rows(r0, r1)``: int8
    block rows ``[r0, r1)`` of the map)."""
    pi_all, pj_all = part // P, part % P
    W = -(-(n * n) // 32)
    words = torch.empty(len(part), W, dtype=torch.int64)
    shifts = 2 * torch.arange(32, dtype=torch.int64)
    band = max(1, _BAND_BLOCKS // (n * n * P))          # q ranks painted at once
    starts = np.searchsorted(pi_all, np.arange(0, P + band, band))
    for b, i0 in enumerate(range(0, P, band)):
        lo, hi = starts[b], starts[b + 1]
        if lo == hi:
            continue
        i1 = min(P, i0 + band)
        grid = rows(i0 * n, i1 * n).view(i1 - i0, n, P, n)
        pi = torch.as_tensor(pi_all[lo:hi] - i0)
        pj = torch.as_tensor(pj_all[lo:hi])
        for a in range(0, hi - lo, _CHUNK):          # bounded memory: _CHUNK maps at a time
            maps = grid[pi[a:a + _CHUNK], :, pj[a:a + _CHUNK], :]              # [N, n, n]
            flat = torch.nn.functional.pad(maps.reshape(len(maps), n * n).to(torch.int64),
                                           (0, W * 32 - n * n))
            words[lo + a:lo + a + len(maps)] = (flat.view(len(maps), W, 32) << shifts).sum(-1)
    _, first, inv = np.unique(words.numpy(), axis=0, return_index=True, return_inverse=True)
    maps = torch.stack([rows(int(pi_all[f]) * n, (int(pi_all[f]) + 1) * n)[
        :, int(pj_all[f]) * n:(int(pj_all[f]) + 1) * n] for f in first])
    uid, rects, codes = _rects_of_dense(maps.to(torch.int8).numpy())
    return _Distinct(len(first), inv.reshape(-1), uid, rects, codes)


# ---------------------------------------------------------------------------------------------
# The sparse planner: fringe.ops.calls.fused_pieces on row runs instead of dense maps.


def _row_runs(uid: np.ndarray, rects: np.ndarray, codes: np.ndarray, n: int):
    """``(grow, c0, c1, code)``: the block rows of rectangles ``rects`` ``[k, 4]`` (local to
    map ``uid``) as runs, sorted by (row, column), touching runs of one code merged. ``grow``
    is ``uid * (n + 1) + row``: the maps stacked with an EMPTY row between them, as
    :func:`fringe.ops.calls.fused_pieces` stacks them."""
    r0, r1 = rects[:, 0].astype(np.int64), rects[:, 1].astype(np.int64)
    h = r1 - r0
    total = int(h.sum())
    rep = np.repeat(np.arange(len(h)), h)
    off = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(h) - h, h)
    grow = (uid.astype(np.int64) * (n + 1) + r0)[rep] + off
    del off
    c0 = rects[:, 2].astype(np.int64)[rep]
    c1 = rects[:, 3].astype(np.int64)[rep]
    code = codes.astype(np.int8)[rep]
    del rep
    order = np.argsort(grow * (n + 1) + c0, kind="stable")
    grow, c0, c1, code = grow[order], c0[order], c1[order], code[order]
    del order
    if len(grow) > 1:
        join = np.r_[False, (grow[1:] == grow[:-1]) & (c0[1:] == c1[:-1]) & (code[1:] == code[:-1])]
        if join.any():
            first = np.flatnonzero(~join)
            last = np.r_[first[1:], len(grow)] - 1
            grow, c0, c1, code = grow[first], c0[first], c1[last], code[first]
    return grow, c0, c1, code


def _row_spans(grow: np.ndarray, c0: np.ndarray, c1: np.ndarray):
    """``(rows, lo, hi)``: the live rows of sorted runs and each one's first and last+1 column."""
    if not len(grow):
        z = np.zeros(0, dtype=np.int64)
        return z, z, z
    head = np.r_[True, grow[1:] != grow[:-1]]
    first = np.flatnonzero(head)
    last = np.r_[first[1:], len(grow)] - 1
    return grow[first], c0[first], c1[last]


def _group_rows(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`fringe.ops.calls.row_runs` on row spans: ``[G, 4]`` groups ``(q0, q1, k0, k1)``."""
    out = group_spans(rows.tolist(), lo.tolist(), hi.tolist(), GROUP_SLACK)
    return np.asarray(out, dtype=np.int64).reshape(-1, 4)


def _causal_runs(grow, c0, c1, code, n: int):
    """:func:`fringe.ops.calls.causal_squares` (no element check) on row runs: ``(squares
    [Q, 3] (row, col, size), members)`` where ``members`` lists, per square, the indices of
    the PARTIAL runs whose last block is on its diagonal."""
    N = len(grow)
    nxt = np.r_[grow[1:] == grow[:-1], False]
    nxt_c0 = np.r_[c0[1:], 0]
    cand = (code == _PARTIAL) & ~(nxt & (nxt_c0 == c1))
    k = np.flatnonzero(cand)
    if not len(k):
        return np.zeros((0, 3), dtype=np.int64), []
    i, j = grow[k], c1[k] - 1
    # above: block (i - 1, j) EMPTY
    SK = grow * (n + 1) + c0
    at = np.searchsorted(SK, (i - 1) * (n + 1) + j, side="right") - 1
    atc = np.maximum(at, 0)
    above = ~((at >= 0) & (grow[atc] == i - 1) & (c1[atc] > j))
    k, i, j = k[above], i[above], j[above]
    if not len(k):
        return np.zeros((0, 3), dtype=np.int64), []
    # FULL blocks just left (a single-block PARTIAL run after a touching FULL run)
    p = np.maximum(k - 1, 0)
    left = ((c1[k] - c0[k] == 1) & (k > 0) & (grow[p] == i) & (c1[p] == c0[k])
            & (code[p] == _FULL))
    f = np.where(left, c1[p] - c0[p], 0)
    # EMPTY blocks right of it, up to the next run (or far: none)
    g = np.where(nxt[k], nxt_c0[k] - j - 1, 1 << 60)
    ends: dict[int, int] = {}
    runs: list[list] = []
    for kk, ii, jj, ff, gg in zip(k.tolist(), i.tolist(), j.tolist(), f.tolist(),
                                  (g + i).tolist()):
        r = ends.get(jj - ii)
        if r is not None:
            run = runs[r]
            m = run[2]
            # the dense rule: f >= m and the m blocks above (i, j) EMPTY, which are the blocks
            # right of the run's members at (i - s, j - s): each needs s EMPTY blocks right
            if run[0] + m == ii and ff >= m and run[3] >= ii:
                run[2] = m + 1
                run[3] = min(run[3], gg)
                run[4].append(kk)
                continue
        ends[jj - ii] = len(runs)
        runs.append([ii, jj, 1, gg, [kk]])
    sq = np.asarray([r[:3] for r in runs], dtype=np.int64).reshape(-1, 3)
    return sq, [r[4] for r in runs]


def _split_runs(rr, a, b, full, h: int, w: int, qb0: int, kb0: int, out: list) -> None:
    """:func:`fringe.ops.calls.split_cols` on the runs of a group: ``rr`` their rows and
    ``[a, b)`` their columns relative to the group's ``h`` x ``w`` rectangle, ``full``
    whether each is FULL; appends ``(qb0, qb1, kb0, kb1)`` pieces to ``out`` (the same pieces,
    in another order: a stack instead of recursion, which a staircase of FULL blocks makes as
    deep as it is wide)."""
    todo = [(rr, a, b, full, h, w, qb0, kb0)]
    while todo:
        rr, a, b, full, h, w, qb0, kb0 = todo.pop()
        pts = np.unique(np.concatenate([[0, w], a, b]))
        ns = len(pts) - 1
        la, lb = np.searchsorted(pts, a), np.searchsorted(pts, b)
        live = np.cumsum(np.bincount(la, minlength=ns + 1)
                         - np.bincount(lb, minlength=ns + 1))[:ns] > 0
        fc = np.cumsum(np.bincount(la[full], minlength=ns + 1)
                       - np.bincount(lb[full], minlength=ns + 1))[:ns] == h
        runs = column_runs(fc.tolist(), live.tolist())     # the planner's cut rule, on segments
        if runs is None:
            out.append((qb0, qb0 + h, kb0, kb0 + w))
            continue
        xs = pts.tolist()
        for s, e, is_full in runs:
            x0, x1 = xs[s], xs[e]
            sel = (a < x1) & (b > x0)
            rows = rr[sel]
            r0, r1 = int(rows.min()), int(rows.max()) + 1
            if is_full or (r0, r1) == (0, h):
                out.append((qb0 + r0, qb0 + r1, kb0 + x0, kb0 + x1))
            else:
                todo.append((rows - r0, np.maximum(a[sel], x0) - x0,
                             np.minimum(b[sel], x1) - x0, full[sel], r1 - r0, x1 - x0,
                             qb0 + r0, kb0 + x0))


def _whole_groups(groups: np.ndarray, grow, c0, c1, code, n: int) -> np.ndarray:
    """Per row group ``(q0, q1, k0, k1)``: whether :func:`fringe.ops.calls.split_cols` keeps it
    whole (every column all-FULL, or none all-FULL and every column live)."""
    G = len(groups)
    if not G:
        return np.zeros(0, dtype=bool)
    q0, q1, k0, k1 = groups.T
    ra, rb = np.searchsorted(grow, q0), np.searchsorted(grow, q1)
    cnt = rb - ra
    gid = np.repeat(np.arange(G), cnt)
    idx = _ranges(ra, rb)
    h = q1 - q0
    isf = code[idx] == _FULL
    a, b = c0[idx], c1[idx]
    exact = isf & (a == k0[gid]) & (b == k1[gid])
    all_full = (np.bincount(gid, weights=exact, minlength=G) == h) & (cnt == h)
    # every column live: the runs sorted by start cover [k0, k1) without a gap
    o = np.argsort(gid * (n + 1) + a, kind="stable")
    ga, aa, bb = gid[o], a[o], b[o]
    big = bb + ga * (n + 2)
    reach = np.maximum.accumulate(big) - ga * (n + 2)
    gap = np.r_[False, (ga[1:] == ga[:-1]) & (aa[1:] > reach[:-1])]
    all_live = np.bincount(ga, weights=gap, minlength=G) == 0
    # a column all-FULL: FULL runs (disjoint in a row) covering it in all h rows
    fg, fa, fb = gid[isf], a[isf], b[isf]
    ek = np.concatenate([fg * (n + 2) + fa, fg * (n + 2) + fb])
    ed = np.concatenate([np.ones(len(fa), np.int64), -np.ones(len(fb), np.int64)])
    o = np.argsort(ek, kind="stable")
    ek, ed = ek[o], ed[o]
    level = np.cumsum(ed)
    lastk = np.r_[ek[1:] != ek[:-1], True] if len(ek) else np.zeros(0, bool)
    eg = ek // (n + 2)
    hit = lastk & (level == h[eg]) if len(ek) else np.zeros(0, bool)
    any_full = np.bincount(eg[hit], minlength=G) > 0 if len(ek) else np.zeros(G, bool)
    return all_full | (~any_full & all_live)


def _ranges(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """The concatenation of ``arange(a[i], b[i])``."""
    c = b - a
    return np.repeat(a - (np.cumsum(c) - c), c) + np.arange(int(c.sum()), dtype=np.int64)


def _full_blocks(grow, c0, c1, code, n: int, pieces: np.ndarray) -> np.ndarray:
    """FULL blocks inside each piece ``(q0, q1, k0, k1)`` of the map of these runs."""
    if not len(pieces):
        return np.zeros(0, dtype=np.int64)
    q0, q1, k0, k1 = pieces.T
    h = q1 - q0
    rep = np.repeat(np.arange(len(q0)), h)
    row = _ranges(q0, q1)
    SK = grow * (n + 1) + c0
    isf = code == _FULL
    F = np.r_[0, np.cumsum(np.where(isf, c1 - c0, 0))]

    def G(x):                                        # FULL blocks before (row, x) in run order
        at = np.searchsorted(SK, row * (n + 1) + x, side="right") - 1
        atc = np.maximum(at, 0)
        same = (at >= 0) & (grow[atc] == row)
        inside = np.where(same & isf[atc], np.minimum(x, c1[atc]) - c0[atc], 0)
        return np.where(at < 0, 0, np.where(same, F[atc] + inside, F[atc + 1]))
    per_row = G(k1[rep]) - G(k0[rep])
    return np.bincount(rep, weights=per_row, minlength=len(q0)).astype(np.int64)


def _runs_work(uid: np.ndarray, rects: np.ndarray, codes: np.ndarray, U: int, *, n: int,
               block_size: int, masked_ok: bool) -> np.ndarray:
    """``[U, 4]`` (calls, full pairs, masked pairs, causal pairs) of U maps ``n`` x ``n`` given
    as disjoint rectangles (``uid``: the map of each; ``rects`` local block rows and columns
    ``[r0, r1, c0, c1]``; ``codes`` FULL or PARTIAL): the calls of the fused plan of
    :func:`fringe.ops.calls.fused_pieces` (see :func:`_maps_work`), from their row runs,
    never a dense map (memory and time grow with the runs, not with n^2)."""
    bs = block_size
    out = np.zeros((U, 4))
    if U == 0 or not len(rects):
        return out
    m = n + 1
    grow, c0, c1, code = _row_runs(uid, rects, codes, n)
    base = _group_rows(*_row_spans(grow, c0, c1))
    sq, members = (_causal_runs(grow, c0, c1, code, n) if masked_ok
                   else (np.zeros((0, 3), np.int64), []))
    if len(sq):
        # the squares emptied: the PARTIAL run of each member, and the FULL run before it
        alive = np.ones(len(grow), dtype=bool)
        w1 = c1.copy()
        mem = np.concatenate([np.asarray(x, dtype=np.int64) for x in members])
        sizes = sq[:, 2]
        t = _ranges(np.zeros(len(sq), np.int64), sizes)
        j0 = np.repeat(sq[:, 1], sizes)
        first = t == 0
        kf = mem[first]
        cut = c0[kf] < j0[first]
        w1[kf[cut]] = j0[first][cut]
        alive[kf[~cut]] = False
        alive[mem[~first]] = False
        p = mem[~first] - 1
        cut = c0[p] < j0[~first]
        w1[p[cut]] = j0[~first][cut]
        alive[p[~cut]] = False
        wg, w0, w1, wc = grow[alive], c0[alive], w1[alive], code[alive]
        rest = _group_rows(*_row_spans(wg, w0, w1))
    else:
        wg, w0, w1, wc = grow, c0, c1, code
        rest = base
    whole = _whole_groups(rest, wg, w0, w1, wc, n)
    split: list = []                                 # (group, pieces) of the groups cut
    for gi in np.flatnonzero(~whole).tolist():
        a, b, c, d = (int(x) for x in rest[gi])
        ra, rb = np.searchsorted(wg, a), np.searchsorted(wg, b)
        pieces: list = []
        if (b - a) * (d - c) <= _SPLIT_DENSE:         # small: painted, the planner's own cut
            w = d - c
            at = (wg[ra:rb] - a) * (w + 1)
            codes = np.bincount(np.concatenate([at + w0[ra:rb] - c, at + w1[ra:rb] - c]),
                                weights=np.concatenate([wc[ra:rb], -wc[ra:rb]]),
                                minlength=(b - a) * (w + 1))
            codes = codes.reshape(b - a, w + 1).cumsum(1)[:, :w].astype(np.int8)
            split_cols(codes, a, c, pieces)
        else:
            _split_runs(wg[ra:rb] - a, w0[ra:rb] - c, w1[ra:rb] - c, wc[ra:rb] == _FULL,
                        b - a, d - c, a, c, pieces)
        split.append((gi, pieces))

    def per_map(q0):
        return np.bincount(np.asarray(q0, dtype=np.int64) // m, minlength=U)
    n_base, n_rest, n_sq = per_map(base[:, 0]), per_map(rest[:, 0]), per_map(sq[:, 0])
    extra = np.zeros(U, dtype=np.int64)
    for gi, pieces in split:
        extra[int(rest[gi, 0]) // m] += len(pieces) - 1
    choice = np.where(n_sq + n_rest + extra <= n_base, 0, np.where(n_sq + n_rest <= n_base, 1, 2))
    # pieces: base (codes of the map), else squares + rest kept whole + the cuts (squares emptied)
    pb = base[choice[base[:, 0] // m] == 2]
    keep = choice[rest[:, 0] // m] != 2
    keep &= (choice[rest[:, 0] // m] == 1) | whole
    cuts = [p for gi, pieces in split if choice[int(rest[gi, 0]) // m] == 0 for p in pieces]
    pw = np.concatenate([rest[keep], np.asarray(cuts, dtype=np.int64).reshape(-1, 4)])
    psq = sq[choice[sq[:, 0] // m] != 2]
    for pieces, src in ((pb, 0), (pw, 1)):
        if not len(pieces):
            continue
        area = (pieces[:, 1] - pieces[:, 0]) * (pieces[:, 3] - pieces[:, 2])
        if masked_ok:
            runs = (grow, c0, c1, code) if src == 0 else (wg, w0, w1, wc)
            is_full = _full_blocks(*runs, n, pieces) == area
        else:
            is_full = np.ones(len(pieces), dtype=bool)
        pairs = (area * (bs * bs)).astype(np.float64)
        u = pieces[:, 0] // m
        out[:, 0] += np.bincount(u, minlength=U)
        out[:, 1] += np.bincount(u, weights=np.where(is_full, pairs, 0.0), minlength=U)
        out[:, 2] += np.bincount(u, weights=np.where(is_full, 0.0, pairs), minlength=U)
    if len(psq):
        u = psq[:, 0] // m
        out[:, 0] += np.bincount(u, minlength=U)
        out[:, 3] += np.bincount(u, weights=(psq[:, 2] * psq[:, 2] * (bs * bs)).astype(np.float64),
                                 minlength=U)
    return out


def _rects_of_dense(maps: np.ndarray):
    """``(uid, rects, codes)`` of int8 maps ``[U, n, n]``: one rectangle per run of one code
    along a row (height 1)."""
    U, n, _ = maps.shape
    d = np.zeros((U * n, n + 2), dtype=np.int8)
    d[:, 1:-1] = maps.reshape(U * n, n)
    edge = d[:, 1:] != d[:, :-1]
    r, c = np.nonzero(edge & (d[:, 1:] != _EMPTY))
    _, ce = np.nonzero(edge & (d[:, :-1] != _EMPTY))
    code = d[r, c + 1]
    rects = np.stack([r % n, r % n + 1, c, ce], axis=1).astype(np.int64)
    return (r // n).astype(np.int64), rects, code


def tile_costs(plan, hardware: str | Hardware = "cpu", shape: Shape = Shape(), *,
               backward: bool = False, split: int = 1) -> np.ndarray:
    """Seconds each tile (q of rank i, kv of rank j) takes, ``[P, P]``; 0 for EMPTY tiles.

    With ``split=k`` the cost of computing one head slice of k (``C q·kv h i/k``): the
    kernel calls cost as much, the pairs and rows 1/k.
    """
    hw = get_hardware(hardware)
    fixed, heads = _costs(tile_work(plan), plan.local_len, hw, shape, backward)
    return fixed + heads / split


def _costs(work: np.ndarray, L: int, hw: Hardware, shape: Shape,
           backward: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(fixed, per_heads)`` seconds per tile ``[P, P]``: the kernel calls, which a head
    slice pays in full, and the pairs and rows, of which a slice of 1/k of the heads pays 1/k."""
    D = shape.head_dim if shape.v_head_dim is None else (shape.head_dim + shape.v_head_dim) / 2
    BH_D = shape.batch * shape.heads * D        # MLA: q·k at D, p·v at Dv, so their mean
    if backward:
        unit, call = BWD_FLOPS_PER_PAIR * BH_D / hw.bwd_flops, hw.bwd_call_s
    else:
        unit, call = FWD_FLOPS_PER_PAIR * BH_D / hw.fwd_flops, hw.call_s
    calls, full, masked, causal = (work[..., i] for i in range(4))
    mf = hw.bwd_masked if backward and hw.bwd_masked is not None else hw.masked
    cf = hw.bwd_causal if backward and hw.bwd_causal is not None else hw.causal
    some = calls > 0
    fixed = np.where(some, calls * call, 0.0)
    heads = np.where(some, unit * (full + mf * masked + cf * causal)
                     + hw.row_s * L * BH_D, 0.0)
    return fixed, heads




#: Bytes per block-row run of the PARTIAL tiles' rectangles at the peak of :func:`tile_work`
#: (the sparse planner's run columns, groups and pieces; measured 14-350 B/run with
#: tracemalloc on ring, zigzag and striped plans of causal, window and document masks, S = 32K
#: to 1M, P = 8 and 256; the most on striped documents, a single block per rectangle).
TILE_WORK_BYTES_PER_RUN = 384
#: Bytes per tile (P^2) of the tile arrays: kinds, signatures, distinct-map ids, the work.
TILE_WORK_BYTES_PER_TILE = 64
#: Bytes per block of a PARTIAL tile painted when rectangles cross tiles (plans never do) or
#: tiles are too large to group by signature (n >= 16,383 blocks): the int8 maps, their int64
#: packing into words and their row runs (an upper bound: tiles are painted a band at a time).
_PAINT_BYTES_PER_BLOCK = 12
#: Bytes per rectangle of the block map that the estimate's own pass may hold at once.
_SIG_CHUNK = 1 << 18


def distinct_partial_maps(plan) -> int:
    """How many distinct PARTIAL tile block maps :func:`tile_work` will plan (an estimate).

    Read from the sparse block map's rectangles (a tile's signature: its rectangle count and
    two order-free sums of hashed rectangles, as ``tile_work`` groups them), a chunk of
    rectangles at a time, so it allocates O(P^2 + chunk), never a map. A hash collision can
    only merge two tiles (an estimate one low); without rectangles, or with rectangles across
    tiles, every PARTIAL tile counts (an upper bound).
    """
    P, n = plan.world_size, plan.local_len // plan.block_size
    tiles = torch.as_tensor(plan.tiles).to(torch.int64).numpy().reshape(-1)
    part = np.flatnonzero(tiles == _PARTIAL)
    bm = plan.block_map
    if not len(part) or not len(bm.rects):
        return len(part)
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes)
    lo, hi, cnt = np.zeros(P * P), np.zeros(P * P), np.zeros(P * P)
    for a in range(0, len(R), _SIG_CHUNK):
        Rc = R[a:a + _SIG_CHUNK].astype(np.int64)
        ti, lr = np.divmod(Rc[:, 0], n)
        tj, lc = np.divmod(Rc[:, 2], n)
        if ((Rc[:, 1] - 1) // n != ti).any() or ((Rc[:, 3] - 1) // n != tj).any():
            return len(part)                           # across tiles: tile_work paints densely
        key = ti * P + tj
        h = _mix64(((lr * (n + 1) + Rc[:, 1] - Rc[:, 0]) * (n + 1) + lc) * (n + 1)
                   + Rc[:, 3] - Rc[:, 2])
        h = _mix64(h ^ C[a:a + _SIG_CHUNK].astype(np.uint64))
        lo += np.bincount(key, weights=(h & np.uint64(0xFFFFFF)).astype(np.float64),
                          minlength=P * P)
        hi += np.bincount(key, weights=(h >> np.uint64(40)).astype(np.float64), minlength=P * P)
        cnt += np.bincount(key, minlength=P * P)
    sig = np.stack([lo[part], hi[part], cnt[part]], axis=1)
    return len(np.unique(sig, axis=0))


def tile_work_bytes(plan) -> tuple[int, str]:
    """``(bytes, how)``: the estimated peak allocation of :func:`tile_work` on ``plan`` (an
    upper bound: linear in the block-row runs of its PARTIAL tiles' rectangles, plus the
    ``P^2`` tile arrays), and how it was reckoned. One pass over the rectangles, a chunk at a
    time; nothing of the estimate's size is allocated."""
    P, n = plan.world_size, plan.local_len // plan.block_size
    tiles = torch.as_tensor(plan.tiles).to(torch.int64).numpy().reshape(-1)
    bm = plan.block_map
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    runs, across = 0, False
    for a in range(0, len(R), _SIG_CHUNK):
        Rc = R[a:a + _SIG_CHUNK].astype(np.int64)
        ti, tj = Rc[:, 0] // n, Rc[:, 2] // n
        across |= bool(((Rc[:, 1] - 1) // n != ti).any() or ((Rc[:, 3] - 1) // n != tj).any())
        part = tiles[np.minimum(ti, P - 1) * P + np.minimum(tj, P - 1)] == _PARTIAL
        runs += int((Rc[part, 1] - Rc[part, 0]).sum())
    need = TILE_WORK_BYTES_PER_RUN * runs + TILE_WORK_BYTES_PER_TILE * P * P
    how = (f"{TILE_WORK_BYTES_PER_RUN} bytes x {runs:,} block-row runs of the partial tiles + "
           f"{TILE_WORK_BYTES_PER_TILE} bytes x {P * P:,} tiles")
    if across or not _signed(n):                     # painted by tile (the dense fallback)
        k = int((tiles == _PARTIAL).sum())
        need += _PAINT_BYTES_PER_BLOCK * k * n * n
        how += f" + {_PAINT_BYTES_PER_BLOCK} bytes x {k:,} painted tiles x {n:,}^2 blocks"
    return need, how
