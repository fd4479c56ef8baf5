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

from ._batch_key import BatchKey, _and_documents as _and_documents, check_batch, plan_batch_key
from ._common import IGNORE_INDEX
from ._documents import (doc_ids_from_cu_seqlens, doc_ids_from_position_ids, document_mask,
                         positions_in_document)
from ._loss import global_token_count, loss_sum, shift_labels, token_weighted_loss
from ._padding import pad_batch, pad_mask
from ._real_tokens import real_len_of, real_tokens
from ._shard import Shard, run_digest as _run_digest, shard_batch

__all__ = ["IGNORE_INDEX", "BatchKey", "Shard", "check_batch", "doc_ids_from_cu_seqlens",
           "doc_ids_from_position_ids", "document_mask", "global_token_count", "loss_sum",
           "pad_batch", "pad_mask", "plan_batch_key", "positions_in_document", "real_len_of",
           "real_tokens", "shard_batch", "shift_labels", "token_weighted_loss"]

