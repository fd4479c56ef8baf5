"""The cost model: run a plan's programs symbolically and predict where the time goes.

No tensors are made. Each tile costs what a work model says, each transfer latency plus
bytes over bandwidth, and overlap follows the interpreter's real order (see
:mod:`fringe.runtime.interpreter`): at every step a rank *issues* its transfers and
collectives, *computes* its tiles, then *waits* for all of them; a step ends when both its
compute and its communication are done, a transfer cannot start before both ends have issued
it, and a collective not before every member has (a rank's collectives of one step run one
after the other).

Communication, per step (the alpha-beta model; :meth:`Hardware.collective_s` gives sources):

* point to point: ``latency + bytes / bandwidth``, where bytes is the busier end's traffic in
  that step (a rank's sends share its link);
* all-gather (AG) and reduce-scatter (RS), ring: ``(n - 1) * latency + bytes / bandwidth``
  with bytes the most one member receives (AG) or sends (RS), empty contributions (``-``)
  counting nothing: a full AG of b bytes each is the textbook ``(n - 1) * (latency + b /
  bandwidth)``;
* all-to-all (A2A), pairwise: ``(n - 1) * latency + max(bytes sent, bytes received) /
  bandwidth`` of the busiest member;
* the link: ``latency_s`` / ``bandwidth`` (NVLink on H100) when both ends, or every member of a
  collective, sit in one node of ``node_size`` consecutive ranks (8 on the H100 presets), else
  ``inter_latency_s`` / ``inter_bandwidth`` (InfiniBand on ``h100-ib``).

A head-sliced tile (``C q3·kv5 h1/4``, Ulysses) pays its kernel calls in full and 1/k of the
pairs and rows; a head-sliced buffer moves 1/k of the query heads (kv: the kv heads they read).

The result carries the same
:class:`~fringe.runtime.interpreter.StepRecord` values a measured run leaves behind, so the
reports and figures of :mod:`fringe.render` work for both.

Work model, per tile: the tile's block map is split into dense sub-problems exactly as
:func:`fringe.ops.tile.tile_forward` splits it for the fused ``sdpa`` kernel (``_plan`` with
``fused=True``, the block pattern deciding): a causal-aligned diagonal run of blocks is one
square ``is_causal`` call, the rest is grouped by q-block rows and cut where columns switch
between all-FULL and mixed, whichever makes no more calls than plain row groups. Each
sub-problem costs ``call_s + pairs * unit``, where ``unit`` is the seconds per (q, kv) pair for
its kind: FULL (no mask), masked (a PARTIAL or EMPTY block inside: a float mask), or causal
(the whole square, at the ``causal`` factor). A per-tile overhead (merging the partial output,
accumulating dq) scales with the q rows. (Costing a causal diagonal as masked row groups
over-predicted measured causal steps by 17-33%.)

>>> import fringe
>>> from fringe import masks, schedules
>>> from fringe.runtime import costmodel
>>> p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=4096, world_size=4)
>>> pred = costmodel.simulate(p, hardware="h100-nvlink")
>>> pred.forward_s < pred.backward_s, round(pred.balance, 2)
(True, 1.0)

Legend: B batch · H query heads · G kv heads · S sequence · L tokens per rank · D head dim ·
P ranks.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import operator
import os
import time
from typing import Sequence

import torch

try:
    import numpy as np
except ImportError as e:                      # numpy is in the test / plots extras
    raise ImportError("fringe.runtime.costmodel needs numpy: pip install numpy "
                      "(or pip install 'fringe[test]')") from e

from ..masks import BlockKind
from .interpreter import StepRecord

__all__ = ["HARDWARE", "Hardware", "Prediction", "Shape", "available_memory", "calibrate",
           "check_memory", "check_plan_memory", "distinct_partial_maps", "get_hardware",
           "mask_from_spec", "memory_budget", "simulate", "tile_costs", "tile_work",
           "tile_work_bytes", "validate"]

_FULL, _PARTIAL, _EMPTY = int(BlockKind.FULL), int(BlockKind.PARTIAL), int(BlockKind.EMPTY)
_CHUNK = 1 << 15          # tiles whose block maps are packed at once in tile_work
_BAND_BLOCKS = 1 << 24    # blocks of the block map made dense at once in tile_work
_BULK_OPS = 16            # steps of this many ops take their computes in bulk (op walk)
_RECT_CHUNK = 1 << 16     # rectangles hashed at once in _distinct_maps_from_rects (in cache)
_SLICE_LOOKUP = 1 << 22   # head-slice keys looked up in a dense table up to this many


def _tile(plan, i: int, j: int, n: int) -> torch.Tensor:
    """Block map of tile (q of rank i, kv of rank j), ``[n, n]``."""
    if hasattr(plan, "tile_blocks"):
        return plan.tile_blocks(i, j)
    return _rows(plan, i * n, (i + 1) * n)[:, j * n:(j + 1) * n]


def _rows(plan, r0: int, r1: int) -> torch.Tensor:
    """Dense int8 block rows ``[r0, r1)`` of the plan's map (sparse ``block_map`` or ``blocks``)."""
    bm = getattr(plan, "block_map", None)
    if bm is not None and hasattr(bm, "dense"):
        return bm.dense(rows=(r0, r1), limit=None)
    return plan.blocks[r0:r1]

#: FLOPs per (q, kv) pair, per head and per unit of D: QKᵀ and PV in the forward (2 + 2),
#: and 2.5x that in the backward (the convention of :class:`fringe.plan.PlanStats`).
FWD_FLOPS_PER_PAIR = 4
BWD_FLOPS_PER_PAIR = 10


