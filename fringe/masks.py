"""Mask mods with global token indices, their composition, and exact block classification.

A mask_mod has FlexAttention's signature ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``
where ``q_idx`` / ``kv_idx`` are **global** token positions (a layout permutes tokens, so a
rank's local row i is global position ``layout.positions(rank)[i]``).

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` / ``Lk`` query / key lengths (local, in
layout order), ``bs`` block size, ``nQb = Lq / bs`` and ``nKb = Lk / bs`` block counts.

Three layers:

* :class:`Mask` — a frozen, named, composable mask_mod. Factories :func:`full`,
  :func:`causal`, :func:`sliding_window`, :func:`document`, :func:`prefix_lm` and
  :func:`as_mask`; ``&`` / ``|`` behave like torch's ``and_masks`` / ``or_masks``.
* :func:`evaluate` — the dense mask ``[B or 1, H or 1, Lq, Lk]``. Fast path: call the
  mask_mod once on broadcast index tensors. Fallback (only when broadcasting raises):
  torch's public ``create_mask`` (vmap), which also accepts mods written for scalars.
* :func:`classify` — the exact block map ``[nQb, nKb]`` (int8 :class:`BlockKind` codes)
  for arbitrary global index sets, without evaluating all pairs for structured masks.

How ``classify`` stays exact and cheap: every block is summarised by the min / max of
its positions and whether its sorted positions form an arithmetic progression (stride 1:
a contiguous run). Structured leaves decide a block pair from those summaries and answer
EMPTY / PARTIAL / FULL, or UNKNOWN where the summaries cannot decide; ``&`` / ``|``
combine codes with UNKNOWN (AND: any EMPTY -> EMPTY, FULL -> the other; OR: dually).
Block pairs left UNKNOWN — and every pair of an arbitrary callable — are resolved by
evaluating the mask_mod on just those blocks, in bounded-memory chunks. The result is
always equal to the block-wise reduction of the dense mask.

>>> m = causal() & document(torch.tensor([0, 0, 1, 1]))
>>> m
causal & document(2 docs)
>>> classify(m, torch.arange(4), torch.arange(4), block_size=2).tolist()
[[1, 0], [0, 1]]
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import Callable

import torch

from .layout import DEFAULT_BLOCK_SIZE  # the one default block size (tokens per side)

MaskMod = Callable[..., torch.Tensor]

__all__ = [
    "BlockKind",
    "Mask",
    "MaskError",
    "MaskMod",
    "as_mask",
    "causal",
    "classify",
    "document",
    "evaluate",
    "full",
    "prefix_lm",
    "reads_batch_head",
    "sliding_window",
]


# Memory bounds (elements) for the temporaries of classify.
_ROW_CHUNK_ELEMS = 1 << 15  # block-pair codes per row chunk: [rows, nKb]
_DENSE_CHUNK_ELEMS = 1 << 16  # token pairs per dense resolution chunk: [n, B, H, bs, bs]


class BlockKind(enum.IntEnum):
    """Classification of a (q-block, kv-block) tile; stored as int8 in block maps."""

    EMPTY = 0
    PARTIAL = 1
    FULL = 2


_UNKNOWN = 3  # internal only: the block summaries cannot decide; resolve densely
_EMPTY, _PARTIAL, _FULL = int(BlockKind.EMPTY), int(BlockKind.PARTIAL), int(BlockKind.FULL)


class MaskError(ValueError):
    """A mask_mod that cannot be evaluated as a mask; the message says how to fix it."""


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
        srt = pos.sort(dim=1).values
        lo, hi = srt[:, 0], srt[:, -1]
        if block_size == 1:
            stride = torch.ones_like(lo)
        else:
            d = srt[:, 1:] - srt[:, :-1]
            step = d[:, 0]
            is_ap = (d == step[:, None]).all(dim=1) & (step > 0)
            stride = torch.where(is_ap, step, torch.zeros_like(step))
        return _Blocks(pos=pos, lo=lo, hi=hi, stride=stride)

    @property
    def block_size(self) -> int:
        return self.pos.shape[1]


# A rule sees the q and kv block summaries once and returns a function of a row range
# (r0, r1) that gives int8 codes [r1 - r0, nKb] in {EMPTY, PARTIAL, FULL, UNKNOWN}.
_RowCodes = Callable[[int, int], torch.Tensor]


def _codes(full: torch.Tensor, empty: torch.Tensor, partial: torch.Tensor | None) -> torch.Tensor:
    """int8 codes from exact FULL / EMPTY predicates; ``partial`` marks the pairs that are
    certainly PARTIAL when neither FULL nor EMPTY (None: all of them), the rest UNKNOWN."""
    rest = _PARTIAL if partial is None else torch.where(partial, _PARTIAL, _UNKNOWN)
    return torch.where(empty, _EMPTY, torch.where(full, _FULL, rest)).to(torch.int8)


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

    def prepare(self, qb: _Blocks, kb: _Blocks) -> _RowCodes:
        bs = qb.block_size
        lo, hi = self.lo, self.hi

        def rows(r0: int, r1: int) -> torch.Tensor:
            qlo, qhi = qb.lo[r0:r1, None], qb.hi[r0:r1, None]
            dmin = qlo - kb.hi[None, :]
            dmax = qhi - kb.lo[None, :]
            full = torch.ones_like(dmin, dtype=torch.bool)
            empty = torch.zeros_like(dmin, dtype=torch.bool)
            if lo is not None:
                full &= dmin >= lo
                empty |= dmax < lo
            if hi is not None:
                full &= dmax <= hi
                empty |= dmin > hi
            if lo is None or hi is None:
                return _codes(full, empty, None)
            inside = ((dmin >= lo) & (dmin <= hi)) | ((dmax >= lo) & (dmax <= hi))
            s = qb.stride[r0:r1, None]
            same = (s > 0) & (s == kb.stride[None, :])
            s1 = torch.where(same, s, torch.ones_like(s))
            d0 = qlo - kb.lo[None, :]
            kmin = torch.clamp(-torch.div(d0 - lo, s1, rounding_mode="floor"), min=-(bs - 1))
            kmax = torch.clamp(torch.div(hi - d0, s1, rounding_mode="floor"), max=bs - 1)
            decided = inside | same
            hit = inside | (same & (kmin <= kmax))
            out = _codes(full, empty, decided)
            # decided and no difference inside the band: EMPTY after all
            return torch.where(decided & ~hit & ~full, torch.tensor(_EMPTY, dtype=torch.int8), out)

        return rows


@dataclasses.dataclass(frozen=True)
class _KvBelow:
    """``kv_idx < n``: exact for any sets from min / max."""

    n: int

    def prepare(self, qb: _Blocks, kb: _Blocks) -> _RowCodes:
        code = _codes(kb.hi < self.n, kb.lo >= self.n, None)  # [nKb]

        def rows(r0: int, r1: int) -> torch.Tensor:
            return code[None, :].expand(r1 - r0, -1)

        return rows


@dataclasses.dataclass(frozen=True, eq=False)
class _Document:
    """``doc_ids[q_idx] == doc_ids[kv_idx]``.

    FULL iff all four doc min / max are equal; PARTIAL if they are not all equal and some
    doc is shared; EMPTY iff no doc is shared. A shared doc is certain when the doc ranges
    overlap and both blocks are contiguous runs over non-decreasing ``doc_ids`` (packed
    documents: a run's docs are every doc id in its range), or when an endpoint of one range
    is a single-doc block lying inside a contiguous block's range; else disjoint doc ranges
    give EMPTY and the rest is UNKNOWN.
    """

    doc_ids: torch.Tensor
    sorted_ids: bool

    def _summ(self, b: _Blocks) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        n = self.doc_ids.numel()
        if b.pos.numel() and (int(b.hi.max()) >= n or int(b.lo.min()) < 0):
            raise MaskError(
                f"document: positions span [{int(b.lo.min())}, {int(b.hi.max())}] but doc_ids "
                f"has {n} entries; give one doc id per global position (0..S-1)"
            )
        d = self.doc_ids.to(b.pos.device)[b.pos]
        dlo, dhi = d.min(dim=1).values, d.max(dim=1).values
        run = (b.stride == 1) & self.sorted_ids
        return dlo, dhi, run

    def prepare(self, qb: _Blocks, kb: _Blocks) -> _RowCodes:
        qlo, qhi, qrun = self._summ(qb)
        klo, khi, krun = self._summ(kb)

        def rows(r0: int, r1: int) -> torch.Tensor:
            a, b = qlo[r0:r1, None], qhi[r0:r1, None]
            c, d = klo[None, :], khi[None, :]
            full = (a == b) & (c == d) & (a == c)
            empty = (b < c) | (d < a)
            qr, kr = qrun[r0:r1, None], krun[None, :]
            shared = (qr & kr) | (qr & (c == d)) | (kr & (a == b))
            return _codes(full, empty, shared)

        return rows


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
        bh_invariant: True when the mask ignores ``b`` and ``h``. Every factory is. A plain
            callable wrapped by :func:`as_mask` is *assumed* invariant, as FlexAttention
            assumes with ``B=None, H=None``; pass ``bh_invariant=False`` to have
            :func:`classify` take the union over ``b < B``, ``h < H``.
        op: ``"leaf"``, ``"and"`` or ``"or"``; ``children`` are the operands.
        rule: the structured block rule of a leaf (None: classified densely).
    """

    mod: MaskMod
    name: str
    bh_invariant: bool = True
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
    mods = tuple(k.mod for k in kids)
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
    name = f" {'&' if op == 'and' else '|'} ".join(parts)
    mod.__name__ = name
    return Mask(mod=mod, name=name, bh_invariant=all(k.bh_invariant for k in kids), op=op,
                children=tuple(kids), display_op=op)


def as_mask(fn, name: str | None = None, *, bh_invariant: bool = True) -> Mask:
    """Wrap an arbitrary mask_mod (returned unchanged if it already is a :class:`Mask`).

    Args:
        fn: ``fn(b, h, q_idx, kv_idx) -> bool tensor`` on global indices.
        name: display name; defaults to ``fn.__name__``.
        bh_invariant: whether ``fn`` ignores ``b`` / ``h`` (assumed, like FlexAttention's
            ``B=None, H=None``; set False if it reads them).

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
    return Mask(mod=fn, name=name or getattr(fn, "__name__", "mask_mod"),
                bh_invariant=bh_invariant)


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
    """
    if not isinstance(doc_ids, torch.Tensor):
        doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.dim() != 1 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool \
            or doc_ids.is_complex():
        raise ValueError(f"document: doc_ids must be a 1-D integer tensor over global positions, "
                         f"got dtype={doc_ids.dtype} shape={tuple(doc_ids.shape)}")
    doc_ids = doc_ids.detach()
    n_docs = int(torch.unique(doc_ids).numel())
    sorted_ids = bool((doc_ids[1:] >= doc_ids[:-1]).all())

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
# Dense evaluation
# --------------------------------------------------------------------------------------

_CONTROL_FLOW_HINT = (
    "mask_mod uses Python control flow on tensors (if / and / or / not, bool(), or a "
    "data-dependent branch); a mask_mod is called on whole index tensors, so write it with "
    "tensor ops: & instead of 'and', | instead of 'or', ~ instead of 'not', and "
    "torch.where(cond, a, b) instead of 'a if cond else b'"
)


def _is_control_flow_error(e: BaseException) -> bool:
    s = str(e)
    return ("Boolean value of Tensor" in s and "ambiguous" in s) or "data-dependent control flow" in s


def _check_result(out, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a mask_mod result and broadcast it to ``shape``.

    A wrong dtype raises :class:`MaskError`; a shape that does not broadcast raises
    torch's RuntimeError, so that the caller can fall back to vmap.
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


def evaluate(mask_mod: MaskMod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             B: int | None = None, H: int | None = None, method: str = "auto") -> torch.Tensor:
    """Evaluate ``mask_mod`` densely on global positions.

    Args:
        mask_mod: a :class:`Mask` or any ``(b, h, q_idx, kv_idx) -> bool tensor``.
        q_pos, kv_pos: 1-D int tensors of global positions (any order).
        B, H: batch / head counts to evaluate (None: 1, i.e. ``b = h = 0``).
        method: ``"auto"`` (broadcast, falling back to vmap when broadcasting raises),
            ``"broadcast"`` or ``"vmap"`` (torch's ``create_mask``).

    Returns:
        bool tensor ``[B or 1, H or 1, Lq, Lk]`` (possibly an expanded view).

    Raises:
        MaskError: the mask_mod returns a non-bool result or uses Python control flow.
    """
    if method not in ("auto", "broadcast", "vmap"):
        raise ValueError(f"evaluate: method={method!r}; use 'auto', 'broadcast' or 'vmap'")
    dev = q_pos.device
    nb, nh, lq, lk = B or 1, H or 1, q_pos.numel(), kv_pos.numel()
    shape = (nb, nh, lq, lk)
    first: BaseException | None = None
    if method != "vmap":
        b = torch.arange(nb, device=dev).view(-1, 1, 1, 1)
        h = torch.arange(nh, device=dev).view(1, -1, 1, 1)
        try:
            out = mask_mod(b, h, q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))
            return _check_result(out, shape)
        except MaskError:
            raise
        except Exception as e:  # noqa: BLE001 - anything else: try the vmap path
            if method == "broadcast":
                if _is_control_flow_error(e):
                    raise MaskError(_CONTROL_FLOW_HINT) from e
                raise
            first = e
    if 0 in shape:  # vmap cannot index an empty position tensor; nothing to evaluate
        return torch.zeros(shape, dtype=torch.bool, device=dev)
    from torch.nn.attention.flex_attention import create_mask

    def by_index(b, h, qi, ki):
        return mask_mod(b, h, q_pos[qi], kv_pos[ki])

    try:
        out = create_mask(by_index, nb, nh, lq, lk, device=dev)
    except Exception as e:  # noqa: BLE001
        if _is_control_flow_error(e) or (first is not None and _is_control_flow_error(first)):
            raise MaskError(_CONTROL_FLOW_HINT) from e
        if first is not None:
            raise RuntimeError(f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!s} failed "
                               f"when broadcast ({first}) and under vmap ({e})") from e
        raise
    return _check_result(out, shape)


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


