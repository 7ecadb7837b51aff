"""Times the in-chunk inverse T = (I + A)^-1 of the Gated DeltaNet as its bf16 pair: the Mosaic GPU kernel
(`mosaic_inverse.inverse_pair`, products on the tensor cores) against the Triton kernel (`wy_chunk._inverse`,
16 x 16 forward substitution), on the same inputs, with T's error against a float64 inverse of the same A.

    python experiments/bench_mosaic_inverse.py --sizes=8x2048x16x128,1x32768x16x128

Columns: ms per call (marginal device time, `_timing.marginal_ms`) of each kernel alone, and the largest relative
error (Frobenius, per chunk and head) of each T against float64 on --error_size, for random keys and for correlated
keys with beta near 2 (where fp32 methods differ most).
"""

from __future__ import annotations

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import mosaic_inverse, mosaic_vectors, wy_chunk
import _timing  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (D = 128, Hv = H, T a multiple of 64).")
flags.DEFINE_integer("iters", 20, "Calls per timing queue (`marginal_ms`).")
flags.DEFINE_string("error_size", "2x512x4x128", "BxTxHxD of the error columns (empty: none).")

C = 64


def inputs(B, T, H, D, *, correlated=False, seed=0):
    """Padded-free kernel inputs (k, beta, gates, the Mosaic kernel's vectors and document index)."""
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    k = jax.random.normal(keys[0], (B, T, H, D))
    if correlated:
        k = jax.random.normal(keys[3], (1, 1, H, D)) + 0.02 * k
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    lo, hi = (1.9, 2.0) if correlated else (0.0, 1.0)
    beta = jax.random.uniform(keys[1], (B, T, H), minval=lo, maxval=hi)
    log_decay = -1e-4 * jnp.ones((B, T, H)) if correlated else jax.nn.log_sigmoid(
        jax.random.normal(keys[2], (B, T, H)) + 3.0)
    doc = jnp.zeros((B, T), jnp.int32)
    ones = jnp.ones((B, T), jnp.float32)
    g, vectors, _, doc_f = mosaic_vectors.prologue(log_decay, beta, doc, ones, ones, segmented=False, state_dim=D,
                                                   interpret=False)
    return k, beta, g, doc, vectors, doc_f


def triton_inverse(k, beta, g, doc):
    cfg = wy_chunk.default_config(k, k, scale=1.0, chunk_size=C, delta=True, segmented=False, interpret=False)
    return wy_chunk._inverse(cfg, k, beta, g, doc, pair=True, fp32=False)


def mosaic(k, vectors, doc_f):
    return mosaic_inverse.inverse_pair(k, vectors, doc_f, segmented=False, interpret=False)


def largest_error(pair, k, beta, g):
    t = np.asarray(pair[0], np.float64) + np.asarray(pair[1], np.float64)
    k, beta = np.asarray(k, np.float64), np.asarray(beta, np.float64)
    gates = np.asarray(g[0], np.float64) + np.asarray(g[1], np.float64)
    B, T, H, _ = k.shape
    worst = 0.0
    for b in range(B):
        for h in range(H):
            for c in range(T // C):
                rows = slice(c * C, (c + 1) * C)
                kc, gc = k[b, rows, h], gates[b, rows, h]
                a = beta[b, rows, h][:, None] * (kc @ kc.T) * np.exp(np.minimum(gc[:, None] - gc[None, :], 0.0))
                ref = np.linalg.inv(np.eye(C) + np.tril(a, -1))
                worst = max(worst, np.linalg.norm(t[b, rows, h] - ref) / np.linalg.norm(ref))
    return worst


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print("| size | Triton inverse ms | Mosaic inverse ms |\n|---|---:|---:|", flush=True)
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        k, beta, g, doc, vectors, doc_f = inputs(B, T, H, D)
        ms = lambda fn, *a: _timing.marginal_ms(jax.jit(fn), *a, iters=FLAGS.iters)
        print(f"| {size} | {ms(triton_inverse, k, beta, g, doc):.3f} | {ms(mosaic, k, vectors, doc_f):.3f} |",
              flush=True)
    if FLAGS.error_size:
        B, T, H, D = (int(x) for x in FLAGS.error_size.split("x"))
        print(f"\n| keys ({FLAGS.error_size}) | Triton T error | Mosaic T error |\n|---|---:|---:|")
        for correlated in (False, True):
            k, beta, g, doc, vectors, doc_f = inputs(B, T, H, D, correlated=correlated, seed=1)
            errors = [largest_error(jax.jit(fn)(*a), k, beta, g)
                      for fn, a in ((triton_inverse, (k, beta, g, doc)), (mosaic, (k, vectors, doc_f)))]
            name = "correlated, beta near 2" if correlated else "random"
            print(f"| {name} | {errors[0]:.2e} | {errors[1]:.2e} |", flush=True)


if __name__ == "__main__":
    app.run(main)
