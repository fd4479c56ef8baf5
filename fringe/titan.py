"""torchtitan: fringe context-parallel attention inside torchtitan's decoder models (Llama 3).

A training step (see ``examples/titan_train.py`` for the whole loop)::

    import fringe.titan
    from fringe import packing, schedules
    model = llama3_configs["debugmodel"](attn_backend="flex").build(); model.init_states()
    fringe.titan.apply(model)                                   # once: every layer -> fringe
    plans = fringe.titan.plans(model, schedules.zigzag(), positions, world_size=P)   # per batch
    shard = fringe.titan.shard_batch(inputs, labels, plans, positions=positions, rank=rank)
    logits = model(**fringe.titan.model_inputs(shard, plans))   # tokens, positions, attention_masks
    loss = packing.token_weighted_loss(logits, shard.shift_labels, num_items=shard.num_items)
    loss.backward()              # this rank's share: sum the CP ranks' gradients (all_reduce SUM)

How the pieces meet torchtitan 0.3 (read from ``torchtitan/models/common/attention.py`` and
``decoder.py``):

* ``Decoder.forward(tokens, positions, attention_masks)`` hands ``attention_masks`` through
  every ``TransformerBlock`` to its attention module (``GQAttention``), which calls
  ``self.inner_attention(q, k, v, attention_masks=..., scale=self.scaling,
  enable_gqa=...)`` with q ``[B, L, H, D]`` and k / v ``[B, L, G, D]`` after RoPE. That
  inner module (``FlexAttention`` or ``VarlenAttention``) is the seam: :func:`apply` swaps
  each one for a :class:`FringeAttention`, and the batch's :class:`Plans` travel as
  ``attention_masks`` (per forward, so activation checkpointing's recomputation sees them).
* torchtitan's document mask is causal & same document, a document starting wherever
  ``positions`` is 0 (``get_document_mask_mod``); :func:`plans` builds the same mask as
  fringe rules (``masks.causal() & packing.document_mask(doc_ids)``: classified exactly per
  block, no S² evaluation). RoPE reads ``positions`` as given: each rank passes its tokens'
  global positions (``positions[:, layout.positions(rank)]``, :attr:`Shard.position_ids`).
* ``scale`` is ``GQAttention.scaling`` (None: ``D**-0.5``); each layer's scale must equal
  its plan's, or the call raises before any communication.
* torchtitan's data loader yields labels that are next-token targets already, shifted within
  each document (``text_datasets.py``), so :func:`shard_batch` shards them as given
  (``shift=False``); the loss is local SUM / global target count, as torchtitan's own.

Not covered: torchtitan's Trainer (it does not run on CPU; use the model classes in your own
loop), tensor / pipeline parallelism inside the CP group (DTensor activations), sliding
windows and ``out_transform`` / ``score_mod`` of other torchtitan models (they raise).

Legend: B batch · H query heads · G kv heads · S global sequence · L = S/P · D head dim.
"""
from __future__ import annotations

import dataclasses
import inspect
import math

import torch

from . import masks as _masks
from . import packing as _packing
from .api import attention as _cp_attention
from .plan import Plan, plan as _plan

__all__ = ["FringeAttention", "Plans", "apply", "doc_ids_from_positions", "layer_scales",
           "model_inputs", "plans", "shard_batch"]

_WHERE = "fringe.titan"


