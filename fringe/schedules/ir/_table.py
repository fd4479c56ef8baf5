"""The columnar program table, *the* IR: every rank's program as read-only int columns."""
from __future__ import annotations

from typing import Sequence

from ._buffers import _FAMILIES, _FAMILY_CODE, _FIELDS, Buffer, _buf
from ._ops import Collective, Compute, GradCompute, Recv, Send
from ._program import Program, Step, marked
from ._rules import C_, COLL_KINDS, G_, R_, S_


_KINDS = (Compute, GradCompute, Send, Recv)


class _Columns(dict):
    """A part of a :class:`ProgramTable`: a dict of read-only columns that cannot itself be
    changed (a swapped column would change a table that :func:`check` already passed)."""

    def _read_only(self, *args, **kwargs):
        raise TypeError("a ProgramTable's columns are read-only; build a new table "
                        "(ProgramTable.of(programs) or a ProgramBuilder)")

    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = _read_only
    __ior__ = _read_only

    def __reduce__(self):               # pickled as a plain dict; a table wraps it again
        return (dict, (dict(self),))


class ScheduleError(ValueError):
    """A program violates the IR's rules; the message names the rank and step."""


class ProgramTable:
    """Every rank's program as typed, read-only integer columns: *the* IR.

    One form, built by every schedule (the ring family's lowering, the collectives,
    ``compose``, :class:`~fringe.schedules.columns.ProgramBuilder`) and by :meth:`of` from
    op objects (hand-written, ``programs_fn=``, ``build=``, parsed text). Three parts
    (:meth:`_of_parts`), each a dict of equal-length int columns:

    * ``comp``: one row per compute: ``rank, step, kind`` (0 ``C``, 1 ``G``), ``q, kv``,
      ``hi, hn`` (head slice ``hi`` of ``hn``; ``hn == 0``: all heads) and ``order``;
    * ``xfer``: one row per point-to-point transfer, its send and its receive together:
      ``step, src, dst, fam, chunk, hi, hn`` (family codes index ``tuple(Family)``),
      ``order`` (the send's place on ``src``), ``rorder`` (the receive's on ``dst``) and
      ``rng``: -1 moves the whole chunk, else an index into ``xfer["ranges"]``, a tuple of
      block-range sets (each a tuple of half-open ``(lo, hi)`` block ranges of the chunk:
      the op's ``blocks``);
    * ``coll``: one row per member side of a collective (``rank, step, order, kind, group``:
      kind a code of :data:`COLL_KINDS`, group an index into ``coll["groups"]``, a tuple of
      rank tuples) and one row per occupied slot (``slot_side``: its side's row,
      ``slot_dir``: 0 send, 1 receive, ``slot_idx``: the member index, ``slot_fam,
      slot_chunk, slot_hi, slot_hn``: the buffer, ``slot_rng``: its block ranges, an index
      into ``coll["ranges"]`` or -1 for the whole chunk), slots sorted by (side, dir, idx).

    Within a rank's step ops go by ``order`` (computes first on ties, then sends, then
    receives, then collectives). The arrays are the table's own read-only memory, so a check
    that passed on a table stays true. :class:`Program` values cut from it (:meth:`programs`)
    are *views*: they build their op objects only when looked at. Rows (one per op: ``rank,
    step, kind, a, b, c``) are a view too, for tables of whole-heads computes and transfers
    (:attr:`chain`); ``ProgramTable(P, rank, step, kind, a, b, c)`` builds the table of such
    rows.

    Room for what comes next: a route row (one buffer forwarded along consecutive hops from
    step a to step b) is another column of ``xfer`` that the passes read where they read
    ``xfer``, as ``rng`` is.
    """

    def __init__(self, world_size: int, rank, step, kind, a, b, c) -> None:
        import numpy as np
        cols = [np.array(x, dtype=np.int64, order="C", copy=True).reshape(-1)
                for x in (rank, step, kind, a, b, c)]
        if len({len(x) for x in cols}) != 1:
            raise ValueError(f"ProgramTable columns must have one length, got {[len(x) for x in cols]}")
        rank, step, kind, a, b, c = cols
        dr, ds = np.diff(rank), np.diff(step)
        if len(rank) and (rank.min() < 0 or rank.max() >= world_size
                          or (dr < 0).any() or ((dr == 0) & (ds < 0)).any()):
            raise ValueError(f"ProgramTable rows must be sorted by rank (each in [0, {world_size})), "
                             f"then by step")
        if len(kind) and (kind.min() < C_ or kind.max() > R_):
            raise ValueError(f"ProgramTable rows hold kinds 0-3 (C, G, S, R), got kind "
                             f"{int(kind[(kind < C_) | (kind > R_)][0])}")
        order = np.arange(len(rank))
        comp = kind <= G_
        is_s, is_r = kind == S_, kind == R_
        # a send is (step, src, dst, fam, chunk) on src; its receive the same on dst
        skey = np.stack([step[is_s], rank[is_s], c[is_s], a[is_s], b[is_s]])
        rkey = np.stack([step[is_r], c[is_r], rank[is_r], a[is_r], b[is_r]])
        so, ro = np.lexsort(skey[::-1]), np.lexsort(rkey[::-1])
        if skey.shape != rkey.shape or not np.array_equal(skey[:, so], rkey[:, ro]):
            raise ValueError("ProgramTable rows: a send without its receive in the same step "
                             "(or a receive without its send); ProgramTable.of(programs) names it")
        xs = np.flatnonzero(is_s)[so]
        xr = np.flatnonzero(is_r)[ro]
        P = world_size
        t = ProgramTable._of_parts(
            P, dict(rank=rank[comp], step=step[comp], kind=kind[comp], q=a[comp], kv=b[comp],
                    order=order[comp]),
            dict(step=step[xs], src=rank[xs], dst=c[xs], fam=a[xs], chunk=b[xs], order=xs,
                 rorder=xr))
        self.__dict__.update(t.__dict__)
        self._programs = tuple(Program._from_table(self, r) for r in range(P))

    def _init(self, world_size: int, parts) -> None:
        self.world_size = world_size
        # read-only mappings of read-only arrays: no column can be swapped after a check
        self._parts = tuple(_Columns(d) for d in parts)
        self._cols = None                # the row view, derived on first use (chain tables)
        self._gindex = None              # each rank's rows and sides' slots
        self._passed: set = set()        # check() flags whose structural checks passed
        comp, xfer, coll = parts
        #: Whether some transfer moves block ranges of its chunk (``rng >= 0``).
        self.ranged = bool(len(xfer["ranges"]) or len(coll["ranges"]))
        #: Whether the table holds whole-heads computes and transfers only (no head slice, no
        #: collective): what the row view and the ring chain's shortcuts of the passes take.
        self.chain = bool(not len(coll["rank"]) and not comp["hn"].any() and not xfer["hn"].any()
                          and not self.ranged)
        self._programs = tuple(Program._from_table(self, r) for r in range(world_size))

    @classmethod
    def _of_parts(cls, world_size: int, comp: dict, xfer: dict,
                  coll: dict | None = None, *, fresh: bool = False,
                  base: ProgramTable | None = None) -> ProgramTable:
        """The table of parts ``comp``, ``xfer`` and ``coll`` (the class docstring's
        columns). ``hi, hn`` may be left out (all heads), ``rorder`` too (the send's order),
        and ``coll`` (no collectives). ``fresh``: the transfer columns are arrays the caller
        just made and holds nowhere else (a pass's output): one already narrow is taken
        as the table's own, not copied (16.8M rows at P=4,096: 67 MB a column). ``base``: a
        table whose columns (the very arrays, read-only and its own) this one shares where the
        parts hold them (a pass that changes some columns: narrow's ranges)."""
        import numpy as np
        shared = set() if base is None else {
            id(v) for part in base._parts for v in part.values() if isinstance(v, np.ndarray)}

        def small(x, take=False):        # int32 where it fits: half the memory at P=1024
            if id(x) in shared:          # a column of base: already small, read-only, its own
                return x
            x = np.asarray(x)
            want = column_dtype(*((int(x.min()), int(x.max())) if len(x) else (0, 0)))
            if want is None:             # all zeros (whole heads, ...): fresh zeroed pages,
                x = np.zeros(len(x), dtype=np.int32)    # not resident until written
            elif take and x.dtype == want and x.base is None and x.flags.c_contiguous:
                pass                     # the caller's fresh array: ours now
            else:
                x = np.array(x, dtype=want, order="C", copy=True)
            x.setflags(write=False)      # its own read-only memory: nothing can refill it, so
            return x                     # a check that passed on the table stays true
        self = object.__new__(cls)
        comp = {k: small(v) for k, v in comp.items()}
        same = "rorder" not in xfer or xfer["rorder"] is xfer["order"]
        ranges = tuple(xfer.get("ranges", ()))
        xfer = {k: small(v, fresh) for k, v in xfer.items()
                if (k != "rorder" or not same) and k != "ranges"}
        if "rng" in xfer and not ranges and len(xfer["rng"]) and int(xfer["rng"].max()) >= 0:
            raise ValueError("ProgramTable: xfer['rng'] names block-range sets but "
                             "xfer['ranges'] holds none")
        if "rng" not in xfer or not ranges:
            xfer["rng"] = np.full(len(xfer["order"]), -1, np.int32)
            xfer["rng"].setflags(write=False)
            ranges = ()
        elif len(xfer["rng"]) and int(xfer["rng"].max()) >= len(ranges):
            raise ValueError(f"ProgramTable: xfer['rng'] indexes {len(ranges)} range sets, got "
                             f"{int(xfer['rng'].max())}")
        xfer["ranges"] = ranges
        for d in (comp, xfer):
            n = len(d["order"])
            for k in ("hi", "hn"):
                if k not in d:               # all heads: zeros, already small and read-only
                    d[k] = np.zeros(n, np.int32)
                    d[k].setflags(write=False)
        if "rorder" not in xfer:
            xfer["rorder"] = xfer["order"]
        coll = _no_coll() if coll is None else dict(coll)
        groups = tuple(tuple(int(m) for m in g) for g in coll.pop("groups"))
        c_ranges = tuple(coll.pop("ranges", ()))
        coll = {k: small(v) for k, v in coll.items()}
        if "slot_rng" not in coll or not c_ranges:
            if "slot_rng" in coll and len(coll["slot_rng"]) and int(coll["slot_rng"].max()) >= 0:
                raise ValueError("ProgramTable: coll['slot_rng'] names block-range sets but "
                                 "coll['ranges'] holds none")
            coll["slot_rng"] = np.full(len(coll["slot_side"]), -1, np.int32)
            coll["slot_rng"].setflags(write=False)
            c_ranges = ()
        coll["groups"] = groups
        coll["ranges"] = c_ranges
        self._init(world_size, (comp, xfer, coll))
        return self

    # ---- the row view (chain tables) -----------------------------------------------------
    def _rows(self):
        if self._cols is None:
            if not self.chain:
                raise TypeError("rows (rank, step, kind, a, b, c) are a view of tables of "
                                "whole-heads computes and transfers; this one holds head "
                                "slices or collectives: read its parts or its programs")
            import numpy as np
            comp, xfer, _ = self._parts
            rank, step, kind, a, b, c, order = self._part_rows(comp, xfer)
            o = _lex_order([rank, step, order])
            self._cols = [np.ascontiguousarray(x[o], dtype=np.int64)
                          for x in (rank, step, kind, a, b, c)]
            for x in self._cols:
                x.setflags(write=False)
        return self._cols

    @staticmethod
    def _part_rows(comp, xfer):
        """Rows (rank, step, kind, a, b, c, order) of a chain table's computes, sends and
        receives."""
        import numpy as np
        cat = np.concatenate
        n_c, n_x = len(comp["rank"]), len(xfer["src"])
        return (cat([comp["rank"], xfer["src"], xfer["dst"]]),
                cat([comp["step"], xfer["step"], xfer["step"]]),
                cat([comp["kind"], np.full(n_x, S_), np.full(n_x, R_)]),
                cat([comp["q"], xfer["fam"], xfer["fam"]]),
                cat([comp["kv"], xfer["chunk"], xfer["chunk"]]),
                cat([np.full(n_c, -1), xfer["dst"], xfer["src"]]),
                cat([comp["order"], xfer["order"], xfer["rorder"]]))

    rank = property(lambda self: self._rows()[0])
    step = property(lambda self: self._rows()[1])
    kind = property(lambda self: self._rows()[2])
    a = property(lambda self: self._rows()[3])
    b = property(lambda self: self._rows()[4])
    c = property(lambda self: self._rows()[5])

    def __reduce__(self):
        """Pickle the parts: the loaded table is built as any other (read-only columns, its
        programs views of it); checks that passed, and the derived views, are not carried."""
        return (_table_of_parts, (self.world_size, self._parts))

    def __setstate__(self, state: dict) -> None:
        """A table pickled by its ``__dict__`` (as the one-module IR did): read-only parts."""
        self.__dict__.update(state)
        self._parts = tuple(_Columns(d) for d in self._parts)

    def __len__(self) -> int:
        comp, xfer, coll = self._parts
        return len(comp["rank"]) + 2 * len(xfer["src"]) + len(coll["rank"])

    def head_splits(self) -> set[int]:
        """The ways the table's buffers split heads (``n`` of every ``h<i>/<n>``)."""
        import numpy as np
        comp, xfer, coll = self._parts
        found = set()
        for x in (comp["hn"], xfer["hn"], coll["slot_hn"]):
            if len(x) and x.any():
                found.update(int(n) for n in np.unique(x) if n)
        return found

    def programs(self) -> tuple[Program, ...]:
        """One (lazily built) program per rank."""
        return self._programs

    def digest(self) -> str:
        """A hash of the programs: equal for equal programs however they were built (any
        builder's order keys, op objects turned into a table, pickled), without building
        any op.

        It hashes canonical columns: one row per op in program order (``rank, step, kind,
        a, b, c`` as the row view; a collective side is kind ``4 + its code`` with ``a`` its
        group's index in order of first use and ``b, c`` its send and receive slot counts),
        then head slices and collective slots only when there are any.
        ``ProgramTable.of(plan.forward).digest()`` is what a plan fingerprint hashes at
        P=1024 instead of the programs' text (millions of ops).
        """
        import hashlib
        import numpy as np
        h = hashlib.sha1(f"programs/{self.world_size}/".encode())
        comp, xfer, coll = self._parts
        i64 = lambda x: np.asarray(x, dtype=np.int64)     # noqa: E731
        nc, nx, nk = len(comp["rank"]), len(xfer["src"]), len(coll["rank"])
        cat = np.concatenate
        slot_side = i64(coll["slot_side"])
        n_send = np.bincount(slot_side[i64(coll["slot_dir"]) == 0], minlength=nk)[:nk]
        n_recv = np.bincount(slot_side[i64(coll["slot_dir"]) == 1], minlength=nk)[:nk]
        rank = cat([comp["rank"], xfer["src"], xfer["dst"], coll["rank"]])
        step = cat([comp["step"], xfer["step"], xfer["step"], coll["step"]])
        order = cat([comp["order"], xfer["order"], xfer["rorder"], coll["order"]])
        tie = np.repeat(np.arange(4, dtype=np.int8), [nc, nx, nx, nk])
        o = _lex_order([rank, step, order, tie])        # stable: the programs' op order
        kind = cat([i64(comp["kind"]), np.full(nx, S_), np.full(nx, R_), 4 + i64(coll["kind"])])
        a = cat([i64(comp["q"]), i64(xfer["fam"]), i64(xfer["fam"]), i64(coll["group"])])
        b = cat([i64(comp["kv"]), i64(xfer["chunk"]), i64(xfer["chunk"]), n_send])
        c = cat([np.full(nc, -1), i64(xfer["dst"]), i64(xfer["src"]), n_recv])
        if nk:                                           # groups by first use, not by index
            sides = o[o >= 2 * nx + nc] - (2 * nx + nc)  # collective sides in program order
            g = a[2 * nx + nc:]
            first = {}
            for x in g[sides].tolist():
                first.setdefault(x, len(first))
            a[2 * nx + nc:] = [first[x] for x in g.tolist()]
        for col in (rank, step, kind, a, b, c):
            h.update(np.ascontiguousarray(i64(col)[o]).tobytes())
        if comp["hn"].any() or xfer["hn"].any():
            hi = cat([i64(comp["hi"]), i64(xfer["hi"]), i64(xfer["hi"]), np.zeros(nk, np.int64)])
            hn = cat([i64(comp["hn"]), i64(xfer["hn"]), i64(xfer["hn"]), np.zeros(nk, np.int64)])
            h.update(b"heads")
            h.update(np.ascontiguousarray(hi[o]).tobytes())
            h.update(np.ascontiguousarray(hn[o]).tobytes())
        if self.ranged:                      # range sets by content, in order of first use
            rng = np.concatenate([np.full(nc, -1, np.int64), i64(xfer["rng"]), i64(xfer["rng"]),
                                  np.full(nk, -1, np.int64)])[o]
            seen: dict = {}
            for x in rng[rng >= 0].tolist():
                seen.setdefault(x, len(seen))
            remap = np.full(len(xfer["ranges"]) + 1, -1, np.int64)
            for x, n in seen.items():
                remap[x] = n
            h.update(b"ranges")
            h.update(np.ascontiguousarray(remap[rng]).tobytes())
            h.update(repr([xfer["ranges"][x] for x in seen]).encode())
        if nk:
            groups = coll["groups"]
            h.update(b"collectives")
            h.update(repr([groups[x] for x in sorted(first, key=first.get)]).encode())
            so = np.lexsort((i64(coll["slot_idx"]), i64(coll["slot_dir"]),
                             np.argsort(sides)[slot_side]))   # slots by side's program position
            for k in ("slot_dir", "slot_idx", "slot_fam", "slot_chunk", "slot_hi", "slot_hn"):
                h.update(np.ascontiguousarray(i64(coll[k])[so]).tobytes())
            if len(coll["ranges"]):                  # slot ranges by content
                h.update(b"slot ranges")
                h.update(repr([None if g < 0 else coll["ranges"][g]
                               for g in i64(coll["slot_rng"])[so].tolist()]).encode())
        return h.hexdigest()

    def _general_index(self):
        """Per part, the rows of each rank: (order, bounds) for computes, sends, receives,
        collective sides; and each side's slot bounds."""
        import numpy as np
        if self._gindex is None:
            comp, xfer, coll = self._parts
            ix = []
            for col in (comp["rank"], xfer["src"], xfer["dst"], coll["rank"]):
                o = np.argsort(col, kind="stable")
                ix.append((o, np.searchsorted(col[o], np.arange(self.world_size + 1))))
            sb = np.searchsorted(coll["slot_side"], np.arange(len(coll["rank"]) + 1))
            self._gindex = (ix, sb)
        return self._gindex

    def _steps_of(self, rank: int) -> tuple[Step, ...]:
        """Rank ``rank``'s steps as op objects (the view)."""
        comp, xfer, coll = self._parts
        ix, sb = self._general_index()
        ci, si, ri, ki = (o[b[rank]:b[rank + 1]] for o, b in ix)
        rows = []        # (step, order, tie, op)
        for t, o, k, q, kv, hi, hn in zip(*(comp[c][ci].tolist() for c in
                                            ("step", "order", "kind", "q", "kv", "hi", "hn"))):
            rows.append((t, o, 0, _KINDS[k](q, kv, (hi, hn) if hn else None)))
        ranges = xfer["ranges"]
        for tie, sel, cls, peer, oc in ((1, si, Send, "dst", "order"), (2, ri, Recv, "src", "rorder")):
            for t, o, f, ch, hi, hn, p, g in zip(*(xfer[c][sel].tolist() for c in
                                                   ("step", oc, "fam", "chunk", "hi", "hn", peer,
                                                    "rng"))):
                rows.append((t, o, tie, cls(buffer_of(f, ch, hi, hn), p,
                                            None if g < 0 else ranges[g])))
        groups = coll["groups"]
        sd, sx, sf, sc, sh, sn = (coll[c] for c in ("slot_dir", "slot_idx", "slot_fam",
                                                    "slot_chunk", "slot_hi", "slot_hn"))
        sr, c_ranges = coll["slot_rng"], coll["ranges"]
        for side in ki.tolist():
            lo, hi_ = int(sb[side]), int(sb[side + 1])
            d = sd[lo:hi_].tolist()
            split = d.count(0)
            idx = sx[lo:hi_].tolist()
            bufs = [buffer_of(*x) for x in zip(sf[lo:hi_].tolist(), sc[lo:hi_].tolist(),
                                               sh[lo:hi_].tolist(), sn[lo:hi_].tolist())]
            ks = None
            if c_ranges:
                ks = [None if g < 0 else c_ranges[g] for g in sr[lo:hi_].tolist()]
            op = Collective.sparse(COLL_KINDS[int(coll["kind"][side])],
                                   groups[int(coll["group"][side])],
                                   (idx[:split], bufs[:split]), (idx[split:], bufs[split:]),
                                   (None, None) if ks is None else (ks[:split], ks[split:]))
            rows.append((int(coll["step"][side]), int(coll["order"][side]), 3, op))
        rows.sort(key=lambda x: x[:3])
        steps, i, n = [], 0, len(rows)
        while i < n:
            t = rows[i][0]
            j = i
            while j < n and rows[j][0] == t:
                j += 1
            steps.append(Step(t, tuple(x[3] for x in rows[i:j])))
            i = j
        return tuple(steps)

    @classmethod
    def of(cls, programs: Sequence[Program]) -> ProgramTable:
        """The table of any programs, one per rank in rank order (the table itself when they
        were cut from one): its :meth:`programs` equal them op for op.

        Raises :class:`ScheduleError` naming the rank and step (``<-- ERROR HERE``) when a
        transfer names an invalid peer, or a send and its receive are not in the same step.
        """
        import numpy as np
        src = programs[0].table if len(programs) else None
        if src is not None and src.world_size == len(programs) and all(
                p.table is src and p.rank == r for r, p in enumerate(programs)):
            return src
        P = len(programs)
        comp: list = []
        sends: dict = {}
        recvs: dict = {}
        sides: list = []
        slots: list = []
        slot_ranges: dict = {}
        groups: dict = {}
        for prog in programs:
            r = prog.rank
            for step in prog.steps:
                t = step.index
                for o, op in enumerate(step.ops):
                    tp = type(op)
                    if tp is Compute or tp is GradCompute:
                        hi, hn = op.heads or (0, 0)
                        comp.append((r, t, C_ if tp is Compute else G_, op.q, op.kv, o, hi, hn))
                    elif tp is Send or tp is Recv:
                        if not 0 <= op.peer < P or op.peer == r:
                            raise ScheduleError(f"rank {r}, step {t}: {op} names an invalid peer "
                                                f"(world size {P})\n{marked(prog, t)}")
                        src_, dst = (r, op.peer) if tp is Send else (op.peer, r)
                        key = (t, src_, dst, op.buf, op.blocks)
                        (sends if tp is Send else recvs).setdefault(key, []).append(o)
                    elif tp is Collective:
                        g = groups.setdefault(op.group, len(groups))
                        side = len(sides)
                        sides.append((r, t, o, COLL_KINDS.index(op.kind), g))
                        for d, (idx, bufs), ks in ((0, op.sparse_sends, op.send_blocks),
                                                   (1, op.sparse_recvs, op.recv_blocks)):
                            for i, b, k in zip(idx, bufs, ks):
                                fam, ch, h = _FIELDS[b]
                                g_ = -1 if k is None else slot_ranges.setdefault(k, len(slot_ranges))
                                slots.append((side, d, i, _FAMILY_CODE[fam], ch, *(h or (0, 0)), g_))
                    else:
                        raise TypeError(f"rank {r}, step {t}: {op!r} is not an op of the IR")
        if len(sends) != len(recvs) or any(len(v) != len(recvs.get(k, ())) for k, v in sends.items()):
            _unmatched(programs, sends, recvs)
        xfer = []
        range_ids: dict = {}
        for key, os_ in sends.items():
            fam, ch, h = _FIELDS[key[3]]
            g = -1 if key[4] is None else range_ids.setdefault(key[4], len(range_ids))
            for a, b in zip(os_, recvs[key]):
                xfer.append((key[0], key[1], key[2], _FAMILY_CODE[fam], ch, a, *(h or (0, 0)), b,
                             g))

        def cols(rows, names, where):
            arr = np.array(rows)            # its dtype says whether every field is an integer
            if rows and not (arr.dtype.kind == "i" or arr.dtype.kind == "b" or (
                    arr.dtype.kind == "u" and int(arr.max()) < 2 ** 63)):
                for row in rows:            # a float (1.5 ran as 1) or an int past int64
                    for n, v in zip(names, row):
                        if not isinstance(v, (int, np.integer)) or not -2 ** 63 <= v < 2 ** 63:
                            raise ScheduleError(f"{where(row)}: {n} is {v!r}; op fields (ranks, "
                                                f"steps, chunks, peers) are integers in int64")
            arr = arr.astype(np.int64).reshape(-1, len(names))
            return {n: arr[:, i] for i, n in enumerate(names)}

        def at(r, t):
            return f"rank {r}, step {t}"
        c = cols(comp, ("rank", "step", "kind", "q", "kv", "order", "hi", "hn"),
                 lambda row: at(row[0], row[1]))
        x = cols(xfer, ("step", "src", "dst", "fam", "chunk", "order", "hi", "hn", "rorder",
                        "rng"), lambda row: at(row[1], row[0]))
        x["ranges"] = tuple(range_ids)
        k = cols(sides, ("rank", "step", "order", "kind", "group"), lambda row: at(row[0], row[1]))
        k.update(cols(slots, ("slot_side", "slot_dir", "slot_idx", "slot_fam", "slot_chunk",
                              "slot_hi", "slot_hn", "slot_rng"),
                      lambda row: at(*sides[row[0]][:2])))
        k["groups"] = tuple(groups)
        k["ranges"] = tuple(slot_ranges)
        return cls._of_parts(P, c, x, k)


