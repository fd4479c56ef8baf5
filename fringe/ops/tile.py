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
- Kernels with ``fused_calls`` (``sdpa``) get the calls a fused kernel likes (see
  :func:`_plan`): a square lower-triangular piece (found from the block map, then checked
  element by element) runs with ``causal=True`` and no mask, FULL column runs without a mask,
  and a float mask only over mixed columns, when that makes no more calls than the plain
  grouping. Measured (torch 2.13 CPU, 1 thread, B=1, H=8, D=64, fp32, block 64, one 4096-token
  tile, fwd+bwd CPU time, busy machine so +-10%): causal 2.33 s -> 1.65 s (0.71x, one is_causal
  call instead of 8 masked ones); 16 equal documents & causal 0.36 -> 0.29 s (0.80x, 48 -> 16
  calls); 8 ragged documents 0.96x-1.0x (22 calls either way); window 512: plain grouping kept.
- Kernels with ``wants_blocks`` (``flex``) get the whole tile instead: its block map (all
  FULL for a FULL tile, all PARTIAL without a map) and mask_mod, and follow the map themselves
  (see :mod:`fringe.ops.flex`); where such a kernel is not available (flex on CPU) the
  automatic choice runs the tile, with a warning once.
- ``tile_backward`` takes the GLOBAL merged out/lse (flash-attention style), so partial
  gradients over several kv tiles sum to the exact gradient.

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim of q and k ·
Dv head dim of v and out (may differ from D: MLA).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import threading
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from fringe.masks import DEFAULT_BLOCK_SIZE, BlockKind

from .calls import GROUP_SLACK, plan_tile, split_cols
from .kernels import get_kernel
from .reference import (MaskMod, ScoreMod, check_qkv, compute_dtype, default_scale, mask_for)

__all__ = ["check_qkv", "merge", "tile_backward", "tile_forward", "GROUP_SLACK"]

@dataclass(frozen=True)
class _Group:
    """One dense sub-problem: q rows ``[q0, q1)`` x kv rows ``[k0, k1)`` (element indices).

    ``causal``: the sub-problem is square and its mask is exactly lower-triangular (``q >= kv``
    in local indices), so a fused kernel runs it with ``is_causal`` and no mask.
    """

    q0: int
    q1: int
    k0: int
    k1: int
    codes: torch.Tensor  # BlockKind codes of the blocks covered, [q-blocks, kv-blocks]
    causal: bool = False


CausalCheck = Callable[[int, int], bool]


def _groups(blocks: torch.Tensor, pieces, *, Lq: int, Lk: int, block_size: int) -> list[_Group]:
    """Block rectangles ``(qb0, qb1, kb0, kb1, causal)`` as :class:`_Group` values (the last
    block clipped to the tile)."""
    bs = block_size
    return [_Group(a * bs, min(b * bs, Lq), c * bs, min(d * bs, Lk), blocks[a:b, c:d], causal=sq)
            for a, b, c, d, sq in pieces]


def _plan(blocks: torch.Tensor, *, Lq: int, Lk: int, block_size: int, fused: bool = False,
          causal_block: CausalCheck | None = None) -> list[_Group]:
    """Split a tile's block map into dense sub-problems (kernel calls): the one call planner,
    :func:`fringe.ops.calls.plan_tile` (the cost model counts its calls), as groups.

    ``fused``: kernels that like few large calls without masks (``fused_calls``) get causal
    squares and column cuts where they make no more calls; ``causal_block(i, j)`` is the exact
    element-level check of one diagonal block.
    """
    pieces = plan_tile(blocks.numpy(), Lq=Lq, Lk=Lk, block_size=block_size, fused=fused,
                       causal_block=causal_block)
    return _groups(blocks, pieces, Lq=Lq, Lk=Lk, block_size=block_size)


def _split_columns(g: _Group, *, block_size: int, Lq: int, Lk: int) -> list[_Group]:
    """Cut a group's kv range where its columns switch between all-FULL and mixed
    (:func:`fringe.ops.calls.split_cols`); ``[g]`` when it need not be cut."""
    codes = g.codes
    if codes.numel() == 0:
        return [g]
    nr, nc = codes.shape
    pieces: list = []
    split_cols(codes.numpy(), 0, 0, pieces)
    if pieces == [(0, nr, 0, nc)]:
        return [g]
    bs = block_size
    qb0, kb0 = g.q0 // bs, g.k0 // bs
    return [_Group((qb0 + a) * bs, min((qb0 + b) * bs, Lq), (kb0 + c) * bs,
                   min((kb0 + e) * bs, Lk), codes[a:b, c:e]) for a, b, c, e in pieces]


