"""attngen/bench.py time_beside without a GPU: the calls are timed in turn, round after round, the order
reversed every other round, each time the median of its runs; a call that raises is reported, not timed."""

from __future__ import annotations

import attngen.bench as bench


def test_calls_are_timed_in_turn_and_a_failing_one_is_reported(monkeypatch):
    order = []
    clock = iter(range(1000))

    def fake_time_ms(fn, input_sets, warmup=5, repeats=30):
        fn(*input_sets[0])
        order.append((fn.__name__, warmup, repeats))
        return float(next(clock))

    def a():
        pass

    def b():
        pass

    def broken():
        raise RuntimeError("no cuDNN here")

    monkeypatch.setattr(bench, "time_ms", fake_time_ms)
    times, errors = bench.time_beside({"a": a, "broken": broken, "b": b}, [()], rounds=4, repeats=4, warmup=2)
    assert list(errors) == ["broken"] and isinstance(errors["broken"], RuntimeError)
    assert order[:2] == [("a", 2, 1), ("b", 2, 1)]  # warm-ups, then the rounds, every other one reversed
    assert [name for name, _, _ in order[2:]] == ["a", "b", "b", "a"] * 2
    assert all(repeats == 4 and warmup == 0 for _, warmup, repeats in order[2:])
    # A clock that rises by one every run: a's runs read 2, 5, 6, 9 and b's 3, 4, 7, 8, both medians 5.5
    # (in the same order every round they would read 4.5 and 6.5: the drift credited to a).
    assert times == {"a": 5.5, "b": 5.5}


def test_the_clock_is_settled_by_calls_for_the_seconds_asked(monkeypatch):
    import time

    import torch

    now = iter(x * 0.25 for x in range(100))  # each reading a quarter second on
    synced = []
    monkeypatch.setattr(time, "perf_counter", lambda: next(now))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: synced.append(1))
    calls = []
    made = bench.settle_clock(lambda: calls.append(1), seconds=1.0)
    # Start at 0; checks at 0.25, 0.5, 0.75 go on, 1.0 stops: three batches of 8, each synchronized.
    assert made == len(calls) == 24 and len(synced) == 3
