"""Chunkwise WY form of the delta rule and linear attention (scalar or no decay) as Pallas Triton kernels.

The math is `deltajax.rules.chunk` (see its docstring), rearranged so that the only per-chunk factor stored between
kernels is the in-chunk inverse T. Per chunk of C tokens, with S_0 its start state, G the in-chunk cumulative
log-decay, `carry`/`tail` the document masks and M the causal same-document mask:

    A      = diag(beta) (K K^T (.) exp(G_t - G_s), s < t, same document)                        (1)
    T      = (I + A)^-1                      16x16 fp32 forward substitutions + exact block merges (2)
    y      = V - diag(carry exp(G)) K S_0                                                        (3)
    u      = T diag(beta) y                  (= U0 - W S_0 of the W/U0 form)                     (4)
    O      = scale [ diag(carry exp(G)) Q S_0 + (Q K^T (.) exp(G_t - G_s), M) u ]                 (5)
    S_end  = carry_C exp(G_C) S_0 + K_end^T u,   K_end = diag(tail exp(G_C - G)) K               (6)

Linear attention is u = V. Kernels, in the order they run:

- `_inverse_kernel`, grid (chunks, B*Hv): (1)-(2) for one chunk; writes T (C x C, fp32). `Config.inverse_method`:
  "blocks16": the 10 SUB x SUB blocks of A from SUB x SUB x K dots, the 4 diagonal blocks inverted one after
  another by forward substitution (4 x 15 serial steps), then T_ij = -T_ii sum_m A_im T_mj in exact SUB x SUB
  dots.
  "batched16": A by halves of the chunk (three C/2 x C/2 x K dots), the 4 diagonal blocks inverted side by side
  in one loop of 15 steps, merged 16 -> 32 inside each half and 32 -> 64 with C/2 x C/2 dots. All are exact
  (IEEE fp32 products, or for 16-bit inputs exact 3-way bf16 splits, `_exact_dot`); their H100 times are in
  docs/kernels.md.
  "blocks16_from_a" (opt-in): two kernels, `_scores_a_kernel` (A from one C x C x K product, 4 warps, stored in
  fp32), then `_inverse_from_a_kernel` (blocks16's substitutions and exact products, block column by block
  column, loading A's rows and blocks where it needs them): fewer registers than "blocks16" (168 against 255 on
  the H200) for ~2% less time, measured in docs/kernels.md.
- The sequential pass over chunks, grid (V/BV, B*Hv), with the fp32 state block S[:, BV] in registers
  (`Config.output_method`): "fused", `_forward_kernel`: (3)-(6) fused; writes O and the final state (and, for the
  backward, every chunk's start state and u). "split" (the default when the passes have at most two programs per
  SM): `_state_kernel` does (3), (4), (6) alone and writes every chunk's start state and u, then
  `_output_kernel`, grid (V/BV, chunks, B*Hv), does (5) chunk-parallel. With few programs the pass is bound by
  the latency of each step's dependency chain, and "split" leaves only that chain in it.
- `_reverse_kernel`, grid (V/BV, B*Hv): the sequential pass backwards, carrying dL/dS; writes every chunk's
  end-state cotangent, dL/d(initial_state) and (for the gradients) dx = T^T du. Its state-free part of du, scale
  P^T dO, comes from `_reverse_scores_kernel`, grid (V/BV, chunks, B*Hv), run before it where the pass has at most
  one program per SM (`Config.reverse_scores="stored"`), else from its own steps.
- The gradients, chunk-parallel, from the saved start states and end-state cotangents (`Config.grad_method`):
  "fused": `_grad_kernel`, grid (K/BK, chunks, B*Hv), loops over V blocks inside the program so that dq, dk (a K
  block of them), dbeta and d(log_decay) come out whole. "staged": `_grad_v_kernel`, grid (V/BV, chunks, B*Hv),
  writes dv, u, dx and per-V-block partials of the C x C products; then `_grad_k_kernel`, grid (K/BK, chunks,
  B*Hv), loops over V blocks for dq and dk and does the C x C terms. No program of "staged" holds more than two
  C x BK accumulators. "merged" (the default for K <= 128): `_grad_merged_kernel`, grid (1, chunks, B*Hv), reads
  u and dx saved by the passes (`Config.grads_from_passes`, which "staged" can use too) and does everything in
  three loops over V blocks, the C x C products in registers.

Precision. Products of two input-dtype operands (Q K^T, K K^T) are exact on the tensor cores. A product with an fp32
operand (the state, T, P, u, ...) is done in one of the modes of `common.dot` (`Config.dots` etc.): "highest" (IEEE
fp32, for fp32 inputs), "tf32", "bf16" (operands rounded), or "split": each fp32 operand x is written as hi + lo with
hi = bf16(x), lo = bf16(x - hi), and the product is summed from the bf16 dots hi*hi + hi*lo + lo*hi (two dots when
the other operand is already bf16): ~2^-16 relative error per product at bf16 tensor-core speed. float16 inputs take
"fp16_split" and "fp16" in their place (`FP16_DOTS`): the fp32 partner of an fp16 tile scaled into fp16's range and
split into (or rounded to) fp16, so that the fp16 tile itself is used as it is. The products that
keep the bf16 bounds with plainly rounded operands even for correlated keys with beta near 2 have modes of their
own (`state_dots`: K S_0, Q S_0, K dS and Q^T dO; `grad_k_dots`: the state and dA products of "staged" part 2);
which products those are was measured per group (docs/kernels.md, "Which products need split").

Key heads are indexed, never repeated: value head hv reads key head hv // (Hv // H). Cumulative gates, document
masks and padding are computed in XLA; d(log_decay) is written per token by the gradient kernels (`_dlog`), with
per-block shares summed in XLA.
"""

from __future__ import annotations

import dataclasses
import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.kernels.gpu.common import chunk_parallel_call as _chunk_parallel_call
from deltajax.kernels.gpu.common import compiler_params as _params
from deltajax.kernels.gpu.common import GRID_ORDERS
from deltajax.kernels.gpu.common import dot as _dot
from deltajax.kernels.gpu.common import fp16_scaled
from deltajax.kernels.gpu.common import iota2 as _iota2
from deltajax.kernels.gpu.common import last as _last
from deltajax.kernels.gpu.common import MIN_SEQUENTIAL_PROGRAMS
from deltajax.kernels.gpu.common import one_program_per_sm_block_v
from deltajax.kernels.gpu.common import sequential_block_v
from deltajax.kernels.gpu.common import split_bf16 as _split_bf16
from deltajax.kernels.gpu.common import split3_bf16
from deltajax.kernels.gpu.common import split_pair_dot as _split_pair_dot
from deltajax.kernels.gpu.common import unit_lower_inverse as _unit_lower_inverse
from deltajax.kernels.gpu.common import unit_lower_inverse_by_rows as _unit_lower_inverse_by_rows
from deltajax.rules.chunk import CumulativeLogDecay
from deltajax.rules.common import document_index

SUB = 16  # side of the diagonal blocks inverted by forward substitution
F32 = jnp.float32
BF16 = jnp.bfloat16
F16 = jnp.float16
HIGHEST = lax.Precision.HIGHEST
GRAD_METHODS = ("fused", "staged", "merged")
INVERSE_METHODS = ("blocks16", "batched16", "blocks16_from_a")
INVERSE_STORAGES = ("fp32", "split")
ROUNDING_GRAD_METHODS = ("staged", "merged")  # whose state products take `grad_k_dots` (bf16 states possible)
STATE_STORAGES = ("fp32", "bf16", "fp16")
# A third method, "folded" (the inverse kernel also writing Z = diag(beta) T^T K_end, so the pass has two
# dependent products per chunk instead of three), measured slower at every size on the H100 and was removed
# (docs/kernels.md, "Eighth session").
OUTPUT_METHODS = ("fused", "split")
PASS_SCALARS = ("inline", "stored")
# Where the reverse pass gets each chunk's state-free part of du, scale P^T dO (REVERSE_SCORES): "inline", formed in
# every step of the pass (Q K^T, the masks and exps, P^T dO: in each of the V/BV programs of a head, and on the
# step's instruction stream); "stored", formed chunk-parallel by `_reverse_scores_kernel` before the pass and read
# as one more fp32 input (C x V per chunk and head written and read once).
REVERSE_SCORES = ("inline", "stored")
# The forward without residuals in pieces of the sequence, each piece's state pass beside the next piece's inverse
# and the last piece's output (on side streams through `compute_on`, then as roles of one launch per piece),
# measured slower than one piece at 1x32768x16x128 and 1x65536x16x128 on the H100 and was removed (docs/kernels.md,
# "The forward in pieces"; the code is in the history at commit 0b6babe).


def rounded_state_storage(grad_method, state_dots, grad_k_dots, block_v, grad_block_v, delta=True):
    """The storage (STATE_STORAGES) of the saved start states and end-state cotangents that changes no product
    reading them, beyond fp32: "bf16" where every such product rounds them to bf16; "fp16" where every such product
    is an "fp16" one and reads them in whole tiles of the passes' V blocks, so that the passes can store each tile
    as that product scales and rounds it, with its factor (the delta rule's "merged" gradient kernel, whose V block
    must lie inside one of the passes'; linear attention's "merged" runs the "staged" kernels); else None."""
    if grad_method not in ROUNDING_GRAD_METHODS or state_dots != grad_k_dots:
        return None
    if state_dots == "bf16":
        return "bf16"
    if state_dots == "fp16" and grad_method == "merged" and delta and block_v % grad_block_v == 0:
        return "fp16"
    return None


@dataclasses.dataclass(frozen=True)
class Config:
    """Static configuration of one call (hashable: it is a `custom_vjp` non-differentiable argument)."""

    scale: float
    chunk_size: int
    key_heads: int
    value_heads: int
    delta: bool  # False: linear attention (u = V)
    segmented: bool  # same-document masks inside the chunk are needed
    gated: bool  # a log-decay was given (False: G = 0, never computed from a constant)
    dots: str  # forward products with an fp32 operand (`common.DOT_MODES`)
    state_dots: str  # K S_0, Q S_0, K dS, Q^T dO (passes, output, gradient part 1; see `_chunk_step`)
    inverse_dots: str  # products with T, forward and backward
    grad_dots: str  # the other products of the backward kernels
    grad_k_dots: str  # "staged" part 2: its products with S_0, dS_end and dA (see `_grad_k_kernel`)
    block_v: int  # BV of the sequential passes
    grad_block_v: int  # BV of the gradient kernels (the loops of "fused" and "merged", both kernels of "staged")
    grad_block_k: int  # BK of dq and dk (a grid axis of the gradient kernel that writes them; K: whole rows)
    grad_method: str  # GRAD_METHODS: "fused" (one kernel), "staged" (a V-block kernel, then a K-block kernel) or
    # "merged" (staged's two in one, reading u and dx from the passes; linear attention: "staged")
    warps: int  # sequential passes
    grad_warps: int  # gradient kernel ("fused"), the V-block kernel ("staged")
    grad_k_warps: int  # the K-block kernel ("staged"), the kernel of "merged"
    inverse_warps: int  # inverse kernel
    inverse_method: str  # INVERSE_METHODS: how `_inverse_kernel` forms T (see there)
    stages: int
    interpret: bool
    # How the gradient kernels read T (INVERSE_STORAGES): fp32, or "split": its bf16 pair (hi, lo) = split_bf16(T),
    # written once by the inverse kernel next to the fp32 T when the call is differentiated (the gradient kernels
    # then load two bf16 operands instead of holding and splitting an fp32 C x C tile: no register spills in
    # part 1 on the H100). The sequential passes have storages of their own (`pass_inverse_storage`,
    # `reverse_inverse_storage`): with two programs per SM the pair slowed them (the fused forward pass from 0.73
    # to 0.86 ms on 2026-11-24 morning, 0.41 to 0.53 ms in the evening); with one per SM it sped them up.
    inverse_storage: str = "fp32"
    # dtype of the saved chunk start states and end-state cotangents (STATE_STORAGES). "bf16" only where every
    # product that reads them rounds them to bf16 anyway ("staged" gradients, state_dots = grad_k_dots = "bf16");
    # "fp16" (float16 inputs) where every product that reads them scales each of the passes' tiles into fp16's
    # range and rounds it: the passes store the tile so, with its factor per column (`_save_state`,
    # `rounded_state_storage`).
    state_storage: str = "fp32"
    # The sequential passes save u (forward) and dx (reverse), which they compute anyway, and the gradient
    # kernels read them instead of recomputing P, du and both products with T (then no gradient kernel reads T).
    # "staged": either; "merged": always; "fused": never.
    grads_from_passes: bool = False
    # Where O (eq. 5) is computed (OUTPUT_METHODS): "fused", inside the forward pass; "split", chunk-parallel by
    # `_output_kernel` after a pass that carries only the state and writes every start state (`state_storage`) and
    # u. "split" moves Q K^T, Q S_0 and P u off the pass's dependency chain at the price of writing and reading
    # the states and u (which the backward saves anyway).
    output_method: str = "fused"
    output_block_v: int = 128  # BV of `_output_kernel`
    output_warps: int = 4
    # Pipeline stages of the sequential passes (None: `stages`). Deeper pipelines take shared memory that limits
    # the programs per SM, which matters only when there are more programs than SMs.
    pass_stages: int | None = None
    # How the forward pass and the reverse pass read T (INVERSE_STORAGES): fp32, split into bf16 (hi, lo) in every
    # step, or "split": the pair written by the inverse kernel (the same three products, so the same values).
    pass_inverse_storage: str = "fp32"
    reverse_inverse_storage: str = "fp32"
    # Where the sequential passes get each chunk's exp(G) carry, exp(G_C - G) tail and survival factor
    # (PASS_SCALARS): "stored", read as `_stored_scalars` forms them in XLA before the pass (see `_pass_loop`);
    # "inline", from G, carry and tail in every step: three reductions for the chunk's last values, each through
    # shared memory and a barrier, behind an un-prefetched load of carry, all on the step's chain (1.52 -> 1.16 ms
    # for the forward pass at 1x32768x16x128 on the H100; docs/kernels.md, "Chunk scalars out of the passes").
    pass_scalars: str = "stored"
    # Pipeline stages of "staged" part 2, `_grad_k_kernel` (None: `stages`). On bf16 saved states at K = 256 its
    # dq came out wrong compiled with two stages and right with one (docs/kernels.md, "dq of the staged gradient
    # kernels at K = 256").
    grad_k_stages: int | None = None
    # Where the reverse pass gets scale P^T dO, the part of du that does not depend on the state (REVERSE_SCORES).
    reverse_scores: str = "inline"

    # Launch order of the chunk-parallel kernels (`common.GRID_ORDERS`): chunks or heads fastest.
    grid_order: str = "chunks"

    def __post_init__(self):
        if self.grid_order not in GRID_ORDERS:
            raise ValueError(f"grid_order must be one of {GRID_ORDERS}, got {self.grid_order!r}")
        if self.inverse_storage not in INVERSE_STORAGES:
            raise ValueError(f"inverse_storage must be one of {INVERSE_STORAGES}, got {self.inverse_storage!r}")
        if self.inverse_storage == "split" and self.inverse_dots != "split":
            raise ValueError(f"inverse_storage='split' needs inverse_dots='split', got {self.inverse_dots!r}")
        for name in ("pass_inverse_storage", "reverse_inverse_storage"):
            value = getattr(self, name)
            if value not in INVERSE_STORAGES:
                raise ValueError(f"{name} must be one of {INVERSE_STORAGES}, got {value!r}")
            if value == "split" and self.inverse_dots != "split":
                raise ValueError(f"{name}='split' needs inverse_dots='split', got {self.inverse_dots!r}")
        if self.pass_scalars not in PASS_SCALARS:
            raise ValueError(f"pass_scalars must be one of {PASS_SCALARS}, got {self.pass_scalars!r}")
        if self.reverse_scores not in REVERSE_SCORES:
            raise ValueError(f"reverse_scores must be one of {REVERSE_SCORES}, got {self.reverse_scores!r}")
        if self.state_storage not in STATE_STORAGES:
            raise ValueError(f"state_storage must be one of {STATE_STORAGES}, got {self.state_storage!r}")
        rounded = rounded_state_storage(self.grad_method, self.state_dots, self.grad_k_dots, self.block_v,
                                        self.grad_block_v, self.delta)
        if self.state_storage != "fp32" and self.state_storage != rounded:
            raise ValueError(f"state_storage={self.state_storage!r} needs every product that reads the saved states "
                             f"to round them so: 'bf16' grad_method in {ROUNDING_GRAD_METHODS} and state_dots = "
                             f"grad_k_dots = 'bf16'; 'fp16' the delta rule, grad_method='merged', state_dots = "
                             f"grad_k_dots = 'fp16' and grad_block_v dividing block_v (got {self.grad_method!r}, "
                             f"{self.state_dots!r}, {self.grad_k_dots!r}, {self.grad_block_v}, {self.block_v}, "
                             f"delta={self.delta})")
        if self.grads_from_passes != (self.grad_method == "merged") and self.grad_method != "staged":
            raise ValueError(f"grads_from_passes={self.grads_from_passes} does not go with grad_method="
                             f"{self.grad_method!r} ('merged' needs it, 'fused' cannot use it)")