def _unmatched(programs, sends: dict, recvs: dict):
    """Raise the :class:`ScheduleError` of the first transfer (in program order) whose
    sends and receives differ in number."""
    for prog in programs:
        r = prog.rank
        for step in prog.steps:
            t = step.index
            for op in step.ops:
                if type(op) is Send:
                    key, mine, other, peer, missing = ((t, r, op.peer, op.buf, op.blocks), sends,
                                                       recvs, op.peer, "receive")
                elif type(op) is Recv:
                    key, mine, other, peer, missing = ((t, op.peer, r, op.buf, op.blocks), recvs,
                                                       sends, op.peer, "send")
                else:
                    continue
                if len(other.get(key, ())) != len(mine[key]):
                    raise ScheduleError(f"rank {r}, step {t}: '{op}' has no matching {missing} "
                                        f"on rank {peer} in the same step\n{marked(prog, t)}")
    raise AssertionError("unreachable: sends and receives differ but no op says so")


def column_dtype(lo: int, hi: int):
    """How wide a table column holding values in ``[lo, hi]`` is: int32 where they fit (half
    the memory: 16.8M transfer rows a direction at P=4,096), else int64; None when every
    value is 0 (fresh zeroed pages, not resident until written). The one rule for it:
    :meth:`ProgramTable._of_parts` and the passes that build columns it takes (``fresh``)."""
    import numpy as np
    if lo == hi == 0:
        return None
    return np.int32 if lo >= -2 ** 31 and hi < 2 ** 31 else np.int64


