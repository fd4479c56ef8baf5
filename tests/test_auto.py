"""schedules.auto(): fringe.plan chooses the schedule with the cost model, deterministically,
among the candidates that can run, and says why (plan.explain())."""
from __future__ import annotations

import copy
import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import fringe
from fringe import _auto, masks, render, schedules
from fringe.cost.hardware import Shape, get_hardware
from fringe.ops import reference
from fringe.schedules import registry
from fringe.testing import make_qkv, tolerances

PLAN_MODULE = sys.modules["fringe.plan"]      # the module (fringe.plan is the function)
S, P, BS = 1024, 4, 32
DOCS = torch.repeat_interleave(torch.arange(5), torch.tensor([320, 64, 256, 192, 192]))
MASKS = {"causal": masks.causal(), "documents": masks.causal() & masks.document(DOCS)}


def _planned(choice) -> list[str]:
    return [c.name for c in choice.candidates if c.step_s is not None]


def test_module_docstring_runs():
    import doctest
    module = sys.modules["fringe.schedules.auto"]       # schedules.auto is the function
    result = doctest.testmod(module, extraglobs=dict(fringe=fringe, masks=masks,
                                                     schedules=schedules, render=render))
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize("mask", sorted(MASKS))
def test_the_pick_is_the_argmin_of_what_explain_lists(mask):
    p = fringe.plan(schedules.auto(hardware="h100-ib"), MASKS[mask], seq_len=S, world_size=P,
                    block_size=BS)
    choice = p.choice
    ran = [c for c in choice.candidates if c.step_s is not None]
    best = min(c.step_s for c in ran)
    assert choice.winner == min(c.name for c in ran if c.step_s <= best * (1 + _auto.TIE))
    # the plan is the winner's: the same plan fringe.plan(<winner>) makes
    again = fringe.plan(schedules.get(choice.winner), MASKS[mask], seq_len=S, world_size=P,
                        block_size=BS)
    assert p.fingerprint() == again.fingerprint() and p.schedule.name == again.schedule.name
    # what explain() prints: every planned candidate once, fastest first, the winner on top
    text = p.explain()
    lines = text.splitlines()
    sep = next(i for i, line in enumerate(lines) if line.startswith("---"))
    rows = [line.split() for line in lines[sep + 1:sep + 1 + len(ran)]]
    assert sorted(r[0] for r in rows) == sorted(_planned(choice))
    assert rows[0][0] == choice.winner and rows[0][-1] == "chosen"
    printed = [float(r[1]) for r in rows]
    assert printed == sorted(printed) and printed[0] == min(printed)
    assert f"{min(c.step_s for c in ran) * 1e3:.4g}" == rows[0][1]
    assert "GPU presets never checked on a GPU" in text and "why: least predicted" in text


