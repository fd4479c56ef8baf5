"""Plan stats: per-rank work and communication of a plan's programs, read from their
table columns (:class:`PlanStats`, what :meth:`fringe.plan.Plan.stats` returns).

The op-by-op walk (:func:`fringe.testing.oracle.op_counts`) is the oracle the column counts
are tested against."""
from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np
import torch

from .masks import BlockKind
from .cost.hardware import check_head_split
from .schedules.ir import C_, OWN_SLOT_IN_PLACE, Family, ProgramTable
from .runtime.contract import PlanLike
from .schedules.passes import _table


@dataclasses.dataclass(frozen=True)
class PlanStats:
    """Per-rank counts from a plan (no tensors are run).

    ``blocks`` counts non-empty (q-block, kv-block) pairs a rank computes (FULL and PARTIAL
    blocks alike; a head slice's compute counts its tile's pairs); FLOPs are 2·block²·(D+Dv)·B
    per block and head computed (H, or H/n for a compute on head slice i/n) for the forward
    and 2.5x that for the backward (Dv = D unless ``v_head_dim`` is given: MLA).

    Bytes are what each rank sends (``*_sent``) and receives (``*_recv``) over the forward
    and the backward programs, as a run on the virtual mesh records them
    (``StepRecord.sent_bytes`` / ``recv_bytes``): point-to-point ``Send`` / ``Recv``, and
    every collective's non-empty slots to and from the other members (all-gather: each
    member receives every other member's non-empty contribution; reduce-scatter, its
    adjoint in the backward: each member sends its gradient of every chunk it gathered;
    all-to-all: the head slices sent and received). A member's own slot stays in place and
    an empty slot moves nothing. A buffer is priced as the interpreter holds it (kv: k and v,
    G·(D + Dv) a token; out/lse and dout/dlse at Dv + 1): q and kv at
    ``dtype``; out/lse, dout/dlse, dq and dkv in the accumulation dtype (float32; float64
    for float64); a head slice ``h<i>/<n>`` holds H/n query heads (kv: G/n kv heads, or the
    one it shares when n % G == 0).

    Read from the programs' table columns without building an op (a P=1024 plan has
    millions), collectives and head slices too; only programs not cut from one table are
    walked, a step at a time.
    """

    rows: tuple[dict, ...]
    balance: float

    @classmethod
    def of(cls, plan: PlanLike, *, batch, heads=None, kv_heads=None, head_dim, dtype,
           v_head_dim=None) -> PlanStats:
        """The stats of ``plan`` for these shapes (``heads``, ``kv_heads``: as :meth:`Plan.stats`).

        Raises:
            ValueError: the plan splits heads n ways and H, G cannot be split so.
        """
        P = plan.world_size
        n = plan.local_len // plan.block_size        # counts in blocks: ranged hops move some
        fwd = _op_counts(plan.forward, P, n=n)
        bwd = _op_counts(plan.backward, P, steps=False, computes=False, n=n)
        splits = {n for _, n in fwd.keys + bwd.keys}
        if fwd.splits is not None:
            splits.update(np.unique(fwd.splits).tolist())
        splits.discard(1)
        heads = heads or math.lcm(*splits)           # lcm() of nothing is 1
        kv_heads = kv_heads or heads
        for n in sorted(splits):
            check_head_split(n, heads, kv_heads, what=f"stats of schedule {plan.schedule.name!r} "
                                                     f"(heads split {n} ways)")
        v_head_dim = head_dim if v_head_dim is None else v_head_dim
        shape = dict(B=batch, H=heads, G=kv_heads, D=head_dim, Dv=v_head_dim, L=plan.block_size,
                     item=torch.empty((), dtype=dtype).element_size(),
                     acc=8 if dtype == torch.float64 else 4)
        bs2 = plan.block_size ** 2
        rank, q, kv = (torch.from_numpy(x) for x in fwd.computes)
        kind = plan.tiles[q, kv].long()
        full = torch.bincount(rank[kind == BlockKind.FULL], minlength=P).tolist()
        partial = torch.bincount(rank[kind == BlockKind.PARTIAL], minlength=P).tolist()
        work = plan.tile_block_counts()[q, kv]
        blocks = torch.zeros(P, dtype=torch.int64).index_add_(0, rank, work).tolist()
        if fwd.splits is None:
            head_blocks = [b * heads for b in blocks]
        else:                                        # blocks x heads each compute covers
            per = work * torch.div(heads, torch.from_numpy(fwd.splits), rounding_mode="floor")
            head_blocks = torch.zeros(P, dtype=torch.int64).index_add_(0, rank, per).tolist()
        fwd_sent, fwd_recv, bwd_sent, bwd_recv = (
            (x @ _prices(c.keys, x, **shape)).tolist()
            for c in (fwd, bwd) for x in (c.sent, c.recv))
        steps = fwd.steps.tolist()
        rows = []
        for r in range(P):
            fwd_flops = 2 * head_blocks[r] * bs2 * (head_dim + v_head_dim) * batch
            rows.append(dict(rank=r, full_tiles=full[r], partial_tiles=partial[r],
                             blocks=blocks[r], fwd_flops=fwd_flops,
                             bwd_flops=int(2.5 * fwd_flops), fwd_sent=fwd_sent[r],
                             fwd_recv=fwd_recv[r], bwd_sent=bwd_sent[r], bwd_recv=bwd_recv[r],
                             steps=steps[r]))
        mean = sum(blocks) / len(blocks)
        balance = max(blocks) / mean if mean else 1.0
        return cls(tuple(rows), balance)

    def table(self) -> str:
        """The rows as a text table (tabulate), with the balance max/mean underneath."""
        from tabulate import tabulate
        text = tabulate([list(r.values()) for r in self.rows], headers=list(self.rows[0]),
                        intfmt=",")
        return f"{text}\nwork balance (max/mean blocks): {self.balance:.3f}"

    def __str__(self) -> str:
        return self.table()


