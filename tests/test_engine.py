"""The timing helpers of tvm_fusion.build.engine (no TVM compile: fake runs record their order) and
the one-line error messages taken from TVM's exceptions."""

import time

import pytest

from tvm_fusion.build import engine
from tvm_fusion.errors import first_line


def _recorder(log: list, name: str, seconds: float = 0.0):
    def run():
        log.append(name)
        if seconds:
            time.sleep(seconds)

    return run


def test_interleaved_alternates_engines_in_rounds():
    log: list = []
    runs = {"a": _recorder(log, "a"), "b": _recorder(log, "b")}
    timings = engine.time_interleaved(runs, repeat=10, budget_s=10.0, pause_s=0.0, rounds=5)
    assert {k: t["runs"] for k, t in timings.items()} == {"a": 10, "b": 10}
    # warm-up 3 times each, then blocks of at most repeat / rounds = 2 timed runs (+ 1 warm
    # call each, the runs being short): a's and b's blocks alternate, b is not all timed after a.
    assert log[:6] == ["a"] * 3 + ["b"] * 3
    blocks = []
    for name in log[6:]:
        if not blocks or blocks[-1][0] != name:
            blocks.append([name, 0])
        blocks[-1][1] += 1
    assert [b[0] for b in blocks] == ["a", "b"] * 5
    assert all(b[1] == 3 for b in blocks)  # the warm call and 2 timed runs
    assert all(t["min_ms"] <= t["median_ms"] for t in timings.values())


def test_interleaved_long_runs_one_per_block_and_budget():
    log: list = []
    runs = {"slow": _recorder(log, "slow", 0.06), "fast": _recorder(log, "fast")}
    timings = engine.time_interleaved(
        runs, repeat=10, budget_s=0.15, pause_s=0.0, rounds=5, warm_s=0.05
    )
    # the slow engine stops at its budget once it has 3 runs; no untimed warm call for it (its
    # runs are over warm_s): its first call after each pause is a timed one
    assert timings["slow"]["runs"] == 3
    assert timings["fast"]["runs"] == 10
    assert log.count("slow") == 1 + 3
    assert timings["slow"]["median_ms"] >= 60.0
    assert timings["slow"]["first_call_ms"] >= 60.0
    # the slow engine's runs are spread between the fast engine's blocks
    timed = log[2:]
    first_fast, last_fast = timed.index("fast"), len(timed) - 1 - timed[::-1].index("fast")
    assert any(first_fast < i < last_fast for i, n in enumerate(timed) if n == "slow")


def test_interleaved_warms_each_block_and_keeps_first_calls_apart():
    """An engine whose first call after another engine's is slow (60 ms, then 20 ms): its
    medians are of the warm calls, ``first_call_ms`` is the slow first call; under ``warm_s``
    every block (one run each, the runs being over ``block_s``) starts with the warm call."""
    log: list = []

    def engine_run(name):
        def run():
            time.sleep(0.02 if log and log[-1] == name else 0.06)
            log.append(name)

        return run

    runs = {"a": engine_run("a"), "b": engine_run("b")}
    timings = engine.time_interleaved(runs, repeat=4, budget_s=10.0, pause_s=0.0, rounds=4)
    for name in runs:
        assert timings[name]["runs"] == 4
        assert 19.0 <= timings[name]["median_ms"] < 40.0, timings[name]
        assert timings[name]["first_call_ms"] >= 59.0, timings[name]
        # the estimate (3 calls), then a warm and a timed call each
        assert log.count(name) == 3 + 4 * 2


def test_interleaved_no_engines():
    assert engine.time_interleaved({}) == {}


def test_interleaved_min_time_raises_repeat_for_short_runs():
    """``min_time_s``: a 2 ms engine gets about 60 ms of timed runs instead of ``repeat`` = 3;
    a 30 ms engine keeps ``repeat`` (2 runs would make 60 ms, fewer than 3)."""
    log: list = []
    runs = {"short": _recorder(log, "short", 0.002), "long": _recorder(log, "long", 0.03)}
    timings = engine.time_interleaved(runs, repeat=3, budget_s=10.0, pause_s=0.0, min_time_s=0.06)
    assert 12 <= timings["short"]["runs"] <= 30, timings["short"]
    assert timings["long"]["runs"] == 3
    plain = engine.time_interleaved(runs, repeat=3, budget_s=10.0, pause_s=0.0)
    assert plain["short"]["runs"] == 3


def test_interleaved_sizes_blocks_by_the_fastest_warm_up_call():
    """A first call 25x slower than the rest (a model's first call in a process) does not size
    the samples: with ``min_time_s`` = 0.2 s of 2 ms runs, about 100 runs are timed, not the 4
    that a 50 ms estimate would give."""
    log: list = []

    def run():
        time.sleep(0.05 if not log else 0.002)
        log.append("a")

    timings = engine.time_interleaved(
        {"a": run}, repeat=3, budget_s=10.0, pause_s=0.0, min_time_s=0.2
    )
    assert 60 <= timings["a"]["runs"] <= 100, timings["a"]


@pytest.mark.parametrize(
    "text, line",
    [
        ("Traceback (most recent call last):\n  File x.py\nValueError: bad", "ValueError: bad"),
        ("[bt] (0) libtvm.so\nCheck failed: a == b", "Check failed: a == b"),
        (
            "CodeGenVM cannot emit this Relax operator directly.\nOffending call:\nR.add(x, y)",
            "CodeGenVM cannot emit this Relax operator directly. Offending call: R.add(x, y)",
        ),
        ("File a.py\nlabel:\nvalue", "label: value"),
        ("", "RuntimeError"),
        (
            'ir.Op(span=None, ty=ir.Type(span=None), name="relax.log", arguments=(ir.A(name="x"'
            "),), support_level=10) requires the input tensor to have float dtype.",
            "relax.log requires the input tensor to have float dtype.",
        ),
        ("ir.Op(unclosed", "ir.Op(unclosed"),
    ],
)
def test_first_line_keeps_a_labelled_detail_with_its_sentence(text, line):
    assert first_line(RuntimeError(text)) == line
