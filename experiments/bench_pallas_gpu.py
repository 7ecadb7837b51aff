"""Times the Pallas GPU WY kernels one by one and end to end, for a few configurations, on Gated DeltaNet.

    python experiments/bench_pallas_gpu.py --sizes=8x2048x16x128 --variants=default,bv128,warps8

Each variant overrides fields of `wy_chunk.default_config` (see VARIANTS). Rows: the inverse kernel (T), the
forward pass (with and without saving chunk states), the reverse pass, the gradient kernel, then forward and
forward+backward through `chunk_wy` (medians of --iters runs with block_until_ready).
"""

from __future__ import annotations

import dataclasses

from absl import app, flags
import jax
import jax.numpy as jnp

from deltajax.kernels.gpu import wy_chunk
import _timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (K = V = D, Hv = H).")
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "q/k/v dtype (the config follows it).")
flags.DEFINE_enum("timing", "marginal", sorted(_timing.METHODS), "How calls are timed (`_timing.time_ms`): "
                  "marginal (device time of one more queued call), pipelined (a queue's time per call) or each "
                  "(each call waited for).")
flags.DEFINE_integer("iters", 20, "Calls per timed queue (marginal: queues of iters and 3 iters; each: calls).")
flags.DEFINE_bool("per_kernel", True, "Also time each kernel alone.")
flags.DEFINE_bool("grads_only", False, "Time only the gradient kernel(s) (`_grads`, its XLA sums included); the "
                  "other columns are left empty (nan).")
flags.DEFINE_string("error_size", "2x1024x4x128", "BxTxHxD where each variant's error against the fp32 scan "
                    "(on the same bf16 inputs) is measured; empty to skip.")
flags.DEFINE_bool("forward_only", False, "Time only the forward: its kernels and the whole call (other columns nan).")
flags.DEFINE_bool("interpret", False, "Run in Pallas's interpreter (a smoke test of this script on CPU).")