def _buffer_bytes(family: Family, split: int = 1, *, B: int, H: int, G: int, D: int, L: int,
                 item: int, acc: int, Dv: int | None = None) -> int | None:
    """Bytes of one buffer of ``family`` holding L tokens, head slice of ``split`` (1: all
    heads), as the interpreter holds it: q ``[B, H, L, D]`` and kv ``B·G·L·(D + Dv)`` (k and
    v; Dv = D unless given) at ``item`` bytes an element, (out, lse) and (dout, dlse)
    ``[B, H, L, Dv+1]``, dq and dkv in the accumulation dtype (``acc`` bytes). None for
    ``acc`` buffers (no fixed size). H and G must split
    (:func:`fringe.runtime.interpreter.check_head_split`)."""
    Dv = D if Dv is None else Dv
    if split != 1:
        H, G = H // split, (G // split if G % split == 0 else 1)
    kv = B * G * L * (D + Dv)
    q = B * H * L * D
    return {Family.KV: kv * item, Family.DKV: kv * acc, Family.Q: q * item, Family.DQ: q * acc,
            Family.OUT: B * H * L * (Dv + 1) * acc, Family.DOUT: B * H * L * (Dv + 1) * acc,
            }.get(family)


def _prices(keys, counts: np.ndarray, **shape) -> np.ndarray:
    """int64 ``[K]``: bytes of one transfer of each ``(family, split)`` key (of ``L`` tokens:
    one block, where the counts are blocks)."""
    out = np.zeros(len(keys), dtype=np.int64)
    for k, (fam, n) in enumerate(keys):
        b = _buffer_bytes(fam, n, **shape)
        if b is None:
            if counts[:, k].any():
                raise ValueError(f"PlanStats: the programs move {fam.value} buffers, which have "
                                 f"no size here; only q, kv, out and their gradients are priced")
            b = 0
        out[k] = b
    return out


