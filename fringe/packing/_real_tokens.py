"""Padding that attends to nothing: the :func:`real_tokens` mask and its exact block rule,
and :func:`real_len_of`, which finds it in a mask."""
from __future__ import annotations

import dataclasses

import torch

from .. import masks as _masks
from ..masks._kinds import _UNKNOWN


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
