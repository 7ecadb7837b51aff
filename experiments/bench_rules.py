"""Times every implementation of a rule, forward and forward+backward, and prints a markdown table.

    python experiments/bench_rules.py --rule=gated_deltanet --sizes=2x512x4x64 --impls=scan,chunk,chunk_assoc

Each size is BxTxHxD (K = V = D, as many value heads as key heads). Times are medians over --iters runs after
--warmup runs, taken with block_until_ready. The memory floor counts reading q, k, v, beta and the log-decay once
and writing o and the final state once, over --bandwidth_gbs.
"""

from __future__ import annotations

import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp

import deltajax
from deltajax.rules import dispatch

FLAGS = flags.FLAGS
flags.DEFINE_enum("rule", "gated_deltanet", ["linear_attention", "deltanet", "gated_deltanet", "kda"],
                  "Which rule to time.")
flags.DEFINE_list("sizes", ["2x512x4x64", "1x2048x4x64"], "BxTxHxD sizes.")
flags.DEFINE_list("impls", ["scan", "chunk", "chunk_assoc"],
                  "Implementations: scan, chunk, chunk_assoc (chunk with associative state passing), or any "
                  "registered kernel name (e.g. pallas).")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16", "float16"], "Input dtype.")
flags.DEFINE_integer("warmup", 2, "Untimed runs before timing.")
flags.DEFINE_integer("iters", 10, "Timed runs (the median is reported).")
flags.DEFINE_bool("backward", True, "Also time forward+backward.")
flags.DEFINE_float("bandwidth_gbs", 2500.0, "Memory bandwidth for the floor (H100 measured: about 2500 GB/s).")
flags.DEFINE_integer("max_scan_tokens", 1 << 16, "Skip the scan above this many B*T tokens (it is slow).")


def make_inputs(rule, B, T, H, D, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(keys[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H)))
    if rule == "gated_deltanet":
        log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H)) + 3.0)
    elif rule in ("kda",):
        log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, H, D)) + 3.0)
    else:
        log_decay = None
    cast = lambda x: x.astype(dtype)
    return cast(q), cast(k), cast(v), beta, log_decay


def rule_fn(rule, impl):
    state_passing = "associative" if impl == "chunk_assoc" else "sequential"
    impl_name = "chunk" if impl == "chunk_assoc" else impl

    def fn(q, k, v, beta, log_decay):
        if rule == "linear_attention":
            return deltajax.linear_attention(q, k, v, log_decay, impl=impl_name, state_passing=state_passing)
        return deltajax.delta_rule(q, k, v, beta, log_decay, impl=impl_name, state_passing=state_passing)

    return fn


def median_ms(fn, args, warmup, iters):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def floor_bytes(B, T, H, D, dtype, rule):
    item = jnp.dtype(dtype).itemsize
    tokens = B * T * H
    gates = tokens * 4 * (2 if rule != "linear_attention" else 0)
    if rule == "kda":
        gates += tokens * D * 4
    return 4 * tokens * D * item + gates + B * H * D * D * 4


def main(argv):
    del argv
    dtype = jnp.dtype(FLAGS.dtype)
    device = jax.devices()[0]
    print(f"# {FLAGS.rule}, {dtype.name}, {device.platform}: {device.device_kind}, jax {jax.__version__}")
    print("| impl | BxTxHxD | fwd ms | fwd+bwd ms | fwd GB/s | floor / fwd |")
    print("|---|---|---|---|---|---|")
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        args = make_inputs(FLAGS.rule, B, T, H, D, dtype)
        floor_ms = floor_bytes(B, T, H, D, dtype, FLAGS.rule) / (FLAGS.bandwidth_gbs * 1e9) * 1e3
        for impl in FLAGS.impls:
            if impl == "scan" and B * T > FLAGS.max_scan_tokens:
                continue
            name = "chunk" if impl == "chunk_assoc" else impl
            op = "linear_attention" if FLAGS.rule == "linear_attention" else "delta_rule"
            if name not in dispatch.implementations(op):
                print(f"| {impl} | {size} | not registered | | | |")
                continue
            fn = rule_fn(FLAGS.rule, impl)
            forward = jax.jit(lambda *a: fn(*a)[0])
            try:
                fwd = median_ms(forward, args, FLAGS.warmup, FLAGS.iters)
            except ValueError as error:  # e.g. a kernel that does not support this size
                print(f"| {impl} | {size} | unsupported: {error} | | | |")
                continue
            bwd_text = ""
            if FLAGS.backward:
                loss = lambda q, k, v, b, g: jnp.sum(fn(q, k, v, b, g)[0].astype(jnp.float32) ** 2)
                grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
                bwd_text = f"{median_ms(grad, args, FLAGS.warmup, FLAGS.iters):.3f}"
            gbs = floor_bytes(B, T, H, D, dtype, FLAGS.rule) / (fwd * 1e-3) / 1e9
            print(f"| {impl} | {size} | {fwd:.3f} | {bwd_text} | {gbs:.0f} | {floor_ms / fwd:.3f} |", flush=True)


if __name__ == "__main__":
    app.run(main)
