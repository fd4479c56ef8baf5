"""Hugging Face transformers: ``attn_implementation="fringe"`` runs context-parallel attention.

Ten lines (see ``examples/hf_train.py`` for the whole loop)::

    import fringe, fringe.hf
    from fringe import masks, packing, schedules
    fringe.hf.register()                                         # once per process
    model = LlamaForCausalLM(config)                             # config._attn_implementation="fringe"
    doc_ids = packing.doc_ids_from_cu_seqlens(cu_seqlens)        # this batch's documents, [B, S]
    plans = fringe.hf.plans(model, schedules.zigzag(), packing.document_mask(doc_ids),
                            seq_len=S, world_size=P, batch_size=B)  # one plan per layer kind, one layout
    shard = packing.shard_batch(input_ids, labels, plan=plans.plans, rank=rank, cu_seqlens=cu_seqlens)
    out = model(**fringe.hf.model_inputs(shard, plans), use_cache=False)
    out.loss.backward()          # this rank's share: CP gradients must be SUMMED, not averaged

Every CP rank of a replica must shard the same global batch (seed the data loader by dp rank,
not global rank): ``model_inputs`` carries the shard's digest of its global batch into every
attention call, and ranks whose digests differ all raise before any attention data moves.
Passing ``fringe=plans`` directly (without ``model_inputs``) still runs, but neither that
check nor :func:`fringe.packing.check_batch` applies (a one-time warning says so).

The gradient reduction (sum over CP, mean over data-parallel replicas, token-weighted across
microbatches) is :class:`fringe.train.GradSync`'s job with FSDP2 or DDP on a (dp, cp) mesh;
see ``examples/hf_train.py --world-size 4 --cp 2``.

``batch_size=B`` is needed when documents differ per row (per-row ``cu_seqlens`` or
``position_ids`` give ``doc_ids [B, S]``, a mask that reads ``b``) and harmless otherwise (the
plans then accept only B rows). ``labels`` follow transformers' convention (aligned with
``input_ids``, usually ``labels = input_ids``): ``shard_batch`` shifts them on the global
sequence before sharding; pass ``shift=False`` for labels that are next-token targets already.

How the pieces meet transformers (read from its ``integrations/sdpa_attention.py``,
``modeling_utils.AttentionInterface`` and ``masking_utils``):

* A model's attention module calls ``ALL_ATTENTION_FUNCTIONS[impl](module, q, k, v,
  attention_mask, dropout=, scaling=, [sliding_window=, softcap=, s_aux=], **kwargs)``
  with q ``[B, H, L, D]``, k / v ``[B, G, L, D]``, and every extra keyword the model's
  ``forward`` was called with. The plans travel that way, as ``fringe=`` (:data:`KWARG`):
  per forward, so activation checkpointing's recomputation in the backward sees them too
  (a context manager would have exited by then).
* Each call's ``scaling``, ``sliding_window``, ``is_causal`` (keyword or ``module.is_causal``)
  and ``softcap`` must match what the chosen plan was made for, or the call raises. Gemma
  scales by ``query_pre_attn_scalar**-0.5``, not ``D**-0.5``; ignoring that would be a wrong
  loss, not an error. Dropout > 0 raises. gpt-oss passes its sinks as ``s_aux``.
* transformers gives a custom attention function no 2-D padding mask. The registered mask
  function (``AttentionMaskInterface``) raises if a user passes a padding mask that fringe
  would otherwise never see, and returns None: the plan's mask is the mask.

Legend: B batch · H query heads · G kv heads · S global sequence · L = S/P · D head dim.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any, Callable

import torch

from . import _auto
from . import masks as _masks
from . import packing as _packing
from .api import attention as _cp_attention
from .layout import DEFAULT_BLOCK_SIZE
from .plan import Plan, _from_block_mask, padded_len, plan as _plan
from .schedules.base import AUTO, COMPOSE

__all__ = ["KWARG", "NAME", "LayerPlan", "Plans", "attention_forward", "layer_kinds",
           "mask_function", "model_inputs", "plans", "register"]

#: The ``attn_implementation`` name :func:`register` uses by default.
NAME = "fringe"
#: The model keyword that carries the per-batch :class:`Plans` to the attention function.
KWARG = "fringe"


@dataclasses.dataclass(frozen=True, eq=False)
class LayerPlan:
    """A plan and what it was made for, in transformers' terms.

    Attributes:
        plan: the :class:`fringe.Plan` (its ``scale`` is the softmax scale; None = ``D**-0.5``).
        causal: the plan's mask includes causal masking.
        sliding_window: transformers' ``sliding_window`` (``q - kv < w``), or None.
        softcap: the plan's score_mod is ``softcap * tanh(score / softcap)``, or None.
    """

    plan: Plan
    causal: bool = True
    sliding_window: int | None = None
    softcap: float | None = None

    def key(self) -> tuple:
        return (bool(self.causal), self.sliding_window, self.softcap)

    def describe(self) -> str:
        return (f"causal={self.causal}, sliding_window={self.sliding_window}, "
                f"softcap={self.softcap}, scale={self.plan.scale}")


@dataclasses.dataclass(frozen=True, eq=False)
class Plans:
    """The plans of one batch, one per kind of attention layer, over one layout.

    Attributes:
        layers: the :class:`LayerPlan` of each layer kind (distinct ``key()``).
        layout_fingerprint: the layout every plan shards tokens by (checked at construction).
        group: the CP process group (None: the default group).
        timeout_s: passed to :func:`fringe.attention`.
        batch_fingerprint: the layout fingerprint of the batch the model runs on
            (:func:`model_inputs` sets it from the :class:`~fringe.packing.Shard`); every
            attention call checks it against its plan's.
        real_len: the batch's real length S when :func:`plans` padded it to the layout's
            (every plan's mask then removes the padding), else None.
        batch_digest: set by :func:`model_inputs`: the shard's ``batch_digest`` (the global
            batch it was cut from) as a 0-d int64 CPU tensor; every attention call compares it
            across the CP ranks in its agreement exchange, so ranks that sharded different
            batches raise. None for plans passed directly (``fringe=fringe.hf.plans(...)``):
            neither this check nor :func:`fringe.packing.check_batch` applies to those.
    """

    layers: tuple[LayerPlan, ...]
    group: Any = None
    timeout_s: float | None = None
    batch_fingerprint: str | None = None
    real_len: int | None = None
    batch_digest: torch.Tensor | None = None
    layout_fingerprint: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not self.layers:
            raise ValueError("Plans needs at least one LayerPlan")
        fps = {lp.plan.layout.fingerprint() for lp in self.layers}
        if len(fps) != 1:
            raise ValueError(f"the layer plans shard tokens by different layouts {sorted(fps)}; plan "
                             f"every layer kind over one layout (fringe.plan(..., layout=...))")
        keys = [lp.key() for lp in self.layers]
        if len(set(keys)) != len(keys):
            raise ValueError(f"two layer plans are for the same (causal, sliding_window, softcap): {keys}")
        object.__setattr__(self, "layout_fingerprint", fps.pop())

    @property
    def plans(self) -> list[Plan]:
        """The plans (e.g. for :func:`fringe.packing.shard_batch`)."""
        return [lp.plan for lp in self.layers]

    @property
    def layout(self):
        return self.layers[0].plan.layout

    @property
    def schedule(self):
        """The schedule of the first layer kind's plan (:func:`plans` plans every kind with
        one schedule; ``schedules.auto(reuse=plans)`` plans it again)."""
        return self.layers[0].plan.schedule

    @property
    def choice(self):
        """What ``schedules.auto()`` compared and chose for all the layer kinds together (a
        :class:`fringe._auto.Choice`, the same for every kind); None if it did not choose."""
        return self.layers[0].plan.choice

    def explain(self) -> str:
        """For plans of ``schedules.auto()``: the candidates with their step time summed over
        the layers (each kind's step x its number of layers), each kind's step, and why the
        winner won (:meth:`fringe.Plan.explain` of the first kind's plan).

        Raises:
            ValueError: the plans were not made from ``schedules.auto()``.
        """
        return self.layers[0].plan.explain()

    def find(self, *, causal: bool, sliding_window: int | None, softcap: float | None) -> LayerPlan:
        """The layer plan made for exactly these; raises naming the available ones."""
        want = (bool(causal), sliding_window, softcap)
        for lp in self.layers:
            if lp.key() == want:
                return lp
        have = "; ".join(lp.describe() for lp in self.layers)
        raise ValueError(f"fringe: this attention layer runs with causal={causal}, "
                         f"sliding_window={sliding_window}, softcap={softcap}, but no plan was made "
                         f"for that (plans: {have}); build the plans with fringe.hf.plans(model, ...) "
                         f"so every layer kind of the model gets its own")


# --------------------------------------------------------------------------------------
# what a model's attention layers ask for
# --------------------------------------------------------------------------------------


def _softcap_mod(cap: float) -> Callable:
    def softcap_score_mod(score, b, h, q_idx, kv_idx):
        return cap * torch.tanh(score / cap)
    softcap_score_mod.__name__ = f"softcap({cap:g})"
    return softcap_score_mod


def layer_kinds(model) -> list[dict]:
    """The distinct attention-layer kinds of a transformers model, read from its modules.

    An attention module is one with ``scaling`` and ``layer_idx`` attributes (every model
    that uses ``AttentionInterface``). Its kind is what it passes to the attention function:
    ``scaling``, ``is_causal``, ``sliding_window`` (``module.sliding_window``, or
    ``config.sliding_window`` for models such as Mistral that pass the config's) and
    ``softcap`` (``module.attn_logit_softcapping``).

    Returns:
        one dict per kind: ``causal``, ``sliding_window``, ``softcap``, ``scaling``, ``layers``.
    """
    kinds: dict[tuple, dict] = {}
    for mod in model.modules():
        if not (hasattr(mod, "scaling") and hasattr(mod, "layer_idx")):
            continue
        cfg = getattr(mod, "config", None)
        if hasattr(mod, "sliding_window"):
            window = mod.sliding_window
        else:
            window = getattr(cfg, "sliding_window", None)
            types = getattr(cfg, "layer_types", None)
            if types is not None and types[mod.layer_idx] != "sliding_attention":
                window = None
        kind = dict(causal=bool(getattr(mod, "is_causal", True)), sliding_window=window,
                    softcap=getattr(mod, "attn_logit_softcapping", None), scaling=float(mod.scaling))
        key = tuple(kind.values())
        kinds.setdefault(key, dict(kind, layers=[]))["layers"].append(mod.layer_idx)
    if not kinds:
        raise ValueError(f"{type(model).__name__} has no attention module with `scaling` and "
                         f"`layer_idx`; is it a transformers model that uses AttentionInterface?")
    return list(kinds.values())


def _named_plans(fn: Callable) -> Callable:
    """Errors raised under :func:`plans` name ``fringe.hf.plans``, the function the user
    called, not the :func:`fringe.plan` it calls for each layer kind (whose messages say
    which keyword to pass: ``batch_size=``, ``block_size=``...: keywords of
    ``fringe.hf.plans`` too)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, TypeError) as e:
            if type(e) not in (ValueError, TypeError):
                raise
            msg = re.sub(r"\bfringe\.plan\b(?![\w.])", "fringe.hf.plans", str(e))
            if not msg.startswith("fringe.hf.plans"):
                msg = f"fringe.hf.plans: {msg}"
            raise type(e)(msg).with_traceback(e.__traceback__) from None
    return wrapper


def _check_rows(mask, plan_kwargs: dict) -> None:
    """A mask whose document ids differ per row (``doc_ids [B, S]``) needs ``batch_size=B``."""
    rows = sorted({int(t.shape[0]) for t in _packing._and_documents(mask) if t.dim() == 2})
    if not rows:
        return
    given = plan_kwargs.get("batch_size")
    if len(rows) > 1:
        raise ValueError(f"fringe.hf.plans: the mask's document ids have {rows} rows in different "
                         f"parts; give every part one id row per batch row")
    B = rows[0]
    if given is None:
        raise ValueError(f"fringe.hf.plans: the mask's document ids differ per row ({B} rows: "
                         f"per-row cu_seqlens or position_ids), so each row's blocks are "
                         f"classified and the plans are for batches of {B} rows; pass "
                         f"batch_size={B} to fringe.hf.plans(model, schedule, mask, seq_len=, "
                         f"world_size=, batch_size={B})")
    if given != B:
        raise ValueError(f"fringe.hf.plans: batch_size={given} but the mask's document ids have {B} "
                         f"rows (one per batch row); pass batch_size={B}, or document ids of "
                         f"{given} rows")


@_named_plans
def plans(model, schedule, mask=None, *, seq_len: int, world_size: int, group=None,
          timeout_s: float | None = None, layout=None, **plan_kwargs) -> Plans:
    """Plan ``mask`` for every attention-layer kind of ``model``, over one layout.

    Each kind's mask is ``mask & causal() & sliding_window(w)`` as the layer declares, with
    the layer's own ``scaling`` and softcap (as a score_mod). Every kind is planned over one
    layout (the tokens are sharded once per batch), each keeping its own pruning: ``layout``
    if given; for a mask-aware schedule (``schedules.balanced()``) with several kinds, the
    layout balanced for all layers together, by the same predicted step time
    :func:`fringe.plan` minimises for one mask, summed over the kinds weighted by their
    numbers of layers; else the first kind's (layers without a window come first).

    ``schedules.auto()`` chooses one schedule for all the kinds: each candidate plans every
    kind as above, and the pick has the least predicted step time summed over the kinds, each
    weighted by its number of layers (``plans.explain()`` lists the sums and each kind's step);
    ``schedules.auto(reuse=plans)`` plans the last winner again, with no search.

    A ``seq_len`` the schedule's layout does not accept (not whole blocks on every rank,
    zigzag's 2P chunks, or ``tp_size``) is padded to ``fringe.padded_len(S, P,
    block_size=, tp_size=)`` (or to ``layout.seq_len``): the plans are made for the padded
    length with ``packing.pad_mask(mask, real_len=S, ...)``, under which the pad tokens
    attend to nothing and nothing attends to them, and :func:`fringe.packing.shard_batch`
    pads the batch itself (ignored labels, so the loss counts real tokens only).

    Args:
        model: a transformers model (or anything :func:`layer_kinds` reads).
        schedule: e.g. ``schedules.zigzag()``, or ``schedules.auto()``.
        mask: the batch's mask on global positions (e.g. ``packing.document_mask(doc_ids)``),
            without causal / window (added per layer); None: full. A FlexAttention
            ``BlockMask`` is taken as its mask_mod, as :func:`fringe.plan` takes one.
        seq_len, world_size: S (the batch's real length) and P.
        group, timeout_s: for :func:`fringe.attention`.
        layout: a :class:`fringe.Layout` to plan over (default: from the first kind's plan);
            not with ``schedules.auto()``, which chooses the layout with the schedule.
        **plan_kwargs: passed to :func:`fringe.plan` (``block_size``, ``batch_size``, ``kv``,
            ``kernel``, ``tp_size``...). ``batch_size=B`` is required when the mask's
            document ids differ per row (``packing.document_mask`` of ``doc_ids [B, S]``, from
            per-row ``cu_seqlens`` or ``position_ids``), and the plans then take batches of B
            rows only.

    Returns:
        :class:`Plans` (``real_len=S`` when padded).

    Raises:
        ValueError / TypeError: as :func:`fringe.plan`, naming ``fringe.hf.plans`` and its
            keyword to fix (e.g. ``batch_size=`` for per-row documents, with the value).
    """
    kinds = sorted(layer_kinds(model), key=lambda k: (k["sliding_window"] is not None,
                                                       k["sliding_window"] or 0))
    from torch.nn.attention.flex_attention import BlockMask
    if isinstance(mask, BlockMask):          # its mask_mod, checked as fringe.plan does
        mask, B, H = _from_block_mask(
            mask, seq_len=seq_len, block_size=plan_kwargs.get("block_size", DEFAULT_BLOCK_SIZE),
            batch_size=plan_kwargs.get("batch_size"), num_heads=plan_kwargs.get("num_heads"))
        plan_kwargs.update({k: v for k, v in (("batch_size", B), ("num_heads", H))
                            if v is not None})
    _check_rows(mask, plan_kwargs)
    real_len = None
    padded = _padded_len(schedule, seq_len, world_size, layout, plan_kwargs)
    if padded != seq_len:
        mask = _packing.pad_mask(mask, real_len=seq_len, padded_len=padded)
        real_len, seq_len = seq_len, padded
    base = _masks.full() if mask is None else _masks.as_mask(mask)
    kind_masks = []
    for kind in kinds:
        m = base
        w = kind["sliding_window"]
        if w is not None:
            m = m & _masks.sliding_window(int(w), causal=kind["causal"])
        elif kind["causal"]:
            m = m & _masks.causal()
        kind_masks.append(m)
    counts = [len(k["layers"]) for k in kinds]

    def plan_kinds(sched, layout) -> list[Plan]:
        """Every kind planned with ``sched`` over one layout (``layout``, else a mask-aware
        schedule's for all kinds together, else the first kind's)."""
        if layout is None and getattr(sched, "mask_aware", False) and len(kinds) > 1:
            layout = _balanced_layout(sched, kind_masks, counts, seq_len=seq_len,
                                      world_size=world_size, plan_kwargs=plan_kwargs)
        out = []
        for kind, m in zip(kinds, kind_masks):
            score_mod = _softcap_mod(kind["softcap"]) if kind["softcap"] is not None else None
            kw = dict(plan_kwargs)
            if layout is not None:
                kw["layout"] = layout
            p = _plan(sched, m, seq_len=seq_len, world_size=world_size, scale=kind["scaling"],
                      score_mod=score_mod, **kw)
            layout = p.layout
            out.append(p)
        return out

    if getattr(schedule, "kind", None) == AUTO:     # one schedule for every kind, weighted
        if layout is not None:
            raise ValueError("schedules.auto() chooses the schedule and its layout; it does not "
                             "plan over a given layout=. Leave layout= out, or plan the schedule "
                             "you want over that layout (e.g. the one plans.schedule holds)")
        ps = _auto.resolve_kinds(schedule, lambda s: plan_kinds(s, None),
                                 [(_kind_label(k), n) for k, n in zip(kinds, counts)],
                                 world_size=world_size,
                                 num_heads=plan_kwargs.get("num_heads"))
    else:
        ps = plan_kinds(schedule, layout)
    layers = [LayerPlan(p, causal=kind["causal"], sliding_window=kind["sliding_window"],
                        softcap=kind["softcap"]) for kind, p in zip(kinds, ps)]
    return Plans(tuple(layers), group=group, timeout_s=timeout_s, real_len=real_len)


def _kind_label(kind: dict) -> str:
    """A layer kind in a few characters, for ``explain()``: ``causal``, ``window16``,
    ``full``, with ``+cap30.0`` for a softcap."""
    w = kind["sliding_window"]
    label = f"window{w}" if w is not None else ("causal" if kind["causal"] else "full")
    return label + (f"+cap{kind['softcap']}" if kind["softcap"] is not None else "")


def _padded_len(schedule, seq_len: int, world_size: int, layout, plan_kwargs: dict) -> int:
    """``seq_len`` if the schedule's layout (or ``layout``) takes it, else the padded length."""
    if layout is not None:
        if getattr(layout, "seq_len", seq_len) < seq_len:
            raise ValueError(f"the given layout is for S={layout.seq_len} tokens, fewer than the "
                             f"batch's seq_len={seq_len}")
        return layout.seq_len
    bs = plan_kwargs.get("block_size", DEFAULT_BLOCK_SIZE)
    tp = plan_kwargs.get("tp_size", 1)
    sizes = (seq_len, world_size, bs, tp)
    if not hasattr(schedule, "make_layout") or not all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in sizes):
        return seq_len                                  # fringe.plan names the bad argument
    if seq_len % (world_size * bs) == 0 and (seq_len // world_size) % tp == 0:
        if getattr(schedule, "kind", None) == AUTO:
            return seq_len      # candidates whose layouts refuse it are listed with the reason
        try:
            work = torch.ones(seq_len // bs) if getattr(schedule, "mask_aware", False) else None
            schedule.make_layout(seq_len, world_size, block_size=bs, block_work=work)
            return seq_len
        except ValueError:
            pass
    return padded_len(seq_len, world_size, block_size=bs, tp_size=tp,
                      stripe=_stripe_of(getattr(schedule, "spec", None)))


def _stripe_of(spec) -> int | None:
    """The stripe a schedule's striped:N parts need whole on every rank (the lcm over a
    composed schedule's outer and inner), for :func:`fringe.padded_len`; None: none."""
    if spec is None:
        return None
    if spec.name == COMPOSE:
        parts = [_stripe_of(spec.outer), _stripe_of(spec.inner)]
    else:
        parts = [spec.arg if spec.name == "striped" else None]
    parts = [n for n in parts if n]
    return math.lcm(*parts) if parts else None


def _balanced_layout(schedule, kind_masks, counts, *, seq_len, world_size, plan_kwargs):
    """A mask-aware schedule's layout for the work of every layer, by the prediction
    :func:`fringe.plan` uses for one mask: each kind's sparse block map in sequence order,
    weighted by its number of layers (``layout.balanced(natural=[(map, layers), ...])``:
    the predicted step time is the weighted sum over the maps). A mask-aware layout that
    does not take ``natural=`` (e.g. a composed schedule's) gets the weighted block work."""
    import inspect

    bs = plan_kwargs.get("block_size", DEFAULT_BLOCK_SIZE)
    pos = torch.arange(seq_len)
    maps = [(_masks.classify(m, pos, pos, block_size=bs, B=plan_kwargs.get("batch_size"),
                             H=plan_kwargs.get("num_heads"), sparse=True), n)
            for m, n in zip(kind_masks, counts)]
    work = sum(n * bm.row_counts() for bm, n in maps)
    if "natural" in inspect.signature(schedule.layout).parameters:
        return schedule.layout(seq_len, world_size, block_size=bs, block_work=work, natural=maps)
    return schedule.make_layout(seq_len, world_size, block_size=bs, block_work=work)


def model_inputs(shard, plans: Plans) -> dict:
    """Keyword arguments for the model: the shard's inputs plus ``fringe=`` (:data:`KWARG`).

    The shard and the plans describe one batch and are checked against each other: the
    layout, and (:func:`fringe.packing.check_batch`) the real length, B and the documents
    of every plan whose mask holds document ids as a fringe rule (``packing.document_mask``,
    ``masks.document``, through ``&`` and ``pad_mask``). Layouts alone are equal for any two
    batches of one length, so plans made for the previous batch would otherwise run on this
    one with no error. For a mask with no document ids as a rule (a plain callable) the
    documents cannot be compared: that part of the check does not apply.

    The shard's ``batch_digest`` (of the global batch it was cut from) travels with the plans
    into every attention call, which compares it across the CP ranks in the agreement it runs
    anyway: CP ranks that sharded different global batches (a loader seeded by global rank
    instead of dp rank) all raise before any attention data moves, even when their batches'
    documents, and so the plans, agree. Passing ``fringe=plans`` to the model directly
    still works, but neither check applies then (a one-time warning says so).

    Raises:
        ValueError: the shard's tokens follow another layout than the plans', or a batch
            mismatch (the plans were made for another batch than the shard's).
    """
    if shard.layout_fingerprint != plans.layout_fingerprint:
        raise ValueError(f"the batch was sharded by layout {shard.layout_fingerprint} but the plans "
                         f"are for layout {plans.layout_fingerprint}; shard the batch with these plans "
                         f"(packing.shard_batch(..., plan=plans.plans))")
    _packing.check_batch(plans.plans, shard, where="fringe.hf.model_inputs")
    out = shard.model_inputs()
    digest = _packing._run_digest(shard, plans.plans[0], plans.group)
    out[KWARG] = dataclasses.replace(
        plans, batch_fingerprint=shard.layout_fingerprint,
        batch_digest=None if digest is None else torch.tensor(digest, dtype=torch.int64))
    return out


# --------------------------------------------------------------------------------------
# the functions transformers calls
# --------------------------------------------------------------------------------------

_MISSING = object()


def attention_forward(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature, running :func:`fringe.attention`.

    Args:
        module: the attention module (for ``is_causal`` / ``sliding_window`` defaults).
        query: ``[B, H, L, D]`` this rank's queries (layout order); key ``[B, G, L, D]``, value
            ``[B, G, L, Dv]`` (MLA, e.g. DeepSeek-V3: Dv != D, no glue needed).
        attention_mask: must be None (the plan carries the mask).
        dropout: must be 0.
        scaling: the softmax scale the layer wants (None: ``D**-0.5``).
        is_causal: None: ``module.is_causal``.
        **kwargs: ``fringe`` (:class:`Plans`, required), ``sliding_window``, ``softcap``,
            ``s_aux`` (sinks ``[H]``), and whatever else the model passes (ignored).

    Returns:
        ``(out [B, L, H, Dv], None)``.

    Raises:
        ValueError: no plans, a mask / dropout / output_attentions / position_bias request,
            or a plan not made for this layer's scaling, window, causality, softcap or layout.
    """
    ctx = kwargs.get(KWARG)
    if not isinstance(ctx, Plans):
        raise ValueError(f"attn_implementation={NAME!r} needs this batch's plans: call the model with "
                         f"{KWARG}=fringe.hf.plans(model, ...) (or **fringe.hf.model_inputs(shard, plans)); "
                         f"got {KWARG}={type(ctx).__name__ if ctx is not None else None}")
    if attention_mask is not None:
        raise ValueError(f"fringe got an attention_mask of shape {tuple(attention_mask.shape)}; the plan's "
                         f"mask_mod is the mask under fringe, so put padding / documents there and pass "
                         f"attention_mask=None")
    if dropout:
        raise ValueError(f"attention dropout={dropout} is not supported by fringe; set the config's "
                         f"attention_dropout=0.0")
    if kwargs.get("output_attentions"):
        raise ValueError("fringe never materialises attention weights; pass output_attentions=False")
    if kwargs.get("position_bias") is not None:
        raise ValueError("fringe does not take a position_bias tensor; express it as a score_mod in the plan")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    window = kwargs.get("sliding_window", _MISSING)
    if window is _MISSING:
        window = getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    lp = ctx.find(causal=bool(is_causal), sliding_window=window, softcap=softcap)
    D = query.shape[-1]
    want = lp.plan.scale if lp.plan.scale is not None else D ** -0.5
    got = scaling if scaling is not None else D ** -0.5
    if not math.isclose(float(want), float(got), rel_tol=1e-12, abs_tol=0.0):
        raise ValueError(f"fringe: layer {getattr(module, 'layer_idx', '?')} scales scores by {got!r} but "
                         f"its plan was made with scale={lp.plan.scale!r} (= {want!r}); plan with "
                         f"scale=module.scaling (fringe.hf.plans does)")
    # Plans hold one layout (checked when built) and model_inputs checked the batch against it.
    # Checked again eagerly; a compiled graph would guard on these strings and recompile for
    # every new layout (a balanced one changes per batch), so it skips this one comparison.
    fp = ctx.layout_fingerprint
    if (ctx.batch_fingerprint is not None and not torch.compiler.is_compiling()
            and fp != ctx.batch_fingerprint):
        raise ValueError(f"fringe: the plan for this layer shards tokens by layout {fp} but the batch was "
                         f"sharded by {ctx.batch_fingerprint}; plan every layer over the batch's layout")
    if query.shape[2] != key.shape[2]:
        raise ValueError(f"fringe: {query.shape[2]} queries but {key.shape[2]} keys on this rank; a KV "
                         f"cache is not supported under context parallelism (pass use_cache=False)")
    if ctx.batch_fingerprint is None and not torch.compiler.is_compiling():
        _warn_unbound()
    sinks = kwargs.get("s_aux")
    extra = {} if sinks is None else dict(sinks=sinks)
    if ctx.batch_digest is not None:
        extra["batch_digest"] = ctx.batch_digest
    out = _cp_attention(query, key, value, plan=lp.plan, group=ctx.group, timeout_s=ctx.timeout_s,
                        **extra)
    return out.transpose(1, 2).contiguous(), None


@functools.lru_cache(maxsize=None)
def _warn_unbound() -> None:
    """Once per process: plans passed directly skip the batch checks."""
    import warnings
    warnings.warn(f"fringe.hf: the model got {KWARG}=plans directly, not through "
                  f"fringe.hf.model_inputs(shard, plans): the plans are not checked against the "
                  f"batch (packing.check_batch), nor is it checked that every CP rank sharded the "
                  f"same global batch; call model(**fringe.hf.model_inputs(shard, plans)) to get "
                  f"both checks", UserWarning, stacklevel=3)


def mask_function(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0,
                  kv_offset: int = 0, mask_function=None, attention_mask=None, **kwargs):
    """transformers' mask-interface signature: no mask (the plan's mask_mod is the mask).

    Raises:
        ValueError: a 2-D padding ``attention_mask`` with a zero in it (fringe would never see
            it), or a KV cache offset.
    """
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError("fringe: the model got a 2-D attention_mask that pads tokens out; fringe never "
                         "sees that mask (transformers hands custom attention functions no padding "
                         "mask), so it would be ignored. Put padding in the plan's mask instead "
                         "(packing.pad_mask / packing.real_tokens; fringe.hf.plans pads a length "
                         "that does not fit by itself) and pass attention_mask=None")
    if kv_length != q_length or q_offset or kv_offset:
        raise ValueError(f"fringe: {q_length} queries at offset {q_offset} against {kv_length} keys: a "
                         f"KV cache is not supported under context parallelism (pass use_cache=False)")
    return None


def register(name: str = NAME) -> str:
    """Register :func:`attention_forward` and :func:`mask_function` under ``name``.

    Idempotent. Then ``Model(config)`` with ``config._attn_implementation = name`` (or
    ``attn_implementation=name`` in ``from_pretrained`` / ``set_attn_implementation``).

    Returns:
        ``name``.
    """
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:      # pragma: no cover - the extra is missing
        raise ImportError("fringe.hf needs transformers: pip install 'fringe[hf]'") from e
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, mask_function)
    return name
