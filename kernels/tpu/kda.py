"""KDA (the delta rule with one log-decay per key channel) as Mosaic TPU kernels, forward and backward.

The math is the one of `deltajax.rules.chunk` with per-channel gates. Per chunk of C tokens, with S_0 the state at
the chunk's start, G [C, K] the in-chunk cumulative log-decay of every key channel, D_tsc = exp(G_tc - G_sc) and
masks for "same document":

    P_ts = sum_c q_tc k_sc D_tsc  (s <= t)         R_ts = sum_c k_tc k_sc D_tsc  (s < t)
    T    = (I + diag(beta) R)^-1                   forward substitution, fp32 (no triangular_solve in Mosaic)
    W    = T diag(beta) (A (.) K),  U0 = T diag(beta) V,   A_tc = carry_t exp(G_tc)
    U    = U0 - W S_0
    O    = scale [ (A (.) Q) S_0 + P U ]
    S_1  = Diag(gamma) S_0 + (E (.) K)^T U,   E_sc = tail_s exp(G_Cc - G_sc),   gamma_c = carry_C exp(G_Cc)

Unlike a scalar gate, D_tsc does not factor out of the sum over channels, so P and R are not one masked product.
They are built from 16-token sub-chunks so that no exponent is ever positive (log-decays of -20 per token would
overflow exp(-G_s) within a few tokens):

  * a pair in different sub-chunks, t in a later one than s's sub-chunk j, splits at the reference gate G_ref,
    the gate of sub-chunk j's last token: D_ts = exp(G_t - G_ref) exp(G_ref - G_s), both factors <= 1. One MXU
    product per j covers every such pair: (Q (.) to_ref_j) (K (.) from_ref_j)^T with to_ref_j zero outside the
    later sub-chunks and from_ref_j zero outside sub-chunk j;
  * a pair in one sub-chunk takes its exact exponent, masked before exp. A loop over the 16 offsets r pairs every
    token with the token at offset r of its own sub-chunk (its "partner"), giving one C x C column per sub-chunk
    and offset as an elementwise product and a lane reduction.

The backward needs the same decayed pairs in the other direction: with dP, dR the pair-matrix gradients,
left(M, b)_tc = sum_s M_ts b_sc D_tsc and right(M, a)_sc = sum_t M_ts a_tc D_tsc give dq, dk and dG, with the
same split.

Two kernels, each on the grid (B * Hv "parallel", chunks "arbitrary") with the chunk axis last, so one program
walks the chunks of one (batch, value head) in order while the fp32 state lives in a VMEM scratch:

    _forward        O and the final state (or, for the backward, every chunk's start state S_0)
    _backward       chunks in reverse: dS in a VMEM scratch; dq, dk, dv, dbeta, dG, dE, dgamma, d(initial state)

A training step runs three `pallas_call`s: the forward, the forward again emitting chunk states, the backward.
The compensated gate cumsum, gamma, the document flags and the reverse cumsum dG -> d(log_decay) are done in XLA
around the kernels (Mosaic has no cumsum). Q and K stay per key head in HBM: the index maps send value head h to
key head h // group, and dq, dk come out per value head and are summed over each group in XLA.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from deltajax.kernels.tpu.chunk import (
    CHUNK_SIZES,
    F32,
    LANES,
    MAX_HEAD_DIM,
    MAX_VMEM_LIMIT,
    _as_row,
    _cumulative_log_decay,
    _dot,
    _dot_t,
    _heads_first,
    _round_up,
    _row_sum,
    _unit_lower_inverse,
    backward_kernel,
    block_specs,
    chunk_walk_call,
    forward_call,
    recomputing_op,
    vmem_fits,
    vmem_limit,
)
from deltajax.rules.common import document_index

SUB_CHUNK = 16

__all__ = ["CHUNK_SIZES", "MAX_HEAD_DIM", "SUB_CHUNK", "Config", "chunked", "fits_vmem", "make_config",
           "vmem_budget", "vmem_need"]


class Config(NamedTuple):
    """Static facts of one call: what the kernels are specialised on."""

    packed: bool  # segment_ids given
    has_initial_state: bool
    scale: float
    chunk_size: int
    group: int  # value heads per key head
    value_heads: int
    key_dim: int
    value_dim: int


# ----------------------------------------------------------------------------------------------------------------
# The VMEM budget (block specs: `chunk.block_specs`)

def vmem_need(cfg: Config, in_bytes: int, backward: bool) -> int:
    """Bytes of VMEM one program needs: double-buffered blocks, the state scratch and the chunk temporaries.

    (C, 1) and (Kp, 1) blocks occupy C (Kp) x 128 lanes, (1, C) blocks 8 sublanes x roundup(C, 128) in VMEM.
    """
    C = cfg.chunk_size
    Kp, Vp = _round_up(cfg.key_dim, LANES), _round_up(cfg.value_dim, LANES)
    Cl = _round_up(C, LANES)
    column, row, state = C * LANES * 4, 8 * Cl * 4, Kp * Vp * 4
    gamma = Kp * LANES * 4
    blocks = 2 * C * Kp * in_bytes + 2 * C * Vp * in_bytes  # q, k, v, o
    blocks += 2 * C * Kp * 4 + gamma  # the cumulative gates g, g_lo and gamma
    blocks += 4 * column + 2 * row + 2 * state  # beta, doc, carry, tail; beta and doc rows; initial and final
    if backward:  # dO and d(final) in; dq, dk, dG, dE, dv, dbeta, dgamma out
        blocks += C * Vp * in_bytes + state + 4 * C * Kp * 4 + C * Vp * 4 + column + gamma
    # Live chunk temporaries: C x C fp32 matrices (pair matrices, T, masks, their gradients) and C x max(Kp, Vp)
    # fp32 tiles (decays, partners, reference factors, W, U, products), plus the scratch state.
    wide = max(Kp, Vp)
    if backward:
        temporaries = (18 * C * Cl + 32 * C * wide) * 4
    else:
        temporaries = (8 * C * Cl + 16 * C * wide) * 4
    return 2 * blocks + temporaries + state


def vmem_budget(cfg: Config, in_bytes: int, backward: bool) -> int:
    return vmem_limit(vmem_need(cfg, in_bytes, backward))


def fits_vmem(cfg: Config, in_bytes: int) -> bool:
    """Whether the backward (the larger kernel) gets 1.5 x its estimated need within `MAX_VMEM_LIMIT`."""
    return vmem_fits(vmem_need(cfg, in_bytes, backward=True))


# ----------------------------------------------------------------------------------------------------------------
# Chunk math shared by the kernels (values, not refs)

class _Geometry(NamedTuple):
    """Token positions of one chunk and their sub-chunks (sub-chunk size a power of two)."""

    sub: int
    rows: jax.Array  # (C, 1) token index t
    lanes: jax.Array  # (C, C) column index s
    block: jax.Array  # (C, 1) sub-chunk of t
    offset: jax.Array  # (C, 1) position of t inside its sub-chunk
    base: jax.Array  # (C, 1) first token of t's sub-chunk


def _geometry(C: int) -> _Geometry:
    sub = min(SUB_CHUNK, C)
    shift = sub.bit_length() - 1
    rows = lax.broadcasted_iota(jnp.int32, (C, 1), 0)
    # Shifts and masks rather than integer division: the TPU VPU has no vector integer divide.
    block = lax.shift_right_logical(rows, jnp.int32(shift))
    return _Geometry(sub=sub, rows=rows, lanes=lax.broadcasted_iota(jnp.int32, (C, C), 1), block=block,
                     offset=rows & (sub - 1), base=lax.shift_left(block, jnp.int32(shift)))


def _masked_exp(mask, x):
    """exp(x) where `mask`, else 0; the mask is applied before exp, so unselected exponents never overflow."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def _row_at(x, rows, i):
    """Row i of x as (1, D): a masked sublane sum, exact (one term and zeros)."""
    return jnp.sum(jnp.where(rows == i, x, 0.0), axis=0, keepdims=True)


