"""Times the Pallas GPU KDA kernels (`kernels/gpu/kda.py`) one by one and end to end, for named config variants.

    python experiments/bench_kda_gpu.py --sizes=8x2048x16x128 --variants=default,rows,bv128
    python experiments/bench_kda_gpu.py --interpret --sizes=1x128x2x32 --iters=1   # CPU smoke run

Each variant overrides fields of `kda.default_config`, or with `--config=mosaic` of `kda.mosaic_config` (see
VARIANTS; bf16 inputs or --dtype, Hv = H, K = D, V = D or --value_dim, chunk 64).
Columns: the XLA glue before the kernels (compensated cumsum), the prepare kernel (P, T), the forward pass without
and with the saved chunk states, the reverse pass, the two gradient kernels, then forward and forward+backward through
`kda_chunk` (medians of --iters runs, block_until_ready), and optionally the relative errors against the fp32 scan
on the same inputs. A variant that fails to compile is reported in its row, the others still run.
"""

from __future__ import annotations

import dataclasses
import time

from absl import app, flags
import jax
import jax.numpy as jnp

from deltajax.kernels.gpu import kda
import _timing as timing  # experiments/
from _kernel_inputs import kernel_inputs  # experiments/

FLAGS = flags.FLAGS
flags.DEFINE_list("sizes", ["8x2048x16x128"], "BxTxHxD sizes (K = D, V = D or --value_dim, Hv = H).")
flags.DEFINE_integer("value_dim", 0, "V apart from D (0: V = D), in --sizes and --error_size.")
flags.DEFINE_list("variants", ["default"], "Names from VARIANTS.")
flags.DEFINE_enum("dtype", "bfloat16", ["bfloat16", "float16", "float32"], "q/k/v dtype (`--config` follows it).")
flags.DEFINE_enum("config", "default", ["default", "mosaic"],
                  "The config the variants change: `kda.default_config` (the Triton kernels) or `kda.mosaic_config` "
                  "(the dispatch's \"mosaic\" implementation at each size).")
flags.DEFINE_integer("iters", 20, "Timed runs (median reported).")
flags.DEFINE_bool("per_kernel", True, "Also time each kernel alone.")
flags.DEFINE_string("error_size", "", "BxTxHxD where each variant's error against the fp32 scan (on the same "
                    "bf16 inputs) is measured; empty to skip.")
flags.DEFINE_bool("verbose", False, "Print each stage (compile + timing) as it finishes, with seconds elapsed.")
flags.DEFINE_bool("interpret", False, "Run in Pallas's interpreter (a smoke test of this script on CPU).")

