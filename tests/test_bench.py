"""The benchmark runs end to end on tiny sizes (its figures are not asserted: no timing tests)."""
from __future__ import annotations

from fringe.bench import AttnCase, packed_docs, run


def test_packed_docs_are_sorted_and_counted():
    ids = packed_docs(1000, 7, seed=0)
    assert ids.numel() == 1000 and int(ids.max()) == 6
    assert bool((ids[1:] >= ids[:-1]).all())


def test_bench_report_has_every_row_and_a_target_column():
    text = run(world_sizes=(2,), plan_size=4096,
               case=AttnCase(seq_len=512, heads=2, kv_heads=1, head_dim=16, n_docs=4,
                             block_size=32, iters=1))
    for row in ("ring", "zigzag", "striped", "1 process, dense SDPA", "1 process, fringe",
                "2 gloo ranks, fringe"):
        assert row in text, text
    assert "target" in text and ("ok" in text or "MISS" in text)
