"""Document ids from ``cu_seqlens`` / ``position_ids``, positions within a document, and
:func:`document_mask` (with its per-row block rule for rows that differ)."""
from __future__ import annotations

import dataclasses

import torch

from .. import masks as _masks
from ..masks._kinds import _UNKNOWN
from ._common import _int_tensor
from ._real_tokens import real_tokens


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