def test_ties_within_1e_9_go_to_the_first_name():
    # documents that never cross a rank: ring, balanced, zigzag, allgather, ... predict alike
    ids = torch.repeat_interleave(torch.arange(8), S // 8)
    p = fringe.plan(schedules.auto(hardware="h100-ib"), masks.causal() & masks.document(ids),
                    seq_len=S, world_size=P, block_size=BS)
    tied = [c.name for c in p.choice.candidates if c.step_s is not None
            and c.step_s <= min(x.step_s for x in p.choice.candidates if x.step_s) * (1 + 1e-9)]
    assert len(tied) > 1 and p.choice.winner == min(tied)
    assert "ties go to the first by name" in p.explain()


def test_a_copy_of_a_preset_chooses_as_the_preset_does():
    """A preset that crossed a process boundary (pickled to a launched rank) or was copied is
    the same constants: it must predict for the preset's shape and pick what the name picks
    (an identity test made the copy predict for calibrate()'s CPU shape and pick another)."""
    import pickle
    for name in ("h100-ib", "cpu"):
        hw = get_hardware(name)
        picks = [fringe.plan(schedules.auto(hardware=h), masks.causal(), seq_len=8192,
                             world_size=8, block_size=256).choice
                 for h in (name, pickle.loads(pickle.dumps(hw)), copy.deepcopy(hw))]
        for c in picks[1:]:
            assert (c.winner, c.shape, c.shape_from, c.source) == (
                picks[0].winner, picks[0].shape, picks[0].shape_from, picks[0].source)
        assert "calibration shape of preset" in picks[0].shape_from


def test_explain_marks_as_ties_only_the_candidates_that_tied():
    """A tie is within TIE of the least prediction (the rule the pick used); explain() marked
    a candidate within TIE of a winner that was itself a tie above the least, which had not
    tied, as '(tie)', and printed '+-0.0%' for a tied one faster than the winner."""
    def cand(name, step):
        return _auto.Candidate(name, step_s=step, forward_s=step / 2, backward_s=step / 2,
                               forward_bytes=0.0, balance=1.0, memory_bytes=1.0)
    rows = (cand("zz", 1.0), cand("aa", 1.0 + 0.9e-9), cand("bb", 1.0 + 1.5e-9))
    tied = sorted(c.name for c in rows if c.step_s <= 1.0 * (1 + _auto.TIE))
    assert tied == ["aa", "zz"]
    choice = _auto.Choice("aa", rows, get_hardware("cpu"), _auto.CALIBRATION_SHAPES["cpu"],
                          "given", "test", _auto._why("aa", tied, list(rows)))
    lines = {line.split()[0]: line for line in choice.table().splitlines()
             if line.split() and line.split()[0] in ("aa", "bb", "zz")}
    assert lines["zz"].endswith("(tie)") and "+-" not in lines["zz"]
    assert not lines["bb"].endswith("(tie)") and lines["aa"].endswith("chosen")


_CHILD = """
import torch, fringe
from fringe import masks, schedules
ids = torch.repeat_interleave(torch.arange(5), torch.tensor([320, 64, 256, 192, 192]))
for m in (masks.causal(), masks.causal() & masks.document(ids)):
    p = fringe.plan(schedules.auto(), m, seq_len=1024, world_size=4, block_size=32)
    print(p.choice.winner, p.fingerprint())
    for c in p.choice.candidates:
        print(c.name, repr(c.step_s), repr(c.forward_bytes), repr(c.balance), c.excluded)
"""


def test_deterministic_across_processes_and_hash_seeds():
    outs = []
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout)
    assert outs[0] == outs[1] and outs[0].count("\n") > 10
    # and this process chooses the same, with the same plan
    p = fringe.plan(schedules.auto(), MASKS["causal"], seq_len=S, world_size=P, block_size=BS)
    assert outs[0].splitlines()[0] == f"{p.choice.winner} {p.fingerprint()}"


def test_only_candidates_that_can_run_are_planned(monkeypatch):
    simulated = []
    real = _auto.simulate
    monkeypatch.setattr(_auto, "simulate", lambda p, *a, **k: simulated.append(k["name"]) or
                        real(p, *a, **k))
    # H=6 at P=4: ulysses cannot split 6 heads 4 ways; compose with K=2 can; K=4 is P (absent)
    p = fringe.plan(schedules.auto(), MASKS["causal"], seq_len=S, world_size=P, block_size=BS,
                    num_heads=6)
    ran = ["ring", "zigzag", "striped", "balanced", "allgather", "compose:zigzag+ulysses:2",
           "compose:zigzag+zigzag:2", "compose:ring+ulysses:2", "compose:ring+zigzag:2",
           "compose:balanced+ulysses:2", "compose:balanced+zigzag:2"]
    assert _planned(p.choice) == simulated == ran
    excluded = {c.name: c.excluded for c in p.choice.candidates if c.step_s is None}
    assert list(excluded) == ["ulysses"] and "H % 4 == 0, got H=6" in excluded["ulysses"]
    assert p.choice.shape.heads == 6 and "H=G=6" in p.choice.shape_from
    assert p.num_heads == 6
    # P=2: no compose form (K must be below P); H=8 of the cpu preset's shape: ulysses runs
    p2 = fringe.plan(schedules.auto(), MASKS["causal"], seq_len=S, world_size=2, block_size=BS)
    assert _planned(p2.choice) == list(_auto.SINGLE)
    # a size the zigzag layout refuses is listed with the planner's reason, never planned
    p3 = fringe.plan(schedules.auto(candidates=["ring", "zigzag"]), MASKS["causal"],
                     seq_len=192, world_size=2, block_size=32)
    assert p3.choice.winner == "ring" and "pad the sequence" in dict(
        (c.name, c.excluded) for c in p3.choice.candidates)["zigzag"]