def concat_column(parts: list):
    """``np.concatenate(parts)`` at the table's width for its values (:func:`column_dtype`),
    one array and no wider copy on the way: a pass's output column that
    :meth:`ProgramTable._of_parts` takes as it is (``fresh=True``)."""
    import numpy as np
    n = sum(len(p) for p in parts)
    ext = [(int(p.min()), int(p.max())) for p in parts if len(p)]
    want = column_dtype(min([e[0] for e in ext] or [0]), max([e[1] for e in ext] or [0]))
    if want is None:
        return np.zeros(n, np.int32)
    return np.concatenate(parts, dtype=want, casting="unsafe")   # checked: it cannot wrap


def step_scalar(T: int):
    """``T`` as a scalar an int32 step column can be subtracted from (``T - step``, the
    reverse's step rule): a Python int, or an int64 past 2**31 (NumPy raises on a Python int
    that does not fit the column's int32, where int64 gives the wider result)."""
    import numpy as np
    return T if T < 2 ** 31 else np.int64(T)


def _table_of_parts(world_size: int, parts) -> ProgramTable:
    """Unpickle a :class:`ProgramTable` (its parts)."""
    return ProgramTable._of_parts(world_size, *parts)


def _no_coll() -> dict:
    import numpy as np
    z = np.zeros(0, np.int64)
    return dict(rank=z, step=z, order=z, kind=z, group=z, slot_side=z, slot_dir=z, slot_idx=z,
                slot_fam=z, slot_chunk=z, slot_hi=z, slot_hn=z, slot_rng=z - 1, groups=(),
                ranges=())