@dataclasses.dataclass(frozen=True, eq=False)
class Plans:
    """The plans of one batch, one per distinct softmax scale of the model's layers, over one
    layout; what the model gets as ``attention_masks``.

    Attributes:
        plans: the :class:`fringe.Plan` of each scale (distinct ``plan.scale``).
        group: the CP process group or DeviceMesh (None: the default group).
        timeout_s: passed to :func:`fringe.attention`.
        batch_fingerprint: set by :func:`model_inputs`: the layout the batch was sharded by.
        positions: set by :func:`model_inputs`: the shard's RoPE positions ``[B, L]``, which
            the model must be called with (checked by the hook :func:`apply` installs).
        batch_digest: set by :func:`model_inputs`: the shard's ``batch_digest`` as a 0-d int64
            CPU tensor; every attention call compares it across the CP ranks (ranks that
            sharded different global batches raise).
        layout_fingerprint: the layout every plan shards tokens by (checked at construction).
    """

    plans: tuple[Plan, ...]
    group: object = None
    timeout_s: float | None = None
    batch_fingerprint: str | None = None
    positions: torch.Tensor | None = None
    batch_digest: torch.Tensor | None = None
    layout_fingerprint: str = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        if not self.plans:
            raise ValueError("fringe.titan.Plans needs at least one plan")
        fps = {p.layout.fingerprint() for p in self.plans}
        if len(fps) != 1:
            raise ValueError(f"the plans shard tokens by different layouts {sorted(fps)}; plan every "
                             f"scale over one layout (fringe.titan.plans does)")
        scales = [p.scale for p in self.plans]
        if len(set(scales)) != len(scales):
            raise ValueError(f"two plans are for the same scale: {scales}")
        object.__setattr__(self, "layout_fingerprint", fps.pop())

    @property
    def layout(self):
        return self.plans[0].layout

    def find(self, scale: float, *, layer: str = "?") -> Plan:
        """The plan made for ``scale`` (a float; the call's effective scale)."""
        for p in self.plans:
            if p.scale is not None and math.isclose(float(p.scale), float(scale), rel_tol=1e-12,
                                                    abs_tol=0.0):
                return p
        have = ", ".join(repr(p.scale) for p in self.plans)
        raise ValueError(f"fringe.titan: layer {layer} scales scores by {scale!r} but the plans were "
                         f"made for scale {have}; plan with fringe.titan.plans(model, ...) after "
                         f"fringe.titan.apply(model), which reads every layer's scale")


# --------------------------------------------------------------------------------------
# the inner attention module
# --------------------------------------------------------------------------------------


class FringeAttention(torch.nn.Module):
    """Drop-in for torchtitan's inner attention (``GQAttention.inner_attention``).

    Takes q ``[B, L, H, D]``, k / v ``[B, L, G, D]`` (this rank's tokens, layout order, RoPE
    applied) and ``attention_masks=`` the batch's :class:`Plans`; returns ``[B, L, H, D]``.

    Args:
        layer: the attention module's name in the model (for error messages).
        replaced: the class name of the inner attention it replaced.
    """

    def __init__(self, *, layer: str = "?", replaced: str = "") -> None:
        super().__init__()
        self.layer = layer
        self.replaced = replaced

    def extra_repr(self) -> str:
        return f"layer={self.layer!r}, replaced={self.replaced!r}"

    def forward(self, q_BLHD: torch.Tensor, k_BLGD: torch.Tensor, v_BLGD: torch.Tensor, *,
                attention_masks=None, scale: float | None = None, enable_gqa: bool = False,
                score_mod=None, out_transform=None, **kwargs) -> torch.Tensor:
        ctx = attention_masks
        if not isinstance(ctx, Plans):
            raise ValueError(f"fringe.titan: layer {self.layer} runs fringe attention and needs this "
                             f"batch's plans as attention_masks: call the model with "
                             f"**fringe.titan.model_inputs(shard, plans); got attention_masks="
                             f"{type(ctx).__name__ if ctx is not None else None}")
        if score_mod is not None:
            raise ValueError(f"fringe.titan: layer {self.layer} passes a score_mod; put it in the plan "
                             f"(fringe.titan.plans(..., score_mod=...)) instead")
        if out_transform is not None:
            raise ValueError(f"fringe.titan: layer {self.layer} passes an out_transform (an lse "
                             f"epilogue); fringe.titan does not support it")
        if q_BLHD.shape[1] != k_BLGD.shape[1]:
            raise ValueError(f"fringe.titan: {q_BLHD.shape[1]} queries but {k_BLGD.shape[1]} keys on "
                             f"this rank; a KV cache is not supported under context parallelism")
        D = q_BLHD.shape[-1]
        got = float(scale) if scale is not None else D ** -0.5
        p = ctx.find(got, layer=self.layer)
        fp = ctx.layout_fingerprint
        if ctx.batch_fingerprint is None and not torch.compiler.is_compiling():
            # unbound plans were never checked against the batch (a batch N plan on batch N+1)
            raise ValueError(f"fringe.titan: layer {self.layer} got plans not bound to a batch; "
                             f"call the model with **fringe.titan.model_inputs(shard, plans), "
                             f"which checks that the plans describe the shard's batch")
        if (ctx.batch_fingerprint is not None and not torch.compiler.is_compiling()
                and fp != ctx.batch_fingerprint):
            raise ValueError(f"fringe.titan: the plans shard tokens by layout {fp} but the batch was "
                             f"sharded by {ctx.batch_fingerprint}; plan and shard with one Plans")
        out = _cp_attention(q_BLHD.transpose(1, 2), k_BLGD.transpose(1, 2), v_BLGD.transpose(1, 2),
                            plan=p, group=ctx.group, timeout_s=ctx.timeout_s,
                            batch_digest=ctx.batch_digest)
        return out.transpose(1, 2)                          # [B, L, H, D], as torchtitan's


