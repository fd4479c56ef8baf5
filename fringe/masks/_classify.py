"""Exact block classification (:func:`classify`): a quadtree over (q-block range, kv-block
range) cells decided from the rules' summaries, the rest resolved by dense evaluation in
bounded-memory chunks."""
from __future__ import annotations

import time
import warnings

import torch

from ._bh import reads_bh
from ._blockmap import BlockMap, _merge_rows
from ._eval import _eval_pairs, _method
from ._kinds import _EMPTY, _FULL, _PARTIAL, _UNKNOWN, DEFAULT_BLOCK_SIZE, MaskMod
from ._mask import Mask, as_mask
from ._rules import _and_codes, _Band, _Blocks, _CellCodes, _Document, _or_codes, _Tree

# Memory bounds (elements) for the temporaries of classify.
_CELL_CHUNK = 1 << 18  # quadtree cells evaluated per batch (a few int64 temporaries each)
_DENSE_CHUNK_ELEMS = 1 << 16  # token pairs per dense resolution chunk: [n, B, H, bs, bs]

#: :func:`classify` warns (once per mask name) when it is about to evaluate more token pairs
#: than this densely: masks without structure to exploit cost O(S^2).
WARN_DENSE_PAIRS = 10 ** 9



def _prepare(m: Mask, qt: _Tree, kt: _Tree) -> _CellCodes:
    if m.op == "leaf":
        if m.rule is None:
            return lambda level, i, j: torch.full(i.shape, _UNKNOWN, dtype=torch.int8,
                                                  device=i.device)
        return m.rule.prepare(qt, kt)
    kids = [_prepare(c, qt, kt) for c in m.children]
    comb = _and_codes if m.op == "and" else _or_codes
    # An AND of reflexive masks holds on every pair (p, p): a block pair that shares a
    # position is not EMPTY, so an UNKNOWN with a certainly-PARTIAL operand is PARTIAL (the
    # diagonal blocks of causal & document that hold a document boundary, which would
    # otherwise be evaluated densely).
    diagonal = m.op == "and" and _reflexive(m)

    def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        out = kids[0](level, i, j)
        partial = out == _PARTIAL if diagonal and not level else None
        for k in kids[1:]:
            c = k(level, i, j)
            out = comb(out, c)
            if partial is not None:
                partial |= c == _PARTIAL
        if partial is not None:
            fix = (out == _UNKNOWN) & partial
            if bool(fix.any()):
                fix &= _share_position(qt.leaf, kt.leaf, i, j)
                out = torch.where(fix, torch.tensor(_PARTIAL, dtype=torch.int8), out)
        return out

    return cells


def _reflexive(m: Mask) -> bool:
    """Whether the mask's rules make ``m(b, h, p, p)`` true for every position ``p``
    (bands that contain offset 0, documents, and their ``&`` / ``|``); False when unsure."""
    if m.op == "leaf":
        r = m.rule
        if isinstance(r, _Band):
            return (r.lo is None or r.lo <= 0) and (r.hi is None or r.hi >= 0)
        return isinstance(r, _Document)
    kids = [_reflexive(c) for c in m.children]
    return all(kids) if m.op == "and" else any(kids)


