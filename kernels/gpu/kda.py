"""KDA (the delta rule with one log-decay per key channel) as Pallas Triton kernels, forward and backward.

The recurrence, per token t with alpha_t = exp(log_decay_t) [K]:

    S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T,      o_t = scale S_t^T q_t

Chunkwise form (`deltajax.rules.chunk` with per-channel gates). Per chunk of C tokens, with S_0 the state at the
chunk's start, G [C, K] the in-chunk cumulative log-decay of every channel, D_tsc = exp(G_tc - G_sc), `carry_t`
(token t still belongs to the document open at the chunk's start) and `tail_s` (token s belongs to the document
open at the chunk's end):

    P_ts = sum_c q_tc k_sc D_tsc   (s <= t, same document)                                      (1)
    R_ts = sum_c k_tc k_sc D_tsc   (s <  t, same document)                                      (2)
    T    = (I + diag(beta) R)^-1   fp32 forward substitution (`Config.inverse`)                (3)
    A_tc = carry_t exp(G_tc),  E_sc = tail_s exp(G_Cc - G_sc),  gamma_c = carry_C exp(G_Cc)
    y    = V - (A (.) K) S_0,      u = T diag(beta) y                                           (4)
    O    = scale [ (A (.) Q) S_0 + P u ]                                                        (5)
    S_1  = Diag(gamma) S_0 + (E (.) K)^T u                                                      (6)

Unlike a scalar gate, D_tsc does not factor out of the channel sum, so P and R are not one masked product. They
are built from 16-token sub-chunks so that no exponent is ever positive (a log-decay of -20 per token overflows
exp(-G_s) within five tokens):

  * t in a later sub-chunk than s's sub-chunk j: split at the reference gate G_ref, the gate of sub-chunk j's last
    token, D_ts = exp(G_t - G_ref) exp(G_ref - G_s), both factors <= 1. One C x K x C product per j covers all
    such pairs: (Q (.) to_ref_j) (K (.) from_ref_j)^T, to_ref_j zero on sub-chunks <= j, from_ref_j zero outside j;
  * t and s in one sub-chunk: the exact exponent, masked before exp. A loop over the 16 offsets r pairs every
    token with the token at offset r of its own sub-chunk (its "partner", read by one strided load of rows r,
    r + 16, ...) and fills one column per sub-chunk.

A chunk whose gates span little (G_0 - G_{C-1} <= `SPAN_LIMIT` in every channel, the usual case in training) skips
the sub-chunks: every pair splits at the last token's gate, one C x K x C product per matrix (see SPAN_LIMIT). Each
program checks its own chunk and takes one path or the other (`lax.cond`), in prepare and in the pair gradients.

G is a compensated cumsum (hi + lo, as `deltajax.rules.chunk.CumulativeLogDecay`; formed by `_cumulative_kernel`
with an exact TwoSum per row): differences subtract the large parts first, so pairs that decay by ~1 after a -20
gate keep full fp32 accuracy.

Kernels (grids of at most 3 axes, every program independent; value head hv reads key head hv // (Hv // H) through
the index maps, never a repeated copy):

- `_prepare_partner_kernel` (`Config.prepare="partner"`, default) or `_prepare_blocks_kernel` (`"blocks"`: the
  same in 16 x 16 blocks from 16-row ref slices, the partner token read as a ref row), grid (chunks, B*Hv): (1)-(3)
  for one chunk, "partner" summing P and R over blocks of `Config.block_k` channels; writes P and T (C x C fp32
  each) and, for the backward, R (strict, same document).
- `_gates_kernel` (`Config.cumsum="with_operands"`, default), grid (chunks, B*Hv): the compensated cumsum G of one
  chunk (`_cumulative_kernel`'s rows) and, from the same numbers, the forward's stored operands below; under
  differentiation also the parts only the backward reads (`Config.backward_operands="saved"`, default), which the
  backward then takes from the residuals.
- `_operands_kernel` (`Config.operands="stored"`, default), grid (K/BK, chunks, B*Hv): A (.) Q, A (.) K, E (.) K
  (the bf16 parts each phase reads, for "split" products) and gamma for one chunk and BK channels, so that the
  passes below load dot operands instead of forming them in every step; with `cumsum` "xla" or "kernel" the
  forward's, and with `backward_operands="formed"` the backward's, formed again at its start.
- `_forward_kernel`, grid (V/BV, B*Hv): `fori_loop` over the chunks with the fp32 state block S[:, BV] (K x BV) in
  registers, (4)-(6); writes O, the final state and, for the backward, every chunk's start state and
  (`Config.grads_from_passes`) u as a bf16 (hi, lo) pair.
  With `Config.forward="split"` instead: `_state_kernel` (same grid and loop, (4) and (6) only, always writing the
  start states), then `_output_kernel`, grid (V/BV_out, chunks, B*Hv), (4) and (5) from the saved start states;
  the undifferentiated forward alone runs so with fp32 start states where the passes take V blocks of 16
  (`Config.primal_forward`, default there).
  With `Config.pass_backend="mosaic"` (Hopper, bf16, K of 64 or 128, V up to 256; `mosaic_config`): the same pass
  in Mosaic GPU (`mosaic_kda.py`), reading T and P as bf16 (hi, lo) pairs, which prepare then writes and the
  reverse pass reads.
- `_reverse_kernel`, grid (V/BV, B*Hv): the same loop backwards carrying dL/dS; writes every chunk's end-state
  cotangent, dL/d(initial_state) and (`Config.grads_from_passes`) dx = dL/d(beta y) as a bf16 pair.
- `_grad_v_kernel`, grid (chunks, B*Hv): the V contractions of one chunk, chunk-parallel, from the saved start
  states and end-state cotangents (a loop over V blocks; u and dx read as the passes saved them, or formed again
  from T and P): dv, dE, the state/boundary parts of dq, dk, dG, dbeta, and dP, dL/d(diag(beta) R) (C x C).
- `_grad_pair_kernel`, grid (K/BK, chunks, B*Hv) (BK = `Config.pair_block_k`): the decayed pair products of dP
  and dR in 16 x 16 blocks (the block scheme of `_prepare_blocks_kernel`), added to the V kernel's partials; every
  output is per channel, so channel blocks are independent programs (dbeta's share through R, which needs all
  channels, is summed in the V kernel from R saved by prepare). It also turns dG and dE into d(log_decay) (the
  in-chunk sums: reverse for G, exclusive forward for E, whose gates are those after s).
- With `Config.fused_pair_grads` (the 16-bit default), a call whose chunks all span at most `SPAN_LIMIT` runs one
  kernel instead of the last two: `_grad_v_kernel` over grid (K/BK, chunks, B*Hv) forms both dP and dM in every
  program and adds the pair terms of its BK channels (`_one_reference_pair_products`, `_sum_pair_terms`), writing
  dq, dk and d(log_decay); the partials and the squares never go through memory. With the passes' u and dx
  (`Config.grads_from_passes`) it forms the squares in a first loop over V blocks and their pair products after
  it, before the V contractions' loop (fewer tiles live at once).

In XLA around them: padding (T to a multiple of C, K and V to powers of two >= 16), the document flags and, when
value heads share a key head, the sum of dq/dk over them. (The cumsums of d(log_decay) and dtype casts in XLA took
~1 ms of the 6.2 ms forward+backward at 8x2048x16x128 bf16 on the H100; docs/kernels.md.)

Precision (`Config.dots`, products with an fp32 operand): "highest" (IEEE fp32; fp32 inputs) or "split" (16-bit
inputs): each fp32 operand x is written as hi + lo with hi = bf16(x), lo = bf16(x - hi), and the product is summed
from bf16 tensor-core dots hi*hi + hi*lo + lo*hi (~2^-16 relative per product; TF32 would give ~2^-11, which the
inverse can amplify for correlated keys). For bfloat16 inputs the products with a chunk state or state cotangent,
and dO S_0^T, dx S_0^T, take plain bf16 operands (`Config.state_dots`, `Config.grad_k_dots`, TOLERANT_DOT_MODES),
and the saved start states and end-state cotangents are stored in bf16 (`Config.state_storage`); the output's
(A (.) Q) S_0 stays "split" (`Config.output_dots`).
The inverse's own substitution and merges are always IEEE fp32.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.kernels.gpu import mosaic_kda, mosaic_kda_grads
from deltajax.kernels.gpu.common import chunk_parallel_call as _chunk_parallel_call
from deltajax.kernels.gpu.common import compiler_params as _params
from deltajax.kernels.gpu.common import dot as _dot
from deltajax.kernels.gpu.common import last as _last
from deltajax.kernels.gpu.common import one_program_per_sm_block_v, sequential_block_v
from deltajax.kernels.gpu.common import split_bf16 as _split_bf16
from deltajax.kernels.gpu.common import split_pair_dot as _split_pair_dot
from deltajax.kernels.gpu.common import unit_lower_inverse as _unit_lower_row_inverse
from deltajax.rules.chunk import CumulativeLogDecay
from deltajax.rules.common import document_index

SUB = 16  # sub-chunk of the pair matrices and side of the diagonal blocks of the inverse
CHUNK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256
F32 = jnp.float32
BF16 = jnp.bfloat16
HIGHEST = lax.Precision.HIGHEST
DOT_MODES = ("highest", "split")  # the modes this kernel is tested with (`common.dot` has more)
# "rows": forward substitution over all C rows (C sequential steps on C x C values); "blocks": 16 x 16 diagonal
# blocks by substitution, then block merges X_ij = -X_ii sum_m a_im X_mj. Both exact fp32 (never Neumann series
# or doubling). With correlated keys and beta near 2, cond(I + A) reaches ~3e3 and "blocks" had 2-3x the error
# of "rows" in T and in the outputs (1.7e-5 vs 7.5e-6 against the fp32 scan on one such input), hence the default.
INVERSE_METHODS = ("rows", "blocks")
# "partner": whole C x C / C x K values, a C x K x C product per reference and a 16-step loop over partner offsets
# (measured faster on the H100); "blocks": 16 x 16 blocks from 16-row ref slices (measured 2.4x slower: 12.7 ms
# against 5.2 ms at 8x2048x16x128 bf16).
PREPARE_METHODS = ("partner", "blocks")
# How the partner loop of `prepare="partner"` gets, for offset r, row r of every sub-chunk (of k and the gates):
# "gathered" from the C x BK tiles it holds (a masked sum over each sub-chunk, a reduction across rows through
# shared memory, three per step); "loaded" from the refs with one strided load each (prepare 3.27 -> 2.59 ms at
# 8x2048x16x128 bf16 on the H100; docs/kernels.md, "KDA: partner rows by strided loads").
PARTNER_ROWS = ("gathered", "loaded")
# "fused": one sequential pass does (4)-(6) and writes O. "split": the pass carries only the state ((4) and (6):
# no q, no P, two of the five products) and writes every chunk's start state; `_output_kernel` then does (4)
# and (5) chunk-parallel from those states. On the H100 the fused pass measured 3.8 ms at 8x2048x16x128 bf16
# against a ~0.4 ms floor, with far more live C x K fp32 values than registers; "split" is the Gated DeltaNet
# kernels' answer to the same problem (docs/kernels.md).
FORWARD_METHODS = ("fused", "split")
# Where the sequential passes get a chunk's boundary operands A (.) Q, A (.) K, E (.) K and gamma. "inline": every
# step forms them from q, k and the gates (two C x K exps, and for 16-bit inputs the bf16 pairs of three C x K fp32
# tiles); "stored": `_operands_kernel` (or, in the forward, `_gates_kernel`) forms them once, chunk-parallel, and
# writes them (bf16 parts for 16-bit inputs, only those each phase reads: `_operand_parts`; fp32 otherwise), so the
# step only loads dot operands. The same values either way: the products are unchanged. With "inline" on the H100
# every KDA kernel sat at 255 registers and spilled (docs/kernels.md).
OPERAND_METHODS = ("inline", "stored")
# Where the compensated in-chunk cumsum G = hi + lo of the log-decay is formed. "xla": `CumulativeLogDecay.of`
# (0.74-0.92 ms at 8x2048x16x128 bf16 on the H100, 2026-11-25, for 134 MB in and 268 MB out); "kernel":
# `_cumulative_kernel`, one pass over the rows of each chunk with an exact TwoSum per addition.
# "with_operands": the cumsum kernel also writes the forward's stored operands (`_gates_kernel`), so that no
# kernel reads G back to form them (the backward's come from it too with `backward_operands="saved"`, else from
# `_operands_kernel`).
CUMSUM_METHODS = ("xla", "kernel", "with_operands")
# Where the backward's stored operands come from (`Config.backward_operands`, stored operands only). "formed":
# `_operands_kernel` forms them again at the start of the backward from q, k and the gates, so only the residuals
# the backward needs anyway stay alive between the two. "saved": the forward's operand kernel (or `_gates_kernel`)
# also writes the parts only the backward reads (for bfloat16 inputs A (.) K's lo half; `_operand_parts(cfg,
# "both")`) and the backward takes its tiles from the saved ones (the same values bit for bit: one kernel, one
# rounding), so the backward runs no operand kernel, at the price of those tiles kept alive from the forward to the
# backward (for bfloat16 inputs four bf16 tiles of C x K per chunk and value head). Without stored operands
# (`operands="inline"`) there is nothing to save and the knob does nothing.
BACKWARD_OPERANDS = ("formed", "saved")
# The products that tolerate plain bf16 operands for bf16 inputs (`Config.state_dots`, `Config.grad_k_dots`): the
# products of a chunk operand with a chunk state or state cotangent, and those of dO and dx with S_0; not the
# output's (A (.) Q) S_0 (`Config.output_dots`), which decides o where the state dominates it. Measured in
# the interpreter on the adversarial families (docs/kernels.md, "KDA: bf16 products"): u dS_end^T and the dR
# products, tolerant in the scalar-decay kernels, took d(log_decay) over its bound with correlated keys (one
# gradient per channel here, not a sum over channels), so they stay "split" with T, P, E (.) K^T u, dO u^T, dx u^T.
TOLERANT_DOT_MODES = ("highest", "split", "bf16")
# A chunk whose gates span at most SPAN_LIMIT in every channel (G_0 - G_{C-1} <= SPAN_LIMIT, the in-chunk cumulative
# log-decay of its first and last token) needs no sub-chunks: all its pairs split at one reference, the last token's
# gate, D_ts = exp(G_t - G_end) exp(G_end - G_s), the first factor in [1, e^SPAN_LIMIT], the second in
# [e^-SPAN_LIMIT, 1]. Every factor is finite, each product term keeps its relative precision, and the pairs s > t
# that the masks drop stay below e^SPAN_LIMIT |q| |k| K. Chunks with a larger span (a log-decay of -20 per token
# spans 1260) take the sub-chunk scheme, decided per program at run time (`lax.cond`).
SPAN_LIMIT = 30.0
# dtype of the saved chunk start states and end-state cotangents (`Config.state_storage`). "bf16" needs bf16 state
# products (state_dots = grad_k_dots = "bf16"): then the V gradient kernel's only readers at a higher precision are
# (E (.) K)-side u dS_end^T (u's split against bf16 dS_end: two bf16 dots instead of three) and the fp32 sum of
# S_0 (.) dS_end behind gamma's gradient, both rounded once more than with fp32 storage.
STATE_STORAGES = ("fp32", "bf16")
PASS_BACKENDS = ("triton", "mosaic")
INPUT_DTYPES = ("float32", "bfloat16", "float16")
# Compiled (not interpreted), padded K or V above this take bfloat16 inputs only (`compiles_for`): at K = V = 256
# with float32 inputs a gradient kernel asked 264 KiB of shared memory (227 KiB on Hopper; H200, 2026-12-04), and
# float16 there was never run. The interpreter takes every INPUT_DTYPES up to MAX_HEAD_DIM.
NON_BF16_MAX_HEAD_DIM = 128

__all__ = ["CHUNK_SIZES", "CUMSUM_METHODS", "DOT_MODES", "FORWARD_METHODS", "INVERSE_METHODS", "MAX_HEAD_DIM",
           "OPERAND_METHODS", "PREPARE_METHODS", "STATE_STORAGES", "Config", "default_config", "kda_chunk"]


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable: the `custom_vjp`'s non-differentiable argument)."""

    scale: float
    chunk_size: int
    key_heads: int
    value_heads: int
    segmented: bool  # same-document masks inside the chunk are needed
    dots: str  # products with an fp32 operand (DOT_MODES)
    inverse: str  # how T is formed (INVERSE_METHODS)
    prepare: str  # how P, T and R are formed (PREPARE_METHODS)
    block_v: int  # BV of the sequential passes
    grad_block_v: int  # BV of the loop inside the V gradient kernel (the two-kernel path)
    warps: int  # sequential passes
    prepare_warps: int  # prepare kernel
    grad_warps: int  # gradient kernel of the V contractions
    pair_warps: int  # gradient kernel of the pair terms
    stages: int
    interpret: bool
    forward: str = "fused"  # FORWARD_METHODS
    # The method of the forward when it is not differentiated (FORWARD_METHODS, or None: `forward`'s). "split" here
    # writes fp32 start states for its output kernel whatever `state_storage` says (the output's (A (.) Q) S_0 then
    # rounds S_0 only as the fused pass does, so decoding stays exact), as only its own output kernel reads them.
    primal_forward: str | None = None
    output_block_v: int = 64  # BV of `_output_kernel` ("split")
    operands: str = "inline"  # OPERAND_METHODS
    block_k: int = 128  # channels per step of prepare's loop and per program of the operand and pair kernels
    reverse_warps: int = 4  # reverse pass
    pair_block_k: int = 128  # channels per program of the pair gradient kernel
    pass_stages: int = 2  # software-pipeline depth of the sequential passes (stored operands need 1: shared memory)
    grad_v_splits: int = 1  # programs per chunk of the V gradient kernel, each over V / grad_v_splits columns
    # Programs per chunk of the V gradient kernel, each over K / grad_k_splits channels (1 or 2; 2 needs
    # `grads_from_passes`): half the C x K accumulators per program, dP formed on one and dM on the other.
    grad_k_splits: int = 1
    # The pair terms formed in the V gradient kernel's epilogue (`_grads_fused`) when every chunk of the call spans at
    # most `span_limit` (one reference per chunk): one program per chunk and `pair_block_k` channels forms both dP
    # and dM and writes dq, dk and d(log_decay) of its channels, so no partials or squares go through memory. Calls
    # with a longer span, or without the call's span check (`span_limit` None, `call_span_check` False), run the two
    # kernels.
    fused_pair_grads: bool = False
    fused_grad_block_v: int = 32  # BV of the same loop when the kernel also forms the pair terms (`fused_pair_grads`)
    grid_order: str = "chunks"  # launch order of the chunk-parallel kernels (`common.GRID_ORDERS`)
    cumsum: str = "xla"  # CUMSUM_METHODS
    partner_rows: str = "loaded"  # PARTNER_ROWS: how prepare's partner loop gets the partner tokens' rows
    state_dots: str = "split"  # (A.K) S_0, (E.K) dS, (A.Q)^T dO (TOLERANT_DOT_MODES)
    # (A.Q) S_0 in the forward's output (TOLERANT_DOT_MODES): plain bf16 operands took o of a short sequence from an
    # initial state (decoding) over the bf16 output bound (docs/kernels.md, "KDA: the output's state product").
    output_dots: str = "split"
    grad_k_dots: str = "split"  # the V gradient kernel's dO S_0^T and dx S_0^T (TOLERANT_DOT_MODES)
    span_limit: float | None = None  # chunks whose gate span is at most this take one reference (`_bounded_span`)
    # Set by `_when_all_bounded` for the kernels of a call whose chunks all span at most `span_limit`: one reference
    # everywhere, and the sub-chunk code is not compiled into them (its registers cost prepare ~0.1 ms).
    all_bounded: bool = False
    # Whether the call checks all its chunks at once (`_when_all_bounded`) before the per-program switch.
    call_span_check: bool = True
    state_storage: str = "fp32"  # STATE_STORAGES
    # The passes save u (forward) and dx (reverse), which they compute anyway, as bf16 (hi, lo) pairs, and the V
    # gradient kernel reads them instead of forming them again from T, P and the states (no products with T or P,
    # nor (E (.) K) dS_end, in its loop; T and P are not kept in its registers).
    grads_from_passes: bool = False
    # The forward pass's kernel (PASS_BACKENDS): "triton" (`_forward_kernel`) or "mosaic", the same pass in Mosaic GPU
    # on Hopper (`mosaic_kda.forward_pass`: bf16 inputs, K of 64 or 128, V up to 256, stored operands, plain bf16
    # state products), with state blocks of `mosaic_block_v` columns.
    pass_backend: str = "triton"
    mosaic_block_v: int = 64
    mosaic_shared_head: bool = False  # one CTA per value head (`mosaic_kda._body_producer`; V blocks of 64)
    # One CTA per V block with a producer warpgroup that releases each input as soon as it is read
    # (`mosaic_kda._body_producer` with one consumer) instead of `emit_pipeline`'s whole steps
    # (`MOSAIC_PRODUCER_AT_128`).
    mosaic_producer: bool = False
    # The reverse pass's kernel (PASS_BACKENDS): "mosaic" (`mosaic_kda.reverse_pass`, V blocks of `mosaic_block_v`)
    # needs the Mosaic forward pass (T and P as pairs) and the backward's stored operands with plain bf16 state
    # products. The default of `mosaic_config` (timed on an H200, 2026-11-29; `MOSAIC_PASS_MIN_BATCH_HEADS`).
    reverse_backend: str = "triton"
    # The Mosaic reverse pass with a producer warpgroup per V block, as `mosaic_producer` (`mosaic_kda._reverse_body`).
    mosaic_reverse_producer: bool = False
    # The Mosaic reverse pass with one CTA per value head, as `mosaic_shared_head` (V blocks of 64).
    mosaic_reverse_shared_head: bool = False
    # The gradient kernel of a call whose chunks all span at most `span_limit` (PASS_BACKENDS): "triton" (the fused
    # `_grad_v_kernel`, `fused_pair_grads`) or "mosaic" (`mosaic_kda_grads.grads`: one CTA of two warpgroups per
    # chunk and value head, the squares formed once; bf16, K = V = 128, the passes' saved u and dx and bf16 states).
    # Calls with a longer span take the two Triton kernels either way. Opt-in: measured slower than the Triton kernel
    # (2.33 against 1.88 ms at 8x2048x16x128, H200, 2026-11-29; docs/kernels.md).
    grads_backend: str = "triton"
    backward_operands: str = "formed"  # BACKWARD_OPERANDS


