"""Tile forward / backward and the lse merge: pure functions, no communication.

A *tile* is this rank's q rows ``[B, H, Lq, D]`` against one kv chunk ``[B, G, Lk, D]``, with
the GLOBAL positions of both (``q_pos [Lq]``, ``kv_pos [Lk]``) so that ``mask_mod`` and
``score_mod`` see global token indices whatever the layout.

- ``kind``: FULL skips mask evaluation, PARTIAL applies ``mask_mod``, EMPTY is never run.
- ``blocks`` (int8 ``[ceil(Lq/block_size), ceil(Lk/block_size)]`` of ``BlockKind`` codes for this
  tile): work follows the mask at block granularity. EMPTY blocks are never computed; each
  q-block row runs against the contiguous range of its non-empty kv blocks, consecutive rows
  with equal or similar ranges are grouped (few Python iterations), and ``mask_mod`` is only
  evaluated over the bounding box of blocks that are themselves PARTIAL. Cost grows with the
  non-empty blocks, not with ``Lq * Lk``; the result equals the unblocked path.
- ``tile_backward`` takes the GLOBAL merged out/lse (flash-attention style), so partial
  gradients over several kv tiles sum to the exact gradient.

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fringe.masks import BlockKind

from .reference import (MaskMod, ScoreMod, check_qkv, compute_dtype, default_scale, mask_for)

__all__ = ["check_qkv", "merge", "tile_backward", "tile_forward", "GROUP_SLACK"]

#: A q-block row joins the current group while the group's rectangle costs at most this factor
#: times the exact (per-row range) cost: fewer, larger sub-problems for a little masked waste.
GROUP_SLACK = 1.25


@dataclass(frozen=True)
class _Group:
    """One dense sub-problem: q rows ``[q0, q1)`` x kv rows ``[k0, k1)`` (element indices)."""

    q0: int
    q1: int
    k0: int
    k1: int
    codes: torch.Tensor  # BlockKind codes of the blocks covered, [q-blocks, kv-blocks]


def _plan(blocks: torch.Tensor, *, Lq: int, Lk: int, block_size: int) -> list[_Group]:
    """Group consecutive q-block rows into dense sub-problems over non-empty kv block ranges."""
    nq, nk = blocks.shape
    ne = blocks != int(BlockKind.EMPTY)
    live = ne.any(dim=1).tolist()
    lo = ne.to(torch.int8).argmax(dim=1).tolist()
    hi = (nk - ne.flip(1).to(torch.int8).argmax(dim=1)).tolist()
    groups: list[tuple[int, int, int, int]] = []  # (qb0, qb1, kb0, kb1) in blocks
    cur = None
    exact = 0
    for i in range(nq):
        if not live[i]:
            if cur is not None:
                groups.append(cur)
            cur = None
            continue
        w = hi[i] - lo[i]
        if cur is not None:
            qb0, _, kb0, kb1 = cur
            nlo, nhi = min(kb0, lo[i]), max(kb1, hi[i])
            if (i + 1 - qb0) * (nhi - nlo) <= GROUP_SLACK * (exact + w):
                cur, exact = (qb0, i + 1, nlo, nhi), exact + w
                continue
            groups.append(cur)
        cur, exact = (i, i + 1, lo[i], hi[i]), w
    if cur is not None:
        groups.append(cur)
    bs = block_size
    return [_Group(qb0 * bs, min(qb1 * bs, Lq), kb0 * bs, min(kb1 * bs, Lk),
                   blocks[qb0:qb1, kb0:kb1])
            for qb0, qb1, kb0, kb1 in groups]


def _group_mask(g: _Group, mask_mod: MaskMod | None, q_pos: torch.Tensor, kv_pos: torch.Tensor,
                *, B: int, H: int, block_size: int) -> torch.Tensor | None:
    """Element mask of one group: True in FULL blocks, False in EMPTY, ``mask_mod`` in PARTIAL.

    ``mask_mod`` is evaluated only over the bounding box of the PARTIAL blocks.
    """
    codes = g.codes
    full = codes == int(BlockKind.FULL)
    if bool(full.all()):
        return None
    partial = codes == int(BlockKind.PARTIAL)
    if mask_mod is None:              # nothing to evaluate: a PARTIAL block counts as FULL
        full, partial = full | partial, torch.zeros_like(partial)
    lq, lk = g.q1 - g.q0, g.k1 - g.k0
    dev = q_pos.device

    def elems(b: torch.Tensor) -> torch.Tensor:
        e = b.repeat_interleave(block_size, 0).repeat_interleave(block_size, 1)
        return e[:lq, :lk].to(dev)

    mask = elems(full)[None, None]
    if bool(partial.any()):
        rows = partial.any(dim=1).nonzero().flatten()
        cols = partial.any(dim=0).nonzero().flatten()
        r0, r1 = int(rows[0]) * block_size, min((int(rows[-1]) + 1) * block_size, lq)
        c0, c1 = int(cols[0]) * block_size, min((int(cols[-1]) + 1) * block_size, lk)
        m = mask_for(mask_mod, q_pos[g.q0 + r0:g.q0 + r1], kv_pos[g.k0 + c0:g.k0 + c1], B=B, H=H)
        mask = mask.expand(m.shape[0], m.shape[1], lq, lk).clone()
        box = mask[..., r0:r1, c0:c1]
        box |= m & elems(partial)[r0:r1, c0:c1]
    return mask


def _prepare(q, k, v, *, q_pos, kv_pos, kind, blocks, block_size, kernel, score_mod, scale):
    B, H, G, Lq, Lk, D = check_qkv(q, k, v, q_pos=q_pos, kv_pos=kv_pos)
    kind = BlockKind(int(kind))
    if kind == BlockKind.EMPTY:
        raise ValueError("tile kind is EMPTY: an EMPTY tile has no work and must not be run; "
                         "skip it in the schedule")
    if blocks is not None and kind == BlockKind.PARTIAL:
        if block_size is None or int(block_size) <= 0:
            raise ValueError(f"blocks given without a positive block_size (got {block_size}); "
                             f"pass block_size=the block size the block map was built with")
        want = (-(-Lq // block_size), -(-Lk // block_size))
        if tuple(blocks.shape) != want:
            raise ValueError(f"blocks must have shape [ceil(Lq/block_size), ceil(Lk/block_size)]"
                             f" = {list(want)} for Lq={Lq}, Lk={Lk}, block_size={block_size}; "
                             f"got {list(blocks.shape)}")
    else:
        blocks = None
    from . import get_kernel

    kern = get_kernel(kernel, score_mod=score_mod, device=q.device)
    return (B, H, G, Lq, Lk, D), kind, blocks, kern, default_scale(D, scale)


def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                 kv_pos: torch.Tensor, mask_mod: MaskMod | None = None,
                 score_mod: ScoreMod | None = None, scale: float | None = None,
                 kind: BlockKind | int = BlockKind.PARTIAL, blocks: torch.Tensor | None = None,
                 block_size: int | None = None, kernel=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q rows against one kv tile, on global positions.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, D]``.
        q_pos: global positions of q's rows, ``[Lq]``.
        kv_pos: global positions of k/v's rows, ``[Lk]``.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` on global indices (None = full).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` on global indices.
        scale: softmax scale, default ``1/sqrt(D)``.
        kind: the tile's ``BlockKind``: FULL skips the mask, PARTIAL applies it, EMPTY raises.
        blocks: optional int8 block map ``[ceil(Lq/block_size), ceil(Lk/block_size)]`` of
            ``BlockKind`` codes for this tile (PARTIAL tiles only); work follows it.
        block_size: the block size ``blocks`` was built with.
        kernel: kernel name, kernel object, or None to choose automatically.

    Returns:
        ``(out [B, H, Lq, D] in q's dtype, lse [B, H, Lq])``; lse natural-log, float32
        (float64 for float64 inputs), -inf (with out 0) for rows with nothing to attend to.

    Raises:
        ValueError: for malformed inputs (see ``check_qkv``) or an EMPTY tile.
    """
    (B, H, G, Lq, Lk, D), kind, blocks, kern, scale = _prepare(
        q, k, v, q_pos=q_pos, kv_pos=kv_pos, kind=kind, blocks=blocks, block_size=block_size,
        kernel=kernel, score_mod=score_mod, scale=scale)
    kw = dict(score_mod=score_mod, scale=scale)
    if blocks is None:
        mask = mask_for(mask_mod, q_pos, kv_pos, B=B, H=H) if kind == BlockKind.PARTIAL else None
        return kern.forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask, **kw)
    out = q.new_zeros(B, H, Lq, D)
    lse = torch.full((B, H, Lq), -math.inf, dtype=compute_dtype(q.dtype), device=q.device)
    for g in _plan(blocks.cpu(), Lq=Lq, Lk=Lk, block_size=block_size):
        qp, kp = q_pos[g.q0:g.q1], kv_pos[g.k0:g.k1]
        mask = _group_mask(g, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)
        o, l = kern.forward(q[:, :, g.q0:g.q1], k[:, :, g.k0:g.k1], v[:, :, g.k0:g.k1],
                            q_pos=qp, kv_pos=kp, mask=mask, **kw)
        out[:, :, g.q0:g.q1] = o
        lse[:, :, g.q0:g.q1] = l
    return out, lse


def tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, *, q_pos: torch.Tensor,
                  kv_pos: torch.Tensor, mask_mod: MaskMod | None = None,
                  score_mod: ScoreMod | None = None, scale: float | None = None,
                  kind: BlockKind | int = BlockKind.PARTIAL, blocks: torch.Tensor | None = None,
                  block_size: int | None = None, kernel=None, dlse: torch.Tensor | None = None,
                  score_params: tuple[torch.Tensor, ...] = ()) -> tuple:
    """This tile's share of the gradient, given the GLOBAL merged ``out`` and ``lse``.

    Flash-attention style: ``p = exp(s - lse)``, ``delta = rowsum(dout * out)``,
    ``ds = p * (dp - (delta - dlse))``; summing the results over all kv tiles of a q chunk gives
    the exact ``dq`` of a loss that uses ``out`` and ``lse``, and each tile's ``dk``/``dv`` is
    that tile's exact share from these q rows. A globally dead row (lse = -inf) gets zero
    gradient whatever ``dlse`` is.

    Args:
        q, k, v: as in :func:`tile_forward`.
        out: global merged output ``[B, H, Lq, D]``.
        lse: global merged lse ``[B, H, Lq]``.
        dout: gradient of the loss w.r.t. ``out``, ``[B, H, Lq, D]``.
        q_pos, kv_pos, mask_mod, score_mod, scale, kind, blocks, block_size, kernel: as in
            :func:`tile_forward`.
        dlse: gradient of the loss w.r.t. the GLOBAL ``lse`` of these rows, ``[B, H, Lq]``;
            None means zero.
        score_params: tensors the score_mod closes over that require grad (e.g. an
            ``nn.Parameter`` bias table it indexes). Their gradients are returned, not
            accumulated into ``.grad``.

    Returns:
        ``(dq [B, H, Lq, D], dk [B, G, Lk, D], dv [B, G, Lk, D])`` in the inputs' dtype; with
        ``score_params``, ``(dq, dk, dv, dparams)`` where ``dparams`` is a tuple aligned with
        ``score_params`` (each param's dtype and shape): this tile's contribution, masked pairs
        contributing nothing.
    """
    (B, H, G, Lq, Lk, D), kind, blocks, kern, scale = _prepare(
        q, k, v, q_pos=q_pos, kv_pos=kv_pos, kind=kind, blocks=blocks, block_size=block_size,
        kernel=kernel, score_mod=score_mod, scale=scale)
    for name, t, want in (("out", out, (B, H, Lq, D)), ("dout", dout, (B, H, Lq, D)),
                          ("lse", lse, (B, H, Lq)), ("dlse", dlse, (B, H, Lq))):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} must have shape {list(want)}, got {list(t.shape)}; "
                             f"pass the global merged out/lse (and their gradients) for these "
                             f"q rows")
    score_params = tuple(score_params)
    if score_params and score_mod is None:
        raise ValueError(f"score_params given ({len(score_params)} tensors) without a score_mod;"
                         f" they are the tensors a score_mod closes over")
    kw = dict(score_mod=score_mod, scale=scale, dlse=dlse, score_params=score_params)
    if blocks is None:
        mask = mask_for(mask_mod, q_pos, kv_pos, B=B, H=H) if kind == BlockKind.PARTIAL else None
        return kern.backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos, mask=mask, **kw)
    ct = compute_dtype(q.dtype)
    dq = q.new_zeros(B, H, Lq, D)
    dk = torch.zeros(B, G, Lk, D, dtype=ct, device=k.device)
    dv = torch.zeros(B, G, Lk, D, dtype=ct, device=v.device)
    dparams = [torch.zeros_like(p) for p in score_params]
    for g in _plan(blocks.cpu(), Lq=Lq, Lk=Lk, block_size=block_size):
        rows, cols = slice(g.q0, g.q1), slice(g.k0, g.k1)
        mask = _group_mask(g, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)
        kw["dlse"] = None if dlse is None else dlse[:, :, rows]
        res = kern.backward(q[:, :, rows], k[:, :, cols], v[:, :, cols],
                            out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
                            q_pos=q_pos[rows], kv_pos=kv_pos[cols], mask=mask, **kw)
        dq[:, :, rows] = res[0]
        dk[:, :, cols] += res[1]
        dv[:, :, cols] += res[2]
        for acc, gp in zip(dparams, res[3] if score_params else ()):
            acc += gp
    grads = (dq, dk.to(k.dtype), dv.to(v.dtype))
    return (*grads, tuple(dparams)) if score_params else grads