def _gates(g_ref, rows=slice(None)):
    """(hi, lo) of the compensated in-chunk cumulative gate G = hi + lo at `rows` (see `CumulativeLogDecay`)."""
    return g_ref[0, rows], g_ref[1, rows]


def _pair_decay(g_rows, g_cols, mask):
    """exp(G_t - G_s) where `mask`, else 0; masked before the exp so it cannot overflow. The difference is taken
    part by part, (hi_t - hi_s) + (lo_t - lo_s), so near-1 decays after a large gate keep their fp32 accuracy."""
    (hi_r, lo_r), (hi_c, lo_c) = g_rows, g_cols
    diff = (hi_r[:, None] - hi_c[None, :]) + (lo_r[:, None] - lo_c[None, :])
    return jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _chunk_mask(doc, c, strict, segmented):
    row, col = _iota2(c, c, 0), _iota2(c, c, 1)
    mask = row > col if strict else row >= col
    if segmented:
        mask = mask & (doc[:, None] == doc[None, :])
    return mask


def _chunk_scalars(g, carry, tail):
    """exp(G) carry, exp(G_C - G) tail and the state's survival factor carry_C exp(G_C) of one chunk."""
    hi, lo = g
    hi_last, lo_last = _last(hi), _last(lo)
    return (carry * jnp.exp(hi + lo), tail * jnp.exp((hi_last - hi) + (lo_last - lo)),
            _last(carry) * jnp.exp(hi_last + lo_last))


def _stored_scalars(cfg, g, carry, tail):
    """`_chunk_scalars` of every chunk, formed in XLA for the passes of `pass_scalars="stored"`: from_start and
    to_end [B, Hv, Tp], and survive [B, Hv, nt]."""
    _, B, Tp, Hv = g.shape
    C = cfg.chunk_size
    nt = Tp // C
    hi, lo = (x.reshape(B, nt, C, Hv) for x in g)
    carry, tail = carry.reshape(B, nt, C, 1), tail.reshape(B, nt, C, 1)
    hi_last, lo_last = hi[:, :, -1:], lo[:, :, -1:]
    from_start = carry * jnp.exp(hi + lo)
    to_end = tail * jnp.exp((hi_last - hi) + (lo_last - lo))
    survive = (carry[:, :, -1:] * jnp.exp(hi_last + lo_last))[:, :, 0]  # [B, nt, Hv]
    per_head = lambda x: jnp.moveaxis(x.reshape(B, Tp, Hv), 2, 1)
    return per_head(from_start), per_head(to_end), jnp.moveaxis(survive, 2, 1)


def _pass_scalar_inputs(cfg, sp, g, carry, tail, *, gates=True):
    """(arrays, BlockSpecs) of a sequential pass's `scalar_refs` (see `_pass_loop`): for "inline" (carry, tail),
    with `gates` (G, carry, tail) for a pass that has no G ref of its own; for "stored" `_stored_scalars`."""
    if cfg.pass_scalars == "stored":
        return _stored_scalars(cfg, g, carry, tail), (sp["head_seq"], sp["head_seq"], sp["head_chunks"])
    if not gates:
        return (carry, tail), (sp["seq"], sp["seq"])
    return (g, carry, tail), (sp["gates"], sp["seq"], sp["seq"])


def _pass_loop(cfg, nt, scalar_refs, body, init, *, reverse=False):
    """`lax.fori_loop` of a sequential pass over its chunks (the last one first with `reverse`): the carried state
    goes through s = body(i, stored, s) for chunk i. `stored` is None for "inline" (the body forms
    `_chunk_scalars` itself), else chunk i's (from_start, to_end, survive) read from `scalar_refs`. The survival
    factor is a scalar load, which the software pipeline does not prefetch: it is loaded one step ahead and
    carried, so its latency is off the step's chain."""
    C = cfg.chunk_size
    chunk = (lambda n: nt - 1 - n) if reverse else (lambda n: n)
    if cfg.pass_scalars != "stored":
        return lax.fori_loop(0, nt, lambda n, s: body(chunk(n), None, s), init)
    from_start_ref, to_end_ref, survive_ref = scalar_refs

    def step(n, carried):
        s, survive = carried
        i = chunk(n)
        ahead = survive_ref[chunk(jnp.minimum(n + 1, nt - 1))]
        rows = pl.ds(pl.multiple_of(i * C, C), C)
        return body(i, (from_start_ref[rows], to_end_ref[rows], survive), s), ahead

    return lax.fori_loop(0, nt, step, (init, survive_ref[chunk(0)]))[0]


def _block_diagonal_inverses(ats):
    """(I + A)^-1 for each A of `ats`, given as A^T: n x n, block diagonal with strictly lower SUB x SUB blocks (zero
    outside them). The forward substitutions of `_unit_lower_inverse` for all blocks of all matrices in one loop of
    SUB - 1 steps.

    Step i makes row i of every block final. With d[j] = A[b(j) SUB + i, j] (row i of the block of j), the update
    of row b SUB + i at column c is w[c] = sum_j d[j] T[j, c]: T is block diagonal, so only the j of c's own block
    contribute, and d is nonzero only for j before row i there, rows that are already final. d is a reduction of
    A^T along axis 1 and w one along axis 0, so neither needs a layout change in the loop.
    """
    n = ats[0].shape[0]
    row, col = _iota2(n, n, 0), _iota2(n, n, 1)
    same_block = row // SUB == col // SUB
    col_in_block, row_in_block = col % SUB, row % SUB

    def step(i, ts):
        out = []
        for at, t in zip(ats, ts):
            d = jnp.sum(jnp.where(col_in_block == i, at, 0.0), axis=1)  # d[j] = A[b(j) SUB + i, j]
            w = jnp.sum(d[:, None] * t, axis=0)
            out.append(t - jnp.where(same_block & (row_in_block == i), w[None, :], 0.0))
        return tuple(out)

    eye = jnp.where(row == col, 1.0, 0.0).astype(F32)
    return lax.fori_loop(1, SUB, step, tuple(eye for _ in ats))


def _exact_dot(a, b, fp32):
    """a @ b of two fp32 values at about IEEE fp32 accuracy: IEEE fp32 for fp32 inputs (`fp32`), else six bf16
    tensor-core dots of the exact 3-way splits (the dropped terms are below 2^-24 relative; "split" mode's
    ~2^-17 per product gave 10x the error of IEEE fp32 in T with correlated keys and beta near 2)."""
    if fp32:
        return _dot(a, b, mode="highest")
    raw = lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())), preferred_element_type=F32)
    (a_hi, a_mid, a_lo), (b_hi, b_mid, b_lo) = split3_bf16(a), split3_bf16(b)
    small = raw(a_hi, b_lo) + raw(a_mid, b_mid) + raw(a_lo, b_hi)
    return (small + (raw(a_hi, b_mid) + raw(a_mid, b_hi))) + raw(a_hi, b_hi)


# ---------------------------------------------------------------------------------------------------------------
# (1)-(2): the in-chunk inverse, chunk-parallel
# ---------------------------------------------------------------------------------------------------------------


def _store_inverse(t_refs, rows, cols, value):
    """Writes a block of T into each ref: fp32, or its bf16 pair (hi, lo) where the ref has a leading axis of 2."""
    for ref in t_refs:
        if len(ref.shape) == 3:
            hi, lo = _split_bf16(value)
            ref[0, rows, cols] = hi
            ref[1, rows, cols] = lo
        else:
            ref[rows, cols] = value


def _inverse_dot(t_ref, rows, x, cfg, *, ta=False):
    """T x (T^T x with `ta`) for the rows `rows` of T and an fp32 x. T is an fp32 block (products in
    `cfg.inverse_dots`) or its stored bf16 pair, a block with a leading axis of 2 (the same three bf16 products as
    "split")."""
    if len(t_ref.shape) == 3:
        return _split_pair_dot((t_ref[0, rows, :], t_ref[1, rows, :]), x, ta=ta)
    return _dot(t_ref[rows, :], x, ta=ta, mode=cfg.inverse_dots)


def inverse_spec(cfg, index_map, *, pair=False):
    """BlockSpec of one chunk's T (all C rows): [B, Tp, Hv, C] fp32, or with `pair` its [2, B, Tp, Hv, C] bf16
    pair; `index_map` gives (b, chunk, hv, 0) of the fp32 layout."""
    C = cfg.chunk_size
    if pair:
        return pl.BlockSpec((2, None, C, None, C), lambda *ids: (0,) + tuple(index_map(*ids)))
    return pl.BlockSpec((None, C, None, C), index_map)


def _inverse_kernel(k_ref, beta_ref, g_ref, doc_ref, *t_refs, cfg: Config):
    if cfg.inverse_method == "blocks16":
        _inverse_blocks16(k_ref, beta_ref, g_ref, doc_ref, t_refs, cfg)
    elif cfg.inverse_method == "batched16":
        _inverse_batched16(k_ref, beta_ref, g_ref, doc_ref, t_refs, cfg)
    else:
        raise ValueError(f"inverse_method must be one of {INVERSE_METHODS}, got {cfg.inverse_method!r}")


def _scores_a_kernel(k_ref, beta_ref, g_ref, doc_ref, a_ref, *, cfg: Config):
    """(1) of one chunk for `inverse_method="blocks16_from_a"`: A = diag(beta) (K K^T (.) exp(G_t - G_s)), strictly
    lower and same-document, from one C x C x K product; the elementwise operations of `_inverse_blocks16` on the
    same numbers."""
    mask = _chunk_mask(doc_ref[...], cfg.chunk_size, True, cfg.segmented)
    k = k_ref[...]
    a_ref[...] = beta_ref[...][:, None] * _dot(k, k, tb=True) * _pair_decay(_gates(g_ref), _gates(g_ref), mask)


def _inverse_from_a_kernel(a_ref, *t_refs, fp32: bool):
    """(2) of one chunk for `inverse_method="blocks16_from_a"`, from the stored A: the diagonal blocks by forward
    substitution first, then T block column by block column, T_ij = -T_ii sum_{j <= m < i} A_im T_mj (the sums and
    exact SUB x SUB products of `_inverse_blocks16`, in the same order). Column by column only the diagonal
    inverses and one column of T are live, and A's blocks are loaded where a product needs them, with no key tiles:
    168 registers on the H200, 12 programs per SM, where "blocks16" (row by row, all of T live) takes 255 and 8,
    and the same kernel row by row 227 and 8 (docs/kernels.md)."""
    exact = functools.partial(_exact_dot, fp32=fp32)
    nb = a_ref.shape[0] // SUB
    blocks = [slice(i * SUB, (i + 1) * SUB) for i in range(nb)]
    # Row r of a diagonal block is loaded, not extracted by a masked reduction: off the substitution's serial chain.
    diagonal = [_unit_lower_inverse_by_rows(SUB, lambda r, b=b: a_ref[b.start + r, b]) for b in blocks]
    zero = jnp.zeros((SUB, SUB), F32)
    for j in range(nb):
        column = {j: diagonal[j]}
        for i in range(j + 1, nb):
            acc = exact(a_ref[blocks[i], blocks[j]], column[j])
            for m in range(j + 1, i):
                acc = acc + exact(a_ref[blocks[i], blocks[m]], column[m])
            column[i] = -exact(diagonal[i], acc)
        for i in range(nb):
            _store_inverse(t_refs, blocks[i], blocks[j], column.get(i, zero))