VARIANTS = {
    # Stored operands (pass stages 1), prepare in blocks of 32 channels, pair gradients 32 channels per program at 4
    # warps, V gradients at 8 warps, inverse "blocks" for bf16 (docs/kernels.md, KDA, 2026-11-25).
    "default": {},
    # For --dtype=float16: the bf16 default's plain bf16 products (and its bf16 states), or one group of them
    # (docs/kernels.md, "float16 products for float16 inputs").
    "tolerant_bf16": dict(state_dots="bf16", grad_k_dots="bf16", state_storage="bf16"),
    "state_bf16": dict(state_dots="bf16"),
    "grad_k_bf16": dict(grad_k_dots="bf16"),
    # (The "grad_*" variants time the V gradient kernel of the two-kernel path: `fused_pair_grads=False`.)
    # The gates' compensated cumsum in XLA (`CumulativeLogDecay.of`) instead of `_cumulative_kernel`.
    "cumsum_xla": dict(cumsum="xla"),
    # The cumsum kernel writing only G, the forward's operands by their own kernel.
    "cumsum_kernel": dict(cumsum="kernel"),
    # The chunk-parallel kernels launched heads fastest instead of chunks fastest (`common.GRID_ORDERS`).
    "heads_first": dict(grid_order="heads"),
    "chunks_first": dict(grid_order="chunks"),
    # The defaults until 2026-11-25: every kernel sat at 255 registers and spilled.
    "previous": dict(operands="inline", cumsum="kernel", pass_stages=2, block_k=128, pair_block_k=128, pair_warps=8,
                     grad_warps=4, grad_k_splits=1, fused_pair_grads=False),
    "inline": dict(operands="inline", cumsum="kernel", pass_stages=2),
    "rows": dict(inverse="rows"),
    "prep_blocks": dict(prepare="blocks"),  # 16 x 16 block prepare (measured 2.4x slower once)
    "prep_blocks_rows": dict(prepare="blocks", inverse="rows"),  # row substitution as 16-row strips (the fp32 default)
    # The partner loop of prepare gathering each sub-chunk's partner row by a masked sum (the default loads it).
    "partner_gathered": dict(partner_rows="gathered"),
    "partner_loaded": dict(partner_rows="loaded"),
    # No plain-bf16 products (the default before 11-25), so fp32 saved states.
    "all_split": dict(state_dots="split", grad_k_dots="split", state_storage="fp32"),
    "states_fp32": dict(state_storage="fp32"),  # the saved states as before 11-27 (`kda.STATE_STORAGES`)
    # (A (.) Q) S_0 of the output with plain bf16 operands, as until 2026-11-27 evening (`Config.output_dots`).
    "output_bf16": dict(output_dots="bf16"),
    # The V gradient kernel forming u and dx from T, P and the states, as before 11-27 (the default reads them as
    # the passes saved them, `Config.grads_from_passes`).
    "recomputed_u_dx": dict(grads_from_passes=False, grad_k_splits=1, fused_pair_grads=False),
    "sub_chunks_only": dict(span_limit=None),
    # Only the per-program span switch: prepare and the pair kernel always carry the sub-chunk code (before 11-26).
    "per_program_check": dict(call_span_check=False),  # never one reference per chunk (kda.SPAN_LIMIT)
    "bv16": dict(block_v=16),
    "bv32": dict(block_v=32),
    "warps2": dict(warps=2),
    "warps8": dict(warps=8),
    "reverse_warps8": dict(reverse_warps=8),
    # Two pipeline stages in the passes: at BV 64 with stored operands 295 KB of shared memory asked (fails on the
    # H100); at BV 16 they fit (the default where that leaves at most one program per SM, `kda.NARROW_PASS_STAGES`).
    "pass_stages1": dict(pass_stages=1),
    "pass_stages2": dict(pass_stages=2),
    "pass_stages2_heads_first": dict(pass_stages=2, grid_order="heads"),
    "pass_stages2_warps2": dict(pass_stages=2, warps=2, reverse_warps=2),
    "pass_stages2_warps8": dict(pass_stages=2, warps=8, reverse_warps=8),
    "bv32_stages2": dict(block_v=32, pass_stages=2),  # one program per SM at 2x8192x16x128
    # bf16's layout at 1x32768x16x128: 128 programs of BV 16, two stages, the split forward for inference.
    "bv16_stages2_split": dict(block_v=16, pass_stages=2, primal_forward="split"),
    "split_forward": dict(forward="split"),  # a pass carrying only the state, then the output chunk-parallel
    # the output kernel reading fp32 start states (with bf16 ones it rounds S_0 in (A (.) Q) S_0)
    "split_forward_fp32": dict(forward="split", state_storage="fp32"),
    "split_forward_fp32_obv128": dict(forward="split", state_storage="fp32", output_block_v=128),
    # the forward pass in Mosaic GPU (Hopper), state blocks of 64 or 32 columns
    "mosaic_pass": dict(pass_backend="mosaic", mosaic_block_v=64),
    "mosaic_pass_bv32": dict(pass_backend="mosaic", mosaic_block_v=32),
    "mosaic_pass_output_bf16": dict(pass_backend="mosaic", output_dots="bf16"),
    "mosaic_shared_head": dict(pass_backend="mosaic", mosaic_shared_head=True),  # one CTA per head
    "mosaic_reverse": dict(pass_backend="mosaic", reverse_backend="mosaic"),  # both passes in Mosaic GPU
    "mosaic_reverse_bv32": dict(pass_backend="mosaic", reverse_backend="mosaic", mosaic_block_v=32),
    # both at K = 256, where they take state blocks of 16 columns only (`mosaic_kda.WIDE_KEY_BLOCK_V`; opt-in)
    "mosaic_reverse_bv16": dict(pass_backend="mosaic", reverse_backend="mosaic", mosaic_block_v=16),
    "mosaic_shared_head_reverse": dict(pass_backend="mosaic", mosaic_shared_head=True, reverse_backend="mosaic"),
    "mosaic_shared_head_output_bf16": dict(pass_backend="mosaic", mosaic_shared_head=True, output_dots="bf16"),
    # the fused gradient kernel in Mosaic GPU (`Config.grads_backend`, `mosaic_kda_grads.py`), alone and with both
    # Mosaic passes
    # The backward's stored operands saved by the forward instead of formed again (`Config.backward_operands`),
    # with the Triton kernels and with both Mosaic passes (`kda.mosaic_config` at 64+ value heads).
    "backward_operands_saved": dict(backward_operands="saved"),
    "backward_operands_formed": dict(backward_operands="formed"),
    "mosaic_reverse_operands_saved": dict(pass_backend="mosaic", reverse_backend="mosaic", backward_operands="saved"),
    "mosaic_reverse_operands_formed": dict(pass_backend="mosaic", reverse_backend="mosaic",
                                           backward_operands="formed"),
    "mosaic_grads": dict(grads_backend="mosaic"),
    "mosaic_reverse_grads": dict(pass_backend="mosaic", reverse_backend="mosaic", grads_backend="mosaic"),
    "split_forward_obv32": dict(forward="split", output_block_v=32),
    "split_forward_obv128": dict(forward="split", output_block_v=128),
    "split_forward_warps8": dict(forward="split", warps=8),
    "bk16": dict(block_k=16),
    "bk64": dict(block_k=64),
    "bk128": dict(block_k=128),
    "prep_warps1": dict(prepare_warps=1),
    "prep_warps2": dict(prepare_warps=2),
    "prep_warps8": dict(prepare_warps=8),
    "prep_warps2_bk64": dict(prepare_warps=2, block_k=64),
    "prep_warps4": dict(prepare_warps=4),
    "grad_bv16": dict(grad_block_v=16, fused_pair_grads=False),
    "grad_bv64": dict(grad_block_v=64, fused_pair_grads=False),
    "grad_warps4": dict(grad_warps=4, fused_pair_grads=False),
    # 2 programs per chunk, 64 value columns each
    "grad_split2": dict(grad_v_splits=2, grad_k_splits=1, grad_warps=8, fused_pair_grads=False),
    "grad_split4": dict(grad_v_splits=4, grad_k_splits=1, grad_warps=8, fused_pair_grads=False),
    "grad_split2_warps4": dict(grad_v_splits=2, grad_k_splits=1, grad_warps=4, fused_pair_grads=False),
    "grad_split4_warps4": dict(grad_v_splits=4, grad_k_splits=1, grad_warps=4, fused_pair_grads=False),
    # the V gradient kernel before 2026-11-29
    "grad_one_program": dict(grad_k_splits=1, grad_warps=8, fused_pair_grads=False),
    # 2 programs per chunk, 64 channels each (dP on one, dM on the other); the default at 4 warps
    "grad_ksplit2": dict(grad_k_splits=2, grad_warps=8, fused_pair_grads=False),
    "grad_ksplit2_warps4": dict(grad_k_splits=2, grad_warps=4, fused_pair_grads=False),
    "grad_ksplit2_bv64": dict(grad_k_splits=2, grad_block_v=64, fused_pair_grads=False),
    "grad_ksplit2_bv64_warps4": dict(grad_k_splits=2, grad_block_v=64, grad_warps=4, fused_pair_grads=False),
    "grad_bv64_warps4": dict(grad_block_v=64, grad_warps=4, fused_pair_grads=False),
    # The pair terms in the V gradient kernel's epilogue (`Config.fused_pair_grads`, the 16-bit default; these inputs'
    # chunks all take one reference), `pair_block_k` channels per program (32 by default), each forming both squares;
    # "two_grad_kernels" is the V and the pair kernel as before 2026-11-29 (and as calls with longer spans run them);
    # other channel blocks: "pair_bk*" below.
    "two_grad_kernels": dict(fused_pair_grads=False),
    "fused_bk64_warps8": dict(pair_block_k=64, grad_warps=8),
    "fused_warps8": dict(grad_warps=8),
    "fused_warps2": dict(grad_warps=2),
    "fused_bk128_warps8": dict(pair_block_k=128, grad_warps=8),
    "fused_bv16": dict(fused_grad_block_v=16),
    "fused_bv32": dict(fused_grad_block_v=32),
    "fused_bv64": dict(fused_grad_block_v=64),
    "fused_bv128": dict(fused_grad_block_v=128),
    "two_grad_kernels_bv64": dict(fused_pair_grads=False, grad_block_v=64),
    "fused_bk16_warps2": dict(pair_block_k=16, grad_warps=2),
    # the pair kernel's channel blocks (with `fused_pair_grads` also the fused kernel's)
    "pair_bk16": dict(pair_block_k=16),
    "pair_bk64": dict(pair_block_k=64),
    "pair_bk128": dict(pair_block_k=128),
    "pair_warps2": dict(pair_warps=2),
    "pair_warps8": dict(pair_warps=8),
    "stages1": dict(stages=1),
    "stages3": dict(stages=3),
}