@dataclasses.dataclass(frozen=True)
class _OpCounts:
    """What :class:`PlanStats` reads from one direction's programs, per rank.

    ``computes``: ``(rank, q, kv)`` int64 arrays, one entry per ``Compute`` op (forward tile;
    ``GradCompute`` ops are not listed); ``splits``: int64, n of each one's head slice
    ``h<i>/<n>`` (1: all heads), or None when none is sliced. ``keys``: the ``(Family,
    split)`` of each column of ``sent`` / ``recv``, int64 ``[P, len(keys)]``: buffers each
    rank sends / receives, by ``Send`` / ``Recv`` or in a collective's slots (its own slot
    excluded), counted in blocks when the counts were taken with ``n`` (blocks per chunk: a
    whole buffer counts n, a ranged transfer its blocks). ``steps``: int64 ``[P]``, steps in
    each rank's program.
    """

    computes: tuple
    splits: np.ndarray | None
    keys: tuple
    sent: np.ndarray
    recv: np.ndarray
    steps: np.ndarray


#: The columns of a table's transfers: each family (``tuple(Family)`` order, the family codes
#: of :class:`ProgramTable`), all heads (a table holds no head slice).
_WHOLE = tuple((f, 1) for f in Family)


def _op_counts(programs, P: int, *, steps: bool = True, computes: bool = True,
               n: int | None = None) -> _OpCounts:
    """:class:`_OpCounts` of ``programs`` from their :class:`ProgramTable` columns (no op
    is built: millions at P=1024), whatever form they are in (:func:`_general_counts`; op
    programs become their table first). :func:`fringe.testing.oracle.op_counts` walks the
    ops instead: the oracle of the tests.
    ``steps=False``: leave ``steps`` zero (the backward's are not reported);
    ``computes=False``: list no compute; ``n``: count transfers in blocks, ``n`` to a chunk
    (needed where transfers move block ranges).

    Raises:
        ValueError: the programs move block ranges and ``n`` is not given.
    """
    return _general_counts(_table(programs), P, steps=steps, computes=computes, n=n)