def _partner(geo: _Geometry, x, r):
    """Row t -> row base_t + r of x: every token sees the token at offset r of its own sub-chunk.

    A masked sum over the sub-chunk and a sublane broadcast, exact in fp32; `r` may be a loop index.
    """
    C, D = x.shape
    n = C // geo.sub
    picked = jnp.where(geo.offset == r, x, 0.0).reshape(n, geo.sub, D)
    per_block = jnp.sum(picked, axis=1, keepdims=True)
    return jnp.broadcast_to(per_block, (n, geo.sub, D)).reshape(C, D)


def _reference_split(geo: _Geometry, g, g_lo, j: int):
    """(to_ref, from_ref) for sub-chunk j: exp(G_t - G_s) = to_ref_t from_ref_s, t in a later sub-chunk, s in j.

    G_ref is the gate of sub-chunk j's last token, so G_t <= G_ref <= G_s and both exponents are <= 0.
    `to_ref` is zero on rows of sub-chunks <= j, `from_ref` outside sub-chunk j. G = g + g_lo is compensated:
    differences take the large parts first.
    """
    ref_token = geo.sub * (j + 1) - 1
    ref, ref_lo = _row_at(g, geo.rows, ref_token), _row_at(g_lo, geo.rows, ref_token)
    to_ref = _masked_exp(geo.block > j, (g - ref) + (g_lo - ref_lo))
    from_ref = _masked_exp(geo.block == j, (ref - g) + (ref_lo - g_lo))
    return to_ref, from_ref


