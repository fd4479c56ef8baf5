"""The speed-ups of the op-by-op passes and of the plan's block map change no plan.

The digests below are of the forward and backward programs' ASCII text as planned at commit
e60faf3, before the passes' fast paths (reverse, prune, check) and the tile-boundary cut of
``fringe.plan`` were written; every plan here must still hash to them. P=16, S=4096, block 16.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest
import torch

from fringe import masks, schedules
from fringe.testing import packed_docs
from fringe.plan import _classify_layout, _cut_at_tiles, plan as make_plan

P, S, BLOCK = 16, 4096, 16

#: (schedule, mask, kv) -> sha1 of the programs' text, recorded before the speed-ups.
BEFORE = {
    ("striped", "causal", "resend"): "4adb9a6015a15d78e28f0da1512783901ff42125",
    ("striped", "causal", "keep"): "83135d1675e72d494d90796655c235ee40f1e582",
    ("allgather", "causal", "resend"): "51af6149770be7a4ae9bd63fe4676f30e8ecbf81",
    ("allgather", "causal", "keep"): "783101c0c36db3a69ccad31b1e7f494d73a27686",
    ("allgather:3", "causal", "resend"): "8db31499e645351863c5a7d161522dafb1446ec2",
    ("allgather:3", "causal", "keep"): "520dd7728dc76acabd71ab22a9336f4c18d72c37",
    ("ulysses", "causal", "resend"): "fd7d5c1d127fb31e4a2d099c50bd8b57fba97cc5",
    ("ulysses", "causal", "keep"): "d123344102ac6d26dc44c7d40578d340c5a5b51f",
    ("compose:zigzag+ulysses:2", "causal", "resend"): "337c9cd09128833dc07e7c07dddd6cb5c0dbe0d5",
    ("compose:zigzag+ulysses:2", "causal", "keep"): "5a921ae8893d6bcf360c21917d2138cae59a6426",
    ("compose:zigzag+allgather:2:2", "causal", "resend"): "d71d92fc9154b835593a7a5045cf10161f0aee5b",
    ("compose:zigzag+allgather:2:2", "causal", "keep"): "ae7bbe698f11d05a618644c3a300dfd0ae18e209",
    ("compose:zigzag+ring:2", "causal", "resend"): "11481f7026e8a2c6eee1b6e5cd2ff9d80c729a9d",
    ("compose:zigzag+ring:2", "causal", "keep"): "e25fe86f9357bb294753cdf7177ffba2c1501336",
    ("striped", "doc", "resend"): "4adb9a6015a15d78e28f0da1512783901ff42125",
    ("striped", "doc", "keep"): "83135d1675e72d494d90796655c235ee40f1e582",
    ("allgather", "doc", "resend"): "2ad00762e6f0fcb1330f6332748eb8b82ccac293",
    ("allgather", "doc", "keep"): "e478ea0514562511b42e7c1be796d7a4b877a853",
    ("allgather:3", "doc", "resend"): "bf852cdf7ee11c167ce771a2f9e20750a037ce1b",
    ("allgather:3", "doc", "keep"): "91882d73e835bc31e6065f32eb12fe50b819955c",
    ("ulysses", "doc", "resend"): "cca4964c551748c0350b2b0d48fcf74349b5b5e4",
    ("ulysses", "doc", "keep"): "8ee12bdccdb0b56be82d5d5cee43c08c32900ff9",
    ("compose:zigzag+ulysses:2", "doc", "resend"): "8f45bfdf4dc809642341caccd152ea5c69aa514c",
    ("compose:zigzag+ulysses:2", "doc", "keep"): "5569b0b2aa9161a4a8d4d271896b39b1b7a6fc99",
    ("compose:zigzag+allgather:2:2", "doc", "resend"): "a6e04220a9cfad791c720efafc4fdaac066ea261",
    ("compose:zigzag+allgather:2:2", "doc", "keep"): "97af7280732515c1a3302e3bd6734bdde5408cf3",
    ("compose:zigzag+ring:2", "doc", "resend"): "eed2c58c3bf37e33e07826120af2ef32dc4c1c94",
    ("compose:zigzag+ring:2", "doc", "keep"): "207c2ca27708a6388d4b4b5f97d147c06b1c3391",
    ("striped", "window", "resend"): "4adb9a6015a15d78e28f0da1512783901ff42125",
    ("striped", "window", "keep"): "83135d1675e72d494d90796655c235ee40f1e582",
    ("allgather", "window", "resend"): "1bf1ef35567a861006194b6f444ed53badb10ac7",
    ("allgather", "window", "keep"): "22cd71f022eb2b02b24e9f6c120739bb284f273f",
    ("allgather:3", "window", "resend"): "be48fe10048008e1cad410d62667e3da0519f4e0",
    ("allgather:3", "window", "keep"): "336b36eede6b78237d614568f5591c093bfeb862",
    ("ulysses", "window", "resend"): "4b7da6a778fabbac3cebbadc69543d611f0e2162",
    ("ulysses", "window", "keep"): "8289a61fcf22a873f25d0d79e862d32f16af6d5c",
    ("compose:zigzag+ulysses:2", "window", "resend"): "cea858b26903f33b7aa6a7c1eb19f14a0c8f79ff",
    ("compose:zigzag+ulysses:2", "window", "keep"): "7b3f46a74b0ba652cc40c6fbf0bc3409bf97bd55",
    ("compose:zigzag+allgather:2:2", "window", "resend"): "dce6cfc5881e44119ccc4268bb2f6eb6c07ba2d1",
    ("compose:zigzag+allgather:2:2", "window", "keep"): "2db9dfb7a51fa73a41d206a456e43a914d0df721",
    ("compose:zigzag+ring:2", "window", "resend"): "d1bbe0450065c7a13da9c97a9fb999a3b3f90bde",
    ("compose:zigzag+ring:2", "window", "keep"): "b3141aa3d3511a1a842d6c0032d53b7651a49fb7",
}


def _mask(name: str):
    return {"causal": masks.causal(),
            "doc": masks.causal() & masks.document(packed_docs(S, 5, 1)),
            "window": masks.sliding_window(3 * S // P)}[name]


def _digest(p) -> str:
    text = "\n".join(x.ascii() for x in p.forward) + "--" + "\n".join(x.ascii() for x in p.backward)
    return hashlib.sha1(text.encode()).hexdigest()


@pytest.mark.parametrize("spec", sorted({k[0] for k in BEFORE}))
def test_programs_are_those_planned_before_the_fast_paths(spec):
    for (s, mname, kv), want in BEFORE.items():
        if s != spec:
            continue
        p = make_plan(schedules.get(spec), _mask(mname), seq_len=S, world_size=P,
                      block_size=BLOCK, kv=kv, ranges=False)    # whole chunks, as then
        assert _digest(p) == want, (spec, mname, kv)


def test_programs_do_not_depend_on_the_string_hash_seed():
    """Buffers that sort alike (head slices of one chunk) keep program order, not set order:
    two processes with different hash seeds plan the same programs, and the plan fingerprint
    (its digest of the general table's columns) is the same (else ranks disagree)."""
    code = ("import hashlib, torch; from fringe import masks, schedules, plan; "
            "p = plan(schedules.get('compose:zigzag+ulysses:2'), masks.causal(), seq_len=512, "
            "world_size=8, block_size=16); print(hashlib.sha1(('\\n'.join(x.ascii() for x in "
            "p.forward + p.backward)).encode()).hexdigest() + p.digests()['programs'])")
    here = {}
    exec(code.replace("print(", "here['digest'] = ("), {"here": here})
    seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"    # not this process's
    res = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONHASHSEED=seed),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip() == here["digest"]


