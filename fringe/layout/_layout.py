"""The layout primitives: :class:`Layout` (a permutation of the global positions into equal
shards, with ``shard`` / ``unshard`` / ``positions``) and the fixed kinds (contiguous,
zigzag, striped, from an explicit order). Public names are re-exported by
:mod:`fringe.layout`."""
from __future__ import annotations

import dataclasses
import hashlib
import math
import operator

import torch

from ..masks import DEFAULT_BLOCK_SIZE as DEFAULT_BLOCK_SIZE  # masks does not import layout


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
    """A permutation of ``S`` global positions into ``P`` equal shards.

    Mutable state: a layout owns a copy of the ``order`` it is given (refilling the caller's
    tensor afterwards changes nothing), and every accessor that returns tensors
    (:meth:`positions`, :meth:`owner`, :meth:`shard`, :meth:`unshard`) returns new tensors
    that alias nothing of the layout: edit them freely. ``order`` itself is the layout's
    state (read it, never write it): an in-place edit is detected by its ``_version`` and
    the next use of the layout (or of a plan over it) raises.

    Args:
        kind: display name (``"contiguous"``, ``"zigzag"``, ``"striped"``, or yours).
        order: int64 ``[S]``; ``order[r*L:(r+1)*L]`` are the global positions of rank r.
        world_size: P.
    """

    kind: str
    order: torch.Tensor
    world_size: int

    def __post_init__(self) -> None:
        S, P = self.order.numel(), self.world_size
        if P < 1:
            raise ValueError(f"world_size must be >= 1, got {P}")
        if self.order.dim() != 1:
            raise ValueError(f"layout order must be 1-D [S], got shape {tuple(self.order.shape)}")
        if S % P:
            raise ValueError(f"S={S} tokens cannot be split into P={P} equal shards")
        dt = self.order.dtype
        if dt == torch.bool or dt.is_floating_point or dt.is_complex:
            raise TypeError(f"layout order must be an integer tensor of global positions (a "
                            f"permutation of range({S})), got dtype {dt}; build it with "
                            f"torch.randperm / torch.arange or pass ints")
        # own a copy: a layout must not alias the caller's tensor (nor hand out its own)
        order = self.order.detach().to("cpu", torch.int64, copy=True).contiguous()
        lo, hi = (int(order.min()), int(order.max())) if S else (0, 0)
        if lo < 0 or hi >= S:       # a negative entry would index from the end and pass below
            raise ValueError(f"layout order must be a permutation of range({S}), but it holds "
                             f"{lo if lo < 0 else hi}, outside [0, {S})")
        count = torch.bincount(order, minlength=S)
        if bool((count != 1).any()):
            dup, miss = int((count > 1).nonzero()[0]), int((count == 0).nonzero()[0])
            raise ValueError(f"layout order must be a permutation of range({S}), but position "
                             f"{dup} appears {int(count[dup])} times and position {miss} not at "
                             f"all; every global position must be held by exactly one rank")
        object.__setattr__(self, "order", order)
        object.__setattr__(self, "_order_version", order._version)

    def __getstate__(self) -> dict:
        """A copy or pickle (and so a copied or pickled plan) of an edited layout would record
        the edit as its own state: refuse it, as every other use does."""
        self._check_unchanged()
        state = dict(self.__dict__)
        state.pop("_order_version", None)
        return state

    def __setstate__(self, state: dict) -> None:
        """A copied or unpickled layout records its own order's version (unpickling bumps it)."""
        self.__dict__.update(state)
        object.__setattr__(self, "_order_version", self.order._version)

    # ---- sizes -------------------------------------------------------------------
    @property
    def seq_len(self) -> int:
        """S, the global sequence length."""
        return self.order.numel()

    @property
    def local_len(self) -> int:
        """L = S / P, tokens per rank."""
        return self.seq_len // self.world_size

    # ---- maps --------------------------------------------------------------------
    def positions(self, rank: int | None = None, *, group=None) -> torch.Tensor:
        """Global positions held by ``rank`` (int64 ``[L]``), in local order.

        A **copy** (L int64, cheap): derive RoPE or per-document positions from it in place
        (``pos -= starts[ids[pos]]``) without touching the layout or any plan over it.

        Args:
            rank: the plan rank; or
            group: the process group or ``DeviceMesh`` :func:`fringe.attention` runs on:
                the rank is this process's coordinate in it (:meth:`rank_in`).
        """
        rank = self._resolve_rank(rank, group)
        L = self.local_len
        return self.order[rank * L:(rank + 1) * L].clone()

    def owner(self) -> torch.Tensor:
        """int64 ``[S]``: the rank that holds each global position (a new tensor)."""
        self._check_unchanged()
        own = torch.empty(self.seq_len, dtype=torch.int64)
        own[self.order] = torch.arange(self.seq_len) // self.local_len
        return own

    def shard(self, x: torch.Tensor, rank: int | None = None, *, dim: int = -2,
              group=None) -> torch.Tensor:
        """Rank ``rank``'s tokens of a global tensor (sequence along ``dim``; a new tensor).

        Which rank: the **plan rank**, the position in the CP group that
        :func:`fringe.attention` runs this process as. For a process group it is
        ``dist.get_rank(group)``; for a ``DeviceMesh`` it is the place of this process in
        the mesh (row-major over a 2D mesh: ``g*k + p`` for coordinate ``(g, p)``), which is
        **not** ``dist.get_rank()`` when the mesh orders ranks otherwise (``DeviceMesh("cuda",
        [[3, 1], [0, 2]])``: global rank 3 is plan rank 0). Sharding by the global rank there
        gives every rank another rank's tokens, a wrong answer with no error; pass
        ``group=`` (the same object given to :func:`fringe.attention`) and the layout reads
        the coordinate itself.

        Args:
            x: the global tensor, ``S`` along ``dim``.
            rank: the plan rank (give this or ``group``).
            dim: the sequence dimension.
            group: a process group (``dist.group.WORLD`` for the default one) or a
                ``DeviceMesh``; leave None when giving ``rank``.

        Raises:
            ValueError: neither or both of ``rank`` / ``group``; a rank out of range; a
                group whose size is not the layout's ``P``; ``S`` does not match.
        """
        rank = self._resolve_rank(rank, group)
        self._check_len(x, dim)
        L = self.local_len
        return x.index_select(dim, self.order[rank * L:(rank + 1) * L].to(x.device))

    def rank_in(self, group) -> int:
        """This process's plan rank in ``group`` (a process group, None or
        ``dist.group.WORLD`` for the default one, or a 1D / 2D ``DeviceMesh`` in plan-rank
        order, as :func:`fringe.attention` reads it).

        Raises:
            ValueError: torch.distributed is not initialised, this process is not in the
                group, or the group's size is not the layout's ``P``.
        """
        import torch.distributed as dist
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("layout.shard(..., group=) reads this process's rank in the group, "
                             "but torch.distributed is not initialised; pass rank= instead")
        try:
            from torch.distributed.device_mesh import DeviceMesh
        except ImportError:              # a torch built without device meshes
            DeviceMesh = ()
        if isinstance(group, DeviceMesh):
            if group.ndim not in (1, 2):
                raise ValueError(f"a {group.ndim}D DeviceMesh of shape {tuple(group.shape)}: pass "
                                 f"the CP sub-mesh (1D, or 2D (outer, inner) for compose), as to "
                                 f"fringe.attention")
            ranks = [int(r) for r in group.mesh.reshape(-1).tolist()]   # plan-rank order
            me = dist.get_rank()
            if me not in ranks:
                raise ValueError(f"global rank {me} is not in the DeviceMesh {ranks}")
            rank, size = ranks.index(me), len(ranks)
        else:
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            if rank < 0:
                raise ValueError(f"global rank {dist.get_rank()} is not a member of the group")
        if size != self.world_size:
            raise ValueError(f"the group has {size} ranks but the layout is for P="
                             f"{self.world_size}; pass the CP group (the one given to "
                             f"fringe.attention)")
        return rank

    def unshard(self, shards: list[torch.Tensor] | tuple[torch.Tensor, ...], *,
                dim: int = -2) -> torch.Tensor:
        """Inverse of :meth:`shard`: the global tensor from all P shards in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"unshard needs {self.world_size} shards (one per rank), "
                             f"got {len(shards)}")
        self._check_unchanged()
        for r, t in enumerate(shards):      # equal totals can hide unequal shards
            if t.shape[dim] != self.local_len:
                raise ValueError(f"unshard: shard {r} has {t.shape[dim]} tokens along dim {dim}, "
                                 f"but every rank holds L=S/P={self.local_len} (S={self.seq_len}, "
                                 f"P={self.world_size}); pass each rank's shard as "
                                 f"layout.shard(x, rank, dim={dim}) made it, in rank order")
        cat = torch.cat(list(shards), dim=dim)
        self._check_len(cat, dim)
        inverse = torch.empty_like(self.order)
        inverse[self.order] = torch.arange(self.seq_len)
        return cat.index_select(dim, inverse.to(cat.device))

    def fingerprint(self) -> str:
        """A short hash of the permutation, equal on every rank that built the same layout."""
        self._check_unchanged()
        digest = hashlib.sha1(self.order.numpy().tobytes()).hexdigest()[:12]
        return f"{self.kind}/P{self.world_size}/S{self.seq_len}/{digest}"

    def __repr__(self) -> str:
        return f"Layout({self.kind}, S={self.seq_len}, P={self.world_size})"

    # ---- checks ------------------------------------------------------------------
    def _check_unchanged(self) -> None:
        """Raise if ``order`` was edited in place since the layout was built."""
        if self.order._version != self.__dict__["_order_version"]:
            raise ValueError(f"{self!r}: its order tensor was edited in place after the layout "
                             f"was built, so it no longer matches the plans made over it; a "
                             f"layout is immutable: edit a copy (layout.positions(rank) and "
                             f"layout.order.clone() are yours) and build a new layout "
                             f"(fringe.layout.from_order) and plan with it")

    def _resolve_rank(self, rank, group) -> int:
        if group is not None:
            if rank is not None:
                raise ValueError("give rank= or group=, not both")
            rank = self.rank_in(group)
        elif rank is None:
            raise ValueError("give the plan rank (rank=) or the CP group / DeviceMesh (group=)")
        rank = self._check_rank(rank)
        self._check_unchanged()
        return rank

    def _check_rank(self, rank) -> int:
        try:
            r = operator.index(rank)
        except TypeError:
            r = None
        if r is None or isinstance(rank, bool) or not 0 <= r < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank!r}")
        return r

    def _check_len(self, x: torch.Tensor, dim: int) -> None:
        if x.shape[dim] != self.seq_len:
            raise ValueError(f"tensor has {x.shape[dim]} tokens along dim {dim}, but the layout "
                             f"is for S={self.seq_len}; shape {tuple(x.shape)}")


def _granularity_error(S: int, unit: int, what: str) -> ValueError:
    pad = -(-S // unit) * unit if S > 0 else unit
    return ValueError(f"S={S} is not divisible by {what}={unit}; pad the sequence to {pad} "
                      f"tokens (or choose a smaller block size)")


def _check(S: int, P: int, block_size: int = 1) -> None:
    for name, v in (("world_size", P), ("seq_len", S), ("block_size", block_size)):
        try:
            ok = not isinstance(v, bool) and operator.index(v) is not None   # ints, numpy/torch ints
        except TypeError:
            ok = False
        if not ok:
            raise ValueError(f"{name} must be an int >= 1, got {v!r} ({type(v).__name__})")
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")


def contiguous(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Rank r holds ``[r*L, (r+1)*L)``. Needs ``S % (P*block_size) == 0``."""
    _check(seq_len, world_size, block_size)
    if seq_len % (world_size * block_size):
        raise _granularity_error(seq_len, world_size * block_size, f"P*block={world_size}*{block_size}")
    return Layout("contiguous", torch.arange(seq_len), world_size)


