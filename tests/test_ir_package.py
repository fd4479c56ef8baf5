"""``fringe.schedules.ir`` is a package of private modules: its values pickle and load back
(pickles that name the IR as one module, ``fringe.schedules.ir.<name>``, included), and the
private modules' examples run."""
from __future__ import annotations

import copyreg
import doctest
import importlib
import io
import pickle
import pkgutil

import pytest

import fringe.schedules.ir as ir
from fringe.schedules.ir import (Buffer, Collective, Compute, GradCompute, Program, ProgramTable,
                                 Recv, Send, Step, parse_programs)

#: Two ranks, every op kind: head slices, a transfer each way, a collective with empty slots.
TEXT = """
r0:
  t0: S kv0->r1 | C q0.kv0 | C q0.kv0 h1/2
  t1: R dkv0<-r1 | G q0.kv0
  t2: AG[0,1] kv0,- > -,kv1
r1:
  t0: R kv0<-r0 | C q1.kv1
  t1: S dkv0->r0 | G q1.kv0 h0/2
  t2: AG[0,1] -,kv1 > kv0,-
"""


class _OneModule(pickle.Unpickler):
    """Loads a pickle as if it had been written when the IR was one module: every name it
    looks up in a private module of the package is looked up on ``fringe.schedules.ir``."""

    def __init__(self, data: bytes) -> None:
        super().__init__(io.BytesIO(data))
        self.moved: list[str] = []

    def find_class(self, module: str, name: str):
        if module.startswith(ir.__name__ + "."):
            self.moved.append(f"{module}.{name}")
            module = ir.__name__
        return super().find_class(module, name)


class _AsBefore(pickle.Pickler):
    """Pickles a :class:`ProgramTable` as the one-module IR did: by its ``__dict__`` (it had no
    ``__reduce__``; its programs went as op objects)."""

    def reducer_override(self, obj):
        if type(obj) is ProgramTable:
            return copyreg.__newobj__, (ProgramTable,), dict(obj.__dict__)
        return NotImplemented


def _programs() -> list[Program]:
    return parse_programs(TEXT)


@pytest.mark.parametrize("load", ["same", "one_module"])
def test_a_pickled_program_round_trips(load):
    progs = _programs()
    ops = {type(op) for p in progs for _, op in p.ops()}
    assert ops == {Compute, GradCompute, Send, Recv, Collective}
    for p in progs:
        data = pickle.dumps(p)
        if load == "same":
            q = pickle.loads(data)
        else:
            u = _OneModule(data)
            q = u.load()
            assert u.moved, "the pickle names no private module of fringe.schedules.ir"
        assert q == p and q.ascii() == p.ascii() and q.table is None
        assert all(type(s) is Step for s in q.steps)
        assert all(type(b) is Buffer for _, op in q.ops() for b in op.reads() + op.writes())


@pytest.mark.parametrize("load", ["same", "before_split"])
def test_a_pickled_program_table_round_trips(load):
    progs = _programs()
    table = ProgramTable.of(progs)
    assert table.programs() == tuple(progs)
    if load == "same":
        back = pickle.loads(pickle.dumps(table))
    else:                           # written as the one-module IR wrote it, loaded from there
        buf = io.BytesIO()
        _AsBefore(buf).dump(table)
        u = _OneModule(buf.getvalue())
        back = u.load()
        assert u.moved, "the pickle names no private module of fringe.schedules.ir"
    assert type(back) is ProgramTable and back.world_size == table.world_size
    assert back.digest() == table.digest() and len(back) == len(table)
    assert back.programs() == table.programs()
    if load == "same":
        # its programs are views of the loaded table, so the passes' fast path takes it as is
        assert all(p.table is back for p in back.programs())
        assert ProgramTable.of(back.programs()) is back
        comp, xfer, coll = back._parts
        assert not any(x.flags.writeable for part in (comp, xfer) for k, x in part.items()
                       if k != "ranges")            # ranges: the tuple of block-range sets
        assert not any(x.flags.writeable for k, x in coll.items() if k not in ("groups", "ranges"))


def test_a_program_cut_from_a_table_pickles_as_its_ops():
    table = ProgramTable.of(_programs())
    p = table.programs()[1]
    q = pickle.loads(pickle.dumps(p))
    assert q == p and q.table is None and p.table is table


def test_every_name_a_pickle_of_the_one_module_ir_named_is_still_there():
    """What a pickle written before the split looks up on ``fringe.schedules.ir``: the
    classes of its values and the function a collective unpickles through."""
    for name in ("Buffer", "Family", "Compute", "GradCompute", "Send", "Recv", "Collective",
                 "Step", "Program", "ProgramTable", "_collective"):
        obj = getattr(ir, name)
        assert obj.__module__.startswith(ir.__name__ + "."), name
        assert getattr(importlib.import_module(obj.__module__), name) is obj


def test_the_private_modules_examples_run():
    subs = [m.name for m in pkgutil.iter_modules(ir.__path__)]
    assert set(subs) == {"_buffers", "_rules", "_ops", "_program", "_table"}
    attempted = 0
    for name in subs:
        result = doctest.testmod(importlib.import_module(f"{ir.__name__}.{name}"))
        assert result.failed == 0, name
        attempted += result.attempted
    # the package's own run covers the re-exported names' examples as well
    package = doctest.testmod(ir)
    assert package.failed == 0 and package.attempted >= attempted + 3