def _masked_exp(mask, x):
    """exp(x) where `mask`, else 0; masked before exp, so an unselected (possibly positive) exponent never runs."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


class _Geometry(NamedTuple):
    """Token positions of one chunk (C tokens, sub-chunks of SUB)."""

    rows: jax.Array  # (C, 1) token index t
    rows_cc: jax.Array  # (C, C) row index
    lanes: jax.Array  # (C, C) column index s
    block: jax.Array  # (C, 1) sub-chunk of t
    offset: jax.Array  # (C, 1) position of t inside its sub-chunk
    base: jax.Array  # (C, 1) first token of t's sub-chunk
    base_lanes: jax.Array  # (1, C) first token of column s's sub-chunk


def _geometry(C: int) -> _Geometry:
    shift = SUB.bit_length() - 1
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    lanes_row = lax.broadcasted_iota(jnp.int32, (1, C), 1)
    block = lax.shift_right_logical(rows, jnp.int32(shift))
    return _Geometry(
        rows=rows, rows_cc=lax.broadcasted_iota(jnp.int32, (C, C), 0),
        lanes=lax.broadcasted_iota(jnp.int32, (C, C), 1), block=block, offset=rows & (SUB - 1),
        base=lax.shift_left(block, jnp.int32(shift)),
        base_lanes=lax.shift_left(lax.shift_right_logical(lanes_row, jnp.int32(shift)), jnp.int32(shift)))


def _row(geo, x, i):
    """Row i of x as a 1-D value: a masked sum over rows, exact (one term and zeros)."""
    return jnp.sum(jnp.where(geo.rows == i, x, 0.0), axis=0)


def _masks(geo, doc, segmented):
    """(s <= t, s < t), both restricted to one document when `segmented`."""
    rows = geo.rows_cc
    incl, strict = geo.lanes <= rows, geo.lanes < rows
    if segmented:
        same = doc[:, None] == doc[None, :]
        incl, strict = incl & same, strict & same
    return incl, strict


class _Boundary(NamedTuple):
    a: jax.Array  # (C, K) carry_t exp(G_tc)
    e: jax.Array  # (C, K) tail_s exp(G_Cc - G_sc)
    gamma: jax.Array  # (K,) carry_C exp(G_Cc): how much of S_0 survives the chunk, per channel


def _boundary(geo, g, glo, carry, tail):
    C = g.shape[0]
    g_last, glo_last = _row(geo, g, C - 1)[None, :], _row(geo, glo, C - 1)[None, :]
    a = carry[:, None] * jnp.exp(g + glo)
    e = tail[:, None] * jnp.exp((g_last - g) + (glo_last - glo))
    gamma = _last(carry) * jnp.exp(g_last[0] + glo_last[0])
    return _Boundary(a, e, gamma)


def _partner(geo, x, r):
    """Row t -> row base_t + r of x (C x D): every token sees the token at offset r of its own sub-chunk.

    A masked sum over each sub-chunk and a broadcast back, exact in fp32; `r` may be a loop index.
    """
    C, D = x.shape
    n = C // SUB
    picked = jnp.where(geo.offset == r, x, 0.0).reshape(n, SUB, D)
    per_block = jnp.sum(picked, axis=1, keepdims=True)
    return jnp.broadcast_to(per_block, (n, SUB, D)).reshape(C, D)


def _reference_split(geo, g, glo, j):
    """(to_ref, from_ref) of sub-chunk j: D_ts = to_ref_t from_ref_s for t in a later sub-chunk and s in j.

    G_ref is the gate of sub-chunk j's last token, so G_t <= G_ref <= G_s and both exponents are <= 0;
    to_ref is zero on rows of sub-chunks <= j, from_ref outside sub-chunk j.
    """
    token = SUB * (j + 1) - 1
    ref, ref_lo = _row(geo, g, token)[None, :], _row(geo, glo, token)[None, :]
    to_ref = _masked_exp(geo.block > j, (g - ref) + (glo - ref_lo))
    from_ref = _masked_exp(geo.block == j, (ref - g) + (ref_lo - glo))
    return to_ref, from_ref


def _bounded_span(cfg, g_ref, glo_ref, cols):
    """Whether every channel in `cols` spans at most `cfg.span_limit` over the chunk (a traced bool); None when
    there is no limit (`lax.cond` on a constant does not lower for Triton), True when every chunk of the call is
    known to be bounded (`Config.all_bounded`)."""
    if cfg.span_limit is None:
        return None
    if cfg.all_bounded:
        return True
    first, last = pl.ds(0, 1), pl.ds(cfg.chunk_size - 1, 1)
    span = (g_ref[first, cols] - g_ref[last, cols]) + (glo_ref[first, cols] - glo_ref[last, cols])
    return jnp.max(span) <= cfg.span_limit


def _end_reference_split(g_ref, glo_ref, cols):
    """(exp(G_t - G_end), exp(G_end - G_t)) for every token t, G_end the chunk's last gate (C x BK each); see
    SPAN_LIMIT."""
    end = pl.ds(g_ref.shape[0] - 1, 1)
    d = (g_ref[:, cols] - g_ref[end, cols]) + (glo_ref[:, cols] - glo_ref[end, cols])
    return jnp.exp(d), jnp.exp(-d)


def _spread_partner_rows(x):
    """(C / SUB, D) rows, one per sub-chunk, -> (C, D): each row repeated over its sub-chunk."""
    n, D = x.shape
    return jnp.broadcast_to(x.reshape(n, 1, D), (n, SUB, D)).reshape(n * SUB, D)


def _pair_matrices(geo, lefts, b, g, glo, mode, partner_rows):
    """For each a in `lefts`: M[t, s] = sum_c a_tc b_sc D_tsc for s < t (unmasked by documents; 0 on and above
    the diagonal). `partner_rows(r)` gives (G hi, G lo, b) at row base_t + r for every row t (C x D each); the
    pair (t, base_t + r) decays by exp(G_t - G_p) where p < t, masked before exp; p = t is left out (its decay
    is the constant 1, which callers add without exp so that it never enters dG)."""
    C = g.shape[0]
    out = [jnp.zeros((C, C), F32) for _ in lefts]
    for j in range(C // SUB - 1):
        to_ref, from_ref = _reference_split(geo, g, glo, j)
        b_from = b * from_ref
        out = [m + _dot(a * to_ref, b_from, tb=True, mode=mode) for m, a in zip(out, lefts)]

    def diagonal(r, out):
        g_p, glo_p, b_p = partner_rows(r)
        after = _masked_exp(geo.offset > r, (g - g_p) + (glo - glo_p))  # exp(G_t - G_p)
        column = geo.lanes == geo.base + r  # entry [t, base_t + r]; rows with p >= t get 0 from `after`
        return tuple(jnp.where(column, jnp.sum(a * b_p * after, axis=1)[:, None], m) for m, a in zip(out, lefts))

    return list(lax.fori_loop(0, SUB, diagonal, tuple(out)))


def _unit_lower_inverse(a):
    """Blocks {(i, j): X_ij, j <= i} of X = (I + a)^-1, a strictly lower C x C: 16 x 16 forward substitutions,
    then X_ij = -X_ii sum_{j <= m < i} a_im X_mj, all at IEEE fp32 (never Neumann series or doubling: powers of a
    overflow for correlated keys)."""
    nb = a.shape[0] // SUB
    blocks = [jnp.split(r, nb, axis=1) for r in jnp.split(a, nb, axis=0)]
    x = {(i, i): _unit_lower_row_inverse(blocks[i][i]) for i in range(nb)}
    for d in range(1, nb):
        for i in range(d, nb):
            j = i - d
            acc = _dot(blocks[i][j], x[j, j])
            for m in range(j + 1, i):
                acc = acc + _dot(blocks[i][m], x[m, j])
            x[i, j] = -_dot(x[i, i], acc)
    return x


def _blk(i):
    """Rows (or columns) of sub-chunk i."""
    return pl.ds(i * SUB, SUB)


def _iota(n, m, axis):
    return lax.broadcasted_iota(jnp.int32, (n, m), axis)


def _block_masks(doc_ref, i, j, segmented):
    """(s <= t, s < t) for the (i, j) block of a chunk (i >= j), restricted to one document when `segmented`."""
    rows, cols = _iota(SUB, SUB, 0), _iota(SUB, SUB, 1)
    if i == j:
        incl, strict = cols <= rows, cols < rows
    else:
        incl = strict = rows >= 0
    if segmented:
        same = doc_ref[_blk(i)][:, None] == doc_ref[_blk(j)][None, :]
        incl, strict = incl & same, strict & same
    return incl, strict


def _gates(g_ref, glo_ref, rows):
    return g_ref[rows, :], glo_ref[rows, :]


def _reference(g_ref, glo_ref, j):
    """The reference gate of sub-chunk j: the gate of its last token, (1, K) hi and lo."""
    return _gates(g_ref, glo_ref, pl.ds(j * SUB + SUB - 1, 1))


def _to_ref(gates, ref):
    """exp(G_t - G_ref) for t in a later sub-chunk than the reference's (exponent <= 0)."""
    (g, glo), (r, rlo) = gates, ref
    return jnp.exp((g - r) + (glo - rlo))


def _from_ref(gates, ref):
    """exp(G_ref - G_s) for s in the reference's sub-chunk, at or before it (exponent <= 0)."""
    (g, glo), (r, rlo) = gates, ref
    return jnp.exp((r - g) + (rlo - glo))


def _partner_exponent(g_ref, glo_ref, gates, row):
    """G_t - G_c for the SUB tokens t of `gates` and the token c at `row` (a (1, K) ref row), compensated."""
    g, glo = gates
    return (g - g_ref[row, :]) + (glo - glo_ref[row, :])


def _substitute(systems):
    """Solves (I + l) x = b for each (l, [b, ...]) in `systems` (l strictly lower SUB x SUB fp32), all in one loop.

    Column-oriented forward substitution, exact fp32: at step m, row m of every x is final and is removed from the
    rows below through column m of l (l[r, m] = 0 for r <= m, so rows at and above m are left unchanged).
    """
    rows, cols = _iota(SUB, SUB, 0), _iota(SUB, SUB, 1)

    def step(m, xs):
        out, n = [], 0
        for l, bs in systems:
            l_col = jnp.sum(jnp.where(cols == m, l, 0.0), axis=1)[:, None]  # l[:, m]
            for _ in bs:
                x = xs[n]
                n += 1
                out.append(x - l_col * jnp.sum(jnp.where(rows == m, x, 0.0), axis=0)[None, :])
        return tuple(out)

    flat = lax.fori_loop(0, SUB - 1, step, tuple(b for _, bs in systems for b in bs))
    out, n = [], 0
    for _, bs in systems:
        out.append(list(flat[n:n + len(bs)]))
        n += len(bs)
    return out


def _identity():
    return jnp.where(_iota(SUB, SUB, 0) == _iota(SUB, SUB, 1), 1.0, 0.0).astype(F32)


def _hdot(a, b):
    return lax.dot_general(a, b, (((1,), (0,)), ((), ())), precision=HIGHEST, preferred_element_type=F32)


def _inverse_rows(a, nb):
    """Blocks (i, j <= i) of (I + a)^-1 by forward substitution row by row, done as 16-row strips: strip i's
    right-hand sides -sum_{m < i} a_im X_mj (IEEE fp32 dots), then substitution through a_ii (no explicit
    diagonal inverse is multiplied in: the same operations as the 64-row substitution, summed in another order)."""
    x = {}
    for i in range(nb):
        rhs = []
        for j in range(i):
            acc = _hdot(a[i, j], x[j, j])
            for m in range(j + 1, i):
                acc = acc + _hdot(a[i, m], x[m, j])
            rhs.append(-acc)
        (solved,) = _substitute([(a[i, i], rhs + [_identity()])])
        for j in range(i + 1):
            x[i, j] = solved[j]
    return x


def _inverse_blocks(a, nb):
    """Blocks (i, j <= i) of (I + a)^-1: the nb diagonal 16 x 16 inverses by substitution in one loop, then the
    merges X_ij = -X_ii sum_{j <= m < i} a_im X_mj, all at IEEE fp32 (never Neumann series or doubling)."""
    diag = _substitute([(a[i, i], [_identity()]) for i in range(nb)])
    x = {(i, i): diag[i][0] for i in range(nb)}
    for d in range(1, nb):
        for i in range(d, nb):
            j = i - d
            acc = _hdot(a[i, j], x[j, j])
            for m in range(j + 1, i):
                acc = acc + _hdot(a[i, m], x[m, j])
            x[i, j] = -_hdot(x[i, i], acc)
    return x


# ---------------------------------------------------------------------------------------------------------------
# (1)-(3): pair matrix P and the in-chunk inverse T, chunk-parallel, in 16 x 16 blocks
# ---------------------------------------------------------------------------------------------------------------


class _PairRef:
    """An fp32 C x C output or input of a kernel (T or P) held as two bf16 refs (hi, lo) = `_split_bf16` of it:
    stores split, loads give hi + lo, from which a "split" product's own split takes back the same hi and lo."""

    def __init__(self, hi_ref, lo_ref):
        self.hi_ref, self.lo_ref = hi_ref, lo_ref

    def __setitem__(self, index, x):
        self.hi_ref[index], self.lo_ref[index] = _split_bf16(x)

    def __getitem__(self, index):
        return self.hi_ref[index].astype(F32) + self.lo_ref[index].astype(F32)


