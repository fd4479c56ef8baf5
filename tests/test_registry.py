"""The schedule registry: one list of names, read by every CLI; and the kv policy enum."""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import masks, schedules
from fringe.schedules import registry

SPECS = ["ring", "zigzag", "striped", "striped:4", "balanced", "allgather", "allgather:3",
         "ulysses", "compose:zigzag+ulysses:2", "compose:allgather:3+ulysses:2",
         "compose:balanced+ulysses:2", "compose:zigzag+ring:2", "compose:ring+allgather:3:2"]


def test_every_builtin_is_registered_once_with_a_description():
    assert schedules.names() == ["ring", "zigzag", "striped", "balanced", "allgather", "ulysses"]
    for e in registry.entries():
        assert e.description and "\n" not in e.description
        assert isinstance(schedules.get(e.name), schedules.Schedule)
    # one line each (auto too: it is registered, not listed by names()) + compose
    assert registry.describe().count("\n") == len(registry.entries()) == len(schedules.names()) + 1


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
    # a pair compose() refuses is not cleared: why_not says what get() would raise
    for spec, why in (("compose:ulysses+ring:2", "outer schedule must move sequence chunks"),
                      ("compose:ring+compose:ring+ring:2:2", "cannot itself be composed")):
        assert why in registry.why_not(spec, world_size=4, heads=4, kv_heads=4)
        with pytest.raises(ValueError, match=why):
            schedules.get(spec)


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


# ---- the CLIs read the registry ---------------------------------------------------------------

@pytest.mark.parametrize("command", ["demo", "show", "bench", "predict"])
def test_cli_help_lists_every_registered_schedule(command, capsys):
    from fringe.__main__ import main
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    for name in schedules.names():
        assert f"\n  {name} " in out, (name, out)
    assert "compose:OUTER+INNER:K" in out and "allgather[:pieces]" in out


@pytest.mark.parametrize("argv", [["show", "--schedule", "spiral"],
                                  ["bench", "--schedule", "allgather:0"],
                                  ["demo", "--schedule", "compose:zigzag"],
                                  ["predict", "--schedules", "ring", "spiral"]])
def test_cli_rejects_a_bad_schedule_listing_the_valid_ones(argv, capsys):
    from fringe.__main__ import main
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "valid: ring, zigzag, striped[:stripe]" in err, err
    for name in schedules.names():
        assert name in err


@pytest.mark.parametrize("argv, spec", [
    (["bench", "--schedule", "compose:zigzag+ulysses:2"], "compose:zigzag+ulysses:2"),
    (["bench", "--schedule", "allgather:4"], "allgather:4"),
    (["bench", "--schedule", " allgather:2"], "allgather"),
    (["show", "--schedule", "ulysses"], "ulysses"),
    (["demo", "--schedule", "striped:8"], "striped:8")])
def test_cli_accepts_compose_and_allgather_names(argv, spec):
    from fringe.__main__ import parser
    assert parser().parse_args(argv).schedule == spec


