"""fringe under torchrun (env://): every rank checks its shard against dense attention.

    torchrun --standalone --nproc-per-node 2 examples/torchrun_attention.py          # CPU, gloo
    torchrun --standalone --nproc-per-node 8 examples/torchrun_attention.py --cuda   # GPUs, NCCL

Prints one line per rank and exits non-zero if any rank's output or gradients differ from
the dense reference by more than the dtype's tolerance.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

import fringe
from fringe import masks, schedules
from fringe.ops import reference
from fringe.schedules import registry
from fringe.testing import make_qkv, tolerances

H, G = 4, 2          # query and kv heads of the random q/k/v


def _schedule_name(text: str) -> str:
    try:
        return registry.canonical(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cuda", action="store_true", help="NCCL, one GPU per rank")
    ap.add_argument("--schedule", default="zigzag", type=_schedule_name, metavar="NAME",
                    help="a schedule name: " + registry.syntax().replace("%", "%%"))
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dtype", default="float64", choices=["float64", "float32", "bfloat16"])
    args = ap.parse_args()

    device = torch.device("cpu")
    if args.cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if args.cuda else "gloo")      # env:// from torchrun
    rank, P = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)

    S = args.seq_len
    doc_ids = torch.arange(S) // (S // 3 + 1)                        # three packed documents
    mask = masks.causal() & masks.document(doc_ids)
    why = registry.why_not(args.schedule, world_size=P, heads=H, kv_heads=G)
    if why:
        raise SystemExit(f"--schedule {args.schedule}: {why}; on {P} ranks with H={H}, G={G} "
                         f"these run: {registry.names(world_size=P, heads=H, kv_heads=G)}")
    plan = fringe.plan(schedules.get(args.schedule), mask, seq_len=S, world_size=P,
                       block_size=16)
    q, k, v = make_qkv(B=1, H=H, G=G, S=S, D=32, seed=0, dtype=dtype, device=device)
    ql, kl, vl = (plan.layout.shard(t, rank).requires_grad_() for t in (q, k, v))
    out = fringe.attention(ql, kl, vl, plan=plan)
    out.square().sum().backward()

    qg, kg, vg = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = reference.attention(qg, kg, vg, mask_mod=mask)
    ref.square().sum().backward()
    tol = tolerances(dtype)
    errs = {name: (a.double() - plan.layout.shard(b, rank)).abs().max().item()
            for name, a, b in (("out", out, ref), ("dq", ql.grad, qg.grad),
                               ("dk", kl.grad, kg.grad), ("dv", vl.grad, vg.grad))}
    ok = all(torch.allclose(a.double(), plan.layout.shard(b, rank), **tol)
             for a, b in ((out, ref), (ql.grad, qg.grad), (kl.grad, kg.grad), (vl.grad, vg.grad)))
    stats = fringe.last_run().summary()
    line = (f"rank {rank}/{P} {args.schedule} {device.type} {args.dtype}: max err "
            + " ".join(f"{k}={v:.1e}" for k, v in errs.items())
            + f" exposed comm fwd={stats['forward']['exposed']:.2f} -> {'OK' if ok else 'MISMATCH'}")
    sys.stdout.write(line + "\n")          # one write per line: ranks share the pipe
    sys.stdout.flush()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