def _inverse_batched16(k_ref, beta_ref, g_ref, doc_ref, t_refs, cfg):
    """T of eq. (2) by halves of the chunk (h = C/2 rows): A_11, A_22 and A_21 from three h x h x K dots, the 2h/SUB
    diagonal SUB-blocks of both halves inverted side by side (`_block_diagonal_inverses`, SUB - 1 serial steps in
    all), merged inside each half, then T_21 = -T_22 A_21 T_11. All products of the merges are exact (`_exact_dot`).

    Merge of diagonal blocks of side n into blocks of side 2n: with T_d the inverse of the n-blocks and A_off the
    part of A inside the 2n-blocks but outside the n-blocks, T_2n = T_d - T_d A_off T_d (for
    [[I + A_11, 0], [A_21, I + A_22]] the inverse is [[T_1, 0], [-T_2 A_21 T_1, T_2]]). The zero blocks of the
    operands are exact zeros, so the n-blocks of T_d pass through unchanged.
    """
    h = cfg.chunk_size // 2
    halves = (pl.ds(0, h), pl.ds(h, h))
    k = [k_ref[rows, :] for rows in halves]
    beta = [beta_ref[rows] for rows in halves]
    g = [_gates(g_ref, rows) for rows in halves]
    doc = [doc_ref[rows] for rows in halves]
    fp32 = k_ref.dtype == F32
    row, col = _iota2(h, h, 0), _iota2(h, h, 1)

    def block(i, j):
        mask = row > col if i == j else row >= 0
        if cfg.segmented:
            mask = mask & (doc[i][:, None] == doc[j][None, :])
        return beta[i][:, None] * _dot(k[i], k[j], tb=True) * _pair_decay(g[i], g[j], mask)

    diagonal = (block(0, 0), block(1, 1))
    same_block = row // SUB == col // SUB
    t = list(_block_diagonal_inverses(tuple(jnp.where(same_block, a.T, 0.0) for a in diagonal)))
    n = SUB
    while n < h:
        inside = (row // (2 * n) == col // (2 * n)) & (row // n != col // n)
        for i, a in enumerate(diagonal):
            t[i] = t[i] - _exact_dot(t[i], _exact_dot(jnp.where(inside, a, 0.0), t[i], fp32), fp32)
        n *= 2
    _store_inverse(t_refs, halves[0], halves[0], t[0])
    _store_inverse(t_refs, halves[1], halves[1], t[1])
    _store_inverse(t_refs, halves[1], halves[0], -_exact_dot(t[1], _exact_dot(block(1, 0), t[0], fp32), fp32))
    _store_inverse(t_refs, halves[0], halves[1], jnp.zeros((h, h), F32))


def _inverse_blocks16(k_ref, beta_ref, g_ref, doc_ref, t_refs, cfg):
    """T of eq. (2) block by block, one block row at a time: row i's blocks of A from SUB x SUB x K dots, its
    diagonal block inverted by forward substitution (`_unit_lower_inverse`), then T_ij = -T_ii sum_m A_im T_mj
    (j < i, from the rows above) with exact SUB x SUB dots; the row is stored and its A blocks dropped.
    Row by row, only one row of A and one key block at a time are live (the 1-warp program spilled registers
    holding all 10 blocks of A and all 4 key blocks). For 16-bit inputs the SUB x SUB products are `_exact_dot`'s
    six bf16 tensor-core dots of exact 3-way splits rather than IEEE fp32 FMAs: the same accuracy (T 7.66e-6 against
    7.69e-6 from an fp64 inverse, correlated keys with beta near 2) and on the H100 0.169 -> 0.145 ms at
    8x2048x16x128, 0.334 -> 0.272 ms at 1x32768x16x128 (`experiments/bench_inverse_gpu.py`, docs/kernels.md)."""
    exact = functools.partial(_exact_dot, fp32=k_ref.dtype == F32)
    nb = cfg.chunk_size // SUB
    blocks = [slice(i * SUB, (i + 1) * SUB) for i in range(nb)]
    row, col = _iota2(SUB, SUB, 0), _iota2(SUB, SUB, 1)
    t = {}
    for i in range(nb):
        k_i, beta_i, g_i = k_ref[blocks[i], :], beta_ref[blocks[i]], _gates(g_ref, blocks[i])
        a = {}
        for j in range(i + 1):
            mask = row > col if i == j else row >= 0
            if cfg.segmented:
                mask = mask & (doc_ref[blocks[i]][:, None] == doc_ref[blocks[j]][None, :])
            kk = _dot(k_i, k_ref[blocks[j], :], tb=True)
            a[j] = beta_i[:, None] * kk * _pair_decay(g_i, _gates(g_ref, blocks[j]), mask)
        t[i, i] = _unit_lower_inverse(a[i])
        for j in range(i - 1, -1, -1):  # T_ij = -T_ii sum_{j <= m < i} A_im T_mj, every product exact
            acc = exact(a[j], t[j, j])
            for m in range(j + 1, i):
                acc = acc + exact(a[m], t[m, j])
            t[i, j] = -exact(t[i, i], acc)
        for j in range(nb):
            _store_inverse(t_refs, blocks[i], blocks[j], t[i, j] if j <= i else jnp.zeros((SUB, SUB), F32))


def _inverse(cfg, k, beta, g, doc, *, pair=False, fp32=True):
    """T (fp32) of every chunk and/or (`pair`) its bf16 pair (hi, lo); a tuple (fp32, pair) when both."""
    B, Tp, H, K = k.shape
    Hv, C, G = cfg.value_heads, cfg.chunk_size, cfg.value_heads // cfg.key_heads
    key = lambda t, bh: (bh // Hv, t, (bh % Hv) // G, 0)
    head = lambda t, bh: (bh // Hv, t, bh % Hv, 0)
    gate = lambda t, bh: (bh // Hv, t, bh % Hv)
    seq = lambda t, bh: (bh // Hv, t)
    in_specs = [pl.BlockSpec((None, C, None, K), key), pl.BlockSpec((None, C, None), gate),
                pl.BlockSpec((2, None, C, None), lambda t, bh: (0,) + gate(t, bh)), pl.BlockSpec((None, C), seq)]
    out_specs = ([inverse_spec(cfg, head)] if fp32 else []) + ([inverse_spec(cfg, head, pair=True)] if pair else [])
    out_shape = ([jax.ShapeDtypeStruct((B, Tp, Hv, C), F32)] if fp32 else []) + (
        [jax.ShapeDtypeStruct((2, B, Tp, Hv, C), BF16)] if pair else [])
    call = functools.partial(_chunk_parallel_call, grid=(Tp // C, B * Hv), grid_order=cfg.grid_order,
                             interpret=cfg.interpret)
    inverse = functools.partial(call, out_specs=out_specs, out_shape=out_shape,
                                compiler_params=_params(cfg.inverse_warps, cfg.stages), name="wy_inverse")
    if cfg.inverse_method == "blocks16_from_a":
        a = call(functools.partial(_scores_a_kernel, cfg=cfg), in_specs=in_specs, out_specs=inverse_spec(cfg, head),
                 out_shape=jax.ShapeDtypeStruct((B, Tp, Hv, C), F32),
                 compiler_params=_params(SCORES_A_WARPS, cfg.stages), name="wy_inverse_scores")(k, beta, g, doc)
        out = inverse(functools.partial(_inverse_from_a_kernel, fp32=k.dtype == F32),
                      in_specs=[inverse_spec(cfg, head)])(a)
    else:
        out = inverse(functools.partial(_inverse_kernel, cfg=cfg), in_specs=in_specs)(k, beta, g, doc)
    return tuple(out) if len(out) == 2 else out[0]


# ---------------------------------------------------------------------------------------------------------------
# (3)-(6): the sequential forward pass over chunks, output fused
# ---------------------------------------------------------------------------------------------------------------


def _sequence_specs(cfg, Tp, K, BV, *, pair=False):
    """BlockSpecs of the sequential passes (grid (V/BV, B*Hv)): whole sequences of one head, V block j; `pair`: T
    comes as its bf16 pair [2, B, Tp, Hv, C]."""
    Hv, G = cfg.value_heads, cfg.value_heads // cfg.key_heads
    return dict(
        key=pl.BlockSpec((None, Tp, None, K), lambda j, bh: (bh // Hv, 0, (bh % Hv) // G, 0)),
        value=pl.BlockSpec((None, Tp, None, BV), lambda j, bh: (bh // Hv, 0, bh % Hv, j)),
        # T, or its bf16 pair (`pair`). Linear attention reads no T: k stands in for it (see `_inverses`).
        inverse=(pl.BlockSpec((2, None, Tp, None, cfg.chunk_size), lambda j, bh: (0, bh // Hv, 0, bh % Hv, 0))
                 if pair else
                 pl.BlockSpec((None, Tp, None, cfg.chunk_size), lambda j, bh: (bh // Hv, 0, bh % Hv, 0))
                 if cfg.delta else pl.BlockSpec((None, Tp, None, K), lambda j, bh: (bh // Hv, 0, (bh % Hv) // G, 0))),
        gate=pl.BlockSpec((None, Tp, None), lambda j, bh: (bh // Hv, 0, bh % Hv)),
        gates=pl.BlockSpec((2, None, Tp, None), lambda j, bh: (0, bh // Hv, 0, bh % Hv)),  # G as (hi, lo)
        seq=pl.BlockSpec((None, Tp), lambda j, bh: (bh // Hv, 0)),
        # [B, Hv, Tp] and [B, Hv, nt]: per-head rows of `_stored_scalars`.
        head_seq=pl.BlockSpec((None, None, Tp), lambda j, bh: (bh // Hv, bh % Hv, 0)),
        head_chunks=pl.BlockSpec((None, None, Tp // cfg.chunk_size), lambda j, bh: (bh // Hv, bh % Hv, 0)),
        state=pl.BlockSpec((None, None, K, BV), lambda j, bh: (bh // Hv, bh % Hv, 0, j)),
        # Every chunk's state (or state cotangent) of the head, stacked: [B, Hv, nt * K, V].
        states=pl.BlockSpec((None, None, (Tp // cfg.chunk_size) * K, BV), lambda j, bh: (bh // Hv, bh % Hv, 0, j)),
        # Their factors for "fp16" storage, one row per chunk: [B, Hv, nt, V] (`_save_state`).
        state_factors=pl.BlockSpec((None, None, Tp // cfg.chunk_size, BV), lambda j, bh: (bh // Hv, bh % Hv, 0, j)),
    )


def _chunk_step(cfg, k_ref, v_ref, beta_ref, t_ref, rows, k, scalars, s):
    """(3), (4) and (6) of one chunk: u (fp32) and the state block at the chunk's end, from s at its start."""
    from_start, to_end, survive = scalars
    u = v_ref[rows, :].astype(F32)
    if cfg.delta:
        # K S_0, Q S_0, K dS and Q^T dO (here, in `_output`, the reverse pass and the gradients' part 1) tolerate
        # bf16 operands where the other products of the passes do not (docs/kernels.md, "Which products need
        # split").
        y = u - from_start[:, None] * _dot(k, s, mode=cfg.state_dots)
        u = _inverse_dot(t_ref, rows, beta_ref[rows][:, None] * y, cfg)
    return u, survive * s + _dot(k, to_end[:, None] * u, ta=True, mode=cfg.dots)


def _output(cfg, q, k, g, doc, from_start, s, u):
    """Eq. (5): O of one chunk from its start state block s and u (fp32, or v of linear attention). Diagonal scales
    go on the fp32 side of each dot so that q and k enter the tensor cores unrounded."""
    mask = _chunk_mask(doc, cfg.chunk_size, strict=False, segmented=cfg.segmented)
    p = _dot(q, k, tb=True, mode=cfg.dots) * _pair_decay(g, g, mask)
    # Q S_0 with `state_dots`: "split" reads the saved start states, bf16 for bf16 inputs, so both methods round S_0.
    return cfg.scale * (from_start[:, None] * _state_dot(q, s, mode=cfg.state_dots) + _dot(p, u, mode=cfg.dots))


def _forward_kernel(q_ref, k_ref, v_ref, beta_ref, t_ref, g_ref, doc_ref, scalar_refs, h0_ref, o_ref, final_ref,
                    *saved_refs, cfg: Config, nt: int):
    """`cfg.output_method` "fused": the output inside the pass. saved_refs: none (forward only), or every chunk's
    start state, and with `cfg.grads_from_passes` u (fp32, or its bf16 hi and lo halves: `_save_u`). scalar_refs:
    see `_pass_scalar_inputs`."""
    C = cfg.chunk_size
    states_refs, u_refs = _split_saved(cfg, saved_refs) if saved_refs else ((), ())

    def chunk(i, stored, s):
        """s: the state block at the start of chunk i; returns the one at its end."""
        rows = pl.ds(pl.multiple_of(i * C, C), C)
        if states_refs:
            _save_state(states_refs, i, s)
        k, g = k_ref[rows, :], _gates(g_ref, rows)
        scalars = stored if stored is not None else _chunk_scalars(g, *(ref[rows] for ref in scalar_refs))
        u, s_end = _chunk_step(cfg, k_ref, v_ref, beta_ref, t_ref, rows, k, scalars, s)
        if cfg.delta:
            _save_u(u_refs, rows, u)
        o_ref[rows, :] = _output(cfg, q_ref[rows, :], k, g, doc_ref[rows], scalars[0], s, u).astype(o_ref.dtype)
        return s_end

    final_ref[...] = _pass_loop(cfg, nt, scalar_refs, chunk, h0_ref[...])


def _state_kernel(k_ref, v_ref, beta_ref, t_ref, scalar_refs, h0_ref, final_ref, *saved_refs, cfg: Config,
                  nt: int):
    """`cfg.output_method` "split": the pass carries only the state, (3), (4) and (6); writes every chunk's start
    state and u (delta rule) for `_output_kernel`, which does (5) chunk-parallel. The dependency chain of a step is
    then K S_0, T (beta y) and K_end^T u alone, with nothing else for the program to issue between them. T is
    read as fp32 or as its bf16 pair (`Config.pass_inverse_storage`)."""
    C = cfg.chunk_size
    states_refs, u_refs = _split_saved(cfg, saved_refs)

    def chunk(i, stored, s):
        rows = pl.ds(pl.multiple_of(i * C, C), C)
        _save_state(states_refs, i, s)
        if stored is None:
            g_ref, carry_ref, tail_ref = scalar_refs
            stored = _chunk_scalars(_gates(g_ref, rows), carry_ref[rows], tail_ref[rows])
        u, s_end = _chunk_step(cfg, k_ref, v_ref, beta_ref, t_ref, rows, k_ref[rows, :], stored, s)
        _save_u(u_refs, rows, u)
        return s_end

    final_ref[...] = _pass_loop(cfg, nt, scalar_refs, chunk, h0_ref[...])


def _save_u(u_refs, rows, u):
    """u of one chunk into the pass's u output: none, fp32, or its bf16 (hi, lo) halves (two refs)."""
    if len(u_refs) == 1:
        u_refs[0][rows, :] = u
    elif u_refs:
        u_refs[0][rows, :], u_refs[1][rows, :] = _split_bf16(u)


def _output_kernel(q_ref, k_ref, *refs, cfg: Config):
    """Eq. (5) for one chunk and V block, from the start state and u written by `_state_kernel` (fp32, or its bf16
    halves, summed here). refs: u's, then g, doc, carry, the start state (one ref, or two: `_split_saved`) and o."""
    n_state = _saved_arrays(cfg)
    *u_refs, g_ref, doc_ref, carry_ref = refs[:-1 - n_state]
    g = _gates(g_ref)
    from_start = carry_ref[...] * jnp.exp(g[0] + g[1])
    u = sum(ref[...].astype(F32) for ref in u_refs)
    s0, o_ref = _saved_tile(refs[-1 - n_state:-1]), refs[-1]
    o = _output(cfg, q_ref[...], k_ref[...], g, doc_ref[...], from_start, s0, u)
    o_ref[...] = o.astype(o_ref.dtype)


def _pass_stages(cfg):
    return cfg.pass_stages or cfg.stages


def _saves_u_dx(cfg):
    """The passes save u and dx for the gradient kernels (delta rule, `cfg.grads_from_passes`)."""
    return cfg.delta and cfg.grads_from_passes


def _state_dtype(cfg):
    return {"bf16": BF16, "fp16": F16}.get(cfg.state_storage, F32)


def _state_outputs(cfg, sp, shape):
    """(BlockSpecs, shapes) of a pass's saved states (every chunk's start state or end-state cotangent), `shape`
    (B, Hv, nt * K, V): one array, or for "fp16" storage also the factors (B, Hv, nt, V) (`_save_state`)."""
    specs, shapes = [sp["states"]], [jax.ShapeDtypeStruct(shape, _state_dtype(cfg))]
    if cfg.state_storage == "fp16":
        B, Hv, _, V = shape
        specs.append(sp["state_factors"])
        shapes.append(jax.ShapeDtypeStruct((B, Hv, sp["state_factors"].block_shape[2], V), F32))
    return specs, shapes


def _saved_arrays(cfg):
    """How many arrays hold one set of saved states: 1, or 2 for "fp16" storage (the tiles, their factors)."""
    return 2 if cfg.state_storage == "fp16" else 1


def _split_saved(cfg, refs):
    """(a pass's saved-state refs or outputs, the rest), the first `_saved_arrays(cfg)` of `refs` being the states."""
    n = _saved_arrays(cfg)
    return refs[:n], refs[n:]


def _save_state(refs, i, s):
    """Chunk i's state block s (K x BV, fp32) into a pass's saved states (`_split_saved`): in their dtype, or for
    "fp16" storage scaled by a power of two into fp16's range and rounded, as an "fp16" product of the tile does it
    (`common.fp16_scaled`), with the factor that scales it back written to each of its columns."""
    K, BV = s.shape
    rows = pl.ds(pl.multiple_of(i * K, K), K)
    if len(refs) == 1:
        refs[0][rows, :] = s.astype(refs[0].dtype)
        return
    scaled, factor = fp16_scaled(s)
    refs[0][rows, :] = scaled.astype(F16)
    refs[1][pl.ds(i, 1), :] = jnp.full((1, BV), factor, F32)


def _saved_tile(refs, cols=slice(None), *, shared=False):
    """Columns `cols` of one chunk's saved state as `_state_dot` takes it: the array, or for "fp16" storage (two
    refs) the fp16 tile and its factor: a row of per-column factors, or with `shared` (all columns inside one of the
    passes' V blocks, as products contracting over V need) their common value as a scalar."""
    if len(refs) == 1:
        return refs[0][:, cols]
    factors = refs[1][cols]
    return refs[0][:, cols], jnp.max(factors) if shared else factors[None, :]


def _state_inner(a, b):
    """sum(a (.) b) of two saved state tiles as `_saved_tile` loads them (with `shared` factors)."""
    if not isinstance(a, tuple):
        return jnp.sum(a.astype(F32) * b.astype(F32))
    return jnp.sum(a[0].astype(F32) * b[0].astype(F32)) * (a[1] * b[1])


def _state_dot(a, state, *, mode, ta=False, tb=False):
    """`_dot(a, state)` for a state block as the passes hold it (fp32) or as `_saved_tile` loads it. An fp16 tile
    with its factor gives what mode "fp16" gives for the fp32 block it was saved from: against fp16 `a`, one fp16
    product of the tile, scaled back; against fp32 `a`, both rounded to bf16 (where fp32 meets fp32, "fp16" is
    "bf16")."""
    if not isinstance(state, tuple):
        return _dot(a, state, ta=ta, tb=tb, mode=mode)
    tile, factor = state
    if a.dtype != F16:
        a, tile = a.astype(BF16), tile.astype(BF16)
    return _dot(a, tile, ta=ta, tb=tb) * factor


def _forward_pass(cfg, q, k, v, beta, t, g, doc, carry, tail, h0, *, with_states, u_pair=False):
    """(o, final state), and `with_states` every chunk's start state and (`_saves_u_dx`) u: fp32, or with `u_pair`
    its bf16 (hi, lo) halves as a tuple of two arrays."""
    if cfg.output_method == "split":
        final, starts, u = _state_pass(cfg, k, v, beta, t, g, carry, tail, h0, u_pair=u_pair)
        o = _output_pass(cfg, q, k, v if u is None else u, g, doc, carry, starts, v.dtype)
        if not with_states:
            return o, final
        return (o, final, starts, u) if _saves_u_dx(cfg) else (o, final, starts)
    if cfg.output_method != "fused":
        raise ValueError(f"output_method must be one of {OUTPUT_METHODS}, got {cfg.output_method!r}")
    B, Tp, H, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    BV = min(cfg.block_v, V)
    nt = Tp // cfg.chunk_size
    sp = _sequence_specs(cfg, Tp, K, BV, pair=t.ndim == 5)
    out_shape = [jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), jax.ShapeDtypeStruct((B, Hv, K, V), F32)]
    out_specs = [sp["value"], sp["state"]]
    if with_states:
        state_specs, state_shapes = _state_outputs(cfg, sp, (B, Hv, nt * K, V))
        out_shape += state_shapes
        out_specs += state_specs
        if _saves_u_dx(cfg):
            out_shape += _u_shapes(u_pair, (B, Tp, Hv, V))
            out_specs += [sp["value"]] * (1 + u_pair)
    scalars, scalar_specs = _pass_scalar_inputs(cfg, sp, g, carry, tail, gates=False)
    o, final, *saved = pl.pallas_call(
        functools.partial(_forward_kernel, cfg=cfg, nt=nt),
        grid=(V // BV, B * Hv),
        in_specs=[sp["key"], sp["key"], sp["value"], sp["gate"], sp["inverse"], sp["gates"], sp["seq"],
                  scalar_specs, sp["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg.warps, _pass_stages(cfg)),
        interpret=cfg.interpret,
        name="wy_forward",
    )(q, k, v, beta, t, g, doc, scalars, h0)
    if not saved:
        return o, final
    starts, u = _grouped_states(cfg, saved)
    u = _grouped_u(u)
    return (o, final, starts) if u is None else (o, final, starts, u)


def _pass_layout(cfg, t, B, Tp, K, Hv, V):
    """BV, chunks, BlockSpecs (`_sequence_specs`, T as `t` is stored) and the first two outputs of the state pass
    and the reverse pass: one state block (final state, dL/d(initial state)) and every chunk's (start states,
    end-state cotangents)."""
    BV = min(cfg.block_v, V)
    nt = Tp // cfg.chunk_size
    sp = _sequence_specs(cfg, Tp, K, BV, pair=t.ndim == 5)
    state_specs, state_shapes = _state_outputs(cfg, sp, (B, Hv, nt * K, V))
    return BV, nt, sp, [sp["state"], *state_specs], [jax.ShapeDtypeStruct((B, Hv, K, V), F32), *state_shapes]


def _u_shapes(pair, shape):
    """The pass outputs that save u (or dx): fp32, or with `pair` its bf16 hi and lo halves."""
    return [jax.ShapeDtypeStruct(shape, dtype) for dtype in ((BF16, BF16) if pair else (F32,))]


def _grouped_u(outputs):
    """The u outputs of a pass as one value: None, the fp32 array, or a tuple of its halves."""
    return tuple(outputs) if len(outputs) == 2 else outputs[0] if outputs else None


def _state_arrays(states):
    """The arrays of one set of saved states as `_grouped_states` groups them: (array,) or (tiles, factors)."""
    return states if isinstance(states, tuple) else (states,)


def _grouped_states(cfg, outputs):
    """(saved states, the outputs after them) from a pass's outputs after its state block: the saved states as one
    value, the array or for "fp16" storage the tuple (tiles, factors)."""
    states, rest = _split_saved(cfg, list(outputs))
    return (states[0] if len(states) == 1 else tuple(states)), rest


def _state_pass(cfg, k, v, beta, t, g, carry, tail, h0, *, u_pair=False):
    """The sequential pass of "split": (final state, every chunk's start state (`_grouped_states`), u: None (linear
    attention), fp32, or with `u_pair` its bf16 hi and lo halves as a tuple)."""
    B, Tp, H, K = k.shape
    Hv, V = v.shape[2], v.shape[3]
    BV, nt, sp, out_specs, out_shape = _pass_layout(cfg, t, B, Tp, K, Hv, V)
    if cfg.delta:
        out_specs += [sp["value"]] * (1 + u_pair)
        out_shape += _u_shapes(u_pair, (B, Tp, Hv, V))
    scalars, scalar_specs = _pass_scalar_inputs(cfg, sp, g, carry, tail)
    final, *saved = pl.pallas_call(
        functools.partial(_state_kernel, cfg=cfg, nt=nt),
        grid=(V // BV, B * Hv),
        in_specs=[sp["key"], sp["value"], sp["gate"], sp["inverse"], scalar_specs, sp["state"]],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg.warps, _pass_stages(cfg)),
        interpret=cfg.interpret,
        name="wy_states",
    )(k, v, beta, t, scalars, h0)
    starts, u = _grouped_states(cfg, saved)
    return final, starts, _grouped_u(u)


def _value_block_specs(cfg, K, BV, Hv, H):
    """BlockSpecs of a chunk-parallel kernel over V blocks, grid (V/BV, chunks, B*Hv): one chunk's q or k at its key
    head, its V block of a per-value-head array, its gates [hi, lo] and a per-sequence row (doc, carry)."""
    C, G = cfg.chunk_size, Hv // H
    return types.SimpleNamespace(
        key=pl.BlockSpec((None, C, None, K), lambda j, i, bh: (bh // Hv, i, (bh % Hv) // G, 0)),
        value=pl.BlockSpec((None, C, None, BV), lambda j, i, bh: (bh // Hv, i, bh % Hv, j)),
        gates=pl.BlockSpec((2, None, C, None), lambda j, i, bh: (0, bh // Hv, i, bh % Hv)),
        seq=pl.BlockSpec((None, C), lambda j, i, bh: (bh // Hv, i)))


def _output_pass(cfg, q, k, u, g, doc, carry, starts, out_dtype):
    """O of every chunk, chunk-parallel: grid (V/BV, chunks, B*Hv) with BV = `cfg.output_block_v`. u: fp32, v (linear
    attention), or a tuple of u's bf16 halves; `starts` as `_state_pass` returns them."""
    u = u if isinstance(u, tuple) else (u,)
    starts = _state_arrays(starts)
    B, Tp, H, K = q.shape
    Hv, V = u[0].shape[2], u[0].shape[3]
    BV = min(cfg.output_block_v, V)
    sp = _value_block_specs(cfg, K, BV, Hv, H)
    state_specs = [pl.BlockSpec((None, None, K, BV), lambda j, i, bh: (bh // Hv, bh % Hv, i, j)),
                   pl.BlockSpec((None, None, None, BV), lambda j, i, bh: (bh // Hv, bh % Hv, i, j))]
    return _chunk_parallel_call(
        functools.partial(_output_kernel, cfg=cfg),
        grid=(V // BV, Tp // cfg.chunk_size, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[sp.key, sp.key, *[sp.value] * len(u), sp.gates, sp.seq, sp.seq, *state_specs[:len(starts)]],
        out_specs=sp.value,
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hv, V), out_dtype),
        compiler_params=_params(cfg.output_warps, cfg.stages),
        interpret=cfg.interpret,
        name="wy_output",
    )(q, k, *u, g, doc, carry, *starts)


# ---------------------------------------------------------------------------------------------------------------
# Backward: the reverse state pass, then the chunk-parallel gradients
# ---------------------------------------------------------------------------------------------------------------


def _reverse_scores_kernel(q_ref, k_ref, g_ref, doc_ref, do_ref, out_ref, *, cfg: Config):
    """`Config.reverse_scores="stored"`: scale P^T dO of one chunk and V block, P = (Q K^T) (.) exp(G_t - G_s)
    [t >= s, same document], with the same products as the reverse pass forms it inline (`_reverse_scores`)."""
    out_ref[...] = _reverse_scores(cfg, q_ref[...], k_ref[...], _gates(g_ref), doc_ref[...], do_ref[...])


def _reverse_scores(cfg, q, k, g, doc, do):
    """scale P^T dO: dL/du of eq. (5) through the in-chunk scores, which no state enters."""
    mask = _chunk_mask(doc, cfg.chunk_size, strict=False, segmented=cfg.segmented)
    p = _dot(q, k, tb=True, mode=cfg.grad_dots) * _pair_decay(g, g, mask)
    return cfg.scale * _dot(p, do, ta=True, mode=cfg.grad_dots)


def _reverse_scores_pass(cfg, q, k, g, doc, do):
    """scale P^T dO of every chunk (B, Tp, Hv, V) fp32, chunk-parallel: grid (V/BV, chunks, B*Hv), BV =
    `cfg.output_block_v` (P is formed again in each V block)."""
    B, Tp, H, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    BV = min(cfg.output_block_v, V)
    sp = _value_block_specs(cfg, K, BV, Hv, H)
    return _chunk_parallel_call(
        functools.partial(_reverse_scores_kernel, cfg=cfg),
        grid=(V // BV, Tp // cfg.chunk_size, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=[sp.key, sp.key, sp.gates, sp.seq, sp.value],
        out_specs=sp.value,
        out_shape=jax.ShapeDtypeStruct((B, Tp, Hv, V), F32),
        compiler_params=_params(cfg.output_warps, cfg.stages),
        interpret=cfg.interpret,
        name="wy_reverse_scores",
    )(q, k, g, doc, do)


def _reverse_kernel(q_ref, k_ref, beta_ref, t_ref, g_ref, doc_ref, scalar_refs, do_ref, dfinal_ref, score_refs,
                    dh0_ref, *saved_refs, cfg: Config, nt: int):
    """scalar_refs: see `_pass_scalar_inputs`; score_refs: () or (with `reverse_scores="stored"`) the V block of
    `_reverse_scores_pass`'s output."""
    C = cfg.chunk_size
    dends_refs, dx_ref = _split_saved(cfg, saved_refs)

    def chunk(i, stored, ds):
        """ds: dL/d(state at the end of chunk i); returns dL/d(state at its start)."""
        rows = pl.ds(pl.multiple_of(i * C, C), C)
        _save_state(dends_refs, i, ds)
        q, k = q_ref[rows, :], k_ref[rows, :]
        if stored is None:
            stored = _chunk_scalars(_gates(g_ref, rows), *(ref[rows] for ref in scalar_refs))
        from_start, to_end, survive = stored
        do = do_ref[rows, :]
        ds_start = survive * ds + cfg.scale * _dot(q, from_start[:, None] * do.astype(F32), ta=True,
                                                   mode=cfg.state_dots)
        if cfg.delta:
            if score_refs:
                scores = score_refs[0][rows, :]
            else:
                scores = _reverse_scores(cfg, q, k, _gates(g_ref, rows), doc_ref[rows], do)
            du = scores + to_end[:, None] * _dot(k, ds, mode=cfg.state_dots)
            dx = _inverse_dot(t_ref, rows, du, cfg, ta=True)  # dL/d(beta y) of eq. (4)
            if len(dx_ref) == 1:
                dx_ref[0][rows, :] = dx
            elif dx_ref:  # as its bf16 (hi, lo) pair
                dx_ref[0][rows, :], dx_ref[1][rows, :] = _split_bf16(dx)
            dks = -(beta_ref[rows] * from_start)[:, None] * dx  # dL/d(K S_0) of eq. (3)
            ds_start = ds_start + _dot(k, dks, ta=True, mode=cfg.grad_dots)
        return ds_start

    dh0_ref[...] = _pass_loop(cfg, nt, scalar_refs, chunk, dfinal_ref[...], reverse=True)


def _reverse_pass(cfg, q, k, beta, t, g, doc, carry, tail, do, dfinal, *, dx_pair=False):
    """(dL/d(initial state), every chunk's end-state cotangent (as `_grouped_states` groups saved states)) and, where
    the gradient kernels read it (`_saves_u_dx`), dx = dL/d(beta y): fp32, or with `dx_pair` its bf16 (hi, lo)
    halves as two arrays."""
    B, Tp, H, K = q.shape
    Hv, V = do.shape[2], do.shape[3]
    BV, nt, sp, out_specs, out_shape = _pass_layout(cfg, t, B, Tp, K, Hv, V)
    if _saves_u_dx(cfg):
        out_specs += [sp["value"]] * (1 + dx_pair)
        out_shape += _u_shapes(dx_pair, (B, Tp, Hv, V))
    scalars, scalar_specs = _pass_scalar_inputs(cfg, sp, g, carry, tail, gates=False)
    stored = cfg.delta and cfg.reverse_scores == "stored"
    scores = (_reverse_scores_pass(cfg, q, k, g, doc, do),) if stored else ()
    dh0, *saved = pl.pallas_call(
        functools.partial(_reverse_kernel, cfg=cfg, nt=nt),
        grid=(V // BV, B * Hv),
        in_specs=[sp["key"], sp["key"], sp["gate"], sp["inverse"], sp["gates"], sp["seq"], scalar_specs,
                  sp["value"], sp["state"], (sp["value"],) if stored else ()],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg.warps, _pass_stages(cfg)),
        interpret=cfg.interpret,
        name="wy_reverse",
    )(q, k, beta, t, g, doc, scalars, do, dfinal, scores)
    dends, dx = _grouped_states(cfg, saved)
    return (dh0, dends, *dx)


def _grad_kernel(q_ref, k_ref, v_ref, beta_ref, t_ref, g_ref, doc_ref, carry_ref, tail_ref, s0_ref, dend_ref,
                 do_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dlog_ref, *, cfg: Config):
    """All gradients of one chunk ("fused"): a loop over V blocks accumulates the V-contractions, then the C x C terms.

    Grid (K/BK, chunks, B*Hv). With BK < K every K block recomputes the V-local terms; its dq and dk columns are its
    own, and its block 0 alone writes dv, dbeta and the K-independent part of d(log_decay) (dbeta and d(log_decay)
    are written per K block and summed in XLA).
    """
    C = cfg.chunk_size
    K, V = k_ref.shape[-1], v_ref.shape[-1]
    BV = min(cfg.grad_block_v, V)
    BK = dq_ref.shape[-1]
    whole = BK == K
    first = pl.program_id(0) == 0
    kcols = pl.ds(pl.multiple_of(pl.program_id(0) * BK, BK), BK)
    mode = cfg.grad_dots
    q, k, g = q_ref[...], k_ref[...], _gates(g_ref)
    from_start, to_end, survive = _chunk_scalars(g, carry_ref[...], tail_ref[...])
    doc = doc_ref[...]
    mask = _chunk_mask(doc, C, strict=False, segmented=cfg.segmented)
    strict = _chunk_mask(doc, C, strict=True, segmented=cfg.segmented)
    decay = _pair_decay(g, g, mask)
    qk = _dot(q, k, tb=True, mode=mode)
    p = qk * decay
    beta = beta_ref[...]
    whole_chunk = slice(None)

    def write_dv(cols, value):
        if whole:
            dv_ref[:, cols] = value.astype(dv_ref.dtype)
        else:
            @pl.when(first)
            def _():
                dv_ref[:, cols] = value.astype(dv_ref.dtype)

    def v_block(j, acc):
        dq_acc, dk_acc, dp_acc, da_acc, dbeta_acc, dg_acc, end_acc, survive_acc = acc
        cols = pl.ds(pl.multiple_of(j * BV, BV), BV)
        s0, dend, do = s0_ref[:, cols], dend_ref[:, cols], do_ref[:, cols]
        s0_k, dend_k = (s0, dend) if whole else (s0_ref[kcols, cols], dend_ref[kcols, cols])  # this K block's rows
        kd = _dot(k, dend, mode=mode)  # K dS_end
        du = cfg.scale * _dot(p, do, ta=True, mode=mode) + to_end[:, None] * kd
        u = v_ref[:, cols].astype(F32)
        if cfg.delta:
            ks = _dot(k, s0, mode=mode)
            y = u - from_start[:, None] * ks
            u = _inverse_dot(t_ref, whole_chunk, beta[:, None] * y, cfg)
            dx = _inverse_dot(t_ref, whole_chunk, du, cfg, ta=True)
            write_dv(cols, beta[:, None] * dx)
            dks = -(beta * from_start)[:, None] * dx
            da_acc = da_acc - _dot(dx, u, tb=True, mode=mode)  # dA = -T^T du (T beta y)^T
            dbeta_acc = dbeta_acc + jnp.sum(dx * y, axis=1)
            dg_acc = dg_acc + jnp.sum(dks * ks, axis=1)  # through carry exp(G) in eq. (3)
            dk_acc = dk_acc + _dot(dks, s0_k, tb=True, mode=mode)
        else:
            write_dv(cols, du)
        dp_acc = dp_acc + _dot(do, u, tb=True, mode=mode)
        dk_acc = dk_acc + _dot(to_end[:, None] * u, dend_k, tb=True, mode=mode)
        end_acc = end_acc + to_end * jnp.sum(u * kd, axis=1)  # e_i = dL/d log(token i's end factor)
        dq_acc = dq_acc + _dot(do, s0_k, tb=True, mode=mode)
        survive_acc = survive_acc + jnp.sum(s0_k * dend_k)
        return dq_acc, dk_acc, dp_acc, da_acc, dbeta_acc, dg_acc, end_acc, survive_acc

    zeros = lambda *shape: jnp.zeros(shape, F32)
    acc = (zeros(C, BK), zeros(C, BK), zeros(C, C), zeros(C, C), zeros(C), zeros(C), zeros(C), jnp.float32(0.0))
    dq_acc, dk_acc, dp_acc, da_acc, dbeta_acc, dg, end_acc, survive_acc = lax.fori_loop(0, V // BV, v_block, acc)

    q_k, k_k = (q, k) if whole else (q_ref[:, kcols], k_ref[:, kcols])
    dq_state = cfg.scale * from_start[:, None] * dq_acc
    dp = cfg.scale * dp_acc * decay  # dL/d(Q K^T) of eq. (5)
    dq = dq_state + _dot(dp, k_k, mode=mode)
    dk = dk_acc + _dot(dp, q_k, ta=True, mode=mode)
    z = jnp.where(strict, dp * qk, 0.0)
    shared = dg + jnp.sum(z, axis=1) - jnp.sum(z, axis=0)  # the K-independent terms of dL/dG
    if cfg.delta:
        decay_strict = jnp.where(strict, decay, 0.0)
        kk = _dot(k, k, tb=True, mode=mode)
        da = jnp.where(strict, da_acc, 0.0)
        dbeta = dbeta_acc + jnp.sum(da * kk * decay_strict, axis=1)
        dbeta_ref[...] = dbeta if whole else jnp.where(first, dbeta, 0.0)
        da_k = da * decay_strict * beta[:, None]  # dL/d(k_t . k_s)
        dk = dk + _dot(da_k, k_k, mode=mode) + _dot(da_k, k_k, ta=True, mode=mode)
        za = da_k * kk  # dA (.) A
        shared = shared + jnp.sum(za, axis=1) - jnp.sum(za, axis=0)
    dlog_ref[...] = _dlog(jnp.sum(dq_state * q_k.astype(F32), axis=1), shared, end_acc, survive * survive_acc,
                          None if whole else first)
    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)


def _dlog(local, shared, end, survive_term, first):
    """d(log_decay) per token from dL/dG's terms: `local` + `shared` (summed from each position on), the end terms.

    Gate gradient, written per token as d(log_decay) (the in-chunk reverse cumsum of dL/dG), never as dL/dG.
    The end factor exp(G_C - G_i) of token i adds -e_i at G_i and +e_i at G_C: summed over positions >= t that
    is e_i for i < t and an exact 0 otherwise, so it enters as an exclusive prefix sum. Through dL/dG it would be
    a large +e_i and -e_i cancelling in fp32 (e_i is O(1) for the tokens before zero-decay padding, while the
    true gradient can be e^-20-small). Diagonal pairs (exp(0) = 1 exactly) depend on no gate and are left out.
    With `first` (a traced bool: this program is K block 0 of several), `shared` and the end terms count only
    there; `local` and `survive_term` are this K block's share.
    """
    if first is not None:
        shared = jnp.where(first, shared, 0.0)
        end = jnp.where(first, end, 0.0)
    local = local + shared
    C = local.shape[0]
    row, col = _iota2(C, C, 0), _iota2(C, C, 1)
    from_here = jnp.sum(jnp.where(col >= row, local[None, :], 0.0), axis=1)
    ended_before = jnp.sum(jnp.where(col < row, end[None, :], 0.0), axis=1)
    return from_here + ended_before + survive_term


def _grad_v_kernel(q_ref, k_ref, v_ref, beta_ref, t_ref, g_ref, doc_ref, carry_ref, tail_ref, s0_ref, dend_ref,
                   do_ref, dv_ref, dp_ref, end_ref, *delta_refs, cfg: Config):
    """"staged", part 1: one chunk and one V block, grid (V/BV, chunks, B*Hv); no loop, no accumulator.

    The terms whose contractions run over K or C: du, u, dx and dv; and the V block's shares of the V-contractions
    that end in C x C or per-token values (dO u^T, dx u^T, the dbeta, dG and end sums), written per V block.
    Delta rule: also u and dx (fp32) for part 2.
    """
    C = cfg.chunk_size
    mode = cfg.grad_dots
    q, k, g = q_ref[...], k_ref[...], _gates(g_ref)
    from_start, to_end, _ = _chunk_scalars(g, carry_ref[...], tail_ref[...])
    mask = _chunk_mask(doc_ref[...], C, strict=False, segmented=cfg.segmented)
    p = _dot(q, k, tb=True, mode=mode) * _pair_decay(g, g, mask)
    do = do_ref[...]
    kd = _dot(k, dend_ref[...], mode=cfg.state_dots)  # K dS_end
    du = cfg.scale * _dot(p, do, ta=True, mode=mode) + to_end[:, None] * kd
    u = v_ref[...].astype(F32)
    if cfg.delta:
        u_ref, dx_ref, da_ref, dbeta_ref, dg_ref = delta_refs
        beta = beta_ref[...]
        ks = _dot(k, s0_ref[...], mode=cfg.state_dots)
        y = u - from_start[:, None] * ks
        u = _inverse_dot(t_ref, slice(None), beta[:, None] * y, cfg)
        dx = _inverse_dot(t_ref, slice(None), du, cfg, ta=True)
        dv_ref[...] = (beta[:, None] * dx).astype(dv_ref.dtype)
        u_ref[...] = u
        dx_ref[...] = dx
        da_ref[...] = -_dot(dx, u, tb=True, mode=mode)  # dA = -T^T du (T beta y)^T
        dbeta_ref[...] = jnp.sum(dx * y, axis=1)
        dks = -(beta * from_start)[:, None] * dx
        dg_ref[...] = jnp.sum(dks * ks, axis=1)  # through carry exp(G) in eq. (3)
    else:
        dv_ref[...] = du.astype(dv_ref.dtype)
    dp_ref[...] = _dot(do, u, tb=True, mode=mode)
    end_ref[...] = to_end * jnp.sum(u * kd, axis=1)  # e_i = dL/d log(token i's end factor)


def _grad_v_saved_kernel(k_ref, v_ref, beta_ref, g_ref, carry_ref, tail_ref, s0_ref, dend_ref, do_ref, u_ref,
                         dx_ref, dv_ref, dp_ref, end_ref, da_ref, dbeta_ref, dg_ref, *, cfg: Config):
    """"staged", part 1 with `cfg.grads_from_passes` (delta rule): `_grad_v_kernel` with u and dx read from the
    passes, which computed them from the fp32 state in registers. No P, du or product with T is formed here;
    K S_0 and K dS_end remain (y, the dG and end sums)."""
    mode = cfg.grad_dots
    from_start, to_end, _ = _chunk_scalars(_gates(g_ref), carry_ref[...], tail_ref[...])
    k, beta, u, dx = k_ref[...], beta_ref[...], u_ref[...], dx_ref[...]
    ks = _dot(k, s0_ref[...], mode=cfg.state_dots)
    kd = _dot(k, dend_ref[...], mode=cfg.state_dots)
    y = v_ref[...].astype(F32) - from_start[:, None] * ks
    dv_ref[...] = (beta[:, None] * dx).astype(dv_ref.dtype)
    da_ref[...] = -_dot(dx, u, tb=True, mode=mode)  # dA = -T^T du (T beta y)^T
    dbeta_ref[...] = jnp.sum(dx * y, axis=1)
    dg_ref[...] = jnp.sum(-(beta * from_start)[:, None] * dx * ks, axis=1)  # through carry exp(G) in eq. (3)
    dp_ref[...] = _dot(do_ref[...], u, tb=True, mode=mode)
    end_ref[...] = to_end * jnp.sum(u * kd, axis=1)  # e_i = dL/d log(token i's end factor)


def _grad_k_kernel(q_ref, k_ref, u_ref, beta_ref, g_ref, doc_ref, carry_ref, tail_ref, s0_ref, dend_ref, do_ref,
                   dp_ref, end_ref, *refs, cfg: Config, nv: int):
    """"staged", part 2: one chunk and one K block of dq and dk, grid (K/BK, chunks, B*Hv).

    A loop over V blocks accumulates the state terms of dq and dk (C x BK); then the C x C terms from part 1's
    partial products. `u_ref` is u from part 1 (delta rule) or v. Every K block writes its share of d(log_decay);
    block 0 alone adds the K-independent terms and writes dbeta (both summed over K blocks in XLA).
    """
    if cfg.delta:
        dx_ref, da_ref, dbeta_part_ref, dg_ref, dq_ref, dk_ref, dbeta_ref, dlog_ref = refs
    else:
        dq_ref, dk_ref, dlog_ref = refs
    C = cfg.chunk_size
    V = do_ref.shape[-1]
    BV = min(cfg.grad_block_v, V)
    BK = dq_ref.shape[-1]
    first = pl.program_id(0) == 0
    kcols = pl.ds(pl.multiple_of(pl.program_id(0) * BK, BK), BK)
    # The products with S_0, dS_end and dA come after every product with T, whose entries grow large for
    # correlated keys with beta near 2: rounding their operands to bf16 is not amplified by T (errors of the
    # choices: docs/kernels.md). The dO u^T partials (dp) are not among them: with bf16 operands dq failed.
    late = cfg.grad_k_dots
    g = _gates(g_ref)
    from_start, to_end, survive = _chunk_scalars(g, carry_ref[...], tail_ref[...])
    beta = beta_ref[...]

    def v_block(j, acc):
        dq_acc, dk_acc, survive_acc = acc
        cols = pl.ds(pl.multiple_of(j * BV, BV), BV)
        s0, dend, do = s0_ref[:, cols], dend_ref[:, cols], do_ref[:, cols]  # s0, dend: this K block's rows
        if cfg.delta:
            dks = -(beta * from_start)[:, None] * dx_ref[:, cols]
            dk_acc = dk_acc + _dot(dks, s0, tb=True, mode=late)
        dk_acc = dk_acc + _dot(to_end[:, None] * u_ref[:, cols].astype(F32), dend, tb=True, mode=late)
        dq_acc = dq_acc + _dot(do, s0, tb=True, mode=late)
        survive_acc = survive_acc + jnp.sum(s0.astype(F32) * dend.astype(F32))
        return dq_acc, dk_acc, survive_acc

    acc = (jnp.zeros((C, BK), F32), jnp.zeros((C, BK), F32), jnp.float32(0.0))
    dq_acc, dk_acc, survive_acc = lax.fori_loop(0, V // BV, v_block, acc)

    parts = lambda ref: functools.reduce(lambda a, b: a + b, [ref[:, pl.ds(j * C, C)] for j in range(nv)])
    sums = dict(dp=parts(dp_ref), end=end_ref[...], survive=survive * survive_acc)
    if cfg.delta:
        sums.update(da=parts(da_ref), dbeta=dbeta_part_ref[...], dg=dg_ref[...])
    _pair_terms(cfg, q_ref, k_ref, g, doc_ref[...], beta, from_start, dq_acc, dk_acc, sums, first, kcols,
                dq_ref, dk_ref, dbeta_ref if cfg.delta else None, dlog_ref)


def _pair_products(cfg, q, k, g, doc, beta, sums):
    """The C x C gradients of one chunk from the V-contractions summed over every V block (`sums`: dp = dO u^T,
    and for the delta rule da = dx u^T, dbeta and dg, the per-token terms of the V loop): dp = dL/d(Q K^T) with its
    decay, da_k = dL/d(k_t . k_s) (delta rule, else None), the K-independent terms of dL/dG and dbeta (or None)."""
    C = cfg.chunk_size
    mode = cfg.grad_dots
    mask = _chunk_mask(doc, C, strict=False, segmented=cfg.segmented)
    strict = _chunk_mask(doc, C, strict=True, segmented=cfg.segmented)
    decay = _pair_decay(g, g, mask)
    dp = cfg.scale * sums["dp"] * decay  # dL/d(Q K^T) of eq. (5)
    z = jnp.where(strict, dp * _dot(q, k, tb=True, mode=mode), 0.0)
    shared = jnp.sum(z, axis=1) - jnp.sum(z, axis=0)  # the K-independent terms of dL/dG
    if not cfg.delta:
        return dp, None, shared, None
    decay_strict = jnp.where(strict, decay, 0.0)
    kk = _dot(k, k, tb=True, mode=mode)
    da = jnp.where(strict, sums["da"], 0.0)
    dbeta = sums["dbeta"] + jnp.sum(da * kk * decay_strict, axis=1)
    da_k = da * decay_strict * beta[:, None]  # dL/d(k_t . k_s)
    za = da_k * kk  # dA (.) A
    return dp, da_k, sums["dg"] + shared + jnp.sum(za, axis=1) - jnp.sum(za, axis=0), dbeta


def _dk_pair_terms(cfg, dp, da_k, q_k, k_k):
    """dk's C x C terms for the K columns of q_k, k_k: dp^T Q (+ da_k K + da_k^T K for the delta rule)."""
    dk = _dot(dp, q_k, ta=True, mode=cfg.grad_dots)
    if da_k is not None:
        dk = dk + _dot(da_k, k_k, mode=cfg.grad_k_dots) + _dot(da_k, k_k, ta=True, mode=cfg.grad_k_dots)
    return dk


def _pair_terms(cfg, q_ref, k_ref, g, doc, beta, from_start, dq_acc, dk_acc, sums, first, kcols, dq_ref, dk_ref,
                dbeta_ref, dlog_ref):
    """The end of the gradient kernels that write dq and dk after one loop over V blocks: `_pair_products`, then
    dq and dk. `dq_acc`, `dk_acc`: dO S_0^T and dks S_0^T + (e u) dS_end^T (C x BK); `sums` as `_pair_products`
    takes it, with end and survive (the end-factor and state-survival terms of d(log_decay)). K block `kcols`;
    `first` (traced) says whether it is block 0 of several, None when it is all of K."""
    BK = dq_ref.shape[-1]
    q, k = q_ref[...], k_ref[...]
    q_k, k_k = (q, k) if BK == q.shape[-1] else (q_ref[:, kcols], k_ref[:, kcols])
    dp, da_k, shared, dbeta = _pair_products(cfg, q, k, g, doc, beta, sums)
    dq_state = cfg.scale * from_start[:, None] * dq_acc
    dq_ref[...] = (dq_state + _dot(dp, k_k, mode=cfg.grad_dots)).astype(dq_ref.dtype)
    if dbeta is not None:
        dbeta_ref[...] = dbeta if first is None else jnp.where(first, dbeta, 0.0)
    dk_ref[...] = (dk_acc + _dk_pair_terms(cfg, dp, da_k, q_k, k_k)).astype(dk_ref.dtype)
    local = jnp.sum(dq_state * q_k.astype(F32), axis=1)
    dlog_ref[...] = _dlog(local, shared, sums["end"], sums["survive"], first)


def _grad_merged_kernel(q_ref, k_ref, v_ref, beta_ref, g_ref, doc_ref, carry_ref, tail_ref, *refs, cfg: Config):
    """"merged" (delta rule): the two kernels of "staged" with u and dx from the passes, as one, grid (1, chunks,
    B*Hv); dq and dk are whole rows (BK = K). Three loops over the V blocks, so that at most one C x K accumulator
    is live at a time: (1) dv, the per-token sums and the C x C products dO u^T and dx u^T, accumulated in
    registers (no partials through memory); `_pair_products`; (2) dO S_0^T, then dq is written; (3) dk's state
    terms onto its C x C terms. The later loops' loads mostly come from the L2 cache.

    One loop doing all three (every accumulator live at once) was slower (1.31-1.39 against 1.17 ms at
    8x2048x16x128 on the H100) and, as first written, gave dq and d(log_decay) errors of 1.1e-2 to 2.0e-2 there,
    varying from run to run, where the interpreter gave 2.2e-3 on bf16 inputs (docs/kernels.md).

    refs: the start states and the end-state cotangents (one ref each, or two: `_split_saved`), then dO, u, dx and
    the outputs."""
    n_state = _saved_arrays(cfg)
    s0_refs, dend_refs = refs[:n_state], refs[n_state:2 * n_state]
    do_ref, u_ref, dx_ref, dq_ref, dk_ref, dv_ref, dbeta_ref, dlog_ref = refs[2 * n_state:]
    C = cfg.chunk_size
    K, V = k_ref.shape[-1], do_ref.shape[-1]
    BV = min(cfg.grad_block_v, V)
    nv = V // BV
    mode, late = cfg.grad_dots, cfg.grad_k_dots
    g = _gates(g_ref)
    from_start, to_end, survive = _chunk_scalars(g, carry_ref[...], tail_ref[...])
    beta = beta_ref[...]
    k = k_ref[...]
    block = lambda j: pl.ds(pl.multiple_of(j * BV, BV), BV)

    def v_block(j, acc):
        dp_acc, da_acc, dbeta_acc, dg_acc, end_acc, survive_acc = acc
        cols = block(j)
        s0, dend = _saved_tile(s0_refs, cols, shared=True), _saved_tile(dend_refs, cols, shared=True)
        do, u, dx = do_ref[:, cols], u_ref[:, cols], dx_ref[:, cols]
        ks = _state_dot(k, s0, mode=cfg.state_dots)
        kd = _state_dot(k, dend, mode=cfg.state_dots)
        y = v_ref[:, cols].astype(F32) - from_start[:, None] * ks
        dv_ref[:, cols] = (beta[:, None] * dx).astype(dv_ref.dtype)
        dp_acc = dp_acc + _dot(do, u, tb=True, mode=mode)
        da_acc = da_acc - _dot(dx, u, tb=True, mode=mode)  # dA = -T^T du (T beta y)^T
        dbeta_acc = dbeta_acc + jnp.sum(dx * y, axis=1)
        dg_acc = dg_acc - jnp.sum((beta * from_start)[:, None] * dx * ks, axis=1)  # through carry exp(G), eq. (3)
        end_acc = end_acc + to_end * jnp.sum(u * kd, axis=1)  # e_i = dL/d log(token i's end factor)
        survive_acc = survive_acc + _state_inner(s0, dend)
        return dp_acc, da_acc, dbeta_acc, dg_acc, end_acc, survive_acc

    def dk_state_terms(j, dk):
        """dks S_0^T + (e u) dS_end^T of V block j."""
        cols = block(j)
        dks = -(beta * from_start)[:, None] * dx_ref[:, cols]
        s0, dend = _saved_tile(s0_refs, cols, shared=True), _saved_tile(dend_refs, cols, shared=True)
        return (dk + _state_dot(dks, s0, tb=True, mode=late)
                + _state_dot(to_end[:, None] * u_ref[:, cols], dend, tb=True, mode=late))

    zeros = lambda *shape: jnp.zeros(shape, F32)
    acc = (zeros(C, C), zeros(C, C), zeros(C), zeros(C), zeros(C), jnp.float32(0.0))
    dp, da, dbeta, dg, end, survive_acc = lax.fori_loop(0, nv, v_block, acc)
    q = q_ref[...]
    dp, da_k, shared, dbeta = _pair_products(cfg, q, k, g, doc_ref[...], beta, dict(dp=dp, da=da, dbeta=dbeta, dg=dg))
    dbeta_ref[...] = dbeta
    dq_acc = lax.fori_loop(
        0, nv, lambda j, a: a + _state_dot(do_ref[:, block(j)], _saved_tile(s0_refs, block(j), shared=True), tb=True,
                                           mode=late), zeros(C, K))
    dq_state = cfg.scale * from_start[:, None] * dq_acc
    dq_ref[...] = (dq_state + _dot(dp, k, mode=mode)).astype(dq_ref.dtype)
    dlog_ref[...] = _dlog(jnp.sum(dq_state * q.astype(F32), axis=1), shared, end, survive * survive_acc, None)
    dk_ref[...] = lax.fori_loop(0, nv, dk_state_terms, _dk_pair_terms(cfg, dp, da_k, q, k)).astype(dk_ref.dtype)


def _grads(cfg, q, k, v, beta, t, g, doc, carry, tail, starts, dends, do, saved=None):
    """dq, dk (per value head), dv, dbeta and d(log_decay) of every chunk, by `cfg.grad_method`. `t` is T as
    `cfg.inverse_storage` says (fp32, or its bf16 pair from `_inverse(..., pair=True)`; None when
    `_saves_u_dx(cfg)`: then `saved` is (u, dx) from the passes)."""
    pair = cfg.inverse_storage == "split"
    B, Tp, H, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C, G = cfg.chunk_size, Hv // H
    BK, BV = min(cfg.grad_block_k, K), min(cfg.grad_block_v, V)
    nk, nv = K // BK, V // BV
    if cfg.grad_method not in GRAD_METHODS:
        raise ValueError(f"grad_method must be one of {GRAD_METHODS}, got {cfg.grad_method!r}")
    # Grid (blocks, chunks, B*Hv): the blocks of one chunk run side by side and share its inputs in the L2 cache.
    key = lambda j, i, bh: (bh // Hv, i, (bh % Hv) // G, 0)
    key_spec = pl.BlockSpec((None, C, None, K), key)
    gate_spec = pl.BlockSpec((None, C, None), lambda j, i, bh: (bh // Hv, i, bh % Hv))
    gates_spec = pl.BlockSpec((2, None, C, None), lambda j, i, bh: (0, bh // Hv, i, bh % Hv))  # G as (hi, lo)
    seq_spec = pl.BlockSpec((None, C), lambda j, i, bh: (bh // Hv, i))
    # Written per K block (or V block) and summed in XLA.
    block_vector_spec = pl.BlockSpec((None, None, C, None), lambda j, i, bh: (j, bh // Hv, i, bh % Hv))
    block_vector = lambda n: jax.ShapeDtypeStruct((n, B, Tp, Hv), F32)
    k_block_spec = pl.BlockSpec((None, C, None, BK), lambda j, i, bh: (bh // Hv, i, bh % Hv, j))
    # One key head's gradient sums over its G value heads: written per value head (fp32) unless G == 1.
    qk_grad = jax.ShapeDtypeStruct((B, Tp, Hv, K), q.dtype if G == 1 else F32)
    total = lambda x: x[0] if x.shape[0] == 1 else jnp.sum(x, axis=0)

    # Whole rows of a chunk: its V columns, its start state / end-state cotangent (K x V).
    value_spec = pl.BlockSpec((None, C, None, V), lambda j, i, bh: (bh // Hv, i, bh % Hv, 0))
    chunk_state_spec = pl.BlockSpec((None, None, K, V), lambda j, i, bh: (bh // Hv, bh % Hv, i, 0))
    if cfg.grad_method == "fused":
        dq, dk, dv, dbeta, dlog = _chunk_parallel_call(
            functools.partial(_grad_kernel, cfg=cfg),
            grid=(nk, Tp // C, B * Hv),
            grid_order=cfg.grid_order,
            in_specs=[key_spec, key_spec, value_spec, gate_spec,
                      inverse_spec(cfg, lambda j, i, bh: (bh // Hv, i, bh % Hv, 0), pair=pair) if cfg.delta
                      else key_spec,
                      gates_spec, seq_spec, seq_spec, seq_spec, chunk_state_spec, chunk_state_spec, value_spec],
            out_specs=[k_block_spec, k_block_spec, value_spec, block_vector_spec, block_vector_spec],
            out_shape=[qk_grad, qk_grad, jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), block_vector(nk),
                       block_vector(nk)],
            compiler_params=_params(cfg.grad_warps, cfg.stages),
            interpret=cfg.interpret,
            name="wy_grads",
        )(q, k, v, beta, t, g, doc, carry, tail, starts, dends, do)
        return dq, dk, dv, total(dbeta), total(dlog)

    if cfg.grad_method == "merged" and cfg.delta:
        if BK != K:
            raise ValueError(f"grad_method='merged' writes whole rows of dq and dk: grad_block_k must be K = {K}, "
                             f"got {cfg.grad_block_k}")
        states = _state_arrays(starts) + _state_arrays(dends)
        factor_spec = pl.BlockSpec((None, None, None, V), lambda j, i, bh: (bh // Hv, bh % Hv, i, 0))
        state_specs = [chunk_state_spec, factor_spec][:len(states) // 2] * 2
        dq, dk, dv, dbeta, dlog = _chunk_parallel_call(
            functools.partial(_grad_merged_kernel, cfg=cfg),
            grid=(1, Tp // C, B * Hv),
            grid_order=cfg.grid_order,
            in_specs=[key_spec, key_spec, value_spec, gate_spec, gates_spec, seq_spec, seq_spec, seq_spec,
                      *state_specs, value_spec, value_spec, value_spec],
            out_specs=[k_block_spec, k_block_spec, value_spec, block_vector_spec, block_vector_spec],
            out_shape=[qk_grad, qk_grad, jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), block_vector(1),
                       block_vector(1)],
            compiler_params=_params(cfg.grad_k_warps, cfg.stages),
            interpret=cfg.interpret,
            name="wy_grads_merged",
        )(q, k, v, beta, g, doc, carry, tail, *states, do, *saved)
        return dq, dk, dv, dbeta[0], dlog[0]

    # "staged" (and "merged" for linear attention), part 1: grid (V/BV, chunks, B*Hv).
    v_block_spec = pl.BlockSpec((None, C, None, BV), lambda j, i, bh: (bh // Hv, i, bh % Hv, j))
    cc_spec = pl.BlockSpec((None, C, None, C), lambda j, i, bh: (bh // Hv, i, bh % Hv, j))  # V block j's C x C
    cc_parts = jax.ShapeDtypeStruct((B, Tp, Hv, nv * C), F32)
    fp32_value = jax.ShapeDtypeStruct((B, Tp, Hv, V), F32)
    out_specs = [v_block_spec, cc_spec, block_vector_spec]
    out_shape = [jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), cc_parts, block_vector(nv)]
    if cfg.delta:  # u, dx, dA, dbeta and dG partials
        out_specs += [v_block_spec, v_block_spec, cc_spec, block_vector_spec, block_vector_spec]
        out_shape += [fp32_value, fp32_value, cc_parts, block_vector(nv), block_vector(nv)]
    state_v_spec = pl.BlockSpec((None, None, K, BV), lambda j, i, bh: (bh // Hv, bh % Hv, i, j))
    if _saves_u_dx(cfg):
        u, dx = saved
        dv, dp_parts, end, da_parts, dbeta_parts, dg = _chunk_parallel_call(
            functools.partial(_grad_v_saved_kernel, cfg=cfg),
            grid=(nv, Tp // C, B * Hv),
            grid_order=cfg.grid_order,
            in_specs=[key_spec, v_block_spec, gate_spec, gates_spec, seq_spec, seq_spec, state_v_spec, state_v_spec,
                      v_block_spec, v_block_spec, v_block_spec],
            out_specs=[v_block_spec, cc_spec, block_vector_spec, cc_spec, block_vector_spec, block_vector_spec],
            out_shape=[jax.ShapeDtypeStruct((B, Tp, Hv, V), v.dtype), cc_parts, block_vector(nv), cc_parts,
                       block_vector(nv), block_vector(nv)],
            compiler_params=_params(cfg.grad_warps, cfg.stages),
            interpret=cfg.interpret,
            name="wy_grads_v",
        )(k, v, beta, g, carry, tail, starts, dends, do, u, dx)
        part1 = (dv, dp_parts, end, u, dx, da_parts, dbeta_parts, dg)
    else:
        part1 = _chunk_parallel_call(
            functools.partial(_grad_v_kernel, cfg=cfg),
            grid=(nv, Tp // C, B * Hv),
            grid_order=cfg.grid_order,
            in_specs=[key_spec, key_spec, v_block_spec, gate_spec,
                      inverse_spec(cfg, lambda j, i, bh: (bh // Hv, i, bh % Hv, 0), pair=pair) if cfg.delta
                          else key_spec,
                      gates_spec, seq_spec, seq_spec, seq_spec, state_v_spec, state_v_spec, v_block_spec],
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=_params(cfg.grad_warps, cfg.stages),
            interpret=cfg.interpret,
            name="wy_grads_v",
        )(q, k, v, beta, t, g, doc, carry, tail, starts, dends, do)
    dv, dp_parts, end = part1[:3]

    # Part 2: grid (K/BK, chunks, B*Hv).
    cc_all_spec = pl.BlockSpec((None, C, None, nv * C), lambda j, i, bh: (bh // Hv, i, bh % Hv, 0))
    state_k_spec = pl.BlockSpec((None, None, BK, V), lambda j, i, bh: (bh // Hv, bh % Hv, i * nk + j, 0))
    in_specs = [key_spec, key_spec, value_spec, gate_spec, gates_spec, seq_spec, seq_spec, seq_spec, state_k_spec,
                state_k_spec, value_spec, cc_all_spec, gate_spec]
    args = [q, k, part1[3] if cfg.delta else v, beta, g, doc, carry, tail, starts, dends, do, dp_parts, total(end)]
    out_specs = [k_block_spec, k_block_spec, block_vector_spec]
    out_shape = [qk_grad, qk_grad, block_vector(nk)]
    if cfg.delta:
        _, dx, da_parts, dbeta_parts, dg = part1[3:]  # u went in above
        in_specs += [value_spec, cc_all_spec, gate_spec, gate_spec]
        args += [dx, da_parts, total(dbeta_parts), total(dg)]
        out_specs.insert(2, block_vector_spec)
        out_shape.insert(2, block_vector(nk))
    part2 = _chunk_parallel_call(
        functools.partial(_grad_k_kernel, cfg=cfg, nv=nv),
        grid=(nk, Tp // C, B * Hv),
        grid_order=cfg.grid_order,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_params(cfg.grad_k_warps, cfg.grad_k_stages or cfg.stages),
        interpret=cfg.interpret,
        name="wy_grads_k",
    )(*args)
    if cfg.delta:
        dq, dk, dbeta, dlog = part2
        return dq, dk, dv, total(dbeta), total(dlog)
    dq, dk, dlog = part2
    return dq, dk, dv, jnp.zeros((B, Tp, Hv), F32), total(dlog)


# ---------------------------------------------------------------------------------------------------------------
# custom_vjp glue
# ---------------------------------------------------------------------------------------------------------------


def _inverses(cfg, k, beta, g, doc, *, for_grads=False):
    """T as each kernel reads it: the forward pass's, and with `for_grads` (forward pass, reverse pass, gradient
    kernels). Each is fp32 T or its bf16 pair (`Config.pass_inverse_storage`, `reverse_inverse_storage`,
    `inverse_storage`), or None for gradients that read u and dx; the inverse kernel writes only what is read."""
    if not cfg.delta:
        return (k, k, k) if for_grads else k  # linear attention never reads T (cfg.delta gates every use)
    storage = lambda split: "pair" if split else "fp32"
    wanted = [storage(cfg.pass_inverse_storage == "split")]
    if for_grads:
        wanted.append(storage(cfg.reverse_inverse_storage == "split"))
        wanted.append(None if _saves_u_dx(cfg) else storage(cfg.inverse_storage == "split"))
    written = _inverse(cfg, k, beta, g, doc, pair="pair" in wanted, fp32="fp32" in wanted)
    if not isinstance(written, tuple):
        written = (written,)
    by_storage = dict(zip([name for name in ("fp32", "pair") if name in wanted], written))
    arrays = tuple(by_storage.get(name) for name in wanted)
    return arrays if for_grads else arrays[0]


def _in_chunk_cumsum(cfg, log_decay):
    """G of every chunk as a compensated sum, stacked [hi, lo] -> [2, B, Tp, Hv] (`CumulativeLogDecay`)."""
    B, Tp, Hv = log_decay.shape
    C = cfg.chunk_size
    g = CumulativeLogDecay.of(log_decay.reshape(B, Tp // C, C, Hv), axis=2)
    return jnp.stack([g.hi.reshape(B, Tp, Hv), g.lo.reshape(B, Tp, Hv)])


def _gate_input(cfg, log_decay):
    """G as the kernels read it. Without a decay it is zeros outright: the cumsums of a constant zero log-decay
    were folded by XLA at compile time element by element (seconds per layer at training shapes)."""
    if cfg.gated:
        return _in_chunk_cumsum(cfg, log_decay)
    return jnp.zeros((2,) + log_decay.shape, F32)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _wy(cfg, q, k, v, beta, log_decay, doc, carry, tail, h0):
    """Differentiable in log_decay itself (not in G): the gate gradient comes out per token, see `_grad_kernel`."""
    g = _gate_input(cfg, log_decay)
    t = _inverses(cfg, k, beta, g, doc)
    return _forward_pass(cfg, q, k, v, beta, t, g, doc, carry, tail, h0, with_states=False)


def _wy_fwd(cfg, q, k, v, beta, log_decay, doc, carry, tail, h0, *, u_pair=False, g=None):
    """The forward rule of `_wy`; `u_pair`: u saved as its bf16 (hi, lo) halves (a tuple), for the Mosaic GPU
    gradient kernel (`mosaic_wy`), which reads them as its wgmma operands; `g`: the in-chunk gates [hi, lo] where
    the caller made them (`mosaic_vectors`), else `_gate_input`'s."""
    g = _gate_input(cfg, log_decay) if g is None else g
    t_forward, t, t_grads = _inverses(cfg, k, beta, g, doc, for_grads=True)
    o, final, starts, *u = _forward_pass(cfg, q, k, v, beta, t_forward, g, doc, carry, tail, h0, with_states=True,
                                         u_pair=u_pair)
    return (o, final), (q, k, v, beta, g, doc, carry, tail, t, t_grads, starts, u)


def _wy_bwd(cfg, residuals, cotangents, reverse=None):
    """The reverse pass, then the chunk-parallel gradients. `reverse`: the reverse pass's outputs (dL/d(initial
    state), the end-state cotangents, dx) where another kernel ran it (`mosaic_wy`'s)."""
    q, k, v, beta, g, doc, carry, tail, t, t_grads, starts, u = residuals
    do, dfinal = cotangents
    do = do.astype(v.dtype)
    if reverse is None:
        reverse = _reverse_pass(cfg, q, k, beta, t, g, doc, carry, tail, do, dfinal.astype(F32))
    dh0, dends, *dx = reverse
    dq, dk, dv, dbeta, dlog = _grads(cfg, q, k, v, beta, t_grads, g, doc, carry, tail, starts, dends, do,
                                     saved=(*u, *dx))
    B, Tp, H, K = q.shape
    G = cfg.value_heads // cfg.key_heads
    if G > 1:
        dq = dq.reshape(B, Tp, H, G, K).sum(3)
        dk = dk.reshape(B, Tp, H, G, K).sum(3)
    dbeta = dbeta if cfg.delta else jnp.zeros_like(beta)
    return (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbeta.astype(beta.dtype),
            dlog, None, None, None, dh0)


_wy.defvjp(_wy_fwd, _wy_bwd)


# ---------------------------------------------------------------------------------------------------------------
# Entry point (the rules' signature)
# ---------------------------------------------------------------------------------------------------------------

BLOCK_V = 32  # the widest V block of the sequential passes (`common.sequential_block_v` narrows it)
# Gradient kernels per method: V block, K block of dq and dk (None: whole rows), warps of the K-block kernel. On the
# H100 (docs/kernels.md) "staged" took 2.7 ms where "fused" took 3.7 ms at 8x2048x16x128 (host-timed), same errors;
# device time per call on 2026-11-24: "merged" (u and dx from the passes, BV 32, 4 warps) 1.16 ms, "staged" 1.33
# from the passes and 1.37-1.49 recomputing them. "merged" holds dq or dk whole (C x K fp32): for K above
# MERGED_MAX_K (not measured) "staged" with K blocks is used.
GRAD_METHOD = "merged"
MERGED_MAX_K = 128
GRAD_BLOCKS = {"fused": (32, None, 4), "staged": (64, 128, 8), "merged": (32, None, 4)}
# Inverse kernel alone on the H100, 8x2048x16x128 bf16 (docs/kernels.md): "blocks16" 0.61 ms at 4 warps, 0.25 at 1;
# "batched16" 0.26-0.28 at 1-2 warps, the same within the run-to-run spread. The warps were the gain.
INVERSE_METHOD = "blocks16"
# "blocks16_from_a" (A by its own 4-warp kernel, T from the stored A) stays opt-in: on the H200 (2026-12-03,
# docs/kernels.md) 0.139-0.140 against 0.140-0.143 ms at 8x2048x16x128 for T's pair, no gain resolvable in the
# forward (0.374-0.375 against 0.375-0.378 ms with impl="mosaic"), and A's C x C fp32 tiles (67 MB there) besides.
# fp32 inputs ask for fp32 exactness: the merges of "batched16" keep T about twice as accurate as the block
# substitution of "blocks16" when keys are correlated and beta is near 2 (off-diagonal blocks of T 2.6e-6 to 5.9e-6
# from an fp64 inverse against 4.2e-6 to 1.0e-5; fp32 outputs 6.0e-6 from the scan's at worst over 30 draws of the
# adversarial test inputs, against 2.0e-5). 16-bit inputs keep the faster "blocks16" (docs/kernels.md).
FP32_INVERSE_METHOD = "batched16"
INVERSE_WARPS = 1
SCORES_A_WARPS = 4  # the A kernel of "blocks16_from_a": one C x C x K product and elementwise work per chunk
# For 16-bit inputs (float32 inputs always get IEEE fp32 products); see docs/kernels.md for what each choice
# measured against the fp32 scan and on the H100. With bfloat16 inputs, K S_0 / K dS (STATE_DOTS) and part 2's
# S_0 / dS_end / dA products (GRAD_K_DOTS) take plain bf16 operands (float16 inputs fp16 ones, FP16_DOTS): every
# error stays within half its bound on the adversarial inputs (interpreter and H100), and forward+backward went
# from 4.44 to 3.85 ms at 8x2048x16x128 (H100, 2026-11-23). Every other product needs "split" (correlated keys
# with beta near 2).
DOTS = "split"
INVERSE_DOTS = "split"
GRAD_DOTS = "split"
GRAD_K_DOTS = "bf16"
STATE_DOTS = "bf16"
# float16 inputs take fp16 products where bfloat16 inputs take bf16 ones ("split" -> "fp16_split", "bf16" -> "fp16",
# `common.dot`): fp16 q, k, v, dO as they are, against their fp32 partner scaled per tile into fp16's range. Each
# fp16 tile made an exact bf16 pair instead (the default until 2026-12-07) took three products where bf16 inputs take
# one or two. H100, 8x2048x16x128, `bench_pallas_gpu.py --dtype=float16`, forward / forward+backward: 1.265 / 7.117
# ms with bf16 pairs, 0.531 / 2.913 with these (0.496 / 2.501 unscaled, which overflows beyond 65,504); errors
# against the fp32 scan 2e-4 to 8e-4 (docs/kernels.md, "float16 products for float16 inputs").
FP16_DOTS = {"split": "fp16_split", "bf16": "fp16"}
# "staged" (K above MERGED_MAX_K) runs part 2 in one pipeline stage: with two, its compiled dq on bf16 saved states
# reached 3.7e-3 to 7.3e-3 against the fp32 scan on the H200 (over the 6e-3 bound on some draws; 2.2e-3 in the
# interpreter), the error at the chunks' first tokens, where dq is mostly the state term dO S_0^T; with every kernel
# in one stage 2.2e-3 on the same draw, the interpreter's values (docs/kernels.md, "dq of the staged gradient
# kernels at K = 256").
STAGED_GRAD_K_STAGES = 1
# Storage between kernels, where the consumers' products allow it (`Config.inverse_storage`, `state_storage`): T
# for the gradient kernels that read it ("fused", "staged" recomputing u and dx) as its bf16 (hi, lo) pair whenever
# its products are "split"; the saved states and end-state cotangents in bf16 whenever every product reading them
# rounds them to bf16 (bfloat16 inputs), and in fp16 tiles with their factors wherever every product reading them
# is an "fp16" one on whole tiles of the passes' V blocks (float16 inputs; the "merged" gradient kernel then takes
# the passes' V block where it is narrower than its own), as `rounded_state_storage` allows. H100, 2026-12-07,
# float16 `bench_pallas_gpu.py`, forward+backward ms with fp32 / fp16 saved states: 8x2048x16x128 2.946 / 2.443 (the
# gradient kernel 1.755 / 1.325), 2x8192x16x128 3.161 / 2.560 (and the forward 0.813 / 0.656: its "split" output
# kernel reads the start states), 1x32768x16x128 7.010 / 5.882 (both with the gradient kernel in V blocks of 16;
# 7.056 in blocks of 32); docs/kernels.md, "float16 saved states".
INVERSE_STORAGE = "split"
# Per gradient method: the passes save u and dx for the gradient kernels (`Config.grads_from_passes`).
GRADS_FROM_PASSES = {"fused": False, "staged": True, "merged": True}
# Where the output leaves the forward pass (`Config.output_method`, `sequential_layout`). H100, 2026-11-24, device
# time, forward / forward+backward ms: 8x2048x16x128 (512 programs) fused 0.638-0.646 / 2.319-2.325, split
# 0.679-0.691 / 2.300-2.306; 2x8192x16x128 (256) fused 0.927 / 2.931, split 0.868 / 2.825, split reading T's pair
# 0.781 / 2.759; 1x32768x16x128 (128) fused 2.545 / 7.122, split 2.171-2.203 / 6.748-6.761, with 3 pass stages
# 1.860 / 6.256, and the pair 1.803 / 6.276.
SPLIT_OUTPUT_MAX_PROGRAMS = 2 * MIN_SEQUENTIAL_PROGRAMS
DEEP_PASS_STAGES = 3  # 2x8192x16x128 (256 programs): 2.759 -> 3.053 ms forward+backward with 3
DEEP_PASS_STAGES_MAX_K = 128


# bfloat16 inputs take the narrowest V block of 16 or 32 that leaves at most one program per SM (with three stages)
# rather than BV 16 with more programs: H100, 2026-11-27, 2x8192x16x128 bf16 (`bench_pallas_gpu.py`, variant
# `bv32_pstages3`), BV 16 (256 programs, two stages) / BV 32 (128 programs, three): forward 0.713 / 0.636 ms,
# forward+backward 2.612 / 2.280, reverse 0.671 / 0.461, the same errors against the fp32 scan (2x1024x4x128 run
# with each config). float16 inputs likewise since 2026-12-07 (H100, 2x8192x16x128 fp16, the bf16 layout against
# BV 16: forward 0.802 / 0.861 ms, forward+backward 3.157 / 3.555, reverse 0.546 / 0.849; docs/kernels.md, "float16
# inputs: bf16's sequential layout, and the state products without scaling"). float32 inputs (wider tiles in three
# stages) were not measured and keep BV 16.
def sequential_layout(batch_heads, key_dim, value_dim, *, sixteen_bit=False):
    """(block_v, output_method, pass_stages) of the sequential passes for B*Hv pairs, K and V (measurements in
    docs/kernels.md, "Sixth session"). "split" once the fused forward pass fits in one wave (at most two programs
    per SM); three pipeline stages where there is at most one program per SM, whose shared memory then is free, and
    K <= DEEP_PASS_STAGES_MAX_K (the reverse pass at K = 256 asked for 252 KB with three). With 16-bit inputs
    (`sixteen_bit`) a V block of 32 that gives one program per SM is taken over twice the programs of BV 16
    (measured above)."""
    block_v = sequential_block_v(batch_heads, value_dim, BLOCK_V)
    if sixteen_bit and key_dim <= DEEP_PASS_STAGES_MAX_K:
        block_v = one_program_per_sm_block_v(batch_heads, value_dim) or block_v
    programs = batch_heads * (value_dim // block_v)
    output_method = "split" if programs <= SPLIT_OUTPUT_MAX_PROGRAMS else "fused"
    deep = programs <= MIN_SEQUENTIAL_PROGRAMS and key_dim <= DEEP_PASS_STAGES_MAX_K
    return block_v, output_method, DEEP_PASS_STAGES if deep else None


def default_output_method(batch_heads, key_dim, value_dim):
    return sequential_layout(batch_heads, key_dim, value_dim)[1]


# The reverse pass reads scale P^T dO formed chunk-parallel (`Config.reverse_scores="stored"`) where its programs
# fit one per SM: there the step's instruction stream sets the pass's time, and Q K^T, the exps and P^T dO, formed
# again by each of a head's V/BV programs, were a large part of it. With more programs the extra C x V fp32 per
# chunk and head written and read costs more than it saves. H200, 2026-12-02 (`bench_pallas_gpu.py`, variants
# reverse_scores_inline / reverse_scores_stored, two runs each, ms): 1x32768x16x128 (128 programs of BV 16) reverse
# pass 1.506-1.515 / 1.174-1.177, forward+backward 4.948-4.954 / 4.613-4.616; 8x2048x16x128 (512 programs of BV
# 32) reverse 0.401 / 0.429, forward+backward 1.949 / 1.976. The same errors against the fp32 scan.
def default_reverse_scores(batch_heads, key_dim, value_dim, *, sixteen_bit=False):
    block_v = sequential_layout(batch_heads, key_dim, value_dim, sixteen_bit=sixteen_bit)[0]
    return "stored" if batch_heads * (value_dim // block_v) <= MIN_SEQUENTIAL_PROGRAMS else "inline"


def default_grad_method(key_dim):
    return "staged" if GRAD_METHOD == "merged" and key_dim > MERGED_MAX_K else GRAD_METHOD


def default_config(q, v, *, scale, chunk_size, delta, segmented, interpret, gated=True):
    """The config of one call (the choices above)."""
    K, V = q.shape[3], v.shape[3]
    fp32 = jnp.dtype(q.dtype) == jnp.float32
    mode = lambda chosen: "highest" if fp32 else chosen
    # float16 inputs: the fp32 partner of q, k, v and dO as a scaled fp16 pair or fp16 (`common.dot`), the same
    # number of products as bf16 inputs take and more exact ones (FP16_DOTS).
    fp16 = jnp.dtype(q.dtype) == jnp.float16
    by_dtype = lambda chosen: FP16_DOTS[chosen] if fp16 else mode(chosen)
    grad_method = default_grad_method(K)
    grad_bv, grad_bk, grad_k_warps = GRAD_BLOCKS[grad_method]
    sixteen_bit = jnp.dtype(q.dtype).itemsize == 2
    block_v, output_method, pass_stages = sequential_layout(q.shape[0] * v.shape[2], K, V, sixteen_bit=sixteen_bit)
    inverse_dots, state_dots, grad_k_dots = mode(INVERSE_DOTS), by_dtype(STATE_DOTS), by_dtype(GRAD_K_DOTS)
    grad_block_v = min(grad_bv, V)
    # fp16 saved states need the gradient kernel's V block inside the passes': narrowed to theirs where that buys them.
    rounded = functools.partial(rounded_state_storage, grad_method, state_dots, grad_k_dots, block_v, delta=delta)
    if rounded(min(grad_block_v, block_v)) == "fp16":
        grad_block_v = min(grad_block_v, block_v)
    rounded_states = rounded(grad_block_v)
    return Config(
        scale=float(scale), chunk_size=chunk_size, key_heads=q.shape[2], value_heads=v.shape[2], delta=delta,
        segmented=segmented, gated=gated, dots=by_dtype(DOTS), state_dots=state_dots,
        inverse_dots=inverse_dots, grad_dots=by_dtype(GRAD_DOTS), grad_k_dots=grad_k_dots,
        block_v=block_v, grad_block_v=grad_block_v,
        grad_block_k=min(grad_bk or K, K),
        grad_method=grad_method, warps=4, grad_warps=4, grad_k_warps=grad_k_warps,
        grad_k_stages=STAGED_GRAD_K_STAGES if grad_method == "staged" else None,
        inverse_warps=INVERSE_WARPS, inverse_method=FP32_INVERSE_METHOD if fp32 else INVERSE_METHOD, stages=2,
        interpret=interpret, inverse_storage=INVERSE_STORAGE if inverse_dots == "split" else "fp32",
        state_storage=rounded_states or "fp32", grads_from_passes=GRADS_FROM_PASSES[grad_method],
        output_method=output_method, pass_stages=pass_stages,
        # The passes read T's bf16 pair where T's products are "split" and (measured, "Sixth session") it was
        # faster: the state pass of "split" always, the reverse pass with one program per SM.
        pass_inverse_storage="split" if output_method == "split" and inverse_dots == "split" else "fp32",
        reverse_inverse_storage="split" if pass_stages and inverse_dots == "split" else "fp32",
        reverse_scores=default_reverse_scores(q.shape[0] * v.shape[2], K, V, sixteen_bit=sixteen_bit))


def replace_config(cfg, **changes):
    """`dataclasses.replace` for a variant of a config: the storages, unless `changes` names them, fall back to fp32
    where the changed products no longer allow "split" T or bf16 states, and `grads_from_passes` follows the
    gradient method."""
    fields = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)} | changes
    if "inverse_storage" not in changes and fields["inverse_dots"] != "split":
        fields["inverse_storage"] = "fp32"
    if "state_storage" not in changes and fields["state_storage"] != rounded_state_storage(
            fields["grad_method"], fields["state_dots"], fields["grad_k_dots"], fields["block_v"],
            fields["grad_block_v"], fields["delta"]):
        fields["state_storage"] = "fp32"
    if "grads_from_passes" not in changes:
        fields["grads_from_passes"] = GRADS_FROM_PASSES.get(fields["grad_method"], False)
    for name in ("pass_inverse_storage", "reverse_inverse_storage"):
        if name not in changes and fields["inverse_dots"] != "split":
            fields[name] = "fp32"
    return Config(**fields)


def _pad_time(x, pad, mode="constant"):
    if pad == 0:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


def chunk_wy(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
             state_passing="sequential", interpret=None, config=None):
    """Both ops (`beta is None` is linear attention) with scalar or no decay. Shapes as in `dispatch`.

    `state_passing` is accepted for the common signature; the kernels always pass states sequentially.
    """
    del state_passing
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    T, C = q.shape[1], chunk_size
    delta = beta is not None
    gated = log_decay is not None
    cfg = config or default_config(q, v, scale=scale, chunk_size=C, delta=delta,
                                   segmented=segment_ids is not None, interpret=interpret, gated=gated)
    cfg = dataclasses.replace(cfg, gated=gated)
    o, final = _wy(cfg, *padded_call_inputs(q, k, v, beta, log_decay, initial_state, segment_ids, C))
    return o[:, :T].astype(v.dtype), final


def padded_call_inputs(q, k, v, beta, log_decay, initial_state, segment_ids, chunk_size):
    """The arguments of `_wy` after its config: q, k, v, beta, log_decay padded to whole chunks, the document
    index, the carry and tail masks (does token t continue the previous chunk's last document; is it in the
    chunk's last one) and the initial state in fp32 (zeros when None). beta None (linear attention) becomes zeros."""
    B, T, H, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    C = chunk_size
    nt = -(-T // C)
    pad = nt * C - T
    # Padding tokens have k = 0, beta = 0 and no decay: they leave the state unchanged.
    qp, kp, vp = (_pad_time(x, pad) for x in (q, k, v))
    beta_p = _pad_time(jnp.zeros((B, T, Hv), F32) if beta is None else beta.astype(F32), pad)
    log_decay = jnp.zeros((B, T, Hv), F32) if log_decay is None else log_decay.astype(F32)
    doc = _pad_time(document_index(segment_ids, B, T), pad, mode="edge")
    chunks = doc.reshape(B, nt, C)
    before = jnp.concatenate([chunks[:, :1, :1], chunks[:, :-1, -1:]], axis=1)  # last doc of the previous chunk
    carry = (chunks == before).astype(F32).reshape(B, nt * C)
    tail = (chunks == chunks[:, :, -1:]).astype(F32).reshape(B, nt * C)
    h0 = jnp.zeros((B, Hv, K, V), F32) if initial_state is None else initial_state.astype(F32)
    return qp, kp, vp, beta_p, _pad_time(log_decay, pad), doc, carry, tail, h0
