"""Shared test helpers: the one tolerance table, a seeded qkv factory, hypothesis strategies,
and :func:`check_mask`, which property-tests a user's mask_mod on every schedule.

Legend: B batch · H query heads · G kv heads (H % G == 0) · S sequence · D head dim.
"""
from __future__ import annotations

import torch

from .. import masks
from .. import masks as _masks
from .. import plan as _plan
from .. import schedules as _schedules
from .. import simulate
from .._data import packed_docs
from ..ops import reference
from ..plan import classified_bh
from ..runtime import RankState, VirtualMesh, execute
from ..schedules import GradCompute, registry
from ..schedules.ir import Family, buffer_name

__all__ = ["CHECK_MASK_SCHEDULES", "check_mask", "make_qkv", "mask_family", "packed_docs",
           "probe_adjoint", "seeds", "tiny_llama", "tolerances", "warm_up_cpu_math"]

#: The schedules :func:`check_mask` tries by default, as registry names: every registered
#: schedule (``fringe.schedules.names()``, read when check_mask runs) and this 2D one.
CHECK_MASK_SCHEDULES = ("compose:zigzag+ulysses:2",)

#: The heads and rows (batch entries) :func:`check_mask` runs when it is not told: a mask may
#: read ``h`` or ``b`` only for some values (heads >= 4), so two heads prove little.
CHECK_MASK_HEADS = 8
CHECK_MASK_ROWS = 3


def warm_up_cpu_math() -> None:
    """Run each elementwise transcendental once, multi-threaded, and throw the result away.

    Measured on torch 2.13 CPU (MKL build, 2 threads): in about one process in six, the FIRST
    parallel ``torch.exp`` on a float64 tensor returns values off by ~1e-9 relative in the
    chunk computed by the worker thread; every later call is exact to 1 ulp. That is far
    above the 1e-10 float64 tolerance of our exactness checks, so the suite (and
    :func:`check_mask`) absorb the first call here.
    """
    for dtype in (torch.float64, torch.float32):
        x = torch.zeros(1 << 17, dtype=dtype)
        torch.exp(x)
        torch.log1p(x)
        torch.log(x + 1)


def tolerances(dtype: torch.dtype) -> dict[str, float]:
    """``assert_close`` tolerances for comparing a kernel in ``dtype`` against the reference.

    This is the ONE place low-precision tolerances live.
    """
    if dtype == torch.float64:
        # Exactness checks: tiling / merging only reorders sums, error ~ 1e-15 * S.
        return dict(atol=1e-10, rtol=1e-10)
    if dtype == torch.float32:
        # fp32 accumulation in a different order (fused kernel vs einsum): ~1e-6 relative.
        return dict(atol=2e-5, rtol=2e-5)
    if dtype == torch.float16:
        # Inputs / outputs rounded to 10-bit mantissa (eps ~ 1e-3); accumulation is fp32.
        return dict(atol=5e-3, rtol=5e-3)
    if dtype == torch.bfloat16:
        # 7-bit mantissa (eps ~ 8e-3) on inputs and outputs; accumulation is fp32.
        return dict(atol=3e-2, rtol=3e-2)
    raise ValueError(f"no tolerances for {dtype}; use float64/float32/float16/bfloat16")


