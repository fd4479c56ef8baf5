"""The ``flex`` kernel: FlexAttention (its public API) over a whole tile, sparse by fringe's map.

Legend: B batch · H query heads · G kv heads (H % G == 0) · L tokens · D head dim.

A kernel with ``wants_blocks = True`` gets the whole tile from :mod:`fringe.ops.tile` with its
block map and mask_mod instead of dense sub-problems with dense masks::

    kernel.forward(q, k, v, *, q_pos, kv_pos, blocks, block_size, mask_mod, score_mod, scale)
        -> (out [B, H, Lq, Dv], lse [B, H, Lq])       # Dv: v's head dim (FlexAttention's own)
    kernel.backward(q, k, v, out, lse, dout, *, q_pos, kv_pos, blocks, block_size, mask_mod,
                    score_mod, scale, dlse=None, score_params=())
        -> (dq, dk, dv) or (dq, dk, dv, dparams)     # out, lse: the GLOBAL merged ones

``blocks`` is always given (int8 ``[ceil(Lq/block_size), ceil(Lk/block_size)]`` of
``BlockKind`` codes: all FULL for a FULL tile, all PARTIAL for a PARTIAL tile without a map).

**Block sparsity follows fringe's classification** (:func:`block_mask`): FULL blocks become
FlexAttention's ``full_kv`` blocks (no mask_mod evaluated), PARTIAL blocks its partial blocks
(mask_mod applied), EMPTY blocks are absent. The BlockMask's block size is fringe's
``block_size`` when that is a multiple of ``sparse_multiple`` (default 128), else the smallest
common multiple, made by merging fringe's blocks exactly (a merged block is FULL when all its
blocks are FULL, absent when all are EMPTY, PARTIAL otherwise). Why 128: the Triton kernels
need the sparse block to be a multiple of their tile sizes, and the default backward configs
in torch 2.13's inductor for sm90 (H100/H200) with 64 < D <= 128 use BLOCK_N1 = 128 and skip
any config that does not divide the sparse block, so a 64-token BlockMask leaves the backward
with no config there. ``FlexKernel(sparse_multiple=None)`` keeps fringe's block size exactly
and sets the forward's ``BLOCK_M`` / ``BLOCK_N`` (``fwd_`` kernel options) to divide it;
``examples/gpu_check.py`` runs both (read from inductor's source, not yet run on a GPU).

**Global positions**: FlexAttention calls mask_mod / score_mod with local row indices; they
are wrapped so fringe's mods see ``q_pos[q_idx]`` / ``kv_pos[kv_idx]`` (indices clamped into
range: the compiled kernel may evaluate a mod on the padded tail of a last partial block).

**Backward through public autograd** (:func:`tile_vjp`): FlexAttention has no public backward
that takes the GLOBAL out/lse, so the tile's forward is recomputed under autograd and the
tile's cotangents are composed from the global ones. With ``w = exp(lse_t - lse)`` (0 where
either is -inf), ``delta = rowsum(dout * out)``, ``delta_t = rowsum(dout * out_t)``::

    d out_t = w * dout
    d lse_t = w * (delta_t - delta + dlse)

Through the tile's softmax (``p_t = exp(s - lse_t)``, ``w * p_t = p = exp(s - lse)``) this gives
``ds = p * (dp - (delta - dlse))``, the flash-attention backward every fringe kernel computes;
FlexAttention's own backward folds the lse cotangent into its delta, so it computes
``w * (delta - dlse)`` there. Cost: one extra tile forward per backward (the recompute).

**Compiled, static shapes**: on CUDA, FlexAttention runs through
``torch.compile(flex_attention, dynamic=False)``; a tile keeps its shape from call to call in a
plan, and the block map, positions and mask tensors are inputs, not constants, so a new batch's
document ids do not recompile (measured on CPU with a counting backend, ``tests/test_flex.py``).
A mask whose *Python constants* change (``sliding_window(5)`` then ``sliding_window(7)``) does
recompile, as in FlexAttention.

**One compiled function per mask structure** (a workaround for pytorch issue #176211, fixed by
PR #184793, open at the time of writing): when a compiled function's guards fail, Dynamo
re-evaluates the tensor sources its first compile recorded (``...__closure__[0]
.cell_contents[1]...``) to word a recompile reason, and raises ``TypeError: 'int' object is
not subscriptable`` where a second mask_mod has another closure layout there (a document
mask, then a sliding window: torch 2.13, eager ``flex_attention`` and every backend alike,
since they all share one code object's cache). So each kernel keeps its own compiled functions
(each a fresh copy of one small code object, so that each has its own cache), one per
*structure* of the call (:func:`call_structure`: the code objects and closure layout of the
mask_mod and score_mod, tensor dtypes and ranks but not their values, the tile's shapes), at
most :data:`MAX_COMPILED` of them, least recently used dropped first. A new batch's document
ids keep their structure, so they reuse their function (and a diagonal tile's positions are
copied rather than passed twice, so it shares the off-diagonal tiles' function: Dynamo compiles
aliased inputs apart). ``backend=None`` (FlexAttention's
eager semantics) compiles the same way with the ``"eager"`` backend, as ``flex_attention``'s
own eager path does, only per structure.

**CPU**: FlexAttention has no CPU backward (torch 2.13: "FlexAttention does not support
backward on CPU") and its eager path is dense math over the whole score matrix that ignores
the block map, so ``available("cpu")`` is False and :mod:`fringe.ops.tile` falls back to the
automatic choice there. ``FlexKernel(backend=None, devices=("cpu",))`` runs the eager forward on
CPU; the tests use it to check the wrapping, GQA, scale, score_mod and lse against the
reference in float64, and a stand-in whose differentiable tile forward is the reference
restricted to the BlockMask's own semantics to check block sparsity and the backward.
"""
from __future__ import annotations

