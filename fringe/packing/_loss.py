"""Labels and loss: next-token targets shifted on the global sequence, and the token-weighted
loss under context parallelism."""
from __future__ import annotations

import torch

from ._common import IGNORE_INDEX, _int_tensor


def shift_labels(labels: torch.Tensor, doc_ids: torch.Tensor | None = None, *,
                 ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets on the GLOBAL sequence: ``out[:, i] = labels[:, i+1]``.

    A target that crosses a document boundary (token i is the last of its document) and the
    last position become ``ignore_index``. Shift BEFORE sharding: a rank's last token's
    target lives on another rank (or, under zigzag, in another chunk).

    Args:
        labels: int ``[B, S]`` (or ``[S]``), ``ignore_index`` where there is no target.
        doc_ids: ``[S]`` or ``[B, S]`` document ids (None: one document).
        ignore_index: the ignored label.

    Returns:
        int64, the shape of ``labels``.
    """
    lab = _int_tensor(labels, "labels")
    one = lab.dim() == 1
    lab2 = lab.view(1, -1) if one else lab
    if lab2.dim() != 2:
        raise ValueError(f"labels must be [B, S] or [S], got shape {tuple(lab.shape)}")
    out = torch.full_like(lab2, ignore_index)
    out[:, :-1] = lab2[:, 1:]
    if doc_ids is not None:
        ids = _int_tensor(doc_ids, "doc_ids").to(lab2.device)
        if ids.shape[-1] != lab2.shape[-1]:
            raise ValueError(f"doc_ids has {ids.shape[-1]} tokens but labels have {lab2.shape[-1]}")
        ids = ids.view(-1, ids.shape[-1]).expand(lab2.shape[0], -1)
        cross = ids[:, 1:] != ids[:, :-1]
        out[:, :-1] = torch.where(cross, torch.full_like(out[:, :-1], ignore_index), out[:, :-1])
    return out.view(lab.shape)


def loss_sum(logits: torch.Tensor, targets: torch.Tensor, *,
             ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of token cross-entropies (fp32), ignored targets contribute 0.

    Args:
        logits: ``[..., V]``; targets: int ``[...]``.
    """
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1).to(logits.device),
                                             ignore_index=ignore_index, reduction="sum")


def global_token_count(local_targets: torch.Tensor, *, group=None,
                       ignore_index: int = IGNORE_INDEX) -> int:
    """Non-ignored targets over every rank of ``group`` (one all-reduce).

    :func:`shard_batch` already knows the count from the global batch (``Shard.num_items``);
    use this when each rank only ever sees its own shard.
    """
    import torch.distributed as dist
    n = (local_targets != ignore_index).sum().to(torch.float64).reshape(1)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(n, group=group)
    return int(n.item())


def token_weighted_loss(logits: torch.Tensor, targets: torch.Tensor, *, num_items: int,
                        ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """This rank's share of the global mean loss under context parallelism.

    ``loss_r = sum of rank r's token losses / N``, where ``N`` is the number of non-ignored
    targets in the GLOBAL batch (all CP ranks together). Why: ranks hold different numbers
    of real targets (document boundaries, padding), so the mean of per-rank means is not the
    mean over tokens; the shares ``loss_r`` add up to exactly the one-process loss.

    The condition that makes it right: the CP ranks' gradients must then be **summed**
    (``all_reduce(SUM)``), not averaged as DDP does — every rank's gradient is already its
    share of the global one. With FSDP2 or DDP on a (dp, cp) mesh, let
    :class:`fringe.train.GradSync` do the reduction and the scaling (it sets FSDP's divide
    factor, or scales the loss for DDP's mean, and counts tokens over every replica and
    microbatch); do not hand-write it. The reported loss is ``all_reduce(SUM)`` of the shares
    (``GradSync.step(...).loss()``).

    Args:
        logits: ``[B, L, V]`` this rank's logits; targets: ``[B, L]`` this rank's
            pre-shifted targets (``Shard.shift_labels``).
        num_items: N, e.g. ``Shard.num_items`` or :func:`global_token_count`.
    """
    if num_items < 1:
        raise ValueError(f"num_items={num_items}: the global batch has no target to learn from "
                         f"(every label is {ignore_index})")
    return loss_sum(logits, targets, ignore_index=ignore_index) / num_items
