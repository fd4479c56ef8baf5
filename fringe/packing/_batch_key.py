"""Which batch a plan was made for: :class:`BatchKey` digests, :func:`plan_batch_key` and
:func:`check_batch`, which compares the plans with a shard's batch."""
from __future__ import annotations

import dataclasses
import hashlib
import weakref
from typing import Mapping, Sequence

import torch

from .. import masks as _masks
from ._documents import _RowDocuments
from ._real_tokens import real_len_of


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


def _plans_of(plan) -> list:
    plans = list(plan.values()) if isinstance(plan, Mapping) else (
        list(plan) if isinstance(plan, Sequence) else [plan])
    if not plans:
        raise ValueError("shard_batch: give a plan (or plans over one layout), got none")
    if any(getattr(p, "layout", None) is None for p in plans):
        raise TypeError("shard_batch: plan must be a fringe.Plan (or a list / dict of them)")
    return plans
