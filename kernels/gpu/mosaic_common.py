"""Register- and SMEM-level helpers shared by the Mosaic GPU kernels (`mosaic_wy.py`, `mosaic_wy_grads.py`).

Every product is a wgmma with bf16 operands from SMEM (the Mosaic GPU interpreter takes no register operand for
wgmma's A) and an fp32 accumulator. fp32 operands enter as bf16 hi/lo pairs, x = hi + lo with hi = bf16(x) and
lo = bf16(x - hi), and a product of two such operands is hi*hi + hi*lo + lo*hi (the "split" mode of `common.dot`,
~2^-16 relative per product).
"""

from __future__ import annotations

import contextvars
import functools
import itertools
import os

import jax.experimental.mosaic.gpu as mgpu
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxlib.mlir import ir
from jaxlib.mlir.dialects import llvm, vector
import numpy as np

F32 = jnp.float32
BF16 = jnp.bfloat16
SWIZZLE = 128  # bytes; rows of 64 bf16 (narrower tiles take the swizzle of their row)


def wgmma_transforms(swizzle=SWIZZLE):
    return plgpu.TilingTransform((8, swizzle // jnp.dtype(BF16).itemsize)), plgpu.SwizzleTransform(swizzle)


def tiled(shape, swizzle=SWIZZLE):
    """A bf16 SMEM buffer laid out for wgmma operands (8-row tiles, swizzled)."""
    return plgpu.SMEM(shape, BF16, transforms=wgmma_transforms(swizzle))


def tiled_spec(block_shape, index_map, swizzle=SWIZZLE):
    return plgpu.BlockSpec(block_shape=block_shape, index_map=index_map, transforms=wgmma_transforms(swizzle))


def acc(m, n):
    """A zero-initialised m x n fp32 wgmma accumulator (a `pl.run_scoped` allocation: the Mosaic GPU
    interpreter runs `run_scoped` accumulators but not `pl.run_state` ones, so initial values are added after)."""
    return plgpu.ACC((m, n), F32)


def read(*acc_refs):
    """The values of wgmma accumulators, once their products are done. Reading a ref waits for the wgmmas, but that
    wait is an instruction LLVM cannot see the accumulators depend on: it may hoist arithmetic on them (a negation,
    say) above the wait, and ptxas then serializes every wgmma of the kernel (note C7514, "non wgmma instructions
    reading accumulator registers"). An optimization barrier after the reads keeps that arithmetic below them."""
    values = lax.optimization_barrier(tuple(ref[...] for ref in acc_refs))
    return values[0] if len(acc_refs) == 1 else values


# fp32 -> bf16 in pairs of elements (`split`, `store_rounded`): on unless `DELTAJAX_PAIRED_CONVERSIONS=0`, in
# kernels built by `kernel` and compiled (the Mosaic GPU interpreter cannot run `plgpu.inline_mgpu`). Measured on the
# H100 (docs/mosaic.md, "bf16 splits in pairs"): the Gated DeltaNet forward 6% faster, nothing slower. It is read
# when a kernel is traced: after changing it, `jax.clear_caches()` keeps earlier traces from being reused.
PAIRED_CONVERSIONS = os.environ.get("DELTAJAX_PAIRED_CONVERSIONS", "1") != "0"
_PAIRED_IN_THIS_KERNEL = contextvars.ContextVar("paired_conversions", default=False)


def kernel(body, *, interpret, **kwargs):
    """`plgpu.kernel(body, **kwargs)`, run by the Mosaic GPU interpreter if `interpret`, else compiled; while `body`
    is traced, `split` and `store_rounded` convert in pairs if `PAIRED_CONVERSIONS` and compiled."""
    paired = PAIRED_CONVERSIONS and not interpret

    @functools.wraps(body)
    def traced(*args, **body_kwargs):
        token = _PAIRED_IN_THIS_KERNEL.set(paired)
        try:
            return body(*args, **body_kwargs)
        finally:
            _PAIRED_IN_THIS_KERNEL.reset(token)

    return plgpu.kernel(traced, interpret=plgpu.InterpretGPUParams() if interpret else False, **kwargs)


def split(x):
    """x = hi + lo (+ ~2^-17 |x|) as two bf16 values (WGMMA layout): two elements a conversion instruction in a
    compiled `kernel` (`_split_in_pairs`), else one (`split_scalar`)."""
    return _split_in_pairs(x) if _PAIRED_IN_THIS_KERNEL.get() else split_scalar(x)


def split_scalar(x):
    """`split` by Mosaic GPU's `astype`, one conversion per element (what the interpreter runs)."""
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


# Each register of the WGMMA layout holds two fp32 elements, a and b. `cvt.rn.bf16x2.f32` rounds both to bf16 in one
# instruction, with the round-to-nearest-even of the scalar conversion that Mosaic GPU's `astype` emits once per
# element (then packing the halves); the remainders x - hi are exact in fp32 and rounded the same way. On the H200
# the scalar form took 128 conversions and 80 packing permutes per warp and chunk of the forward pass, whose
# conversions held the most stall samples of any instruction (docs/mosaic.md).
_SPLIT_PAIR_PTX = """{
.reg .b32 hi, hb;
.reg .f32 fa, fb, ra, rb;
cvt.rn.bf16x2.f32 hi, $3, $2;
shl.b32 fa, hi, 16;
and.b32 hb, hi, 0xffff0000;
mov.b32 fb, hb;
sub.f32 ra, $2, fa;
sub.f32 rb, $3, fb;
cvt.rn.bf16x2.f32 $1, rb, ra;
mov.b32 $0, hi;
}"""


def _split_in_pairs(x):
    """`split` by `_SPLIT_PAIR_PTX` on each register (a, b) of the WGMMA layout: (hi, lo) as two bf16 arrays."""
    return _per_register_pair(x, _SPLIT_PAIR_PTX, outputs=2)


# bf16(x) alone (the roundings with no lo part: a bf16 state operand, the output tiles), two elements an instruction.
_ROUND_PAIR_PTX = "cvt.rn.bf16x2.f32 $0, $2, $1;"


def _per_register_pair(x, ptx, *, outputs):
    """`ptx` on each register (a, b) of x in the WGMMA layout: inputs $outputs.. = a, b (fp32), outputs $0.. = one
    bf16x2 word each, element a in its low half; returns that many bf16 arrays of x's shape."""
    layout = plgpu.Layout.WGMMA
    out = plgpu.ShapeDtypeStruct(x.shape, BF16, layout=layout)

    @plgpu.inline_mgpu(arg_types=(layout,), return_type=(out,) * outputs)
    def convert(ctx, arr):
        del ctx
        i32 = ir.IntegerType.get_signless(32)
        word, pair = ir.VectorType.get((1,), i32), ir.VectorType.get((2,), ir.BF16Type.get())
        parts = tuple(np.empty_like(arr.registers) for _ in range(outputs))
        constraints = ",".join(["=r"] * outputs + ["f", "f"])
        result_type = llvm.StructType.get_literal([i32] * outputs) if outputs > 1 else i32
        for idx, reg in np.ndenumerate(arr.registers):
            a, b = (vector.extract(reg, dynamic_position=[], static_position=ir.DenseI64ArrayAttr.get([i]))
                    for i in range(2))
            result = llvm.inline_asm(result_type, [a, b], ptx, constraints)
            for n, regs in enumerate(parts):
                bits = llvm.extractvalue(i32, result, [n]) if outputs > 1 else result
                regs[idx] = vector.bitcast(pair, vector.broadcast(word, bits))
        return tuple(mgpu.FragmentedArray(_registers=regs, _layout=arr.layout, _is_signed=None) for regs in parts)

    return convert(wgmma_layout(x))


def wgmma_layout(x):
    """x pinned to the WGMMA register layout. These annotations keep Mosaic GPU's layout search small and the
    layouts explicit; the kernels also lower without them."""
    return plgpu.layout_cast(x, plgpu.Layout.WGMMA)


def store_split(x, hi_ref, lo_ref):
    """x (fp32 registers) into two SMEM operand tiles as its bf16 hi/lo pair."""
    hi, lo = split(wgmma_layout(x))
    hi_ref[...] = wgmma_layout(hi)
    lo_ref[...] = wgmma_layout(lo)


def store_rounded(x, ref):
    """x (fp32 registers) rounded to `ref`'s dtype (round to nearest even) into an SMEM tile: to bf16 two elements
    an instruction in a compiled `kernel` (see `split`), else (and to fp16) one by one."""
    x = wgmma_layout(x)
    if _PAIRED_IN_THIS_KERNEL.get() and ref.dtype == BF16:
        (rounded,) = _per_register_pair(x, _ROUND_PAIR_PTX, outputs=1)
    else:
        rounded = x.astype(ref.dtype)
    ref[...] = wgmma_layout(rounded)


def row_vector(ref):
    """A (n,) SMEM vector in the layout of the WGMMA rows (x[t] lives with row t)."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1), optimized=False)


def rows(ref, m):
    """A (n,) SMEM vector broadcast to n x m (x[t, :] = ref[t]) in the WGMMA layout."""
    return wgmma_layout(lax.broadcast_in_dim(row_vector(ref), (ref.shape[0], m), [0]))


def broadcast_rows(x, m):
    """A row vector (`row_vector`'s layout) broadcast to n x m."""
    return wgmma_layout(lax.broadcast_in_dim(x, (x.shape[0], m), [0]))


def cols(ref, m):
    """A (n,) SMEM vector broadcast to m x n (x[:, s] = ref[s]) in the WGMMA layout.

    Mosaic GPU's layout inference finds no solution when one SMEM ref is loaded both as rows and as columns: a
    vector needed both ways goes to SMEM twice (two buffers of the same GMEM data)."""
    x = plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0), optimized=False)
    return wgmma_layout(lax.broadcast_in_dim(x, (m, ref.shape[0]), [1]))


def chunk_masks(row_doc, col_doc, c, segmented, *, transposed=False):
    """(t >= s, t > s) for a c x c chunk (row t, column s), within one document when `segmented` (doc: the SMEM
    document index as rows and as columns). `transposed`: the masks of the transposed matrix (row s, column t)."""
    row = plgpu.broadcasted_iota(jnp.int32, (c, c), 0, layout=plgpu.Layout.WGMMA)
    col = plgpu.broadcasted_iota(jnp.int32, (c, c), 1, layout=plgpu.Layout.WGMMA)
    if transposed:
        row, col = col, row
    causal, strict = row >= col, row > col
    if segmented:
        same = rows(row_doc, c) == cols(col_doc, c)
        causal, strict = causal & same, strict & same
    return causal, strict


def pair_decay(g_hi, g_lo, g_hi_c, g_lo_c, causal, c, *, transposed=False):
    """exp(G_t - G_s) where `causal`, else 0, at row t and column s (`transposed`: row s, column t). The gate
    difference is taken part by part so that near-1 decays after a large cumulative gate keep their fp32 accuracy,
    and masked before the exp so that it cannot overflow."""
    diff = wgmma_layout((rows(g_hi, c) - cols(g_hi_c, c)) + (rows(g_lo, c) - cols(g_lo_c, c)))
    if transposed:
        diff = -diff
    return wgmma_layout(jnp.exp(jnp.where(causal, diff, -jnp.inf)))


def run_roles(roles, wg, threads):
    """Traces the warpgroups' roles, each a function returning a generator that yields between its steps: with two
    Pallas threads role w runs on warpgroup w (`wg`, the thread index); with one, that warpgroup runs every role in
    turn, step by step, so that the SMEM handoffs between the roles keep their order without barriers. (The Mosaic GPU
    interpreter runs each thread as a computation of its own, and on few CPU cores one blocked in a barrier wait can
    starve the other of host threads.)"""
    if threads == 2:
        for w, role in enumerate(roles):
            pl.when(wg == w)(lambda role=role: _trace(role()))
    else:
        _trace(itertools.zip_longest(*(role() for role in roles)))


def _trace(steps):
    for _ in steps:
        pass
