"""The kernel protocol and registry: :func:`get_kernel` (imported by :mod:`fringe.ops.tile`;
the package ``__init__`` re-exports it, so there is no import cycle inside ``ops``)."""
from __future__ import annotations

from typing import Protocol

import torch

from ._fast import SDPA
from .flex import FLEX
from .reference import REFERENCE


class Kernel(Protocol):
    """One dense sub-problem's forward and backward (see :mod:`fringe.ops`).

    A kernel with ``wants_blocks = True`` takes the whole tile instead, with ``blocks``,
    ``block_size`` and ``mask_mod`` in place of ``mask`` (see :mod:`fringe.ops.flex`).
    """

    name: str

    def available(self, device: torch.device | str | None = None) -> tuple[bool, str]: ...

    def forward(self, q, k, v, *, q_pos, kv_pos, mask=None, score_mod=None, scale): ...

    def backward(self, q, k, v, out, lse, dout, *, q_pos, kv_pos, mask=None, score_mod=None,
                 scale, dlse=None, score_params=()): ...


KERNELS: dict[str, Kernel] = {"reference": REFERENCE, "sdpa": SDPA, "flex": FLEX}


def get_kernel(name: str | Kernel | None = None, *, score_mod=None,
               device: torch.device | str | None = None) -> Kernel:
    """Look up a kernel by name, or choose one when ``name`` is None.

    The automatic choice is ``sdpa`` when it is available on ``device`` and there is no
    score_mod, else ``reference`` (``flex`` is chosen by name only). A kernel object is
    returned as is.

    Raises:
        KeyError: for an unknown name, listing the known ones.
    """
    if name is None:
        if score_mod is None and SDPA.available(device)[0]:
            return SDPA
        return REFERENCE
    if not isinstance(name, str):
        return name
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"unknown kernel {name!r}; choose one of {sorted(KERNELS)}") from None