# --------------------------------------------------------------------------------------
# swapping it in
# --------------------------------------------------------------------------------------


def _attention_modules(model) -> list[tuple[str, torch.nn.Module]]:
    return [(name, m) for name, m in model.named_modules()
            if isinstance(getattr(m, "inner_attention", None), torch.nn.Module)]


def _check_swappable(name: str, inner) -> None:
    try:
        from torchtitan.models.common.attention import FlexAttention, VarlenAttention
    except ImportError as e:      # pragma: no cover - the extra is missing
        raise ImportError("fringe.titan needs torchtitan: pip install 'fringe[titan]'") from e
    if isinstance(inner, FringeAttention):
        return
    if isinstance(inner, FlexAttention):
        return                      # torchtitan gives it the causal + document BlockMask
    if isinstance(inner, VarlenAttention) and tuple(inner.window_size) == (-1, 0):
        return                      # causal within each document
    window = getattr(inner, "window_size", None)
    raise ValueError(f"fringe.titan.apply: {name}.inner_attention is {type(inner).__name__}"
                     f"{'' if window is None else f'(window_size={window})'}"
                     f"; fringe.titan replaces causal document attention (FlexAttention, or "
                     f"VarlenAttention with window_size=(-1, 0)), as Llama 3 uses. Build the model "
                     f"with attn_backend='flex'")


def _bind_forward(model, args, kwargs) -> dict:
    sig = inspect.signature(type(model).forward)
    try:
        bound = sig.bind(model, *args, **kwargs)
    except TypeError:
        return {}
    return dict(bound.arguments)


def _check_positions_hook(model, args, kwargs):
    """The model's forward pre-hook: RoPE under fringe must get the shard's global positions."""
    call = _bind_forward(model, args, kwargs)
    ctx = call.get("attention_masks")
    if not isinstance(ctx, Plans):
        return None
    tokens, pos = call.get("tokens"), call.get("positions")
    if pos is None:
        raise ValueError("fringe.titan: the model got fringe plans but positions=None, so RoPE would "
                         "use local indices 0..L-1; call it with **fringe.titan.model_inputs(shard, "
                         "plans) (positions = the shard's global positions)")
    if ctx.positions is not None and not torch.compiler.is_compiling() and (
            pos.shape != ctx.positions.shape
            or not torch.equal(pos, ctx.positions.to(pos.device))):
        raise ValueError(f"fringe.titan: positions {tuple(pos.shape)} are not the shard's RoPE "
                         f"positions {tuple(ctx.positions.shape)} (its tokens' global positions); "
                         f"pass positions=shard.position_ids (fringe.titan.model_inputs does)")
    if torch.is_tensor(tokens) and tokens.dim() >= 2 and tuple(pos.shape[-1:]) != tuple(tokens.shape[1:2]):
        raise ValueError(f"fringe.titan: positions {tuple(pos.shape)} do not match tokens "
                         f"{tuple(tokens.shape)} (one position per local token)")
    return None


def apply(model) -> int:
    """Swap every attention layer's inner attention in ``model`` for :class:`FringeAttention`.

    Idempotent. Also registers a forward pre-hook on ``model`` that checks, when it is called
    with fringe :class:`Plans`, that ``positions`` are the shard's (RoPE of global positions).

    Args:
        model: a torchtitan decoder (``Llama3Model`` and others whose attention modules have
            an ``inner_attention``), built with ``attn_backend="flex"`` (or ``"varlen"``).

    Returns:
        the number of attention layers that now run fringe.

    Raises:
        ValueError: no attention module, or one whose inner attention is not causal document
            attention (a sliding window, an SDPA without masks).
        ImportError: torchtitan is not installed.
    """
    mods = _attention_modules(model)
    if not mods:
        raise ValueError(f"fringe.titan.apply: {type(model).__name__} has no module with an "
                         f"inner_attention; is it a torchtitan decoder (e.g. Llama3Model)?")
    for name, m in mods:
        _check_swappable(name, m.inner_attention)
    for name, m in mods:
        if not isinstance(m.inner_attention, FringeAttention):
            m.inner_attention = FringeAttention(layer=name, replaced=type(m.inner_attention).__name__)
    if not getattr(model, "_fringe_titan_hook", False):
        model.register_forward_pre_hook(_check_positions_hook, with_kwargs=True)
        model._fringe_titan_hook = True
    return len(mods)


