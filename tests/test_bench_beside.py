"""attngen/bench.py time_beside without a GPU: the calls are timed in turn, round after round, each
time the median of its runs; a call that raises is reported, not timed."""

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
    times, errors = bench.time_beside({"a": a, "broken": broken, "b": b}, [()], rounds=3, repeats=4, warmup=2)
    assert list(errors) == ["broken"] and isinstance(errors["broken"], RuntimeError)
    assert order[:2] == [("a", 2, 1), ("b", 2, 1)]  # warm-ups, then the rounds alternate
    assert [name for name, _, _ in order[2:]] == ["a", "b"] * 3
    assert all(repeats == 4 and warmup == 0 for _, warmup, repeats in order[2:])
    # a's runs read clocks 2, 4, 6 and b's 3, 5, 7: medians 4 and 5.
    assert times == {"a": 4.0, "b": 5.0}
