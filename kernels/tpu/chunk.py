"""The chunkwise WY form of the delta rule and of linear attention as Mosaic TPU kernels, forward and backward.

The math is the one of `deltajax.rules.chunk` (its docstring has every formula). Per chunk of C tokens, with S_0
the state at the chunk's start, G the in-chunk cumulative log-decay, and masks for "same document":

    R   = (K K^T) (.) Gamma_strict,   Gamma_ts = exp(G_t - G_s) for s < t (s <= t for P), same document
    T   = (I + diag(beta) R)^-1                        forward substitution, fp32 (no triangular_solve in Mosaic)
    W   = T diag(beta a) K,   U0 = T diag(beta) V,   a_t = carry_t exp(G_t)
    U   = U0 - W S_0                                   (linear attention: U = V)
    O   = scale [ diag(a) Q S_0 + ((Q K^T) (.) Gamma_incl) U ]
    S_1 = gamma S_0 + (diag(e) K)^T U,   e_s = tail_s exp(G_C - G_s),   gamma = carry_C exp(G_C)

Two kernels, each on the grid (B * Hv "parallel", chunks "arbitrary") with the chunk axis last, so one program
walks the chunks of one (batch, value head) in order while the fp32 state lives in a VMEM scratch:

    _forward        O and the final state (or, for the backward, every chunk's start state S_0)
    _backward       chunks in reverse: dS in a VMEM scratch; dq, dk, dv, dbeta, dG, dE and d(initial state)

A training step runs three `pallas_call`s: the forward, the forward again emitting chunk states, the backward.

The gate cumsum, the document masks carry/tail and the cumsums dG, dE -> d(log_decay) are elementwise work done
in XLA around the kernels (Mosaic has no cumsum). Head dims are zero-padded to multiples of 128 lanes; padded
channels stay zero in every product. Per-token gates enter as (C, 1) column blocks and (1, C) row blocks of
[..., N, 1, C] arrays, both legal under the (8, 128) rule because their small dims are full array dims.

Products of two bf16 inputs (Q K^T, K K^T) use the MXU's bf16 path, which is exact before the fp32 accumulation;
every product with an fp32 operand (T, W, U, the state, decays) runs at HIGHEST precision.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from deltajax.rules.common import document_index

LANES = 128
CHUNK_SIZES = (16, 32, 64, 128)
MAX_HEAD_DIM = 256
# Scoped-VMEM request bounds: the default scoped limit is 16 MiB on v5e and 32 MiB on v6e; 64 MiB is a v7x
# TensorCore's whole VMEM, so no configuration we accept may ask for more.
MIN_VMEM_LIMIT = 16 * 2**20
MAX_VMEM_LIMIT = 64 * 2**20
F32 = jnp.float32


class Config(NamedTuple):
    """Static facts of one call: what the kernels are specialised on."""

    delta: bool  # delta rule (True) or linear attention (False)
    gated: bool  # a scalar log-decay per token and value head
    packed: bool  # segment_ids given
    has_initial_state: bool
    scale: float
    chunk_size: int
    group: int  # value heads per key head
    value_heads: int
    key_dim: int
    value_dim: int


def _round_up(x, m):
    return -(-x // m) * m


# ----------------------------------------------------------------------------------------------------------------
# Block specs and the VMEM budget

def block_specs(cfg, reverse: bool):
    """BlockSpecs for the grid (bh, j) of both kernel families (`cfg`: this module's or `kda`'s Config); chunk j of
    the walk is chunk N-1-j when `reverse`."""
    C = cfg.chunk_size
    Kp, Vp = _round_up(cfg.key_dim, LANES), _round_up(cfg.value_dim, LANES)
    Hv, group = cfg.value_heads, cfg.group

    def chunk(j):
        return (pl.num_programs(1) - 1 - j) if reverse else j

    # lax.div/rem: grid indices are non-negative, and `//` on ints lowers through sign(), which needs a TPU.
    # lax.div/rem take no mixed dtypes: constants take the index's dtype (int32), which Python ints do not
    # under jax_enable_x64.
    batch = lambda bh: lax.div(bh, jnp.asarray(Hv, bh.dtype))
    head = lambda bh: lax.rem(bh, jnp.asarray(Hv, bh.dtype))
    key_head = lambda bh, j: (batch(bh), lax.div(head(bh), jnp.asarray(group, bh.dtype)), chunk(j), 0)
    value_head = lambda bh, j: (batch(bh), head(bh), chunk(j), 0)
    value_head_row = lambda bh, j: (batch(bh), head(bh), chunk(j), 0, 0)
    per_batch = lambda bh, j: (batch(bh), chunk(j), 0)
    per_batch_row = lambda bh, j: (batch(bh), chunk(j), 0, 0)
    state = lambda bh, j: (batch(bh), head(bh), 0, 0)
    return dict(
        key=pl.BlockSpec((None, None, C, Kp), key_head),
        value=pl.BlockSpec((None, None, C, Vp), value_head),
        value_key=pl.BlockSpec((None, None, C, Kp), value_head),
        column=pl.BlockSpec((None, None, C, 1), value_head),
        row=pl.BlockSpec((None, None, None, 1, C), value_head_row),
        channel_column=pl.BlockSpec((None, None, None, Kp, 1), value_head_row),  # KDA's per-chunk gamma
        batch_column=pl.BlockSpec((None, C, 1), per_batch),
        batch_row=pl.BlockSpec((None, None, 1, C), per_batch_row),
        state=pl.BlockSpec((None, None, Kp, Vp), state),
        chunk_state=pl.BlockSpec((None, None, None, Kp, Vp), value_head_row),
    )


def vmem_need(cfg: Config, in_bytes: int, backward: bool) -> int:
    """Bytes of VMEM one program needs: double-buffered blocks, the state scratch and the chunk temporaries.

    (C, 1) blocks occupy C x 128 lanes and (1, C) blocks 8 sublanes x roundup(C, 128) in VMEM.
    """
    C = cfg.chunk_size
    Kp, Vp = _round_up(cfg.key_dim, LANES), _round_up(cfg.value_dim, LANES)
    Cl = _round_up(C, LANES)
    column, row, state = C * LANES * 4, 8 * Cl * 4, Kp * Vp * 4
    blocks = 2 * C * Kp * in_bytes + 2 * C * Vp * in_bytes  # q, k, v, o
    blocks += 8 * column + 5 * row + 2 * state  # gates, masks, initial and final (or chunk start) state
    if backward:  # dO in; dq, dk, dv, dbeta, dG, dE, dG rows out
        blocks += C * Vp * in_bytes + 2 * C * Kp * 4 + C * Vp * 4 + 3 * column + row
    # Live chunk temporaries: about eight C x C fp32 matrices and eight C x max(Kp, Vp) fp32 tiles (twice that
    # in the backward), plus the scratch state.
    temporaries = (8 * C * Cl + 8 * C * max(Kp, Vp)) * 4 * (2 if backward else 1) + state
    return 2 * blocks + temporaries


def vmem_limit(need: int) -> int:
    """`vmem_limit_bytes` for programs that need `need` bytes (an estimate): 1.5 x it, at least the v5e default
    scoped limit and at most `MAX_VMEM_LIMIT`."""
    return int(min(max(_round_up(need * 3 // 2, 2**20), MIN_VMEM_LIMIT), MAX_VMEM_LIMIT))


def vmem_fits(need: int) -> bool:
    """Whether `vmem_limit` grants `need` bytes 1.5 x without clamping to `MAX_VMEM_LIMIT`."""
    return need * 3 // 2 <= MAX_VMEM_LIMIT


def vmem_budget(cfg: Config, in_bytes: int, backward: bool) -> int:
    return vmem_limit(vmem_need(cfg, in_bytes, backward))


def fits_vmem(cfg: Config, in_bytes: int) -> bool:
    """Whether the backward (the larger kernel) gets 1.5 x its estimated need within `MAX_VMEM_LIMIT`."""
    return vmem_fits(vmem_need(cfg, in_bytes, backward=True))


# ----------------------------------------------------------------------------------------------------------------
# Math shared by the kernels (values, not refs)

def _dot(a, b, *, transpose_b=False):
    """a @ b (or a @ b^T) accumulated in fp32; exact bf16 x bf16 on the MXU, HIGHEST precision otherwise."""
    if a.dtype == b.dtype == jnp.bfloat16:
        precision = lax.Precision.DEFAULT
    else:
        a, b = a.astype(F32), b.astype(F32)
        precision = lax.Precision.HIGHEST
    contract = ((1,), (1,)) if transpose_b else ((1,), (0,))
    return lax.dot_general(a, b, (contract, ((), ())), precision=precision, preferred_element_type=F32)


def _dot_t(a, b):
    """a^T @ b for fp32 operands (Mosaic transposes the (C, D) tile in vregs)."""
    return _dot(a.astype(F32).T, b)


def _row_sum(x):
    return jnp.sum(x, axis=1, keepdims=True)


def _col_sum(x):
    return jnp.sum(x, axis=0, keepdims=True)


def _unit_lower_inverse(strict_t, C):
    """(I + A)^-1 for strictly lower A, given A^T; exact fp32 forward substitution over rows.

    Row i of X = (I + A)^-1 is e_i - sum_{j<i} A_ij X_j; the loop invariant is that rows 0..i-1 of X are final
    and rows >= i still hold the identity. Reading A's row i as a column of A^T keeps every step a lane-mask,
    a lane reduction, a broadcast multiply and a sublane reduction: VPU/XLU work, no MXU round trips.
    """
    rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    lanes = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    x = (rows == lanes).astype(F32)

    def step(i, x):
        a_i = _row_sum(jnp.where(lanes == i, strict_t, 0.0))  # (C, 1): A[i, :]^T
        update = _col_sum(a_i * x)  # (1, C): sum_j A_ij X_j
        return jnp.where(rows == i, x - update, x)

    return lax.fori_loop(1, C, step, x)


class _Gates(NamedTuple):
    incl: jax.Array  # (C, C) Gamma on s <= t, same document (0 elsewhere)
    strict: jax.Array  # (C, C) Gamma on s < t
    strict_t: jax.Array  # (C, C) its transpose, Gamma_st on s > t
    a: jax.Array  # (C, 1) carry_t exp(G_t)
    e: jax.Array  # (C, 1) tail_s exp(G_C - G_s)
    gamma: jax.Array  # (1, 1) carry_C exp(G_C)
    last: jax.Array  # (C, 1) bool, the chunk's last token


def _gates(cfg: Config, g, g_row, g_lo, g_lo_row, doc, doc_row, carry, tail):
    """Decays and masks of one chunk. Masks are applied before every exp; all exponents are <= 0.

    G = g + g_lo (a compensated cumsum, see `_cumulative_log_decay`): differences G_t - G_s subtract the large
    parts first, so pairs whose decay is near 1 keep full relative accuracy even after a -20 gate.
    """
    C = cfg.chunk_size
    rows = lax.broadcasted_iota(jnp.int32, (C, C), 0)
    lanes = lax.broadcasted_iota(jnp.int32, (C, C), 1)
    incl, strict, upper = lanes <= rows, lanes < rows, lanes > rows
    if cfg.packed:
        same = doc == doc_row  # (C, 1) vs (1, C)
        incl, strict, upper = incl & same, strict & same, upper & same
    last = lax.broadcasted_iota(jnp.int32, (C, 1), 0) == C - 1
    if cfg.packed:
        carry_last = jnp.sum(jnp.where(last, carry, 0.0), axis=0, keepdims=True)
    else:
        carry, tail, carry_last = (jnp.ones((C, 1), F32),) * 2 + (jnp.ones((1, 1), F32),)
    if not cfg.gated:
        incl_f, strict_f, upper_f = (m.astype(F32) for m in (incl, strict, upper))
        return _Gates(incl_f, strict_f, upper_f, carry, tail, carry_last, last)

    def masked_exp(mask, x):
        return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)

    diff = (g - g_row) + (g_lo - g_lo_row)  # G_t - G_s
    g_last = jnp.sum(jnp.where(last, g, 0.0), axis=0, keepdims=True)  # (1, 1)
    g_lo_last = jnp.sum(jnp.where(last, g_lo, 0.0), axis=0, keepdims=True)
    return _Gates(
        incl=masked_exp(incl, diff),
        strict=masked_exp(strict, diff),
        strict_t=masked_exp(upper, -diff),
        a=carry * (jnp.exp(g) * jnp.exp(g_lo)),
        e=tail * jnp.exp((g_last - g) + (g_lo_last - g_lo)),
        gamma=carry_last * (jnp.exp(g_last) * jnp.exp(g_lo_last)),
        last=last,
    )


def _wy_factors(cfg: Config, k, v, beta, beta_row, gates: _Gates):
    """T = (I + diag(beta) R)^-1, W = T diag(beta a) K, U0 = T diag(beta) V and R = K K^T (.) Gamma_strict."""
    kk = _dot(k, k, transpose_b=True)  # symmetric, so it serves R and R^T
    r = kk * gates.strict
    a_t = kk * gates.strict_t * beta_row  # A^T, A = diag(beta) R
    t = _unit_lower_inverse(a_t, cfg.chunk_size)
    w = _dot(t, (beta * gates.a) * k.astype(F32))
    u0 = _dot(t, beta * v.astype(F32))
    return t, w, u0, r


# ----------------------------------------------------------------------------------------------------------------
# Forward: O and the final state, or every chunk's start state

def _unpack(cfg: Config, refs, backward: bool):
    """Names the kernel's refs in the order `_inputs` and the out/scratch specs build them."""
    refs = list(refs)
    take = lambda: refs.pop(0)
    x = dict(q=take(), k=take(), v=take())
    if cfg.delta:
        x["beta"], x["beta_row"] = take(), take()
    if cfg.gated:
        x["g"], x["g_row"], x["g_lo"], x["g_lo_row"] = take(), take(), take(), take()
    if cfg.packed:
        x["doc"], x["doc_row"], x["carry"], x["tail"] = take(), take(), take(), take()
    if backward:
        x["chunk_state"], x["do"], x["d_final"] = take(), take(), take()
    elif cfg.has_initial_state:
        x["initial_state"] = take()
    x["rest"] = refs
    return x