def _partner_decays(geo: _Geometry, g, g_lo, r):
    """(after, before) for the partner p = base_t + r of every token t, exact per channel:

    after_t = exp(G_t - G_p) where p < t, before_t = exp(G_p - G_t) where p > t, 0 elsewhere. The pair p = t is
    left out: its decay is the constant 1, which the callers add without exp so that it never enters dG.
    """
    diff = (g - _partner(geo, g, r)) + (g_lo - _partner(geo, g_lo, r))  # G_t - G_p
    return _masked_exp(geo.offset > r, diff), _masked_exp(geo.offset < r, -diff)


class _Masks(NamedTuple):
    """(C, C) fp32 masks of one chunk: s <= t / s < t and the same document, and their transposes."""

    incl: jax.Array
    strict: jax.Array
    incl_t: jax.Array  # [s, t]: t >= s
    strict_t: jax.Array


def _masks(cfg: Config, geo: _Geometry, doc, doc_row):
    rows, lanes = geo.rows, geo.lanes
    incl, strict, incl_t, strict_t = lanes <= rows, lanes < rows, lanes >= rows, lanes > rows
    if cfg.packed:
        same = doc == doc_row  # (C, 1) vs (1, C): symmetric, so it serves both orientations
        incl, strict, incl_t, strict_t = incl & same, strict & same, incl_t & same, strict_t & same
    return _Masks(*(m.astype(F32) for m in (incl, strict, incl_t, strict_t)))


