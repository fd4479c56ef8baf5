"""fringe attention as one opaque ``torch.library`` custom op, so compiled models see one call.

``torch.compile`` (dynamo, AOTAutograd, inductor) sees ``fringe::attention`` and
``fringe::attention_backward`` as single ops with fake (shape-only) implementations; the
planner's data, the interpreter, the agreement between ranks and all communication run
inside them, where no compiler looks. The same ops run eagerly (one path: every call, compiled
or not, goes through them).

What crosses the op boundary:

* tensors that carry gradients are inputs: q, k, v, the plan's ``score_params`` (the tensors
  its score_mod captures, ``Tensor[]``) and ``sinks`` (``Tensor?``, checked and agreed on
  here; applied by the caller, outside the op, so autograd and the compiler see that math);
* ``batch`` (``Tensor?``): the 0-d int64 CPU digest of the global batch this rank's shard was
  cut from (``packing.Shard.batch_digest``, carried by ``fringe.hf`` / ``fringe.titan``), or
  None; it joins the agreement, so ranks that sharded different batches all raise. A tensor,
  not a Python int, so a new batch does not recompile;
* the plan as its handle (:mod:`fringe._handle`): a 0-d int64 tensor, guarded by metadata
  only, so a new plan of the same shapes (next batch's document ids) does not recompile;
* where it runs as a string: ``"virtual"`` (every rank in this process, global tensors) or
  ``"dist"`` / ``"dist:<n>"`` (this rank over the default group / a registered group);
* constants: the timeout, two booleans read from the plan that fix output structure
  (``keep``: the kv buffers kept for the backward) and the vmap rule (``reads_batch``), and
  ``backward``: whether autograd records this call, so that its backward will run (decided
  where the call begins, by :func:`fringe.autograd.records`: the rule autograd records a
  Function by); it joins the agreement, so ranks whose forwards differ in it all raise instead
  of leaving the training ranks' backward waiting for peers that never send.

Outputs: ``out`` (q's shape and dtype), ``lse`` (``q.shape[:-1]``, float32, float64 for
float64 input) and ``kept``, the kept kv buffers packed flat (empty unless the plan keeps kv;
its length is data-dependent, an unbacked size to the compiler).

The backward is the op ``fringe::attention_backward``; it returns ``(dq, dk, dv, dparams)``,
one gradient per score parameter. :mod:`fringe.autograd` joins the two in an
``autograd.Function`` with ``setup_context`` and vmap rules (a custom op's own
``register_autograd`` does not work under ``torch.func.grad`` in torch 2.13: its generated
Function has no ``setup_context``); dynamo traces that Function, so a compiled graph holds
the forward op and its backward graph the backward op.

Legend: B batch · H query heads · G kv heads · S global sequence · L = S/P · D head dim.
"""
from __future__ import annotations

import collections
import concurrent.futures

import torch

from ._handle import resolve
from .runtime.contract import PlanLike
from .runtime.distributed import (BACKWARD, DEFAULT_TIMEOUT_S, FORWARD_ONLY, FORWARD_THEN_BACKWARD,
                                  DistRuntime, check_sinks, is_device_mesh, mesh_ranks,
                                  resolve_timeout, subgroup)
from .runtime.engine import acc_dtype, check_inputs, kept_names
from .runtime.interpreter import head_range, kv_shape
from .runtime.virtual import VirtualRuntime

VIRTUAL = "virtual"
DIST = "dist"

#: group key -> the runtime of this process's last call on that group (``fringe.last_run``)
LAST: dict = {}
#: open ``fringe.recording()`` blocks
RECORDERS: list = []
#: group key -> forward runtimes whose backward has not run yet (LIFO: the backward of a
#: model runs its layers in reverse; a recomputed forward pushes and pops its own; a forward
#: no backward follows pushes nothing)
_PENDING: dict = collections.defaultdict(lambda: collections.deque(maxlen=1024))
#: ``"dist:<n>"`` -> a process group or DeviceMesh passed to ``fringe.attention``
_GROUPS: dict = {}


def group_key(group):
    """The key ``fringe.last_run(group)`` finds a group's last call under."""
    import torch.distributed as dist
    if is_device_mesh(group):
        return ("mesh",) + mesh_ranks(group)
    return tuple(dist.get_process_group_ranks(group)) if group is not None else "default"


