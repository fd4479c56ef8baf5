"""The torch.distributed transport: the same interpreter, real processes.

Point-to-point steps go through ``dist.batch_isend_irecv`` (async): a step's transfers are
issued before its tiles are computed and waited after, so they overlap. On CUDA they are
issued on a dedicated communication stream ordered with the compute stream by events
(``wait_stream`` both ways, ``record_stream`` for the allocator); on CPU (gloo) the
request objects carry the asynchrony. Every wait has a timeout, so a peer that died or
never sends ends in :class:`CommTimeout` naming the step, buffer and peer, never a hang.

Before anything else, on **every** call, ranks exchange a small int64 vector with one
all-gather (:meth:`DistRuntime.agree`): the local shapes, dtype and device type, whether
this rank's inputs passed validation, and one digest per plan component (layout,
programs, block map, mask content, score_mod, options), per extra input (sinks), the
digest of the global batch a shard was cut from (when the call carries one) and what
follows the exchange on this rank (a forward with no backward, a forward whose backward
will run, or the backward itself). A disagreement raises :class:`RankMismatch` on every
rank naming the rank and the component; a rank with invalid input makes every rank raise
its reason at once. On CUDA
the vector travels over a gloo side group of the same ranks (created once, with
``use_local_synchronization``), so the check adds no device-to-host synchronisation.
"""
from __future__ import annotations

import datetime
import hashlib
import math
import os

import torch
import torch.distributed as dist

from .contract import PlanLike
from .engine import Runtime, check_inputs

#: Used when neither ``timeout_s=`` nor ``FRINGE_TIMEOUT`` is given.
DEFAULT_TIMEOUT_S = 300.0
#: The largest timeout accepted (about 31 years). Measured on torch 2.13 gloo: from 1e10 s up,
#: a wait may end at once in a CommTimeout (a deadline past int64 nanoseconds overflows), and
#: above ~8.6e13 s ``datetime.timedelta`` itself raises OverflowError.
_MAX_TIMEOUT_S = 1e9


class CommTimeout(RuntimeError):
    """A transfer did not complete in time (a peer died, hung, or never sends)."""


class RankMismatch(ValueError):
    """Ranks disagree on shapes, dtype, device, plan or inputs before any tile is computed."""


def resolve_timeout(timeout_s=None) -> float:
    """The timeout in seconds: ``timeout_s``, else ``FRINGE_TIMEOUT``, else 300.

    Raises:
        ValueError: for anything but a finite number of seconds > 0.
    """
    src = "timeout_s"
    if timeout_s is None:
        env = os.environ.get("FRINGE_TIMEOUT")
        if env is None:
            return DEFAULT_TIMEOUT_S
        src = "the FRINGE_TIMEOUT environment variable"
        try:
            timeout_s = float(env)
        except ValueError:
            raise ValueError(f"{src} must be a number of seconds > 0, got {env!r}") from None
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        raise ValueError(f"{src} must be a number of seconds > 0, got {timeout_s!r}")
    if not math.isfinite(timeout_s) or timeout_s <= 0:
        raise ValueError(f"{src} must be a finite number of seconds > 0, got {timeout_s!r} "
                         f"(a peer that never answers must end in an error, not a hang)")
    if timeout_s > _MAX_TIMEOUT_S:
        raise ValueError(f"{src} must be a finite number of seconds > 0 and at most "
                         f"{_MAX_TIMEOUT_S:g} (larger ones overflow inside torch: an immediate "
                         f"timeout or an OverflowError), got {timeout_s!r}; 1e9 (about 31 years) "
                         f"waits practically forever")
    return float(timeout_s)


_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
_SHAPE_FIELDS = ["world size", "B (batch)", "H (query heads)", "G (kv heads)",
                 "L (local tokens)", "D (head dim)", "dtype", "device type", "input check"]
