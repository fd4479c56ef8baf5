"""The dense oracle, and the ``reference`` kernel (einsum, any dtype, any mask, any score_mod).

Everything in fringe is checked against :func:`attention`: it materialises the whole
``[B, H, Lq, Lk]`` score matrix over positions ``arange(Lq)`` x ``arange(Lk)`` and is
differentiable with plain autograd (the tests use it as the gradient oracle).

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim.
GQA never materialises repeated k/v: q is viewed as ``[B, G, H/G, Lq, D]`` and the
einsums run over ``"bgrqd,bgkd->bgrqk"`` (query head ``h = g * (H/G) + r`` reads kv head ``g``).
"""
from __future__ import annotations

import math
import weakref
from typing import Callable

import torch

from fringe.masks import evaluate, reads_bh

ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]

__all__ = ["attention", "apply_score_mod", "broadcast_agrees", "causal_mask", "check_causal",
           "check_qkv", "compute_dtype", "grad_tile", "lse_dtype", "mask_for", "ReferenceKernel",
           "REFERENCE", "ScoreModError"]


# ---------------------------------------------------------------------------------------------
# validation and small helpers


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              q_pos: torch.Tensor | None = None,
              kv_pos: torch.Tensor | None = None) -> tuple[int, int, int, int, int, int]:
    """Validate attention inputs before any math.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, Dv]`` (Dv may differ from D: MLA).
        q_pos: optional global positions of q's rows, ``[Lq]``.
        kv_pos: optional global positions of k/v's rows, ``[Lk]``.

    Returns:
        ``(B, H, G, Lq, Lk, D)`` (D of q and k; ``v.shape[-1]`` is Dv).

    Raises:
        ValueError: with what was expected and how to fix it.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            want = "[B, H, Lq, D]" if name == "q" else "[B, G, Lk, D]"
            raise ValueError(f"{name} must be 4-D {want}, got shape {tuple(t.shape)}; "
                             f"add the missing batch/head dims (e.g. {name}[None])")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must agree in [B, G, Lk] (v's head dim Dv may differ from "
                         f"k's, as in MLA), got k {tuple(k.shape)} and v {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    Bk, G, Lk, Dk = k.shape
    if D != Dk:
        raise ValueError(f"head dim mismatch: q has D={D} but k has D={Dk}; q [B, H, Lq, D] "
                         f"and k [B, G, Lk, D] must share D (v may have its own Dv)")
    if B != Bk:
        raise ValueError(f"batch mismatch: q has B={B} but k/v have B={Bk}")
    for name, n, what in (("B", B, "batch size"), ("H", H, "query heads"), ("G", G, "kv heads"),
                          ("Lq", Lq, "query rows"), ("Lk", Lk, "key/value rows"),
                          ("D", D, "head dim"), ("Dv", v.shape[-1], "v head dim")):
        if n == 0:
            raise ValueError(f"{what} {name}=0 (q {tuple(q.shape)} as [B, H, Lq, D], k/v "
                             f"{tuple(k.shape)} as [B, G, Lk, D]); attention needs every "
                             f"dimension >= 1")
    if H % G != 0:
        raise ValueError(f"H={H} query heads is not a multiple of G={G} kv heads; GQA needs "
                         f"H % G == 0 (each kv head serves H/G query heads)")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"dtype mismatch: q {q.dtype}, k {k.dtype}, v {v.dtype}; cast them to one "
                         f"dtype (e.g. k.to(q.dtype))")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q/k/v must be floating point, got {q.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"device mismatch: q on {q.device}, k on {k.device}, v on {v.device}; "
                         f"move them to one device")
    for name, pos, n, rows in (("q_pos", q_pos, Lq, "q's Lq"), ("kv_pos", kv_pos, Lk, "k/v's Lk")):
        if pos is None:
            continue
        if pos.dim() != 1 or pos.numel() != n:
            raise ValueError(f"{name} must be 1-D with {rows}={n} global positions, got shape "
                             f"{tuple(pos.shape)}")
        if pos.device != q.device:
            raise ValueError(f"{name} is on {pos.device} but q/k/v are on {q.device}; move it")
    return B, H, G, Lq, Lk, D


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation dtype: float64 for float64 inputs, float32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


lse_dtype = compute_dtype


def default_scale(D: int, scale: float | None) -> float:
    """The softmax scale: ``1/sqrt(D)`` when ``scale`` is None.

    Raises:
        ValueError: for ``D < 1`` or a scale that is not a finite real number.
    """
    if scale is None:
        if D < 1:
            raise ValueError(f"head dim D={D}: the default scale 1/sqrt(D) needs D >= 1")
        return 1.0 / math.sqrt(D)
    try:
        value = float(scale)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"scale must be a real number (or None for 1/sqrt(D)), got "
                         f"{scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite (or None for 1/sqrt(D)), got {value}")
    return value


def mask_for(mask_mod: MaskMod | None, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             B: int, H: int) -> torch.Tensor | None:
    """Evaluate ``mask_mod`` on global positions: bool ``[B or 1, H or 1, Lq, Lk]`` or None.

    A mask declared or proven not to read ``b`` / ``h`` (:func:`fringe.masks.reads_bh`) is
    evaluated once (``[1, 1, Lq, Lk]``).
    """
    if mask_mod is None:
        return None
    if reads_bh(mask_mod, q_pos=q_pos, kv_pos=kv_pos).invariant:
        return evaluate(mask_mod, q_pos, kv_pos)
    return evaluate(mask_mod, q_pos, kv_pos, B=B, H=H)


def raw_scores(q: torch.Tensor, k: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``q k^T * scale`` in the compute dtype, as ``[B, H, Lq, Lk]`` (GQA without repeats)."""
    B, H, Lq, D = q.shape
    G, Lk = k.shape[1], k.shape[2]
    ct = compute_dtype(q.dtype)
    qg = q.to(ct).reshape(B, G, H // G, Lq, D)
    s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k.to(ct)) * scale
    return s.reshape(B, H, Lq, Lk)


