"""Packed batches: document ids from ``cu_seqlens`` / ``position_ids``, and this rank's shard.

Two conventions describe where the documents of a packed row start:

* ``cu_seqlens`` (flash-attn varlen): cumulative lengths ``[0, n0, n0+n1, ..., S]``.
* ``position_ids`` (transformers): positions restart per document; a new document starts
  wherever consecutive position ids do not step by exactly 1 (what transformers'
  ``find_packed_sequence_indices`` detects, so the masks agree).

Both become ``doc_ids`` (``[S]``, or ``[B, S]`` when rows differ), and :func:`document_mask`
turns those into a mask_mod. :func:`shard_batch` takes the **global** packed batch and a plan
(or several plans over one layout) and returns this rank's :class:`Shard`: local input ids,
labels **shifted before sharding** (shifting after sharding silently drops the target of the
last token on every rank), global RoPE positions and the layout's fingerprint.

Labels follow transformers' convention by default: ``labels`` are aligned with
``input_ids`` (usually ``labels = input_ids``) and the next-token shift happens in the loss,
so :func:`shard_batch` shifts them (``shift=True``) on the global sequence. Labels that are
already next-token targets (``labels[:, i]`` is the target of token ``i``, what transformers
calls ``shift_labels``) are passed with ``shift=False`` and used as given; ``shift=True`` on
such labels (they equal ``input_ids`` moved one to the left) raises rather than shift twice.

A length the layout does not take is padded at the end (:func:`pad_batch`, or
:func:`shard_batch` itself for plans made by :func:`pad_mask`): the pad tokens attend to
nothing and nothing attends to them (:func:`real_tokens`, a structured rule, so blocks wholly
in the padding are EMPTY: never computed, never sent), their labels are ignored and the
loss counts real tokens only.

>>> doc_ids_from_cu_seqlens(torch.tensor([0, 3, 5, 8])).tolist()
[0, 0, 0, 1, 1, 2, 2, 2]
>>> doc_ids_from_position_ids(torch.tensor([0, 1, 2, 0, 1, 0, 1, 2])).tolist()
[0, 0, 0, 1, 1, 2, 2, 2]
>>> shift_labels(torch.tensor([[5, 6, 7, 8, 9]]), torch.tensor([0, 0, 0, 1, 1])).tolist()
[[6, 7, -100, 9, -100]]

Legend: B batch · S global sequence · L = S / P tokens on one rank · P world size.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import operator
import weakref
from typing import Mapping, Sequence

import torch

from . import masks as _masks
from .masks._kinds import _UNKNOWN

__all__ = ["IGNORE_INDEX", "BatchKey", "Shard", "check_batch", "doc_ids_from_cu_seqlens",
           "doc_ids_from_position_ids", "document_mask", "global_token_count", "loss_sum",
           "pad_batch", "pad_mask", "plan_batch_key", "positions_in_document", "real_len_of",
           "real_tokens", "shard_batch", "shift_labels", "token_weighted_loss"]

#: The label that cross-entropy ignores (torch's and transformers' default ``ignore_index``).
IGNORE_INDEX = -100


def _int_tensor(x, name: str) -> torch.Tensor:
    t = torch.as_tensor(x)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise ValueError(f"{name} must hold integers, got dtype={t.dtype}")
    return t.to(torch.int64)


# --------------------------------------------------------------------------------------
# document ids
# --------------------------------------------------------------------------------------


def _one_cu(cu: torch.Tensor, seq_len: int, name: str) -> torch.Tensor:
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D [num_docs + 1] (e.g. [0, 3, 8] for documents of 3 "
                         f"and 5 tokens), got shape {tuple(cu.shape)}")
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0 (cumulative document lengths), got {cu[0].item()}; "
                         f"prepend 0")
    lengths = cu[1:] - cu[:-1]
    if bool((lengths < 0).any()):
        i = int((lengths < 0).nonzero()[0])
        raise ValueError(f"{name} must be non-decreasing (document lengths >= 0), but entry {i + 1} "
                         f"({cu[i + 1].item()}) < entry {i} ({cu[i].item()}): document {i} has "
                         f"length {lengths[i].item()}")
    if int(cu[-1]) != seq_len:
        raise ValueError(f"{name} must end at the sequence length S={seq_len}, got {cu[-1].item()}; "
                         f"the last entry is the total number of tokens (pad the batch and append "
                         f"the padding as its own document)")
    return torch.repeat_interleave(torch.arange(lengths.numel()), lengths)


def doc_ids_from_cu_seqlens(cu_seqlens, *, seq_len: int | None = None,
                            batch_size: int | None = None) -> torch.Tensor:
    """Document ids from cumulative sequence lengths (flash-attn's varlen convention).

    Empty documents (repeated entries) are allowed and get no tokens.

    Args:
        cu_seqlens: ``[n+1]`` int, ``0 = c_0 <= c_1 <= ... <= c_n = S``; or a list of B such
            tensors (one per row, each ending at S; or ``[B, n+1]`` when every row has n
            documents); or one tensor over a flattened batch of
            ``batch_size`` rows ending at ``B*S`` (flash-attn's varlen layout), in which case
            every row boundary must be a document boundary.
        seq_len: S; defaults to the last entry (or that over ``batch_size`` for a flattened batch).
        batch_size: B, for a flattened ``cu_seqlens`` over ``B*S`` tokens.

    Returns:
        int64 ``[S]`` doc ids (ids count up from 0), or ``[B, S]`` for per-row boundaries.

    Raises:
        ValueError: not starting at 0, decreasing, not ending at S, or a document crossing rows.
    """
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 2:     # [B, n+1]: one per row
        cu_seqlens = list(cu_seqlens)
    if isinstance(cu_seqlens, (list, tuple)) and cu_seqlens and not isinstance(cu_seqlens[0], int):
        rows = [_int_tensor(c, f"cu_seqlens[{b}]") for b, c in enumerate(cu_seqlens)]
        S = int(rows[0][-1]) if seq_len is None else seq_len
        return torch.stack([_one_cu(c, S, f"cu_seqlens[{b}]") for b, c in enumerate(rows)])
    cu = _int_tensor(cu_seqlens, "cu_seqlens")
    if batch_size is None:
        S = int(cu[-1]) if seq_len is None and cu.numel() else seq_len
        return _one_cu(cu, S if S is not None else 0, "cu_seqlens")
    total = int(cu[-1]) if cu.numel() else 0
    if total % batch_size:
        raise ValueError(f"cu_seqlens ends at {total} tokens, which is not batch_size={batch_size} "
                         f"rows of equal length")
    S = total // batch_size if seq_len is None else seq_len
    ids = _one_cu(cu, batch_size * S, "cu_seqlens").view(batch_size, S)
    for b in range(1, batch_size):
        if int(ids[b, 0]) == int(ids[b - 1, -1]):
            raise ValueError(f"cu_seqlens: document {int(ids[b, 0])} crosses from row {b - 1} into "
                             f"row {b} (at token {b * S}); add {b * S} to cu_seqlens")
    return ids - ids[:, :1]


def doc_ids_from_position_ids(position_ids) -> torch.Tensor:
    """Document ids from position ids that restart per document (transformers' packing).

    A new document starts wherever consecutive position ids do not step by exactly 1, as in
    transformers' ``find_packed_sequence_indices``.

    Args:
        position_ids: int ``[S]``, ``[1, S]`` or ``[B, S]``, non-negative.

    Returns:
        int64 ``[S]`` (for ``[S]`` / ``[1, S]``, or ``[B, S]`` whose rows agree) or ``[B, S]``.

    Raises:
        ValueError: wrong rank, negative or non-integer positions.
    """
    pos = _int_tensor(position_ids, "position_ids")
    if pos.dim() not in (1, 2) or pos.shape[-1] < 1:
        raise ValueError(f"position_ids must be [S] or [B, S] with S >= 1, got shape {tuple(pos.shape)}")
    if bool((pos < 0).any()):
        raise ValueError(f"position_ids must be >= 0 (positions within each document), got "
                         f"min {pos.min().item()}")
    two_d = pos.dim() == 2
    pos = pos.view(-1, pos.shape[-1])
    new_doc = torch.ones_like(pos, dtype=torch.bool)
    new_doc[:, 1:] = (pos[:, 1:] - pos[:, :-1]) != 1
    ids = new_doc.cumsum(dim=1) - 1
    if not two_d or bool((ids == ids[:1]).all()):
        return ids[0]
    return ids


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its document (RoPE positions that restart per document).

    Args:
        doc_ids: int ``[S]`` or ``[B, S]``; a document is a run of equal ids.

    Returns:
        int64, same shape.
    """
    ids = _int_tensor(doc_ids, "doc_ids")
    flat = ids.view(-1, ids.shape[-1])
    S = flat.shape[-1]
    start = torch.ones_like(flat, dtype=torch.bool)
    start[:, 1:] = flat[:, 1:] != flat[:, :-1]
    idx = torch.arange(S).expand_as(flat)
    first = torch.where(start, idx, torch.zeros_like(idx)).cummax(dim=1).values
    return (idx - first).view(ids.shape)


@dataclasses.dataclass(frozen=True, eq=False)
class _RowDocuments:
    """Block rule for ``doc_ids[b, q] == doc_ids[b, kv]``: the union over rows of each row's
    exact :func:`fringe.masks.document` rule (FULL only if FULL in every row, EMPTY only if
    EMPTY in every row, PARTIAL if any row is PARTIAL or rows differ; undecided pairs are
    resolved densely by :func:`fringe.masks.classify`).

    Attributes:
        row_doc_ids: int64 ``[B, S]`` (a dataclass field, so that plan digests hash it; not
            named ``doc_ids``, which plan() reads as one id per position).
    """

    row_doc_ids: torch.Tensor

    def prepare(self, qt, kt):
        """The quadtree rule of :func:`fringe.masks.classify`: ``cells(level, i, j)`` codes."""
        rows = [_masks.document(row).rule.prepare(qt, kt) for row in self.row_doc_ids]
        E, P, F = (int(k) for k in (_masks.BlockKind.EMPTY, _masks.BlockKind.PARTIAL,
                                    _masks.BlockKind.FULL))
        U = _UNKNOWN            # undecided: refine (nodes) or evaluate (blocks)

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            cs = torch.stack([r(level, i, j) for r in rows])       # [B, cells]
            all_e, all_f = (cs == E).all(0), (cs == F).all(0)
            any_p = (cs == P).any(0) | ((cs == E).any(0) & (cs == F).any(0))
            rest = torch.full_like(cs[0], U)
            if level == 0:                      # a block: PARTIAL as soon as rows disagree
                rest = torch.where(any_p & ~(cs == U).all(0), torch.full_like(rest, P), rest)
            return torch.where(all_e, E, torch.where(all_f, F, rest)).to(torch.int8)
        return cells


def document_mask(doc_ids: torch.Tensor, *, real_len: int | None = None) -> _masks.Mask:
    """The mask_mod for packed documents: a token attends only within its document.

    Args:
        doc_ids: int ``[S]`` (every row of the batch has the same boundaries) or ``[B, S]``
            (per row). A ``[B, S]`` mask reads ``b``: plan it with ``batch_size=B``.
        real_len: for a batch padded by :func:`pad_batch` (``out["real_len"]``): the tokens
            at positions ``>= real_len`` attend to nothing and nothing attends to them
            (``& real_tokens(real_len)``). None: no padding.

    Returns:
        ``masks.document(doc_ids)`` for ``[S]`` (or ``[B, S]`` with equal rows); for rows
        that differ, a mask with ``doc_ids[b, q] == doc_ids[b, kv]`` whose block
        classification is exact from per-row summaries (no S² evaluation).
    """
    m = _document_mask(doc_ids)
    if real_len is None:
        return m
    S = _int_tensor(doc_ids, "doc_ids").shape[-1]
    if isinstance(real_len, bool) or not isinstance(real_len, int) or not 1 <= real_len <= S:
        raise ValueError(f"document_mask: real_len must be an int in [1, S={S}] (the tokens before "
                         f"padding), got {real_len!r}")
    return m & real_tokens(real_len)


def _document_mask(doc_ids: torch.Tensor) -> _masks.Mask:
    ids = _int_tensor(doc_ids, "doc_ids")
    if ids.dim() == 2 and bool((ids == ids[:1]).all()):
        ids = ids[0]
    if ids.dim() == 1:
        return _masks.document(ids)
    if ids.dim() != 2:
        raise ValueError(f"doc_ids must be [S] or [B, S], got shape {tuple(ids.shape)}")
    ids = ids.detach().clone()

    def row_document_mod(b, h, q_idx, kv_idx):
        t = ids.to(q_idx.device)
        return t[b, q_idx] == t[b, kv_idx]

    n = int(ids.max()) + 1 if ids.numel() else 0
    name = f"document({ids.shape[0]} rows, <= {n} docs)"
    row_document_mod.__name__ = name
    return _masks.Mask(mod=row_document_mod, name=name, bh_invariant=False, rule=_RowDocuments(ids))


# --------------------------------------------------------------------------------------
# padding that attends to nothing
# --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _RealTokens:
    """Block rule for ``q_idx < n and kv_idx < n`` (tokens at positions ``>= n`` are padding).

    Exact for any position sets from the attained min / max of each side: FULL iff both
    maxima are ``< n``; EMPTY iff either minimum is ``>= n``; otherwise a single block pair
    holds an allowed pair (the two minima) and a masked one (a maximum), so it is PARTIAL,
    and a quadtree node is refined.

    Attributes:
        n: the number of real tokens (a dataclass field: plan digests hash it).
    """

    n: int

    def prepare(self, qt, kt):
        """The quadtree rule of :func:`fringe.masks.classify`: ``cells(level, i, j)`` codes."""
        n = self.n
        E, P, F = (int(k) for k in (_masks.BlockKind.EMPTY, _masks.BlockKind.PARTIAL,
                                    _masks.BlockKind.FULL))
        U = _UNKNOWN

        def cells(level: int, i: torch.Tensor, j: torch.Tensor) -> torch.Tensor:
            full = (qt.hi[level][i] < n) & (kt.hi[level][j] < n)
            empty = (qt.lo[level][i] >= n) | (kt.lo[level][j] >= n)
            rest = torch.full(i.shape, P if level == 0 else U, dtype=torch.int8)
            return torch.where(empty, E, torch.where(full, F, rest)).to(torch.int8)
        return cells


def real_tokens(n: int) -> _masks.Mask:
    """The mask that removes padding: ``q_idx < n and kv_idx < n``.

    Compose it with the batch's mask (``mask & real_tokens(S)``): the tokens at positions
    ``>= n`` (the padding :func:`pad_batch` appends) then attend to nothing and nothing
    attends to them. Their rows follow FlexAttention's semantics for a fully masked row
    (out 0, lse -inf, gradients 0). Its block classification is exact from the blocks'
    min / max positions, so blocks wholly in the padding are EMPTY: never computed, and a
    rank's kv chunk that only padding would need is never sent.

    Args:
        n: the number of real tokens (S before padding), >= 1.

    Returns:
        a :class:`fringe.masks.Mask` with a structured block rule.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"real_tokens: n must be an int >= 1 (the number of real tokens before "
                         f"padding), got {n!r}")

    def real_tokens_mod(b, h, q_idx, kv_idx):
        return (q_idx < n) & (kv_idx < n)

    name = f"real_tokens({n})"
    real_tokens_mod.__name__ = name
    return _masks.Mask(mod=real_tokens_mod, name=name, rule=_RealTokens(n))


def real_len_of(mask) -> int | None:
    """The ``n`` of a :func:`real_tokens` term ANDed into ``mask`` (the smallest if several),
    or None when the mask does not remove padding."""
    if not isinstance(mask, _masks.Mask):
        return None
    if mask.op == "leaf":
        return mask.rule.n if isinstance(mask.rule, _RealTokens) else None
    if mask.op != "and":
        return None
    found = [n for n in (real_len_of(c) for c in mask.children) if n is not None]
    return min(found) if found else None


def _extend_leaf(m: _masks.Mask, n: int, padded: int) -> _masks.Mask | None:
    """``m`` over ``padded`` positions (None: ``m`` is already defined there)."""
    rule = m.rule
    ids = rule.row_doc_ids if isinstance(rule, _RowDocuments) else (
        getattr(rule, "doc_ids", None) if rule is not None else None)
    if isinstance(ids, torch.Tensor):                       # document ids: one per position
        if ids.shape[-1] == padded:                         # already over the padded length
            return None
        if ids.shape[-1] != n:
            raise ValueError(f"pad_mask: {m.name} has {ids.shape[-1]} document ids per row but "
                             f"real_len={n} (padded_len={padded}); give one id per real token")
        if isinstance(rule, _RowDocuments):
            fill = ids.max(dim=1, keepdim=True).values + 1                  # a document of its own
            return document_mask(torch.cat([ids, fill.expand(-1, padded - n)], dim=1))
        fill = (int(ids.max()) + 1) if ids.numel() else 0
        return _masks.document(torch.cat([ids, ids.new_full((padded - n,), fill)]))
    if rule is not None:     # band / prefix / real_tokens rules: arithmetic on positions, total
        return None
    return _clamped(m.mod, n, name=m.name, bh_invariant=m.bh_invariant)


def _clamped(fn, n: int, *, name: str, bh_invariant: bool | None) -> _masks.Mask:
    """``fn`` evaluated at positions clamped to ``n - 1`` (pads are removed by real_tokens, so
    any in-range value is fine): a mask_mod that indexes a length-n tensor stays in range."""
    def padded_mod(b, h, q_idx, kv_idx):
        return fn(b, h, q_idx.clamp(max=n - 1), kv_idx.clamp(max=n - 1))
    padded_mod.__name__ = name
    return _masks.as_mask(padded_mod, name=name, bh_invariant=bh_invariant)


def _extend(m, n: int, padded: int):
    if not isinstance(m, _masks.Mask):       # its declaration only: masks.reads_bh probes later
        return _clamped(m, n, name=getattr(m, "__name__", "mask_mod"),
                        bh_invariant=_masks.declared_bh_invariant(m))
    if m.op == "leaf":
        return _extend_leaf(m, n, padded)
    kids = [_extend(c, n, padded) for c in m.children]
    if all(k is None for k in kids):
        return None
    kids = [c if k is None else k for c, k in zip(m.children, kids)]
    return functools.reduce(operator.and_ if m.op == "and" else operator.or_, kids)


def pad_mask(mask, *, real_len: int, padded_len: int) -> _masks.Mask:
    """``mask`` (defined on ``real_len`` positions) over ``padded_len`` positions, padding removed.

    The result is ``mask' & real_tokens(real_len)``, where ``mask'`` equals ``mask`` on the
    real tokens and is defined on the padding too: document ids (:func:`fringe.masks.document`,
    :func:`document_mask`) get the padding as a document of its own; causal / window / prefix
    rules are arithmetic on positions and stay as they are; a mask_mod without a block rule
    is evaluated at positions clamped to ``real_len - 1`` (so indexing a length-``real_len``
    tensor stays in range; :func:`real_tokens` masks those pairs anyway). Block
    classification stays exact and cheap.

    Args:
        mask: a :class:`fringe.masks.Mask` or mask_mod on global positions ``< real_len``
            (None: full attention).
        real_len: S, the real tokens per row.
        padded_len: the padded length (e.g. :func:`fringe.padded_len`), >= ``real_len``.

    Returns:
        a :class:`fringe.masks.Mask` for ``fringe.plan(..., seq_len=padded_len)``.
    """
    for name, v in (("real_len", real_len), ("padded_len", padded_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"pad_mask: {name} must be an int >= 1, got {v!r}")
    if padded_len < real_len:
        raise ValueError(f"pad_mask: padded_len={padded_len} < real_len={real_len}; padding only "
                         f"appends tokens")
    base = _masks.full() if mask is None else mask
    if not callable(base):
        raise TypeError(f"pad_mask: mask must be a mask_mod (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(mask).__name__}")
    ext = _extend(base, real_len, padded_len)
    return _masks.as_mask(base if ext is None else ext) & real_tokens(real_len)


def pad_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
              multiple: int | None = None, length: int | None = None, cu_seqlens=None,
              position_ids=None, pad_id: int = 0, ignore_index: int = IGNORE_INDEX) -> dict:
    """Pad a packed batch at the end to a length the layout accepts; the padding attends to
    nothing.

    A layout needs ``S`` to be a multiple of its unit (``P * block_size``; zigzag
    ``2 * P * block_size``; with sequence parallelism also ``P * tp_size``:
    :func:`fringe.padded_len` gives the length). The pad tokens get ``pad_id`` and ignored
    labels (so no target is a pad token and none counts in the loss), and the boundaries
    put them in a document of their own (``cu_seqlens`` gets one more entry,
    ``position_ids`` restart at 0), so no target crosses into them and RoPE positions stay
    valid. The mask must also remove them: plan with ``document_mask(doc_ids,
    real_len=out["real_len"])`` (or :func:`pad_mask` of the unpadded mask), under which pad
    tokens attend to nothing and nothing attends to them. :func:`shard_batch` accepts the
    result as keywords (``shard_batch(**out, plan=plan, rank=rank)``) and checks the plans'
    masks remove the padding.

    Args:
        input_ids: int ``[B, S]``.
        labels: int ``[B, S]`` or None.
        multiple: pad to the next multiple of this; or
        length: pad to exactly this many tokens (>= S). Give one of the two.
        cu_seqlens / position_ids: the batch's boundaries (at most one), as for
            :func:`shard_batch`.
        pad_id: the token id of padding.
        ignore_index: the label of padding.

    Returns:
        ``dict(input_ids, labels, cu_seqlens or position_ids, real_len)``: the padded tensors
        (labels only if given; ``cu_seqlens`` per row when no boundaries were given and
        padding was added) and ``real_len = S``.

    Raises:
        ValueError: neither or both of ``multiple`` / ``length``, a ``length`` below S, both
            boundary conventions, or shapes that are not ``[B, S]``.
    """
    ids = _int_tensor(input_ids, "input_ids")
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S], got shape {tuple(ids.shape)}")
    B, S = ids.shape
    if (multiple is None) == (length is None):
        raise ValueError("pad_batch: give multiple= (e.g. 2*P*block_size) or length= (e.g. "
                         "fringe.padded_len(S, P, block_size=, tp_size=)), exactly one")
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int)
                                 or multiple < 1):
        raise ValueError(f"multiple must be an int >= 1 (e.g. 2*P*block_size for zigzag), got {multiple!r}")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < S):
        raise ValueError(f"pad_batch: length must be an int >= S={S} (the padded length, e.g. "
                         f"fringe.padded_len(S, P, block_size=, tp_size=)), got {length!r}")
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give the document boundaries once: cu_seqlens or position_ids, not both")
    n = (-S % multiple) if multiple is not None else length - S
    out: dict = {}
    out["input_ids"] = torch.cat([ids, ids.new_full((B, n), pad_id)], dim=1)
    if labels is not None:
        lab = _int_tensor(labels, "labels")
        lab = lab.view(1, -1) if lab.dim() == 1 else lab
        if tuple(lab.shape) != (B, S):
            raise ValueError(f"labels must have the shape of input_ids {(B, S)}, got {tuple(lab.shape)}")
        out["labels"] = torch.cat([lab, lab.new_full((B, n), ignore_index)], dim=1)
    if position_ids is not None:
        pos = _int_tensor(position_ids, "position_ids")
        if pos.shape[-1] != S:
            raise ValueError(f"position_ids has {pos.shape[-1]} tokens per row, input_ids {S}")
        pos = pos.reshape(-1, S)
        out["position_ids"] = torch.cat([pos, torch.arange(n).expand(pos.shape[0], n)], dim=1)
    elif n:
        cus = cu_seqlens if cu_seqlens is not None else [torch.tensor([0, S])] * B
        if isinstance(cus, torch.Tensor) and cus.dim() == 2:
            cus = list(cus)
        if isinstance(cus, (list, tuple)) and cus and not isinstance(cus[0], int):
            out["cu_seqlens"] = [torch.cat([_int_tensor(c, "cu_seqlens"), torch.tensor([S + n])])
                                 for c in cus]
        else:
            c = _int_tensor(cus, "cu_seqlens")
            if B > 1 and int(c[-1]) == B * S:
                raise ValueError("pad_batch: give per-row cu_seqlens (a list of B tensors) rather than "
                                 "one over the flattened batch")
            out["cu_seqlens"] = torch.cat([c, torch.tensor([S + n])])
    else:
        out["cu_seqlens"] = cu_seqlens
    out["real_len"] = S
    return out


# --------------------------------------------------------------------------------------
# labels, loss
# --------------------------------------------------------------------------------------


def shift_labels(labels: torch.Tensor, doc_ids: torch.Tensor | None = None, *,
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the GLOBAL sequence: ``out[:, i] = labels[:, i+1]``.

    A target that crosses a document boundary (token i is the last of its document) and the
    last position become ``ignore_index``. Shift BEFORE sharding: a rank's last token's
    target lives on another rank (or, under zigzag, in another chunk).

    Args:
        labels: int ``[B, S]`` (or ``[S]``), ``ignore_index`` where there is no target.
        doc_ids: ``[S]`` or ``[B, S]`` document ids (None: one document).
        ignore_index: the ignored label.

    Returns:
        int64, the shape of ``labels``.
    """
    lab = _int_tensor(labels, "labels")
    one = lab.dim() == 1
    lab2 = lab.view(1, -1) if one else lab
    if lab2.dim() != 2:
        raise ValueError(f"labels must be [B, S] or [S], got shape {tuple(lab.shape)}")
    out = torch.full_like(lab2, ignore_index)
    out[:, :-1] = lab2[:, 1:]
    if doc_ids is not None:
        ids = _int_tensor(doc_ids, "doc_ids").to(lab2.device)
        if ids.shape[-1] != lab2.shape[-1]:
            raise ValueError(f"doc_ids has {ids.shape[-1]} tokens but labels have {lab2.shape[-1]}")
        ids = ids.view(-1, ids.shape[-1]).expand(lab2.shape[0], -1)
        cross = ids[:, 1:] != ids[:, :-1]
        out[:, :-1] = torch.where(cross, torch.full_like(out[:, :-1], ignore_index), out[:, :-1])
    return out.view(lab.shape)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies (fp32), ignored targets contribute 0.

    Args:
        logits: ``[..., V]``; targets: int ``[...]``.
    """
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1).to(logits.device),
                                             ignore_index=ignore_index, reduction="sum")


def global_token_count(local_targets: torch.Tensor, *, group=None,
                       ignore_index: int = IGNORE_INDEX) -> int:
    """Non-ignored targets over every rank of ``group`` (one all-reduce).

    :func:`shard_batch` already knows the count from the global batch (``Shard.num_items``);
    use this when each rank only ever sees its own shard.
    """
    import torch.distributed as dist
    n = (local_targets != ignore_index).sum().to(torch.float64).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n, group=group)
    return int(n.item())


def token_weighted_loss(logits: torch.Tensor, targets: torch.Tensor, *, num_items: int,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This rank's share of the global mean loss under context parallelism.

    ``loss_r = sum of rank r's token losses / N``, where ``N`` is the number of non-ignored
    targets in the GLOBAL batch (all CP ranks together). Why: ranks hold different numbers
    of real targets (document boundaries, padding), so the mean of per-rank means is not the
    mean over tokens; the shares ``loss_r`` add up to exactly the one-process loss.

    The condition that makes it right: the CP ranks' gradients must then be **summed**
    (``all_reduce(SUM)``), not averaged as DDP does — every rank's gradient is already its
    share of the global one. With FSDP2 or DDP on a (dp, cp) mesh, let
    :class:`fringe.train.GradSync` do the reduction and the scaling (it sets FSDP's divide
    factor, or scales the loss for DDP's mean, and counts tokens over every replica and
    microbatch); do not hand-write it. The reported loss is ``all_reduce(SUM)`` of the shares
    (``GradSync.step(...).loss()``).

    Args:
        logits: ``[B, L, V]`` this rank's logits; targets: ``[B, L]`` this rank's
            pre-shifted targets (``Shard.shift_labels``).
        num_items: N, e.g. ``Shard.num_items`` or :func:`global_token_count`.
    """
    if num_items < 1:
        raise ValueError(f"num_items={num_items}: the global batch has no target to learn from "
                         f"(every label is {ignore_index})")
    return loss_sum(logits, targets, ignore_index=ignore_index) / num_items


# --------------------------------------------------------------------------------------
# the batch helper
# --------------------------------------------------------------------------------------


def _partition(ids: torch.Tensor) -> torch.Tensor:
    """Ids relabelled by first occurrence (0, 1, ...): equal for two id tensors exactly when
    they group the positions into the same documents (``ids[q] == ids[kv]`` agrees)."""
    n = ids.numel()
    if n == 0:
        return ids.to(torch.int64)
    if bool((ids[1:] >= ids[:-1]).all()):               # packed: count boundaries
        out = torch.zeros(n, dtype=torch.int64)
        out[1:] = (ids[1:] != ids[:-1]).cumsum(0)
        return out
    uniq, inv = torch.unique(ids, return_inverse=True)
    first = torch.full((uniq.numel(),), n, dtype=torch.int64).scatter_reduce_(
        0, inv, torch.arange(n), "amin")
    rank = torch.empty_like(first)
    rank[first.argsort()] = torch.arange(first.numel())
    return rank[inv]


def _row_digests(ids: torch.Tensor, real_len: int) -> tuple[str, ...]:
    """One digest per row of ``ids`` (``[S]``: one for every row) of its documents over the
    real tokens ``[0, real_len)`` (the padding is masked out: its ids do not matter)."""
    rows = ids.reshape(-1, ids.shape[-1])[:, :real_len].detach().cpu()
    return tuple(hashlib.sha1(_partition(r).numpy().tobytes()).hexdigest()[:16] for r in rows)


@dataclasses.dataclass(frozen=True)
class BatchKey:
    """What a batch is, as a plan's mask or a :class:`Shard` describes it: cheap digests that
    two objects describing one batch must agree on.

    Attributes:
        seq_len: S (padded).
        real_len: the real tokens per row (S when there is no padding).
        batch_size: B, or None where it is not fixed (a plan whose mask does not read b and
            was not given ``batch_size=``).
        documents: per document-id tensor, one digest per row of the documents it groups the
            real tokens into (a single digest: the same for every row); empty when there are
            no document ids as a fringe rule (a plain callable mask: the documents cannot be
            compared, and are not).
        boundaries: False for a shard whose batch gave no boundaries (one document per row).
    """

    seq_len: int
    real_len: int
    batch_size: int | None
    documents: tuple[tuple[str, ...], ...]
    boundaries: bool = True

    @staticmethod
    def of(doc_ids: torch.Tensor, *, seq_len: int, real_len: int | None, batch_size: int | None,
           boundaries: bool) -> BatchKey:
        """The key of a batch with these document ids (``[S]`` or ``[B, S]``)."""
        n = seq_len if real_len is None else real_len
        return BatchKey(seq_len, n, batch_size, (_row_digests(doc_ids, n),), boundaries)


def _and_documents(m) -> list[torch.Tensor]:
    """The document-id tensors of the document rules reachable from ``m`` through ``&``
    (:func:`fringe.masks.document`, :func:`document_mask`, as :func:`pad_mask` extends
    them). A rule under ``|`` (``causal() | document(image_ids)``) need not describe the
    batch's documents, and a plain callable cannot be read: neither is returned."""
    if not isinstance(m, _masks.Mask):
        return []
    if m.op == "leaf":
        rule = m.rule
        if isinstance(rule, _RowDocuments):
            return [rule.row_doc_ids]
        ids = getattr(rule, "doc_ids", None) if rule is not None else None
        return [ids] if isinstance(ids, torch.Tensor) else []
    if m.op != "and":
        return []
    return [t for c in m.children for t in _and_documents(c)]


_PLAN_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def plan_batch_key(plan) -> BatchKey:
    """The :class:`BatchKey` of the batch ``plan`` was made for, as its mask says it: the
    document ids of its document rules (through ``&``), its :func:`real_tokens` length and
    its B (``batch_size=``, or the rows of per-row document ids). Cached per plan while the
    plan's tensors are unchanged (their ``_version``)."""
    vers = plan._versions()
    hit = _PLAN_KEYS.get(plan)
    if hit is not None and hit[0] == vers:
        return hit[1]
    S = plan.seq_len
    n = real_len_of(plan.mask_mod) or S
    B = plan.batch_size
    docs = []
    for ids in _and_documents(plan.mask_mod):
        if ids.dim() == 2 and B is None:
            B = ids.shape[0]
        docs.append(_row_digests(ids, n))
    key = BatchKey(S, n, B, tuple(docs))
    _PLAN_KEYS[plan] = (vers, key)
    return key


def _rows_match(plan_rows: tuple[str, ...], batch_rows: tuple[str, ...]) -> list[int] | None:
    """Rows whose documents differ (None: the row counts do not fit each other)."""
    if len(plan_rows) == 1 or len(batch_rows) == 1:
        n = max(len(plan_rows), len(batch_rows))
        a = plan_rows * n if len(plan_rows) == 1 else plan_rows
        b = batch_rows * n if len(batch_rows) == 1 else batch_rows
    elif len(plan_rows) != len(batch_rows):
        return None
    else:
        a, b = plan_rows, batch_rows
    return [r for r, (x, y) in enumerate(zip(a, b)) if x != y]


def check_batch(plan, shard, *, where: str = "fringe") -> None:
    """Raise unless every plan was made for the batch ``shard`` was cut from.

    Two objects that describe one batch are checked against each other: the layout
    fingerprint is equal for any two batches of one length, so a plan made for batch N would
    run on batch N+1 with no error and a wrong loss. Compared, as digests: the real length,
    B (where the plan fixes it), and the documents of each document rule the plan's mask
    holds through ``&`` (:func:`document_mask`, :func:`fringe.masks.document`, also as
    :func:`pad_mask` extends them), relabelled so that only the grouping counts. A mask with
    no document ids as a fringe rule (a plain callable, however it reads ids) is not
    compared on documents: **the check does not apply** to it; wrap ids in
    :func:`document_mask` to have it.

    Args:
        plan: a :class:`fringe.Plan` or a list / dict of them.
        shard: a :class:`Shard` (or a :class:`BatchKey`).

    Raises:
        ValueError: a batch mismatch, naming what differs and the fix.
    """
    key = shard if isinstance(shard, BatchKey) else shard.batch_key()
    for p in _plans_of(plan):
        want = plan_batch_key(p)
        diffs = []
        if want.seq_len != key.seq_len:
            diffs.append(f"S={want.seq_len} tokens per row, the batch {key.seq_len}")
        if want.real_len != key.real_len:
            diffs.append(f"{want.real_len} real tokens per row (the rest padding), the batch "
                         f"{key.real_len}")
        if want.batch_size is not None and key.batch_size is not None \
                and want.batch_size != key.batch_size:
            diffs.append(f"B={want.batch_size} rows, the batch {key.batch_size}")
        elif want.real_len == key.real_len and key.documents:
            for rows in want.documents:
                bad = _rows_match(rows, key.documents[0])
                if bad is None:
                    diffs.append(f"document ids for {len(rows)} rows, the batch "
                                 f"{len(key.documents[0])}")
                elif bad:
                    rows_s = ", ".join(map(str, bad[:8])) + (" ..." if len(bad) > 8 else "")
                    diffs.append(f"other document boundaries (row {rows_s} differs)"
                                 if len(bad) == 1 else
                                 f"other document boundaries (rows {rows_s} differ)")
                    if not key.boundaries:
                        diffs.append("the batch gave no boundaries (one document per row): pass "
                                     "the cu_seqlens= or position_ids= its document ids came from")
                    break
        if diffs:
            raise ValueError(f"{where}: batch mismatch: the plan {p!r} was made for another batch "
                             f"than the one sharded: the plan's mask has {'; '.join(diffs)}. A "
                             f"plan holds one batch's documents; plan again for this batch "
                             f"(fringe.plan / fringe.hf.plans with this batch's "
                             f"packing.document_mask(doc_ids)) and shard it with those plans")


@dataclasses.dataclass(frozen=True, eq=False)
class Shard:
    """This rank's part of a packed global batch.

    Attributes:
        input_ids: int64 ``[B, L]``, tokens ``plan.layout.positions(rank)`` of each row.
        shift_labels: int64 ``[B, L]`` next-token targets, shifted on the global sequence
            before sharding (``IGNORE_INDEX`` across document boundaries and at the end), or
            the labels as given with ``shard_batch(..., shift=False)``.
        position_ids: int64 ``[B, L]`` global RoPE positions of the local tokens (within
            their document when the batch restarts positions per document).
        doc_ids: int64 ``[S]`` or ``[B, S]`` global document ids (what the plans' masks use).
        num_items: non-ignored targets in the global batch (the loss denominator).
        layout_fingerprint: ``plan.layout.fingerprint()`` of the layout the tokens follow.
        rank: this rank.
        real_len: the real tokens per row when the batch is padded (positions
            ``>= real_len`` are padding: ignored targets, masked out of attention), else None.
        batch: the :class:`BatchKey` of the batch it was cut from (its documents, real
            length and B, as digests): :func:`fringe.hf.model_inputs` checks it against the
            plans. None for a shard built by hand (then read from the fields above).
        batch_digest: a 48-bit digest (blake2b) of the global batch the shard was cut from:
            its ``input_ids``, next-token targets (after shifting and padding) and document
            ids, as :func:`shard_batch` saw them. :func:`fringe.hf.model_inputs` carries it
            into every attention call, whose agreement exchange compares it across the CP
            ranks: ranks that sharded different global batches (a loader seeded by global
            rank instead of dp rank) all raise, even when the batches' documents, and so the
            plans, agree. None for a shard built by hand (no batch check).

    Mutable state: every tensor of a shard is new (cut from the global batch by
    ``index_select``, or computed here) and aliases no plan state: it is yours to edit
    (``batch`` keeps what the shard was cut from, so editing ``doc_ids`` does not change
    what the plans are checked against).
    """

    input_ids: torch.Tensor
    shift_labels: torch.Tensor | None
    position_ids: torch.Tensor
    doc_ids: torch.Tensor
    num_items: int
    layout_fingerprint: str
    rank: int
    real_len: int | None = None
    batch: BatchKey | None = None
    batch_digest: int | None = None

    def batch_key(self) -> BatchKey:
        """:attr:`batch`, or for a shard built by hand the key of its fields."""
        if self.batch is not None:
            return self.batch
        B, S = self.input_ids.shape[0], self.doc_ids.shape[-1]
        return BatchKey.of(self.doc_ids, seq_len=S, real_len=self.real_len, batch_size=B,
                           boundaries=True)

    def model_inputs(self) -> dict:
        """Keyword arguments for a transformers causal LM: ``input_ids``, ``position_ids`` and,
        with labels, ``labels`` / ``shift_labels`` (the model's loss would otherwise shift
        again) and ``num_items_in_batch`` (so its loss is the token-weighted share)."""
        out = dict(input_ids=self.input_ids, position_ids=self.position_ids)
        if self.shift_labels is not None:
            out.update(labels=self.shift_labels, shift_labels=self.shift_labels,
                       num_items_in_batch=self.num_items)
        return out


def _batch_digest(input_ids: torch.Tensor, targets: torch.Tensor | None,
                 doc_ids: torch.Tensor) -> int:
    """A 48-bit blake2b digest of a global batch: its token ids, next-token targets (None: no
    labels) and document ids, with their shapes and dtypes (:attr:`Shard.batch_digest`).
    Hashes the tensors' bytes on the CPU (device tensors are copied first): at S=1M (three
    8 MiB int64 tensors) about 80 ms on a loaded 2-core CPU, blake2b's own speed there."""
    h = hashlib.blake2b(digest_size=6)
    for name, t in (("input_ids", input_ids), ("targets", targets), ("doc_ids", doc_ids)):
        if t is None:
            h.update(f"{name}:none;".encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return int.from_bytes(h.digest(), "big")


def _plans_of(plan) -> list:
    plans = list(plan.values()) if isinstance(plan, Mapping) else (
        list(plan) if isinstance(plan, Sequence) else [plan])
    if not plans:
        raise ValueError("shard_batch: give a plan (or plans over one layout), got none")
    if any(getattr(p, "layout", None) is None for p in plans):
        raise TypeError("shard_batch: plan must be a fringe.Plan (or a list / dict of them)")
    return plans


def _layout_of(plan):
    lays = [p.layout for p in _plans_of(plan)]
    fps = [lay.fingerprint() for lay in lays]
    if len(set(fps)) != 1:
        raise ValueError(f"shard_batch: the plans shard tokens by different layouts {sorted(set(fps))}; "
                         f"plan every mask of a batch over one layout "
                         f"(fringe.plan(..., layout=first_plan.layout))")
    return lays[0]


def _check_padding(plans: list, real_len: int, padded: int) -> None:
    """Every plan's mask must remove the padding (``& real_tokens(real_len)``)."""
    for p in plans:
        got = real_len_of(p.mask_mod)
        if got != real_len:
            have = "no real_tokens term" if got is None else f"real_tokens({got})"
            raise ValueError(
                f"shard_batch: the batch has {real_len} real tokens per row padded to {padded}, but "
                f"the plan's mask {p.mask_mod!r} has {have}, so padding would attend or be attended "
                f"to; plan with packing.pad_mask(mask, real_len={real_len}, padded_len={padded}) "
                f"(fringe.hf.plans does this when S does not fit) or "
                f"packing.document_mask(doc_ids, real_len={real_len})")


def _check_unshifted(ids: torch.Tensor, lab: torch.Tensor, ignore_index: int) -> None:
    """Raise if ``lab`` is plainly ``ids`` shifted already: every label that is not ignored
    is the next token (``lab[:, i] == ids[:, i+1]``, none at the last position) and some
    differ from ``ids`` itself (so they are not ``labels = input_ids``)."""
    keep = lab != ignore_index
    if not bool(keep.any()) or bool(keep[:, -1].any()):
        return
    nxt = torch.cat([ids[:, 1:], ids[:, -1:]], dim=1)
    if bool((lab == nxt)[keep].all()) and bool((lab != ids)[keep].any()):
        raise ValueError(
            "shard_batch: the labels are already next-token targets (labels[:, i] == "
            "input_ids[:, i+1] wherever a label is not ignore_index) but shift=True (the "
            "default, transformers' convention: labels aligned with input_ids, usually "
            "labels=input_ids, shifted here) would shift them again and train on the token "
            "after next. Pass shift=False to use them as given, or pass unshifted labels")


def shard_batch(input_ids: torch.Tensor, labels: torch.Tensor | None = None, *, plan,
                rank: int | None = None, group=None, cu_seqlens=None, position_ids=None,
                restart_positions: bool = True, real_len: int | None = None, pad_id: int = 0,
                ignore_index: int = IGNORE_INDEX, shift: bool = True) -> Shard:
    """This rank's shard of a packed global batch.

    The batch and the plans are checked against each other (:func:`check_batch`): a plan
    whose mask holds document ids (:func:`document_mask`, :func:`fringe.masks.document`,
    through ``&`` and :func:`pad_mask`) must hold this batch's documents, real length and B,
    or this raises naming the batch mismatch (a plan from the previous batch of the same
    length would otherwise run with no error). For a mask with no document ids as a rule (a
    plain callable) the documents cannot be compared and are not.

    Give the document boundaries as ``cu_seqlens`` or as ``position_ids`` (not both; neither
    means one document per row). Labels are shifted on the global sequence FIRST
    (:func:`shift_labels`), then sharded; with ``shift=False`` they are taken as next-token
    targets already and only sharded.

    Padding: a batch shorter than the plans' layout is padded here (:func:`pad_batch`) when
    the plans were made for it, i.e. every plan's mask removes the padding
    (``& real_tokens(S)``, as :func:`pad_mask` and ``fringe.hf.plans`` make it); an already
    padded batch says so with ``real_len`` (``shard_batch(**pad_batch(...), plan=, rank=)``).
    Either way pad tokens have no target, no target is a pad token, and ``num_items``
    counts real targets only.

    Args:
        input_ids: int ``[B, S]`` (or ``[S]``) the global packed batch, same on every rank.
        labels: int ``[B, S]`` labels aligned with ``input_ids`` (usually ``input_ids``;
            ``ignore_index`` to mask a token as a target), or with ``shift=False``
            next-token targets; or None.
        plan: the :class:`fringe.Plan` (or a list / dict of plans sharing one layout, e.g.
            one per attention-mask kind of the model) the tokens are sharded for.
        rank: this rank's plan rank; or
        group: the process group or ``DeviceMesh`` given to :func:`fringe.attention`, whose
            coordinate is the plan rank (``layout.shard(..., group=)``: right on a mesh that
            orders ranks otherwise than ``dist.get_rank()``).
        cu_seqlens: see :func:`doc_ids_from_cu_seqlens`.
        position_ids: ``[S]`` / ``[B, S]`` positions restarting per document; they are also
            the RoPE positions (sharded as given).
        restart_positions: with ``cu_seqlens`` (or neither): RoPE positions restart at 0 per
            document (True, the varlen convention) or count over the whole row (False).
        real_len: the real tokens per row of an already padded batch (``pad_batch``'s
            ``real_len``); None: the batch's own length.
        pad_id: the token id of the padding added here.
        ignore_index: the ignored label.
        shift: True (default; transformers' convention, where ``labels`` are aligned with
            ``input_ids`` and the causal-LM loss shifts them): ``labels`` are shifted on the
            global sequence here, ``ignore_index`` across document boundaries and at the
            end. False: ``labels`` are already next-token targets (``labels[:, i]`` is the
            target of token ``i``, transformers' ``shift_labels``) and are sharded as given
            (padding added here or marked by ``real_len`` is still ignored). Either way
            ``Shard.shift_labels`` holds the targets and ``num_items`` counts those that are
            not ``ignore_index`` in the global batch.

    Returns:
        a :class:`Shard`.

    Raises:
        ValueError: both or invalid boundaries, sizes that do not match the plan, a padded
            batch whose plans do not mask the padding out, plans over different layouts, a
            batch mismatch (the plans were made for another batch), or ``shift=True`` with
            labels that are plainly next-token targets already (``input_ids`` moved left by
            one: every label not ignored is the next token, and some differ from
            ``input_ids``), which would be shifted twice.
    """
    if not isinstance(shift, bool):
        raise TypeError(f"shard_batch: shift must be True (labels aligned with input_ids, "
                        f"shifted here) or False (labels already next-token targets), got "
                        f"{shift!r}")
    plans = _plans_of(plan)
    lay = _layout_of(plans)
    rank = lay._resolve_rank(rank, group)
    ids = _int_tensor(input_ids, "input_ids")
    if ids.dim() == 1:
        ids = ids.view(1, -1)
    if ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, S] or [S], got shape {tuple(ids.shape)}")
    B, S = ids.shape
    if cu_seqlens is not None and position_ids is not None:
        raise ValueError("give the document boundaries once: cu_seqlens or position_ids, not both")
    if S < lay.seq_len and real_len is None and all(real_len_of(p.mask_mod) == S for p in plans):
        padded = pad_batch(ids, labels, length=lay.seq_len, cu_seqlens=cu_seqlens,
                           position_ids=position_ids, pad_id=pad_id, ignore_index=ignore_index)
        ids, labels = padded["input_ids"], padded.get("labels")
        cu_seqlens, position_ids = padded.get("cu_seqlens"), padded.get("position_ids")
        real_len, S = S, lay.seq_len
    if S != lay.seq_len:
        fix = "" if S > lay.seq_len else (
            f", or for padding it: plan with packing.pad_mask(mask, real_len={S}, "
            f"padded_len={lay.seq_len}) (fringe.hf.plans pads a length that does not fit by itself)")
        raise ValueError(f"input_ids has S={S} tokens per row but the plan's layout is for "
                         f"S={lay.seq_len}; plan for this batch's length{fix}")
    if real_len is not None:
        if isinstance(real_len, bool) or not isinstance(real_len, int) or not 1 <= real_len <= S:
            raise ValueError(f"shard_batch: real_len must be an int in [1, S={S}] (the tokens before "
                             f"padding), got {real_len!r}")
        _check_padding(plans, real_len, S)
    if position_ids is not None:
        pos = _int_tensor(position_ids, "position_ids")
        if pos.shape[-1] != S:
            raise ValueError(f"position_ids has {pos.shape[-1]} tokens per row, input_ids {S}")
        doc = doc_ids_from_position_ids(pos)
        rope = pos.view(-1, S).expand(B, S)
    else:
        if cu_seqlens is not None:
            flat = not isinstance(cu_seqlens, (list, tuple)) and B > 1 and \
                int(torch.as_tensor(cu_seqlens)[-1]) == B * S
            doc = doc_ids_from_cu_seqlens(cu_seqlens, seq_len=S, batch_size=B if flat else None)
        else:
            doc = torch.zeros(S, dtype=torch.int64)
        if doc.dim() == 2 and doc.shape[0] != B:
            raise ValueError(f"cu_seqlens describe {doc.shape[0]} rows, input_ids has B={B}")
        if doc.dim() == 2 and bool((doc == doc[:1]).all()):
            doc = doc[0]
        rope = (positions_in_document(doc) if restart_positions else torch.arange(S))
        rope = rope.view(-1, S).expand(B, S)
    if doc.dim() == 2 and doc.shape[0] != B:
        raise ValueError(f"position_ids describe {doc.shape[0]} rows, input_ids has B={B}")
    tgt, num, shifted = None, 0, None
    if labels is not None:
        lab = _int_tensor(labels, "labels")
        lab = lab.view(1, -1) if lab.dim() == 1 else lab
        if tuple(lab.shape) != (B, S):
            raise ValueError(f"labels must have the shape of input_ids {(B, S)}, got {tuple(lab.shape)}")
        if shift:
            _check_unshifted(ids, lab, ignore_index)
            shifted = shift_labels(lab, doc, ignore_index=ignore_index)
            if real_len is not None:    # no target is, or belongs to, a pad token
                shifted[:, real_len - 1:] = ignore_index
        else:                           # next-token targets already: as given
            shifted = lab.clone()
            if real_len is not None:    # pad tokens have no target
                shifted[:, real_len:] = ignore_index
        num = int((shifted != ignore_index).sum())
        tgt = lay.shard(shifted, rank, dim=1)
    key = BatchKey.of(doc, seq_len=S, real_len=real_len, batch_size=B,
                      boundaries=cu_seqlens is not None or position_ids is not None)
    check_batch(plans, key, where="shard_batch")
    return Shard(input_ids=lay.shard(ids, rank, dim=1), shift_labels=tgt,
                 position_ids=lay.shard(rope.contiguous(), rank, dim=1), doc_ids=doc,
                 num_items=num, layout_fingerprint=lay.fingerprint(), rank=rank,
                 real_len=real_len, batch=key, batch_digest=_batch_digest(ids, shifted, doc))