VARIANTS = {
    "default": {},
    # float16 inputs: each fp16 tile as an exact bf16 pair (the default until 2026-12-07), or fp16 pairs throughout.
    "bf16_pairs": dict(dots="split", grad_dots="split", state_dots="split", grad_k_dots="split"),
    "fp16_pairs": dict(state_dots="fp16_split", grad_k_dots="fp16_split"),
    # The sequential passes read each chunk's scalars formed in XLA (`Config.pass_scalars`), or form them inline.
    "scalars_stored": dict(pass_scalars="stored"),
    "scalars_inline": dict(pass_scalars="inline"),
    # The reverse pass's state-free scale P^T dO formed chunk-parallel before it, or in every step
    # (`Config.reverse_scores`).
    "reverse_scores_stored": dict(reverse_scores="stored"),
    "reverse_scores_inline": dict(reverse_scores="inline"),
    # The chunk-parallel kernels launched heads fastest instead of chunks fastest (`common.GRID_ORDERS`).
    "heads_first": dict(grid_order="heads"),
    "chunks_first": dict(grid_order="chunks"),
    # Chunks of 128: half the sequential steps, each twice as long.
    "c128": dict(chunk_size=128),
    "c128_ps2": dict(chunk_size=128, pass_stages=2),
    "c128_ps1": dict(chunk_size=128, pass_stages=1),
    "c128_inv2": dict(chunk_size=128, inverse_warps=2),
    "c128_inv4": dict(chunk_size=128, inverse_warps=4),
    "c128_warps8": dict(chunk_size=128, warps=8),
    "c128_batched": dict(chunk_size=128, inverse_method="batched16"),
    "c128_ps2_batched": dict(chunk_size=128, pass_stages=2, inverse_method="batched16"),
    "c128_ps1_batched": dict(chunk_size=128, pass_stages=1, inverse_method="batched16"),
    # Storage between kernels (wy_chunk.INVERSE_STORAGES, STATE_STORAGES): "storage_fp32" is the default before
    # 2026-11-24 (T and the saved states in fp32).
    "storage_fp32": dict(inverse_storage="fp32", state_storage="fp32"),
    "inverse_fp32": dict(inverse_storage="fp32"),
    "states_fp32": dict(state_storage="fp32"),
    # float16 inputs: the saved states as the "fp16" products read them (fp16 tiles with factors; the default where
    # the passes' V block holds the gradient kernel's), and at few heads (passes in V blocks of 16) the gradient
    # kernel in V blocks of 16 too, without and with them.
    "states_fp16": dict(state_storage="fp16"),
    "grad_bv16": dict(grad_block_v=16),
    "grad_bv16_states_fp16": dict(grad_block_v=16, state_storage="fp16"),
    "recompute_u_dx": dict(grad_method="staged", grad_block_v=64, grad_block_k=128, grad_k_warps=8,
                           grads_from_passes=False),
    "staged": dict(grad_method="staged", grad_block_v=64, grad_block_k=128, grad_k_warps=8),
    "merged": dict(grad_method="merged", grad_block_v=32, grad_block_k=128, grad_k_warps=4),
    "merged_warps8": dict(grad_method="merged", grad_block_v=32, grad_block_k=128, grad_k_warps=8),
    "merged_bv64": dict(grad_method="merged", grad_block_v=64, grad_block_k=128, grad_k_warps=4),
    "merged_bv64_warps8": dict(grad_method="merged", grad_block_v=64, grad_block_k=128, grad_k_warps=8),
    "merged_bv16": dict(grad_method="merged", grad_block_v=16, grad_block_k=128, grad_k_warps=4),
    "merged_warps2": dict(grad_method="merged", grad_block_v=32, grad_block_k=128, grad_k_warps=2),
    "all_bf16": dict(dots="bf16", state_dots="bf16", inverse_dots="bf16", grad_dots="bf16",
                     grad_k_dots="bf16"),
    "all_tf32": dict(dots="tf32", state_dots="tf32", inverse_dots="tf32", grad_dots="tf32",
                     grad_k_dots="tf32"),
    "fwd_bf16": dict(dots="bf16", state_dots="bf16"),
    "grad_bf16": dict(grad_dots="bf16", grad_k_dots="bf16"),
    # bf16 operands only where the correlated-keys case allows it (part 2's S_0 / dS_end / dA products).
    "grad_k_bf16": dict(grad_k_dots="bf16"),
    # ... and K S_0 / K dS wherever they appear (passes, gradient part 1); both together: "tolerant_bf16".
    "state_bf16": dict(state_dots="bf16"),
    "tolerant_bf16": dict(grad_k_dots="bf16", state_dots="bf16"),
    # "split" everywhere: the defaults before 2026-11-23 evening.
    "all_split": dict(grad_k_dots="split", state_dots="split"),
    # "staged" (K = 256): part 2 in two pipeline stages (its compiled dq wrong on bf16 states; the default until
    # 2026-12-04) and fp32 saved states with "split" part-2 products (the default of 2026-12-04-05): against
    # "default" (one stage, `wy_chunk.STAGED_GRAD_K_STAGES`), what one stage costs.
    "part2_two_stages": dict(grad_k_stages=2),
    "fp32_states": dict(grad_k_dots="split"),
    # Output chunk-parallel after a state-only pass (wy_chunk.OUTPUT_METHODS); "split" with the pass's BV as the
    # default picks it, "split_bv16" / "split_bv32" with it fixed.
    "split": dict(output_method="split"),
    "split_obv64": dict(output_method="split", output_block_v=64),
    "split_owarps8": dict(output_method="split", output_warps=8),
    "split_bv16": dict(output_method="split", block_v=16),
    "split_bv32": dict(output_method="split", block_v=32),
    "split_bv64": dict(output_method="split", block_v=64),
    "split_warps2": dict(output_method="split", warps=2),
    "split_warps8": dict(output_method="split", warps=8),
    "split_stages1": dict(output_method="split", stages=1),
    "split_stages3": dict(output_method="split", stages=3),
    "split_pair": dict(output_method="split", pass_inverse_storage="split"),
    "split_pstages3": dict(output_method="split", pass_stages=3),
    "split_pstages4": dict(output_method="split", pass_stages=4),
    "split_pstages3_pair": dict(output_method="split", pass_stages=3, pass_inverse_storage="split"),
    "split_pstages3_prefetch": dict(output_method="split", pass_stages=3, prefetch=True),
    "fused_pstages3": dict(output_method="fused", pass_stages=3),
    # One program per SM at 2x8192x16x128 (128 of BV 32 instead of 256 of BV 16), three stages as `sequential_layout`
    # gives such calls.
    "bv32_pstages3": dict(output_method="split", block_v=32, pass_stages=3, reverse_inverse_storage="split"),
    # The whole layout `sequential_layout` gives 16-bit calls there (the reverse pass reading stored scores too).
    "bv32_pstages3_stored": dict(output_method="split", block_v=32, pass_stages=3, reverse_inverse_storage="split",
                                 reverse_scores="stored"),
    "fused": dict(output_method="fused"),
    # How the passes read T (fp32, or its bf16 pair "split"): forward pass / reverse pass.
    "fused_pair": dict(output_method="fused", pass_inverse_storage="split", reverse_inverse_storage="split"),
    "split_fp32_t": dict(output_method="split", pass_inverse_storage="fp32", reverse_inverse_storage="fp32"),
    "split_pair_fp32": dict(output_method="split", pass_inverse_storage="split", reverse_inverse_storage="fp32"),
    "split_pair_pair": dict(output_method="split", pass_inverse_storage="split", reverse_inverse_storage="split"),
    "bv16": dict(block_v=16),
    "bv16_warps2": dict(block_v=16, warps=2),
    "bv32": dict(block_v=32),
    "bv128": dict(block_v=128),
    "warps8": dict(warps=8),
    "grad_bv16": dict(grad_block_v=16),
    "grad_bv64": dict(grad_block_v=64),
    "grad_bv128": dict(grad_block_v=128),
    "grad_warps8": dict(grad_warps=8),
    "grad_bv64_warps8": dict(grad_block_v=64, grad_warps=8),
    "stages1": dict(stages=1),
    "stages3": dict(stages=3),
    "inv_warps1": dict(inverse_warps=1),
    "inv_warps2": dict(inverse_warps=2),
    "inv_warps4": dict(inverse_warps=4),
    "inv_warps8": dict(inverse_warps=8),
    # In-chunk inverse methods (wy_chunk.INVERSE_METHODS) and their warps.
    "inv_blocks16": dict(inverse_method="blocks16", inverse_warps=1),
    "inv_blocks16_warps2": dict(inverse_method="blocks16", inverse_warps=2),
    "inv_blocks16_warps4": dict(inverse_method="blocks16", inverse_warps=4),
    "inv_blocks16_warps8": dict(inverse_method="blocks16", inverse_warps=8),
    "inv_batched16": dict(inverse_method="batched16", inverse_warps=1),
    "inv_batched16_warps2": dict(inverse_method="batched16", inverse_warps=2),
    "inv_batched16_warps4": dict(inverse_method="batched16", inverse_warps=4),
    "inv_batched16_warps8": dict(inverse_method="batched16", inverse_warps=8),
    "inv_blocks16_from_a": dict(inverse_method="blocks16_from_a", inverse_warps=1),
    "grad_warps2": dict(grad_warps=2),
    # Gradient methods (wy_chunk.GRAD_METHODS), every field given (the defaults differ by method); "fused" with
    # grad_block_k < K recomputes the V-local terms per K block. Measured: docs/kernels.md.
    "grad_fused": dict(grad_method="fused", grad_block_v=32, grad_block_k=128, grad_warps=4),
    "grad_fused_bk64": dict(grad_method="fused", grad_block_v=32, grad_block_k=64, grad_warps=4),
    "grad_fused_bk64_bv64": dict(grad_method="fused", grad_block_v=64, grad_block_k=64, grad_warps=4),
    "grad_fused_bk64_warps8": dict(grad_method="fused", grad_block_v=32, grad_block_k=64, grad_warps=8),
    "grad_staged": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=4, grad_k_warps=4),
    "grad_staged_bv32": dict(grad_method="staged", grad_block_v=32, grad_block_k=64, grad_warps=4, grad_k_warps=4),
    "grad_staged_bv128": dict(grad_method="staged", grad_block_v=128, grad_block_k=64, grad_warps=4, grad_k_warps=4),
    "grad_staged_bk128": dict(grad_method="staged", grad_block_v=64, grad_block_k=128, grad_warps=4, grad_k_warps=4),
    "grad_staged_bk128_kwarps8": dict(grad_method="staged", grad_block_v=64, grad_block_k=128, grad_warps=4,
                                       grad_k_warps=8),
    "grad_staged_bk128_bv32_kwarps8": dict(grad_method="staged", grad_block_v=32, grad_block_k=128, grad_warps=4,
                                            grad_k_warps=8),
    "grad_staged_bk32": dict(grad_method="staged", grad_block_v=64, grad_block_k=32, grad_warps=4, grad_k_warps=4),
    "grad_staged_warps8": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=8, grad_k_warps=8),
    "grad_staged_kwarps8": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=4, grad_k_warps=8),
    "grad_staged_bv32_warps8": dict(grad_method="staged", grad_block_v=32, grad_block_k=64, grad_warps=8,
                                     grad_k_warps=4),
    "grad_staged_warps2": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=2, grad_k_warps=2),
    "grad_staged_stages1": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=4,
                                 grad_k_warps=4, stages=1),
    "grad_staged_bf16": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grad_warps=4,
                              grad_k_warps=4, grad_dots="bf16", grad_k_dots="bf16",
                              inverse_dots="bf16"),
}