def _pair_matrices(geo: _Geometry, q, k, g, g_lo, masks: _Masks, names):
    """The decayed pair matrices in `names` (fp32 q, k of shape (C, Kp)):

    p[t, s] = P_ts, pt[s, t] = P_ts (P^T), r[t, s] = R_ts, rt[s, t] = R_ts (R^T); each masked to its pattern.
    Transposes come from swapped operands, not from transposing C x C tiles.
    """
    C = q.shape[0]
    n = C // geo.sub
    zeros = jnp.zeros((C, C), F32)
    out = {name: zeros for name in names}
    for j in range(n - 1):
        to_ref, from_ref = _reference_split(geo, g, g_lo, j)
        q_to, k_to, k_from = q * to_ref, k * to_ref, k * from_ref
        later_by_j = dict(p=(q_to, k_from), pt=(k_from, q_to), r=(k_to, k_from), rt=(k_from, k_to))
        for name in names:
            out[name] = out[name] + _dot(*later_by_j[name], transpose_b=True)

    def diagonal(r, out):
        after, before = _partner_decays(geo, g, g_lo, r)
        q_p = _partner(geo, q, r) if "pt" in names else None
        k_p = _partner(geo, k, r) if set(names) & {"p", "r", "rt"} else None
        # Entry [t, base_t + r] of each matrix; rows whose partner lies on the other side get 0 from the decay.
        entries = dict(p=lambda: q * k_p * after, pt=lambda: k * q_p * before, r=lambda: k * k_p * after,
                       rt=lambda: k * k_p * before)
        column = geo.lanes == geo.base + r
        return {name: jnp.where(column, _row_sum(entries[name]()), out[name]) for name in names}

    out = lax.fori_loop(0, geo.sub, diagonal, out)
    if "p" in names or "pt" in names:  # P_tt = q_t . k_t, undecayed
        self_pairs = jnp.where(geo.lanes == geo.rows, _row_sum(q * k), 0.0)
        out = {name: out[name] + self_pairs if name in ("p", "pt") else out[name] for name in names}
    pattern = dict(p=masks.incl, pt=masks.incl_t, r=masks.strict, rt=masks.strict_t)
    return {name: out[name] * pattern[name] for name in names}


def _decayed_products(geo: _Geometry, q, k, g, g_lo, dp, dr, dpt, drt):
    """(left(dP, K), left(dR, K), right(dP, Q) + right(dR, K)) over the pairs s < t, with

    left(M, B)_tc = sum_{s<t} M_ts B_sc D_tsc and right(M, A)_sc = sum_{t>s} M_ts A_tc D_tsc, given M and M^T
    (dpt, drt). The pairs s = t (only in dP) have the constant decay 1: the caller adds them to dq and dk only.
    """
    C, Kp = q.shape
    n = C // geo.sub
    left_p = left_r = right = jnp.zeros((C, Kp), F32)
    for j in range(n - 1):
        to_ref, from_ref = _reference_split(geo, g, g_lo, j)
        k_from = k * from_ref
        left_p = left_p + to_ref * _dot(dp, k_from)
        left_r = left_r + to_ref * _dot(dr, k_from)
        right = right + from_ref * (_dot(dpt, q * to_ref) + _dot(drt, k * to_ref))

    def diagonal(r, carry):
        left_p, left_r, right = carry
        after, before = _partner_decays(geo, g, g_lo, r)
        q_p, k_p = _partner(geo, q, r), _partner(geo, k, r)
        column = geo.lanes == geo.base + r
        pick = lambda m: _row_sum(jnp.where(column, m, 0.0))  # m[t, base_t + r] as a column
        left_p = left_p + pick(dp) * k_p * after
        left_r = left_r + pick(dr) * k_p * after
        right = right + (pick(dpt) * q_p + pick(drt) * k_p) * before
        return left_p, left_r, right

    return lax.fori_loop(0, geo.sub, diagonal, (left_p, left_r, right))


class _Boundary(NamedTuple):
    a: jax.Array  # (C, Kp) carry_t exp(G_tc)
    e: jax.Array  # (C, Kp) tail_s exp(G_Cc - G_sc)


def _boundary(cfg: Config, geo: _Geometry, g, g_lo, carry, tail):
    C = cfg.chunk_size
    g_last, g_lo_last = _row_at(g, geo.rows, C - 1), _row_at(g_lo, geo.rows, C - 1)
    a = jnp.exp(g) * jnp.exp(g_lo)
    e = jnp.exp((g_last - g) + (g_lo_last - g_lo))
    if cfg.packed:
        a, e = carry * a, tail * e
    return _Boundary(a, e)


def _unpack(cfg: Config, refs, backward: bool):
    """Names the kernel's refs in the order `_inputs` and the out/scratch specs build them."""
    refs = list(refs)
    take = lambda: refs.pop(0)
    x = dict(q=take(), k=take(), v=take(), beta=take(), beta_row=take(), g=take(), g_lo=take(), gamma=take())
    if cfg.packed:
        x["doc"], x["doc_row"], x["carry"], x["tail"] = take(), take(), take(), take()
    if backward:
        x["chunk_state"], x["do"], x["d_final"] = take(), take(), take()
    elif cfg.has_initial_state:
        x["initial_state"] = take()
    x["rest"] = refs
    return x


