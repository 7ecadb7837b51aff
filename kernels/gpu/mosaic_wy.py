"""The sequential passes of the Gated DeltaNet (delta rule, scalar decay) in the chunkwise WY form as Mosaic GPU
kernels: the forward pass, and under differentiation the reverse pass of the state cotangent (`_reverse_step`).

The math is equations (1)-(6) of `wy_chunk` (see its docstring). The chunk-parallel parts are shared with the
Triton path: the compensated in-chunk gates G = hi + lo and the in-chunk inverse T of eq. (2) come from
`wy_chunk._in_chunk_cumsum` and `wy_chunk._inverse`. This module replaces the sequential pass (`_forward_kernel`)
by a `plgpu.kernel` for Hopper (and `wy_chunk._reverse_kernel` likewise, walking the chunks backwards with the same
inputs, dO in place of v, and the same CTA layouts, `_pass_body`):

- grid (V/BV, B*Hv), one warpgroup per CTA; CTA (j, bh) owns the state block S[:, j*BV:(j+1)*BV] (K x BV, fp32,
  in registers in the WGMMA layout) of value head bh and walks the chunks in order (BV = 64, or 32 for few heads:
  `Config.block_v`; every operand tile then takes the swizzle of a 32-column row, 64 bytes). With many heads
  (`Config.warpgroups=2`) one CTA per head instead: two consumer warpgroups own the two state blocks and a producer
  warpgroup loads the chunk inputs once for both (`_forward_body_shared_head`);
- the chunk inputs (q, k: C x K; v: C x BV; T as bf16 hi/lo: C x C; per-token scalars) stream through
  `plgpu.emit_pipeline` (TMA, double buffered); the state is the pipeline's carry;
- every product is a wgmma with bf16 operands and an fp32 accumulator. fp32 operands (S_0, y, u, P, T) enter as
  bf16 hi/lo pairs, x = hi + lo with hi = bf16(x) and lo = bf16(x - hi), and a product of two such operands is
  hi*hi + hi*lo + lo*hi (the "split" mode of `common.dot`, ~2^-16 relative per product).

Per chunk (C = 64, K = 128, BV = 64), with the wgmma shapes M x N x K:

    KS = k @ S_0,  QS = q @ S_0       2 x (64 x 64 x 128) each (S_0 as hi/lo in SMEM)      (3), (5)
    QK = q @ k^T                      64 x 64 x 128
    y  = v - carry exp(G) (.) KS,  b = beta (.) y                                           (3)
    u  = T @ b                        3 x (64 x 64 x 64)                                     (4)
    O  = scale [carry exp(G) (.) QS + (QK (.) exp(G_t - G_s), t >= s, same doc) @ u]        (5)
                                      3 x (64 x 64 x 64), P as hi/lo in SMEM
    S  = carry_C exp(G_C) S_0 + k^T @ (tail exp(G_C - G) (.) u)
                                      2 x (128 x 64 x 64), k^T a transposed SMEM view         (6)

Inputs are bf16 q/k/v with K and V each of 64, 128 or 256 (`HEAD_DIMS`); Hv value heads,
a multiple of the H key heads (the kernels read value head h's q and k at key head h // (Hv / H); T, beta and the
gates are per value head); the per-token scalars carry exp(G), tail exp(G_C - G), the chunk survival factor and
the document masks are computed in XLA as in `wy_chunk.chunk_wy`. Differentiated (a `custom_vjp`), the pass also
writes what the backward reads (every chunk's start state, and u as its bf16 pair, by TMA from the operand tiles);
the backward is the Mosaic reverse pass (writing every chunk's end-state cotangent and dx as its bf16 pair) and
the Mosaic GPU gradient kernel (`mosaic_wy_grads`). With few heads per call the Triton passes run instead
(`Config.mosaic_forward`, `Config.mosaic_reverse`). At K or V of 256 the gradient kernel runs in blocks of 128
(one CTA per chunk, head, key block and value block, `mosaic_wy_grads`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc
from deltajax.kernels.gpu import mosaic_vectors
from deltajax.kernels.gpu import mosaic_wy_grads
from deltajax.kernels.gpu import wy_chunk
from deltajax.kernels.gpu.common import split_bf16_in_xla

F32, BF16 = mc.F32, mc.BF16
# K and V of the passes, each, and of the gradient kernel (`mosaic_wy_grads.HEAD_DIMS`, at 256 in blocks of 128).
# One CTA per head takes K = V = 128 only. The dispatch takes the sizes that have run and been timed on a GPU
# (`kernels/gpu/__init__.py`, `supports_mosaic`).
HEAD_DIM = 128
HEAD_DIMS = (64, 128, 256)
# At K = 256 a pipeline stage's q and k tiles take 64 KiB: state blocks of at most 32 columns and two stages fit
# the 227 KiB of SMEM (210.5 KiB at BV = 32; BV = 64 needs 254.5, docs/mosaic.md, next step 6). The state block
# (K x BV fp32) then takes 64 registers per thread, as at K = 128, BV = 64.
WIDE_KEY_DIM = 256
WIDE_KEY_MAX_BLOCK_V = 32
WIDE_KEY_MAX_STAGES = 2
CHUNK = 64  # the only chunk size supported
BLOCK_V = 64  # BV: V columns of the state per CTA by default (`Config.block_v`)
BLOCK_VS = (16, 32, 64)
# The default BV where V/32 CTAs per head fit one wave (B * Hv * 4 <= SM_COUNT). Pass / forward ms (2026-11-26,
# `bench_mosaic_gpu.py`), BV 64 -> 32: H100, 2x8192x16x128 0.545 / 0.701 -> 0.428 / 0.587, 1x32768x16x128
# 2.000 / 2.437 -> 1.638 / 1.927; H200, 4x4096x16x128 (256 CTAs at BV 32) 0.288 / 0.444 -> 0.441 / 0.592. BV 16
# measured as BV 32 at 1x32768 (1.653) and twice as slow at 2x8192 (two waves).
NARROW_BLOCK_V = 32
SM_COUNT = 132  # H100 SXM and H200
# The sequential forward pass is the Mosaic one from this many value heads per call on (`Config.mosaic_forward`);
# below, the Triton one runs (primal and differentiated) and only the gradient kernel is Mosaic's. The forward as
# differentiation runs it (`bench_mosaic_gpu.py --residuals`, H100, 2026-11-26 08:30), Mosaic / Triton: 128 heads
# 0.725 / 0.737 ms, 32 heads 0.812 / 0.918; at 16 heads (1x32768) the Mosaic forward alone is slower than the
# Triton one (1.91 / 1.44 ms). The same threshold for the reverse pass (`Config.mosaic_reverse`;
# `bench_mosaic_reverse.py`, H100, 2026-11-26 23:57), Mosaic / Triton: 128 heads 0.237 / 0.416 ms, 32 heads
# 0.431 / 0.690, 16 heads 1.631 / 1.570.
MOSAIC_FORWARD_MIN_BATCH_HEADS = 32
# The same threshold by (K, V) (`mosaic_forward_min_batch_heads`): the fewest value heads per call from which the
# Mosaic passes' forward+backward measured faster than the Triton passes' (H200, 2026-12-04, `bench_mosaic_gpu.py
# --fwd_bwd --variants=triton_passes,mosaic_passes` at 1x32768x16, 2x8192x16, 4x4096x16, 8x2048x16: 16 to 128
# heads; docs/benchmarks.md, "KDA at head dims of 256, and the Mosaic passes' head-count thresholds ..."). At the
# next smaller count timed the Triton passes measured faster. The training step sets these: the Mosaic forward
# alone wins from fewer heads at some dims. Where K or V is 256 they were timed again once the gradient kernel
# there was Mosaic's too (2026-12-04 20:24-20:29, docs/benchmarks.md, "The Mosaic gradient kernel at head dims of
# 256"): (64, 256) and (128, 256) from 32 heads (was 64), (256, 64) at 64 heads (timed now: Mosaic's faster).
MOSAIC_FORWARD_MIN_BATCH_HEADS_BY_DIMS = {
    (64, 64): 128, (64, 128): 64, (64, 256): 32,
    (128, 64): 128, (128, 128): MOSAIC_FORWARD_MIN_BATCH_HEADS, (128, 256): 32,
    (256, 64): 64, (256, 128): 32, (256, 256): 16,
}
MAX_CONCURRENT_STEPS = 2  # chunks in flight in the TMA pipeline by default (`Config.stages`)
# Calls with at least this many value heads (B * Hv) run one CTA per head (`Config.warpgroups=2`). On the H100
# (2026-11-26): 128 heads (8x2048x16), pass 0.314 -> 0.237 ms; 32 heads (2x8192x16), 0.583 -> 0.831 ms, 16 heads
# (1x32768x16), 2.338 -> 3.329 ms: with fewer CTAs than SMs, two CTAs per head (one per V half) keep more SMs busy.
SHARED_HEAD_MIN_BATCH_HEADS = 128
PRODUCER_REGISTERS = 40  # per thread of the producer warpgroup (`Config.warpgroups=2`); the consumers get 232
SWIZZLE = mc.SWIZZLE  # bytes; narrower tiles take the swizzle of their row: 64 bytes at BV = 32
# Where the hi*lo and lo*hi terms of a split product are accumulated: "shared", into the accumulator of hi*hi
# (fewest registers); "separate", into an accumulator of their own, added to hi*hi in fp32 registers (as the
# Triton kernels do, one tl.dot per term). On the H100 (2026-11-23 19:05) both gave the same errors to three digits
# (experiments/mosaic_precision.py): the state error of 2e-4 to 5e-4 measured there came from T's lo half, which
# XLA had folded to zero (see `common.split_bf16_in_xla`), not from the accumulation.
LO_ACCUMULATORS = ("shared", "separate")
# K S_0 and Q S_0: "split" (S_0 as bf16 hi/lo, two wgmmas each) or "bf16" (S_0 rounded to bf16, one wgmma each; the
# Triton kernels' `state_dots` default for bf16 inputs, within the bf16 bounds on correlated keys).
STATE_DOTS = ("split", "bf16")
# Where T's bf16 hi/lo come from: "kernel", written by the Triton inverse itself (`wy_chunk._inverse(pair=True)`);
# "xla", the inverse writes fp32 T and XLA splits it (128 MiB more written and read at 8x2048x16x128).
INVERSE_PAIRS = ("kernel", "xla")
# The masked, decayed Q K^T as wgmma's A operand: "smem" (stored as hi/lo tiles; the only form the Mosaic GPU
# interpreter runs) or "registers" (no SMEM round trip; lowered and run on the GPU only).
P_OPERANDS = ("smem", "registers")
GRADS = ("mosaic", "triton")
# Where the gates' cumsums and the per-token vectors around the kernels are formed: "kernel", one Triton kernel
# before the passes and one after the gradient kernel (`mosaic_vectors`); "xla", XLA (~14 small fusions each side).
VECTORS = ("kernel", "xla")


@dataclasses.dataclass(frozen=True)
class Config:
    """Knobs of the Mosaic GPU pass that leave the math unchanged; `experiments/bench_mosaic_gpu.py` times them."""
    lo_accumulators: str = "shared"  # LO_ACCUMULATORS
    state_dots: str = "bf16"  # STATE_DOTS
    inverse_pair: str = "kernel"  # INVERSE_PAIRS
    p_operand: str = "registers"  # P_OPERANDS
    # Form P while u = T diag(beta) y runs on the tensor cores (between issuing its wgmmas and reading them).
    p_during_u: bool = True
    # 1: one warpgroup per CTA, grid (V/BV, B*Hv). 2: one CTA per value head, two consumer warpgroups (the two V
    # halves) and a producer warpgroup (`_forward_body_shared_head`); compiled, it fits SMEM only with P from
    # registers (P through SMEM, for the interpreter, asks 32 KiB more).
    warpgroups: int = 1
    # Issue Q S_0 with P u at the end of the chunk instead of with K S_0 at its start (fewer live registers): one
    # warpgroup per CTA 0.317 -> 0.294 ms at 8x2048x16x128, 2.332 -> 2.120 at 1x32768x16x128; one CTA per head
    # 0.240 / 0.242 (H100, 2026-11-26).
    query_state_late: bool = True
    # BV, the state columns per CTA with one warpgroup (`BLOCK_VS`): narrower blocks give V/BV CTAs per head, for
    # calls with fewer heads than SMs, at the price of Q K^T and the decayed scores formed by each of them.
    block_v: int = BLOCK_V
    # Chunks in flight in the TMA pipeline (SMEM buffers per input); more than 2 fits SMEM only with BV < 64.
    stages: int = MAX_CONCURRENT_STEPS
    # The sequential forward pass in Mosaic GPU (differentiated, it also writes the backward's residuals: each
    # chunk's start state, bf16, and u as its bf16 pair); False: the Triton forward pass runs instead, primal and
    # differentiated (faster with few heads per call).
    mosaic_forward: bool = True
    # The chunk-parallel gradients under differentiation: "mosaic" (`mosaic_wy_grads`, one CTA per chunk and head)
    # or "triton" (`wy_chunk`'s "merged" kernel). Both read the start states, u and dx saved by the passes.
    grads: str = "mosaic"
    # The reverse state pass under differentiation in Mosaic GPU (`_reverse_step`; after the Mosaic forward pass or
    # before the Mosaic gradient kernel); False: the Triton one (`wy_chunk._reverse_pass`).
    mosaic_reverse: bool = True
    # The gates' cumsums and the per-token vectors: one Triton kernel on each side of the call ("kernel") or XLA.
    vectors: str = "kernel"
    # Under differentiation with the Mosaic forward pass and gradient kernel (and bf16 state products): the gradient
    # kernel forms u = T diag(beta) y itself from T's pair, so the forward pass saves only the start states. Off
    # (the default): the forward pass also writes u's bf16 pair, which the gradient kernel reads. Measured on the
    # H100 (docs/mosaic.md, "u formed in the gradient kernel"): the forward gains ~50 us at 8x2048x16x128 and the
    # gradient kernel loses ~200-270 us.
    recompute_u: bool = False
    # Warpgroups per CTA of the Mosaic gradient kernel: 2, its two roles side by side; 1, both roles in turn, so
    # that two CTAs share an SM where the SMEM allows (K = V = 64).
    grads_warpgroups: int = 2

    def __post_init__(self):
        for name, allowed in (("lo_accumulators", LO_ACCUMULATORS), ("state_dots", STATE_DOTS),
                              ("inverse_pair", INVERSE_PAIRS), ("p_operand", P_OPERANDS), ("warpgroups", (1, 2)),
                              ("block_v", BLOCK_VS), ("stages", (1, 2, 3, 4)), ("grads", GRADS),
                              ("vectors", VECTORS), ("grads_warpgroups", (1, 2))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.warpgroups == 2 and self.state_dots != "bf16":
            # Two consumers' S_0 lo tiles take the SMEM over the H100's 227 KiB (256,032 bytes asked).
            raise ValueError(f"warpgroups=2 needs state_dots='bf16' (S_0 hi only), got {self.state_dots!r}")
        if self.warpgroups == 2 and self.block_v != HEAD_DIM // 2:
            raise ValueError(f"warpgroups=2 gives each consumer half of V: block_v must be {HEAD_DIM // 2}, got "
                             f"{self.block_v}")


def default_config(interpret=False, batch_heads=None, key_dim=HEAD_DIM, value_dim=HEAD_DIM):
    """The knobs as shipped (docs/mosaic.md, "Config knobs on the H100"): plain-bf16 state products and P from
    registers, which the interpreter cannot run, so there P goes through SMEM. With at least
    `SHARED_HEAD_MIN_BATCH_HEADS` value heads in the call (B * Hv), one CTA per head with two consumer warpgroups;
    with few enough that V/32 CTAs per head fit one wave on `SM_COUNT` SMs, state blocks of 32 columns. Below
    `mosaic_forward_min_batch_heads(key_dim, value_dim)` heads, the Triton passes (faster there). Head dims other
    than K = V = 128 (`HEAD_DIMS`): one warpgroup per CTA (`check_config`), at K = 256 state blocks of at most 32
    columns. The Mosaic gradient kernel at every head dim (at 256 in blocks of 128; the training step 1.17-1.52x as
    fast as with the Triton gradient kernels there, H200 2026-12-04, docs/benchmarks.md)."""
    full = key_dim == value_dim == HEAD_DIM
    other_dims = {}
    if key_dim == WIDE_KEY_DIM:
        other_dims["block_v"] = WIDE_KEY_MAX_BLOCK_V
    if interpret:
        return Config(p_operand="smem", **other_dims)
    if batch_heads is None:
        return Config(**other_dims)
    mosaic_passes = batch_heads >= mosaic_forward_min_batch_heads(key_dim, value_dim)
    passes = dict(mosaic_forward=mosaic_passes, mosaic_reverse=mosaic_passes, **other_dims)
    if full and batch_heads >= SHARED_HEAD_MIN_BATCH_HEADS:
        return Config(warpgroups=2, **passes)
    if batch_heads * (value_dim // NARROW_BLOCK_V) <= SM_COUNT:
        return Config(**dict(passes, block_v=NARROW_BLOCK_V))
    return Config(**passes)


def mosaic_forward_min_batch_heads(key_dim, value_dim):
    """The value heads per call (B * Hv) from which the default config runs the Mosaic passes at these head dims."""
    return MOSAIC_FORWARD_MIN_BATCH_HEADS_BY_DIMS[key_dim, value_dim]


def check_config(cfg, key_dim, value_dim):
    """The knobs that depend on the head dims (`Config` checks the others): one CTA per head takes K = V =
    `HEAD_DIM` only, u formed in the Mosaic gradient kernel V = 128 and K of at most 128, K = 256 narrow state
    blocks."""
    if (key_dim, value_dim) == (HEAD_DIM, HEAD_DIM):
        return
    if key_dim == WIDE_KEY_DIM and (cfg.block_v > WIDE_KEY_MAX_BLOCK_V or cfg.stages > WIDE_KEY_MAX_STAGES):
        raise ValueError(f"K={key_dim} fits SMEM with block_v <= {WIDE_KEY_MAX_BLOCK_V} and stages <= "
                         f"{WIDE_KEY_MAX_STAGES}, got block_v={cfg.block_v}, stages={cfg.stages}")
    dims = f"K = V = {HEAD_DIM}, got K={key_dim}, V={value_dim}"
    if cfg.warpgroups != 1:
        raise ValueError(f"warpgroups=2 (one CTA per head) takes {dims}; use warpgroups=1")
    if cfg.grads == "mosaic" and cfg.recompute_u and (value_dim != HEAD_DIM or key_dim > HEAD_DIM):
        raise ValueError(f"recompute_u=True (u formed in the Mosaic gradient kernel) takes V = {HEAD_DIM} and K <= "
                         f"{HEAD_DIM}, got K={key_dim}, V={value_dim}; use recompute_u=False")


def _swizzle(cfg):
    """The one swizzle of every wgmma operand tile (wgmma takes A and B with equal swizzles): 128 bytes, or the
    row of a narrower state block (64 bytes at BV = 32, 32 at BV = 16)."""
    return min(SWIZZLE, cfg.block_v * jnp.dtype(BF16).itemsize)


def _split_product(a_hi, a_lo, b_hi, b_lo, m, n, separate, while_running=None):
    """a @ b with b an fp32 operand given as bf16 hi/lo SMEM tiles (b_lo None: b is bf16), and a one too or (a_lo
    None) a bf16 one: hi*hi + hi*lo (+ lo*hi), the lo terms accumulated as `LO_ACCUMULATORS` says.
    `while_running()` runs after the wgmmas are issued and before their result is read (register work that
    overlaps the tensor cores); then the result is (a @ b, while_running())."""

    def lo_terms(acc_ref):
        if b_lo is not None:
            plgpu.wgmma(acc_ref, a_hi, b_lo)
        if a_lo is not None:
            plgpu.wgmma(acc_ref, a_lo, b_hi)

    def meanwhile():
        return None if while_running is None else while_running()

    def shared(acc_ref):
        plgpu.wgmma(acc_ref, a_hi, b_hi)
        lo_terms(acc_ref)
        other = meanwhile()
        return mc.read(acc_ref), other

    def apart(hi_ref, lo_ref):
        plgpu.wgmma(hi_ref, a_hi, b_hi)
        lo_terms(lo_ref)
        other = meanwhile()
        hi, lo = mc.read(hi_ref, lo_ref)
        return mc.wgmma_layout(hi + lo), other

    has_lo = b_lo is not None or a_lo is not None
    if separate and has_lo:
        product, other = pl.run_scoped(apart, mc.acc(m, n), mc.acc(m, n))
    else:
        product, other = pl.run_scoped(shared, mc.acc(m, n))
    return product if while_running is None else (product, other)


@dataclasses.dataclass(frozen=True)
class _Tiles:
    """One warpgroup's SMEM scratch: S_0 as bf16 hi (and lo), the operand tiles x and u as hi/lo (u None: u goes
    through x, after x's product has completed), P as hi/lo (None: P from registers), the output tile (the reverse
    pass: the operand tile of its Q^T product)."""
    s_hi: object
    s_lo: object
    x_hi: object
    x_lo: object
    u_hi: object
    u_lo: object
    p_hi: object
    p_lo: object
    o_smem: object


def _forward_step(cfg, tiles, inputs, s, out_tiles, *, scale, segmented):
    """Equations (3)-(6) for one chunk and one state block S (K x BV, fp32 registers): writes the chunk's output
    tile (through `tiles.o_smem` and a TMA) and returns the next state. `inputs`: this chunk's SMEM refs q, k
    (C x K), v (C x BV), T hi, T lo, then the vectors G hi, G lo, beta, carry exp(G), tail exp(G_C - G), survive
    (K), G hi, G lo again and doc twice (rows and columns, see `_pass_body`). `out_tiles`: the chunk's GMEM tiles,
    the output, then (differentiated) where the chunk's start state (bf16) and u (as its bf16 hi/lo pair; not with
    `Config.recompute_u`) go, copied from the operand tiles by TMA."""
    o_tile, *saved = out_tiles
    saves_u = len(saved) == 3
    saved = saved or None
    q, k, v, t_hi, t_lo, g_hi, g_lo, beta, from_start, to_end, survive, g_hi_c, g_lo_c, doc, doc_c = inputs
    C, K, BV = CHUNK, q.shape[-1], cfg.block_v
    separate = cfg.lo_accumulators == "separate"
    split_state = cfg.state_dots == "split"
    p_in_smem = tiles.p_hi is not None
    s_hi, s_lo, x_hi, x_lo = tiles.s_hi, tiles.s_lo, tiles.x_hi, tiles.x_lo
    if split_state:
        mc.store_split(s, s_hi, s_lo)
    else:
        mc.store_rounded(s, s_hi)
    plgpu.commit_smem()  # the generic-proxy stores must be visible to the wgmmas (async proxy)
    if saved is not None:
        # bf16(S_0) is S_0's hi half in either state_dots mode. The copy has finished reading s_hi before the next
        # chunk writes it: the wait before the output tile below waits for every earlier copy.
        plgpu.copy_smem_to_gmem(s_hi, saved[0])

    def query_state_product(qs_ref):
        plgpu.wgmma(qs_ref, q, s_hi)
        if split_state:
            plgpu.wgmma(qs_ref, q, s_lo)

    def state_products(ks_ref, qs_ref, qk_ref):
        plgpu.wgmma(ks_ref, k, s_hi)
        if split_state:
            plgpu.wgmma(ks_ref, k, s_lo)
        query_state_product(qs_ref)
        plgpu.wgmma(qk_ref, q, k.transpose((1, 0)))
        return mc.read(ks_ref, qs_ref, qk_ref)

    def key_products(ks_ref, qk_ref):
        plgpu.wgmma(ks_ref, k, s_hi)
        if split_state:
            plgpu.wgmma(ks_ref, k, s_lo)
        plgpu.wgmma(qk_ref, q, k.transpose((1, 0)))
        return mc.read(ks_ref, qk_ref)

    def query_key_product(qk_ref):
        plgpu.wgmma(qk_ref, q, k.transpose((1, 0)))
        return mc.read(qk_ref)

    qs = None
    if cfg.query_state_late:  # Q S_0 issued with P u at the end: its accumulator is not live in between
        ks, qk = pl.run_scoped(key_products, mc.acc(C, BV), mc.acc(C, C))
    elif separate:  # one product at a time: two accumulators live, not five
        ks = _split_product(k, None, s_hi, s_lo, C, BV, True)
        qs = _split_product(q, None, s_hi, s_lo, C, BV, True)
        qk = pl.run_scoped(query_key_product, mc.acc(C, C))
    else:  # all five wgmmas in flight before one wait
        ks, qs, qk = pl.run_scoped(state_products, mc.acc(C, BV), mc.acc(C, BV), mc.acc(C, C))

    def output(u_hi, u_lo):
        """scale-free O of (5): carry exp(G) (.) Q S_0 + P u."""
        if qs is not None:
            return mc.wgmma_layout(start_rows * qs + _split_product(*p_parts, u_hi, u_lo, C, BV, separate))

        def both(qs_ref):
            query_state_product(qs_ref)
            pu = _split_product(*p_parts, u_hi, u_lo, C, BV, separate)  # reading it waits for Q S_0 too
            return mc.read(qs_ref), pu

        late_qs, pu = pl.run_scoped(both, mc.acc(C, BV))
        return mc.wgmma_layout(start_rows * late_qs + pu)

    start_rows = mc.rows(from_start, BV)
    y = mc.wgmma_layout(plgpu.load(v, layout=plgpu.Layout.WGMMA).astype(F32) - start_rows * ks)  # (3)
    mc.store_split(mc.rows(beta, BV) * y, x_hi, x_lo)
    plgpu.commit_smem()

    def decayed_scores():
        # (5): the masked, decayed Q K^T.
        causal, _ = mc.chunk_masks(doc, doc_c, C, segmented)
        p = mc.wgmma_layout(qk * mc.pair_decay(g_hi, g_lo, g_hi_c, g_lo_c, causal, C))
        if p_in_smem:  # the interpreter runs only SMEM operands of wgmma (see docs/mosaic.md)
            mc.store_split(p, tiles.p_hi, tiles.p_lo)
            return None  # (a run_scoped body must not return refs)
        hi, lo = mc.split(p)
        return mc.wgmma_layout(hi), mc.wgmma_layout(lo)

    if cfg.p_during_u:  # (4): u = T diag(beta) y, with P formed while it runs
        u, p_parts = _split_product(t_hi, t_lo, x_hi, x_lo, C, BV, separate, while_running=decayed_scores)
    else:
        u = _split_product(t_hi, t_lo, x_hi, x_lo, C, BV, separate)
        p_parts = decayed_scores()
    if p_in_smem:
        p_parts = (tiles.p_hi, tiles.p_lo)
    end_operand = lambda: mc.rows(to_end, BV) * u  # diag(tail exp(G_C - G)) u, the state-update operand of (6)
    def save_u(u_hi, u_lo):
        if saves_u:
            plgpu.copy_smem_to_gmem(u_hi, saved[1])
            plgpu.copy_smem_to_gmem(u_lo, saved[2])

    if tiles.u_hi is not None:
        mc.store_split(u, tiles.u_hi, tiles.u_lo)
        # x_* is free again (the wgmmas above have completed): it takes the state-update operand.
        mc.store_split(end_operand(), x_hi, x_lo)
        plgpu.commit_smem()
        save_u(tiles.u_hi, tiles.u_lo)  # read before the next chunk writes u: see the wait before o_smem below
        o = output(tiles.u_hi, tiles.u_lo)
    else:  # one operand pair: u through x for P u, then (once P u has completed) the update operand
        mc.store_split(u, x_hi, x_lo)
        plgpu.commit_smem()
        save_u(x_hi, x_lo)
        o = output(x_hi, x_lo)
        if saves_u:
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # u's copies have read x_*
        mc.store_split(end_operand(), x_hi, x_lo)
        plgpu.commit_smem()

    update = _split_product(k.transpose((1, 0)), None, x_hi, x_lo, K, BV, separate)  # (6)
    s_next = mc.wgmma_layout(mc.rows(survive, BV) * s + update)

    o_smem = tiles.o_smem
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's output has left o_smem
    mc.store_rounded(scale * o, o_smem)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_tile)
    return s_next


def _reverse_step(cfg, tiles, inputs, ds, out_tiles, *, scale, segmented):
    """The reverse pass (`wy_chunk._reverse_kernel`) for one chunk and one block dS (K x BV, fp32 registers) of the
    cotangent of the chunk's end state; returns that of its start state. `inputs` as `_forward_step`'s, with dO in
    place of v. With f = carry exp(G) and e = tail exp(G_C - G):

        KD  = k @ dS,  P^T = (k @ q^T) (.) exp(G_t - G_s) [t >= s] (row s, column t)   2 x (64 x 64 x 128)
        du  = scale P^T dO + e (.) KD                     P^T as hi/lo: 2 x (64 x 64 x 64)
        dx  = T^T du                                      3 x (64 x 64 x 64)   (dL/d(beta y) of eq. (4))
        dS_start = survive dS + scale [k^T (-beta f (.) dx / scale) + q^T (f (.) dO)]   3 x (128 x 64 x 64)

    K dS reads dS rounded to bf16 (`Config.state_dots`) and q^T's operand f (.) dO is rounded to bf16 (exact where
    f is 1), as in the Triton pass (`state_dots` "bf16"); the other fp32 operands enter split. `out_tiles`: the
    GMEM tiles of the chunk's end-state cotangent (bf16) and of dx's bf16 hi and lo, copied from SMEM by TMA."""
    q, k, do, t_hi, t_lo, g_hi, g_lo, beta, from_start, to_end, survive, g_hi_c, g_lo_c, doc, doc_c = inputs
    C, K, BV = CHUNK, q.shape[-1], cfg.block_v
    dend_tile, dx_hi_tile, dx_lo_tile = out_tiles
    separate = cfg.lo_accumulators == "separate"
    split_state = cfg.state_dots == "split"
    s_hi, s_lo, x_hi, x_lo, decayed_do = tiles.s_hi, tiles.s_lo, tiles.x_hi, tiles.x_lo, tiles.o_smem
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the previous chunk's copies have read dS's tile and dx's
    if split_state:
        mc.store_split(ds, s_hi, s_lo)
    else:
        mc.store_rounded(ds, s_hi)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(s_hi, dend_tile)  # bf16(dS) is its hi half in either state_dots mode

    def key_products(kd_ref, kq_ref):
        plgpu.wgmma(kd_ref, k, s_hi)
        if split_state:
            plgpu.wgmma(kd_ref, k, s_lo)
        plgpu.wgmma(kq_ref, k, q.transpose((1, 0)))
        return mc.read(kd_ref, kq_ref)

    kd, kq = pl.run_scoped(key_products, mc.acc(C, BV), mc.acc(C, C))
    causal, _ = mc.chunk_masks(doc, doc_c, C, segmented, transposed=True)
    p_t = mc.wgmma_layout(kq * mc.pair_decay(g_hi, g_lo, g_hi_c, g_lo_c, causal, C, transposed=True))
    if tiles.p_hi is not None:  # the interpreter runs only SMEM operands of wgmma (see docs/mosaic.md)
        mc.store_split(p_t, tiles.p_hi, tiles.p_lo)
        plgpu.commit_smem()
        p_parts = (tiles.p_hi, tiles.p_lo)
    else:
        p_parts = tuple(mc.wgmma_layout(x) for x in mc.split(p_t))
    start_rows = mc.rows(from_start, BV)

    def decay_do():  # q^T's operand f (.) dO, formed while P^T dO runs
        mc.store_rounded(start_rows * plgpu.load(do, layout=plgpu.Layout.WGMMA).astype(F32), decayed_do)

    pdo, _ = _split_product(*p_parts, do, None, C, BV, separate, while_running=decay_do)
    mc.store_split(scale * pdo + mc.rows(to_end, BV) * kd, x_hi, x_lo)  # du
    plgpu.commit_smem()
    dx = _split_product(t_hi.transpose((1, 0)), t_lo.transpose((1, 0)), x_hi, x_lo, C, BV, separate)
    # dL/d(K S_0) of eq. (3) over scale, which multiplies the whole sum below.
    dks = mc.wgmma_layout((-1.0 / scale) * (mc.rows(beta, BV) * start_rows) * dx)
    if tiles.u_hi is not None:
        mc.store_split(dx, tiles.u_hi, tiles.u_lo)
        mc.store_split(dks, x_hi, x_lo)  # x is free: T^T du has completed
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tiles.u_hi, dx_hi_tile)
        plgpu.copy_smem_to_gmem(tiles.u_lo, dx_lo_tile)
    else:  # one operand pair: dx through x to GMEM, then dks
        mc.store_split(dx, x_hi, x_lo)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(x_hi, dx_hi_tile)
        plgpu.copy_smem_to_gmem(x_lo, dx_lo_tile)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        mc.store_split(dks, x_hi, x_lo)
        plgpu.commit_smem()

    def start_cotangent(acc_ref):
        plgpu.wgmma(acc_ref, k.transpose((1, 0)), x_hi)
        plgpu.wgmma(acc_ref, k.transpose((1, 0)), x_lo)
        plgpu.wgmma(acc_ref, q.transpose((1, 0)), decayed_do)
        return mc.read(acc_ref)

    update = pl.run_scoped(start_cotangent, mc.acc(K, BV))
    return mc.wgmma_layout(mc.rows(survive, BV) * ds + scale * update)


def _in_specs(cfg, key_dim, block_v, nt, reverse):
    """The pipeline's BlockSpecs, in `_forward_step`'s order of inputs (q and k's blocks are C x key_dim, v's
    C x block_v); with `reverse` pipeline step n loads chunk nt - 1 - n."""
    C, K = CHUNK, key_dim
    chunk = (lambda n: nt - 1 - n) if reverse else (lambda n: n)
    tiled = lambda shape: mc.tiled_spec(shape, lambda n: (chunk(n), 0), _swizzle(cfg))
    vector = lambda n=C: plgpu.BlockSpec(block_shape=(n,), index_map=lambda i: (chunk(i),))
    return [tiled((C, K)), tiled((C, K)), tiled((C, block_v)), tiled((C, C)), tiled((C, C)),
            vector(), vector(), vector(), vector(), vector(), vector(K), vector(), vector(), vector(), vector()]


def _pipeline_refs(q_ref, k_ref, v_ref, t_ref, vec_ref, doc_ref, survive_ref, b, h, bh, v_cols, key_head):
    """The GMEM refs the pipeline walks for value head bh = b * Hv + h (whose q and k are those of `key_head`), in
    `_in_specs`' order."""
    return (q_ref.at[b, :, key_head, :], k_ref.at[b, :, key_head, :], v_ref.at[b, :, h, v_cols],
            t_ref.at[0, b, :, h, :], t_ref.at[1, b, :, h, :], *(vec_ref.at[row, bh] for row in range(5)),
            survive_ref.at[bh], vec_ref.at[0, bh], vec_ref.at[1, bh], doc_ref.at[b], doc_ref.at[b])


