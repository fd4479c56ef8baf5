"""Mask mods with global token indices, their composition, and exact block classification.

A mask_mod has FlexAttention's signature ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``
where ``q_idx`` / ``kv_idx`` are **global** token positions (a layout permutes tokens, so a
rank's local row i is global position ``layout.positions(rank)[i]``).

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` / ``Lk`` query / key lengths (local, in
layout order), ``bs`` block size, ``nQb = Lq / bs`` and ``nKb = Lk / bs`` block counts.

Layers:

* :class:`Mask` — a frozen, named, composable mask_mod. Factories :func:`full`,
  :func:`causal`, :func:`sliding_window`, :func:`document`, :func:`prefix_lm` and
  :func:`as_mask`; ``&`` / ``|`` behave like torch's ``and_masks`` / ``or_masks``.
* :func:`evaluate` — the dense mask ``[B or 1, H or 1, Lq, Lk]`` with FlexAttention's
  semantics (a mask_mod is defined on scalar indices). Fast path: call the mask_mod once on
  broadcast index tensors, used for a mod only where it agreed with the vmap evaluation
  (torch's public ``create_mask``) on small non-square probes at two shapes and did nothing
  with its index tensors but elementwise ops (no shape read, no reduction); otherwise vmap,
  or the :class:`MaskError` FlexAttention's refusal implies (``.item()``, control flow,
  non-bool). :func:`classify` and :func:`reads_batch_head` follow the same per-mod decision.
  Whether a mask reads ``b`` / ``h`` is read from a broadcast mod's output shape; a mod
  evaluated per scalar index cannot be proven to ignore them by a probe, so it is classified
  for every ``b`` / ``h`` it will run with, or declared (:attr:`Mask.bh_invariant`).
* :func:`classify` — the exact block map ``[nQb, nKb]`` (int8 :class:`BlockKind` codes)
  for arbitrary global index sets, without evaluating all pairs for structured masks; with
  ``sparse=True`` a :class:`BlockMap` (the non-empty blocks as rectangles), which is what
  plans keep: the dense map is ``(S/bs)^2`` bytes.

How ``classify`` stays exact and cheap: every block is summarised by the min / max of
its positions and whether its sorted positions form an arithmetic progression (stride 1:
a contiguous run). Structured leaves decide a block pair from those summaries and answer
EMPTY / PARTIAL / FULL, or UNKNOWN where the summaries cannot decide; ``&`` / ``|``
combine codes with UNKNOWN (AND: any EMPTY -> EMPTY, FULL -> the other; OR: dually).
The same min / max summaries over ranges of blocks decide FULL / EMPTY for whole cells of
a quadtree, so only cells that straddle the diagonal, a window edge or a document boundary
are split down to single blocks. Block pairs left UNKNOWN — and every pair of an
arbitrary callable — are resolved by evaluating the mask_mod on just those blocks, in
bounded-memory chunks. The result is always equal to the block-wise reduction of the
dense mask.

Plans keep a :func:`snapshot` of the mask (it does not alias the caller's tensors), and
ranks compare content digests: :func:`digest` for masks (factory parameters; plain
callables by value over the PARTIAL blocks) and :func:`fn_digest` for score_mods (code,
constants, captured values).

>>> m = causal() & document(torch.tensor([0, 0, 1, 1]))
>>> m
causal & document(2 docs)
>>> classify(m, torch.arange(4), torch.arange(4), block_size=2).tolist()
[[1, 0], [0, 1]]
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import re
import time
import types
import warnings
import weakref
from typing import Callable

import torch
from torch.overrides import TorchFunctionMode

#: Default mask-block size (tokens per side of a classification block). A parameter
#: everywhere; this is only its default. (Defined here, the lowest module that uses it;
#: :mod:`fringe.layout` re-exports it, so masks never imports layout.)
DEFAULT_BLOCK_SIZE = 64

MaskMod = Callable[..., torch.Tensor]

__all__ = [
    "BlockKind",
    "BlockMap",
    "Mask",
    "MaskError",
    "MaskMod",
    "as_mask",
    "causal",
    "classify",
    "digest",
    "document",
    "evaluate",
    "fn_digest",
    "full",
    "prefix_lm",
    "reads_batch_head",
    "sliding_window",
    "snapshot",
]


# Memory bounds (elements) for the temporaries of classify.
_CELL_CHUNK = 1 << 18  # quadtree cells evaluated per batch (a few int64 temporaries each)
_DENSE_CHUNK_ELEMS = 1 << 16  # token pairs per dense resolution chunk: [n, B, H, bs, bs]

#: :func:`classify` warns (once per mask name) when it is about to evaluate more token pairs
#: than this densely: masks without structure to exploit cost O(S^2).
WARN_DENSE_PAIRS = 10 ** 9

#: :meth:`BlockMap.dense` (and ``Plan.blocks``) refuses to build a dense map of more blocks
#: than this (16 MB of int8; S = 512k tokens at block 128): ask for a window (``rows=`` /
#: ``cols=``) or per tile instead.
DENSE_LIMIT = 1 << 24


class BlockKind(enum.IntEnum):
    """Classification of a (q-block, kv-block) tile; stored as int8 in block maps.

    ``CAUSAL`` is reserved for a causal-diagonal block (lower-triangular in local indices,
    which a fused kernel runs with ``is_causal``); :func:`classify` does not produce it yet,
    so kernels see EMPTY / PARTIAL / FULL only. Codes fit in 2 bits.
    """

    EMPTY = 0
    PARTIAL = 1
    FULL = 2
    CAUSAL = 3


_UNKNOWN = -1  # internal only: the block summaries cannot decide; refine or resolve densely
_EMPTY, _PARTIAL, _FULL = int(BlockKind.EMPTY), int(BlockKind.PARTIAL), int(BlockKind.FULL)


class MaskError(ValueError):
    """A mask_mod that cannot be evaluated as a mask; the message says how to fix it."""


class _VmapFailure(MaskError):
    """The mod raised under vmap for a reason other than what FlexAttention refuses by
    design (e.g. an index out of range on a probe): worth retrying on smaller probes."""


# --------------------------------------------------------------------------------------
# Block summaries and the structured block rules
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Blocks:
    """Per-block summaries of a position tensor split into blocks.

    Attributes:
        pos: ``[n, bs]`` int64 positions of each block (layout order).
        lo, hi: ``[n]`` min / max position of each block (attained).
        stride: ``[n]`` the common difference if the block's sorted positions form an
            arithmetic progression with a positive step (1 = contiguous run), else 0.
    """

    pos: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    stride: torch.Tensor

    @staticmethod
    def of(pos: torch.Tensor, block_size: int) -> _Blocks:
        pos = pos.to(torch.int64).view(-1, block_size)
        if block_size == 1:
            return _Blocks(pos=pos, lo=pos[:, 0], hi=pos[:, 0], stride=torch.ones_like(pos[:, 0]))
        d = pos[:, 1:] - pos[:, :-1]
        if bool((d > 0).all()):         # every block already increasing (sequence order, the
            srt = pos                   # built-in layouts): its sort is itself
        else:
            srt = pos.sort(dim=1).values
            d = srt[:, 1:] - srt[:, :-1]
        step = d[:, 0]
        is_ap = (d == step[:, None]).all(dim=1) & (step > 0)
        stride = torch.where(is_ap, step, torch.zeros_like(step))
        return _Blocks(pos=pos, lo=srt[:, 0], hi=srt[:, -1], stride=stride)

    @property
    def block_size(self) -> int:
        return self.pos.shape[1]


def _pair_reduce(x: torch.Tensor, op) -> torch.Tensor:
    """One level up a binary tree: ``op`` of elements ``2t`` and ``2t + 1`` (a last odd
    element is its own parent)."""
    n = x.numel()
    out = x[0::2].clone()
    out[:n // 2] = op(out[:n // 2], x[1::2])
    return out


class _Tree:
    """Block summaries of one side (q or kv) at every level of the classification quadtree.

    Level 0 is the blocks themselves (:class:`_Blocks`); node ``t`` of level ``l`` covers
    blocks ``[t * 2**l, min((t + 1) * 2**l, n))``. Upper levels keep the min / max position
    (attained), which decide FULL / EMPTY exactly for every rule; rules add their own
    min / max summaries through :meth:`up`.
    """

    def __init__(self, pos: torch.Tensor, block_size: int, levels: int):
        self.leaf = _Blocks.of(pos, block_size)
        self.levels = levels
        self.lo = self.up(self.leaf.lo, torch.minimum)
        self.hi = self.up(self.leaf.hi, torch.maximum)

    def up(self, x: torch.Tensor, op) -> list[torch.Tensor]:
        out = [x]
        for _ in range(self.levels):
            out.append(_pair_reduce(out[-1], op))
        return out

    def count(self, level: int) -> int:
        return self.lo[level].numel()


# A rule sees the q and kv trees once and returns a function of (level, i, j), index
# tensors of cells, giving int8 codes in {EMPTY, PARTIAL, FULL, UNKNOWN}. Above level 0 only
# FULL / EMPTY matter (anything else is refined), and must be exact.
_CellCodes = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


def _codes(full: torch.Tensor, empty: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
    """int8 codes from exact FULL / EMPTY predicates; ``partial`` marks the pairs that are
    certainly PARTIAL when neither FULL nor EMPTY (None: all of them), the rest UNKNOWN."""
    rest = _PARTIAL if partial is None else torch.where(partial, _PARTIAL, _UNKNOWN)
    return torch.where(empty, _EMPTY, torch.where(full, _FULL, rest)).to(torch.int8)


def _node_codes(full: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Codes of quadtree nodes above the blocks: FULL / EMPTY or UNKNOWN (refine)."""
    return torch.where(empty, _EMPTY, torch.where(full, _FULL, _UNKNOWN)).to(torch.int8)