def _square_pairs(cfg):
    """Whether T and P pass between the kernels as bf16 (hi, lo) pairs: where the Mosaic forward pass reads them
    (its wgmma operands are bf16), so that prepare writes them and the Triton reverse pass reads them (the same
    bytes as fp32)."""
    return cfg.pass_backend == "mosaic"


def _with_square_pairs(kernel, n_before):
    """`kernel` whose T and P refs (after the first `n_before` refs) arrive as (hi, lo) pairs of refs."""
    def wrapped(*refs, cfg):
        t_hi, t_lo, p_hi, p_lo = refs[n_before:n_before + 4]
        return kernel(*refs[:n_before], _PairRef(t_hi, t_lo), _PairRef(p_hi, p_lo), *refs[n_before + 4:], cfg=cfg)
    return wrapped


def _prepare_blocks_kernel(q_ref, k_ref, g_ref, glo_ref, beta_ref, doc_ref, t_ref, p_ref, *r_ref, cfg: Config):
    """P, T (and R for the backward) of one chunk, block by block: block (i, j) of P is

    * i > j: (Q_i (.) exp(G_i - G_ref)) (K_j (.) exp(G_ref - G_j))^T with G_ref the gate of sub-chunk j's last
      token, both factors <= 1: 2 x 16 x K exponentials folded into the operands of one dot;
    * i = j: the exact exponent per pair, one column c per step: the partner token c is read as a (1, K) row of
      the refs, exp(G_t - G_c) is masked to t > c before it is taken, and the column is a row sum.
    """
    C, mode = cfg.chunk_size, cfg.dots
    nb = C // SUB
    rows, cols = _iota(SUB, SUB, 0), _iota(SUB, SUB, 1)
    offset = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    zeros = jnp.zeros((SUB, SUB), F32)
    p, r = {}, {}
    for i in range(nb):
        q_i, k_i = q_ref[_blk(i), :].astype(F32), k_ref[_blk(i), :].astype(F32)
        gates_i = _gates(g_ref, glo_ref, _blk(i))

        def column(c, acc, i=i, q_i=q_i, k_i=k_i, gates_i=gates_i):
            p_ii, r_ii = acc
            row = pl.ds(i * SUB + c, 1)
            after = _masked_exp(offset > c, _partner_exponent(g_ref, glo_ref, gates_i, row))
            w = k_ref[row, :].astype(F32) * after
            p_ii = jnp.where(cols == c, jnp.sum(q_i * w, axis=1)[:, None], p_ii)
            r_ii = jnp.where(cols == c, jnp.sum(k_i * w, axis=1)[:, None], r_ii)
            return p_ii, r_ii

        p_ii, r_ii = lax.fori_loop(0, SUB, column, (zeros, zeros))
        # P_tt = q_t . k_t, decay exactly 1.
        p[i, i] = p_ii + jnp.where(rows == cols, jnp.sum(q_i * k_i, axis=1)[:, None], 0.0)
        r[i, i] = r_ii
    for j in range(nb - 1):
        ref = _reference(g_ref, glo_ref, j)
        k_from = k_ref[_blk(j), :].astype(F32) * _from_ref(_gates(g_ref, glo_ref, _blk(j)), ref)
        for i in range(j + 1, nb):
            to = _to_ref(_gates(g_ref, glo_ref, _blk(i)), ref)
            p[i, j] = _dot(q_ref[_blk(i), :].astype(F32) * to, k_from, tb=True, mode=mode)
            r[i, j] = _dot(k_ref[_blk(i), :].astype(F32) * to, k_from, tb=True, mode=mode)
    a = {}
    for i in range(nb):
        beta_i = beta_ref[_blk(i)][:, None]
        for j in range(i + 1):
            incl, strict = _block_masks(doc_ref, i, j, cfg.segmented)
            p[i, j] = jnp.where(incl, p[i, j], 0.0)
            r[i, j] = jnp.where(strict, r[i, j], 0.0)
            a[i, j] = beta_i * r[i, j]
    x = (_inverse_rows if cfg.inverse == "rows" else _inverse_blocks)(a, nb)
    outs = [(t_ref, x), (p_ref, p)] + [(ref, r) for ref in r_ref]
    for i in range(nb):
        for j in range(nb):
            for ref, blocks in outs:
                ref[_blk(i), _blk(j)] = blocks[i, j] if j <= i else zeros


