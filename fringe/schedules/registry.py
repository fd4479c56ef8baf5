"""The one list of schedule names: every built-in registered once, read by every CLI.

A **spec** is the text a command line, a config file or :func:`get` takes:

=================================  ==========================================================
spec                               schedule
=================================  ==========================================================
``ring``                           :func:`~fringe.schedules.ring`
``zigzag``                         :func:`~fringe.schedules.zigzag`
``striped`` / ``striped:S``        :func:`~fringe.schedules.striped` (stripes of S tokens)
``balanced``                       :func:`~fringe.schedules.balanced`
``allgather`` / ``allgather:N``    :func:`~fringe.schedules.allgather` (N pieces, default 2)
``ulysses``                        :func:`~fringe.schedules.ulysses`
``compose:OUTER+INNER:K``          ``compose(get(OUTER), get(INNER), inner_size=K)``, e.g.
                                   ``compose:zigzag+ulysses:2`` (2D: Ulysses inside groups of
                                   2 ranks, a zigzag ring across the groups)
``auto``                           :func:`~fringe.schedules.auto`: :func:`fringe.plan` plans
                                   the candidates above and keeps the one the cost model
                                   predicts fastest (``cpu`` preset)
=================================  ==========================================================

``name:N`` passes one positive integer to a schedule that takes one (its ``arg``). In
``compose:OUTER+INNER:K`` the last ``:K`` is the group size; OUTER and INNER are specs
themselves (``compose:allgather:4+ulysses:2``), and :func:`~fringe.schedules.compose` decides
which pairs it supports. Which schedules can run a given world size and head count is data
too (``names(world_size=4, heads=2, kv_heads=1)``, :func:`why_not`), so a caller need not
learn each schedule's rules.

The text is input: :func:`get` parses it into a :class:`~fringe.schedules.base.Spec` and builds
from that; a schedule carries its spec as a field (set by the built-in constructors, and by
:func:`get` for a registered user factory), and :func:`spec` prints that field. A schedule's
display name is never parsed: a hand-made ``Schedule("zigzag", ...)`` has no spec.

>>> from fringe import schedules
>>> schedules.get("compose:zigzag+ulysses:2")
Schedule(compose(zigzag, ulysses, inner_size=2))
>>> spec(schedules.get("allgather:4"))
'allgather:4'
>>> names(world_size=3, heads=2, kv_heads=1)        # ulysses needs H % P == 0
['ring', 'zigzag', 'striped', 'balanced', 'allgather']

Users add their own with :func:`register`; the CLIs then accept them too. :func:`names` lists
the schedules that run, not ``auto``, which chooses among them (``get("auto")`` builds it;
:func:`describe` and :func:`syntax` list it).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from .auto import auto
from .base import AUTO, COMPOSE, Schedule, Spec
from .collectives import allgather, compose, ulysses
from .rings import balanced, ring, striped, zigzag

__all__ = ["Entry", "canonical", "describe", "get", "names", "register", "spec", "why_not"]

#: ``constraint(world_size=, heads=, kv_heads=) -> reason or None``; an argument is None when
#: the caller does not know it (then it is not checked).
Constraint = Callable[..., "str | None"]

_NAME = re.compile(r"[a-z][a-z0-9_]*\Z")


@dataclasses.dataclass(frozen=True)
class Entry:
    """One registered schedule.

    Args:
        name: the spec's name (lower case letters, digits, ``_``).
        factory: ``factory()`` (or ``factory(n)`` for ``name:n`` when ``arg`` is set) returns
            the :class:`Schedule`.
        description: one line, shown in CLI help.
        arg: the name of the optional positive-integer argument ``name:n`` passes, or None.
        constraint: ``constraint(world_size=, heads=, kv_heads=)`` returns why the schedule
            cannot run there (a sentence), or None; arguments the caller does not know are None.
    """

    name: str
    factory: Callable[..., Schedule]
    description: str
    arg: str | None = None
    constraint: Constraint | None = None


_REGISTRY: dict[str, Entry] = {}
_BUILTIN: set[str] = set()


def register(name: str, factory: Callable[..., Schedule], *, description: str,
             arg: str | None = None, constraint: Constraint | None = None,
             replace: bool = False) -> None:
    """Add a schedule under ``name``; :func:`get`, :func:`names` and the CLIs then know it.

    Args:
        name: lower case letters, digits and ``_``, starting with a letter (not ``compose``).
        factory: returns a fresh :class:`Schedule`; called with one positive int when
            ``arg`` is given and the spec is ``name:n``.
        description: one line for help texts.
        arg: what ``n`` in ``name:n`` means (e.g. ``"pieces"``), or None if it takes none.
        constraint: see :class:`Entry`.
        replace: allow replacing a schedule registered earlier (never a built-in).

    Raises:
        ValueError: a malformed or taken name; TypeError: a factory that is not callable.
    """
    if not isinstance(name, str) or not _NAME.match(name) or name == COMPOSE:
        raise ValueError(f"schedule name {name!r} must be lower case letters, digits and '_', "
                         f"starting with a letter, and not {COMPOSE!r} (e.g. 'my_ring')")
    if not callable(factory):
        raise TypeError(f"register({name!r}, factory): factory must be callable and return a "
                        f"Schedule, got {type(factory).__name__}")
    if not isinstance(description, str) or not description.strip() or "\n" in description:
        raise ValueError(f"register({name!r}, ...): description must be one non-empty line")
    if constraint is not None and not callable(constraint):
        raise TypeError(f"register({name!r}, ...): constraint must be callable or None")
    if name in _BUILTIN or (name in _REGISTRY and not replace):
        raise ValueError(f"schedule name {name!r} is already registered"
                         + ("" if name in _BUILTIN else "; pass replace=True to replace it"))
    _REGISTRY[name] = Entry(name, factory, description.strip(), arg, constraint)


def unregister(name: str) -> None:
    """Remove a schedule added with :func:`register` (built-ins stay)."""
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in schedule and cannot be removed")
    if name not in _REGISTRY:
        raise ValueError(f"no schedule {name!r} is registered; registered: {names()}")
    del _REGISTRY[name]


def entries() -> list[Entry]:
    """Every registered schedule, built-ins first, in registration order."""
    return list(_REGISTRY.values())


def names(*, world_size: int | None = None, heads: int | None = None,
          kv_heads: int | None = None) -> list[str]:
    """Registered names of schedules that run (not the ``compose:`` forms, nor ``auto``, which
    chooses among them), those that can run with the given world size and head counts when
    any is given."""
    return [n for n in _REGISTRY if n != AUTO
            and why_not(n, world_size=world_size, heads=heads, kv_heads=kv_heads) is None]


def syntax() -> str:
    """One line saying which specs are valid, for error messages and help."""
    forms = [f"{e.name}[:{e.arg}]" if e.arg else e.name for e in _REGISTRY.values()]
    return (", ".join(forms) + f", or {COMPOSE}:OUTER+INNER:K (e.g. {COMPOSE}:zigzag+ulysses:2: "
            f"INNER inside groups of K ranks, OUTER across them)")


def describe() -> str:
    """One line per registered schedule: ``name: description``, then the compose form."""
    width = max(len(n) for n in _REGISTRY)
    rows = [f"{e.name:<{width}}  {e.description}" for e in _REGISTRY.values()]
    rows.append(f"{COMPOSE}:OUTER+INNER:K  2D: INNER inside groups of K consecutive ranks, "
                f"OUTER across the groups")
    return "\n".join(rows)


def _unknown(text: object, why: str = "") -> ValueError:
    return ValueError(f"unknown schedule {text!r}{why}; valid: {syntax()}")


def _positive(text: str, what: str, whole: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"schedule {whole!r}: {what} must be a positive integer, got {text!r}; "
                         f"valid: {syntax()}")
    return int(text)


def _parse(text: str) -> Spec:
    """The :class:`Spec` a spec's text names (input: a command line, a config file), checked
    against the registry.

    Raises:
        ValueError: an unknown or malformed spec, listing the valid ones.
    """
    if text.startswith(COMPOSE + ":"):
        outer, plus, rest = text[len(COMPOSE) + 1:].partition("+")
        inner, colon, k = rest.rpartition(":")
        if not plus or not outer or not colon or not inner:
            raise _unknown(text, f" (the 2D form is {COMPOSE}:OUTER+INNER:K, e.g. "
                                 f"{COMPOSE}:zigzag+ulysses:2)")
        return Spec(COMPOSE, outer=_parse(outer), inner=_parse(inner),
                    inner_size=_positive(k, "K (ranks per inner group)", text))
    name, colon, arg = text.partition(":")
    e = _REGISTRY.get(name)
    if e is None:
        raise _unknown(text)
    if not colon:
        return Spec(name)
    if e.arg is None:
        raise ValueError(f"schedule {name!r} takes no ':' argument, got {text!r}; valid: "
                         f"{syntax()}")
    return Spec(name, _positive(arg, e.arg, text))


def _build(sp: Spec) -> Schedule:
    """The schedule ``sp`` names. A registered user factory's schedule carries ``sp`` (the
    built-in constructors set their own spec, in its one spelling: ``allgather:2`` is
    ``allgather``)."""
    if sp.name == COMPOSE:
        return compose(_build(sp.outer), _build(sp.inner), inner_size=sp.inner_size)
    e = _REGISTRY[sp.name]
    s = e.factory() if sp.arg is None else e.factory(sp.arg)
    if not isinstance(s, Schedule):
        raise TypeError(f"the factory registered as {sp.name!r} returned "
                        f"{type(s).__name__}, not a fringe.schedules.Schedule")
    if sp.name not in _BUILTIN and s.spec != sp:
        s = dataclasses.replace(s, spec=sp)
    return s


def get(name: str | Schedule) -> Schedule:
    """The schedule a spec names (see the module docstring); a :class:`Schedule` is returned
    as it is, so APIs can take either.

    Raises:
        ValueError: an unknown or malformed spec, listing the valid ones (and whatever
            :func:`~fringe.schedules.compose` raises for a pair it does not support).
        TypeError: neither a string nor a Schedule.
    """
    if isinstance(name, Schedule):
        return name
    if not isinstance(name, str):
        raise TypeError(f"a schedule is a name such as 'zigzag' or a Schedule, got "
                        f"{type(name).__name__}; valid names: {syntax()}")
    return _build(_parse(name.strip()))


def why_not(name: str, *, world_size: int | None = None, heads: int | None = None,
            kv_heads: int | None = None) -> str | None:
    """Why the schedule ``name`` (a spec) cannot run on ``world_size`` ranks with ``heads``
    query and ``kv_heads`` kv heads, or None if it can (unknown values are not checked).

    Raises:
        ValueError: an unknown or malformed spec.
    """
    if not isinstance(name, str):
        raise TypeError(f"why_not takes a schedule name, got {type(name).__name__}")
    return _why_not(_parse(name.strip()), world_size=world_size, heads=heads, kv_heads=kv_heads)


def _why_not(sp: Spec, *, world_size, heads, kv_heads) -> str | None:
    if sp.name == COMPOSE:
        k = sp.inner_size
        if world_size is not None and world_size % k:
            return (f"{sp} puts {k} ranks in a group: world_size={world_size} is not a "
                    f"multiple of {k}")
        try:                    # a pair compose() refuses (ulysses outside, compose inside)
            _build(sp)
        except ValueError as e:
            return str(e)
        return (_why_not(sp.inner, world_size=k, heads=heads, kv_heads=kv_heads)
                or _why_not(sp.outer, world_size=None if world_size is None else world_size // k,
                            heads=heads, kv_heads=kv_heads))
    e = _REGISTRY[sp.name]
    if e.constraint is None:
        return None
    return e.constraint(world_size=world_size, heads=heads, kv_heads=kv_heads)


def spec(schedule: Schedule) -> str:
    """The spec that :func:`get` turns back into this schedule: the inverse of :func:`get`
    for registered schedules (``spec(get(s)) == canonical(s)``), printed from its
    :attr:`~fringe.schedules.Schedule.spec` field (never read from its display name).

    Raises:
        ValueError: a schedule no registered name builds (a hand-made :class:`Schedule`,
            whatever its name), or one whose name was unregistered since.
        TypeError: not a Schedule.
    """
    if not isinstance(schedule, Schedule):
        raise TypeError(f"spec() takes a Schedule (schedules.get(text) for a spec's text), got "
                        f"{type(schedule).__name__}")
    sp = schedule.spec
    gone = [] if sp is None else [n for n in sp.names() if n not in _REGISTRY]
    if sp is None or gone:
        why = f" ({', '.join(map(repr, gone))} no longer registered)" if gone else ""
        raise ValueError(f"schedule {schedule.name!r} is not built by a registered name{why}; "
                         f"register its factory with fringe.schedules.register(name, factory, "
                         f"description=...) and build it with fringe.schedules.get(name)")
    return str(sp)


def canonical(name: str) -> str:
    """A spec in the one spelling :func:`spec` gives (``allgather:2`` -> ``allgather``);
    validates it on the way (the argparse ``type=`` of the CLIs)."""
    return spec(get(name))


# ---- the built-ins ---------------------------------------------------------------------------

def _head_split(n: int | None, heads: int | None, kv_heads: int | None, who: str) -> str | None:
    if n is None or n == 1:
        return None
    if heads is not None and heads % n:
        return f"{who} splits heads {n} ways: needs H % {n} == 0, got H={heads}"
    if kv_heads is not None and kv_heads % n and n % kv_heads:
        return (f"{who} splits heads {n} ways: needs G % {n} == 0 or {n} % G == 0, "
                f"got G={kv_heads}")
    return None


def _ulysses_constraint(*, world_size=None, heads=None, kv_heads=None) -> str | None:
    return _head_split(world_size, heads, kv_heads, "ulysses")


for _e in (
        Entry("ring", ring, "ring over the contiguous layout (causal work unbalanced)"),
        Entry("zigzag", zigzag, "ring over the zigzag layout (rank r holds chunks r and 2P-1-r)"),
        Entry("striped", striped, "ring over stripes of S tokens (default: the block size)",
              arg="stripe"),
        Entry("balanced", balanced, "ring over a mask-aware layout (packed documents, windows)"),
        Entry("allgather", allgather, "all-gather of the kv a rank needs, in N pieces "
                                      "(default 2), over the zigzag layout", arg="pieces"),
        Entry("ulysses", ulysses, "all-to-all to head-sharded, full-sequence attention "
                                  "(needs H % P == 0 and G % P == 0 or P % G == 0)",
              constraint=_ulysses_constraint),
        Entry(AUTO, auto, "fringe.plan plans the candidates that run and keeps the one the "
                          "cost model predicts fastest (cpu preset; plan.explain() says why)")):
    _REGISTRY[_e.name] = _e
    _BUILTIN.add(_e.name)
del _e