def _load_gates(cfg: Config, x):
    get = lambda name: x[name][...] if name in x else None
    return _gates(cfg, get("g"), get("g_row"), get("g_lo"), get("g_lo_row"), get("doc"), get("doc_row"),
                  get("carry"), get("tail"))


def forward_kernel(unpack, forward_chunk, cfg, emit_states: bool, *refs):
    """The forward program of either kernel family at chunk j = program_id(1): `unpack(cfg, refs, backward=False)`
    names the refs; `forward_chunk(cfg, emit_states, x, first_out, s0)` writes chunk j's output (or S_0) and
    returns S_1. S_0 comes from the VMEM scratch (at j = 0, the initial state, or zeros), S_1 goes back into it and,
    at the last chunk, into the final state."""
    x = unpack(cfg, refs, backward=False)
    first_out, final_ref, state_ref = x["rest"]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        if "initial_state" in x:
            state_ref[...] = x["initial_state"][...]
        else:
            state_ref[...] = jnp.zeros_like(state_ref)

    # Invariant: state_ref holds S_0 of chunk j, the state after every token of chunks 0..j-1.
    s1 = forward_chunk(cfg, emit_states, x, first_out, state_ref[...])
    state_ref[...] = s1

    @pl.when(j == pl.num_programs(1) - 1)
    def _store_final():
        final_ref[...] = s1