_START = time.perf_counter()


def log(what):
    if FLAGS.verbose:
        print(f"  [{time.perf_counter() - _START:7.1f} s] {what}", flush=True)


def median_ms(fn, *args, iters):
    result = timing.median_ms(fn, *args, iters=iters, warmup=1)
    log(f"timed {getattr(fn, '__name__', fn)}: {result:.3f} ms")
    return result


def inputs(B, T, H, D, seed=0):
    return kernel_inputs(B, T, H, D, per_channel=True, seed=seed, value_dim=FLAGS.value_dim or None,
                         dtype=jnp.dtype(FLAGS.dtype))


def make_config(name, q, v, D):
    """`--config`'s config of these inputs with the variant's fields."""
    make = kda.mosaic_config if FLAGS.config == "mosaic" else kda.default_config
    cfg = make(q, v, scale=D ** -0.5, chunk_size=64, segmented=False, interpret=FLAGS.interpret)
    return dataclasses.replace(cfg, **VARIANTS[name])


def run_fn(cfg, D):
    return lambda q, k, v, b, g: kda.kda_chunk(q, k, v, b, g, scale=D ** -0.5, initial_state=None, segment_ids=None,
                                                interpret=cfg.interpret, config=cfg)


def variant_errors(name):
    """Relative errors of o, final state and every gradient against the fp32 scan on the same `--dtype` inputs."""
    import numpy as np
    from deltajax.rules.scan import recurrent_scan

    B, T, H, D = (int(x) for x in FLAGS.error_size.split("x"))
    q, k, v, beta, log_decay = inputs(B, T, H, D, seed=1)
    cfg = make_config(name, q, v, D)
    f32 = lambda x: x.astype(jnp.float32)
    weights = jnp.cos(0.37 * jnp.arange(v.size, dtype=jnp.float32)).reshape(v.shape)

    def loss(fn, *a):
        o, s = fn(*a)
        return jnp.sum(o.astype(jnp.float32) * weights) + jnp.sum(s)

    kernel = run_fn(cfg, D)
    scan = lambda q, k, v, b, g: recurrent_scan(q, k, v, b, g, scale=D ** -0.5, initial_state=None,
                                                 segment_ids=None)
    o, s = jax.jit(kernel)(q, k, v, beta, log_decay)
    o_ref, s_ref = jax.jit(scan)(f32(q), f32(k), f32(v), beta, log_decay)
    grads = jax.jit(jax.grad(lambda *a: loss(kernel, *a), argnums=(0, 1, 2, 3, 4)))(q, k, v, beta, log_decay)
    grads_ref = jax.jit(jax.grad(lambda *a: loss(scan, *a), argnums=(0, 1, 2, 3, 4)))(
        f32(q), f32(k), f32(v), beta, log_decay)
    rel = lambda x, r: float(np.linalg.norm(np.float64(x) - np.float64(r)) / np.linalg.norm(np.float64(r)))
    return ", ".join(f"{rel(x, r):.1e}" for x, r in zip((o, s) + grads, (o_ref, s_ref) + grads_ref))


