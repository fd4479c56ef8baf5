"""fn_digest looks into the data an object holds: a score_mod that is a bound method or a
callable instance reading ``self.softcap`` was digested by its type only, so ranks whose
``softcap`` differed (30.0 vs 50.0) agreed and each ran its own number on its own tiles."""
from __future__ import annotations

import dataclasses
import time

import numpy as np
import torch

from fringe import masks as M


class _Softcap:
    def __init__(self, cap, slopes=None):
        self.cap = cap
        self.slopes = slopes

    def score(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)

    def __call__(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)


class _Slotted:
    __slots__ = ("cap", "unset")

    def __init__(self, cap):
        self.cap = cap

    def __call__(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)


@dataclasses.dataclass
class _Config:
    cap: float
    names: tuple = ("a", "b")


class _Bias(torch.nn.Module):
    """A score_mod's owner: ~100 parameters in 50 layers, a buffer, a float attribute."""

    def __init__(self, cap=30.0, layers=50):
        super().__init__()
        self.cap = cap
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(layers))
        self.register_buffer("slopes", torch.tensor([0.5, 0.25]))

    def score(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap) - self.slopes[h] * (q - kv).abs()


def _differ(make):
    """make(cap) at two caps: digests differ; two objects of equal state: equal."""
    assert M.fn_digest(make(30.0)) == M.fn_digest(make(30.0))
    assert M.fn_digest(make(30.0)) != M.fn_digest(make(50.0))


def test_fn_digest_reads_the_state_of_bound_methods_and_callable_objects():
    _differ(lambda c: _Softcap(c).score)                            # a bound method's instance
    _differ(lambda c: _Softcap(c))                                  # a callable instance
    _differ(lambda c: _Slotted(c))                                  # __slots__ values
    t = torch.tensor([0.5, 0.25])
    _differ(lambda c: _Softcap(30.0, slopes=t * c).score)           # a tensor attribute by value
    _differ(lambda c: _Softcap(_Config(c)).score)                   # a dataclass it holds

    def through_cell(c):                                            # an object a closure reads
        cfg = _Config(c)
        return lambda s, b, h, q, kv: cfg.cap * torch.tanh(s / cfg.cap)
    _differ(through_cell)
    # an unset slot is not None
    a, b = _Slotted(1.0), _Slotted(1.0)
    b.unset = None
    assert M.fn_digest(a) != M.fn_digest(b)


_GLOBAL_CFG = _Config(30.0)


def _global_softcap(s, b, h, q, kv):                               # a global object, by name
    return _GLOBAL_CFG.cap * torch.tanh(s / _GLOBAL_CFG.cap)


def test_fn_digest_reads_the_state_of_a_global_object():
    d = M.fn_digest(_global_softcap)
    _GLOBAL_CFG.cap = 50.0
    try:
        assert M.fn_digest(_global_softcap) != d
    finally:
        _GLOBAL_CFG.cap = 30.0
    assert M.fn_digest(_global_softcap) == d


def test_fn_digest_of_a_module_reads_attributes_and_buffers_not_parameter_values():
    torch.manual_seed(0)
    a = _Bias()
    torch.manual_seed(1)
    b = _Bias()                                                     # other parameter values
    assert M.fn_digest(a.score) == M.fn_digest(b.score)             # DDP keeps them equal
    assert M.fn_digest(a.score) != M.fn_digest(_Bias(cap=50.0).score)
    c = _Bias()
    c.slopes[1] = 0.125                                             # a buffer, by content
    assert M.fn_digest(a.score) != M.fn_digest(c.score)
    assert M.fn_digest(a.score) != M.fn_digest(_Bias(layers=49).score)  # parameter shapes
    d = _Bias()
    d.layers[3].weight.requires_grad_(False)                        # frozen: by value
    e = _Bias()
    e.layers[3].weight.requires_grad_(False)
    with torch.no_grad():
        e.layers[3].weight.add_(1.0)
    assert M.fn_digest(d.score) != M.fn_digest(e.score)
    # tensors without data here (meta; subclasses such as DTensor, whose values would take a
    # collective): by dtype and shape, no error
    assert M.fn_digest(_Softcap(30.0, slopes=torch.zeros(3, device="meta")).score) == \
        M.fn_digest(_Softcap(30.0, slopes=torch.ones(3, device="meta")).score)
    # a device index is each rank's own accelerator: the device type is what must agree
    assert M.fn_digest(_Softcap(torch.device("cuda", 0)).score) == \
        M.fn_digest(_Softcap(torch.device("cuda", 1)).score)
    assert M.fn_digest(_Softcap(torch.device("cuda", 0)).score) != \
        M.fn_digest(_Softcap(torch.device("cpu")).score)


class _Mesh:                                    # stands for a DeviceMesh: per-rank by design
    __module__ = "torch.distributed.device_mesh"

    def __init__(self, rank):
        self.coordinate = [rank]


def test_fn_digest_reads_no_per_rank_placement():
    a, b = _Softcap(30.0, slopes=_Mesh(0)), _Softcap(30.0, slopes=_Mesh(1))
    assert M.fn_digest(a.score) == M.fn_digest(b.score)


