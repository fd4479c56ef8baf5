"""Whether a mask_mod or a score_mod reads ``b`` / ``h``: the one answer every caller asks.

The rule (issue 17, round 3): ``bh_invariant`` is a declaration, one of True / False / None
(:attr:`Mask.bh_invariant`; a plain function's ``bh_invariant`` attribute when it is exactly
True or False). A declaration decides. Without one, fringe reads the answer from a probe only
where the probe proves it: a mod evaluated by broadcasting reads an index exactly when its
output broadcasts along that axis. A probe proves nothing about values it did not try, so a
mod fringe evaluates per scalar index (vmap), or one the probe cannot run, **reads both**:
it is classified for every ``(b, h)`` (or refused, naming both remedies, when the plan is
given neither count or the budget is exceeded).

Probes use a few positions (no S² evaluation).
"""
from __future__ import annotations

import dataclasses
import types
import weakref

import torch

from ._eval import PROBE_SHAPE, _by_vmap_pairs, _decide, _IndexWatch, _name, _spread
from ._kinds import MaskMod, _VmapFailure
from ._mask import Mask, declared_bh_invariant


@dataclasses.dataclass(frozen=True)
class ReadsBH:
    """What :func:`reads_bh` answers.

    Attributes:
        b, h: whether the mod may read the index. False only where it is declared
            ``bh_invariant=True`` or proven not to (a broadcast mod whose output has no such
            axis); a part fringe cannot decide reads both.
        seen_b, seen_h: a probe saw it read the index (a witness, whatever it declares);
            filled with ``witness=True`` only.
        unproven: the names of the parts neither declared nor proven; they count as reading
            ``b`` and ``h``.
    """

    b: bool
    h: bool
    seen_b: bool = False
    seen_h: bool = False
    unproven: tuple[str, ...] = ()

    @property
    def invariant(self) -> bool:
        """Neither ``b`` nor ``h`` is read: evaluate (classify, digest) once, for b = h = 0."""
        return not (self.b or self.h)


def reads_bh(fn, *, seq_len: int | None = None, q_pos: torch.Tensor | None = None,
             kv_pos: torch.Tensor | None = None, score: bool = False,
             witness: bool = False) -> ReadsBH:
    """Whether ``fn`` (a mask_mod, or with ``score`` a score_mod) reads ``b`` / ``h``.

    Part by part (the leaves of a :class:`Mask` tree; a plain callable is one part): a
    declaration decides (a tree's declaration decides for the whole tree); an undeclared part
    is probed. A mask_mod evaluated by broadcasting (a factory rule; else as :func:`evaluate`
    decides) is called once with ``b`` of shape ``[2, 1, 1, 1]`` and ``h`` of shape
    ``[1, 2, 1, 1]`` on a 2x2 tile: an output that broadcasts along a dimension reads that
    index, one that does not proves it does not. A score_mod is called the same way on zero
    scores, under a watch of its index tensors. A mod evaluated per scalar index, one that
    reads its index tensors' shape or reduces them, and one that raises on the probe cannot
    be decided: it reads both.

    Args:
        fn: the mask_mod (``fn(b, h, q_idx, kv_idx)``) or score_mod
            (``fn(score, b, h, q_idx, kv_idx)``).
        seq_len: S; the probe positions are then spread over ``0..S-1``.
        q_pos, kv_pos: or the positions to spread the probe over (the caller's own). With
            neither, positions ``0, 1`` are made up, and a mod that fails on them is undecided.
        score: ``fn`` is a score_mod.
        witness: also evaluate the undeclared per-scalar parts, and the declared ones, for
            ``b < 2``, ``h < 3`` and report what the probe saw (``seen_b`` / ``seen_h``):
            :func:`fringe.plan` names a mask seen reading an index it was not given, and one
            declared invariant that is seen reading one. The answer (``b`` / ``h``) is the
            same either way.

    Returns:
        a :class:`ReadsBH`.

    Raises:
        MaskError: a mask_mod FlexAttention would refuse (see :func:`evaluate`), where the
            positions are the caller's.
    """
    decl = _declared(fn)
    if decl is not None and not witness:                    # the common case: no probe
        return ReadsBH(b=not decl, h=not decl)
    q_pos, kv_pos, given = _probe_positions(seq_len, q_pos, kv_pos)
    parts = _parts(fn, q_pos, kv_pos, strict=given, score=score, witness=witness)
    return ReadsBH(b=any(p[1] for p in parts), h=any(p[2] for p in parts),
                   seen_b=any(p[3] for p in parts), seen_h=any(p[4] for p in parts),
                   unproven=tuple(p[0] for p in parts if p[5]))