def merge(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
          lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two partial attentions over disjoint kv sets (stable sigmoid / logsigmoid form).

    ``lse = max(a, b) - logsigmoid(|a - b|)``, ``out = sigmoid(a - b) out_a + sigmoid(b - a)
    out_b``. Merging with an all -inf side returns the other side exactly; both -inf gives out 0
    and lse -inf, never NaN.

    Args:
        out_a: ``[B, H, Lq, D]``.
        lse_a: ``[B, H, Lq]``.
        out_b: ``[B, H, Lq, D]``.
        lse_b: ``[B, H, Lq]``.

    Returns:
        ``(out, lse)`` in float32, or float64 when any input is float64 (accumulate in this
        dtype across tiles and cast ``out`` to q's dtype once at the end).
    """
    f64 = torch.float64 in (out_a.dtype, lse_a.dtype, out_b.dtype, lse_b.dtype)
    dt = torch.float64 if f64 else torch.float32
    a, b = lse_a.to(dt), lse_b.to(dt)
    oa, ob = out_a.to(dt), out_b.to(dt)
    both = torch.isneginf(a) & torch.isneginf(b)
    d = torch.where(both, torch.zeros_like(a), a - b)   # -inf - -inf would be NaN
    lse = torch.maximum(a, b) - torch.nn.functional.logsigmoid(d.abs())
    wa = torch.sigmoid(d).unsqueeze(-1)                  # exactly 1 / 0 when one side is -inf
    wb = torch.sigmoid(-d).unsqueeze(-1)
    out = wa * oa + wb * ob
    out = out.masked_fill(both.unsqueeze(-1), 0.0)
    return out, lse