def test_fn_digest_of_objects_stays_cheap():
    m = _Bias()                                                     # 100 parameters
    assert sum(1 for _ in m.parameters()) == 100
    M.fn_digest(m.score)
    t0 = time.perf_counter()
    for _ in range(5):
        M.fn_digest(m.score)
    per = (time.perf_counter() - t0) / 5
    assert per < 0.05, f"fn_digest of a score_mod bound to a 100-parameter module: {per:.4f} s"
    # a huge structure is not walked: digested by type (documented), in bounded time
    big = _Softcap(30.0, slopes=[[i, str(i)] for i in range(200_000)])
    t0 = time.perf_counter()
    M.fn_digest(big.score)
    assert time.perf_counter() - t0 < 0.5
    # deterministic however the walk is ordered: equal huge objects, equal digests
    assert M.fn_digest(big.score) == M.fn_digest(_Softcap(30.0, slopes=list(big.slopes)).score)
    assert M.fn_digest(big.score) != M.fn_digest(_Softcap(50.0, slopes=big.slopes).score)


def test_fn_digest_reads_numpy_arrays_and_scalars():
    """A closure's numpy array (snapshot copies it) was digested by type only."""
    def alibi(slopes):
        return lambda s, b, h, q, kv: s - torch.as_tensor(slopes)[h] * (q - kv).abs()
    _differ(lambda c: alibi(np.array([0.5, 0.25]) * c))
    _differ(lambda c: alibi(np.array([0.5, 0.25], dtype=np.float32) * np.float32(c)))
    _differ(lambda c: _Softcap(np.float32(c)).score)
    assert M.fn_digest(alibi(np.zeros(2))) != M.fn_digest(alibi(np.zeros(2, dtype=np.float32)))
    assert M.fn_digest(alibi(np.zeros(2))) != M.fn_digest(alibi(np.zeros((1, 2))))
    _differ(lambda c: alibi(np.array([c, "x"], dtype=object)))    # of objects: their values


class _Capped(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cap = 30.0

    def score(self, s, b, h, q, kv):
        return self.cap * torch.tanh(s / self.cap)


def _rank_digest(rank: int, *, training: bool = True) -> str:
    """One rank's score_mod digest: rank 0 alone logs its head's activations (a hook), then
    every rank wraps the attention module (a hook of its own, the same code everywhere)."""
    head, attn = torch.nn.Linear(2, 2), _Capped()
    if rank == 0:
        head.register_forward_hook(lambda *args: None)
        torch.zeros(1, requires_grad=True).register_hook(lambda g: g)
    attn.register_forward_pre_hook(lambda *args: None)
    attn.train(training)
    return M.fn_digest(attn.score)


def test_fn_digest_of_a_module_leaves_its_hooks_out():
    """A hook's key in a module's hook table is a process-wide counter: a hook rank 0 alone
    registered elsewhere (activation logging) made the identical hooks every rank then put on
    the attention module differ in key, so a score_mod bound to it raised a RankMismatch on
    every call. Hooks are the module's bookkeeping, per rank by nature: left out; ``training``
    and the module's data are still read."""
    assert _rank_digest(0) == _rank_digest(1)
    assert _rank_digest(1, training=False) != _rank_digest(1)
    a, b = _Capped(), _Capped()
    b.cap = 50.0
    assert M.fn_digest(a.score) != M.fn_digest(b.score)


def _fully_sharded(cap: float) -> _Capped:
    """What ``fully_shard`` does to a module's Python state (no process group needed here): its
    class becomes ``FSDP<name>`` (a subclass of ``FSDPModule`` and the module's own class,
    defined in ``torch.distributed``), and it keeps its state under a name ending in a uuid4
    drawn per process."""
    from torch.distributed._composable.contract import generate_state_key
    from torch.distributed.fsdp import FSDPModule
    m = _Capped()
    m.cap = cap
    cls = type(f"FSDP{_Capped.__name__}", (FSDPModule, _Capped), {})
    cls.__module__ = "torch.distributed.fsdp._fully_shard._fsdp_init"
    m.__class__ = cls
    m.__dict__[generate_state_key()] = {}
    return m


def test_fn_digest_reads_a_fully_sharded_module():
    """``fully_shard`` re-classes the module into ``torch.distributed``: it was digested by
    type only, so ranks whose ``self.cap`` differed (30 vs 50) under FSDP2 agreed, and the
    guard recorded none of its attributes. Its data is the user's module's: read; the state
    ``fully_shard`` keeps under a per-process name is not."""
    assert M.fn_digest(_fully_sharded(30.0).score) == M.fn_digest(_fully_sharded(30.0).score)
    assert M.fn_digest(_fully_sharded(30.0).score) != M.fn_digest(_fully_sharded(50.0).score)
    import pytest

    import fringe
    from fringe import schedules
    m = _fully_sharded(30.0)
    m.lin = torch.nn.Linear(2, 2)                   # parameters the score_mod does not read
    m.step = 0
    plan = fringe.plan(schedules.zigzag(), M.causal(), seq_len=16, world_size=2, block_size=4,
                       score_mod=m.score)
    m.step = 1                                      # FSDPAttn's code is FSDP's: not the mod's
    plan.check_unchanged()

    def grad_tensors(x, depth=0):                   # as FSDP2 walks a module's forward args
        if isinstance(x, torch.Tensor):
            return [x] if x.requires_grad else []
        if depth > 32:
            return []
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            x = [getattr(x, f.name) for f in dataclasses.fields(x)]
        elif isinstance(x, dict):
            x = list(x.values())
        elif not isinstance(x, (list, tuple)):
            return []
        return [t for v in x for t in grad_tensors(v, depth + 1)]
    # the plan's records of m's attributes must not hand FSDP2 m's parameters to replace in
    # the plan (dataclasses.replace of a Plan raised: "field cache is declared with init=False")
    assert grad_tensors(plan) == []
    m.cap = 50.0
    with pytest.raises(ValueError, match=r"score_mod reads self\.cap, rebound"):
        plan.check_unchanged()