@dataclasses.dataclass(frozen=True)
class _Band:
    """``lo <= q_idx - kv_idx <= hi`` (None = unbounded). Causal is ``lo=0``.

    FULL / EMPTY are exact for any position sets, because the extreme differences
    ``min(q) - max(kv)`` and ``max(q) - min(kv)`` are attained. A one-sided band is then
    PARTIAL for every other pair. A two-sided band whose extremes both fall outside it is
    PARTIAL exactly when some difference lands inside; that is decided when both blocks are
    arithmetic progressions with the same stride (contiguous runs, striped layouts): the
    differences are then ``q.lo - kv.lo + k * stride`` for every ``|k| < bs``.
    """

    lo: int | None
    hi: int | None

    def _extremes(self, dmin, dmax):
        lo, hi = self.lo, self.hi
        full = torch.ones_like(dmin, dtype=torch.bool)
        empty = torch.zeros_like(dmin, dtype=torch.bool)
        if lo is not None:
            full &= dmin >= lo
            empty |= dmax < lo
        if hi is not None:
            full &= dmax <= hi
            empty |= dmin > hi
        return full, empty

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        qb, kb = qt.leaf, kt.leaf
        bs = qb.block_size
        lo, hi = self.lo, self.hi

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            qlo, kHi = qt.lo[level][i], kt.hi[level][j]
            dmin, dmax = qlo - kHi, qt.hi[level][i] - kt.lo[level][j]
            full, empty = self._extremes(dmin, dmax)
            if level:
                return _node_codes(full, empty)
            if lo is None or hi is None:
                return _codes(full, empty, None)
            inside = ((dmin >= lo) & (dmin <= hi)) | ((dmax >= lo) & (dmax <= hi))
            s = qb.stride[i]
            same = (s > 0) & (s == kb.stride[j])
            s1 = torch.where(same, s, torch.ones_like(s))
            d0 = qlo - kb.lo[j]
            kmin = torch.clamp(-torch.div(d0 - lo, s1, rounding_mode="floor"), min=-(bs - 1))
            kmax = torch.clamp(torch.div(hi - d0, s1, rounding_mode="floor"), max=bs - 1)
            decided = inside | same
            hit = inside | (same & (kmin <= kmax))
            out = _codes(full, empty, decided)
            # decided and no difference inside the band: EMPTY after all
            return torch.where(decided & ~hit & ~full, torch.tensor(_EMPTY, dtype=torch.int8), out)

        return cells


@dataclasses.dataclass(frozen=True)
class _KvBelow:
    """``kv_idx < n``: exact for any sets from min / max."""

    n: int

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            full, empty = kt.hi[level][j] < self.n, kt.lo[level][j] >= self.n
            return _codes(full, empty, None) if level == 0 else _node_codes(full, empty)

        return cells


@dataclasses.dataclass(frozen=True, eq=False)
class _Document:
    """``doc_ids[q_idx] == doc_ids[kv_idx]``.

    FULL iff all four doc min / max are equal; PARTIAL if they are not all equal and some
    doc is shared; EMPTY iff no doc is shared. A shared doc is certain when the doc ranges
    overlap and both blocks are contiguous runs over non-decreasing ``doc_ids`` (packed
    documents: a run's docs are every doc id in its range), or when an endpoint of one range
    is a single-doc block lying inside a contiguous block's range; else disjoint doc ranges
    give EMPTY and the rest is UNKNOWN. Quadtree nodes use the doc min / max of their blocks
    (FULL iff one doc on both sides; EMPTY if the doc ranges are disjoint).

    ``sorted_ids`` is a check cached from ``doc_ids``: it must not outlive an in-place edit
    of them, so the ids' ``_version`` is recorded and classifying edited ids raises.
    """

    doc_ids: torch.Tensor
    sorted_ids: bool

    def __post_init__(self) -> None:
        object.__setattr__(self, "_ids_version", self.doc_ids._version)

    def _summ(self, b: _Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.doc_ids._version != self._ids_version:
            raise MaskError("document: its doc_ids were edited in place after masks.document() "
                            "built the mask (which recorded whether they were sorted, and named "
                            "it by their count), so its block rule no longer describes them; "
                            "build a new mask for new ids: masks.document(new_ids)")
        n = self.doc_ids.numel()
        if b.pos.numel() and (int(b.hi.max()) >= n or int(b.lo.min()) < 0):
            raise MaskError(
                f"document: positions span [{int(b.lo.min())}, {int(b.hi.max())}] but doc_ids "
                f"has {n} entries; give one doc id per global position (0..S-1)"
            )
        ids = self.doc_ids.to(b.pos.device)
        if self.sorted_ids:  # non-decreasing ids: the extremes sit at the extreme positions
            dlo, dhi = ids[b.lo], ids[b.hi]
        else:
            d = ids[b.pos]
            dlo, dhi = d.min(dim=1).values, d.max(dim=1).values
        run = (b.stride == 1) & self.sorted_ids
        return dlo, dhi, run

    def prepare(self, qt: _Tree, kt: _Tree) -> _CellCodes:
        qlo, qhi, qrun = self._summ(qt.leaf)
        klo, khi, krun = self._summ(kt.leaf)
        qlo_, qhi_ = qt.up(qlo, torch.minimum), qt.up(qhi, torch.maximum)
        klo_, khi_ = kt.up(klo, torch.minimum), kt.up(khi, torch.maximum)

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            a, b = qlo_[level][i], qhi_[level][i]
            c, d = klo_[level][j], khi_[level][j]
            full = (a == b) & (c == d) & (a == c)
            empty = (b < c) | (d < a)
            if level:
                return _node_codes(full, empty)
            qr, kr = qrun[i], krun[j]
            shared = (qr & kr) | (qr & (c == d)) | (kr & (a == b))
            return _codes(full, empty, shared)

        return cells


# --------------------------------------------------------------------------------------
# Mask
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Mask:
    """A named, composable mask_mod with global token indices.

    Call it like a mask_mod: ``mask(b, h, q_idx, kv_idx) -> bool tensor``. Combine with
    ``&`` / ``|`` (the other side may be a plain callable).

    Attributes:
        mod: the mask_mod.
        name: display name (also ``repr(mask)`` and ``mask.__name__``).
        bh_invariant: a declaration, one of three values. ``True``: the mask ignores ``b``
            and ``h`` (every factory; :func:`as_mask` with ``bh_invariant=True``: trusted,
            the mask is classified once). ``False``: it reads them (classified for every
            ``b < B``, ``h < H``). ``None`` (:func:`as_mask`'s default): not declared; fringe
            decides where it can prove it: a mask evaluated by broadcasting reads ``b`` /
            ``h`` exactly when its output varies along that axis, but a mask evaluated per
            scalar index (torch.vmap; see :func:`evaluate`) cannot be proven to ignore
            them by a probe (a probe proves nothing about values it did not try), so
            :func:`fringe.plan` classifies it for every ``b`` / ``h`` it is given, or
            raises when it is given neither. ``&`` / ``|``: True if every operand is True,
            False if one is False, else None.
        op: ``"leaf"``, ``"and"`` or ``"or"``; ``children`` are the operands.
        rule: the structured block rule of a leaf (None: classified densely).
    """

    mod: MaskMod
    name: str
    bh_invariant: bool | None = True
    op: str = "leaf"
    children: tuple[Mask, ...] = ()
    rule: object | None = None
    display_op: str | None = None  # "and"/"or" for an unnamed composition (parenthesised)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b, h, q_idx, kv_idx)

    @property
    def __name__(self) -> str:  # noqa: A003 - mimic a function for FlexAttention users
        return self.name

    def __repr__(self) -> str:
        return self.name

    @property
    def structured(self) -> bool:
        """True when every leaf has a block rule (classify never needs dense fallback
        except for undecided pairs)."""
        if self.op == "leaf":
            return self.rule is not None
        return all(c.structured for c in self.children)

    def __and__(self, other) -> Mask:
        return _combine("and", self, other)

    def __rand__(self, other) -> Mask:
        return _combine("and", other, self)

    def __or__(self, other) -> Mask:
        return _combine("or", self, other)

    def __ror__(self, other) -> Mask:
        return _combine("or", other, self)


def _combine(op: str, *masks) -> Mask:
    ms = [as_mask(m) for m in masks]
    kids: list[Mask] = []
    parts: list[str] = []
    for m in ms:
        if m.display_op == op:  # flatten unnamed a & (b & c)
            kids.extend(m.children)
        else:
            kids.append(m)
        parts.append(f"({m.name})" if m.display_op not in (None, op) else m.name)
    name = f" {'&' if op == 'and' else '|'} ".join(parts)
    decl = [k.bh_invariant for k in kids]
    inv = True if all(d is True for d in decl) else False if any(d is False for d in decl) else None
    return Mask(mod=_combined_mod(op, tuple(k.mod for k in kids), name), name=name,
                bh_invariant=inv, op=op, children=tuple(kids), display_op=op)


def _combined_mod(op: str, mods: tuple, name: str) -> MaskMod:
    """``mods[0] & mods[1] & ...`` (or ``|``) as one mask_mod."""
    if op == "and":
        def mod(b, h, q_idx, kv_idx):
            out = mods[0](b, h, q_idx, kv_idx)
            for f in mods[1:]:
                out = out & f(b, h, q_idx, kv_idx)
            return out
    else:
        def mod(b, h, q_idx, kv_idx):
            out = mods[0](b, h, q_idx, kv_idx)
            for f in mods[1:]:
                out = out | f(b, h, q_idx, kv_idx)
            return out
    mod.__name__ = name
    return mod


def as_mask(fn, name: str | None = None, *, bh_invariant: bool | None = None) -> Mask:
    """Wrap an arbitrary mask_mod (returned unchanged if it already is a :class:`Mask`).

    Args:
        fn: ``fn(b, h, q_idx, kv_idx) -> bool tensor`` on global indices.
        name: display name; defaults to ``fn.__name__``.
        bh_invariant: ``True`` declares that ``fn`` ignores ``b`` and ``h`` (trusted: it is
            classified once, for ``b = h = 0``); ``False`` that it reads them; ``None``
            (default) takes ``fn``'s own ``bh_invariant`` attribute when that is True or
            False, and otherwise declares nothing: fringe reads the dependence from the
            output's shape where it evaluates ``fn`` by broadcasting, and otherwise (a mod
            evaluated per scalar index) :func:`fringe.plan` needs ``batch_size=`` /
            ``num_heads=`` or this declaration (see :attr:`Mask.bh_invariant`).

    Returns:
        a :class:`Mask` classified by dense evaluation.
    """
    if isinstance(fn, Mask):
        if name is None or name == fn.name:
            return fn
        return dataclasses.replace(fn, name=name, display_op=None)
    if not callable(fn):
        raise TypeError(f"a mask_mod must be callable (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(fn).__name__}")
    if bh_invariant is None:
        bh_invariant = declared_bh_invariant(fn)
    return Mask(mod=fn, name=name or getattr(fn, "__name__", "mask_mod"),
                bh_invariant=bh_invariant)


def declared_bh_invariant(mask_mod) -> bool | None:
    """What ``mask_mod`` declares about ``b`` / ``h``: ``True`` (ignores both), ``False``
    (reads them) or ``None`` (nothing). A :class:`Mask` by :attr:`Mask.bh_invariant`; a plain
    function by a ``bh_invariant`` attribute that is exactly True or False."""
    d = getattr(mask_mod, "bh_invariant", None)
    return d if d is True or d is False else None


def _leaf(mod: MaskMod, name: str, rule) -> Mask:
    mod.__name__ = name
    return Mask(mod=mod, name=name, rule=rule)


def full() -> Mask:
    """Every pair allowed."""
    def full_mod(b, h, q_idx, kv_idx):
        return q_idx.new_ones((), dtype=torch.bool)
    return _leaf(full_mod, "full", _Band(None, None))


def causal() -> Mask:
    """``q_idx >= kv_idx``."""
    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return _leaf(causal_mod, "causal", _Band(0, None))


def sliding_window(window: int, *, causal: bool = True) -> Mask:
    """Local attention.

    Args:
        window: number of allowed offsets per side (>= 1).
        causal: True: ``0 <= q_idx - kv_idx < window``; False: ``|q_idx - kv_idx| < window``.
    """
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window: window={window} must be >= 1 (window=1 keeps the "
                         f"diagonal only)")
    if causal:
        def sliding_window_mod(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d >= 0) & (d < window)
        return _leaf(sliding_window_mod, f"sliding_window({window})", _Band(0, window - 1))

    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < window
    return _leaf(sliding_window_mod, f"sliding_window({window}, causal=False)",
                 _Band(-(window - 1), window - 1))


def document(doc_ids: torch.Tensor) -> Mask:
    """Attention within a document: ``doc_ids[q_idx] == doc_ids[kv_idx]``.

    Args:
        doc_ids: 1-D integer tensor, one doc id per **global** position. Packed documents
            (non-decreasing ids) classify exactly from block summaries; any ids work.

    Mutable state: the mask owns a copy of ``doc_ids`` (refilling yours for the next batch
    changes nothing). Its copy (``mask.rule.doc_ids``) is its state: edited in place, the
    mask raises when it is classified or planned, and a plan over it on its next call.
    """
    if not isinstance(doc_ids, torch.Tensor):
        doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.dim() != 1 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool \
            or doc_ids.is_complex():
        raise ValueError(f"document: doc_ids must be a 1-D integer tensor over global positions, "
                         f"got dtype={doc_ids.dtype} shape={tuple(doc_ids.shape)}")
    doc_ids = doc_ids.detach().clone()  # own a copy: the caller may refill theirs
    sorted_ids = bool((doc_ids[1:] >= doc_ids[:-1]).all())
    if sorted_ids:  # packed documents: count boundaries (no sort of S ids)
        n_docs = int((doc_ids[1:] != doc_ids[:-1]).sum()) + int(doc_ids.numel() > 0)
    else:
        n_docs = int(torch.unique(doc_ids).numel())

    def document_mod(b, h, q_idx, kv_idx):
        ids = doc_ids.to(q_idx.device)
        return ids[q_idx] == ids[kv_idx]

    return _leaf(document_mod, f"document({n_docs} doc{'s' if n_docs != 1 else ''})",
                 _Document(doc_ids, sorted_ids))


def prefix_lm(prefix_len: int) -> Mask:
    """Bidirectional over a prefix, causal after: ``kv_idx < prefix_len or q_idx >= kv_idx``."""
    n = int(prefix_len)
    if n < 0:
        raise ValueError(f"prefix_lm: prefix_len={n} must be >= 0")

    def prefix_mod(b, h, q_idx, kv_idx):
        return kv_idx < n
    below = _leaf(prefix_mod, f"kv<{n}", _KvBelow(n))
    m = _combine("or", below, causal())

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (q_idx >= kv_idx)
    prefix_lm_mod.__name__ = f"prefix_lm({n})"
    return dataclasses.replace(m, mod=prefix_lm_mod, name=f"prefix_lm({n})", display_op=None)


# --------------------------------------------------------------------------------------
# Dense evaluation: FlexAttention's semantics, broadcasting where it agrees
# --------------------------------------------------------------------------------------

#: The probe on which a mask_mod's broadcast evaluation is compared with its per-index (vmap)
#: evaluation: ``(B, H, Lq, Lk)``, non-square so that a reduction over one axis cannot hide.
PROBE_SHAPE = (2, 3, 5, 7)

#: The second probe shape: a mod whose broadcast evaluation depends on the index tensors'
#: shape (``q_idx.numel()``) agrees with itself at one shape only by coincidence.
PROBE_SHAPE_2 = (3, 4, 11, 13)

# What a mask_mod may not do with an index tensor (or a tensor computed from one) for its
# broadcast evaluation to mean its per-scalar one: read the shape or turn it into Python.
_SHAPE_READS = frozenset({
    "numel", "nelement", "size", "dim", "ndimension", "__len__", "shape", "ndim", "stride",
    "item", "tolist", "numpy", "__array__", "__int__", "__float__", "__index__",
    "data_ptr", "storage_offset", "is_contiguous", "count_nonzero", "unique", "nonzero"})


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":                     # a property such as .shape / .ndim
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


class _IndexWatch(TorchFunctionMode):
    """Watches a mask_mod called on broadcast index tensors and records the first thing it
    does with them (or with a tensor computed from them) that is not elementwise: reading a
    shape (``q_idx.numel()``, ``len``, ``.shape``), turning one into a Python value, or an
    op whose result is smaller than its index-tensor input (``.sum()``, ``.any()``,
    ``q_idx[0]``). Such a mod means something else broadcast than per scalar index, even
    where the two agree on a probe."""

    def __init__(self, inputs) -> None:
        super().__init__()
        self.tainted = {id(t): t for t in inputs}
        self.found: str | None = None

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)
               and id(a) in self.tainted]
        if not ins:
            return out
        outs = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
        name = _func_name(func)
        if self.found is None:
            on_index = args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.tainted
            if name in _SHAPE_READS:
                self.found = f"reads .{name} of an index tensor"
            elif on_index and not name.startswith("new_") and \
                    any(o.numel() < max(t.numel() for t in ins) for o in outs):
                self.found = (f"reduces an index tensor ({name} returns fewer elements than "
                              f"it was given)")
        for o in outs:
            self.tainted[id(o)] = o
        return out


