"""Content digests: what ranks compare so that they compute the same numbers (:func:`digest`
for masks, :func:`fn_digest` for score_mods)."""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import types

import numpy as np
import torch

from ._bh import reads_bh
from ._blockmap import BlockMap
from ._eval import _eval_pairs, _method
from ._guard import _module_internals, rank_local
from ._kinds import _PARTIAL
from ._mask import Mask
from ._snapshot import global_data

_DIGEST_CHUNK_ELEMS = 1 << 22  # token pairs per chunk when a plain leaf is digested by value


class _Hasher:
    """blake2b over typed, length-prefixed tokens (no id(), no hash() of strings: both
    differ across processes)."""

    def __init__(self, tag: str):
        self.h = hashlib.blake2b(digest_size=20)
        self.put("tag", tag)

    def put(self, kind: str, data) -> None:
        if isinstance(data, str):
            data = data.encode()
        elif not isinstance(data, (bytes, bytearray, memoryview)):
            data = repr(data).encode()
        if len(data) < 4096:            # one update: the same bytes, a third of the calls
            self.h.update(f"{kind}:{len(data)}:".encode() + data)
            return
        self.h.update(f"{kind}:{len(data)}:".encode())
        self.h.update(data)

    def tensor(self, t: torch.Tensor, *, values: bool = True) -> None:
        self.put("tensor", f"{t.dtype}{tuple(t.shape)}")
        if values:
            flat = t.detach().reshape(-1).contiguous().cpu()
            if flat.dtype == torch.bool:
                flat = flat.to(torch.uint8)
            raw = flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8)
            self.put("bytes", memoryview(raw.numpy()))

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _rule_digest(hs: _Hasher, rule) -> None:
    hs.put("rule", type(rule).__name__)
    for f in dataclasses.fields(rule):
        v = getattr(rule, f.name)
        hs.put("field", f.name)
        if isinstance(v, torch.Tensor):
            hs.tensor(v.to(torch.int64) if not v.dtype.is_floating_point else v)
        else:
            hs.put("value", repr(v))


