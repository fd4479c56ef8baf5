"""What each op kind reads, writes and its adjoint: the one rule table, and its codes."""
from __future__ import annotations

import dataclasses

from ._buffers import _FAMILY_CODE, Family

_Q, _KV, _OUT, _DQ, _DKV, _DOUT = (Family.Q, Family.KV, Family.OUT, Family.DQ, Family.DKV,
                                   Family.DOUT)

#: Sides of a tile op: the buffer of its q chunk or of its kv chunk.
Q_SIDE, KV_SIDE = 0, 1


@dataclasses.dataclass(frozen=True)
class OpRule:
    """What ops of one kind touch: the buffer-touch rule, written once (:data:`RULES`).

    ``reads`` and ``writes`` name what the op touches. A tile op (``C``, ``G``) touches
    ``(family, side)`` pairs: side :data:`Q_SIDE` is the buffer of the op's q chunk,
    :data:`KV_SIDE` of its kv chunk (a head slice carries over). A transfer touches its one
    buffer (``"buf"``); a collective its occupied send slots (``"sends"``) and receive slots
    (``"recvs"``). ``adjoint`` is the kind of the adjoint op (transfers and collectives move
    the cotangents of their buffers). ``own_slot_in_place`` (collectives): the slot of the
    rank itself stays in place, so its buffer is neither sent nor received by that slot (it
    is when another slot of the same side also holds it).

    The op views (:meth:`Compute.reads`, ...) and the column passes (through
    :meth:`touch_codes`) read this table; nothing else restates it.
    """

    kind: str
    reads: tuple
    writes: tuple
    adjoint: str
    own_slot_in_place: bool = False

    def touches(self) -> tuple[tuple[Family, int, bool], ...]:
        """A tile op's touches as ``(family, side, written)``: its reads, then its writes."""
        return (tuple((f, s, False) for f, s in self.reads)
                + tuple((f, s, True) for f, s in self.writes))

    def touch_codes(self) -> tuple[tuple[int, int, bool], ...]:
        """:meth:`touches` with family codes (indices into ``tuple(Family)``, as in a
        :class:`ProgramTable`)."""
        return tuple((_FAMILY_CODE[f], s, w) for f, s, w in self.touches())


#: The rule of every op kind, by its text letter (collectives by their kind).
RULES: dict[str, OpRule] = {
    "C": OpRule("C", reads=((_Q, Q_SIDE), (_KV, KV_SIDE)), writes=((_OUT, Q_SIDE),),
                adjoint="G"),
    "G": OpRule("G", reads=((_Q, Q_SIDE), (_KV, KV_SIDE), (_OUT, Q_SIDE), (_DOUT, Q_SIDE)),
                writes=((_DQ, Q_SIDE), (_DKV, KV_SIDE)), adjoint="C"),
    "S": OpRule("S", reads=("buf",), writes=(), adjoint="R"),
    "R": OpRule("R", reads=(), writes=("buf",), adjoint="S"),
    "AG": OpRule("AG", reads=("sends",), writes=("recvs",), adjoint="RS", own_slot_in_place=True),
    "RS": OpRule("RS", reads=("sends",), writes=("recvs",), adjoint="AG", own_slot_in_place=True),
    "A2A": OpRule("A2A", reads=("sends",), writes=("recvs",), adjoint="A2A",
                  own_slot_in_place=True),
}


#: Collective kinds and their adjoints: all-gather <-> reduce-scatter, all-to-all <-> itself
#: (read from :data:`RULES`).
COLLECTIVE_ADJOINT = {k: RULES[k].adjoint for k in ("AG", "RS", "A2A")}


C_, G_, S_, R_ = 0, 1, 2, 3          # op kind codes of a ProgramTable
#: ``(family code, side, written)`` touches of each tile kind (:data:`RULES`) by its table
#: kind code: what the column passes index instead of restating the rule.
TILE_TOUCH_CODES = {C_: RULES["C"].touch_codes(), G_: RULES["G"].touch_codes()}
#: The same with :class:`Family` values (for passes with their own family codes).
TILE_TOUCHES = {C_: RULES["C"].touches(), G_: RULES["G"].touches()}
#: The adjoint's table kind code of each table kind code (``C_ -> G_``, ``S_ -> R_``, ...).
_KIND_CODE = {"C": C_, "G": G_, "S": S_, "R": R_}
ADJOINT_CODE = tuple(_KIND_CODE[RULES[k].adjoint] for k in sorted(_KIND_CODE, key=_KIND_CODE.get))

#: Collective kinds by their code in a general :class:`ProgramTable`.
COLL_KINDS = ("AG", "RS", "A2A")
#: Whether a collective's own slot stays in place (:data:`RULES`), by its kind code.
OWN_SLOT_IN_PLACE = tuple(RULES[k].own_slot_in_place for k in COLL_KINDS)

#: Families a transfer may move in block ranges (``Send(..., blocks=)``): what a tile reads
#: block by block (q, kv: :data:`RULES` ``"C"``'s reads) and their cotangents (dq, dkv). A
#: partial output merges by its lse, whole.
RANGED_FAMILIES = (tuple(f for f, _ in RULES["C"].reads)
                   + tuple(f.cotangent for f, _ in RULES["C"].reads))