def _chunk_tiles(out_refs, kinds, b, h, i, cols, key_dim):
    """The GMEM tiles of chunk i of the per-chunk outputs: C x BV of a "tokens" array (B, Tp, Hv, V), K x BV of a
    "states" array (B, Hv, nt * K, V)."""
    tile = dict(tokens=lambda ref: ref.at[b, pl.ds(i * CHUNK, CHUNK), h, cols],
                states=lambda ref: ref.at[b, h, pl.ds(i * key_dim, key_dim), cols])
    return [tile[kind](ref) for ref, kind in zip(out_refs, kinds, strict=True)]


def _split_refs(refs, kinds):
    """A pass kernel's refs: the seven GMEM inputs of `_pipeline_refs`, the state it starts from, the state it
    ends with, the per-chunk outputs (`kinds`) and the scratch."""
    n = 9 + len(kinds)
    return refs[:7], refs[7], refs[8], refs[9:n], list(refs[n:])


def _pass_body(*refs, step, kinds, reverse, nt, num_heads, group, key_dim, cfg):
    """One CTA of one warpgroup: value head bh = b * Hv + h, V block j; walks the chunks in order (`reverse`: last
    first) with its state block in registers, s = step(tiles, inputs, s, out_tiles) per chunk. The GMEM inputs:
    q, k (B, Tp, H, K), read at key head h // `group` (Hv = group * H value heads share a key head); v (or dO)
    (B, Tp, Hv, V); T as bf16 (hi, lo) stacked on a leading axis
    (2, B, Tp, Hv, C); the vector rows G hi, G lo, beta, carry exp(G), tail exp(G_C - G) (each (B*Hv, Tp)); the
    document index as fp32 (B, Tp); the chunk survival factor repeated K times per chunk (B*Hv, nt*K).

    G and doc enter the pipeline twice, once for the rows and once for the columns of the C x C mask and decay:
    Mosaic GPU's layout inference finds no solution when one SMEM vector is loaded in both the row and the column
    layout (see docs/mosaic.md)."""
    inputs, init_ref, last_ref, out_refs, scratch = _split_refs(refs, kinds)
    tiles = _unpack_tiles(cfg, scratch, key_dim, two_pairs=True, reverse=reverse)
    j = lax.axis_index("v_block")
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    cols = pl.ds(j * cfg.block_v, cfg.block_v)

    # The state block goes between GMEM and registers directly (once per CTA, not worth SMEM and a TMA).
    s0 = plgpu.load(init_ref.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)

    def chunk(indices, *chunk_inputs):
        (n,) = indices
        *chunk_inputs, s = chunk_inputs
        i = nt - 1 - n if reverse else n
        return step(tiles, chunk_inputs, s, _chunk_tiles(out_refs, kinds, b, h, i, cols, key_dim))

    pipeline = plgpu.emit_pipeline(chunk, grid=(nt,), in_specs=_in_specs(cfg, key_dim, cfg.block_v, nt, reverse),
                                   max_concurrent_steps=cfg.stages, init_carry=s0)
    last = pipeline(*_pipeline_refs(*inputs, b, h, bh, cols, h // group))
    last_ref.at[b, h, :, cols][...] = last
    plgpu.wait_smem_to_gmem(0)


def _pass_body_shared_head(*refs, step, kinds, reverse, nt, num_heads, group, key_dim, cfg):
    """`_pass_body` with one CTA per value head: two consumer warpgroups, each with the state block of one half of
    V (BV = 64 of 128), and a producer warpgroup streaming the chunk inputs through TMA
    (`emit_pipeline_warp_specialized`). q, k, T and the vectors are loaded once for both halves. Each consumer has
    its own scratch (a leading axis of 2 on every tile) with one operand pair x (to fit 227 KiB of SMEM)."""
    inputs, init_ref, last_ref, out_refs, scratch = _split_refs(refs, kinds)
    value_dim = inputs[2].shape[-1]  # v's whole width, loaded once for both consumers
    wg = lax.axis_index("wg")
    tiles = _unpack_tiles(cfg, [ref.at[wg] for ref in scratch], key_dim, two_pairs=False, reverse=reverse)
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    cols = pl.ds(wg * cfg.block_v, cfg.block_v)

    def chunk(indices, *chunk_inputs):
        (n,) = indices
        *chunk_inputs, s = chunk_inputs
        chunk_inputs[2] = chunk_inputs[2].at[:, cols]  # this warpgroup's half of v (dO)
        i = nt - 1 - n if reverse else n
        return step(tiles, chunk_inputs, s, _chunk_tiles(out_refs, kinds, b, h, i, cols, key_dim))

    def consumer(run_pipeline):
        s0 = plgpu.load(init_ref.at[b, h, :, cols], layout=plgpu.Layout.WGMMA, optimized=False)
        last_ref.at[b, h, :, cols][...] = run_pipeline(s0)
        plgpu.wait_smem_to_gmem(0)

    pipeline = plgpu.emit_pipeline_warp_specialized(
        chunk, grid=(nt,), in_specs=_in_specs(cfg, key_dim, value_dim, nt, reverse), max_concurrent_steps=cfg.stages,
        memory_registers=PRODUCER_REGISTERS, wg_axis="wg", num_compute_wgs=2, compute_context=consumer)
    pipeline(*_pipeline_refs(*inputs, b, h, bh, slice(None), h // group))


def _tile_shapes(cfg, key_dim, two_pairs, reverse):
    """`_Tiles`' fields in use, as (name, shape, tiled) in order."""
    C, K, BV = CHUNK, key_dim, cfg.block_v
    shapes = [("s_hi", (K, BV))] + ([("s_lo", (K, BV))] if cfg.state_dots == "split" else [])
    shapes += [("x_hi", (C, BV)), ("x_lo", (C, BV))]
    shapes += [("u_hi", (C, BV)), ("u_lo", (C, BV))] if two_pairs else []
    shapes += [("p_hi", (C, C)), ("p_lo", (C, C))] if cfg.p_operand == "smem" else []
    # The forward's output tile leaves by TMA; the reverse pass's is a wgmma operand.
    return [(name, shape, True) for name, shape in shapes] + [("o_smem", (C, BV), reverse)]


def _unpack_tiles(cfg, scratch, key_dim, two_pairs, reverse):
    fields = dict.fromkeys(f.name for f in dataclasses.fields(_Tiles))
    for (name, _, _), ref in zip(_tile_shapes(cfg, key_dim, two_pairs, reverse), scratch, strict=True):
        fields[name] = ref
    return _Tiles(**fields)


def _pass_kernel(cfg, step, kinds, out_type, dtype, *, reverse, nt, batch, num_heads, group, key_dim, value_dim,
                 interpret, name):
    """The `plgpu.kernel` of a sequential pass (`_pass_body`, or `_pass_body_shared_head` with
    `Config.warpgroups=2`) over `batch` rows of `num_heads` value heads, `group` of them per key head, with head
    dims `key_dim` and `value_dim`. `out_type`: the state it ends with, then the per-chunk outputs (`kinds`);
    `dtype`: that of the forward's output tile."""
    body = dict(step=step, kinds=kinds, reverse=reverse, nt=nt, num_heads=num_heads, group=group, key_dim=key_dim,
                cfg=cfg)
    batch_heads = batch * num_heads
    shared = cfg.warpgroups == 2
    lead = (2,) if shared else ()
    scratch = tuple(mc.tiled(lead + shape, _swizzle(cfg)) if tiled else plgpu.SMEM(lead + shape, dtype)
                    for _, shape, tiled in _tile_shapes(cfg, key_dim, not shared, reverse))
    if shared:
        return mc.kernel(
            functools.partial(_pass_body_shared_head, **body), out_type=out_type, scratch_types=scratch,
            grid=(batch_heads,), grid_names=("head",), num_threads=3, thread_name="wg",
            compiler_params=plgpu.CompilerParams(), interpret=interpret, kernel_name=f"{name}_shared_head")
    return mc.kernel(
        functools.partial(_pass_body, **body), out_type=out_type, scratch_types=scratch,
        grid=(value_dim // cfg.block_v, batch_heads), grid_names=("v_block", "head"),
        compiler_params=plgpu.CompilerParams(), interpret=interpret, kernel_name=name)


def _forward_pass(cfg, q, k, v, t_pair, vectors, doc, survive, h0, *, scale, segmented, interpret,
                  with_states=False, with_u=True):
    """(o, final state), and `with_states` every chunk's start state (bf16, (B, H, nt*K, V)) and (`with_u`) u as
    its bf16 (hi, lo) halves (two (B, Tp, H, V) arrays), the residuals of the backward. H is v's heads (Hv), a
    multiple of q's."""
    B, Tp, _, K = q.shape
    H, V = v.shape[2:]
    # The final state, then the per-chunk outputs (`_pass_body`'s order).
    out_type = (jax.ShapeDtypeStruct((B, H, K, V), F32), jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype))
    kinds = ("tokens",)
    if with_states:
        out_type += (jax.ShapeDtypeStruct((B, H, Tp // CHUNK * K, V), BF16),)
        kinds += ("states",)
    if with_states and with_u:
        out_type += (jax.ShapeDtypeStruct((B, Tp, H, V), BF16),) * 2
        kinds += ("tokens", "tokens")
    step = functools.partial(_forward_step, cfg, scale=scale, segmented=segmented)
    kernel = _pass_kernel(cfg, step, kinds, out_type, v.dtype, reverse=False, nt=Tp // CHUNK, batch=B, num_heads=H,
                          group=H // q.shape[2], key_dim=K, value_dim=V, interpret=interpret,
                          name="wy_forward_mosaic")
    final, o, *saved = kernel(q, k, v, t_pair, vectors, doc, survive, h0)
    return (o, final, *saved)


def _reverse_pass(cfg, q, k, do, t_pair, vectors, doc, survive, dfinal, *, scale, segmented, interpret):
    """`wy_chunk._reverse_pass` with `dx_pair` in Mosaic GPU: (dL/d(initial state) (B, H, K, V) fp32, every
    chunk's end-state cotangent (bf16, (B, H, nt*K, V)), dx's bf16 (hi, lo) halves (B, Tp, H, V) each). The
    inputs are the forward pass's (`_pass_inputs`), dO (bf16) in place of v. H is dO's heads (Hv)."""
    B, Tp, _, K = q.shape
    H, V = do.shape[2:]
    out_type = (jax.ShapeDtypeStruct((B, H, K, V), F32), jax.ShapeDtypeStruct((B, H, Tp // CHUNK * K, V), BF16),
                *(jax.ShapeDtypeStruct((B, Tp, H, V), BF16),) * 2)
    step = functools.partial(_reverse_step, cfg, scale=scale, segmented=segmented)
    kernel = _pass_kernel(cfg, step, ("states", "tokens", "tokens"), out_type, do.dtype, reverse=True,
                          nt=Tp // CHUNK, batch=B, num_heads=H, group=H // q.shape[2], key_dim=K, value_dim=V,
                          interpret=interpret, name="wy_reverse_mosaic")
    dh0, dends, dx_hi, dx_lo = kernel(q, k, do, t_pair, vectors, doc, survive, dfinal)
    return dh0, dends, (dx_hi, dx_lo)


def _triton_config(q, v, *, scale, segmented, interpret, gated=True):
    """The Triton kernels' default config beside the Mosaic ones (its bf16 saved states are what the Mosaic kernels
    write and read)."""
    return wy_chunk.default_config(q, v, scale=scale, chunk_size=CHUNK, delta=True, segmented=segmented,
                                   interpret=interpret, gated=gated)


def _chunk_vectors(cfg, tcfg, log_decay, beta, doc, carry, tail, *, key_dim, segmented, interpret):
    """The in-chunk gates g = [hi, lo] (2, B, Tp, H) and the passes' per-token inputs: (g, vectors, the document
    index as fp32 (B, Tp), the survival factors (B*H, nt*K), K = `key_dim`). `Config.vectors` "kernel": one Triton
    kernel (`mosaic_vectors.prologue`; the vectors' 6 rows are the gradient kernel's too); "xla": XLA (5 rows)."""
    if cfg.vectors == "kernel":
        g, vectors, survive, doc_f = mosaic_vectors.prologue(log_decay, beta, doc, carry, tail, segmented=segmented,
                                                             state_dim=key_dim, interpret=interpret)
        return g, vectors, doc_f, survive
    g = wy_chunk._gate_input(tcfg, log_decay)
    return (g, *_pass_vectors(g, beta, doc, carry, tail, key_dim))


def _prologue(cfg, tcfg, k, beta, log_decay, doc, carry, tail, *, segmented, interpret, reverse_fp32=False):
    """The chunk-parallel parts before the pass, in Triton (and XLA): (g, fp32 T where `reverse_fp32` asks for it
    else None, the pass's inputs (T as a bf16 pair (2, B, Tp, H, C), vectors, doc, survive))."""
    g, vectors, doc_f, survive = _chunk_vectors(cfg, tcfg, log_decay, beta, doc, carry, tail, key_dim=k.shape[-1],
                                                segmented=segmented, interpret=interpret)
    if cfg.inverse_pair == "kernel":
        written = wy_chunk._inverse(tcfg, k, beta, g, doc, pair=True, fp32=reverse_fp32)
        t_fp32, t_pair = written if reverse_fp32 else (None, written)
    else:
        # Split in XLA: the plain x - f32(bf16(x)) is folded to 0 on the GPU (`common.split_bf16_in_xla`).
        t_fp32 = wy_chunk._inverse(tcfg, k, beta, g, doc)
        t_pair = jnp.stack(split_bf16_in_xla(t_fp32))
        t_fp32 = t_fp32 if reverse_fp32 else None
    return g, t_fp32, (t_pair, vectors, doc_f, survive)


def _pass_inputs(cfg, q, k, beta, log_decay, doc, carry, tail, *, scale, segmented, interpret, v=None):
    """The forward pass's inputs after q, k, v: T's bf16 pair, the vectors, the document index and the survival
    factors (`_prologue`). `v` (its shape only) where value heads outnumber q's."""
    tcfg = _triton_config(q, q if v is None else v, scale=scale, segmented=segmented, interpret=interpret)
    return _prologue(cfg, tcfg, k, beta, log_decay, doc, carry, tail, segmented=segmented, interpret=interpret)[2]


def _pass_vectors(g, beta, doc, carry, tail, key_dim):
    """The per-token vectors of the passes (5, B*H, Tp), the document index as fp32 and the chunk survival factors
    repeated K = `key_dim` times (B*H, nt*K), in XLA (`Config.vectors="xla"`)."""
    B, Tp, H = beta.shape
    nt, C, K = Tp // CHUNK, CHUNK, key_dim
    vectors = mosaic_wy_grads.token_vectors(g, beta, carry, tail)
    hi, lo = (x.reshape(B, nt, C, H) for x in g)
    survive = carry.reshape(B, nt, C, 1)[:, :, -1] * jnp.exp(hi[:, :, -1] + lo[:, :, -1])  # (B, nt, H)
    survive = jnp.broadcast_to(jnp.moveaxis(survive, 2, 1)[..., None], (B, H, nt, K)).reshape(B * H, nt * K)
    return vectors, doc.astype(F32), survive


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _wy_mosaic(static, q, k, v, beta, log_decay, doc, carry, tail, h0):
    """The forward, its sequential pass in Mosaic GPU (or Triton's: `Config.mosaic_forward`). Differentiated (the
    arguments are those of `wy_chunk._wy`), see `_wy_mosaic_fwd` and `_wy_mosaic_bwd`."""
    cfg, tcfg, scale, segmented, interpret = static
    if not cfg.mosaic_forward and cfg.vectors != "kernel":
        return wy_chunk._wy(tcfg, q, k, v, beta, log_decay, doc, carry, tail, h0)
    if not cfg.mosaic_forward:  # `wy_chunk._wy`'s forward on the kernel's gates
        g, *_ = _chunk_vectors(cfg, tcfg, log_decay, beta, doc, carry, tail, key_dim=k.shape[-1],
                               segmented=segmented, interpret=interpret)
        t = wy_chunk._inverses(tcfg, k, beta, g, doc)
        return wy_chunk._forward_pass(tcfg, q, k, v, beta, t, g, doc, carry, tail, h0, with_states=False)
    *_, inputs = _prologue(cfg, tcfg, k, beta, log_decay, doc, carry, tail, segmented=segmented,
                           interpret=interpret)
    return _forward_pass(cfg, q, k, v, *inputs, h0, scale=scale, segmented=segmented, interpret=interpret)


def _grads_read_the_passes(tcfg):
    """Whether the gradient kernels read u and dx saved by the passes and every chunk's bf16 start state and
    end-state cotangent (what the Mosaic passes write and the Mosaic gradient kernel reads)."""
    return wy_chunk._saves_u_dx(tcfg) and tcfg.state_storage == "bf16"


def _saves_triton_residuals(cfg, tcfg):
    """Whether the Mosaic pass runs and writes the backward's residuals (`Config.mosaic_forward`): where the
    backward reads them from the passes (no T in the gradient kernels) and T's bf16 pair exists."""
    return cfg.mosaic_forward and _grads_read_the_passes(tcfg) and tcfg.inverse_dots == "split"


def _wy_mosaic_fwd(static, q, k, v, beta, log_decay, doc, carry, tail, h0):
    """The Mosaic pass, also writing what the Triton backward reads (`_saves_triton_residuals`); otherwise the
    Triton forward pass with states (u as its bf16 pair where the Mosaic gradient kernel reads it). T's pair is
    written once, for the Mosaic pass and the reverse pass (fp32 T too where the reverse pass reads that)."""
    cfg, tcfg, scale, segmented, interpret = static
    if not _saves_triton_residuals(cfg, tcfg):
        if cfg.vectors != "kernel":
            return wy_chunk._wy_fwd(tcfg, q, k, v, beta, log_decay, doc, carry, tail, h0,
                                    u_pair=_mosaic_grads_apply(cfg, tcfg))
        # The Triton forward on the kernel's gates; its vectors kept for the backward.
        g, *made = _chunk_vectors(cfg, tcfg, log_decay, beta, doc, carry, tail, key_dim=k.shape[-1],
                                  segmented=segmented, interpret=interpret)
        out, residuals = wy_chunk._wy_fwd(tcfg, q, k, v, beta, log_decay, doc, carry, tail, h0,
                                          u_pair=_mosaic_grads_apply(cfg, tcfg), g=g)
        return out, (*residuals, tuple(made))
    reverse_fp32 = not _mosaic_reverse_applies(cfg, tcfg) and tcfg.reverse_inverse_storage != "split"
    g, t_fp32, inputs = _prologue(cfg, tcfg, k, beta, log_decay, doc, carry, tail, segmented=segmented,
                                  interpret=interpret, reverse_fp32=reverse_fp32)
    saves_u = not _recomputes_u(cfg, tcfg)
    o, final, starts, *u = _forward_pass(cfg, q, k, v, *inputs, h0, scale=scale, segmented=segmented,
                                         interpret=interpret, with_states=True, with_u=saves_u)
    t_reverse = t_fp32 if reverse_fp32 else inputs[0]
    # The vectors, document index and survival factors made once, for the backward's kernels too. u None: the
    # gradient kernel forms it from T.
    u = tuple(u) if saves_u else None
    return (o, final), (q, k, v, beta, g, doc, carry, tail, t_reverse, None, starts, [u], inputs[1:])


def _mosaic_grads_apply(cfg, tcfg):
    """Whether the gradient kernel is the Mosaic one (`Config.grads`): it reads what the Triton "merged" kernel
    reads, every chunk's bf16 start state and end-state cotangent, and u and dx saved by the passes."""
    return cfg.grads == "mosaic" and _grads_read_the_passes(tcfg)


def _recomputes_u(cfg, tcfg):
    """Whether the Mosaic gradient kernel forms u itself (`Config.recompute_u`), where the Mosaic forward pass runs
    with bf16 state products (the gradient kernel reads bf16(S_0) for K S_0, as that pass does)."""
    return cfg.recompute_u and cfg.state_dots == "bf16" and _mosaic_grads_apply(cfg, tcfg)


def _mosaic_reverse_applies(cfg, tcfg):
    """Whether the reverse pass is the Mosaic one (`Config.mosaic_reverse`): it writes what the gradient kernels
    read from the passes (bf16 end-state cotangents, dx as its pair, which the Triton kernels read summed), after
    the Mosaic forward pass (whose T pair and vectors it reads) or before the Mosaic gradient kernel."""
    return (cfg.mosaic_reverse and _grads_read_the_passes(tcfg)
            and (cfg.mosaic_forward or _mosaic_grads_apply(cfg, tcfg)))


def _wy_mosaic_bwd(static, residuals, cotangents):
    """The reverse pass (Mosaic's or Triton's, `_mosaic_reverse_applies`), then the chunk-parallel gradients in
    Mosaic GPU (`_mosaic_grads_apply`) or Triton's."""
    cfg, tcfg, scale, segmented, interpret = static
    q, k, v, beta, g, doc, carry, tail, t, _, starts, (u,), *made = residuals
    do, dfinal = cotangents
    do = do.astype(v.dtype)
    mosaic_reverse, mosaic_grads = _mosaic_reverse_applies(cfg, tcfg), _mosaic_grads_apply(cfg, tcfg)
    if mosaic_reverse or mosaic_grads:
        # The forward's vectors (the kernel's 6 rows with `Config.vectors="kernel"`, or the Mosaic pass's XLA 5),
        # or made here in XLA (5 rows, and the gradient kernel's 6 in `grads`).
        vectors, doc_f, survive = made[0] if made else _pass_vectors(g, beta, doc, carry, tail, k.shape[-1])
        # T as its bf16 pair (2, B, Tp, H, C) for the Mosaic reverse pass and (u None, `_recomputes_u`) the
        # gradient kernel, which then forms u from it: the Mosaic forward's pair, or fp32 T split here.
        t_pair = t if t.ndim == 5 else jnp.stack(split_bf16_in_xla(t))
    if mosaic_reverse:
        dh0, dends, dx = _reverse_pass(cfg, q, k, do, t_pair, vectors, doc_f, survive, dfinal.astype(F32),
                                       scale=scale, segmented=segmented, interpret=interpret)
    if not mosaic_grads:
        # u's and dx's pairs from the Mosaic passes summed: the Triton gradient kernels read them in fp32.
        as_fp32 = lambda x: x[0].astype(F32) + x[1].astype(F32) if isinstance(x, tuple) else x
        reverse = (dh0, dends, as_fp32(dx)) if mosaic_reverse else None
        return wy_chunk._wy_bwd(tcfg, tuple(residuals[:11]) + ([as_fp32(u)],), cotangents, reverse=reverse)
    if not mosaic_reverse:
        dh0, dends, *dx = wy_chunk._reverse_pass(tcfg, q, k, beta, t, g, doc, carry, tail, do, dfinal.astype(F32),
                                                 dx_pair=True)
    with_kernel = cfg.vectors == "kernel" and bool(made)
    dq, dk, dv, dbeta, dlog = mosaic_wy_grads.grads(
        q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx, scale=scale, segmented=segmented,
        interpret=interpret, vectors=vectors if with_kernel else None, survive=survive if with_kernel else None,
        t_pair=t_pair if u is None else None, warpgroups=cfg.grads_warpgroups)
    return dq, dk, dv, dbeta.astype(beta.dtype), dlog, None, None, None, dh0


_wy_mosaic.defvjp(_wy_mosaic_fwd, _wy_mosaic_bwd)


def _check_supported(q, k, v, beta, log_decay, initial_state, chunk_size):
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape (B, T, H, K), got {q.shape} and {k.shape}")
    B, T, H, K = q.shape
    if K not in HEAD_DIMS:
        raise ValueError(f"q/k head dim K must be one of {HEAD_DIMS}, got {K}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape (B, T, Hv, V) matching q, got {v.shape}")
    if v.shape[2] % H:
        raise ValueError(f"value heads Hv must be a multiple of the key heads H (groups of Hv/H value heads share a "
                         f"key head), got Hv={v.shape[2]}, H={H}")
    if v.shape[3] not in HEAD_DIMS:
        raise ValueError(f"v head dim V must be one of {HEAD_DIMS}, got {v.shape[3]}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype != BF16:
            raise ValueError(f"{name} must be bfloat16 (the only input dtype supported), got {x.dtype}")
    if beta is None:
        raise ValueError("beta is None (linear attention) is not supported: the Mosaic path is the delta rule only")
    Hv = v.shape[2]
    if beta.shape != (B, T, Hv):
        raise ValueError(f"beta must have shape (B, T, Hv) = {(B, T, Hv)}, got {beta.shape}")
    if log_decay is not None and log_decay.shape != (B, T, Hv):
        raise ValueError(f"log_decay must be a scalar decay per token and value head, shape {(B, T, Hv)} "
                         f"(per-key decay, KDA, is not supported), got {log_decay.shape}")
    if initial_state is not None and initial_state.shape != (B, Hv, K, v.shape[3]):
        raise ValueError(f"initial_state must have shape (B, Hv, K, V) = {(B, Hv, K, v.shape[3])}, got "
                         f"{initial_state.shape}")
    if chunk_size != CHUNK:
        raise ValueError(f"chunk_size must be {CHUNK} (the only size supported), got {chunk_size}")


def chunk_wy_mosaic(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64, interpret=None,
                    config=None):
    """Gated DeltaNet forward (o, final_state) with the sequential pass in Mosaic GPU; the signature of
    `wy_chunk.chunk_wy`. Supported: bf16 q/k/v, K and V in `HEAD_DIMS` (one CTA per head at K = V = 128 only,
    `check_config`), Hv a multiple of H, scalar or no decay, any T, optional initial state and segment_ids,
    chunk_size 64. `interpret` (default: when the backend is not a GPU) runs the
    kernel in the Mosaic GPU interpreter; `config`: a `Config` (default `default_config()`). Differentiated: the
    reverse pass (Mosaic GPU's from 32 value heads per call on, `Config.mosaic_reverse`), then the gradient kernel
    in Mosaic GPU (`Config.grads`)."""
    _check_supported(q, k, v, beta, log_decay, initial_state, chunk_size)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    K, V = q.shape[3], v.shape[3]
    cfg = (default_config(interpret, batch_heads=q.shape[0] * v.shape[2], key_dim=K, value_dim=V) if config is None
           else config)
    check_config(cfg, K, V)
    if cfg.p_operand == "registers" and interpret:
        raise ValueError("p_operand='registers' does not run in the Mosaic GPU interpreter (it takes wgmma's A from "
                         "SMEM only); use 'smem' there")
    triton_cfg = _triton_config(q, v, scale=scale, segmented=segment_ids is not None, interpret=bool(interpret),
                                gated=log_decay is not None)
    static = (cfg, triton_cfg, float(scale), segment_ids is not None, bool(interpret))
    args = wy_chunk.padded_call_inputs(q, k, v, beta, log_decay, initial_state, segment_ids, chunk_size)
    o, final = _wy_mosaic(static, *args)
    return o[:, :q.shape[1]], final