def _prepare_partner_kernel(q_ref, k_ref, g_ref, glo_ref, beta_ref, doc_ref, t_ref, p_ref, *r_ref, cfg: Config):
    """`Config.prepare="partner"`: P, T (and R) on whole C x C / C x K values; see the module docstring."""
    C, K = cfg.chunk_size, q_ref.shape[-1]
    BK = min(cfg.block_k, K)
    geo = _geometry(C)

    def channels(j, acc):
        """P and R are sums over channels: one block of BK channels at a time keeps 4 C x BK fp32 tiles live
        instead of 4 C x K (at K = 128 and 4 warps those alone are the 255 registers a thread may hold)."""
        cols = pl.ds(pl.multiple_of(j * BK, BK), BK)
        q, k = q_ref[:, cols].astype(F32), k_ref[:, cols].astype(F32)

        g, glo = g_ref[:, cols], glo_ref[:, cols]

        def partner_rows(r):
            """Row r of every sub-chunk of G hi, G lo and k (`Config.partner_rows`)."""
            if cfg.partner_rows == "loaded":  # one strided load per ref, no reduction across rows
                rows = pl.ds(r, C // SUB, stride=SUB)
                return tuple(_spread_partner_rows(ref[rows, cols].astype(F32)) for ref in (g_ref, glo_ref, k_ref))
            return tuple(_partner(geo, x, r) for x in (g, glo, k))

        def one_reference():
            to_end, from_end = _end_reference_split(g_ref, glo_ref, cols)
            k_from = k * from_end
            strict = geo.lanes < geo.rows_cc
            return tuple(jnp.where(strict, _dot(a * to_end, k_from, tb=True, mode=cfg.dots), 0.0) for a in (q, k))

        sub_chunks = lambda: tuple(_pair_matrices(geo, (q, k), k, g, glo, cfg.dots, partner_rows))
        if bounded is None or bounded is True:
            p, r = sub_chunks() if bounded is None else one_reference()
        else:
            p, r = lax.cond(bounded, one_reference, sub_chunks)
        # P_tt = q_t . k_t, decay exactly 1.
        p = p + jnp.where(geo.lanes == geo.rows_cc, jnp.sum(q * k, axis=1)[:, None], 0.0)
        return acc[0] + p, acc[1] + r

    bounded = _bounded_span(cfg, g_ref, glo_ref, slice(None))
    zeros = jnp.zeros((C, C), F32)
    p, r = lax.fori_loop(0, K // BK, channels, (zeros, zeros))
    incl, strict = _masks(geo, doc_ref[...], cfg.segmented)
    p_ref[...] = jnp.where(incl, p, 0.0)
    r = jnp.where(strict, r, 0.0)
    for ref in r_ref:
        ref[...] = r
    a = beta_ref[...][:, None] * r
    if cfg.inverse == "rows":
        t_ref[...] = _unit_lower_row_inverse(a)
        return
    x = _unit_lower_inverse(a)
    nb = C // SUB
    for i in range(nb):
        for j in range(nb):
            t_ref[i * SUB:(i + 1) * SUB, j * SUB:(j + 1) * SUB] = x[i, j] if j <= i else jnp.zeros((SUB, SUB), F32)


def _chunk_specs(cfg, K, V):
    """BlockSpecs of the chunk-parallel kernels (grid (chunks, B*Hv))."""
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    return dict(
        key=pl.BlockSpec((None, C, None, K), lambda i, bh: (bh // Hv, i, (bh % Hv) // G, 0)),
        channel=pl.BlockSpec((None, C, None, K), lambda i, bh: (bh // Hv, i, bh % Hv, 0)),
        value=pl.BlockSpec((None, C, None, V), lambda i, bh: (bh // Hv, i, bh % Hv, 0)),
        square=pl.BlockSpec((None, C, None, C), lambda i, bh: (bh // Hv, i, bh % Hv, 0)),
        gate=pl.BlockSpec((None, C, None), lambda i, bh: (bh // Hv, i, bh % Hv)),
        seq=pl.BlockSpec((None, C), lambda i, bh: (bh // Hv, i)),
        state=pl.BlockSpec((None, None, K, V), lambda i, bh: (bh // Hv, bh % Hv, i, 0)),
        gamma=pl.BlockSpec((None, None, K), lambda i, bh: (bh // Hv, bh % Hv, i)),
    )


def _when_all_bounded(cfg, g, glo, call):
    """`call(cfg)`, and with a span limit `call(cfg with all_bounded)` instead when every chunk of every channel
    spans at most the limit (`_bounded_span`'s test, in XLA on the first and last rows of each chunk): chosen by
    `lax.cond` at run time, so -20 gates anywhere still take the per-program switch."""
    if cfg.span_limit is None or cfg.all_bounded or not cfg.call_span_check:
        return call(cfg)
    B, Tp, Hv, K = g.shape
    C = cfg.chunk_size
    ends = lambda x: (x.reshape(B, Tp // C, C, Hv, K)[:, :, 0], x.reshape(B, Tp // C, C, Hv, K)[:, :, C - 1])
    (g0, g1), (lo0, lo1) = ends(g), ends(glo)
    every_chunk_bounded = jnp.max((g0 - g1) + (lo0 - lo1)) <= cfg.span_limit
    return lax.cond(every_chunk_bounded, lambda: call(dataclasses.replace(cfg, all_bounded=True)),
                    lambda: call(cfg))


def _prepare(cfg, q, k, g, glo, beta, doc, *, with_r=False):
    """(T, P), and R (strictly lower, same document) for the backward when `with_r`."""
    if cfg.inverse not in INVERSE_METHODS:
        raise ValueError(f"config.inverse must be one of {INVERSE_METHODS}, got {cfg.inverse!r}")
    if cfg.prepare not in PREPARE_METHODS:
        raise ValueError(f"config.prepare must be one of {PREPARE_METHODS}, got {cfg.prepare!r}")
    if cfg.dots not in DOT_MODES:
        raise ValueError(f"config.dots must be one of {DOT_MODES}, got {cfg.dots!r}")
    for name in ("state_dots", "grad_k_dots", "output_dots"):
        if getattr(cfg, name) not in TOLERANT_DOT_MODES:
            raise ValueError(f"config.{name} must be one of {TOLERANT_DOT_MODES}, got {getattr(cfg, name)!r}")
    if cfg.forward not in FORWARD_METHODS:
        raise ValueError(f"config.forward must be one of {FORWARD_METHODS}, got {cfg.forward!r}")
    if cfg.primal_forward is not None and cfg.primal_forward not in FORWARD_METHODS:
        raise ValueError(f"config.primal_forward must be None or one of {FORWARD_METHODS}, got "
                         f"{cfg.primal_forward!r}")
    if cfg.operands not in OPERAND_METHODS:
        raise ValueError(f"config.operands must be one of {OPERAND_METHODS}, got {cfg.operands!r}")
    if cfg.partner_rows not in PARTNER_ROWS:
        raise ValueError(f"config.partner_rows must be one of {PARTNER_ROWS}, got {cfg.partner_rows!r}")
    if cfg.state_storage not in STATE_STORAGES:
        raise ValueError(f"config.state_storage must be one of {STATE_STORAGES}, got {cfg.state_storage!r}")
    if cfg.grads_from_passes and cfg.dots != "split":
        raise ValueError(f"config.grads_from_passes saves bf16 pairs for 'split' products, got dots={cfg.dots!r}")
    if cfg.state_storage == "bf16" and not cfg.state_dots == cfg.grad_k_dots == "bf16":
        raise ValueError(f"config.state_storage='bf16' needs state_dots = grad_k_dots = 'bf16', got "
                         f"{cfg.state_dots!r}, {cfg.grad_k_dots!r}")
    B, Tp, _, K = q.shape
    if cfg.block_k < 16 or cfg.block_k & (cfg.block_k - 1):
        raise ValueError(f"config.block_k must be a power of two >= 16, got {cfg.block_k}")
    Hv, C = cfg.value_heads, cfg.chunk_size
    sp = _chunk_specs(cfg, K, K)
    square = jax.ShapeDtypeStruct((B, Tp, Hv, C), F32)
    pairs = _square_pairs(cfg)
    if pairs and cfg.prepare != "partner":
        raise ValueError(f"T and P as bf16 pairs (config.pass_backend='mosaic') need config.prepare='partner', got "
                         f"{cfg.prepare!r}")
    # T, P (each as two bf16 arrays when `_square_pairs`), R
    out_shape = [jax.ShapeDtypeStruct(square.shape, BF16)] * 4 if pairs else [square] * 2
    out_shape += [square] if with_r else []
    kernel = _prepare_partner_kernel if cfg.prepare == "partner" else _prepare_blocks_kernel
    kernel = _with_square_pairs(kernel, 6) if pairs else kernel

    def call(cfg):
        outs = _chunk_parallel_call(
            functools.partial(kernel, cfg=cfg),
            grid=(Tp // C, B * Hv),
            grid_order=cfg.grid_order,
            in_specs=[sp["key"], sp["key"], sp["channel"], sp["channel"], sp["gate"], sp["seq"]],
            out_specs=[sp["square"]] * len(out_shape),
            out_shape=out_shape,
            compiler_params=_params(cfg.prepare_warps, cfg.stages),
            interpret=cfg.interpret,
            name="kda_prepare",
        )(q, k, g, glo, beta, doc)
        return (tuple(outs[:2]), tuple(outs[2:4]), *outs[4:]) if pairs else tuple(outs)

    return _when_all_bounded(cfg, g, glo, call)


# ---------------------------------------------------------------------------------------------------------------
# (4)-(6): the sequential passes over chunks
# ---------------------------------------------------------------------------------------------------------------


def _sequence_specs(cfg, Tp, K, BV):
    """BlockSpecs of the sequential passes (grid (V/BV, B*Hv)): whole sequences of one head, V block j."""
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    return dict(
        key=pl.BlockSpec((None, Tp, None, K), lambda j, bh: (bh // Hv, 0, (bh % Hv) // G, 0)),
        channel=pl.BlockSpec((None, Tp, None, K), lambda j, bh: (bh // Hv, 0, bh % Hv, 0)),
        value=pl.BlockSpec((None, Tp, None, BV), lambda j, bh: (bh // Hv, 0, bh % Hv, j)),
        square=pl.BlockSpec((None, Tp, None, C), lambda j, bh: (bh // Hv, 0, bh % Hv, 0)),
        gate=pl.BlockSpec((None, Tp, None), lambda j, bh: (bh // Hv, 0, bh % Hv)),
        seq=pl.BlockSpec((None, Tp), lambda j, bh: (bh // Hv, 0)),
        gamma=pl.BlockSpec((None, None, (Tp // C) * K), lambda j, bh: (bh // Hv, bh % Hv, 0)),
        state=pl.BlockSpec((None, None, K, BV), lambda j, bh: (bh // Hv, bh % Hv, 0, j)),
        states=pl.BlockSpec((None, None, (Tp // C) * K, BV), lambda j, bh: (bh // Hv, bh % Hv, 0, j)),
    )


# ---------------------------------------------------------------------------------------------------------------
# The chunk operands of the passes, A (.) Q, A (.) K, E (.) K and gamma: formed in every step or stored
# ---------------------------------------------------------------------------------------------------------------


class _ChunkOperands(NamedTuple):
    qa: object  # A (.) Q (C x K): fp32, or stored for "split" products its bf16 (hi,) or (hi, lo); None if unused
    ak: object  # A (.) K
    ke: object  # E (.) K
    gamma: jax.Array  # (K,)


# Which passes read the stored operands (`_operand_parts`); "both": the tiles of either phase, written once by the
# forward for `backward_operands="saved"` and taken apart by `_phase_operands`.
PHASES = ("forward", "backward", "both")


def _operand_parts(cfg, phase):
    """The bf16 parts stored of A (.) Q, A (.) K and E (.) K for the passes of `phase`: 2 (hi, lo) where one of
    their products is "split", 1 (hi) where all are plain bf16 (`Config.state_dots`, `Config.output_dots`); fp32
    operands are one fp32 tile each. Forward: (A.Q) S_0 is the output's state product, (A.K) S_0 a state product,
    (E.K)^T u is "split". Backward (the reverse pass and the V kernel): (A.Q)^T dO, (E.K) dS and (A.K) S_0 are state
    products, (A.K)^T (beta dx) is "split". For bfloat16 inputs that stores 5 bf16 tiles in the forward and 4 in
    the backward instead of 6 each; "both" is each operand's larger count (6 for bfloat16: the forward's five and
    A (.) K's lo half), since hi is always the first part."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    if phase == "both":
        return tuple(map(max, _operand_parts(cfg, "forward"), _operand_parts(cfg, "backward")))
    if cfg.dots != "split":
        return 1, 1, 1
    state = 1 if cfg.state_dots == "bf16" else 2
    return (1 if cfg.output_dots == "bf16" else 2, state, 2) if phase == "forward" else (state, 2, state)


def _phase_operands(cfg, both, phase):
    """The stored operands of `phase` taken from those of "both" (tiles, then gamma): each operand's first parts
    (hi before lo), the same arrays, so the same values as formed for `phase` alone."""
    *tiles, gamma = both
    groups = _by_operand(tiles, _operand_parts(cfg, "both"))
    picked = [part for group, n in zip(groups, _operand_parts(cfg, phase)) for part in group[:n]]
    return (*picked, gamma)


def _source(cfg, q, k, g, glo, carry, tail, phase):
    """The arrays the passes of `phase` read their chunk operands from (`Config.operands`)."""
    if cfg.operands == "inline":
        return q, k, g, glo, carry, tail
    return _stored_operands(cfg, q, k, g, glo, carry, tail, phase)


def _source_specs(cfg, sp, phase):
    """BlockSpecs of `_source`'s arrays, from a dict of specs (`_sequence_specs` or `_output_specs`)."""
    if cfg.operands == "inline":
        return [sp["key"], sp["key"], sp["channel"], sp["channel"], sp["seq"], sp["seq"]]
    return [sp["channel"]] * sum(_operand_parts(cfg, phase)) + [sp["gamma"]]


def _n_source(cfg, phase):
    return 6 if cfg.operands == "inline" else sum(_operand_parts(cfg, phase)) + 1


def _by_operand(tiles, parts):
    """The stored tiles (refs) grouped per operand (A (.) Q, A (.) K, E (.) K), `parts` of each."""
    groups, start = [], 0
    for n in parts:
        groups.append(tiles[start:start + n])
        start += n
    return groups


def _store_parts(cfg, refs, index, x):
    """Writes the fp32 operand x at `index` of its stored tiles: (hi, lo) as `_split_bf16`, hi alone, or x itself
    without "split" products."""
    if cfg.dots != "split":
        refs[0][index] = x
    elif len(refs) == 2:
        refs[0][index], refs[1][index] = _split_bf16(x)
    else:
        refs[0][index] = x.astype(BF16)  # the hi of `_split_bf16`


def _load_operands(cfg, geo, src, rows, gamma_rows, phase, *, with_q=True):
    """The operands of the chunk at `rows` (`gamma_rows`: its K entries of the stored gamma) from `src` refs."""
    if cfg.operands == "inline":
        q_ref, k_ref, g_ref, glo_ref, carry_ref, tail_ref = src
        k = k_ref[rows, :].astype(F32)
        bound = _boundary(geo, g_ref[rows, :], glo_ref[rows, :], carry_ref[rows], tail_ref[rows])
        qa = bound.a * q_ref[rows, :].astype(F32) if with_q else None
        return _ChunkOperands(qa, bound.a * k, bound.e * k, bound.gamma)
    *tiles, gamma_ref = src
    ops = [tuple(r[rows, :] for r in refs) if cfg.dots == "split" else refs[0][rows, :]
           for refs in _by_operand(tiles, _operand_parts(cfg, phase))]
    return _ChunkOperands(ops[0] if with_q else None, ops[1], ops[2], gamma_ref[gamma_rows])


def _odot(x, b, *, ta=False, mode):
    """`_dot(x, b)` for a chunk operand given as fp32 or as its stored bf16 parts: the same bf16 products."""
    if not isinstance(x, tuple):
        return _dot(x, b, ta=ta, mode=mode)
    if mode == "bf16":  # hi is x rounded to bf16
        return _dot(x[0], b.astype(BF16), ta=ta)
    if len(x) != 2:
        raise ValueError(f"a {mode!r} product needs the stored operand's (hi, lo), got {len(x)} part(s)")
    if b.dtype != x[0].dtype:  # float16 dO against bf16 parts: as its exact bf16 pair, not an IEEE fp32 product
        b = b.astype(F32)
    if b.dtype == F32:
        return _split_pair_dot(x, b, ta=ta)
    return _dot(x[0], b, ta=ta) + _dot(x[1], b, ta=ta)


def _operands_kernel(q_ref, k_ref, g_ref, glo_ref, carry_ref, tail_ref, *out_refs, cfg: Config, parts):
    """`Config.operands="stored"`: one chunk's A (.) Q, A (.) K, E (.) K (bf16 parts for "split" products, `parts`
    of each) and gamma, for BK channels; the operations of `_load_operands`'s inline branch, so the same values."""
    geo = _geometry(cfg.chunk_size)
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    bound = _boundary(geo, g_ref[...], glo_ref[...], carry_ref[...], tail_ref[...])
    *tiles, gamma_ref = out_refs
    for refs, x in zip(_by_operand(tiles, parts), (bound.a * q, bound.a * k, bound.e * k)):
        _store_parts(cfg, refs, ..., x)
    gamma_ref[...] = bound.gamma


def _operand_shapes(cfg, B, Tp, K, phase):
    """Shapes of the stored operands of `phase`: `_operand_parts` [B, Tp, Hv, K] tiles (bf16, or fp32 without
    "split" products) and gamma [B, Hv, chunks * K] fp32."""
    tile = jax.ShapeDtypeStruct((B, Tp, cfg.value_heads, K), BF16 if cfg.dots == "split" else F32)
    gamma = jax.ShapeDtypeStruct((B, cfg.value_heads, (Tp // cfg.chunk_size) * K), F32)
    return [tile] * sum(_operand_parts(cfg, phase)) + [gamma]


def _stored_operands(cfg, q, k, g, glo, carry, tail, phase):
    """(qa..., ak..., ke..., gamma) for the passes of `phase`: [B, Tp, Hv, K] tiles (bf16 parts for "split"
    products, `_operand_parts`, else one fp32 each) and gamma [B, Hv, chunks * K] fp32, from `_operands_kernel`,
    grid (K/BK, chunks, B*Hv)."""
    B, Tp, _, K = q.shape
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    BK = min(cfg.block_k, K)
    nk, nt = K // BK, Tp // C
    key = pl.BlockSpec((None, C, None, BK), lambda kb, i, bh: (bh // Hv, i, (bh % Hv) // G, kb))
    channel = pl.BlockSpec((None, C, None, BK), lambda kb, i, bh: (bh // Hv, i, bh % Hv, kb))
    seq = pl.BlockSpec((None, C), lambda kb, i, bh: (bh // Hv, i))
    gamma = pl.BlockSpec((None, None, BK), lambda kb, i, bh: (bh // Hv, bh % Hv, i * nk + kb))
    shapes = _operand_shapes(cfg, B, Tp, K, phase)
    return tuple(_chunk_parallel_call(
        functools.partial(_operands_kernel, cfg=cfg, parts=_operand_parts(cfg, phase)),
        grid=(nk, nt, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[key, key, channel, channel, seq, seq],
        out_specs=[channel] * (len(shapes) - 1) + [gamma],
        out_shape=shapes,
        compiler_params=_params(cfg.prepare_warps, cfg.stages),
        interpret=cfg.interpret,
        name="kda_operands",
    )(q, k, g, glo, carry, tail))


# ---------------------------------------------------------------------------------------------------------------
# (4)-(6): the sequential passes over chunks
# ---------------------------------------------------------------------------------------------------------------


def _pseudo_values(cfg, ak, v, t, beta, s):
    """(4): u = T diag(beta) (V - (A (.) K) S_0), the values the chunk writes into the state (fp32, C x BV)."""
    y = v.astype(F32) - _odot(ak, s, mode=cfg.state_dots)
    return _dot(t, beta[:, None] * y, mode=cfg.dots)


def _chunk_rows(cfg, i, K):
    """(rows of chunk i in a sequence, its K entries in a per-chunk (K,) array)."""
    C = cfg.chunk_size
    return pl.ds(pl.multiple_of(i * C, C), C), pl.ds(pl.multiple_of(i * K, K), K)


def _forward_kernel(*refs, cfg: Config, nt: int):
    n = _n_source(cfg, "forward")
    src = refs[:n]
    v_ref, beta_ref, t_ref, p_ref, h0_ref, o_ref, final_ref, *saved_refs = refs[n:]
    mode = cfg.dots
    K = h0_ref.shape[0]
    geo = _geometry(cfg.chunk_size)

    def chunk(i, s):
        """s: the state block at the start of chunk i; returns the one at its end."""
        rows, per_chunk = _chunk_rows(cfg, i, K)
        if saved_refs:
            saved_refs[0][per_chunk, :] = s.astype(saved_refs[0].dtype)
        ops = _load_operands(cfg, geo, src, rows, per_chunk, "forward")
        u = _pseudo_values(cfg, ops.ak, v_ref[rows, :], t_ref[rows, :], beta_ref[rows], s)
        _store_pair(cfg, saved_refs[1:], rows, u)
        o = cfg.scale * (_odot(ops.qa, s, mode=cfg.output_dots) + _dot(p_ref[rows, :], u, mode=mode))
        o_ref[rows, :] = o.astype(o_ref.dtype)
        return ops.gamma[:, None] * s + _odot(ops.ke, u, ta=True, mode=mode)

    final_ref[...] = lax.fori_loop(0, nt, chunk, h0_ref[...])


def _state_kernel(*refs, cfg: Config, nt: int):
    """`Config.forward="split"`: (4) and (6) only, writing every chunk's start state."""
    n = _n_source(cfg, "forward")
    src = refs[:n]
    v_ref, beta_ref, t_ref, h0_ref, final_ref, states_ref, *u_refs = refs[n:]
    mode = cfg.dots
    K = h0_ref.shape[0]
    geo = _geometry(cfg.chunk_size)

    def chunk(i, s):
        rows, per_chunk = _chunk_rows(cfg, i, K)
        states_ref[per_chunk, :] = s.astype(states_ref.dtype)
        ops = _load_operands(cfg, geo, src, rows, per_chunk, "forward", with_q=False)
        u = _pseudo_values(cfg, ops.ak, v_ref[rows, :], t_ref[rows, :], beta_ref[rows], s)
        _store_pair(cfg, u_refs, rows, u)
        return ops.gamma[:, None] * s + _odot(ops.ke, u, ta=True, mode=mode)

    final_ref[...] = lax.fori_loop(0, nt, chunk, h0_ref[...])


def _output_kernel(*refs, cfg: Config):
    """`Config.forward="split"`: (4) and (5) for one chunk and V block from its saved start state; the same
    operations as the pass's, so u is the value the pass carried on."""
    n = _n_source(cfg, "forward")
    src = refs[:n]
    v_ref, beta_ref, t_ref, p_ref, s_ref, o_ref = refs[n:]
    mode = cfg.dots
    s = s_ref[...]
    ops = _load_operands(cfg, _geometry(cfg.chunk_size), src, slice(None), slice(None), "forward")
    u = _pseudo_values(cfg, ops.ak, v_ref[...], t_ref[...], beta_ref[...], s)
    o = cfg.scale * (_odot(ops.qa, s, mode=cfg.output_dots) + _dot(p_ref[...], u, mode=mode))
    o_ref[...] = o.astype(o_ref.dtype)


def _output_specs(cfg, K, OV):
    """BlockSpecs of `_output_kernel`, grid (V/OV, chunks, B*Hv): one chunk of one head, V block j."""
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    head = lambda i, bh: (bh // Hv, i, bh % Hv)
    return dict(
        key=pl.BlockSpec((None, C, None, K), lambda j, i, bh: (bh // Hv, i, (bh % Hv) // G, 0)),
        channel=pl.BlockSpec((None, C, None, K), lambda j, i, bh: head(i, bh) + (0,)),
        value=pl.BlockSpec((None, C, None, OV), lambda j, i, bh: head(i, bh) + (j,)),
        gate=pl.BlockSpec((None, C, None), lambda j, i, bh: head(i, bh)),
        seq=pl.BlockSpec((None, C), lambda j, i, bh: (bh // Hv, i)),
        square=pl.BlockSpec((None, C, None, C), lambda j, i, bh: head(i, bh) + (0,)),
        gamma=pl.BlockSpec((None, None, K), lambda j, i, bh: (bh // Hv, bh % Hv, i)),
        state=pl.BlockSpec((None, None, K, OV), lambda j, i, bh: (bh // Hv, bh % Hv, i, j)),
    )


def _state_dtype(cfg):
    return BF16 if cfg.state_storage == "bf16" else F32


def _store_pair(cfg, refs, rows, x):
    """u or dx at `rows` of the (hi, lo) refs that save it (`_store_parts`); nothing when refs is empty."""
    if refs:
        _store_parts(cfg, refs, (rows, slice(None)), x)


def _pair_shapes(cfg, shape, saved):
    """The pass outputs that save u or dx (`Config.grads_from_passes`) where `saved`: its bf16 (hi, lo)."""
    return [jax.ShapeDtypeStruct(shape, BF16)] * 2 if saved and cfg.grads_from_passes else []


def _split_forward(cfg, src, v, beta, t, p, h0, *, with_states):
    """(O, final state, start states, u's pair if saved) by `_state_kernel` then `_output_kernel`."""
    B, Tp, Hv, V = v.shape
    K = h0.shape[2]
    nt = Tp // cfg.chunk_size
    BV = min(cfg.block_v, V)
    sp = _sequence_specs(cfg, Tp, K, BV)
    u_shapes = _pair_shapes(cfg, v.shape, with_states)
    final, starts, *u_pair = pl.pallas_call(
        functools.partial(_state_kernel, cfg=cfg, nt=nt),
        grid=(V // BV, B * Hv),
        in_specs=_source_specs(cfg, sp, "forward") + [sp["value"], sp["gate"], sp["square"], sp["state"]],
        out_specs=[sp["state"], sp["states"]] + [sp["value"]] * len(u_shapes),
        out_shape=[jax.ShapeDtypeStruct((B, Hv, K, V), F32),
                   jax.ShapeDtypeStruct((B, Hv, nt * K, V), _state_dtype(cfg))] + u_shapes,
        compiler_params=_params(cfg.warps, cfg.pass_stages),
        interpret=cfg.interpret,
        name="kda_state_pass",
    )(*src, v, beta, t, h0)
    OV = min(cfg.output_block_v, V)
    op = _output_specs(cfg, K, OV)
    o = _chunk_parallel_call(
        functools.partial(_output_kernel, cfg=cfg),
        grid=(V // OV, nt, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=_source_specs(cfg, op, "forward") + [op["value"], op["gate"], op["square"], op["square"],
                                                      op["state"]],
        out_specs=op["value"],
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype),
        compiler_params=_params(cfg.warps, cfg.stages),
        interpret=cfg.interpret,
        name="kda_output",
    )(*src, v, beta, t, p, starts)
    return o, final, starts, tuple(u_pair)


def _check_mosaic_pass(cfg, with_states, knob="pass_backend"):
    """The knobs the Mosaic kernels implement (`Config.pass_backend`, `Config.reverse_backend`,
    `Config.grads_backend` = "mosaic")."""
    if knob == "grads_backend":  # the gradient kernel reads the passes' u, dx and bf16 states, whichever passes
        wanted = dict(dots="split", state_storage="bf16", grads_from_passes=True, fused_pair_grads=True)
    else:
        wanted = dict(forward="fused", dots="split", operands="stored", state_dots="bf16")
        if with_states:
            wanted.update(state_storage="bf16", grads_from_passes=True)
        if knob == "reverse_backend":
            wanted.update(pass_backend="mosaic")
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            raise ValueError(f"config.{knob}='mosaic' needs config.{name}={value!r}, got {getattr(cfg, name)!r}")


def _forward_pass(cfg, src, v, beta, t, p, h0, *, with_states):
    """(O, final state), and `with_states` the start states and u's pair (`Config.grads_from_passes`, else ())."""
    if cfg.pass_backend not in PASS_BACKENDS:
        raise ValueError(f"config.pass_backend must be one of {PASS_BACKENDS}, got {cfg.pass_backend!r}")
    if cfg.pass_backend == "mosaic":
        _check_mosaic_pass(cfg, with_states)
        return mosaic_kda.forward_pass(src, v, beta, t, p, h0, scale=cfg.scale, output_dots=cfg.output_dots,
                                       block_v=cfg.mosaic_block_v, shared_head=cfg.mosaic_shared_head,
                                       producer=cfg.mosaic_producer, with_states=with_states, interpret=cfg.interpret)
    if cfg.forward == "split":
        o, final, starts, u_pair = _split_forward(cfg, src, v, beta, t, p, h0, with_states=with_states)
        return (o, final, starts, u_pair) if with_states else (o, final)
    B, Tp, Hv, V = v.shape
    K = h0.shape[2]
    BV = min(cfg.block_v, V)
    nt = Tp // cfg.chunk_size
    sp = _sequence_specs(cfg, Tp, K, BV)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), jax.ShapeDtypeStruct((B, Hv, K, V), F32)]
    out_specs = [sp["value"], sp["state"]]
    if with_states:
        out_shape.append(jax.ShapeDtypeStruct((B, Hv, nt * K, V), _state_dtype(cfg)))
        out_specs.append(sp["states"])
    u_shapes = _pair_shapes(cfg, v.shape, with_states)
    o, final, *saved = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg, nt=nt),
        grid=(V // BV, B * Hv),
        in_specs=_source_specs(cfg, sp, "forward") + [sp["value"], sp["gate"], sp["square"], sp["square"],
                                                      sp["state"]],
        out_specs=out_specs + [sp["value"]] * len(u_shapes),
        out_shape=out_shape + u_shapes,
        compiler_params=_params(cfg.warps, cfg.pass_stages),
        interpret=cfg.interpret,
        name="kda_forward",
    )(*src, v, beta, t, p, h0)
    return (o, final, saved[0], tuple(saved[1:])) if with_states else (o, final)


def _reverse_kernel(*refs, cfg: Config, nt: int):
    n = _n_source(cfg, "backward")
    src = refs[:n]
    beta_ref, t_ref, p_ref, do_ref, dfinal_ref, dh0_ref, dends_ref, *dx_refs = refs[n:]
    mode = cfg.dots
    K = dfinal_ref.shape[0]
    geo = _geometry(cfg.chunk_size)

    def chunk(m, ds):
        """ds: dL/d(state at the end of chunk i = nt-1-m); returns dL/d(state at its start)."""
        rows, per_chunk = _chunk_rows(cfg, nt - 1 - m, K)
        dends_ref[per_chunk, :] = ds.astype(dends_ref.dtype)
        ops = _load_operands(cfg, geo, src, rows, per_chunk, "backward")
        do = do_ref[rows, :]
        # Through (5) and (6): du = scale P^T dO + (E (.) K) dS_1; through (4): d(beta y) = T^T du.
        du = cfg.scale * _dot(p_ref[rows, :], do, ta=True, mode=mode) + _odot(ops.ke, ds, mode=cfg.state_dots)
        dx = _dot(t_ref[rows, :], du, ta=True, mode=mode)
        _store_pair(cfg, dx_refs, rows, dx)
        return (ops.gamma[:, None] * ds + cfg.scale * _odot(ops.qa, do, ta=True, mode=cfg.state_dots)
                - _odot(ops.ak, beta_ref[rows][:, None] * dx, ta=True, mode=mode))

    dh0_ref[...] = lax.fori_loop(0, nt, chunk, dfinal_ref[...])


def _reverse_pass(cfg, src, beta, t, p, do, dfinal):
    """(dL/d(initial state), the end-state cotangents, dx's pair (`Config.grads_from_passes`, else ())). T and P
    fp32, or each a (hi, lo) pair of bf16 arrays (`_square_pairs`)."""
    if cfg.reverse_backend not in PASS_BACKENDS:
        raise ValueError(f"config.reverse_backend must be one of {PASS_BACKENDS}, got {cfg.reverse_backend!r}")
    if cfg.reverse_backend == "mosaic":
        _check_mosaic_pass(cfg, True, knob="reverse_backend")
        return mosaic_kda.reverse_pass(src, beta, t, p, do, dfinal, scale=cfg.scale, block_v=cfg.mosaic_block_v,
                                       producer=cfg.mosaic_reverse_producer,
                                       shared_head=cfg.mosaic_reverse_shared_head, interpret=cfg.interpret)
    pairs = isinstance(t, tuple)
    squares = (*t, *p) if pairs else (t, p)
    B, Tp, Hv, V = do.shape
    K = dfinal.shape[2]
    BV = min(cfg.block_v, V)
    nt = Tp // cfg.chunk_size
    sp = _sequence_specs(cfg, Tp, K, BV)
    dx_shapes = _pair_shapes(cfg, do.shape, True)
    kernel = functools.partial(_reverse_kernel, nt=nt)
    if pairs:
        kernel = _with_square_pairs(kernel, _n_source(cfg, "backward") + 1)
    dh0, dends, *dx_pair = pl.pallas_call(
        functools.partial(kernel, cfg=cfg),
        grid=(V // BV, B * Hv),
        in_specs=_source_specs(cfg, sp, "backward") + [sp["gate"]] + [sp["square"]] * len(squares) + [
            sp["value"], sp["state"]],
        out_specs=[sp["state"], sp["states"]] + [sp["value"]] * len(dx_shapes),
        out_shape=[jax.ShapeDtypeStruct((B, Hv, K, V), F32),
                   jax.ShapeDtypeStruct((B, Hv, nt * K, V), _state_dtype(cfg))] + dx_shapes,
        compiler_params=_params(cfg.reverse_warps, cfg.pass_stages),
        interpret=cfg.interpret,
        name="kda_reverse",
    )(*src, beta, *squares, do, dfinal)
    return dh0, dends, tuple(dx_pair)


# ---------------------------------------------------------------------------------------------------------------
# The chunk-parallel gradients
# ---------------------------------------------------------------------------------------------------------------


def _grad_v_kernel(*refs, cfg: Config, channel_blocks: int):
    """The V-contractions of one chunk (a loop over V blocks): dv, dbeta, and the state/boundary terms of dq, dk,
    dG with dE; dP (scaled, masked s <= t) and dL/d(diag(beta) R) (masked s < t) for the pair kernel.

    With stored operands the loop loads A (.) K and E (.) K as dot operands, and A, E are formed after it, for the
    boundary terms only: fewer C x K fp32 tiles live across the loop. With `Config.grads_from_passes` it loads u
    and dx as the passes saved them (bf16 pairs) instead of T, P and the products that form them.

    With `Config.grad_k_splits` = 2 the program sees half of the channels (its blocks of the K-indexed refs) and
    its role is `pl.program_id(0)`: every C x K term is per channel, dbeta's sum over channels is split (the value
    counted by role 0) and summed in XLA, and the C x C squares, which need no channel, are shared out: role 0
    forms dP and writes dv, role 1 forms dM (one C x C accumulator each).

    Fused (`Config.fused_pair_grads` in a call whose chunks all span at most `span_limit`): every program forms
    both squares and adds the pair terms of its channels itself (`_one_reference_pair_products`,
    `_sum_pair_terms`), writing dq, dk and d(log_decay) instead of partials and squares; the value, dv and dbeta's
    share through R are counted by the first channel block. With the saved u and dx (`Config.grads_from_passes`)
    it forms the squares first, in a loop of their own, and their pair products before the V contractions' loop:
    the squares are dead by then, and the three C x BK products live across that loop in their place (H100,
    8x2048x16x128 bf16, 2026-12-06: kda_grads_fused 1.90-1.92 -> 1.81 ms, half the spilled sectors; one loop per
    accumulator instead of the second loop measured slower; docs/kernels.md, "KDA: the fused gradient kernel's
    squares first"). Without them (u and dx formed per V block, which would then be twice), one loop forms all and
    the pair terms come last.
    """
    n = _n_source(cfg, "backward") if cfg.operands == "stored" else 0
    n_saved = 4 if cfg.grads_from_passes else 2  # (u hi, u lo, dx hi, dx lo) or (T, P)
    src, refs = refs[:n], refs[n:]
    q_ref, k_ref, v_ref, beta_ref, g_ref, glo_ref, doc_ref, carry_ref, tail_ref = refs[:9]
    saved_refs = refs[9:9 + n_saved]
    r_ref, s0_ref, dend_ref, do_ref, *out_refs = refs[9 + n_saved:]
    fused = _fuses_pair_grads(cfg)
    if fused:
        dv_ref = out_refs[0]  # the rest are `_fused_epilogue`'s
    else:
        dv_ref, dq_ref, dk_ref, dg_ref, de_ref, dbeta_ref, dp_ref, dm_ref, dpt_ref, dmt_ref = out_refs
    C, mode = cfg.chunk_size, cfg.dots
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    BV = min(cfg.fused_grad_block_v if fused else cfg.grad_block_v, V)
    geo = _geometry(C)
    beta = beta_ref[...]
    split_k = channel_blocks > 1
    role = pl.program_id(0) if split_k else None
    shared_squares = split_k and not fused  # dP on role 0, dM on role 1
    squares_first = fused and cfg.grads_from_passes
    boundary = lambda: _boundary(geo, g_ref[...], glo_ref[...], carry_ref[...], tail_ref[...])
    if not src:
        bound = boundary()
        inline = (bound.a * k_ref[...].astype(F32), bound.e * k_ref[...].astype(F32))

    if not cfg.grads_from_passes:
        # T and P as dot operands (bf16 pairs for "split" products: the values `_dot` forms from them), loaded and
        # split once for the V blocks (per V block: V kernel 4.47 -> 2.90 ms at 8x2048x16x128 bf16, H100,
        # 2026-11-25).
        t, p = (_split_bf16(x[...]) if mode == "split" else x[...] for x in saved_refs)

    block_cols = lambda j: pl.ds(pl.multiple_of(j * BV, BV), BV)  # V block j's columns

    def saved_u_and_dx(cols):
        """(u, dx) of V block `cols` as the passes saved them, (hi, lo) pairs."""
        return tuple((hi[:, cols], lo[:, cols]) for hi, lo in (saved_refs[:2], saved_refs[2:]))

    def u_and_dx(cols, y, do, dend, ke):
        """(u, dx) of V block `cols`: fp32 or, as the passes saved them, (hi, lo) pairs."""
        if cfg.grads_from_passes:
            return saved_u_and_dx(cols)
        u = _odot(t, beta[:, None] * y, mode=mode)
        du = cfg.scale * _odot(p, do, ta=True, mode=mode) + _odot(ke, dend, mode=cfg.state_dots)
        return u, _odot(t, du, ta=True, mode=mode)  # dx = dL/d(beta y)

    def store_dv(cols, dx):
        dv_ref[:, cols] = (beta[:, None] * dx).astype(dv_ref.dtype)

    def add_squares(squares, do, u, dx_parts):
        dp, dm = squares
        dp = dp + _nt_dot(do, u, mode=mode)  # / scale
        dm = dm - _nt_dot(dx_parts, u, mode=mode)  # dL/d(diag(beta) R) = -T^T du u^T
        return dp, dm

    def v_block(j, acc):
        dqa, dka, dke, squares, dbeta, dgamma = acc
        cols = block_cols(j)
        s0, dend, do = s0_ref[:, cols], dend_ref[:, cols], do_ref[:, cols]
        if src:
            ops = _load_operands(cfg, geo, src, slice(None), slice(None), "backward", with_q=False)
            ka, ke = ops.ak, ops.ke
        else:
            ka, ke = inline
        values = v_ref[:, cols].astype(F32)
        if split_k:  # y's share of this program's channels: the value is counted once, by role 0
            values = jnp.where(role == 0, values, 0.0)
        y = values - _odot(ka, s0, mode=cfg.state_dots)
        u, dx_parts = u_and_dx(cols, y, do, dend, ke)
        dx = _fp32(dx_parts)
        if split_k:
            pl.when(role == 0)(lambda: store_dv(cols, dx))
        else:
            store_dv(cols, dx)
        late = cfg.grad_k_dots
        dqa = dqa + _dot(do, s0, tb=True, mode=late)  # / scale
        dka = dka - _dot(beta[:, None] * dx, s0, tb=True, mode=late)
        dke = dke + _nt_dot(u, dend, mode=mode)
        if shared_squares:
            # dP = dO u^T on role 0, dM = -dx u^T on role 1: the left operand as a bf16 pair either way (dO's is
            # (dO, 0), so its three products are the two of `_nt_dot(do, u)` and a zero; -dx's are dx's negated),
            # the same sums as below.
            left = tuple(jnp.where(role == 0, a, -b) for a, b in zip(_split_bf16(do), dx_parts))
            squares = (squares[0] + _nt_dot(left, u, mode=mode),)
        elif not squares_first:
            squares = add_squares(squares, do, u, dx_parts)
        dbeta = dbeta + jnp.sum(dx * y, axis=1)
        dgamma = dgamma + jnp.sum(s0.astype(F32) * dend.astype(F32), axis=1)
        return dqa, dka, dke, squares, dbeta, dgamma

    zeros = lambda *shape: jnp.zeros(shape, F32)
    pair_inputs = (cfg, geo, g_ref, glo_ref, beta, doc_ref, r_ref)
    if squares_first:
        def square_block(j, squares):
            cols = block_cols(j)
            return add_squares(squares, do_ref[:, cols], *saved_u_and_dx(cols))

        squares = lax.fori_loop(0, V // BV, square_block, (zeros(C, C), zeros(C, C)))
        q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
        r_term, dp_self, products = _fused_pair_products(*pair_inputs, q, k, squares)
        formed = (r_term, dp_self, tuple(form() for form in products))
        pair = lambda q, k: formed  # formed already, from the q and k loaded above
        squares = ()
    else:
        squares = (zeros(C, C),) if shared_squares else (zeros(C, C), zeros(C, C))
    acc = (zeros(C, K), zeros(C, K), zeros(C, K), squares, zeros(C), zeros(K))
    dqa, dka, dke, squares, dbeta, dgamma = lax.fori_loop(0, V // BV, v_block, acc)
    if src:
        bound = boundary()
    if fused:
        if not squares_first:  # the products formed as the sums take them
            pair = lambda q, k: _fused_pair_products(*pair_inputs, q, k, squares)
        _fused_epilogue(cfg, geo, q_ref, k_ref, out_refs[1:], bound, dqa, dka, dke, pair, dbeta, dgamma, role)
        return
    q, k, dq, dk, dg, de = _boundary_grads(cfg, geo, q_ref, k_ref, bound, dqa, dka, dke, dgamma)

    incl, strict = _masks(geo, doc_ref[...], cfg.segmented)
    masked_dp = lambda dp: jnp.where(incl, cfg.scale * dp, 0.0)
    masked_dm = lambda dm: jnp.where(strict, dm, 0.0)

    def store(refs, x):
        refs[0][...], refs[1][...] = x, x.T  # the pair kernel loads rows of dP and dM as columns of the transposes

    if split_k:
        square = jnp.where(role == 0, masked_dp(squares[0]), masked_dm(squares[0]))
        pl.when(role == 0)(lambda: store((dp_ref, dpt_ref), square))
        pl.when(role == 1)(lambda: store((dm_ref, dmt_ref), square))
        dbeta_ref[...] = dbeta + jnp.where(role == 1, jnp.sum(square * r_ref[...], axis=1), 0.0)
    else:
        dp, dm = masked_dp(squares[0]), masked_dm(squares[1])
        store((dp_ref, dpt_ref), dp)
        store((dm_ref, dmt_ref), dm)
        dbeta_ref[...] = dbeta + jnp.sum(dm * r_ref[...], axis=1)  # through R's factor diag(beta)
    dq_ref[...], dk_ref[...], dg_ref[...], de_ref[...] = dq, dk, dg, de


def _boundary_grads(cfg, geo, q_ref, k_ref, bound, dqa, dka, dke, dgamma):
    """(q, k, dq, dk, dG, dE) of the V contractions' accumulators for one chunk and block of channels, fp32: dq =
    A (.) scale dqa, dk = E (.) dke + A (.) dka, dG through A = carry exp(G) and gamma = carry_C exp(G_C) (at the
    last token), dE = K (.) dke (.) E. Each accumulator is folded in as early as the sums allow and k is loaded
    before q, so that fewer C x BK tiles are live at once (the fused kernel spills at 255 registers). E's share goes
    out separately: its gates are those after s, an exclusive cumsum done in XLA; routing it through dG (-x at s,
    +x at C) would cancel in the reverse cumsum and leave O(eps x) where d(log_decay) ~ exp(-20)."""
    a, e = bound.a, bound.e
    k = k_ref[...].astype(F32)
    de = k * dke * e
    dk = e * dke + a * dka
    q = q_ref[...].astype(F32)
    dqa = cfg.scale * dqa
    gamma_term = jnp.where(geo.rows == cfg.chunk_size - 1, (bound.gamma * dgamma)[None, :], 0.0)
    dg = a * (q * dqa + k * dka) + gamma_term
    return q, k, a * dqa, dk, dg, de


def _fused_pair_products(cfg, geo, g_ref, glo_ref, beta, doc_ref, r_ref, q, k, squares):
    """(dbeta's share through R, dp_self, thunks of the pair products) of the fused kernel's squares (dP, dM
    unmasked): `_one_reference_pair_products`."""
    incl, strict = _masks(geo, doc_ref[...], cfg.segmented)
    dm = jnp.where(strict, squares[1], 0.0)
    r_term = jnp.sum(dm * r_ref[...], axis=1)  # through R's factor diag(beta)
    dp = jnp.where(incl, cfg.scale * squares[0], 0.0)
    to_end, from_end = _end_reference_split(g_ref, glo_ref, slice(None))
    return (r_term, *_one_reference_pair_products(cfg, q, k, to_end, from_end, beta, dp, dm))


def _fused_epilogue(cfg, geo, q_ref, k_ref, out_refs, bound, dqa, dka, dke, pair, dbeta, dgamma, role):
    """The fused kernel's end (`_grad_v_kernel`): the boundary terms (`_boundary_grads`), then the pair terms
    (`_sum_pair_terms`), which take each term as it is formed, so that fewer tiles are live at once. The same
    operations in the same order of summation as the two-kernel path's. `pair`: the function of (q, k) that gives
    `_fused_pair_products`' triple (its products formed, or thunks). `out_refs`: dq, dk, d(log_decay), dbeta. (The
    same sums in one expression, all terms formed first, spilled more: docs/kernels.md, "KDA: the fused gradient
    kernel's end reordered".)"""
    dq_ref, dk_ref, dlog_ref, dbeta_ref = out_refs
    q, k, dq_in, dk_in, dg_in, de = _boundary_grads(cfg, geo, q_ref, k_ref, bound, dqa, dka, dke, dgamma)
    r_term, dp_self, products = pair(q, k)
    dbeta_ref[...] = dbeta + (r_term if role is None else jnp.where(role == 0, r_term, 0.0))
    dg = _sum_pair_terms(q, k, dp_self, *products, dq_in=dq_in, dk_in=dk_in, dg_in=dg_in,
                         store_dq=lambda x: _store(dq_ref, x), store_dk=lambda x: _store(dk_ref, x))
    _write_log_decay_grad(dlog_ref, [dg], [de])


def _store(ref, x):
    ref[...] = x.astype(ref.dtype)


def _fp32(x):
    """An fp32 value, or the fp32 sum of a (hi, lo) pair."""
    return x[0].astype(F32) + x[1].astype(F32) if isinstance(x, tuple) else x


def _nt_dot(a, b, *, mode):
    """a b^T as `_dot(a, b, tb=True, mode=mode)` forms it, where a or b may also be a (hi, lo) pair saved by the
    passes (its `_split_bf16`, so the same bf16 products: a pair against a bf16 operand two, three otherwise)."""
    is_pair = lambda x: isinstance(x, tuple)
    if not is_pair(a) and not is_pair(b):
        return _dot(a, b, tb=True, mode=mode)
    if mode != "split":
        raise ValueError(f"saved (hi, lo) pairs need 'split' products, got {mode!r}")
    if not is_pair(a) and b[0].dtype == a.dtype == BF16:
        return _dot(a, b[0], tb=True) + _dot(a, b[1], tb=True)
    if not is_pair(b) and a[0].dtype == b.dtype == BF16:
        return _dot(a[0], b, tb=True) + _dot(a[1], b, tb=True)
    a, b = (x if is_pair(x) else _split_bf16(x) for x in (a, b))
    return _dot(a[0], b[0], tb=True) + (_dot(a[0], b[1], tb=True) + _dot(a[1], b[0], tb=True))


def _grad_pair_kernel(*refs, cfg: Config):
    """The pair terms of one chunk and BK channels (every output is per channel) in 16 x 16 blocks, added to the
    V kernel's partials:

    left(M, B)_tc = sum_{s<t} M_ts B_sc D_tsc (M = dP with B = K, M = dR with B = K) and
    right_sc = sum_{t>s} (dP_ts Q_tc + dR_ts K_tc) D_tsc; blocks i > j fold the reference split into the operands
    of 16 x 16 x K dots, diagonal blocks loop over the partner token c with the exact exponent. The pairs s = t
    (decay 1, only in dP) feed dq and dk but not dG (sending +x and -x through two roundings would leave O(eps x)
    in dG, which swamps d(log_decay) ~ exp(-20) when gates are -20).

    dG and the V kernel's dE leave as d(log_decay) of the chunk's tokens (`_write_log_decay_grad`), and dq, dk in
    the inputs' dtype when every key head has one value head (nothing left to sum in XLA).
    """
    # refs: q, k, G hi, G lo, beta, dP, dM, dP^T, dM^T, the V kernel's dq, dk, dG, dE; then the outputs dq, dk,
    # d(log_decay).
    bounded = _bounded_span(cfg, refs[2], refs[3], slice(None))
    if bounded is True:
        _pair_grads_one_reference(*refs, cfg=cfg)
    elif bounded is None:
        _pair_grads_sub_chunks(*refs, cfg=cfg)
    else:
        lax.cond(bounded, lambda: _pair_grads_one_reference(*refs, cfg=cfg),
                 lambda: _pair_grads_sub_chunks(*refs, cfg=cfg))


def _upper(n):
    """(n, n) bf16: 1 where column >= row."""
    return jnp.where(_iota(n, n, 1) >= _iota(n, n, 0), 1.0, 0.0).astype(BF16)


def _strictly_lower(n):
    """(n, n) bf16: 1 where column < row."""
    return jnp.where(_iota(n, n, 1) < _iota(n, n, 0), 1.0, 0.0).astype(BF16)


def _zero_one_dot(m, x):
    """m @ x for a 0/1 matrix m (bf16, exact) and fp32 x, on the bf16 tensor cores: x = x1 + x2 + x3 exactly (an
    fp32 significand is three bf16 ones), every product exact, each of the three sums accumulated in fp32. IEEE
    fp32 dots (`_hdot`) gave the same sums at 0.4 ms more per pair kernel (8x2048x16x128, H100)."""
    x1 = x.astype(BF16)
    rest = x - x1.astype(F32)
    x2 = rest.astype(BF16)
    x3 = (rest - x2.astype(F32)).astype(BF16)
    return _dot(m, x1) + _dot(m, x2) + _dot(m, x3)


def _write_log_decay_grad(dlog_ref, dgs, des):
    """d(log_decay)_r = sum_{t >= r} dG_t + sum_{s < r} dE_s over the chunk's tokens: G_t sums the log-decays
    r <= t of its chunk, E_s = exp(G_C - G_s) those after s. `dgs`, `des`: dG and dE in row blocks of equal height
    (one block for the whole chunk, or its sub-chunks). Inside a block, products with 0/1 triangles
    (`_zero_one_dot`); across blocks, column sums. Every term enters once with its own value (dE never passes
    through dG, see `_grad_v_kernel`)."""
    n = dgs[0].shape[0]
    column_sum = lambda x: jnp.sum(x, axis=0)[None, :]
    later = [None] * len(dgs)  # sum of dG over the blocks after block i
    acc = jnp.zeros_like(column_sum(dgs[0]))
    for i in reversed(range(len(dgs))):
        later[i] = acc
        acc = acc + column_sum(dgs[i])
    earlier = jnp.zeros_like(acc)  # sum of dE over the blocks before block i
    for i, (dg, de) in enumerate(zip(dgs, des)):
        dlog_ref[pl.ds(i * n, n), :] = (_zero_one_dot(_upper(n), dg) + later[i] + _zero_one_dot(_strictly_lower(n), de)
                                        + earlier)
        earlier = earlier + column_sum(de)


def _one_reference_pair_products(cfg, q, k, to_end, from_end, beta, dp, dm):
    """(dp_self, thunks of left_p, left_r, right) of one chunk of bounded span (SPAN_LIMIT) and a block of channels,
    fp32: the pair terms are the products of the sub-chunk scheme's blocks i > j over the whole chunk, split at the
    last token's gate (`to_end`, `from_end`: `_end_reference_split`). dP, dM as the V kernel masks them; dp_self
    their pairs s = t (dq, dk only). The thunks let a caller form each C x BK product as late as its sums allow
    (`_sum_pair_terms`)."""
    C, mode = cfg.chunk_size, cfg.dots
    diagonal = _iota(C, C, 0) == _iota(C, C, 1)
    dp_self = jnp.sum(jnp.where(diagonal, dp, 0.0), axis=1)[:, None]
    dp = jnp.where(diagonal, 0.0, dp)  # the pairs s < t; s = t stays out of dG, as in the sub-chunk scheme
    dr = beta[:, None] * dm
    k_from = k * from_end
    left_p = lambda: to_end * _dot(dp, k_from, mode=mode)
    left_r = lambda: to_end * _dot(dr, k_from, mode=mode)
    right = lambda: from_end * (_dot(dp, q * to_end, ta=True, mode=mode) + _dot(dr, k * to_end, ta=True, mode=mode))
    return dp_self, (left_p, left_r, right)


def _sum_pair_terms(q, k, dp_self, left_p, left_r, right, *, dq_in, dk_in, dg_in, store_dq, store_dk):
    """dq, dk (given to `store_dq`, `store_dk`) and dG (returned): the V contractions' partials plus the pair
    terms (`_one_reference_pair_products`: each product given, or a thunk formed here). dq is complete after the
    first product and leaves then, dk after the last; dG takes each term as it comes (fewer C x BK tiles live at
    once: the fused kernel spills at 255 registers)."""
    form = lambda x: x() if callable(x) else x
    left_p = form(left_p)
    store_dq(dq_in + left_p + dp_self * k)
    dg = dg_in + q * left_p
    left_r = form(left_r)
    dk = dk_in + left_r + dp_self * q
    dg = dg + k * left_r
    right = form(right)
    store_dk(dk + right)
    return dg - k * right


def _pair_grads_one_reference(q_ref, k_ref, g_ref, glo_ref, beta_ref, dp_ref, dm_ref, dpt_ref, dmt_ref, dq_in_ref,
                              dk_in_ref, dg_in_ref, de_ref, dq_ref, dk_ref, dlog_ref, *, cfg):
    """The pair terms of a chunk of bounded span (`_one_reference_pair_products`, `_sum_pair_terms`)."""
    del dpt_ref, dmt_ref
    q, k = q_ref[...].astype(F32), k_ref[...].astype(F32)
    to_end, from_end = _end_reference_split(g_ref, glo_ref, slice(None))
    dp_self, products = _one_reference_pair_products(cfg, q, k, to_end, from_end, beta_ref[...], dp_ref[...],
                                                     dm_ref[...])
    dg = _sum_pair_terms(q, k, dp_self, *products, dq_in=dq_in_ref[...], dk_in=dk_in_ref[...], dg_in=dg_in_ref[...],
                         store_dq=lambda x: _store(dq_ref, x), store_dk=lambda x: _store(dk_ref, x))
    _write_log_decay_grad(dlog_ref, [dg], [de_ref[...]])


def _pair_grads_sub_chunks(q_ref, k_ref, g_ref, glo_ref, beta_ref, dp_ref, dm_ref, dpt_ref, dmt_ref, dq_in_ref,
                           dk_in_ref, dg_in_ref, de_ref, dq_ref, dk_ref, dlog_ref, *, cfg):
    """The pair terms of one chunk in 16 x 16 blocks (the `_grad_pair_kernel` docstring)."""
    C, mode = cfg.chunk_size, cfg.dots
    K = q_ref.shape[-1]
    nb = C // SUB
    rows, cols = _iota(SUB, SUB, 0), _iota(SUB, SUB, 1)
    offset = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)
    block = lambda ref, i, j: ref[_blk(i), _blk(j)]
    row_block = lambda ref, i: ref[_blk(i), :].astype(F32)
    right = [jnp.zeros((SUB, K), F32) for _ in range(nb)]
    dk_rest, dg_rest = [], []
    for i in range(nb):
        q_i, k_i = row_block(q_ref, i), row_block(k_ref, i)
        gates_i = _gates(g_ref, glo_ref, _blk(i))
        beta_i = beta_ref[_blk(i)][:, None]
        dp_ii = block(dp_ref, i, i)

        def picks(c, i=i, beta_i=beta_i):
            """(dP[:, c], dR[:, c], dP[c, :], dR[c, :]) of the diagonal block i, each a (SUB, 1) column loaded from
            the refs (masked sums across the block instead, four per step: pair kernel 5.17 against 3.98 ms at
            8x2048x16x128 bf16, H100, 2026-11-25)."""
            column = pl.ds(i * SUB + c, 1)
            beta_c = beta_ref[column][None, :]
            return (dp_ref[_blk(i), column], beta_i * dm_ref[_blk(i), column], dpt_ref[_blk(i), column],
                    beta_c * dmt_ref[_blk(i), column])

        def column(c, acc, i=i, gates_i=gates_i, picks=picks):
            left_p, left_r, right_i = acc
            row = pl.ds(i * SUB + c, 1)
            q_c, k_c = q_ref[row, :].astype(F32), k_ref[row, :].astype(F32)
            d = _partner_exponent(g_ref, glo_ref, gates_i, row)  # G_t - G_c
            after, before = _masked_exp(offset > c, d), _masked_exp(offset < c, -d)
            p_col, r_col, p_row, r_row = picks(c)
            left_p = left_p + p_col * k_c * after
            left_r = left_r + r_col * k_c * after
            right_i = right_i + (p_row * q_c + r_row * k_c) * before
            return left_p, left_r, right_i

        zeros = jnp.zeros((SUB, K), F32)
        left_p, left_r, right[i] = lax.fori_loop(0, SUB, column, (zeros, zeros, right[i]))
        for j in range(i):
            ref = _reference(g_ref, glo_ref, j)
            to = _to_ref(gates_i, ref)
            k_from = row_block(k_ref, j) * _from_ref(_gates(g_ref, glo_ref, _blk(j)), ref)
            dp_ij, dm_ij = block(dp_ref, i, j), block(dm_ref, i, j)
            dr_ij = beta_i * dm_ij
            left_p = left_p + to * _dot(dp_ij, k_from, mode=mode)
            left_r = left_r + to * _dot(dr_ij, k_from, mode=mode)
            right[j] = right[j] + _from_ref(_gates(g_ref, glo_ref, _blk(j)), ref) * (
                _dot(dp_ij, q_i * to, ta=True, mode=mode) + _dot(dr_ij, k_i * to, ta=True, mode=mode))
        dp_self = jnp.sum(jnp.where(rows == cols, dp_ii, 0.0), axis=1)[:, None]
        dq_ref[_blk(i), :] = (dq_in_ref[_blk(i), :] + left_p + dp_self * k_i).astype(dq_ref.dtype)
        dk_rest.append(dk_in_ref[_blk(i), :] + left_r + dp_self * q_i)
        dg_rest.append(dg_in_ref[_blk(i), :] + q_i * left_p + k_i * left_r)
    for i in range(nb):
        dk_ref[_blk(i), :] = (dk_rest[i] + right[i]).astype(dk_ref.dtype)
    _write_log_decay_grad(dlog_ref, [dg_rest[i] - row_block(k_ref, i) * right[i] for i in range(nb)],
                          [de_ref[_blk(i), :] for i in range(nb)])


def _fuses_pair_grads(cfg):
    """Whether the V gradient kernel forms the pair terms: `Config.fused_pair_grads` in a call whose chunks all span
    at most the limit (`_when_all_bounded`)."""
    return cfg.fused_pair_grads and cfg.all_bounded


def _grad_channel_blocks(cfg, K):
    """Programs per chunk over the channels in the V gradient kernel: K / `pair_block_k` in the fused kernel (each
    forms both squares), else `grad_k_splits` (1, or 2 with the roles dP and dM)."""
    if _fuses_pair_grads(cfg):
        BK = min(cfg.pair_block_k, K)
        if BK < 16 or BK & (BK - 1):
            raise ValueError(f"config.pair_block_k must be a power of two >= 16 (the fused gradient kernel's channel "
                             f"blocks), got {cfg.pair_block_k}")
        return K // BK
    KS = cfg.grad_k_splits
    if KS not in (1, 2) or K // KS < 16:
        raise ValueError(f"config.grad_k_splits must be 1 or 2 (the roles dP and dM) with K / grad_k_splits >= 16, got "
                         f"{KS} with K = {K}")
    return KS


def _grads_v(cfg, src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do):
    """`_grad_v_kernel`, grid (P, chunks, B*Hv) with P programs per chunk: S = `Config.grad_v_splits` over V/S value
    columns each, or KS = `Config.grad_k_splits` over K/KS channels each. Returns (dv, dq, dk, dG, dE, dbeta, dP,
    dM) with dq, dk, dG partial. Every output but dv is linear in the V contractions, so the S programs' shares are
    summed here; with KS programs the per-channel outputs are disjoint blocks and only dbeta is a sum of shares.
    `saved`: (T, P), or with `Config.grads_from_passes` the pairs of u and dx (u hi, u lo, dx hi, dx lo)."""
    B, Tp, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C, S = cfg.chunk_size, cfg.grad_v_splits
    G = cfg.value_heads // cfg.key_heads
    if S < 1 or V % S or V // S < 16 or (V // S) & (V // S - 1):
        raise ValueError(f"config.grad_v_splits must divide V = {V} into power-of-two blocks >= 16, got {S}")
    for knob in ("grad_block_v", "fused_grad_block_v"):  # the V kernel's loop walks V / BV blocks of BV columns
        bv = getattr(cfg, knob)
        if bv < 16 or bv & (bv - 1):
            raise ValueError(f"config.{knob} must be a power of two >= 16, got {bv}")
    fused = _fuses_pair_grads(cfg)
    KS = _grad_channel_blocks(cfg, K)
    knob = "pair_block_k (with fused_pair_grads)" if fused else "grad_k_splits"
    if KS > 1 and (S > 1 or not cfg.grads_from_passes):
        raise ValueError(f"config.{knob}: {KS} channel blocks need grad_v_splits=1 and grads_from_passes (y's full "
                         f"sum over the channels is not formed); got grad_v_splits={S}, "
                         f"grads_from_passes={cfg.grads_from_passes}")
    VS, BK, nt = V // S, K // KS, Tp // C
    # the grid's first axis p is a V share (S > 1) or a channel block (KS > 1)
    vs = (lambda p: p) if S > 1 else (lambda p: 0)
    kb = (lambda p: p) if KS > 1 else (lambda p: 0)
    sp = _chunk_specs(cfg, K, V)
    lift = lambda spec: pl.BlockSpec(spec.block_shape, lambda p, i, bh, f=spec.index_map: f(i, bh))
    head = lambda i, bh: (bh // Hv, i, bh % Hv)
    key = pl.BlockSpec((None, C, None, BK), lambda p, i, bh: (bh // Hv, i, (bh % Hv) // G, kb(p)))
    channel = pl.BlockSpec((None, C, None, BK), lambda p, i, bh: head(i, bh) + (kb(p),))
    gamma = pl.BlockSpec((None, None, BK), lambda p, i, bh: (bh // Hv, bh % Hv, i * KS + kb(p)))
    value = pl.BlockSpec((None, C, None, VS), lambda p, i, bh: head(i, bh) + (vs(p),))
    state = pl.BlockSpec((None, None, BK, VS), lambda p, i, bh: (bh // Hv, bh % Hv, i * KS + kb(p), vs(p)))
    per_channel_share = pl.BlockSpec((None, None, C, None, BK), lambda p, i, bh: (vs(p),) + head(i, bh) + (kb(p),))
    square_share = pl.BlockSpec((None, None, C, None, C), lambda p, i, bh: (vs(p),) + head(i, bh) + (0,))
    gate_share = pl.BlockSpec((None, None, C, None), lambda p, i, bh: (p,) + head(i, bh))
    per_channel = jax.ShapeDtypeStruct((S, B, Tp, Hv, K), F32)
    square = jax.ShapeDtypeStruct((S, B, Tp, Hv, C), F32)
    src = src if cfg.operands == "stored" else ()
    src_specs = [channel] * (len(src) - 1) + [gamma] if src else []
    n_square = 4  # dP, dM, dP^T, dM^T
    dbeta_shares = jax.ShapeDtypeStruct((S * KS, B, Tp, Hv), F32)
    if fused:  # dq, dk (as `_grads_pairs` writes them), d(log_decay), dbeta's shares
        channel_grad = jax.ShapeDtypeStruct((B, Tp, Hv, K), q.dtype if G == 1 else F32)
        out_specs = [value] + [channel] * 3 + [gate_share]
        out_shape = [jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), channel_grad, channel_grad,
                     jax.ShapeDtypeStruct((B, Tp, Hv, K), F32), dbeta_shares]
    else:
        out_specs = [value] + [per_channel_share] * 4 + [gate_share] + [square_share] * n_square
        out_shape = [jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), per_channel, per_channel, per_channel,
                     per_channel, dbeta_shares] + [square] * n_square
    outs = _chunk_parallel_call(
        functools.partial(_grad_v_kernel, cfg=cfg, channel_blocks=KS),
        grid=(S * KS, nt, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=src_specs + [
            key, key, value, lift(sp["gate"]), channel, channel, lift(sp["seq"]), lift(sp["seq"]),
            lift(sp["seq"])] + ([value] * 4 if cfg.grads_from_passes else [lift(sp["square"])] * 2) + [
            lift(sp["square"]), state, state, value],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg.grad_warps, cfg.stages),
        interpret=cfg.interpret,
        name="kda_grads_fused" if fused else "kda_grads_v",
    )(*src, q, k, v, beta, g, glo, doc, carry, tail, *saved, r, starts, dends, do)
    total = lambda x: x[0] if x.shape[0] == 1 else jnp.sum(x, axis=0)
    if fused:
        dv, dq, dk, dlog_decay, dbeta = outs
        return dv, dq, dk, total(dbeta), dlog_decay
    dv, dq, dk, dg, de, dbeta, *squares = outs
    return (dv,) + tuple(total(x) for x in (dq, dk, dg, de, dbeta)) + (tuple(total(x) for x in squares),)


def _grads_pairs(cfg, q, k, g, glo, beta, squares, dq, dk, dg, de):
    """`_grad_pair_kernel`, grid (K/BK, chunks, B*Hv): dq, dk with the pair terms added (in q's dtype when
    every key head has one value head, else fp32 per value head) and d(log_decay) [B, Tp, Hv, K] fp32."""
    B, Tp, _, K = q.shape
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    BK = min(cfg.pair_block_k, K)
    key = pl.BlockSpec((None, C, None, BK), lambda kb, i, bh: (bh // Hv, i, (bh % Hv) // G, kb))
    channel = pl.BlockSpec((None, C, None, BK), lambda kb, i, bh: (bh // Hv, i, bh % Hv, kb))
    square = pl.BlockSpec((None, C, None, C), lambda kb, i, bh: (bh // Hv, i, bh % Hv, 0))
    gate = pl.BlockSpec((None, C, None), lambda kb, i, bh: (bh // Hv, i, bh % Hv))
    return _when_all_bounded(cfg, g, glo, lambda cfg: tuple(_chunk_parallel_call(
        functools.partial(_grad_pair_kernel, cfg=cfg),
        grid=(K // BK, Tp // C, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[key, key, channel, channel, gate] + [square] * len(squares) + [channel] * 4,
        out_specs=[channel] * 3,
        out_shape=[jax.ShapeDtypeStruct((B, Tp, Hv, K), q.dtype if G == 1 else F32)] * 2 + [
            jax.ShapeDtypeStruct((B, Tp, Hv, K), F32)],
        compiler_params=_params(cfg.pair_warps, cfg.stages),
        interpret=cfg.interpret,
        name="kda_grads_pairs",
    )(q, k, g, glo, beta, *squares, dq, dk, dg, de)))


def _grads_fused(cfg, *args):
    """(dq, dk, dv, dbeta, d(log_decay)) from the fused gradient kernel (`Config.fused_pair_grads`; `cfg` with
    `all_bounded`, the caller's check): the Triton one, or with `Config.grads_backend="mosaic"` the Mosaic GPU one."""
    if cfg.grads_backend == "mosaic":
        src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do = args
        return mosaic_kda_grads.grads(q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do,
                                      scale=cfg.scale, segmented=cfg.segmented, interpret=cfg.interpret)
    dv, dq, dk, dbeta, dlog_decay = _grads_v(cfg, *args)
    return dq, dk, dv, dbeta, dlog_decay


def _grads_two_kernels(cfg, src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do):
    dv, dq, dk, dg, de, dbeta, squares = _grads_v(cfg, src, q, k, v, beta, g, glo, doc, carry, tail, saved, r,
                                                  starts, dends, do)
    dq, dk, dlog_decay = _grads_pairs(cfg, q, k, g, glo, beta, squares, dq, dk, dg, de)
    return dq, dk, dv, dbeta, dlog_decay


def _grads(cfg, src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do):
    """(dq, dk, dv, dbeta, d(log_decay)): the V and the pair gradient kernels, or with `Config.fused_pair_grads` the
    fused kernel when every chunk spans at most the limit (a `lax.cond` on the call's check), the two kernels
    otherwise."""
    args = (src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do)
    if cfg.grads_backend not in PASS_BACKENDS:
        raise ValueError(f"config.grads_backend must be one of {PASS_BACKENDS}, got {cfg.grads_backend!r}")
    if cfg.grads_backend == "mosaic":
        _check_mosaic_pass(cfg, True, knob="grads_backend")
        mosaic_kda_grads.check_supported(key_dim=q.shape[3], value_dim=v.shape[3], chunk_size=cfg.chunk_size,
                                         dtype=q.dtype)
    if not cfg.fused_pair_grads:
        return _grads_two_kernels(cfg, *args)

    def call(cfg):  # without the call's span check (`_when_all_bounded`) cfg is never all_bounded: two kernels
        if _fuses_pair_grads(cfg):
            return _grads_fused(cfg, *args)
        # chunks of a longer span need the sub-chunk scheme: the two kernels, the pair kernel switching per program
        return _grads_two_kernels(dataclasses.replace(cfg, fused_pair_grads=False, call_span_check=False), *args)

    return _when_all_bounded(cfg, g, glo, call)


# ---------------------------------------------------------------------------------------------------------------
# custom_vjp glue
# ---------------------------------------------------------------------------------------------------------------


def _add_row(x_ref, r, hi, lo):
    """Row r of x_ref added into the running sums (hi, lo) by TwoSum: s = hi + x, b = s - hi, and the addition's
    exact rounding error (hi - (s - b)) + (x - b) added into lo."""
    x = x_ref[pl.ds(r, 1), :]
    total = hi + x
    b = total - hi
    return total, lo + ((hi - (total - b)) + (x - b))


def _cumulative_kernel(x_ref, hi_ref, lo_ref):
    """G_t = sum_{r <= t} x_r down the C rows of one chunk, as hi + lo: hi the fp32 running sum, lo the running sum
    of each addition's exact rounding error (`_add_row`).

    Invariant: after row r, hi + lo = G_r up to lo's own roundings, which are ~2^-24 of lo (itself ~2^-24 of
    hi): the split `CumulativeLogDecay` is made for (differences G_t - G_s taken part by part stay exact to fp32
    after a -20 gate). Rows are loaded one at a time (Triton slices no values); each is independent of the
    running sums, so the loop's loads are pipelined."""
    zero = jnp.zeros((1, x_ref.shape[1]), F32)

    def row(r, sums):
        hi, lo = _add_row(x_ref, r, *sums)
        hi_ref[pl.ds(r, 1), :] = hi
        lo_ref[pl.ds(r, 1), :] = lo
        return hi, lo

    lax.fori_loop(0, x_ref.shape[0], row, (zero, zero))


def _cumulative(cfg, log_decay):
    """Compensated in-chunk cumsum (hi, lo) of log_decay [B, Tp, Hv, K] (`Config.cumsum`)."""
    B, Tp, Hv, K = log_decay.shape
    C = cfg.chunk_size
    if cfg.cumsum == "xla":
        g = CumulativeLogDecay.of(log_decay.reshape(B, Tp // C, C, Hv, K), axis=2)
        return g.hi.reshape(B, Tp, Hv, K), g.lo.reshape(B, Tp, Hv, K)
    if cfg.cumsum not in CUMSUM_METHODS:
        raise ValueError(f"config.cumsum must be one of {CUMSUM_METHODS}, got {cfg.cumsum!r}")
    channel = _chunk_specs(cfg, K, K)["channel"]
    return tuple(_chunk_parallel_call(
        _cumulative_kernel,
        grid=(Tp // C, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[channel],
        out_specs=[channel, channel],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, Hv, K), F32)] * 2,
        compiler_params=_params(1, 3),
        interpret=cfg.interpret,
        name="kda_cumsum",
    )(log_decay.astype(F32)))


def _gates_kernel(x_ref, q_ref, k_ref, carry_ref, tail_ref, hi_ref, lo_ref, *out_refs, cfg: Config, parts):
    """`Config.cumsum="with_operands"`: `_cumulative_kernel`'s rows of one chunk and, from the same hi and lo, the
    forward's stored operands (`_operands_kernel`'s values: `_boundary`'s operations on the same numbers).

    A_t needs G_t, E_s = tail_s exp(G_C - G_s) also the chunk's last gate. A first loop runs the additions alone
    (x's rows only) for G_C; the second runs the same additions again (the same hi and lo, bit for bit) and writes
    G, A (.) Q, A (.) K and E (.) K row by row, reading each row of q and k once. (Written the other way round, the
    E loop after the A loop, k was read twice too. On the H100 every program of an 8x2048x16x128 call is resident at
    once, so second reads miss L2: x's still do, 135 MB from DRAM per call; k's no longer, 67 MB; docs/kernels.md.)"""
    C, K = x_ref.shape
    *tiles, gamma_ref = out_refs
    qa_refs, ak_refs, ke_refs = _by_operand(tiles, parts)
    store = lambda refs, row, x: _store_parts(cfg, refs, (row, slice(None)), x)
    zero = jnp.zeros((1, K), F32)
    hi_end, lo_end = lax.fori_loop(0, C, lambda r, sums: _add_row(x_ref, r, *sums), (zero, zero))
    gamma_ref[...] = (carry_ref[pl.ds(C - 1, 1)][:, None] * jnp.exp(hi_end + lo_end)).reshape(K)

    def down(r, sums):
        hi, lo = _add_row(x_ref, r, *sums)
        row = pl.ds(r, 1)
        hi_ref[row, :], lo_ref[row, :] = hi, lo
        a = carry_ref[row][:, None] * jnp.exp(hi + lo)
        k = k_ref[row, :].astype(F32)
        store(qa_refs, row, a * q_ref[row, :].astype(F32))
        store(ak_refs, row, a * k)
        e = tail_ref[row][:, None] * jnp.exp((hi_end - hi) + (lo_end - lo))
        store(ke_refs, row, e * k)
        return hi, lo

    lax.fori_loop(0, C, down, (zero, zero))


def _gates_and_operands(cfg, q, k, log_decay, carry, tail, phase="forward"):
    """(G hi, G lo, the chunk operands `_source` of `phase`: "forward", or "both" for `backward_operands="saved"`): by
    `_gates_kernel` with `cumsum="with_operands"`."""
    if cfg.cumsum != "with_operands":
        g, glo = _cumulative(cfg, log_decay)
        return g, glo, _source(cfg, q, k, g, glo, carry, tail, phase)
    if cfg.operands != "stored":
        raise ValueError(f"config.cumsum='with_operands' needs config.operands='stored', got {cfg.operands!r}")
    B, Tp, Hv, K = log_decay.shape
    sp = _chunk_specs(cfg, K, K)
    shapes = _operand_shapes(cfg, B, Tp, K, phase)
    g, glo, *src = _chunk_parallel_call(
        functools.partial(_gates_kernel, cfg=cfg, parts=_operand_parts(cfg, phase)),
        grid=(Tp // cfg.chunk_size, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[sp["channel"], sp["key"], sp["key"], sp["seq"], sp["seq"]],
        out_specs=[sp["channel"]] * (len(shapes) + 1) + [sp["gamma"]],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, Hv, K), F32)] * 2 + shapes,
        compiler_params=_params(1, 3),
        interpret=cfg.interpret,
        name="kda_gates",
    )(log_decay.astype(F32), q, k, carry, tail)
    return g, glo, tuple(src)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _kda(cfg, q, k, v, beta, log_decay, doc, carry, tail, h0):
    g, glo, src = _gates_and_operands(cfg, q, k, log_decay, carry, tail)
    t, p = _prepare(cfg, q, k, g, glo, beta, doc)  # (also checks the config as given)
    return tuple(_forward_pass(_primal_config(cfg), src, v, beta, t, p, h0, with_states=False))


def _kda_fwd(cfg, q, k, v, beta, log_decay, doc, carry, tail, h0):
    # Residuals: the inputs, P, T and R (C x C per chunk), the chunk start states (K x V per chunk, fp32 or bf16),
    # with `Config.grads_from_passes` u's pair, and with `backward_operands="saved"` the backward's stored operands.
    backward_src = None
    saved = _saves_backward_operands(cfg)
    g, glo, src = _gates_and_operands(cfg, q, k, log_decay, carry, tail, "both" if saved else "forward")
    if saved:
        src, backward_src = (_phase_operands(cfg, src, phase) for phase in ("forward", "backward"))
    t, p, r = _prepare(cfg, q, k, g, glo, beta, doc, with_r=True)
    o, final, starts, u_pair = _forward_pass(cfg, src, v, beta, t, p, h0, with_states=True)
    return (o, final), (q, k, v, beta, g, glo, doc, carry, tail, t, p, r, starts, u_pair, backward_src)


def _primal_config(cfg):
    """The config of the forward when not differentiated (`Config.primal_forward`; the Mosaic pass is fused only,
    so `pass_backend="mosaic"` keeps its config)."""
    if cfg.primal_forward is None or cfg.pass_backend == "mosaic":
        return cfg
    if cfg.primal_forward == "split":
        return dataclasses.replace(cfg, forward="split", state_storage="fp32")
    return dataclasses.replace(cfg, forward=cfg.primal_forward)


def _saves_backward_operands(cfg):
    """Whether the forward writes and keeps the backward's stored operands (`Config.backward_operands`)."""
    if cfg.backward_operands not in BACKWARD_OPERANDS:
        raise ValueError(f"config.backward_operands must be one of {BACKWARD_OPERANDS}, got "
                         f"{cfg.backward_operands!r}")
    # "inline" operands store nothing: their passes form the operands in every step, in either phase.
    return cfg.backward_operands == "saved" and cfg.operands == "stored"


def _kda_bwd(cfg, residuals, cotangents):
    q, k, v, beta, g, glo, doc, carry, tail, t, p, r, starts, u_pair, src = residuals
    do, dfinal = cotangents
    do = do.astype(v.dtype)
    if src is None:  # `backward_operands="formed"`: a chunk-parallel kernel instead of tiles kept alive
        src = _source(cfg, q, k, g, glo, carry, tail, "backward")
    dh0, dends, dx_pair = _reverse_pass(cfg, src, beta, t, p, do, dfinal.astype(F32))
    saved = u_pair + dx_pair if cfg.grads_from_passes else (t, p)
    dq, dk, dv, dbeta, dlog_decay = _grads(cfg, src, q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts,
                                           dends, do)
    B, Tp, H, K = q.shape
    G = cfg.value_heads // H
    if G > 1:  # one key head's gradient sums over its value heads (fp32 per value head from the pair kernel)
        dq = dq.reshape(B, Tp, H, G, K).sum(3)
        dk = dk.reshape(B, Tp, H, G, K).sum(3)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbeta.astype(beta.dtype), dlog_decay,
            None, None, None, dh0)


_kda.defvjp(_kda_fwd, _kda_bwd)
_kda_jit = jax.jit(_kda, static_argnums=0)  # eager callers compile once per configuration and shapes


# ---------------------------------------------------------------------------------------------------------------
# Entry point (the rules' signature)
# ---------------------------------------------------------------------------------------------------------------

BLOCK_V = 64  # the widest V block of the sequential passes (`common.sequential_block_v` narrows it)
# With operands formed in every step, V blocks narrower than 32 slowed the passes down (2026-11-23); with stored
# operands 16 is faster where it buys programs: 1x32768x16x128 bf16 passes 4.64-4.71 -> 3.93-4.17 ms, forward +
# backward 38.5-38.6 -> 37.5-37.6 ms; at 2x8192x16x128 17.87 -> 17.78 ms (H100, 2026-11-25).
KDA_NARROWEST_BLOCK_V = 16
GRAD_BLOCK_V = 32  # the V kernel of the two-kernel path (calls with long spans): 64 measured slower (2026-11-29)
# V block of the fused gradient kernel's loop (`Config.fused_grad_block_v`) for bfloat16 inputs. H100, 8x2048x16x128,
# 2026-12-06 (docs/kernels.md, "KDA: the fused gradient kernel's end reordered"): host-timed 2.419 / 2.673 ms at 32,
# 2.224 / 2.179 at 64, 2.566 at 16 (`bench_kda_gpu.py`), 1,973 -> 1,906 us from 32 to 64 under Nsight Compute: half
# the loop's steps, though it spills more (66 M local-memory load sectors against 38 M). Other dtypes keep
# GRAD_BLOCK_V: fp16 saves fp32 states, whose wider tiles were not compiled at 64, and fp32 inputs at 64 asked 256
# KiB of shared memory (H100, 2026-12-06). With the squares in a loop of their own, 32 again measured slower: KDA
# forward+backward 3.80 ms against 3.69 at 64 (H100, 2026-12-06, docs/kernels.md, "KDA: the fused gradient kernel's
# squares first").
FUSED_GRAD_BLOCK_V = 64
# Programs per chunk of the V gradient kernel with u and dx from the passes (`Config.grad_k_splits`), at 4 warps.
# H200, 8x2048x16x128 bf16, `bench_kda_gpu.py` host-timed in one call (2026-11-29 07:16-07:21): the kernel 1.755-1.762
# ms as one program at 8 warps, 1.445 as two at 4 warps (2.126 at 8 warps; 1.907 / 1.778 with V blocks of 64).
GRAD_K_SPLITS = 2
# With "split" products the pair terms are formed in the V gradient kernel where every chunk of a call spans at most
# SPAN_LIMIT (`Config.fused_pair_grads`), one program per chunk and 32 channels (`pair_block_k`) at 4 warps. H200,
# 8x2048x16x128 bf16, `bench_kda_gpu.py` host-timed (2026-11-29 10:42-10:55): 2.25-2.40 ms against 3.19-3.57 for the
# two kernels (V 1.54-1.62, pairs 1.61-1.95); at 64 channels per program 4.44 ms (8 warps 4.06), 16 channels 3.28.
# By `bench_rules.py` (device time) forward+backward 4.02 -> 3.79 ms ("mosaic"; docs/kernels.md).
# Software-pipeline depth of the passes where a V block of 16 or 32 gives them at most one program per SM, for
# bfloat16 inputs, K <= 128 and C <= 64 (four stored bf16 operand tiles of C x K per chunk, which two stages fit in
# shared memory, leaving room for no second program); elsewhere 1 (at BV 64 two stages asked for 295 KB). H100,
# 2026-11-27, `bench_kda_gpu.py` (docs/kernels.md, "KDA: two pipeline stages in the narrow passes"):
# 1x32768x16x128, BV 16 (128 programs), 1 -> 2 stages: forward / forward+backward 4.57 / 15.13 -> 3.90-4.02 /
# 13.53-13.65 ms; 2x8192x16x128, BV 16 (256 programs) one stage 1.84 / 6.66-6.96, two 2.19 / 7.10, BV 32 (128
# programs) two stages 1.56 / 6.17.
NARROW_PASS_STAGES = 2
# The forward that is not differentiated runs split, with fp32 start states (`Config.primal_forward`), where the
# passes take V blocks of 16 at one program per SM (bfloat16, `NARROW_PASS_STAGES`), the fused pass forming the
# output's Q-side products again in each of a head's eight programs. H200, 2026-12-02 (`bench_kda_gpu.py
# --per_kernel=false`, host-timed, docs/kernels.md, "KDA: the split forward for inference at few heads"):
# 1x32768x16x128 (BV 16) forward 4.178 / 4.175 ms fused, 3.769 / 3.766 split; 2x8192x16x128 (BV 32) 1.610 fused,
# 1.794 split, so BV 32 stays fused.
PRIMAL_SPLIT_BLOCK_V = 16

# The backward takes its stored operands from the forward's (`Config.backward_operands`) rather than forming them
# again. H200, bf16, 2026-12-02 (docs/kernels.md, "KDA: the backward's operands saved by the forward"):
# `bench_rules.py` forward+backward 3.79 -> 3.62 ms at 8x2048x16x128 ("mosaic"), 9.92 -> 9.63 at 1x32768x16x128,
# for 268 MB more residuals at 8x2048x16x128 (four bf16 C x K tiles per chunk and value head).
BACKWARD_OPERANDS_DEFAULT = "saved"


def default_config(q, v, *, scale, chunk_size, segmented, interpret):
    """fp32 inputs get IEEE fp32 products everywhere; 16-bit inputs the bf16x3 "split" products, except, for
    bfloat16 inputs, plain bf16 operands in the products that tolerate them (`TOLERANT_DOT_MODES`) and bf16 saved
    states (`STATE_STORAGES`); with "split" products the passes save u and dx for the V gradient kernel
    (`Config.grads_from_passes`: its spills at 255 registers had made it the largest kernel), which then also forms
    the pair terms where the call's chunks allow it (`Config.fused_pair_grads`, GRAD_K_SPLITS). H100, 8x2048x16x128
    bf16, 2026-11-27: forward+backward 5.47 -> 5.09 ms (bf16 states) -> 4.58 (both). The output's state product
    stays "split" (`Config.output_dots`; plain bf16 there took decoding's o over the 3e-3 bound): forward 1.13 ->
    1.46 ms, forward+backward 4.58 -> 4.90 ms.

    Register pressure sets the rest (H100, 8x2048x16x128 bf16, 2026-11-25, docs/kernels.md): stored operands
    (passes 3.6 -> 0.9 ms forward, 4.1 -> 1.1 ms reverse; one pipeline stage, two asked for more shared memory
    than there is), 32 channels per step of prepare (4.5 -> 2.9 ms) and per program of the pair gradients, 8 warps
    for the V gradient kernel, prepare at 2 warps (0.80 -> 0.69-0.74 ms, 2026-11-26). The compensated cumsum of the
    gates is a kernel (the XLA form took 0.74-0.92 ms for a memory floor near 0.16 ms) that also writes the
    forward's operands (`_gates_kernel`: 0.53-0.55 ms against 0.28 + 0.45 for the cumsum and the operand kernel)."""
    V = _pow2_at_least_16(v.shape[3])
    fp32 = jnp.dtype(q.dtype) == jnp.float32
    dots = "highest" if fp32 else "split"
    bf16 = jnp.dtype(q.dtype) == jnp.bfloat16
    tolerant = "bf16" if bf16 else dots
    batch_heads = q.shape[0] * v.shape[2]
    # u and dx from the passes free the V gradient kernel from y's full channel sum: two programs per chunk, one per
    # half of the channels, at 4 warps (GRAD_K_SPLITS).
    grad_k_splits = GRAD_K_SPLITS if dots == "split" and _pow2_at_least_16(q.shape[3]) >= 32 else 1
    block_v = sequential_block_v(batch_heads, V, BLOCK_V, KDA_NARROWEST_BLOCK_V)
    pass_stages = 1
    one_per_sm = one_program_per_sm_block_v(batch_heads, V, KDA_NARROWEST_BLOCK_V)
    primal_forward = None
    if bf16 and q.shape[3] <= 128 and chunk_size <= 64 and one_per_sm:  # two stages fit (NARROW_PASS_STAGES)
        block_v, pass_stages = one_per_sm, NARROW_PASS_STAGES
        primal_forward = "split" if block_v == PRIMAL_SPLIT_BLOCK_V else None
    return Config(scale=float(scale), chunk_size=int(chunk_size), key_heads=q.shape[2], value_heads=v.shape[2],
                  segmented=segmented, dots=dots, inverse="rows" if fp32 else "blocks", state_dots=tolerant,
                  grad_k_dots=tolerant, output_dots=dots,
                  prepare="partner",
                  block_v=block_v,
                  grad_block_v=min(GRAD_BLOCK_V, V), warps=4, prepare_warps=2,
                  grad_warps=4 if grad_k_splits > 1 else 8, pair_warps=4, stages=2, interpret=interpret,
                  operands="stored", pass_stages=pass_stages, block_k=32, pair_block_k=32, reverse_warps=4,
                  cumsum="with_operands", span_limit=SPAN_LIMIT, state_storage="bf16" if bf16 else "fp32",
                  grads_from_passes=dots == "split", grad_k_splits=grad_k_splits,
                  fused_pair_grads=dots == "split", backward_operands=BACKWARD_OPERANDS_DEFAULT,
                  fused_grad_block_v=min(FUSED_GRAD_BLOCK_V if bf16 else GRAD_BLOCK_V, V),
                  primal_forward=primal_forward)


# The Mosaic GPU forward pass (`Config.pass_backend="mosaic"`, Hopper) from this many batch x value-head pairs per
# call: one warpgroup per V block of 64, so 2 CTAs per head. Measured faster at 64 and 128 heads; with 16 the
# Triton pass's narrow blocks fill more SMs (1x32768x16x128, H100, host-timed: forward 4.41-4.48 ms with the Mosaic
# pass against 4.23-4.26 for the Triton one; docs/kernels.md); 32 heads were not timed. With it the reverse pass
# runs in Mosaic GPU too (8x2048x16x128, H200, host-timed in one call: 0.544 ms against the Triton reverse pass's
# 0.729 on the same Mosaic forward, forward+backward 4.568 against 4.802). At K = V = 128 the threshold is
# MOSAIC_PASS_MIN_BATCH_HEADS_128.
MOSAIC_PASS_MIN_BATCH_HEADS = 64
# At K = V = 128 the Mosaic passes run from 16 value heads, with state blocks of MOSAIC_NARROW_BLOCK_V columns where
# V / 32 CTAs per head fit one wave (`one_program_per_sm_block_v`): H100, 2026-12-06, `bench_rules.py --rule=kda
# --impls=mosaic` (marginal device time, ms, forward / forward+backward; two runs each in one call, the Triton passes
# of BV 16 at 16 heads and 32 at 32 heads against the Mosaic ones of BV 32): 1x32768x16x128 3.550 / 9.471, 3.556 /
# 9.462 -> 3.441 / 9.101, 3.433 / 9.093; 2x8192x16x128 1.429 / 3.942, 1.424 / 3.945 -> 1.327 / 3.824, 1.346 / 3.822
# (docs/benchmarks.md). Fewer heads and the other head dims were not timed; they keep MOSAIC_PASS_MIN_BATCH_HEADS.
MOSAIC_PASS_MIN_BATCH_HEADS_128 = 16
MOSAIC_NARROW_BLOCK_V = 32
# At K = V = 128 both Mosaic passes run a producer warpgroup beside each state block's warpgroup, which releases
# every input as soon as the chunk has read it (`Config.mosaic_producer`, `Config.mosaic_reverse_producer`): H100,
# 2026-12-06, `bench_rules.py --rule=kda --impls=mosaic` (marginal device time, ms, forward / forward+backward;
# without, with the forward's, with both): 1x32768x16x128 3.443 / 9.088, 3.048 / 8.730, 3.057 / 8.490; 2x8192x16x128
# 1.330 / 3.819, 1.188 / 3.685, 1.186 / 3.578; 4x4096x16x128 1.226 / 3.534, 1.062 / 3.521, 1.057 / 3.499
# (docs/benchmarks.md). At 128 heads too, in state blocks of 64 (two runs each, interleaved in one call, 18:35):
# 1.184 / 3.665, 1.185 / 3.670 against 1.197 / 3.725, 1.201 / 3.728 with one CTA per head in the forward
# (`Config.mosaic_shared_head`) and `emit_pipeline` in the reverse pass; blocks of 32 there (four waves) gave
# 1.512 / 4.342. So at K = V = 128 no call takes the shared head. The reverse pass with one CTA per head
# (`Config.mosaic_reverse_shared_head`) gave 3.727 against 3.692 (18:06) and stays a knob.
MOSAIC_PRODUCER_AT_128 = True
MOSAIC_REVERSE_PRODUCER_AT_128 = True
# From this many batch x value-head pairs the Mosaic forward pass runs one CTA per value head (a producer and two
# consumer warpgroups, `Config.mosaic_shared_head`) where V is two state blocks of 64 outside K = V = 128 (so at
# K = 64, V = 128), reading the chunk's key-side operands once for both V halves. Measured at K = V = 128 on an
# H200 (2026-12-03, 8x2048x16x128 bf16, against `emit_pipeline` per state block, marginal device time): forward
# 1.046 against 1.155 ms, forward+backward 3.527 against 3.610, the same outputs bit for bit. Not timed below 128
# heads, where one CTA per head leaves SMs idle.
MOSAIC_SHARED_HEAD_MIN_BATCH_HEADS = 128


def mosaic_config(q, v, *, scale, chunk_size, segmented, interpret):
    """`default_config` with the forward and reverse passes in Mosaic GPU where they apply
    (`mosaic_kda.check_supported`: bf16, K of 64 or 128, V of 64, 128 or 256, chunk 64) and the call has at least
    `MOSAIC_PASS_MIN_BATCH_HEADS` value heads (`MOSAIC_PASS_MIN_BATCH_HEADS_128` at K = V = 128, there in state
    blocks of `MOSAIC_NARROW_BLOCK_V` columns while V / 32 CTAs per head fit one wave, and with a producer warpgroup
    per state block, `MOSAIC_PRODUCER_AT_128`, `MOSAIC_REVERSE_PRODUCER_AT_128`; at other head dims from
    `MOSAIC_SHARED_HEAD_MIN_BATCH_HEADS` with one CTA per value head in the forward pass); the Triton kernels
    otherwise. The config of the dispatch's "mosaic" implementation for KDA."""
    cfg = default_config(q, v, scale=scale, chunk_size=chunk_size, segmented=segmented, interpret=interpret)
    if q.shape[3] not in mosaic_kda.DISPATCH_KEY_DIMS:  # K = 256: opt-in, measured slower (mosaic_kda.py)
        return cfg
    try:
        mosaic_kda.check_supported(key_dim=q.shape[3], value_dim=v.shape[3], chunk_size=chunk_size, dtype=q.dtype,
                                   block_v=cfg.mosaic_block_v, output_dots=cfg.output_dots)
    except ValueError:
        return cfg
    batch_heads, V = q.shape[0] * v.shape[2], v.shape[3]
    dims_128 = q.shape[3] == V == 128  # the head dims whose thresholds, blocks and layouts were timed
    if batch_heads < (MOSAIC_PASS_MIN_BATCH_HEADS_128 if dims_128 else MOSAIC_PASS_MIN_BATCH_HEADS):
        return cfg
    shared_head = not dims_128 and batch_heads >= MOSAIC_SHARED_HEAD_MIN_BATCH_HEADS and 2 * cfg.mosaic_block_v == V
    one_wave_narrow = one_program_per_sm_block_v(batch_heads, V, MOSAIC_NARROW_BLOCK_V) == MOSAIC_NARROW_BLOCK_V
    block_v = MOSAIC_NARROW_BLOCK_V if dims_128 and one_wave_narrow else cfg.mosaic_block_v
    return dataclasses.replace(cfg, pass_backend="mosaic", reverse_backend="mosaic", mosaic_shared_head=shared_head,
                               mosaic_block_v=block_v, mosaic_producer=MOSAIC_PRODUCER_AT_128 and dims_128,
                               mosaic_reverse_producer=MOSAIC_REVERSE_PRODUCER_AT_128 and dims_128)


def compiles_for(key_dim, value_dim, dtype):
    """Whether the compiled kernels take these head dims with q/k/v of this dtype (`NON_BF16_MAX_HEAD_DIM`)."""
    widest = max(_pow2_at_least_16(key_dim), _pow2_at_least_16(value_dim))
    return widest <= NON_BF16_MAX_HEAD_DIM or jnp.dtype(dtype) == BF16


def _pow2_at_least_16(n):
    """Triton arrays need power-of-two sizes, and dots want sides >= 16."""
    return max(16, 1 << (int(n) - 1).bit_length())


def _pad(x, time=0, last=0, mode="constant"):
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, time)
    if last:
        widths[-1] = (0, last)
    return jnp.pad(x, widths, mode=mode) if time or last else x


def _validate(q, k, v, beta, log_decay, initial_state, segment_ids, chunk_size):
    if q.ndim != 4:
        raise ValueError(f"q must have shape [B, T, H, K], got {q.shape}")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {q.shape}, got {k.shape}")
    if v.ndim != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [B, T, Hv, V] with B, T = {B, T}, got {v.shape}")
    Hv, V = v.shape[2], v.shape[3]
    if H < 1 or Hv % H:
        raise ValueError(f"v's heads ({Hv}) must be a multiple of q/k's heads ({H})")
    if beta is None:
        raise ValueError("beta must be given: the KDA kernels implement the delta rule")
    if beta.shape != (B, T, Hv):
        raise ValueError(f"beta must have shape [B, T, Hv] = {(B, T, Hv)}, got {beta.shape}")
    if log_decay is None or log_decay.shape != (B, T, Hv, K):
        raise ValueError(f"log_decay must have shape [B, T, Hv, K] = {(B, T, Hv, K)} (one decay per key channel), "
                         f"got {None if log_decay is None else log_decay.shape}")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in INPUT_DTYPES:
            raise ValueError(f"{name} must have a dtype in {INPUT_DTYPES}, got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (1 <= K <= MAX_HEAD_DIM and 1 <= V <= MAX_HEAD_DIM):
        raise ValueError(f"key and value dims must be in [1, {MAX_HEAD_DIM}], got K={K} (q) and V={V} (v)")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    if initial_state is not None and initial_state.shape != (B, Hv, K, V):
        raise ValueError(f"initial_state must have shape [B, Hv, K, V] = {(B, Hv, K, V)}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, T):
        raise ValueError(f"segment_ids must have shape [B, T] = {(B, T)}, got {segment_ids.shape}")


def kda_chunk(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
              state_passing="sequential", interpret=None, config=None):
    """The delta rule with log_decay [B, T, Hv, K] (<= 0) through the Triton kernels; shapes as in `dispatch`.

    q, k [B, T, H, K]; v [B, T, Hv, V]; beta [B, T, Hv]; initial_state [B, Hv, K, V] or None; segment_ids [B, T]
    or None. Returns (o [B, T, Hv, V] in v.dtype, final state [B, Hv, K, V] float32). `state_passing` is accepted
    for the common signature; the kernels always pass states sequentially. `interpret` defaults to "not on a GPU".
    """
    del state_passing
    _validate(q, k, v, beta, log_decay, initial_state, segment_ids, chunk_size)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    B, T, H, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    nt = -(-T // C)
    pad = nt * C - T
    Kp, Vp = _pow2_at_least_16(K), _pow2_at_least_16(V)
    if not interpret and not compiles_for(K, V, q.dtype):
        raise ValueError(f"compiled, K or V above {NON_BF16_MAX_HEAD_DIM} needs bfloat16 q/k/v (float32 tiles "
                         f"exceed shared memory), got {jnp.dtype(q.dtype).name} with K={K}, V={V}")
    cfg = config or default_config(q, v, scale=scale, chunk_size=C, segmented=segment_ids is not None,
                                   interpret=interpret)
    # Padded tokens have k = v = 0, beta = 0 and no decay: they leave the state unchanged. Padded channels have
    # q = k = 0 and no decay, so they stay zero in the state and in every product.
    qp, kp = _pad(q, pad, Kp - K), _pad(k, pad, Kp - K)
    vp = _pad(v, pad, Vp - V)
    beta_p = _pad(beta.astype(F32), pad)
    log_decay_p = _pad(log_decay.astype(F32), pad, Kp - K)
    doc = _pad(document_index(segment_ids, B, T), pad, mode="edge")
    chunks = doc.reshape(B, nt, C)
    before = jnp.concatenate([chunks[:, :1, :1], chunks[:, :-1, -1:]], axis=1)  # last doc of the previous chunk
    carry = (chunks == before).astype(F32).reshape(B, nt * C)
    tail = (chunks == chunks[:, :, -1:]).astype(F32).reshape(B, nt * C)
    if initial_state is None:
        h0 = jnp.zeros((B, Hv, Kp, Vp), F32)
    else:
        h0 = jnp.pad(initial_state.astype(F32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
    o, final = _kda_jit(cfg, qp, kp, vp, beta_p, log_decay_p, doc, carry, tail, h0)
    return o[:, :T, :, :V].astype(v.dtype), final[:, :, :K, :V]