def _prepare(m: Mask, qb: _Blocks, kb: _Blocks) -> _RowCodes:
    if m.op == "leaf":
        if m.rule is None:
            nk = kb.lo.numel()
            return lambda r0, r1: torch.full((r1 - r0, nk), _UNKNOWN, dtype=torch.int8,
                                             device=qb.pos.device)
        return m.rule.prepare(qb, kb)
    kids = [_prepare(c, qb, kb) for c in m.children]
    comb = _and_codes if m.op == "and" else _or_codes

    def rows(r0: int, r1: int) -> torch.Tensor:
        out = kids[0](r0, r1)
        for k in kids[1:]:
            out = comb(out, k(r0, r1))
        return out

    return rows


def _dense_codes(mod: MaskMod, qpos: torch.Tensor, kpos: torch.Tensor,
                 nb: int, nh: int) -> torch.Tensor:
    """Exact codes for block pairs given as gathered positions ``[n, bs]`` each."""
    n, bs = qpos.shape
    dev = qpos.device
    shape = (n, nb, nh, bs, bs)
    b = torch.arange(nb, device=dev).view(1, -1, 1, 1, 1)
    h = torch.arange(nh, device=dev).view(1, 1, -1, 1, 1)
    try:
        m = _check_result(mod(b, h, qpos.view(n, 1, 1, bs, 1), kpos.view(n, 1, 1, 1, bs)), shape)
    except MaskError:
        raise
    except Exception:  # noqa: BLE001 - mod does not broadcast over an extra dim: go pair by pair
        m = torch.stack([evaluate(mod, qpos[i], kpos[i], B=nb, H=nh) for i in range(n)])
    flat = m.reshape(n, -1)
    allv, anyv = flat.all(dim=1), flat.any(dim=1)
    return torch.where(allv, _FULL, torch.where(anyv, _PARTIAL, _EMPTY)).to(torch.int8)