def test_reuse_plans_exactly_one_schedule_and_no_search(monkeypatch):
    first = fringe.plan(schedules.auto(), MASKS["documents"], seq_len=S, world_size=P,
                        block_size=BS)
    planned, simulated = [], []
    real_plan, real_sim = PLAN_MODULE.plan, _auto.simulate

    def counting_plan(schedule, *args, **kwargs):
        planned.append(registry.spec(schedule))
        return real_plan(schedule, *args, **kwargs)
    monkeypatch.setattr(PLAN_MODULE, "plan", counting_plan)
    monkeypatch.setattr(_auto, "simulate", lambda *a, **k: simulated.append(1) or real_sim(*a, **k))
    ids = DOCS.roll(64)                                  # the next batch: other documents
    m = masks.causal() & masks.document(ids)
    p = real_plan(schedules.auto(reuse=first), m, seq_len=S, world_size=P, block_size=BS)
    assert planned == [first.choice.winner] and simulated == []
    assert p.schedule.name == first.schedule.name and p.choice.reused == first.choice.winner
    assert p.fingerprint() == real_plan(first.schedule, m, seq_len=S, world_size=P,
                                        block_size=BS).fingerprint()
    assert "reused the choice of an earlier plan" in p.explain()
    planned.clear()                                      # a full search plans every candidate
    full = real_plan(schedules.auto(), m, seq_len=S, world_size=P, block_size=BS)
    assert planned == _planned(full.choice) and len(planned) == 12


def test_a_reused_choice_says_which_call_its_table_predicted_for():
    """auto(reuse=) for another mask and length prints the earlier search's table and why
    under the new plan's title: explain() says they were predicted for the earlier call (the
    one that searched, through a chain of reuses), not for this one."""
    first = fringe.plan(schedules.auto(), masks.causal(), seq_len=S, world_size=P,
                        block_size=BS)
    then = masks.sliding_window(64)
    again = fringe.plan(schedules.auto(reuse=first), then, seq_len=2 * S, world_size=P,
                        block_size=BS)
    twice = fringe.plan(schedules.auto(reuse=again), then, seq_len=2 * S, world_size=P,
                        block_size=BS)
    searched = f"causal · S={S} P={P} block={BS}"
    for p in (again, twice):
        text = p.explain()
        assert f"S={2 * S} P={P}" in text.splitlines()[0]
        assert f"the table and why are that search's, predicted for {searched}" in text


@pytest.mark.parametrize("mask", ["causal", "documents"])
def test_the_auto_plan_computes_dense_attention_exactly(mask):
    m = masks.causal() if mask == "causal" else masks.causal() & masks.document(DOCS[::4])
    p = fringe.plan(schedules.auto(), m, seq_len=256, world_size=P, block_size=8, num_heads=4)
    assert p.choice is not None
    q, k, v = make_qkv(B=1, H=4, G=2, S=256, D=8, seed=7)
    out = fringe.simulate.attention(q, k, v, plan=p)
    ref, _ = reference.attention(q, k, v, mask_mod=m)
    torch.testing.assert_close(out, ref, **tolerances(torch.float64))


def test_auto_through_the_registry():
    s = schedules.get("auto")
    assert s.kind == "auto" and not s.moves_sequence and registry.spec(s) == "auto"
    assert registry.canonical(" auto ") == "auto"
    assert "auto" not in schedules.names()          # names() lists what runs
    assert "auto" in registry.syntax() and "\nauto " in registry.describe()
    with pytest.raises(ValueError, match="not built by a registered name"):
        registry.spec(schedules.auto(hardware="h100-ib"))   # options a spec cannot spell
    with pytest.raises(ValueError, match="takes no ':' argument"):
        schedules.get("auto:2")