def kernel_times(cfg, B, T, H, D, q, k, v, beta, log_decay):
    """ms of: the gates' cumsum (with the forward's operands for cumsum="with_operands"), prepare (with R), the
    operand kernel (0 when inline; the backward runs it in any case), forward pass, forward pass + states, reverse
    pass, the V and the pair gradient kernels (where `fused_pair_grads` applies: the fused kernel, as these inputs'
    chunks all take one reference, and 0)."""
    it = FLAGS.iters
    doc = jnp.zeros((B, T), jnp.int32)
    ones = jnp.ones((B, T), jnp.float32)
    h0 = jnp.zeros((B, H, D, v.shape[-1]), jnp.float32)
    # with `backward_operands="saved"` the forward's operand kernel also writes the backward's tiles
    phase = "both" if cfg.backward_operands == "saved" and cfg.operands == "stored" else "forward"
    cum = jax.jit(lambda q, k, g: kda._gates_and_operands(cfg, q, k, g, ones, ones, phase))
    g, glo, _ = cum(q, k, log_decay)
    prep = jax.jit(lambda q, k, g, glo, b: kda._prepare(cfg, q, k, g, glo, b, doc, with_r=True))
    t, p, r = prep(q, k, g, glo, beta)
    log('prep' + ' ran')
    source = jax.jit(lambda q, k, g, glo: kda._source(cfg, q, k, g, glo, ones, ones, "forward"))
    src = source(q, k, g, glo)
    back_source = jax.jit(lambda q, k, g, glo: kda._source(cfg, q, k, g, glo, ones, ones, "backward"))
    back_src = back_source(q, k, g, glo)
    fwd = lambda states: jax.jit(lambda src, v, b, t, p: kda._forward_pass(cfg, src, v, b, t, p, h0,
                                                                            with_states=states))
    fwd0, fwd1 = fwd(False), fwd(True)
    o, final, starts, u_pair = fwd1(src, v, beta, t, p)
    log('fwd1' + ' ran')
    rev = jax.jit(lambda src, b, t, p, do, df: kda._reverse_pass(cfg, src, b, t, p, do, df))
    dh0, dends, dx_pair = rev(back_src, beta, t, p, o, final)
    log('rev' + ' ran')
    saved = u_pair + dx_pair if cfg.grads_from_passes else (t, p)
    gargs = (back_src, q, k, v, beta, g, glo, doc, ones, ones, saved, r, starts, dends, o)
    fused_applies = cfg.fused_pair_grads and cfg.span_limit is not None and cfg.call_span_check
    if fused_applies:
        assert bool(jax.jit(lambda g, glo: kda._when_all_bounded(cfg, g, glo, lambda c: jnp.asarray(c.all_bounded)))(
            g, glo)), "the fused kernel's timing needs inputs whose chunks all take one reference"
        fused = jax.jit(lambda *a: kda._grads_fused(dataclasses.replace(cfg, all_bounded=True), *a))
        grad_times = [median_ms(fused, *gargs, iters=it), 0.0]
    else:
        grads_v = jax.jit(lambda *a: kda._grads_v(cfg, *a))
        dv, dq, dk, dg, de, dbeta, squares = grads_v(*gargs)
        grads_pairs = jax.jit(lambda *a: kda._grads_pairs(cfg, *a))
        pargs = (q, k, g, glo, beta, squares, dq, dk, dg, de)
        grad_times = [median_ms(grads_v, *gargs, iters=it), median_ms(grads_pairs, *pargs, iters=it)]
    return [median_ms(cum, q, k, log_decay, iters=it),
            median_ms(prep, q, k, g, glo, beta, iters=it),
            median_ms(source, q, k, g, glo, iters=it) if cfg.operands == "stored" else 0.0,
            median_ms(fwd0, src, v, beta, t, p, iters=it),
            median_ms(fwd1, src, v, beta, t, p, iters=it),
            median_ms(rev, back_src, beta, t, p, o, final, iters=it)] + grad_times


