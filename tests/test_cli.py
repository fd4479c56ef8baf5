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
    (["demo", "--timeout", "-1"], "argument --timeout: expected a positive number of seconds up "
                                  "to 1,000,000 (11.6 days), got -1"),
    (["demo", "--timeout", "inf"], "argument --timeout: expected a positive number of seconds up "
                                   "to 1,000,000 (11.6 days), got inf"),
    (["demo", "--lr", "nan"], "argument --lr: expected a positive number up to 1, got nan"),
    (["demo", "--lr", "fast"], "argument --lr: expected a positive number up to 1, got 'fast'"),
    (["demo", "--steps", "0"], "argument --steps: expected a positive integer"),
    (["demo", "--batch-size", "-2"], "argument --batch-size: expected a positive integer"),
    (["demo", "--layers", "0"], "argument --layers: expected a positive integer"),
    (["demo", "--world-size", "0"], "argument --world-size: expected a positive integer"),
    (["demo", "--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    # issue 17: values that reached a traceback (float32 overflow, a C int, int64 products)
    (["demo", "--lr", "1e300"], "argument --lr: expected a positive number up to 1, got 1e300"),
    (["demo", "--lr", "2"], "argument --lr: expected a positive number up to 1, got 2"),
    (["demo", "--timeout", "1e300"], "argument --timeout: expected a positive number of seconds "
                                     "up to 1,000,000 (11.6 days), got 1e300"),
    (["demo", "--layers", str(1 << 40)], "argument --layers: expected a positive integer up to 1024"),
    (["predict", "--heads", str(1 << 40)], "argument --heads: expected a positive integer up to 4096"),
    (["predict", "--kv-heads", "5000"], "argument --kv-heads: expected a positive integer up to 4096"),
    (["predict", "--head-dim", str(1 << 40)], "argument --head-dim: expected a positive integer up "
                                              "to 4096"),
    (["predict", "--max-memory", "4Q"], "argument --max-memory: expected a memory size such as 4G, "
                                        "512M or 1.5GiB, got '4Q'"),
    (["show", "--max-memory", "0"], "argument --max-memory: expected a memory size"),
    (["bench", "--max-memory", "0.5"], "argument --max-memory: expected a memory size"),
    (["show", "--png", "/no/such/dir/grid.png"], "argument --png: the directory of "
                                                 "'/no/such/dir/grid.png' does not exist: create "
                                                 "it first (mkdir -p /no/such/dir)"),
    (["predict", "--png", "/no/such/dir/t.png"], "argument --png: the directory of "
                                                 "'/no/such/dir/t.png' does not exist"),
    (["predict", "--png", "timeline.svg"], "argument --png: give a file name ending in .png, got "
                                           "'timeline.svg'"),
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


def test_png_into_a_missing_directory_fails_before_any_work(tmp_path, capsys):
    """Issue 17: ``--png`` into a directory that does not exist was a FileNotFoundError
    traceback after the plan and prediction were made."""
    missing = tmp_path / "nope" / "grid.png"
    for argv in (["show", "--seq-len", "256", "--world-size", "2", "--png", str(missing)],
                 ["predict", "--world-size", "8", "--seq-len", "65536", "--schedules", "zigzag",
                  "--png", str(missing)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if "error:" in line]
        assert len(lines) == 1 and "does not exist: create it first" in lines[0], err
        assert "Traceback" not in err and out == "" and not missing.parent.exists()


def test_a_window_wider_than_any_int64_is_the_same_mask_as_the_sequence(capsys):
    argv = ["predict", "--world-size", "8", "--seq-len", "65536", "--schedules", "zigzag"]
    assert main([*argv, "--mask", "window:" + "9" * 20]) == 0
    wide = capsys.readouterr().out.splitlines()[3].split()[:4]
    assert main([*argv, "--mask", "window:65536"]) == 0
    assert capsys.readouterr().out.splitlines()[3].split()[:4] == wide


@pytest.mark.parametrize("error,said", [
    (MemoryError("Unable to allocate 7.50 GiB for an array with shape (1, 2)"),
     "error: Unable to allocate 7.50 GiB for an array with shape (1, 2); use a smaller --seq-len "
     "or a larger --block-size"),
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't "
                  "allocate memory: you tried to allocate 8796093022208 bytes."),
     "error: out of memory: [enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: "
     "can't allocate memory: you tried to allocate 8796093022208 bytes.; use a smaller"),
    (OverflowError("Python int too large to convert to C long"),
     "error: a value is too large (Python int too large to convert to C long); use a smaller"),
])
def test_an_allocation_or_overflow_the_checks_missed_is_one_error_line(monkeypatch, capsys,
                                                                      error, said):
    """The class behind the absurd sizes: whatever a size argument makes the allocator refuse
    (or overflow) ends in one ``error:`` line naming the fix and exit 2, never a traceback."""
    from fringe.cost import cli as cost_cli

    def refuse(args):
        raise error

    monkeypatch.setattr(cost_cli, "cli", refuse)
    assert main(["predict", "--world-size", "8", "--seq-len", "65536"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(said) and err.count("\n") == 1, err


def test_an_unrelated_runtime_error_is_not_disguised(monkeypatch):
    from fringe.cost import cli as cost_cli

    def broken(args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(cost_cli, "cli", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["predict", "--world-size", "8", "--seq-len", "65536"])


def test_demo_sizes_the_allocator_refuses_end_in_one_error_line(capsys):
    assert main(["demo", "--seq-len", str(1 << 40), "--world-size", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("error: out of memory:"), err
    assert "use a smaller --seq-len" in lines[0] and "Traceback" not in err


def test_demo_config_refuses_a_learning_rate_past_its_bound():
    from fringe.demo import DemoConfig

    for lr in (1e300, 2.0, float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="lr=.* must be positive and at most 1"):
            DemoConfig(lr=lr)


def test_png_that_names_a_directory_or_cannot_be_written_is_one_error_line(tmp_path, capsys):
    """The same class as a missing directory: a --png that is itself a directory, or a file
    matplotlib cannot write, ends in one ``error:`` line, exit 2, not an OSError traceback."""
    folder = tmp_path / "maps.png"
    folder.mkdir()
    assert main(["show", "--seq-len", "256", "--world-size", "2", "--png", str(folder)]) == 2
    err = capsys.readouterr().err
    assert f"argument --png: {str(folder)!r} is a directory" in err and "Traceback" not in err
    from fringe import render

    class Refuses:
        def savefig(self, path, dpi):
            raise PermissionError(13, "Permission denied")

    with pytest.raises(ValueError, match=r"could not write 'x.png' \(Permission denied\); give "
                                         r"--png a file in a directory that exists"):
        render.save_png(Refuses(), "x.png")


def test_the_largest_seed_and_an_unbounded_window_run(capsys):
    """Values the parser accepts run: the largest seed (it overflowed deriving a batch's seed)
    and a window past int64 (it is the same mask as a window of S)."""
    assert main(["show", "--seed", str(2 ** 63 - 1)]) == 0
    capsys.readouterr()
    base = ["show", "--mask", "sliding_window", "--seq-len", "512", "--world-size", "2"]
    assert main([*base, "--window", "9" * 20]) == 0
    wide = capsys.readouterr()
    assert main([*base, "--window", "512"]) == 0
    assert capsys.readouterr().out == wide.out and "error" not in wide.err
