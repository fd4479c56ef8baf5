"""Mask mods with global token indices, their composition, and exact block classification.

A mask_mod has FlexAttention's signature ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor``
where ``q_idx`` / ``kv_idx`` are **global** token positions (a layout permutes tokens, so a
rank's local row i is global position ``layout.positions(rank)[i]``).

Shape legend: ``B`` batch, ``H`` heads, ``Lq`` / ``Lk`` query / key lengths (local, in
layout order), ``bs`` block size, ``nQb = Lq / bs`` and ``nKb = Lk / bs`` block counts.

Modules (private, each importing only those above it; this package re-exports the names):

* ``_kinds`` — :class:`BlockKind` codes, :class:`MaskError`, ``MaskMod``, the default block size;
* ``_rules`` — block summaries and the structured block rules (band, kv-below, document);
* ``_mask`` — the :class:`Mask` type, ``&`` / ``|`` and the factories;
* ``_eval`` — :func:`evaluate`: FlexAttention's semantics, broadcasting where a probe agrees;
* ``_bh`` — whether a mask_mod or score_mod reads ``b`` / ``h`` (one answer for every caller);
* ``_blockmap`` — :class:`BlockMap`, the sparse classification;
* ``_classify`` — :func:`classify`, the quadtree;
* ``_snapshot`` — :func:`snapshot`;
* ``_guard`` — what a plan records of the state a mask reads but cannot copy (versions,
  identities), checked on every call;
* ``_digest`` — :func:`digest` and :func:`fn_digest`.

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
  non-bool). :func:`classify` and :func:`reads_bh` follow the same per-mod decision.
* :func:`reads_bh` — the one answer to "does this mask_mod (or score_mod) read ``b`` / ``h``"
  that classification, digests, plans and the tile ops ask: a declaration
  (:attr:`Mask.bh_invariant`) decides; else a broadcast mod's output shape; a mod evaluated
  per scalar index (or one the probe cannot call) cannot be proven to ignore them, so it
  reads both: it is classified for every ``b`` / ``h`` it will run with, or refused.
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
constants, captured values, the attributes of the objects they are bound to or read).

>>> import torch
>>> from fringe.masks import causal, classify, document
>>> m = causal() & document(torch.tensor([0, 0, 1, 1]))
>>> m
causal & document(2 docs)
>>> classify(m, torch.arange(4), torch.arange(4), block_size=2).tolist()
[[1, 0], [0, 1]]
"""
from __future__ import annotations

import sys
import types

from . import _classify
from ._bh import ReadsBH as ReadsBH, reads_batch_head, reads_bh as reads_bh
from ._blockmap import DENSE_LIMIT as DENSE_LIMIT, BlockMap
from ._classify import BH_BUDGET_PAIRS as BH_BUDGET_PAIRS, WARN_DENSE_PAIRS as WARN_DENSE_PAIRS
from ._classify import classify
from ._digest import digest, fn_digest
from ._eval import PROBE_SHAPE as PROBE_SHAPE, PROBE_SHAPE_2 as PROBE_SHAPE_2, evaluate
from ._kinds import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE, BlockKind, MaskError, MaskMod
from ._mask import (Mask, as_mask, causal, declared_bh_invariant as declared_bh_invariant, document,
                    full, prefix_lm, sliding_window)
from ._snapshot import snapshot

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



class _Package(types.ModuleType):
    """``fringe.masks`` itself: a setting assigned here (``fringe.masks.BH_BUDGET_PAIRS = n``)
    reaches the private module that reads it, as it did when masks was one module."""

    def __setattr__(self, name: str, value) -> None:
        owner = _SETTINGS.get(name)
        if owner is not None:
            setattr(owner, name, value)
        super().__setattr__(name, value)


#: settings read at call time, by the module that owns them
_SETTINGS = {"BH_BUDGET_PAIRS": _classify, "WARN_DENSE_PAIRS": _classify}
sys.modules[__name__].__class__ = _Package
