"""Host-side timing of jitted functions, shared by the benchmark scripts: `warmup` calls (the first compiles), then
`iters` calls, each waited for with `block_until_ready`; wall milliseconds per call."""

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
