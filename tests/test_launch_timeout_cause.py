"""A call that times out because a peer waits for a rank that already raised must name
that rank's exception (the root cause), not only the waiting ranks.

(With the default ``peer_grace_s`` the waiting peer is stopped long before the call's
timeout: tests/test_launch.py. A grace longer than the timeout keeps this path reachable.)"""
from __future__ import annotations

import time

import pytest

from fringe import launch
from fringe.launch import LaunchError, Workers


def raise_or_wait(rank, world_size):
    if rank == 1:
        raise ValueError("rank 1 fails mid-step")
    time.sleep(60)          # a peer blocked in a collective the failed rank never joins
    return rank


def test_timeout_names_the_rank_that_raised(monkeypatch):
    with pytest.raises(LaunchError) as info:
        with Workers(2, timeout_s=15, threads=1, peer_grace_s=600) as w:
            # the short slack for the call only: joining (spawn, torch import) takes longer
            # than 15 + 1 s on a loaded machine
            monkeypatch.setattr(launch, "_COLLECT_SLACK_S", 1.0)
            w.run(raise_or_wait)
    msg = str(info.value)
    assert "ranks [0] did not answer" in msg, msg
    assert "rank 1 raised ValueError: rank 1 fails mid-step" in msg, msg
