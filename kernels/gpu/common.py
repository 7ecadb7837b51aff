"""Value-level helpers shared by the Triton kernels (`wy_chunk.py`, `kda.py`).

Triton lowers neither value slicing nor concatenation: rows and last elements are taken by masked sums, which are
exact (one term and zeros).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

F32 = jnp.float32
BF16 = jnp.bfloat16
F16 = jnp.float16
HIGHEST = lax.Precision.HIGHEST
DOT_MODES = ("highest", "tf32", "bf16", "split", "fp16", "fp16_split")
# Where the fp16 modes bring a tile's largest magnitude: 2^14, below fp16's largest finite 65,504 (~2^16) with room
# for the rounding, and ~2^28 above its smallest normal, so that the tile's small entries keep their precision.
FP16_TILE_EXPONENT = 14


# The sequential passes (forward, reverse) run one program per (batch x value head, V block) through every chunk:
# with few batch x head pairs most SMs idle, and narrower V blocks buy programs (each recomputes its chunk's K-side
# products, which are cheap next to the idle SMs). H100, Gated DeltaNet bf16, 2026-11-23 (docs/kernels.md):
# forward / forward+backward at 8x2048x16x128 BV 64 1.06 / 3.76 ms, BV 32 0.74 / 3.51, BV 16 1.07 / 4.06 ms; at
# 1x32768x16x128 BV 64 5.22 / 14.06, BV 32 3.39 / 10.31, BV 16 2.91 / 9.36 ms. KDA: 8x2048 BV 64 26.4, BV 32
# 28.9 ms; 2x8192 29.5 / 29.6; 1x32768 BV 64 72.5, BV 32 65.0, BV 16 74.9 ms (forward+backward).
MIN_SEQUENTIAL_PROGRAMS = 132  # the SMs of an H100 SXM
NARROWEST_BLOCK_V = 16  # Triton dots want sides >= 16


def sequential_block_v(batch_heads, value_dim, widest, narrowest=NARROWEST_BLOCK_V):
    """V block of the sequential passes: `widest` (or V), halved while that leaves fewer programs than
    `MIN_SEQUENTIAL_PROGRAMS`, down to `narrowest` (KDA: 32, below which its passes slowed down)."""
    block = min(widest, value_dim)
    while block > narrowest and batch_heads * (value_dim // block) < MIN_SEQUENTIAL_PROGRAMS:
        block //= 2
    return block


def one_program_per_sm_block_v(batch_heads, value_dim, narrowest=NARROWEST_BLOCK_V):
    """The narrowest V block of `narrowest` or twice it that leaves the sequential passes at most
    `MIN_SEQUENTIAL_PROGRAMS` programs (one per SM, whose shared memory then holds a deeper pipeline), or None."""
    for block in (narrowest, 2 * narrowest):
        if block <= value_dim and batch_heads * (value_dim // block) <= MIN_SEQUENTIAL_PROGRAMS:
            return block
    return None


# Launch order of the chunk-parallel kernels' grids (..., chunks, batch x heads): Pallas's first grid axis is CUDA's
# x, which the GPU schedules fastest. "chunks": consecutive programs walk the chunks of one head, so with few long
# sequences the programs resident at one time read a few heads' rows spread over the whole sequence; "heads": they
# read every head of a few neighbouring chunks. Same programs and values, another order.
GRID_ORDERS = ("chunks", "heads")


def chunk_parallel_call(kernel, *, grid, in_specs, out_specs, grid_order, **kwargs):
    """`pl.pallas_call` of a chunk-parallel kernel whose grid (and every index map) is written as (..., chunks,
    batch x heads); with `grid_order="heads"` the last two axes are launched swapped. Kernels may read
    `pl.program_id` only of the leading axes."""
    if grid_order not in GRID_ORDERS:
        raise ValueError(f"grid_order must be one of {GRID_ORDERS}, got {grid_order!r}")
    if grid_order == "heads":
        grid = (*grid[:-2], grid[-1], grid[-2])

        def swapped(spec):
            index_map = spec.index_map
            return dataclasses.replace(spec, index_map=lambda *ids: index_map(*ids[:-2], ids[-1], ids[-2]))

        in_specs = [swapped(spec) for spec in in_specs]
        out_specs = [swapped(spec) for spec in out_specs] if isinstance(out_specs, (list, tuple)) else swapped(
            out_specs)
    return pl.pallas_call(kernel, grid=grid, in_specs=in_specs, out_specs=out_specs, **kwargs)


def compiler_params(warps, stages):
    return pltriton.CompilerParams(num_warps=warps, num_stages=stages)


def split_bf16(x):
    """x = hi + lo (+ ~2^-17 |x|) with two bf16 values. Inside kernels only; in XLA use `split_bf16_in_xla`."""
    x = x.astype(F32)
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def split3_bf16(x):
    """x = hi + mid + lo exactly (fp32 normal numbers and zeros) with three bf16 values. Inside kernels only."""
    hi = x.astype(BF16)
    rest = x - hi.astype(F32)
    mid = rest.astype(BF16)
    return hi, mid, (rest - mid.astype(F32)).astype(BF16)


def split_bf16_in_xla(x):
    """`split_bf16` for use outside kernels, where XLA optimises the arithmetic. XLA's GPU pipeline removes
    f32 -> bf16 -> f32 conversion pairs (`SimplifyFPConversions`, on under its default
    `--xla_allow_excess_precision`), which turns x - f32(bf16(x)) into x - x = 0: the lo half vanishes. The bf16
    rounding of hi is therefore done on the bits (round to nearest even, as `astype(bfloat16)` does for finite
    values), which no conversion pass can fold away."""
    x = x.astype(F32)
    bits = lax.bitcast_convert_type(x, jnp.uint32)
    rounded = (bits + jnp.uint32(0x7FFF) + ((bits >> 16) & jnp.uint32(1))) & jnp.uint32(0xFFFF0000)
    hi = lax.bitcast_convert_type(rounded, F32)
    return hi.astype(BF16), (x - hi).astype(BF16)


def dot(a, b, *, ta=False, tb=False, mode="highest"):
    """a @ b (a^T if ta, b^T if tb) with fp32 accumulation; `mode` (DOT_MODES) applies when an operand is fp32.

    "highest": IEEE fp32; "tf32": the backend default; "bf16": operands rounded to bf16; "split": each fp32 operand
    as hi + lo in bf16, summed from 2 (one 16-bit operand) or 3 bf16 tensor-core dots, ~2^-16 relative.
    "fp16" and "fp16_split", for an fp16 operand against an fp32 one (else "bf16" and "split"): the fp32 tile, scaled
    by a power of two into fp16's range (`fp16_scaled`), rounded to fp16 (one fp16 dot, ~2^-12 relative) or as
    hi + lo in fp16 (two, ~2^-22), the sum scaled back. The fp16 operand is used as it is, where "split" makes it an
    exact bf16 pair (three dots against a bf16 pair) and "bf16" rounds it.
    """
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    raw = lambda x, y, precision=None: lax.dot_general(x, y, dims, precision=precision, preferred_element_type=F32)
    if a.dtype == b.dtype and a.dtype != F32:
        return raw(a, b)  # two 16-bit operands: exact products on the tensor cores
    if mode == "highest":
        return raw(a.astype(F32), b.astype(F32), HIGHEST)
    if mode == "tf32":
        return raw(a.astype(F32), b.astype(F32), lax.Precision.DEFAULT)
    if mode in ("fp16", "fp16_split") and F16 in (a.dtype, b.dtype):
        scaled, inverse = fp16_scaled(b if a.dtype == F16 else a)
        parts = (scaled.astype(F16),)
        if mode == "fp16_split":
            parts += ((scaled - parts[0].astype(F32)).astype(F16),)
        terms = [raw(a, part) if a.dtype == F16 else raw(part, b) for part in parts]
        return sum(terms[1:], terms[0]) * inverse
    mode = {"fp16": "bf16", "fp16_split": "split"}.get(mode, mode)
    if mode == "bf16":
        return raw(a.astype(BF16), b.astype(BF16))
    if mode != "split":
        raise ValueError(f"dot mode must be one of {DOT_MODES}, got {mode!r}")
    if a.dtype == BF16:
        b_hi, b_lo = split_bf16(b)
        return raw(a, b_hi) + raw(a, b_lo)
    if b.dtype == BF16:
        a_hi, a_lo = split_bf16(a)
        return raw(a_hi, b) + raw(a_lo, b)
    return split_pair_dot(split_bf16(a), b, ta=ta, tb=tb)


def fp16_scaled(x):
    """(x * factor, 1 / factor) with factor a power of two that brings max |x| to [2^e, 2^(e + 1)), e =
    `FP16_TILE_EXPONENT`: every entry then fits fp16, and fp16's 11 bits (22 as a pair) are relative to the tile's
    largest entry whatever its scale. Both factors are made from the exponent bits of max |x|, so scaling and
    scaling back are exact; an all-zero tile takes 2^126, a non-finite one keeps its inf or NaN."""
    x = x.astype(F32)
    largest = lax.bitcast_convert_type(jnp.max(jnp.abs(x)), jnp.int32)
    exponent = jnp.clip(lax.shift_right_logical(largest, 23), 15, 255)  # biased; >= 15 keeps 1 / factor normal
    power = lambda biased: lax.bitcast_convert_type(lax.shift_left(biased, 23), F32)
    return x * power(254 + FP16_TILE_EXPONENT - exponent), power(exponent - FP16_TILE_EXPONENT)


def split_pair_dot(a_pair, b, *, ta=False, tb=False):
    """The "split" product of `dot` for two fp32 operands, with a given as its pair (hi, lo) = `split_bf16(a)`
    (which a kernel may receive already made and stored, loading two bf16 operands): three bf16 products."""
    dims = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    raw = lambda x, y: lax.dot_general(x, y, dims, preferred_element_type=F32)
    (a_hi, a_lo), (b_hi, b_lo) = a_pair, split_bf16(b)
    return raw(a_hi, b_hi) + (raw(a_hi, b_lo) + raw(a_lo, b_hi))


def iota2(n, m, axis):
    return lax.broadcasted_iota(jnp.int32, (n, m), axis)


def last(x):
    """x[-1] of a 1-D value."""
    n = x.shape[0]
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, (n,), 0) == n - 1, x, 0))


def unit_lower_inverse(a):
    """(I + a)^-1 for a strictly lower n x n fp32 matrix, by forward substitution row by row (exact fp32; never a
    Neumann series or doubling, whose powers of a overflow for correlated keys). Row i of a is taken by a masked
    sum (exact: one term and zeros), since Triton slices no values."""
    rows = iota2(*a.shape, 0)
    return unit_lower_inverse_by_rows(a.shape[0], lambda i: jnp.sum(jnp.where(rows == i, a, 0.0), axis=0))


def unit_lower_inverse_by_rows(n, row):
    """`unit_lower_inverse` of the strictly lower n x n matrix whose row i is `row(i)` (an (n,) fp32 value, e.g.
    loaded from a ref, so that it does not depend on the loop's carry).

    Invariant: after step i, rows 0..i of x are rows of the inverse; rows below are still identity rows, and
    a[i, j] = 0 for j >= i, so they never contribute to row i.
    """
    rows, cols = iota2(n, n, 0), iota2(n, n, 1)

    def step(i, x):
        row_i = jnp.sum(row(i)[:, None] * x, axis=0)  # sum_j a[i, j] x[j, :]
        return x - jnp.where(rows == i, row_i[None, :], 0.0)

    return lax.fori_loop(1, n, step, jnp.where(rows == cols, 1.0, 0.0).astype(F32))
