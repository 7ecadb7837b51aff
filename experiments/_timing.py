"""Host-side timing of jitted functions, shared by the benchmark scripts: `warmup` calls (the first compiles), then
`iters` calls, each waited for with `block_until_ready`; wall milliseconds per call (`median_ms`). Or
`pipelined_ms`: calls queued back to back and waited for once, so that the host's dispatch and wait overlap the
device's work (what a training step sees): the device time per call, median over repeats."""

from __future__ import annotations

import statistics
import time

import jax


def times_ms(fn, *args, iters, warmup=2):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return times


def median_ms(fn, *args, iters, warmup=2):
    return statistics.median(times_ms(fn, *args, iters=iters, warmup=warmup))


def pipelined_ms(fn, *args, iters, warmup=2, repeats=5):
    """Median over `repeats` of the wall time of `iters` calls queued without waiting in between, per call."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    per_call = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(iters)]
        jax.block_until_ready(outs)
        per_call.append((time.perf_counter() - start) * 1e3 / iters)
        del outs
    return statistics.median(per_call)


def time_ms(fn, *args, iters, warmup=2, pipelined=True):
    """`pipelined_ms` (device time per call) or, with `pipelined=False`, `median_ms` (each call waited for)."""
    return (pipelined_ms if pipelined else median_ms)(fn, *args, iters=iters, warmup=warmup)