class _Chunk(NamedTuple):
    """Everything one chunk's forward computes before touching the state."""

    geo: _Geometry
    masks: _Masks
    bound: _Boundary
    pairs: dict
    t: jax.Array  # (I + diag(beta) R)^-1
    w: jax.Array
    u0: jax.Array


def _chunk(cfg: Config, x, qf, kf, vf, pair_names) -> _Chunk:
    C = cfg.chunk_size
    geo = _geometry(C)
    packed = (x["doc"][...], x["doc_row"][...], x["carry"][...], x["tail"][...]) if cfg.packed else (None,) * 4
    doc, doc_row, carry, tail = packed
    g, g_lo = x["g"][...], x["g_lo"][...]
    beta, beta_row = x["beta"][...], x["beta_row"][...]
    masks = _masks(cfg, geo, doc, doc_row)
    bound = _boundary(cfg, geo, g, g_lo, carry, tail)
    pairs = _pair_matrices(geo, qf, kf, g, g_lo, masks, pair_names)
    t = _unit_lower_inverse(pairs["rt"] * beta_row, C)  # A^T = R^T diag(beta)
    w = _dot(t, (beta * bound.a) * kf)
    u0 = _dot(t, beta * vf)
    return _Chunk(geo, masks, bound, pairs, t, w, u0)


# ----------------------------------------------------------------------------------------------------------------
# Forward: O and the final state, or every chunk's start state

def _forward_chunk(cfg: Config, emit_states: bool, x, first_out, s0):
    """Chunk j's output (or its start state S_0) into `first_out`; returns S_1."""
    qf, kf, vf = (x[name][...].astype(F32) for name in ("q", "k", "v"))
    c = _chunk(cfg, x, qf, kf, vf, ("rt",) if emit_states else ("p", "rt"))
    u = c.u0 - _dot(c.w, s0)
    if emit_states:
        first_out[...] = s0
    else:
        o = cfg.scale * (_dot(c.bound.a * qf, s0) + _dot(c.pairs["p"], u))
        first_out[...] = o.astype(first_out.dtype)
    return x["gamma"][...] * s0 + _dot_t(c.bound.e * kf, u)


def _inputs(cfg: Config, prepared, specs, backward: bool):
    """(arrays, in_specs) in the order `_unpack` reads them."""
    arrays = [prepared[name] for name in ("q", "k", "v", "beta", "beta_row", "g", "g_lo", "gamma")]
    in_specs = [specs["key"], specs["key"], specs["value"], specs["column"], specs["row"], specs["value_key"],
                specs["value_key"], specs["channel_column"]]
    if cfg.packed:
        arrays += [prepared["doc"], prepared["doc_row"], prepared["carry"], prepared["tail"]]
        in_specs += [specs["batch_column"], specs["batch_row"], specs["batch_column"], specs["batch_column"]]
    if not backward and cfg.has_initial_state:
        arrays.append(prepared["initial_state"])
        in_specs.append(specs["state"])
    return arrays, in_specs


def _forward(cfg: Config, prepared, emit_states: bool):
    specs = block_specs(cfg, reverse=False)
    arrays, in_specs = _inputs(cfg, prepared, specs, backward=False)
    return forward_call(_unpack, _forward_chunk, cfg, arrays, specs, in_specs, emit_states, name="kda_chunk",
                        vmem_limit_bytes=vmem_budget(cfg, prepared["q"].dtype.itemsize, backward=False))


# ----------------------------------------------------------------------------------------------------------------
# Backward: chunks in reverse, dS carried in VMEM

BACKWARD_OUTPUTS = ("dq", "dk", "dv", "dbeta", "dg", "de", "dgamma", "d_initial")


