"""The chunk-parallel gradients of KDA (per-key-channel decay) as one Mosaic GPU kernel (`kda.Config.grads_backend
="mosaic"`), for calls whose chunks all span at most `kda.SPAN_LIMIT` (one reference gate per chunk): the math of
`kda._grad_v_kernel` fused with `kda._one_reference_pair_products`, `kda._sum_pair_terms` and
`kda._write_log_decay_grad`.

Per chunk and value head, with S_0 the chunk's start state (bf16, saved by the forward pass), dS its end state's
cotangent (bf16, from the reverse pass), u and dx = dL/d(beta y) as the passes saved them (bf16 pairs), G the
in-chunk cumulative log-decay (hi + lo), A = carry exp(G), E = tail exp(G_C - G), gamma = carry_C exp(G_C), and
to_end = exp(G - G_C), from_end = exp(G_C - G) (the reference split at the chunk's last gate):

    dP   = scale dO u^T,  s < t, same document;  dp_self = scale rowsum(dO (.) u)      (dP's diagonal)
    dM   = -dx u^T,       s < t, same document;  dR = diag(beta) dM
    dqa  = scale dO S_0^T,  dxs = dx S_0^T,  dke = u dS^T                               (C x K)
    left_p = to_end (.) dP (K (.) from_end),   left_r = to_end (.) dR (K (.) from_end)
    right  = from_end (.) [dP^T (Q (.) to_end) + dR^T (K (.) to_end)]
    dq   = A (.) dqa + left_p + dp_self (.) K
    dk   = E (.) dke - A (.) beta (.) dxs + left_r + dp_self (.) Q + right
    dG   = A (.) (Q (.) dqa - K (.) beta (.) dxs) + Q (.) left_p + K (.) left_r - K (.) right
    dE   = K (.) dke (.) E
    d(log_decay)_r = sum_{t >= r} dG_t + sum_{s < r} dE_s + gamma (.) rowsum(S_0 (.) dS)
    dbeta = rowsum(dx (.) V) - rowsum(A (.) K (.) dxs) + rowsum(dM (.) R)
    dv   = beta (.) dx

dbeta's y = V - (A (.) K) S_0 enters through rowsum(dx (.) y) = rowsum(dx (.) V) - rowsum((A (.) K) (.) dx S_0^T), so
no product forms y: dx S_0^T is dk's term anyway. The survival term gamma (.) sum_v S_0 (.) dS reaches every token of
the chunk (d(log_decay)_r for r <= C - 1); it is formed as ones(C x V) (S_0 (.) dS)^T, the product of bf16 values
split exactly into a bf16 pair, so that each token's row holds every channel's sum in the columns' layout. The
in-chunk sums over tokens are products with the 0/1 triangles [t >= r] and [s < r] against dG and dE split into
three bf16 parts (exact, as `kda._zero_one_dot`).

One CTA of two warpgroups per (chunk, value head), grid (chunks, B*Hv); warpgroup w owns the key channels
[64 w, 64 w + 64). Every SMEM input arrives by TMA at the start: S_0 and dS by (channel half, V half), dO, and u's
and dx's pairs by V half, the per-token and per-channel vectors; q, k, G, v and R are elementwise operands only and
are read from GMEM into registers (q, k and G once per warpgroup). The squares are formed once per chunk: warpgroup 0 dP, warpgroup 1
dM (`handoff`). Once both have read dO, u and dx (`release`), warpgroup w reuses their V-half-w tiles and its own
S_0 and dS tiles as operand tiles of the pair and sum products. The products, 64 x 64 x 64 each: dP 4, dM 6, the
state terms 2 x 10, the survival sums 2 x 4, dE's sum 2 x 3, the pair terms 2 x 12, dG's sum 2 x 3: 74 (~39 MFLOP
per chunk-head). SMEM: 25 operand tiles of 8 KiB (200 KiB) and the vectors. A = carry exp(G_C) to_end and to_end =
1 / from_end are formed from one fp32 tile of G where used, and q, k stay in registers as bf16.

Measured slower than the fused Triton kernel, so opt-in (docs/kernels.md, "KDA: the Mosaic GPU gradient kernel"):
2.33 against 1.88 ms at 8x2048x16x128, 4.50 against 3.75 at 1x32768x16x128 (H200, marginal device time,
`experiments/bench_mosaic_kda_grads.py`, 2026-11-29). One CTA per SM runs its steps one after another: the
register loads of q, k and G from GMEM wait out their latency (~1 ms of 2.76 in an earlier version that loaded them
at every use), and ptxas spills 2 KB per thread at 255 registers.

Supported: bf16 q/k/v, K = V = 128, C = 64, Hv a multiple of H; dq and dk are written per value head (in q's dtype
when every key head has one value head, else fp32 for the caller's sum).
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

F32, BF16 = mc.F32, mc.BF16
CHUNK = 64
HEAD_DIM = 128
HALF = HEAD_DIM // 2  # the channels of one warpgroup, and the V columns of one operand tile
ROW_VECTORS = ("beta", "carry", "tail", "doc")  # per token, in `token_vectors`' rows; doc again as columns
CHANNEL_VECTORS = ("g_hi_end", "g_lo_end", "gamma", "exp_g_end")  # per channel of a chunk (`channel_vectors`)
CONSTANTS = ("ones", "from_here", "before")  # 0/1 tiles: all ones, [t >= r], [s < r] (row r, column t or s)


def check_supported(*, key_dim, value_dim, chunk_size, dtype):
    """Raises ValueError naming what the Mosaic gradient kernel does not take."""
    if key_dim != HEAD_DIM or value_dim != HEAD_DIM:
        raise ValueError(f"the Mosaic KDA gradient kernel takes K = V = {HEAD_DIM}, got K={key_dim}, V={value_dim}")
    if chunk_size != CHUNK:
        raise ValueError(f"the Mosaic KDA gradient kernel takes chunk_size {CHUNK}, got {chunk_size}")
    if jnp.dtype(dtype) != BF16:
        raise ValueError(f"the Mosaic KDA gradient kernel takes bfloat16 q/k/v, got {jnp.dtype(dtype).name}")


def _body(*refs, scale, num_heads, group, segmented, threads):
    """Chunk i of value head bh = b * Hv + h. GMEM inputs: q, k (B, Tp, H, K) at key head h // `group`; v, dO, u's
    and dx's bf16 halves (B, Tp, Hv, V); G hi, G lo (B, Tp, Hv, K) fp32; R (B, Tp, Hv, C) fp32; the start states
    and end-state cotangents (B, Hv, nt*K, V) bf16; `token_vectors` (5, B*Hv, Tp); `channel_vectors`
    (3, B*Hv, nt*K). Outputs: dq, dk (B, Tp, Hv, K); dv (B, Tp, Hv, V); d(log_decay) (B, Tp, Hv, K) fp32; the
    warpgroups' shares of dbeta (2, B*Hv, Tp)."""
    (q_ref, k_ref, v_ref, g_ref, glo_ref, r_ref, do_ref, u_hi_ref, u_lo_ref, dx_hi_ref, dx_lo_ref, starts_ref,
     dends_ref, vec_ref, chan_ref) = refs[:15]
    dq_ref, dk_ref, dv_ref, dlog_ref, dbeta_ref = refs[15:20]
    s0_s, ds_s, do_s, u_s, x_s, p_s, r_s, const_s, *scratch = refs[20:]
    n_row, n_chan = len(ROW_VECTORS), 2 * len(CHANNEL_VECTORS)
    row_vec = dict(zip(ROW_VECTORS, scratch[:n_row]))
    col_doc = scratch[n_row]
    n_c = len(CHANNEL_VECTORS)
    chan_vec = [dict(zip(CHANNEL_VECTORS, scratch[n_row + 1 + n_c * w:n_row + 1 + n_c * (w + 1)])) for w in range(2)]
    loads, handoff, release = scratch[n_row + 1 + n_chan:]
    i = lax.axis_index("chunk")
    bh = lax.axis_index("head")
    wg = lax.axis_index("wg") if threads == 2 else 0
    b, h = bh // num_heads, bh % num_heads
    key_head = h // group
    tokens = pl.ds(i * CHUNK, CHUNK)
    halves = [pl.ds(j * HALF, HALF) for j in range(2)]
    state_rows = [pl.ds(i * HEAD_DIM + w * HALF, HALF) for w in range(2)]

    @pl.when(wg == 0)
    def _issue_loads():
        copies = []
        for w in range(2):
            for j in range(2):
                copies += [(starts_ref.at[b, h, state_rows[w], halves[j]], s0_s.at[w, j]),
                           (dends_ref.at[b, h, state_rows[w], halves[j]], ds_s.at[w, j])]
            copies += [(chan_ref.at[n, bh, state_rows[w]], chan_vec[w][name])
                       for n, name in enumerate(CHANNEL_VECTORS)]
        for j in range(2):
            copies += [(do_ref.at[b, tokens, h, halves[j]], do_s.at[j]),
                       (u_hi_ref.at[b, tokens, h, halves[j]], u_s.at[j, 0]),
                       (u_lo_ref.at[b, tokens, h, halves[j]], u_s.at[j, 1]),
                       (dx_hi_ref.at[b, tokens, h, halves[j]], x_s.at[j, 0]),
                       (dx_lo_ref.at[b, tokens, h, halves[j]], x_s.at[j, 1])]
        copies += [(vec_ref.at[n, bh, tokens], ref) for n, ref in enumerate(row_vec.values())]
        copies.append((vec_ref.at[n_row, bh, tokens], col_doc))
        for src, dst in copies:
            plgpu.copy_gmem_to_smem(src, dst, loads)
        # The 0/1 tiles, read by both warpgroups after `handoff[0]`, which follows this warpgroup's commit.
        row = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=plgpu.Layout.WGMMA)
        col = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=plgpu.Layout.WGMMA)
        for n, mask in enumerate((row >= 0, col >= row, col < row)):
            const_s.at[n][...] = mc.wgmma_layout(jnp.where(mask, 1.0, 0.0).astype(BF16))

    r = types.SimpleNamespace(s0_s=s0_s, ds_s=ds_s, do_s=do_s, u_s=u_s, x_s=x_s, p_s=p_s, r_s=r_s, const_s=const_s,
                              row_vec=row_vec, col_doc=col_doc, loads=loads, handoff=handoff, release=release)
    roles = []
    for w in range(2):
        own = pl.ds(w * HALF, HALF)
        gmem = types.SimpleNamespace(
            q=q_ref.at[b, tokens, key_head, own], k=k_ref.at[b, tokens, key_head, own],
            g=g_ref.at[b, tokens, h, own], glo=glo_ref.at[b, tokens, h, own], v=v_ref.at[b, tokens, h, halves[w]],
            r=r_ref.at[b, tokens, h, :])
        out = types.SimpleNamespace(
            dq=dq_ref.at[b, tokens, h, own], dk=dk_ref.at[b, tokens, h, own], dv=dv_ref.at[b, tokens, h, halves[w]],
            dlog=dlog_ref.at[b, tokens, h, own], dbeta=dbeta_ref.at[w, bh, tokens])
        roles.append(functools.partial(_warpgroup, w, r, chan_vec[w], gmem, out, scale=scale, segmented=segmented,
                                       concurrent=threads == 2))
    mc.run_roles(roles, wg, threads)