def ranks_where(ranks) -> str:
    """The ``where`` string of the process group over these global ranks (plain string
    arithmetic: dynamo traces it, ``dist.get_process_group_ranks`` is a constant to it)."""
    return f"{DIST}:" + ",".join(str(int(r)) for r in ranks)


def register_group(group) -> str:
    """The ``where`` string naming ``group`` (None: the default group) to the ops.

    A process group is named by its ranks and remembered, so an eager call runs on the very
    group given; a compiled call names it by its ranks and finds it here, or (never seen
    eagerly) runs on fringe's cached group over the same ranks. A DeviceMesh is named by its
    place in the registry. Groups are kept for the life of the process, as torch keeps them.
    """
    import torch.distributed as dist
    if group is None:
        return DIST
    if not is_device_mesh(group):
        name = ranks_where(dist.get_process_group_ranks(group))
        _GROUPS[name] = group
        return name
    for name, g in _GROUPS.items():
        if g is group:
            return name
    name = f"mesh:{len(_GROUPS)}"
    _GROUPS[name] = group
    return name


def _key(where: str, group):
    """:func:`group_key` of the group a ``where`` names (by its ranks: the group a compiled
    call runs on may be fringe's own over the same ranks)."""
    if where.startswith(f"{DIST}:"):
        return tuple(int(r) for r in where[len(DIST) + 1:].split(","))
    return group_key(group)


def _group(where: str):
    import torch.distributed as dist
    if where == DIST:
        return None
    if where in _GROUPS:
        return _GROUPS[where]
    if where.startswith(f"{DIST}:"):
        ranks = tuple(int(r) for r in where[len(DIST) + 1:].split(","))
        if sorted(ranks) == list(range(dist.get_world_size())):
            return None
        return subgroup(ranks)
    raise RuntimeError(f"fringe: no process group registered as {where!r} in this process")


# --------------------------------------------------------------------------------------
# the virtual mesh: global tensors <-> rank-stacked ones
# --------------------------------------------------------------------------------------


def _identity(plan: PlanLike) -> bool:
    """One rank holding every position in natural order: sharding is a view, not a copy."""
    order = plan.layout.order
    return plan.world_size == 1 and torch.equal(order, torch.arange(order.numel()))


def _stack(plan: PlanLike, x: torch.Tensor) -> torch.Tensor:
    """Global ``[..., S, D]`` -> rank-stacked ``[P, ..., L, D]`` in the plan's layout (one
    gather: rank r's rows are ``order[r*L:(r+1)*L]``, as ``layout.shard(x, r)``)."""
    if _identity(plan):
        return x.unsqueeze(0)
    P, L = plan.world_size, plan.local_len
    rows = x.index_select(-2, plan.layout.order.to(x.device))      # [..., P*L, D]
    return rows.unflatten(-2, (P, L)).movedim(-3, 0).contiguous()


