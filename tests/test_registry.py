"""The schedule registry: one list of names, read by every CLI; and the kv policy enum."""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.schedules import registry

SPECS = ["ring", "zigzag", "striped", "striped:4", "balanced", "allgather", "allgather:3",
         "ulysses", "compose:zigzag+ulysses:2", "compose:allgather:3+ulysses:2",
         "compose:balanced+ulysses:2"]


def test_every_builtin_is_registered_once_with_a_description():
    assert schedules.names() == ["ring", "zigzag", "striped", "balanced", "allgather", "ulysses"]
    for e in registry.entries():
        assert e.description and "\n" not in e.description
        assert isinstance(schedules.get(e.name), schedules.Schedule)
    assert registry.describe().count("\n") == len(schedules.names())   # one line each + compose


@pytest.mark.parametrize("spec", SPECS)
def test_every_spec_builds_a_plan_that_matches_dense_attention(spec):
    from fringe.ops import reference
    from fringe.testing import make_qkv, tolerances
    mask = masks.causal()
    p = fringe.plan(schedules.get(spec), mask, seq_len=32, world_size=4, block_size=2)
    q, k, v = make_qkv(B=1, H=4, G=2, S=32, D=4, seed=3)
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=mask)
    torch.testing.assert_close(out, ref, **tolerances(torch.float64))


@pytest.mark.parametrize("spec", SPECS)
def test_specs_round_trip(spec):
    sched = schedules.get(spec)
    assert registry.spec(sched) == spec
    assert schedules.get(registry.spec(sched)).name == sched.name
    assert registry.canonical(f"  {spec} ") == spec


def test_defaults_have_one_spelling():
    assert registry.canonical("allgather:2") == "allgather"
    assert schedules.get("allgather:2").name == "allgather"


def test_a_schedule_passes_through_get():
    s = schedules.zigzag()
    assert schedules.get(s) is s


@pytest.mark.parametrize("bad, says", [
    ("rng", "unknown schedule 'rng'"), ("ring:2", "takes no ':' argument"),
    ("allgather:0", "pieces must be a positive integer"), ("allgather:x", "got 'x'"),
    ("compose:zigzag", "compose:OUTER+INNER:K"), ("compose:zigzag+ulysses", "compose:OUTER+INNER:K"),
    ("compose:zigzag+ulysses:0", "must be a positive integer"), ("", "unknown schedule ''")])
def test_bad_names_raise_listing_the_valid_ones(bad, says):
    with pytest.raises(ValueError) as e:
        schedules.get(bad)
    assert says in str(e.value)
    for name in schedules.names():
        assert name in str(e.value)


def test_compose_raises_for_pairs_it_does_not_support():
    with pytest.raises(ValueError, match="outer schedule"):
        schedules.get("compose:ulysses+ulysses:2")


def test_get_rejects_other_types():
    with pytest.raises(TypeError, match="a name such as 'zigzag' or a Schedule"):
        schedules.get(3)


def test_which_schedules_run_here():
    assert "ulysses" in schedules.names(world_size=2, heads=2, kv_heads=1)
    assert "ulysses" not in schedules.names(world_size=3, heads=2, kv_heads=1)
    assert "ulysses" not in schedules.names(world_size=4, heads=8, kv_heads=3)
    assert "ulysses" in schedules.names(world_size=4, heads=8, kv_heads=2)    # P % G == 0
    assert schedules.names(world_size=3) == schedules.names()   # H unknown: not checked
    assert registry.why_not("compose:zigzag+ulysses:2", world_size=4, heads=2, kv_heads=1) is None
    assert "multiple of 2" in registry.why_not("compose:zigzag+ulysses:2", world_size=3)
    assert "H % 4 == 0" in registry.why_not("compose:ring+ulysses:4", world_size=4, heads=2)


def test_the_constraints_agree_with_planning_and_running():
    """A spec why_not clears runs; one it rejects fails with the same rule when run."""
    from fringe.testing import make_qkv
    for P, H, G in ((2, 2, 1), (3, 2, 1), (4, 4, 2), (4, 2, 2), (4, 4, 3)):
        q, k, v = make_qkv(B=1, H=H, G=G, S=48, D=2, seed=0) if H % G == 0 else (None,) * 3
        if q is None:
            continue
        for spec in ("ulysses", "compose:ring+ulysses:2"):
            reason = registry.why_not(spec, world_size=P, heads=H, kv_heads=G)
            try:
                p = fringe.plan(schedules.get(spec), masks.causal(), seq_len=48, world_size=P,
                                block_size=2)
                fringe.simulate.attention(q, k, v, plan=p)
                ran = True
            except ValueError:
                ran = False
            assert ran == (reason is None), (spec, P, H, G, reason)