def _split3(x):
    """x (fp32) = x1 + x2 + x3 exactly as three bf16 values (an fp32 significand is three bf16 ones)."""
    x1 = x.astype(BF16)
    rest = x - x1.astype(F32)
    x2 = rest.astype(BF16)
    return x1, x2, (rest - x2.astype(F32)).astype(BF16)


def _warpgroup(w, r, chan, gmem, out, *, scale, segmented, concurrent):
    """Warpgroup w's share of one chunk, a generator that yields between its steps so that one warpgroup can also
    run both roles in turn (`concurrent=False`: no barriers between the roles; the first steps of both store the
    squares, the second steps are the last reads of dO, u and dx, which only the third steps overwrite).

    Step 1: the square (w = 0: dP, w = 1: dM), stored as its bf16 pair (`handoff[w]`). Step 2: dv and dbeta's
    value part of V half w, dP's diagonal, the state terms of the warpgroup's channels (then `release`), dbeta's
    share, the survival sums and dE's sum (into d(log_decay)'s output). Step 3: the pair terms, dq, dk, and dG's sum
    added to d(log_decay)."""
    C = CHUNK
    load = lambda ref: plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False).astype(F32)
    pair = lambda tiles: mc.wgmma_layout(load(tiles.at[0]) + load(tiles.at[1]))
    transposed = lambda ref: ref.transpose((1, 0))
    rows = lambda x, m=C: mc.broadcast_rows(x, m)
    acc = lambda: mc.acc(C, C)

    def accumulate(products):
        def body(acc_ref):
            for a_operand, b_operand in products:
                plgpu.wgmma(acc_ref, a_operand, b_operand)
            return mc.read(acc_ref)
        return pl.run_scoped(body, acc())

    if concurrent or w == 0:
        plgpu.barrier_wait(r.loads)
    beta = mc.row_vector(r.row_vec["beta"])
    _, strict = mc.chunk_masks(r.row_vec["doc"], r.col_doc, C, segmented)

    # Step 1: the square, masked to s < t in one document (dP's diagonal s = t is dp_self, below).
    if w == 0:
        square = accumulate([(r.do_s.at[j], transposed(r.u_s.at[j, part])) for j in range(2) for part in range(2)])
        mc.store_split(jnp.where(strict, scale * square, 0.0), r.p_s.at[0], r.p_s.at[1])
        r_term = None
    else:
        square = accumulate([(r.x_s.at[j, x_part], transposed(r.u_s.at[j, u_part])) for j in range(2)
                             for x_part, u_part in ((0, 0), (0, 1), (1, 0))])
        dm = mc.wgmma_layout(jnp.where(strict, -square, 0.0))
        mc.store_split(rows(beta) * dm, r.r_s.at[0], r.r_s.at[1])
        r_term = jnp.sum(dm * load(gmem.r), axis=1)  # dbeta through R's factor diag(beta)
    plgpu.commit_smem()
    if concurrent:
        plgpu.barrier_arrive(r.handoff.at[w])
    yield

    # Step 2: the state terms of this warpgroup's channels, each product folded into running sums of dq, dk and dG as
    # soon as it is read (so that at most one accumulator and three running C x 64 tiles are live: keeping every
    # term to the end spilled 3.5 KB per thread); dv, dbeta's value part (V half w) and dP's diagonal first.
    dx = pair(r.x_s.at[w])
    mc.store_rounded(rows(beta, HALF) * dx, out.dv)
    dbeta = jnp.sum(dx * load(gmem.v), axis=1)
    dp_self = scale * sum(jnp.sum(load(r.do_s.at[j]) * pair(r.u_s.at[j]), axis=1) for j in range(2))
    s0_t = [transposed(r.s0_s.at[w, j]) for j in range(2)]
    ds_t = [transposed(r.ds_s.at[w, j]) for j in range(2)]

    # The boundary factors of this warpgroup's channels. q and k stay in registers as bf16, G only as from_end:
    # to_end = 1 / from_end and A = carry exp(G_C) to_end are formed again where used. (Each GMEM tile load costs
    # latency that one CTA per SM does not hide, and keeping every fp32 factor live spilled.)
    q16, k16 = (plgpu.load(ref, layout=plgpu.Layout.WGMMA, optimized=False) for ref in (gmem.q, gmem.k))
    q, k = (lambda: q16.astype(F32)), (lambda: k16.astype(F32))
    above_end = mc.wgmma_layout((load(gmem.g) - mc.cols(chan["g_hi_end"], C))
                                + (load(gmem.glo) - mc.cols(chan["g_lo_end"], C)))  # G_t - G_C >= 0
    from_end_tile = mc.wgmma_layout(jnp.exp(-above_end))  # exp(G_C - G_t) <= 1
    from_end = lambda: from_end_tile
    to_end = lambda: mc.wgmma_layout(1.0 / from_end_tile)
    a = mc.wgmma_layout(mc.rows(r.row_vec["carry"], HALF) * mc.cols(chan["exp_g_end"], C) * to_end())

    dqa = scale * accumulate([(r.do_s.at[j], s0_t[j]) for j in range(2)])
    dq = mc.wgmma_layout(a * dqa + rows(dp_self, HALF) * k())
    dg = mc.wgmma_layout(a * q() * dqa)
    dxs = accumulate([(r.x_s.at[j, part], s0_t[j]) for j in range(2) for part in range(2)])
    a_k = mc.wgmma_layout(a * k())
    dbeta = dbeta - jnp.sum(a_k * dxs, axis=1)
    dka = mc.wgmma_layout(-rows(beta, HALF) * dxs)
    dg = mc.wgmma_layout(dg + a_k * dka)
    dk = mc.wgmma_layout(a * dka + rows(dp_self, HALF) * q())
    dke = accumulate([(r.u_s.at[j, part], ds_t[j]) for j in range(2) for part in range(2)])
    if concurrent:
        plgpu.barrier_arrive(r.release)  # this warpgroup's last read of dO, u and dx
    e = mc.wgmma_layout(mc.rows(r.row_vec["tail"], HALF) * from_end())
    dk = mc.wgmma_layout(dk + e * dke)
    de = mc.wgmma_layout(k() * dke * e)
    if r_term is not None:
        dbeta = dbeta + r_term
    out.dbeta[...] = dbeta

    # The survival sums (every token's row) and dE's sum over s < r, in this warpgroup's S_0 and dS tiles (read for
    # the last time above); their sum waits in d(log_decay)'s output until dG's is added.
    ones, from_here, before = (r.const_s.at[n] for n in range(len(CONSTANTS)))
    own = [r.s0_s.at[w, 0], r.s0_s.at[w, 1], r.ds_s.at[w, 0], r.ds_s.at[w, 1]]
    for j in range(2):
        survive = load(r.s0_s.at[w, j]) * load(r.ds_s.at[w, j])  # exact: a product of two bf16 values
        mc.store_split(survive, r.s0_s.at[w, j], r.ds_s.at[w, j])
    plgpu.commit_smem()
    if concurrent and w == 1:
        plgpu.barrier_wait(r.handoff.at[0])  # the 0/1 tiles, and dP
    survival = mc.cols(chan["gamma"], C) * accumulate([(ones, transposed(t)) for t in own])
    for part, t in zip(_split3(de), own[:3]):
        t[...] = mc.wgmma_layout(part)
    plgpu.commit_smem()
    out.dlog[...] = mc.wgmma_layout(survival + accumulate([(before, t) for t in own[:3]]))
    yield

    # Step 3: the pair terms, split at the chunk's last gate, in this warpgroup's tiles and V half w's of dx.
    if concurrent:
        plgpu.barrier_wait(r.release)  # dO, u and dx are read: V half w's tiles are this warpgroup's
        if w == 0:
            plgpu.barrier_wait(r.handoff.at[1])  # dR (warpgroup 1 waited for dP before the survival sums)
    k_from, q_to, k_to = own[:2], own[2:], [r.x_s.at[w, 0], r.x_s.at[w, 1]]
    mc.store_split(k() * from_end(), *k_from)
    mc.store_split(q() * to_end(), *q_to)
    mc.store_split(k() * to_end(), *k_to)
    plgpu.commit_smem()
    split_terms = lambda a_pair, b_pair: [(a_pair[0], b_pair[0]), (a_pair[0], b_pair[1]), (a_pair[1], b_pair[0])]
    p_pair, r_pair = (r.p_s.at[0], r.p_s.at[1]), (r.r_s.at[0], r.r_s.at[1])
    left_p = mc.wgmma_layout(to_end() * accumulate(split_terms(p_pair, k_from)))
    mc.store_rounded(dq + left_p, out.dq)
    dg = mc.wgmma_layout(dg + q() * left_p)
    left_r = mc.wgmma_layout(to_end() * accumulate(split_terms(r_pair, k_from)))
    dk = mc.wgmma_layout(dk + left_r)
    dg = mc.wgmma_layout(dg + k() * left_r)
    p_t, r_t = tuple(map(transposed, p_pair)), tuple(map(transposed, r_pair))
    right = mc.wgmma_layout(from_end() * accumulate(split_terms(p_t, q_to) + split_terms(r_t, k_to)))
    mc.store_rounded(dk + right, out.dk)
    dg = mc.wgmma_layout(dg - k() * right)

    # dG's sum over t >= r, in tiles the pair terms have read, added to what d(log_decay)'s output holds.
    sums = own[:2] + k_to[:1]
    for part, t in zip(_split3(dg), sums):
        t[...] = mc.wgmma_layout(part)
    plgpu.commit_smem()
    from_later = accumulate([(from_here, t) for t in sums])
    out.dlog[...] = mc.wgmma_layout(load(out.dlog) + from_later)


