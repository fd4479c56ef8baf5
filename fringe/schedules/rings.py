"""Ring, zigzag and striped: one ring pattern over three layouts.

Each rank keeps its queries; kv chunks travel around the ring one hop per step, and each
rank computes a tile the step a chunk arrives. Zigzag and striped only change which tokens
a rank holds, which balances causal work; pruning then drops empty tiles and stops a chunk
after the last rank that needs it.

The grids in the docstrings below are printed by the code and checked by the test suite
(``tests/test_schedules.py``), so they cannot drift.
"""
from __future__ import annotations

from .. import layout as _layout
from .base import Schedule, Spec, ring_hops


def ring() -> Schedule:
    """Ring attention on the contiguous layout (rank r holds ``[rL, (r+1)L)``).

    Causal pruning leaves rank 0 idle after step 0 and the last rank with P tiles:

    >>> p = fringe.plan(schedules.ring(), masks.causal(), seq_len=32, world_size=4, block_size=2)
    >>> print(render.table(p)); print(render.tile_map(p))
    ring · causal · S=32 P=4 block=2 · forward
    ┌────────┬──────────┬──────────┬──────────┬──────────┐
    │ step   │ rank 0   │ rank 1   │ rank 2   │ rank 3   │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t0     │ C q0·kv0 │ R kv0←r0 │ R kv1←r1 │ R kv2←r2 │
    │        │ S kv0→r1 │ C q1·kv1 │ C q2·kv2 │ C q3·kv3 │
    │        │          │ S kv1→r2 │ S kv2→r3 │          │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t1     │          │ C q1·kv0 │ R kv0←r1 │ R kv1←r2 │
    │        │          │ S kv0→r2 │ C q2·kv1 │ C q3·kv2 │
    │        │          │          │ S kv1→r3 │          │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t2     │          │          │ C q2·kv0 │ R kv0←r2 │
    │        │          │          │ S kv0→r3 │ C q3·kv1 │
    ├────────┼──────────┼──────────┼──────────┼──────────┤
    │ t3     │          │          │          │ C q3·kv0 │
    └────────┴──────────┴──────────┴──────────┴──────────┘
    q\\kv    0    1    2    3
       0 p  0    .    .    .
       1 F  1 p  0    .    .
       2 F  2 F  1 p  0    .
       3 F  3 F  2 F  1 p  0
    """
    return Schedule("ring", layout=_layout.contiguous, hops=ring_hops, kind="ring",
                    spec=Spec("ring"))


def zigzag() -> Schedule:
    """Ring over the zigzag layout: 2P chunks, rank r holds chunks r and 2P-1-r.

    Every rank computes one tile per step; causal work is balanced:

    >>> p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=32, world_size=4, block_size=2)
    >>> print(render.table(p)); print(render.tile_map(p))
    zigzag · causal · S=32 P=4 block=2 · forward
    ┌────────┬───────────────┬───────────────┬───────────────┬───────────────┐
    │ step   │ rank 0        │ rank 1        │ rank 2        │ rank 3        │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t0     │ R kv3←r3      │ R kv0[0:2]←r0 │ R kv1←r1      │ R kv2←r2      │
    │        │ C q0·kv0      │ C q1·kv1      │ C q2·kv2      │ C q3·kv3      │
    │        │ S kv0[0:2]→r1 │ S kv1→r2      │ S kv2→r3      │ S kv3→r0      │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t1     │ R kv2←r3      │ R kv3←r0      │ R kv0[0:2]←r1 │ R kv1←r2      │
    │        │ C q0·kv3      │ C q1·kv0      │ C q2·kv1      │ C q3·kv2      │
    │        │ S kv3→r1      │ S kv0[0:2]→r2 │ S kv1→r3      │ S kv2→r0      │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t2     │ R kv1←r3      │ R kv2←r0      │ R kv3←r1      │ R kv0[0:2]←r2 │
    │        │ C q0·kv2      │ C q1·kv3      │ C q2·kv0      │ C q3·kv1      │
    │        │ S kv2→r1      │ S kv3→r2      │ S kv0[0:2]→r3 │ S kv1→r0      │
    ├────────┼───────────────┼───────────────┼───────────────┼───────────────┤
    │ t3     │ C q0·kv1      │ C q1·kv2      │ C q2·kv3      │ C q3·kv0      │
    └────────┴───────────────┴───────────────┴───────────────┴───────────────┘
    q\\kv    0    1    2    3
       0 p  0 p  3 p  2 p  1
       1 p  1 p  0 p  3 p  2
       2 p  2 p  1 p  0 p  3
       3 p  3 p  2 p  1 p  0
    """
    return Schedule("zigzag", layout=_layout.zigzag, hops=ring_hops, kind="zigzag",
                    spec=Spec("zigzag"))