def _tril_check(mask_mod: MaskMod | None, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, B: int,
                H: int, block_size: int) -> CausalCheck:
    """The exact check of one block: its mask is ``tril`` (for every b, h)."""
    tril = torch.ones(block_size, block_size, dtype=torch.bool, device=q_pos.device).tril()

    def check(i: int, j: int) -> bool:
        if mask_mod is None:
            return False
        rows = slice(i * block_size, (i + 1) * block_size)
        cols = slice(j * block_size, (j + 1) * block_size)
        return bool((mask_for(mask_mod, q_pos[rows], kv_pos[cols], B=B, H=H) == tril).all())

    return check


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


def _build_calls(kern, blocks: torch.Tensor, mask_mod: MaskMod | None, q_pos: torch.Tensor,
                 kv_pos: torch.Tensor, *, B: int, H: int, block_size: int) -> list:
    """``(group, mask kwargs)`` for each kernel call of a tile with a block map."""
    fused = bool(getattr(kern, "fused_calls", False))
    Lq, Lk = q_pos.numel(), kv_pos.numel()
    check = _tril_check(mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)
    out = []
    for g in _plan(blocks.cpu(), Lq=Lq, Lk=Lk, block_size=block_size, fused=fused,
                   causal_block=check):
        if g.causal:
            out.append((g, dict(mask=None, causal=True)))
        else:
            out.append((g, dict(mask=_group_mask(g, mask_mod, q_pos, kv_pos, B=B, H=H,
                                                 block_size=block_size))))
    return out


#: Bytes of element masks the call cache (:class:`_CallCache`) may hold, least recently used
#: evicted first. The plans themselves (group geometry) are small and cost nothing to keep.
CALL_CACHE_BYTES = 256 << 20
#: At most this many tiles in the call cache (entries without masks cost no mask bytes).
CALL_CACHE_ENTRIES = 4096


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:            # inference tensors keep no version counter: never cached
        return None