def _leaves(tree) -> list:
    if isinstance(tree, (tuple, list)):
        return [x for t in tree for x in _leaves(t)]
    if isinstance(tree, dict):
        return [x for t in tree.values() for x in _leaves(t)]
    return [tree]

_CONTROL_FLOW_HINT = (
    "mask_mod uses Python control flow on tensors (if / and / or / not, bool(), or a "
    "data-dependent branch); mask_mods are traced per scalar index under torch.vmap, as in "
    "FlexAttention, where that is not allowed, so write it with tensor ops: & instead of "
    "'and', | instead of 'or', ~ instead of 'not', and torch.where(cond, a, b) instead of "
    "'a if cond else b'"
)
_ITEM_HINT = (
    "mask_mod calls .item() (or int() / float() / a Python comparison) on an index tensor; "
    "mask_mods are traced per scalar index under torch.vmap, as in FlexAttention, and "
    ".item() / Python control flow on index values are not allowed there; keep the value a "
    "tensor (index a captured tensor with it, compare it, combine with & | ~ and torch.where)"
)

# Per-mod verdict of the probe: mod -> (method, probed_b, probed_h) with method "broadcast"
# or "vmap" (a plain callable) or "tree" (a Mask evaluated child by child), and the number
# of distinct b / h values the probe saw (a later call with more re-probes). Weak keys: a
# verdict lives as long as its mod. Bound methods are keyed by (instance, function).
_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOUND_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED: set[tuple[str, int, str]] = set()


def _is_control_flow_error(e: BaseException) -> bool:
    s = str(e)
    return ("Boolean value of Tensor" in s and "ambiguous" in s) or "data-dependent control flow" in s


def _name(fn) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _vmap_error(e: BaseException, mod) -> MaskError | None:
    """The MaskError FlexAttention's behaviour implies for an error raised under vmap."""
    s = str(e)
    if ".item()" in s:
        return MaskError(f"{_name(mod)}: {_ITEM_HINT}")
    if _is_control_flow_error(e):
        return MaskError(_CONTROL_FLOW_HINT)
    m = re.search(r"must only return Tensors, got type <class '([\w.]+)'>", s)
    if m:
        return MaskError(f"mask_mod {_name(mod)} must return a bool tensor, got {m.group(1)}; "
                         f"build it from comparisons combined with & and |")
    return None


def _check_result(out, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a mask_mod result and broadcast it to ``shape``.

    A wrong type or dtype raises :class:`MaskError`; a shape that does not broadcast raises
    torch's RuntimeError.
    """
    if isinstance(out, bool):
        out = torch.tensor(out)
    if not isinstance(out, torch.Tensor):
        raise MaskError(f"mask_mod must return a bool tensor, got {type(out).__name__}; "
                        f"build it from comparisons combined with & and |")
    if out.dtype != torch.bool:
        raise MaskError(f"mask_mod must return a bool tensor, got {out.dtype}; "
                        f"build it from comparisons combined with & and |")
    return out.expand(shape)


def _by_broadcast(mod, b, h, q_pos, kv_pos) -> torch.Tensor:
    """``mod`` called once on broadcast index tensors: ``[len(b), len(h), Lq, Lk]``."""
    out = mod(b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q_pos.view(1, 1, -1, 1),
              kv_pos.view(1, 1, 1, -1))
    return _check_result(out, (b.numel(), h.numel(), q_pos.numel(), kv_pos.numel()))


def _pick(values: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``values[i]`` for a 0-d index under vmap, as a 0-d tensor."""
    return values.gather(0, i.reshape(1)).reshape(())


def _by_vmap_pairs(mod, b, h, qpos, kpos) -> torch.Tensor:
    """FlexAttention's evaluation (torch's public ``create_mask``, i.e. vmap over scalar
    indices) of ``mod`` on ``n`` pairs of position sets ``qpos [n, lq]``, ``kpos [n, lk]``,
    batch / head values ``b``, ``h``: bool ``[n, len(b), len(h), lq, lk]``. The pair index
    rides in create_mask's batch dimension, so this is one vmapped call.

    Raises:
        MaskError: what FlexAttention would refuse (``.item()``, control flow, non-bool).
    """
    from torch.nn.attention.flex_attention import create_mask

    n, lq = qpos.shape
    lk = kpos.shape[1]
    nb, nh = b.numel(), h.numel()
    shape = (n, nb, nh, lq, lk)
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.bool, device=qpos.device)

    qflat, kflat = qpos.reshape(-1), kpos.reshape(-1)

    def by_index(bb, hh, qi, ki):  # gather, not getitem: ~10x faster under vmap (measured)
        pair = bb // nb
        return mod(_pick(b, bb % nb), _pick(h, hh), _pick(qflat, pair * lq + qi),
                   _pick(kflat, pair * lk + ki))

    try:
        out = create_mask(by_index, n * nb, nh, lq, lk, device=qpos.device)
    except MaskError:
        raise
    except Exception as e:  # noqa: BLE001 - named and re-raised
        err = _vmap_error(e, mod)
        if err is not None:
            raise err from e
        raise _VmapFailure(f"mask_mod {_name(mod)} fails when called per scalar index, as "
                        f"FlexAttention calls it (torch.vmap): {type(e).__name__}: {e}") from e
    return _check_result(out, (n * nb, nh, lq, lk)).reshape(shape)