def _forward_chunk(cfg: Config, emit_states: bool, x, first_out, s0):
    """Chunk j's output (or its start state S_0) into `first_out`; returns S_1."""
    q, k, v = x["q"][...], x["k"][...], x["v"][...]
    gates = _load_gates(cfg, x)
    if cfg.delta:
        _, w, u0, _ = _wy_factors(cfg, k, v, x["beta"][...], x["beta_row"][...], gates)
        u = u0 - _dot(w, s0)
    else:
        u = v.astype(F32)
    if emit_states:
        first_out[...] = s0
    else:
        p = _dot(q, k, transpose_b=True) * gates.incl
        o = cfg.scale * (_dot(gates.a * q.astype(F32), s0) + _dot(p, u))
        first_out[...] = o.astype(first_out.dtype)
    return gates.gamma * s0 + _dot_t(gates.e * k.astype(F32), u)


def _inputs(cfg: Config, prepared, specs, backward: bool):
    """(arrays, in_specs) in the order `_unpack` reads them."""
    arrays = [prepared["q"], prepared["k"], prepared["v"]]
    in_specs = [specs["key"], specs["key"], specs["value"]]
    if cfg.delta:
        arrays += [prepared["beta"], prepared["beta_row"]]
        in_specs += [specs["column"], specs["row"]]
    if cfg.gated:
        arrays += [prepared["g"], prepared["g_row"], prepared["g_lo"], prepared["g_lo_row"]]
        in_specs += [specs["column"], specs["row"], specs["column"], specs["row"]]
    if cfg.packed:
        arrays += [prepared["doc"], prepared["doc_row"], prepared["carry"], prepared["tail"]]
        in_specs += [specs["batch_column"], specs["batch_row"], specs["batch_column"], specs["batch_column"]]
    if not backward and cfg.has_initial_state:
        arrays.append(prepared["initial_state"])
        in_specs.append(specs["state"])
    return arrays, in_specs


