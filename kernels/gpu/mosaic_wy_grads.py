"""The chunk-parallel gradients of the Gated DeltaNet (delta rule, scalar decay) as a Mosaic GPU kernel.

The math is that of `wy_chunk._grad_merged_kernel` (equations (1)-(6) of `wy_chunk`, differentiated): per chunk and
value head, with S_0 the chunk's start state, dS_end the cotangent of its end state (from the reverse pass), u and
dx = dL/d(beta y) saved by the passes, and e = tail exp(G_C - G), f = carry exp(G):

    KS = K S_0,  KD = K dS_end,  y = v - f (.) KS
    dv     = beta (.) dx
    dP     = scale (dO u^T) (.) exp(G_t - G_s) [t >= s]                         (the decayed scores' cotangent)
    dA_k   = beta_t (-dx u^T) (.) exp(G_t - G_s) [t > s]                        (the cotangent of k_t . k_s)
    dq     = scale f (.) dO S_0^T + dP K
    dk     = dP^T Q + dA_k K + dA_k^T K + (-beta f (.) dx) S_0^T + (e (.) u) dS_end^T
    dbeta  = rowsum(dx (.) y) + rowsum(dA (.) K K^T (.) decay, t > s)
    dL/dG  = rowsum(dq_state (.) Q) - rowsum(beta f (.) dx (.) KS) + rowsum(Z) - colsum(Z),
             Z = [t > s] (dP (.) Q K^T + dA_k (.) K K^T)

and the per-token end terms e (.) rowsum(u (.) KD) and the chunk's survival term sum(S_0 (.) dS_end). The kernel
writes dL/dG's per-token terms, the end terms and the survival row sums; `grads` turns them into d(log_decay) in
XLA (the in-chunk reverse cumsum of `wy_chunk._dlog`, exact fp32 sums).

One CTA of one warpgroup per (chunk, value head), grid (chunks, B*Hv). Every input tile arrives by TMA at the start
(q, k: C x K; dO, S_0, dS_end, and u and dx as their bf16 hi/lo pairs, in two V halves of 64 columns, the 128-byte
swizzle), in two groups on two barriers (dO and q, first read later, second); v is loaded into registers while
K S_0 runs. The Mosaic pass and the reverse pass write u and dx as bf16 pairs for this kernel (fp32 arrays are
split in XLA, `as_pair`). The phases, each a few wgmmas and one wait, so that few accumulators are live at a time:
(1) per V half, K S_0 and K dS_end, dv and the per-token sums; (2) dP (with Q K^T), stored as its pair; (3) dA_k
(with K K^T), stored as its pair, and Z; (4) dk; (5) colsum(Z), Z^T against a tile of ones in the freed dx and u
tiles; (6) dq. The products, M x N x K:

    KS, KD                     2 x 2 x (64 x 64 x 128)         bf16 x bf16
    dO u^T, dx u^T             2 x (2 + 3) x (64 x 64 x 64)    u, dx as hi/lo pairs (split)
    Q K^T, K K^T               2 x (64 x 64 x 128)
    dP^T Q, dA_k K, dA_k^T K   2 x 3 x (64 x 128 x 64)         dP, dA_k as hi/lo pairs
    dx S_0^T, u dS_end^T       2 x 2 x 2 x (64 x 128 x 64)     dx, u as pairs; the row factors -beta f and e after
    colsum(Z)                  2 x (64 x 64 x 64)              Z^T (hi/lo) times a tile of ones
    dO S_0^T, dP K             2 x (64 x 128 x 64), 2 x (64 x 128 x 64)

Every fp32 operand thus enters in the "split" mode (~2^-16 relative per product): the Triton "merged" kernel's
`grad_dots`, and finer than its default `grad_k_dots` "bf16" (which rounds the operands of dk's state and dA_k
terms to bf16). Supported: bf16 q/k/v, K = V = 128, Hv == H, C = 64. SMEM: 218 KiB, one CTA per SM.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc
from deltajax.kernels.gpu.common import split_bf16_in_xla

F32, BF16 = mc.F32, mc.BF16
CHUNK = 64
HEAD_DIM = 128
HALF = HEAD_DIM // 2  # the V columns per wgmma operand tile (128-byte rows)
# The per-token vectors the kernel reads, in the order of `token_vectors`' rows; G and doc again as columns.
ROW_VECTORS = ("g_hi", "g_lo", "beta", "from_start", "to_end", "doc")
COL_VECTORS = ("g_hi", "g_lo", "doc")


def _grad_body(q_ref, k_ref, v_ref, do_ref, u_hi_ref, u_lo_ref, dx_hi_ref, dx_lo_ref, starts_ref, dends_ref, vec_ref,
               dq_ref, dk_ref, dv_ref, dbeta_ref, dgate_ref, end_ref, survive_ref, q_s, k_s, do_s, s0_s, dend_s, u_s,
               x_s, *scratch, scale, num_heads, segmented):
    """One chunk i of value head bh = b * H + h. u and dx come as bf16 (hi, lo) halves (B, Tp, H, V) each;
    vec_ref: `token_vectors` (6, B*H, Tp). Outputs: dq, dk, dv (B, Tp, H, 128) bf16; dbeta, dL/dG's per-token terms,
    the end terms (B*H, Tp) fp32; survival row sums (B*H, nt*K). SMEM: the inputs by V half (u_s, x_s: [half, hi/lo]),
    the dP and dA_k pairs, the vectors; once dk is formed, the dx tiles of the first half hold Z and one u tile a
    tile of ones."""
    C, K = CHUNK, HEAD_DIM
    n_vec = len(ROW_VECTORS) + len(COL_VECTORS)
    (p_hi, p_lo, a_hi, a_lo), vec_s, barriers = scratch[:4], scratch[4:4 + n_vec], scratch[4 + n_vec:]
    row_vec = dict(zip(ROW_VECTORS, vec_s[:len(ROW_VECTORS)]))
    col_vec = dict(zip(COL_VECTORS, vec_s[len(ROW_VECTORS):]))
    i = lax.axis_index("chunk")
    bh = lax.axis_index("head")
    b, h = bh // num_heads, bh % num_heads
    tokens = pl.ds(i * C, C)
    state_rows = pl.ds(i * K, K)
    halves = [pl.ds(j * HALF, HALF) for j in range(2)]

    # Two groups of copies: what the V contractions start with, then dO and q (read from the first dO u^T on).
    first = [(k_ref.at[b, tokens, h, :], k_s)]
    first += [(vec_ref.at[ROW_VECTORS.index(name), bh, tokens], ref) for name, ref in row_vec.items()]
    first += [(vec_ref.at[ROW_VECTORS.index(name), bh, tokens], ref) for name, ref in col_vec.items()]
    for j, cols in enumerate(halves):
        first += [(starts_ref.at[b, h, state_rows, cols], s0_s.at[j]),
                  (dends_ref.at[b, h, state_rows, cols], dend_s.at[j])]
        first += [(ref.at[b, tokens, h, cols], tiles.at[j, part])
                  for refs, tiles in (((u_hi_ref, u_lo_ref), u_s), ((dx_hi_ref, dx_lo_ref), x_s))
                  for part, ref in enumerate(refs)]
    second = [(do_ref.at[b, tokens, h, cols], do_s.at[j]) for j, cols in enumerate(halves)]
    second.append((q_ref.at[b, tokens, h, :], q_s))
    for group, group_barrier in ((first, barriers[0]), (second, barriers[1])):
        for src, dst in group:
            plgpu.copy_gmem_to_smem(src, dst, group_barrier)
    plgpu.barrier_wait(barriers[0])

    beta = mc.row_vector(row_vec["beta"])
    from_start = mc.row_vector(row_vec["from_start"])
    to_end = mc.row_vector(row_vec["to_end"])
    beta_start = beta * from_start
    rows = lambda x, m=HALF: mc.broadcast_rows(x, m)
    zero = lambda n: plgpu.layout_cast(jnp.zeros((n,), F32), plgpu.Layout.WGMMA.reduce(1))
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False).astype(F32)
    pair = lambda tiles: mc.wgmma_layout(load(tiles.at[0]) + load(tiles.at[1]))  # hi + lo in fp32
    transposed = lambda ref: ref.transpose((1, 0))

    # The V contractions with S_0 and dS_end, half by half: dv and the per-token sums.
    dbeta, dgate, end = zero(C), zero(C), zero(C)
    for j, cols in enumerate(halves):
        def state_products(ks_ref, kd_ref):
            plgpu.wgmma(ks_ref, k_s, s0_s.at[j])
            plgpu.wgmma(kd_ref, k_s, dend_s.at[j])
            v = load(v_ref.at[b, tokens, h, cols])  # from GMEM while the products run
            return ks_ref[...], kd_ref[...], v

        ks, kd, v = pl.run_scoped(state_products, mc.acc(C, HALF), mc.acc(C, HALF))
        end = end + to_end * jnp.sum(pair(u_s.at[j]) * kd, axis=1)
        dx = pair(x_s.at[j])
        dv_ref.at[b, tokens, h, cols][...] = mc.wgmma_layout((rows(beta) * dx).astype(dv_ref.dtype))
        dbeta = dbeta + jnp.sum(dx * (v - rows(from_start) * ks), axis=1)  # dx (.) y
        dgate = dgate - jnp.sum(rows(beta_start) * dx * ks, axis=1)  # through carry exp(G) in (3)
    plgpu.barrier_wait(barriers[1])

    u_parts = [transposed(u_s.at[j, part]) for j in range(2) for part in range(2)]
    # The masks are formed where they are used (from iotas and the document vectors), not held across the phases.
    masks = lambda: mc.chunk_masks(row_vec["doc"], col_vec["doc"], C, segmented)

    def decayed_score_grads(dp_ref, qk_ref):
        """dP = scale (dO u^T) (.) decay, stored as its pair; returns (decay, the dP (.) Q K^T part of Z)."""
        for n, u_part in enumerate(u_parts):
            plgpu.wgmma(dp_ref, do_s.at[n // 2], u_part)
        plgpu.wgmma(qk_ref, q_s, transposed(k_s))
        causal, strict = masks()
        decay = mc.pair_decay(row_vec["g_hi"], row_vec["g_lo"], col_vec["g_hi"], col_vec["g_lo"], causal, C)
        dp = mc.wgmma_layout(scale * dp_ref[...] * decay)  # dL/d(Q K^T) of (5), decayed
        mc.store_split(dp, p_hi, p_lo)
        return decay, mc.wgmma_layout(jnp.where(strict, dp * qk_ref[...], 0.0))

    decay, z = pl.run_scoped(decayed_score_grads, mc.acc(C, C), mc.acc(C, C))

    def key_pair_grads(nda_ref, kk_ref):
        """dA_k = beta_t dA (.) decay (t > s), dA = -dx u^T, stored as its pair; returns (its dbeta terms, the
        dA_k (.) K K^T part of Z)."""
        for j in range(2):
            for x_part, u_part in ((0, 0), (0, 1), (1, 0)):  # hi*hi + hi*lo + lo*hi
                plgpu.wgmma(nda_ref, x_s.at[j, x_part], u_parts[2 * j + u_part])
        plgpu.wgmma(kk_ref, k_s, transposed(k_s))
        _, strict = masks()
        decay_strict = jnp.where(strict, decay, 0.0)
        kk = kk_ref[...]
        da = jnp.where(strict, -nda_ref[...], 0.0)
        da_k = mc.wgmma_layout(da * decay_strict * rows(beta, C))  # dL/d(k_t . k_s)
        mc.store_split(da_k, a_hi, a_lo)
        return jnp.sum(da * kk * decay_strict, axis=1), mc.wgmma_layout(da_k * kk)

    dbeta_pairs, z_keys = pl.run_scoped(key_pair_grads, mc.acc(C, C), mc.acc(C, C))
    dbeta = dbeta + dbeta_pairs
    z = mc.wgmma_layout(z + z_keys)
    dgate = dgate + jnp.sum(z, axis=1)
    plgpu.commit_smem()

    def accumulate(products, m=C, n=K):
        """One accumulator over `products` ((A, B) operand pairs), read once they have all been issued. dk and dq
        are built one accumulator at a time (two at once measured the same: 0.846 / 0.866 ms at 8x2048x16x128,
        ptxas 468 / 480 bytes spilled either way, H100 2026-11-26)."""
        def body(acc_ref):
            for a_operand, b_operand in products:
                plgpu.wgmma(acc_ref, a_operand, b_operand)
            return acc_ref[...]
        return pl.run_scoped(body, mc.acc(m, n))

    pairs = lambda tiles, b_operand: [(tiles.at[j, part], b_operand(j)) for j in range(2) for part in range(2)]
    # dk: its C x C terms; its state term through S_0, the row factor -beta f of dks = -beta f (.) dx after the
    # product; (e (.) u) dS_end^T, the factor e after the product.
    dk = accumulate([(transposed(p_hi), q_s), (transposed(p_lo), q_s), (a_hi, k_s), (a_lo, k_s),
                     (transposed(a_hi), k_s), (transposed(a_lo), k_s)])
    dk = mc.wgmma_layout(dk - rows(beta_start, K) * accumulate(pairs(x_s, lambda j: transposed(s0_s.at[j]))))
    dk = mc.wgmma_layout(dk + rows(to_end, K) * accumulate(pairs(u_s, lambda j: transposed(dend_s.at[j]))))
    dk_ref.at[b, tokens, h, :][...] = mc.wgmma_layout(dk.astype(dk_ref.dtype))
    # Reading the last accumulator waited for every wgmma: the u and dx tiles are free.

    z_hi, z_lo, ones_s = x_s.at[0, 0], x_s.at[0, 1], u_s.at[0, 0]
    mc.store_split(z, z_hi, z_lo)
    ones_s[...] = mc.wgmma_layout(jnp.ones((C, C), BF16))  # colsum(Z) = rows of Z^T times ones
    plgpu.commit_smem()

    ones_products = [(transposed(z_hi), ones_s), (transposed(z_lo), ones_s)]
    dgate = dgate - jnp.max(accumulate(ones_products, n=C), axis=1)  # every column holds colsum(Z)

    dq_state = accumulate([(do_s.at[j], transposed(s0_s.at[j])) for j in range(2)])
    dq_state = mc.wgmma_layout(scale * rows(from_start, K) * dq_state)
    local = jnp.sum(dq_state * load(q_s), axis=1)
    dq = mc.wgmma_layout(dq_state + accumulate([(p_hi, k_s), (p_lo, k_s)]))
    dq_ref.at[b, tokens, h, :][...] = mc.wgmma_layout(dq.astype(dq_ref.dtype))
    dbeta_ref.at[bh, tokens][...] = dbeta
    dgate_ref.at[bh, tokens][...] = dgate + local
    end_ref.at[bh, tokens][...] = end
    # Last, when few registers are live: sum(S_0 (.) dS_end) by rows, for the survival factor's gradient.
    survive_ref.at[bh, state_rows][...] = sum(jnp.sum(load(s0_s.at[j]) * load(dend_s.at[j]), axis=1)
                                              for j in range(2))


def token_vectors(g, beta, carry, tail, doc=None):
    """The per-token vectors of the Mosaic kernels, (5 or 6, B*H, Tp) fp32 in `ROW_VECTORS`' order: G hi, G lo, beta,
    carry exp(G), tail exp(G_C - G), and the document index when `doc` is given. g: [hi, lo] x (B, Tp, H); carry,
    tail: (B, Tp) or (B, Tp, 1); doc: (B, Tp)."""
    B, Tp, H = beta.shape
    nt, C = Tp // CHUNK, CHUNK
    hi, lo = (x.reshape(B, nt, C, H) for x in g)
    carry_c, tail_c = carry.reshape(B, nt, C, 1), tail.reshape(B, nt, C, 1)
    from_start = carry_c * jnp.exp(hi + lo)
    to_end = tail_c * jnp.exp((hi[:, :, -1:] - hi) + (lo[:, :, -1:] - lo))
    rows = [hi, lo, beta, from_start, to_end]
    if doc is not None:
        rows.append(jnp.broadcast_to(doc.astype(F32)[:, :, None], (B, Tp, H)))
    heads_major = lambda x: jnp.moveaxis(x.reshape(B, Tp, H), 2, 1).reshape(B * H, Tp)
    return jnp.stack([heads_major(x.astype(F32)) for x in rows])


def _scratch_types():
    C, K = CHUNK, HEAD_DIM
    inputs = (mc.tiled((C, K)), mc.tiled((C, K)), mc.tiled((2, C, HALF)), mc.tiled((2, K, HALF)),
              mc.tiled((2, K, HALF)), mc.tiled((2, 2, C, HALF)), mc.tiled((2, 2, C, HALF)))
    vectors = tuple(plgpu.SMEM((C,), F32) for _ in ROW_VECTORS + COL_VECTORS)
    operands = tuple(mc.tiled((C, C)) for _ in range(4))
    # Arrivals: one per copy of each group (`_grad_body`).
    first = 1 + len(ROW_VECTORS) + len(COL_VECTORS) + 2 * (2 + 4)
    second = 2 + 1
    return inputs + operands + vectors + (plgpu.Barrier(num_arrivals=first), plgpu.Barrier(num_arrivals=second))


def as_pair(x):
    """An fp32 array as its bf16 (hi, lo) halves; a pair of halves as it is."""
    return tuple(x) if isinstance(x, (tuple, list)) else split_bf16_in_xla(x)


def grads(q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx, *, scale, segmented, interpret):
    """(dq, dk, dv, dbeta, d(log_decay)) of every chunk, as `wy_chunk._grads` returns them for "merged": padded
    inputs (Tp a multiple of 64), g = [hi, lo] in-chunk gates, starts / dends (B, H, nt*K, V) bf16, do bf16, u and
    dx each as its bf16 (hi, lo) halves (B, Tp, H, V) (fp32 arrays are split in XLA, `as_pair`)."""
    u, dx = as_pair(u), as_pair(dx)
    B, Tp, H, K = q.shape
    V = v.shape[-1]
    nt = Tp // CHUNK
    vectors = token_vectors(g, beta, carry, tail, doc)
    bh_vector = jax.ShapeDtypeStruct((B * H, Tp), F32)
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), q.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype),
                jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), bh_vector, bh_vector, bh_vector,
                jax.ShapeDtypeStruct((B * H, nt * K), F32))
    kernel = plgpu.kernel(
        functools.partial(_grad_body, scale=scale, num_heads=H, segmented=segmented), out_type=out_type,
        scratch_types=_scratch_types(), grid=(nt, B * H), grid_names=("chunk", "head"),
        compiler_params=plgpu.CompilerParams(), interpret=plgpu.InterpretGPUParams() if interpret else False,
        kernel_name="wy_grads_mosaic")
    dq, dk, dv, dbeta, dgate, end, survive_rows = kernel(q, k, v, do, *u, *dx, starts, dends, vectors)
    heads_last = lambda x: jnp.moveaxis(x.reshape(B, H, Tp), 1, 2)
    dlog = _dlog(heads_last(dgate), heads_last(end), survive_rows.reshape(B, H, nt, K).sum(-1), g, carry)
    return dq, dk, dv, heads_last(dbeta), dlog


def _dlog(dgate, end, survive_sums, g, carry):
    """d(log_decay) per token (B, Tp, H), as `wy_chunk._dlog` forms it: the in-chunk reverse cumsum of dL/dG's
    per-token terms, the end terms as an exclusive prefix sum, and every token's share of the chunk's survival
    factor carry_C exp(G_C) times sum(S_0 (.) dS_end)."""
    B, Tp, H = dgate.shape
    nt, C = Tp // CHUNK, CHUNK
    chunks = lambda x: x.reshape(B, nt, C, H)
    from_here = jnp.flip(jnp.cumsum(jnp.flip(chunks(dgate), 2), axis=2), 2)
    ended_before = jnp.cumsum(jnp.pad(chunks(end)[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0))), axis=2)
    hi_last, lo_last = (chunks(x)[:, :, -1] for x in g)  # (B, nt, H)
    survive = carry.reshape(B, nt, C)[:, :, -1:] * jnp.exp(hi_last + lo_last)
    survive_term = (survive * jnp.moveaxis(survive_sums, 1, 2))[:, :, None, :]
    return (from_here + ended_before + survive_term).reshape(B, Tp, H)
