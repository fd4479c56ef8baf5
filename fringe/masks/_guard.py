"""Guards: what a plan records of the state its mask_mod and score_mod read but
:func:`~fringe.masks.snapshot` cannot copy (a bound method's instance, an object a closure
reads, a function's live globals), so that every call can check it is unchanged.

Two kinds of change reach such state, and each has its record:

* **in place** (``self.doc_ids.copy_(next_ids)``): the tensors reached are returned, and the
  plan records their ``_version`` (``Plan.check_unchanged``);
* **rebinding** (``self.doc_ids = next_ids``, ``batch.cuts.append(40)``, a closure variable
  assigned again): :func:`guard` records the identity of every value found in the attributes
  of the objects it walks (``__dict__`` and ``__slots__``), in dict entries and list items,
  closure cells, and the module globals a live function loads; :func:`rebound` compares them.
  Identity, not equality: it is one pointer compare per value (the check runs on every
  attention call), and a tensor rebound to an equal-valued copy is no longer the one whose
  version is guarded, so a later in-place edit of it would go unseen. Immutable scalars
  (numbers, strings, ``None``, dtypes, devices, tuples of those) rebound to an equal value
  are accepted: nothing can edit them afterwards.

Only what the code can read is recorded: an object's attributes are followed where their
name is one the code walked loads (``co_names`` of the mod, the functions it reaches, the
methods, properties and called submodules' ``forward`` those names reach), so state a module
keeps beside what the mod reads (a step counter ``forward`` bumps, a cache dict, a running
buffer, another submodule) neither raises nor is guarded; code that reads attributes by a
computed name (``getattr``, ``vars``, a class's own ``__getattr__``) records them all. Library
code handed a whole object (``dataclasses.astuple(self.cfg)`` is caught by name, other such
calls are not) reads attributes this cannot see.

Not recorded, by design: what requires grad (parameters change in training, and
``torch.func.functional_call`` swaps them: :func:`fringe.autograd` checks those), an
``nn.Module``'s own bookkeeping (``training``, hooks) unless the code reads it by name (a mask
that reads ``self.training`` raises after ``eval()``), ``torch.distributed`` objects (they are rank-local by design), keys
added to a dict or attributes added to an object (a class attribute shadowed that way is not
seen, nor are class attributes at all), sets, numpy arrays edited in place (no version
counter), and what a snapshot's copy holds directly (its cells, globals dict, and the lists and
dicts it copied: only the copy can change those, so a mask that counts its calls into a
captured list keeps running). Lists are recorded item by item (O(len) per call).
"""
from __future__ import annotations

import dis
import functools
import inspect
import operator
import re
import types

import torch

from ._mask import Mask
from ._snapshot import global_data, owns

_MISSING = object()
_MAX_DEPTH = 16
_RANK_LOCAL = re.compile(r"torch\.distributed(\.|$)")
_SCALARS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_SEQ, _SLOT, _CELL = range(3)
#: an ``nn.Module``'s tables, walked entry by entry
_TABLES = frozenset({"_parameters", "_buffers", "_modules"})
#: names whose presence in the code read means attributes are read by a computed name (or all
#: at once): every attribute of every object walked is recorded then
_DYNAMIC = frozenset({"getattr", "hasattr", "vars", "__dict__", "__getattribute__",
                      "__getattr__", "attrgetter", "asdict", "astuple", "__slots__"})


@functools.lru_cache(maxsize=None)
def _module_internals() -> frozenset[str]:
    """The attributes ``nn.Module.__init__`` sets (its bookkeeping: ``training``, hooks, ...)."""
    return frozenset(vars(torch.nn.Module()))


@functools.lru_cache(maxsize=1024)
def rank_local(cls: type) -> bool:
    """Whether instances of ``cls`` describe this rank's place in the group by design
    (``DeviceMesh``, process groups, FSDP state): ``torch.distributed``'s own classes. Not a
    module ``fully_shard`` re-classed (``FSDPAttn``, a subclass of ``FSDPModule`` and the
    user's ``Attn``, defined in ``torch.distributed``): its data is the user's module's."""
    if not _RANK_LOCAL.match(str(cls.__module__)):
        return False
    return not any(issubclass(c, torch.nn.Module) and c is not torch.nn.Module and
                   not _RANK_LOCAL.match(str(c.__module__)) for c in cls.__mro__)


