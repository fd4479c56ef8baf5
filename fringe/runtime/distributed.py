"""The torch.distributed transport: the same interpreter, real processes.

Point-to-point steps go through ``dist.batch_isend_irecv`` (async): a step's transfers are
issued before its tiles are computed and waited after, so they overlap. On CUDA they are
issued on a dedicated communication stream ordered with the compute stream by events
(``wait_stream`` both ways, ``record_stream`` for the allocator); on CPU (gloo) the
request objects carry the asynchrony. Every wait has a timeout, so a peer that died or
never sends ends in :class:`CommTimeout` naming the step, buffer and peer, never a hang.

Before the first tile of a new (plan, shapes) combination, ranks exchange a small int64
metadata vector (shapes, dtype, device type, plan fingerprint) with one all-gather and
fail with :class:`RankMismatch` naming the rank and the field that differs.
"""
from __future__ import annotations

import datetime
import hashlib
import os

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = float(os.environ.get("FRINGE_TIMEOUT", "300"))


class CommTimeout(RuntimeError):
    """A transfer did not complete in time (a peer died, hung, or never sends)."""


class RankMismatch(ValueError):
    """Ranks disagree on shapes, dtype, device or plan before any tile is computed."""


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_FIELDS = ["world size", "B (batch)", "H (query heads)", "G (kv heads)", "L (local tokens)",
           "D (head dim)", "dtype", "device type", "plan fingerprint"]


def _h48(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:12], 16)


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else f"code {value}"
    if field == "device type":
        return "cuda" if value == 1 else "cpu" if value == 0 else f"code {value}"
    if field == "plan fingerprint":
        return f"#{value:x}"
    return str(value)


class DistTransport:
    """Moves buffers between ranks of a process group with async p2p."""

    def __init__(self, group, *, timeout_s: float, device: torch.device) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None

    def _global(self, peer: int) -> int:
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def issue(self, rank: int, step: int, sends: list, recvs: list):
        if not sends and not recvs:
            return [], []
        ops, meta = [], []
        for peer, name, tensor in sends:
            ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), group=self.group))
            meta.append(("send", name, peer))
        for peer, name, tensor in recvs:
            ops.append(dist.P2POp(dist.irecv, tensor, self._global(peer), group=self.group))
            meta.append(("receive", name, peer))
        try:
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    reqs = dist.batch_isend_irecv(ops)
                for op in ops:
                    op.tensor.record_stream(self.stream)
            else:
                reqs = dist.batch_isend_irecv(ops)
        except RuntimeError as e:       # a peer that already died can fail the issue itself
            kind, name, peer = meta[0]
            raise CommTimeout(
                f"rank {rank}, step {step}: could not start the {kind} of {name} "
                f"{'to' if kind == 'send' else 'from'} rank {peer} (and {len(meta) - 1} more "
                f"transfers); the peer may have died. Backend said: "
                f"{str(e).splitlines()[0][:200]}") from e
        return reqs, meta

    def wait(self, rank: int, step: int, handle) -> None:
        reqs, meta = handle
        if len(reqs) != len(meta):       # backends that coalesce return one request
            meta = [("transfer", ",".join(m[1] for m in meta), "/".join(str(m[2]) for m in meta))]
        for req, (kind, name, peer) in zip(reqs, meta):
            try:
                req.wait(timeout=self.timeout)
            except RuntimeError as e:
                direction = "to" if kind == "send" else "from"
                raise CommTimeout(
                    f"rank {rank}, step {step}: {kind} of {name} {direction} rank {peer} did not "
                    f"complete within {self.timeout_s:g}s; the peer may have died or be running a "
                    f"different plan (raise timeout_s= or FRINGE_TIMEOUT if it is just slow). "
                    f"Backend said: {str(e).splitlines()[0][:200]}") from e
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)


class DistRuntime:
    """Drives this process's rank of a plan over torch.distributed."""

    def __init__(self, group=None, *, timeout_s: float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fringe.attention needs an initialised process group: call "
                               "torch.distributed.init_process_group (or use fringe.launch) "
                               "first, or use fringe.simulate.attention on one process")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.ranks = [self.rank]
        self.timeout_s = DEFAULT_TIMEOUT_S if timeout_s is None else timeout_s
        self.last_states: dict = {}
        self._agreed: set = set()

    def agree(self, plan, q: torch.Tensor, k: torch.Tensor) -> None:
        """Check once per (plan, shapes) that all ranks agree; raise on every rank if not."""
        B, H, L, D = q.shape if q.dim() == 4 else (-1, -1, -1, -1)   # malformed: still agree
        G = k.shape[1] if k.dim() == 4 else -1
        dtype = _DTYPES.index(q.dtype) if q.dtype in _DTYPES else 99
        fp = plan.fingerprint()
        mine = [plan.world_size, B, H, G, L, D, dtype, int(q.is_cuda), _h48(fp)]
        key = tuple(mine)
        if key in self._agreed:
            return
        dev = q.device if q.is_cuda else torch.device("cpu")
        local = torch.tensor(mine, dtype=torch.int64, device=dev)
        everyone = [torch.empty_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(everyone, local, group=self.group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CommTimeout(f"rank {self.rank}: the agreement exchange before attention did not "
                              f"complete within {self.timeout_s:g}s; is every rank calling "
                              f"fringe.attention? ({str(e).splitlines()[0][:200]})") from e
        rows = torch.stack(everyone).cpu().tolist()
        if plan.world_size != self.world_size:
            raise RankMismatch(f"rank {self.rank}: the plan is for world_size={plan.world_size} "
                               f"but the process group has {self.world_size} ranks")
        for r, row in enumerate(rows):
            for field, a, b in zip(_FIELDS, rows[0], row):
                if a != b:
                    raise RankMismatch(
                        f"rank {r} disagrees with rank 0 on {field}: rank 0 has "
                        f"{_describe(field, a)}, rank {r} has {_describe(field, b)} (seen from "
                        f"rank {self.rank}, before any communication of attention data); every "
                        f"rank must call fringe.attention with the same plan and local shapes")
        self._agreed.add(key)

    def _transport(self, device: torch.device) -> DistTransport:
        return DistTransport(self.group, timeout_s=self.timeout_s, device=device)

    def forward(self, plan, q, k, v):
        from . import engine
        out, lse, kept, states = engine.forward(plan, self.ranks, q, k, v,
                                                self._transport(q.device))
        self.last_states["forward"] = states
        return out, lse, kept

    def backward(self, plan, q, k, v, out, lse, dout, kept):
        from . import engine
        dq, dk, dv, states = engine.backward(plan, self.ranks, q, k, v, out, lse, dout, kept,
                                             self._transport(q.device))
        self.last_states["backward"] = states
        return dq, dk, dv