_PLAN_FIELDS = ["layout", "programs", "blocks", "mask", "score_mod", "options"]
_EXTRA_FIELDS = ["sinks"]
_DV_FIELD = "Dv (v head dim)"       # v's head dim may differ from D (MLA)
#: the digest of the global batch a shard was cut from (``packing.Shard.batch_digest``), or
#: -1 where no shard is involved (plain ``fringe.attention``)
_BATCH_FIELD = "batch digest"
#: what follows the exchange on this rank (``agree(phase=)``): ranks whose forwards differ in
#: whether a backward follows would leave the training ranks' backward waiting for peers that
#: never send, and a backward that meets a forward (a rank skipped it) would run programs that
#: do not match
_PHASE_FIELD = "what follows"
FORWARD_ONLY, FORWARD_THEN_BACKWARD, BACKWARD = 0, 1, 2
_PHASES = ["a forward with no backward to follow", "a forward whose backward will run",
           "the backward"]
_FIELDS = (_SHAPE_FIELDS + [f"plan {f}" for f in _PLAN_FIELDS] + _EXTRA_FIELDS + [_DV_FIELD]
           + [_BATCH_FIELD, _PHASE_FIELD])
_DIGESTS = set(_FIELDS[len(_SHAPE_FIELDS):]) - {_DV_FIELD, _BATCH_FIELD, _PHASE_FIELD}
#: what a digest covers, where the cause may not be plain from the field's name
_HINTS = {"plan score_mod": (
    ". The score_mod's digest (fringe.masks.fn_digest) covers its code, constants, the values "
    "it captures and the attributes of the objects it is bound to or reads (self.softcap, "
    "buffers); an object that also holds per-rank values the score_mod does not read (a rank "
    "number, a logger) differs on every rank: bind only the values it reads (a closure)")}


def _h48(text: str) -> int:
    return int(hashlib.sha1(text.encode()).hexdigest()[:12], 16)


def _describe(field: str, value: int) -> str:
    if field == "dtype":
        return str(_DTYPES[value]) if 0 <= value < len(_DTYPES) else f"code {value}"
    if field == "device type":
        return "cuda" if value == 1 else "cpu" if value == 0 else f"code {value}"
    if field == "input check":
        return "valid input" if value == 0 else "invalid input"
    if field in _DIGESTS:
        return f"digest #{value:012x}"
    if field == _PHASE_FIELD:
        return _PHASES[value] if 0 <= value < len(_PHASES) else f"code {value}"
    if field == _BATCH_FIELD:
        if value == -1:
            return "no batch digest"
        if value < 0:                   # packing's run_digest: the shard of another plan rank
            return f"a shard cut for plan rank {-2 - value}"
        return f"batch digest #{value:012x}"
    return str(value)


_SIDE_GROUPS: dict = {}


class _Found(Exception):
    """A problem found before :meth:`DistRuntime.agree` (carried in, not checked again)."""


def _cpu_capable(group) -> bool:
    """The group moves CPU tensors (gloo, or a ``cpu:gloo,cuda:nccl`` default group)."""
    return "gloo" in str(dist.get_backend(group)).lower()


def _side_group(group):
    """A gloo group over the same ranks as ``group`` (for CPU-side agreement on CUDA)."""
    ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
    if ranks not in _SIDE_GROUPS:
        _SIDE_GROUPS[ranks] = dist.new_group(list(ranks), backend="gloo",
                                             use_local_synchronization=True)
    return _SIDE_GROUPS[ranks]


_SUBGROUPS: dict = {}


