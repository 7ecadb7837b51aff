"""Times the Mosaic GPU forward of the Gated DeltaNet (`kernels/gpu/mosaic_wy.py`) piece by piece, for named config
variants, next to the Triton forward (`impl="pallas"`) on the same inputs.

    python experiments/bench_mosaic_gpu.py --sizes=8x2048x16x128 --variants=default,state_bf16
    MOSAIC_GPU_DUMP_PTXAS=1 python experiments/bench_mosaic_gpu.py ...   # ptxas's register and spill counts too

Columns (ms, marginal device time per call, `_timing.marginal_ms`): the chunk-parallel inputs of the pass (gates,
the Triton inverse, the per-token vectors), the Mosaic pass alone, the whole forward, and the Triton forward. With
--error_size, the relative errors of o and of the final state against the fp32 scan on the same bf16 inputs
(with the config timed at each size).
bf16 q/k/v, K = V = D or K = D and V apart (sizes BxTxHxKxV; each of 64, 128 or 256), Hv = H, scalar decay, no
documents, no initial state.
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

import deltajax
from deltajax.kernels.gpu import mosaic_wy
from deltajax.rules.scan import recurrent_scan
import _timing as timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/
from _mosaic_calls import training_step_cells  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD (K = V = D) or BxTxHxKxV sizes (each in mosaic_wy.HEAD_DIMS).")
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_integer("iters", 20, "Calls per timing queue (`marginal_ms`).")
flags.DEFINE_string("error_size", "", "BxTxHxD where each variant's error against the fp32 scan is measured.")
flags.DEFINE_bool("triton", True, "Also time the Triton forward on the same inputs.")
flags.DEFINE_bool("residuals", False, "Also time the forward as differentiation runs it (`jax.vjp`: the outputs and "
                  "the residuals of the backward), for the variant and for the Triton path.")
flags.DEFINE_bool("pieces", True, "Time the pass's inputs and the pass alone (else '-' in those columns).")
flags.DEFINE_bool("fwd_bwd", False, "Also time forward+backward (the gradients of sum(o) + sum(final state)).")

# Each variant overrides fields of `mosaic_wy.default_config(batch_heads=B * H, key_dim=K, value_dim=V)`.
VARIANTS = {
    "default": {},
    "separate": dict(lo_accumulators="separate"),
    "state_bf16": dict(state_dots="bf16"),
    "state_split": dict(state_dots="split"),
    "inverse_xla": dict(inverse_pair="xla"),
    "p_registers": dict(p_operand="registers"),
    "p_smem": dict(p_operand="smem"),
    "p_after_u": dict(p_during_u=False),
    "one_warpgroup": dict(warpgroups=1),  # grid (V/BV, B*H), one warpgroup per CTA
    "shared_head": dict(warpgroups=2),  # one CTA per head: two consumer warpgroups and a producer
    "shared_head_separate": dict(warpgroups=2, lo_accumulators="separate"),
    "shared_head_p_after_u": dict(warpgroups=2, p_during_u=False),
    "query_state_early": dict(query_state_late=False),  # Q S_0 with K S_0 (the default until 2026-11-26 05:47)
    "one_warpgroup_query_state_early": dict(warpgroups=1, query_state_late=False),
    # One pipeline stage: the layout an fp16 pass with q's and k's bf16 pairs would fit in (docs/mosaic.md, item 5).
    "one_warpgroup_stages1": dict(warpgroups=1, stages=1),
    # Narrower state blocks (V/BV CTAs per head, one warpgroup each), for calls with few heads.
    "block_v32": dict(warpgroups=1, block_v=32),
    "block_v16": dict(warpgroups=1, block_v=16),
    "block_v32_stages3": dict(warpgroups=1, block_v=32, stages=3),
    "block_v16_stages3": dict(warpgroups=1, block_v=16, stages=3),
    "block_v16_stages4": dict(warpgroups=1, block_v=16, stages=4),
    # The Mosaic passes below `MOSAIC_FORWARD_MIN_BATCH_HEADS` heads too (the default runs Triton's there).
    "mosaic_block_v32": dict(warpgroups=1, block_v=32, mosaic_forward=True, mosaic_reverse=True),
    "mosaic_block_v16": dict(warpgroups=1, block_v=16, mosaic_forward=True, mosaic_reverse=True),
    "triton_forward": dict(mosaic_forward=False),  # the Triton forward pass instead
    "triton_passes": dict(mosaic_forward=False, mosaic_reverse=False),  # the Triton forward and reverse passes
    "mosaic_passes": dict(mosaic_forward=True, mosaic_reverse=True),  # the Mosaic passes whatever the heads
    "xla_vectors": dict(vectors="xla"),  # the gates' cumsums and per-token vectors in XLA (until 2026-11-27)
    "recompute_u": dict(recompute_u=True),  # the gradient kernel forms u from T; the forward pass saves no u
    "mosaic_grads": dict(grads="mosaic"),  # the Mosaic gradient kernel (at K or V of 256 in blocks of 128)
    "mosaic_grads_1wg": dict(grads="mosaic", grads_warpgroups=1),  # its roles in turn, two CTAs per SM at 64
    "triton_grads": dict(grads="triton"),  # the Triton gradient kernel on the Mosaic passes' residuals (K <= 128)
    # The kernel as it was until 2026-11-26 (split state products, P through SMEM, T split in XLA).
    "previous": dict(state_dots="split", p_operand="smem", inverse_pair="xla", p_during_u=False, warpgroups=1,
                     query_state_late=False),
}


def inputs(B, T, H, D, seed=0, V=None):
    return kernel_inputs(B, T, H, D, per_channel=False, seed=seed, value_dim=V)


def config_of(name, batch_heads, D, V=None):
    base = mosaic_wy.default_config(batch_heads=batch_heads, key_dim=D, value_dim=V or D)
    return dataclasses.replace(base, **VARIANTS[name])


def forward(cfg, D):
    return jax.jit(lambda q, k, v, b, g: mosaic_wy.chunk_wy_mosaic(
        q, k, v, b, g, scale=D ** -0.5, initial_state=None, segment_ids=None, config=cfg))


def pieces(cfg, B, T, H, D, q, k, v, beta, log_decay):
    """(inputs of the pass, the pass) as jitted functions of the padded-free inputs (T a multiple of 64)."""
    doc = jnp.zeros((B, T), jnp.int32)
    ones = jnp.ones((B, T), jnp.float32)
    h0 = jnp.zeros((B, H, D, v.shape[-1]), jnp.float32)
    prepare = jax.jit(lambda q, k, b, g: mosaic_wy._pass_inputs(cfg, q, k, b, g, doc, ones, ones, scale=D ** -0.5,
                                                                segmented=False, interpret=False))
    run = jax.jit(lambda q, k, v, t, vec, d, surv: mosaic_wy._forward_pass(
        cfg, q, k, v, t, vec, d, surv, h0, scale=D ** -0.5, segmented=False, interpret=False))
    return prepare, run


def with_residuals(fn):
    """`jax.vjp` of the call, jitted: the forward under differentiation, residuals included (returned, so kept)."""
    return jax.jit(lambda *a: jax.vjp(lambda *x: fn(*x), *a))


def errors(cfg):
    B, T, H, D = (int(x) for x in FLAGS.error_size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D, seed=1)
    o, s = forward(cfg, D)(q, k, v, beta, log_decay)
    f32 = lambda x: x.astype(jnp.float32)
    o_ref, s_ref = jax.jit(lambda *a: recurrent_scan(*a, scale=D ** -0.5, initial_state=None, segment_ids=None))(
        f32(q), f32(k), f32(v), beta, log_decay)
    rel = lambda x, r: float(np.linalg.norm(np.float64(x) - np.float64(r)) / np.linalg.norm(np.float64(r)))
    return f"{rel(o, o_ref):.2e}, {rel(s, s_ref):.2e}"


def main(argv):
    del argv
    print(f"# {jax.devices()[0].device_kind}, jax {jax.__version__}")
    header = ["size", "variant", "pass inputs", "mosaic pass", "mosaic fwd", "triton fwd"]
    if FLAGS.residuals:
        header += ["mosaic fwd with residuals", "triton fwd with residuals"]
    if FLAGS.fwd_bwd:
        header.append("mosaic fwd+bwd")
    if FLAGS.error_size:
        header.append(f"rel. error o, state ({FLAGS.error_size})")
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    ms = lambda fn, *a: timing.marginal_ms(fn, *a, iters=FLAGS.iters)
    for size in FLAGS.sizes:
        B, T, H, D, *value_dim = (int(x) for x in size.split("x"))
        V = value_dim[0] if value_dim else D
        q, k, v, beta, log_decay = inputs(B, T, H, D, V=V)
        triton, triton_residuals = "-", "-"
        triton_call = lambda *a: deltajax.gated_deltanet(*a, scale=D ** -0.5, impl="pallas")
        if FLAGS.triton:
            triton = f"{ms(jax.jit(lambda *a: triton_call(*a)[0]), q, k, v, beta, log_decay):.3f}"
        if FLAGS.residuals:
            triton_residuals = f"{ms(with_residuals(triton_call), q, k, v, beta, log_decay):.3f}"
        for name in FLAGS.variants:
            try:
                cfg = config_of(name, B * H, D, V)
                cells = ["-", "-"]
                if FLAGS.pieces:
                    prepare, run = pieces(cfg, B, T, H, D, q, k, v, beta, log_decay)
                    pass_inputs = prepare(q, k, beta, log_decay)
                    cells = [f"{ms(prepare, q, k, beta, log_decay):.3f}", f"{ms(run, q, k, v, *pass_inputs):.3f}"]
                cells.append(f"{ms(forward(cfg, D), q, k, v, beta, log_decay):.3f}")
                row = [size, name] + cells + [triton]
                if FLAGS.residuals:
                    call = lambda *a: mosaic_wy.chunk_wy_mosaic(*a, scale=D ** -0.5, initial_state=None,
                                                                segment_ids=None, config=cfg)
                    row += [f"{ms(with_residuals(call), q, k, v, beta, log_decay):.3f}", triton_residuals]
                if FLAGS.fwd_bwd:
                    row += training_step_cells(ms, [cfg], D, (q, k, v, beta, log_decay))
                if FLAGS.error_size:
                    row.append(errors(cfg))
            except Exception as e:  # a variant that fails to lower or run is reported, not fatal
                row = [size, name, f"failed: {type(e).__name__}: {str(e)[:300]}"]
            print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    app.run(main)
