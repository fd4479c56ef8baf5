"""Ranks must agree on whether a backward follows a forward, and on which of the two they run.

A rank whose forward ran under ``torch.no_grad()`` (or with inputs that do not require grad)
records no backward; its peers that do train then wait in their backward for a rank that never
sends, until the timeout, and a rank that skips a backward another runs pairs its next forward
with that backward: both pass the agreement (same plan, same shapes) and then run programs that
do not match. The per-call agreement now carries what follows the exchange on each rank (a
forward with no backward, a forward whose backward will run, the backward), decided by the
very predicate under which autograd records the Function, so every rank raises a RankMismatch
before any attention data moves.
"""
from __future__ import annotations

import pytest
import torch

import fringe
from fringe import _attention_op as _op
from fringe import masks, schedules
from fringe.launch import Workers
from fringe.testing import make_qkv

BLOCK = 2
TIMEOUT_S = 10          # a peer that never answers ends the case in a CommTimeout, not a hang


@pytest.fixture(scope="module")
def pool2():
    with Workers(2, timeout_s=120, threads=1) as w:
        yield w


def worker_grad(rank: int, world_size: int, what: str):
    S = 2 * world_size * BLOCK * 2
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=world_size,
                    block_size=BLOCK)
    q, k, v = (p.layout.shard(t, rank) for t in make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0))

    def attn(q, k, v):
        return fringe.attention(q, k, v, plan=p, timeout_s=TIMEOUT_S)

    def loss(q, k, v):
        return attn(q, k, v).square().sum()

    def trainable():
        return [t.clone().requires_grad_() for t in (q, k, v)]

    try:
        if what == "no_grad":           # rank 1 evaluates, rank 0 trains
            if rank == 1:
                with torch.no_grad():
                    attn(*trainable())
            else:
                loss(*trainable()).backward()
        elif what == "inputs":          # grad mode on everywhere; rank 1's inputs need no grad
            if rank == 1:
                attn(q, k, v)
            else:
                loss(*trainable()).backward()
        elif what == "func.grad":       # torch.func.grad's own level decides on rank 0
            if rank == 0:
                torch.func.grad(loss)(q, k, v)
            else:
                with torch.no_grad():
                    attn(q, k, v)
        elif what == "vmap":            # vmap over inputs that require grad: the vmap rule's
            stacked = [torch.stack([t, 2 * t]) for t in (q, k, v)]    # inner call records
            if rank == 0:
                torch.func.vmap(loss)(*(t.requires_grad_() for t in stacked)).sum().backward()
            else:
                with torch.no_grad():
                    torch.func.vmap(attn)(*stacked)
        elif what == "skipped backward":    # both record; rank 1 skips the backward and goes on
            if rank == 0:
                loss(*trainable()).backward()
            else:
                loss(*trainable())      # recorded, never differentiated
                loss(*trainable())
        else:                           # the same on every rank, through each path: runs
            ref = trainable()
            loss(*ref).backward()
            want = [t.grad for t in ref]
            if what == "same func.grad":
                got = torch.func.grad(loss, argnums=(0, 1, 2))(q, k, v)
            else:                       # "same vmap": two slices, each its own gradient
                stacked = [torch.stack([t, 2 * t]).requires_grad_() for t in (q, k, v)]
                torch.func.vmap(loss)(*stacked).sum().backward()
                got = [t.grad[0] for t in stacked]
            torch.testing.assert_close(list(got), want)
            with torch.no_grad():
                attn(*trainable())
    except fringe.RankMismatch as e:    # anything else (a CommTimeout) fails the pool's run
        return f"RankMismatch: {e}"
    return "no error"