def token_vectors(beta, carry, tail, doc):
    """The per-token vectors (5, B*Hv, Tp) fp32 in `ROW_VECTORS`' order, then doc again (read as columns). beta
    (B, Tp, Hv); carry, tail, doc (B, Tp)."""
    B, Tp, H = beta.shape
    heads_major = lambda x: jnp.moveaxis(jnp.broadcast_to(x, (B, Tp, H)), 2, 1).reshape(B * H, Tp)
    per_token = [x.astype(F32)[:, :, None] for x in (carry, tail, doc)]
    return jnp.stack([heads_major(beta.astype(F32))] + [heads_major(x) for x in per_token + per_token[-1:]])


def channel_vectors(g, glo, carry):
    """Per chunk and channel (4, B*Hv, nt*K) fp32 in `CHANNEL_VECTORS`' order: G's hi and lo at the chunk's last
    token, gamma = carry_C exp(G_C) and exp(G_C). g, glo (B, Tp, Hv, K); carry (B, Tp)."""
    B, Tp, H, K = g.shape
    last = lambda x: x[:, CHUNK - 1::CHUNK]  # (B, nt, ...)
    hi, lo = last(g), last(glo)
    survive = jnp.exp(hi + lo)
    gamma = last(carry)[:, :, None, None] * survive
    heads_major = lambda x: jnp.moveaxis(x, 2, 1).reshape(B * H, -1)
    return jnp.stack([heads_major(x) for x in (hi, lo, gamma, survive)])