def subgroup(global_ranks: tuple[int, ...]):
    """The process group over ``global_ranks``, created once and cached.

    Creating a group is itself a collective, so schedules use a fixed mesh of groups (never one
    per mask): the first use creates it with ``use_local_synchronization=True`` (only its
    members take part), later ones reuse it. The groups of a ``DeviceMesh`` passed to
    :func:`fringe.attention` are put in this cache first (:func:`register_mesh`), so a
    composed schedule's collectives inside a group or across groups run on
    ``mesh.get_group(dim)`` and nothing is created. The cache follows the default group: a
    new ``init_process_group`` starts a new cache.
    """
    world = dist.group.WORLD
    key = (id(world), tuple(sorted(global_ranks)))
    if key not in _SUBGROUPS:
        _SUBGROUPS[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
    return _SUBGROUPS[key]


def is_device_mesh(obj) -> bool:
    """True for a ``torch.distributed.device_mesh.DeviceMesh``."""
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:                  # a torch built without distributed
        return False
    return isinstance(obj, DeviceMesh)


def mesh_ranks(mesh) -> tuple[int, ...]:
    """Global ranks of a 1D or 2D ``DeviceMesh`` in plan-rank order (row-major).

    Plan rank ``g*k + p`` is ``mesh[g, p]`` of a mesh with dims (outer, inner): the p-th rank
    of the g-th group of k, whatever the global rank order; the rank to shard for is
    ``g*k + p`` with ``(g, p) = mesh.get_coordinate()``.

    Raises:
        ValueError: a mesh of more than two dimensions.
    """
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fringe.attention(group=mesh) takes a 1D DeviceMesh (the CP ranks) or a "
                         f"2D one with dims (outer, inner) for a composed schedule; got a "
                         f"{mesh.ndim}D mesh of shape {tuple(mesh.shape)} (names "
                         f"{mesh.mesh_dim_names}): pass the CP sub-mesh, e.g. mesh['cp'] or "
                         f"mesh['outer', 'inner']")
    return tuple(int(r) for r in mesh.mesh.reshape(-1).tolist())


def register_mesh(mesh) -> None:
    """Put this rank's process group of every dimension of ``mesh`` in the subgroup cache.

    Every member of a mesh group registers the same group, so the members agree on the group
    a collective over them runs on.
    """
    world = dist.group.WORLD
    for dim in range(mesh.ndim):
        pg = mesh.get_group(dim)
        ranks = tuple(sorted(dist.get_process_group_ranks(pg)))
        _SUBGROUPS[(id(world), ranks)] = pg