@pytest.mark.parametrize("what,ranks", [
    ("no_grad", ("a forward whose backward will run", "a forward with no backward to follow")),
    ("inputs", ("a forward whose backward will run", "a forward with no backward to follow")),
    ("func.grad", ("a forward whose backward will run", "a forward with no backward to follow")),
    ("vmap", ("a forward whose backward will run", "a forward with no backward to follow")),
    ("skipped backward", ("the backward", "a forward whose backward will run")),
])
def test_ranks_that_differ_in_whether_a_backward_follows_all_raise_before_communication(
        pool2, what, ranks):
    msgs = pool2.run(worker_grad, what)
    for me, msg in enumerate(msgs):
        assert msg.startswith("RankMismatch: rank 1 disagrees with rank 0 on what follows"), msgs
        assert f"rank 0 runs {ranks[0]}, rank 1 runs {ranks[1]}" in msg, msgs
        assert f"seen from rank {me}" in msg and "same grad mode" in msg, msgs


@pytest.mark.parametrize("what", ["same func.grad", "same vmap"])
def test_ranks_in_the_same_grad_mode_agree_through_torch_func(pool2, what):
    assert pool2.run(worker_grad, what) == ["no error", "no error"]


# -------------------------------------------------------------------------------------
# the flag the op receives is what autograd does: no process needed (the virtual mesh)
# -------------------------------------------------------------------------------------
def test_the_flag_is_true_exactly_when_the_backward_runs(monkeypatch):
    S = 16
    p = fringe.plan(schedules.zigzag(), masks.causal(), seq_len=S, world_size=2,
                    block_size=BLOCK)
    q, k, v = make_qkv(B=1, H=2, G=1, S=S, D=4, seed=0)
    flags, backwards = [], []
    forward_op, backward_op = _op.attention_op, _op.attention_backward_op

    def spy_forward(*args):
        flags.append(args[-1])          # the op's last argument: a backward follows
        return forward_op(*args)

    def spy_backward(*args):
        backwards.append(True)
        return backward_op(*args)

    monkeypatch.setattr(_op, "attention_op", spy_forward)
    monkeypatch.setattr(_op, "attention_backward_op", spy_backward)

    def attn(q, k, v):
        return fringe.simulate.attention(q, k, v, plan=p)

    def loss(q, k, v):
        return attn(q, k, v).square().sum()

    def grads(*t):
        return [x.detach().requires_grad_() for x in t]

    stacked = [torch.stack([t, 2 * t]) for t in (q, k, v)]
    cases = {
        "plain inputs": lambda: attn(q, k, v),
        "requires grad": lambda: loss(*grads(q, k, v)).backward(),
        "no_grad": lambda: torch.no_grad()(loss)(*grads(q, k, v)),
        "inference_mode": lambda: torch.inference_mode()(loss)(*grads(q, k, v)),
        "func.grad": lambda: torch.func.grad(loss)(q, k, v),
        "func.grad of v only": lambda: torch.func.grad(loss, argnums=2)(q, k, v),
        "func.grad, no_grad inside": lambda: torch.func.grad(
            lambda q: torch.no_grad()(loss)(q, k, v) + q.sum())(q),
        "func.vjp": lambda: torch.func.vjp(lambda q: attn(q, k, v), q)[1](torch.ones_like(q)),
        "vmap": lambda: torch.func.vmap(attn)(*stacked),
        "vmap, requires grad": lambda: torch.func.vmap(loss)(*grads(*stacked)).sum().backward(),
        "vmap, requires grad, no_grad": lambda: torch.no_grad()(torch.func.vmap(loss))(
            *grads(*stacked)),
        "vmap(grad)": lambda: torch.func.vmap(torch.func.grad(loss))(*stacked),
        "grad(vmap)": lambda: torch.func.grad(lambda q: torch.func.vmap(loss)(q, *stacked[1:])
                                              .sum())(stacked[0]),
        "jacrev": lambda: torch.func.jacrev(lambda q: attn(q, k, v)[0, 0, 0])(q),
    }
    for name, run in cases.items():
        flags.clear()
        backwards.clear()
        run()
        assert flags and set(flags) == {bool(backwards)}, (name, flags, backwards)
