"""Times every implementation of a rule, forward and forward+backward, and prints a markdown table.

    python experiments/bench_rules.py --rule=gated_deltanet --sizes=2x512x4x64 --impls=scan,chunk,chunk_assoc

Each size is BxTxHxD (K = V = D, as many value heads as key heads) or BxTxHxDxHv (Hv value heads, a multiple of the
H key heads: groups of Hv/H value heads share a key head's q and k); --value_dim sets V apart from D (= K). Times
are device time per call (`--timing=marginal`, `_timing.marginal_ms`): queues of --iters and 3 x --iters calls, each
queued back to back and waited for once, per call (t(3n) - t(n)) / 2n, median of 5 such pairs, after --warmup runs.
That is the device's time for one more call, what a long training loop sees and what `triton.testing.do_bench`
reports for the PyTorch/Triton peer (CUDA events around each call). `--timing=pipelined` is one queue's time per
call (it spreads the queue's start and final wait over its n calls; the method of earlier tables), `--timing=each`
the median of calls each waited for with block_until_ready (adds the host's dispatch and wait, 0.1-0.4 ms per call
on the H100).
The memory floor counts reading q, k, v, beta and the log-decay once
and writing o and the final state once, over --bandwidth_gbs. Forward+backward differentiates a sum of squares of o
with respect to every floating input (q, k, v, beta, log-decay). "vs chunk" is the XLA chunk form's time over this
row's (forward / forward+backward), when chunk is among --impls. --peak_memory adds the device's peak bytes in use
(cumulative over the process: put the largest size last, or run it alone); it needs --timing=each, whose calls
are each waited for and dropped, so that the peak is one call's and not a queue's outputs.

    python experiments/bench_rules.py --impls=chunk,chunk_assoc,pallas \
        --sizes=8x2048x16x128,2x8192x16x128,1x32768x16x128
"""

from __future__ import annotations


from absl import app, flags
import jax
import jax.numpy as jnp

import deltajax
from deltajax.rules import dispatch
import _timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_enum("rule", "gated_deltanet", ["linear_attention", "deltanet", "gated_deltanet", "kda"],
                  "Which rule to time.")
flags.DEFINE_list("sizes", ["2x512x4x64", "1x2048x4x64"], "BxTxHxD or BxTxHxDxHv sizes.")
flags.DEFINE_list("impls", ["scan", "chunk", "chunk_assoc"],
                  "Implementations: scan, chunk, chunk_assoc (chunk with associative state passing), or any "
                  "registered kernel name (e.g. pallas).")
flags.DEFINE_integer("value_dim", 0, "V when it differs from D (D is then K only); 0: V = D.")
flags.DEFINE_enum("dtype", "bfloat16", ["float32", "bfloat16", "float16"], "Input dtype.")
flags.DEFINE_integer("warmup", 2, "Untimed runs before timing.")
flags.DEFINE_integer("iters", 10, "Calls per timed queue (marginal: queues of iters and 3 iters, median of 5 "
                     "repeats; each: calls, median).")
flags.DEFINE_enum("timing", "marginal", sorted(_timing.METHODS), "marginal: device time of one more queued call "
                  "(`_timing.marginal_ms`); pipelined: a queue's time per call; each: each call waited for.")
flags.DEFINE_bool("backward", True, "Also time forward+backward.")
flags.DEFINE_float("bandwidth_gbs", 2500.0, "Memory bandwidth for the floor (H100 measured: about 2500 GB/s).")
flags.DEFINE_enum("chunk_inverse", "solve", ["blocked", "solve"],
                  "How the chunk form inverts (I + A): 16x16 forward substitution + merges, or XLA's triangular solve.")
flags.DEFINE_enum("chunk_precision", "auto", ["auto", "highest"],
                  "Matmul precision of the chunk form: by input dtype (auto) or IEEE fp32 always (highest).")
flags.DEFINE_integer("max_scan_tokens", 1 << 16, "Skip the scan above this many B*T tokens (it is slow).")
flags.DEFINE_bool("peak_memory", False, "Print the device's peak memory in use after each row (needs --timing=each: "
                  "a queue of calls keeps every call's outputs alive, which would count in the peak).")


def make_inputs(rule, B, T, H, D, dtype, seed=0, Hv=None, V=None):
    Hv, V = Hv or H, V or D
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(keys[0], (B, T, H, D), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, H, D), jnp.float32)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(keys[2], (B, T, Hv, V), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, Hv)))
    if rule == "gated_deltanet":
        log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, Hv)) + 3.0)
    elif rule in ("kda",):
        log_decay = jax.nn.log_sigmoid(jax.random.normal(keys[4], (B, T, Hv, D)) + 3.0)
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


