"""The vocabulary every part of :mod:`fringe.masks` shares: block kinds and their int8
codes, the mask error, the mask_mod type and the default block size."""
from __future__ import annotations

import enum
from typing import Callable

import torch

#: Default mask-block size (tokens per side of a classification block). A parameter
#: everywhere; this is only its default. (Defined here, the lowest module that uses it;
#: :mod:`fringe.layout` re-exports it, so masks never imports layout.)
DEFAULT_BLOCK_SIZE = 64

MaskMod = Callable[..., torch.Tensor]


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