def _general_counts(table: ProgramTable, P: int, *, steps: bool = True, n: int | None = None,
                    computes: bool = True) -> _OpCounts:
    """:class:`_OpCounts` of a general table (head slices, collectives) from its parts, what
    :func:`fringe.testing.oracle.op_counts` gives for its programs: computes (kind ``C_``) with their head
    slices ``hi/hn``; a transfer counts on its ``src`` (sent) and ``dst`` (received); a
    collective side's occupied slots count on its rank by direction, but for a kind whose
    rule keeps the own slot in place (``OWN_SLOT_IN_PLACE``) the slot at the side's own
    member index. Keys are ``(family, hn or 1)`` of every transfer and slot (an own slot's
    too, as the walk lists it at count zero)."""
    comp, xfer, coll = table._parts
    i64 = functools.partial(np.asarray, dtype=np.int64)
    F = len(_WHOLE)
    if computes:
        is_c = i64(comp["kind"]) == C_
        found = tuple(i64(comp[k])[is_c] for k in ("rank", "q", "kv"))
        hn = i64(comp["hn"])[is_c]
        splits = np.where(hn == 0, 1, hn) if (hn > 0).any() else None
    else:
        found = tuple(np.zeros(0, dtype=np.int64) for _ in range(3))
        splits = None
    # slots: the side's rank, direction, and whether it is the side's own slot kept in place
    side = i64(coll["slot_side"])
    s_rank = i64(coll["rank"])[side]
    s_dir = i64(coll["slot_dir"])
    own = np.zeros(len(side), dtype=bool)
    kind, group = i64(coll["kind"]), i64(coll["group"])
    in_place = np.asarray(OWN_SLOT_IN_PLACE, dtype=bool)
    if len(side) and in_place[kind].any():
        groups = coll["groups"]
        pair = group * np.int64(P) + i64(coll["rank"])        # (group, rank) of each side
        uniq, inv = np.unique(pair, return_inverse=True)
        index = [{m: i for i, m in enumerate(g)} for g in groups]
        me = np.array([index[int(u) // P].get(int(u) % P, -1) for u in uniq],
                      dtype=np.int64)[inv.reshape(-1)]
        own = in_place[kind[side]] & (i64(coll["slot_idx"]) == me[side])
    fams = (i64(xfer["fam"]), i64(coll["slot_fam"]))
    ns = tuple(np.where(n == 0, 1, n) for n in (i64(xfer["hn"]), i64(coll["slot_hn"])))
    NH = 1 + max((int(n.max()) for n in ns if len(n)), default=1)
    x_key, k_key = (f * NH + n for f, n in zip(fams, ns))
    present = np.zeros(F * NH, dtype=bool)
    present[x_key] = True
    present[k_key] = True
    codes = np.flatnonzero(present)                  # (family order, n) order, as the walk
    keys = tuple((_FAMILIES[int(c) // NH], int(c) % NH) for c in codes)
    col = np.cumsum(present) - 1
    K = len(keys)
    src, dst = i64(xfer["src"]), i64(xfer["dst"])
    keep = ~own
    if table.ranged and n is None:
        raise ValueError("the programs move block ranges: count them in blocks (n=blocks per "
                         "chunk, plan.local_len // plan.block_size)")
    w = None
    if n is not None:                               # blocks each transfer (slot) moves
        w, sw = (np.array([sum(hi - lo for lo, hi in rs) for rs in ranges] + [n],
                          dtype=np.int64)[i64(rng)]      # -1: the whole chunk, n blocks
                 for ranges, rng in ((xfer["ranges"], xfer["rng"]),
                                     (coll["ranges"], coll["slot_rng"])))
    out = []
    for x_rank, d in ((src, 0), (dst, 1)):
        sel = keep & (s_dir == d)
        r = np.concatenate([x_rank, s_rank[sel]])
        k = np.concatenate([col[x_key], col[k_key[sel]]])
        if w is None:
            c = np.bincount(r * K + k, minlength=P * K)
        else:
            ws = np.concatenate([w, sw[sel]])
            c = np.rint(np.bincount(r * K + k, weights=ws, minlength=P * K))
        out.append(c.reshape(P, K).astype(np.int64))
    pairs = ((i64(comp["rank"]), i64(comp["step"])), (src, i64(xfer["step"])),
             (dst, i64(xfer["step"])), (i64(coll["rank"]), i64(coll["step"])))
    return _OpCounts(found, splits, keys, *out,
                     _distinct_steps(pairs, P) if steps else np.zeros(P, dtype=np.int64))


_FAMILIES = tuple(Family)


def _distinct_steps(pairs, P: int) -> np.ndarray:
    """int64 ``[P]``: distinct step indices per rank among rows given as ``(rank, step)``
    column pairs (a table program's steps are the distinct steps of its rows)."""
    pairs = [(r, t) for r, t in pairs if len(r)]
    if not pairs:
        return np.zeros(P, dtype=np.int64)
    lo = min(int(t.min()) for _, t in pairs)
    span = max(int(t.max()) for _, t in pairs) - lo + 1
    if P * span <= 1 << 26:                           # a presence plane: no sort
        seen = np.zeros(P * span, dtype=bool)
        for r, t in pairs:
            key = r * np.int64(span)
            key += t
            key -= lo
            seen[key] = True
        return seen.reshape(P, span).sum(1, dtype=np.int64)
    key = np.sort(np.concatenate([r * np.int64(span) + (t - lo) for r, t in pairs]))
    first = np.ones(len(key), dtype=bool)
    first[1:] = key[1:] != key[:-1]
    return np.bincount(key[first] // span, minlength=P).astype(np.int64)


