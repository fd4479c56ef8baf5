"""Padding a packed batch at the end (:func:`pad_batch`) and a mask over the padded length
(:func:`pad_mask`): the mask defined on the padding too, with the padding removed."""
from __future__ import annotations

import functools
import operator

import torch

from .. import masks as _masks
from ._common import IGNORE_INDEX, _int_tensor
from ._documents import _RowDocuments, document_mask
from ._real_tokens import real_tokens


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
    ``2 * P * block_size``; ``striped:N`` also ``N * P``; with sequence parallelism also
    ``P * tp_size``: :func:`fringe.padded_len` gives the length, with ``stripe=N``). The pad tokens get ``pad_id`` and ignored
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
