"""Explicit contracts: a frozen plan holds its fields and nothing else (derived state lives in
its one ``PlanCache``), and the runtime, the custom ops and autograd read a plan through
``PlanLike``: those members, and no others."""
from __future__ import annotations

import ast
import copy
import dataclasses
import pathlib
import pickle

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe._handle import new_handle
from fringe.cost.simulate import simulate
from fringe.ops import reference
from fringe.plan import PlanCache, PlanLike
from fringe.runtime import engine
from fringe.testing import make_qkv, tolerances

S, P, BS = 32, 4, 2
FIELDS = {f.name for f in dataclasses.fields(fringe.Plan)}


def causal_mod(b, h, q_idx, kv_idx):
    """A module-level mask (picklable, unlike the factories' closures)."""
    return kv_idx <= q_idx


def _plan(spec: str, mask=None) -> fringe.Plan:
    return fringe.plan(schedules.get(spec), masks.causal() if mask is None else mask,
                       seq_len=S, world_size=P, block_size=BS)


def _run(plan, seed: int = 0):
    """Virtual forward and backward: (out, dq, dk, dv), float64."""
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=4, seed=seed, requires_grad=True)
    out = fringe.simulate.attention(q, k, v, plan=plan)
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


# ---- derived state: in plan.cache, never in the frozen plan's __dict__ ------------------------

@pytest.mark.parametrize("spec", ["zigzag", "allgather", "compose:zigzag+ulysses:2"])
def test_a_plan_holds_only_its_fields_after_plan_run_and_stats(spec):
    p = _plan(spec)
    assert set(p.__dict__) == FIELDS
    assert isinstance(p.cache, PlanCache) and p.cache.guarded           # guarded when built
    got = _run(p)
    p.stats()
    p.fingerprint()
    p.tile_blocks(0, 1)
    p.positions(2)
    simulate(p, "cpu")
    assert set(p.__dict__) == FIELDS, sorted(set(p.__dict__) - FIELDS)
    c = p.cache                      # every entry filled by its writer, none elsewhere
    assert c.positions and c.tiles and c.tile_index is not None and c.digests is not None
    assert c.head_splits == ((2,) if spec.startswith("compose") else ())
    assert 0 in c.head_shift and "work" in c.simulate
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=4, seed=0)
    ref, _ = reference.attention(q, k, v, mask_mod=masks.causal())
    torch.testing.assert_close(got[0], ref, **tolerances(torch.float64))


def test_cache_is_not_part_of_the_value():
    a, b = _plan("zigzag"), _plan("zigzag")
    a.fingerprint()
    assert a.cache is not b.cache and b.cache.digests is None
    assert "cache" not in repr(a)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.cache = PlanCache()


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy"])
def test_copies_and_pickles_are_equal_plans_with_their_own_cache(how):
    p = fringe.plan(schedules.zigzag(), causal_mod, seq_len=S, world_size=P, block_size=BS)
    want = _run(p)
    other = {"pickle": lambda x: pickle.loads(pickle.dumps(x)), "copy": copy.copy,
             "deepcopy": copy.deepcopy}[how](p)
    assert set(other.__dict__) == FIELDS
    assert other.cache is not p.cache
    assert other.cache.positions == {} and other.cache.digests is None
    assert int(other.handle) != int(p.handle)
    assert other.fingerprint() == p.fingerprint() and other.digests() == p.digests()
    for x, y in zip(want, _run(other)):
        assert torch.equal(x, y)
    assert set(other.__dict__) == FIELDS


def test_an_edited_cached_map_is_still_caught():
    """The cache's tensors are guarded like the plan's own (its guard list lives in it too)."""
    p = _plan("zigzag")
    _run(p)
    p._tile_blocks(1, 0).fill_(0)          # a kernel that wrote into its arguments
    with pytest.raises(ValueError, match="cached tile"):
        p.check_unchanged()


# ---- PlanLike: what the runtime, the ops and autograd read ---------------------------------

def _members() -> set[str]:
    names = set(PlanLike.__annotations__)
    names |= {n for n, v in vars(PlanLike).items()
              if not n.startswith("__") and (callable(v) or isinstance(v, property))}
    return names


#: files that take a plan, and the names a plan goes by in them
READERS = {"runtime/engine.py": ("plan",), "runtime/distributed.py": ("plan",),
           "runtime/interpreter.py": ("plan",), "runtime/virtual.py": ("plan",),
           "autograd.py": ("plan",), "_attention_op.py": ("plan", "p"), "api.py": ("plan",)}


def test_plan_like_names_exactly_what_the_runtime_and_autograd_read():
    root = pathlib.Path(fringe.__file__).parent
    read = set()
    for path, names in READERS.items():
        for node in ast.walk(ast.parse((root / path).read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in names):
                read.add(node.attr)
    members = _members()
    assert read == members, (f"read but not in PlanLike: {sorted(read - members)}; "
                             f"in PlanLike but read nowhere: {sorted(members - read)}")
    assert isinstance(_plan("ring"), PlanLike)


class _OnlyPlanLike:
    """A plan seen through PlanLike only: any other attribute raises (and is recorded)."""

    def __init__(self, plan) -> None:
        object.__setattr__(self, "_plan", plan)
        object.__setattr__(self, "read", set())
        object.__setattr__(self, "refused", set())
        object.__setattr__(self, "handle", new_handle(self))     # the ops resolve to the view

    def __getattr__(self, name):
        if name in _members():
            self.read.add(name)
            return getattr(self._plan, name)
        self.refused.add(name)
        raise AttributeError(f"{name} is not a PlanLike member")


@pytest.mark.parametrize("spec", ["zigzag", "compose:zigzag+ulysses:2"])
def test_the_runtime_and_autograd_run_a_plan_through_plan_like_alone(spec):
    p = _plan(spec, mask=masks.causal() & masks.sliding_window(9))
    view = _OnlyPlanLike(p)
    assert isinstance(view, PlanLike)
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=4, seed=1, requires_grad=True)
    out = fringe.autograd.attention(q, k, v, plan=view, where="virtual")[0]
    out.square().sum().backward()
    assert view.refused == set()
    assert {"forward", "backward", "cache", "layout", "check_unchanged", "kv"} <= view.read
    want = _run_with(p, seed=1)
    assert torch.equal(out, want[0])
    for g, w in zip((q.grad, k.grad, v.grad), want[1:]):
        assert torch.equal(g, w)


def _run_with(plan, seed: int):
    q, k, v = make_qkv(B=1, H=4, G=2, S=S, D=4, seed=seed, requires_grad=True)
    out = fringe.autograd.attention(q, k, v, plan=plan, where="virtual")[0]
    out.square().sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("bad", ["zigzag", None, object()])
def test_check_inputs_refuses_what_is_not_plan_like(bad):
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    with pytest.raises(TypeError, match="plan must be a fringe.Plan from fringe.plan"):
        engine.check_inputs(q, k, v, plan=bad, local=False)
    with pytest.raises(TypeError, match="plan must be a fringe.Plan"):
        fringe.simulate.attention(q, k, v, plan=bad)


def test_check_inputs_imports_nothing_inside():
    import inspect
    tree = ast.parse(inspect.getsource(engine.check_inputs).lstrip())
    assert not [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]