def inputs(B, T, H, D):
    return kernel_inputs(B, T, H, D, per_channel=False, dtype=jnp.dtype(FLAGS.dtype))


def variant_errors(cfg):
    """Relative errors of o and of every gradient against the fp32 scan on the same `--dtype` inputs."""
    from deltajax.rules.scan import recurrent_scan
    import numpy as np

    B, T, H, D = (int(x) for x in FLAGS.error_size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D)
    # The timing config was built for the benchmark size; the head counts must match the error size.
    cfg = dataclasses.replace(cfg, scale=D ** -0.5, key_heads=H, value_heads=H)

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


def time_ms(fn, *args, iters):
    return _timing.time_ms(fn, *args, iters=iters, method=FLAGS.timing)


def _grads(cfg, *args):
    """`wy_chunk._grads` on the 12 arrays it always takes, then u and dx saved by the passes (if any)."""
    return wy_chunk._grads(cfg, *args[:12], saved=args[12:] or None)


def grads_row(size, name, cfg, gargs):
    """--grads_only: the gradient kernels, and for "staged" its first kernel alone (dv needs no other)."""
    grads = jax.jit(lambda *a: _grads(cfg, *a))
    note = ""
    if cfg.grad_method == "staged":
        first = jax.jit(lambda *a: _grads(cfg, *a)[2])  # XLA drops the second kernel
        note = f"V-block kernel alone {time_ms(first, *gargs, iters=FLAGS.iters):.3f} ms"
    cells = ["nan"] * 4 + [f"{time_ms(grads, *gargs, iters=FLAGS.iters):.3f}", "nan", "nan", note]
    return f"| {size} | {name} | " + " | ".join(cells) + " |"