def main(argv):
    del argv
    dev = jax.devices()[0]
    print(f"# {dev.device_kind}, jax {jax.__version__}, {FLAGS.dtype}, interpret={FLAGS.interpret}")
    header = ["size", "variant", "cumsum (+operands)", "prepare", "operands", "fwd pass", "fwd pass+states", "reverse",
              "grads V", "grads pairs", "fwd", "fwd+bwd"]
    if FLAGS.error_size:
        header.append(f"rel. error o, state, dq, dk, dv, dbeta, dlog_decay ({FLAGS.error_size})")
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    print(rows[0], rows[1], sep="\n")
    for size in FLAGS.sizes:
        B, T, H, D = (int(x) for x in size.split("x"))
        q, k, v, beta, log_decay = inputs(B, T, H, D)
        for name in FLAGS.variants:
            try:
                cfg = make_config(name, q, v, D)
                cells = kernel_times(cfg, B, T, H, D, q, k, v, beta, log_decay) if FLAGS.per_kernel else \
                    [float("nan")] * 8
                run = run_fn(cfg, D)
                fwd = jax.jit(lambda *a: run(*a)[0])
                loss = lambda *a: jnp.sum(run(*a)[0].astype(jnp.float32) ** 2)
                bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))
                cells += [median_ms(fwd, q, k, v, beta, log_decay, iters=FLAGS.iters),
                          median_ms(bwd, q, k, v, beta, log_decay, iters=FLAGS.iters)]
                row = f"| {size} | {name} | " + " | ".join(f"{c:.3f}" for c in cells) + " |"
                if FLAGS.error_size:
                    row += f" {variant_errors(name)} |"
            except Exception as error:  # a variant that does not compile (registers, shared memory) is reported
                row = f"| {size} | {name} | failed: {type(error).__name__}: {str(error)[:300]} |"
            rows.append(row)
            print(row, flush=True)
    print("\n## summary\n" + "\n".join(rows))


if __name__ == "__main__":
    app.run(main)
