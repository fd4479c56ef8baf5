"""The ``sdpa`` kernel: torch's fused CPU flash-attention op, which returns an lse.

This is the ONLY module in fringe that touches non-public torch ops. Every use is guarded by a
feature check (``hasattr(torch.ops.aten, ...)``) and a tiny self-test against the reference
kernel at first use per device type; on any failure the kernel falls back to ``reference`` and
records why in :meth:`SdpaKernel.available`.

Measured on torch 2.13 CPU (``_scaled_dot_product_flash_attention_for_cpu``):

- the lse it returns is natural-log but not differentiable -> we only call it from explicit
  forward/backward functions, never under autograd;
- it takes float (0 / -inf) masks only, a bool mask is rejected -> we build an additive bias;
- a fully masked row gets lse = 0 (not -inf) and out = 0 -> we set lse to -inf for those rows;
  in the backward a globally dead row's lse (-inf) is replaced by 0 so p = exp(-inf - 0) = 0;
- ``is_causal`` aligns top-left when Lq < Lk -> used only for square sub-problems whose mask is
  exactly lower-triangular (``fused_calls``: ``fringe/ops/tile.py`` splits a tile so that the
  diagonal pieces are square); the self-test checks it, else an explicit mask is used;
- it accepts G < H (GQA, kv head ``h // (H/G)``) natively in forward and backward; the
  self-test checks this and we expand k/v (inside this kernel only) if it ever stops holding;
- its ``_backward`` op accepts the GLOBAL merged out/lse (flash-attention style);
- it reads q, k, v and out as if their head dim D had stride 1: a transposed or
  ``[..., ::2]`` view gives wrong numbers, no error -> such inputs are copied (``_unit_stride``);
- it needs one head size ("Q/K/V should have the same head size"): for MLA (Dv != D) q and k,
  or v, out and dout, get zero columns up to max(D, Dv) for the op call only, and out, dq, dk,
  dv are cut back (exact: a zero column adds 0 to every score, to ``delta`` and to ``dp``).

Non-finite inputs: the op adds a -inf bias to a masked score, and NaN + -inf is NaN, so a NaN
key would turn rows of OTHER documents to NaN. A masked sub-problem whose k (forward) or q, k,
v, out, dout, lse (backward) hold a non-finite value therefore runs on ``reference``, which
confines it (masked pairs never contribute, NaN included). The check is one ``sum`` per tensor:
measured ~1.5 ms for a 2048-token k (8 heads, D=64, fp32, 1 thread) beside ~100 ms for the op.

No score_mod support: with a score_mod (or ``score_params``) the kernel delegates to
``reference``; so does a backward with a nonzero ``dlse`` (see :meth:`SdpaKernel.backward`). On CUDA the fused
ops with a mask (memory-efficient attention) are not validated here yet, so CUDA delegates to
``reference`` with a reason string.
"""
from __future__ import annotations

import math

import torch

from .reference import REFERENCE, causal_mask, check_causal, compute_dtype

_FWD = "_scaled_dot_product_flash_attention_for_cpu"
_BWD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def _expand_kv(t: torch.Tensor, H: int) -> torch.Tensor:
    """``[B, G, L, D] -> [B, H, L, D]`` (kv head g serves query heads g*R .. g*R+R-1)."""
    B, G, L, D = t.shape
    return t[:, :, None].expand(B, G, H // G, L, D).reshape(B, H, L, D)


def _finite(*ts: torch.Tensor) -> bool:
    """Whether every entry of every tensor is finite (one fused reduction per tensor)."""
    return all(bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all()) for t in ts)


