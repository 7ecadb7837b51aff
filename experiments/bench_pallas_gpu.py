"""Times the Pallas GPU WY kernels one by one and end to end, for a few configurations, on Gated DeltaNet.

    python experiments/bench_pallas_gpu.py --sizes=8x2048x16x128 --variants=default,bv128,warps8

Each variant overrides fields of `wy_chunk.default_config` (see VARIANTS). Rows: the prepare kernel (W, U0, T), the
forward pass (with and without saving chunk states), the reverse pass, the gradient kernel, then forward and
forward+backward through `chunk_wy` (medians of --iters runs with block_until_ready).
"""

from __future__ import annotations

import dataclasses
import statistics
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from deltajax.kernels.gpu import wy_chunk

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (K = V = D, Hv = H).")
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_integer("iters", 20, "Timed runs (median reported).")
flags.DEFINE_bool("per_kernel", True, "Also time each kernel alone.")
flags.DEFINE_string("error_size", "2x1024x4x128", "BxTxHxD where each variant's error against the fp32 scan "
                    "(on the same bf16 inputs) is measured; empty to skip.")
flags.DEFINE_bool("interpret", False, "Run in Pallas's interpreter (a smoke test of this script on CPU).")

VARIANTS = {
    "default": {},
    "bv32": dict(block_v=32, grad_block_v=32),
    "bv128": dict(block_v=128, grad_block_v=128),
    "fwd_bv128": dict(block_v=128),
    "grad_bv128": dict(grad_block_v=128),
    "grad_bv32": dict(grad_block_v=32),
    "warps8": dict(warps=8),
    "stages1": dict(stages=1),
    "stages3": dict(stages=3),
    "bf16_factors": dict(factor_dtype="bfloat16"),
    "bf16_factors_warps8": dict(factor_dtype="bfloat16", warps=8),
    "bf16dots": dict(dots="bf16"),
    "bf16dots_factors": dict(dots="bf16", factor_dtype="bfloat16"),
    "bf16dots_grad_bv128": dict(dots="bf16", grad_block_v=128),
    "grad_bv128_warps8": dict(grad_block_v=128, warps=8),
    "tf32_backward": dict(grad_dots="tf32"),
    "grad_bv64": dict(grad_block_v=64),
}


def median_ms(fn, *args, iters):
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def inputs(B, T, H, D):
    ks = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(ks[0], (B, T, H, D)).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, H, D))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, H, D)).astype(jnp.bfloat16)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    log_decay = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H)) + 3.0)
    return q, k, v, beta, log_decay


def variant_errors(cfg):
    """Relative errors of o and of every gradient against the fp32 scan on the same bf16-rounded inputs."""
    from deltajax.rules.scan import recurrent_scan
    import numpy as np

    B, T, H, D = (int(x) for x in FLAGS.error_size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D)
    cfg = dataclasses.replace(cfg, scale=D ** -0.5)

    def loss(fn, q, k, v, b, g):
        o, _ = fn(q, k, v, b, g, scale=D ** -0.5, initial_state=None, segment_ids=None)
        return jnp.sum(o.astype(jnp.float32) * jnp.cos(jnp.arange(o.size, dtype=jnp.float32).reshape(o.shape)))

    kernel = lambda *a, **kw: wy_chunk.chunk_wy(*a, **kw, interpret=cfg.interpret, config=cfg)
    f32 = lambda x: x.astype(jnp.float32)
    o = kernel(q, k, v, beta, log_decay, scale=D ** -0.5, initial_state=None, segment_ids=None)[0]
    o_ref = recurrent_scan(f32(q), f32(k), f32(v), beta, log_decay, scale=D ** -0.5, initial_state=None,
                           segment_ids=None)[0]
    grads = jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3, 4))(q, k, v, beta, log_decay)
    grads_ref = jax.jit(jax.grad(lambda *a: loss(recurrent_scan, *a), argnums=(0, 1, 2, 3, 4)))(
        f32(q), f32(k), f32(v), beta, log_decay)
    rel = lambda x, r: float(np.linalg.norm(np.float64(x) - np.float64(r)) / np.linalg.norm(np.float64(r)))
    return ", ".join(f"{rel(x, r):.1e}" for x, r in zip((o,) + grads, (o_ref,) + grads_ref))