def make_qkv(*, B: int, H: int, G: int, S: int, D: int, dtype: torch.dtype = torch.float64,
             seed: int, requires_grad: bool = False, device: str | torch.device = "cpu",
             Lk: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q ``[B, H, S, D]``, k/v ``[B, G, Lk or S, D]`` from a local ``torch.Generator``."""
    if H % G:
        raise ValueError(f"H={H} query heads is not a multiple of G={G} kv heads")
    g = torch.Generator().manual_seed(seed)
    Lk = S if Lk is None else Lk
    q = torch.randn(B, H, S, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, G, Lk, D, generator=g, dtype=torch.float64)
    return tuple(t.to(device=device, dtype=dtype).requires_grad_(requires_grad) for t in (q, k, v))


def tiny_llama(seq_len: int, *, seed: int = 0):
    """A 2-layer GQA Llama (H 4, G 2, D 8, vocab 32) with ``attn_implementation="fringe"``,
    weights from ``torch.manual_seed(seed)``; needs transformers."""
    import transformers

    import fringe.hf
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=seq_len,
                                   attention_dropout=0.0, use_cache=False, head_dim=8)
    cfg._attn_implementation = fringe.hf.register()
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg)


def mask_family(kind: str, S: int):
    """One mask of each family the distributed and collective suites sweep, for S tokens.

    ``causal``; ``document`` (causal within four uneven documents, one of a single token);
    ``window`` / ``sliding_window`` (S // 3); ``lambda`` (a plain callable, classified densely);
    ``per_head`` (a callable that reads ``h``: plan it with ``num_heads=``).
    """
    if kind == "causal":
        return masks.causal()
    if kind == "document":
        ids = torch.tensor([0] * 3 + [1] * (S // 2 - 3) + [2] + [3] * (S - S // 2 - 1))
        return masks.causal() & masks.document(ids)
    if kind in ("window", "sliding_window"):
        return masks.sliding_window(S // 3)
    if kind == "lambda":
        return lambda b, h, q, kv: ((q + 2 * kv) % 3 != 0) & (kv <= q + 4)
    if kind == "per_head":
        return lambda b, h, q, kv: (kv <= q) & ((q - kv) <= 2 + 3 * h)
    raise ValueError(f"unknown mask family {kind!r}; use causal, document, window, lambda or "
                     f"per_head")


def seeds():
    """Hypothesis strategy for a seed (for a local ``torch.Generator``)."""
    from hypothesis import strategies as st

    return st.integers(min_value=0, max_value=2**31 - 1)


def check_mask(mask_mod, *, seq_len: int | None = None, world_sizes=(1, 2, 3, 4),
               block_sizes=(1, 2, 4), schedules=None, score_mod=None, heads: int | None = None,
               kv_heads: int = 1, num_heads: int | None = None, batch: int | None = None,
               batch_size: int | None = None, seed: int = 0) -> int:
    """Check a mask_mod (and score_mod) end to end against dense attention, on one process.

    For every schedule × world size × block size: the block classification equals the
    block-wise reduction of the dense mask, and context-parallel attention on the virtual
    mesh (out, lse, dq, dk, dv in float64; the gradients of a loss that reads out and the
    finite lse) equals :func:`fringe.ops.reference.attention`.
    The dense mask is FlexAttention's definition, the mask_mod evaluated per scalar index
    (``masks.evaluate(..., method="vmap")``), so a mod whose broadcast evaluation means
    something else (a reduction such as ``.all()`` over the indices) fails here unless
    fringe evaluates it the FlexAttention way. A NaN or infinity where dense attention has
    none fails too. Use it in your own tests before training with a new mask.

    A probe proves nothing about values it did not try: the check runs, and compares
    against the dense mask of, every head and row the user will run (``heads`` / ``batch``),
    at least :data:`CHECK_MASK_HEADS` heads and :data:`CHECK_MASK_ROWS` rows when not told,
    so a mask that reads ``h`` only for heads >= 4 (or ``b`` only for row 2) is caught.

    Args:
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx)`` on global positions.
        seq_len: S; default the smallest length every combination accepts (times 2).
        world_sizes, block_sizes: the P and block sizes to try.
        schedules: registry names (``["zigzag", "allgather:4", "compose:zigzag+ulysses:2"]``)
            or ``{name: Schedule}``. Default: every registered schedule
            (``fringe.schedules.names()``) and :data:`CHECK_MASK_SCHEDULES`. A named schedule
            is tried only at the world sizes where it runs with ``heads`` / ``kv_heads``
            (``fringe.schedules.registry.why_not``: ulysses needs H % P == 0, ...); a
            ``Schedule`` at every one.
        score_mod: optional ``score_mod(score, b, h, q_idx, kv_idx)``.
        heads, batch: H and B the user will run (of the random q/k/v). Default: ``num_heads``
            / ``batch_size`` when given, else the H / B the plan records for this mask
            (:func:`fringe.plan.classified_bh`: a plan accepts only those), else
            :data:`CHECK_MASK_HEADS` / :data:`CHECK_MASK_ROWS`.
        kv_heads: G of the random k/v.
        num_heads, batch_size: what the user passes to :func:`fringe.plan` (needed when the
            mask reads ``h`` / ``b``, or is evaluated per scalar index and not declared
            ``masks.as_mask(fn, bh_invariant=True)``).
        seed: for the random tensors.

    Returns:
        The number of combinations checked.

    Raises:
        AssertionError: naming the first combination that differs, and by how much.
        ValueError: an unknown schedule name, or one that runs at none of ``world_sizes``;
            or what :func:`fringe.plan` / the call raise for this mask with these
            ``num_heads`` / ``batch_size`` (e.g. a mask evaluated per scalar index planned
            with neither: pass them or declare the mask ``bh_invariant=True``).
    """
    import math


    default = schedules is None
    if seq_len is None:
        unit = 1
        for P in world_sizes:
            for bs in block_sizes:
                unit = unit * (2 * P * bs) // math.gcd(unit, 2 * P * bs)
        seq_len = 2 * unit
    # the B and H a plan of this mask accepts (raises as fringe.plan would, naming the fix)
    _, _, _, plan_b, plan_h = classified_bh(_masks.snapshot(mask_mod), seq_len=seq_len,
                                            batch_size=batch_size, num_heads=num_heads)
    heads = heads if heads is not None else plan_h if plan_h is not None else CHECK_MASK_HEADS
    batch = batch if batch is not None else plan_b if plan_b is not None else CHECK_MASK_ROWS
    if default:
        schedules = [*registry.names(), *CHECK_MASK_SCHEDULES]
    if isinstance(schedules, str):
        raise TypeError(f"schedules= takes a list of names, e.g. [{schedules!r}], or "
                        f"{{name: Schedule}}; got the string {schedules!r}")
    if isinstance(schedules, dict):                # (name, Schedule, world sizes it runs at)
        cases = [(name, sched, tuple(world_sizes)) for name, sched in schedules.items()]
    else:
        cases = []
        for name in schedules:
            why = {P: registry.why_not(name, world_size=P, heads=heads, kv_heads=kv_heads)
                   for P in world_sizes}
            at = tuple(P for P in world_sizes if why[P] is None)
            if at:
                cases.append((name, _schedules.get(name), at))
            elif not default:
                raise ValueError(f"schedule {name!r} runs at none of world_sizes="
                                 f"{tuple(world_sizes)} with heads={heads}, kv_heads={kv_heads} "
                                 f"({'; '.join(why.values())}): give world sizes or heads it "
                                 f"runs with, or leave it out")
    warm_up_cpu_math()
    q, k, v = make_qkv(B=batch, H=heads, G=kv_heads, S=seq_len, D=4, seed=seed,
                       requires_grad=True)
    # The oracle follows FlexAttention's definition: the mask_mod evaluated per scalar index
    # (vmap), never fringe's broadcast fast path, so a mod whose broadcast meaning differs
    # fails here unless fringe evaluates it correctly; for every b < B and h < H, never
    # assuming that a mask ignores them.
    everything = torch.arange(seq_len)
    truth = _masks.evaluate(mask_mod, everything, everything, B=batch, H=heads, method="vmap")

    def oracle_mask(b, h, q_idx, kv_idx):          # [B, H, S, S] looked up, elementwise
        return truth[b, h, q_idx, kv_idx]

    ref, ref_lse = reference.attention(q, k, v, mask_mod=oracle_mask, score_mod=score_mod)
    gen = torch.Generator().manual_seed(seed + 1)
    dout = torch.randn(ref.shape, generator=gen, dtype=ref.dtype)
    dlse = torch.randn(ref_lse.shape, generator=gen, dtype=ref_lse.dtype)

    def loss(out, lse):         # through out and lse (a z-loss, a merge with other attention)
        return (out * dout).sum() + (torch.where(torch.isfinite(lse), lse, 0) * dlse).sum()
    want = torch.autograd.grad(loss(ref, ref_lse), (q, k, v))
    tol = tolerances(torch.float64)
    checked = 0
    for name, sched, at in cases:
        for P in at:
            for bs in block_sizes:
                where = f"schedule={name} P={P} block_size={bs} S={seq_len}"
                p = _plan(sched, mask_mod, seq_len=seq_len, world_size=P, block_size=bs,
                          score_mod=score_mod, num_heads=num_heads, batch_size=batch_size)
                pos = p.layout.order
                dense = truth[:, :, pos][:, :, :, pos].reshape(-1, seq_len // bs, bs,
                                                               seq_len // bs, bs)
                kinds = torch.full(dense.shape[1:4:2], int(_masks.BlockKind.PARTIAL),
                                   dtype=torch.int8)
                kinds[dense.all(dim=(0, 2, 4))] = int(_masks.BlockKind.FULL)
                kinds[~dense.any(dim=(0, 2, 4))] = int(_masks.BlockKind.EMPTY)
                bad = (kinds != p.blocks).nonzero()
                if len(bad):
                    i, j = bad[0].tolist()
                    raise AssertionError(f"{where}: block ({i}, {j}) classified "
                                         f"{_masks.BlockKind(int(p.blocks[i, j])).name}, dense "
                                         f"says {_masks.BlockKind(int(kinds[i, j])).name}")
                out, lse = simulate.attention(q, k, v, plan=p, return_lse=True)
                got = torch.autograd.grad(loss(out, lse), (q, k, v))
                for what, a, b in (("out", out, ref), ("lse", lse, ref_lse),
                                   *zip(("dq", "dk", "dv"), got, want)):
                    problem = _difference(a.detach(), b.detach(), tol)
                    if problem:
                        raise AssertionError(f"{where}: {what} differs from dense attention "
                                             f"({problem})")
                checked += 1
    return checked


def _difference(got: torch.Tensor, want: torch.Tensor, tol: dict[str, float]) -> str | None:
    """Why ``got`` is not ``want`` within ``tol`` (NaN and infinities must match exactly),
    or None when it is."""
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} vs {tuple(want.shape)}"
    nan_g, nan_w = torch.isnan(got), torch.isnan(want)
    if not torch.equal(nan_g, nan_w):
        return (f"NaN at {int((nan_g & ~nan_w).sum())} entries where dense attention is not NaN, "
                f"and not NaN at {int((nan_w & ~nan_g).sum())} where it is")
    if torch.allclose(got, want, equal_nan=True, **tol):
        return None
    finite = torch.isfinite(got) & torch.isfinite(want)
    inf_mismatch = int((~finite & ~nan_g & (got != want)).sum())
    err = (got - want)[finite].abs().max().item() if finite.any() else 0.0
    extra = f", {inf_mismatch} infinities differ" if inf_mismatch else ""
    return f"max |diff| {err:.3g}{extra}"


def probe_adjoint(p, *, seed: int):
    """The adjoint dot-product probe: run a plan's forward and backward programs with probe
    tiles on the virtual mesh (the real interpreter), with no attention math.

    Forward tile (i, j) reads kv_j as it arrived (x_j); backward tile (i, j) adds a random
    y_ij into dkv_j, zero outside the blocks of kv_j the tile reads (a tile's gradient is, and
    a ranged transfer moves only blocks some tile reads). The backward's communication is the
    adjoint of the forward's when ``<A x, y> == <x, A^T y>``.

    Returns:
        ``(<A x, y>, <x, A^T y>, kv seen by each forward tile, kv seen by each backward
        tile, x, dkv buffers left on a rank that does not own them)``; a tile's kv seen is
        what arrived on the blocks it reads, and x's elsewhere (blocks no ranged transfer
        need bring it: they arrive as zeros).
    """

    P, L, bs = p.world_size, p.local_len, p.block_size
    g = torch.Generator().manual_seed(seed)
    x = {j: torch.randn(2, 1, 1, L, 1, generator=g, dtype=torch.float64) for j in range(P)}
    reads = {(i, j): p.tile_blocks(i, j).ne(0).any(0).repeat_interleave(bs).reshape(L, 1)
             for i in range(P) for j in range(P)}
    y = {(i, j): torch.randn(2, 1, 1, L, 1, generator=g, dtype=torch.float64) * reads[i, j]
         for i in range(P) for j in range(P)}
    seen_fwd, seen_bwd = {}, {}

    def states(progs, backward):
        out = {}
        for r in range(P):
            st_ = RankState(r, progs[r], like=lambda b: ((2, 1, 1, L, 1), torch.float64),
                            heads=(1, 1), device="cpu", block_size=bs,
                            protect={buffer_name("kv", r), buffer_name("dkv", r)})
            st_.bufs[buffer_name("kv", r)] = x[r].clone()
            if backward and p.kv == "keep":
                for _, op in progs[r].ops():
                    if isinstance(op, GradCompute):
                        st_.bufs[buffer_name("kv", op.kv)] = x[op.kv].clone()
            out[r] = st_
        return out

    def fwd(st_, op):
        seen_fwd[(op.q, op.kv)] = torch.where(reads[op.q, op.kv],
                                              st_.bufs[buffer_name("kv", op.kv)], x[op.kv])

    def bwd(st_, op):
        seen_bwd[(op.q, op.kv)] = torch.where(reads[op.q, op.kv],
                                              st_.bufs[buffer_name("kv", op.kv)], x[op.kv])
        st_.accumulate(buffer_name("dkv", op.kv), y[(op.q, op.kv)])

    execute({r: p.forward[r] for r in range(P)}, states(p.forward, False), VirtualMesh(P), fwd)
    bst = states(p.backward, True)
    execute({r: p.backward[r] for r in range(P)}, bst, VirtualMesh(P), bwd)
    ax_y = sum(float((seen_fwd[t] * y[t]).sum()) for t in seen_fwd)
    x_aty = sum(float((x[j] * bst[j].bufs[buffer_name("dkv", j)]).sum())
                for j in range(P) if buffer_name("dkv", j) in bst[j].bufs)
    leftovers = {(r, n) for r in range(P) for n in bst[r].bufs
                 if n.family is Family.DKV and n != buffer_name("dkv", r)}
    return ax_y, x_aty, seen_fwd, seen_bwd, x, leftovers
