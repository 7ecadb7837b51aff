"""The in-chunk inverse T = (I + A)^-1 of the Gated DeltaNet (eq. (2) of `wy_chunk`) as a Mosaic GPU kernel, written
as its bf16 (hi, lo) pair for the Mosaic passes: the same output as `wy_chunk._inverse(..., pair=True)`.

A = strictly lower (diag(beta) K K^T (.) exp(G_t - G_s)), masked to one document, is unit lower triangular's
off-diagonal part, so T needs no substitution: every step below is a masked product on the tensor cores.

    T_4  = (I - A_4)(I + A_4^2)          A_4: the 4 x 4 diagonal blocks of A (nilpotent: A_4^4 = 0)
    T_2n = T_n - T_n (A_n T_n)           A_n: A inside the 2n-blocks, outside the n-blocks (n = 4, 8, 16, 32)

For a block lower triangular [[I + A_11, 0], [A_21, I + A_22]] the inverse is [[T_1, 0], [-T_2 A_21 T_1, T_2]],
which the doubling step forms for every 2n-block at once. Each T_n is the exact inverse of the n-block-diagonal
part of I + A (the diagonal blocks of a lower triangular matrix's inverse are the inverses of its diagonal blocks),
so no intermediate is larger than the blocks of T itself (a power series in A over the whole chunk would be: its
terms overflow). Ten 64 x 64 x 64 products, each of two fp32 operands as fp16 (hi, lo) pairs: hi*hi + hi*lo +
lo*hi, three wgmmas. fp16 carries 11 bits of mantissa to bf16's 8, so a pair holds ~22 bits: T lands within
~6e-6 of a float64 inverse on correlated keys with beta near 2 (where bf16 pairs give ~3e-4 and the Triton kernel's
fp32 forward substitution ~8e-6), at the cost of bf16 pairs. fp16's range ends at 65504: each chunk tracks the
largest operand it split, and where any exceeds `FP16_LIMIT` the chunk is formed again with bf16 pairs (fp32's
range), so no input that the fp32 path handles turns into inf here.

One CTA of one warpgroup per (chunk, value head), grid (chunks, B*Hv); k (at the value head's key head), G hi/lo,
beta and the document index arrive by TMA, T's pair leaves by TMA. ~80 KiB of SMEM, so two CTAs share an SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc

F32, BF16, F16 = mc.F32, mc.BF16, jnp.float16
CHUNK = 64
HEAD_DIM = 128
FIRST_BLOCK = 4  # the side of the diagonal blocks inverted by the nilpotent series (A_4^4 = 0)
# Operands above this split as bf16 pairs instead of fp16 ones: fp16's hi rounds to inf from 65520 on; half of that
# leaves the hi + lo of every operand finite.
FP16_LIMIT = 32768.0
# The rows of the per-token vectors (`mosaic_vectors.prologue`, `mosaic_wy._pass_vectors`) this kernel reads.
G_HI, G_LO, BETA = 0, 1, 2
ROW_VECTORS = ("g_hi", "g_lo", "beta", "doc")
COL_VECTORS = ("g_hi", "g_lo", "doc")


def _operand_tiles(dtype):
    """Two (hi, lo) pairs of C x C wgmma operand tiles of `dtype`, and a third for the other operand."""
    swizzle = mc.SWIZZLE
    transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))
    return tuple(plgpu.SMEM((2, CHUNK, CHUNK), dtype, transforms=transforms) for _ in range(3))


def _store_pair(x, pair_ref):
    """x (fp32 registers) as its (hi, lo) pair of the pair's dtype."""
    x = mc.wgmma_layout(x)
    hi = x.astype(pair_ref.dtype)
    lo = (x - hi.astype(F32)).astype(pair_ref.dtype)
    pair_ref.at[0][...] = mc.wgmma_layout(hi)
    pair_ref.at[1][...] = mc.wgmma_layout(lo)