def layer_scales(model) -> dict[float, list[str]]:
    """The softmax scale of each fringe attention layer (after :func:`apply`).

    A layer's scale is what it passes to its inner attention: ``module.scaling``, or
    ``head_dim**-0.5`` where that is None (torchtitan's default).

    Returns:
        ``{scale: [layer names]}``.

    Raises:
        ValueError: no layer runs fringe attention yet (call :func:`apply` first).
    """
    out: dict[float, list[str]] = {}
    for name, m in _attention_modules(model):
        if not isinstance(m.inner_attention, FringeAttention):
            continue
        s = getattr(m, "scaling", None)
        if s is None:
            s = m.head_dim ** -0.5
        out.setdefault(float(s), []).append(name)
    if not out:
        raise ValueError("fringe.titan: no layer of the model runs fringe attention; call "
                         "fringe.titan.apply(model) first")
    return out


# --------------------------------------------------------------------------------------
# per batch
# --------------------------------------------------------------------------------------


def _positions_2d(positions) -> torch.Tensor:
    if not torch.is_tensor(positions) or positions.is_floating_point() or positions.is_complex() \
            or positions.dtype == torch.bool:
        raise TypeError(f"{_WHERE}: positions must be an int tensor [B, S] or [S], got "
                        f"{type(positions).__name__ if not torch.is_tensor(positions) else positions.dtype}")
    if positions.dim() not in (1, 2) or positions.shape[-1] < 1:
        raise ValueError(f"{_WHERE}: positions must be [B, S] or [S], got shape {tuple(positions.shape)}")
    return positions.detach().cpu().to(torch.int64).reshape(-1, positions.shape[-1])


def doc_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """Document ids by torchtitan's rule: a document starts wherever ``positions`` is 0.

    The positions must be per-document positions (0 at each document's start, then +1 per
    token), as torchtitan's data loader makes them: its RoPE reads them as given while its
    mask reads only the zeros, and fringe shards them by :func:`fringe.packing.shard_batch`,
    which needs both to agree.

    Args:
        positions: int ``[B, S]`` or ``[S]``.

    Returns:
        int64 ``[S]`` (every row alike) or ``[B, S]``.

    Raises:
        ValueError: a row that does not start at 0, or positions that do not step by 1
            inside a document (naming the first such token).
    """
    pos = _positions_2d(positions)
    ids = torch.cumsum((pos == 0).to(torch.int64), dim=1) - 1
    bad = (pos[:, 0] != 0).nonzero()
    if bad.numel():
        b = int(bad[0, 0])
        raise ValueError(f"{_WHERE}: row {b}'s positions start at {int(pos[b, 0])}, not 0; torchtitan "
                         f"starts a document at every position 0 (its loader renormalises each row's "
                         f"first document to start at 0): do the same")
    want = _packing.positions_in_document(ids)
    wrong = (pos != want).nonzero()
    if wrong.numel():
        b, i = (int(x) for x in wrong[0])
        raise ValueError(f"{_WHERE}: row {b} token {i} has position {int(pos[b, i])}, expected "
                         f"{int(want[b, i])} (0 at a document's start, +1 per token); torchtitan "
                         f"would put its RoPE and its document mask out of step here")
    if positions.dim() == 1 or bool((ids == ids[:1]).all()):
        return ids[0]
    return ids


