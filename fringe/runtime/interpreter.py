"""One interpreter for every schedule and every transport.

:func:`execute` runs the programs of the ranks this process drives (all P on the virtual
mesh, one under ``torch.distributed``) in lockstep over global step indices. For each step
it *issues* the step's communication, *computes* the step's tiles on buffers already
present (the transfers are in flight meanwhile), then *waits* for the communication and
files what arrived. A transport only moves tensors:

.. code-block:: python

    class Transport(Protocol):
        def issue(self, rank, step, sends, recvs, collectives=()) -> handle
        def wait(self, rank, step, handle) -> None

``sends``: ``[(peer, buf, tensor)]``; ``recvs``: ``[(peer, buf, out)]``; ``collectives``:
``[(op, send_tensors, recv_tensors)]`` with one entry per member of ``op.group`` (None for
an empty contribution and for the rank's own slot). What arrives is filed by the rules of
the buffer's family, never by a schedule: a gradient accumulates (in a fixed order: point
to point in canonical order, then collectives in program order and member order), a partial
``out`` merges by its lse, anything else is stored (into its parent's head slice when the
whole buffer is here).

Buffers come from a per-rank pool and go back to it after their last use in the program,
so a ring keeps about two kv buffers alive and reuses them step after step.

A transfer, or a collective's slot, may carry only block ranges of its chunk
(``S kv3[0:2,4:6]->r2``, ``AG[0,1] kv0[0:2],- > -,kv1[1:3]``; blocks of ``block_size``
tokens, local to the chunk). The sender packs the ranges' tokens into one
contiguous tensor (concatenated along L; parts narrowed part by part, no whole-size
temporary), the receive buffer is sized to them, and on arrival they are filed into the
whole-size buffer: a primal one not here yet (q, kv) is made of zeros first (the tiles read
the blocks outside the ranges, all masked for them: 0 there is harmless, uninitialised
memory is not), a gradient accumulates the ranges (made as zeros when absent). Out and dout
never move in ranges.

A buffer may also be held as its *parts* (k and v of a kv buffer, out and lse of a partial
output, dk and dv of a dkv gradient) instead of the one packed tensor that travels: the rank's
own inputs are then used where they are, and a kernel's results are kept, not copied. Parts are
packed only for a whole-buffer use (a send packs a temporary; any other whole read packs once).
Borrowed parts (the caller's tensors: q/k/v, saved out/lse, dout) are never written: a write
into them packs a copy first.
"""
from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Protocol

import torch

from ..cost.hardware import check_head_split  # the head-split rule (re-exported here)
from ..schedules.ir import RANGED_FAMILIES, Buffer, Compute, Family, GradCompute, Program, Send


class Transport(Protocol):
    def issue(self, rank: int, step: int, sends: list, recvs: list, collectives: list = ()) -> Any: ...

    def wait(self, rank: int, step: int, handle: Any) -> None: ...


@dataclasses.dataclass
class StepRecord:
    """What one rank spent on one step: computing tiles, and waiting for transfers.

    On CPU both times are wall-clock. On CUDA they are read from events on the compute stream
    (compute: from before the first tile to after the last; wait: from there until the
    stream may go on after the transfers), resolved on first access so that recording never
    synchronises the device.
    """

    rank: int
    step: int
    _compute_s: float | None
    _wait_s: float | None
    tiles: int
    sent_bytes: int
    recv_bytes: int
    events: tuple | None = None

    def _resolve(self) -> None:
        if self._compute_s is None and self.events is not None:
            e0, e1, e2 = self.events
            e2.synchronize()
            self._compute_s = e0.elapsed_time(e1) / 1e3
            self._wait_s = e1.elapsed_time(e2) / 1e3

    @property
    def compute_s(self) -> float:
        self._resolve()
        return self._compute_s

    @property
    def wait_s(self) -> float:
        self._resolve()
        return self._wait_s