def test_cli_show_runs_a_compose_schedule(capsys):
    from fringe.__main__ import main
    assert main(["show", "--schedule", "compose:zigzag+ulysses:2", "--world-size", "4",
                 "--seq-len", "256", "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("compose(zigzag, ulysses, inner_size=2) · causal & document") and "A2A" in out


def test_predict_is_the_cost_model_and_simulate_still_works_saying_so(capsys):
    from fringe.__main__ import DEPRECATED_SIMULATE, main, parser
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "predict (simulate)" in out and "fringe.simulate" in out and "cost model" in out
    argv = ["--world-size", "4", "--seq-len", "1024", "--block-size", "64", "--heads", "4",
            "--kv-heads", "2", "--mask", "causal", "--hardware", "h100-ib"]
    assert parser().parse_args(["predict", *argv]).schedules is None      # all that run here
    assert main(["predict", *argv, "--schedules", "zigzag"]) == 0
    new = capsys.readouterr()
    assert "zigzag" in new.out and "predict" not in new.err and "simulate" not in new.err
    assert main(["simulate", *argv, "--schedules", "zigzag"]) == 0
    old = capsys.readouterr()
    assert old.out == new.out.replace(_cpu_seconds(new.out), _cpu_seconds(old.out))
    assert DEPRECATED_SIMULATE in old.err and "python -m fringe predict" in old.err


def _cpu_seconds(table: str) -> str:
    return table.splitlines()[-2]      # the row of the one schedule: its plan/simulate seconds


# ---- check_mask's default list comes from the registry ---------------------------------------

def test_check_mask_runs_every_registered_schedule_where_it_runs():
    from fringe.testing import CHECK_MASK_SCHEDULES, check_mask
    mask = masks.causal() & masks.sliding_window(5)
    n = check_mask(mask, world_sizes=(2, 3), block_sizes=(2,))         # H=2, G=1
    # at P=2 all six and compose:zigzag+ulysses:2; at P=3 not ulysses (H % 3) nor compose
    assert n == (len(schedules.names()) + len(CHECK_MASK_SCHEDULES)) + (len(schedules.names()) - 1)
    assert "allgather" in schedules.names() and "ulysses" in schedules.names()


def test_check_mask_takes_names_and_refuses_those_that_run_nowhere():
    from fringe.testing import check_mask
    assert check_mask(masks.causal(), world_sizes=(2,), block_sizes=(2,),
                      schedules=["allgather:3", "ulysses"]) == 2
    with pytest.raises(ValueError, match=r"'ulysses' runs at none of world_sizes=\(3,\).*H % 3"):
        check_mask(masks.causal(), world_sizes=(3,), block_sizes=(2,), schedules=["ulysses"])
    with pytest.raises(ValueError, match="unknown schedule 'spiral'"):
        check_mask(masks.causal(), world_sizes=(2,), block_sizes=(2,), schedules=["spiral"])
    with pytest.raises(TypeError, match=r"list of names, e.g. \['zigzag'\]"):
        check_mask(masks.causal(), world_sizes=(2,), block_sizes=(2,), schedules="zigzag")


def test_check_mask_runs_a_per_head_mask_under_the_head_splitting_schedules():
    """ulysses and compose hand each rank a slice of heads: the mask must still see global
    head indices, which check_mask's dense comparison would catch."""
    from fringe.testing import check_mask

    def per_head(b, h, q, kv):
        return (kv <= q) & ((q - kv) <= 1 + 4 * h)
    assert check_mask(per_head, world_sizes=(2, 4), block_sizes=(2,), heads=4, kv_heads=2,
                      num_heads=4, schedules=["ulysses", "compose:zigzag+ulysses:2"]) == 4


# ---- a schedule's kind, inner size and spec are fields, never read from its name -------------

COMPOSED = ["compose:ring+ulysses:4", "compose:striped:4+ulysses:2", "compose:balanced+zigzag:2",
            "compose:allgather+striped:8:2", "compose:zigzag+balanced:2",
            "compose:striped+allgather:2"]


@pytest.mark.parametrize("text", SPECS + COMPOSED + [f"{e.name}:3" for e in registry.entries()
                                                     if e.arg])
def test_kind_inner_size_and_spec_round_trip_as_fields(text):
    from fringe.schedules.base import COMPOSE, Spec
    s = schedules.get(text)
    assert isinstance(s.spec, Spec) and str(s.spec) == registry.spec(s) == text
    again = schedules.get(str(s.spec))
    assert (again.kind, again.inner_size, again.spec, again.name) == \
        (s.kind, s.inner_size, s.spec, s.name)
    if text.startswith(COMPOSE + ":"):
        assert s.kind == COMPOSE and s.inner_size == int(text.rsplit(":", 1)[1])
        assert str(s.spec.outer) + "+" + str(s.spec.inner) in text
        assert schedules.collectives.inner_size_of(s) == s.inner_size
    else:
        assert s.kind == s.spec.name == text.split(":")[0] and s.inner_size is None


def test_every_builtin_constructor_sets_its_kind():
    made = {"ring": schedules.ring(), "zigzag": schedules.zigzag(), "striped": schedules.striped(8),
            "balanced": schedules.balanced(), "allgather": schedules.allgather(3),
            "ulysses": schedules.ulysses(),
            "compose": schedules.compose(schedules.zigzag(), schedules.ulysses(), inner_size=2),
            "auto": schedules.auto()}
    assert {s.kind for s in made.values()} | {"user"} == set(schedules.base.KINDS)
    for kind, s in made.items():
        assert s.kind == kind
    assert [k for k, s in made.items() if not s.moves_sequence] == ["ulysses", "compose", "auto"]
    mine = schedules.Schedule("mine", layout=fringe.layout.contiguous, hops=schedules.ring_hops)
    assert (mine.kind, mine.inner_size, mine.spec, mine.moves_sequence) == ("user", None, None, True)


@pytest.mark.parametrize("name", ["zigzag", "striped(4)", "allgather(3)", "ulysses",
                                  "compose(zigzag, ulysses, inner_size=2)", "compose(x)"])
def test_a_user_schedule_named_like_a_builtin_is_not_taken_for_one(name):
    """On main these were read from the name: registry.spec() printed 'zigzag' / 'striped:4'
    for hand-made schedules, compose() refused a user outer named 'compose(x)', and a user
    ring named 'ulysses' inside compose() ran as Ulysses (its own programs ignored)."""
    from fringe.ops import reference
    from fringe.runtime.engine import head_splits
    from fringe.testing import make_qkv, tolerances
    user = schedules.Schedule(name, layout=fringe.layout.contiguous, hops=schedules.ring_hops)
    assert user.kind == "user" and user.inner_size is None and user.moves_sequence
    with pytest.raises(ValueError, match="not built by a registered name"):
        registry.spec(user)
    mask = masks.causal()
    q, k, v = make_qkv(B=1, H=4, G=2, S=32, D=4, seed=2)
    ref, _ = reference.attention(q, k, v, mask_mod=mask)
    for s, splits in ((schedules.compose(user, schedules.ulysses(), inner_size=2), (2,)),
                      (schedules.compose(schedules.zigzag(), user, inner_size=2), ())):
        assert s.kind == "compose" and s.inner_size == 2 and s.spec is None
        p = fringe.plan(s, mask, seq_len=32, world_size=4, block_size=2)
        assert head_splits(p) == splits          # a user inner is a sequence schedule (a double ring)
        torch.testing.assert_close(fringe.simulate.attention(q, k, v, plan=p), ref,
                                   **tolerances(torch.float64))


@pytest.mark.parametrize("kw, says", [
    (dict(kind="spiral"), "kind must be one of"), (dict(kind="compose"), "inner_size"),
    (dict(inner_size=2), "inner_size"), (dict(kind="compose", inner_size=0), "inner_size"),
    (dict(spec="zigzag"), "spec must be")])
def test_schedule_fields_are_checked(kw, says):
    with pytest.raises((ValueError, TypeError), match=says):
        schedules.Schedule("s", layout=fringe.layout.contiguous, hops=schedules.ring_hops, **kw)


def test_a_registered_factory_gets_its_spec_and_loses_it_when_unregistered():
    schedules.register("fast", schedules.zigzag, description="zigzag, by another name")
    try:
        s = schedules.get("fast")
        assert (s.kind, registry.spec(s), registry.canonical("fast")) == ("zigzag", "fast", "fast")
        assert registry.spec(schedules.get("compose:fast+ulysses:2")) == "compose:fast+ulysses:2"
    finally:
        registry.unregister("fast")
    with pytest.raises(ValueError, match="'fast' no longer registered"):
        registry.spec(s)
    with pytest.raises(TypeError, match="takes a Schedule"):
        registry.spec("zigzag")
