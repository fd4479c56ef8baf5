"""``lower``: programs from a communication pattern (each kv chunk's hops, a
:class:`HopTable`), pruned by the tile map when one is given."""
from __future__ import annotations

import dataclasses
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch

from ..ir import C_, Family, Program, ProgramTable, ScheduleError
from ._columns import _FAMILY_CODE, _need_array
from ._keys import _assign_min, _runs
from ._prune import _keep_hops


@dataclasses.dataclass(frozen=True)
class Hop:
    """kv chunk ``chunk`` moves from rank ``src`` to rank ``dst`` during step ``step``."""

    step: int
    src: int
    dst: int


class HopTable(Mapping):
    """Hops of every kv chunk as parallel integer arrays: a compact ``{chunk: [Hop, ...]}``.

    It is a read-only mapping (``table[j]`` lists chunk j's hops as :class:`Hop` values), so
    it goes wherever a dict of hops does; :func:`lower` reads the arrays directly, which is
    what lets a full ring at P=1024 (a million hops) be lowered and pruned in well under a
    second.

    Args:
        chunk, step, src, dst: 1-D integer arrays of equal length, one entry per hop.
    """

    def __init__(self, chunk, step, src, dst) -> None:
        arrs = [np.asarray(a, dtype=np.int64).reshape(-1) for a in (chunk, step, src, dst)]
        if len({a.shape for a in arrs}) != 1:
            raise ValueError(f"HopTable arrays must have one length, got {[len(a) for a in arrs]}")
        self._arrays = arrs
        self._ring: int | None = None
        self._index: dict[int, np.ndarray] | None = None

    @classmethod
    def _of_ring(cls, world_size: int) -> HopTable:
        """The ring on P ranks (:func:`fringe.schedules.ring_hops`): chunk j moves j → j+1 →
        ... (mod P), one hop per step. :func:`lower` lowers it without the P(P-1) hop arrays,
        which are built only when read."""
        self = object.__new__(cls)
        self._arrays, self._ring, self._index = None, world_size, None
        return self

    def _cols(self) -> list[np.ndarray]:
        if self._arrays is None:
            P = self._ring
            j, s = np.divmod(np.arange(P * max(P - 1, 0), dtype=np.int64), max(P - 1, 1))
            self._arrays = [j, s, (j + s) % P, (j + s + 1) % P]
        return self._arrays

    chunk = property(lambda self: self._cols()[0])
    step = property(lambda self: self._cols()[1])
    src = property(lambda self: self._cols()[2])
    dst = property(lambda self: self._cols()[3])

    @classmethod
    def of(cls, hops: Mapping[int, Sequence[Hop]]) -> HopTable:
        """A table from ``{chunk: [Hop, ...]}`` (returned unchanged if already a table)."""
        if isinstance(hops, HopTable):
            return hops
        rows = [(j, h.step, h.src, h.dst) for j, hs in hops.items() for h in hs]
        arr = np.array(rows, dtype=np.int64).reshape(-1, 4)
        return cls(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])

    def _rows(self) -> dict[int, np.ndarray]:
        if self._index is None:
            order = np.argsort(self.chunk, kind="stable")
            chunks, starts = _runs(self.chunk[order])
            ends = list(starts[1:]) + [len(order)]
            self._index = {int(c): order[a:b] for c, a, b in zip(chunks, starts, ends)}
        return self._index

    def __getitem__(self, chunk: int) -> list[Hop]:
        rows = self._rows()[chunk]
        return [Hop(int(self.step[i]), int(self.src[i]), int(self.dst[i])) for i in rows]

    def __iter__(self) -> Iterator[int]:
        return iter(self._rows())

    def __len__(self) -> int:
        return len(self._rows())

    def __repr__(self) -> str:
        return f"HopTable({len(self.chunk)} hops, {len(self)} chunks)"


