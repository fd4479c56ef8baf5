"""Dense evaluation with FlexAttention's semantics: a mask_mod is defined on scalar indices
(vmap, torch's public ``create_mask``); broadcasting index tensors is the fast path, used for
a mod only where a probe at two shapes, under a watch of its index tensors, agrees."""
from __future__ import annotations

import re
import time
import types
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode

from ._kinds import MaskError, MaskMod, _VmapFailure
from ._mask import Mask

#: The probe on which a mask_mod's broadcast evaluation is compared with its per-index (vmap)
#: evaluation: ``(B, H, Lq, Lk)``, non-square so that a reduction over one axis cannot hide.
PROBE_SHAPE = (2, 3, 5, 7)

#: The second probe shape: a mod whose broadcast evaluation depends on the index tensors'
#: shape (``q_idx.numel()``) agrees with itself at one shape only by coincidence.
PROBE_SHAPE_2 = (3, 4, 11, 13)

# What a mask_mod may not do with an index tensor (or a tensor computed from one) for its
# broadcast evaluation to mean its per-scalar one: read the shape or turn it into Python.
_SHAPE_READS = frozenset({
    "numel", "nelement", "size", "dim", "ndimension", "__len__", "shape", "ndim", "stride",
    "item", "tolist", "numpy", "__array__", "__int__", "__float__", "__index__",
    "data_ptr", "storage_offset", "is_contiguous", "count_nonzero", "unique", "nonzero"})


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":                     # a property such as .shape / .ndim
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return str(name)


class _IndexWatch(TorchFunctionMode):
    """Watches a mask_mod called on broadcast index tensors and records the first thing it
    does with them (or with a tensor computed from them) that is not elementwise: reading a
    shape (``q_idx.numel()``, ``len``, ``.shape``), turning one into a Python value, or an
    op whose result is smaller than its index-tensor input (``.sum()``, ``.any()``,
    ``q_idx[0]``). Such a mod means something else broadcast than per scalar index, even
    where the two agree on a probe."""

    def __init__(self, inputs) -> None:
        super().__init__()
        self.tainted = {id(t): t for t in inputs}
        self.found: str | None = None

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        ins = [a for a in _leaves((args, kwargs)) if isinstance(a, torch.Tensor)
               and id(a) in self.tainted]
        if not ins:
            return out
        outs = [o for o in _leaves(out) if isinstance(o, torch.Tensor)]
        name = _func_name(func)
        if self.found is None:
            on_index = args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.tainted
            if name in _SHAPE_READS:
                self.found = f"reads .{name} of an index tensor"
            elif on_index and not name.startswith("new_") and \
                    any(o.numel() < max(t.numel() for t in ins) for o in outs):
                self.found = (f"reduces an index tensor ({name} returns fewer elements than "
                              f"it was given)")
        for o in outs:
            self.tainted[id(o)] = o
        return out


def _leaves(tree) -> list:
    if isinstance(tree, (tuple, list)):
        return [x for t in tree for x in _leaves(t)]
    if isinstance(tree, dict):
        return [x for t in tree.values() for x in _leaves(t)]
    return [tree]

_CONTROL_FLOW_HINT = (
    "mask_mod uses Python control flow on tensors (if / and / or / not, bool(), or a "
    "data-dependent branch); mask_mods are traced per scalar index under torch.vmap, as in "
    "FlexAttention, where that is not allowed, so write it with tensor ops: & instead of "
    "'and', | instead of 'or', ~ instead of 'not', and torch.where(cond, a, b) instead of "
    "'a if cond else b'"
)
_ITEM_HINT = (
    "mask_mod calls .item() (or int() / float() / a Python comparison) on an index tensor; "
    "mask_mods are traced per scalar index under torch.vmap, as in FlexAttention, and "
    ".item() / Python control flow on index values are not allowed there; keep the value a "
    "tensor (index a captured tensor with it, compare it, combine with & | ~ and torch.where)"
)

