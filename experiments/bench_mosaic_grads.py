"""Times the chunk-parallel gradient kernel of the Gated DeltaNet in Mosaic GPU (`kernels/gpu/mosaic_wy_grads.py`)
against the Triton "merged" kernel (`wy_chunk._grads`) on the same residuals, and the whole backward of
`impl="mosaic"` with each (`mosaic_wy.Config.grads`).

    python experiments/bench_mosaic_grads.py --sizes=8x2048x16x128,1x32768x16x128
    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/bench_mosaic_grads.py ...   # ptxas's register and spill counts too

Columns (ms, marginal device time per call, `_timing.marginal_ms`): the gradient kernel (Mosaic, Triton), the
relative differences of their dq, dk, dv, dbeta, d(log_decay), and forward+backward (`jax.grad` of a sum of the
outputs) with each gradient kernel. bf16 q/k/v, K = V = 128, Hv = H, scalar decay, no documents, no initial state.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import mosaic_wy, mosaic_wy_grads, wy_chunk
import _timing as timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/
from _mosaic_calls import training_step_cells  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (D must be 128).")
flags.DEFINE_integer("iters", 20, "Calls per timing queue (`marginal_ms`).")
flags.DEFINE_bool("end_to_end", True, "Also time forward+backward with each gradient kernel.")


def residuals(B, T, H, D, q, k, v, beta, log_decay):
    """The Triton config and the gradient kernels' inputs from the Triton passes (q, k, v, beta, g, doc, carry,
    tail, starts, dends, do, u, dx), with the fp32 T pair the Triton kernel is given (None where it reads u)."""
    scale = D ** -0.5
    cfg = wy_chunk.default_config(q, v, scale=scale, chunk_size=64, delta=True, segmented=False, interpret=False)
    args = wy_chunk.padded_call_inputs(q, k, v, beta, log_decay, None, None, 64)
    q, k, v, beta, g, doc, carry, tail, t, t_grads, starts, (u,) = wy_chunk._wy_fwd(cfg, *args)[1]
    do = jax.random.normal(jax.random.PRNGKey(7), v.shape, jnp.bfloat16)
    dfinal = jnp.zeros((B, H, D, D), jnp.float32)
    _, dends, dx = wy_chunk._reverse_pass(cfg, q, k, beta, t, g, doc, carry, tail, do, dfinal)
    return cfg, t_grads, (q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx)


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    header = ["size", "mosaic grads", "triton merged", "rel. diff dq, dk, dv, dbeta, dlog", "fwd+bwd mosaic grads",
              "fwd+bwd triton grads"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    ms = lambda fn, *a: timing.marginal_ms(fn, *a, iters=FLAGS.iters)
    rel = lambda x, r: float(np.linalg.norm(np.float64(x) - np.float64(r)) / np.linalg.norm(np.float64(r)))
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        x = kernel_inputs(B, T, H, D, per_channel=False)
        row = [size]
        try:
            cfg, t_grads, res = residuals(B, T, H, D, *x)
        except Exception as e:
            print(f"| {size} | residuals failed: {type(e).__name__}: {str(e)[:300]} |", flush=True)
            continue
        mosaic = jax.jit(lambda *a: mosaic_wy_grads.grads(*a, scale=D ** -0.5, segmented=False, interpret=False))
        triton = jax.jit(lambda *a: wy_chunk._grads(cfg, *a[:4], t_grads, *a[4:11], saved=a[11:]))
        # The Mosaic kernel reads u and dx as bf16 (hi, lo) halves, as the Mosaic pass and the reverse pass write
        # them under differentiation: split here, outside the timing.
        res_pairs = res[:11] + tuple(jax.jit(mosaic_wy_grads.as_pair)(x) for x in res[11:])
        try:
            ours, ref = mosaic(*res_pairs), triton(*res)
            row += [f"{ms(mosaic, *res_pairs):.3f}", f"{ms(triton, *res):.3f}",
                    ", ".join(f"{rel(a.astype(jnp.float32), r.astype(jnp.float32)):.1e}" for a, r in zip(ours, ref))]
        except Exception as e:
            row += [f"failed: {type(e).__name__}: {str(e)[:300]}", "-", "-"]
        if FLAGS.end_to_end:
            base = mosaic_wy.default_config(batch_heads=B * H)
            row += training_step_cells(ms, [dataclasses.replace(base, grads=g) for g in ("mosaic", "triton")], D, x)
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