def reads_batch_head(mask_mod: MaskMod) -> tuple[bool, bool]:
    """Whether ``mask_mod`` reads ``b`` / ``h``, probed by broadcasting (no evaluation of S² pairs).

    The mod is called once with ``b`` of shape ``[2, 1, 1, 1]`` and ``h`` of shape ``[1, 2, 1, 1]``
    on a 2x2 tile: an output that broadcasts along a dimension read that index. A mod that
    cannot be broadcast (it only works under vmap) is reported as reading neither.

    Returns:
        ``(reads_b, reads_h)``.
    """
    idx = torch.arange(2)
    try:
        out = mask_mod(idx.view(2, 1, 1, 1), idx.view(1, 2, 1, 1), idx.view(1, 1, 2, 1),
                       idx.view(1, 1, 1, 2))
    except Exception:           # noqa: BLE001 - evaluate()/classify() report real errors
        return False, False
    shape = tuple(torch.as_tensor(out).shape)
    shape = (1,) * (4 - len(shape)) + shape
    return shape[0] == 2, shape[1] == 2


def classify(mask_mod: MaskMod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             block_size: int = DEFAULT_BLOCK_SIZE, B: int | None = None, H: int | None = None,
             stats: dict | None = None) -> torch.Tensor:
    """Exact block map of ``mask_mod`` over arbitrary global index sets.

    Block ``i`` of q is ``q_pos[i*bs:(i+1)*bs]`` (likewise kv); positions may be in any
    order (layouts permute tokens). The result equals the block-wise reduction of
    ``evaluate(mask_mod, q_pos, kv_pos)``: all-true -> FULL, all-false -> EMPTY, else
    PARTIAL. Structured masks decide most block pairs from block summaries; only the
    pairs they cannot decide (and every pair of an arbitrary callable) are evaluated,
    in chunks of bounded memory.

    Args:
        mask_mod: a :class:`Mask` or a plain mask_mod (wrapped with :func:`as_mask`).
        q_pos, kv_pos: 1-D int tensors of global positions, lengths divisible by block_size.
        block_size: tokens per block side.
        B, H: for masks that read ``b`` / ``h`` (``bh_invariant=False``): the block kind is
            the union over ``b < B``, ``h < H`` (FULL only if full for all, EMPTY only if
            empty for all). Ignored for invariant masks.
        stats: optional dict, filled with ``block_pairs``, ``dense_blocks`` (block pairs
            evaluated densely), ``dense_pairs`` (token pairs evaluated, times B*H) and
            ``seconds``.

    Returns:
        int8 tensor ``[Lq / block_size, Lk / block_size]`` of :class:`BlockKind` codes.

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
    dev = q_pos.device
    kv_pos = kv_pos.to(dev)
    nqb, nkb = q_pos.numel() // bs, kv_pos.numel() // bs
    # a plain callable is invariant only if it does not read b / h (probed by broadcasting)
    invariant = mask.bh_invariant and (isinstance(mask_mod, Mask)
                                       or not any(reads_batch_head(mask_mod)))
    nb, nh = (1, 1) if invariant else (B or 1, H or 1)
    out = torch.empty((nqb, nkb), dtype=torch.int8, device=dev)
    dense_blocks = 0
    if nqb and nkb:
        qb, kb = _Blocks.of(q_pos, bs), _Blocks.of(kv_pos, bs)
        rows = _prepare(mask, qb, kb)
        step = max(1, _ROW_CHUNK_ELEMS // nkb)
        per = max(1, _DENSE_CHUNK_ELEMS // (nb * nh * bs * bs))
        for r0 in range(0, nqb, step):
            r1 = min(nqb, r0 + step)
            codes = rows(r0, r1).clone()
            pi, pj = (codes == _UNKNOWN).nonzero(as_tuple=True)
            for c0 in range(0, pi.numel(), per):
                i, j = pi[c0:c0 + per], pj[c0:c0 + per]
                codes[i, j] = _dense_codes(mask.mod, qb.pos[i + r0], kb.pos[j], nb, nh)
            dense_blocks += pi.numel()
            out[r0:r1] = codes
    if stats is not None:
        stats.update(block_pairs=nqb * nkb, dense_blocks=dense_blocks,
                     dense_pairs=dense_blocks * bs * bs * nb * nh,
                     seconds=time.perf_counter() - t0)
    return out
