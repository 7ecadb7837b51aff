"""The benchmarks' timing methods (`experiments/_timing.py`) on a simulated clock: a call that costs `per_call` and
a wait that costs a fixed `per_queue` once. "marginal" must return the per-call cost alone, "pipelined" the cost
with the fixed part spread over the queue, "each" the cost of a call plus a wait."""

import os
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "experiments"))

import _timing  # noqa: E402


class SimulatedClock:
    def __init__(self, per_call, per_queue):
        self.now, self.per_call, self.per_queue = 0.0, per_call, per_queue

    def perf_counter(self):
        return self.now

    def call(self):
        self.now += self.per_call
        return object()

    def wait(self, outs):
        self.now += self.per_queue
        return outs


@pytest.fixture
def clock(monkeypatch):
    clock = SimulatedClock(per_call=2e-3, per_queue=7e-3)  # seconds
    monkeypatch.setattr(_timing.time, "perf_counter", clock.perf_counter)
    monkeypatch.setattr(_timing.jax, "block_until_ready", clock.wait)
    return clock


@pytest.mark.parametrize("iters", [1, 10, 37])
def test_marginal_leaves_out_the_queue_cost(clock, iters):
    assert _timing.time_ms(clock.call, iters=iters, method="marginal") == pytest.approx(2.0)
    assert _timing.time_ms(clock.call, iters=iters, method="pipelined") == pytest.approx(2.0 + 7.0 / iters)
    assert _timing.time_ms(clock.call, iters=iters, method="each") == pytest.approx(9.0)


def test_unknown_method_is_named(clock):
    with pytest.raises(ValueError, match="timing method must be one of"):
        _timing.time_ms(clock.call, iters=3, method="events")