def check_mesh(mesh, plan: PlanLike) -> None:
    """A 2D mesh must have the plan's grid: shape ``(P // k, k)`` for ``compose(..., inner_size=k)``.

    Raises:
        ValueError: the mesh does not fit the plan, naming the shape to build.
    """
    if mesh.ndim != 2:
        return
    P = plan.world_size
    k = plan.schedule.inner_size        # set by schedules.compose, None for any other
    shape = tuple(int(x) for x in mesh.shape)
    names = mesh.mesh_dim_names
    if k is None:
        raise ValueError(f"a 2D DeviceMesh {shape} (dims {names}) runs a schedule made by "
                         f"schedules.compose(outer, inner, inner_size=k), but the plan's schedule "
                         f"is {plan.schedule.name!r}; pass a 1D mesh or process group for it "
                         f"(e.g. group=mesh.get_group() of a 1D mesh), or plan a composed schedule "
                         f"with inner_size={shape[1]}")
    if shape != (P // k, k):
        raise ValueError(f"the DeviceMesh has shape {shape} (dims {names}) but the plan "
                         f"{plan.schedule.name!r} runs m={P // k} groups of k={k} ranks: build it "
                         f"with init_device_mesh(device_type, ({P // k}, {k}), "
                         f"mesh_dim_names=('outer', 'inner')) (dims (outer, inner), the inner "
                         f"groups along the last dimension)")


class DistTransport:
    """Moves buffers between ranks of a process group: async p2p and async collectives.

    A collective over a subgroup runs as one ``all_to_all_single`` on that (cached) group with
    per-member split sizes, a zero size being an empty contribution: pure data movement, so
    gloo, NCCL and the virtual mesh give the same bits, and a reduce-scatter's sum is the
    interpreter's, in member order.
    """

    def __init__(self, group, *, timeout_s: float, device: torch.device,
                 ranks: tuple[int, ...] | None = None) -> None:
        self.group = group
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device=device) if self.cuda else None
        self._mapped = ranks is not None        # plan rank -> global rank given (a DeviceMesh)
        if ranks is None:
            ranks = (tuple(dist.get_process_group_ranks(group)) if group is not None
                     else tuple(range(dist.get_world_size())))
        self._ranks = tuple(ranks)

    def _global(self, peer: int) -> int:
        if self._mapped:
            return self._ranks[peer]
        return dist.get_global_rank(self.group, peer) if self.group is not None else peer

    def _pg(self, members: tuple[int, ...]):
        """(process group, the group rank of each member) for members given as group ranks."""
        glob = tuple(self._ranks[m] for m in members)
        if sorted(glob) == sorted(self._ranks):
            pg = self.group
            order = [dist.get_group_rank(pg, g) if pg is not None else g for g in glob]
        else:
            pg = subgroup(glob)
            order = [dist.get_group_rank(pg, g) for g in glob]
        return pg, order

    def _collective(self, op, sends: list, recvs: list):
        pg, order = self._pg(op.group)
        n = len(order)
        send_t = [None] * n
        recv_t = [None] * n
        for k, pos in enumerate(order):
            send_t[pos], recv_t[pos] = sends[k], recvs[k]
        dtype = next((t.dtype for t in send_t + recv_t if t is not None), torch.float32)
        device = next((t.device for t in send_t + recv_t if t is not None),
                      torch.device("cuda" if self.cuda else "cpu"))
        in_split = [0 if t is None else t.numel() for t in send_t]
        out_split = [0 if t is None else t.numel() for t in recv_t]
        flat_in = (torch.cat([t.reshape(-1) for t in send_t if t is not None])
                   if any(in_split) else torch.empty(0, dtype=dtype, device=device))
        flat_out = torch.empty(sum(out_split), dtype=dtype, device=device)
        work = dist.all_to_all_single(flat_out, flat_in, output_split_sizes=out_split,
                                      input_split_sizes=in_split, group=pg, async_op=True)
        return work, (flat_out, out_split, recv_t, flat_in)

    def issue(self, rank: int, step: int, sends: list, recvs: list, collectives: list = ()):
        if not sends and not recvs and not collectives:
            return [], [], []
        ops, meta = [], []
        for peer, name, tensor in sends:
            ops.append(dist.P2POp(dist.isend, tensor, self._global(peer), group=self.group))
            meta.append(("send", name, peer))
        for peer, name, tensor in recvs:
            ops.append(dist.P2POp(dist.irecv, tensor, self._global(peer), group=self.group))
            meta.append(("receive", name, peer))
        colls = []
        try:
            if self.cuda:
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    reqs = dist.batch_isend_irecv(ops) if ops else []
                    for op, outs, ins in collectives:
                        colls.append((op,) + self._collective(op, outs, ins))
                for op in ops:
                    op.tensor.record_stream(self.stream)
                for _, _, (flat_out, _, _, flat_in) in colls:
                    flat_out.record_stream(self.stream)
                    flat_in.record_stream(self.stream)
            else:
                reqs = dist.batch_isend_irecv(ops) if ops else []
                for op, outs, ins in collectives:
                    colls.append((op,) + self._collective(op, outs, ins))
        except RuntimeError as e:       # a peer that already died can fail the issue itself
            if meta:
                kind, name, peer = meta[0]
                what = (f"the {kind} of {name} {'to' if kind == 'send' else 'from'} rank {peer} "
                        f"(and {len(meta) - 1} more transfers)")
            else:
                op = collectives[len(colls)][0]
                what = f"collective '{op.ascii()}' over group {list(op.group)}"
            raise CommTimeout(
                f"rank {rank}, step {step}: could not start {what}; the peer may have died. "
                f"Backend said: {str(e).splitlines()[0][:200]}") from e
        return reqs, meta, colls

    def wait(self, rank: int, step: int, handle) -> None:
        reqs, meta, colls = handle
        if len(reqs) != len(meta):       # backends that coalesce return one request
            meta = [("transfer", ",".join(m[1] for m in meta), "/".join(str(m[2]) for m in meta))]
        for req, (kind, name, peer) in zip(reqs, meta):
            try:
                req.wait(timeout=self.timeout)
            except RuntimeError as e:
                direction = "to" if kind == "send" else "from"
                raise CommTimeout(
                    f"rank {rank}, step {step}: {kind} of {name} {direction} rank {peer} did not "
                    f"complete within {self.timeout_s:g}s; the peer may have died or be running a "
                    f"different plan (raise timeout_s= or FRINGE_TIMEOUT if it is just slow). "
                    f"Backend said: {str(e).splitlines()[0][:200]}") from e
        for op, work, (flat_out, out_split, recv_t, _) in colls:
            try:
                work.wait(timeout=self.timeout)
            except RuntimeError as e:
                raise CommTimeout(
                    f"rank {rank}, step {step}: collective '{op.ascii()}' over group "
                    f"{list(op.group)} did not complete within {self.timeout_s:g}s; a member may "
                    f"have died or be running a different plan (raise timeout_s= or "
                    f"FRINGE_TIMEOUT if it is just slow). Backend said: "
                    f"{str(e).splitlines()[0][:200]}") from e
            if self.cuda:
                torch.cuda.current_stream().wait_stream(self.stream)
            off = 0
            for t, size in zip(recv_t, out_split):
                if t is not None:
                    t.copy_(flat_out[off:off + size].view(t.shape))
                off += size
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)


