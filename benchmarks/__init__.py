"""Benchmarks that compare fringe with other systems (outside the package; never tests)."""