@functools.lru_cache(maxsize=4096)
def _loaded_globals(code: types.CodeType) -> frozenset[str]:
    """The names ``code`` (and the code nested in it) loads as globals: not the attribute names
    ``co_names`` lists too (``self.doc_ids`` must not guard a module global ``doc_ids``)."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(i.argval for i in dis.get_instructions(c)
                     if i.opname in ("LOAD_GLOBAL", "LOAD_NAME"))
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(names)


@functools.lru_cache(maxsize=4096)
def _code_names(code: types.CodeType) -> frozenset[str]:
    """Every name ``code`` (and the code nested in it) may read an attribute by: its
    ``co_names`` (attribute and global names alike: a superset)."""
    names, todo = set(), [code]
    while todo:
        c = todo.pop()
        names.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    return frozenset(names)


def _library(fn) -> bool:
    """torch's own code: not followed for names (its methods read their own bookkeeping, by
    ``hasattr`` too); an object whose class inherits it has all its data recorded instead
    (:func:`_library_reads`)."""
    return str(getattr(fn, "__module__", None) or "").startswith("torch")


@functools.lru_cache(maxsize=1024)
def _library_reads(cls: type) -> bool:
    """Whether torch code ``cls`` inherits may read its instances' attributes (a
    ``ModuleList``'s ``[i]``, a ``Linear``'s ``forward``): ``nn.Module`` itself and
    ``torch.distributed``'s classes (``FSDPModule``, the ``FSDPAttn`` ``fully_shard`` makes
    of a user's ``Attn``: their code reads FSDP's state) aside."""
    return any(c is not torch.nn.Module and _library(c) and
               not _RANK_LOCAL.match(str(c.__module__)) for c in cls.__mro__)


def _class_functions(cls: type, name: str) -> list:
    """The functions that may run when ``name`` is read on an instance of ``cls`` (a method, a
    property's getter, a static or class method), looked up without running anything: every
    class of the MRO's own (an override's ``super().name()`` runs its parent's)."""
    out = []
    for c in cls.__mro__:
        a = c.__dict__.get(name)
        if isinstance(a, (staticmethod, classmethod)):
            a = a.__func__
        elif isinstance(a, property):
            a = a.fget
        elif isinstance(a, functools.cached_property):
            a = a.func
        if isinstance(a, types.FunctionType) and not _library(a):
            out.append(a)
    return out


#: special methods that run without their name in the code (``obj[i]``, ``len(obj)``, ``for x
#: in obj``, ``obj + 1``): every other one a walked object's class defines is followed
_NOT_READING = frozenset({
    "__init__", "__new__", "__init_subclass__", "__post_init__", "__setattr__", "__delattr__",
    "__setitem__", "__delitem__", "__del__", "__repr__", "__str__", "__format__", "__dir__",
    "__sizeof__", "__reduce__", "__reduce_ex__", "__getstate__", "__setstate__", "__copy__",
    "__deepcopy__", "__enter__", "__exit__", "__class_getitem__", "__subclasshook__",
    "__getattr__", "__getattribute__"})


@functools.lru_cache(maxsize=1024)
def _special_methods(cls: type) -> tuple:
    """``(name, function)`` of the special methods ``cls`` defines (not ``object``'s, nor
    ``nn.Module``'s own, whose attribute lookup is by the names the code reads)."""
    out, seen = [], set()
    for c in cls.__mro__:
        if c is object or _library(c):
            continue
        for name, f in c.__dict__.items():
            if name.startswith("__") and name.endswith("__") and name not in seen \
                    and name not in _NOT_READING and isinstance(f, types.FunctionType):
                seen.add(name)
                out.append((name, f))
    return tuple(out)


def _reads_any_attribute(cls: type) -> bool:
    """A class whose attribute reads run its own code by a computed name (``__getattr__``,
    ``__getattribute__``; ``nn.Module``'s, which looks the same names up in its parameters,
    buffers and submodules, excepted)."""
    for name in ("__getattr__", "__getattribute__"):
        f = inspect.getattr_static(cls, name, None)
        if isinstance(f, types.FunctionType) and f is not getattr(torch.nn.Module, name, None):
            return True
    return False


class _Walk:
    """One walk of a mask_mod or score_mod: the tensors it reaches, and the bindings.

    Only the attributes the code can read are followed: the names the code walked loads
    (:func:`_code_names`), grown by the methods and properties those names reach on the
    objects walked (``self.helper()``, a submodule's ``forward``), to a fixed point
    (:meth:`settle`). An attribute no code reads (a step counter ``forward`` bumps, a cache
    dict, a submodule the mod never touches) is neither recorded nor its tensors guarded; code
    that reads attributes by a computed name (``getattr``, ``vars``, a class's own
    ``__getattr__``) makes every attribute recorded."""

    def __init__(self) -> None:
        self.tensors: list[tuple[str, torch.Tensor]] = []
        self.entries: list[list] = []       # [dict, key, value, path]: attributes, entries, globals
        self.other: list[list] = []         # [_SEQ | _SLOT | _CELL, ...]
        self.memo: dict[int, object] = {}   # id -> the object, kept alive for the walk
        self.names: set[str] = set()        # attribute names the code walked may read
        self.dynamic = False                # some code reads attributes by a computed name
        self.deferred: list[tuple] = []     # (names, args of _attr) none read (yet)
        self.objects: list[list] = []       # [obj, where, path, depth, bind, names checked]
        self.selves: set[int] = set()       # ids of bound methods' instances (not called)

    def add_code(self, code, glob: dict | None = None) -> None:
        """Add the names ``code`` reads; with ``glob`` (its function's globals), those of the
        functions of the same module it calls by a global name too (``window_of(cfg)``),
        recursively (a library's functions are not followed)."""
        todo = [code]
        while todo:
            code = todo.pop()
            if not isinstance(code, types.CodeType) or id(code) in self.memo:
                continue
            self.memo[id(code)] = code
            names = _code_names(code)
            self.names |= names
            if not self.dynamic and not names.isdisjoint(_DYNAMIC):
                self.dynamic = True
            if glob is not None:
                for n in _loaded_globals(code):
                    f = glob.get(n)
                    if isinstance(f, types.FunctionType) and f.__globals__ is glob:
                        todo.append(f.__code__)

    def attr(self, names: tuple, *args, force: bool = False) -> None:
        """Visit an attribute now if the code may read it by one of ``names`` (or ``force``:
        library code may), else when it turns out to."""
        if force or self.dynamic or not self.names.isdisjoint(names):
            self._attr(*args)
        else:
            self.deferred.append((names, args))

    def _attr(self, d, key, v, where: str, path: str, depth: int, bind: bool,
              slot: bool = False) -> None:
        if bind:
            if slot:
                if not (isinstance(v, torch.Tensor) and v.requires_grad):
                    self.other.append([_SLOT, d, key, v, path])
            else:
                self.bind_entry(d, key, v, path)
        if v is not _MISSING:
            self.visit(v, where, path, depth + 1, bind)

    def settle(self) -> None:
        """Follow what the names found so far reach (methods and properties of the objects
        walked, attributes deferred), until nothing new is found."""
        while True:
            progressed = False
            i = 0
            while i < len(self.objects):    # grows as functions are visited
                rec = self.objects[i]
                i += 1
                obj, where, path, depth, bind, checked = rec
                for name in sorted(self.names - checked):
                    checked.add(name)
                    for fn in _class_functions(type(obj), name):
                        if id(fn) not in self.memo:
                            progressed = True
                            self.visit(fn, where, f"{path}.{name}", depth + 1, bind)
            pending, self.deferred = self.deferred, []
            for names, args in pending:
                if self.dynamic or not self.names.isdisjoint(names):
                    progressed = True
                    self._attr(*args)
                else:
                    self.deferred.append((names, args))
            if not progressed:
                return

    def bind_entry(self, d: dict, key, value, path: str) -> None:
        if not (isinstance(value, torch.Tensor) and value.requires_grad):  # learnable: may change
            self.entries.append([d, key, value, path])

    def visit(self, obj, where: str, path: str, depth: int, bind: bool,  # noqa: C901
              owned: bool = False) -> None:
        """``owned``: ``obj`` sits in a container a snapshot copy holds directly (a list, dict
        or tuple the copy made): no bindings are recorded for that container, which only the
        copy can edit (a mask that counts its calls into a list keeps running); objects in it
        are the caller's, and recorded as any."""
        if type(obj) in _SCALARS or depth > _MAX_DEPTH or id(obj) in self.memo:
            return
        self.memo[id(obj)] = obj
        if isinstance(obj, torch.Tensor):
            self.tensors.append((where, obj))
        elif isinstance(obj, Mask):         # a factory's rule: frozen values it owns
            name = f"mask {obj.name!r}" if obj.op == "leaf" else where
            rule = obj.rule
            for f in getattr(rule, "__dataclass_fields__", {}):
                self.visit(getattr(rule, f), f"{name} ({f})", path, depth + 1, False)
            for c in obj.children:          # first: a leaf names what it reads (self.ids)
                self.visit(c, where, path, depth + 1, bind)
            # a combination's mod is fringe's closure over its children's, a factory leaf's
            # over the copies it made (document ids): cells only the Mask holds
            self.visit(obj.mod, name, path, depth + 1,
                       bind and obj.op == "leaf" and obj.rule is None)
        elif isinstance(obj, types.MethodType):     # a bound method: its function and instance
            self.selves.add(id(obj.__self__))       # read through the method, not called
            self.visit(obj.__func__, where, path, depth + 1, bind)
            self.visit(obj.__self__, where, f"{path}.__self__" if path else "self", depth + 1,
                       bind)
        elif callable(obj) and hasattr(obj, "__code__"):
            self._function(obj, where, path, depth, bind)
        elif isinstance(obj, functools.partial):
            self.visit(obj.func, where, path, depth + 1, bind)
            base, own = path or "partial", owns(obj)
            for i, v in enumerate(obj.args):
                self.visit(v, where, f"{base}.args[{i}]", depth + 1, bind, own)
            for k, v in obj.keywords.items():
                self.visit(v, where, f"{base}.keywords[{k!r}]", depth + 1, bind, own)
        elif isinstance(obj, tuple):        # namedtuples too: snapshot does not copy them
            fields = getattr(type(obj), "_fields", None)
            for i, v in enumerate(obj):
                sub = f"{path}.{fields[i]}" if fields and i < len(fields) else f"{path}[{i}]"
                self.visit(v, where, sub, depth + 1, bind, owned)
        elif isinstance(obj, list):
            if bind and not owned:
                self.other.append([_SEQ, obj, tuple(obj), path])
            for i, v in enumerate(obj):
                self.visit(v, where, f"{path}[{i}]", depth + 1, bind, owned)
        elif isinstance(obj, dict):
            for k, v in obj.items():
                if bind and not owned:
                    self.bind_entry(obj, k, v, f"{path}[{k!r}]")
                self.visit(v, where, f"{path}[{k!r}]", depth + 1, bind, owned)
        elif not isinstance(obj, (type, types.ModuleType)):
            self._object(obj, where, path or "self", depth, bind)

    def _function(self, fn, where: str, path: str, depth: int, bind: bool) -> None:
        # a snapshot's copy owns its cells, defaults and globals dict (and the containers in
        # them): nobody else can rebind those; the original a snapshot left as it was (it
        # held nothing to copy, or is a bound method's function) shares them with its scope
        own = owns(fn)
        code = getattr(fn, "__code__", None)
        if not _library(fn):
            self.add_code(code, getattr(fn, "__globals__", None))
        names = getattr(code, "co_freevars", ())
        for name, c in zip(names, getattr(fn, "__closure__", None) or ()):
            try:
                v = c.cell_contents
            except ValueError:              # an empty cell: nothing read yet
                continue
            sub = f"{name} (a variable of {path})" if path else name
            if bind and not own and not (isinstance(v, torch.Tensor) and v.requires_grad):
                self.other.append([_CELL, c, v, sub])
            self.visit(v, where, sub, depth + 1, bind, own)
        for v in (getattr(fn, "__defaults__", None) or ()):
            self.visit(v, where, path or "a default", depth + 1, bind, own)
        for k, v in (getattr(fn, "__kwdefaults__", None) or {}).items():
            self.visit(v, where, k, depth + 1, bind, own)
        if isinstance(fn, types.FunctionType):  # module globals it reads
            loads = _loaded_globals(fn.__code__)
            for n, v in global_data(fn).items():
                if bind and not own and n in loads:
                    self.bind_entry(fn.__globals__, n, v, n)
                self.visit(v, where, n, depth + 1, bind, own)

    def _object(self, obj, where: str, path: str, depth: int, bind: bool) -> None:
        # an object (a callable instance, a bound method's, or one a closure reads such as
        # ``batch.ids``): the attributes of its __dict__ or __slots__ the code may read
        if rank_local(type(obj)):
            bind = False                    # DeviceMesh, process groups: rank-local by design
        cls = type(obj)
        if _reads_any_attribute(cls):
            self.dynamic = True
        lib = _library_reads(cls)           # torch code it inherits may read any attribute
        self.objects.append([obj, where, path, depth, bind, set()])
        if id(obj) not in self.selves:      # an object called: what its call runs
            for name in ("forward",) if isinstance(obj, torch.nn.Module) else ("__call__",):
                for fn in _class_functions(cls, name):
                    self.visit(fn, where, f"{path}.{name}", depth + 1, bind)
        for name, fn in _special_methods(cls):  # obj[i], len(obj), iter(obj), obj + 1
            self.visit(fn, where, f"{path}.{name}", depth + 1, bind)
        d = getattr(obj, "__dict__", None)
        if type(d) is dict:
            if isinstance(obj, torch.nn.Module):
                self._module(obj, d, where, path, depth, bind, lib)
            else:
                for name, v in d.items():
                    self.attr((name,), d, name, v, where, f"{path}.{name}", depth, bind,
                              force=lib)
        for c in cls.__mro__:
            slots = c.__dict__.get("__slots__", ())
            for name in ((slots,) if isinstance(slots, str) else slots):
                if name in ("__dict__", "__weakref__"):
                    continue
                self.attr((name,), obj, name, getattr(obj, name, _MISSING), where,
                          f"{path}.{name}", depth, bind, True, force=lib)

    def _module(self, obj, d: dict, where: str, path: str, depth: int, bind: bool,
                lib: bool) -> None:
        """An ``nn.Module``: its buffers and submodules by entry (a rebound buffer is caught),
        plain attributes like any object's, parameters for their tensors only (they change
        by design); its own bookkeeping (``training``, hooks) as plain attributes, recorded
        where the code reads them by name (``self.training`` in a mask: ``eval()`` raises;
        in a model's ``forward`` beside the mask, nothing)."""
        for part in ("_buffers", "_modules"):
            entries = d.get(part)
            if isinstance(entries, dict):   # OrderedDict in older torch
                for name, v in entries.items():
                    # read by name, or through the table (``self._modules[...]``: a
                    # ModuleList's ``[i]``, a Sequential's iteration)
                    self.attr((name, part), entries, name, v, where, f"{path}.{name}", depth,
                              bind, force=lib)
        internals = _module_internals()
        for name, v in d.items():           # its bookkeeping too, where read by name: a mask
            if name not in _TABLES:         # that reads self.training changes with eval()
                self.attr((name,), d, name, v, where, f"{path}.{name}", depth, bind,
                          force=lib and name not in internals)
        params = d.get("_parameters")
        if isinstance(params, dict):        # for their tensors only (a frozen one's version)
            for name, v in params.items():
                self.attr((name, "_parameters"), params, name, v, where, f"{path}.{name}",
                          depth, False)

class Records:
    """What :func:`guard` recorded, for :func:`rebound`: opaque (not a list, dict or
    dataclass), so that code walking a plan's fields for tensors (FSDP2 walks a module's
    forward arguments, a plan among them) does not reach the objects recorded (a module's
    ``__dict__``, its parameters)."""

    __slots__ = ("entries", "other")

    def __init__(self, entries: list, other: list) -> None:
        self.entries, self.other = entries, other


def guard(fn, what: str) -> tuple[list[tuple[str, torch.Tensor]], Records]:
    """Walk ``fn`` (a mask_mod or score_mod, as a plan holds it) and what it reads.

    Follows a :class:`Mask`'s rule fields and mod, closure cells and defaults of functions,
    the module globals they read, partials, tuples, lists and dicts, bound methods' instances
    and the attributes of objects (``__dict__``, ``__slots__``; an ``nn.Module``'s buffers and
    submodules), recursively up to depth 16.

    Args:
        fn: the callable (or None).
        what: its name in messages (``"mask_mod"``, ``"score_mod"``).

    Returns:
        ``(tensors, bindings)``: ``(where, tensor)`` for every tensor reached (to guard by
        version), and the records :func:`rebound` checks.
    """
    walk = _Walk()
    if fn is not None:
        walk.visit(fn, what, "", 0, True)
        walk.settle()
    return walk.tensors, Records(walk.entries, walk.other)


def _same(a, b) -> bool:
    """Whether ``b`` may stand for ``a``: the same object, or an equal immutable scalar."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b) or (t not in _SCALARS and t is not tuple):
        return False
    if t is tuple:
        return len(a) == len(b) and all(map(_same, a, b))
    if t in (float, complex):           # -0.0 is not 0.0 to a score_mod
        return repr(a) == repr(b)
    return a == b


def _describe(v) -> str:
    if v is _MISSING:
        return "nothing"
    if isinstance(v, torch.Tensor):
        return f"a tensor {list(v.shape)} {str(v.dtype).removeprefix('torch.')}"
    if type(v) in _SCALARS:
        r = repr(v)
        return r if len(r) <= 40 else r[:37] + "..."
    return f"a {type(v).__name__}"


def rebound(bindings: Records) -> tuple[str, str] | None:
    """The first binding :func:`guard` recorded that changed: ``(path, how)``, or None.

    An equal immutable scalar rebound in its place is accepted, and recorded instead (so the
    next check takes the fast path again). Cost: one identity compare per recorded value
    (about 60 ns each, plus 0.3 us per list).
    """
    entries, other = bindings.entries, bindings.other
    for rec in entries:
        d, k, old, path = rec
        now = d.get(k, _MISSING)
        if now is old:
            continue
        if now is not _MISSING and _same(old, now):
            rec[2] = now
            continue
        how = "deleted" if now is _MISSING else "rebound"
        return path, f"{how} since the plan was made ({_describe(old)} then, " \
                     f"{_describe(now)} now)"
    for rec in other:
        kind = rec[0]
        if kind == _SEQ:
            _, lst, items, path = rec
            if len(lst) == len(items) and all(map(operator.is_, lst, items)):
                continue
            if len(lst) != len(items):
                return path, f"a list of {len(items)} items when the plan was made, " \
                             f"{len(lst)} now"
            if all(map(_same, items, lst)):
                rec[2] = tuple(lst)
                continue
            i = next(i for i, (a, b) in enumerate(zip(items, lst)) if not _same(a, b))
            return f"{path}[{i}]", f"rebound since the plan was made " \
                                   f"({_describe(items[i])} then, {_describe(lst[i])} now)"
        if kind == _CELL:
            try:
                now = rec[1].cell_contents
            except ValueError:
                now = _MISSING
            old, path, at = rec[2], rec[3], 2
        else:
            now = getattr(rec[1], rec[2], _MISSING)
            old, path, at = rec[3], rec[4], 3
        if now is old:
            continue
        if now is not _MISSING and _same(old, now):
            rec[at] = now
            continue
        return path, f"rebound since the plan was made ({_describe(old)} then, " \
                     f"{_describe(now)} now)"
    return None
