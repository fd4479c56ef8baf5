"""Training on a 2-D (dp, cp) mesh: gradient and loss scaling that are right by construction.

Under context parallelism every CP rank's loss is its *share* of the global loss: the sum of
its own targets' token losses divided by the global target count N. The shares add up to
the one-process loss, and the CP ranks' gradients must be SUMMED (each is already its share
of the global gradient). A data-parallel dimension on top makes N the count over every
replica and every microbatch of the optimizer step, so the same sum, over all dp x cp ranks,
gives the token-weighted mean over replicas. Averaging over the CP ranks instead (what DDP
and FSDP do by default) leaves gradients off by a factor of the CP size while the loss looks
right: :class:`GradSync` configures the wrapper so that cannot happen::

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    import fringe.train

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp", "cp"))
    dp_cp = fringe.train.dp_cp_mesh(mesh)                # 1-D, over the dp x cp ranks
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_cp)
    fully_shard(model, mesh=dp_cp)                       # or DDP(model, process_group=dp_cp.get_group())
    sync = fringe.train.GradSync(model, mesh)            # checks, sets FSDP's divide factor
    for microbatches in loader:                          # the CP ranks of a replica: the same data
        micro = []
        for ids, cu in microbatches:                     # plans and shards per microbatch
            doc_ids = packing.doc_ids_from_cu_seqlens(cu)
            plans = fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(doc_ids),
                                    seq_len=S, world_size=cp, group=mesh["cp"], batch_size=B)
            micro.append((plans, packing.shard_batch(ids, ids, plan=plans.plans,
                                                     group=mesh["cp"], cu_seqlens=cu)))
        step = sync.step(num_items=sum(s.num_items for _, s in micro),   # N over every replica
                         plans=[p for p, _ in micro])
        for plans, s in micro:                           # gradient accumulation
            out = model(**fringe.hf.model_inputs(s, plans), use_cache=False)
            step.backward(out.loss, num_items=s.num_items)   # HF's loss: sum / s.num_items
        opt.step(); opt.zero_grad()
        log(step.loss())                                 # the global loss (one all-reduce)

What :class:`GradSync` does, per wrapper:

* **FSDP2** (``fully_shard``, HSDP included): ``set_gradient_divide_factor(1.0)`` and
  ``set_force_sum_reduction_for_comms(True)`` on every FSDP module (the reduction is a plain
  SUM over the wrapper's ranks; gloo has no pre-multiplied sum), and
  ``set_reduce_scatter_unused_params(True)``: a parameter without a gradient on some rank
  (an MoE expert no local token was routed to) takes part in the reduce-scatter with zeros,
  so the ranks' collectives match. The loss share is ``loss_sum / N``.
* **DDP** averages over its process group of G ranks, so the share is ``loss_sum * G / N``:
  the average of the scaled gradients is the sum of the shares. Unused parameters are
  DDP's own business: build it with ``find_unused_parameters=True`` when ranks may leave
  parameters without a gradient (MoE); without it DDP raises at the next step.

Both are refused (before any communication) unless the wrapper's gradient reduction spans
exactly the mesh's dp x cp ranks (a wrapper over ``mesh["dp"]`` alone would average the CP
shares away), and :meth:`GradSync.step` refuses plans whose world size is not the mesh's
CP size or whose group is not ``mesh["cp"]``.

Every function here that communicates is a collective: every rank of the mesh calls it.
"""
from __future__ import annotations

import dataclasses
import numbers

import torch

__all__ = ["GradSync", "Step", "dp_cp_mesh", "group_ranks"]


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("fringe.train needs torch.distributed initialised "
                           "(dist.init_process_group) before the mesh is built")
    return dist


def _is_mesh(x) -> bool:
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:              # a torch built without device meshes
        return False
    return isinstance(x, DeviceMesh)


def group_ranks(group) -> list[int]:
    """The global ranks of a process group, a ``DeviceMesh`` (this rank's slice, flattened in
    mesh order) or None (the default group)."""
    dist = _dist()
    if group is None:
        return list(range(dist.get_world_size()))
    if _is_mesh(group):
        return [int(r) for r in group.mesh.reshape(-1).tolist()]
    return [int(r) for r in dist.get_process_group_ranks(group)]