_BUFFER_OF: dict = {}


def buffer_of(fam: int, chunk: int, hi: int, hn: int) -> Buffer:
    """The interned buffer of a table's columns (family code, chunk, head slice hi of hn;
    ``hn == 0``: all heads)."""
    if not hn:
        return _buf(_FAMILIES[fam], chunk)
    key = (fam, chunk, hi, hn)
    b = _BUFFER_OF.get(key)
    if b is None:
        b = _BUFFER_OF[key] = Buffer.of(_FAMILIES[fam], chunk, (hi, hn))
    return b


def _lex_order(cols):
    """A stable sort of rows by the columns ``cols`` (most significant first): one argsort of
    a combined key where it fits in int64, else a lexsort."""
    import numpy as np
    n = len(cols[0])
    if not n:
        return np.zeros(0, np.int64)
    lo = [int(x.min()) for x in cols]
    span = [int(x.max()) - m + 1 for x, m in zip(cols, lo)]
    if np.prod([float(w) for w in span]) >= 2.0 ** 62:
        return np.lexsort([np.asarray(x) for x in cols[::-1]])
    key = np.asarray(cols[0], dtype=np.int64) - lo[0]
    for x, m, w in zip(cols[1:], lo[1:], span[1:]):
        key = key * w + (np.asarray(x, dtype=np.int64) - m)
    return np.argsort(key, kind="stable")
