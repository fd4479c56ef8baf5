"""The prepared GPU check: run this once when a session has a GPU (one device, a few minutes).

    python examples/gpu_check.py            # prints one line per check and a timing table

Checks the CUDA paths CI cannot (it has no GPU), each against the float64 dense reference:

1. tile ops on CUDA (reference kernel; ``sdpa`` must report why it falls back);
2. the virtual mesh on CUDA: every schedule, forward + backward, P = 4;
3. ``fringe.attention`` under NCCL with world size 1 (agreement exchange on a CUDA tensor);
4. two ranks on the one GPU through gloo with CUDA tensors, which exercises the transport's
   communication stream and events (one GPU cannot host two NCCL ranks); if this torch's gloo
   cannot move CUDA tensors point to point, it says so instead of failing;
5. timings: fringe (virtual mesh, P = 4) vs dense SDPA for a causal & document mask;
6. the ``flex`` kernel (compiled FlexAttention, ``fringe/ops/flex.py``): two kv tiles with
   global offsets, GQA, Lq != Lk and FULL / PARTIAL / EMPTY blocks, forward merged and
   backward with the GLOBAL out/lse and an lse cotangent, in float32 and bfloat16 against the
   float64 reference; the 64-token BlockMask variant (``sparse_multiple=None``); a plan with
   ``kernel="flex"`` on the virtual mesh; two masks in one process (a Ulysses plan on a
   document mask, then on a sliding window: pytorch #176211); recompiles across batches; and a
   timing of one whole-sequence tile against SDPA and native FlexAttention.

    python examples/gpu_check.py --only flex     # just step 6 (or e.g. --only tiles,flex)

Exits non-zero if any numerical check fails.
"""
from __future__ import annotations

import math
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import fringe
from fringe import masks, schedules
from fringe.ops import reference, tile_backward, tile_forward
from fringe.testing import make_qkv

FAILED: list[str] = []


def check(name: str, ok: bool, detail: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name} {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def max_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def tiles(dev: torch.device) -> None:
    q, k, v = make_qkv(B=1, H=4, G=2, S=64, D=16, seed=0, device=dev)
    pos = torch.arange(64, device=dev)
    mask = masks.causal()
    o, l = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=mask)
    ref, ref_l = reference.attention(q, k, v, mask_mod=mask)
    check("tile_forward on cuda", max_err(o, ref) < 1e-10, f"err={max_err(o, ref):.1e}")
    dout = torch.randn_like(o)
    grads = tile_backward(q, k, v, o, l, dout, q_pos=pos, kv_pos=pos, mask_mod=mask)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(reference.attention(qg, kg, vg, mask_mod=mask)[0], (qg, kg, vg),
                               dout)
    err = max(max_err(a, b) for a, b in zip(grads, want))
    check("tile_backward on cuda", err < 1e-10, f"err={err:.1e}")
    ok, why = fringe.ops.KERNELS["sdpa"].available(dev)
    print(f"info sdpa on cuda: available={ok} ({why})")


def virtual_mesh(dev: torch.device) -> None:
    S = 256
    ids = torch.arange(S) // 50
    mask = masks.causal() & masks.document(ids)
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=16, seed=1, device=dev, requires_grad=True)
    ref = reference.attention(q, k, v, mask_mod=mask)[0]
    want = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for name in schedules.names(world_size=4, heads=4, kv_heads=2):
        p = fringe.plan(schedules.get(name), mask, seq_len=S, world_size=4, block_size=8)
        out = fringe.simulate.attention(q, k, v, plan=p)
        got = torch.autograd.grad(out.square().sum(), (q, k, v))
        err = max([max_err(out, ref)] + [max_err(a, b) for a, b in zip(got, want)])
        check(f"virtual mesh on cuda, {name}", err < 1e-10, f"err={err:.1e}")