def _dims(mesh, dp_dim: str, cp_dim: str) -> None:
    if not _is_mesh(mesh):
        raise TypeError(f"mesh must be a 2-D torch.distributed DeviceMesh with dims "
                        f"({dp_dim!r}, {cp_dim!r}), got {type(mesh).__name__}; build it with "
                        f"init_device_mesh(device, (dp, cp), mesh_dim_names=({dp_dim!r}, {cp_dim!r}))")
    names = tuple(mesh.mesh_dim_names or ())
    if mesh.ndim != 2 or dp_dim not in names or cp_dim not in names:
        raise ValueError(f"mesh must be 2-D with dims named {dp_dim!r} and {cp_dim!r}, got shape "
                         f"{tuple(mesh.shape)} with names {names}; build it with init_device_mesh("
                         f"device, (dp, cp), mesh_dim_names=({dp_dim!r}, {cp_dim!r})) or pass "
                         f"dp_dim= / cp_dim=")


def dp_cp_mesh(mesh, *, dp_dim: str = "dp", cp_dim: str = "cp", name: str = "dp_cp"):
    """A 1-D ``DeviceMesh`` over the dp x cp ranks of a 2-D (dp, cp) mesh (public API).

    This is the mesh to give ``fully_shard(..., mesh=)`` (or, as ``.get_group()``, DDP's
    ``process_group=``): the gradient reduction then spans both the data-parallel replicas
    and the CP ranks, which is what :class:`GradSync` requires. The mesh must cover every
    rank of the default group (a (dp, cp) slice of a larger mesh: flatten it there, e.g.
    torchtitan's ``dp_shard_cp``, and give that mesh to the wrapper).

    Raises:
        ValueError: ``mesh`` is not a 2-D (dp, cp) mesh over the whole default group.
    """
    _dims(mesh, dp_dim, cp_dim)
    dist = _dist()
    ranks = group_ranks(mesh)
    if sorted(ranks) != list(range(dist.get_world_size())):
        raise ValueError(f"the (dp, cp) mesh covers ranks {sorted(ranks)} but the default group has "
                         f"{dist.get_world_size()}: dp_cp_mesh builds a mesh over the whole default "
                         f"group; for a slice of a larger mesh, flatten the dp and cp dims of that "
                         f"mesh and pass the result to the wrapper")
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh(mesh.device_type, torch.tensor(ranks, dtype=torch.int64), mesh_dim_names=(name,))


def _wrapper(model) -> tuple[str, list[int], int]:
    """(kind, the ranks its gradient reduction spans, its averaging divisor)."""
    from torch.nn.parallel import DistributedDataParallel
    if isinstance(model, DistributedDataParallel):
        ranks = group_ranks(model.process_group)
        return "ddp", ranks, len(ranks)
    from torch.distributed.fsdp import FSDPModule
    if isinstance(model, FSDPModule):
        from torch.distributed.tensor import DTensor
        spans = set()
        for name, p in model.named_parameters():
            if not isinstance(p, DTensor):
                raise ValueError(f"parameter {name!r} is not sharded by fully_shard, so FSDP never "
                                 f"reduces its gradient; apply fully_shard to the root module "
                                 f"(fully_shard(model, mesh=...)) after its layers")
            spans.add(tuple(sorted(int(r) for r in p.device_mesh.mesh.reshape(-1).tolist())))
        if len(spans) != 1:
            raise ValueError(f"the model's parameters are sharded over different meshes "
                             f"{sorted(spans)}; shard every module over the one dp x cp mesh")
        return "fsdp", list(spans.pop()), 1
    raise TypeError(f"GradSync needs the model wrapped for data parallelism: fully_shard(model, "
                    f"mesh=fringe.train.dp_cp_mesh(mesh)) or DistributedDataParallel(model, "
                    f"process_group=fringe.train.dp_cp_mesh(mesh).get_group()); got "
                    f"{type(model).__name__}")