class DistRuntime(Runtime):
    """Drives this process's rank of a plan over torch.distributed.

    Cheap to build (no communication): :func:`fringe.attention` makes one per call.

    ``group`` is a process group (None: the default one) or a ``DeviceMesh``: 1D (its ranks
    in mesh order), or 2D with dims (outer, inner) for a schedule made by
    :func:`fringe.schedules.compose` (plan rank ``g*k + p`` is ``mesh[g, p]``; collectives
    inside a group and across groups run on ``mesh.get_group(dim)``).
    """

    def __init__(self, group=None, *, timeout_s: float | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("fringe.attention needs an initialised process group: call "
                               "torch.distributed.init_process_group (or use fringe.launch) "
                               "first, or use fringe.simulate.attention on one process")
        self.mesh = group if is_device_mesh(group) else None
        self._ranks = None
        if self.mesh is not None:
            ranks = mesh_ranks(self.mesh)
            me = dist.get_rank()
            if me not in ranks:
                raise ValueError(f"global rank {me} is not in the DeviceMesh {list(ranks)}; call "
                                 f"fringe.attention only on the mesh's ranks")
            register_mesh(self.mesh)
            if sorted(ranks) == list(range(dist.get_world_size())):
                group = None
            else:
                group = subgroup(ranks)
            self._ranks = ranks
            self.rank = ranks.index(me)
            self.world_size = len(ranks)
        else:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        self.group = group
        self.timeout_s = resolve_timeout(timeout_s)
        super().__init__([self.rank], self._transport)

    def agree(self, plan: PlanLike | None, q, k, v, *, sinks=None, batch=None, problem: str = "",
              phase: int = FORWARD_ONLY) -> None:
        """All ranks agree on shapes, dtype, device, plan and inputs; raise on every rank if not.

        Runs on every call (one all-gather of a short int64 vector, never cached). This
        rank's local validation travels in the same exchange, so a rank with bad input
        makes every rank raise that rank's reason at once instead of leaving its peers to
        wait for a timeout.

        ``problem``: this rank's input was already found invalid before the op (a q that is
        not a tensor, a plan that is not a Plan: ``"TypeError: ..."``); it travels as is.

        ``batch``: the digest of the global batch this rank's shard was cut from (an int or a
        0-d int64 tensor, ``packing.Shard.batch_digest``, carried by ``fringe.hf`` /
        ``fringe.titan``), or None where no shard is involved. Ranks whose digests differ
        sharded different global batches: the plans can agree (same documents) while the
        tokens do not, so it is compared here, in the same exchange.

        ``phase``: what follows the exchange on this rank: :data:`FORWARD_ONLY` (a forward
        that autograd does not record: grad mode off, or no input requires grad),
        :data:`FORWARD_THEN_BACKWARD` (a forward autograd records, whose backward will run its
        own exchange) or :data:`BACKWARD`. Ranks that differ would run programs that do not
        match (a backward waiting for a peer that never sends), so they raise here.

        Raises:
            RankMismatch: ranks differ (the message names the rank and the component; for
                different batch digests: "CP ranks sharded different batches"; for different
                phases: "what follows").
            ValueError: some rank's inputs are invalid (the message names the rank).
            CommTimeout: a peer never joined the exchange.
        """
        try:
            if problem:
                raise _Found
            check_inputs(q, k, v, plan=plan, local=True)
            if plan.world_size != self.world_size:
                raise ValueError(f"the plan is for world_size={plan.world_size} but the process "
                                 f"group has {self.world_size} ranks; plan with "
                                 f"world_size=dist.get_world_size(group)")
            if self.mesh is not None:
                check_mesh(self.mesh, plan)
            if sinks is not None:
                check_sinks(sinks, q)
        except _Found:
            pass
        except (ValueError, TypeError) as e:
            problem = f"{type(e).__name__}: {e}"
        shape4 = isinstance(q, torch.Tensor) and q.dim() == 4
        B, H, L, D = q.shape if shape4 else (-1, -1, -1, -1)
        G = k.shape[1] if isinstance(k, torch.Tensor) and k.dim() == 4 else -1
        dtype = q.dtype if isinstance(q, torch.Tensor) else None
        code = _DTYPES.index(dtype) if dtype in _DTYPES else 99
        cuda = isinstance(q, torch.Tensor) and q.is_cuda
        # valid: check_inputs passed, so plan is a Plan (no import of the plan layer needed);
        # where this rank's input is invalid every rank raises on the flag below before any
        # other field is compared
        valid = not problem
        digests = plan.digests() if valid else dict.fromkeys(_PLAN_FIELDS, "")
        sink_desc = "none" if sinks is None else \
            f"{tuple(getattr(sinks, 'shape', ()))}/{getattr(sinks, 'dtype', type(sinks).__name__)}"
        mine = ([plan.world_size if valid else -1, B, H, G, L, D, code, int(cuda), int(bool(problem))]
                + [_h48(digests[f]) for f in _PLAN_FIELDS] + [_h48(sink_desc)]
                + [v.shape[-1] if isinstance(v, torch.Tensor) and v.dim() == 4 else -1]
                + [-1 if batch is None else int(batch), int(phase)])
        # the exchange's group follows the group's backend, never this rank's input (a rank
        # whose q is on another device, or not a tensor, must still meet its peers)
        group = self.group if _cpu_capable(self.group) else _side_group(self.group)
        local = torch.tensor(mine, dtype=torch.int64)
        everyone = [torch.empty_like(local) for _ in range(self.world_size)]
        work = dist.all_gather(everyone, local, group=group, async_op=True)
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            what, ask = (("attention's backward", "is every rank running this backward "
                          "(loss.backward() on every rank)?") if phase == BACKWARD else
                         ("attention", "is every rank calling fringe.attention?"))
            raise CommTimeout(f"rank {self.rank}: the agreement exchange before {what} did not "
                              f"complete within {self.timeout_s:g}s; {ask} "
                              f"({str(e).splitlines()[0][:200]})") from e
        rows = torch.stack(everyone).tolist()
        if self._ranks is not None:     # rows by plan rank (a mesh may order ranks otherwise)
            glob = [dist.get_global_rank(group, i) if group is not None else i
                    for i in range(self.world_size)]
            rows = [rows[glob.index(g)] for g in self._ranks]
        bad = [r for r, row in enumerate(rows) if row[len(_SHAPE_FIELDS) - 1]]
        if bad:                 # every rank sees the flags, so every rank joins this exchange
            msgs = [None] * self.world_size
            dist.all_gather_object(msgs, problem, group=group)
            if self._ranks is not None:
                msgs = [msgs[glob.index(g)] for g in self._ranks]
            r = bad[0]
            others = f" (also invalid on ranks {bad[1:]})" if len(bad) > 1 else ""
            raise ValueError(f"rank {r} of {self.world_size} got invalid input for "
                             f"fringe.attention{others}, seen from rank {self.rank} before any "
                             f"attention data moved: {msgs[r]}")
        # a forward meeting a backward explains any other difference (a backward carries no
        # batch digest)
        col = _FIELDS.index(_PHASE_FIELD)
        for r, row in enumerate(rows):
            if row[col] != rows[0][col]:
                raise RankMismatch(
                    f"rank {r} disagrees with rank 0 on what follows this exchange: rank 0 runs "
                    f"{_describe(_PHASE_FIELD, rows[0][col])}, rank {r} runs "
                    f"{_describe(_PHASE_FIELD, row[col])} (seen from rank {self.rank}, before any "
                    f"attention data moved); the ranks' programs would not match (a backward "
                    f"waiting for peers that never send). Run every rank in the same grad mode "
                    f"(torch.no_grad() / inference_mode on all ranks or none, inputs that require "
                    f"grad on all ranks or none) and call backward on every rank or none")
        # a different batch explains any other difference (its documents, hence its plans)
        col = _FIELDS.index(_BATCH_FIELD)
        # -2 - r: the shard was cut for plan rank r, not this one (``packing._run_digest``)
        for r, row in enumerate(rows):
            if row[col] <= -2:
                raise ValueError(
                    f"rank {r} of {self.world_size} runs attention on the shard cut for plan rank "
                    f"{-2 - row[col]} (seen from rank {self.rank}, before any attention data "
                    f"moved): shard the batch for this process's rank in the plans' group "
                    f"(shard_batch(..., group=mesh['cp']), or rank= its CP coordinate, not its dp "
                    f"or global rank)")
        for r, row in enumerate(rows):
            if row[col] != rows[0][col] and min(row[col], rows[0][col]) < 0:
                raise RankMismatch(
                    f"rank {r} disagrees with rank 0 on the batch: rank 0 has "
                    f"{_describe(_BATCH_FIELD, rows[0][col])}, rank {r} has "
                    f"{_describe(_BATCH_FIELD, row[col])} (seen from rank {self.rank}, before any "
                    f"attention data moved); every CP rank must pass its shard's digest (call "
                    f"the model with fringe.hf.model_inputs(shard, plans) on every rank) or none")
            if row[col] != rows[0][col]:
                raise RankMismatch(
                    f"CP ranks sharded different batches: rank {r}'s "
                    f"{_describe(_BATCH_FIELD, row[col])} differs from rank 0's "
                    f"{_describe(_BATCH_FIELD, rows[0][col])} (seen from rank {self.rank}, before "
                    f"any attention data moved); every CP rank of a replica must shard the same "
                    f"global batch (same input_ids, labels and boundaries) — seed the loader by "
                    f"dp rank, not by global rank")
        for r, row in enumerate(rows):
            for field, a, b in zip(_FIELDS, rows[0], row):
                if a != b:
                    raise RankMismatch(
                        f"rank {r} disagrees with rank 0 on {field}: rank 0 has "
                        f"{_describe(field, a)}, rank {r} has {_describe(field, b)} (seen from "
                        f"rank {self.rank}, before any communication of attention data); every "
                        f"rank must call fringe.attention with the same plan (same mask content, "
                        f"score_mod, options) and the same local shapes{_HINTS.get(field, '')}")

    def _transport(self, device: torch.device) -> DistTransport:
        return DistTransport(self.group, timeout_s=self.timeout_s, device=device,
                             ranks=self._ranks)


def check_sinks(sinks, q) -> None:
    """``sinks`` must be a floating ``[H]`` tensor on q's device."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"sinks must be a tensor of per-head sink logits [H], got "
                        f"{type(sinks).__name__}")
    H = q.shape[1] if isinstance(q, torch.Tensor) and q.dim() == 4 else None
    if sinks.dim() != 1 or (H is not None and sinks.shape[0] != H):
        raise ValueError(f"sinks must have shape [H]=[{H}] (one logit per query head), got "
                         f"{tuple(sinks.shape)}")
    if not sinks.dtype.is_floating_point:
        raise ValueError(f"sinks must be floating point, got {sinks.dtype}")
    if isinstance(q, torch.Tensor) and sinks.device != q.device:
        raise ValueError(f"sinks are on {sinks.device} but q is on {q.device}; move them")