def test_register_a_user_schedule():
    def mine():
        return schedules.Schedule("mine", layout=fringe.layout.contiguous,
                                  hops=schedules.ring_hops)
    schedules.register("mine", mine, description="my ring",
                       constraint=lambda *, world_size=None, **_: (
                           "even P only" if world_size and world_size % 2 else None))
    try:
        assert "mine" in schedules.names()
        assert schedules.get("mine").name == "mine"
        assert registry.spec(schedules.get("mine")) == "mine"
        assert "mine" not in schedules.names(world_size=3)
        assert schedules.get("compose:mine+ulysses:2").name == \
            "compose(mine, ulysses, inner_size=2)"
        with pytest.raises(ValueError, match="already registered"):
            schedules.register("mine", mine, description="again")
        schedules.register("mine", mine, description="again", replace=True)
    finally:
        registry.unregister("mine")
    assert "mine" not in schedules.names()


@pytest.mark.parametrize("name, kw, err, says", [
    ("Ring", {}, ValueError, "lower case"), ("compose", {}, ValueError, "not 'compose'"),
    ("a:b", {}, ValueError, "lower case"), ("zigzag", {}, ValueError, "already registered"),
    ("ok", {"factory": 3}, TypeError, "callable"), ("ok", {"description": ""}, ValueError,
                                                     "one non-empty line")])
def test_register_rejects_bad_input(name, kw, err, says):
    args = dict(factory=schedules.ring, description="d") | kw
    with pytest.raises(err, match=says):
        schedules.register(name, args.pop("factory"), **args)
    assert name not in schedules.names() or name == "zigzag"


def test_builtins_cannot_be_replaced_or_removed():
    with pytest.raises(ValueError, match="already registered"):
        schedules.register("ring", schedules.ring, description="d", replace=True)
    with pytest.raises(ValueError, match="built-in"):
        registry.unregister("ring")


def test_spec_of_a_hand_made_schedule_says_how_to_register_it():
    s = schedules.Schedule("hand", layout=fringe.layout.contiguous, hops=schedules.ring_hops)
    with pytest.raises(ValueError, match="register"):
        registry.spec(s)


def test_registry_doctest():
    import doctest
    result = doctest.testmod(registry, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted >= 3 and result.failed == 0


# ---- the kv memory policy -------------------------------------------------------------------

def test_kv_policy_is_a_string_enum_with_todays_values():
    from fringe import KVPolicy
    assert KVPolicy is schedules.KVPolicy
    assert [m.value for m in KVPolicy] == list(schedules.KV_MODES)
    assert KVPolicy.RESEND == "resend" and KVPolicy.KEEP == "keep"
    assert f"{KVPolicy.KEEP}" == "keep" and "kv=" + KVPolicy.KEEP == "kv=keep"
    assert KVPolicy.parse("keep") is KVPolicy.KEEP
    assert KVPolicy.parse(KVPolicy.RESEND) is KVPolicy.RESEND


@pytest.mark.parametrize("bad", ["Keep", "resent", "", None, 1, ("keep",)])
def test_kv_policy_parse_lists_the_valid_values(bad):
    from fringe import KVPolicy
    with pytest.raises(ValueError) as e:
        KVPolicy.parse(bad)
    assert "'resend', 'keep'" in str(e.value) and repr(bad) in str(e.value)


@pytest.mark.parametrize("policy", ["resend", "keep"])
def test_a_plan_takes_the_enum_or_its_string_alike(policy):
    """The member and its string give the same plan (same digest) and the same gradients."""
    from fringe import KVPolicy
    from fringe.testing import make_qkv
    mask = masks.causal()
    kw = dict(seq_len=32, world_size=4, block_size=2)
    a = fringe.plan(schedules.zigzag(), mask, kv=policy, **kw)
    b = fringe.plan(schedules.zigzag(), mask, kv=KVPolicy.parse(policy), **kw)
    assert a.digests() == b.digests() and a.backward == b.backward
    grads = []
    for p in (a, b):
        q, k, v = make_qkv(B=1, H=2, G=1, S=32, D=4, seed=5, requires_grad=True)
        fringe.simulate.attention(q, k, v, plan=p).square().sum().backward()
        grads.append((q.grad, k.grad, v.grad))
    for x, y in zip(*grads):
        assert torch.equal(x, y)