def _backward_chunk(cfg: Config, x, out, ds1, s0):
    """Chunk j's dq, dk, dv, dbeta, dg, de and dgamma into `out` (`chunk.backward_kernel` walks the chunks); returns
    dL/dS_0."""
    qf, kf, vf = (x[name][...].astype(F32) for name in ("q", "k", "v"))
    do = x["do"][...].astype(F32)
    beta, beta_row, gamma = x["beta"][...], x["beta_row"][...], x["gamma"][...]
    g, g_lo = x["g"][...], x["g_lo"][...]
    scale = cfg.scale
    c = _chunk(cfg, x, qf, kf, vf, ("p", "pt", "r", "rt"))
    a, e, masks = c.bound.a, c.bound.e, c.masks
    u = c.u0 - _dot(c.w, s0)
    ke = e * kf

    # Through O = scale ((A (.) Q) S_0 + P U) and S_1 = Diag(gamma) S_0 + (E (.) K)^T U.
    du = scale * _dot(c.pairs["pt"], do) + _dot(ke, ds1)
    dp = scale * _dot(do, u, transpose_b=True) * masks.incl
    dpt = scale * _dot(u, do, transpose_b=True) * masks.incl_t
    dqa = scale * _dot(do, s0, transpose_b=True)  # d(A (.) Q)
    dke = _dot(u, ds1, transpose_b=True)  # d(E (.) K)
    ds0 = scale * _dot_t(a * qf, do) + gamma * ds1
    dgamma = _row_sum(s0 * ds1)  # (Kp, 1): gamma scales rows of S_0

    # Through U = U0 - W S_0, W = T B_w, U0 = T B_u (X = T B gives dB = T^T dX, dA = -dB X^T).
    ds0 = ds0 - _dot_t(c.w, du)
    dw = -_dot(du, s0, transpose_b=True)
    db_w = _dot_t(c.t, dw)
    db_u = _dot_t(c.t, du)
    da_strict = -(_dot(db_w, c.w, transpose_b=True) + _dot(db_u, c.u0, transpose_b=True)) * masks.strict
    da_strict_t = -(_dot(c.w, db_w, transpose_b=True) + _dot(c.u0, db_u, transpose_b=True)) * masks.strict_t
    # Through A = diag(beta) R.
    dr, drt = beta * da_strict, da_strict_t * beta_row
    left_p, left_r, right = _decayed_products(c.geo, qf, kf, g, g_lo, dp, dr, dpt, drt)

    # P_tt = q_t . k_t has no decay: it feeds dq and dk but not dG (sending +x and -x through two roundings
    # would leave O(eps x) in dG, which swamps d(log_decay) ~ exp(-20) when gates are -20).
    dp_self = _row_sum(jnp.where(c.geo.lanes == c.geo.rows, dp, 0.0))
    kdb_w = kf * db_w
    out["dq"][...] = a * dqa + left_p + dp_self * kf
    out["dk"][...] = e * dke + (beta * a) * db_w + left_r + right + dp_self * qf
    out["dv"][...] = beta * db_u
    out["dbeta"][...] = _row_sum(a * kdb_w) + _row_sum(vf * db_u) + _row_sum(da_strict * c.pairs["r"])
    # dG: A_tc = carry_t exp(G_tc) and the pair decays exp(G_tc - G_sc); gamma's share (dgamma gamma at the last
    # token) is added in XLA, where gamma is laid out per channel. E_sc = tail_s exp(G_Cc - G_sc) depends on the
    # gates after s only, so its share of d(log_decay)_r is sum_{s<r} dE_s E_s, an exclusive cumsum done in XLA:
    # routing it through dG (-x at s, +x at C) would cancel in the reverse cumsum and leave O(eps x) where E_s
    # is ~1 (a padded or slowly decaying tail) but d(log_decay)_r ~ exp(-20).
    out["dg"][...] = a * (qf * dqa + beta * kdb_w) + qf * left_p + kf * (left_r - right)
    out["de"][...] = kf * dke * e
    out["dgamma"][...] = dgamma
    return ds0