def _unstack(plan: PlanLike, x: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_stack` (``layout.unshard`` of the P shards)."""
    if _identity(plan):
        return x.squeeze(0)
    order = plan.layout.order.to(x.device)
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=x.device)
    return x.movedim(0, -3).flatten(-3, -2).index_select(-2, inverse)


def _stack_rows(plan: PlanLike, x: torch.Tensor) -> torch.Tensor:
    """:func:`_stack` for ``[..., S]`` (lse)."""
    return _stack(plan, x.unsqueeze(-1)).squeeze(-1)


def _unstack_rows(plan: PlanLike, x: torch.Tensor) -> torch.Tensor:
    return _unstack(plan, x.unsqueeze(-1)).squeeze(-1)


# --------------------------------------------------------------------------------------
# kept kv buffers, packed flat
# --------------------------------------------------------------------------------------


def _pack(kept: list, k: torch.Tensor) -> torch.Tensor:
    flat = [t.reshape(-1) for per_rank in kept for t in per_rank]
    return torch.cat(flat) if flat else k.new_empty(0)


def _unpack(plan: PlanLike, ranks, flat: torch.Tensor, k: torch.Tensor, v: torch.Tensor, H: int) -> list:
    """Per-rank lists of kept kv buffers ``[2, B, G', L, D]`` (G' the heads a slice holds;
    ``[1, B, G', L, D + Dv]`` when v's head dim differs, as the interpreter packs them)."""
    B, G, _, D = k.shape
    L = plan.local_len
    kept, off = [], 0
    for r in ranks:
        mine = []
        for b in kept_names(plan, r):
            shape = list(kv_shape(B, G, L, D, v.shape[-1]))
            if b.heads is not None:
                dim, lo, hi = head_range(b, H, G)
                shape[dim] = hi - lo
            n = shape[0] * B * L * shape[4] * shape[2]
            mine.append(flat[off:off + n].view(shape))
            off += n
        kept.append(mine)
    if off != flat.numel():
        raise RuntimeError(f"fringe: the kept kv buffers hold {flat.numel()} values but the plan "
                           f"reads {off}; was the plan changed between forward and backward?")
    return kept


def _unaliased(outputs: list, inputs: tuple) -> list:
    """Outputs that share no storage with an input or an earlier output (a custom op's rule):
    the interpreter hands out parts of packed buffers (dk and dv of one ``[2, ...]`` kv
    gradient, out and lse of one ``[..., D+1]`` partial), copied here only where they share."""
    seen = {t.untyped_storage().data_ptr() for t in inputs
            if isinstance(t, torch.Tensor) and t.numel()}
    fresh = []
    for t in outputs:
        if t.numel():
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            seen.add(ptr)
        fresh.append(t)
    return fresh


_WORKER: list = []       # one thread, made on first use (see _with_autograd)
#: kernels whose CPU tile backward is plain math (None: fringe chooses, on CPU one of these)
_NO_AUTOGRAD_KERNELS = (None, "reference", "sdpa")


def _autograd_excluded() -> bool:
    """True inside a custom op's kernel, where torch has switched autograd off for this thread
    (below the Autograd dispatch key: ``requires_grad`` tensors record nothing)."""
    with torch.enable_grad():
        return not (torch.ones((), requires_grad=True) * 1.0).requires_grad


def _with_autograd(fn, device: torch.device):
    """``fn()`` where autograd records: the tile backward of a score_mod with parameters (their
    gradients come from ``torch.autograd.grad`` through the user's closure), FlexAttention's
    backward and any kernel's ``torch.autograd.grad`` need it, and a custom op's kernel runs
    with autograd switched off for its thread by a thread-local guard that no public API
    lifts. So ``fn`` runs on a worker thread (fresh thread-local state with the caller's grad
    mode; on CUDA the caller's device and current stream) and this thread waits: about
    50 us a call, once per backward.
    """
    if not _autograd_excluded():
        return fn()
    if not _WORKER:
        _WORKER.append(concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fringe"))
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
    grad = torch.is_grad_enabled()          # the caller's (off: a backward records nothing)

    def run():
        with torch.set_grad_enabled(grad):
            if stream is None:
                return fn()
            with torch.cuda.device(device), torch.cuda.stream(stream):
                return fn()
    return _WORKER[0].submit(run).result()


def timeout_problem(timeout_s) -> Exception | None:
    """The error :class:`DistRuntime` would raise for this timeout (or ``FRINGE_TIMEOUT``)."""
    try:
        resolve_timeout(timeout_s)
    except ValueError as e:
        return e
    return None


def fail_everywhere(where: str, timeout_s, q, k, v, sinks, problem: str) -> None:
    """Join the agreement exchange the op's peers are in with this rank's ``problem`` (input
    that cannot enter the op), so every rank raises it at once; always raises. A bad
    ``timeout_s`` (or ``FRINGE_TIMEOUT``) waits the default time instead."""
    if timeout_problem(timeout_s):
        timeout_s = DEFAULT_TIMEOUT_S if timeout_problem(None) else None
    rt = DistRuntime(_group(where), timeout_s=timeout_s)
    tensor = lambda t: t if isinstance(t, torch.Tensor) else None   # noqa: E731
    rt.agree(None, tensor(q), tensor(k), tensor(v), sinks=tensor(sinks), problem=problem)
    raise AssertionError("fringe: the agreement passed an input flagged invalid")  # unreachable


# --------------------------------------------------------------------------------------
# the ops
# --------------------------------------------------------------------------------------


@torch.library.custom_op("fringe::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: list[torch.Tensor],
                 sinks: torch.Tensor | None, batch: torch.Tensor | None, plan: torch.Tensor,
                 where: str,
                 timeout_s: float | None, keep: bool, reads_batch: bool, backward: bool
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, lse, kept)`` of the plan named by ``plan`` (see the module docstring)."""
    p: PlanLike = resolve(plan)
    if where == VIRTUAL:
        check_inputs(q, k, v, plan=p, local=False)
        if sinks is not None:
            check_sinks(sinks, q)
        rt = VirtualRuntime(p.world_size)
        out, lse, kept = rt.forward(p, _stack(p, q), _stack(p, k), _stack(p, v))
        out, lse = _unstack(p, out), _unstack_rows(p, lse)
    else:
        group = _group(where)
        rt = DistRuntime(group, timeout_s=timeout_s)
        # every call; folds in this rank's input validation (and the batch digest, if any) and
        # whether a backward follows
        rt.agree(p, q, k, v, sinks=sinks, batch=batch,
                 phase=FORWARD_THEN_BACKWARD if backward else FORWARD_ONLY)
        out, lse, kept = rt.forward(p, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0))
        out, lse = out[0], lse[0]
        key = _key(where, group)
        LAST[key] = rt
        if backward:
            _PENDING[key].append(rt)
        for rec in RECORDERS:
            rec.runtimes.append(rt)
    out, lse, flat = _unaliased([out.contiguous(), lse.contiguous(), _pack(kept, k)],
                                (q, k, v, sinks, *params))
    return out, lse, flat


@attention_op.register_fake
def _(q, k, v, params, sinks, batch, plan, where, timeout_s, keep, reads_batch, backward):
    out = q.new_empty((*q.shape[:-1], v.shape[-1]))            # Dv: v's head dim (MLA)
    lse = q.new_empty(q.shape[:-1], dtype=acc_dtype(q.dtype))
    n = torch.library.get_ctx().new_dynamic_size() if keep else 0
    return out, lse, k.new_empty(n)


@torch.library.custom_op("fringe::attention_backward", mutates_args=())
def attention_backward_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, dout: torch.Tensor, dlse: torch.Tensor,
                          kept: torch.Tensor, params: list[torch.Tensor], plan: torch.Tensor,
                          where: str, timeout_s: float | None, reads_batch: bool
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """``(dq, dk, dv, dparams)``: the plan's backward programs (``reverse(plan)``)."""
    p: PlanLike = resolve(plan)
    H = q.shape[-3]
    if where == VIRTUAL:
        p.check_unchanged()     # the forward's check must not outlive an edit made since
        rt = VirtualRuntime(p.world_size)
        args = [_stack(p, x) for x in (q, k, v, out)] + [_stack_rows(p, lse), _stack(p, dout),
                                                         _stack_rows(p, dlse)]
    else:
        group = _group(where)
        pending = _PENDING[_key(where, group)]
        rt = pending.pop() if pending else DistRuntime(group, timeout_s=timeout_s)
        # every backward too: a plan edited on one rank since the forward makes every rank
        # raise that rank's reason, instead of its peers waiting for a CommTimeout; a rank
        # that skipped this backward and runs a forward instead raises too
        rt.agree(p, q, k, v, phase=BACKWARD)
        args = [x.unsqueeze(0) for x in (q, k, v, out, lse, dout, dlse)]
    kept = _unpack(p, rt.ranks, kept, k, v, H)
    # tile backwards that use autograd (score_mod parameters, FlexAttention's backward, any
    # kernel but the CPU built-ins) run where it records
    if p.score_params or q.is_cuda or p.kernel not in _NO_AUTOGRAD_KERNELS:
        dq, dk, dv, dparams = _with_autograd(lambda: rt.backward(p, *args, kept), q.device)
    else:
        dq, dk, dv, dparams = rt.backward(p, *args, kept)
    if where == VIRTUAL:
        dq, dk, dv = _unstack(p, dq), _unstack(p, dk), _unstack(p, dv)
    else:
        dq, dk, dv = dq[0], dk[0], dv[0]
    dq, dk, dv, *dparams = _unaliased([dq.contiguous(), dk.contiguous(), dv.contiguous(),
                                       *dparams], (q, k, v, out, lse, dout, dlse, kept, *params))
    return dq, dk, dv, dparams


@attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, dlse, kept, params, plan, where, timeout_s, reads_batch):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            [t.new_empty(t.shape) for t in params])