def reads_batch_head(mask_mod: MaskMod, *, seq_len: int | None = None,
                     q_pos: torch.Tensor | None = None,
                     kv_pos: torch.Tensor | None = None) -> tuple[bool, bool]:
    """Whether ``mask_mod`` may read ``b`` / ``h``: :func:`reads_bh`'s answer as a pair.

    False only where it is declared ``bh_invariant=True`` or proven not to read the index (a
    mod evaluated by broadcasting whose output has no such axis); a mod evaluated per scalar
    index (vmap, see :func:`evaluate`) cannot be proven by a probe to ignore them, and reads
    both. Arguments as :func:`reads_bh`.

    Returns:
        ``(reads_b, reads_h)``.
    """
    r = reads_bh(mask_mod, seq_len=seq_len, q_pos=q_pos, kv_pos=kv_pos)
    return r.b, r.h


def _probe_positions(seq_len, q_pos, kv_pos):
    """The positions to spread the probe over and whether they are the caller's."""
    given = q_pos is not None or seq_len is not None
    if q_pos is None:
        q_pos = torch.arange(2) if seq_len is None else \
            torch.linspace(0, max(0, int(seq_len) - 1), PROBE_SHAPE[3]).round().long()
    kv_pos = q_pos if kv_pos is None else kv_pos.to(q_pos.device)
    return q_pos, kv_pos, given


def _few(pos: torch.Tensor) -> torch.Tensor:
    """At most :data:`PROBE_SHAPE`'s ``Lk`` positions, spread over ``pos``."""
    return _spread(pos, PROBE_SHAPE[3]) if pos.numel() > PROBE_SHAPE[3] else pos


# One part: (name, reads_b, reads_h, seen_b, seen_h, unproven).
_Part = tuple[str, bool, bool, bool, bool, bool]


def _declared(fn) -> bool | None:
    return fn.bh_invariant if isinstance(fn, Mask) else declared_bh_invariant(fn)


def _parts(fn, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, strict: bool, score: bool,
           witness: bool) -> list[_Part]:
    decl = _declared(fn)
    if decl is not None and not witness:
        return [(_name(fn), not decl, not decl, False, False, False)]
    if isinstance(fn, Mask) and fn.op != "leaf":
        kids = [p for c in fn.children for p in _parts(c, q_pos, kv_pos, strict=strict,
                                                       score=score, witness=witness)]
        if decl is None:
            return kids
        return [(n, not decl, not decl, sb, sh, False) for n, _, _, sb, sh, _ in kids]
    if q_pos.numel() == 0 or kv_pos.numel() == 0:
        seen_b = seen_h = proven = False                     # nothing to probe on
    else:
        mod, rule = (fn.mod, fn.rule) if isinstance(fn, Mask) else (fn, None)
        key = (score, witness)
        hit = _SEEN.get(mod, key) if strict else None
        if hit is not None:
            seen_b, seen_h, proven = hit
        elif score:
            seen_b, seen_h, proven = _probe_score(mod, _few(q_pos), _few(kv_pos))
        else:
            seen_b, seen_h, proven = _probe_mask(mod, _few(q_pos), _few(kv_pos), strict=strict,
                                                 elementwise=rule is not None, witness=witness)
        if strict and hit is None:
            _SEEN.put(mod, key, (seen_b, seen_h, proven))
    if decl is not None:
        return [(_name(fn), not decl, not decl, seen_b, seen_h, False)]
    if proven:
        return [(_name(fn), seen_b, seen_h, seen_b, seen_h, False)]
    return [(_name(fn), True, True, seen_b, seen_h, True)]