def main(argv):
    del argv
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}, jax {jax.__version__}, {FLAGS.dtype}")
    print("| size | variant | inverse | fwd pass | fwd pass+states | reverse | grads | fwd | fwd+bwd | rel. error "
          "o, dq, dk, dv, dbeta, dlog_decay |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    prepared = {}  # --grads_only: the gradient kernels' inputs per size and forward configuration
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        q, k, v, beta, log_decay = inputs(B, T, H, D)
        for name in FLAGS.variants:
            cfg = wy_chunk.default_config(q, v, scale=D ** -0.5, chunk_size=64, delta=True, segmented=False,
                                          interpret=FLAGS.interpret)
            try:
                cfg = wy_chunk.replace_config(cfg, **VARIANTS[name])
                cells = []
                if FLAGS.per_kernel:
                    g = wy_chunk._in_chunk_cumsum(cfg, log_decay)  # [hi, lo]
                    doc = jnp.zeros((B, T), jnp.int32)
                    ones = jnp.ones((B, T), jnp.float32)
                    h0 = jnp.zeros((B, H, D, D), jnp.float32)
                    inv = jax.jit(lambda k, b, g: wy_chunk._inverses(cfg, k, b, g, doc))  # the forward's T
                    # The gradient kernels' inputs depend on no grad_* field but grad_dots: made once per size.
                    key = (size, cfg.state_storage, cfg.grads_from_passes, wy_chunk.replace_config(
                        cfg, grad_block_v=0, grad_block_k=0, grad_method="", grad_warps=0, grad_k_warps=0,
                        grad_k_dots="", state_storage="fp32"))
                    if FLAGS.grads_only and key in prepared:
                        print(grads_row(size, name, cfg, prepared[key]), flush=True)
                        continue
                    t = inv(k, beta, g)
                    fwd0 = jax.jit(lambda q, k, v, b, t, g: wy_chunk._forward_pass(
                        cfg, q, k, v, b, t, g, doc, ones, ones, h0, with_states=False))
                    fwd1 = jax.jit(lambda q, k, v, b, t, g: wy_chunk._forward_pass(
                        cfg, q, k, v, b, t, g, doc, ones, ones, h0, with_states=True))
                    if FLAGS.forward_only:
                        cells += [time_ms(inv, k, beta, g, iters=FLAGS.iters),
                                  time_ms(fwd0, q, k, v, beta, t, g, iters=FLAGS.iters)] + [float("nan")] * 3
                    else:
                        o, final, starts, *u = fwd1(q, k, v, beta, t, g)
                        rev = jax.jit(lambda q, k, b, t, g, do, df: wy_chunk._reverse_pass(
                            cfg, q, k, b, t, g, doc, ones, ones, do, df))
                        _, t_reverse, t_grads = wy_chunk._inverses(cfg, k, beta, g, doc, for_grads=True)
                        dh0, dends, *dx = rev(q, k, beta, t_reverse, g, o, final)
                        grads = jax.jit(lambda *a: _grads(cfg, *a))
                        gargs = (q, k, v, beta, t_grads, g, doc, ones, ones, starts, dends, o, *u, *dx)
                        if FLAGS.grads_only:
                            prepared[key] = gargs
                            print(grads_row(size, name, cfg, gargs), flush=True)
                            continue
                        cells += [time_ms(inv, k, beta, g, iters=FLAGS.iters),
                                  time_ms(fwd0, q, k, v, beta, t, g, iters=FLAGS.iters),
                                  time_ms(fwd1, q, k, v, beta, t, g, iters=FLAGS.iters),
                                  time_ms(rev, q, k, beta, t_reverse, g, o, final, iters=FLAGS.iters),
                                  time_ms(grads, *gargs, iters=FLAGS.iters)]
                        del t, t_reverse, t_grads, o, final, starts, dh0, dends, u, dx, gargs
                else:
                    cells += [float("nan")] * 5
                run = lambda q, k, v, b, g: wy_chunk.chunk_wy(q, k, v, b, g, scale=D ** -0.5, initial_state=None,
                                                                 segment_ids=None, interpret=cfg.interpret, config=cfg,
                                                                 chunk_size=cfg.chunk_size)
                fwd = jax.jit(lambda *a: run(*a)[0])
                loss = lambda *a: jnp.sum(run(*a)[0].astype(jnp.float32) ** 2)
                bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
                cells += [time_ms(fwd, q, k, v, beta, log_decay, iters=FLAGS.iters),
                          float("nan") if FLAGS.forward_only else time_ms(bwd, q, k, v, beta, log_decay,
                                                                          iters=FLAGS.iters)]
                errors = variant_errors(cfg) if FLAGS.error_size else ""
                print(f"| {size} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + f" | {errors} |", flush=True)
            except Exception as error:  # a variant that does not compile (registers, shared memory) is reported
                print(f"| {size} | {name} | failed: {type(error).__name__}: {str(error)[:300]} |", flush=True)


if __name__ == "__main__":
    app.run(main)