def _product(a_pair, b_pair):
    """a @ b from the two operands' pairs: hi*hi + hi*lo + lo*hi into one fp32 accumulator."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a_pair.at[0], b_pair.at[0])
        plgpu.wgmma(acc_ref, a_pair.at[0], b_pair.at[1])
        plgpu.wgmma(acc_ref, a_pair.at[1], b_pair.at[0])
        return acc_ref[...]

    return mc.wgmma_layout(pl.run_scoped(body, mc.acc(CHUNK, CHUNK)))


def _scores(k_s, row_vec, col_vec, segmented):
    """A of eq. (2): beta_t (k_t . k_s) exp(G_t - G_s) for s < t in one document, else 0 (fp32 registers)."""

    def key_key(acc_ref):
        plgpu.wgmma(acc_ref, k_s, k_s.transpose((1, 0)))
        return acc_ref[...]

    kk = pl.run_scoped(key_key, mc.acc(CHUNK, CHUNK))
    _, strict = mc.chunk_masks(row_vec["doc"], col_vec["doc"], CHUNK, segmented)
    decay = mc.pair_decay(row_vec["g_hi"], row_vec["g_lo"], col_vec["g_hi"], col_vec["g_lo"], strict, CHUNK)
    return mc.wgmma_layout(mc.rows(row_vec["beta"], CHUNK) * kk * decay)


def _iota(dim):
    return plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), dim, layout=plgpu.Layout.WGMMA)


def _blocks(a_s, n):
    """A inside the 2n-blocks of the diagonal and outside the n-blocks (n = 0: the FIRST_BLOCK-blocks), from its
    SMEM copy. The index arrays are formed at each use, so that none stays live across the products."""
    row, col = _iota(0), _iota(1)
    if n == 0:
        keep = (row // FIRST_BLOCK) == (col // FIRST_BLOCK)
    else:
        keep = ((row // (2 * n)) == (col // (2 * n))) & ((row // n) != (col // n))
    return mc.wgmma_layout(jnp.where(keep, mc.wgmma_layout(a_s[...]), 0.0))


def _doubling(a_s, tiles):
    """T = (I + A)^-1 by the steps of the module docstring, A in fp32 SMEM, every product's operands as pairs in
    `tiles` (one dtype). Returns T and the largest magnitude of any operand split, per row (a row vector)."""
    o_pair, t_pair, y_pair = tiles
    largest = [None]

    def store(x, pair_ref):
        row_max = jnp.max(jnp.abs(x), axis=1)
        largest[0] = row_max if largest[0] is None else jnp.maximum(largest[0], row_max)
        _store_pair(x, pair_ref)

    a_4 = _blocks(a_s, 0)
    store(a_4, o_pair)
    _store_pair(a_4, t_pair)  # a second copy: one SMEM ref cannot be both operands of a wgmma
    plgpu.commit_smem()
    eye = mc.wgmma_layout(jnp.where(_iota(0) == _iota(1), 1.0, 0.0))
    x = mc.wgmma_layout(eye + _product(o_pair, t_pair))  # I + A_4^2
    store(x, y_pair)
    plgpu.commit_smem()
    t = mc.wgmma_layout(x - _product(o_pair, y_pair))  # (I - A_4)(I + A_4^2) = X - A_4 X
    n = FIRST_BLOCK
    while n < CHUNK:
        store(_blocks(a_s, n), o_pair)
        store(t, t_pair)
        plgpu.commit_smem()
        store(_product(o_pair, t_pair), y_pair)  # A_n T_n
        plgpu.commit_smem()
        t = mc.wgmma_layout(t - _product(t_pair, y_pair))
        n *= 2
    return t, largest[0]


def _inverse_body(k_ref, vec_ref, doc_ref, t_ref, k_s, *scratch, num_heads, group, segmented):
    """Chunk i of value head bh = b * Hv + h. GMEM: k (B, Tp, H, K) bf16, read at key head h // `group`; the
    per-token vectors (rows, B*Hv, Tp) fp32 (G hi, G lo, beta first); the document index (B, Tp) fp32; out: T's
    pair (2, B, Tp, Hv, C) bf16."""
    n_vec = len(ROW_VECTORS) + len(COL_VECTORS)
    vec_s, (a_s, out_pair, loaded) = scratch[:n_vec], scratch[n_vec:]
    row_vec = dict(zip(ROW_VECTORS, vec_s[:len(ROW_VECTORS)]))
    col_vec = dict(zip(COL_VECTORS, vec_s[len(ROW_VECTORS):]))
    i = lax.axis_index("chunk")
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    tokens = pl.ds(i * CHUNK, CHUNK)
    source = dict(g_hi=vec_ref.at[G_HI, bh, tokens], g_lo=vec_ref.at[G_LO, bh, tokens],
                  beta=vec_ref.at[BETA, bh, tokens], doc=doc_ref.at[b, tokens])
    plgpu.copy_gmem_to_smem(k_ref.at[b, tokens, h // group, :], k_s, loaded)
    for vectors in (row_vec, col_vec):
        for name, ref in vectors.items():
            plgpu.copy_gmem_to_smem(source[name], ref, loaded)
    plgpu.barrier_wait(loaded)

    a_s[...] = _scores(k_s, row_vec, col_vec, segmented)  # read back block by block (fewer live registers)

    def inverse(*tiles):
        t, largest = _doubling(a_s, tiles)
        _store_pair(t, out_pair)
        return jnp.max(largest)

    largest = pl.run_scoped(inverse, *_operand_tiles(F16))

    @pl.when(largest > FP16_LIMIT)
    def _bf16_pairs():  # fp16 would overflow somewhere in this chunk: bf16 pairs, fp32's range
        pl.run_scoped(inverse, *_operand_tiles(BF16))

    plgpu.commit_smem()
    for part in range(2):
        plgpu.copy_smem_to_gmem(out_pair.at[part], t_ref.at[part, b, tokens, h, :])
    plgpu.wait_smem_to_gmem(0)


def check_supported(k, vectors, doc):
    B, Tp, H, K = k.shape
    if k.dtype != BF16:
        raise ValueError(f"k must be bfloat16 for the Mosaic inverse, got {k.dtype}")
    if K != HEAD_DIM:
        raise ValueError(f"k's head dim must be {HEAD_DIM} for the Mosaic inverse, got {K}")
    if Tp % CHUNK:
        raise ValueError(f"k's time axis must be padded to chunks of {CHUNK}, got {Tp}")
    if vectors.ndim != 3 or vectors.shape[0] < 3 or vectors.shape[2] != Tp or vectors.shape[1] % B:
        raise ValueError(f"vectors must be (rows >= 3, B*Hv, Tp) with rows G hi, G lo, beta first, got {vectors.shape}")
    if (vectors.shape[1] // B) % H:
        raise ValueError(f"value heads Hv = {vectors.shape[1] // B} must be a multiple of k's heads H = {H}")
    if doc.shape != (B, Tp):
        raise ValueError(f"doc must be (B, Tp) = {(B, Tp)}, got {doc.shape}")


def inverse_pair(k, vectors, doc, *, segmented, interpret):
    """T = (I + A)^-1 of every chunk as its bf16 (hi, lo) pair (2, B, Tp, Hv, C). k: (B, Tp, H, K) bf16, padded to
    whole chunks; vectors: the passes' per-token vectors (rows, B*Hv, Tp) fp32 with G hi, G lo and beta as rows 0,
    1, 2 (`mosaic_vectors.prologue` or `mosaic_wy._pass_vectors`); doc: the document index (B, Tp) fp32 (read with
    `segmented` only)."""
    check_supported(k, vectors, doc)
    B, Tp, H, K = k.shape
    Hv = vectors.shape[1] // B
    scratch = (mc.tiled((CHUNK, K)),) + tuple(plgpu.SMEM((CHUNK,), F32) for _ in ROW_VECTORS + COL_VECTORS)
    scratch += (plgpu.SMEM((CHUNK, CHUNK), F32), mc.tiled((2, CHUNK, CHUNK)), plgpu.Barrier(num_arrivals=1 + len(ROW_VECTORS) + len(COL_VECTORS)))
    kernel = plgpu.kernel(
        functools.partial(_inverse_body, num_heads=Hv, group=Hv // H, segmented=segmented),
        out_type=jax.ShapeDtypeStruct((2, B, Tp, Hv, CHUNK), BF16), scratch_types=scratch,
        grid=(Tp // CHUNK, B * Hv), grid_names=("chunk", "head"),
        compiler_params=plgpu.CompilerParams(),
        interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="wy_inverse_mosaic")
    return kernel(k, vectors, doc)
