"""Every CLI argument is validated where it is parsed: a bad one ends with exit status 2 and a
message saying what was expected, never a traceback; every option has help."""
from __future__ import annotations

import argparse

import pytest

from fringe.__main__ import main, parser

BAD = [
    (["show", "--seq-len", "0"], "argument --seq-len: expected a positive integer (1, 2, ...), got 0"),
    (["show", "--world-size", "abc"], "argument --world-size: expected a positive integer (1, 2, ...), "
                                      "got 'abc'"),
    (["show", "--block-size", "-64"], "argument --block-size: expected a positive integer"),
    (["show", "--window", "0"], "argument --window: expected a positive integer"),
    (["show", "--seed", "-1"], "argument --seed: expected a non-negative integer"),
    (["bench", "--plan-size", "-5"], "argument --plan-size: expected a positive integer (1, 2, ...), "
                                     "got -5"),
    (["bench", "--iters", "0"], "argument --iters: expected a positive integer (1, 2, ...), got 0"),
    (["bench", "--world-sizes", "2", "0"], "argument --world-sizes: expected a positive integer"),
    (["bench", "--seq-len", "1.5"], "argument --seq-len: expected a positive integer (1, 2, ...), "
                                    "got '1.5'"),
    (["demo", "--timeout", "-1"], "argument --timeout: expected a positive, finite number, got -1"),
    (["demo", "--timeout", "inf"], "argument --timeout: expected a positive, finite number, got inf"),
    (["demo", "--lr", "nan"], "argument --lr: expected a positive, finite number, got nan"),
    (["demo", "--lr", "fast"], "argument --lr: expected a positive, finite number, got 'fast'"),
    (["demo", "--steps", "0"], "argument --steps: expected a positive integer"),
    (["demo", "--batch-size", "-2"], "argument --batch-size: expected a positive integer"),
    (["demo", "--layers", "0"], "argument --layers: expected a positive integer"),
    (["demo", "--world-size", "0"], "argument --world-size: expected a positive integer"),
    (["demo", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
]


@pytest.mark.parametrize("argv,message", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_argument_exits_2_saying_what_was_expected(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert "Traceback" not in err and err.startswith("usage: python -m fringe " + argv[0])


SIZES = [
    (["show", "--world-size", "2", "--seq-len", "100", "--block-size", "32"],
     "error: S=100 is not divisible by 2*P*block=2*2*32=128"),
    (["bench", "--plan-size", "100"],
     "error: plan_size=100 is not a positive multiple of 2*P*block=2*1024*128=262144"),
    (["bench", "--seq-len", "1000", "--plan-size", "262144"],
     "error: seq_len=1000 is not divisible by 2*P*block=2*1*128=256; use 1024"),
]


@pytest.mark.parametrize("argv,message", SIZES, ids=[" ".join(a) for a, _ in SIZES])
def test_sizes_that_do_not_fit_exit_2_with_the_fix(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message), err
    assert "Traceback" not in err


def _options():
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    for command, p in sub.choices.items():
        for action in p._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                yield command, action


def test_every_option_has_help_and_no_numeric_option_is_unchecked():
    options = list(_options())
    assert {c for c, _ in options} >= {"demo", "show", "bench"}
    for command, action in options:
        name = f"{command} {action.option_strings[0]}"
        assert action.help and action.help.strip() and action.help != argparse.SUPPRESS, \
            f"{name} has no help"
        # a bare int/float accepts 0, negatives, inf and nan: use the checked types
        assert action.type not in (int, float), f"{name} uses type={action.type.__name__}"


def test_help_exits_0_and_documents_each_bench_option(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    for option in ("--seq-len", "--world-sizes", "--schedule", "--iters", "--plan-size"):
        assert option in out
    assert "timed repetitions" in out and "planning benchmark" in out