@dataclasses.dataclass(frozen=True)
class Hardware:
    """What one rank can compute and move, as data (with where the numbers come from).

    Attributes:
        name: preset name.
        source: where the numbers come from (datasheet, paper, or a measurement).
        fwd_flops: sustained attention FLOP/s of the kernel on FULL sub-problems, forward.
        bwd_flops: the same for the backward.
        call_s: fixed seconds per kernel call (sub-problem), forward.
        bwd_call_s: fixed seconds per kernel call, backward.
        masked: cost of a pair in a masked sub-problem, relative to a FULL pair (forward).
        causal: cost of a pair in a causal-aligned sub-problem run with ``is_causal``
            (counting the whole square: the kernel skips the upper half itself).
        bwd_masked: the masked factor for the backward (None: as the forward).
        bwd_causal: the causal factor for the backward (None: as the forward).
        row_s: seconds per (q row · head · D) element per tile (merging out/lse, adding dq).
        latency_s: seconds to start a transfer between two ranks of one node.
        bandwidth: bytes/s one way between two ranks of one node.
        node_size: ranks per node; 0 means all ranks share one node.
        inter_latency_s: latency between nodes.
        inter_bandwidth: bytes/s one way per rank between nodes.
        memory_bytes: memory per rank (None: not stated), to flag plans that do not fit.
    """

    name: str
    source: str
    fwd_flops: float
    bwd_flops: float
    call_s: float
    bwd_call_s: float
    masked: float = 1.0
    causal: float = 0.6
    bwd_masked: float | None = None
    bwd_causal: float | None = None
    row_s: float = 0.0
    latency_s: float = 10e-6
    bandwidth: float = 100e9
    node_size: int = 0
    inter_latency_s: float = 20e-6
    inter_bandwidth: float = 50e9
    memory_bytes: float | None = None

    def __post_init__(self) -> None:
        for f in ("fwd_flops", "bwd_flops", "bandwidth", "inter_bandwidth"):
            if not getattr(self, f) > 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be > 0, got {getattr(self, f)}")
        for f in ("call_s", "bwd_call_s", "row_s", "latency_s", "inter_latency_s"):
            if getattr(self, f) < 0:
                raise ValueError(f"Hardware {self.name!r}: {f} must be >= 0, got {getattr(self, f)}")
        if self.node_size < 0:
            raise ValueError(f"Hardware {self.name!r}: node_size must be >= 0 (0 = one node)")

    def collective_s(self, n, nbytes, intra):
        """Seconds of collectives over ``n`` members moving ``nbytes`` (arrays), ``intra``:
        all members on one node (NVLink), else across nodes (the slower link bounds a ring).

        ``(n - 1) * latency + nbytes / bandwidth``: the alpha-beta cost of a ring all-gather or
        reduce-scatter and of a pairwise all-to-all, n - 1 rounds each (Thakur, Rabenseifner
        and Gropp, "Optimization of Collective Communication Operations in MPICH", IJHPCA
        2005, sec. 4; NCCL's ring algorithms, nccl-tests doc/PERFORMANCE.md "bus bandwidth").
        ``nbytes`` is what the busiest member moves, counting only non-empty contributions:
        for an all-gather the bytes a member receives (in a ring every byte it gathers enters
        it once), for a reduce-scatter the bytes a member sends (its adjoint), for an
        all-to-all the larger of the two. A full all-gather of b bytes per member gives the
        textbook ``(n - 1) * (latency + b / bandwidth)``.
        """
        n = np.asarray(n, dtype=np.float64)
        intra = np.asarray(intra, dtype=bool)
        lat = np.where(intra, self.latency_s, self.inter_latency_s)
        bw = np.where(intra, self.bandwidth, self.inter_bandwidth)
        return np.maximum(n - 1, 0) * lat + np.asarray(nbytes, dtype=np.float64) / bw

    def link(self, src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(latency, bandwidth) arrays for transfers ``src[i] -> dst[i]``."""
        if not self.node_size:
            return (np.full(len(src), self.latency_s), np.full(len(src), self.bandwidth))
        same = (src // self.node_size) == (dst // self.node_size)
        return (np.where(same, self.latency_s, self.inter_latency_s),
                np.where(same, self.bandwidth, self.inter_bandwidth))


# Sources. H100 SXM: NVIDIA H100 datasheet (NVLink 4: 900 GB/s bidirectional per GPU, so 450 GB/s
# one way; 80 GB HBM3); NCCL point-to-point reaches ~80% of it. Attention throughput:
# FlashAttention-3 (Shah et al. 2024, arXiv:2407.08608, figs. 5-7): BF16 forward ~600 TFLOP/s
# at head dim 128 and long sequences, backward ~450 TFLOP/s; a kernel launch + tail ~5 us.
# Masked blocks (FlexAttention's mask_mod on partial blocks) ~1.3x a full block (attention-gym
# FlexAttention blog, "block sparsity" benchmarks). InfiniBand: NDR 400 Gb/s per GPU (one
# ConnectX-7 per GPU in DGX H100) = 50 GB/s one way, ~45 GB/s achieved by NCCL, ~20 us.
_H100 = dict(fwd_flops=600e12, bwd_flops=450e12, call_s=5e-6, bwd_call_s=8e-6, masked=1.3,
             causal=0.55, row_s=1e-14, latency_s=10e-6, bandwidth=360e9, memory_bytes=80e9)

#: Measured on this repository's shared 2-core x86 runner by :func:`calibrate` (torch 2.13,
#: 1 thread per rank, float32, H=8 D=64, fused CPU SDPA through fringe.ops; CPU time of the
#: calling thread). gloo between two processes over shared memory measured 0.9-9.5 GB/s and
#: 0.1-2 ms round-trip latency depending on the load from other processes: 2 GB/s and 0.1 ms
#: are taken. Re-measure with ``costmodel.calibrate()`` or ``--hardware this`` elsewhere.
_CPU = dict(fwd_flops=4.5e10, bwd_flops=4.1e10, call_s=1.0e-4, bwd_call_s=1.6e-4, masked=1.25,
            bwd_masked=1.3, causal=0.6, row_s=1.1e-8, latency_s=1.0e-4, bandwidth=2.0e9,
            memory_bytes=None)

HARDWARE: dict[str, Hardware] = {
    "h100-nvlink": Hardware("h100-nvlink", "one DGX H100 node (8 GPUs, NVLink 4); H100 datasheet, "
                            "FlashAttention-3 paper", node_size=8, inter_latency_s=10e-6,
                            inter_bandwidth=360e9, **_H100),
    "h100-ib": Hardware("h100-ib", "DGX H100 nodes of 8 over InfiniBand NDR 400 Gb/s per GPU; "
                        "H100 datasheet, FlashAttention-3 paper, ConnectX-7 spec",
                        node_size=8, inter_latency_s=20e-6, inter_bandwidth=45e9, **_H100),
    "cpu": Hardware("cpu", "this repository's 2-core CPU runner, gloo over shared memory; "
                    "measured by costmodel.calibrate() (re-run it for your machine)", **_CPU),
}


def get_hardware(hardware: str | Hardware) -> Hardware:
    """A preset by name (``"this"`` calibrates now), or a :class:`Hardware` as is.

    Raises:
        ValueError: for an unknown name, listing the presets.
    """
    if isinstance(hardware, Hardware):
        return hardware
    if hardware == "this":
        return calibrate()
    try:
        return HARDWARE[hardware]
    except KeyError:
        raise ValueError(f"unknown hardware {hardware!r}; choose one of "
                         f"{sorted(HARDWARE) + ['this']} or pass a costmodel.Hardware") from None


_DTYPES = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2}


@dataclasses.dataclass(frozen=True)
class Shape:
    """The tensors a plan runs on: ``q [B, H, L, D]``, ``k [B, G, L, D]``, ``v [B, G, L, Dv]``.

    The default is one Llama-3-8B-like attention layer: H=32, G=8, D=128, bfloat16.
    ``v_head_dim`` (Dv) None means D; MLA (DeepSeek-V3) has a v head dim smaller than D.
    """

    batch: int = 1
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128             # D of a Llama-3-70B-like layer (not a block size)
    dtype: str = "bfloat16"
    v_head_dim: int | None = None   # Dv of v and out (None: head_dim)

    def __post_init__(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(_DTYPES)}")
        for f in ("batch", "heads", "kv_heads", "head_dim"):
            if getattr(self, f) < 1:
                raise ValueError(f"Shape.{f} must be >= 1, got {getattr(self, f)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.v_head_dim is not None and self.v_head_dim < 1:
            raise ValueError(f"Shape.v_head_dim must be >= 1 (or None: head_dim), got "
                             f"{self.v_head_dim}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype]

    @property
    def acc_itemsize(self) -> int:
        """Accumulators (out/lse, dq, dkv) are float32, float64 for float64."""
        return 8 if self.dtype == "float64" else 4

    def buffer_bytes(self, kind: str, L: int, *, split: int = 1) -> int:
        """Bytes of one buffer of ``kind`` (kv, dkv, q, dq, out, dout) holding ``L`` tokens.

        With ``split=k``, one head slice of k (``q3h1/4``): H/k query heads, and for kv the
        kv heads those read (G/k of them, or one when k % G == 0, as the interpreter holds
        them).

        Raises:
            ValueError: H and G cannot be split k ways (the interpreter's rule).
        """
        B, H, G, D = self.batch, self.heads, self.kv_heads, self.head_dim
        Dv = D if self.v_head_dim is None else self.v_head_dim
        if split != 1:
            from .interpreter import check_head_split
            check_head_split(split, H, G, what=f"a head slice of {split} (H={H}, G={G})")
            H, G = H // split, (G // split if G % split == 0 else 1)
        if kind == "kv":                     # k and v: G·(D + Dv) per token
            return B * G * L * (D + Dv) * self.itemsize
        if kind == "dkv":
            return B * G * L * (D + Dv) * self.acc_itemsize
        if kind == "q":
            return B * H * L * D * self.itemsize
        if kind == "dq":
            return B * H * L * D * self.acc_itemsize
        return B * H * L * (Dv + 1) * self.acc_itemsize     # a partial out + lse


def _row_runs(ne: np.ndarray, slack: float) -> tuple[list, list, list, list]:
    """:func:`fringe.ops.tile._row_groups` on a bool map of non-EMPTY blocks: consecutive
    rows grouped while the rectangle costs at most ``slack`` times the exact blocks, as
    block-index lists ``(qb0, qb1, kb0, kb1)``."""
    nk = ne.shape[1]
    live = ne.any(axis=1)
    rows = np.flatnonzero(live)
    lo = ne[rows].argmax(axis=1)
    hi = nk - ne[rows, ::-1].argmax(axis=1)
    Q0, Q1, K0, K1 = [], [], [], []
    cur = None
    exact = 0
    for i, a, b in zip(rows.tolist(), lo.tolist(), hi.tolist()):
        w = b - a
        if cur is not None:
            qb0, qb1, kb0, kb1 = cur
            if qb1 == i:                               # the row right below: may join
                nlo, nhi = min(kb0, a), max(kb1, b)
                if (i + 1 - qb0) * (nhi - nlo) <= slack * (exact + w):
                    cur, exact = (qb0, i + 1, nlo, nhi), exact + w
                    continue
            Q0.append(qb0), Q1.append(qb1), K0.append(kb0), K1.append(kb1)
        cur, exact = (i, i + 1, a, b), w
    if cur is not None:
        Q0.append(cur[0]), Q1.append(cur[1]), K0.append(cur[2]), K1.append(cur[3])
    return Q0, Q1, K0, K1


def _causal_squares(blocks: np.ndarray, nqf: int, nkf: int) -> list[tuple[int, int, int]]:
    """:func:`fringe.ops.tile._causal_runs` without element checks (the block pattern decides):
    maximal diagonal runs ``(i, j, n)`` of PARTIAL blocks with FULL blocks left of the
    diagonal and EMPTY ones above it inside the square, streamed in row-major order."""
    nq, nk = blocks.shape
    if nqf == 0 or nkf == 0:
        return []
    E = blocks == _EMPTY
    c = blocks[:nqf, :nkf]
    right = np.ones((nqf, nkf), dtype=bool)
    right[:, :nkf - 1] = E[:nqf, 1:nkf]
    if nkf < nk:
        right[:, nkf - 1] = E[:nqf, nkf]
    above = np.ones((nqf, nkf), dtype=bool)
    above[1:] = E[:nqf - 1, :nkf]
    ci, cj = np.nonzero((c == _PARTIAL) & right & above)
    if not len(ci):
        return []
    # FULL blocks just left of (i, j) in its row, EMPTY blocks just above it in its column
    idx = np.arange(nk)
    last = np.maximum.accumulate(np.where(blocks == _FULL, -1, idx[None, :]), axis=1)
    left_full = np.where(cj > 0, cj - 1 - last[ci, np.maximum(cj - 1, 0)], 0)
    ridx = np.arange(nq)[:, None]
    lastr = np.maximum.accumulate(np.where(E, -1, ridx), axis=0)
    up_empty = np.where(ci > 0, ci - 1 - lastr[np.maximum(ci - 1, 0), cj], 0)
    runs: list[list[int]] = []
    ends: dict[int, int] = {}                          # diagonal j - i -> run index
    for i, j, f, e in zip(ci.tolist(), cj.tolist(), left_full.tolist(), up_empty.tolist()):
        r = ends.get(j - i)
        if r is not None:
            run = runs[r]
            n = run[2]
            if run[0] + n == i and f >= n and e >= n:
                run[2] = n + 1
                continue
        ends[j - i] = len(runs)
        runs.append([i, j, 1])
    return [tuple(r) for r in runs]


def _split_cols(codes: np.ndarray, qb0: int, kb0: int, out: list) -> None:
    """:func:`fringe.ops.tile._split_columns` on a group's codes, appending ``(qb0, qb1, kb0,
    kb1)`` pieces to ``out``."""
    ne = codes != _EMPTY
    full_col = (codes == _FULL).all(0)
    live_col = ne.any(0)
    if full_col.all() or (not full_col.any() and live_col.all()):
        out.append((qb0, qb0 + codes.shape[0], kb0, kb0 + codes.shape[1]))
        return
    fc, lc = full_col.tolist(), live_col.tolist()
    j, nk, nr = 0, codes.shape[1], codes.shape[0]
    while j < nk:
        if not lc[j]:
            j += 1
            continue
        e = j + 1
        while e < nk and lc[e] and fc[e] == fc[j]:
            e += 1
        rows = np.flatnonzero(ne[:, j:e].any(1))
        r0, r1 = int(rows[0]), int(rows[-1]) + 1
        if fc[j] or (r0, r1) == (0, nr):
            out.append((qb0 + r0, qb0 + r1, kb0 + j, kb0 + e))
        else:
            _split_cols(codes[r0:r1, j:e], qb0 + r0, kb0 + j, out)
        j = e


def _fused_pieces(tall: np.ndarray, *, per: int, Lq: int, Lk: int, block_size: int,
                  runs_ok: bool):
    """The sub-problems :func:`fringe.ops.tile._plan` makes with ``fused=True`` (the ``sdpa``
    kernel's calls; the block pattern decides the causal squares) for maps stacked in
    ``tall`` ``[N * per, n]`` (each map's last row all EMPTY), decided map by map.

    Returns:
        ``(q0, q1, k0, k1, causal, codes_of)`` block-index arrays per piece and, per piece,
        which map ``tall`` or the map with the squares emptied (``work``) its codes come from
        (0 / 1), with ``work``.
    """
    from ..ops import tile
    slack = tile.GROUP_SLACK
    bs = block_size
    nq, nk = tall.shape
    N = nq // per
    base = _row_runs(tall != _EMPTY, slack)
    runs = (_causal_squares(tall, min(nq, Lq // bs), min(nk, Lk // bs)) if runs_ok else [])
    work = tall
    if runs:
        work = tall.copy()
        for i, j, n in runs:
            work[i:i + n, j:j + n] = _EMPTY
    rest = _row_runs(work != _EMPTY, slack) if runs else base
    # the column split of every rest group (most are kept whole: find those without Python)
    split: list = []
    rq0, rq1, rk0, rk1 = (np.asarray(x, dtype=np.int64) for x in rest)
    if len(rq0):
        cf = np.zeros((nq + 1, nk), dtype=np.int32)
        cf[1:] = np.cumsum(work == _FULL, axis=0)
        cl = np.zeros((nq + 1, nk), dtype=np.int32)
        cl[1:] = np.cumsum(work != _EMPTY, axis=0)
        h = (rq1 - rq0)[:, None]
        inside = (np.arange(nk)[None, :] >= rk0[:, None]) & (np.arange(nk)[None, :] < rk1[:, None])
        fullc = (cf[rq1] - cf[rq0]) == h
        livec = (cl[rq1] - cl[rq0]) > 0
        all_full = (fullc | ~inside).all(1)
        none_full_all_live = ~(fullc & inside).any(1) & (livec | ~inside).all(1)
        whole = all_full | none_full_all_live
        for g in np.flatnonzero(~whole).tolist():
            a, b, c, d = int(rq0[g]), int(rq1[g]), int(rk0[g]), int(rk1[g])
            pieces: list = []
            _split_cols(work[a:b, c:d], a, c, pieces)
            split.append((g, pieces))
    # per map: squares + split, else squares + rest, else base (the fewest calls wins)
    def per_map(q0):
        return np.bincount(np.asarray(q0, dtype=np.int64) // per, minlength=N)
    n_base, n_rest = per_map(base[0]), per_map(rest[0])
    n_sq = per_map([r[0] for r in runs])
    extra = np.zeros(N, dtype=np.int64)                # pieces beyond one per split group
    for g, pieces in split:
        extra[int(rq0[g]) // per] += len(pieces) - 1
    n_split = n_rest + extra
    choice = np.where(n_sq + n_split <= n_base, 0, np.where(n_sq + n_rest <= n_base, 1, 2))
    parts = []
    # base (codes of tall)
    bq0 = np.asarray(base[0], dtype=np.int64)
    sel = choice[bq0 // per] == 2
    parts.append((bq0[sel], np.asarray(base[1], dtype=np.int64)[sel],
                  np.asarray(base[2], dtype=np.int64)[sel], np.asarray(base[3], dtype=np.int64)[sel],
                  np.zeros(int(sel.sum()), bool), np.zeros(int(sel.sum()), np.int8)))
    if runs:
        R = np.asarray(runs, dtype=np.int64)
        sel = choice[R[:, 0] // per] != 2
        i, j, n = R[sel, 0], R[sel, 1], R[sel, 2]
        parts.append((i, i + n, j, j + n, np.ones(len(i), bool), np.ones(len(i), np.int8)))
    # rest groups: kept whole for choice 1, and for choice 0 when not split
    m_rest = choice[rq0 // per] if len(rq0) else np.zeros(0, np.int64)
    keep = m_rest == 1
    if len(rq0):
        keep |= (m_rest == 0) & whole
    parts.append((rq0[keep], rq1[keep], rk0[keep], rk1[keep], np.zeros(int(keep.sum()), bool),
                  np.ones(int(keep.sum()), np.int8)))
    sp = [p for g, pieces in split if m_rest[g] == 0 for p in pieces]
    if sp:
        S_ = np.asarray(sp, dtype=np.int64)
        parts.append((S_[:, 0], S_[:, 1], S_[:, 2], S_[:, 3], np.zeros(len(S_), bool),
                      np.ones(len(S_), np.int8)))
    cat = [np.concatenate([p[k] for p in parts]) for k in range(6)]
    return (*cat, work)


def _maps_work(maps: torch.Tensor, *, L: int, block_size: int, masked_ok: bool) -> np.ndarray:
    """``[N, 4]`` (calls, full pairs, masked pairs, causal pairs) of N block maps ``[N, n, n]``.

    The sub-problems are the ``sdpa`` kernel's (:func:`fringe.ops.tile._plan` with
    ``fused=True``): square causal-aligned diagonal runs as one ``is_causal`` call each, the
    rest grouped by rows and cut where columns switch between all-FULL (no mask) and mixed,
    whichever makes no more calls than the plain grouping, map by map (the block pattern
    decides, as :mod:`fringe.ops.tile` says for the cost model). The maps are stacked into
    one column with an all-EMPTY row between them (an empty q-block row always ends a
    group), so one pass groups them all exactly as one by one; a piece is FULL when every
    block it covers is FULL (no mask).
    """
    N, n, _ = maps.shape
    if N == 0:
        return np.zeros((0, 4))
    m = torch.as_tensor(maps).to(torch.int8).numpy()
    tall = np.full((N, n + 1, n), _EMPTY, dtype=np.int8)
    tall[:, :n] = m
    tall = tall.reshape(N * (n + 1), n)
    bs = block_size
    q0, q1, k0, k1, causal, src, work = _fused_pieces(
        tall, per=n + 1, Lq=tall.shape[0] * bs, Lk=L, block_size=bs, runs_ok=masked_ok)
    out = np.zeros((N, 4))
    if not len(q0):
        return out
    rows = np.minimum(q1 * bs, tall.shape[0] * bs) - q0 * bs
    pairs = (rows * (np.minimum(k1 * bs, L) - k0 * bs)).astype(np.float64)
    nonfull = np.zeros(len(q0), dtype=np.int64)
    for s, codes in ((0, tall), (1, work)):            # blocks that are not FULL in each piece
        sel = src == s
        if sel.any():
            bad = np.zeros((codes.shape[0] + 1, n + 1), dtype=np.int64)
            bad[1:, 1:] = (codes != _FULL).cumsum(0).cumsum(1)
            a, b, c, d = q0[sel], q1[sel], k0[sel], k1[sel]
            nonfull[sel] = bad[b, d] - bad[a, d] - bad[b, c] + bad[a, c]
    is_full = (nonfull == 0) | (not masked_ok)
    which = q0 // (n + 1)
    out[:, 0] = np.bincount(which, minlength=N)
    out[:, 1] = np.bincount(which, weights=np.where(~causal & is_full, pairs, 0.0), minlength=N)
    out[:, 2] = np.bincount(which, weights=np.where(~causal & ~is_full, pairs, 0.0), minlength=N)
    out[:, 3] = np.bincount(which, weights=np.where(causal, pairs, 0.0), minlength=N)
    return out


def tile_work(plan) -> np.ndarray:
    """Per tile: ``[P, P, 4]`` (calls, full, masked, causal pairs); zero for EMPTY tiles.

    Tiles with the same block map share one evaluation, so this costs the number of
    *distinct* maps, all grouped in one call of the tile grouping. A plan's maps are read
    from the rectangles of its sparse ``block_map`` (only the PARTIAL tiles are painted,
    one distinct map once); plan-like objects with a dense ``blocks`` map work too.
    """
    P, L, bs = plan.world_size, plan.local_len, plan.block_size
    n = L // bs
    masked_ok = plan.mask_mod is not None
    tiles = torch.as_tensor(plan.tiles).to(torch.int64).numpy().reshape(P, P)
    work = np.zeros((P, P, 4), dtype=np.float64)
    full_tiles = tiles == _FULL
    if full_tiles.any():
        work[full_tiles] = _maps_work(torch.full((1, n, n), _FULL, dtype=torch.int8), L=L,
                                      block_size=bs, masked_ok=masked_ok)[0]
    part = np.flatnonzero(tiles.reshape(-1) == _PARTIAL)      # tile keys i * P + j, sorted
    if len(part):
        found = None
        bm = getattr(plan, "block_map", None)
        if bm is not None and hasattr(bm, "rects"):
            found = _distinct_maps_from_rects(bm, tiles.reshape(-1), part, P, n)
        if found is None:
            found = _distinct_maps_dense(plan, part, P, n)
        maps, inv = found
        per_map = _maps_work(maps, L=L, block_size=bs, masked_ok=masked_ok)
        work.reshape(P * P, 4)[part] = per_map[inv]
    return work


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a well-spread uint64 hash of each element (wrapping)."""
    x = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        x ^= x >> np.uint64(30)
        x *= np.uint64(0xBF58476D1CE4E5B9)
        x ^= x >> np.uint64(27)
        x *= np.uint64(0x94D049BB133111EB)
        x ^= x >> np.uint64(31)
    return x


def _distinct_maps_from_rects(bm, tiles_flat: np.ndarray, part: np.ndarray, P: int, n: int):
    """``(maps [U, n, n] int8, inv [len(part)])``: the distinct block maps of the PARTIAL
    tiles ``part`` and which one each tile has, from the block map's rectangles.

    A rectangle's signature is its position inside its tile, its size and its code; a tile's
    signature is the (order-free) sum of its rectangles' hashed signatures and their count.
    Tiles are grouped by signature, and then checked exactly: a tile has as many rectangles
    as its group's representative and every one of them is one of the representative's
    (rectangles of one tile are disjoint, so the two sets, and maps, are equal). Equal maps
    cut into different rectangles land in different groups (an evaluation more, the same
    work). A few passes over the rectangles, no sort of them.
    Returns None when a rectangle crosses a tile boundary (the caller paints densely).
    """
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = (bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes))
    if not len(R) or n + 1 > 1 << 14:
        return None
    m = n + 1
    # int32 where the packed signature fits (n <= 126: 4 coordinates < m and a 2-bit code)
    it = np.int32 if m ** 4 * 4 < 1 << 31 and max(R.shape[0], P * P) < 1 << 31 else np.int64
    N = len(R)
    key = np.empty(N, dtype=it)                       # tile i * P + j of every rectangle
    enc = np.empty(N, dtype=it)                       # (row, height, col, width, code) packed
    # a tile's signature: the sums of two 24-bit hashes of its rectangles (float64 sums of
    # integers below 2**53 are exact and order-free) and its count, by bincount
    lo = np.zeros(P * P)
    hi = np.zeros(P * P)
    cnt = np.zeros(P * P, dtype=np.int64)
    mask24 = np.uint32((1 << 24) - 1)
    for a in range(0, N, _RECT_CHUNK):                # a chunk at a time: arrays stay in cache
        Rc = R[a:a + _RECT_CHUNK]
        r0, r1, c0, c1 = (Rc[:, k].astype(it) for k in range(4))
        if n & (n - 1) == 0:                          # shifts and masks for a power of two
            sh = it(n.bit_length() - 1)
            ti, lr, tj, lc = r0 >> sh, r0 & it(n - 1), c0 >> sh, c0 & it(n - 1)
        else:
            (ti, lr), (tj, lc) = np.divmod(r0, it(n)), np.divmod(c0, it(n))
        r1 -= r0                                       # height
        c1 -= c0                                       # width
        if (lr + r1).max() > n or (lc + c1).max() > n:
            return None                               # rectangles across tiles: paint densely
        k = key[a:a + _RECT_CHUNK]
        np.multiply(ti, it(P), out=k)
        k += tj
        e = enc[a:a + _RECT_CHUNK]
        np.multiply(lr, it(m), out=e)
        e += r1
        e *= it(m)
        e += lc
        e *= it(m)
        e += c1
        e *= it(4)
        e += C[a:a + _RECT_CHUNK].astype(it)          # injective
        k0, k1 = int(k.min()), int(k.max()) + 1       # the chunk's tiles (rows: a few)
        kk = k - it(k0)
        with np.errstate(over="ignore"):
            for acc, mul in ((lo, 0x9E3779B1), (hi, 0x85EBCA77)):
                x = e.astype(np.uint32)
                x *= np.uint32(mul)
                x ^= x >> np.uint32(15)
                x *= np.uint32(0xC2B2AE3D)
                x ^= x >> np.uint32(13)
                x &= mask24
                acc[k0:k1] += np.bincount(kk, weights=x, minlength=k1 - k0)
        cnt[k0:k1] += np.bincount(kk, minlength=k1 - k0)
    del r0, r1, c0, c1, ti, tj, lr, lc
    with np.errstate(over="ignore"):
        sig = _mix64(lo[part].astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
                     + hi[part].astype(np.uint64) * np.uint64(0x94D049BB133111EB)
                     + cnt[part].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    _, first, inv = np.unique(sig.view(np.int64), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    U = len(first)
    rep_tile = part[first]                            # each group's representative tile
    uid = np.full(P * P + 1, U, dtype=it)             # U: not a PARTIAL tile (not checked)
    uid[part] = inv
    is_rep = np.zeros(P * P, dtype=bool)
    is_rep[rep_tile] = True
    E = m ** 4 * 4
    ok = bool((cnt[part] == cnt[rep_tile][inv]).all())
    # the representatives' rectangles, and then every rectangle checked against them, a chunk
    # at a time (gathers from small tables, temporaries in cache)
    keep = np.concatenate([a + np.flatnonzero(is_rep[key[a:a + _RECT_CHUNK]])
                           for a in range(0, N, _RECT_CHUNK)])
    if ok:
        ref_u, ref_e = uid[key[keep]].astype(np.int64), enc[keep].astype(np.int64)
        if (U + 1) * E <= 1 << 26:                    # membership by a table
            table = np.zeros((U + 1) * E, dtype=bool)
            table[ref_u * E + ref_e] = True
            table[U * E:] = True
            for a in range(0, N, _RECT_CHUNK):
                look = uid[key[a:a + _RECT_CHUNK]]
                look *= it(E)
                look += enc[a:a + _RECT_CHUNK]
                if not table[look].all():
                    ok = False
                    break
        else:                                         # membership by a search
            u = uid[key]
            ref = np.unique(ref_u * E + ref_e)
            cand = u.astype(np.int64) * E + enc
            chk = cand[u < U]
            at = np.minimum(np.searchsorted(ref, chk), len(ref) - 1)
            ok = bool((ref[at] == chk).all())
    if not ok:                                        # a hash collision: sort and compare
        return _distinct_maps_sorted(bm, tiles_flat, part, P, n)
    cc = C[keep].astype(np.int8)
    rr = R[keep].astype(np.int64)
    kt = key[keep].astype(np.int64)
    ti_, tj_ = kt // P, kt % P
    lr0, lr1 = rr[:, 0] - ti_ * n, rr[:, 1] - ti_ * n
    lc0, lc1 = rr[:, 2] - tj_ * n, rr[:, 3] - tj_ * n
    diff = np.zeros(U * m * m, dtype=np.int8)
    base = uid[kt].astype(np.int64) * (m * m)
    for rows, cols, sign in ((lr0, lc0, cc), (lr0, lc1, -cc), (lr1, lc0, -cc), (lr1, lc1, cc)):
        np.add.at(diff, base + rows * m + cols, sign)
    maps = diff.reshape(U, m, m).cumsum(1, dtype=np.int8).cumsum(2, dtype=np.int8)[:, :n, :n]
    return torch.from_numpy(np.ascontiguousarray(maps)), inv


def _distinct_maps_sorted(bm, tiles_flat: np.ndarray, part: np.ndarray, P: int, n: int):
    """As :func:`_distinct_maps_from_rects` (its fallback on a hash collision), exactly: the
    rectangles sorted by tile, tiles grouped by (count, hash of the ordered signature), every
    group checked element by element against its first tile, and grouped by content if not.
    Returns None when a rectangle crosses a tile boundary (the caller paints densely).
    """
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = (bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes))
    R = R.astype(np.int64, copy=False)
    if not len(R) or n + 1 > 1 << 14:
        return None
    ti, tj = R[:, 0] // n, R[:, 2] // n
    if ((R[:, 1] - 1) // n != ti).any() or ((R[:, 3] - 1) // n != tj).any():
        return None                                   # rectangles across tiles: paint densely
    key = ti * P + tj
    sel = tiles_flat[key] == _PARTIAL
    key, R, C, ti, tj = key[sel], R[sel], C[sel].astype(np.int64), ti[sel], tj[sel]
    order = np.argsort(key, kind="stable")            # keeps the (r0, c0) order inside a tile
    key, R, C, ti, tj = key[order], R[order], C[order], ti[order], tj[order]
    tile = np.searchsorted(part, key)                 # index into part of each rectangle
    m = n + 1
    enc = ((((R[:, 0] - ti * n) * m + (R[:, 1] - ti * n)) * m + (R[:, 2] - tj * n)) * m
           + (R[:, 3] - tj * n)) * 4 + C
    cnt = np.bincount(tile, minlength=len(part))
    start = np.cumsum(cnt) - cnt
    k = np.arange(len(tile)) - start[tile]
    h = _mix64(enc * np.int64(1 << 20) + k)           # position-dependent: order matters
    tile_hash = np.zeros(len(part), dtype=np.uint64)
    nz = cnt > 0
    if nz.any():
        with np.errstate(over="ignore"):
            tile_hash[nz] = np.add.reduceat(h, start[nz])
    with np.errstate(over="ignore"):
        sig = _mix64(tile_hash + cnt.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15))
    _, first, inv = np.unique(sig.view(np.int64), return_index=True, return_inverse=True)
    inv = inv.reshape(-1)
    rep = first[inv]                                  # each tile's representative tile
    same = (cnt == cnt[rep]).all() and (enc == enc[np.minimum(start[rep[tile]] + k,
                                                               len(enc) - 1)]).all()
    if not same:                                      # a hash collision: group by content
        width = int(cnt.max())
        pad = np.full((len(part), width), -1, dtype=np.int64)
        pad[tile, k] = enc
        _, first, inv = np.unique(np.concatenate([cnt[:, None], pad], axis=1), axis=0,
                                  return_index=True, return_inverse=True)
        inv = inv.reshape(-1)
    U = len(first)
    uid = np.full(len(part), -1, dtype=np.int64)
    uid[first] = np.arange(U)
    keep = uid[tile] >= 0                             # the representatives' rectangles
    u, rr, cc = uid[tile[keep]], R[keep], C[keep].astype(np.int8)
    r0, r1 = rr[:, 0] - ti[keep] * n, rr[:, 1] - ti[keep] * n
    c0, c1 = rr[:, 2] - tj[keep] * n, rr[:, 3] - tj[keep] * n
    diff = np.zeros(U * m * m, dtype=np.int8)
    base = u * (m * m)
    for rows, cols, sign in ((r0, c0, cc), (r0, c1, -cc), (r1, c0, -cc), (r1, c1, cc)):
        np.add.at(diff, base + rows * m + cols, sign)
    maps = diff.reshape(U, m, m).cumsum(1, dtype=np.int8).cumsum(2, dtype=np.int8)[:, :n, :n]
    return torch.from_numpy(np.ascontiguousarray(maps)), inv


def _distinct_maps_dense(plan, part: np.ndarray, P: int, n: int):
    """As :func:`_distinct_maps_from_rects`, from dense block rows (plan-like objects)."""
    pi_all, pj_all = part // P, part % P
    W = -(-(n * n) // 32)
    words = torch.empty(len(part), W, dtype=torch.int64)
    shifts = 2 * torch.arange(32, dtype=torch.int64)
    band = max(1, _BAND_BLOCKS // (n * n * P))          # q ranks painted at once
    starts = np.searchsorted(pi_all, np.arange(0, P + band, band))
    for b, i0 in enumerate(range(0, P, band)):
        lo, hi = starts[b], starts[b + 1]
        if lo == hi:
            continue
        i1 = min(P, i0 + band)
        grid = _rows(plan, i0 * n, i1 * n).view(i1 - i0, n, P, n)
        pi = torch.as_tensor(pi_all[lo:hi] - i0)
        pj = torch.as_tensor(pj_all[lo:hi])
        for a in range(0, hi - lo, _CHUNK):          # bounded memory: _CHUNK maps at a time
            maps = grid[pi[a:a + _CHUNK], :, pj[a:a + _CHUNK], :]              # [N, n, n]
            flat = torch.nn.functional.pad(maps.reshape(len(maps), n * n).to(torch.int64),
                                           (0, W * 32 - n * n))
            words[lo + a:lo + a + len(maps)] = (flat.view(len(maps), W, 32) << shifts).sum(-1)
    _, first, inv = np.unique(words.numpy(), axis=0, return_index=True, return_inverse=True)
    maps = torch.stack([_tile(plan, int(pi_all[f]), int(pj_all[f]), n) for f in first])
    return maps.to(torch.int8), inv.reshape(-1)


def tile_costs(plan, hardware: str | Hardware = "cpu", shape: Shape = Shape(), *,
               backward: bool = False, split: int = 1) -> np.ndarray:
    """Seconds each tile (q of rank i, kv of rank j) takes, ``[P, P]``; 0 for EMPTY tiles.

    With ``split=k`` the cost of computing one head slice of k (``C q·kv h i/k``): the
    kernel calls cost as much, the pairs and rows 1/k.
    """
    hw = get_hardware(hardware)
    fixed, heads = _costs(tile_work(plan), plan.local_len, hw, shape, backward)
    return fixed + heads / split


def _costs(work: np.ndarray, L: int, hw: Hardware, shape: Shape,
           backward: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(fixed, per_heads)`` seconds per tile ``[P, P]``: the kernel calls, which a head
    slice pays in full, and the pairs and rows, of which a slice of 1/k of the heads pays 1/k."""
    D = shape.head_dim if shape.v_head_dim is None else (shape.head_dim + shape.v_head_dim) / 2
    BH_D = shape.batch * shape.heads * D        # MLA: q·k at D, p·v at Dv, so their mean
    if backward:
        unit, call = BWD_FLOPS_PER_PAIR * BH_D / hw.bwd_flops, hw.bwd_call_s
    else:
        unit, call = FWD_FLOPS_PER_PAIR * BH_D / hw.fwd_flops, hw.call_s
    calls, full, masked, causal = (work[..., i] for i in range(4))
    mf = hw.bwd_masked if backward and hw.bwd_masked is not None else hw.masked
    cf = hw.bwd_causal if backward and hw.bwd_causal is not None else hw.causal
    some = calls > 0
    fixed = np.where(some, calls * call, 0.0)
    heads = np.where(some, unit * (full + mf * masked + cf * causal)
                     + hw.row_s * L * BH_D, 0.0)
    return fixed, heads


#: Collective kinds in the columns: all-gather, reduce-scatter, all-to-all.
_COLL_KINDS = {"AG": 0, "RS": 1, "A2A": 2}


@dataclasses.dataclass
class _Cols:
    """One direction's programs as integer columns (one pass over the ops).

    ``comp``: ``(rank, step, grad, q, kv, split)`` per tile compute (``split`` k: one head
    slice of k; 1: all heads). ``send``: ``(rank, step, peer, bytes)`` per point-to-point
    send. ``touch``: groups of ``(rank, step, buffer id, start)``: ops on buffers another
    rank owns (``start``, an array or one bool for the group: it arrives or is first written
    there). ``coll``: ``(rank, step, group id,
    ordinal, kind, sent bytes, received bytes)`` per member side of a collective; ``ordinal``
    counts the collectives on the same group earlier in that step. ``groups``: the groups by
    id; ``buf_bytes``: bytes by buffer id; ``splits``: the head splits the programs use.
    """

    P: int
    comp: tuple
    send: tuple
    touch: tuple
    coll: tuple
    groups: list
    buf_bytes: np.ndarray
    splits: tuple
    #: the peak bytes of other ranks' buffers alive at once per rank, once computed (it does
    #: not depend on the hardware: a plan simulated on several presets computes it once)
    live_peak: np.ndarray | None = None


def _i64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.int64)


def _family_codes():
    from ..schedules import ir
    fams = list(ir.Family)
    return ir, fams, {f: c for c, f in enumerate(fams)}


def _fam_bytes(fams, L: int, shape: Shape) -> np.ndarray:
    return _i64([shape.buffer_bytes(f.value, L) for f in fams])


def _columns(programs: Sequence, L: int, shape: Shape) -> _Cols:
    """Programs as :class:`_Cols`: from the IR's :class:`~fringe.schedules.ir.ProgramTable`
    without building an op (P=1024 rings have millions), plain or general (head slices and
    collectives as columns), else by walking the ops once. Both table readers give the
    columns the walk gives, up to the numbering of buffers and groups."""
    from ..schedules import passes
    ir, fams, code = _family_codes()
    passes._start()
    table_cls = getattr(ir, "ProgramTable", None)
    if table_cls is not None:
        t = table_cls.of(list(programs))
        cols = _general_columns(t, len(programs), L, shape, ir, fams, code)
        if cols is not None:
            return cols
    why = passes._WHY[0]
    import gc
    paused = gc.isenabled()           # the walk makes many small lists and tuples: without a
    gc.disable()                      # pause, collections traverse the plan's millions of ops
    try:
        cols = _walk_columns(programs, L, shape, ir, fams, code)
    finally:
        if paused:
            gc.enable()
    passes._WHY[0] = why              # the walk answered: a fallback (counted, strict raises)
    passes._settle("costmodel", "no ProgramTable in the IR")
    return cols


def _fallback(reason: str):
    """:func:`fringe.schedules.passes._fallback`: the column reader gives up, saying why."""
    from ..schedules import passes
    return passes._fallback(reason)


def _plain_table(t) -> bool:
    """Whether a table holds only what :func:`_table_columns` reads (whole-heads computes,
    sends and receives); anything else (a general table has its own reader, and columns no
    reader knows) is walked op by op instead of being dropped without a word."""
    parts = getattr(t, "_parts", None)
    if parts is not None:
        if len(parts) != 2:
            return False
        comp, xfer = parts
        if (set(comp) != {"rank", "step", "kind", "q", "kv", "order"}
                or set(xfer) != {"step", "src", "dst", "fam", "chunk", "order"}):
            return False
        return not len(comp["kind"]) or int(np.max(comp["kind"])) <= 1
    return not len(t) or int(np.max(t.kind)) <= 3


def _compute_touches(P, rank, step, grad, q, kv, code):
    """Touch rows of tile computes on buffers other ranks own (all heads, ``bufid = family
    code * P + chunk``), by the rule table (``ir.TILE_TOUCHES``: ``grad`` holds the kind
    codes, 0 a forward compute, 1 its VJP). Written buffers start there."""
    from ..schedules.ir import TILE_TOUCHES
    out = []
    for g, fam_chunks in TILE_TOUCHES.items():
        sel = grad == g
        if not sel.any():
            continue
        r, s, cq, ck = rank[sel], step[sel], q[sel], kv[sel]
        remote = (cq != r, ck != r)
        for fam, which, start in fam_chunks:
            m = remote[which]
            if m.any():
                ch = (cq, ck)[which][m]
                out.append((r[m], s[m], code[fam] * P + ch, bool(start)))
    return out


def _table_columns(t, P: int, L: int, shape: Shape, fams, code) -> _Cols:
    """Columns of a :class:`~fringe.schedules.ir.ProgramTable`: from its *parts* when it has
    them (computes, and one row per send and its receive: no sort into rank order needed),
    else from its rows."""
    fam_bytes = _fam_bytes(fams, L, shape)
    parts = getattr(t, "_parts", None)
    if parts is not None:
        comp, xfer = parts
        c = tuple(_i64(comp[k]) for k in ("rank", "step", "kind", "q", "kv"))
        src_, dst, step, fam, chunk = (_i64(xfer[k]) for k in ("src", "dst", "step", "fam", "chunk"))
        sends = (src_, step, dst, fam_bytes[fam])
        xfers = [(src_, False), (dst, True)]
    else:
        comp = t.kind <= 1
        c = (t.rank[comp], t.step[comp], t.kind[comp], t.a[comp], t.b[comp])
        send = t.kind == 2
        sends = (t.rank[send], t.step[send], t.c[send], fam_bytes[t.a[send]])
        step, fam, chunk = t.step, t.a, t.b
        xfers = [(t.rank, t.kind == 3)]
    touches = _compute_touches(P, *c, code)
    for rank, start in xfers:                     # a transfer touches a buffer another rank owns
        sel = chunk != rank
        if not isinstance(start, bool):
            sel &= t.kind >= 2
            start = start[sel]
        touches.append((rank[sel], step[sel], fam[sel] * P + chunk[sel], start))
    e = np.zeros(0, dtype=np.int64)
    comp_cols = (*c, np.ones(len(c[0]), dtype=np.int64))
    return _Cols(P, comp_cols, sends, touches, (e,) * 7, [], np.repeat(fam_bytes, P), (1,))


#: The parts of a general :class:`~fringe.schedules.ir.ProgramTable` that
#: :func:`_general_columns` reads: computes, transfers, collective sides and their slots.
_GENERAL_PARTS = (
    frozenset({"rank", "step", "kind", "q", "kv", "order", "hi", "hn"}),
    frozenset({"step", "src", "dst", "fam", "chunk", "order", "hi", "hn", "rorder"}),
    frozenset({"rank", "step", "order", "kind", "group", "slot_side", "slot_dir", "slot_idx",
               "slot_fam", "slot_chunk", "slot_hi", "slot_hn", "groups"}))


def _within(x: np.ndarray, lo: int, hi: int) -> bool:
    """Every value of ``x`` in ``[lo, hi)``."""
    return not len(x) or (int(x.min()) >= lo and int(x.max()) < hi)


def _cell_order(*keys: np.ndarray) -> np.ndarray | slice:
    """Rows in (keys[0], keys[1], ...) order, ties in row order (a slice when already so)."""
    if not len(keys[0]):
        return slice(None)
    lo = [int(k.min()) for k in keys]
    spans = [int(k.max()) - m + 1 for k, m in zip(keys, lo)]
    if math.prod(float(w) for w in spans) >= 2.0 ** 62:
        return np.lexsort(keys[::-1])
    key = keys[0] - lo[0]
    for k, m, w in zip(keys[1:], lo[1:], spans[1:]):
        key *= w
        key += k - m
    if (np.diff(key) >= 0).all():
        return slice(None)
    return np.argsort(key, kind="stable")


def _member_index(groups: list, gid: np.ndarray, rank: np.ndarray, P: int) -> np.ndarray | None:
    """The index of ``rank[i]`` in ``groups[gid[i]]`` (None when a rank is not in its group)."""
    if not len(gid):
        return _i64([])
    M = 1 + max(P, max(max(g) for g in groups))
    key = np.concatenate([i * M + _i64(g) for i, g in enumerate(groups)])
    idx = np.concatenate([np.arange(len(g), dtype=np.int64) for g in groups])
    o = np.argsort(key)
    key, idx = key[o], idx[o]
    want = gid * M + rank
    at = np.minimum(np.searchsorted(key, want), len(key) - 1)
    if not (key[at] == want).all():
        return None
    return idx[at]


def _general_columns(t, P: int, L: int, shape: Shape, ir, fams, code) -> _Cols | None:
    """Columns of a general :class:`~fringe.schedules.ir.ProgramTable` (head slices and
    collectives) from its parts, with numpy: what :func:`_walk_columns` gives for its
    programs (buffers and groups may be numbered otherwise; nothing the simulation reads
    differs).

    Returns None, to have the programs walked, for a part or column this reader does not
    know and for anything the walk would refuse or build ops from that fail (a chunk or rank
    outside ``[0, P)``, a bad head slice, a side whose rank is not in its group, slots out of
    order): the walk then models it or raises its error, never a silent drop.
    """
    parts = t._parts
    if len(parts) != 3 or any(set(d) != k for d, k in zip(parts, _GENERAL_PARTS)):
        return _fallback("_general_columns: parts this reader does not know")
    comp, xfer, coll = ({k: (v if k == "groups" else _i64(v)) for k, v in d.items()}
                        for d in parts)
    nf = len(fams)
    try:
        kind_code = _i64([_COLL_KINDS[k] for k in ir.COLL_KINDS])
    except (AttributeError, KeyError):           # collective kinds this model does not know
        return _fallback("_general_columns: collective kinds this model does not know")
    raw_groups = coll["groups"]
    for g in raw_groups:                         # what Collective checks of a group
        if not g or len(set(g)) != len(g) or min(g) < 0:
            return _fallback("_general_columns: an invalid group")
    g_size = _i64([len(g) for g in raw_groups])

    def heads_ok(hi, hn):
        return _within(hn, 0, 1 << 16) and bool(((hn == 0) | ((hi >= 0) & (hi < hn))).all())

    ss = coll["slot_side"]
    n_sides = len(coll["rank"])
    if not (_within(comp["kind"], 0, 2) and all(_within(comp[k], 0, P) for k in ("rank", "q", "kv"))
            and _within(xfer["fam"], 0, nf) and all(_within(xfer[k], 0, P)
                                                    for k in ("src", "dst", "chunk"))
            and _within(coll["kind"], 0, len(kind_code)) and _within(coll["rank"], 0, P)
            and _within(coll["group"], 0, len(raw_groups)) and _within(ss, 0, n_sides)
            and _within(coll["slot_dir"], 0, 2) and _within(coll["slot_fam"], 0, nf)
            and _within(coll["slot_chunk"], 0, P)
            and all(_within(d["step"], 0, 1 << 40) for d in (comp, xfer, coll))
            and heads_ok(comp["hi"], comp["hn"]) and heads_ok(xfer["hi"], xfer["hn"])
            and heads_ok(coll["slot_hi"], coll["slot_hn"])):
        return _fallback("_general_columns: a column out of range, or an invalid head slice")
    sx = coll["slot_idx"]
    if len(ss) and not (_within(sx, 0, 1 << 40) and (sx < g_size[coll["group"][ss]]).all()):
        return _fallback("_general_columns: a slot index out of range")
    slot_key = (ss * 2 + coll["slot_dir"]) * (1 << 40) + sx
    if (np.diff(slot_key) <= 0).any():           # slots in (side, dir, idx) order, distinct
        return _fallback("_general_columns: slots not in (side, direction, index) order")

    # buffer ids: whole heads family * P + chunk (as the walk), head slices one id each after
    NH = 1 + max((int(d[k].max()) for d, k in ((comp, "hn"), (xfer, "hn"), (coll, "slot_hn"))
                  if len(d[k])), default=0)
    base = nf * P

    def slice_key(fam, chunk, hi, hn):
        return ((fam * P + chunk) * NH + hi) * NH + hn

    o = _cell_order(comp["rank"], comp["step"], comp["order"])   # op order within a cell:
    cr, ct, cg, cq, ckv, chi, chn = (comp[k][o] for k in     # the sums of compute times
                                     ("rank", "step", "kind", "q", "kv", "hi", "hn"))
    sides = (ir.Q_SIDE, ir.KV_SIDE)             # the rule table's touches, by chunk side
    by_grad = tuple((g, tuple(tuple(f for f, sd, _ in t if sd == s) for s in sides),
                     tuple(tuple(w for _, sd, w in t if sd == s) for s in sides))
                    for g, t in ir.TILE_TOUCHES.items())
    whole = chn == 0
    sl = ~whole
    sliced_refs = []                             # computes on head slices other ranks own
    for g, fams_of, starts_of in by_grad:
        sel = sl & (cg == g)
        if not sel.any():
            continue
        for ch, fs, starts in zip((cq, ckv), fams_of, starts_of):
            m = sel & (ch != cr)
            if not m.any():
                continue
            r, s, k = cr[m], ct[m], slice_key(0, ch[m], chi[m], chn[m])
            for fam, start in zip(fs, starts):
                sliced_refs.append((r, s, k + code[fam] * (P * NH * NH), start))
    x_sl, k_sl = xfer["hn"] > 0, coll["slot_hn"] > 0
    x_key = slice_key(*(xfer[k][x_sl] for k in ("fam", "chunk", "hi", "hn")))
    k_key = slice_key(*(coll[k][k_sl] for k in ("slot_fam", "slot_chunk", "slot_hi", "slot_hn")))
    keys = [x_key, k_key] + [r[2] for r in sliced_refs]
    if nf * P * NH * NH <= _SLICE_LOOKUP:        # few possible slices: a dense lookup
        seen = np.zeros(nf * P * NH * NH, dtype=bool)
        for k in keys:
            seen[k] = True
        uniq, at = np.flatnonzero(seen), np.cumsum(seen) - 1
        slot_of = at.__getitem__
    else:
        uniq = np.unique(np.concatenate(keys))

        def slot_of(key):
            return np.searchsorted(uniq, key)
    u_hn = uniq % NH
    u_fam = uniq // (NH * NH * P)
    sliced_bytes = np.zeros(len(uniq), dtype=np.int64)
    for f, n in sorted(set(zip(u_fam.tolist(), u_hn.tolist()))):
        sliced_bytes[(u_fam == f) & (u_hn == n)] = shape.buffer_bytes(fams[f].value, L, split=n)
    fam_bytes = _fam_bytes(fams, L, shape)
    buf_bytes = np.concatenate([np.repeat(fam_bytes, P), sliced_bytes])

    def ids(sliced, key, fam, chunk):
        """Buffer ids of rows (``key``: the slice keys of the rows where ``sliced``)."""
        out = fam * P + chunk
        if len(key):
            out[sliced] = base + slot_of(key)
        return out

    touch = _compute_touches(P, cr[whole], ct[whole], cg[whole], cq[whole], ckv[whole], code)
    touch += [(r, s, base + slot_of(key), start) for r, s, key, start in sliced_refs]

    xs, src, dst, xc = (xfer[k] for k in ("step", "src", "dst", "chunk"))
    x_id = ids(x_sl, x_key, xfer["fam"], xc)
    sends = (src, xs, dst, buf_bytes[x_id])
    for rank, start in ((src, False), (dst, True)):     # a transfer touches a buffer another
        m = xc != rank                                  # rank owns
        touch.append((rank[m], xs[m], x_id[m], start))

    # collectives: groups by value (as the walk keys them), the member index of each side's
    # rank, and its ordinal (the collectives on its group earlier in the rank's step)
    gid_of: dict[tuple, int] = {}
    remap = _i64([gid_of.setdefault(g, len(gid_of)) for g in raw_groups])
    groups = list(gid_of)
    kr, kt = coll["rank"], coll["step"]
    kg = remap[coll["group"]]
    me = _member_index(groups, kg, kr, P)
    if me is None:
        return _fallback("_general_columns: a collective side whose rank is not in its group")
    seq = np.arange(n_sides, dtype=np.int64)[_cell_order(kr, kt, coll["order"])]   # op order
    seq = seq[_cell_order(kr[seq], kt[seq], kg[seq])]  # by (rank, step, group), op order kept
    pos = np.arange(n_sides, dtype=np.int64)
    head = np.r_[True, (np.diff(kr[seq]) != 0) | (np.diff(kt[seq]) != 0)
                 | (np.diff(kg[seq]) != 0)][:n_sides]
    ordinal = np.empty(n_sides, dtype=np.int64)
    ordinal[seq] = pos - np.maximum.accumulate(np.where(head, pos, 0))
    # bytes each side moves: its slots' buffers but its own slot (which stays in place,
    # by the rule table: ir.OWN_SLOT_IN_PLACE, by the table's kind code)
    s_id = ids(k_sl, k_key, coll["slot_fam"], coll["slot_chunk"])
    in_place = np.array(ir.OWN_SLOT_IN_PLACE)[coll["kind"][ss]] if len(ss) else None
    s_bytes = np.where((sx == me[ss]) & in_place, 0, buf_bytes[s_id]) if len(ss) else _i64([])
    moved = np.r_[0, np.cumsum(s_bytes)][np.searchsorted(
        ss * 2 + coll["slot_dir"], np.arange(2 * n_sides + 1))]
    moved = np.diff(moved)
    coll_cols = (kr, kt, kg, ordinal, kind_code[coll["kind"]], moved[0::2], moved[1::2])
    s_rank = kr[ss]
    far = coll["slot_chunk"] != s_rank
    touch.append((s_rank[far], kt[ss][far], s_id[far], coll["slot_dir"][far] == 1))
    splits = tuple(sorted({1} | set(u_hn.tolist())))
    return _Cols(P, (cr, ct, cg, cq, ckv, np.where(whole, 1, chn)), sends, touch, coll_cols,
                 groups, buf_bytes, splits)


def _walk_columns(programs: Sequence, L: int, shape: Shape, ir, fams, code) -> _Cols:
    """Columns by walking every op (programs with collectives or head slices)."""
    P = len(programs)
    fam_bytes = _fam_bytes(fams, L, shape)
    base = len(fams) * P
    sliced: dict[tuple, int] = {}                      # (family code, chunk, (i, n)) -> id
    sliced_bytes: list[int] = []
    splits = {1}
    Compute, GradCompute, Send, Recv = ir.Compute, ir.GradCompute, ir.Send, ir.Recv
    Collective = ir.Collective
    in_place = {k: rule.own_slot_in_place for k, rule in ir.RULES.items()}
    cache: dict = {}
    sliced_chunks: list[int] = []

    class _Ids(dict):                                  # buffer -> id, learning new buffers
        def __missing__(self, b):
            return of_buffer(b)[0]
    ids_of = _Ids()

    def bid(fc: int, chunk: int, heads) -> int:
        if heads is None:
            return fc * P + chunk
        k = (fc, chunk, heads)
        hit = sliced.get(k)
        if hit is None:
            n = heads[1]
            splits.add(n)
            hit = sliced[k] = base + len(sliced_bytes)
            sliced_bytes.append(shape.buffer_bytes(fams[fc].value, L, split=n))
            sliced_chunks.append(chunk)
        return hit

    def of_buffer(b) -> tuple[int, int, int]:
        """(id, bytes, chunk) of a Buffer, cached."""
        hit = cache.get(b)
        if hit is None:
            fc, chunk, heads = code[b.family], b.chunk, b.heads
            if chunk >= P:
                raise ValueError(f"buffer {b} names chunk {chunk}, but the programs are for "
                                 f"P={P} ranks")
            i = bid(fc, chunk, heads)
            hit = cache[b] = (i, int(fam_bytes[fc]) if heads is None else sliced_bytes[i - base],
                              chunk)
            ids_of[b] = i
        return hit

    comp, send, touch, coll = [], [], [], []      # comp: computes of short steps, a row each
    # computes of long steps, a step at a time: (rank, step, count) and the step's q, kv, grad, heads lists
    c_at, c_q, c_kv, c_g, c_h = [], [], [], [], []
    k_touch = []                                       # collective sides: (rank, step, bufs, side)
    groups: dict[tuple, int] = {}
    qget, kvget, hget = (operator.attrgetter(a) for a in ("q", "kv", "heads"))
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            t = step.index
            ops = step.ops
            if len(ops) < _BULK_OPS:                   # a short step: op by op
                rest = []
                for op in ops:
                    tp = type(op)
                    if tp is Compute or tp is GradCompute:
                        h = op.heads
                        comp.append((r, t, tp is GradCompute, op.q, op.kv, *(h or (-1, 1))))
                    else:
                        rest.append((op, tp))
                nc = ng = 0
            else:
                types = list(map(type, ops))
                nc, ng = types.count(Compute), types.count(GradCompute)
                rest = zip(ops, types)
            if nc or ng:                               # computes in bulk (most ops are these)
                comps = ops if nc + ng == len(ops) else [
                    op for op, tp in zip(ops, types) if tp is Compute or tp is GradCompute]
                c_at.append((r, t, len(comps)))
                c_q.append(list(map(qget, comps)))
                c_kv.append(list(map(kvget, comps)))
                c_g.append(ng if not nc or not ng else
                           [tp is GradCompute for tp in types if tp is Compute or tp is GradCompute])
                hs = list(map(hget, comps))
                c_h.append(None if hs.count(None) == len(hs) else hs)
                if nc + ng == len(ops):
                    continue
                rest = [(op, tp) for op, tp in zip(ops, types)
                        if tp is not Compute and tp is not GradCompute]
            seen: dict[int, int] = {}
            for op, tp in rest:
                if tp is Send or tp is Recv:
                    i, nbytes, chunk = of_buffer(op.buf)
                    if tp is Send:
                        send.append((r, t, op.peer, nbytes))
                    if chunk != r:
                        touch.append((r, t, i, tp is Recv))
                elif tp is Collective:
                    gid = groups.setdefault(op.group, len(groups))
                    if r not in op.group:
                        raise ValueError(f"rank {r}, step {t}: {op.ascii()} does not list rank "
                                         f"{r} in its group {list(op.group)}")
                    me = op.group.index(r) if in_place[op.kind] else None
                    refs = [-1, -1]                   # its sides in k_touch (bytes: later)
                    for side, (idx, bufs) in enumerate((op.sparse_sends, op.sparse_recvs)):
                        if not bufs:                  # the occupied slots only
                            continue
                        refs[side] = len(k_touch)     # its own slot stays in place (RULES)
                        k_touch.append((r, t, bufs, side, bufs[idx.index(me)] if me in idx
                                        else None))   # (its touch, if any, is harmless)
                    ordinal = seen.get(gid, 0)
                    seen[gid] = ordinal + 1
                    coll.append((r, t, gid, ordinal, _COLL_KINDS[op.kind], *refs))
                else:
                    raise ValueError(
                        f"the cost model does not model {type(op).__name__} ops (rank {r}, step "
                        f"{t}: {op}); it runs compute, send, receive and collective (AG, RS, A2A) "
                        f"ops")

    def cols(rows, width):
        flat = np.fromiter(itertools.chain.from_iterable(rows), dtype=np.int64,
                           count=len(rows) * width)
        return tuple(flat.reshape(-1, width).T)

    def flat(lists, n):
        return np.fromiter(itertools.chain.from_iterable(lists), dtype=np.int64, count=n)

    tc = cols(touch, 4)
    touch_cols = [(tc[0], tc[1], tc[2], tc[3].astype(bool))]
    coll_cols = cols(coll, 7)
    if k_touch:                                        # collective slots, one id lookup a slot
        counts = _i64([len(x[2]) for x in k_touch])
        n = int(counts.sum())
        ids = np.fromiter(map(ids_of.__getitem__, itertools.chain.from_iterable(
            x[2] for x in k_touch)), dtype=np.int64, count=n)
        by_id = np.concatenate([np.repeat(fam_bytes, P), _i64(sliced_bytes)])
        chunk_by_id = np.concatenate([np.tile(np.arange(P, dtype=np.int64), len(fams)),
                                      _i64(sliced_chunks)])
        moved = np.add.reduceat(by_id[ids], np.cumsum(counts) - counts)
        own = [i for i, x in enumerate(k_touch) if x[4] is not None]
        if own:
            moved[own] -= by_id[_i64([ids_of[k_touch[i][4]] for i in own])]
        moved = np.r_[moved, 0]                        # ref -1: an empty side moves nothing
        coll_cols = (*coll_cols[:5], moved[coll_cols[5]], moved[coll_cols[6]])
        kr = np.repeat(_i64([x[0] for x in k_touch]), counts)
        far = chunk_by_id[ids] != kr
        touch_cols.append((kr[far], np.repeat(_i64([x[1] for x in k_touch]), counts)[far],
                           ids[far], np.repeat(np.array([x[3] for x in k_touch], bool), counts)[far]))
    at = np.array(c_at, dtype=np.int64).reshape(-1, 3)
    n_c = int(at[:, 2].sum())
    cr, ct = np.repeat(at[:, 0], at[:, 2]), np.repeat(at[:, 1], at[:, 2])
    cq, ckv = flat(c_q, n_c), flat(c_kv, n_c)
    off = np.cumsum(at[:, 2]) - at[:, 2]
    cg = np.repeat(_i64([min(g, 1) if isinstance(g, int) else 0 for g in c_g]), at[:, 2])
    for o, g in zip(off.tolist(), c_g):               # steps mixing C and G (none built-in)
        if not isinstance(g, int):
            cg[o:o + len(g)] = g
    chi, chn = np.full(n_c, -1, dtype=np.int64), np.ones(n_c, dtype=np.int64)
    sliced_steps = [(o, hs) for o, hs in zip(off.tolist(), c_h) if hs is not None]
    if sliced_steps:
        where = np.concatenate([np.arange(o, o + len(hs)) for o, hs in sliced_steps])
        hh = np.array([(-1, 1) if h is None else h for h in
                       itertools.chain.from_iterable(hs for _, hs in sliced_steps)],
                      dtype=np.int64).reshape(-1, 2)
        chi[where], chn[where] = hh[:, 0], hh[:, 1]
    if comp:                                           # short steps' rows (a cell's computes
        rows = cols(comp, 7)                           # come from one path, in op order)
        cr, ct, cg, cq, ckv, chi, chn = (np.concatenate([x, y]) for x, y in
                                         zip((cr, ct, cg, cq, ckv, chi, chn), rows))
    whole = chi < 0
    touch_cols += _compute_touches(P, cr[whole], ct[whole], cg[whole], cq[whole], ckv[whole], code)
    if not whole.all():                               # head slices: an id per distinct buffer
        sl = ~whole
        r_, t_, g_, q_, kv_, hi, hn = (x[sl] for x in (cr, ct, cg, cq, ckv, chi, chn))
        for gval, fam_chunks in ir.TILE_TOUCHES.items():      # the rule table's touches
            for fam, which, start in fam_chunks:
                ch = kv_ if which else q_
                m = (g_ == gval) & (ch != r_)
                if not m.any():
                    continue
                combo = np.stack([ch[m], hi[m], hn[m]], axis=1)
                uniq, inv = np.unique(combo, axis=0, return_inverse=True)
                fc = code[fam]
                ids = _i64([bid(fc, int(c), (int(i), int(n))) for c, i, n in uniq.tolist()])
                touch_cols.append((r_[m], t_[m], ids[inv.reshape(-1)], bool(start)))
    buf_bytes = np.concatenate([np.repeat(fam_bytes, P), _i64(sliced_bytes)])
    return _Cols(P, (cr, ct, cg, cq, ckv, chn), cols(send, 4), touch_cols, coll_cols,
                 [g for g, _ in sorted(groups.items(), key=lambda x: x[1])], buf_bytes,
                 tuple(sorted(splits)))


@dataclasses.dataclass
class _Flat:
    """One direction's programs as flat arrays, ready to run."""

    steps: np.ndarray            # sorted distinct global step indices
    active: np.ndarray           # [P, T] bool: rank has a step at that index
    tiles: np.ndarray            # [P, T] tiles computed
    compute: np.ndarray          # [P, T] seconds
    sends: tuple                 # (rank, step position, peer, bytes) arrays
    colls: tuple                 # collective sides: (rank, position, instance) + instances
    live_peak: np.ndarray        # [P] peak bytes of other ranks' buffers alive at once


def _flatten(cols: _Cols, fixed: np.ndarray, per_heads: np.ndarray, hw: Hardware) -> _Flat:
    P = cols.P
    c_rank, c_step, _, c_q, c_kv, c_split = cols.comp
    s_rank, s_step, s_peer, s_bytes = cols.send
    k_rank, k_step, k_gid, k_ord, k_kind, k_sent, k_recv = cols.coll
    every = (c_step, s_step, k_step, *(u[1] for u in cols.touch))
    present = np.zeros(1 + max((int(s.max()) for s in every if len(s)), default=-1), dtype=bool)
    for s in every:
        present[s] = True
    steps = np.flatnonzero(present)
    T = len(steps)
    if T == len(present):                             # steps 0..T-1: positions are steps
        def at(step):
            return step
    else:
        lut = np.zeros(max(len(present), 1), dtype=np.int64)
        lut[steps] = np.arange(T)

        def at(step):
            return lut[step]
    s_pos = at(s_step)
    touch = [(r, at(st), b, start) for r, st, b, start in cols.touch]
    active = np.zeros(P * T, dtype=bool)
    for r, pos in ((c_rank, at(c_step)), (s_rank, s_pos), (k_rank, at(k_step)),
                   *((u[0], u[1]) for u in touch)):
        active[r * T + pos] = True
    active = active.reshape(P, T)
    cell = c_rank * T + at(c_step)
    flat_q = c_q * P + c_kv
    if (c_split == 1).all():
        w = (fixed + per_heads).reshape(-1)[flat_q]
    else:
        w = fixed.reshape(-1)[flat_q] + per_heads.reshape(-1)[flat_q] / c_split
    compute = np.bincount(cell, weights=w, minlength=P * T).reshape(P, T)
    tiles = np.bincount(cell, minlength=P * T).reshape(P, T)
    sends = (s_rank, s_pos, s_peer, s_bytes)
    colls = _instances(cols, at, hw)
    if cols.live_peak is None:
        cols.live_peak = _live_peak(P, T, touch, cols.buf_bytes)
    return _Flat(steps, active, tiles, compute, sends, colls, cols.live_peak)


def _instances(cols: _Cols, at, hw: Hardware) -> tuple:
    """Collective sides grouped into instances (one per step, group and ordinal).

    Returns ``(rank, pos, sent, recv, inst, waves, duration)``: the sides sorted by (step,
    ordinal, instance); ``waves`` maps a step position to its ``(side start, side stop,
    instance starts)`` runs, one per ordinal; ``duration`` per instance (see
    :meth:`Hardware.collective_s`).
    """
    k_rank, k_step, k_gid, k_ord, k_kind, k_sent, k_recv = cols.coll
    if not len(k_rank):
        return None
    pos = at(k_step)
    G = len(cols.groups)
    O = int(k_ord.max()) + 1
    key = (pos * O + k_ord) * G + k_gid
    order = np.argsort(key, kind="stable")
    key, rank, pos, gid = key[order], k_rank[order], pos[order], k_gid[order]
    kind, sent, recv, ordv = k_kind[order], k_sent[order], k_recv[order], k_ord[order]
    head = np.r_[True, key[1:] != key[:-1]]
    starts = np.flatnonzero(head)
    inst = np.cumsum(head) - 1
    sizes = _i64([len(g) for g in cols.groups])
    ns = hw.node_size
    intra = np.array([not ns or len({m // ns for m in g}) == 1 for g in cols.groups])
    ikind, igid = kind[starts], gid[starts]
    load = np.where(ikind == 0, np.maximum.reduceat(recv, starts),
                    np.where(ikind == 1, np.maximum.reduceat(sent, starts),
                             np.maximum(np.maximum.reduceat(recv, starts),
                                        np.maximum.reduceat(sent, starts))))
    dur = hw.collective_s(sizes[igid], load.astype(np.float64), intra[igid])
    waves: dict[int, list] = {}
    wkey = pos * O + ordv
    wstart = np.flatnonzero(np.r_[True, wkey[1:] != wkey[:-1]])
    wstop = np.r_[wstart[1:], len(wkey)]
    for a, b in zip(wstart.tolist(), wstop.tolist()):
        i0, i1 = int(inst[a]), int(inst[b - 1]) + 1
        waves.setdefault(int(pos[a]), []).append((a, b, i0, starts[i0:i1] - a))
    return rank, pos, sent, recv, inst, waves, dur


def _live_peak(P: int, T: int, touch: list, size_of: np.ndarray) -> np.ndarray:
    """Peak bytes of other ranks' buffers alive at once on each rank: a buffer lives from the
    first step it arrives or is written there to the last step an op touches it. ``touch``:
    groups of ``(rank, position, buffer id, start)`` (start: an array, or one bool)."""
    peak = np.zeros(P, dtype=np.int64)
    touch = [t for t in touch if len(t[0])]
    if not touch or not any(bool(np.any(t[3])) for t in touch):
        return peak
    used = np.zeros(len(size_of), dtype=bool)
    for t in touch:
        used[t[2]] = True
    ids = np.flatnonzero(used)                        # the buffers touched anywhere
    NB = len(ids)
    if P * NB > 1 << 26:                              # compact the keys (large sliced plans)
        remap = np.cumsum(used) - 1
        keys = [t[0] * NB + remap[t[2]] for t in touch]
        uniq, inv = np.unique(np.concatenate(keys), return_inverse=True)
        inv = inv.reshape(-1)
        bounds = np.cumsum([0] + [len(k) for k in keys])
        keys = [inv[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        nk, pt = len(uniq), np.int64
    else:                                             # int32 keys, int16 steps where they fit
        uniq, nk = None, P * NB
        kt = np.int32 if nk < 1 << 31 else np.int64
        pt = np.int16 if T < (1 << 15) - 1 else np.int64
        remap = (np.cumsum(used) - 1).astype(kt)
        keys = []
        for t in touch:
            k = t[0].astype(kt)
            k *= kt(NB)
            k += remap[t[2]]
            keys.append(k)
    first = np.full(nk, T, dtype=pt)
    last = np.full(nk, -1, dtype=pt)
    for key, (_, pos, _, start) in zip(keys, touch):
        pos = pos.astype(pt, copy=False)
        if isinstance(start, np.ndarray):
            if start.any():
                np.minimum.at(first, key[start], pos[start])
        elif start:
            np.minimum.at(first, key, pos)
        np.maximum.at(last, key, pos)
    n_bins = P * (T + 1)
    if uniq is None and nk <= 1 << 22:                # dense (rank, buffer): no index arrays
        F = first.reshape(P, NB).astype(np.int64)
        E = np.maximum(last.reshape(P, NB), first.reshape(P, NB)).astype(np.int64)
        row = (np.arange(P, dtype=np.int64) * (T + 1))[:, None]
        F += row
        E += row + 1                                  # not alive: past its row, weight 0
        sz = np.where(first.reshape(P, NB) < T, size_of[ids].astype(np.float64)[None, :], 0.0)
        sz, F, E = sz.reshape(-1), F.reshape(-1), E.reshape(-1)
    else:
        at = np.flatnonzero(first < T)
        full_key = at if uniq is None else uniq[at]
        lr, lb = full_key // NB, ids[full_key % NB]
        F = lr * (T + 1) + first[at].astype(np.int64)
        E = lr * (T + 1) + np.maximum(last[at], first[at]).astype(np.int64) + 1
        sz = size_of[lb].astype(np.float64)
    delta = (np.bincount(F, weights=sz, minlength=n_bins)[:n_bins]
             - np.bincount(E, weights=sz, minlength=n_bins)[:n_bins])
    return np.cumsum(delta.reshape(P, T + 1), axis=1).max(axis=1).round().astype(np.int64)


def _counts(index: np.ndarray, weights: np.ndarray, n: int) -> np.ndarray:
    """``np.bincount`` with float64 weights, float64 even when empty."""
    return np.bincount(index, weights=np.asarray(weights, dtype=np.float64),
                       minlength=n).astype(np.float64, copy=False)


def _run(flat: _Flat, hw: Hardware, P: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Event simulation: ``(issue, wait, sent, recv)``, each ``[P, T]``.

    At each step every active rank issues its transfers and collectives at its clock,
    computes, then waits for all of them (the interpreter's order). A point-to-point
    transfer starts when both ends have issued it and takes latency + bytes / bandwidth of
    the busier end's traffic in that step. A collective starts when every member has issued
    it (and finished its earlier collectives of the step: they run one after the other) and
    takes :meth:`Hardware.collective_s`. A step ends when its compute and all its
    communication are done.
    """
    T = len(flat.steps)
    issue = np.zeros((P, T))
    wait = np.zeros((P, T))
    src, spos, dst, nbytes = flat.sends
    ks, kd = src * T + spos, dst * T + spos
    sent = _counts(ks, nbytes, P * T)
    recv = _counts(kd, nbytes, P * T)
    lat, bw = hw.link(src, dst)
    dur = lat + np.maximum(sent[ks], recv[kd]) / bw                  # the busier end's link
    sent, recv = sent.reshape(P, T), recv.reshape(P, T)
    order = np.argsort(spos.astype(np.int16 if T < 1 << 15 else np.int64), kind="stable")  # radix
    src, dst, dur = src[order], dst[order], dur[order]               # by step
    bounds = np.r_[0, np.cumsum(np.bincount(spos, minlength=T))].tolist()
    waves = {}
    if flat.colls is not None:
        c_rank, c_pos, c_sent, c_recv, _, waves, c_dur = flat.colls
        sent += _counts(c_rank * T + c_pos, c_sent, P * T).reshape(P, T)
        recv += _counts(c_rank * T + c_pos, c_recv, P * T).reshape(P, T)
    compute = np.ascontiguousarray(flat.compute.T)                   # [T, P]
    issue_t, wait_t = np.zeros((T, P)), np.zeros((T, P))
    clock = np.zeros(P)
    for i in range(T):
        issue_t[i] = clock
        done = clock + compute[i]
        a, b = bounds[i], bounds[i + 1]
        if b > a:
            s, d = src[a:b], dst[a:b]
            fin = np.maximum(clock[s], clock[d])
            fin += dur[a:b]
            np.maximum.at(done, s, fin)               # (a rank's several transfers: the last)
            np.maximum.at(done, d, fin)
        if i in waves:
            ready = clock.copy()
            for a, b, i0, rel in waves[i]:
                m = c_rank[a:b]
                fin = np.maximum.reduceat(ready[m], rel) + c_dur[i0:i0 + len(rel)]
                fin_m = np.repeat(fin, np.diff(np.r_[rel, b - a]))
                np.maximum.at(ready, m, fin_m)
                np.maximum.at(done, m, fin_m)
        wait_t[i] = done - clock - compute[i]        # exactly 0 where the rank has no step
        clock = done
    issue, wait = issue_t.T, wait_t.T
    return issue, wait, sent, recv


@dataclasses.dataclass
class Prediction:
    """What the cost model predicts for one plan on one machine.

    Attributes:
        name: a label (the plan's schedule name).
        hardware: the machine model used.
        shape: the tensor shapes assumed.
        steps: ``{"forward": [T], "backward": [T]}`` global step indices.
        compute, wait, sent, recv, tiles: ``{"forward"/"backward": [P, T]}`` arrays
            (seconds, seconds, bytes, bytes, count) per rank and step.
        active: ``{...: [P, T]}`` whether the rank has that step.
        memory: ``[P]`` predicted peak bytes per rank (resident tensors + received buffers
            alive at once, forward or backward, whichever is larger).
    """

    name: str
    hardware: Hardware
    shape: Shape
    world_size: int
    seq_len: int
    steps: dict
    compute: dict
    wait: dict
    sent: dict
    recv: dict
    tiles: dict
    active: dict
    memory: np.ndarray

    def span(self, which: str = "forward") -> float:
        """Seconds from the first issue to the last rank's end (the step's makespan)."""
        return float((self.compute[which] + self.wait[which]).sum(axis=1).max(initial=0.0))

    @property
    def forward_s(self) -> float:
        return self.span("forward")

    @property
    def backward_s(self) -> float:
        return self.span("backward")

    @property
    def step_s(self) -> float:
        """Forward plus backward of one attention layer."""
        return self.forward_s + self.backward_s

    @property
    def balance(self) -> float:
        """max / mean compute seconds per rank (forward + backward)."""
        c = self.compute["forward"].sum(1) + self.compute["backward"].sum(1)
        return float(c.max() / c.mean()) if c.mean() > 0 else 1.0

    def exposed(self, which: str | None = None) -> float:
        """Waiting / (compute + waiting), summed over ranks (as ``RunStats`` reports it)."""
        whichs = (which,) if which else ("forward", "backward")
        w = sum(float(self.wait[x].sum()) for x in whichs)
        c = sum(float(self.compute[x].sum()) for x in whichs)
        return w / (w + c) if w + c else 0.0

    def bytes_per_rank(self) -> float:
        """Largest bytes one rank sends (forward + backward)."""
        return float((self.sent["forward"].sum(1) + self.sent["backward"].sum(1)).max())

    def records(self, which: str = "forward") -> list[StepRecord]:
        """The prediction as the per-step records a measured run leaves (one per rank·step)."""
        act = self.active[which]
        out = []
        for r, i in zip(*np.nonzero(act)):
            out.append(StepRecord(int(r), int(self.steps[which][i]),
                                  float(self.compute[which][r, i]), float(self.wait[which][r, i]),
                                  int(self.tiles[which][r, i]), int(self.sent[which][r, i]),
                                  int(self.recv[which][r, i])))
        return out

    def row(self) -> dict:
        """One summary row (what ``python -m fringe simulate`` prints)."""
        mem = float(self.memory.max())
        return {"schedule": self.name, "step ms": self.step_s * 1e3,
                "fwd ms": self.forward_s * 1e3, "bwd ms": self.backward_s * 1e3,
                "balance": self.balance, "exposed comm": self.exposed(),
                "sent MB/rank": self.bytes_per_rank() / 1e6, "memory MB/rank": mem / 1e6}


def simulate(plan, hardware: str | Hardware = "cpu", shape: Shape = Shape(), *,
             name: str | None = None) -> Prediction:
    """Predict a plan's forward and backward on ``hardware`` for tensors of ``shape``.

    Args:
        plan: from :func:`fringe.plan`.
        hardware: a preset name (see :data:`HARDWARE`; ``"this"`` calibrates now) or a
            :class:`Hardware`.
        shape: batch, heads, kv heads, head dim and dtype of q/k/v.
        name: label for reports (default: the schedule's name).

    Returns:
        A :class:`Prediction`; ``.records("forward")`` are :class:`StepRecord` values.

    Raises:
        ValueError: the plan splits heads in a way ``shape`` does not allow (Ulysses over
            more ranks than heads), saying what would.
    """
    from .interpreter import check_head_split
    hw = get_hardware(hardware)
    P, L = plan.world_size, plan.local_len
    label = name or plan.schedule.name
    # what does not depend on the hardware is kept on the plan (several presets, one plan)
    cache = plan.__dict__.setdefault("_costmodel_cache", {}) if hasattr(plan, "__dict__") else {}
    cols = {}
    for which, progs in (("forward", plan.forward), ("backward", plan.backward)):
        key = (which, L, shape, id(progs))
        if key not in cache:
            cache[key] = _columns(progs, L, shape)
        cols[which] = cache[key]
    for n in sorted({k for c in cols.values() for k in c.splits} | {
            int(k) for c in cols.values() if len(c.comp[5])
            for k in np.flatnonzero(np.bincount(c.comp[5]))}):          # splits: small ints
        if n > 1:
            check_head_split(n, shape.heads, shape.kv_heads,
                             what=f"schedule {label!r} (heads split {n} ways)")
    if ("work", id(plan.tiles)) not in cache:
        cache["work", id(plan.tiles)] = tile_work(plan)
    work = cache["work", id(plan.tiles)]
    out = dict(steps={}, compute={}, wait={}, sent={}, recv={}, tiles={}, active={})
    peak = np.zeros(P, dtype=np.int64)
    for which, c in cols.items():
        fixed, per_heads = _costs(work, L, hw, shape, which == "backward")
        flat = _flatten(c, fixed, per_heads, hw)
        _, wait, sent, recv = _run(flat, hw, P)
        out["steps"][which] = flat.steps
        out["compute"][which] = flat.compute
        out["wait"][which] = wait
        out["sent"][which] = sent
        out["recv"][which] = recv
        out["tiles"][which] = flat.tiles
        out["active"][which] = flat.active
        peak = np.maximum(peak, flat.live_peak)
    # resident per rank: q, k, v, out (+lse), and in the backward dout, dq, dk, dv as well
    resident = (2 * shape.buffer_bytes("q", L) + shape.buffer_bytes("kv", L)
                + shape.buffer_bytes("out", L) + shape.buffer_bytes("dq", L)
                + shape.buffer_bytes("dkv", L))
    return Prediction(label, hw, shape, P, plan.seq_len, memory=peak + resident, **out)


# ---- command line --------------------------------------------------------------------------------

def mask_from_spec(spec: str, seq_len: int):
    """``causal``, ``full``, ``document:N`` (causal within N packed documents, lengths drawn
    with seed 0 as in ``fringe.bench``) or ``window:W`` (causal sliding window of W tokens).

    Raises:
        ValueError: for anything else, saying what is accepted.
    """
    from .. import masks
    from .._data import packed_docs
    kind, _, arg = spec.partition(":")
    if kind in ("causal", "full") and not arg:
        return masks.causal() if kind == "causal" else None
    if kind in ("document", "window") and arg.isdigit() and int(arg) > 0:
        n = int(arg)
        if kind == "document":
            if n > seq_len:
                raise ValueError(f"--mask document:{n}: more documents than tokens (S={seq_len})")
            return masks.causal() & masks.document(packed_docs(seq_len, n, 0))
        return masks.sliding_window(min(n, seq_len))    # wider than S: the same mask as S
    raise ValueError(f"--mask {spec!r} is not understood; use causal, full, document:N "
                     f"(N packed documents, e.g. document:1000) or window:W (e.g. window:4096)")


#: Bytes per block of the distinct PARTIAL tile maps at the peak of :func:`tile_work` (in
#: ``_maps_work``): the maps (1), their stack with an EMPTY row per map (1) and its copy with the
#: causal squares emptied (1), a ``!= FULL`` mask (1), two int64 cumulative sums (8 + 8) and the
#: int64 prefix table they fill (8). Measured peak over the baseline: ``tests/test_cli_memory.py``.
TILE_WORK_BYTES_PER_BLOCK = 28
#: Bytes per rectangle of the block map that the estimate's own pass may hold at once.
_SIG_CHUNK = 1 << 18


def distinct_partial_maps(plan) -> int:
    """How many distinct PARTIAL tile block maps :func:`tile_work` will paint (an estimate).

    Read from the sparse block map's rectangles (a tile's signature: its rectangle count and
    two order-free sums of hashed rectangles, as ``tile_work`` groups them), a chunk of
    rectangles at a time, so it allocates O(P^2 + chunk), never a map. A hash collision can
    only merge two tiles (an estimate one low); without rectangles, or with rectangles across
    tiles, every PARTIAL tile counts (an upper bound).
    """
    P, n = plan.world_size, plan.local_len // plan.block_size
    tiles = torch.as_tensor(plan.tiles).to(torch.int64).numpy().reshape(-1)
    part = np.flatnonzero(tiles == _PARTIAL)
    bm = getattr(plan, "block_map", None)
    if not len(part) or bm is None or not hasattr(bm, "rects") or not len(bm.rects):
        return len(part)
    R = bm.rects.numpy() if isinstance(bm.rects, torch.Tensor) else np.asarray(bm.rects)
    C = bm.codes.numpy() if isinstance(bm.codes, torch.Tensor) else np.asarray(bm.codes)
    lo, hi, cnt = np.zeros(P * P), np.zeros(P * P), np.zeros(P * P)
    for a in range(0, len(R), _SIG_CHUNK):
        Rc = R[a:a + _SIG_CHUNK].astype(np.int64)
        ti, lr = np.divmod(Rc[:, 0], n)
        tj, lc = np.divmod(Rc[:, 2], n)
        if ((Rc[:, 1] - 1) // n != ti).any() or ((Rc[:, 3] - 1) // n != tj).any():
            return len(part)                           # across tiles: tile_work paints densely
        key = ti * P + tj
        h = _mix64(((lr * (n + 1) + Rc[:, 1] - Rc[:, 0]) * (n + 1) + lc) * (n + 1)
                   + Rc[:, 3] - Rc[:, 2])
        h = _mix64(h ^ C[a:a + _SIG_CHUNK].astype(np.uint64))
        lo += np.bincount(key, weights=(h & np.uint64(0xFFFFFF)).astype(np.float64),
                          minlength=P * P)
        hi += np.bincount(key, weights=(h >> np.uint64(40)).astype(np.float64), minlength=P * P)
        cnt += np.bincount(key, minlength=P * P)
    sig = np.stack([lo[part], hi[part], cnt[part]], axis=1)
    return len(np.unique(sig, axis=0))


def tile_work_bytes(plan) -> tuple[int, str]:
    """``(bytes, how)``: the estimated peak allocation of :func:`tile_work` on ``plan`` (the
    dominant allocation of :func:`simulate`, quadratic in S/block), and how it was reckoned."""
    n = plan.local_len // plan.block_size
    u = distinct_partial_maps(plan)
    need = TILE_WORK_BYTES_PER_BLOCK * u * (n + 1) * n
    return need, (f"{TILE_WORK_BYTES_PER_BLOCK} bytes x {u:,} distinct partial tile maps x "
                  f"{n + 1:,} x {n:,} blocks")


def available_memory() -> int | None:
    """Bytes of memory available to this process now: ``MemAvailable`` of /proc/meminfo, else
    free pages from ``os.sysconf`` (None when neither says)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


#: The default memory budget: this fraction of :func:`available_memory`.
MEMORY_FRACTION = 0.8
#: Bytes per token while a plan is made for the CLI: the mask's document ids (8) and the
#: layout's block classification (measured 33-39 B/token at S = 16M, P = 8, block 4096).
PLAN_BYTES_PER_TOKEN = 48
#: Bytes per token a plan keeps after it is made (measured 9-10 B/token, same runs).
KEPT_BYTES_PER_TOKEN = 10
#: Bytes per non-EMPTY tile for the programs and their columns that :func:`simulate` builds
#: (measured 880-960 B/tile: zigzag, causal, P = 1024 and 2048, S = 128 P).
BYTES_PER_TILE = 1024


def memory_budget(max_memory: int | None) -> tuple[int | None, str]:
    """``(bytes, said)``: ``max_memory``, or 80% of :func:`available_memory` (None when that
    cannot be read: no check)."""
    if max_memory is not None:
        return int(max_memory), f"--max-memory {_gib(max_memory)}"
    avail = available_memory()
    if avail is None:
        return None, ""
    return int(MEMORY_FRACTION * avail), f"{MEMORY_FRACTION:.0%} of the {_gib(avail)} available"


def _gib(nbytes: float) -> str:
    for unit, size in (("TiB", 2 ** 40), ("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if nbytes >= size:
            return f"{nbytes / size:.3g} {unit}"
    return f"{int(nbytes)} B"


def _over(need: int, how: str, budget: tuple[int | None, str], what: str, fix: str) -> None:
    limit, said = budget
    if limit is not None and need > limit:
        suggest = -(-need * 5 // 4 // 2 ** 30)        # GiB, rounded up, a quarter to spare
        raise MemoryError(
            f"{what} would need about {_gib(need)} ({how}), over the memory budget of "
            f"{_gib(limit)} ({said}); {fix}, or allow it with --max-memory {suggest}G")


def check_plan_memory(seq_len: int, budget: tuple[int | None, str], *,
                      flag: str = "--seq-len") -> None:
    """Before planning: raise ``MemoryError`` (one line: the estimate and ``--max-memory``)
    when making the mask and plan for ``seq_len`` tokens (given as ``flag``) would pass
    ``budget`` (from :func:`memory_budget`)."""
    _over(PLAN_BYTES_PER_TOKEN * int(seq_len),
          f"{PLAN_BYTES_PER_TOKEN} bytes x {int(seq_len):,} tokens to plan", budget,
          f"{flag} {seq_len}", f"use a smaller {flag}")


def check_memory(plan, budget: tuple[int | None, str], *, what: str) -> None:
    """Before :func:`simulate`: raise ``MemoryError`` (one line: the estimate and
    ``--max-memory``) when the plan kept and the cost model's tile work (:func:`tile_work_bytes`,
    quadratic in S/block) would pass ``budget``. Costs one pass over the block map's
    rectangles and allocates nothing of the estimate's size; skipped when even every PARTIAL
    tile distinct would fit."""
    limit = budget[0]
    if limit is None:
        return
    n = plan.local_len // plan.block_size
    tiles = torch.as_tensor(plan.tiles)
    live = int((tiles != int(BlockKind.EMPTY)).sum())
    base = KEPT_BYTES_PER_TOKEN * plan.seq_len + BYTES_PER_TILE * live
    bound = TILE_WORK_BYTES_PER_BLOCK * int((tiles == _PARTIAL).sum()) * (n + 1) * n
    if base + bound <= limit:
        return
    work, how = tile_work_bytes(plan)
    _over(base + work, f"the cost model's tile work, {how}; {KEPT_BYTES_PER_TOKEN} bytes x "
          f"{plan.seq_len:,} tokens of plan; {BYTES_PER_TILE} bytes x {live:,} tiles of programs",
          budget, what, "use a smaller --seq-len or a larger --block-size or --world-size")


def cli(args) -> int:
    """``python -m fringe simulate``: one row per schedule, optionally the timeline as PNG."""
    from tabulate import tabulate

    from ..plan import plan as make_plan
    from ..schedules import registry
    for name, value in (("--world-size", args.world_size), ("--seq-len", args.seq_len),
                        ("--block-size", args.block_size), ("--heads", args.heads),
                        ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim)):
        if value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value}")
    made = {}
    for name in args.schedules:               # unknown names raise, listing the valid ones
        made[name] = registry.get(name)
        why = registry.why_not(name, world_size=args.world_size, heads=args.heads,
                               kv_heads=args.kv_heads)
        if why:
            ok = registry.names(world_size=args.world_size, heads=args.heads,
                                kv_heads=args.kv_heads)
            raise ValueError(f"--schedules {name}: {why}; choose from {ok} or "
                             f"compose:OUTER+ulysses:K with K dividing H={args.heads}")
    if args.png and not args.png.lower().endswith(".png"):
        raise ValueError(f"--png {args.png!r}: give a file name ending in .png")
    shape = Shape(heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                  dtype=args.dtype)
    hw = get_hardware(args.hardware)
    budget = memory_budget(getattr(args, "max_memory", None))
    check_plan_memory(args.seq_len, budget)
    mask = mask_from_spec(args.mask, args.seq_len)
    rows, preds = [], []
    for name in args.schedules:
        t0 = time.process_time()
        p = make_plan(made[name], mask, seq_len=args.seq_len,
                      world_size=args.world_size, block_size=args.block_size)
        check_memory(p, budget, what=f"predicting {name} at S={args.seq_len:,}")
        t1 = time.process_time()
        pred = simulate(p, hw, shape, name=name)
        t2 = time.process_time()
        preds.append(pred)
        row = pred.row()
        row.update({"plan s": t1 - t0, "simulate s": t2 - t1})
        rows.append(row)
    print(f"cost model · {hw.name} ({hw.source}) · P={args.world_size:,} S={args.seq_len:,} "
          f"mask={args.mask} · B={shape.batch} H={shape.heads} G={shape.kv_heads} "
          f"D={shape.head_dim} {shape.dtype} · one attention layer, forward + backward")
    print(tabulate([list(r.values()) for r in rows], headers=list(rows[0]), floatfmt=".3g"))
    print("balance: max/mean compute per rank; exposed comm: waiting / (compute + waiting); "
          "memory: resident q, k, v, out, grads + received buffers alive at once; "
          "plan s / simulate s: CPU seconds of this process")
    if args.png:
        from .. import render
        stem = args.png[:-4]
        for pred in preds:
            path = args.png if len(preds) == 1 else f"{stem}.{pred.name}.png"
            render.save_png(render.timeline_figure(pred), path)
            print(f"wrote {path}")
    return 0


# ---- calibration ---------------------------------------------------------------------------------

def _best(fn, repeats: int, clock=time.perf_counter) -> float:
    """Fastest of ``repeats`` calls after a warm-up, on ``clock``."""
    fn()
    best = math.inf
    for _ in range(repeats):
        t0 = clock()
        fn()
        best = min(best, clock() - t0)
    return best


def calibrate(*, heads: int = 8, head_dim: int = 64, dtype: torch.dtype = torch.float32,
              threads: int = 1, comm: bool = True, repeats: int = 2) -> Hardware:
    """Measure this machine: the fused CPU attention kernel (via fringe's tile ops) and gloo.

    Times FULL and masked sub-problems of two sizes, forward and backward, with ``threads``
    torch threads (ranks on a CPU run with one each; with one thread the CPU time of this
    thread is used, so that other processes on a shared machine do not inflate it), and,
    with ``comm``, round trips of a tiny and a 4 MB tensor between two spawned gloo ranks
    (a few seconds: process start-up).

    Returns:
        A :class:`Hardware` named ``"this"`` whose source says what was measured.
    """
    from ..ops import merge, tile_backward, tile_forward
    # one thread: this thread's CPU time is the kernel's time even on a machine other
    # processes share (wall-clock would count their time slices too)
    cpu = time.thread_time if threads == 1 else time.perf_counter
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        H, D = heads, head_dim

        def timed(L: int, kw: dict):
            q, k, v, do = (torch.randn(1, H, L, D, generator=g, dtype=dtype) for _ in range(4))
            pos = torch.arange(L)
            kw = dict(q_pos=pos, kv_pos=pos, **kw)
            out, lse = tile_forward(q, k, v, **kw)
            fwd = _best(lambda: tile_forward(q, k, v, **kw), repeats, cpu)
            bwd = _best(lambda: tile_backward(q, k, v, out, lse, do, **kw), repeats, cpu)
            return fwd, bwd

        small, big, bs = 64, 2048, 128   # a call's fixed cost from a tiny tile, pairs from a big one
        (f0, b0) = timed(small, dict(kind=BlockKind.FULL))
        (f1, b1) = timed(big, dict(kind=BlockKind.FULL))
        pairs0, pairs1 = small * small, big * big
        f_unit = max((f1 - f0) / (pairs1 - pairs0), 1e-15)
        b_unit = max((b1 - b0) / (pairs1 - pairs0), 1e-15)
        f_call = max(f0 - f_unit * pairs0, 0.0)
        b_call = max(b0 - b_unit * pairs0, 0.0)
        # a causal diagonal tile run the way plans run it (block map, the sdpa grouping: one
        # is_causal call) gives the causal factor; a tile of PARTIAL blocks that are not
        # lower-triangular (one call with a float mask over all of it) the masked factor
        nb = big // bs
        codes = torch.full((nb, nb), _EMPTY, dtype=torch.int8)
        codes[torch.tril(torch.ones(nb, nb, dtype=torch.bool), -1)] = _FULL
        codes[torch.arange(nb), torch.arange(nb)] = _PARTIAL
        from ..masks import causal as _causal

        def checker(b, h, q_idx, kv_idx):
            return (q_idx + kv_idx) % 2 == 0
        factors = []
        for kw in (dict(blocks=codes, mask_mod=_causal()),
                   dict(blocks=torch.full((nb, nb), _PARTIAL, dtype=torch.int8),
                        mask_mod=checker)):
            fm, bm = timed(big, dict(kind=BlockKind.PARTIAL, block_size=bs, **kw))
            calls, full, mpairs, cpairs = _maps_work(kw["blocks"][None], L=big, block_size=bs,
                                                     masked_ok=True)[0]
            pairs = max(mpairs + cpairs, 1.0)
            factors.append((max((fm - calls * f_call - full * f_unit) / (pairs * f_unit), 0.05),
                            max((bm - calls * b_call - full * b_unit) / (pairs * b_unit), 0.05)))
        (causal, bwd_causal), (masked, bwd_masked) = factors
        o = torch.randn(1, H, big, D, generator=g)
        lse_ = torch.randn(1, H, big, generator=g)
        row = _best(lambda: merge(o, lse_, o, lse_), repeats, cpu) / (H * big * D)
        per = H * D
        fields = dict(fwd_flops=FWD_FLOPS_PER_PAIR * per / f_unit,
                      bwd_flops=BWD_FLOPS_PER_PAIR * per / b_unit, call_s=f_call,
                      bwd_call_s=b_call, masked=float(masked), bwd_masked=float(bwd_masked),
                      causal=float(causal), bwd_causal=float(bwd_causal), row_s=row)
    finally:
        torch.set_num_threads(old)
    lat, bw = _CPU["latency_s"], _CPU["bandwidth"]
    if comm:
        from ..launch import run
        res = run(_gloo_probe, world_size=2, timeout_s=60)
        lat, bw = max(r[0] for r in res), min(r[1] for r in res)
    src = (f"calibrated here: fused CPU SDPA through fringe.ops, {threads} thread(s), "
           f"{str(dtype).replace('torch.', '')}, H={H} D={D}; "
           f"{'gloo round trips between 2 spawned ranks' if comm else 'gloo from the cpu preset'}")
    return Hardware("this", src, latency_s=lat, bandwidth=bw, memory_bytes=None, **fields)


def _gloo_probe(rank: int, world_size: int, size: int = 1 << 20, reps: int = 5):
    """(latency s, bandwidth B/s) of gloo between ranks 0 and 1 (halved round trips)."""
    import torch.distributed as dist
    torch.set_num_threads(1)
    peer = 1 - rank

    def round_trip(x):
        if rank == 0:
            dist.send(x, peer)
            dist.recv(x, peer)
        else:
            dist.recv(x, peer)
            dist.send(x, peer)
    tiny, big = torch.zeros(1), torch.zeros(size)
    lat = _best(lambda: round_trip(tiny), reps) / 2
    t = _best(lambda: round_trip(big), reps) / 2
    return lat, big.numel() * 4 / max(t - lat, 1e-9)


# ---- validation against measured runs ----------------------------------------------------------

def _validation_plan(schedule: str, mask: str, seq_len: int, world_size: int, block_size: int,
                     n_docs: int):
    from .. import masks, schedules
    from .._data import packed_docs
    from ..plan import plan as make_plan
    m = masks.causal()
    if mask == "document":
        m = m & masks.document(packed_docs(seq_len, n_docs, 1))
    elif mask != "causal":
        raise ValueError(f"validation mask must be 'causal' or 'document', got {mask!r}")
    return make_plan(schedules.get(schedule), m, seq_len=seq_len, world_size=world_size,
                     block_size=block_size)


def _measure_worker(rank: int, world_size: int, cases: list, shape: Shape, iters: int):
    """Per case: the median over ``iters`` of this rank's (fwd, bwd) interpreter seconds."""
    import statistics

    import fringe
    torch.set_num_threads(1)
    out = []
    dt = getattr(torch, shape.dtype)
    for schedule, mask, S, block_size, n_docs in cases:
        p = _validation_plan(schedule, mask, S, world_size, block_size, n_docs)
        g = torch.Generator().manual_seed(0)
        q = torch.randn(shape.batch, shape.heads, S, shape.head_dim, generator=g, dtype=dt)
        k, v = (torch.randn(shape.batch, shape.kv_heads, S, d, generator=g, dtype=dt)
                for d in (shape.head_dim, shape.v_head_dim or shape.head_dim))
        q, k, v = (p.layout.shard(t, rank).requires_grad_() for t in (q, k, v))
        fwd, bwd, cpu = [], [], []
        for it in range(iters + 1):
            c0 = time.thread_time()                 # this rank's compute (gloo runs elsewhere)
            fringe.attention(q, k, v, plan=p).sum().backward()
            c1 = time.thread_time()
            s = fringe.last_run().summary()
            if it:                                              # the first call warms up
                fwd.append(s["forward"]["compute_s"] + s["forward"]["wait_s"])
                bwd.append(s["backward"]["compute_s"] + s["backward"]["wait_s"])
                cpu.append(c1 - c0)
        out.append((statistics.median(fwd), statistics.median(bwd), statistics.median(cpu)))
    return out


def validate(*, world_size: int = 2, seq_len: int = 8192, block_size: int = 128,
             schedules: Sequence[str] = ("ring", "zigzag", "striped", "balanced"),
             masks: Sequence[str] = ("causal", "document"), n_docs: int = 16,
             shape: Shape = Shape(heads=8, kv_heads=8, head_dim=64, dtype="float32"),
             hardware: str | Hardware = "cpu", iters: int = 3) -> list[dict]:
    """Predicted vs measured forward + backward on spawned gloo ranks (one thread each).

    Measured: each rank's interpreter time (compute + waits, from ``fringe.last_run()``),
    median over ``iters`` calls after a warm-up, slowest rank; and the CPU time of each rank's
    main thread over the call (its compute, which other processes on a shared machine do not
    inflate the way they inflate wall-clock). Predicted: the same spans, and the busiest
    rank's compute, from :func:`simulate`. Use ``world_size`` at most the number of free cores.

    Returns:
        One dict per (schedule, mask): predicted and measured seconds and the relative error.
    """
    from ..launch import Workers
    hw = get_hardware(hardware)
    cases = [(s, m, seq_len, block_size, n_docs) for s in schedules for m in masks]
    with Workers(world_size, timeout_s=600, threads=1) as w:
        res = [w.run(_measure_worker, [case], shape, iters) for case in cases]  # a call a case
    rows = []
    for c, case in enumerate(cases):
        pred = simulate(_validation_plan(*case[:2], seq_len, world_size, block_size, n_docs), hw,
                        shape)
        mf = max(r[0][0] for r in res[c])
        mb = max(r[0][1] for r in res[c])
        mc = max(r[0][2] for r in res[c])
        pc = float((pred.compute["forward"].sum(1) + pred.compute["backward"].sum(1)).max())
        rows.append(dict(schedule=case[0], mask=case[1], predicted_s=pred.step_s,
                         measured_s=mf + mb, error=pred.step_s / (mf + mb) - 1,
                         predicted_fwd_s=pred.forward_s, measured_fwd_s=mf,
                         predicted_bwd_s=pred.backward_s, measured_bwd_s=mb,
                         predicted_compute_s=pc, measured_cpu_s=mc, compute_error=pc / mc - 1))
    return rows