# Per-mod verdict of the probe: mod -> (method, probed_b, probed_h) with method "broadcast"
# or "vmap" (a plain callable) or "tree" (a Mask evaluated child by child), and the number
# of distinct b / h values the probe saw (a later call with more re-probes). Weak keys: a
# verdict lives as long as its mod. Bound methods are keyed by (instance, function).
_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_BOUND_METHODS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_WARNED: set[tuple[str, int, str]] = set()


def _is_control_flow_error(e: BaseException) -> bool:
    s = str(e)
    return ("Boolean value of Tensor" in s and "ambiguous" in s) or "data-dependent control flow" in s


def _name(fn) -> str:
    return str(getattr(fn, "__name__", type(fn).__name__))


def _vmap_error(e: BaseException, mod) -> MaskError | None:
    """The MaskError FlexAttention's behaviour implies for an error raised under vmap."""
    s = str(e)
    if ".item()" in s:
        return MaskError(f"{_name(mod)}: {_ITEM_HINT}")
    if _is_control_flow_error(e):
        return MaskError(_CONTROL_FLOW_HINT)
    m = re.search(r"must only return Tensors, got type <class '([\w.]+)'>", s)
    if m:
        return MaskError(f"mask_mod {_name(mod)} must return a bool tensor, got {m.group(1)}; "
                         f"build it from comparisons combined with & and |")
    return None


def _check_result(out, shape: tuple[int, ...]) -> torch.Tensor:
    """Validate a mask_mod result and broadcast it to ``shape``.

    A wrong type or dtype raises :class:`MaskError`; a shape that does not broadcast raises
    torch's RuntimeError.
    """
    if isinstance(out, bool):
        out = torch.tensor(out)
    if not isinstance(out, torch.Tensor):
        raise MaskError(f"mask_mod must return a bool tensor, got {type(out).__name__}; "
                        f"build it from comparisons combined with & and |")
    if out.dtype != torch.bool:
        raise MaskError(f"mask_mod must return a bool tensor, got {out.dtype}; "
                        f"build it from comparisons combined with & and |")
    return out.expand(shape)


def _by_broadcast(mod, b, h, q_pos, kv_pos) -> torch.Tensor:
    """``mod`` called once on broadcast index tensors: ``[len(b), len(h), Lq, Lk]``."""
    out = mod(b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q_pos.view(1, 1, -1, 1),
              kv_pos.view(1, 1, 1, -1))
    return _check_result(out, (b.numel(), h.numel(), q_pos.numel(), kv_pos.numel()))