class Pool:
    """Free tensors by (shape, dtype, device), reused across steps (double buffering)."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = collections.defaultdict(list)
        self.allocated = 0

    def get(self, like: torch.Tensor) -> torch.Tensor:
        return self.get_shape(tuple(like.shape), like.dtype, like.device)

    def get_shape(self, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        key = (tuple(shape), dtype, torch.device(device))
        if self._free[key]:
            return self._free[key].pop()
        self.allocated += 1
        return torch.empty(shape, dtype=dtype, device=device)

    def put(self, t: torch.Tensor) -> None:
        self._free[(tuple(t.shape), t.dtype, t.device)].append(t)

    def clear(self) -> None:
        """Drop the free tensors (``allocated`` still counts what was made)."""
        self._free.clear()


#: Where a buffer family keeps its heads: query-side tensors are ``[B, H, L, ...]``, kv ones
#: ``[2, B, G, L, D]`` (``[1, B, G, L, D + Dv]`` when v's head dim Dv differs: MLA).
_HEAD_DIM = {Family.Q: 1, Family.OUT: 1, Family.DQ: 1, Family.DOUT: 1, Family.KV: 2,
             Family.DKV: 2}


def head_range(buf: Buffer, num_heads: int, kv_heads: int) -> tuple[int, int, int]:
    """``(dim, start, stop)`` of the heads a sliced buffer holds in its parent tensor.

    Query-side buffers ``h<i>/<n>`` hold query heads ``[i*H/n, (i+1)*H/n)``; kv buffers the
    kv heads those read: ``G/n`` of them when ``G % n == 0``, else (``n % G == 0``) the one
    kv head they share, replicated on several ranks.

    Raises:
        ValueError: H not divisible by n, or neither G % n == 0 nor n % G == 0.
    """
    i, n = buf.heads
    fam = buf.family
    check_head_split(n, num_heads, kv_heads)
    if fam in (Family.KV, Family.DKV):
        if kv_heads % n == 0:
            w = kv_heads // n
            return 2, i * w, (i + 1) * w
        g = i * kv_heads // n
        return 2, g, g + 1
    w = num_heads // n
    return _HEAD_DIM[fam], i * w, (i + 1) * w


#: Families packed from parts: kv-like ones stack (k, v) along a new dim 0 (or, when v's head
#: dim differs from k's, as in MLA, put them side by side in one ``[1, B, G, L, D + Dv]``, so
#: v travels at Dv, unpadded); query-side ones put (out, lse) side by side (lse as the last
#: column). Parts keep heads in dim 1.
_STACKED = (Family.KV, Family.DKV)
_COLUMNS = (Family.OUT, Family.DOUT)


#: A part's token (L) dim, in every family (q ``[B, H, L, D]``, k and v ``[B, G, L, D]``, out
#: ``[B, H, L, Dv]``, lse ``[B, H, L]``); a packed buffer's is :func:`token_dim`.
_PART_L_DIM = 2


def token_dim(family: Family) -> int:
    """The token (L) dim of a packed buffer of ``family``: 3 for kv-like ones (``[2, B, G, L,
    D]`` or ``[1, B, G, L, D + Dv]``), 2 for the query-side ones (``[B, H, L, ...]``)."""
    return 3 if family in _STACKED else 2


def token_spans(blocks, block_size: int) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` in tokens of half-open block ranges ``blocks`` (blocks of
    ``block_size`` tokens): ``token_spans(((0, 2), (4, 5)), 8) == ((0, 16), (32, 8))``."""
    return tuple((lo * block_size, (hi - lo) * block_size) for lo, hi in blocks)


def _gather_spans(dst: tuple, src: tuple, spans) -> None:
    """Copy the ``spans`` of each part of ``src`` (whole-size) into ``dst`` (range-sized),
    one after another along L."""
    for d, x in zip(dst, src):
        at = 0
        for start, n in spans:
            d.narrow(_PART_L_DIM, at, n).copy_(x.narrow(_PART_L_DIM, start, n))
            at += n


def _scatter_spans(dst: tuple, src: tuple, spans, *, add: bool) -> None:
    """File range-sized ``src`` parts into the ``spans`` of whole-size ``dst`` parts: add
    (gradients) or copy."""
    for d, x in zip(dst, src):
        at = 0
        for start, n in spans:
            piece, into = x.narrow(_PART_L_DIM, at, n), d.narrow(_PART_L_DIM, start, n)
            if add:
                into.add_(piece)
            else:
                into.copy_(piece)
            at += n