# ---------------------------------------------------------------------------------------------
# score_mod semantics: FlexAttention's (defined on scalar indices), broadcasting as the fast path

#: The probe on which a score_mod's broadcast evaluation is compared with its vmap evaluation:
#: ``(B, H, Lq, Lk)``, non-square so that a reduction over one axis cannot hide.
PROBE_SHAPE = (2, 3, 5, 7)

_BROADCAST_OK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class ScoreModError(ValueError):
    """A score_mod that cannot be evaluated the way FlexAttention evaluates it (per scalar)."""


def _vmapped(fn: Callable) -> Callable:
    """``fn(score, b, h, q_idx, kv_idx)`` on scalars -> the same on ``[B,H,Lq,Lk]`` / 1-D indices.

    Nested ``torch.func.vmap`` over (b, h, q_idx, kv_idx), as FlexAttention applies a score_mod.
    """
    f = torch.func.vmap(fn, in_dims=(0, None, None, None, 0))     # kv_idx
    f = torch.func.vmap(f, in_dims=(0, None, None, 0, None))      # q_idx
    f = torch.func.vmap(f, in_dims=(0, None, 0, None, None))      # h
    return torch.func.vmap(f, in_dims=(0, 0, None, None, None))   # b


def _by_vmap(s: torch.Tensor, score_mod: ScoreMod, b, h, q_pos, kv_pos) -> torch.Tensor:
    try:
        out = _vmapped(score_mod)(s, b, h, q_pos, kv_pos)
    except Exception as e:  # noqa: BLE001 - re-raised with the cause named
        raise ScoreModError(
            f"score_mod {_name(score_mod)} fails when applied per (b, h, q_idx, kv_idx) with "
            f"torch.func.vmap, as FlexAttention applies it ({type(e).__name__}: {e}); write it "
            f"for scalar tensors: no .item(), no Python control flow on tensor values") from e
    if tuple(out.shape) != tuple(s.shape):
        raise ScoreModError(f"score_mod {_name(score_mod)} must return one score per "
                            f"(b, h, q_idx, kv_idx) (a scalar under vmap); got shape "
                            f"{tuple(out.shape)} for scores {tuple(s.shape)}")
    return out