import collections
import functools
import importlib.util
import math
import types
from typing import Callable

import torch

from fringe.masks import BlockKind, Mask

from .reference import compute_dtype

__all__ = ["FLEX", "MAX_COMPILED", "FlexKernel", "block_mask", "call_structure",
           "flex_block_size", "on_device", "on_global", "tile_vjp"]

#: The sparse block of a BlockMask is a multiple of this many tokens by default (see the module
#: docstring): FlexAttention's own default block size, which its default Triton configs divide.
SPARSE_MULTIPLE = 128

_EMPTY, _FULL = int(BlockKind.EMPTY), int(BlockKind.FULL)

#: At most this many compiled FlexAttention functions per kernel (one per call structure, see
#: the module docstring and :func:`call_structure`); the least recently used is dropped first.
MAX_COMPILED = 64


def flex_block_size(block_size: int, sparse_multiple: int | None = SPARSE_MULTIPLE) -> int:
    """The BlockMask block size for fringe's ``block_size``: the least common multiple with
    ``sparse_multiple`` (``block_size`` itself when ``sparse_multiple`` is None)."""
    block_size = int(block_size)
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    if not sparse_multiple:
        return block_size
    return block_size * sparse_multiple // math.gcd(block_size, sparse_multiple)


def _merge_blocks(blocks: torch.Tensor, factor: int) -> torch.Tensor:
    """Merge ``factor x factor`` groups of block codes exactly: FULL when every block is FULL,
    EMPTY when every block is EMPTY, PARTIAL otherwise. Blocks past the map's edge (the padded
    tail) count as either."""
    if factor == 1:
        return blocks
    nq, nk = blocks.shape
    mq, mk = -(-nq // factor), -(-nk // factor)
    pad = torch.full((mq * factor, mk * factor), -1, dtype=blocks.dtype)
    pad[:nq, :nk] = blocks
    g = pad.view(mq, factor, mk, factor)
    outside = g == -1
    full = ((g == _FULL) | outside).all(3).all(1)
    empty = ((g == _EMPTY) | outside).all(3).all(1)
    out = torch.full((mq, mk), int(BlockKind.PARTIAL), dtype=blocks.dtype)
    out[full] = _FULL
    out[empty] = _EMPTY                           # a group wholly outside never occurs
    return out


def _ordered(sel: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense bool ``[nq, nk]`` -> (num_blocks ``[1, 1, nq]``, indices ``[1, 1, nq, nk]``) int32,
    the selected kv blocks of each row first, in increasing order."""
    num = sel.sum(-1, dtype=torch.int32)
    idx = torch.argsort((~sel).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num[None, None].to(device), idx[None, None].to(device)


def on_device(mod: Callable, device: torch.device | str) -> Callable:
    """``mod`` with the tensors it captures on ``device``.

    A compiled FlexAttention kernel reads a mod's captured tensors on the GPU, but fringe's
    masks keep theirs on the CPU (``document`` moves its ids at each call, which a compiled
    kernel cannot do inside its mask graph). Like :func:`fringe.masks.snapshot`, closure
    cells, defaults, :class:`~fringe.masks.Mask` mods, ``functools.partial`` arguments, tuples,
    lists and dicts are walked; a tensor that requires grad (a score_mod's parameter) is left
    where it is, so it keeps its gradient. The mod itself is returned when nothing moves. Not
    cached: a captured tensor refilled in place between calls is copied again (the copy is one
    small host-to-device transfer per captured tensor and tile call, e.g. 1 MB of document ids
    at S = 128K).
    """
    return _move(mod, torch.device(device), {})


_NO_CELL = object()


def _move(obj, device: torch.device, memo: dict):
    key = id(obj)
    if key in memo:
        return memo[key]
    memo[key] = out = obj
    if isinstance(obj, torch.Tensor):
        if not obj.requires_grad and obj.device != device:
            out = obj.to(device)
    elif isinstance(obj, Mask):
        out = _move(obj.mod, device, memo)
    elif isinstance(obj, types.FunctionType):
        out = _move_function(obj, device, memo)
    elif isinstance(obj, functools.partial):
        f = _move(obj.func, device, memo)
        args = tuple(_move(a, device, memo) for a in obj.args)
        kw = {k: _move(v, device, memo) for k, v in obj.keywords.items()}
        if f is not obj.func or any(a is not b for a, b in zip(args, obj.args)) or any(
                kw[k] is not obj.keywords[k] for k in kw):
            out = functools.partial(f, *args, **kw)
    elif type(obj) in (tuple, list):
        items = [_move(v, device, memo) for v in obj]
        if any(a is not b for a, b in zip(items, obj)):
            out = type(obj)(items)
    elif type(obj) is dict:
        items = {k: _move(v, device, memo) for k, v in obj.items()}
        if any(items[k] is not obj[k] for k in items):
            out = items
    memo[key] = out
    return out


def _move_function(fn: types.FunctionType, device: torch.device, memo: dict):
    cells = fn.__closure__ or ()
    old = []
    for c in cells:
        try:
            old.append(c.cell_contents)
        except ValueError:                    # an empty cell
            old.append(_NO_CELL)
    new = [v if v is _NO_CELL else _move(v, device, memo) for v in old]
    defaults = fn.__defaults__
    new_defaults = None if defaults is None else tuple(_move(v, device, memo) for v in defaults)
    if all(a is b for a, b in zip(new, old)) and (
            defaults is None or all(a is b for a, b in zip(new_defaults, defaults))):
        return fn
    closure = tuple(types.CellType() if v is _NO_CELL else types.CellType(v) for v in new)
    out = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, new_defaults,
                             closure if cells else None)
    out.__kwdefaults__ = fn.__kwdefaults__
    out.__dict__.update(fn.__dict__)
    out.__qualname__, out.__module__, out.__doc__ = fn.__qualname__, fn.__module__, fn.__doc__
    return out


def on_global(mod: Callable | None, q_pos: torch.Tensor, kv_pos: torch.Tensor, *,
              score: bool = False) -> Callable | None:
    """``mod`` on global positions, called with FlexAttention's local indices.

    ``mask_mod(b, h, q_pos[q_idx], kv_pos[kv_idx])`` (``score_mod(score, b, h, ...)`` with
    ``score=True``); indices are clamped into ``[0, L)`` (see the module docstring), and the
    tensors ``mod`` captures are moved to the positions' device (:func:`on_device`).
    """
    if mod is None:
        return None
    mod = on_device(mod, q_pos.device)
    qmax, kmax = q_pos.numel() - 1, kv_pos.numel() - 1
    if score:
        def global_score_mod(s, b, h, q_idx, kv_idx):
            return mod(s, b, h, q_pos[q_idx.clamp(0, qmax)], kv_pos[kv_idx.clamp(0, kmax)])
        return global_score_mod

    def global_mask_mod(b, h, q_idx, kv_idx):
        return mod(b, h, q_pos[q_idx.clamp(0, qmax)], kv_pos[kv_idx.clamp(0, kmax)])
    return global_mask_mod


def block_mask(blocks: torch.Tensor, *, block_size: int, q_pos: torch.Tensor,
               kv_pos: torch.Tensor, mask_mod: Callable | None,
               sparse_multiple: int | None = SPARSE_MULTIPLE):
    """A FlexAttention ``BlockMask`` for one tile from fringe's block map.

    Args:
        blocks: int8 ``[ceil(Lq/block_size), ceil(Lk/block_size)]`` of ``BlockKind`` codes.
        block_size: the block size ``blocks`` was built with.
        q_pos: global positions of the tile's q rows, ``[Lq]`` (on the tile's device).
        kv_pos: global positions of its kv rows, ``[Lk]``.
        mask_mod: fringe's mask_mod (global positions), or None (PARTIAL blocks unmasked).
        sparse_multiple: see :func:`flex_block_size`.

    Returns:
        a ``BlockMask`` of shape ``[1, 1, Lq, Lk]`` (broadcast over b, h): FULL blocks in
        ``full_kv_*``, PARTIAL (and any other non-EMPTY code) in ``kv_*``, EMPTY absent;
        ``mask_mod`` wrapped by :func:`on_global`.
    """
    from torch.nn.attention.flex_attention import BlockMask

    Lq, Lk = q_pos.numel(), kv_pos.numel()
    want = (-(-Lq // block_size), -(-Lk // block_size))
    if tuple(blocks.shape) != want:
        raise ValueError(f"blocks must have shape [ceil(Lq/block_size), ceil(Lk/block_size)] = "
                         f"{list(want)} for Lq={Lq}, Lk={Lk}, block_size={block_size}; got "
                         f"{list(blocks.shape)}")
    fb = flex_block_size(block_size, sparse_multiple)
    codes = _merge_blocks(blocks.detach().cpu().to(torch.int8), fb // block_size)
    full = codes == _FULL
    partial = (codes != _FULL) & (codes != _EMPTY)
    dev = q_pos.device
    kv_num, kv_idx = _ordered(partial, dev)
    full_num, full_idx = _ordered(full, dev)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=fb,
                                    mask_mod=on_global(mask_mod, q_pos, kv_pos),
                                    seq_lengths=(Lq, Lk))


def call_structure(*objs) -> tuple:
    """A hashable summary of the object graphs Dynamo guards on in a FlexAttention call.

    The same summary means the same paths from the call's arguments to every tensor and
    constant: functions by their code object and the structure of their closure cells and
    defaults (walking :class:`~fringe.masks.Mask` mods, ``functools.partial``, bound methods,
    tuples, lists and dicts), tensors by dtype, rank, device and ``requires_grad`` (never
    their values or lengths: a new batch's document ids keep the summary), other values by
    their type (``sliding_window(5)`` and ``sliding_window(7)`` share one). Cycles are cut.
    """
    memo: dict[int, int] = {}
    return tuple(_structure(o, memo) for o in objs)


def _structure(obj, memo: dict[int, int]):
    if isinstance(obj, (bool, int, float, str, type(None))):
        return type(obj)
    key = id(obj)
    if key in memo:
        return ("seen", memo[key])
    memo[key] = len(memo)
    if isinstance(obj, torch.Tensor):
        return ("tensor", obj.dtype, obj.dim(), obj.device.type, obj.requires_grad)
    if isinstance(obj, Mask):
        return ("mask", _structure(obj.mod, memo))
    if isinstance(obj, types.FunctionType):
        cells = []
        for c in obj.__closure__ or ():
            try:
                cells.append(_structure(c.cell_contents, memo))
            except ValueError:                      # an empty cell
                cells.append("empty")
        kw = obj.__kwdefaults__ or {}
        return ("fn", obj.__code__, tuple(cells),
                tuple(_structure(d, memo) for d in obj.__defaults__ or ()),
                tuple((k, _structure(v, memo)) for k, v in kw.items()))
    if isinstance(obj, functools.partial):
        return ("partial", _structure(obj.func, memo),
                tuple(_structure(a, memo) for a in obj.args),
                tuple((k, _structure(v, memo)) for k, v in obj.keywords.items()))
    if isinstance(obj, types.MethodType):
        return ("method", _structure(obj.__func__, memo), _structure(obj.__self__, memo))
    if type(obj) in (tuple, list):
        return (type(obj), tuple(_structure(v, memo) for v in obj))
    if type(obj) is dict:
        return (dict, tuple((k if isinstance(k, (str, int)) else repr(k), _structure(v, memo))
                            for k, v in obj.items()))
    return type(obj)


def _flex_call(q, k, v, score_mod, block_mask, scale, enable_gqa, kernel_options, return_aux):
    """The function each compiled copy runs (see :meth:`FlexKernel._compiled`)."""
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale,
                          enable_gqa=enable_gqa, kernel_options=kernel_options,
                          return_aux=return_aux)


def tile_vjp(fwd: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, *,
             dlse: torch.Tensor | None = None,
             score_params: tuple[torch.Tensor, ...] = ()) -> tuple:
    """A tile's gradient given the GLOBAL ``out`` / ``lse``, through public autograd.

    Args:
        fwd: ``fwd(q, k, v) -> (out_t, lse_t)``, the tile's forward, differentiable.
        q, k, v: the tile's inputs (``[B, H, Lq, D]``, ``[B, G, Lk, D]``, ``[B, G, Lk, D]``).
        out: global merged output of these rows, ``[B, H, Lq, D]``.
        lse: global merged lse, ``[B, H, Lq]``.
        dout: cotangent of ``out``.
        dlse: cotangent of the global ``lse`` (None = 0).
        score_params: tensors ``fwd``'s score_mod closes over that require grad.

    Returns:
        ``(dq, dk, dv)`` in the inputs' dtypes, plus a tuple of ``dparams`` when
        ``score_params`` is given (see the module docstring for the composition).
    """
    ct = compute_dtype(q.dtype)
    with torch.enable_grad():
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
        out_t, lse_t = fwd(qg, kg, vg)
    lse_g = lse.to(ct)
    lt = lse_t.detach().to(ct)
    dead = torch.isneginf(lse_g) | torch.isneginf(lt)
    zero = torch.zeros((), dtype=ct, device=q.device)
    w = torch.where(dead, zero, torch.exp(torch.where(dead, zero, lt - lse_g)))
    dout_c = dout.to(ct)
    delta = (dout_c * out.to(ct)).sum(-1)
    delta_t = (dout_c * out_t.detach().to(ct)).sum(-1)
    g_lse = delta_t - delta
    if dlse is not None:
        g_lse = g_lse + dlse.to(ct)
    g_lse = torch.where(dead, zero, w * g_lse)
    g_out = w.unsqueeze(-1) * dout_c
    inputs = (qg, kg, vg, *score_params)
    grads = torch.autograd.grad((out_t, lse_t), inputs,
                                (g_out.to(out_t.dtype), g_lse.to(lse_t.dtype)), allow_unused=True)
    grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(inputs, grads)]
    res = (grads[0].to(q.dtype), grads[1].to(k.dtype), grads[2].to(v.dtype))
    return (*res, tuple(grads[3:])) if score_params else res


class FlexKernel:
    """FlexAttention over a whole tile with fringe's block map (see the module docstring).

    Args:
        backend: ``torch.compile`` backend for ``flex_attention`` (``"inductor"``: the fused
            Triton kernels); None gives FlexAttention's eager semantics (dense math, forward
            only on CPU: for tests), compiled with the ``"eager"`` backend as
            ``flex_attention`` itself does, but per call structure (see the module docstring).
        devices: device types on which :meth:`available` may say yes.
        sparse_multiple: the BlockMask block is a multiple of this (see :func:`flex_block_size`);
            None keeps fringe's block size and sets the forward's BLOCK_M / BLOCK_N to divide it.
        kernel_options: extra FlexAttention ``kernel_options`` (merged over the block ones).
    """

    name = "flex"
    #: tile.py hands this kernel the whole tile with its block map and mask_mod.
    wants_blocks = True

    def __init__(self, *, backend: str | Callable | None = "inductor",
                 devices: tuple[str, ...] = ("cuda",),
                 sparse_multiple: int | None = SPARSE_MULTIPLE,
                 kernel_options: dict | None = None) -> None:
        self.backend = backend
        self.devices = tuple(devices)
        self.sparse_multiple = sparse_multiple
        self.kernel_options = dict(kernel_options or {})
        # call structure -> compiled copy of _flex_call, least recently used first (#176211)
        self._fns: collections.OrderedDict = collections.OrderedDict()
        self._made = 0

    # -- availability --------------------------------------------------------------------------

    def available(self, device: torch.device | str | None = None) -> tuple[bool, str]:
        """``(ok, reason)`` on ``device`` (default CPU)."""
        dev = torch.device(device if device is not None else "cpu").type
        try:
            from torch.nn.attention.flex_attention import AuxRequest, BlockMask  # noqa: F401
        except ImportError as e:
            return False, (f"torch {torch.__version__} has no public FlexAttention with "
                           f"AuxRequest ({e}); use 'sdpa' or 'reference'")
        if dev not in self.devices:
            return False, (f"flex runs compiled FlexAttention on {'/'.join(self.devices)}, not "
                           f"{dev}: FlexAttention has no CPU backward (torch "
                           f"{torch.__version__}) and its eager path is dense math that ignores "
                           f"the block map; use 'sdpa' or 'reference' on CPU")
        if dev == "cuda":
            if not torch.cuda.is_available():
                return False, "no CUDA device is available"
            if self.backend == "inductor" and importlib.util.find_spec("triton") is None:
                return False, "torch.compile(flex_attention) on CUDA needs triton, not installed"
        how = ("eager (uncompiled)" if self.backend is None
               else f"torch.compile(backend={getattr(self.backend, '__name__', self.backend)!s})")
        return True, f"FlexAttention, {how}, block sparsity from fringe's block map"

    # -- the FlexAttention call ----------------------------------------------------------------

    def _compiled(self, key: tuple) -> Callable:
        """The compiled function for one call structure (made on first use).

        Workaround for pytorch issue #176211 (fix: pytorch PR #184793, open when written):
        Dynamo keeps its compiled graphs on the *code object*, so every ``torch.compile`` of
        ``flex_attention`` (and its eager path) shares one cache, and a guard failure on a
        second mask_mod of another closure layout raises ``TypeError: 'int' object is not
        subscriptable`` while wording the recompile reason. Each structure gets a fresh copy
        of :func:`_flex_call`'s code object, so a function's guards only ever see one layout.
        """
        fn = self._fns.get(key)
        if fn is not None:
            self._fns.move_to_end(key)
            return fn
        while len(self._fns) >= MAX_COMPILED:
            self._fns.popitem(last=False)
        self._made += 1
        code = _flex_call.__code__.replace(co_name=f"_flex_call_{self._made}")
        copy = types.FunctionType(code, _flex_call.__globals__, code.co_name)
        if self.backend is None:                 # flex_attention's eager path, per structure
            fn = torch.compile(copy, backend="eager", fullgraph=True, dynamic=False)
        else:
            fn = torch.compile(copy, backend=self.backend, dynamic=False)
        self._fns[key] = fn
        return fn

    def _options(self, fb: int) -> dict | None:
        opts = {}
        if self.backend is not None and fb % SPARSE_MULTIPLE:
            tile = min(64, fb & -fb)                     # largest power of 2 dividing fb, <= 64
            opts.update(fwd_BLOCK_M=tile, fwd_BLOCK_N=tile)   # the backward cannot be told
        opts.update(self.kernel_options)
        return opts or None

    def _attend(self, q, k, v, *, block_mask, score_mod, scale):
        """FlexAttention on one tile: ``(out, lse)``, differentiable where flex is."""
        from torch.nn.attention.flex_attention import AuxRequest

        opts = self._options(block_mask.BLOCK_SIZE[0])
        key = (call_structure(block_mask.mask_mod, score_mod, opts),
               tuple((t.shape, t.dtype, t.device) for t in (q, k, v)), block_mask.BLOCK_SIZE,
               tuple(block_mask.kv_indices.shape))
        out, aux = self._compiled(key)(q, k, v, score_mod, block_mask, scale,
                                       q.shape[1] != k.shape[1], opts, AuxRequest(lse=True))
        return out, aux.lse

    def _tile(self, *, q_pos, kv_pos, blocks, block_size, mask_mod, score_mod, scale):
        if kv_pos is q_pos or (kv_pos.numel() and kv_pos.data_ptr() == q_pos.data_ptr()):
            # a diagonal tile passes one tensor twice: Dynamo compiles aliased inputs apart,
            # so a copy (L int64) lets it share the off-diagonal tiles' compiled kernel
            kv_pos = kv_pos.clone()
        bm = block_mask(blocks, block_size=block_size, q_pos=q_pos, kv_pos=kv_pos,
                        mask_mod=mask_mod, sparse_multiple=self.sparse_multiple)
        sm = on_global(score_mod, q_pos, kv_pos, score=True)
        return lambda q, k, v: self._attend(q, k, v, block_mask=bm, score_mod=sm, scale=scale)

    # -- kernel interface (wants_blocks) -------------------------------------------------------

    def forward(self, q, k, v, *, q_pos, kv_pos, blocks, block_size, mask_mod=None,
                score_mod=None, scale):
        fwd = self._tile(q_pos=q_pos, kv_pos=kv_pos, blocks=blocks, block_size=block_size,
                         mask_mod=mask_mod, score_mod=score_mod, scale=scale)
        with torch.no_grad():
            out, lse = fwd(q, k, v)
        return out.to(q.dtype), lse.to(compute_dtype(q.dtype))

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, blocks, block_size,
                 mask_mod=None, score_mod=None, scale, dlse=None, score_params=()):
        fwd = self._tile(q_pos=q_pos, kv_pos=kv_pos, blocks=blocks, block_size=block_size,
                         mask_mod=mask_mod, score_mod=score_mod, scale=scale)
        return tile_vjp(fwd, q, k, v, out, lse, dout, dlse=dlse, score_params=score_params)


FLEX = FlexKernel()
