"""Times the reverse state pass of the Gated DeltaNet in Mosaic GPU (`mosaic_wy._reverse_pass`) against the Triton
one (`wy_chunk._reverse_pass`) on the same residuals, and forward+backward with each (`Config.mosaic_reverse`).

    python experiments/bench_mosaic_reverse.py --sizes=8x2048x16x128,2x8192x16x128,1x32768x16x128
    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/bench_mosaic_reverse.py ...   # ptxas's register and spill counts too

Columns (ms, marginal device time per call, `_timing.marginal_ms`): the Mosaic pass for each of `--variants`
(`mosaic_wy.Config` changes on the size's default config), the Triton pass (reading T as the Triton config stores
it), the relative differences of the Mosaic default's outputs (dL/dS_0, the end-state cotangents, dx) from the
Triton pass's, and forward+backward (`jax.grad` of a sum of the outputs) with either reverse pass. bf16 q/k/v,
K = V = 128, Hv = H, scalar decay, no documents, no initial state.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from deltajax.kernels.gpu import mosaic_wy, wy_chunk
from deltajax.kernels.gpu.common import split_bf16_in_xla
import _timing as timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/
from _mosaic_calls import training_step_cells  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (D must be 128).")
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_integer("iters", 20, "Calls per timing queue (`marginal_ms`).")

VARIANTS = {
    "default": {},
    "one_warpgroup": dict(warpgroups=1, block_v=64),  # one warpgroup per CTA, two CTAs per head
    "shared_head": dict(warpgroups=2, block_v=64),  # one CTA per head, two consumers and a producer
    "block_v32": dict(warpgroups=1, block_v=32),
    "stages3": dict(warpgroups=1, block_v=32, stages=3),
}


def _forward_residuals(B, T, H, D, q, k, v, beta, log_decay):
    """The Triton config and what the reverse pass reads, from the Triton forward with states."""
    cfg = wy_chunk.default_config(q, v, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False, interpret=False)
    args = wy_chunk.padded_call_inputs(q, k, v, beta, log_decay, None, None, 64)
    q, k, v, beta, g, doc, carry, tail, t, *_ = jax.jit(lambda *a: wy_chunk._wy_fwd(cfg, *a))(*args)[1]
    return cfg, (q, k, beta, t, g, doc, carry, tail)


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    header = (["size"] + [f"mosaic {name}" for name in FLAGS.variants] + ["triton", "rel. diff dh0, dends, dx",
                                                                          "fwd+bwd mosaic", "fwd+bwd triton"])
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    ms = lambda fn, *a: timing.marginal_ms(fn, *a, iters=FLAGS.iters)
    rel = lambda x, r: float(np.linalg.norm(np.float64(x) - np.float64(r)) / np.linalg.norm(np.float64(r)))
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        x = kernel_inputs(B, T, H, D, per_channel=False)
        tcfg, (q, k, beta, t, g, doc, carry, tail) = _forward_residuals(B, T, H, D, *x)
        do = jax.random.normal(jax.random.PRNGKey(7), q.shape, jnp.bfloat16)
        dfinal = jax.random.normal(jax.random.PRNGKey(8), (B, H, D, D), jnp.float32)
        t_pair = t if t.ndim == 5 else jax.jit(lambda t: jnp.stack(split_bf16_in_xla(t)))(t)
        vectors = jax.jit(mosaic_wy._pass_vectors, static_argnums=5)(g, beta, doc, carry, tail, D)
        base = mosaic_wy.default_config(batch_heads=B * H)
        pair_sum = lambda p: p[0].astype(jnp.float32) + p[1].astype(jnp.float32)
        row, outputs = [size], None
        for name in FLAGS.variants:
            cfg = dataclasses.replace(base, **VARIANTS[name])
            fn = jax.jit(lambda q, k, do, t, vec, d, surv, dfinal, cfg=cfg: mosaic_wy._reverse_pass(
                cfg, q, k, do, t, vec, d, surv, dfinal, scale=D ** -0.5, segmented=False, interpret=False))
            try:
                if outputs is None:
                    outputs = fn(q, k, do, t_pair, *vectors, dfinal)
                row.append(f"{ms(fn, q, k, do, t_pair, *vectors, dfinal):.3f}")
            except Exception as e:
                row.append(f"failed: {type(e).__name__}: {str(e)[:300]}")
        triton = jax.jit(lambda *a: wy_chunk._reverse_pass(tcfg, *a, dx_pair=True))
        triton_args = (q, k, beta, t, g, doc, carry, tail, do, dfinal)
        row.append(f"{ms(triton, *triton_args):.3f}")
        if outputs is not None:
            dh0, dends, dx = outputs
            dh0_r, dends_r, *dx_r = triton(*triton_args)
            row.append(", ".join(f"{rel(a.astype(jnp.float32), r.astype(jnp.float32)):.1e}"
                                 for a, r in ((dh0, dh0_r), (dends, dends_r), (pair_sum(dx), pair_sum(dx_r)))))
        else:
            row.append("-")
        row += training_step_cells(ms, [dataclasses.replace(base, mosaic_reverse=on) for on in (True, False)], D, x)
        print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