def test_cli_show_and_predict_take_auto(capsys):
    from fringe.__main__ import main, parser
    assert parser().parse_args(["show", "--schedule", "auto"]).schedule == "auto"
    assert main(["show", "--schedule", "auto", "--world-size", "4", "--seq-len", "256",
                 "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    assert "schedules.auto() chose" in out and "preset 'cpu' calibrated on" in out
    assert main(["show", "--help"]) == 0 and "\n  auto " in capsys.readouterr().out
    argv = ["predict", "--world-size", "4", "--seq-len", "1024", "--block-size", "64",
            "--heads", "4", "--kv-heads", "4", "--mask", "causal", "--hardware", "h100-ib",
            "--schedules", "auto", "zigzag"]
    assert main(argv) == 0
    rows = {line.split()[0].split("=")[0]: line.split()[1]
            for line in capsys.readouterr().out.splitlines()
            if line.split() and line.split()[0].split("=")[0] in ("auto", "zigzag")}
    # auto chose on the command's hardware and shape: its row is the winner's prediction
    p = fringe.plan(schedules.auto(hardware="h100-ib", shape=Shape(heads=4, kv_heads=4)),
                    masks.causal(), seq_len=1024, world_size=4, block_size=64)
    assert float(rows["auto"]) == pytest.approx(
        min(c.step_s for c in p.choice.candidates if c.step_s) * 1e3, rel=1e-2)


def test_options_and_refusals():
    with pytest.raises(ValueError, match="'this' calibrates the machine each rank runs on"):
        schedules.auto(hardware="this")
    with pytest.raises(ValueError, match="non-empty list"):
        schedules.auto(candidates=[])
    with pytest.raises(ValueError, match="other than auto"):
        schedules.auto(candidates=["zigzag", "auto"])
    with pytest.raises(ValueError, match="give reuse= alone"):
        schedules.auto(reuse=fringe.plan(schedules.ring(), None, seq_len=64, world_size=2,
                                                   block_size=8),
                       hardware="h100-ib")
    with pytest.raises(ValueError, match="takes a plan"):
        schedules.auto(reuse=schedules.zigzag())
    marker = schedules.auto()
    with pytest.raises(ValueError, match="marker that fringe.plan resolves"):
        marker.programs(2)
    with pytest.raises(ValueError, match="must move sequence chunks"):
        schedules.compose(marker, schedules.ulysses(), inner_size=2)
    base = fringe.plan(schedules.ring(), masks.causal(), seq_len=64, world_size=2, block_size=8)
    with pytest.raises(ValueError, match="does not plan over a given layout"):
        fringe.plan(marker, masks.causal(), seq_len=64, world_size=2, layout=base.layout)
    with pytest.raises(ValueError, match="was not chosen by schedules.auto"):
        base.explain()
    with pytest.raises(ValueError, match="H=8 but fringe.plan\\(num_heads=4\\)"):
        fringe.plan(schedules.auto(shape=Shape(heads=8, kv_heads=8)), masks.causal(),
                    seq_len=64, world_size=2, block_size=8, num_heads=4)
    with pytest.raises(ValueError, match="no candidate could be planned; the first, ring"):
        fringe.plan(schedules.auto(), masks.causal(), seq_len=100, world_size=2, block_size=32)
    p = fringe.plan(schedules.auto(), masks.causal(), seq_len=64, world_size=2, block_size=8)
    assert base.choice is None and copy.deepcopy(p).choice is None     # kept in plan.cache


def test_candidates_may_be_given_and_a_hand_made_schedule_competes():
    from fringe import layout
    mine = schedules.Schedule("mine", layout=layout.contiguous, hops=schedules.ring_hops)
    p = fringe.plan(schedules.auto(candidates=[mine, "zigzag", schedules.striped(4)]),
                    MASKS["causal"], seq_len=S, world_size=P, block_size=BS)
    assert [c.name for c in p.choice.candidates] == ["mine", "zigzag", "striped:4"]
    assert p.choice.winner == "zigzag"       # ring-like "mine" is unbalanced on causal


def test_a_candidate_listed_twice_is_refused_naming_it():
    """Plans and ties are kept by name: a hand-made schedule named like a listed one (or one
    listed twice) made the search lose the winner's plan (KeyError) or keep the wrong one."""
    from fringe import layout
    mine = schedules.Schedule("zigzag", layout=layout.contiguous, hops=schedules.ring_hops)
    for given in (["zigzag", mine], [mine, "zigzag"], ["ring", schedules.ring()]):
        with pytest.raises(ValueError, match="more than once"):
            fringe.plan(schedules.auto(candidates=given), MASKS["causal"], seq_len=S,
                        world_size=P, block_size=BS)


def test_candidates_over_the_presets_memory_cannot_run():
    # the same search with no memory limit, then with a limit below the unlimited winner's
    # predicted peak: what is over it is listed as unable to run and never picked
    # (H=G=8, D=64, float32: a shape where the winner is not the leanest candidate; a replaced
    # preset otherwise keeps the preset's shape)
    hw = dataclasses.replace(get_hardware("h100-ib"), name="roomy", memory_bytes=None,
                             shape=_auto.OWN_SHAPE)
    free = fringe.plan(schedules.auto(hardware=hw), MASKS["causal"], seq_len=S, world_size=P,
                       block_size=BS).choice
    mem = {c.name: c.memory_bytes for c in free.candidates if c.step_s is not None}
    assert min(mem.values()) < mem[free.winner]
    limit = (min(mem.values()) + mem[free.winner]) / 2          # the winner cannot stay
    tiny = dataclasses.replace(hw, name="tiny", memory_bytes=limit)
    p = fringe.plan(schedules.auto(hardware=tiny), MASKS["causal"], seq_len=S, world_size=P,
                    block_size=BS)
    fits = {n for n, m in mem.items() if m <= limit}
    assert {c.name for c in p.choice.candidates if c.runs} == fits
    for c in p.choice.candidates:                  # the same predictions, memory aside
        assert c.step_s == next(f.step_s for f in free.candidates if f.name == c.name)
        if c.name not in fits:
            assert "over the" in c.excluded and "of hardware 'tiny'" in c.excluded
    best = min(c.step_s for c in p.choice.candidates if c.runs)
    assert p.choice.winner == min(c.name for c in p.choice.candidates
                                  if c.runs and c.step_s <= best * (1 + _auto.TIE))
    assert p.choice.winner in fits and p.schedule.name == schedules.get(p.choice.winner).name
    text = p.explain()
    assert "cannot run here:" in text and f"  {free.winner}: predicted" in text
    assert f"(memory: {limit / 1e9:.4g} GB per rank)" in text
    with pytest.raises(ValueError, match="no candidate fits in the memory of hardware 'none'"):
        fringe.plan(schedules.auto(hardware=dataclasses.replace(hw, name="none",
                                                                memory_bytes=1.0)),
                    MASKS["causal"], seq_len=S, world_size=P, block_size=BS)


def _two_kinds(weights):
    """Plans of causal and sliding-window(64) layers over one layout (what fringe.hf.plans
    does for a model with both kinds), chosen by resolve_kinds with these layer counts."""
    kinds = [masks.causal(), masks.sliding_window(64)]

    def plan_kinds(s):
        out, lay = [], None
        for m in kinds:
            out.append(fringe.plan(s, m, seq_len=S, world_size=P, block_size=BS, layout=lay))
            lay = out[-1].layout
        return out
    return _auto.resolve_kinds(schedules.auto(hardware="h100-ib"), plan_kinds,
                               list(zip(("causal", "window64"), weights)), world_size=P,
                               num_heads=None)


def _weighted_argmin(choice) -> str:
    ran = [c for c in choice.candidates if c.runs]
    for c in ran:        # the step it reports is the layer-weighted sum of the parts it reports
        assert c.step_s == sum(n * x for (_, n), x in zip(choice.kinds, c.parts))
    best = min(c.step_s for c in ran)
    return min(c.name for c in ran if c.step_s <= best * (1 + _auto.TIE))


def test_layer_kinds_get_one_schedule_weighted_by_layer_count():
    picks = {}
    for weights in ((1, 1), (50, 1)):
        ps = _two_kinds(weights)
        choice = ps[0].choice
        assert all(p.choice is choice for p in ps) and choice.kinds == (
            ("causal", weights[0]), ("window64", weights[1]))
        assert choice.winner == _weighted_argmin(choice)
        assert len({p.layout.fingerprint() for p in ps}) == 1
        assert {p.schedule.name for p in ps} == {schedules.get(choice.winner).name}
        picks[weights] = choice.winner
        again = _two_kinds(weights)[0].choice          # deterministic: the same rows again
        assert again.candidates == choice.candidates and again.winner == choice.winner
    # the weighting decides: ring keeps the window layer cheap, but 50 causal layers favour a
    # balanced layout (measured on h100-ib: ring at 1:1, compose:zigzag+zigzag:2 at 50:1)
    assert picks[(1, 1)] != picks[(50, 1)]
    text = _two_kinds((50, 1))[0].explain()
    assert "step = 50 x causal + 1 x window64" in text and "causal ms" in text


def test_hf_plans_take_auto_one_schedule_for_every_layer_kind(monkeypatch):
    transformers = pytest.importorskip("transformers")
    import fringe.hf
    from fringe import packing
    kw = dict(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              attention_dropout=0.0, use_cache=False, head_dim=8)
    cfg = transformers.Qwen2Config(**kw, use_sliding_window=True, sliding_window=32,
                                   layer_types=["sliding_attention"] + ["full_attention"] * 3)
    cfg._attn_implementation = "fringe"
    fringe.hf.register()
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    mask = packing.document_mask(packing.doc_ids_from_cu_seqlens([0, 100, 256]))
    args = dict(seq_len=256, world_size=P, block_size=16, num_heads=4)
    plans = fringe.hf.plans(model, schedules.auto(hardware="h100-ib"), mask, **args)
    choice = plans.choice
    assert choice.kinds == (("causal", 3), ("window32", 1))
    assert choice.winner == _weighted_argmin(choice)
    assert all(lp.plan.choice is choice for lp in plans.layers)
    # the plans are the winner's: what fringe.hf.plans(<winner>) makes, layer by layer
    fixed = fringe.hf.plans(model, schedules.get(choice.winner), mask, **args)
    assert [lp.plan.fingerprint() for lp in plans.layers] == [
        lp.plan.fingerprint() for lp in fixed.layers]
    assert "step = 3 x causal + 1 x window32" in plans.explain()
    # the next batch: one schedule planned for every kind, no search
    planned = []
    real = fringe.hf._plan
    monkeypatch.setattr(fringe.hf, "_plan", lambda s, *a, **k: planned.append(s.name) or
                        real(s, *a, **k))
    again = fringe.hf.plans(model, schedules.auto(reuse=plans), mask, **args)
    assert planned == [plans.schedule.name] * 2 and again.choice.reused == choice.winner
    with pytest.raises(ValueError, match="fringe.hf.plans: schedules.auto\\(\\) chooses the "
                                         "schedule and its layout"):
        fringe.hf.plans(model, schedules.auto(), mask, layout=fixed.layout, **args)
    # a length every rank holds whole blocks of is kept (zigzag's 2P chunks refuse 48 and are
    # listed so); one that is not whole blocks is padded as for any schedule
    two = schedules.auto(candidates=["ring", "zigzag"])
    kept = fringe.hf.plans(model, two, None, seq_len=48, world_size=2, block_size=8)
    assert kept.real_len is None and kept.choice.winner == "ring"
    assert "pad the sequence" in dict((c.name, c.excluded) for c in kept.choice.candidates)[
        "zigzag"]
    padded = fringe.hf.plans(model, two, None, seq_len=40, world_size=2, block_size=8)
    assert (padded.real_len, padded.layout.seq_len) == (40, 64)