def zigzag(seq_len: int, world_size: int, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """2P chunks; rank r holds chunks r and 2P-1-r. Needs ``S % (2*P*block_size) == 0``."""
    _check(seq_len, world_size, block_size)
    unit = 2 * world_size * block_size
    if seq_len % unit:
        raise _granularity_error(seq_len, unit, f"2*P*block=2*{world_size}*{block_size}")
    chunk = seq_len // (2 * world_size)
    chunks = torch.arange(seq_len).view(2 * world_size, chunk)
    order = torch.cat([torch.cat([chunks[r], chunks[2 * world_size - 1 - r]])
                       for r in range(world_size)])
    return Layout("zigzag", order, world_size)


def striped(seq_len: int, world_size: int, *, stripe: int = 1,
            block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """Stripe i (``stripe`` tokens) goes to rank ``i % P``.

    Needs ``S % (stripe*P) == 0`` and the local length to be a multiple of ``block_size``.
    """
    _check(seq_len, world_size, block_size)
    if stripe < 1:
        raise ValueError(f"stripe must be >= 1 token, got {stripe}")
    P = world_size
    unit = math.lcm(stripe * P, P * block_size)     # whole stripes and whole blocks per rank
    if seq_len % unit:
        what = (f"stripe*P={stripe}*{P}" if unit == stripe * P else
                f"P*block={P}*{block_size}" if unit == P * block_size else
                f"lcm(stripe*P, P*block)=lcm({stripe}*{P}, {P}*{block_size})")
        raise _granularity_error(seq_len, unit, what)
    stripes = torch.arange(seq_len).view(seq_len // (stripe * P), P, stripe)
    order = stripes.transpose(0, 1).reshape(-1)
    return Layout(f"striped({stripe})" if stripe != 1 else "striped", order, world_size)


def from_order(order: torch.Tensor, world_size: int, *, kind: str = "custom",
               block_size: int = DEFAULT_BLOCK_SIZE) -> Layout:
    """A user-defined layout from an explicit permutation (``order[r*L:(r+1)*L]`` → rank r)."""
    order = torch.as_tensor(order)          # Layout refuses a non-integer dtype (no truncation)
    _check(order.numel(), world_size, block_size)
    if order.numel() % (world_size * block_size):
        raise _granularity_error(order.numel(), world_size * block_size,
                                 f"P*block={world_size}*{block_size}")
    return Layout(kind, order, world_size)
