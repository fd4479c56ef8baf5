"""The prepared GPU check: run this once when a session has a GPU (one device, a few minutes).

    python examples/gpu_check.py            # prints one line per check and a timing table

Checks the CUDA paths CI cannot (it has no GPU), each against the float64 dense reference:

1. tile ops on CUDA (reference kernel; ``sdpa`` must report why it falls back);
2. the virtual mesh on CUDA: every schedule, forward + backward, P = 4;
3. ``fringe.attention`` under NCCL with world size 1 (agreement exchange on a CUDA tensor);
4. two ranks on the one GPU through gloo with CUDA tensors, which exercises the transport's
   communication stream and events (one GPU cannot host two NCCL ranks); if this torch's gloo
   cannot move CUDA tensors point to point, it says so instead of failing;
5. timings: fringe (virtual mesh, P = 4) vs dense SDPA for a causal & document mask.

Exits non-zero if any numerical check fails.
"""
from __future__ import annotations

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
    from fringe.bench import packed_docs
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


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device; nothing to check")
        return 0
    dev = torch.device("cuda", 0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(dev)}")
    for step in (tiles, virtual_mesh, nccl_single_rank):
        try:
            step(dev)
        except Exception as e:          # noqa: BLE001 - report and go on to the next check
            check(step.__name__, False, f"{type(e).__name__}: {e}")
    os.environ.setdefault("FRINGE_TIMEOUT", "60")
    gloo_cuda_two_ranks()
    timings(dev)
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