class _Probes:
    """What the probe of a mod saw, per mod (weak keys: it lives as long as the mod) and per
    ``(score, witness)``, on the caller's positions only: the tile ops ask on every call."""

    def __init__(self) -> None:
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, mod, key) -> tuple[bool, bool, bool] | None:
        if isinstance(mod, types.MethodType):      # a new object on every attribute access
            return None
        try:
            return self.seen.get(mod, {}).get(key)
        except TypeError:                          # not weak-referenceable: probe every call
            return None

    def put(self, mod, key, value: tuple[bool, bool, bool]) -> None:
        if isinstance(mod, types.MethodType):
            return
        try:
            self.seen.setdefault(mod, {})[key] = value
        except TypeError:
            pass


_SEEN = _Probes()


def _probe_mask(mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, strict: bool,
                elementwise: bool, witness: bool) -> tuple[bool, bool, bool]:
    """``(seen_b, seen_h, proven)`` for one mask_mod. ``proven``: the mod is evaluated by
    broadcasting and its output's shape on the probe decided both (``seen_*`` are then the
    answer). A mod evaluated per scalar index is evaluated for ``b < 2``, ``h < 3`` when
    ``witness`` (an output that varies is a witness; one that does not proves nothing)."""
    if not elementwise:
        # B and H are unknown here: a mod indexing a per-head table may accept fewer heads
        for pb, ph in ((2, 3), (2, 2), (1, 1)):
            try:
                method = _decide(mod, q_pos, kv_pos, pb, ph, strict)
                if method is None:                  # fails on made-up positions: undecided
                    return False, False, False
                if method != "vmap":
                    break
                if not witness:
                    return False, False, False
                out = _by_vmap_pairs(mod, torch.arange(pb, device=q_pos.device),
                                     torch.arange(ph, device=q_pos.device),
                                     _spread(q_pos, PROBE_SHAPE[2])[None],
                                     _spread(kv_pos, PROBE_SHAPE[3])[None])[0]
            except _VmapFailure:
                if (pb, ph) == (1, 1):
                    raise
                continue
            reads_b = pb > 1 and not torch.equal(out[0], out[1])
            reads_h = any(not torch.equal(out[:, 0], out[:, j]) for j in range(1, ph))
            return reads_b, reads_h, False
    idx = torch.arange(2, device=q_pos.device)
    try:
        out = mod(idx.view(2, 1, 1, 1), idx.view(1, 2, 1, 1), _spread(q_pos, 2).view(1, 1, 2, 1),
                  _spread(kv_pos, 2).view(1, 1, 1, 2))
    except Exception:           # noqa: BLE001 - undecided; evaluate()/classify() report real errors
        return False, False, False
    return (*_axes(out), True)


def _probe_score(fn, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> tuple[bool, bool, bool]:
    """``(seen_b, seen_h, proven)`` for one score_mod, called on zero scores ``[1, 1, 2, 2]``
    with broadcast ``b`` / ``h``; a shape read or a reduction of an index tensor, or an error,
    leaves it undecided (the tile ops may then evaluate it per scalar index)."""
    idx = torch.arange(2, device=q_pos.device)
    args = (idx.view(2, 1, 1, 1), idx.view(1, 2, 1, 1), _spread(q_pos, 2).view(1, 1, 2, 1),
            _spread(kv_pos, 2).view(1, 1, 1, 2))
    watch = _IndexWatch(args)
    try:
        with torch.no_grad(), watch:
            out = fn(torch.zeros(1, 1, 2, 2, dtype=torch.float64, device=q_pos.device), *args)
    except Exception:           # noqa: BLE001 - undecided: it reads both
        return False, False, False
    if watch.found is not None:
        return False, False, False
    return (*_axes(out), True)


def _axes(out) -> tuple[bool, bool]:
    """Whether a probe's output broadcasts along the b and the h axis."""
    shape = tuple(torch.as_tensor(out).shape)
    shape = (1,) * (4 - len(shape)) + shape
    return shape[0] == 2, shape[1] == 2