@pytest.mark.parametrize("spec,mname", [("striped", "causal"), ("striped", "doc"),
                                        ("zigzag", "causal"), ("ring", "window")])
def test_tile_cut_returns_what_the_identity_permute_builds(spec, mname):
    """``_cut_at_tiles`` skips the identity permute only when no rectangle crosses a tile;
    the map is then the permute's, rectangle for rectangle and in the same order."""
    lay = schedules.get(spec).make_layout(S, P, block_size=BLOCK)
    m = masks.snapshot(_mask(mname))
    bm = masks.classify(m, lay.order, lay.order, block_size=BLOCK, sparse=True)
    n = lay.local_len // BLOCK
    same = torch.arange(bm.shape[0])
    want = bm.permute(same, same, cut=n)
    got = _cut_at_tiles(bm, n)
    assert torch.equal(got.rects, want.rects) and torch.equal(got.codes, want.codes)
    # and the plan's own map (permuted from sequence order where that is cheap) is the same
    # classification
    planned = _classify_layout(m, lay, BLOCK, B=None, H=None, natural=None)
    assert torch.equal(planned.dense(limit=None), want.dense(limit=None))


def test_tile_cut_cuts_rectangles_that_cross_a_tile():
    """A map whose rectangles cross tile boundaries is cut (not returned as it is)."""
    bm = masks.classify(masks.causal(), torch.arange(96), torch.arange(96), block_size=8,
                        sparse=True)          # 12 x 12 blocks, FULL squares of 2^k blocks
    n = 3                                     # tiles of 3 blocks: squares of 4 cross them
    got = _cut_at_tiles(bm, n)
    assert len(got) > len(bm)
    r = got.rects
    assert bool(((r[:, 0] // n) == ((r[:, 1] - 1) // n)).all())
    assert bool(((r[:, 2] // n) == ((r[:, 3] - 1) // n)).all())
    assert torch.equal(got.dense(limit=None), bm.dense(limit=None))