def _name(fn) -> str:
    return repr(getattr(fn, "__name__", fn))


def _cycle(t: torch.Tensor, n: int) -> torch.Tensor:
    return t[torch.arange(n, device=t.device) % t.numel()]


def _broadcast(s: torch.Tensor, score_mod: ScoreMod, b, h, q_pos, kv_pos) -> torch.Tensor:
    out = score_mod(s, b.view(-1, 1, 1, 1), h.view(1, -1, 1, 1), q_pos.view(1, 1, -1, 1),
                    kv_pos.view(1, 1, 1, -1))
    out = torch.as_tensor(out, device=s.device)
    return out.expand(s.shape)


def broadcast_agrees(score_mod: ScoreMod, *, B: int, H: int, q_pos: torch.Tensor,
                     kv_pos: torch.Tensor, dtype: torch.dtype = torch.float64) -> bool:
    """Whether broadcasting ``score_mod`` over index tensors gives what vmap gives (cached).

    FlexAttention defines a score_mod on scalar indices and vmaps it. Broadcasting index
    tensors is much faster and agrees for elementwise code, but not for reductions
    (``.sum()``, ``torch.dot`` over captured per-index vectors) or shape-dependent code. The
    first call per mod compares both on a small non-square probe (:data:`PROBE_SHAPE`, random
    scores, indices cycled from the problem's own so captured tables are indexed in range) and
    caches the verdict per mod (weakly). This is a check on one probe, not a proof: a mod that
    agrees on the probe and differs elsewhere is evaluated by broadcasting.

    Raises:
        ScoreModError: when the mod fails under vmap too (as it would in FlexAttention).
    """
    try:
        return _BROADCAST_OK[score_mod]
    except (KeyError, TypeError):
        pass
    pb, ph, pq, pk = PROBE_SHAPE
    dev = q_pos.device
    g = torch.Generator().manual_seed(0)
    s = torch.randn(PROBE_SHAPE, generator=g, dtype=dtype).to(dev)
    bi = _cycle(torch.arange(max(B, 1), device=dev), pb)
    hi = _cycle(torch.arange(max(H, 1), device=dev), ph)
    qi = _cycle(q_pos, pq) if q_pos.numel() else torch.zeros(pq, dtype=torch.long, device=dev)
    ki = _cycle(kv_pos, pk) if kv_pos.numel() else torch.zeros(pk, dtype=torch.long, device=dev)
    with torch.no_grad():
        want = _by_vmap(s, score_mod, bi, hi, qi, ki)
        try:
            got = _broadcast(s, score_mod, bi, hi, qi, ki)
            ok = got.shape == want.shape and bool(
                torch.allclose(got.to(want.dtype), want, rtol=1e-12, atol=1e-12, equal_nan=True))
        except Exception:  # noqa: BLE001 - a mod written for scalars may reject broadcasting
            ok = False
    try:
        _BROADCAST_OK[score_mod] = ok
    except TypeError:            # not weak-referenceable: probe again next time
        pass
    return ok


def apply_score_mod(s: torch.Tensor, score_mod: ScoreMod | None, q_pos: torch.Tensor,
                    kv_pos: torch.Tensor) -> torch.Tensor:
    """``score_mod`` applied to scores ``[B, H, Lq, Lk]`` at global positions, per FlexAttention.

    Broadcasting where :func:`broadcast_agrees` says it agrees with vmap for this mod, else
    nested ``torch.func.vmap`` over scalar indices. Differentiable either way (autograd and
    ``torch.func.vjp`` both work through vmap).
    """
    if score_mod is None:
        return s
    B, H, Lq, Lk = s.shape
    dev = s.device
    b, h = torch.arange(B, device=dev), torch.arange(H, device=dev)
    if broadcast_agrees(score_mod, B=B, H=H, q_pos=q_pos, kv_pos=kv_pos):
        return _broadcast(s, score_mod, b, h, q_pos, kv_pos)
    return _by_vmap(s, score_mod, b, h, q_pos, kv_pos)


