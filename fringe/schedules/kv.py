"""How the backward gets kv again: the kv memory policy of a plan.

The forward moves kv chunks between ranks; the backward needs them once more. A
:class:`KVPolicy` says where it gets them:

* ``KVPolicy.RESEND`` (``"resend"``, the default): a rank keeps only the kv it owns; the
  backward re-sends each chunk along the forward's path (O(L) kv memory per rank, the
  forward's traffic again).
* ``KVPolicy.KEEP`` (``"keep"``): a rank keeps every kv chunk it received in the forward;
  the backward moves only gradients (O(S) kv memory in the worst case, no re-send).

The members are strings (``KVPolicy.RESEND == "resend"``), so code and users passing the
plain strings keep working; :meth:`KVPolicy.parse` turns either into the member.

>>> KVPolicy.parse("keep")
<KVPolicy.KEEP: 'keep'>
>>> KVPolicy.RESEND == "resend"
True
"""
from __future__ import annotations

import enum

__all__ = ["KVPolicy"]


class KVPolicy(str, enum.Enum):
    """Where the backward gets kv: re-sent (``"resend"``) or kept from the forward
    (``"keep"``)."""

    RESEND = "resend"
    KEEP = "keep"

    def __str__(self) -> str:          # f"{policy}" prints "resend", as the string did
        return self.value

    @classmethod
    def parse(cls, value: KVPolicy | str) -> KVPolicy:
        """The member for ``value`` (a member or its string).

        Raises:
            ValueError: anything else, listing the valid values.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                return cls(value)
            except ValueError:
                pass
        valid = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"kv must be one of {valid} (or fringe.KVPolicy.RESEND / .KEEP), "
                         f"got {value!r}")
