"""Whether a mask_mod reads ``b`` / ``h``: probes of a few positions (no S² evaluation)."""
from __future__ import annotations

import torch

from ._eval import PROBE_SHAPE, _by_vmap_pairs, _decide, _name, _spread
from ._kinds import MaskMod, _VmapFailure
from ._mask import Mask, declared_bh_invariant


def _probe_positions(seq_len, q_pos, kv_pos):
    """The probe positions of :func:`reads_batch_head` and whether they are the caller's."""
    given = q_pos is not None or seq_len is not None
    if q_pos is None:
        q_pos = torch.arange(2) if seq_len is None else \
            torch.linspace(0, max(0, int(seq_len) - 1), PROBE_SHAPE[3]).round().long()
    kv_pos = q_pos if kv_pos is None else kv_pos.to(q_pos.device)
    return q_pos, kv_pos, given


def _leaf_bh(mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *, strict: bool,
             elementwise: bool) -> tuple[bool, bool, bool]:
    """``(reads_b, reads_h, proven)`` for one mask_mod (a leaf of a Mask tree).

    A mod evaluated by broadcasting (``elementwise``: a factory rule; else as
    :func:`_decide` finds) is called with ``b [2,1,1,1]``, ``h [1,2,1,1]``: it reads an
    index exactly when its output broadcasts along that axis (``proven``). A mod evaluated
    per scalar index is evaluated for ``b < 2``, ``h < 3`` on the probe: an output that varies
    there is a witness that it reads the index; one that does not vary proves nothing about
    the values the probe did not try (``proven`` False).
    """
    if not elementwise:
        # B and H are unknown here: a mod indexing a per-head table may accept fewer heads
        for pb, ph in ((2, 3), (2, 2), (1, 1)):
            try:
                method = _decide(mod, q_pos, kv_pos, pb, ph, strict)
                if method != "vmap":
                    break
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
    except Exception:           # noqa: BLE001 - evaluate()/classify() report real errors
        return False, False, True
    shape = tuple(torch.as_tensor(out).shape)
    shape = (1,) * (4 - len(shape)) + shape
    return shape[0] == 2, shape[1] == 2, True


def _bh_leaves(mask_mod, q_pos, kv_pos, strict: bool) -> list[tuple[str, bool | None, tuple]]:
    """``(name, declared, (reads_b, reads_h, proven))`` for each leaf of ``mask_mod`` (a
    plain callable is one leaf)."""
    if isinstance(mask_mod, Mask) and mask_mod.op != "leaf":
        return [x for c in mask_mod.children for x in _bh_leaves(c, q_pos, kv_pos, strict)]
    if isinstance(mask_mod, Mask):
        mod, rule, decl = mask_mod.mod, mask_mod.rule, mask_mod.bh_invariant
    else:
        mod, rule, decl = mask_mod, None, declared_bh_invariant(mask_mod)
    return [(_name(mask_mod), decl,
             _leaf_bh(mod, q_pos, kv_pos, strict=strict, elementwise=rule is not None))]


def unproven_bh(mask_mod: MaskMod, *, seq_len: int | None = None,
                q_pos: torch.Tensor | None = None,
                kv_pos: torch.Tensor | None = None) -> tuple[str, ...]:
    """The names of the parts of ``mask_mod`` that fringe cannot prove ignore ``b`` and ``h``.

    Those are the mask_mods it evaluates per scalar index (vmap; see :func:`evaluate`) that
    are not declared ``bh_invariant=True`` (:func:`as_mask`): a probe proves nothing about
    the ``b`` / ``h`` values it did not try. (A mod evaluated by broadcasting is decided by
    its output's shape; factories are invariant by construction.) :func:`fringe.plan`
    classifies such a mask for every ``b < batch_size``, ``h < num_heads``, and refuses it
    when it is given neither.

    Args: as :func:`reads_batch_head`.
    """
    q_pos, kv_pos, given = _probe_positions(seq_len, q_pos, kv_pos)
    if q_pos.numel() == 0 or kv_pos.numel() == 0:
        return ()
    return tuple(name for name, decl, (_, _, proven) in
                 _bh_leaves(mask_mod, q_pos, kv_pos, given) if decl is not True and not proven)


def reads_batch_head(mask_mod: MaskMod, *, seq_len: int | None = None,
                     q_pos: torch.Tensor | None = None,
                     kv_pos: torch.Tensor | None = None) -> tuple[bool, bool]:
    """Whether ``mask_mod`` reads ``b`` / ``h``, probed on a few positions (no S² evaluation).

    Leaf by leaf (a plain callable is one leaf). A mod that :func:`evaluate` broadcasts is
    called once with ``b`` of shape ``[2, 1, 1, 1]`` and ``h`` of shape ``[1, 2, 1, 1]`` on a
    2x2 tile: an output that broadcasts along a dimension read that index (exact). A mod
    evaluated per scalar index (vmap, see :func:`evaluate`) is evaluated for ``b < 2``,
    ``h < 3`` on the probe positions: True means it was seen reading the index there; False
    proves nothing about other values (see :func:`unproven_bh`: :func:`fringe.plan` does not
    rely on it).

    Args:
        mask_mod: the mask_mod.
        seq_len: S; the probe positions are then spread over ``0..S-1`` (pass it: it also
            decides the evaluation method on valid positions).
        q_pos, kv_pos: or give the probe's positions directly. With neither, positions
            ``0, 1`` are used and a mod that fails on them is reported as reading neither.

    Returns:
        ``(reads_b, reads_h)``.
    """
    q_pos, kv_pos, given = _probe_positions(seq_len, q_pos, kv_pos)
    if q_pos.numel() == 0 or kv_pos.numel() == 0:
        return False, False
    leaves = _bh_leaves(mask_mod, q_pos, kv_pos, given)
    return any(r[2][0] for r in leaves), any(r[2][1] for r in leaves)


def _proven_invariant(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor) -> bool:
    q = _spread(q_pos, PROBE_SHAPE[3])
    k = _spread(kv_pos, PROBE_SHAPE[3])
    return all(decl is True or (proven and not rb and not rh)
               for _, decl, (rb, rh, proven) in _bh_leaves(mask_mod, q, k, True))
