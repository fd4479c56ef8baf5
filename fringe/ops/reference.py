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
from typing import Callable

import torch

ScoreMod = Callable[..., torch.Tensor]
MaskMod = Callable[..., torch.Tensor]

__all__ = ["attention", "check_qkv", "compute_dtype", "lse_dtype", "mask_for", "ReferenceKernel",
           "REFERENCE"]


# ---------------------------------------------------------------------------------------------
# validation and small helpers


def check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              q_pos: torch.Tensor | None = None,
              kv_pos: torch.Tensor | None = None) -> tuple[int, int, int, int, int, int]:
    """Validate attention inputs before any math.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, D]``.
        q_pos: optional global positions of q's rows, ``[Lq]``.
        kv_pos: optional global positions of k/v's rows, ``[Lk]``.

    Returns:
        ``(B, H, G, Lq, Lk, D)``.

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
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape [B, G, Lk, D], got k {tuple(k.shape)} "
                         f"and v {tuple(v.shape)}")
    B, H, Lq, D = q.shape
    Bk, G, Lk, Dk = k.shape
    if D != Dk:
        raise ValueError(f"head dim mismatch: q has D={D} but k/v have D={Dk}; q [B, H, Lq, D] "
                         f"and k/v [B, G, Lk, D] must share D")
    if B != Bk:
        raise ValueError(f"batch mismatch: q has B={B} but k/v have B={Bk}")
    if G == 0 or H % G != 0:
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
    return 1.0 / math.sqrt(D) if scale is None else float(scale)


def mask_for(mask_mod: MaskMod | None, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
             B: int, H: int) -> torch.Tensor | None:
    """Evaluate ``mask_mod`` on global positions: bool ``[B or 1, H or 1, Lq, Lk]`` or None.

    A mask with ``bh_invariant = True`` is evaluated once (``[1, 1, Lq, Lk]``).
    """
    if mask_mod is None:
        return None
    from fringe.masks import evaluate

    if getattr(mask_mod, "bh_invariant", False):
        return evaluate(mask_mod, q_pos, kv_pos)
    return evaluate(mask_mod, q_pos, kv_pos, B=B, H=H)


def bh_index(B: int, H: int, q_pos: torch.Tensor, kv_pos: torch.Tensor):
    """Broadcastable ``(b, h, q_idx, kv_idx)`` index tensors for a ``[B, H, Lq, Lk]`` score."""
    dev = q_pos.device
    return (torch.arange(B, device=dev).view(-1, 1, 1, 1),
            torch.arange(H, device=dev).view(1, -1, 1, 1),
            q_pos.view(1, 1, -1, 1), kv_pos.view(1, 1, 1, -1))


def raw_scores(q: torch.Tensor, k: torch.Tensor, *, scale: float) -> torch.Tensor:
    """``q k^T * scale`` in the compute dtype, as ``[B, H, Lq, Lk]`` (GQA without repeats)."""
    B, H, Lq, D = q.shape
    G, Lk = k.shape[1], k.shape[2]
    ct = compute_dtype(q.dtype)
    qg = q.to(ct).reshape(B, G, H // G, Lq, D)
    s = torch.einsum("bgrqd,bgkd->bgrqk", qg, k.to(ct)) * scale
    return s.reshape(B, H, Lq, Lk)


def apply_score_mod(s: torch.Tensor, score_mod: ScoreMod | None, q_pos: torch.Tensor,
                    kv_pos: torch.Tensor) -> torch.Tensor:
    if score_mod is None:
        return s
    B, H, Lq, Lk = s.shape
    out = score_mod(s, *bh_index(B, H, q_pos, kv_pos))
    return torch.as_tensor(out).expand(B, H, Lq, Lk)


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


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
              mask_mod: MaskMod | None = None, score_mod: ScoreMod | None = None,
              scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense reference attention over positions ``arange(Lq)`` x ``arange(Lk)``.

    Args:
        q: ``[B, H, Lq, D]``.
        k: ``[B, G, Lk, D]``.
        v: ``[B, G, Lk, D]``.
        mask_mod: FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``; None = full.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``; None = identity.
        scale: softmax scale, default ``1/sqrt(D)``.

    Returns:
        ``(out [B, H, Lq, D] in q's dtype, lse [B, H, Lq])``, lse natural-log in float32
        (float64 for float64 inputs). A fully masked row has out 0 and lse -inf; its gradients
        are 0, never NaN.
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
    """

    name = "reference"

    def available(self, device: torch.device | None = None) -> tuple[bool, str]:
        return True, "always available"

    def forward(self, q, k, v, *, q_pos, kv_pos, mask=None, score_mod=None, scale):
        with torch.no_grad():
            return attend(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask, score_mod=score_mod,
                          scale=scale)

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask=None, score_mod=None,
                 scale):
        B, H, Lq, D = q.shape
        G, Lk = k.shape[1], k.shape[2]
        R = H // G
        ct = compute_dtype(q.dtype)
        # Plain ops, no no_grad(): autograd already runs backward without grad, and this keeps
        # the body transformable by torch.func when called from an autograd.Function.
        s_raw = raw_scores(q, k, scale=scale)
        s = apply_score_mod(s_raw, score_mod, q_pos, kv_pos)
        if mask is not None:
            s = s.masked_fill(~mask, -math.inf)
        lse = lse.to(ct)
        # A globally dead row (lse = -inf) is masked in every tile: p must be 0, not NaN.
        lse = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
        p = torch.exp(s - lse.unsqueeze(-1))                           # [B, H, Lq, Lk]
        dout_c, out_c = dout.to(ct), out.to(ct)
        pg = p.reshape(B, G, R, Lq, Lk)
        dog = dout_c.reshape(B, G, R, Lq, D)
        dv = torch.einsum("bgrqk,bgrqd->bgkd", pg, dog)
        dp = torch.einsum("bgrqd,bgkd->bgrqk", dog, v.to(ct)).reshape(B, H, Lq, Lk)
        delta = (dout_c * out_c).sum(-1, keepdim=True)                   # [B, H, Lq, 1]
        ds = p * (dp - delta)
        if score_mod is not None:
            idx = bh_index(B, H, q_pos, kv_pos)
            _, pullback = torch.func.vjp(
                lambda t: torch.as_tensor(score_mod(t, *idx)).expand(B, H, Lq, Lk), s_raw)
            (ds,) = pullback(ds)
            if mask is not None:
                ds = ds.masked_fill(~mask, 0.0)
        dsg = ds.reshape(B, G, R, Lq, Lk)
        dq = torch.einsum("bgrqk,bgkd->bgrqd", dsg, k.to(ct)).reshape(B, H, Lq, D) * scale
        dk = torch.einsum("bgrqk,bgrqd->bgkd", dsg, q.to(ct).reshape(B, G, R, Lq, D)) * scale
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


REFERENCE = ReferenceKernel()