def chunk_walk_call(kernel, arrays, in_specs, outputs, *, chunk_size, vmem_limit_bytes, name):
    """`kernel` on the grid (B * Hv "parallel", chunks "arbitrary") with a Kp x Vp fp32 VMEM scratch for the state
    it carries from chunk to chunk. `arrays`: q, k [B, H, Tp, Kp] and v [B, Hv, Tp, Vp] first, then the rest,
    with their `in_specs`; `outputs`: (ShapeDtypeStruct, BlockSpec) pairs."""
    Kp, (B, Hv, Tp, Vp) = arrays[0].shape[-1], arrays[2].shape
    return pl.pallas_call(
        kernel,
        grid=(B * Hv, Tp // chunk_size),
        in_specs=in_specs,
        out_specs=[spec for _, spec in outputs],
        out_shape=[shape for shape, _ in outputs],
        scratch_shapes=[pltpu.VMEM((Kp, Vp), F32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary"),
                                             vmem_limit_bytes=vmem_limit_bytes),
        name=name,
    )(*arrays)


def forward_call(unpack, forward_chunk, cfg, arrays, specs, in_specs, emit_states: bool, *, vmem_limit_bytes, name):
    """(O [B, Hv, Tp, Vp] or chunk start states [B, Hv, N, Kp, Vp] fp32, final state [B, Hv, Kp, Vp] fp32) of the
    forward program (`forward_kernel` on `unpack` and `forward_chunk`), named `name` + "_forward" or "_states"."""
    chunk_size = cfg.chunk_size
    kernel = functools.partial(forward_kernel, unpack, forward_chunk, cfg, emit_states)
    Kp, v = arrays[0].shape[-1], arrays[2]
    B, Hv, Tp, Vp = v.shape
    if emit_states:
        first = (jax.ShapeDtypeStruct((B, Hv, Tp // chunk_size, Kp, Vp), F32), specs["chunk_state"])
    else:
        first = (jax.ShapeDtypeStruct((B, Hv, Tp, Vp), v.dtype), specs["value"])
    final = (jax.ShapeDtypeStruct((B, Hv, Kp, Vp), F32), specs["state"])
    return chunk_walk_call(kernel, arrays, in_specs, [first, final], chunk_size=chunk_size,
                           vmem_limit_bytes=vmem_limit_bytes, name=name + ("_states" if emit_states else "_forward"))


def _forward(cfg: Config, prepared, emit_states: bool):
    specs = block_specs(cfg, reverse=False)
    arrays, in_specs = _inputs(cfg, prepared, specs, backward=False)
    return forward_call(_unpack, _forward_chunk, cfg, arrays, specs, in_specs, emit_states, name="delta_rule_chunk",
                        vmem_limit_bytes=vmem_budget(cfg, prepared["q"].dtype.itemsize, backward=False))


# ----------------------------------------------------------------------------------------------------------------
# Backward: chunks in reverse, dS carried in VMEM

def backward_kernel(unpack, backward_chunk, output_names, cfg, *refs):
    """The reverse program of either kernel family at step j = program_id(1), which visits the chunks last to first:
    `unpack(cfg, refs, backward=True)` names the refs, the outputs in the order of `output_names` (d_initial last),
    then the dS scratch; `backward_chunk(cfg, x, out, ds1, s0)` writes the chunk's gradients into `out` (a dict by
    name) from dL/dS_1 and the saved S_0, and returns dL/dS_0. dL/dS_1 comes from the VMEM scratch (at j = 0, the
    final state's cotangent), dL/dS_0 goes back into it and, after the first chunk, into d_initial."""
    x = unpack(cfg, refs, backward=True)
    out = dict(zip(output_names, x["rest"]))
    dstate_ref = x["rest"][-1]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dstate_ref[...] = x["d_final"][...]

    # Invariant: dstate_ref holds dL/dS_1 of the chunk visited at step j (the gradient at its end).
    ds0 = backward_chunk(cfg, x, out, dstate_ref[...], x["chunk_state"][...])
    dstate_ref[...] = ds0

    @pl.when(j == pl.num_programs(1) - 1)
    def _store_initial():
        out["d_initial"][...] = ds0


def _backward_chunk(cfg: Config, x, out, ds1, s0):
    """Chunk j's dq, dk, dv (and dbeta, dg, dg_row, de) into `out`; returns dL/dS_0."""
    q, k, v = x["q"][...], x["k"][...], x["v"][...]
    do = x["do"][...].astype(F32)
    qf, kf, vf = q.astype(F32), k.astype(F32), v.astype(F32)
    gates = _load_gates(cfg, x)
    scale = cfg.scale
    if cfg.delta:
        beta = x["beta"][...]
        t, w, u0, r = _wy_factors(cfg, k, v, beta, x["beta_row"][...], gates)
        u = u0 - _dot(w, s0)
    else:
        u = vf
    kk_q = _dot(q, k, transpose_b=True)
    p = kk_q * gates.incl
    ke = gates.e * kf

    # Through O = scale (Q_a S_0 + P U) and S_1 = gamma S_0 + K_e^T U.
    du = scale * _dot_t(p, do) + _dot(ke, ds1)
    dp = scale * _dot(do, u, transpose_b=True)
    dqa = scale * _dot(do, s0, transpose_b=True)
    dke = _dot(u, ds1, transpose_b=True)
    ds0 = scale * _dot_t(gates.a * qf, do) + gates.gamma * ds1
    d_gamma = jnp.sum(jnp.sum(s0 * ds1, axis=1, keepdims=True), axis=0, keepdims=True)

    dp_gamma = dp * gates.incl  # d(Q K^T)
    dq = _dot(dp_gamma, kf) + gates.a * dqa
    dk = _dot_t(dp_gamma, qf) + gates.e * dke
    # d(G_t - G_s) of the output's pair decays, over s < t only. The pair t = s has decay exp(0) = 1 whatever the
    # gates: it reaches dq, dk through dp_gamma but would enter dG as +x (row sum) and -x (column sum) at one
    # token through two different roundings, leaving O(eps x) that swamps d(log_decay) ~ exp(-20) at -20 gates.
    dpp = dp * (kk_q * gates.strict)
    dg = _row_sum(dpp)
    dg_row = -_col_sum(dpp)
    da = _row_sum(qf * dqa)
    de = _row_sum(kf * dke)

    if cfg.delta:
        # Through U = U0 - W S_0, W = T B_w, U0 = T B_u (X = T B gives dB = T^T dX, dA = -dB X^T).
        ds0 = ds0 - _dot_t(w, du)
        dw = -_dot(du, s0, transpose_b=True)
        db_w = _dot_t(t, dw)
        db_u = _dot_t(t, du)
        da_strict = -(_dot(db_w, w, transpose_b=True) + _dot(db_u, u0, transpose_b=True))
        kdb_w = _row_sum(kf * db_w)
        dk = dk + (beta * gates.a) * db_w
        dv = beta * db_u
        da = da + beta * kdb_w
        dbeta = gates.a * kdb_w + _row_sum(vf * db_u) + _row_sum(da_strict * r)
        # Through A = diag(beta) (K K^T (.) Gamma_strict).
        dr = beta * da_strict
        dkk = dr * gates.strict
        dk = dk + _dot(dkk, kf) + _dot_t(dkk, kf)
        drr = dr * r
        dg = dg + _row_sum(drr)
        dg_row = dg_row - _col_sum(drr)
        out["dbeta"][...] = dbeta
    else:
        dv = du

    if cfg.gated:
        # a_t = carry_t exp(G_t) and gamma = carry_C exp(G_C) go into dG. e_s = tail_s exp(G_C - G_s) depends on
        # the gates after s only: its share of d(log_decay)_r is sum_{s<r} de_s e_s, an exclusive cumsum done in
        # XLA from the dE output. Sent through dG instead (-x at s, +x at the last token) it would cancel in the
        # reverse cumsum only to O(eps x), and e_s = 1 exactly for the last token (G_C - G_C) and for the last
        # real token before a padded tail, where d(log_decay) ~ exp(-20) at -20 gates.
        dg = dg + da * gates.a + jnp.where(gates.last, d_gamma * gates.gamma, 0.0)
        out["dg"][...] = dg
        out["dg_row"][...] = dg_row
        out["de"][...] = de * gates.e

    out["dq"][...] = dq
    out["dk"][...] = dk
    out["dv"][...] = dv
    return ds0


def _backward_outputs(cfg: Config):
    names = ["dq", "dk", "dv"]
    if cfg.delta:
        names.append("dbeta")
    if cfg.gated:
        names += ["dg", "dg_row", "de"]
    return names + ["d_initial"]


def _backward(cfg: Config, prepared, chunk_states, do, d_final):
    """A dict of fp32 gradients per value head: dq, dk [B, Hv, Tp, Kp], dv [B, Hv, Tp, Vp], dbeta, dg and de
    (columns [B, Hv, Tp, 1]), dg_row [B, Hv, N, 1, C] and d_initial [B, Hv, Kp, Vp]; dG = dg + dg_row, and de is
    dE (.) e, the share of e_s = tail_s exp(G_C - G_s)."""
    q, v = prepared["q"], prepared["v"]
    B, _, Tp, Kp = q.shape
    Hv, Vp, C = cfg.value_heads, v.shape[-1], cfg.chunk_size
    N = Tp // C
    specs = block_specs(cfg, reverse=True)
    arrays, in_specs = _inputs(cfg, prepared, specs, backward=True)
    arrays += [chunk_states, do, d_final]
    in_specs += [specs["chunk_state"], specs["value"], specs["state"]]
    column = (jax.ShapeDtypeStruct((B, Hv, Tp, 1), F32), specs["column"])
    outputs = dict(
        dq=(jax.ShapeDtypeStruct((B, Hv, Tp, Kp), F32), specs["value_key"]),
        dk=(jax.ShapeDtypeStruct((B, Hv, Tp, Kp), F32), specs["value_key"]),
        dv=(jax.ShapeDtypeStruct((B, Hv, Tp, Vp), F32), specs["value"]),
        dbeta=column, dg=column, de=column,
        dg_row=(jax.ShapeDtypeStruct((B, Hv, N, 1, C), F32), specs["row"]),
        d_initial=(jax.ShapeDtypeStruct((B, Hv, Kp, Vp), F32), specs["state"]))
    names = _backward_outputs(cfg)
    kernel = functools.partial(backward_kernel, _unpack, _backward_chunk, names, cfg)
    results = chunk_walk_call(kernel, arrays, in_specs, [outputs[name] for name in names], chunk_size=C,
                              name="delta_rule_chunk_backward",
                              vmem_limit_bytes=vmem_budget(cfg, q.dtype.itemsize, backward=True))
    return dict(zip(names, results))


# ----------------------------------------------------------------------------------------------------------------
# Layout in and out of the kernels (XLA), and the custom_vjp

def _heads_first(x, pad_t, pad_d):
    """[B, T, H, D] -> [B, H, T + pad_t, D + pad_d]."""
    x = jnp.swapaxes(x, 1, 2)
    return jnp.pad(x, ((0, 0), (0, 0), (0, pad_t), (0, pad_d)))


def _cumulative_log_decay(log_decay):
    """In-chunk G_t = sum_{r <= t} log_decay_r along the last axis as g + g_lo (Neumaier's compensated sum).

    A plain fp32 cumsum rounds every small gate added after a large one (-1e-4 after -20 loses ~4% of itself),
    and the error reaches exp(G_t - G_s) of pairs that should decay by ~1; g_lo keeps what g rounded away.
    """
    def step(carry, x):
        total, compensation = carry
        new = total + x
        lost = jnp.where(jnp.abs(total) >= jnp.abs(x), (total - new) + x, (x - new) + total)
        carry = (new, compensation + lost)
        return carry, carry

    zeros = jnp.zeros(log_decay.shape[:-1], F32)
    _, (g, g_lo) = lax.scan(step, (zeros, zeros), jnp.moveaxis(log_decay, -1, 0))
    return jnp.moveaxis(g, 0, -1), jnp.moveaxis(g_lo, 0, -1)


def _as_row(x, C):
    """[B, Hv, Tp, 1] -> [B, Hv, N, 1, C]."""
    B, H, Tp, _ = x.shape
    return x.reshape(B, H, Tp // C, 1, C)


def _prepare(cfg: Config, q, k, v, beta, log_decay, initial_state, segment_ids):
    B, T = q.shape[:2]
    C = cfg.chunk_size
    Tp = _round_up(T, C)
    N = Tp // C
    pad = Tp - T
    pad_k = _round_up(cfg.key_dim, LANES) - cfg.key_dim
    pad_v = _round_up(cfg.value_dim, LANES) - cfg.value_dim
    # Padded tokens have k = v = 0, beta = 0 and no decay: they leave the state unchanged.
    prepared = dict(q=_heads_first(q, pad, pad_k), k=_heads_first(k, pad, pad_k), v=_heads_first(v, pad, pad_v))

    def column(x):  # [B, T, Hv] -> [B, Hv, Tp, 1] fp32
        return _heads_first(x.astype(F32)[..., None], pad, 0)

    if cfg.delta:
        prepared["beta"] = column(beta)
        prepared["beta_row"] = _as_row(prepared["beta"], C)
    if cfg.gated:
        g, g_lo = _cumulative_log_decay(column(log_decay).reshape(B, cfg.value_heads, N, C))
        prepared["g"], prepared["g_lo"] = (x.reshape(B, cfg.value_heads, Tp, 1) for x in (g, g_lo))
        prepared["g_row"], prepared["g_lo_row"] = g[:, :, :, None, :], g_lo[:, :, :, None, :]
    if cfg.packed:
        doc = jnp.pad(document_index(segment_ids, B, T), ((0, 0), (0, pad)), mode="edge").reshape(B, N, C)
        doc_before = jnp.concatenate([doc[:, :1, :1], doc[:, :-1, -1:]], axis=1)  # open document at chunk start
        prepared["doc"] = doc.reshape(B, Tp, 1)
        prepared["doc_row"] = doc[:, :, None, :]
        prepared["carry"] = (doc == doc_before).astype(F32).reshape(B, Tp, 1)
        prepared["tail"] = (doc == doc[:, :, -1:]).astype(F32).reshape(B, Tp, 1)
    if cfg.has_initial_state:
        prepared["initial_state"] = jnp.pad(initial_state.astype(F32), ((0, 0), (0, 0), (0, pad_k), (0, pad_v)))
    return prepared


def recomputing_op(prepare, forward, backward, gate_gradients):
    """A kernel family's op (cfg, q, k, v, beta, log_decay, initial_state, segment_ids) -> (o, final state) as a
    `custom_vjp`. `prepare(cfg, *inputs)` lays the inputs out for the kernels (`_prepare`); `forward(cfg, prepared,
    emit_states)` and `backward(cfg, prepared, chunk_states, do, d_final)` run them (`_forward`, `_backward`);
    `gate_gradients(cfg, inputs, prepared, grads)` turns the backward's per-token gradients into (d_beta,
    d_log_decay). The residuals are the inputs only: the backward recomputes the chunk states (Kp x Vp per chunk)
    and factors."""

    def run_forward(cfg, q, k, v, beta, log_decay, initial_state, segment_ids):
        prepared = prepare(cfg, q, k, v, beta, log_decay, initial_state, segment_ids)
        o, final = forward(cfg, prepared, emit_states=False)
        o = jnp.swapaxes(o[:, :, :q.shape[1], :cfg.value_dim], 1, 2)
        return o, final[:, :, :cfg.key_dim, :cfg.value_dim]

    @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
    def op(cfg, q, k, v, beta, log_decay, initial_state, segment_ids):
        return run_forward(cfg, q, k, v, beta, log_decay, initial_state, segment_ids)

    def op_fwd(cfg, q, k, v, beta, log_decay, initial_state, segment_ids):
        inputs = (q, k, v, beta, log_decay, initial_state, segment_ids)
        return run_forward(cfg, *inputs), inputs

    def op_bwd(cfg, inputs, cotangents):
        q, k, v, beta, log_decay, initial_state, segment_ids = inputs
        do, d_final = cotangents
        B, T, H, K = q.shape
        V = cfg.value_dim
        prepared = prepare(cfg, *inputs)
        chunk_states, _ = forward(cfg, prepared, emit_states=True)
        Tp, Kp, Vp = prepared["q"].shape[2], prepared["q"].shape[3], prepared["v"].shape[3]
        do = _heads_first(do, Tp - T, Vp - V)
        d_final = jnp.pad(d_final.astype(F32), ((0, 0), (0, 0), (0, Kp - K), (0, Vp - V)))
        grads = backward(cfg, prepared, chunk_states, do, d_final)

        def to_key_heads(x):  # [B, Hv, Tp, Kp] -> [B, T, H, K], summing each key head's value heads
            x = x.reshape(B, H, cfg.group, Tp, Kp).sum(axis=2)
            return jnp.swapaxes(x[:, :, :T, :K], 1, 2).astype(q.dtype)

        d_beta, d_log_decay = gate_gradients(cfg, inputs, prepared, grads)
        d_v = jnp.swapaxes(grads["dv"][:, :, :T, :V], 1, 2).astype(v.dtype)
        d_initial = None
        if initial_state is not None:
            d_initial = grads["d_initial"][:, :, :K, :V].astype(initial_state.dtype)
        return to_key_heads(grads["dq"]), to_key_heads(grads["dk"]), d_v, d_beta, d_log_decay, d_initial, None

    op.defvjp(op_fwd, op_bwd)
    return op


def _gate_gradients(cfg: Config, inputs, prepared, grads):
    """(d_beta [B, T, Hv] or None, d_log_decay [B, T, Hv] or None) from the backward's columns."""
    q, _, _, beta, log_decay, _, _ = inputs
    B, T = q.shape[:2]
    Hv, C, Tp = cfg.value_heads, cfg.chunk_size, prepared["q"].shape[2]

    def token_major(x):  # [B, Hv, Tp, 1] -> [B, T, Hv]
        return jnp.swapaxes(x[:, :, :T, 0], 1, 2)

    d_beta = token_major(grads["dbeta"]).astype(beta.dtype) if cfg.delta else None
    d_log_decay = None
    if cfg.gated:
        N = Tp // C
        d_cum = (grads["dg"] + grads["dg_row"].reshape(B, Hv, Tp, 1)).reshape(B, Hv, N, C)
        d_step = jnp.flip(jnp.cumsum(jnp.flip(d_cum, -1), axis=-1), -1)  # G_t = sum_{t' <= t} log_decay_t'
        # e_s = tail_s exp(G_C - G_s) depends on the gates r > s: the exclusive forward cumsum sum_{s<r} de_s
        # (shifted, never cumsum - de, which would bring back the O(eps x) residue).
        de = grads["de"].reshape(B, Hv, N, C)
        d_step = d_step + jnp.cumsum(jnp.pad(de[..., :-1], ((0, 0),) * 3 + ((1, 0),)), axis=-1)
        d_log_decay = token_major(d_step.reshape(B, Hv, Tp, 1)).astype(log_decay.dtype)
    return d_beta, d_log_decay


_chunked = recomputing_op(_prepare, _forward, _backward, _gate_gradients)


def make_config(q, v, beta, log_decay, initial_state, segment_ids, *, scale, chunk_size) -> Config:
    return Config(delta=beta is not None, gated=log_decay is not None, packed=segment_ids is not None,
                  has_initial_state=initial_state is not None, scale=float(scale), chunk_size=int(chunk_size),
                  group=v.shape[2] // q.shape[2], value_heads=v.shape[2], key_dim=q.shape[3],
                  value_dim=v.shape[3])


def chunked(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
            state_passing="sequential"):
    """Both ops (`beta is None` is linear attention) through the Mosaic TPU kernels; shapes as in the dispatch.

    States always pass sequentially inside the kernel; `state_passing` only changes how the XLA form would
    associate the chunk maps, not the result, so both values are accepted.
    """
    del state_passing
    if log_decay is not None and log_decay.ndim != 3:
        raise ValueError("the TPU kernels take log_decay None or [B, T, Hv] (one decay per value head)")
    cfg = make_config(q, v, beta, log_decay, initial_state, segment_ids, scale=scale, chunk_size=chunk_size)
    return _chunked_jit(cfg, q, k, v, beta, log_decay, initial_state, segment_ids)


# Eager callers get one compilation per configuration and shapes instead of one per call.
_chunked_jit = jax.jit(_chunked, static_argnums=0)