def kv_shape(B: int, G: int, L: int, D: int, Dv: int) -> tuple:
    """Shape of a packed kv (or dkv) buffer: ``[2, B, G, L, D]``, or ``[1, B, G, L, D + Dv]``
    when ``Dv != D``."""
    return (2, B, G, L, D) if D == Dv else (1, B, G, L, D + Dv)


def pack_parts(family: Family, parts: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The one tensor of a buffer held as ``parts`` (a new tensor, in ``dtype``)."""
    if family in _STACKED:
        k, v = parts
        if k.shape[-1] != v.shape[-1]:          # Dv != D: side by side, see kv_shape
            return torch.cat([k.to(dtype), v.to(dtype)], dim=-1).unsqueeze(0)
        return torch.stack([p.to(dtype) for p in parts])
    if family in _COLUMNS:
        o, lse = parts
        return torch.cat([o.to(dtype), lse.to(dtype).unsqueeze(-1)], dim=-1)
    (t,) = parts
    return t.to(dtype).clone() if t.dtype == dtype else t.to(dtype)


def split_parts(family: Family, t: torch.Tensor, kv_split: int | None = None) -> tuple:
    """Views of a packed buffer's parts (the inverse of :func:`pack_parts`); ``kv_split``: k's
    head dim D when v's differs (a ``[1, ..., D + Dv]`` kv buffer), else None."""
    if family in _STACKED:
        if kv_split is not None:
            return t[0, ..., :kv_split], t[0, ..., kv_split:]
        return t[0], t[1]
    if family in _COLUMNS:
        D = t.shape[-1] - 1
        return t[..., :D], t[..., D]
    return (t,)


class RankState:
    """Buffers of one rank while its program runs.

    Args:
        rank: the rank.
        program: its program (buffers are released after their last use in it).
        like: ``like(buf) -> (shape, dtype)`` of a whole-heads buffer of that family.
        heads: ``(H, G)``, for head-sliced buffers.
        device: where buffers live.
        protect: names never released (the rank's own data, kept kv).
        merge_out: ``merge_out(out_a, lse_a, out_b, lse_b) -> (out, lse)`` merges a received
            partial ``out`` into the one here (by :meth:`combine`).
        kv_split: k's head dim D when v's head dim differs (MLA: kv buffers are
            ``[1, B, G, L, D + Dv]``, see :func:`kv_shape`); None when they are equal.
        block_size: tokens per block (``plan.block_size``): what a transfer's block ranges
            count in. None: the program moves whole chunks only (a ranged transfer raises).
    """

    def __init__(self, rank: int, program: Program, *, like: Callable, heads: tuple[int, int],
                 device, protect: set[str] = frozenset(), merge_out: Callable | None = None,
                 kv_split: int | None = None, block_size: int | None = None) -> None:
        self.rank = rank
        self.program = program
        self.bufs: dict[str, torch.Tensor] = {}
        self.parts: dict[Buffer, tuple] = {}      # buffers held as parts (see the module doc)
        self.borrowed: set[Buffer] = set()        # parts that are the caller's tensors
        self.pool = Pool()
        self.like = like
        self.heads = heads
        self.device = device
        self.protect = {Buffer(n) for n in protect} | {Buffer(n).parent for n in protect}
        self.merge_out = merge_out
        self.kv_split = kv_split
        self.block_size = block_size
        last = program.last_uses()
        for b, t in list(last.items()):        # a slice keeps its whole buffer alive
            if b.heads is not None:
                last[b.parent] = max(last.get(b.parent, -1), t)
        self.last = last
        self.records: list[StepRecord] = []

    def shape_of(self, name: str) -> tuple[tuple, torch.dtype]:
        b = Buffer(name)
        shape, dtype = self.like(b)
        if b.heads is not None:
            dim, lo, hi = head_range(b, *self.heads)
            shape = tuple(shape[:dim]) + (hi - lo,) + tuple(shape[dim + 1:])
        return tuple(shape), dtype

    def _held(self, b: Buffer) -> Buffer | None:
        """Which held buffer ``b`` lives in: itself, or its whole parent (None: not here)."""
        if b in self.bufs or b in self.parts:
            return b
        if b.heads is not None and (b.parent in self.bufs or b.parent in self.parts):
            return b.parent
        return None

    def has(self, name: str) -> bool:
        return self._held(Buffer(name)) is not None

    def set_parts(self, name: str, parts: tuple, *, borrowed: bool) -> None:
        """Hold a whole buffer as its parts; ``borrowed``: they are the caller's (read-only)."""
        b = Buffer(name)
        self.parts[b] = tuple(parts)
        if borrowed:
            self.borrowed.add(b)
        else:
            self.borrowed.discard(b)

    def _pack(self, b: Buffer) -> None:
        """Replace ``b``'s parts by the packed tensor (a copy the state owns)."""
        parts = self.parts.pop(b)
        self.borrowed.discard(b)
        self.bufs[b] = pack_parts(b.family, parts, self.shape_of(b)[1])

    def get(self, name: str) -> torch.Tensor:
        """The buffer, or the head slice of its whole buffer (a view); packs parts first."""
        b = Buffer(name)
        held = self._held(b)
        if held is not None and held in self.parts:
            self._pack(held)
        hit = self.bufs.get(b)
        if hit is not None:
            return hit
        if b.heads is not None and b.parent in self.bufs:
            dim, lo, hi = head_range(b, *self.heads)
            return self.bufs[b.parent].narrow(dim, lo, hi - lo)
        raise RuntimeError(f"rank {self.rank}: buffer {b} is not here (the program is "
                           f"inconsistent; fringe.schedules.check finds such faults)")

    def get_parts(self, name: str, *, write: bool = False) -> tuple:
        """The buffer's parts (views where it is packed or a head slice); no copy to read.

        ``write``: the caller writes into them in place, so borrowed parts are packed first.
        """
        b = Buffer(name)
        held = self._held(b)
        if held is not None and held in self.parts:
            if write and held in self.borrowed:
                self._pack(held)
            else:
                parts = self.parts[held]
                if held == b:
                    return parts
                _, lo, hi = head_range(b, *self.heads)
                return tuple(p.narrow(1, lo, hi - lo) for p in parts)
        return split_parts(b.family, self.get(b), self.kv_split)

    def combine(self, name: str, new: tuple, fn: Callable) -> None:
        """``buffer = fn(*buffer_parts, *new)`` (e.g. an lse merge): replaces whole owned
        parts, else writes the result into the buffer's (views of its) parts."""
        b = Buffer(name)
        if b in self.parts and b not in self.borrowed:
            self.parts[b] = tuple(fn(*self.parts[b], *new))
            return
        dst = self.get_parts(b, write=True)
        for d, x in zip(dst, fn(*dst, *new)):
            d.copy_(x)

    def _spans(self, b: Buffer, blocks) -> tuple[tuple[int, int], ...]:
        """``(start, length)`` token spans of a transfer's block ranges (see
        :func:`token_spans`).

        Raises:
            RuntimeError: this state has no ``block_size``, or ``b``'s family never moves in
                ranges (``fringe.plan`` refuses such programs first, as it refuses ranges past
                the chunk's ``L / block_size`` blocks).
        """
        if self.block_size is None:
            raise RuntimeError(f"rank {self.rank}: a transfer of {b}{list(blocks)} carries block "
                               f"ranges, but this RankState has no block_size; give it "
                               f"RankState(..., block_size=plan.block_size)")
        if b.family not in RANGED_FAMILIES:
            raise RuntimeError(f"rank {self.rank}: {b} moves in block ranges, but only "
                               f"{'/'.join(f.value for f in RANGED_FAMILIES)} buffers may (the "
                               f"program is inconsistent; fringe.schedules.check finds such "
                               f"faults)")
        return token_spans(blocks, self.block_size)

    def _wire_shape(self, b: Buffer, spans) -> tuple[tuple, torch.dtype]:
        """Shape and dtype of what a transfer of ``b`` moves: the whole buffer, or (``spans``
        not None) its spans' tokens along L."""
        shape, dtype = self.shape_of(b)
        if spans is not None:
            d = token_dim(b.family)
            shape = shape[:d] + (sum(n for _, n in spans),) + shape[d + 1:]
        return shape, dtype

    def outgoing(self, name: str, blocks=None) -> torch.Tensor:
        """The tensor to send: a buffer held as parts is packed into a temporary; with
        ``blocks`` (block ranges of the chunk) only their tokens, copied part by part from
        (views of) the parts into one new range-sized tensor."""
        b = Buffer(name)
        if blocks is not None:
            spans = self._spans(b, blocks)
            shape, dtype = self._wire_shape(b, spans)
            t = torch.empty(shape, dtype=dtype, device=self.device)
            _gather_spans(split_parts(b.family, t, self.kv_split), self.get_parts(b), spans)
            return t
        held = self._held(b)
        if held is not None and held in self.parts:
            return pack_parts(b.family, self.get_parts(b), self.shape_of(b)[1])
        return self.get(name).contiguous()

    def incoming(self, name: str, blocks=None) -> torch.Tensor:
        """A receive buffer from the pool: whole-size, or sized to ``blocks``' tokens."""
        b = Buffer(name)
        shape, dtype = self._wire_shape(b, None if blocks is None else self._spans(b, blocks))
        return self.pool.get_shape(shape, dtype, self.device)

    def _home(self, b: Buffer) -> None:
        """A head slice of this rank's own gradient accumulates into the whole buffer: make it
        (zero) on the slice's first write."""
        if (b.family.is_gradient and b.heads is not None and b.chunk == self.rank
                and self._held(b) is None):
            shape, dtype = self.shape_of(b.parent)
            self.bufs[b.parent] = torch.zeros(shape, dtype=dtype, device=self.device)

    def arrived(self, name: str, t: torch.Tensor, blocks=None) -> None:
        """File a received tensor by its family's rule (see the module doc); ``blocks``: it
        holds only those block ranges of the chunk."""
        b = Buffer(name)
        self._home(b)
        held = self._held(b)
        if blocks is not None:
            spans = self._spans(b, blocks)
            if held is None:                # zeros outside the ranges (pool reuse: refilled)
                shape, dtype = self.shape_of(b)
                self.bufs[b] = self.pool.get_shape(shape, dtype, self.device).zero_()
            _scatter_spans(self.get_parts(b, write=True),
                           split_parts(b.family, t, self.kv_split), spans,
                           add=b.family.is_gradient)
            self.pool.put(t)
        elif b.family.is_gradient and held is not None:
            for d, x in zip(self.get_parts(b, write=True), split_parts(b.family, t, self.kv_split)):
                d.add_(x)
            self.pool.put(t)
        elif b.family is Family.OUT and held is not None and self.merge_out is not None:
            self.combine(b, split_parts(b.family, t, self.kv_split), self.merge_out)
            self.pool.put(t)
        elif held is not None and held != b:
            for d, x in zip(self.get_parts(b, write=True), split_parts(b.family, t, self.kv_split)):
                d.copy_(x)
            self.pool.put(t)
        else:
            self.bufs[b] = t

    def accumulate(self, name: str, value: torch.Tensor) -> None:
        """Add ``value`` into the buffer (its first value is copied: ``value`` stays the
        caller's)."""
        if self.has(name):
            self.get(name).add_(value)
        else:
            acc = self.pool.get(value)
            acc.copy_(value)
            self.bufs[Buffer(name)] = acc

    def accumulate_parts(self, name: str, parts: tuple) -> None:
        """Add ``parts`` into the buffer; its first value is ``parts`` themselves (no zero fill,
        no copy), so the caller hands them over: fresh tensors nothing else holds."""
        b = Buffer(name)
        self._home(b)
        if self.has(b):
            for d, x in zip(self.get_parts(b, write=True), parts):
                d.add_(x)
        elif len(parts) == 1:
            self.bufs[b] = parts[0]
        else:
            self.set_parts(b, parts, borrowed=False)

    def drop_buffers(self) -> None:
        """Forget every buffer (keep the step records and the pool's allocation count), so a
        finished run's state does not hold tensors."""
        self.bufs.clear()
        self.parts.clear()
        self.borrowed.clear()
        self.pool.clear()

    def release(self, step: int) -> None:
        for name in [n for n, t in self.last.items() if t == step]:
            if name in self.protect or name.parent in self.protect:
                continue
            if name in self.bufs:
                self.pool.put(self.bufs.pop(name))
            elif name in self.parts:
                self.parts.pop(name)
                self.borrowed.discard(name)


ComputeFn = Callable[[RankState, "Compute | GradCompute"], None]


def execute(programs: dict[int, Program], states: dict[int, RankState], transport: Transport,
            compute: ComputeFn) -> None:
    """Run the given ranks' programs in lockstep over their global step indices."""
    steps = {r: {s.index: s for s in programs[r].steps} for r in programs}
    indices = sorted({t for r in steps for t in steps[r]})
    for t in indices:
        pending = {}
        for r, st in states.items():
            step = steps[r].get(t)
            if step is None:
                continue
            sends, recvs, colls = [], [], []
            ranges, slot_ranges = [], []    # each receive's block ranges; each collective's
            for op in step.comms:
                if isinstance(op, Send):
                    sends.append((op.peer, op.buf, st.outgoing(op.buf, op.blocks)))
                else:
                    recvs.append((op.peer, op.buf, st.incoming(op.buf, op.blocks)))
                    ranges.append(op.blocks)
            for op in step.collectives:
                me = op.group.index(r)
                sk, rk = _slot_blocks(op)
                colls.append((op, [None if k == me or b is None else st.outgoing(b, sk.get(k))
                                   for k, b in enumerate(op.sends)],
                              [None if k == me or b is None else st.incoming(b, rk.get(k))
                               for k, b in enumerate(op.recvs)]))
                slot_ranges.append(rk)
            handle = (transport.issue(r, t, sends, recvs, colls) if colls else
                      transport.issue(r, t, sends, recvs))
            sent = sum(x.numel() * x.element_size() for _, _, x in sends) + sum(
                x.numel() * x.element_size() for _, xs, _ in colls for x in xs if x is not None)
            pending[r] = (step, recvs, colls, handle, sent, sends,   # sends: alive until waited
                          ranges, slot_ranges)
        timings, events = {}, {}
        for r, (step, *_) in pending.items():
            ev = _events(states[r])
            t0 = time.perf_counter()
            for op in step.computes:
                compute(states[r], op)
            timings[r] = time.perf_counter() - t0
            if ev is not None:
                ev[1].record()
            events[r] = ev
        for r, (step, recvs, colls, handle, sent, _, ranges, slot_ranges) in pending.items():
            st = states[r]
            t0 = time.perf_counter()
            transport.wait(r, t, handle)
            wait_s = time.perf_counter() - t0
            ev = events[r]
            if ev is not None:
                ev[2].record()
            got = sum(x.numel() * x.element_size() for _, _, x in recvs)
            for (_, name, buf), blocks in zip(recvs, ranges):
                st.arrived(name, buf, blocks)
            for (op, _, outs), rk in zip(colls, slot_ranges):   # member order: a fixed order
                for k, (name, buf) in enumerate(zip(op.recvs, outs)):   # of summation
                    if buf is not None:
                        got += buf.numel() * buf.element_size()
                        st.arrived(name, buf, rk.get(k))
            st.release(t)
            st.records.append(StepRecord(
                r, t, None if ev else timings[r], None if ev else wait_s, len(step.computes),
                sent, got, ev))


_WHOLE: dict = {}


def _slot_blocks(op) -> tuple[dict, dict]:
    """``(sends, receives)``: a collective's ranged slots' block ranges by member index (empty
    when every slot moves its whole chunk)."""
    if not op.ranged:
        return _WHOLE, _WHOLE
    return (dict(zip(op.sparse_sends[0], op.send_blocks)),
            dict(zip(op.sparse_recvs[0], op.recv_blocks)))


def _events(st: RankState):
    """Three timing events on CUDA (the first recorded now), else None."""
    if torch.device(st.device).type != "cuda":
        return None
    ev = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
    ev[0].record()
    return ev
