"""Host-side timing of jitted functions, shared by the benchmark scripts: `warmup` calls (the first compiles), then
`iters` calls, each waited for with `block_until_ready`; wall milliseconds per call (`median_ms`). Or
`pipelined_ms`: calls queued back to back and waited for once, so that the host's dispatch and wait overlap the
device's work (what a training step sees): the device time per call, median over repeats. `marginal_ms`: the same
queues of n and 3n calls, per call (t(3n) - t(n)) / 2n, which removes what every queue pays once (the first call's
dispatch before the device starts, the final wait's round trip); `pipelined_ms` spreads that over its n calls.

On the H100 (2026-11-24) that fixed part is visible at n = 10-20: the same Gated DeltaNet forward at
8x2048x16x128 read 0.603 ms from `pipelined_ms` with n = 10 and 0.554 ms with n = 20 in two runs of the same
kernels (docs/benchmarks.md).
"""

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


def marginal_ms(fn, *args, iters, warmup=2, repeats=5):
    """Median over `repeats` of (t(3 iters) - t(iters)) / (2 iters), t(n) the wall time of n calls queued without
    waiting in between: the device time of one more call, without the fixed cost of starting and ending a queue."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))

    def queue_ms(n):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(n)]
        jax.block_until_ready(outs)
        del outs
        return (time.perf_counter() - start) * 1e3

    per_call = []
    for _ in range(repeats):
        short = queue_ms(iters)
        per_call.append((queue_ms(3 * iters) - short) / (2 * iters))
    return statistics.median(per_call)


METHODS = {"marginal": marginal_ms, "pipelined": pipelined_ms, "each": median_ms}


def time_ms(fn, *args, iters, warmup=2, method="marginal"):
    """Milliseconds per call by `method`: "marginal" (`marginal_ms`, the device time of one more queued call),
    "pipelined" (`pipelined_ms`, a queue's time per call) or "each" (`median_ms`, each call waited for)."""
    if method not in METHODS:
        raise ValueError(f"timing method must be one of {sorted(METHODS)}, got {method!r}")
    return METHODS[method](fn, *args, iters=iters, warmup=warmup)


def run_for_profiler(run, args, calls):
    """`calls` times: the forward of `run` (returning (o, state)), then its forward+backward (the gradient of
    sum(o) with respect to the first five arguments), each waited for, so a profiler sees whole calls in order."""
    import jax.numpy as jnp

    forward = jax.jit(lambda *a: run(*a)[0])
    both = jax.jit(jax.grad(lambda *a: jnp.sum(run(*a)[0].astype(jnp.float32)), argnums=(0, 1, 2, 3, 4)))
    for _ in range(calls):
        jax.block_until_ready(forward(*args))
        jax.block_until_ready(both(*args))