def plans(model, schedule, positions: torch.Tensor | None = None, *, world_size: int,
          seq_len: int | None = None, group=None, timeout_s: float | None = None, layout=None,
          **plan_kwargs) -> Plans:
    """Plan this batch's torchtitan mask (causal & same document) for every scale of ``model``.

    Args:
        model: the torchtitan model after :func:`apply`.
        schedule: e.g. ``schedules.zigzag()``.
        positions: the batch's GLOBAL positions ``[B, S]`` / ``[S]`` as torchtitan's loader
            gives them (0 at each document start); None: one document per row (``seq_len``
            required).
        world_size: P.
        seq_len: S (default: ``positions.shape[-1]``).
        group, timeout_s: for :func:`fringe.attention`.
        layout: plan over this :class:`fringe.Layout` (default: the schedule's).
        **plan_kwargs: passed to :func:`fringe.plan` (``block_size``, ``kv``, ``kernel``...).
            ``batch_size`` defaults to B when rows have different documents.

    Returns:
        :class:`Plans`, one plan per distinct layer scale, all over one layout.

    Raises:
        ValueError: see :func:`doc_ids_from_positions` and :func:`fringe.plan` (a ``seq_len``
            the layout does not take: pad to ``fringe.padded_len(S, P, block_size=)``).
    """
    if "scale" in plan_kwargs:
        raise ValueError(f"{_WHERE}.plans reads each layer's scale from the model; do not pass scale=")
    scales = layer_scales(model)
    mask = _masks.causal()
    if positions is not None:
        doc_ids = doc_ids_from_positions(positions)
        S = doc_ids.shape[-1]
        if seq_len is not None and seq_len != S:
            raise ValueError(f"{_WHERE}.plans: seq_len={seq_len} but positions have S={S}")
        seq_len = S
        mask = mask & _packing.document_mask(doc_ids)
        if doc_ids.dim() == 2 and plan_kwargs.get("batch_size") is None:
            plan_kwargs["batch_size"] = doc_ids.shape[0]
    elif seq_len is None:
        raise ValueError(f"{_WHERE}.plans: give the batch's positions (or seq_len= for one document "
                         f"per row)")
    out = []
    for scale in scales:
        kw = dict(plan_kwargs)
        if layout is not None:
            kw["layout"] = layout
        try:
            p = _plan(schedule, mask, seq_len=seq_len, world_size=world_size, scale=scale, **kw)
        except (ValueError, TypeError) as e:
            raise type(e)(f"{_WHERE}.plans: {e}") from e
        layout = p.layout
        out.append(p)
    return Plans(tuple(out), group=group, timeout_s=timeout_s)


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor | None, plans: Plans, *,
                positions: torch.Tensor | None = None, rank: int | None = None, group=None,
                ignore_index: int = _packing.IGNORE_INDEX) -> _packing.Shard:
    """This rank's shard of a torchtitan batch (:func:`fringe.packing.shard_batch`).

    Labels are torchtitan's: next-token targets already (``shift=False``); RoPE positions
    are ``positions`` (checked by :func:`doc_ids_from_positions`) at the layout's tokens.

    Args:
        inputs: int ``[B, S]`` token ids (torchtitan's ``input_dict["input"]``).
        labels: int ``[B, S]`` next-token targets, or None.
        plans: this batch's :class:`Plans`.
        positions: the global positions (None: ``arange(S)`` per row, one document each).
        rank, group: this rank (or the group / mesh whose coordinate it is).
        ignore_index: the ignored label (torchtitan's is -100).

    Returns:
        a :class:`fringe.packing.Shard`: ``input_ids``, ``shift_labels``, ``position_ids``,
        ``num_items`` (targets in the global batch).
    """
    if not isinstance(plans, Plans):
        raise TypeError(f"{_WHERE}.shard_batch: plans must be fringe.titan.Plans, got "
                        f"{type(plans).__name__}")
    kw = {}
    if positions is not None:
        doc_ids_from_positions(positions)                       # the same rule as plans()
        kw["position_ids"] = positions
    return _packing.shard_batch(inputs, labels, plan=list(plans.plans), rank=rank, group=group,
                                shift=False, ignore_index=ignore_index, **kw)


def model_inputs(shard: _packing.Shard, plans: Plans, *, device=None) -> dict:
    """Arguments for the torchtitan model: ``tokens``, ``positions`` and ``attention_masks``
    (the plans, bound to the shard's batch after checking they describe it).

    Args:
        shard: from :func:`shard_batch`.
        plans: the :class:`Plans` it was sharded with.
        device: move ``tokens`` and ``positions`` there (the model's device); None: as they are.

    Raises:
        ValueError: the shard was cut by another layout, or from another batch (other
            documents, length or B) than the plans were made for.
    """
    if not isinstance(plans, Plans):
        raise TypeError(f"{_WHERE}.model_inputs: plans must be fringe.titan.Plans, got "
                        f"{type(plans).__name__}")
    if shard.layout_fingerprint != plans.layout_fingerprint:
        raise ValueError(f"{_WHERE}.model_inputs: the batch was sharded by layout "
                         f"{shard.layout_fingerprint} but the plans are for layout "
                         f"{plans.layout_fingerprint}; shard it with fringe.titan.shard_batch(..., plans)")
    _packing.check_batch(list(plans.plans), shard, where=f"{_WHERE}.model_inputs")
    tokens, positions = shard.input_ids, shard.position_ids
    if device is not None:
        tokens, positions = tokens.to(device), positions.to(device)
    digest = _packing._run_digest(shard, plans.plans[0], plans.group)
    bound = dataclasses.replace(
        plans, batch_fingerprint=shard.layout_fingerprint, positions=positions,
        batch_digest=None if digest is None else torch.tensor(digest, dtype=torch.int64))
    return dict(tokens=tokens, positions=positions, attention_masks=bound)