def nccl_single_rank(dev: torch.device) -> None:
    d = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{d}/store", rank=0, world_size=1)
    try:
        p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=128, world_size=1,
                        block_size=8)
        q, k, v = make_qkv(B=1, H=2, G=2, S=128, D=16, seed=2, device=dev, requires_grad=True)
        out = fringe.attention(q, k, v, plan=p)
        ref = reference.attention(q, k, v, mask_mod=masks.causal())[0]
        check("fringe.attention under nccl (P=1)", max_err(out, ref) < 1e-10)
        # the per-call agreement travels over a gloo side group: it must not wait for the GPU
        from fringe.runtime.distributed import DistRuntime
        rt = DistRuntime(None)
        x = torch.randn(4096, 4096, device=dev)
        for _ in range(50):                        # queue ~a second of work on the stream
            x = torch.tanh(x @ x)
        t0 = time.perf_counter()
        rt.agree(p, q, k, v)
        dt = time.perf_counter() - t0
        busy = not torch.cuda.current_stream().query()
        torch.cuda.synchronize()
        check("agreement exchange adds no device-to-host sync", busy, f"({dt * 1e3:.2f} ms per call)")
        # lse cotangent and sinks on CUDA, against the float64 reference
        sinks = torch.tensor([0.3, -0.7], dtype=torch.float64, device=dev, requires_grad=True)
        o, lse = fringe.attention(q, k, v, plan=p, return_lse=True, sinks=sinks)
        g = torch.autograd.grad((o.sum() + (lse ** 2).sum()), (q, sinks))
        r_o, r_l = reference.attention(q, k, v, mask_mod=masks.causal())
        w = torch.sigmoid(r_l - sinks.view(1, -1, 1))
        r_o, r_l = r_o * w.unsqueeze(-1), torch.logaddexp(r_l, sinks.view(1, -1, 1))
        rg = torch.autograd.grad((r_o.sum() + (r_l ** 2).sum()), (q, sinks))
        check("lse cotangent + sinks under nccl (P=1)",
              max(max_err(a, b) for a, b in zip(g, rg)) < 1e-9)
    finally:
        dist.destroy_process_group()


def _gloo_cuda_worker(rank: int, world_size: int):
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    S = 128
    p = fringe.plan(schedules.ring(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=8)
    q, k, v = make_qkv(B=1, H=2, G=2, S=S, D=16, seed=3, device=dev)
    ql, kl, vl = (p.layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    out = fringe.attention(ql, kl, vl, plan=p, timeout_s=60)
    out.sum().backward()
    ref = reference.attention(q, k, v, mask_mod=masks.causal())[0]
    return max_err(out, p.layout.shard(ref, rank))


def gloo_cuda_two_ranks() -> None:
    try:
        errs = fringe.launch.run(_gloo_cuda_worker, world_size=2, timeout_s=120)
        check("2 gloo ranks with cuda tensors (comm stream + events)", max(errs) < 1e-10,
              f"err={max(errs):.1e}")
    except fringe.launch.LaunchError as e:
        last = e.remote_traceback.strip().splitlines()[-1] if e.remote_traceback else str(e)
        print(f"info gloo cannot run cuda point-to-point here: {last[:200]}")


def timings(dev: torch.device) -> None:
    from fringe.testing import packed_docs
    rows = []
    for S in (8192, 32768):
        mask = masks.causal() & masks.document(packed_docs(S, 16, 0))
        q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=8, G=8, S=S, D=64, seed=0,
                                                         device=dev, dtype=torch.bfloat16))
        p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=4, block_size=128)
        dense_mask = masks.evaluate(mask, torch.arange(S, device=dev),
                                    torch.arange(S, device=dev))

        def run_fringe():
            fringe.simulate.attention(q, k, v, plan=p).sum().backward()

        def run_dense():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_mask) \
                .sum().backward()
        for name, fn in (("fringe virtual P=4", run_fringe), ("dense SDPA", run_dense)):
            fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            rows.append((S, name, (time.perf_counter() - t0) / 3))
    for S, name, t in rows:
        print(f"time S={S:>6} {name:<20} fwd+bwd {t * 1e3:8.1f} ms")