class GradSync:
    """Gradient and loss scaling for a model trained on a 2-D (dp, cp) mesh.

    Args:
        model: the model wrapped by ``fully_shard`` (FSDP2; HSDP too) or
            ``DistributedDataParallel``, whose gradient reduction spans exactly the mesh's
            dp x cp ranks (:func:`dp_cp_mesh`).
        mesh: the 2-D ``DeviceMesh`` with dims ``dp_dim`` and ``cp_dim``; ``mesh[cp_dim]``
            is the CP group the plans run on.
        dp_dim, cp_dim: the mesh's dimension names.

    Raises:
        TypeError: ``model`` is not wrapped by FSDP2 or DDP, or ``mesh`` is no DeviceMesh.
        ValueError: the wrapper's reduction does not span the dp x cp ranks of the mesh
            (e.g. it was built over ``mesh["dp"]``, which would average over CP), or the
            mesh is not 2-D (dp, cp). Raised on every rank, before any communication.
    """

    def __init__(self, model, mesh, *, dp_dim: str = "dp", cp_dim: str = "cp") -> None:
        _dims(mesh, dp_dim, cp_dim)
        dist = _dist()
        kind, spans, divisor = _wrapper(model)
        want = sorted(group_ranks(mesh))
        if sorted(spans) != want:
            me = dist.get_rank()
            cp = sorted(group_ranks(mesh[cp_dim]))
            missing = sorted(set(cp) - set(spans))
            why = (f"it does not span the CP dimension (CP ranks {missing} of this rank's CP group "
                   f"{cp} are not in it), so the CP shares would be averaged, not summed"
                   if missing else "it spans other ranks than the dp x cp ones")
            raise ValueError(f"rank {me}: the {kind.upper()} wrapper reduces gradients over ranks "
                             f"{sorted(spans)}, but the (dp, cp) mesh has ranks {want}: {why}; wrap "
                             f"the model over fringe.train.dp_cp_mesh(mesh)")
        self.model = model
        self.mesh = mesh
        self.kind = kind
        self.dp_dim, self.cp_dim = dp_dim, cp_dim
        self.cp_size = mesh[cp_dim].size()
        self.dp_size = mesh[dp_dim].size()
        #: the factor the loss share is multiplied by so that the wrapper's reduction sums
        self.loss_scale = float(divisor)
        self._group = None
        if kind == "ddp":
            self._group = model.process_group
        else:
            meshes = {id(p.device_mesh): p.device_mesh for p in model.parameters()}
            if len(meshes) == 1 and next(iter(meshes.values())).ndim == 1:
                self._group = next(iter(meshes.values())).get_group()
        #: whether FSDP zero-fills parameters without a local gradient (torch >= 2.10 has
        #: ``set_reduce_scatter_unused_params``; DDP: ``find_unused_parameters=True``)
        self.zero_fills_unused = kind == "ddp" and bool(getattr(model, "find_unused_parameters", False))
        if kind == "fsdp":
            from torch.distributed.fsdp import FSDPModule
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    # older torch: set_reduce_scatter_divide_factor, a plain SUM then a divide
                    getattr(m, "set_gradient_divide_factor",
                            getattr(m, "set_reduce_scatter_divide_factor", None))(1.0)
                    if hasattr(m, "set_force_sum_reduction_for_comms"):   # no PREMUL_SUM on gloo
                        m.set_force_sum_reduction_for_comms(True)
            if hasattr(model, "set_reduce_scatter_unused_params"):
                model.set_reduce_scatter_unused_params(True, recurse=True)
                self.zero_fills_unused = True

    def _reduce_group(self):
        """The process group over the dp x cp ranks (for the loss and the token count)."""
        if self._group is None:             # HSDP's 2-D mesh: one group over the whole world
            self._group = dp_cp_mesh(self.mesh, dp_dim=self.dp_dim, cp_dim=self.cp_dim).get_group()
        return self._group

    def check_plans(self, plans) -> None:
        """Refuse plans that do not run on this mesh's CP dimension.

        ``plans``: a :class:`fringe.hf.Plans` or :class:`fringe.titan.Plans` (its ``group``
        is checked too), a :class:`fringe.Plan`, or a list of these (one per microbatch).

        Raises:
            ValueError: a plan's world size is not the mesh's CP size, or the plans' group
                (``fringe.hf.plans(..., group=)``) is not ``mesh[cp_dim]``'s ranks.
        """
        if isinstance(plans, (list, tuple)):
            for p in plans:
                self.check_plans(p)
            return
        cp_mesh = self.mesh[self.cp_dim]
        bundle = hasattr(plans, "plans") and hasattr(plans, "group")     # hf / titan Plans
        items = plans.plans if bundle else [plans]
        for p in items:
            P = getattr(p, "world_size", None)
            if P != self.cp_size:
                raise ValueError(f"the plan is for P={P} CP ranks but the mesh's {self.cp_dim!r} "
                                 f"dimension has {self.cp_size}; plan with world_size="
                                 f"{self.cp_size} (mesh shape {tuple(self.mesh.shape)})")
        if bundle:
            got, want = group_ranks(plans.group), group_ranks(cp_mesh)
            if sorted(got) != sorted(want):
                what = "the default group" if plans.group is None else "group"
                raise ValueError(f"the plans run attention over {what} with ranks {sorted(got)}, "
                                 f"but this rank's CP group (mesh[{self.cp_dim!r}]) has ranks "
                                 f"{sorted(want)}; make them with fringe.hf.plans(..., "
                                 f"group=mesh[{self.cp_dim!r}]) (or fringe.titan.plans)")

    def step(self, *, num_items: int, plans=None) -> Step:
        """Start an optimizer step: the global target count N, over every dp replica.

        Args:
            num_items: this dp replica's non-ignored targets over all the microbatches of
                the step (``sum(shard.num_items)``: a :class:`~fringe.packing.Shard` counts its
                whole global batch, so every CP rank of a replica gives the same number).
            plans: checked with :meth:`check_plans` (optional).

        Returns:
            a :class:`Step`. One all-gather of a number over the dp x cp ranks (a collective).

        Raises:
            ValueError: ``num_items`` is not a non-negative int, the plans do not fit the
                mesh (before any communication); the CP ranks of a replica gave different
                counts (a count of each rank's own targets: N would come out as their mean,
                every gradient off by that factor), or the step has no target on any replica
                (on every rank).
        """
        if isinstance(num_items, bool) or not isinstance(num_items, numbers.Integral) or num_items < 0:
            raise ValueError(f"num_items must be an int >= 0 (this replica's targets over the "
                             f"step's microbatches, e.g. sum(shard.num_items)), got {num_items!r}")
        if plans is not None:
            self.check_plans(plans)
        dist = _dist()
        group = self._reduce_group()
        counts = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(counts, torch.tensor([float(num_items)], dtype=torch.float64), group=group)
        of = dict(zip(dist.get_process_group_ranks(group), (int(c.item()) for c in counts)))
        grid = self.mesh.mesh if self.dp_dim == self.mesh.mesh_dim_names[0] else self.mesh.mesh.T
        for replica in grid.tolist():           # the CP ranks of one replica: one batch
            got = [of[int(r)] for r in replica]
            if len(set(got)) > 1:
                raise ValueError(f"num_items differs between the CP ranks {replica} of one dp "
                                 f"replica: {got}; give the replica's count (shard.num_items, "
                                 f"the same on each of its CP ranks), not each rank's own targets")
        total = sum(of.values()) / self.cp_size  # every CP rank of a replica gave its count
        if total < 1:
            raise ValueError("the optimizer step has no target on any replica (every label is "
                             "ignored); skip the step")
        return Step(self, int(round(total)))