def _scratch_types():
    C = CHUNK
    tiles = (mc.tiled((2, 2, HALF, HALF)), mc.tiled((2, 2, HALF, HALF)),  # S_0, dS: [channel half, V half]
             mc.tiled((2, C, HALF)), mc.tiled((2, 2, C, HALF)), mc.tiled((2, 2, C, HALF)),  # dO, u, dx: [V half]
             mc.tiled((2, C, C)), mc.tiled((2, C, C)), mc.tiled((len(CONSTANTS), C, C)))  # dP, dR pairs; 0/1 tiles
    vectors = tuple(plgpu.SMEM((C,), F32) for _ in range(len(ROW_VECTORS) + 1))
    vectors += tuple(plgpu.SMEM((HALF,), F32) for _ in range(2 * len(CHANNEL_VECTORS)))
    n_copies = 2 * (2 * 2 + len(CHANNEL_VECTORS)) + 2 * 5 + len(ROW_VECTORS) + 1  # `_body`'s copies
    barriers = (plgpu.Barrier(num_arrivals=n_copies), plgpu.Barrier(num_arrivals=1, num_barriers=2),
                plgpu.Barrier(num_arrivals=2))
    return tiles + vectors + barriers


def grads(q, k, v, beta, g, glo, doc, carry, tail, saved, r, starts, dends, do, *, scale, segmented, interpret):
    """(dq, dk, dv, dbeta, d(log_decay)) as `kda._grads_fused` returns them: padded inputs (Tp a multiple of 64),
    q, k (B, Tp, H, K) and v, dO (B, Tp, Hv, V) bf16, beta (B, Tp, Hv), G's hi and lo (B, Tp, Hv, K), doc, carry,
    tail (B, Tp), `saved` = (u hi, u lo, dx hi, dx lo) as the passes write them, R (B, Tp, Hv, C) fp32, starts and
    dends (B, Hv, nt*K, V) bf16. Every chunk must span at most `kda.SPAN_LIMIT` (the caller's check)."""
    B, Tp, key_heads, K = q.shape
    H, V = v.shape[2:]
    check_supported(key_dim=K, value_dim=V, chunk_size=CHUNK, dtype=q.dtype)
    if Tp % CHUNK or H % key_heads:
        raise ValueError(f"grads: Tp must be a multiple of {CHUNK} and Hv of H, got Tp={Tp}, H={key_heads}, Hv={H}")
    group = H // key_heads
    nt = Tp // CHUNK
    dqk_dtype = q.dtype if group == 1 else F32
    out_type = (jax.ShapeDtypeStruct((B, Tp, H, K), dqk_dtype), jax.ShapeDtypeStruct((B, Tp, H, K), dqk_dtype),
                jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), F32),
                jax.ShapeDtypeStruct((2, B * H, Tp), F32))
    # Two warpgroups compiled; in the interpreter one runs both roles in turn (`mosaic_wy_grads.grads`: a thread
    # blocked in a barrier wait can starve the other of host threads on few CPU cores).
    threads = 1 if interpret else 2
    kernel = mc.kernel(
        functools.partial(_body, scale=float(scale), num_heads=H, group=group, segmented=segmented, threads=threads),
        out_type=out_type, scratch_types=_scratch_types(), grid=(nt, B * H), grid_names=("chunk", "head"),
        num_threads=threads, thread_name="wg",
        # Every reduction is along the rows, within a warp: no SMEM for cross-warp ones.
        compiler_params=plgpu.CompilerParams(reduction_scratch_bytes=0),
        interpret=interpret,
        kernel_name="kda_grads_mosaic")
    dq, dk, dv, dlog, dbeta = kernel(q, k, v, g.astype(F32), glo.astype(F32), r.astype(F32), do, *saved, starts,
                                     dends, token_vectors(beta, carry, tail, doc), channel_vectors(g, glo, carry))
    dbeta = jnp.moveaxis((dbeta[0] + dbeta[1]).reshape(B, H, Tp), 1, 2)
    return dq, dk, dv, dbeta, dlog
