"""The :class:`Mask` type: a frozen, named, composable mask_mod; ``&`` / ``|``; the factories
(:func:`full`, :func:`causal`, :func:`sliding_window`, :func:`document`, :func:`prefix_lm`)
and :func:`as_mask`."""
from __future__ import annotations

import dataclasses

import torch

from ._kinds import MaskMod
from ._rules import _Band, _Document, _KvBelow


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Mask:
    """A named, composable mask_mod with global token indices.

    Call it like a mask_mod: ``mask(b, h, q_idx, kv_idx) -> bool tensor``. Combine with
    ``&`` / ``|`` (the other side may be a plain callable).

    Attributes:
        mod: the mask_mod.
        name: display name (also ``repr(mask)`` and ``mask.__name__``).
        bh_invariant: a declaration, one of three values. ``True``: the mask ignores ``b``
            and ``h`` (every factory; :func:`as_mask` with ``bh_invariant=True``: trusted,
            the mask is classified once). ``False``: it reads them (classified for every
            ``b < B``, ``h < H``). ``None`` (:func:`as_mask`'s default): not declared; fringe
            decides where it can prove it: a mask evaluated by broadcasting reads ``b`` /
            ``h`` exactly when its output varies along that axis, but a mask evaluated per
            scalar index (torch.vmap; see :func:`evaluate`) cannot be proven to ignore
            them by a probe (a probe proves nothing about values it did not try), so
            :func:`fringe.plan` classifies it for every ``b`` / ``h`` it is given, or
            raises when it is given neither. ``&`` / ``|``: True if every operand is True,
            False if one is False, else None.
        op: ``"leaf"``, ``"and"`` or ``"or"``; ``children`` are the operands.
        rule: the structured block rule of a leaf (None: classified densely).
    """

    mod: MaskMod
    name: str
    bh_invariant: bool | None = True
    op: str = "leaf"
    children: tuple[Mask, ...] = ()
    rule: object | None = None
    display_op: str | None = None  # "and"/"or" for an unnamed composition (parenthesised)

    def __call__(self, b, h, q_idx, kv_idx):
        return self.mod(b, h, q_idx, kv_idx)

    @property
    def __name__(self) -> str:  # noqa: A003 - mimic a function for FlexAttention users
        return self.name

    def __repr__(self) -> str:
        return self.name

    @property
    def structured(self) -> bool:
        """True when every leaf has a block rule (classify never needs dense fallback
        except for undecided pairs)."""
        if self.op == "leaf":
            return self.rule is not None
        return all(c.structured for c in self.children)

    def __and__(self, other) -> Mask:
        return _combine("and", self, other)

    def __rand__(self, other) -> Mask:
        return _combine("and", other, self)

    def __or__(self, other) -> Mask:
        return _combine("or", self, other)

    def __ror__(self, other) -> Mask:
        return _combine("or", other, self)


def _combine(op: str, *masks) -> Mask:
    ms = [as_mask(m) for m in masks]
    kids: list[Mask] = []
    parts: list[str] = []
    for m in ms:
        if m.display_op == op:  # flatten unnamed a & (b & c)
            kids.extend(m.children)
        else:
            kids.append(m)
        parts.append(f"({m.name})" if m.display_op not in (None, op) else m.name)
    name = f" {'&' if op == 'and' else '|'} ".join(parts)
    decl = [k.bh_invariant for k in kids]
    inv = True if all(d is True for d in decl) else False if any(d is False for d in decl) else None
    return Mask(mod=_combined_mod(op, tuple(k.mod for k in kids), name), name=name,
                bh_invariant=inv, op=op, children=tuple(kids), display_op=op)


def _combined_mod(op: str, mods: tuple, name: str) -> MaskMod:
    """``mods[0] & mods[1] & ...`` (or ``|``) as one mask_mod."""
    if op == "and":
        def mod(b, h, q_idx, kv_idx):
            out = mods[0](b, h, q_idx, kv_idx)
            for f in mods[1:]:
                out = out & f(b, h, q_idx, kv_idx)
            return out
    else:
        def mod(b, h, q_idx, kv_idx):
            out = mods[0](b, h, q_idx, kv_idx)
            for f in mods[1:]:
                out = out | f(b, h, q_idx, kv_idx)
            return out
    mod.__name__ = name
    return mod


def as_mask(fn, name: str | None = None, *, bh_invariant: bool | None = None) -> Mask:
    """Wrap an arbitrary mask_mod (returned unchanged if it already is a :class:`Mask`).

    Args:
        fn: ``fn(b, h, q_idx, kv_idx) -> bool tensor`` on global indices.
        name: display name; defaults to ``fn.__name__``.
        bh_invariant: ``True`` declares that ``fn`` ignores ``b`` and ``h`` (trusted: it is
            classified once, for ``b = h = 0``); ``False`` that it reads them; ``None``
            (default) takes ``fn``'s own ``bh_invariant`` attribute when that is True or
            False, and otherwise declares nothing: fringe reads the dependence from the
            output's shape where it evaluates ``fn`` by broadcasting, and otherwise (a mod
            evaluated per scalar index) :func:`fringe.plan` needs ``batch_size=`` /
            ``num_heads=`` or this declaration (see :attr:`Mask.bh_invariant`).

    Returns:
        a :class:`Mask` classified by dense evaluation.
    """
    if isinstance(fn, Mask):
        if name is None or name == fn.name:
            return fn
        return dataclasses.replace(fn, name=name, display_op=None)
    if not callable(fn):
        raise TypeError(f"a mask_mod must be callable (b, h, q_idx, kv_idx) -> bool tensor, "
                        f"got {type(fn).__name__}")
    if bh_invariant is None:
        bh_invariant = declared_bh_invariant(fn)
    return Mask(mod=fn, name=name or getattr(fn, "__name__", "mask_mod"),
                bh_invariant=bh_invariant)