def striped(stripe: int | None = None) -> Schedule:
    """Ring over the striped layout; ``stripe`` tokens per stripe (default: the block size).

    Stripe i goes to rank i % P. The steps are those of :func:`zigzag`; what changes is
    which tokens each tile holds, and causal work is balanced at block granularity:

    >>> p = fringe.plan(schedules.striped(), masks.causal(), seq_len=256, world_size=4, block_size=2)
    >>> print(render.tile_map(p)); print(round(p.stats().balance, 3))
    q\\kv    0    1    2    3
       0 p  0 p  3 p  2 p  1
       1 p  1 p  0 p  3 p  2
       2 p  2 p  1 p  0 p  3
       3 p  3 p  2 p  1 p  0
    1.023
    """
    if stripe is not None and (isinstance(stripe, bool) or not isinstance(stripe, int)
                               or stripe < 1):
        raise ValueError(f"striped(stripe=) must be an int >= 1 (tokens per stripe) or None "
                         f"(the block size), got {stripe!r}")

    def make(seq_len: int, world_size: int, *, block_size: int):
        return _layout.striped(seq_len, world_size, stripe=stripe or block_size,
                               block_size=block_size)
    return Schedule("striped" if stripe is None else f"striped({stripe})", layout=make,
                    hops=ring_hops, kind="striped", spec=Spec("striped", stripe))


def balanced() -> Schedule:
    """Ring over a mask-aware layout: balanced work, then the least predicted step time.

    Zigzag and striped balance causal masks; packed documents, windows and arbitrary masks
    need the mask itself. :func:`fringe.plan` classifies the mask once in sequence order and
    :func:`fringe.layout.balanced` chooses the block order: for document and window masks,
    among the candidates predicted within ``BALANCE_COST`` of the fastest, those whose
    heaviest rank is within ``SPREAD`` of the mean (pair work and non-empty blocks), and of
    those the one whose slowest rank is predicted fastest, counting kernel calls, pairs and
    the kv blocks its ranged hops carry. Documents stay whole on a rank where that
    balances; otherwise they are cut where a cut sends the fewest kv blocks, into pieces on
    consecutive ranks of the ring (each hop carries only the blocks the rest of its route
    reads). The block map is permuted, not recomputed. For six packed documents, one longer
    than a rank's 256 tokens (kv chunks sent and kv blocks received in the forward,
    predicted max/mean time per rank, max/mean non-empty blocks per rank, documents on each
    rank):

    >>> import torch
    >>> ids = torch.repeat_interleave(torch.arange(6), torch.tensor([256, 64, 192, 128, 320, 64]))
    >>> m = masks.causal() & masks.document(ids)
    >>> natural = masks.classify(m, torch.arange(1024), torch.arange(1024), block_size=16)
    >>> for name in ("ring", "zigzag", "striped", "balanced"):
    ...     p = fringe.plan(getattr(schedules, name)(), m, seq_len=1024, world_size=4, block_size=16)
    ...     t = fringe.layout.predict(natural, p.layout.order[::16] // 16, 4, block_size=16)
    ...     recv = [op for prog in p.forward for _, op in prog.ops() if type(op).__name__ == "Recv"]
    ...     kv = sum(16 if r.blocks is None else sum(b - a for a, b in r.blocks) for r in recv)
    ...     docs = "/".join("".join(map(str, ids[p.layout.positions(r)].unique().tolist()))
    ...                     for r in range(4))
    ...     print(f"{name:9} sends {len(recv):2} kv blocks {kv:3}  time {float(t.max() / t.mean()):.2f}"
    ...           f"  blocks {p.stats().balance:.2f}  docs {docs}")
    ring      sends  1 kv blocks   8  time 1.52  blocks 1.53  docs 0/12/34/45
    zigzag    sends  7 kv blocks  60  time 1.28  blocks 1.67  docs 045/04/124/23
    striped   sends 12 kv blocks 156  time 1.12  blocks 1.20  docs 012345/012345/012345/012345
    balanced  sends  4 kv blocks  36  time 1.07  blocks 1.07  docs 02/013/14/245
    """
    return Schedule("balanced", layout=_layout.balanced, hops=ring_hops, mask_aware=True,
                    kind="balanced", spec=Spec("balanced"))
