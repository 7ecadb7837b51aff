"""Runs every rule of the family through the scan reference and the chunked form and prints how they agree.

    python experiments/demo_rules.py --seq_len=300

For each rule: the relative error of the chunked form (sequential and associative state passing) against the
fp32 token-by-token scan, for outputs, final states and gradients, on fresh random inputs with packed documents
and an initial state.
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax import rules

FLAGS = flags.FLAGS
flags.DEFINE_integer("batch", 2, "Batch size.")
flags.DEFINE_integer("seq_len", 300, "Tokens per sequence (need not be a multiple of the chunk size).")
flags.DEFINE_integer("heads", 2, "Key heads.")
flags.DEFINE_integer("value_heads", 4, "Value heads (a multiple of the key heads).")
flags.DEFINE_integer("key_dim", 32, "K.")
flags.DEFINE_integer("value_dim", 16, "V.")
flags.DEFINE_integer("chunk_size", 64, "Chunk size of the chunked form.")
flags.DEFINE_integer("seed", 0, "PRNG seed.")


def relative_error(x, ref):
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def rule_table(key, B, T, H, Hv, K, V):
    """name -> function(q, k, v, coefficient, log_decay, **kw) and its inputs."""
    ks = jax.random.split(key, 8)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    raw_k = jax.random.normal(ks[1], (B, T, H, K)) * jax.random.uniform(ks[7], (B, T, H, 1), minval=0.2,
                                                                       maxval=3.0)
    coefficient = jax.random.uniform(ks[3], (B, T, Hv), minval=0.05, maxval=1.0)
    scalar_decay = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, Hv)) + 3.0)
    channel_decay = jax.nn.log_sigmoid(jax.random.normal(ks[5], (B, T, Hv, K)) + 3.0)
    la = lambda q, k, v, c, g, **kw: rules.linear_attention(q, k, v, g, **kw)
    return {
        "linear attention": (la, unit(raw_k), None, None),
        "linear attention + decay": (la, unit(raw_k), None, scalar_decay),
        "DeltaNet": (rules.delta_rule, unit(raw_k), coefficient, None),
        "DeltaNet, beta in (0, 2)": (rules.delta_rule, unit(raw_k), 2 * coefficient, None),
        "Gated DeltaNet": (rules.delta_rule, unit(raw_k), coefficient, scalar_decay),
        "KDA": (rules.delta_rule, unit(raw_k), coefficient, channel_decay),
        "Kaczmarz": (lambda q, k, v, c, g, **kw: rules.kaczmarz(q, k, v, g, **kw), raw_k, None, scalar_decay),
        "relaxed Kaczmarz": (rules.relaxed_kaczmarz, raw_k, 1.5 * coefficient, scalar_decay),
        "Longhorn": (rules.longhorn, raw_k, 4 * coefficient, scalar_decay),
        "EFLA": (rules.efla, raw_k, 2 * coefficient, scalar_decay),
    }


def main(argv):
    del argv
    B, T, H, Hv, K, V = (FLAGS.batch, FLAGS.seq_len, FLAGS.heads, FLAGS.value_heads, FLAGS.key_dim,
                         FLAGS.value_dim)
    key = jax.random.PRNGKey(FLAGS.seed)
    ks = jax.random.split(key, 4)
    q = jax.random.normal(ks[0], (B, T, H, K))
    v = jax.random.normal(ks[1], (B, T, Hv, V))
    initial_state = jax.random.normal(ks[2], (B, Hv, K, V))
    segment_ids = jnp.cumsum(jax.random.bernoulli(ks[3], 0.01, (B, T)).astype(jnp.int32), axis=1)
    print(f"B={B} T={T} H={H} Hv={Hv} K={K} V={V} chunk={FLAGS.chunk_size}, packed documents, initial state; "
          f"jax {jax.__version__} on {jax.devices()[0].platform}")
    print("| rule | state passing | output err | state err | grad err (q, v, S0) |")
    print("|---|---|---|---|---|")
    for name, (fn, k, coefficient, log_decay) in rule_table(jax.random.fold_in(key, 1), B, T, H, Hv, K, V).items():
        # Every array is an argument of the jitted functions (closed-over arrays would be constant-folded).
        def run(impl, passing, q, v, initial_state, k, coefficient, log_decay, segment_ids):
            return fn(q, k, v, coefficient, log_decay, initial_state=initial_state, segment_ids=segment_ids,
                      impl=impl, chunk_size=FLAGS.chunk_size, state_passing=passing)

        results = {}
        for impl, passing in (("scan", "sequential"), ("chunk", "sequential"), ("chunk", "associative")):
            forward = jax.jit(lambda *a, impl=impl, passing=passing: run(impl, passing, *a))
            loss = lambda *a, impl=impl, passing=passing: sum(jnp.sum(jnp.sin(x)) for x in run(impl, passing, *a))
            args = (q, v, initial_state, k, coefficient, log_decay, segment_ids)
            outputs = jax.block_until_ready(forward(*args))
            grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*args)
            results[impl, passing] = (outputs, grads)
        (o_ref, s_ref), g_ref = results["scan", "sequential"]
        for passing in ("sequential", "associative"):
            (o, s), g = results["chunk", passing]
            grad_error = max(relative_error(a, b) for a, b in zip(g, g_ref))
            print(f"| {name} | {passing} | {relative_error(o, o_ref):.1e} | {relative_error(s, s_ref):.1e} | "
                  f"{grad_error:.1e} |", flush=True)


if __name__ == "__main__":
    app.run(main)
