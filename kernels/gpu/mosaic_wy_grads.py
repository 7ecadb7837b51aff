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

One CTA of two warpgroups per (chunk, value head), grid (chunks, B*Hv). Every input tile arrives by TMA at the
start (q, k: C x K; dO, S_0, dS_end, and u and dx as their bf16 hi/lo pairs, in two V halves of 64 columns, the
128-byte swizzle), in two groups on two barriers (dO and q, first read later, second). The Mosaic pass and the
reverse pass write u and dx as bf16 pairs for this kernel (fp32 arrays are split in XLA, `as_pair`); with u None
the kernel forms u = T diag(beta) y from T's pair instead (`mosaic_wy.Config.recompute_u`, measured slower on the
H100: docs/mosaic.md, "u formed in the gradient kernel"). The two warpgroups work side by side (`_warpgroup`), each
in phases of a few wgmmas and one wait, so that few accumulators are live at a time:

    warpgroup 0                                     warpgroup 1
    V half 0: K S_0, K dS_end (v from GMEM         V half 1: the same
      meanwhile), dv, the per-token sums
    dA_k (with K K^T), its pair -> handoff 0        dk: its state terms (e (.) u) dS_end^T, dks S_0^T,
    dP (with Q K^T), its pair -> handoff 1            then (handoff 0) dA_k's terms, (handoff 1) dP's
    dq = scale f (.) dO S_0^T + dP K                  -> handoff 2
    (handoff 2) colsum(Z) in dP's tiles

colsum is Z^T (hi/lo) against a tile of ones. dk is warpgroup 1's whole: 32 of 60 wgmma units of 64 x 64 x 64
against warpgroup 0's 28. Until 2026-11-27 warpgroup 1 formed dA_k too (42 units against 20, each warpgroup
its part of Z): 0.726 ms against 0.610-0.616 now at 8x2048x16x128 (H100, docs/mosaic.md, "Rebalanced roles");
K halves of dk and dq on both instead (operands sliced by columns) measured 1.05 ms against 0.69 ms then.
The products, M x N x K:

    KS, KD                     2 x 2 x (64 x 64 x 128)         bf16 x bf16
    dO u^T, dx u^T             2 x (2 + 3) x (64 x 64 x 64)    u, dx as hi/lo pairs (split)
    Q K^T, K K^T               2 x (64 x 64 x 128)
    dP^T Q, dA_k K, dA_k^T K   2 x 3 x (64 x 128 x 64)         dP, dA_k as hi/lo pairs
    dx S_0^T, u dS_end^T       2 x 2 x 2 x (64 x 128 x 64)     dx, u as pairs; the row factors -beta f and e after
    colsum(Z)                  2 x (64 x 64 x 64)              Z^T (hi/lo) times a tile of ones
    dO S_0^T, dP K             2 x (64 x 128 x 64), 2 x (64 x 128 x 64)

Every fp32 operand thus enters in the "split" mode (~2^-16 relative per product): the Triton "merged" kernel's
`grad_dots`, and finer than its default `grad_k_dots` "bf16" (which rounds the operands of dk's state and dA_k
terms to bf16). Supported: bf16 q/k/v, K and V each of 64, 128 or 256 (`HEAD_DIMS`), C = 64, Hv value heads a
multiple of the H key heads (value head h reads q and k at key head h // (Hv / H) and writes its own dq and dk in
fp32, which `grads` sums over the heads sharing a key head). The tables above are for K = V = 128; at V = 64
warpgroup 1 has no V piece (its shares of the per-token sums are zeros) and forms dk only, at K = 64 the key-sized
tiles and accumulators halve. SMEM tiles: 210 KiB at K = V = 128 (one CTA per SM), 106 KiB at K = V = 64, where two
CTAs of one warpgroup each (`warpgroups=1`, both roles in turn) may share an SM: measured slower than one CTA of two
warpgroups (docs/mosaic.md, next step 6).

