"""Times KDA's fused gradient kernel in Mosaic GPU (`kernels/gpu/mosaic_kda_grads.py`, `kda.Config.grads_backend`)
against the fused Triton kernel (`kda._grads_fused`) on the same residuals (from the Triton passes), and reports
their outputs' relative differences.

    python experiments/bench_mosaic_kda_grads.py --sizes=8x2048x16x128
    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/bench_mosaic_kda_grads.py ...   # ptxas's register and spill counts

Columns (ms, marginal device time per call, `_timing.marginal_ms`): the Mosaic kernel, the Triton kernel, then the
relative differences of dq, dk, dv, dbeta, d(log_decay). bf16 q/k/v, K = V = 128, Hv = H, no documents, no initial
state, gates whose chunks all take one reference.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import kda
import _timing as timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (D must be 128).")
flags.DEFINE_integer("iters", 20, "Calls per timing queue (`marginal_ms`).")
flags.DEFINE_bool("triton", True, "Also time the fused Triton kernel (else its column is nan).")


def residuals(B, T, H, D):
    """The bounded config and the gradient kernels' arguments (`kda._grads_fused`), from the Triton passes."""
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    q = jax.random.normal(keys[0], (B, T, H, D), jnp.bfloat16)
    k = (jax.random.normal(keys[1], (B, T, H, D)) / jnp.sqrt(D)).astype(jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, H, D), jnp.bfloat16)
    beta = jax.nn.sigmoid(jax.random.normal(keys[3], (B, T, H)))
    log_decay = -0.1 * jax.nn.softplus(jax.random.normal(keys[4], (B, T, H, D)))
    do = jax.random.normal(keys[5], (B, T, H, D), jnp.bfloat16)
    cfg = kda.default_config(q, v, scale=D ** -0.5, chunk_size=64, segmented=False, interpret=False)
    cfg = dataclasses.replace(cfg, all_bounded=True)
    doc = jnp.zeros((B, T), jnp.int32)
    ones = jnp.ones((B, T), jnp.float32)
    h0 = jnp.zeros((B, H, D, D), jnp.float32)

    @jax.jit
    def make(q, k, v, beta, log_decay, do):
        g, glo, src = kda._gates_and_operands(cfg, q, k, log_decay, ones, ones)
        t, p, r = kda._prepare(cfg, q, k, g, glo, beta, doc, with_r=True)
        o, final, starts, u_pair = kda._forward_pass(cfg, src, v, beta, t, p, h0, with_states=True)
        back = kda._source(cfg, q, k, g, glo, ones, ones, "backward")
        _, dends, dx_pair = kda._reverse_pass(cfg, back, beta, t, p, do, final)
        return (back, q, k, v, beta, g, glo, doc, ones, ones, u_pair + dx_pair, r, starts, dends, do)

    return cfg, make(q, k, v, beta, log_decay, do)


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| size | mosaic (ms) | triton fused (ms) | rel. diff dq, dk, dv, dbeta, dlog_decay |")
    print("|---|---|---|---|")
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        cfg, args = residuals(B, T, H, D)
        mosaic = jax.jit(lambda *a: kda._grads_fused(dataclasses.replace(cfg, grads_backend="mosaic"), *a))
        triton = jax.jit(lambda *a: kda._grads_fused(cfg, *a))
        fns = (mosaic, triton) if FLAGS.triton else (mosaic,)
        outs = [jax.block_until_ready(f(*args)) for f in fns]
        rel = lambda a, b: float(np.linalg.norm(np.float64(a) - np.float64(b)) / np.linalg.norm(np.float64(b)))
        diffs = ", ".join(f"{rel(a, b):.1e}" for a, b in zip(*outs)) if FLAGS.triton else ""
        times = [timing.marginal_ms(f, *args, iters=FLAGS.iters) for f in fns] + [float("nan")] * (2 - len(fns))
        print(f"| {size} | {times[0]:.3f} | {times[1]:.3f} | {diffs} |", flush=True)


if __name__ == "__main__":
    app.run(main)
