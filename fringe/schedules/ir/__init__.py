"""The schedule IR: small immutable ops grouped into steps, one program per rank.

Buffers are typed ids (:class:`Buffer`): a *family* (what the buffer holds) and a *chunk*
(the rank that owns the data). They print as, and parse from, short names:

=========  ==========================================================================
name       family
=========  ==========================================================================
``q3``     ``Family.Q``: rank 3's queries ``[B, H, L, D]``
``kv5``    ``Family.KV``: rank 5's keys and values, packed ``[2, B, G, L, D]``
``out3``   ``Family.OUT``: the (out, lse) of q3's rows, partial or merged
``dq3``    ``Family.DQ``: the gradient of ``q3``
``dkv5``   ``Family.DKV``: the gradient of ``kv5``, which travels back to rank 5
``dout3``  ``Family.DOUT``: the cotangent of ``out3``
``acc0``   ``Family.ACC``: an accumulator for parameter gradients (e.g. a score_mod's)
=========  ==========================================================================

Ops, what they read and write, their adjoint, and their text forms (``parse_op(str(op)) ==
parse_op(op.ascii()) == op``; the pretty form is for display, the ASCII one for goldens):

==========================  ============  ==============  ===================  ==================
op                          pretty        ASCII           reads -> writes      adjoint
==========================  ============  ==============  ===================  ==================
``Compute(q=3, kv=5)``      ``C q3·kv5``  ``C q3.kv5``    q3, kv5 -> out3      ``G q3·kv5``
``GradCompute(q=3, kv=5)``  ``G q3·kv5``  ``G q3.kv5``    q3, kv5, out3,       ``C q3·kv5``
                                                          dout3 -> dq3, dkv5
``Send("kv5", peer=2)``     ``S kv5→r2``  ``S kv5->r2``   kv5 ->               ``R dkv5←r2``
``Recv("kv5", peer=0)``     ``R kv5←r0``  ``R kv5<-r0``   -> kv5               ``S dkv5→r0``
==========================  ============  ==============  ===================  ==================

Head slices: ``q3h1/4`` is head slice 1 of 4 of ``q3`` (query heads ``[H/4, 2H/4)``; for kv the
kv heads those read, replicated when ``4 % G == 0``); ``Compute(3, 5, heads=(1, 4))`` prints
``C q3·kv5 h1/4``, reads ``q3h1/4, kv5h1/4`` and merges into ``out3h1/4``. On the rank that
holds the whole buffer a slice is a view of it.

Collectives (:class:`Collective`) over a fixed group, one side per member, one slot per
member (``-``: an empty contribution): ``AG[0,1,2] kv0,kv0,- > -,kv1,kv2`` (ASCII; ``⇄``
pretty) reads what it sends and writes what it receives; its adjoint is ``RS[0,1,2]
-,dkv1,dkv2 > dkv0,dkv0,-`` (received gradients accumulate in member order), and an ``A2A``'s
adjoint is the inverse ``A2A`` of the cotangents. Queries and partial outputs may move:
``S q3h1/2->r1``, ``R out3<-r2`` (a received partial ``out`` merges by its lse; in the
backward the merged ``out`` travels with its cotangent ``dout``).

Semantics of one step on one rank: its communication is *issued* first, its tiles are
computed on buffers that were present at the start of the step (so compute overlaps the
transfers in flight), and the communication *completes* at the end of the step. A buffer
received in step t is usable from step t+1. A received gradient buffer (``dkv*``) is
accumulated into the local one. Every ``Send`` at step t on rank a has a matching ``Recv``
of the same buffer from a at step t on its peer (checked by :func:`fringe.schedules.check`).
Steps with nothing to do are absent; step indices are global rounds.

At scale the same programs live in a :class:`ProgramTable` (one row of integers per op);
the passes run on its columns, and a :class:`Program` cut from it builds its steps only when
they are looked at.

Modules (private, each importing only those above it; this package re-exports the names):

* ``_buffers`` — :class:`Family`, :class:`Buffer` (interned ids), names, family codes;
* ``_rules`` — :class:`OpRule`, :data:`RULES` (what each op kind touches, its adjoint) and
  the op kind codes of a table;
* ``_ops`` — :class:`Compute`, :class:`GradCompute`, :class:`Send`, :class:`Recv`,
  :class:`Collective` and :func:`parse_op`;
* ``_program`` — :class:`Step`, :class:`Program`, their text forms, :func:`marked`;
* ``_table`` — :class:`ProgramTable` (its parts, digest, :meth:`ProgramTable.of`) and
  :class:`ScheduleError`.

>>> p = Program.parse("r1:\\n  t0: R kv0<-r0 | C q1.kv1\\n  t1: C q1.kv0")
>>> print(p)
r1:
  t0: R kv0←r0 | C q1·kv1
  t1: C q1·kv0
>>> [str(b) for b in p.steps[0].ops[0].writes()], p.steps[0].ops[0].adjoint().ascii()
(['kv0'], 'S dkv0->r0')
"""
from __future__ import annotations

import inspect

from ._buffers import (_BUFS_OF as _BUFS_OF, _FAMILY_CODE as _FAMILY_CODE, _FIELDS as _FIELDS,
                       Buffer as Buffer, Family as Family, _buf as _buf, buffer_name as buffer_name,
                       split_name as split_name)
from ._ops import (Collective as Collective, Comm as Comm, Compute as Compute,
                   GradCompute as GradCompute, Op as Op, Recv as Recv, Send as Send,
                   _collective as _collective, blocks_text as blocks_text,
                   parse_op as parse_op)
from ._program import (Program as Program, Step as Step, format_programs as format_programs,
                       marked as marked, parse_programs as parse_programs,
                       program_from_ops as program_from_ops, steps_of as steps_of)
from ._rules import (ADJOINT_CODE as ADJOINT_CODE, C_ as C_, COLL_KINDS as COLL_KINDS,
                     COLLECTIVE_ADJOINT as COLLECTIVE_ADJOINT, G_ as G_, KV_SIDE as KV_SIDE,
                     OWN_SLOT_IN_PLACE as OWN_SLOT_IN_PLACE, Q_SIDE as Q_SIDE, R_ as R_,
                     RANGED_FAMILIES as RANGED_FAMILIES,
                     RULES as RULES, S_ as S_, TILE_TOUCH_CODES as TILE_TOUCH_CODES,
                     TILE_TOUCHES as TILE_TOUCHES, OpRule as OpRule)
from ._table import (ProgramTable as ProgramTable, ScheduleError as ScheduleError,
                     _no_coll as _no_coll, buffer_of as buffer_of, column_dtype as column_dtype,
                     concat_column as concat_column, step_scalar as step_scalar)

# ``_collective``: pickles written when the IR was one module name it here (a Collective
# unpickles through it), as they name the classes re-exported above.

#: ``doctest.testmod(fringe.schedules.ir)`` runs the examples of the classes and functions
#: re-exported here too (they live in the private modules, and doctest looks only at objects
#: defined in the module it is given).
__test__ = {name: obj for name, obj in sorted(globals().items())
            if (inspect.isclass(obj) or inspect.isfunction(obj))
            and obj.__module__.startswith(__name__ + ".")}
