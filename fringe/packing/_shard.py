"""This rank's :class:`Shard` of a packed global batch: :func:`shard_batch`."""
from __future__ import annotations

import dataclasses
import hashlib

import torch
import torch.distributed as dist

from ._batch_key import BatchKey, _plans_of, check_batch
from ._common import IGNORE_INDEX, _int_tensor
from ._documents import doc_ids_from_cu_seqlens, doc_ids_from_position_ids, positions_in_document
from ._loss import shift_labels
from ._padding import pad_batch
from ._real_tokens import real_len_of


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
            its ``input_ids``, next-token targets (after shifting and padding), document
            ids and RoPE positions, as :func:`shard_batch` saw them. :func:`fringe.hf.model_inputs` carries it
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
                 doc_ids: torch.Tensor, positions: torch.Tensor) -> int:
    """A 48-bit blake2b digest of a global batch: its token ids, next-token targets (None: no
    labels), document ids and RoPE positions, with their shapes and dtypes
    (:attr:`Shard.batch_digest`).
    Hashes the tensors' bytes on the CPU (device tensors are copied first): at S=1M (three
    8 MiB int64 tensors) about 80 ms on a loaded 2-core CPU, blake2b's own speed there."""
    h = hashlib.blake2b(digest_size=6)
    for name, t in (("input_ids", input_ids), ("targets", targets), ("doc_ids", doc_ids),
                    ("position_ids", positions)):
        if t is None:
            h.update(f"{name}:none;".encode())
            continue
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return int.from_bytes(h.digest(), "big")


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


def _check_unshifted(ids: torch.Tensor, lab: torch.Tensor, ignore_index: int,
                     real_len: int | None = None) -> None:
    """Raise if ``lab`` is plainly ``ids`` shifted already: every label that is not ignored,
    before the last position, is the next token (``lab[:, i] == ids[:, i+1]``) and some
    differ from ``ids`` itself (so they are not ``labels = input_ids``). The last position has
    no next token to compare with, so whatever it holds (ignored, or an EOS / pad id filled in
    by the loader) does not decide; nor does the padding after ``real_len`` real tokens."""
    n = ids.shape[1] if real_len is None else real_len
    lab, ids = lab[:, :n - 1], ids[:, :n]
    keep = lab != ignore_index
    if not bool(keep.any()):
        return
    nxt, cur = ids[:, 1:], ids[:, :-1]
    if bool((lab == nxt)[keep].all()) and bool((lab != cur)[keep].any()):
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
            _check_unshifted(ids, lab, ignore_index, real_len)
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
                 real_len=real_len, batch=key, batch_digest=_batch_digest(ids, shifted, doc, rope))


def run_digest(shard, plan, group) -> int | None:
    """The batch digest a shard joins the attention agreement with (``fringe.hf`` /
    ``fringe.titan`` ``model_inputs``): its ``batch_digest``, or ``-2 - shard.rank`` where
    this process is another plan rank of ``group`` than the one the shard was cut for (a
    ``rank=`` given the dp coordinate, a group other than the plans'). The agreement then
    raises on every rank of the group, naming it; the digests alone agree (one batch)."""
    digest = getattr(shard, "batch_digest", None)
    rank = getattr(shard, "rank", None)
    if (rank is None or plan.world_size <= 1 or not dist.is_available()
            or not dist.is_initialized()):
        return digest
    try:
        me = plan.layout.rank_in(group)
    except ValueError:               # not in the group / another size: the agreement says so
        return digest
    return digest if me == rank else -2 - int(rank)