@dataclasses.dataclass(eq=False)
class Step:
    """One optimizer step's loss scaling (from :meth:`GradSync.step`).

    Attributes:
        num_items: N, the non-ignored targets over every dp replica and microbatch.
        scale: what a loss sum is multiplied by before ``backward``: ``loss_scale / N``.
    """

    sync: GradSync
    num_items: int
    _sum: float = 0.0

    @property
    def scale(self) -> float:
        return self.sync.loss_scale / self.num_items

    def share(self, loss: torch.Tensor, *, num_items: int | None = None) -> torch.Tensor:
        """The tensor to backpropagate for one microbatch on this rank.

        Args:
            loss: the sum of this rank's token losses (``packing.loss_sum``), or with
                ``num_items`` a mean over that many targets (transformers' loss given
                ``num_items_in_batch=shard.num_items``, which ``model_inputs`` passes).
            num_items: see ``loss``.
        """
        if loss.dim() != 0:
            raise ValueError(f"loss must be a scalar, got shape {tuple(loss.shape)}")
        factor = self.scale if num_items is None else self.scale * float(num_items)
        self._sum += float(loss.detach().double()) * (1.0 if num_items is None else float(num_items))
        return loss * factor

    def backward(self, loss: torch.Tensor, *, num_items: int | None = None) -> None:
        """``self.share(loss, num_items=...).backward()``."""
        self.share(loss, num_items=num_items).backward()

    def loss(self) -> float:
        """The step's global loss (mean over every target of every replica and microbatch),
        for logging: one all-reduce over the dp x cp ranks (a collective)."""
        dist = _dist()
        t = torch.tensor([self._sum], dtype=torch.float64)
        dist.all_reduce(t, group=self.sync._reduce_group())
        return t.item() / self.num_items