def _share_position(qb: _Blocks, kb: _Blocks, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
    """bool per block pair ``(i, j)``: the two blocks certainly hold a common position. Decided
    when both are arithmetic progressions with one stride ``s`` (contiguous runs, striped
    layouts) whose starts differ by a multiple of ``s``: they then share a position exactly
    when their ranges overlap. Other pairs: False (not known)."""
    s = qb.stride[i]
    same = (s > 0) & (s == kb.stride[j])
    qlo, klo = qb.lo[i], kb.lo[j]
    aligned = torch.remainder(qlo - klo, torch.where(same, s, torch.ones_like(s))) == 0
    return same & aligned & (qlo <= kb.hi[j]) & (klo <= qb.hi[i])


def _has_rule(m: Mask) -> bool:
    if m.op == "leaf":
        return m.rule is not None
    return any(_has_rule(c) for c in m.children)


def _dense_codes(mask: Mask, method: str, qpos: torch.Tensor, kpos: torch.Tensor,
                 nb: int, nh: int) -> torch.Tensor:
    """Exact codes for block pairs given as gathered positions ``[n, bs]`` each."""
    n = qpos.shape[0]
    flat = _eval_pairs(mask, method, qpos, kpos, nb, nh).reshape(n, -1)
    allv, anyv = flat.all(dim=1), flat.any(dim=1)
    return torch.where(allv, _FULL, torch.where(anyv, _PARTIAL, _EMPTY)).to(torch.int8)


def classify(mask_mod: MaskMod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             block_size: int = DEFAULT_BLOCK_SIZE, B: int | None = None, H: int | None = None,
             stats: dict | None = None, sparse: bool = False) -> torch.Tensor | BlockMap:
    """Exact block map of ``mask_mod`` over arbitrary global index sets.

    Block ``i`` of q is ``q_pos[i*bs:(i+1)*bs]`` (likewise kv); positions may be in any
    order (layouts permute tokens). The result equals the block-wise reduction of
    ``evaluate(mask_mod, q_pos, kv_pos)``: all-true -> FULL, all-false -> EMPTY, else
    PARTIAL.

    How: a quadtree over (q-block range, kv-block range) cells. A cell is decided from the
    min / max summaries of its blocks (every rule's FULL / EMPTY is exact from them); a
    FULL cell is kept as one rectangle, an EMPTY one dropped, anything else split in four.
    At single blocks the rules' exact leaf tests apply (and an ``&`` of masks that hold on
    every pair (p, p) is PARTIAL on blocks sharing a position when an operand is certainly
    PARTIAL), and the pairs they cannot decide (and every pair of an arbitrary callable) are
    evaluated, in chunks of bounded memory.
    For structured masks (causal, window, document, prefix and their ``&`` / ``|``) in
    sequence order only cells along the diagonal and document boundaries are split, so the
    work grows like ``(S/bs) log(S/bs)`` plus the PARTIAL blocks, not ``(S/bs)^2``; scattered
    layouts split more (a cell of zigzag's two far-apart chunks decides nothing), which is
    why :func:`fringe.plan` classifies block-aligned layouts in sequence order and permutes.

    Masks without structure (plain callables) cost O(Lq * Lk) mask evaluations. Measured
    (torch 2.13 CPU, 1 thread, block 128, CPU time): ``(q >= kv) & ((q - kv) % 7 != 0)``
    broadcast takes ~17 ns a token pair (S = 16k: 2.7e8 pairs, 4.3 s; 1e9 pairs ~ 17 s;
    S = 1M ~ 5 hours), and a mod evaluated per scalar index (vmap) ~50 ns a pair. A
    warning (once per mask name) gives the count above :data:`WARN_DENSE_PAIRS` pairs;
    build the mask from the factories (:func:`causal`, :func:`sliding_window`,
    :func:`document`, :func:`prefix_lm`, ``&``, ``|``) to avoid the cost.

    Args:
        mask_mod: a :class:`Mask` or a plain mask_mod (wrapped with :func:`as_mask`).
        q_pos, kv_pos: 1-D int tensors of global positions, lengths divisible by block_size.
        block_size: tokens per block side.
        B, H: for masks that read ``b`` / ``h`` (``bh_invariant=False``): the block kind is
            the union over ``b < B``, ``h < H`` (FULL only if full for all, EMPTY only if
            empty for all). Ignored for invariant masks.
        stats: optional dict, filled with ``block_pairs``, ``cells`` (quadtree cells
            decided from summaries), ``rects`` (rectangles kept), ``dense_blocks`` (block
            pairs evaluated densely), ``dense_pairs`` (token pairs evaluated, times B*H) and
            ``seconds``.
        sparse: return a :class:`BlockMap` (rectangles) instead of the dense map.

    Returns:
        int8 tensor ``[Lq / block_size, Lk / block_size]`` of :class:`BlockKind` codes, or
        with ``sparse`` the same as a :class:`BlockMap`.

    Raises:
        ValueError: a length is not divisible by ``block_size``, or bad positions.
        MaskError: the mask_mod cannot be evaluated (see :func:`evaluate`).
    """
    t0 = time.perf_counter()
    mask = as_mask(mask_mod)
    bs = int(block_size)
    if bs < 1:
        raise ValueError(f"classify: block_size={bs} must be >= 1")
    for nm, p in (("q_pos", q_pos), ("kv_pos", kv_pos)):
        if not isinstance(p, torch.Tensor) or p.dim() != 1 or p.dtype.is_floating_point \
                or p.dtype == torch.bool:
            raise ValueError(f"classify: {nm} must be a 1-D integer tensor of global positions, "
                             f"got {getattr(p, 'dtype', type(p).__name__)} "
                             f"shape={tuple(getattr(p, 'shape', ()))}")
        if p.numel() % bs:
            pad = -(-p.numel() // bs) * bs
            raise ValueError(f"classify: len({nm})={p.numel()} is not divisible by "
                             f"block_size={bs}; pad the sequence to {pad} or pick a block_size "
                             f"that divides {p.numel()}")
    q_pos = q_pos.cpu()
    kv_pos = kv_pos.cpu()
    nqb, nkb = q_pos.numel() // bs, kv_pos.numel() // bs
    # classified once where it is declared or proven not to read b / h (reads_bh), else
    # for each b < B, h < H
    invariant = reads_bh(mask_mod, q_pos=q_pos, kv_pos=kv_pos).invariant
    nb, nh = (1, 1) if invariant else (B or 1, H or 1)
    if nb * nh > 1 and nqb and nkb and not _has_rule(mask):    # every pair is evaluated
        _check_bh_budget(mask, nqb * nkb * bs * bs, nb, nh)
    info = dict(cells=0, dense_blocks=0)
    parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    if nqb and nkb:
        levels = max(nqb - 1, nkb - 1, 0).bit_length()
        qt = _Tree(q_pos, bs, levels)
        same = kv_pos is q_pos or (kv_pos.shape == q_pos.shape and torch.equal(kv_pos, q_pos))
        kt = qt if same else _Tree(kv_pos, bs, levels)     # one summary of a square map's side
        resolve = _Resolver(mask, qt.leaf, kt.leaf, nb, nh, info)
        if _has_rule(mask):
            _quadtree(_prepare(mask, qt, kt), qt, kt, levels, resolve, parts, info)
        else:  # nothing to decide from summaries: every block pair, row chunk by row chunk
            resolve.warn(nqb * nkb)
            step = max(1, _CELL_CHUNK // nkb)
            for r0 in range(0, nqb, step):
                r1 = min(nqb, r0 + step)
                i = torch.arange(r0, r1).repeat_interleave(nkb)
                j = torch.arange(nkb).repeat(r1 - r0)
                c = resolve(i, j)
                keep = c != _EMPTY
                parts.append(_merge_rows(i[keep], j[keep], c[keep]))
    rects = torch.cat([p[0] for p in parts]) if parts else torch.zeros((0, 4), dtype=torch.int64)
    codes = torch.cat([p[1] for p in parts]) if parts else torch.zeros(0, dtype=torch.int8)
    bm = BlockMap.of((nqb, nkb), rects, codes)
    if stats is not None:
        stats.update(block_pairs=nqb * nkb, cells=info["cells"], rects=len(bm),
                     dense_blocks=info["dense_blocks"],
                     dense_pairs=info["dense_blocks"] * bs * bs * nb * nh,
                     seconds=time.perf_counter() - t0)
    return bm if sparse else bm.dense(limit=None)


#: The most token-pair evaluations (counted once per ``b`` and ``h``) :func:`classify` spends on
#: classifying a mask for every ``b < B``, ``h < H`` (2e10: minutes through vmap at ~50 ns a
#: pair); above it, it raises instead of proving over that many values.
BH_BUDGET_PAIRS = 2 * 10 ** 10


def _check_bh_budget(mask: Mask, pairs: int, nb: int, nh: int) -> None:
    """Raise before classifying ``mask`` for ``nb * nh`` values of (b, h) on up to ``pairs``
    token pairs each, when that exceeds :data:`BH_BUDGET_PAIRS`."""
    total = pairs * nb * nh
    if total > BH_BUDGET_PAIRS:
        raise ValueError(
            f"classify: mask {mask.name} is not proven to ignore b and h, so it is classified "
            f"for every b < {nb} and h < {nh}: up to {total:.3g} token-pair evaluations "
            f"({pairs:.3g} pairs x {nb * nh} (b, h)), over the planning budget "
            f"fringe.masks.BH_BUDGET_PAIRS={BH_BUDGET_PAIRS:.3g}; whether it reads b or h "
            f"cannot be proven within it. Declare masks.as_mask(fn, bh_invariant=True) if it "
            f"ignores b and h, write it elementwise (no .any() / .all() / .item() over the "
            f"indices) so fringe reads that from its output's shape, plan with fewer heads / "
            f"rows, or build it from the factories (causal, sliding_window, document, ...)")


class _Resolver:
    """Exact codes of block pairs the summaries left UNKNOWN, by evaluating the mask."""

    def __init__(self, mask: Mask, qb: _Blocks, kb: _Blocks, nb: int, nh: int, info: dict):
        self.mask, self.qb, self.kb, self.nb, self.nh, self.info = mask, qb, kb, nb, nh, info
        self.method = None
        self.per = max(1, _DENSE_CHUNK_ELEMS // (nb * nh * qb.block_size ** 2))

    def warn(self, n_blocks: int) -> None:
        pairs = n_blocks * self.qb.block_size ** 2 * self.nb * self.nh
        if pairs > WARN_DENSE_PAIRS and self.mask.name not in _WARNED_DENSE:
            _WARNED_DENSE.add(self.mask.name)
            warnings.warn(
                f"classify: mask {self.mask.name} is evaluated densely on {pairs:.3g} token "
                f"pairs (O(S^2) for a mask without structure: measured ~17 ns a pair on one CPU "
                f"thread, ~50 ns through vmap); build it from fringe.masks.causal / sliding_window / "
                f"document / prefix_lm combined with & and |, which classify from their "
                f"parameters", stacklevel=4)

    def __call__(self, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
        out = torch.empty(i.numel(), dtype=torch.int8)
        if self.nb * self.nh > 1:       # the pairs evaluated so far and these, per (b, h)
            _check_bh_budget(self.mask, (self.info["dense_blocks"] + i.numel()) *
                             self.qb.block_size ** 2, self.nb, self.nh)
        for c0 in range(0, i.numel(), self.per):
            ii, jj = i[c0:c0 + self.per], j[c0:c0 + self.per]
            if self.method is None:  # decided once, on the first pairs that need it
                self.method = _method(self.mask, self.qb.pos.view(-1), self.kb.pos.view(-1),
                                      self.nb, self.nh)
            out[c0:c0 + self.per] = _dense_codes(self.mask, self.method, self.qb.pos[ii],
                                                 self.kb.pos[jj], self.nb, self.nh)
        self.info["dense_blocks"] += i.numel()
        return out


_WARNED_DENSE: set[str] = set()
_CHILD_I = torch.tensor([0, 0, 1, 1])
_CHILD_J = torch.tensor([0, 1, 0, 1])


def _quadtree(cells: _CellCodes, qt: _Tree, kt: _Tree, top: int, resolve: _Resolver,
              parts: list, info: dict) -> None:
    """Decide cells level by level from the top; FULL cells become rectangles in ``parts``,
    undecided ones are split, and UNKNOWN single blocks are resolved densely."""
    nq, nk = qt.count(0), kt.count(0)
    i = j = torch.zeros(1, dtype=torch.int64)
    for level in range(top, -1, -1):
        if not i.numel():
            return
        c = torch.cat([cells(level, i[a:a + _CELL_CHUNK], j[a:a + _CELL_CHUNK])
                       for a in range(0, i.numel(), _CELL_CHUNK)])
        info["cells"] += i.numel()
        if level:
            full = c == _FULL
            if bool(full.any()):
                fi, fj = i[full], j[full]
                rects = torch.stack([fi << level, ((fi + 1) << level).clamp(max=nq),
                                     fj << level, ((fj + 1) << level).clamp(max=nk)], dim=1)
                parts.append((rects, c[full]))
            split = (c != _EMPTY) & ~full
            i = (2 * i[split, None] + _CHILD_I).flatten()
            j = (2 * j[split, None] + _CHILD_J).flatten()
            ok = (i < qt.count(level - 1)) & (j < kt.count(level - 1))
            i, j = i[ok], j[ok]
        else:
            unknown = c == _UNKNOWN
            n_unknown = int(unknown.sum())
            if n_unknown:
                resolve.warn(n_unknown)
                c[unknown] = resolve(i[unknown], j[unknown])
            keep = c != _EMPTY
            parts.append(_merge_rows(i[keep], j[keep], c[keep]))