class _CallCache:
    """A tile's kernel calls (groups and their element masks), built once per tile and reused.

    ``tile_forward(..., cache=True)`` and ``tile_backward(..., cache=True)`` look a tile up by
    the identity of its block map, positions and mask_mod, and its ``Lq``, ``Lk``, block size,
    kernel grouping, ``B`` and ``H``. An entry is used only when all of these hold:

    - ``blocks``, ``q_pos`` and ``kv_pos`` are the very objects it was built from (weak
      references: a new tensor at a reused ``id()`` misses) with the same ``_version`` (an
      in-place edit misses);
    - the mask_mod is the same object (held strongly, so its ``id`` is not reused meanwhile);
    - the cached masks' own ``_version`` is unchanged (a kernel that wrote into one misses).

    What it cannot see: state a mask_mod reads that is not one of these tensors (a captured
    tensor refilled in place, a global). That is why caching is opt-in: the runtime passes
    ``cache=True`` because a plan's mask_mod is a snapshot (:func:`fringe.masks.snapshot`)
    that never changes; a direct caller with a mask_mod over mutable state must leave it off.

    Memory: masks count against :data:`CALL_CACHE_BYTES` (LRU by bytes, and at most
    :data:`CALL_CACHE_ENTRIES` tiles); an entry whose masks alone exceed the budget keeps its
    plan and rebuilds the masks each call. An entry holds no reference to the block map or
    positions (weak references; the codes are copies), so it goes when its block map does.
    """

    def __init__(self, budget: int = CALL_CACHE_BYTES) -> None:
        self.budget = budget
        self.entries: OrderedDict = OrderedDict()
        self.bytes = 0
        self.lock = threading.RLock()    # a weakref callback may run inside
        self.hits = self.misses = 0

    def clear(self) -> None:
        with self.lock:
            self.entries.clear()
            self.bytes = 0

    def calls(self, kern, blocks, mask_mod, q_pos, kv_pos, *, B, H, block_size) -> list:
        fused = bool(getattr(kern, "fused_calls", False))
        vers = (_version(blocks), _version(q_pos), _version(kv_pos))
        if None in vers:
            return _build_calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H,
                                block_size=block_size)
        key = (id(blocks), id(q_pos), id(kv_pos), id(mask_mod), q_pos.numel(), kv_pos.numel(),
               int(block_size), fused, B, H)
        with self.lock:
            e = self.entries.get(key)
            hit = e is not None and self._valid(e, blocks, q_pos, kv_pos, mask_mod, vers)
            if hit:
                self.entries.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
        if hit and e["calls"] is not None:
            return e["calls"]
        if hit:                         # the plan is known; its masks were too big to keep
            return [(g, mkw if mkw.get("causal") else dict(mask=_group_mask(
                g, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)))
                for g, mkw in e["plan"]]
        calls = _build_calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H,
                             block_size=block_size)
        # own copies of the codes: a view would keep the block map alive (and its entry)
        calls = [(dataclasses.replace(g, codes=g.codes.clone()), m) for g, m in calls]
        masks = [m["mask"] for _, m in calls if m.get("mask") is not None]
        nbytes = sum(m.numel() * m.element_size() for m in masks)
        keep = nbytes <= self.budget
        drop = functools.partial(self._drop, key)      # the block map freed: masks go too
        e = dict(refs=tuple(weakref.ref(t, drop) for t in (blocks, q_pos, kv_pos)), vers=vers,
                 mask_mod=mask_mod, calls=calls if keep else None,
                 plan=[(g, m if m.get("causal") else {}) for g, m in calls],
                 masks=[(m, m._version) for m in masks] if keep else [],
                 nbytes=nbytes if keep else 0)
        with self.lock:
            old = self.entries.pop(key, None)
            if old is not None:
                self.bytes -= old["nbytes"]
            self.entries[key] = e
            self.bytes += e["nbytes"]
            while len(self.entries) > 1 and (self.bytes > self.budget
                                             or len(self.entries) > CALL_CACHE_ENTRIES):
                _, gone = self.entries.popitem(last=False)
                self.bytes -= gone["nbytes"]
        return calls

    def _drop(self, key, ref) -> None:
        with self.lock:
            e = self.entries.get(key)
            if e is not None and any(r is ref for r in e["refs"]):
                del self.entries[key]
                self.bytes -= e["nbytes"]

    @staticmethod
    def _valid(e, blocks, q_pos, kv_pos, mask_mod, vers) -> bool:
        return (e["mask_mod"] is mask_mod and e["vers"] == vers
                and all(r() is t for r, t in zip(e["refs"], (blocks, q_pos, kv_pos)))
                and all(m._version == v for m, v in e["masks"]))


_CACHE = _CallCache()


def _calls(kern, blocks: torch.Tensor, mask_mod: MaskMod | None, q_pos: torch.Tensor,
           kv_pos: torch.Tensor, *, B: int, H: int, block_size: int, cache: bool = False):
    """``(group, mask kwargs)`` for each kernel call of a tile with a block map (from
    :data:`_CACHE` with ``cache``)."""
    if cache:
        return _CACHE.calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H,
                            block_size=block_size)
    return _build_calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size)


def _whole(kern, mask: torch.Tensor | None) -> dict:
    """Mask kwargs for a tile without a block map: ``causal`` when a fused kernel can take it
    (a square tile whose mask is exactly lower-triangular for every b, h)."""
    if (mask is not None and getattr(kern, "fused_calls", False)
            and mask.shape[-1] == mask.shape[-2]):
        n = mask.shape[-1]
        if bool((mask == torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()).all()):
            return dict(mask=None, causal=True)
    return dict(mask=mask)


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

    kern = get_kernel(kernel, score_mod=score_mod, device=q.device)
    if getattr(kern, "wants_blocks", False):
        ok, why = kern.available(q.device)
        if not ok:                            # e.g. flex on CPU: the automatic choice, once told
            _warn_once(kern, q.device, why)
            kern = get_kernel(None, score_mod=score_mod, device=q.device)
    return (B, H, G, Lq, Lk, D), kind, blocks, kern, default_scale(D, scale)