def _backward(cfg: Config, prepared, chunk_states, do, d_final):
    """A dict of fp32 gradients per value head: dq, dk, dg, de [B, Hv, Tp, Kp], dv [B, Hv, Tp, Vp], dbeta
    [B, Hv, Tp, 1], dgamma [B, Hv, N, Kp, 1] and d_initial [B, Hv, Kp, Vp]."""
    q, v = prepared["q"], prepared["v"]
    B, _, Tp, Kp = q.shape
    Hv, Vp, C = cfg.value_heads, v.shape[-1], cfg.chunk_size
    N = Tp // C
    specs = block_specs(cfg, reverse=True)
    arrays, in_specs = _inputs(cfg, prepared, specs, backward=True)
    arrays += [chunk_states, do, d_final]
    in_specs += [specs["chunk_state"], specs["value"], specs["state"]]
    per_token_key = (jax.ShapeDtypeStruct((B, Hv, Tp, Kp), F32), specs["value_key"])
    outputs = dict(
        dq=per_token_key, dk=per_token_key, dg=per_token_key, de=per_token_key,
        dv=(jax.ShapeDtypeStruct((B, Hv, Tp, Vp), F32), specs["value"]),
        dbeta=(jax.ShapeDtypeStruct((B, Hv, Tp, 1), F32), specs["column"]),
        dgamma=(jax.ShapeDtypeStruct((B, Hv, N, Kp, 1), F32), specs["channel_column"]),
        d_initial=(jax.ShapeDtypeStruct((B, Hv, Kp, Vp), F32), specs["state"]))
    kernel = functools.partial(backward_kernel, _unpack, _backward_chunk, BACKWARD_OUTPUTS, cfg)
    results = chunk_walk_call(kernel, arrays, in_specs, [outputs[name] for name in BACKWARD_OUTPUTS], chunk_size=C,
                              name="kda_chunk_backward",
                              vmem_limit_bytes=vmem_budget(cfg, q.dtype.itemsize, backward=True))
    return dict(zip(BACKWARD_OUTPUTS, results))


# ----------------------------------------------------------------------------------------------------------------
# Layout in and out of the kernels (XLA), and the custom_vjp

def _prepare(cfg: Config, q, k, v, beta, log_decay, initial_state, segment_ids):
    B, T = q.shape[:2]
    C, Hv = cfg.chunk_size, cfg.value_heads
    Tp = _round_up(T, C)
    N = Tp // C
    pad = Tp - T
    Kp = _round_up(cfg.key_dim, LANES)
    pad_k = Kp - cfg.key_dim
    pad_v = _round_up(cfg.value_dim, LANES) - cfg.value_dim
    # Padded tokens have k = v = 0, beta = 0 and no decay: they leave the state unchanged. Padded channels have
    # q = k = 0 and no decay, so they stay zero in the state and in every product.
    prepared = dict(q=_heads_first(q, pad, pad_k), k=_heads_first(k, pad, pad_k), v=_heads_first(v, pad, pad_v))
    prepared["beta"] = _heads_first(beta.astype(F32)[..., None], pad, 0)
    prepared["beta_row"] = _as_row(prepared["beta"], C)

    # Compensated in-chunk cumsum over the token axis, per channel: [B, Hv, N, Kp, C] puts tokens last.
    log_decay = _heads_first(log_decay.astype(F32), pad, pad_k).reshape(B, Hv, N, C, Kp)
    g, g_lo = _cumulative_log_decay(jnp.swapaxes(log_decay, -1, -2))
    g, g_lo = jnp.swapaxes(g, -1, -2), jnp.swapaxes(g_lo, -1, -2)  # [B, Hv, N, C, Kp]
    prepared["g"], prepared["g_lo"] = g.reshape(B, Hv, Tp, Kp), g_lo.reshape(B, Hv, Tp, Kp)
    gamma = jnp.exp(g[..., -1, :]) * jnp.exp(g_lo[..., -1, :])  # [B, Hv, N, Kp]
    if cfg.packed:
        doc = jnp.pad(document_index(segment_ids, B, T), ((0, 0), (0, pad)), mode="edge").reshape(B, N, C)
        doc_before = jnp.concatenate([doc[:, :1, :1], doc[:, :-1, -1:]], axis=1)  # open document at chunk start
        carry = (doc == doc_before).astype(F32)
        prepared["doc"] = doc.reshape(B, Tp, 1)
        prepared["doc_row"] = doc[:, :, None, :]
        prepared["carry"] = carry.reshape(B, Tp, 1)
        prepared["tail"] = (doc == doc[:, :, -1:]).astype(F32).reshape(B, Tp, 1)
        # The state survives a chunk only if no document starts inside it.
        gamma = gamma * carry[:, None, :, -1:]
    prepared["gamma"] = gamma[..., None]
    if cfg.has_initial_state:
        prepared["initial_state"] = jnp.pad(initial_state.astype(F32), ((0, 0), (0, 0), (0, pad_k), (0, pad_v)))
    return prepared