def digest(mask_mod, *, order: torch.Tensor, blocks: torch.Tensor | BlockMap, block_size: int,
           B: int | None = None, H: int | None = None) -> str:
    """A content digest (hex) of a mask, for ranks to check that they compute the same mask.

    Together with the block map (which the plan hashes separately) it decides every value
    the tiles use:

    * a :class:`Mask` from the factories digests its own parameters (name, window / prefix
      sizes, the int64 values of ``doc_ids``), recursively through ``&`` and ``|``;
    * a leaf without a block rule (a plain callable, or :func:`as_mask` of one) is digested
      by **value**: it is evaluated (as :func:`evaluate` would) over every PARTIAL block of
      ``blocks`` and the bits are hashed. FULL and EMPTY blocks are already fixed by the
      block map. This is sound whatever the callable reads (globals, bound methods, module
      state), and costs O(#PARTIAL blocks * block_size²) evaluations.

    Args:
        mask_mod: a :class:`Mask` or a plain mask_mod (the one the plan evaluates).
        order: the layout's global positions ``[S]``; block ``i`` holds
            ``order[i*bs:(i+1)*bs]``.
        blocks: int8 ``[S/bs, S/bs]`` :class:`BlockKind` map in layout order, or the same
            as a :class:`BlockMap` (same digest).
        block_size: bs.
        B, H: the batch / head counts the mask was classified for (None: b = h = 0);
            used for leaves that may read b / h.

    Returns:
        a 40-character hex string, equal across processes for equal masks.
    """
    bs = int(block_size)
    if order.dim() != 1 or order.numel() % bs or tuple(blocks.shape) != (order.numel() // bs,) * 2:
        raise ValueError(f"digest: expected order [S] and blocks [S/block_size]*2 with "
                         f"block_size={bs}; got order {tuple(order.shape)}, blocks "
                         f"{tuple(blocks.shape)}")
    hs = _Hasher("fringe.mask/1")
    ctx = {"order": order, "blocks": blocks, "bs": bs, "B": B, "H": H}
    _mask_digest(hs, mask_mod, ctx)
    return hs.hexdigest()


def _mask_digest(hs: _Hasher, m, ctx: dict) -> None:
    if not isinstance(m, Mask):
        _values_digest(hs, m, ctx, invariant=_digest_invariant(m, ctx))
        return
    hs.put("mask", f"{m.op}/{m.name}/{len(m.children)}/{m.bh_invariant}")
    if m.op != "leaf":
        for c in m.children:
            _mask_digest(hs, c, ctx)
    elif m.rule is not None:
        _rule_digest(hs, m.rule)
    else:
        _values_digest(hs, m.mod, ctx, invariant=_digest_invariant(m, ctx))


def _digest_invariant(leaf, ctx: dict) -> bool:
    """Whether a leaf's bits are hashed once (b = h = 0): declared or proven invariant."""
    return reads_bh(leaf, q_pos=ctx["order"], kv_pos=ctx["order"]).invariant


def _values_digest(hs: _Hasher, mod, ctx: dict, *, invariant: bool) -> None:
    """Hash the bits of ``mod`` over the PARTIAL blocks of the plan's block map."""
    if "partial" not in ctx:
        blocks = ctx["blocks"]
        ctx["partial"] = blocks.nonzero(_PARTIAL) if isinstance(blocks, BlockMap) else \
            (blocks == _PARTIAL).nonzero(as_tuple=True)
    pi, pj = ctx["partial"]
    bs, order = ctx["bs"], ctx["order"]
    nb, nh = (1, 1) if invariant else (ctx["B"] or 1, ctx["H"] or 1)
    hs.put("values", f"{nb}/{nh}/{bs}/{pi.numel()}")
    if not pi.numel():
        return
    pos = order.view(-1, bs)
    method = _method(mod, order, order, nb, nh)
    per = max(1, _DIGEST_CHUNK_ELEMS // (nb * nh * bs * bs))
    for c0 in range(0, pi.numel(), per):
        i, j = pi[c0:c0 + per], pj[c0:c0 + per]
        bits = _eval_pairs(mod, method, pos[i], pos[j], nb, nh)
        hs.put("bits", memoryview(bits.contiguous().view(torch.uint8).cpu().numpy()))


def fn_digest(fn) -> str:
    """A digest (hex) of a callable's code and captured values, for score_mods and the like.

    Covered: the code object (bytecode, names, constants recursively, argument layout),
    defaults and keyword defaults, and the contents of closure cells — tensors and numpy
    arrays / scalars by dtype, shape and content bytes, numbers / strings / None by repr,
    tuples, lists, dicts, sets, ``functools.partial`` objects, nested functions and
    :class:`Mask` objects recursively (a Mask's plain leaves by their function). Tensors that require grad are digested by
    dtype and shape only: their values legitimately change during training and are kept
    in sync by data parallelism. A device by its type only (its index is each rank's own
    accelerator).

    Objects are digested by the data they hold: a bound method by its function and its
    instance, a callable instance by its type's ``__call__`` and its state, and any other
    object reached (through closure cells, defaults, globals, containers or another
    object's attributes) by its type's name and the values of its ``__dict__`` and
    ``__slots__``, recursively, the same way. So ``self.softcap``, a dataclass's float, a
    ``torch.nn.Module``'s attributes, buffers (by content) and submodules are covered; its
    parameters, which require grad, by dtype and shape. Module globals the code reads by
    name are covered where they hold data (tensors, numbers, containers, objects:
    :func:`fringe.masks.snapshot` copies those); globals holding callables, classes or
    modules by name only.

    Not covered (by type only): objects whose state Python cannot read (C extensions:
    ``torch.Generator``, process groups), an ``nn.Module``'s hooks and other bookkeeping
    (``training`` is covered), ``torch.distributed``'s own objects
    (``DeviceMesh``, FSDP state: they differ on every rank by design; a module
    ``fully_shard`` re-classed is read as the module it was), an object's
    attribute that holds more than ~5,000 objects or 5 MB of tensor data (the walk is
    bounded so a plan over a score_mod bound to a large model stays cheap), class
    attributes, values computed when read (properties, ``__getattr__``) and the globals of
    functions it calls by name. Ranks that run the same program with the same arguments
    agree; a rank whose value differs there is not detected, and an object that holds
    per-rank state the score_mod does not read (a rank number, a logger) makes ranks
    disagree: bind the values the score_mod reads instead (a closure or ``partial``).

    Returns:
        a 40-character hex string, equal across processes for equal functions.
    """
    hs = _Hasher("fringe.fn/1")
    _obj_digest(hs, fn, _Walk(), 0)
    return hs.hexdigest()


_MAX_DEPTH = 64
#: what one attribute of an object may cost to digest: objects and container items visited,
#: plus one per KiB of tensor content hashed. Beyond it the attribute is digested by its type
_ATTR_BUDGET = 5_000


class _TooLarge(Exception):
    pass


class _Walk(set):
    """One :func:`fn_digest` walk: the ids on the current path (the set: a cycle guard, never
    part of the digest) and the cost spent, bounded while an object's attribute is walked."""

    def __init__(self):
        super().__init__()
        self.spent = 0
        self.limit: int | None = None   # set while the outermost object attribute is walked

    def spend(self, units: int) -> None:
        self.spent += units
        if self.limit is not None and self.spent > self.limit:
            raise _TooLarge


_UNSET = object()


#: the prefix of the attributes torch.distributed's composable APIs (``fully_shard``,
#: ``replicate``) keep their state under: the rest of the name is a uuid4 drawn per process
_COMPOSABLE = "__composable_api_state_key_"
#: what ``nn.Module.__init__`` sets that holds the module's data (the rest is bookkeeping)
_MODULE_DATA = frozenset({"training", "_parameters", "_buffers", "_modules"})


def _state(obj) -> list[tuple[str, object]] | None:
    """The data an instance holds by name: its ``__dict__`` and the values of its
    ``__slots__`` (an unset slot as :data:`_UNSET`), sorted by name; None for an object with
    neither (a C extension's, whose state Python cannot read). An ``nn.Module``'s hooks and
    other bookkeeping are left out: a hook's key is a process-wide counter (a hook registered
    on rank 0 alone, anywhere, shifts every later key there), and hooks are registered per
    rank (logging, profiling)."""
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:                   # noqa: BLE001 - no __dict__, or one that cannot be read
        d = None
    items = dict(d) if type(d) is dict else {}
    if isinstance(obj, torch.nn.Module):   # its bookkeeping: hooks, keyed by a process-wide
        for name in _module_internals() - _MODULE_DATA:     # counter, registered per rank
            items.pop(name, None)
        for name in [n for n in items if n.startswith(_COMPOSABLE)]:
            del items[name]     # fully_shard's state, under a name with a per-process uuid4
    slotted = False
    for cls in type(obj).__mro__:
        if "__slots__" not in cls.__dict__:
            continue
        for name, member in cls.__dict__.items():   # one member descriptor per slot
            if isinstance(member, types.MemberDescriptorType):
                slotted = True
                try:
                    items[f"{cls.__qualname__}.{name}"] = member.__get__(obj, cls)
                except AttributeError:
                    items[f"{cls.__qualname__}.{name}"] = _UNSET
    if type(d) is not dict and not slotted:
        return None
    return sorted(items.items(), key=lambda kv: str(kv[0]))


def _state_digest(hs: _Hasher, obj, seen: _Walk, depth: int) -> None:
    """An instance: its type's name, then each attribute's value, recursively. The outermost
    attributes are each walked within :data:`_ATTR_BUDGET`; one that exceeds it is digested by
    its type (whether it does is independent of the walk's order, so equal objects agree)."""
    t = type(obj)
    hs.put("object", f"{t.__module__}.{t.__qualname__}")
    # torch.distributed's objects (DeviceMesh, process groups, FSDP state) describe this rank's
    # place in the group: they differ on every rank by design, so they are digested by type
    items = None if rank_local(t) else _state(obj)
    if items is None:
        hs.put("opaque", "")
        return
    hs.put("state", len(items))
    for name, v in items:
        hs.put("attr", str(name))
        if v is _UNSET:
            hs.put("unset", "")
        elif seen.limit is not None:           # inside an attribute already bounded
            _obj_digest(hs, v, seen, depth + 1)
        else:
            sub = _Hasher("attr")
            seen.limit = seen.spent + _ATTR_BUDGET
            try:
                _obj_digest(sub, v, seen, depth + 1)
                hs.put("value", sub.hexdigest())
            except _TooLarge:
                hs.put("large", f"{type(v).__module__}.{type(v).__qualname__}")
            finally:
                seen.limit = None


def _sub_digest(obj, seen: _Walk, depth: int) -> str:
    hs = _Hasher("sub")
    _obj_digest(hs, obj, seen, depth)
    return hs.hexdigest()


def _code_digest(hs: _Hasher, code: types.CodeType, seen: _Walk, depth: int) -> None:
    hs.put("code", code.co_code)
    hs.put("names", "\0".join(code.co_names))
    hs.put("vars", "\0".join(code.co_varnames) + "|" + "\0".join(code.co_freevars) + "|" +
           "\0".join(code.co_cellvars))
    hs.put("args", (code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount,
                    code.co_flags & 0xFFFF))  # not the __future__ flags a compile() inherits
    hs.put("consts", len(code.co_consts))
    for c in code.co_consts:
        _obj_digest(hs, c, seen, depth + 1)


def _obj_digest(hs: _Hasher, obj, seen: _Walk, depth: int) -> None:  # noqa: C901 - one case per type
    seen.spend(1)
    if depth > _MAX_DEPTH:
        hs.put("deep", type(obj).__qualname__)
        return
    if obj is None or isinstance(obj, (bool, int, float, complex, str)):
        hs.put(type(obj).__name__, repr(obj))
        return
    if isinstance(obj, (bytes, bytearray)):
        hs.put("bytes", bytes(obj))
        return
    if isinstance(obj, torch.Tensor):
        # values of plain tensors with data here: not learnable ones, nor meta tensors or
        # subclasses (a DTensor's values would take a collective), which count by dtype and shape
        values = not obj.requires_grad and type(obj) in (torch.Tensor, torch.nn.Parameter) \
            and not obj.is_meta and obj.layout == torch.strided
        if values:
            seen.spend(obj.numel() * obj.element_size() >> 10)
        else:
            hs.put("shape-only", type(obj).__qualname__)
        hs.tensor(obj, values=values)
        return
    if isinstance(obj, (np.ndarray, np.generic)) and not obj.dtype.hasobject:  # by content
        seen.spend(obj.nbytes >> 10)
        hs.put("ndarray", f"{obj.dtype.str}{obj.shape}")
        hs.put("bytes", np.ascontiguousarray(obj).tobytes())
        return
    if isinstance(obj, np.ndarray):                     # of Python objects: as nested lists
        hs.put("ndarray", f"O{obj.shape}")
        _obj_digest(hs, obj.tolist(), seen, depth + 1)
        return
    if isinstance(obj, torch.dtype):
        hs.put("dtype", str(obj))
        return
    if isinstance(obj, torch.device):   # its index is each rank's own accelerator
        hs.put("device", obj.type)
        return
    if isinstance(obj, types.CodeType):
        _code_digest(hs, obj, seen, depth)
        return
    if isinstance(obj, types.ModuleType):
        hs.put("module", obj.__name__)
        return
    if isinstance(obj, type):
        hs.put("type", f"{obj.__module__}.{obj.__qualname__}")
        return
    key = id(obj)  # cycle guard for this one call only; never part of the digest
    if key in seen:
        hs.put("cycle", type(obj).__qualname__)
        return
    seen.add(key)
    try:
        if isinstance(obj, (tuple, list)):
            hs.put(type(obj).__name__, len(obj))
            for v in obj:
                _obj_digest(hs, v, seen, depth + 1)
        elif isinstance(obj, dict):
            items = sorted((_sub_digest(k, seen, depth + 1), _sub_digest(v, seen, depth + 1))
                           for k, v in obj.items())
            hs.put("dict", "".join(k + v for k, v in items))
        elif isinstance(obj, (set, frozenset)):
            hs.put("set", "".join(sorted(_sub_digest(v, seen, depth + 1) for v in obj)))
        elif isinstance(obj, Mask):
            hs.put("mask", f"{obj.op}/{obj.name}/{len(obj.children)}/{obj.bh_invariant}")
            if obj.op != "leaf":
                for c in obj.children:
                    _obj_digest(hs, c, seen, depth + 1)
            elif obj.rule is not None:
                _rule_digest(hs, obj.rule)
            else:
                _obj_digest(hs, obj.mod, seen, depth + 1)
        elif isinstance(obj, types.FunctionType):
            hs.put("function", obj.__code__.co_name)
            _code_digest(hs, obj.__code__, seen, depth)
            _obj_digest(hs, obj.__defaults__, seen, depth + 1)
            _obj_digest(hs, obj.__kwdefaults__, seen, depth + 1)
            cells = obj.__closure__ or ()
            hs.put("cells", len(cells))
            for c in cells:
                try:
                    v = c.cell_contents
                except ValueError:
                    hs.put("empty-cell", "")
                    continue
                _obj_digest(hs, v, seen, depth + 1)
            data = global_data(obj)             # module-level data it reads by name
            hs.put("globals", "\0".join(data))
            for v in data.values():
                _obj_digest(hs, v, seen, depth + 1)
        elif isinstance(obj, functools.partial):
            hs.put("partial", len(obj.args))
            _obj_digest(hs, obj.func, seen, depth + 1)
            _obj_digest(hs, obj.args, seen, depth + 1)
            _obj_digest(hs, obj.keywords, seen, depth + 1)
        elif isinstance(obj, types.MethodType):
            hs.put("method", "")
            _obj_digest(hs, obj.__func__, seen, depth + 1)
            _obj_digest(hs, obj.__self__, seen, depth + 1)
        elif isinstance(obj, (types.BuiltinFunctionType, types.BuiltinMethodType)):
            hs.put("builtin", f"{getattr(obj, '__module__', None)}.{obj.__qualname__}")
        else:                                   # an instance: the data it holds
            _state_digest(hs, obj, seen, depth)
            call = getattr(type(obj), "__call__", None)
            if isinstance(call, types.FunctionType):   # a callable instance: its code too
                _obj_digest(hs, call, seen, depth + 1)
    finally:
        seen.discard(key)