def _softmax_attend(s: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked scores ``[B, H, Lq, Lk]`` (-inf where masked) -> (out in compute dtype, lse).

    Differentiable and NaN-free: a row with no finite score gets out 0, lse -inf, grad 0.
    """
    B, H, Lq, Lk = s.shape
    G, D = v.shape[1], v.shape[3]
    m = s.detach().amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    z = e.sum(dim=-1, keepdim=True)
    dead = z == 0
    z_safe = torch.where(dead, torch.ones_like(z), z)
    lse = torch.where(dead, torch.full_like(z, -math.inf), torch.log(z_safe) + m).squeeze(-1)
    p = (e / z_safe).reshape(B, G, H // G, Lq, Lk)
    out = torch.einsum("bgrqk,bgkd->bgrqd", p, v.to(s.dtype)).reshape(B, H, Lq, D)
    return out, lse


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, q_pos: torch.Tensor,
           kv_pos: torch.Tensor, mask: torch.Tensor | None, score_mod: ScoreMod | None,
           scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of q rows against k/v rows with an optional bool mask; autograd-able."""
    s = apply_score_mod(raw_scores(q, k, scale=scale), score_mod, q_pos, kv_pos)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    out, lse = _softmax_attend(s, v)
    return out.to(q.dtype), lse


def _zero_nonfinite(t: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(t), t, torch.zeros((), dtype=t.dtype, device=t.device))


def grad_tile(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
              lse: torch.Tensor, dout: torch.Tensor, *, q_pos: torch.Tensor, kv_pos: torch.Tensor,
              mask: torch.Tensor | None, score_mod: ScoreMod | None, scale: float,
              dlse: torch.Tensor | None = None, score_params: tuple[torch.Tensor, ...] = ()):
    """One dense sub-problem's gradient given the GLOBAL ``out``/``lse`` (the reference backward).

    ``p = exp(s - lse)``, ``delta = rowsum(dout * out)``, ``ds = p * (dp - (delta - dlse))``:
    summed over all kv tiles of the q rows this is the exact gradient of a loss that uses both
    ``out`` and ``lse`` (``dlse`` its lse cotangent, None = 0). A globally dead row (lse = -inf)
    gets zero gradient whatever ``dlse`` is.

    Non-finite inputs: a masked pair contributes exactly nothing, whatever its q row, k row or
    ``dout`` row hold (``p`` and ``ds`` are masked, and the einsums read finite copies of q, k and
    dout where a non-finite entry could only meet a zero; a pair that is not masked still
    propagates NaN as dense attention does). A masked NaN in ``v`` gives NaN in ``out`` (forward)
    exactly as in the dense reference.

    Args:
        q, k, v, out, lse, dout, q_pos, kv_pos, mask, score_mod, scale: as in the kernel.
        dlse: cotangent of the GLOBAL lse of these rows, ``[B, H, Lq]``; None = zero.
        score_params: tensors the score_mod closes over that require grad.

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtypes, plus ``dparams`` (a tuple aligned with
        ``score_params``, this sub-problem's contribution) when ``score_params`` is non-empty.
    """
    B, H, Lq, D = q.shape
    G, Lk = k.shape[1], k.shape[2]
    R = H // G
    ct = compute_dtype(q.dtype)
    score_params = tuple(score_params)
    # Plain ops, no no_grad(): autograd already runs backward without grad, and this keeps
    # the body transformable by torch.func when called from an autograd.Function.
    s_raw = raw_scores(q, k, scale=scale)
    if mask is not None:            # a masked (maybe NaN) score must not reach score_mod's vjp
        s_raw = torch.where(mask, s_raw, torch.zeros((), dtype=ct, device=q.device))
    s = apply_score_mod(s_raw, score_mod, q_pos, kv_pos).to(ct)
    lse = lse.to(ct)
    # A globally dead row (lse = -inf) is masked in every tile: p must be 0, not NaN.
    dead = torch.isneginf(lse)
    lse = torch.where(dead, torch.zeros_like(lse), lse)
    p = torch.exp(s - lse.unsqueeze(-1))                               # [B, H, Lq, Lk]
    zero = torch.zeros((), dtype=ct, device=q.device)
    if mask is not None:
        p = torch.where(mask, p, zero)
    dout_c, out_c = dout.to(ct), out.to(ct)
    dog = dout_c.reshape(B, G, R, Lq, v.shape[-1])                     # Dv: out's head dim
    dp = torch.einsum("bgrqd,bgkd->bgrqk", dog, v.to(ct)).reshape(B, H, Lq, Lk)
    delta = (dout_c * out_c).sum(-1)                                    # [B, H, Lq]
    if dlse is not None:
        delta = delta - torch.where(dead, torch.zeros_like(lse), dlse.to(ct))
    ds = p * (dp - delta.unsqueeze(-1))
    if mask is not None:
        ds = torch.where(mask, ds, zero)
    pg = p.reshape(B, G, R, Lq, Lk)
    dv = torch.einsum("bgrqk,bgrqd->bgkd", pg, _zero_nonfinite(dog))
    bad = ~torch.isfinite(dog)
    if bool(bad.any()):             # a non-finite dout row poisons only the keys it attends to
        live = (mask if mask is not None else torch.ones((), dtype=torch.bool, device=q.device))
        live = live.expand(B, H, Lq, Lk).reshape(B, G, R, Lq, Lk).to(ct)
        hit = torch.einsum("bgrqk,bgrqd->bgkd", live, bad.to(ct)) > 0
        dv = torch.where(hit, torch.full((), math.nan, dtype=ct, device=q.device), dv)
    dparams: tuple[torch.Tensor, ...] = ()
    if score_mod is not None:
        ds, dparams = _score_mod_vjp(s_raw, ds, score_mod, q_pos, kv_pos, score_params)
        if mask is not None:
            ds = torch.where(mask, ds, zero)
    dsg = ds.reshape(B, G, R, Lq, Lk)
    dq = torch.einsum("bgrqk,bgkd->bgrqd", dsg, _zero_nonfinite(k.to(ct))).reshape(B, H, Lq, D)
    dk = torch.einsum("bgrqk,bgrqd->bgkd", dsg, _zero_nonfinite(q.to(ct)).reshape(B, G, R, Lq, D))
    grads = (dq.mul(scale).to(q.dtype), dk.mul(scale).to(k.dtype), dv.to(v.dtype))
    return (*grads, dparams) if score_params else grads


def _score_mod_vjp(s_raw, ds, score_mod, q_pos, kv_pos, score_params):
    """Pull ``ds`` (w.r.t. modified scores) back to raw scores and to ``score_params``."""
    if not score_params:
        _, pullback = torch.func.vjp(lambda t: apply_score_mod(t, score_mod, q_pos, kv_pos)
                                     .to(ds.dtype), s_raw)
        (ds,) = pullback(ds)
        return ds, ()
    for n, prm in enumerate(score_params):
        if not (isinstance(prm, torch.Tensor) and prm.requires_grad):
            raise ValueError(f"score_params[{n}] must be a tensor that requires grad (the "
                             f"parameters the score_mod closes over), got "
                             f"{type(prm).__name__}"
                             + ("" if not isinstance(prm, torch.Tensor) else " without grad"))
    with torch.enable_grad():
        raw = s_raw.detach().requires_grad_()
        mod = apply_score_mod(raw, score_mod, q_pos, kv_pos).to(ds.dtype)
        if not mod.requires_grad:       # the mod ignores scores and params: nothing flows
            return torch.zeros_like(ds), tuple(torch.zeros_like(p) for p in score_params)
        grads = torch.autograd.grad(mod, (raw, *score_params), grad_outputs=ds,
                                    allow_unused=True)
    ds_raw = grads[0] if grads[0] is not None else torch.zeros_like(ds)
    dparams = tuple(torch.zeros_like(p) if g is None else g
                    for p, g in zip(score_params, grads[1:]))
    return ds_raw, dparams


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              mask_mod: MaskMod | None = None, score_mod: ScoreMod | None = None,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reference attention over positions ``arange(Lq)`` x ``arange(Lk)``.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, Dv]`` (Dv may differ from D, as in MLA).
        mask_mod: FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``; None = full.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``; None = identity. As in
            FlexAttention it is defined per scalar (see :func:`apply_score_mod`).
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, H, Lq, Dv] in q's dtype, lse [B, H, Lq])``, lse natural-log in float32
        (float64 for float64 inputs). A fully masked row has out 0 and lse -inf; its gradients
        are 0, never NaN.

    Non-finite inputs: a masked score is replaced by -inf, so a NaN key never reaches the
    forward of a row that does not attend to it. Plain autograd through this oracle is not
    confined (its ``dq = ds @ k`` meets ``0 * NaN``), and a masked NaN value gives NaN in
    ``out`` (``0 * NaN`` in the einsum). fringe's kernels confine NaN in q/k/dout in the
    backward too, and never read EMPTY blocks, so a NaN value in a block no row of a tile
    attends to stays out of it; inside a computed sub-problem a masked NaN value gives NaN as
    here.
    """
    B, H, G, Lq, Lk, D = check_qkv(q, k, v)
    q_pos = torch.arange(Lq, device=q.device)
    kv_pos = torch.arange(Lk, device=q.device)
    mask = mask_for(mask_mod, q_pos, kv_pos, B=B, H=H)
    return attend(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask, score_mod=score_mod,
                  scale=default_scale(D, scale))


# ---------------------------------------------------------------------------------------------
# the reference kernel


class ReferenceKernel:
    """Einsum kernel for one dense sub-problem: any dtype, any mask, any score_mod.

    ``forward`` / ``backward`` take q rows ``[B, H, Lq, D]`` against a contiguous kv range
    ``[B, G, Lk, D]``, an optional bool ``mask`` broadcastable to ``[B, H, Lq, Lk]`` and global
    positions for ``score_mod``. ``backward`` takes the GLOBAL merged out/lse (flash-attention
    style), so partial gradients over kv tiles sum to the exact gradient.

    Non-finite inputs (see :func:`grad_tile`): a masked pair never contributes, whatever the
    values of its q row or k row (a NaN key confines to the rows that attend to it). A masked
    NaN *value* still gives NaN in ``out`` as in the dense reference (``0 * NaN``).
    """

    name = "reference"

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        return True, "always available"

    def forward(self, q, k, v, *, q_pos, kv_pos, mask=None, score_mod=None, scale,
                causal=False):
        mask = causal_mask(q, k, mask, causal)
        with torch.no_grad():
            return attend(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask, score_mod=score_mod,
                          scale=scale)

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask=None, score_mod=None,
                 scale, dlse=None, score_params=(), causal=False):
        return grad_tile(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos,
                         mask=causal_mask(q, k, mask, causal), score_mod=score_mod, scale=scale,
                         dlse=dlse, score_params=score_params)


def causal_mask(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                causal: bool) -> torch.Tensor | None:
    """``mask``, or for ``causal=True`` the lower-triangular bool mask of a square sub-problem.

    Raises:
        ValueError: for ``causal`` with a mask too, or a sub-problem that is not square.
    """
    if not causal:
        return mask
    check_causal(q, k, mask, causal)
    Lq, Lk = q.shape[2], k.shape[2]
    return torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()[None, None]


def check_causal(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None,
                 causal: bool) -> None:
    """Validate a ``causal=True`` call without building its mask (see :func:`causal_mask`).

    Raises:
        ValueError: for ``causal`` with a mask too, or a sub-problem that is not square.
    """
    if not causal:
        return
    Lq, Lk = q.shape[2], k.shape[2]
    if mask is not None or Lq != Lk:
        raise ValueError(f"causal=True needs a square sub-problem and no mask (got Lq={Lq}, "
                         f"Lk={Lk}, mask {'given' if mask is not None else 'None'}); split the "
                         f"call so the diagonal piece is square")


REFERENCE = ReferenceKernel()