def _gate_gradients(cfg: Config, inputs, prepared, grads):
    """(d_beta [B, T, Hv], d_log_decay [B, T, Hv, K]) from the backward's per-token gradients."""
    q, _, _, beta, log_decay, _, _ = inputs
    B, T, _, K = q.shape
    Hv, C = cfg.value_heads, cfg.chunk_size
    Tp, Kp = prepared["q"].shape[2:]
    N = Tp // C
    # gamma_c = carry_C exp(G_Cc) adds dgamma gamma to the last token's dG; then G_t = sum_{t' <= t} log_decay_t'
    # in the chunk turns dG into d(log_decay) by a reverse cumsum. E_s = tail_s exp(G_C - G_s) depends on the
    # gates r > s: its share is the exclusive forward cumsum sum_{s<r} de_s (shifted, never cumsum - de).
    d_cum = grads["dg"].reshape(B, Hv, N, C, Kp)
    d_cum = d_cum.at[:, :, :, -1, :].add((grads["dgamma"] * prepared["gamma"])[..., 0])
    d_step = jnp.flip(jnp.cumsum(jnp.flip(d_cum, 3), axis=3), 3)
    de = grads["de"].reshape(B, Hv, N, C, Kp)
    d_step = d_step + jnp.cumsum(jnp.pad(de[:, :, :, :-1], ((0, 0),) * 3 + ((1, 0), (0, 0))), axis=3)
    d_step = d_step.reshape(B, Hv, Tp, Kp)
    d_log_decay = jnp.swapaxes(d_step[:, :, :T, :K], 1, 2).astype(log_decay.dtype)
    d_beta = jnp.swapaxes(grads["dbeta"][:, :, :T, 0], 1, 2).astype(beta.dtype)
    return d_beta, d_log_decay


_chunked = recomputing_op(_prepare, _forward, _backward, _gate_gradients)


def make_config(q, v, initial_state, segment_ids, *, scale, chunk_size) -> Config:
    return Config(packed=segment_ids is not None, has_initial_state=initial_state is not None,
                  scale=float(scale), chunk_size=int(chunk_size), group=v.shape[2] // q.shape[2],
                  value_heads=v.shape[2], key_dim=q.shape[3], value_dim=v.shape[3])


def chunked(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
            state_passing="sequential"):
    """The delta rule with log_decay [B, T, Hv, K] through the Mosaic TPU kernels; shapes as in the dispatch.

    States always pass sequentially inside the kernel; `state_passing` only changes how the XLA form would
    associate the chunk maps, not the result, so both values are accepted.
    """
    del state_passing
    if beta is None:
        raise ValueError("the KDA TPU kernels implement the delta rule: beta must be given")
    if log_decay is None or log_decay.ndim != 4:
        raise ValueError("the KDA TPU kernels take log_decay [B, T, Hv, K] (one decay per key channel)")
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size}")
    cfg = make_config(q, v, initial_state, segment_ids, scale=scale, chunk_size=chunk_size)
    return _chunked_jit(cfg, q, k, v, beta, log_decay, initial_state, segment_ids)


# Eager callers get one compilation per configuration and shapes instead of one per call.
_chunked_jit = jax.jit(_chunked, static_argnums=0)