def main(argv):
    del argv
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}, jax {jax.__version__}")
    print("| size | variant | prepare | fwd pass | fwd pass+states | reverse | grads | fwd | fwd+bwd | rel. error "
          "o, dq, dk, dv, dbeta, dlog_decay |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        q, k, v, beta, log_decay = inputs(B, T, H, D)
        for name in FLAGS.variants:
            cfg = wy_chunk.default_config(q, v, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False,
                                          interpret=FLAGS.interpret)
            cfg = dataclasses.replace(cfg, **VARIANTS[name])
            try:
                cells = []
                if FLAGS.per_kernel:
                    C = cfg.chunk_size
                    g = jnp.cumsum(log_decay.reshape(B, T // C, C, H), axis=2).reshape(B, T, H)
                    doc = jnp.zeros((B, T), jnp.int32)
                    ones = jnp.ones((B, T), jnp.float32)
                    h0 = jnp.zeros((B, H, D, D), jnp.float32)
                    prep = jax.jit(lambda k, v, b, g: wy_chunk._prepare(cfg, k, v, b, g, doc, ones, with_t=True))
                    w, u0, t = prep(k, v, beta, g)
                    fwd0 = jax.jit(lambda q, k, w, u0, g: wy_chunk._forward_pass(
                        cfg, q, k, w, u0, g, doc, ones, ones, h0, with_states=False))
                    fwd1 = jax.jit(lambda q, k, w, u0, g: wy_chunk._forward_pass(
                        cfg, q, k, w, u0, g, doc, ones, ones, h0, with_states=True))
                    o, final, starts = fwd1(q, k, w, u0, g)
                    rev = jax.jit(lambda q, k, w, g, do, df: wy_chunk._reverse_pass(
                        cfg, q, k, w, g, doc, ones, ones, do, df))
                    dh0, dends = rev(q, k, w, g, o, final)
                    grads = jax.jit(lambda *a: wy_chunk._grads(cfg, *a))
                    gargs = (q, k, v, beta, g, doc, ones, ones, t, w, u0, starts, dends, o)
                    cells += [median_ms(prep, k, v, beta, g, iters=FLAGS.iters),
                              median_ms(fwd0, q, k, w, u0, g, iters=FLAGS.iters),
                              median_ms(fwd1, q, k, w, u0, g, iters=FLAGS.iters),
                              median_ms(rev, q, k, w, g, o, final, iters=FLAGS.iters),
                              median_ms(grads, *gargs, iters=FLAGS.iters)]
                    del w, u0, t, o, final, starts, dh0, dends
                else:
                    cells += [float("nan")] * 5
                run = lambda q, k, v, b, g: wy_chunk.chunk_wy(q, k, v, b, g, scale=D ** -0.5, initial_state=None,
                                                                 segment_ids=None, interpret=cfg.interpret, config=cfg)
                fwd = jax.jit(lambda *a: run(*a)[0])
                loss = lambda *a: jnp.sum(run(*a)[0].astype(jnp.float32) ** 2)
                bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
                cells += [median_ms(fwd, q, k, v, beta, log_decay, iters=FLAGS.iters),
                          median_ms(bwd, q, k, v, beta, log_decay, iters=FLAGS.iters)]
                errors = variant_errors(cfg) if FLAGS.error_size else ""
                print(f"| {size} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {errors} |", flush=True)
            except Exception as error:  # a variant that does not compile (registers, shared memory) is reported
                print(f"| {size} | {name} | failed: {type(error).__name__}: {str(error)[:300]} |", flush=True)


if __name__ == "__main__":
    app.run(main)