def lower(world_size: int, hops: Mapping[int, Sequence[Hop]], *,
          need: torch.Tensor | None = None) -> list[Program]:
    """Programs that move each kv chunk along its hops and compute every tile on arrival.

    Args:
        world_size: P.
        hops: for each kv chunk j (owned by rank j), the hops it takes, forming a tree
            rooted at rank j (a dict of :class:`Hop` lists or a :class:`HopTable`).
        need: optional bool ``[P, P]`` tile map; when given, the result is
            ``prune(lower(P, hops), need)``, computed without building the unpruned programs.

    Returns:
        One program per rank: every (q_r, kv_j) tile that reaches rank r is computed at the
        first step kv_j is present there.

    Raises:
        ScheduleError: a hop names a rank outside ``[0, P)``, sends kv before it is there,
            or delivers it to a rank twice.
    """
    P = world_size
    tab = HopTable.of(hops)
    if need is None:
        use = np.ones((P, P), dtype=bool)
    else:
        use = _need_array(need, P).T.copy()              # use[j, r]: rank r computes with kv_j
    if tab._ring == P:          # the ring: chunk j goes as far as the farthest rank using it
        # int32 where P^2 hops fit (P=4,096 documents: 16.7M hops; no int64 copies of them)
        it = np.int32 if P * P < 2 ** 31 else np.int64
        r = np.arange(P, dtype=it)
        dist = r[None, :] - r[:, None]
        dist %= it(P)
        last = np.where(use, dist, it(0)).max(axis=1)
        del dist
        j = np.repeat(r, last)
        s = np.arange(len(j), dtype=it)
        s -= np.repeat((np.cumsum(last) - last).astype(it), last)
        src = j + s
        src %= it(P)
        dst = src + it(1)
        dst %= it(P)
        k = None                # every hop is kept: hop k is row k
    else:
        sel = (tab.chunk >= 0) & (tab.chunk < P)
        j, s, src, dst = tab.chunk[sel], tab.step[sel], tab.src[sel], tab.dst[sel]
        dj, ds = np.diff(j), np.diff(s)
        if not ((dj > 0) | ((dj == 0) & (ds >= 0))).all():  # by chunk, then step, stable
            order = np.lexsort((np.arange(len(j)), s, j))
            j, s, src, dst = j[order], s[order], src[order], dst[order]
        _validate_hops(P, j, s, src, dst)
        keep = np.ones(len(j), dtype=bool) if need is None else _keep_hops(P, j, s, src, dst, use)
        k = np.nonzero(keep)[0]
    diag = np.nonzero(np.diagonal(use))[0]
    if k is None:               # the ring's hops, all kept: no gathered copies
        arrive = np.flatnonzero(use[j, dst])
        ks, ksrc, kdst, kj = s, src, dst, j
        order = np.arange(1, len(j) + 1, dtype=j.dtype)
    else:
        arrive = k[use[j[k], dst[k]]]
        ks, ksrc, kdst, kj = s[k], src[k], dst[k], j[k]
        order = k + 1
    del use
    # within a rank's step, ops go by emission key: the local tile (-1), then hop k's send,
    # receive and the tile computed on its arrival (key k); order = key + 1
    crank = np.concatenate([diag, dst[arrive]])
    comp = dict(rank=crank, step=np.concatenate([np.zeros(len(diag), np.int64), s[arrive] + 1]),
                kind=np.full(len(crank), C_, np.int64), q=crank,
                kv=np.concatenate([diag, j[arrive]]),
                order=np.concatenate([np.zeros(len(diag), np.int64), arrive + 1]))
    del s, src, dst, j, arrive
    xfer = dict(step=ks, src=ksrc, dst=kdst, fam=np.full(len(ks), _FAMILY_CODE[Family.KV],
                                                         dtype=order.dtype),
                chunk=kj, order=order)
    del ks, ksrc, kdst, kj, order
    return list(ProgramTable._of_parts(P, comp, xfer).programs())


def _validate_hops(P: int, j, s, src, dst) -> None:
    """Raise the first error the hops (sorted by chunk, then step) would hit, in that order."""
    n = len(j)
    out = (src < 0) | (src >= P) | (dst < 0) | (dst >= P)
    ok = ~out
    idx = np.arange(n)
    key = np.where(ok, j * P + dst, P * P)            # out-of-range hops: a spare cell
    first_at = np.full(P * P + 1, n, dtype=np.int64)  # [chunk * P + rank]: its first delivery
    _assign_min(first_at, key, idx)
    first = ok & (first_at[key] == idx)
    twice = ok & (~first | (dst == j))
    arrival = np.full(P * P, np.iinfo(np.int64).max, dtype=np.int64)    # [chunk * P + rank]
    arrival[np.arange(P) * (P + 1)] = 0
    fi = first & (dst != j)
    arrival[key[fi]] = s[fi] + 1
    early = ok & (arrival[np.where(ok, j * P + src, 0)] > s)
    bad = out | twice | early
    if not bad.any():
        return
    i = int(np.nonzero(bad)[0][0])
    hop, jj = Hop(int(s[i]), int(src[i]), int(dst[i])), int(j[i])
    if out[i]:
        rank = hop.src if not 0 <= hop.src < P else hop.dst
        raise ScheduleError(f"hop {hop} of kv{jj} names rank {rank}, outside [0, {P})")
    if early[i]:
        raise ScheduleError(f"kv{jj} is sent from rank {hop.src} at step {hop.step} before it is there")
    raise ScheduleError(f"kv{jj} reaches rank {hop.dst} twice (again at step {hop.step})")
