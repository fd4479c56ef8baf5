"""Hypothesis profiles: ``ci`` (derandomized, modest) when env CI is set, ``dev`` otherwise."""
from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

from fringe.testing import warm_up_cpu_math

settings.register_profile("ci", deadline=None, derandomize=True, max_examples=25,
                          print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, max_examples=25,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci" if os.environ.get("CI") else "dev")

# torch 2.13 CPU: the first multi-threaded float64 exp in a process can be off by ~1e-9
# (see warm_up_cpu_math); absorb it before any exactness check runs.
warm_up_cpu_math()