_WARNED: set = set()


def _warn_once(kern, device, why: str) -> None:
    key = (getattr(kern, "name", type(kern).__name__), torch.device(device).type, why)
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(f"kernel {key[0]!r} is not available on {key[1]}: {why}; using the "
                      f"automatic choice instead", RuntimeWarning, stacklevel=4)


def _whole_tile(kind: BlockKind, blocks: torch.Tensor | None, block_size: int | None,
                mask_mod: MaskMod | None, *, Lq: int, Lk: int) -> dict:
    """Block arguments for a ``wants_blocks`` kernel: always a block map (all FULL for a FULL
    tile, all PARTIAL for a PARTIAL tile without one; block size DEFAULT_BLOCK_SIZE when none
    is given) and the mask_mod (None for a FULL tile: nothing to evaluate)."""
    if blocks is None:
        block_size = int(block_size) if block_size else DEFAULT_BLOCK_SIZE
        code = BlockKind.FULL if kind == BlockKind.FULL else BlockKind.PARTIAL
        blocks = torch.full((-(-Lq // block_size), -(-Lk // block_size)), int(code),
                            dtype=torch.int8)
    return dict(blocks=blocks, block_size=block_size,
                mask_mod=mask_mod if kind == BlockKind.PARTIAL else None)


def tile_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
                 kv_pos: torch.Tensor, mask_mod: MaskMod | None = None,
                 score_mod: ScoreMod | None = None, scale: float | None = None,
                 kind: BlockKind | int = BlockKind.PARTIAL, blocks: torch.Tensor | None = None,
                 block_size: int | None = None, kernel=None,
                 cache: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q rows against one kv tile, on global positions.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, Dv]`` (Dv may differ from D: MLA).
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
        cache: reuse this tile's kernel calls and masks from an earlier call with the same
            block map, positions and mask_mod objects (unedited); see :class:`_CallCache`.
            Only for a mask_mod that reads no mutable state (a plan's snapshot).

    Returns:
        ``(out [B, H, Lq, Dv] in q's dtype, lse [B, H, Lq])``; lse natural-log, float32
        (float64 for float64 inputs), -inf (with out 0) for rows with nothing to attend to.

    Raises:
        ValueError: for malformed inputs (see ``check_qkv``) or an EMPTY tile.
    """
    (B, H, G, Lq, Lk, D), kind, blocks, kern, scale = _prepare(
        q, k, v, q_pos=q_pos, kv_pos=kv_pos, kind=kind, blocks=blocks, block_size=block_size,
        kernel=kernel, score_mod=score_mod, scale=scale)
    kw = dict(score_mod=score_mod, scale=scale)
    if getattr(kern, "wants_blocks", False):  # the whole tile, its block map and mask_mod
        o, l = kern.forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, **kw, **_whole_tile(
            kind, blocks, block_size, mask_mod, Lq=Lq, Lk=Lk))
        return o.to(q.dtype), l.to(compute_dtype(q.dtype))
    if blocks is None:
        mask = mask_for(mask_mod, q_pos, kv_pos, B=B, H=H) if kind == BlockKind.PARTIAL else None
        return kern.forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, **_whole(kern, mask), **kw)
    ct = compute_dtype(q.dtype)
    calls = _calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size,
                   cache=cache)
    if len(calls) == 1 and (calls[0][0].q0, calls[0][0].q1) == (0, Lq):
        g, mkw = calls[0]                     # one call over every row: its result, no copies
        cols = slice(g.k0, g.k1)
        o, l = kern.forward(q, k[:, :, cols], v[:, :, cols], q_pos=q_pos, kv_pos=kv_pos[cols],
                            **mkw, **kw)
        return o.to(q.dtype), l.to(ct)
    out = _Rows((B, H, Lq, v.shape[-1]), ct, q.device)
    lse = torch.full((B, H, Lq), -math.inf, dtype=ct, device=q.device)
    for g, mkw in calls:
        rows, cols = slice(g.q0, g.q1), slice(g.k0, g.k1)
        o, l = kern.forward(q[:, :, rows], k[:, :, cols], v[:, :, cols], q_pos=q_pos[rows],
                            kv_pos=kv_pos[cols], **mkw, **kw)
        if out.touched(rows):                 # these rows have a piece already: merge
            o, l = merge(out.get(rows), lse[:, :, rows], o, l)
        out.put(rows, o)
        lse[:, :, rows] = l
    return out.result(q.dtype), lse


def tile_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                  lse: torch.Tensor, dout: torch.Tensor, *, q_pos: torch.Tensor,
                  kv_pos: torch.Tensor, mask_mod: MaskMod | None = None,
                  score_mod: ScoreMod | None = None, scale: float | None = None,
                  kind: BlockKind | int = BlockKind.PARTIAL, blocks: torch.Tensor | None = None,
                  block_size: int | None = None, kernel=None, dlse: torch.Tensor | None = None,
                  score_params: tuple[torch.Tensor, ...] = (), cache: bool = False) -> tuple:
    """This tile's share of the gradient, given the GLOBAL merged ``out`` and ``lse``.

    Flash-attention style: ``p = exp(s - lse)``, ``delta = rowsum(dout * out)``,
    ``ds = p * (dp - (delta - dlse))``; summing the results over all kv tiles of a q chunk gives
    the exact ``dq`` of a loss that uses ``out`` and ``lse``, and each tile's ``dk``/``dv`` is
    that tile's exact share from these q rows. A globally dead row (lse = -inf) gets zero
    gradient whatever ``dlse`` is.

    Args:
        q, k, v: as in :func:`tile_forward`.
        out: global merged output ``[B, H, Lq, Dv]``.
        lse: global merged lse ``[B, H, Lq]``.
        dout: gradient of the loss w.r.t. ``out``, ``[B, H, Lq, Dv]``.
        q_pos, kv_pos, mask_mod, score_mod, scale, kind, blocks, block_size, kernel, cache: as
            in :func:`tile_forward`.
        dlse: gradient of the loss w.r.t. the GLOBAL ``lse`` of these rows, ``[B, H, Lq]``;
            None means zero.
        score_params: tensors the score_mod closes over that require grad (e.g. an
            ``nn.Parameter`` bias table it indexes). Their gradients are returned, not
            accumulated into ``.grad``.

    Returns:
        ``(dq [B, H, Lq, D], dk [B, G, Lk, D], dv [B, G, Lk, Dv])`` in the inputs' dtype; with
        ``score_params``, ``(dq, dk, dv, dparams)`` where ``dparams`` is a tuple aligned with
        ``score_params`` (each param's dtype and shape): this tile's contribution, masked pairs
        contributing nothing.
    """
    (B, H, G, Lq, Lk, D), kind, blocks, kern, scale = _prepare(
        q, k, v, q_pos=q_pos, kv_pos=kv_pos, kind=kind, blocks=blocks, block_size=block_size,
        kernel=kernel, score_mod=score_mod, scale=scale)
    Dv = v.shape[-1]
    for name, t, want in (("out", out, (B, H, Lq, Dv)), ("dout", dout, (B, H, Lq, Dv)),
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
    if getattr(kern, "wants_blocks", False):  # the whole tile, its block map and mask_mod
        res = kern.backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos, **kw,
                            **_whole_tile(kind, blocks, block_size, mask_mod, Lq=Lq, Lk=Lk))
        grads = (res[0].to(q.dtype), res[1].to(k.dtype), res[2].to(v.dtype))
        return (*grads, tuple(res[3])) if score_params else grads
    if blocks is None:
        mask = mask_for(mask_mod, q_pos, kv_pos, B=B, H=H) if kind == BlockKind.PARTIAL else None
        return kern.backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos,
                             **_whole(kern, mask), **kw)
    ct = compute_dtype(q.dtype)
    calls = _calls(kern, blocks, mask_mod, q_pos, kv_pos, B=B, H=H, block_size=block_size,
                   cache=cache)
    if len(calls) == 1 and (calls[0][0].q0, calls[0][0].q1, calls[0][0].k0,
                            calls[0][0].k1) == (0, Lq, 0, Lk):
        g, mkw = calls[0]                     # one call over the whole tile: no accumulators
        res = kern.backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos, **mkw, **kw)
        grads = (res[0].to(q.dtype), res[1].to(k.dtype), res[2].to(v.dtype))
        return (*grads, tuple(res[3])) if score_params else grads
    dq = _Rows((B, H, Lq, D), ct, q.device)
    dk = _Rows((B, G, Lk, D), ct, k.device)
    dv = _Rows((B, G, Lk, Dv), ct, v.device)
    dparams = [torch.zeros_like(p) for p in score_params]
    for g, mkw in calls:
        rows, cols = slice(g.q0, g.q1), slice(g.k0, g.k1)
        kw["dlse"] = None if dlse is None else dlse[:, :, rows]
        res = kern.backward(q[:, :, rows], k[:, :, cols], v[:, :, cols],
                            out[:, :, rows], lse[:, :, rows], dout[:, :, rows],
                            q_pos=q_pos[rows], kv_pos=kv_pos[cols], **mkw, **kw)
        dq.add(rows, res[0])
        dk.add(cols, res[1])
        dv.add(cols, res[2])
        for acc, gp in zip(dparams, res[3] if score_params else ()):
            acc += gp
    grads = (dq.result(q.dtype), dk.result(k.dtype), dv.result(v.dtype))
    return (*grads, tuple(dparams)) if score_params else grads


class _Rows:
    """A ``[B, H or G, L, D]`` accumulator written by row slices without a zero fill first.

    A row's first write is a copy (:meth:`put` / :meth:`add`), later ones add; rows never
    written are zero in :meth:`result`. Measured: a fresh zero fill plus ``+=`` of a 4096-token
    fp32 tile cost two full passes over memory (page faults included) for nothing. The rows
    written so far are kept as Python intervals (no tensor ops to find them), and a slice that
    is part written is copied where unseen and added where seen (no zero fill of its unseen
    rows first: one pass instead of two; the same numbers, a -0.0 may stay -0.0).
    """

    def __init__(self, shape: tuple, dtype: torch.dtype, device) -> None:
        self.t = torch.empty(shape, dtype=dtype, device=device)
        self.seen: list[tuple[int, int]] = []        # sorted, disjoint, merged [a, b)

    @staticmethod
    def _bounds(sl: slice) -> tuple[int, int]:
        return sl.start or 0, sl.stop

    def _parts(self, a: int, b: int) -> list[tuple[int, int, bool]]:
        """``[a, b)`` cut into runs ``(lo, hi, seen)``."""
        out, x = [], a
        for s0, s1 in self.seen:
            if s1 <= x:
                continue
            if s0 >= b:
                break
            if s0 > x:
                out.append((x, s0, False))
            hi = min(s1, b)
            out.append((max(s0, x), hi, True))
            x = hi
            if x >= b:
                break
        if x < b:
            out.append((x, b, False))
        return out

    def _mark(self, a: int, b: int) -> None:
        merged, placed = [], False
        for s0, s1 in self.seen:
            if s1 < a or s0 > b:
                if s0 > b and not placed:
                    merged.append((a, b))
                    placed = True
                merged.append((s0, s1))
            else:
                a, b = min(a, s0), max(b, s1)
        if not placed:
            merged.append((a, b))
            merged.sort()
        self.seen = merged

    def touched(self, sl: slice) -> bool:
        a, b = self._bounds(sl)
        return any(s0 < b and s1 > a for s0, s1 in self.seen)

    def get(self, sl: slice) -> torch.Tensor:
        self._zero_unseen(sl)
        return self.t[:, :, sl]

    def put(self, sl: slice, x: torch.Tensor) -> None:
        self.t[:, :, sl] = x
        self._mark(*self._bounds(sl))

    def add(self, sl: slice, x: torch.Tensor) -> None:
        a, b = self._bounds(sl)
        for lo, hi, seen in self._parts(a, b):
            if (lo, hi) == (a, b):
                dst, src = self.t[:, :, sl], x
            else:
                dst, src = self.t[:, :, lo:hi], x[:, :, lo - a:hi - a]
            if seen:
                dst += src
            else:
                dst.copy_(src)
        self._mark(a, b)

    def _zero_unseen(self, sl: slice) -> None:
        a, b = self._bounds(sl)
        for lo, hi, seen in self._parts(a, b):
            if not seen:
                self.t[:, :, lo:hi].zero_()
        self._mark(a, b)

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        self._zero_unseen(slice(0, self.t.shape[2]))
        return self.t.to(dtype)


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