# ---------------------------------------------------------------------------------------------
# 6. the flex kernel


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (finite entries of ``want``; NaN in ``got`` -> inf)."""
    g, w = got.double().cpu(), want.double().cpu()
    if not bool(torch.isfinite(g[torch.isfinite(w)]).all()):
        return math.inf
    fin = torch.isfinite(w)
    return ((g - w)[fin].abs().max() / w[fin].abs().max().clamp_min(1e-30)).item()


#: Relative error (to each tensor's scale) allowed against the float64 reference: a wrong
#: block or position gives O(1); rounding gives ~1e-6 (fp32) and ~1e-2 (bf16).
FLEX_TOL = {torch.float32: 1e-3, torch.bfloat16: 5e-2}


def _flex_tiles(dev, kern, dtype, label: str) -> None:
    """Two kv tiles of one q chunk: forward merged, backward summed with GLOBAL out/lse."""
    from fringe.masks import classify
    from fringe.ops import merge
    from fringe.ops.flex import FlexKernel  # noqa: F401 - the kernel under test is passed in

    S, bs = 1024, 64
    pos = torch.arange(S)
    mask = masks.causal() & masks.document(sum((pos >= b).long() for b in (300, 600, 900, 950)))
    q_pos = torch.arange(512, 1024, device=dev)                     # a chunk at an offset
    kv_tiles = [torch.arange(0, 384, device=dev), torch.arange(640, 1024, device=dev)]
    kv_all = torch.cat(kv_tiles)
    q, _, _ = make_qkv(B=2, H=8, G=2, S=512, D=64, seed=90, device=dev)
    _, k, v = make_qkv(B=2, H=8, G=2, S=768, D=64, seed=91, device=dev)
    gen = torch.Generator().manual_seed(92)
    w = torch.randn(2, 8, 512, 64, generator=gen, dtype=torch.float64).to(dev)
    u = torch.randn(2, 8, 512, generator=gen, dtype=torch.float64).to(dev)
    # float64 oracle over the union of the kv tiles, on global positions
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    oracle = lambda b, h, i, j: mask(b, h, q_pos[i], kv_all[j])           # noqa: E731
    ro, rl = reference.attention(qg, kg, vg, mask_mod=oracle)
    live_lse = rl.masked_fill(torch.isneginf(rl), 0.0)                 # dead rows: no lse term
    want = torch.autograd.grad((ro * w).sum() + (live_lse * u).sum(), (qg, kg, vg))
    qd, kd, vd = (t.to(dtype) for t in (q, k, v))
    sl = [slice(0, 384), slice(384, 768)]
    kinds = []
    out = lse = None
    for kvp, cols in zip(kv_tiles, sl):
        blocks = classify(mask, q_pos.cpu(), kvp.cpu(), block_size=bs)
        kinds.append(sorted({int(x) for x in blocks.unique()}))
        o, l = tile_forward(qd, kd[:, :, cols], vd[:, :, cols], q_pos=q_pos, kv_pos=kvp,
                            mask_mod=mask, blocks=blocks, block_size=bs, kernel=kern)
        out, lse = (o, l) if out is None else merge(out, lse, o, l)
    out = out.to(dtype)
    grads = [torch.zeros_like(t, dtype=torch.float64) for t in (qd, kd, vd)]
    for kvp, cols in zip(kv_tiles, sl):
        blocks = classify(mask, q_pos.cpu(), kvp.cpu(), block_size=bs)
        dq, dk, dv = tile_backward(qd, kd[:, :, cols], vd[:, :, cols], out, lse, w.to(dtype),
                                   q_pos=q_pos, kv_pos=kvp, mask_mod=mask, blocks=blocks,
                                   block_size=bs, kernel=kern, dlse=u.float())
        grads[0] += dq.double()
        grads[1][:, :, cols] += dk.double()
        grads[2][:, :, cols] += dv.double()
    errs = dict(out=rel_err(out, ro), lse=rel_err(lse, rl), dq=rel_err(grads[0], want[0]),
                dk=rel_err(grads[1], want[1]), dv=rel_err(grads[2], want[2]))
    dead_ok = torch.equal(torch.isneginf(lse).cpu(), torch.isneginf(rl).cpu())
    worst = max(errs.values())
    check(f"flex {label} {str(dtype)[6:]}: 2 kv tiles (block kinds {kinds}), fwd merge + bwd "
          f"with global out/lse and dlse vs float64", worst < FLEX_TOL[dtype] and dead_ok,
          " ".join(f"{k}={e:.1e}" for k, e in errs.items()) + f" dead rows match={dead_ok}")


def _cuda_time(fn, reps: int = 3) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def flex(dev: torch.device, *, S_time: int = 16384) -> None:
    from fringe.ops.flex import FLEX, FlexKernel

    t_start = time.perf_counter()
    ok, why = FLEX.available(dev)
    check("flex available on cuda", ok, why)
    if not ok:
        return
    for kern, label, dtypes in ((FLEX, "block 64 -> BlockMask 128", (torch.float32,
                                                                      torch.bfloat16)),
                                (FlexKernel(sparse_multiple=None), "BlockMask 64",
                                 (torch.bfloat16,))):
        for dtype in dtypes:
            t0 = time.perf_counter()
            try:
                _flex_tiles(dev, kern, dtype, label)
            except Exception as e:      # noqa: BLE001 - the 64 variant may have no config
                if kern is FLEX:
                    check(f"flex {label} {dtype}", False, f"{type(e).__name__}: {str(e)[:300]}")
                else:
                    print(f"info flex {label} does not run here (keep sparse_multiple=128): "
                          f"{type(e).__name__}: {str(e)[:300]}")
            print(f"info   ({time.perf_counter() - t0:.0f} s incl. compile)", flush=True)

    # a plan with kernel="flex" on the virtual mesh, forward + backward, bf16 vs float64
    S = 4096
    ids = torch.arange(S) * 7 // S
    mask = masks.causal() & masks.document(ids)
    q, k, v = make_qkv(B=1, H=8, G=2, S=S, D=64, seed=93, device=dev, requires_grad=True)
    ro, rl = reference.attention(q, k, v, mask_mod=mask)
    want = torch.autograd.grad(ro.square().sum() + rl.sum(), (q, k, v))
    p = fringe.plan(schedules.zigzag(), mask, seq_len=S, world_size=4, block_size=64,
                    kernel="flex")
    qb, kb, vb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out, lse = fringe.simulate.attention(qb, kb, vb, plan=p, return_lse=True)
    got = torch.autograd.grad(out.float().square().sum() + lse.sum(), (qb, kb, vb))
    errs = [rel_err(out, ro), rel_err(lse, rl)] + [rel_err(a, b) for a, b in zip(got, want)]
    check("flex plan (zigzag P=4, causal & 7 docs) bf16 fwd+bwd vs float64",
          max(errs) < FLEX_TOL[torch.bfloat16], " ".join(f"{e:.1e}" for e in errs)
          + f" ({time.perf_counter() - t0:.0f} s incl. compile)")

    # two masks in one process (issue 17, pytorch #176211): a Ulysses plan on a document mask,
    # then one on a sliding window, through the one shared kernel="flex" (which has compiled
    # the zigzag plan's mask above). Before one compiled function per mask structure, the
    # second raised "TypeError: 'int' object is not subscriptable" from Dynamo's guards.
    S2 = 2048
    q2, k2, v2 = make_qkv(B=1, H=8, G=2, S=S2, D=64, seed=94, device=dev, requires_grad=True)
    for i, (name, m) in enumerate((("causal & 5 docs",
                                    masks.causal() & masks.document(torch.arange(S2) * 5 // S2)),
                                   ("sliding_window(300)", masks.sliding_window(300)))):
        label = f"flex plan (ulysses P=2, {name}: mask {i + 1} of 2 in one process) bf16 fwd+bwd"
        t0 = time.perf_counter()
        try:
            ro2, rl2 = reference.attention(q2, k2, v2, mask_mod=m)
            want2 = torch.autograd.grad(ro2.square().sum() + rl2.sum(), (q2, k2, v2))
            p2 = fringe.plan(schedules.ulysses(), m, seq_len=S2, world_size=2, block_size=64,
                             kernel="flex")
            qb2, kb2, vb2 = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q2, k2, v2))
            out2, lse2 = fringe.simulate.attention(qb2, kb2, vb2, plan=p2, return_lse=True)
            got2 = torch.autograd.grad(out2.float().square().sum() + lse2.sum(), (qb2, kb2, vb2))
            errs = [rel_err(out2, ro2), rel_err(lse2, rl2)] + [rel_err(a, b)
                                                               for a, b in zip(got2, want2)]
            check(f"{label} vs float64", max(errs) < FLEX_TOL[torch.bfloat16],
                  " ".join(f"{e:.1e}" for e in errs)
                  + f" ({time.perf_counter() - t0:.0f} s incl. compile)")
        except Exception as e:          # noqa: BLE001 - the failure this case exists to catch
            check(label, False, f"{type(e).__name__}: {str(e)[:300]}")

    # recompiles: new documents, same tile shape -> the later calls cost no compile
    times = []
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        ids = torch.cumsum((torch.rand(S, generator=g) < 8 / S).long(), 0)
        p = fringe.plan(schedules.zigzag(), masks.causal() & masks.document(ids), seq_len=S,
                        world_size=4, block_size=64, kernel="flex")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fringe.simulate.attention(qb, kb, vb, plan=p).float().sum().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    print("info flex plan fwd+bwd per new batch of documents: "
          + ", ".join(f"{t * 1e3:.0f} ms" for t in times)
          + " (a recompile would cost seconds)")

    # timing: one whole-sequence tile, bf16, causal & 16 documents
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from fringe.testing import packed_docs
    from fringe.masks import classify
    S = S_time
    ids = packed_docs(S, 16, 0)
    mask = masks.causal() & masks.document(ids)
    q, k, v = (t.requires_grad_() for t in make_qkv(B=1, H=8, G=8, S=S, D=64, seed=0,
                                                     device=dev, dtype=torch.bfloat16))
    pos = torch.arange(S, device=dev)
    blocks = classify(mask, pos.cpu(), pos.cpu(), block_size=64)
    dout = torch.ones_like(q)

    def fringe_flex():
        o, l = tile_forward(q, k, v, q_pos=pos, kv_pos=pos, mask_mod=mask, blocks=blocks,
                            block_size=64, kernel=FLEX)
        tile_backward(q, k, v, o, l, dout, q_pos=pos, kv_pos=pos, mask_mod=mask,
                      blocks=blocks, block_size=64, kernel=FLEX)

    ids_d = ids.to(dev)
    native_mask = lambda b, h, qi, ki: (qi >= ki) & (ids_d[qi] == ids_d[ki])  # noqa: E731
    bm = create_block_mask(native_mask, None, None, S, S, device=dev)
    compiled = torch.compile(flex_attention, dynamic=False)
    dense = masks.evaluate(mask, pos, pos)

    def native_flex():
        compiled(q, k, v, block_mask=bm).backward(dout)

    def sdpa_masked():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(dout)

    def sdpa_causal():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    for name, fn in (("fringe flex tile (block 64 -> 128)", fringe_flex),
                     ("native flex_attention (block 128)", native_flex),
                     ("SDPA, dense bool mask", sdpa_masked),
                     ("SDPA is_causal (no documents: a bound)", sdpa_causal)):
        try:
            print(f"time S={S} {name:<40} fwd+bwd {_cuda_time(fn) * 1e3:8.1f} ms", flush=True)
        except Exception as e:          # noqa: BLE001 - a timing row that cannot run says why
            print(f"info time {name}: {type(e).__name__}: {str(e)[:200]}")
    print(f"info flex step took {time.perf_counter() - t_start:.0f} s")


STEPS = ("tiles", "virtual_mesh", "nccl_single_rank", "gloo", "timings", "flex")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    only = set(STEPS)
    if argv[:1] == ["--only"] and len(argv) == 2:
        only = set(argv[1].split(","))
        if only - set(STEPS):
            print(f"unknown steps {sorted(only - set(STEPS))}; choose from {', '.join(STEPS)}")
            return 2
    elif argv:
        print(f"usage: gpu_check.py [--only {','.join(STEPS)}]")
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to check")
        return 0
    dev = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}")
    for step in (tiles, virtual_mesh, nccl_single_rank, flex):
        if step.__name__ not in only:
            continue
        try:
            step(dev)
        except Exception as e:          # noqa: BLE001 - report and go on to the next check
            check(step.__name__, False, f"{type(e).__name__}: {e}")
    os.environ.setdefault("FRINGE_TIMEOUT", "60")
    if "gloo" in only:
        gloo_cuda_two_ranks()
    if "timings" in only:
        timings(dev)
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