def declared_bh_invariant(mask_mod) -> bool | None:
    """What ``mask_mod`` declares about ``b`` / ``h``: ``True`` (ignores both), ``False``
    (reads them) or ``None`` (nothing). A :class:`Mask` by :attr:`Mask.bh_invariant`; a plain
    function by a ``bh_invariant`` attribute that is exactly True or False."""
    d = getattr(mask_mod, "bh_invariant", None)
    return d if d is True or d is False else None


def _leaf(mod: MaskMod, name: str, rule) -> Mask:
    mod.__name__ = name
    return Mask(mod=mod, name=name, rule=rule)


def full() -> Mask:
    """Every pair allowed."""
    def full_mod(b, h, q_idx, kv_idx):
        return q_idx.new_ones((), dtype=torch.bool)
    return _leaf(full_mod, "full", _Band(None, None))


def causal() -> Mask:
    """``q_idx >= kv_idx``."""
    def causal_mod(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx
    return _leaf(causal_mod, "causal", _Band(0, None))


def sliding_window(window: int, *, causal: bool = True) -> Mask:
    """Local attention.

    Args:
        window: number of allowed offsets per side (>= 1).
        causal: True: ``0 <= q_idx - kv_idx < window``; False: ``|q_idx - kv_idx| < window``.
    """
    window = int(window)
    if window < 1:
        raise ValueError(f"sliding_window: window={window} must be >= 1 (window=1 keeps the "
                         f"diagonal only)")
    if causal:
        def sliding_window_mod(b, h, q_idx, kv_idx):
            d = q_idx - kv_idx
            return (d >= 0) & (d < window)
        return _leaf(sliding_window_mod, f"sliding_window({window})", _Band(0, window - 1))

    def sliding_window_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() < window
    return _leaf(sliding_window_mod, f"sliding_window({window}, causal=False)",
                 _Band(-(window - 1), window - 1))


def document(doc_ids: torch.Tensor) -> Mask:
    """Attention within a document: ``doc_ids[q_idx] == doc_ids[kv_idx]``.

    Args:
        doc_ids: 1-D integer tensor, one doc id per **global** position. Packed documents
            (non-decreasing ids) classify exactly from block summaries; any ids work.

    Mutable state: the mask owns a copy of ``doc_ids`` (refilling yours for the next batch
    changes nothing). Its copy (``mask.rule.doc_ids``) is its state: edited in place, the
    mask raises when it is classified or planned, and a plan over it on its next call.
    """
    if not isinstance(doc_ids, torch.Tensor):
        doc_ids = torch.as_tensor(doc_ids)
    if doc_ids.dim() != 1 or doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool \
            or doc_ids.is_complex():
        raise ValueError(f"document: doc_ids must be a 1-D integer tensor over global positions, "
                         f"got dtype={doc_ids.dtype} shape={tuple(doc_ids.shape)}")
    doc_ids = doc_ids.detach().clone()  # own a copy: the caller may refill theirs
    sorted_ids = bool((doc_ids[1:] >= doc_ids[:-1]).all())
    if sorted_ids:  # packed documents: count boundaries (no sort of S ids)
        n_docs = int((doc_ids[1:] != doc_ids[:-1]).sum()) + int(doc_ids.numel() > 0)
    else:
        n_docs = int(torch.unique(doc_ids).numel())

    def document_mod(b, h, q_idx, kv_idx):
        ids = doc_ids.to(q_idx.device)
        return ids[q_idx] == ids[kv_idx]

    return _leaf(document_mod, f"document({n_docs} doc{'s' if n_docs != 1 else ''})",
                 _Document(doc_ids, sorted_ids))


def prefix_lm(prefix_len: int) -> Mask:
    """Bidirectional over a prefix, causal after: ``kv_idx < prefix_len or q_idx >= kv_idx``."""
    n = int(prefix_len)
    if n < 0:
        raise ValueError(f"prefix_lm: prefix_len={n} must be >= 0")

    def prefix_mod(b, h, q_idx, kv_idx):
        return kv_idx < n
    below = _leaf(prefix_mod, f"kv<{n}", _KvBelow(n))
    m = _combine("or", below, causal())

    def prefix_lm_mod(b, h, q_idx, kv_idx):
        return (kv_idx < n) | (q_idx >= kv_idx)
    prefix_lm_mod.__name__ = f"prefix_lm({n})"
    return dataclasses.replace(m, mod=prefix_lm_mod, name=f"prefix_lm({n})", display_op=None)