def _pick(values: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``values[i]`` for a 0-d index under vmap, as a 0-d tensor."""
    return values.gather(0, i.reshape(1)).reshape(())


def _by_vmap_pairs(mod, b, h, qpos, kpos) -> torch.Tensor:
    """FlexAttention's evaluation (torch's public ``create_mask``, i.e. vmap over scalar
    indices) of ``mod`` on ``n`` pairs of position sets ``qpos [n, lq]``, ``kpos [n, lk]``,
    batch / head values ``b``, ``h``: bool ``[n, len(b), len(h), lq, lk]``. The pair index
    rides in create_mask's batch dimension, so this is one vmapped call.

    Raises:
        MaskError: what FlexAttention would refuse (``.item()``, control flow, non-bool).
    """
    from torch.nn.attention.flex_attention import create_mask

    n, lq = qpos.shape
    lk = kpos.shape[1]
    nb, nh = b.numel(), h.numel()
    shape = (n, nb, nh, lq, lk)
    if 0 in shape:
        return torch.zeros(shape, dtype=torch.bool, device=qpos.device)

    qflat, kflat = qpos.reshape(-1), kpos.reshape(-1)

    def by_index(bb, hh, qi, ki):  # gather, not getitem: ~10x faster under vmap (measured)
        pair = bb // nb
        return mod(_pick(b, bb % nb), _pick(h, hh), _pick(qflat, pair * lq + qi),
                   _pick(kflat, pair * lk + ki))

    try:
        out = create_mask(by_index, n * nb, nh, lq, lk, device=qpos.device)
    except MaskError:
        raise
    except Exception as e:  # noqa: BLE001 - named and re-raised
        err = _vmap_error(e, mod)
        if err is not None:
            raise err from e
        raise _VmapFailure(f"mask_mod {_name(mod)} fails when called per scalar index, as "
                        f"FlexAttention calls it (torch.vmap): {type(e).__name__}: {e}") from e
    return _check_result(out, (n * nb, nh, lq, lk)).reshape(shape)


def _spread(pos: torch.Tensor, n: int) -> torch.Tensor:
    """``n`` positions spread evenly over ``pos`` (repeats when it is shorter). The first and
    last are always in, so a probe over ``pos`` x ``pos`` holds diagonal pairs."""
    idx = torch.linspace(0, pos.numel() - 1, n, device=pos.device).round().long()
    return pos[idx]


def _cycle(n_values: int, n: int, device) -> torch.Tensor:
    return torch.arange(n, device=device) % max(1, n_values)


def _cached(mod) -> tuple[str, int, int] | None:
    try:
        if isinstance(mod, types.MethodType):
            return _BOUND_METHODS.get(mod.__self__, {}).get(mod.__func__)
        return _METHODS.get(mod)
    except TypeError:  # not hashable / not weak-referenceable: probe every call
        return None


def _remember(mod, verdict: tuple[str, int, int]) -> None:
    try:
        if isinstance(mod, types.MethodType):
            _BOUND_METHODS.setdefault(mod.__self__, {})[mod.__func__] = verdict
        else:
            _METHODS[mod] = verdict
    except TypeError:
        pass


def _decide(mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, nb: int, nh: int,
            strict: bool = True) -> str | None:
    """``"broadcast"`` if broadcasting ``mod`` agrees with its vmap evaluation on the probe,
    else ``"vmap"`` (cached per mod; warns once per source location when it is "vmap").

    The probe is :data:`PROBE_SHAPE`: b and h cycle through the call's ``nb`` / ``nh``
    values, q / kv positions are spread over the call's own (so captured tables are
    indexed in range), then again at :data:`PROBE_SHAPE_2`; the broadcast calls run under a
    watch of the index tensors (:class:`_IndexWatch`: a shape read or a reduction means
    "vmap" even where the values agree). Checks, not a proof of equality everywhere.

    Raises:
        MaskError: the mod fails per scalar index (FlexAttention would refuse it), unless
            ``strict`` is False (positions made up, not the caller's), which returns None
            instead; a non-strict "broadcast" verdict is used but not cached.
    """
    pb, ph, _, _ = PROBE_SHAPE
    seen_b, seen_h = min(nb, pb), min(nh, ph)
    hit = _cached(mod)
    if hit is not None and (hit[0] == "vmap" or (hit[1] >= seen_b and hit[2] >= seen_h)):
        return hit[0]
    dev = q_pos.device
    reason = None
    t0 = t1 = t2 = 0.0
    for shape in (PROBE_SHAPE, PROBE_SHAPE_2):     # two shapes: see PROBE_SHAPE_2
        sb, sh, pq, pk = shape
        b, h = _cycle(nb, sb, dev), _cycle(nh, sh, dev)
        qp, kp = _spread(q_pos, pq), _spread(kv_pos, pk)
        t0 = time.perf_counter()
        try:
            want = _by_vmap_pairs(mod, b, h, qp[None], kp[None])[0]
        except MaskError:
            if strict:
                raise
            return None
        t1 = time.perf_counter()
        args = (b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), qp.view(1, 1, -1, 1),
                kp.view(1, 1, 1, -1))
        watch = _IndexWatch(args)
        try:
            with watch:
                out = mod(*args)
            got = _check_result(out, (b.numel(), h.numel(), qp.numel(), kp.numel()))
        except Exception as e:  # noqa: BLE001 - a mod written for scalars may reject broadcasting
            reason = f"calling it on broadcast index tensors raises {type(e).__name__}: {e}"
            break
        t2 = time.perf_counter()
        diff = (got != want).nonzero()
        if len(diff):
            i, j, k, l_ = diff[0].tolist()
            reason = (f"at b={int(b[i])}, h={int(h[j])}, q_idx={int(qp[k])}, kv_idx={int(kp[l_])} "
                      f"broadcasting gives {bool(got[i, j, k, l_])} and FlexAttention's "
                      f"per-index evaluation gives {bool(want[i, j, k, l_])} (a reduction such "
                      f"as .all() / .any() / .sum() over the index tensors does this)")
            break
        if watch.found is not None:     # agrees here, but only by the probe's choice of shape
            reason = (f"called on broadcast index tensors it {watch.found}, so what it means "
                      f"depends on the tensors' shape, not only on each (b, h, q_idx, kv_idx)")
            break
    method = "broadcast" if reason is None else "vmap"
    if hit is not None and hit[0] == "vmap":
        method = "vmap"
    if strict or method == "vmap":  # a "broadcast" verdict on made-up positions is not kept
        _remember(mod, (method, max(seen_b, hit[1] if hit else 0),
                        max(seen_h, hit[2] if hit else 0)))
    if reason is not None:
        code = getattr(mod, "__code__", None)
        where = (code.co_filename, code.co_firstlineno, code.co_name) if code is not None else \
            (type(mod).__module__, 0, type(mod).__qualname__)
        if where not in _WARNED:
            _WARNED.add(where)
            cost = "" if t2 < t1 else \
                f" (on the probe: {1e3 * (t1 - t0):.2f} ms by vmap vs {1e3 * (t2 - t1):.2f} ms)"
            warnings.warn(
                f"mask_mod {_name(mod)} does not evaluate elementwise on broadcast index tensors "
                f"(probe B,H,Lq,Lk={PROBE_SHAPE}): {reason}. fringe evaluates it per scalar index "
                f"with torch.vmap (create_mask) from now on, as FlexAttention does: correct, but "
                f"slower than broadcasting{cost}; write it elementwise (no reductions over "
                f"q_idx / kv_idx) to get the fast path", stacklevel=4)
    return method


def _method(mask_mod, q_pos: torch.Tensor, kv_pos: torch.Tensor, nb: int, nh: int,
            strict: bool = True) -> str | None:
    """How :func:`evaluate` evaluates ``mask_mod``: ``"broadcast"``, ``"vmap"`` or ``"tree"``.

    A :class:`Mask` whose leaves all come from the factories is elementwise by construction
    (no probe); a Mask tree with a leaf that needs vmap is evaluated child by child
    (``"tree"``), so its structured leaves keep the fast path.
    """
    if not isinstance(mask_mod, Mask):
        return _decide(mask_mod, q_pos, kv_pos, nb, nh, strict)
    if mask_mod.op == "leaf":
        if mask_mod.rule is not None:
            return "broadcast"
        return _decide(mask_mod.mod, q_pos, kv_pos, nb, nh, strict)
    kids = [_method(c, q_pos, kv_pos, nb, nh, strict) for c in mask_mod.children]
    if None in kids:
        return None
    return "broadcast" if all(k == "broadcast" for k in kids) else "tree"


def _eval_pairs(mask_mod, method: str, qpos: torch.Tensor, kpos: torch.Tensor,
                nb: int, nh: int) -> torch.Tensor:
    """``mask_mod`` on ``n`` pairs of position sets ``qpos [n, lq]``, ``kpos [n, lk]`` for
    ``b < nb``, ``h < nh``, by ``method`` (from :func:`_method`): ``[n, nb, nh, lq, lk]``."""
    n, lq = qpos.shape
    lk = kpos.shape[1]
    dev = qpos.device
    b, h = torch.arange(nb, device=dev), torch.arange(nh, device=dev)
    if method == "tree":
        kids = mask_mod.children
        out = _eval_pairs(kids[0], _method(kids[0], qpos[0], kpos[0], nb, nh), qpos, kpos, nb, nh)
        for c in kids[1:]:
            m = _eval_pairs(c, _method(c, qpos[0], kpos[0], nb, nh), qpos, kpos, nb, nh)
            out = (out & m) if mask_mod.op == "and" else (out | m)
        return out
    mod = mask_mod.mod if isinstance(mask_mod, Mask) else mask_mod
    if method == "vmap":
        return _by_vmap_pairs(mod, b, h, qpos, kpos)
    shape = (n, nb, nh, lq, lk)
    if n == 1:
        return _by_broadcast(mod, b, h, qpos[0], kpos[0])[None]
    try:
        return _check_result(mod(b.view(1, -1, 1, 1, 1), h.view(1, 1, -1, 1, 1),
                                 qpos.view(n, 1, 1, lq, 1), kpos.view(n, 1, 1, 1, lk)), shape)
    except MaskError:
        raise
    except Exception:  # noqa: BLE001 - elementwise on 4-D, not on 5-D: go pair by pair
        return torch.stack([_by_broadcast(mod, b, h, qpos[i], kpos[i]) for i in range(n)])


def evaluate(mask_mod: MaskMod, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             B: int | None = None, H: int | None = None, method: str = "auto") -> torch.Tensor:
    """Evaluate ``mask_mod`` densely on global positions, with FlexAttention's semantics.

    FlexAttention defines a mask_mod on scalar indices and vmaps it. Calling it once on
    broadcast index tensors is the fast path and gives the same answer for elementwise code,
    but not for reductions over the indices (``.all()``, ``.any()``, ``.sum()``), code that
    needs scalars, or ``.item()``. So ``"auto"`` compares both on a small non-square probe
    (:data:`PROBE_SHAPE`, positions spread over the call's own) the first time it sees a mod,
    caches the verdict per mod, and from then on broadcasts where they agreed and vmaps
    (warning once, with the reason) where they did not. Masks from the factories are
    elementwise by construction and never probed. The probe runs at two shapes and watches
    what the mod does with its index tensors: reading their shape (``q_idx.numel()``) or
    reducing them sends it to vmap even where the probe's values agree. Still a **check,
    not a proof**: a mod whose meaning depends on state the probe cannot see (a global
    it changes between calls) could still be broadcast.

    Args:
        mask_mod: a :class:`Mask` or any ``(b, h, q_idx, kv_idx) -> bool tensor``.
        q_pos, kv_pos: 1-D int tensors of global positions (any order).
        B, H: batch / head counts to evaluate (None: 1, i.e. ``b = h = 0``).
        method: ``"auto"`` (above), ``"broadcast"`` (one call on broadcast index tensors,
            whatever it means) or ``"vmap"`` (FlexAttention's definition: torch's public
            ``create_mask``).

    Returns:
        bool tensor ``[B or 1, H or 1, Lq, Lk]`` (possibly an expanded view).

    Raises:
        MaskError: the mask_mod returns something other than a bool tensor, or does what
            FlexAttention refuses: ``.item()``, Python control flow on index values.
    """
    if method not in ("auto", "broadcast", "vmap"):
        raise ValueError(f"evaluate: method={method!r}; use 'auto', 'broadcast' or 'vmap'")
    dev = q_pos.device
    kv_pos = kv_pos.to(dev)
    nb, nh, lq, lk = B or 1, H or 1, q_pos.numel(), kv_pos.numel()
    if 0 in (lq, lk):
        return torch.zeros((nb, nh, lq, lk), dtype=torch.bool, device=dev)
    if method == "auto":
        method = _method(mask_mod, q_pos, kv_pos, nb, nh)
    if method == "broadcast":
        try:
            mod = mask_mod.mod if isinstance(mask_mod, Mask) else mask_mod
            return _by_broadcast(mod, torch.arange(nb, device=dev), torch.arange(nh, device=dev),
                                 q_pos, kv_pos)
        except Exception as e:  # noqa: BLE001
            if _is_control_flow_error(e):
                raise MaskError(_CONTROL_FLOW_HINT) from e
            raise
    return _eval_pairs(mask_mod, method, q_pos[None], kv_pos[None], nb, nh)[0]