def floor_bytes(B, T, H, D, dtype, rule, Hv=None, V=None):
    """q and k (H heads), v and o (Hv), the per-token gates and the final state, each once."""
    Hv, V = Hv or H, V or D
    item = jnp.dtype(dtype).itemsize
    tokens = B * T * Hv
    gates = tokens * 4 * (2 if rule != "linear_attention" else 0)
    if rule == "kda":
        gates += tokens * D * 4
    return 2 * B * T * H * D * item + 2 * tokens * V * item + gates + B * Hv * D * V * 4


def main(argv):
    del argv
    if FLAGS.peak_memory and FLAGS.timing != "each":
        raise app.UsageError(f"--peak_memory needs --timing=each (got --timing={FLAGS.timing}): queued calls keep "
                             "their outputs alive and the peak would count them")
    dtype = jnp.dtype(FLAGS.dtype)
    from deltajax.rules import chunk as chunk_form

    chunk_form.INVERSE_METHOD = FLAGS.chunk_inverse
    if FLAGS.chunk_precision == "highest":
        chunk_form.matmul_precision = lambda dtype: jax.lax.Precision.HIGHEST
    device = jax.devices()[0]
    print(f"# chunk form: inverse={FLAGS.chunk_inverse}, precision={FLAGS.chunk_precision}; timing: "
          + {"marginal": "device time of one more call in a queue (t(3n) - t(n)) / 2n",
             "pipelined": "a queue's time per call", "each": "each call waited for"}[FLAGS.timing])
    print(f"# {FLAGS.rule}, {dtype.name}, {device.platform}: {device.device_kind}, jax {jax.__version__}"
          + (f", V = {FLAGS.value_dim}" if FLAGS.value_dim else ""))
    print("| impl | BxTxHxD[xHv] | fwd ms | fwd+bwd ms | fwd GB/s | floor / fwd | vs chunk (fwd / fwd+bwd) |"
          + (" peak GiB |" if FLAGS.peak_memory else ""))
    print("|---|---|---|---|---|---|---|" + ("---|" if FLAGS.peak_memory else ""))
    for size in FLAGS.sizes:
        B, T, H, D, *value_heads = (int(x) for x in size.split("x"))
        Hv = value_heads[0] if value_heads else H
        V = FLAGS.value_dim or D
        args = make_inputs(FLAGS.rule, B, T, H, D, dtype, Hv=Hv, V=V)
        total_bytes = floor_bytes(B, T, H, D, dtype, FLAGS.rule, Hv=Hv, V=V)
        floor_ms = total_bytes / (FLAGS.bandwidth_gbs * 1e9) * 1e3
        chunk_times = None
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
                fwd = _timing.time_ms(forward, *args, iters=FLAGS.iters, warmup=FLAGS.warmup, method=FLAGS.timing)
            except ValueError as error:  # e.g. a kernel that does not support this size
                print(f"| {impl} | {size} | unsupported: {error} | | | |")
                continue
            bwd, bwd_text = None, ""
            if dispatch.implementations(op)[name].forward_only:  # no backward to time
                bwd_text = "forward only"
            elif FLAGS.backward:
                loss = lambda q, k, v, b, g: jnp.sum(fn(q, k, v, b, g)[0].astype(jnp.float32) ** 2)
                argnums = tuple(i for i, a in enumerate(args) if a is not None)
                grad = jax.jit(jax.grad(loss, argnums=argnums))
                bwd = _timing.time_ms(grad, *args, iters=FLAGS.iters, warmup=FLAGS.warmup, method=FLAGS.timing)
                bwd_text = f"{bwd:.3f}"
            if impl == "chunk":
                chunk_times = (fwd, bwd)
            speedup = ""
            if chunk_times is not None:
                speedup = f"{chunk_times[0] / fwd:.1f}x"
                if bwd is not None and chunk_times[1] is not None:
                    speedup += f" / {chunk_times[1] / bwd:.1f}x"
            gbs = total_bytes / (fwd * 1e-3) / 1e9
            peak = ""
            if FLAGS.peak_memory:
                stats = device.memory_stats() or {}
                peak = f" {stats.get('peak_bytes_in_use', float('nan')) / 2**30:.1f} |"
            print(f"| {impl} | {size} | {fwd:.3f} | {bwd_text} | {gbs:.0f} | {floor_ms / fwd:.3f} | {speedup} |{peak}",
                  flush=True)


if __name__ == "__main__":
    app.run(main)