K or V of 256 (twice the tiles and K-sized accumulators, over the SMEM and registers one CTA has) run in blocks of
`BLOCK` = 128: one CTA per (chunk, head, key block, value block), each the kernel above on its blocks of q, k, the
states and the V-sized inputs. Every term of every gradient is linear in one V block's cotangents and in one K block's
share of the key contractions, so the blocks' terms add up to the whole: dq and dk are written by key block and summed
over the value blocks in fp32 (in XLA), the per-token shares are summed over all blocks, and v's term of dbeta and dv
come from key block 0 alone. The price: the V-side products (dO u^T, dx u^T) are formed once per key block and the
key-side ones (Q K^T, K K^T) once per value block, and dq, dk pass through HBM in fp32 where V = 256.
"""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from deltajax.kernels.gpu import mosaic_common as mc
from deltajax.kernels.gpu import mosaic_vectors
from deltajax.kernels.gpu.common import split_bf16_in_xla

F32, BF16 = mc.F32, mc.BF16
CHUNK = 64
# K and V each. V comes in pieces of HALF columns, one per warpgroup at V = 128; at V = 64 warpgroup 1 has no piece
# and forms dk only. 256 in blocks of BLOCK (the module docstring, last paragraph).
HEAD_DIMS = (64, 128, 256)
BLOCK = 128
HALF = 64  # the V columns per wgmma operand tile (128-byte rows)
# The per-token vectors the kernel reads, in the order of `token_vectors`' rows; G and doc again as columns.
ROW_VECTORS = ("g_hi", "g_lo", "beta", "from_start", "to_end", "doc")
COL_VECTORS = ("g_hi", "g_lo", "doc")


def _grad_body(*refs, scale, num_heads, group, segmented, threads, u_from_t, key_blocks, value_blocks):
    """One chunk i of value head bh = b * Hv + h (`num_heads` = Hv), two warpgroups w = 0, 1 (`_warpgroup`); with heads
    wider than `BLOCK`, one of its `key_blocks` x `value_blocks` blocks (the module docstring; a chunk's blocks are next
    to each other in the launch order). The GMEM inputs: q, k (B, Tp, H, K), read at key head h // `group`; v, dO; u's
    bf16 (hi, lo) halves (B, Tp, Hv, V) each, or (`u_from_t`) T's bf16 pair (2, B, Tp, Hv, C), from which the kernel
    forms u itself; dx's halves; the start states and end-state cotangents; vec_ref: `token_vectors` (6, B*Hv, Tp).
    Outputs: dq, dk (value blocks, B, Tp, Hv, K), bf16, or fp32 where `group` > 1 or there are two value blocks (`grads`
    sums them); dv (B, Tp, Hv, V) bf16; each warpgroup's share of dbeta, of dL/dG's per-token terms and of the end terms
    (2 x blocks, B*Hv, Tp) fp32, and of the survival row sums (2 x value blocks, B*Hv, nt*K). SMEM: the inputs by V
    piece (u_s, x_s: [piece, hi/lo]), the dP and dA_k pairs (p_s, a_s: [hi/lo]; Z's pair and a tile of ones at the end),
    the vectors. With `u_from_t`, T's pair arrives in the tiles of u's second piece (`_warpgroup`)."""
    n_in = 10 if u_from_t else 11
    inputs, outputs, tiles = refs[:n_in], refs[n_in:n_in + 7], refs[n_in + 7:]
    if u_from_t:
        q_ref, k_ref, v_ref, do_ref, t_ref, dx_hi_ref, dx_lo_ref, starts_ref, dends_ref, vec_ref = inputs
        u_refs = ()
    else:
        q_ref, k_ref, v_ref, do_ref, u_hi_ref, u_lo_ref, dx_hi_ref, dx_lo_ref, starts_ref, dends_ref, vec_ref = inputs
        u_refs = (u_hi_ref, u_lo_ref)
    dq_ref, dk_ref, dv_ref, dbeta_ref, dgate_ref, end_ref, survive_ref = outputs
    q_s, k_s, do_s, s0_s, dend_s, u_s, x_s, p_s, a_s, *scratch = tiles
    n_vec = len(ROW_VECTORS) + len(COL_VECTORS)
    vec_s, barriers = scratch[:n_vec], scratch[n_vec:]
    first_loads, second_loads, handoff = barriers[:3]
    # With `u_from_t`: warpgroup 0 has read T; both warpgroups have stored their half of u.
    u_stored = types.SimpleNamespace(t_read=barriers[3], both=barriers[4]) if u_from_t else None
    row_vec = dict(zip(ROW_VECTORS, vec_s[:len(ROW_VECTORS)]))
    col_vec = dict(zip(COL_VECTORS, vec_s[len(ROW_VECTORS):]))
    blocks = key_blocks * value_blocks
    i, block = lax.axis_index("chunk") // blocks, lax.axis_index("chunk") % blocks
    key_block, value_block = block // value_blocks, block % value_blocks
    bh = lax.axis_index("head")
    wg = lax.axis_index("wg") if threads == 2 else 0
    b, h = bh // num_heads, bh % num_heads
    key_head = h // group
    key_dim, n_halves = k_s.shape[1], do_s.shape[0]
    tokens = pl.ds(i * CHUNK, CHUNK)
    keys = pl.ds(key_block * key_dim, key_dim)  # this CTA's key channels, its rows of the states
    state_rows = pl.ds(i * key_dim * key_blocks + key_block * key_dim, key_dim)
    halves = [pl.ds(value_block * n_halves * HALF + j * HALF, HALF) for j in range(n_halves)]
    # The terms read once per head: v's (dbeta) and dv, in key block 0 (None: one key block).
    first_key_block = None if key_blocks == 1 else key_block == 0

    @pl.when(wg == 0)
    def _issue_loads():
        # Two groups of copies: what both warpgroups start with, then dO and q (first read by the dP product).
        first = [(k_ref.at[b, tokens, key_head, keys], k_s)]
        first += [(vec_ref.at[ROW_VECTORS.index(name), bh, tokens], ref) for name, ref in row_vec.items()]
        first += [(vec_ref.at[ROW_VECTORS.index(name), bh, tokens], ref) for name, ref in col_vec.items()]
        for j, cols in enumerate(halves):
            first += [(starts_ref.at[b, h, state_rows, cols], s0_s.at[j]),
                      (dends_ref.at[b, h, state_rows, cols], dend_s.at[j])]
            first += [(ref.at[b, tokens, h, cols], pairs.at[j, part])
                      for srcs, pairs in ((u_refs, u_s), ((dx_hi_ref, dx_lo_ref), x_s))
                      for part, ref in enumerate(srcs)]
        if u_from_t:  # T's pair in the tiles of u's second half, until u is formed (`_warpgroup`)
            first += [(t_ref.at[part, b, tokens, h, :], u_s.at[1, part]) for part in range(2)]
        second = [(do_ref.at[b, tokens, h, cols], do_s.at[j]) for j, cols in enumerate(halves)]
        second.append((q_ref.at[b, tokens, key_head, keys], q_s))
        for group, barrier in ((first, first_loads), (second, second_loads)):
            for src, dst in group:
                plgpu.copy_gmem_to_smem(src, dst, barrier)

    refs = types.SimpleNamespace(
        q_s=q_s, k_s=k_s, do_s=do_s, s0_s=s0_s, dend_s=dend_s, u_s=u_s, x_s=x_s, p_s=p_s, a_s=a_s,
        row_vec=row_vec, col_vec=col_vec, first_loads=first_loads, second_loads=second_loads, handoff=handoff,
        u_stored=u_stored)
    # Warpgroup w's V piece: w itself, or none (V = 64, w = 1).
    share, survive_share = 2 * block, 2 * value_block  # + w; the survival sums' rows are by key block already
    roles = [functools.partial(
        _warpgroup, w, refs, v_ref.at[b, tokens, h, halves[w]] if w < n_halves else None, scale=scale,
        segmented=segmented, concurrent=threads == 2, first_key_block=first_key_block,
        out=dict(dq=dq_ref.at[value_block, b, tokens, h, keys], dk=dk_ref.at[value_block, b, tokens, h, keys],
                 dv=dv_ref.at[b, tokens, h, halves[w]] if w < n_halves else None,
                 dbeta=dbeta_ref.at[share + w, bh, tokens], dgate=dgate_ref.at[share + w, bh, tokens],
                 end=end_ref.at[share + w, bh, tokens], survive=survive_ref.at[survive_share + w, bh, state_rows]))
             for w in range(2)]
    mc.run_roles(roles, wg, threads)


def _warpgroup(w, r, v_tile, *, scale, segmented, concurrent, first_key_block, out):
    """Warpgroup w's share of one chunk: V half w of the contractions with S_0 and dS_end (dv, the per-token
    sums); then (w = 0) the cotangents dA_k and dP, stored as pairs for warpgroup 1, dq and colsum(Z), or (w = 1)
    dk. `handoff`: [0] dA_k's pair is in SMEM, [1] dP's pair is, [2] warpgroup 1 has read both (Z then takes dP's
    tiles). A generator that yields between the roles' steps, so that one warpgroup can also run both roles in turn
    (`concurrent=False`: no barriers between the roles, each load barrier waited on once): warpgroup 0's first step
    stores both pairs before warpgroup 1's first step reads them, and overwrites dP's only in its second.
    `first_key_block` (a traced bool, or None for a single key block): whether this CTA takes v's term of dbeta and
    writes dv, which do not depend on the key block."""
    C, K, n_halves = CHUNK, r.k_s.shape[1], r.do_s.shape[0]
    row_vec, col_vec, handoff = r.row_vec, r.col_vec, r.handoff
    if concurrent or w == 0:
        plgpu.barrier_wait(r.first_loads)
    beta = mc.row_vector(row_vec["beta"])
    from_start = mc.row_vector(row_vec["from_start"])
    to_end = mc.row_vector(row_vec["to_end"])
    beta_start = beta * from_start
    rows = lambda x, m=HALF: mc.broadcast_rows(x, m)
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False).astype(F32)
    pair = lambda tiles: mc.wgmma_layout(load(tiles.at[0]) + load(tiles.at[1]))  # hi + lo in fp32
    transposed = lambda ref: ref.transpose((1, 0))

    def accumulate(products, n=K, before_last=None, last=()):
        """One C x n accumulator over `products` ((A, B) operand pairs), then `before_last()` (a wait) and the
        `last` products, read once all are issued."""
        def body(acc_ref):
            for a_operand, b_operand in products:
                plgpu.wgmma(acc_ref, a_operand, b_operand)
            if before_last is not None:
                before_last()
                for a_operand, b_operand in last:
                    plgpu.wgmma(acc_ref, a_operand, b_operand)
            return mc.read(acc_ref)
        return pl.run_scoped(body, mc.acc(C, n))

    # V half w of the contractions with S_0 and dS_end: dv and the per-token sums.
    def state_products(ks_ref, kd_ref):
        plgpu.wgmma(ks_ref, r.k_s, r.s0_s.at[w])
        plgpu.wgmma(kd_ref, r.k_s, r.dend_s.at[w])
        v = load(v_tile)  # from GMEM while the products run
        return *mc.read(ks_ref, kd_ref), v

    # Zeros in the layout of the rows' sums (a splat of fewer than 128 elements cannot be stored).
    zeros = lambda n: plgpu.layout_cast(jnp.zeros((n,), F32), plgpu.Layout.WGMMA.reduce(1))
    if v_tile is None:  # no V piece (V = 64, warpgroup 1): its shares of the sums are zero
        dbeta = dgate = end = zeros(C)
    else:
        ks, kd, v = pl.run_scoped(state_products, mc.acc(C, HALF), mc.acc(C, HALF))
        if first_key_block is not None:  # y's v term once per head: K S_0 is this key block's share
            v = v * first_key_block.astype(F32)
        y = mc.wgmma_layout(v - rows(from_start) * ks)  # (3)
        dx = pair(r.x_s.at[w])

        def store_dv():
            mc.store_rounded(rows(beta) * dx, out["dv"])
        if first_key_block is None:
            store_dv()
        else:
            pl.when(first_key_block)(store_dv)
        dbeta = jnp.sum(dx * y, axis=1)
        dgate = -jnp.sum(rows(beta_start) * dx * ks, axis=1)  # through carry exp(G) in (3)
        if r.u_stored is None:
            end = to_end * jnp.sum(pair(r.u_s.at[w]) * kd, axis=1)
        else:
            # u = T diag(beta) y of (4), V half w, as the forward pass forms it (from bf16(S_0), which K S_0 reads
            # there too): diag(beta) y's pair goes through this warpgroup's score tiles (free until dP / dA_k), T's
            # pair arrives in the tiles of u's second half, which warpgroup 1 overwrites once warpgroup 0 has read T.
            y_tiles = r.p_s if w == 0 else r.a_s
            mc.store_split(rows(beta) * y, y_tiles.at[0], y_tiles.at[1])
            plgpu.commit_smem()
            t_hi, t_lo = r.u_s.at[1, 0], r.u_s.at[1, 1]
            u = accumulate([(t_hi, y_tiles.at[0]), (t_hi, y_tiles.at[1]), (t_lo, y_tiles.at[0])], n=HALF)
            if concurrent:
                (plgpu.barrier_arrive if w == 0 else plgpu.barrier_wait)(r.u_stored.t_read)
            mc.store_split(u, r.u_s.at[w, 0], r.u_s.at[w, 1])
            plgpu.commit_smem()
            end = to_end * jnp.sum(u * kd, axis=1)
            if concurrent:
                plgpu.barrier_arrive(r.u_stored.both)
            yield
            if concurrent:
                plgpu.barrier_wait(r.u_stored.both)

    u_parts = [transposed(r.u_s.at[j, part]) for j in range(n_halves) for part in range(2)]
    masks = lambda: mc.chunk_masks(row_vec["doc"], col_vec["doc"], C, segmented)
    decay = lambda mask: mc.pair_decay(row_vec["g_hi"], row_vec["g_lo"], col_vec["g_hi"], col_vec["g_lo"], mask, C)

    def decayed_score_grads(dp_ref, qk_ref):
        """dP = scale (dO u^T) (.) decay, stored as its pair; returns the dP (.) Q K^T part of Z."""
        plgpu.barrier_wait(r.second_loads)
        for n, u_part in enumerate(u_parts):
            plgpu.wgmma(dp_ref, r.do_s.at[n // 2], u_part)
        plgpu.wgmma(qk_ref, r.q_s, transposed(r.k_s))
        causal, strict = masks()
        dp, qk = mc.read(dp_ref, qk_ref)
        dp = mc.wgmma_layout(scale * dp * decay(causal))  # dL/d(Q K^T) of (5), decayed
        mc.store_split(dp, r.p_s.at[0], r.p_s.at[1])
        return mc.wgmma_layout(jnp.where(strict, dp * qk, 0.0))

    def key_pair_grads(nda_ref, kk_ref):
        """dA_k = beta_t dA (.) decay (t > s), dA = -dx u^T, stored as its pair; returns (its dbeta terms, the
        dA_k (.) K K^T part of Z)."""
        for j in range(n_halves):
            for x_part, u_part in ((0, 0), (0, 1), (1, 0)):  # hi*hi + hi*lo + lo*hi
                plgpu.wgmma(nda_ref, r.x_s.at[j, x_part], u_parts[2 * j + u_part])
        plgpu.wgmma(kk_ref, r.k_s, transposed(r.k_s))
        _, strict = masks()
        decay_strict = decay(strict)
        nda, kk = mc.read(nda_ref, kk_ref)
        da = jnp.where(strict, -nda, 0.0)
        da_k = mc.wgmma_layout(da * decay_strict * rows(beta, C))  # dL/d(k_t . k_s)
        mc.store_split(da_k, r.a_s.at[0], r.a_s.at[1])
        return jnp.sum(da * kk * decay_strict, axis=1), mc.wgmma_layout(da_k * kk)

    if w == 0:  # dA_k, then dP, each stored as its pair for warpgroup 1's dk; Z = both parts
        dbeta_pairs, z = pl.run_scoped(key_pair_grads, mc.acc(C, C), mc.acc(C, C))
        plgpu.commit_smem()  # the pair's stores, before the wgmmas read them
        if concurrent:
            plgpu.barrier_arrive(handoff.at[0])
        z = z + pl.run_scoped(decayed_score_grads, mc.acc(C, C), mc.acc(C, C))
        plgpu.commit_smem()
        if concurrent:
            plgpu.barrier_arrive(handoff.at[1])
        dbeta = dbeta + dbeta_pairs
        dgate = dgate + jnp.sum(z, axis=1)
        yield

        # dq = scale f (.) dO S_0^T + dP K
        dq_state = mc.wgmma_layout(scale * rows(from_start, K)
                                   * accumulate([(r.do_s.at[j], transposed(r.s0_s.at[j])) for j in range(n_halves)]))
        local = jnp.sum(dq_state * load(r.q_s), axis=1)
        dq = mc.wgmma_layout(dq_state + accumulate([(r.p_s.at[part], r.k_s) for part in range(2)]))
        mc.store_rounded(dq, out["dq"])
        # colsum(Z): rows of Z^T times ones, Z's pair in dP's tiles and the ones in dA_k's hi tile once warpgroup 1
        # has read dP and dA_k (a tile of its own would keep the SMEM at K = V = 64 over half an SM's).
        if concurrent:
            plgpu.barrier_wait(handoff.at[2])
        mc.store_split(z, r.p_s.at[0], r.p_s.at[1])
        r.a_s.at[0][...] = mc.wgmma_layout(jnp.ones((C, C), BF16))
        plgpu.commit_smem()
        colsum = jnp.max(accumulate([(transposed(r.p_s.at[part]), r.a_s.at[0]) for part in range(2)], n=C), axis=1)
        dgate = dgate - colsum + local
    else:  # dk: the state terms with their row factors after the products, then dA_k's and dP's terms
        pairs = lambda tiles, state: [(tiles.at[j, part], transposed(state.at[j])) for j in range(n_halves)
                                      for part in range(2)]
        dk = mc.wgmma_layout(rows(to_end, K) * accumulate(pairs(r.u_s, r.dend_s))  # (e (.) u) dS_end^T
                             - rows(beta_start, K) * accumulate(pairs(r.x_s, r.s0_s)))  # dks S_0^T

        def wait_for_scores():
            if concurrent:
                plgpu.barrier_wait(r.second_loads)  # q
                plgpu.barrier_wait(handoff.at[1])

        if concurrent:
            plgpu.barrier_wait(handoff.at[0])
        key_terms = [(r.a_s.at[part], r.k_s) for part in range(2)]
        key_terms += [(transposed(r.a_s.at[part]), r.k_s) for part in range(2)]
        score_terms = [(transposed(r.p_s.at[part]), r.q_s) for part in range(2)]
        dk = mc.wgmma_layout(dk + accumulate(key_terms, before_last=wait_for_scores, last=score_terms))
        if concurrent:
            plgpu.barrier_arrive(handoff.at[2])
        yield
        mc.store_rounded(dk, out["dk"])
    out["dbeta"][...] = dbeta
    out["dgate"][...] = dgate
    out["end"][...] = end
    # Last, when few registers are live: sum(S_0 (.) dS_end) by rows over V half w, for the survival factor.
    if v_tile is None:
        out["survive"][...] = zeros(K)
    else:
        out["survive"][...] = jnp.sum(load(r.s0_s.at[w]) * load(r.dend_s.at[w]), axis=1)


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


def _scratch_types(u_from_t, key_dim, value_dim):
    C, K, n = CHUNK, key_dim, value_dim // HALF
    inputs = (mc.tiled((C, K)), mc.tiled((C, K)), mc.tiled((n, C, HALF)), mc.tiled((n, K, HALF)),
              mc.tiled((n, K, HALF)), mc.tiled((n, 2, C, HALF)), mc.tiled((n, 2, C, HALF)))
    operands = (mc.tiled((2, C, C)), mc.tiled((2, C, C)))  # dP pair (then Z's), dA_k pair (then ones)
    vectors = tuple(plgpu.SMEM((C,), F32) for _ in ROW_VECTORS + COL_VECTORS)
    # Arrivals: one per copy of each group (`_grad_body`: k, the vectors, S_0 and dS_end by halves, then u's and
    # dx's pairs by halves or dx's by halves and T's pair; dO's halves and q); one per warpgroup for the
    # handoffs, and both warpgroups' for u's pairs.
    first = 1 + len(ROW_VECTORS) + len(COL_VECTORS) + 2 * n + (2 * n + 2 if u_from_t else 4 * n)
    second = n + 1
    barriers = (plgpu.Barrier(num_arrivals=first), plgpu.Barrier(num_arrivals=second),
                plgpu.Barrier(num_arrivals=1, num_barriers=3))
    if u_from_t:
        barriers += (plgpu.Barrier(num_arrivals=1), plgpu.Barrier(num_arrivals=2))
    return inputs + operands + vectors + barriers


def as_pair(x):
    """An fp32 array as its bf16 (hi, lo) halves; a pair of halves as it is."""
    return tuple(x) if isinstance(x, (tuple, list)) else split_bf16_in_xla(x)


def grads(q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx, *, scale, segmented, interpret, vectors=None,
          survive=None, t_pair=None, warpgroups=2):
    """(dq, dk, dv, dbeta, d(log_decay)) of every chunk, as `wy_chunk._grads` returns them for "merged": padded inputs
    (Tp a multiple of 64), q, k (B, Tp, H, K) and v (B, Tp, Hv, V) with Hv a multiple of H, g = [hi, lo] in-chunk gates,
    starts / dends (B, Hv, nt*K, V) bf16, do bf16, u and dx each as its bf16 (hi, lo) halves (B, Tp, Hv, V) (fp32 arrays
    are split in XLA, `as_pair`); K and V in `HEAD_DIMS`, at 256 in blocks of `BLOCK` (`_grad_body`). u None (V = 128, K
    at most 128): the kernel forms u = T diag(beta) (v - carry exp(G) (.) K S_0) itself from `t_pair`, T's bf16 pair (2,
    B, Tp, Hv, C), as the Mosaic forward pass does (S_0 as bf16 in K S_0). `vectors`: the kernel's `token_vectors` (6,
    B*Hv, Tp) where made already (`mosaic_vectors.prologue`); `survive`: that prologue's survival factors (B*Hv, nt*K),
    which send the warpgroups' shares to `mosaic_vectors.epilogue` for dbeta and d(log_decay) instead of XLA. dq and dk
    are summed over the value heads of each key head (in fp32, then rounded once to q's dtype)."""
    u_from_t = u is None
    if u_from_t and t_pair is None:
        raise ValueError("grads: u is None, so t_pair (T's bf16 pair, (2, B, Tp, Hv, 64)) is needed to form it")
    u_inputs = (t_pair,) if u_from_t else as_pair(u)
    dx = as_pair(dx)
    B, Tp, key_heads, K = q.shape
    H, V = v.shape[2:]  # the value heads: the kernel's grid and every per-head array below
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"grads: K and V must each be one of {HEAD_DIMS}, got K={K}, V={V}")
    if u_from_t and (V != 2 * HALF or K > BLOCK):
        # T's pair arrives in the tiles of u's second V piece, which V = 64 does not have; u needs K S_0 over every
        # key channel, which one key block does not see.
        raise ValueError(f"grads: u None (formed from T's pair) takes V = {2 * HALF} and K <= {BLOCK}, got K={K}, "
                         f"V={V}")
    group = H // key_heads
    nt = Tp // CHUNK
    key_block, value_block = min(K, BLOCK), min(V, BLOCK)
    key_blocks, value_blocks = K // key_block, V // value_block
    blocks = key_blocks * value_blocks
    vectors = token_vectors(g, beta, carry, tail, doc) if vectors is None else vectors
    bh_vector = jax.ShapeDtypeStruct((2 * blocks, B * H, Tp), F32)  # one share per warpgroup and block
    # dq and dk per value head and V block; in fp32 where those are summed below, so that they are rounded once.
    summed = group > 1 or value_blocks > 1
    dqk_dtype = F32 if summed else q.dtype
    dqk_type = jax.ShapeDtypeStruct((value_blocks, B, Tp, H, K), dqk_dtype)
    out_type = (dqk_type, dqk_type, jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), bh_vector, bh_vector, bh_vector,
                jax.ShapeDtypeStruct((2 * value_blocks, B * H, nt * K), F32))
    # `warpgroups` compiled: two side by side, or one running both roles in turn (the same SMEM handoffs, no
    # barriers between the roles), where two CTAs share an SM (SMEM at most half of it: K = V = 64). The interpreter
    # runs each Pallas thread as a computation of its own, and on few CPU cores one blocked in a barrier wait can
    # starve the other of host threads (seen on 2 cores): there one warpgroup always.
    if warpgroups not in (1, 2):
        raise ValueError(f"grads: warpgroups must be 1 (both roles in turn) or 2 (side by side), got {warpgroups}")
    threads = 1 if interpret else warpgroups
    kernel = mc.kernel(
        functools.partial(_grad_body, scale=scale, num_heads=H, group=group, segmented=segmented, threads=threads,
                          u_from_t=u_from_t, key_blocks=key_blocks, value_blocks=value_blocks),
        out_type=out_type, scratch_types=_scratch_types(u_from_t, key_block, value_block), grid=(nt * blocks, B * H),
        grid_names=("chunk", "head"),
        num_threads=threads, thread_name="wg",
        # Every reduction is along the rows, within a warp: no SMEM for cross-warp ones (which fills 227 KiB).
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
        interpret=interpret,
        kernel_name="wy_grads_mosaic")
    dq, dk, dv, *shares = kernel(q, k, v, do, *u_inputs, *dx, starts, dends, vectors)
    if summed:
        dq, dk = (x.reshape(value_blocks, B, Tp, key_heads, group, K).sum((0, 4)).astype(q.dtype) for x in (dq, dk))
    else:
        dq, dk = dq[0], dk[0]
    # The warpgroups' shares: summed over the blocks, two left.
    shares = [x if x.shape[0] == 2 else x.reshape(-1, 2, *x.shape[1:]).sum(0) for x in shares]
    if survive is not None:
        dbeta, dlog = mosaic_vectors.epilogue(*shares, survive, num_heads=H, interpret=interpret)
        return dq, dk, dv, dbeta, dlog
    dbeta, dgate, end, survive_rows = (x[0] + x[1] for x in shares)
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