class SdpaKernel:
    """Fused CPU SDPA (flash attention for CPU) with an additive mask; see the module notes."""

    name = "sdpa"
    #: tile.py splits a tile into calls this kernel likes: ``causal=True`` for square
    #: lower-triangular pieces, no mask for FULL ones, a float mask only where needed.
    fused_calls = True

    def __init__(self) -> None:
        self._status: dict[str, tuple[bool, str]] = {}
        self.native_gqa = True
        self.exact_dlse = True
        self.native_causal = True

    # -- availability --------------------------------------------------------------------------

    def available(self, device: torch.device | str | None = None) -> tuple[bool, str]:
        """``(ok, reason)`` on ``device`` (default CPU); self-tests once per device type."""
        dev = torch.device(device if device is not None else "cpu").type
        if dev not in self._status:
            self._status[dev] = self._probe(dev)
        return self._status[dev]

    def _probe(self, dev: str) -> tuple[bool, str]:
        if dev != "cpu":
            return False, (f"sdpa on {dev} is not validated in this build (only the fused CPU op "
                           f"is); using the reference kernel")
        if not (hasattr(torch.ops.aten, _FWD) and hasattr(torch.ops.aten, _BWD)):
            return False, (f"torch {torch.__version__} has no aten.{_FWD}/_backward; "
                           f"using the reference kernel")
        try:
            if self._self_test():
                return True, "fused CPU op, self-test passed (native GQA)"
            self.native_gqa = False
            if self._self_test():
                return True, "fused CPU op, self-test passed (k/v expanded for GQA)"
            return False, "fused CPU op disagrees with reference in the self-test; using reference"
        except Exception as e:  # noqa: BLE001 - any failure of a private op means: do not use it
            self.native_gqa = True
            return False, (f"fused CPU op failed its self-test ({type(e).__name__}: {e}); "
                           f"using the reference kernel")

    def _self_test(self) -> bool:
        g = torch.Generator().manual_seed(0)
        B, H, G, Lq, Lk, D = 1, 4, 2, 5, 7, 8
        q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
        k = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
        v = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
        dout = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
        mask = torch.rand(1, 1, Lq, Lk, generator=g) > 0.4
        mask[..., 0, :] = False                                        # a fully masked row
        mask[..., 1, :] = True
        kw = dict(q_pos=torch.arange(Lq), kv_pos=torch.arange(Lk), mask=mask, scale=0.3)
        out, lse = self._forward(q, k, v, **kw)
        ro, rl = REFERENCE.forward(q, k, v, **kw)
        live = torch.isfinite(rl)
        if not (torch.allclose(out, ro, atol=1e-9) and torch.equal(torch.isfinite(lse), live)
                and torch.allclose(lse[live], rl[live], atol=1e-9)):
            return False
        close = lambda xs, ys: all(a.shape == b.shape and torch.allclose(a, b, atol=1e-9)  # noqa
                                   for a, b in zip(xs, ys))
        if not close(self._backward(q, k, v, ro, rl, dout, **kw),
                     REFERENCE.backward(q, k, v, ro, rl, dout, **kw)):
            return False
        # is_causal on a square call equals the lower-triangular mask
        sq = dict(q_pos=torch.arange(Lq), kv_pos=torch.arange(Lq), mask=None, scale=0.3)
        tril = torch.ones(Lq, Lq, dtype=torch.bool).tril()[None, None]
        co, cl = self._forward(q, k[:, :, :Lq], v[:, :, :Lq], causal=True, **sq)
        ro2, rl2 = REFERENCE.forward(q, k[:, :, :Lq], v[:, :, :Lq], **{**sq, "mask": tril})
        self.native_causal = (torch.allclose(co, ro2, atol=1e-9)
                              and torch.allclose(cl, rl2, atol=1e-9)
                              and close(self._backward(q, k[:, :, :Lq], v[:, :, :Lq], ro2, rl2,
                                                       dout, causal=True, **sq),
                                        REFERENCE.backward(q, k[:, :, :Lq], v[:, :, :Lq], ro2,
                                                           rl2, dout, **{**sq, "mask": tril})))
        # the lse cotangent rides on out (see _backward); then the padded route (rows whose
        # dout is zero or underflows)
        dlse = torch.randn(B, H, Lq, generator=g, dtype=torch.float64)
        self.exact_dlse = True
        for _ in range(2):
            self.exact_dlse &= close(self._backward(q, k, v, ro, rl, dout, dlse=dlse, **kw),
                                     REFERENCE.backward(q, k, v, ro, rl, dout, dlse=dlse, **kw))
            dout[..., 2, :] = 0.0
            dout[..., 3, :] = 1e-200
        return True

    def _usable(self, q: torch.Tensor, score_mod) -> bool:
        return score_mod is None and self.available(q.device)[0]

    # -- kernel interface ----------------------------------------------------------------------

    def forward(self, q, k, v, *, q_pos, kv_pos, mask=None, score_mod=None, scale,
                causal=False):
        masked = mask is not None or causal
        if not self._usable(q, score_mod) or (masked and not _finite(k)):
            return REFERENCE.forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask,
                                     score_mod=score_mod, scale=scale, causal=causal)
        if causal and not self.native_causal:
            mask, causal = causal_mask(q, k, mask, causal), False
        check_causal(q, k, mask, causal)
        return self._forward(q, k, v, q_pos=q_pos, kv_pos=kv_pos, mask=mask, scale=scale,
                             causal=causal)

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask=None, score_mod=None,
                 scale, dlse=None, score_params=(), causal=False):
        masked = mask is not None or causal
        if dlse is not None and not bool(dlse.any()):
            dlse = None            # autograd materialises a zero lse cotangent: nothing to fold
        if (not self._usable(q, score_mod) or score_params
                or (dlse is not None and not self.exact_dlse)
                or (masked and not _finite(q, k, v, out, dout, lse.clamp_min(0.0)))):
            return REFERENCE.backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos,
                                      mask=mask, score_mod=score_mod, scale=scale, dlse=dlse,
                                      score_params=score_params, causal=causal)
        if causal and not self.native_causal:
            mask, causal = causal_mask(q, k, mask, causal), False
        check_causal(q, k, mask, causal)
        return self._backward(q, k, v, out, lse, dout, q_pos=q_pos, kv_pos=kv_pos, mask=mask,
                              scale=scale, dlse=dlse, causal=causal)

    # -- the op calls --------------------------------------------------------------------------

    def _bias(self, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
        if mask is None:
            return None
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask,
                                                                                   -math.inf)

    def _kv(self, k, v, H):
        if self.native_gqa or k.shape[1] == H:
            return k, v
        return _expand_kv(k, H), _expand_kv(v, H)

    def _forward(self, q, k, v, *, q_pos, kv_pos, mask, scale, causal=False):
        H = q.shape[1]
        Dv = v.shape[-1]
        q, k, v = _equal_heads(*_unit_stride(q, k, v))
        kk, vv = self._kv(k, v, H)
        op = getattr(torch.ops.aten, _FWD)
        out, lse = op(q, kk, vv, 0.0, causal, attn_mask=self._bias(mask, q.dtype), scale=scale)
        out = out[..., :Dv]                    # the zero columns of a padded v (MLA), cut
        lse = lse.to(compute_dtype(q.dtype))
        if mask is not None:
            dead = ~mask.any(dim=-1)                                   # [B|1, H|1, Lq]
            if bool(dead.any()):
                lse = lse.masked_fill(dead, -math.inf)
                out = out.masked_fill(dead.unsqueeze(-1), 0.0)
        return out, lse

    def _backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask, scale, dlse=None,
                  causal=False):
        B, H, Lq, Dqk = q.shape
        G, Dv = k.shape[1], v.shape[-1]
        q, k, v = _equal_heads(*_unit_stride(q, k, v))
        D = q.shape[-1]
        kk, vv = self._kv(k, v, H)
        ct = compute_dtype(q.dtype)
        lse = lse.to(ct)
        dead = torch.isneginf(lse)
        lse = torch.where(dead, torch.zeros_like(lse), lse).contiguous()
        out, dout = _unit_stride(_pad_last(out.to(q.dtype), D),   # zero columns: delta and
                                 _pad_last(dout.to(q.dtype), D))  # dp unchanged
        pad = False
        if dlse is not None:
            out, pad = _fold_dlse(out, dout, dlse.to(ct).masked_fill(dead, 0.0), ct)
        if pad:                 # a row with dlse but no usable dout: an extra head-dim column
            dl = dlse.to(ct).masked_fill(dead, 0.0)
            q, kk, vv, dout, out = _pad_column(q, kk, vv, dout, out, dl)
        op = getattr(torch.ops.aten, _BWD)
        # out and dout are usually row slices of packed [.., D+1] buffers: the op takes them
        # strided (measured: bit-identical to contiguous copies), so no copy per call
        dq, dk, dv = op(dout, q, kk, vv, out, lse, 0.0, causal,
                        attn_mask=self._bias(mask, q.dtype), scale=scale)
        dq, dk, dv = dq[..., :Dqk], dk[..., :Dqk], dv[..., :Dv]   # the padded columns, cut
        if kk.shape[1] != G:                                            # fold the H/G copies
            Lk = k.shape[2]
            dk = dk.reshape(B, G, H // G, Lk, Dqk).sum(2)
            dv = dv.reshape(B, G, H // G, Lk, Dv).sum(2)
        return dq, dk, dv


def _unit_stride(*ts: torch.Tensor) -> tuple:
    """The tensors with stride 1 along the head dim (a copy only where it is not): measured on
    torch 2.13, the fused CPU ops read q, k, v and out as if D were contiguous, so a transposed
    or ``[..., ::2]`` view gives wrong numbers with no error. Other strides (head-, token- or
    batch-major, expanded dims) they read correctly."""
    return tuple(t if t.shape[-1] == 1 or t.stride(-1) == 1 else t.contiguous() for t in ts)


def _pad_last(t: torch.Tensor, D: int) -> torch.Tensor:
    """``t`` with zero columns appended up to head dim ``D`` (itself when it has D)."""
    n = D - t.shape[-1]
    return t if n == 0 else torch.nn.functional.pad(t, (0, n))


def _equal_heads(q, k, v):
    """The fused op needs one head size ("Q/K/V should have the same head size"); MLA has
    Dv != Dqk. Zero columns make them equal exactly: appended to q and k they add 0 to every
    score, appended to v they give output columns that are 0 (cut by the caller, as are the
    gradients of the padded columns). Equal sizes: the tensors themselves."""
    Dqk, Dv = q.shape[-1], v.shape[-1]
    if Dqk == Dv:
        return q, k, v
    D = max(Dqk, Dv)
    return _pad_last(q, D), _pad_last(k, D), _pad_last(v, D)


def _fold_dlse(out, dout, dlse, ct):
    """Fold the lse cotangent into ``out`` so that the op's ``delta`` becomes ``delta - dlse``.

    The fused backward computes ``delta = rowsum(dout * out)`` itself and uses ``out`` for
    nothing else, so ``out' = out - dlse * dout / |dout|^2`` gives
    ``ds = p * (dp - (delta - dlse))`` exactly (up to rounding: measured as fast as the plain
    call). Rows with ``dlse = 0`` are untouched. Returns ``(out', pad)`` with ``pad`` True when a
    row has ``dlse != 0`` but a zero (or underflowing) ``dout``: then no ``out'`` works and the
    caller adds a head-dim column instead (:func:`_pad_column`, ~1.2x the plain call).
    """
    dout_c = dout.to(ct)
    n2 = (dout_c * dout_c).sum(-1)
    need = dlse != 0
    if bool((need & ~(n2 > 0)).any()):
        return out, True
    adj = out.to(ct) - (dlse / torch.where(n2 > 0, n2, torch.ones_like(n2))).unsqueeze(-1) * dout_c
    adj = adj.to(out.dtype)
    if not _finite(adj):
        return out, True
    return adj, False


def _pad_column(q, k, v, dout, out, dlse):
    """Append one head-dim column: 0 to q, k, v (scores and dp unchanged), 1 to dout and
    ``-dlse`` to out, so the op's ``delta = rowsum(dout * out)`` becomes ``delta - dlse``."""
    def cat(t, col):
        return torch.cat([t, col.to(t.dtype).expand(*t.shape[:-1], 1)], -1)

    zero = torch.zeros((), dtype=q.dtype, device=q.device).view(1, 1, 1, 1)
    return (cat(q, zero), cat(k, zero), cat(v, zero), cat(dout, zero + 1),
            cat(out, -dlse.unsqueeze(-1)))


SDPA = SdpaKernel()