def _spread(pos: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` positions spread evenly over ``pos`` (repeats when it is shorter). The first and
    last are always in, so a probe over ``pos`` x ``pos`` holds diagonal pairs."""
    idx = torch.linspace(0, pos.numel() - 1, n, device=pos.device).round().long()
    return pos[idx]


def _cycle(n_values: int, n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device) % max(1, n_values)


def _cached(mod) -> tuple[str, int, int] | None:
    try:
        if isinstance(mod, types.MethodType):
            return _BOUND_METHODS.get(mod.__self__, {}).get(mod.__func__)
        return _METHODS.get(mod)
    except TypeError:  # not hashable / not weak-referenceable: probe every call
        return None


def _remember(mod, verdict: tuple[str, int, int]) -> None:
    try:
        if isinstance(mod, types.MethodType):
            _BOUND_METHODS.setdefault(mod.__self__, {})[mod.__func__] = verdict
        else:
            _METHODS[mod] = verdict
    except TypeError:
        pass


def _decide(mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, nb: int, nh: int,
            strict: bool = True) -> str | None:
    """``"broadcast"`` if broadcasting ``mod`` agrees with its vmap evaluation on the probe,
    else ``"vmap"`` (cached per mod; warns once per source location when it is "vmap").

    The probe is :data:`PROBE_SHAPE`: b and h cycle through the call's ``nb`` / ``nh``
    values, q / kv positions are spread over the call's own (so captured tables are
    indexed in range), then again at :data:`PROBE_SHAPE_2`; the broadcast calls run under a
    watch of the index tensors (:class:`_IndexWatch`: a shape read or a reduction means
    "vmap" even where the values agree). Checks, not a proof of equality everywhere.

    Raises:
        MaskError: the mod fails per scalar index (FlexAttention would refuse it), unless
            ``strict`` is False (positions made up, not the caller's), which returns None
            instead; a non-strict "broadcast" verdict is used but not cached.
    """
    pb, ph, _, _ = PROBE_SHAPE
    seen_b, seen_h = min(nb, pb), min(nh, ph)
    hit = _cached(mod)
    if hit is not None and (hit[0] == "vmap" or (hit[1] >= seen_b and hit[2] >= seen_h)):
        return hit[0]
    dev = q_pos.device
    reason = None
    t0 = t1 = t2 = 0.0
    for shape in (PROBE_SHAPE, PROBE_SHAPE_2):     # two shapes: see PROBE_SHAPE_2
        sb, sh, pq, pk = shape
        b, h = _cycle(nb, sb, dev), _cycle(nh, sh, dev)
        qp, kp = _spread(q_pos, pq), _spread(kv_pos, pk)
        t0 = time.perf_counter()
        try:
            want = _by_vmap_pairs(mod, b, h, qp[None], kp[None])[0]
        except MaskError:
            if strict:
                raise
            return None
        t1 = time.perf_counter()
        args = (b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), qp.view(1, 1, -1, 1),
                kp.view(1, 1, 1, -1))
        watch = _IndexWatch(args)
        try:
            with watch:
                out = mod(*args)
            got = _check_result(out, (b.numel(), h.numel(), qp.numel(), kp.numel()))
        except Exception as e:  # noqa: BLE001 - a mod written for scalars may reject broadcasting
            reason = f"calling it on broadcast index tensors raises {type(e).__name__}: {e}"
            break
        t2 = time.perf_counter()
        diff = (got != want).nonzero()
        if len(diff):
            i, j, k, l_ = diff[0].tolist()
            reason = (f"at b={int(b[i])}, h={int(h[j])}, q_idx={int(qp[k])}, kv_idx={int(kp[l_])} "
                      f"broadcasting gives {bool(got[i, j, k, l_])} and FlexAttention's "
                      f"per-index evaluation gives {bool(want[i, j, k, l_])} (a reduction such "
                      f"as .all() / .any() / .sum() over the index tensors does this)")
            break
        if watch.found is not None:     # agrees here, but only by the probe's choice of shape
            reason = (f"called on broadcast index tensors it {watch.found}, so what it means "
                      f"depends on the tensors' shape, not only on each (b, h, q_idx, kv_idx)")
            break
    method = "broadcast" if reason is None else "vmap"
    if hit is not None and hit[0] == "vmap":
        method = "vmap"
    if strict or method == "vmap":  # a "broadcast" verdict on made-up positions is not kept
        _remember(mod, (method, max(seen_b, hit[1] if hit else 0),
                        max(seen_h, hit[2] if hit else 0)))
    if reason is not None:
        code = getattr(mod, "__code__", None)
        where = (code.co_filename, code.co_firstlineno, code.co_name) if code is not None else \
            (type(mod).__module__, 0, type(mod).__qualname__)
        if where not in _WARNED:
            _WARNED.add(where)
            cost = "" if t2 < t1 else \
                f" (on the probe: {1e3 * (t1 - t0):.2f} ms by vmap vs {1e3 * (t2 - t1):.2f} ms)"
            warnings.warn(
                f"mask_mod {_name(mod)} does not evaluate elementwise on broadcast index tensors "
                f"(probe B,H,Lq,Lk={PROBE_SHAPE}): {reason}. fringe evaluates it per scalar index "
                f"with torch.vmap (create_mask) from now on, as FlexAttention does: correct, but "
                f"slower than broadcasting{cost}; write it elementwise (no reductions over "
                f"q_idx / kv_idx) to get the fast path", stacklevel=4)
    return method


def _method(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, nb: int, nh: int,
            strict: bool = True) -> str | None:
    """How :func:`evaluate` evaluates ``mask_mod``: ``"broadcast"``, ``"vmap"`` or ``"tree"``.

    A :class:`Mask` whose leaves all come from the factories is elementwise by construction
    (no probe); a Mask tree with a leaf that needs vmap is evaluated child by child
    (``"tree"``), so its structured leaves keep the fast path.
    """
    if not isinstance(mask_mod, Mask):
        return _decide(mask_mod, q_pos, kv_pos, nb, nh, strict)
    if mask_mod.op == "leaf":
        if mask_mod.rule is not None:
            return "broadcast"
        return _decide(mask_mod.mod, q_pos, kv_pos, nb, nh, strict)
    kids = [_method(c, q_pos, kv_pos, nb, nh, strict) for c in mask_mod.children]
    if None in kids:
        return None
    return "broadcast" if all(k == "broadcast" for k in kids) else "tree"


def _eval_pairs(mask_mod, method: str, qpos: torch.Tensor, kpos: torch.Tensor,
                nb: int, nh: int) -> torch.Tensor:
    """``mask_mod`` on ``n`` pairs of position sets ``qpos [n, lq]``, ``kpos [n, lk]`` for
    ``b < nb``, ``h < nh``, by ``method`` (from :func:`_method`): ``[n, nb, nh, lq, lk]``."""
    n, lq = qpos.shape
    lk = kpos.shape[1]
    dev = qpos.device
    b, h = torch.arange(nb, device=dev), torch.arange(nh, device=dev)
    if method == "tree":
        kids = mask_mod.children
        out = _eval_pairs(kids[0], _method(kids[0], qpos[0], kpos[0], nb, nh), qpos, kpos, nb, nh)
        for c in kids[1:]:
            m = _eval_pairs(c, _method(c, qpos[0], kpos[0], nb, nh), qpos, kpos, nb, nh)
            out = (out & m) if mask_mod.op == "and" else (out | m)
        return out
    mod = mask_mod.mod if isinstance(mask_mod, Mask) else mask_mod
    if method == "vmap":
        return _by_vmap_pairs(mod, b, h, qpos, kpos)
    shape = (n, nb, nh, lq, lk)
    if n == 1:
        return _by_broadcast(mod, b, h, qpos[0], kpos[0])[None]
    try:
        return _check_result(mod(b.view(1, -1, 1, 1, 1), h.view(1, 1, -1, 1, 1),
                                 qpos.view(n, 1, 1, lq, 1), kpos.view(n, 1, 1, 1, lk)), shape)
    except MaskError:
        raise
    except Exception:  # noqa: BLE001 - elementwise on 4-D, not on 5-D: go pair by pair
        return torch.stack([_by_broadcast(mod, b, h, qpos[i], kpos[i]) for i in range(n)])


def evaluate(mask_mod: MaskMod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             B: int | None = None, H: int | None = None, method: str = "auto") -> torch.Tensor:
    """Evaluate ``mask_mod`` densely on global positions, with FlexAttention's semantics.

    FlexAttention defines a mask_mod on scalar indices and vmaps it. Calling it once on
    broadcast index tensors is the fast path and gives the same answer for elementwise code,
    but not for reductions over the indices (``.all()``, ``.any()``, ``.sum()``), code that
    needs scalars, or ``.item()``. So ``"auto"`` compares both on a small non-square probe
    (:data:`PROBE_SHAPE`, positions spread over the call's own) the first time it sees a mod,
    caches the verdict per mod, and from then on broadcasts where they agreed and vmaps
    (warning once, with the reason) where they did not. Masks from the factories are
    elementwise by construction and never probed. The probe runs at two shapes and watches
    what the mod does with its index tensors: reading their shape (``q_idx.numel()``) or
    reducing them sends it to vmap even where the probe's values agree. Still a **check,
    not a proof**: a mod whose meaning depends on state the probe cannot see (a global
    it changes between calls) could still be broadcast.

    Args:
        mask_mod: a :class:`Mask` or any ``(b, h, q_idx, kv_idx) -> bool tensor``.
        q_pos, kv_pos: 1-D int tensors of global positions (any order).
        B, H: batch / head counts to evaluate (None: 1, i.e. ``b = h = 0``).
        method: ``"auto"`` (above), ``"broadcast"`` (one call on broadcast index tensors,
            whatever it means) or ``"vmap"`` (FlexAttention's definition: torch's public
            ``create_mask``).

    Returns:
        bool tensor ``[B or 1, H or 1, Lq, Lk]`` (possibly an expanded view).

    Raises:
        MaskError: the mask_mod returns something other than a bool tensor, or does what
            FlexAttention refuses: ``.item()``, Python control flow on index values.
    """
    if method not in ("auto", "broadcast", "vmap"):
        raise ValueError(f"evaluate: method={method!r}; use 'auto', 'broadcast' or 'vmap'")
    dev = q_pos.device
    kv_pos = kv_pos.to(dev)
    nb, nh, lq, lk = B or 1, H or 1, q_pos.numel(), kv_pos.numel()
    if 0 in (lq, lk):
        return torch.zeros((nb, nh, lq, lk), dtype=torch.bool, device=dev)
    if method == "auto":
        method = _method(mask_mod, q_pos, kv_pos, nb, nh)
    if method == "broadcast":
        try:
            mod = mask_mod.mod if isinstance(mask_mod, Mask) else mask_mod
            return _by_broadcast(mod, torch.arange(nb, device=dev), torch.arange(nh, device=dev),
                                 q_pos, kv_pos)
        except Exception as e:  # noqa: BLE001
            if _is_control_flow_error(e):
                raise MaskError(_CONTROL_FLOW_HINT) from e
            raise
    return _eval_pairs(mask_mod, method, q_pos[None], kv_pos[None], nb, nh)[0]


# --------------------------------------------------------------------------------------
# Block classification
# --------------------------------------------------------------------------------------


def _and_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    unk = torch.tensor(_UNKNOWN, dtype=torch.int8)
    out = torch.where(a == _FULL, b, torch.where(b == _FULL, a, unk))
    return torch.where((a == _EMPTY) | (b == _EMPTY), torch.tensor(_EMPTY, dtype=torch.int8), out)


def _or_codes(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    unk = torch.tensor(_UNKNOWN, dtype=torch.int8)
    out = torch.where(a == _EMPTY, b, torch.where(b == _EMPTY, a, unk))
    return torch.where((a == _FULL) | (b == _FULL), torch.tensor(_FULL, dtype=torch.int8), out)


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


def _probe_positions(seq_len, q_pos, kv_pos):
    """The probe positions of :func:`reads_batch_head` and whether they are the caller's."""
    given = q_pos is not None or seq_len is not None
    if q_pos is None:
        q_pos = torch.arange(2) if seq_len is None else \
            torch.linspace(0, max(0, int(seq_len) - 1), PROBE_SHAPE[3]).round().long()
    kv_pos = q_pos if kv_pos is None else kv_pos.to(q_pos.device)
    return q_pos, kv_pos, given


def _leaf_bh(mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, strict: bool,
             elementwise: bool) -> tuple[bool, bool, bool]:
    """``(reads_b, reads_h, proven)`` for one mask_mod (a leaf of a Mask tree).

    A mod evaluated by broadcasting (``elementwise``: a factory rule; else as
    :func:`_decide` finds) is called with ``b [2,1,1,1]``, ``h [1,2,1,1]``: it reads an
    index exactly when its output broadcasts along that axis (``proven``). A mod evaluated
    per scalar index is evaluated for ``b < 2``, ``h < 3`` on the probe: an output that varies
    there is a witness that it reads the index; one that does not vary proves nothing about
    the values the probe did not try (``proven`` False).
    """
    if not elementwise:
        # B and H are unknown here: a mod indexing a per-head table may accept fewer heads
        for pb, ph in ((2, 3), (2, 2), (1, 1)):
            try:
                method = _decide(mod, q_pos, kv_pos, pb, ph, strict)
                if method != "vmap":
                    break
                out = _by_vmap_pairs(mod, torch.arange(pb, device=q_pos.device),
                                     torch.arange(ph, device=q_pos.device),
                                     _spread(q_pos, PROBE_SHAPE[2])[None],
                                     _spread(kv_pos, PROBE_SHAPE[3])[None])[0]
            except _VmapFailure:
                if (pb, ph) == (1, 1):
                    raise
                continue
            reads_b = pb > 1 and not torch.equal(out[0], out[1])
            reads_h = any(not torch.equal(out[:, 0], out[:, j]) for j in range(1, ph))
            return reads_b, reads_h, False
    idx = torch.arange(2, device=q_pos.device)
    try:
        out = mod(idx.view(2, 1, 1, 1), idx.view(1, 2, 1, 1), _spread(q_pos, 2).view(1, 1, 2, 1),
                  _spread(kv_pos, 2).view(1, 1, 1, 2))
    except Exception:           # noqa: BLE001 - evaluate()/classify() report real errors
        return False, False, True
    shape = tuple(torch.as_tensor(out).shape)
    shape = (1,) * (4 - len(shape)) + shape
    return shape[0] == 2, shape[1] == 2, True


def _bh_leaves(mask_mod, q_pos, kv_pos, strict: bool) -> list[tuple[str, bool | None, tuple]]:
    """``(name, declared, (reads_b, reads_h, proven))`` for each leaf of ``mask_mod`` (a
    plain callable is one leaf)."""
    if isinstance(mask_mod, Mask) and mask_mod.op != "leaf":
        return [x for c in mask_mod.children for x in _bh_leaves(c, q_pos, kv_pos, strict)]
    if isinstance(mask_mod, Mask):
        mod, rule, decl = mask_mod.mod, mask_mod.rule, mask_mod.bh_invariant
    else:
        mod, rule, decl = mask_mod, None, declared_bh_invariant(mask_mod)
    return [(_name(mask_mod), decl,
             _leaf_bh(mod, q_pos, kv_pos, strict=strict, elementwise=rule is not None))]


def unproven_bh(mask_mod: MaskMod, *, seq_len: int | None = None,
                q_pos: torch.Tensor | None = None,
                kv_pos: torch.Tensor | None = None) -> tuple[str, ...]:
    """The names of the parts of ``mask_mod`` that fringe cannot prove ignore ``b`` and ``h``.

    Those are the mask_mods it evaluates per scalar index (vmap; see :func:`evaluate`) that
    are not declared ``bh_invariant=True`` (:func:`as_mask`): a probe proves nothing about
    the ``b`` / ``h`` values it did not try. (A mod evaluated by broadcasting is decided by
    its output's shape; factories are invariant by construction.) :func:`fringe.plan`
    classifies such a mask for every ``b < batch_size``, ``h < num_heads``, and refuses it
    when it is given neither.

    Args: as :func:`reads_batch_head`.
    """
    q_pos, kv_pos, given = _probe_positions(seq_len, q_pos, kv_pos)
    if q_pos.numel() == 0 or kv_pos.numel() == 0:
        return ()
    return tuple(name for name, decl, (_, _, proven) in
                 _bh_leaves(mask_mod, q_pos, kv_pos, given) if decl is not True and not proven)


def reads_batch_head(mask_mod: MaskMod, *, seq_len: int | None = None,
                     q_pos: torch.Tensor | None = None,
                     kv_pos: torch.Tensor | None = None) -> tuple[bool, bool]:
    """Whether ``mask_mod`` reads ``b`` / ``h``, probed on a few positions (no S² evaluation).

    Leaf by leaf (a plain callable is one leaf). A mod that :func:`evaluate` broadcasts is
    called once with ``b`` of shape ``[2, 1, 1, 1]`` and ``h`` of shape ``[1, 2, 1, 1]`` on a
    2x2 tile: an output that broadcasts along a dimension read that index (exact). A mod
    evaluated per scalar index (vmap, see :func:`evaluate`) is evaluated for ``b < 2``,
    ``h < 3`` on the probe positions: True means it was seen reading the index there; False
    proves nothing about other values (see :func:`unproven_bh`: :func:`fringe.plan` does not
    rely on it).

    Args:
        mask_mod: the mask_mod.
        seq_len: S; the probe positions are then spread over ``0..S-1`` (pass it: it also
            decides the evaluation method on valid positions).
        q_pos, kv_pos: or give the probe's positions directly. With neither, positions
            ``0, 1`` are used and a mod that fails on them is reported as reading neither.

    Returns:
        ``(reads_b, reads_h)``.
    """
    q_pos, kv_pos, given = _probe_positions(seq_len, q_pos, kv_pos)
    if q_pos.numel() == 0 or kv_pos.numel() == 0:
        return False, False
    leaves = _bh_leaves(mask_mod, q_pos, kv_pos, given)
    return any(r[2][0] for r in leaves), any(r[2][1] for r in leaves)


# --------------------------------------------------------------------------------------
# Sparse block maps
# --------------------------------------------------------------------------------------


def _paint(rects: torch.Tensor, codes: torch.Tensor, r0: int, r1: int, c0: int,
           c1: int) -> torch.Tensor:
    """int8 ``[r1 - r0, c1 - c0]`` map of disjoint ``rects`` (clipped to the window) by a 2-D
    difference array: four corner updates per rect, then two cumulative sums."""
    h, w = r1 - r0, c1 - c0
    if len(rects):
        hit = (rects[:, 0] < r1) & (rects[:, 1] > r0) & (rects[:, 2] < c1) & (rects[:, 3] > c0)
        rects, codes = rects[hit], codes[hit]
    if not len(rects) or h == 0 or w == 0:
        return torch.zeros((h, w), dtype=torch.int8)
    a = rects[:, 0].clamp(min=r0) - r0
    b = rects[:, 1].clamp(max=r1) - r0
    c = rects[:, 2].clamp(min=c0) - c0
    d = rects[:, 3].clamp(max=c1) - c0
    v = codes.to(torch.int8)
    diff = torch.zeros((h + 1) * (w + 1), dtype=torch.int8)
    for rows, cols, sign in ((a, c, v), (a, d, -v), (b, c, -v), (b, d, v)):
        diff.index_put_((rows * (w + 1) + cols,), sign, accumulate=True)
    diff = diff.view(h + 1, w + 1)
    return diff.cumsum(0, dtype=torch.int8).cumsum(1, dtype=torch.int8)[:h, :w].contiguous()


def _runs(index: torch.Tensor, cut: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Maximal runs of consecutive blocks that stay consecutive under ``index`` (and do not
    cross a multiple of ``cut`` there): ``(starts, ends, run_of_block)``."""
    n = index.numel()
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = index[1:] != index[:-1] + 1
    if cut:
        brk[1:] |= torch.div(index[1:], cut, rounding_mode="floor") != \
            torch.div(index[:-1], cut, rounding_mode="floor")
    starts = brk.nonzero().flatten()
    ends = torch.cat([starts[1:], torch.tensor([n])])
    return starts, ends, brk.cumsum(0) - 1


def _merge_rows(i: torch.Tensor, j: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Single blocks ``(i, j)`` of kind ``c`` as rects, horizontal neighbours of one kind merged."""
    if not i.numel():
        return torch.zeros((0, 4), dtype=torch.int64), torch.zeros(0, dtype=torch.int8)
    key = i * (int(j.max()) + 1) + j
    order = key.argsort()
    i, j, c = i[order], j[order], c[order]
    start = torch.ones(i.numel(), dtype=torch.bool)
    start[1:] = (i[1:] != i[:-1]) | (j[1:] != j[:-1] + 1) | (c[1:] != c[:-1])
    first = start.nonzero().flatten()
    last = torch.cat([first[1:], torch.tensor([i.numel()])]) - 1
    rects = torch.stack([i[first], i[first] + 1, j[first], j[last] + 1], dim=1)
    return rects, c[first]


@dataclasses.dataclass(frozen=True, eq=False)
class BlockMap:
    """A block classification stored sparsely: the non-empty blocks as disjoint rectangles.

    The dense int8 ``[nQb, nKb]`` map costs ``(S/bs)^2`` bytes (268 MB for S = 1M tokens at
    block 64); structured masks have a few rectangles per block row instead (a FULL square
    per quadtree cell inside a document or below the causal diagonal, single blocks along
    the diagonal and document boundaries).

    Attributes:
        shape: ``(nQb, nKb)``.
        rects: int64 ``[N, 4]``: block rows ``[r0, r1)`` x block columns ``[c0, c1)``;
            rectangles are disjoint, sorted by ``(r0, c0)``; EMPTY blocks are not stored.
        codes: int8 ``[N]``: the :class:`BlockKind` of every block of each rectangle (FULL or
            PARTIAL; ``CAUSAL`` is reserved).

    >>> bm = classify(causal(), torch.arange(8), torch.arange(8), block_size=2, sparse=True)
    >>> bm.rects.tolist()[:4]           # rows [r0, r1) x columns [c0, c1), in blocks
    [[0, 1, 0, 1], [1, 2, 0, 1], [1, 2, 1, 2], [2, 4, 0, 2]]
    >>> bm.codes.tolist()               # PARTIAL diagonal blocks, FULL below
    [1, 2, 1, 2, 1, 2, 1]
    >>> bm.dense().tolist()
    [[1, 0, 0, 0], [2, 1, 0, 0], [2, 2, 1, 0], [2, 2, 2, 1]]
    """

    shape: tuple[int, int]
    rects: torch.Tensor
    codes: torch.Tensor

    def __len__(self) -> int:
        return self.rects.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held by the rectangles and their codes."""
        return self.rects.numel() * self.rects.element_size() + self.codes.numel()

    def dense(self, rows: tuple[int, int] | None = None, cols: tuple[int, int] | None = None, *,
              limit: int | None = DENSE_LIMIT) -> torch.Tensor:
        """The dense int8 map (or the window ``rows`` x ``cols``, half-open block ranges).

        Raises:
            ValueError: the window has more than ``limit`` blocks (None: no limit).
        """
        nq, nk = self.shape
        r0, r1 = rows if rows is not None else (0, nq)
        c0, c1 = cols if cols is not None else (0, nk)
        r0, r1, c0, c1 = max(0, r0), min(nq, r1), max(0, c0), min(nk, c1)
        r1, c1 = max(r0, r1), max(c0, c1)
        if limit is not None and (r1 - r0) * (c1 - c0) > limit:
            raise ValueError(f"a dense block map of {r1 - r0} x {c1 - c0} blocks exceeds the "
                             f"limit of {limit:,} blocks; read it by tile (plan.tile_blocks(i, "
                             f"j)) or by window (block_map.dense(rows=, cols=)), or pass "
                             f"limit=None")
        return _paint(self.rects, self.codes, r0, r1, c0, c1)

    def take(self, rows, cols) -> torch.Tensor:
        """int8 ``[len(rows), len(cols)]``: the codes of blocks ``(rows[a], cols[b])`` for any
        block indices (a sampled picture of a map too large to densify)."""
        rows = torch.as_tensor(rows, dtype=torch.int64).flatten()
        cols = torch.as_tensor(cols, dtype=torch.int64).flatten()
        m, nk = rows.numel(), self.shape[1]
        srt, order = rows.sort()
        R = self.rects
        a = torch.searchsorted(srt, R[:, 0].contiguous())     # selected rows inside each rect
        b = torch.searchsorted(srt, R[:, 1].contiguous())
        cnt = b - a
        rep = torch.repeat_interleave(torch.arange(len(R)), cnt)
        k = a[rep] + torch.arange(int(cnt.sum())) - torch.repeat_interleave(cnt.cumsum(0) - cnt, cnt)
        v = self.codes[rep]
        diff = torch.zeros(m * (nk + 1), dtype=torch.int8)
        diff.index_put_((k * (nk + 1) + R[rep, 2],), v, accumulate=True)
        diff.index_put_((k * (nk + 1) + R[rep, 3],), -v, accumulate=True)
        dense_rows = diff.view(m, nk + 1).cumsum(1, dtype=torch.int8)[:, :nk]
        out = torch.empty((m, nk), dtype=torch.int8)
        out[order] = dense_rows
        return out[:, cols].contiguous()

    def _areas(self) -> torch.Tensor:
        return (self.rects[:, 1] - self.rects[:, 0]) * (self.rects[:, 3] - self.rects[:, 2])

    def count(self, kind: BlockKind | int) -> int:
        """Number of blocks of ``kind`` (EMPTY: the blocks not stored)."""
        if int(kind) == _EMPTY:
            return self.shape[0] * self.shape[1] - int(self._areas().sum())
        return int(self._areas()[self.codes == int(kind)].sum())

    def nonzero(self, kind: BlockKind | int = BlockKind.PARTIAL) -> tuple[torch.Tensor, torch.Tensor]:
        """Row and column indices of the blocks of ``kind`` (not EMPTY), in row-major order."""
        sel = self.codes == int(kind)
        rects = self.rects[sel]
        if not len(rects):
            z = torch.zeros(0, dtype=torch.int64)
            return z, z
        w = rects[:, 3] - rects[:, 2]
        area = (rects[:, 1] - rects[:, 0]) * w
        rep = torch.repeat_interleave(torch.arange(len(rects)), area)
        k = torch.arange(int(area.sum())) - torch.repeat_interleave(area.cumsum(0) - area, area)
        i = rects[rep, 0] + torch.div(k, w[rep], rounding_mode="floor")
        j = rects[rep, 2] + k % w[rep]
        order = (i * self.shape[1] + j).argsort()
        return i[order], j[order]

    def row_counts(self) -> torch.Tensor:
        """int64 ``[nQb]``: non-empty blocks in each block row."""
        nq = self.shape[0]
        diff = torch.zeros(nq + 1, dtype=torch.int64)
        w = self.rects[:, 3] - self.rects[:, 2]
        diff.index_add_(0, self.rects[:, 0], w)
        diff.index_add_(0, self.rects[:, 1], -w)
        return diff.cumsum(0)[:nq]

    def row_kind_counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[nQb]`` twice: the FULL and the PARTIAL blocks of each block row, in
        O(rectangles + rows) (no dense map).

        >>> bm = classify(causal(), torch.arange(8), torch.arange(8), block_size=2, sparse=True)
        >>> [t.tolist() for t in bm.row_kind_counts()]
        [[0, 1, 2, 3], [1, 1, 1, 1]]
        """
        nq = self.shape[0]
        w = self.rects[:, 3] - self.rects[:, 2]
        out = []
        for kind in (_FULL, _PARTIAL):
            sel = self.codes == kind
            diff = torch.zeros(nq + 1, dtype=torch.int64)
            diff.index_add_(0, self.rects[sel, 0], w[sel])
            diff.index_add_(0, self.rects[sel, 1], -w[sel])
            out.append(diff.cumsum(0)[:nq])
        return out[0], out[1]

    def row_spans(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int64 ``[nQb]`` twice: the first non-empty block column of each block row and one
        past its last (``nKb`` and ``0`` for an empty row), without a dense map.

        Costs the row-rectangle incidences (the per-row runs: O(log) a row for the
        structured masks).

        >>> ids = torch.tensor([0] * 4 + [1] * 4)
        >>> bm = classify(causal() & document(ids), torch.arange(8), torch.arange(8),
        ...               block_size=2, sparse=True)
        >>> [t.tolist() for t in bm.row_spans()]
        [[0, 0, 2, 2], [1, 2, 3, 4]]
        """
        nq, nk = self.shape
        first = torch.full((nq,), nk, dtype=torch.int64)
        end = torch.zeros(nq, dtype=torch.int64)
        R = self.rects
        if len(R):
            h = R[:, 1] - R[:, 0]
            rep = torch.repeat_interleave(torch.arange(len(R)), h)
            row = R[rep, 0] + torch.arange(rep.numel()) - torch.repeat_interleave(h.cumsum(0) - h, h)
            first.scatter_reduce_(0, row, R[rep, 2], "amin")
            end.scatter_reduce_(0, row, R[rep, 3], "amax")
        return first, end

    @staticmethod
    def from_dense(dense: torch.Tensor) -> BlockMap:
        """The sparse map of a dense int8 ``[nQb, nKb]`` map of :class:`BlockKind` codes (one
        rectangle per run of equal codes along a row).

        Raises:
            ValueError: not a 2-D map of codes EMPTY / PARTIAL / FULL.
        """
        d = torch.as_tensor(dense)
        if d.dim() != 2 or d.dtype.is_floating_point or d.dtype == torch.bool:
            raise ValueError(f"a dense block map is a 2-D integer tensor of BlockKind codes "
                             f"[nQb, nKb], got {d.dtype} shape={tuple(d.shape)}")
        d = d.to(torch.int8)
        if d.numel() and not bool(((d == _EMPTY) | (d == _PARTIAL) | (d == _FULL)).all()):
            raise ValueError("a dense block map holds BlockKind codes only (0 EMPTY, 1 PARTIAL, "
                             "2 FULL)")
        nq, nk = d.shape
        dp = torch.nn.functional.pad(d, (1, 1))                     # [nq, nk + 2], zero edges
        edge = dp[:, 1:] != dp[:, :-1]                              # [nq, nk + 1]: code changes
        r, c = torch.nonzero(edge & (dp[:, 1:] != _EMPTY), as_tuple=True)      # run starts
        re, ce = torch.nonzero(edge & (dp[:, :-1] != _EMPTY), as_tuple=True)   # run ends
        rects = torch.stack([r, r + 1, c, ce], dim=1)
        return BlockMap.of((nq, nk), rects, d[r, c] if len(r) else torch.zeros(0, dtype=torch.int8))

    def pieces(self, q_index: torch.Tensor, kv_index: torch.Tensor, *,
               cut: int | None = None) -> int:
        """How many rectangles :meth:`permute` with these arguments makes (cheap)."""
        qrid, krid = _runs(q_index, cut)[2], _runs(kv_index, cut)[2]
        R = self.rects
        nr = qrid[R[:, 1] - 1] - qrid[R[:, 0]] + 1
        nc = krid[R[:, 3] - 1] - krid[R[:, 2]] + 1
        return int((nr * nc).sum())

    def permute(self, q_index: torch.Tensor, kv_index: torch.Tensor, *,
                cut: int | None = None) -> BlockMap:
        """The same classification with block row ``r`` moved to ``q_index[r]`` and block
        column ``c`` to ``kv_index[c]`` (permutations of the block indices: e.g. sequence
        order to a block-aligned layout's order).

        Each rectangle is split into the runs of rows (and columns) that stay consecutive
        under the index, and, with ``cut``, at multiples of ``cut`` in the new order (tile
        boundaries: no rectangle of the result crosses one).
        """
        q_index = torch.as_tensor(q_index, dtype=torch.int64)
        kv_index = torch.as_tensor(kv_index, dtype=torch.int64)
        if q_index.numel() != self.shape[0] or kv_index.numel() != self.shape[1]:
            raise ValueError(f"permute: q_index has {q_index.numel()} and kv_index "
                             f"{kv_index.numel()} entries; the map is {self.shape}")
        qs, qe, qrid = _runs(q_index, cut)
        ks, ke, krid = _runs(kv_index, cut)
        R = self.rects
        ra, ca = qrid[R[:, 0]], krid[R[:, 2]]
        nr, nc = qrid[R[:, 1] - 1] - ra + 1, krid[R[:, 3] - 1] - ca + 1
        total = nr * nc
        rep = torch.repeat_interleave(torch.arange(len(R)), total)
        k = torch.arange(int(total.sum())) - torch.repeat_interleave(total.cumsum(0) - total, total)
        ncr = nc[rep]
        rr = ra[rep] + torch.div(k, ncr, rounding_mode="floor")
        cc = ca[rep] + k % ncr
        r0 = torch.maximum(R[rep, 0], qs[rr])
        r1 = torch.minimum(R[rep, 1], qe[rr])
        c0 = torch.maximum(R[rep, 2], ks[cc])
        c1 = torch.minimum(R[rep, 3], ke[cc])
        nr0, nc0 = q_index[r0], kv_index[c0]
        rects = torch.stack([nr0, nr0 + (r1 - r0), nc0, nc0 + (c1 - c0)], dim=1)
        return BlockMap.of(self.shape, rects, self.codes[rep])

    @staticmethod
    def of(shape: tuple[int, int], rects: torch.Tensor, codes: torch.Tensor) -> BlockMap:
        """A map from disjoint rectangles in any order (sorted here by ``(r0, c0)``)."""
        if len(rects):
            order = (rects[:, 0] * (shape[1] + 1) + rects[:, 2]).argsort()
            rects, codes = rects[order], codes[order]
        return BlockMap((int(shape[0]), int(shape[1])), rects.to(torch.int64).contiguous(),
                        codes.to(torch.int8).contiguous())

    def __repr__(self) -> str:
        return (f"BlockMap({self.shape[0]} x {self.shape[1]} blocks, {len(self)} rects, "
                f"{self.count(_FULL):,} full, {self.count(_PARTIAL):,} partial)")


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
    # declared invariant (factories, as_mask(fn, bh_invariant=True)): trusted. Undeclared:
    # invariant only where proven (every leaf broadcast-evaluated, its output's shape
    # without a b / h axis); a leaf evaluated per scalar index is classified for each b, h.
    decl = mask.bh_invariant if isinstance(mask_mod, Mask) else declared_bh_invariant(mask_mod)
    invariant = decl is True or (decl is None and q_pos.numel() > 0 and kv_pos.numel() > 0 and
                                 _proven_invariant(mask_mod, q_pos, kv_pos))
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


def _proven_invariant(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> bool:
    q = _spread(q_pos, PROBE_SHAPE[3])
    k = _spread(kv_pos, PROBE_SHAPE[3])
    return all(decl is True or (proven and not rb and not rh)
               for _, decl, (rb, rh, proven) in _bh_leaves(mask_mod, q, k, True))


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


# --------------------------------------------------------------------------------------
# Snapshots: a planned mask does not alias the caller's tensors
# --------------------------------------------------------------------------------------


def snapshot(mask_mod):
    """An equivalent mask_mod (or score_mod) that does not alias the caller's tensors.

    A plan classifies a mask once and its tiles evaluate it later: if the mask reads a
    tensor the caller refills (``ids.copy_(next_batch_ids)``), the two would disagree. So
    :func:`fringe.plan` keeps a snapshot:

    * :class:`Mask` trees are rebuilt with snapshotted children (names, ``bh_invariant``
      preserved). Factory leaves already own copies (:func:`document` clones ``doc_ids``).
    * A plain Python function whose closure cells or defaults hold tensors is rebuilt as a
      new function (same code and globals, attributes such as ``bh_invariant`` copied)
      whose cells hold clones. Cells holding functions, Masks, ``functools.partial``
      objects, tuples, lists or dicts are snapshotted recursively.
    * Tensors that require grad are **not** cloned: a score_mod's learnable bias must stay
      the live parameter (its values are meant to change, and get gradients).
    * Other callables (bound methods, objects with ``__call__``) and module globals the
      function reads by name are returned / left as they are: those cannot be copied
      safely, so refilling them in place still changes the mask.

    Objects with nothing to copy are returned unchanged (the same object). Cost: one copy
    of each captured tensor that does not require grad, per call.
    """
    return _snap(mask_mod, {})


def _snap_tensor(t: torch.Tensor) -> torch.Tensor:
    return t if t.requires_grad else t.detach().clone()


def _snap(obj, memo: dict):
    key = id(obj)  # identity memo for this one call only (cycles, shared cells)
    if key in memo:
        return memo[key]
    memo[key] = obj
    out = obj
    if isinstance(obj, torch.Tensor):
        out = _snap_tensor(obj)
    elif isinstance(obj, Mask):
        out = _snap_mask(obj, memo)
    elif isinstance(obj, types.FunctionType):
        out = _snap_function(obj, memo)
    elif isinstance(obj, functools.partial):
        f = _snap(obj.func, memo)
        args = tuple(_snap(a, memo) for a in obj.args)
        kw = {k: _snap(v, memo) for k, v in obj.keywords.items()}
        if f is not obj.func or any(a is not b for a, b in zip(args, obj.args)) or \
                any(kw[k] is not obj.keywords[k] for k in kw):
            out = functools.partial(f, *args, **kw)
    elif type(obj) in (tuple, list):
        items = [_snap(v, memo) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            out = type(obj)(items)
    elif type(obj) is dict:
        items = {k: _snap(v, memo) for k, v in obj.items()}
        if any(items[k] is not obj[k] for k in items):
            out = items
    memo[key] = out
    return out


def _snap_function(fn: types.FunctionType, memo: dict):
    cells = fn.__closure__ or ()
    contents = []
    for c in cells:
        try:
            contents.append(c.cell_contents)
        except ValueError:  # an empty cell (a name not yet bound in the enclosing scope)
            contents.append(_EMPTY_CELL)
    new_contents = [v if v is _EMPTY_CELL else _snap(v, memo) for v in contents]
    defaults = fn.__defaults__
    new_defaults = None if defaults is None else tuple(_snap(v, memo) for v in defaults)
    kwdefaults = fn.__kwdefaults__
    new_kwdefaults = None if kwdefaults is None else {k: _snap(v, memo) for k, v in kwdefaults.items()}
    changed = any(a is not b for a, b in zip(new_contents, contents)) or \
        (defaults is not None and any(a is not b for a, b in zip(new_defaults, defaults))) or \
        (kwdefaults is not None and any(new_kwdefaults[k] is not kwdefaults[k] for k in kwdefaults))
    if not changed:
        return fn
    closure = tuple(types.CellType() if v is _EMPTY_CELL else types.CellType(v) for v in new_contents)
    new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, new_defaults,
                             closure if cells else None)
    new.__kwdefaults__ = new_kwdefaults
    new.__dict__.update(fn.__dict__)
    new.__qualname__, new.__module__, new.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    hit = _cached(fn)  # same code on equal values: the same evaluation method
    if hit is not None:
        _remember(new, hit)
    return new


_EMPTY_CELL = object()


def _snap_mask(m: Mask, memo: dict) -> Mask:
    if m.op == "leaf":
        if m.rule is not None:  # a factory leaf owns what it captured
            return m
        mod = _snap(m.mod, memo)
        return m if mod is m.mod else dataclasses.replace(m, mod=mod)
    kids = tuple(_snap(c, memo) for c in m.children)
    if all(a is b for a, b in zip(kids, m.children)):
        return m
    return dataclasses.replace(m, mod=_combined_mod(m.op, tuple(k.mod for k in kids), m.name),
                               children=kids)


# --------------------------------------------------------------------------------------
# Content digests: what ranks compare so that they compute the same numbers
# --------------------------------------------------------------------------------------

_DIGEST_CHUNK_ELEMS = 1 << 22  # token pairs per chunk when a plain leaf is digested by value


class _Hasher:
    """blake2b over typed, length-prefixed tokens (no id(), no hash() of strings: both
    differ across processes)."""

    def __init__(self, tag: str):
        self.h = hashlib.blake2b(digest_size=20)
        self.put("tag", tag)

    def put(self, kind: str, data) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            data = repr(data).encode()
        self.h.update(f"{kind}:{len(data)}:".encode())
        self.h.update(data)

    def tensor(self, t: torch.Tensor, *, values: bool = True) -> None:
        self.put("tensor", f"{t.dtype}{tuple(t.shape)}")
        if values:
            flat = t.detach().reshape(-1).contiguous().cpu()
            if flat.dtype == torch.bool:
                flat = flat.to(torch.uint8)
            raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
            self.put("bytes", memoryview(raw.numpy()))

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _rule_digest(hs: _Hasher, rule) -> None:
    hs.put("rule", type(rule).__name__)
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        hs.put("field", f.name)
        if isinstance(v, torch.Tensor):
            hs.tensor(v.to(torch.int64) if not v.dtype.is_floating_point else v)
        else:
            hs.put("value", repr(v))


def digest(mask_mod, *, order: torch.Tensor, blocks: torch.Tensor | BlockMap, block_size: int,
           B: int | None = None, H: int | None = None) -> str:
    """A content digest (hex) of a mask, for ranks to check that they compute the same mask.

    Together with the block map (which the plan hashes separately) it decides every value
    the tiles use:

    * a :class:`Mask` from the factories digests its own parameters (name, window / prefix
      sizes, the int64 values of ``doc_ids``), recursively through ``&`` and ``|``;
    * a leaf without a block rule (a plain callable, or :func:`as_mask` of one) is digested
      by **value**: it is evaluated (as :func:`evaluate` would) over every PARTIAL block of
      ``blocks`` and the bits are hashed. FULL and EMPTY blocks are already fixed by the
      block map. This is sound whatever the callable reads (globals, bound methods, module
      state), and costs O(#PARTIAL blocks * block_size²) evaluations.

    Args:
        mask_mod: a :class:`Mask` or a plain mask_mod (the one the plan evaluates).
        order: the layout's global positions ``[S]``; block ``i`` holds
            ``order[i*bs:(i+1)*bs]``.
        blocks: int8 ``[S/bs, S/bs]`` :class:`BlockKind` map in layout order, or the same
            as a :class:`BlockMap` (same digest).
        block_size: bs.
        B, H: the batch / head counts the mask was classified for (None: b = h = 0);
            used for leaves that may read b / h.

    Returns:
        a 40-character hex string, equal across processes for equal masks.
    """
    bs = int(block_size)
    if order.dim() != 1 or order.numel() % bs or tuple(blocks.shape) != (order.numel() // bs,) * 2:
        raise ValueError(f"digest: expected order [S] and blocks [S/block_size]*2 with "
                         f"block_size={bs}; got order {tuple(order.shape)}, blocks "
                         f"{tuple(blocks.shape)}")
    hs = _Hasher("fringe.mask/1")
    ctx = {"order": order, "blocks": blocks, "bs": bs, "B": B, "H": H}
    _mask_digest(hs, mask_mod, ctx)
    return hs.hexdigest()


def _mask_digest(hs: _Hasher, m, ctx: dict) -> None:
    if not isinstance(m, Mask):
        _values_digest(hs, m, ctx, invariant=_digest_invariant(m, declared_bh_invariant(m), ctx))
        return
    hs.put("mask", f"{m.op}/{m.name}/{len(m.children)}/{m.bh_invariant}")
    if m.op != "leaf":
        for c in m.children:
            _mask_digest(hs, c, ctx)
    elif m.rule is not None:
        _rule_digest(hs, m.rule)
    else:
        _values_digest(hs, m.mod, ctx, invariant=_digest_invariant(m.mod, m.bh_invariant, ctx))


def _digest_invariant(mod, decl: bool | None, ctx: dict) -> bool:
    """Whether a leaf's bits are hashed once (b = h = 0): declared or proven invariant."""
    if decl is not None:
        return decl
    order = ctx["order"]
    return order.numel() > 0 and _proven_invariant(mod, order, order)


def _values_digest(hs: _Hasher, mod, ctx: dict, *, invariant: bool) -> None:
    """Hash the bits of ``mod`` over the PARTIAL blocks of the plan's block map."""
    if "partial" not in ctx:
        blocks = ctx["blocks"]
        ctx["partial"] = blocks.nonzero(_PARTIAL) if isinstance(blocks, BlockMap) else \
            (blocks == _PARTIAL).nonzero(as_tuple=True)
    pi, pj = ctx["partial"]
    bs, order = ctx["bs"], ctx["order"]
    nb, nh = (1, 1) if invariant else (ctx["B"] or 1, ctx["H"] or 1)
    hs.put("values", f"{nb}/{nh}/{bs}/{pi.numel()}")
    if not pi.numel():
        return
    pos = order.view(-1, bs)
    method = _method(mod, order, order, nb, nh)
    per = max(1, _DIGEST_CHUNK_ELEMS // (nb * nh * bs * bs))
    for c0 in range(0, pi.numel(), per):
        i, j = pi[c0:c0 + per], pj[c0:c0 + per]
        bits = _eval_pairs(mod, method, pos[i], pos[j], nb, nh)
        hs.put("bits", memoryview(bits.contiguous().view(torch.uint8).cpu().numpy()))


def fn_digest(fn) -> str:
    """A digest (hex) of a callable's code and captured values, for score_mods and the like.

    Covered: the code object (bytecode, names, constants recursively, argument layout),
    defaults and keyword defaults, and the contents of closure cells — tensors by dtype,
    shape and content bytes, numbers / strings / None by repr, tuples, lists, dicts, sets,
    ``functools.partial`` objects, nested functions and :class:`Mask` objects recursively
    (a Mask's plain leaves by their function). Tensors that require grad are digested by
    dtype and shape only: their values legitimately change during training and are kept
    in sync by data parallelism.

    Not covered: module globals the code reads by name (only the name is digested), the
    state of objects it cannot look into — bound methods (the function's code is digested,
    the instance only by its type) and callable instances (type's qualified name, marked
    opaque) — and anything reached through them. Ranks that run the same program with the
    same arguments agree; a rank whose global or attribute differs is not detected.

    Returns:
        a 40-character hex string, equal across processes for equal functions.
    """
    hs = _Hasher("fringe.fn/1")
    _obj_digest(hs, fn, set(), 0)
    return hs.hexdigest()


_MAX_DEPTH = 64


def _sub_digest(obj, seen: set, depth: int) -> str:
    hs = _Hasher("sub")
    _obj_digest(hs, obj, seen, depth)
    return hs.hexdigest()


def _code_digest(hs: _Hasher, code: types.CodeType, seen: set, depth: int) -> None:
    hs.put("code", code.co_code)
    hs.put("names", "\0".join(code.co_names))
    hs.put("vars", "\0".join(code.co_varnames) + "|" + "\0".join(code.co_freevars) + "|" +
           "\0".join(code.co_cellvars))
    hs.put("args", (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                    code.co_flags & 0xFFFF))  # not the __future__ flags a compile() inherits
    hs.put("consts", len(code.co_consts))
    for c in code.co_consts:
        _obj_digest(hs, c, seen, depth + 1)


def _obj_digest(hs: _Hasher, obj, seen: set, depth: int) -> None:  # noqa: C901 - one case per type
    if depth > _MAX_DEPTH:
        hs.put("deep", type(obj).__qualname__)
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str)):
        hs.put(type(obj).__name__, repr(obj))
        return
    if isinstance(obj, (bytes, bytearray)):
        hs.put("bytes", bytes(obj))
        return
    if isinstance(obj, torch.Tensor):
        hs.tensor(obj, values=not obj.requires_grad)
        return
    if isinstance(obj, (torch.dtype, torch.device)):
        hs.put(type(obj).__name__, str(obj))
        return
    if isinstance(obj, types.CodeType):
        _code_digest(hs, obj, seen, depth)
        return
    if isinstance(obj, types.ModuleType):
        hs.put("module", obj.__name__)
        return
    if isinstance(obj, type):
        hs.put("type", f"{obj.__module__}.{obj.__qualname__}")
        return
    key = id(obj)  # cycle guard for this one call only; never part of the digest
    if key in seen:
        hs.put("cycle", type(obj).__qualname__)
        return
    seen.add(key)
    try:
        if isinstance(obj, (tuple, list)):
            hs.put(type(obj).__name__, len(obj))
            for v in obj:
                _obj_digest(hs, v, seen, depth + 1)
        elif isinstance(obj, dict):
            items = sorted((_sub_digest(k, seen, depth + 1), _sub_digest(v, seen, depth + 1))
                           for k, v in obj.items())
            hs.put("dict", "".join(k + v for k, v in items))
        elif isinstance(obj, (set, frozenset)):
            hs.put("set", "".join(sorted(_sub_digest(v, seen, depth + 1) for v in obj)))
        elif isinstance(obj, Mask):
            hs.put("mask", f"{obj.op}/{obj.name}/{len(obj.children)}/{obj.bh_invariant}")
            if obj.op != "leaf":
                for c in obj.children:
                    _obj_digest(hs, c, seen, depth + 1)
            elif obj.rule is not None:
                _rule_digest(hs, obj.rule)
            else:
                _obj_digest(hs, obj.mod, seen, depth + 1)
        elif isinstance(obj, types.FunctionType):
            hs.put("function", obj.__code__.co_name)
            _code_digest(hs, obj.__code__, seen, depth)
            _obj_digest(hs, obj.__defaults__, seen, depth + 1)
            _obj_digest(hs, obj.__kwdefaults__, seen, depth + 1)
            cells = obj.__closure__ or ()
            hs.put("cells", len(cells))
            for c in cells:
                try:
                    v = c.cell_contents
                except ValueError:
                    hs.put("empty-cell", "")
                    continue
                _obj_digest(hs, v, seen, depth + 1)
        elif isinstance(obj, functools.partial):
            hs.put("partial", len(obj.args))
            _obj_digest(hs, obj.func, seen, depth + 1)
            _obj_digest(hs, obj.args, seen, depth + 1)
            _obj_digest(hs, obj.keywords, seen, depth + 1)
        elif isinstance(obj, types.MethodType):
            owner = type(obj.__self__)
            hs.put("opaque-method", f"{owner.__module__}.{owner.__qualname__}")
            _obj_digest(hs, obj.__func__, seen, depth + 1)
        elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            hs.put("builtin", f"{getattr(obj, '__module__', None)}.{obj.__qualname__}")
        else:
            t = type(obj)
            hs.put("opaque", f"{t.__module__}.{t.__qualname__}")
    finally:
        seen.discard(key)
