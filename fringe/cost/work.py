"""The tile work model: per tile, the kernel calls and the (q, kv) pairs by kind, and their cost.

Per tile, the block map is split into dense sub-problems by the one call planner,
:mod:`fringe.ops.calls` (``fused=True``, the block pattern deciding): what
:func:`fringe.ops.tile.tile_forward` runs for the fused ``sdpa`` kernel. Each sub-problem
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

import numpy as np
import torch

from ..masks import BlockKind
from ..ops.calls import fused_pieces
from .hardware import BWD_FLOPS_PER_PAIR, FWD_FLOPS_PER_PAIR, Hardware, Shape, get_hardware

__all__ = ["TILE_WORK_BYTES_PER_BLOCK", "dense_tile_work", "distinct_partial_maps", "tile_costs",
           "tile_work", "tile_work_bytes"]

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)
_CHUNK = 1 << 15          # tiles whose block maps are packed at once in tile_work
_BAND_BLOCKS = 1 << 24    # blocks of the block map made dense at once in tile_work
_RECT_CHUNK = 1 << 16     # rectangles hashed at once in _distinct_maps_from_rects (in cache)


def _maps_work(maps: torch.Tensor, *, L: int, block_size: int, masked_ok: bool) -> np.ndarray:
    """``[N, 4]`` (calls, full pairs, masked pairs, causal pairs) of N block maps ``[N, n, n]``.

    The sub-problems are the ``sdpa`` kernel's, from the one planner
    (:func:`fringe.ops.calls.fused_pieces`, which :func:`fringe.ops.tile._plan` runs on one
    tile): square causal-aligned diagonal runs as one ``is_causal`` call each, the rest
    grouped by rows and cut where columns switch between all-FULL (no mask) and mixed,
    whichever makes no more calls than the plain grouping, map by map (the block pattern
    decides: the cost model sees block maps only). The maps are stacked into
    one column with an all-EMPTY row between them (an empty q-block row always ends a
    group), so one pass groups them all exactly as one by one; a piece is FULL when every
    block it covers is FULL (no mask).
    """
    N, n, _ = maps.shape
    if N == 0:
        return np.zeros((0, 4))
    m = torch.as_tensor(maps).to(torch.int8).numpy()
    tall = np.full((N, n + 1, n), _EMPTY, dtype=np.int8)
    tall[:, :n] = m
    tall = tall.reshape(N * (n + 1), n)
    bs = block_size
    q0, q1, k0, k1, causal, src, work = fused_pieces(
        tall, per=n + 1, Lq=tall.shape[0] * bs, Lk=L, block_size=bs, runs_ok=masked_ok)
    out = np.zeros((N, 4))
    if not len(q0):
        return out
    rows = np.minimum(q1 * bs, tall.shape[0] * bs) - q0 * bs
    pairs = (rows * (np.minimum(k1 * bs, L) - k0 * bs)).astype(np.float64)
    nonfull = np.zeros(len(q0), dtype=np.int64)
    for s, codes in ((0, tall), (1, work)):            # blocks that are not FULL in each piece
        sel = src == s
        if sel.any():
            bad = np.zeros((codes.shape[0] + 1, n + 1), dtype=np.int64)
            bad[1:, 1:] = (codes != _FULL).cumsum(0).cumsum(1)
            a, b, c, d = q0[sel], q1[sel], k0[sel], k1[sel]
            nonfull[sel] = bad[b, d] - bad[a, d] - bad[b, c] + bad[a, c]
    is_full = (nonfull == 0) | (not masked_ok)
    which = q0 // (n + 1)
    out[:, 0] = np.bincount(which, minlength=N)
    out[:, 1] = np.bincount(which, weights=np.where(~causal & is_full, pairs, 0.0), minlength=N)
    out[:, 2] = np.bincount(which, weights=np.where(~causal & ~is_full, pairs, 0.0), minlength=N)
    out[:, 3] = np.bincount(which, weights=np.where(causal, pairs, 0.0), minlength=N)
    return out


def tile_work(plan) -> np.ndarray:
    """Per tile: ``[P, P, 4]`` (calls, full, masked, causal pairs); zero for EMPTY tiles.

    Tiles with the same block map share one evaluation, so this costs the number of
    *distinct* maps, all grouped in one call of the tile grouping. A plan's maps are read
    from the rectangles of its sparse ``block_map`` (only the PARTIAL tiles are painted,
    one distinct map once), or painted from its dense rows when rectangles cross tiles.
    """
    P, n = plan.world_size, plan.local_len // plan.block_size
    bm = plan.block_map

    def distinct(part, tiles_flat):
        found = _distinct_maps_from_rects(bm, tiles_flat, part, P, n)
        if found is None:
            found = _distinct_maps_dense(lambda r0, r1: bm.dense(rows=(r0, r1), limit=None),
                                         part, P, n)
        return found
    return _tile_work(plan.tiles, distinct, P=P, L=plan.local_len, block_size=plan.block_size,
                      masked_ok=plan.mask_mod is not None)


def dense_tile_work(tiles: torch.Tensor, blocks: torch.Tensor, *, block_size: int,
                    masked_ok: bool = True) -> np.ndarray:
    """:func:`tile_work` of a dense block map ``blocks`` int8 ``[P * n, P * n]`` (rank-major)
    with tile kinds ``tiles`` ``[P, P]`` (the balanced layout's solver, before any plan)."""
    P = tiles.shape[0]
    n = blocks.shape[0] // P

    def distinct(part, tiles_flat):
        return _distinct_maps_dense(lambda r0, r1: blocks[r0:r1], part, P, n)
    return _tile_work(tiles, distinct, P=P, L=n * block_size, block_size=block_size,
                      masked_ok=masked_ok)


def _tile_work(tiles, distinct, *, P: int, L: int, block_size: int,
               masked_ok: bool) -> np.ndarray:
    """:func:`tile_work` with ``distinct(part, tiles_flat) -> (maps, inv)``: the distinct maps
    of the PARTIAL tiles ``part`` (keys ``i * P + j``) and which one each tile has."""
    bs = block_size
    n = L // bs
    tiles = torch.as_tensor(tiles).to(torch.int64).numpy().reshape(P, P)
    work = np.zeros((P, P, 4), dtype=np.float64)
    full_tiles = tiles == _FULL
    if full_tiles.any():
        work[full_tiles] = _maps_work(torch.full((1, n, n), _FULL, dtype=torch.int8), L=L,
                                      block_size=bs, masked_ok=masked_ok)[0]
    part = np.flatnonzero(tiles.reshape(-1) == _PARTIAL)      # tile keys i * P + j, sorted
    if len(part):
        maps, inv = distinct(part, tiles.reshape(-1))
        per_map = _maps_work(maps, L=L, block_size=bs, masked_ok=masked_ok)
        work.reshape(P * P, 4)[part] = per_map[inv]
    return work


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
    if not len(R) or n + 1 > 1 << 14:
        return None
    m = n + 1
    # int32 where the packed signature fits (n <= 126: 4 coordinates < m and a 2-bit code)
    it = np.int32 if m ** 4 * 4 < 1 << 31 and max(R.shape[0], P * P) < 1 << 31 else np.int64
    N = len(R)
    key = np.empty(N, dtype=it)                       # tile i * P + j of every rectangle
    enc = np.empty(N, dtype=it)                       # (row, height, col, width, code) packed
    # a tile's signature: the sums of two 24-bit hashes of its rectangles (float64 sums of
    # integers below 2**53 are exact and order-free) and its count, by bincount
    lo = np.zeros(P * P)
    hi = np.zeros(P * P)
    cnt = np.zeros(P * P, dtype=np.int64)
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
        k0, k1 = int(k.min()), int(k.max()) + 1       # the chunk's tiles (rows: a few)
        kk = k - it(k0)
        with np.errstate(over="ignore"):
            for acc, mul in ((lo, 0x9E3779B1), (hi, 0x85EBCA77)):
                x = e.astype(np.uint32)
                x *= np.uint32(mul)
                x ^= x >> np.uint32(15)
                x *= np.uint32(0xC2B2AE3D)
                x ^= x >> np.uint32(13)
                x &= mask24
                acc[k0:k1] += np.bincount(kk, weights=x, minlength=k1 - k0)
        cnt[k0:k1] += np.bincount(kk, minlength=k1 - k0)
    del r0, r1, c0, c1, ti, tj, lr, lc
    with np.errstate(over="ignore"):
        sig = _mix64(lo[part].astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
                     + hi[part].astype(np.uint64) * np.uint64(0x94D049BB133111EB)
                     + cnt[part].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    _, first, inv = np.unique(sig.view(np.int64), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    U = len(first)
    rep_tile = part[first]                            # each group's representative tile
    uid = np.full(P * P + 1, U, dtype=it)             # U: not a PARTIAL tile (not checked)
    uid[part] = inv
    is_rep = np.zeros(P * P, dtype=bool)
    is_rep[rep_tile] = True
    E = m ** 4 * 4
    ok = bool((cnt[part] == cnt[rep_tile][inv]).all())
    # the representatives' rectangles, and then every rectangle checked against them, a chunk
    # at a time (gathers from small tables, temporaries in cache)
    keep = np.concatenate([a + np.flatnonzero(is_rep[key[a:a + _RECT_CHUNK]])
                           for a in range(0, N, _RECT_CHUNK)])
    if ok:
        ref_u, ref_e = uid[key[keep]].astype(np.int64), enc[keep].astype(np.int64)
        if (U + 1) * E <= 1 << 26:                    # membership by a table
            table = np.zeros((U + 1) * E, dtype=bool)
            table[ref_u * E + ref_e] = True
            table[U * E:] = True
            for a in range(0, N, _RECT_CHUNK):
                look = uid[key[a:a + _RECT_CHUNK]]
                look *= it(E)
                look += enc[a:a + _RECT_CHUNK]
                if not table[look].all():
                    ok = False
                    break
        else:                                         # membership by a search
            u = uid[key]
            ref = np.unique(ref_u * E + ref_e)
            cand = u.astype(np.int64) * E + enc
            chk = cand[u < U]
            at = np.minimum(np.searchsorted(ref, chk), len(ref) - 1)
            ok = bool((ref[at] == chk).all())
    if not ok:                                        # a hash collision: sort and compare
        return _distinct_maps_sorted(bm, tiles_flat, part, P, n)
    cc = C[keep].astype(np.int8)
    rr = R[keep].astype(np.int64)
    kt = key[keep].astype(np.int64)
    ti_, tj_ = kt // P, kt % P
    lr0, lr1 = rr[:, 0] - ti_ * n, rr[:, 1] - ti_ * n
    lc0, lc1 = rr[:, 2] - tj_ * n, rr[:, 3] - tj_ * n
    diff = np.zeros(U * m * m, dtype=np.int8)
    base = uid[kt].astype(np.int64) * (m * m)
    for rows, cols, sign in ((lr0, lc0, cc), (lr0, lc1, -cc), (lr1, lc0, -cc), (lr1, lc1, cc)):
        np.add.at(diff, base + rows * m + cols, sign)
    maps = diff.reshape(U, m, m).cumsum(1, dtype=np.int8).cumsum(2, dtype=np.int8)[:, :n, :n]
    return torch.from_numpy(np.ascontiguousarray(maps)), inv


def _distinct_maps_sorted(bm, tiles_flat: np.ndarray, part: np.ndarray, P: int, n: int):
    """As :func:`_distinct_maps_from_rects` (its fallback on a hash collision), exactly: the
    rectangles sorted by tile, tiles grouped by (count, hash of the ordered signature), every
    group checked element by element against its first tile, and grouped by content if not.
    Returns None when a rectangle crosses a tile boundary (the caller paints densely).
    """
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = (bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes))
    R = R.astype(np.int64, copy=False)
    if not len(R) or n + 1 > 1 << 14:
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
    r0, r1 = rr[:, 0] - ti[keep] * n, rr[:, 1] - ti[keep] * n
    c0, c1 = rr[:, 2] - tj[keep] * n, rr[:, 3] - tj[keep] * n
    diff = np.zeros(U * m * m, dtype=np.int8)
    base = u * (m * m)
    for rows, cols, sign in ((r0, c0, cc), (r0, c1, -cc), (r1, c0, -cc), (r1, c1, cc)):
        np.add.at(diff, base + rows * m + cols, sign)
    maps = diff.reshape(U, m, m).cumsum(1, dtype=np.int8).cumsum(2, dtype=np.int8)[:, :n, :n]
    return torch.from_numpy(np.ascontiguousarray(maps)), inv


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
    return maps.to(torch.int8), inv.reshape(-1)


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




TILE_WORK_BYTES_PER_BLOCK = 28
#: Bytes per rectangle of the block map that the estimate's own pass may hold at once.
_SIG_CHUNK = 1 << 18


def distinct_partial_maps(plan) -> int:
    """How many distinct PARTIAL tile block maps :func:`tile_work` will paint (an estimate).

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
    """``(bytes, how)``: the estimated peak allocation of :func:`tile_work` on ``plan`` (the
    dominant allocation of :func:`simulate`, quadratic in S/block), and how it was reckoned."""
    n = plan.local_len // plan.block_size
    u = distinct_partial_maps(plan)
    need = TILE_WORK_BYTES_PER_BLOCK * u * (n + 1) * n
    return need, (f"{TILE_WORK_BYTES_PER_BLOCK} bytes x {u:,} distinct partial tile maps x "
                  f"{n + 1:,} x {n:,} blocks")
