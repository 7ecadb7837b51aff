"""The chunkwise WY/UT form (seed 002) in plain XLA, float32 accumulation.

Split the sequence into chunks of C tokens. Inside a chunk, with the state S_0 at its start, G_t the in-chunk
cumulative log-decay (a scalar or one per key channel) and every pair (t, s) restricted to one document:

    A_ts  = beta_t sum_c k_tc k_sc exp(G_tc - G_sc)          s < t         (strictly lower, C x C)
    W     = (I + A)^-1 diag(beta) (carry * exp(G) * K)       the "w" factor, C x K
    U0    = (I + A)^-1 diag(beta) V                          the "u" factor, C x V
    U     = U0 - W S_0                                       the per-token updates u_t
    O     = scale [ (carry * exp(G) * Q) S_0 + (Q K^T (.) exp(G_t - G_s), s <= t) U ]
    S_end = M S_0 + E,  M = Diag(carry_C exp(G_C)) - K_end^T W,  E = K_end^T U0,
            K_end = tail * exp(G_C - G) * K

(linear attention is the same with W = 0 and U0 = V). `carry_t` says token t still belongs to the document that
was open when the chunk started, `tail_s` that token s belongs to the document open at the chunk's end. Masks are
applied before every `exp`, and every decay is a difference of cumulative log-gates that is <= 0, so nothing can
overflow. Per-channel decays use 16-token sub-chunks with the last gate of the earlier sub-chunk as reference so
that both factors of each product stay <= 1.

Chunk states pass either sequentially (`lax.scan` over chunks) or through the associative composition of the
affine chunk maps S_end = M S_0 + E (`lax.associative_scan`), which is what sequence parallelism builds on.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from deltajax.rules.common import HIGHEST, document_index, repeat_key_heads, zero_state

SUB_CHUNK = 16
# How (I + A)^-1 is formed: "blocked" inverts the 16 x 16 diagonal blocks by fp32 forward substitution and merges
# them (X21 = -X22 L21 X11); "solve" calls XLA's batched triangular solve. Both are exact in fp32.
INVERSE_METHOD = "solve"
INVERSE_BLOCK = 16


def matmul_precision(dtype):
    """fp32 inputs get IEEE fp32 products (the oracle-grade path); 16-bit inputs get the backend's default
    (TF32 tensor cores on GPU) with fp32 accumulation, whose rounding sits below the inputs' own."""
    return HIGHEST if jnp.dtype(dtype) == jnp.float32 else jax.lax.Precision.DEFAULT


def _einsum(spec, *operands, precision=HIGHEST):
    return jnp.einsum(spec, *operands, precision=precision)


def unit_lower_inverse(lower, method=None):
    """(I + A)^-1 for `lower` = I + A, A strictly lower triangular: [..., C, C] float32, exact in fp32.

    Never by Neumann series or doubling (powers of A overflow for correlated keys).
    """
    method = method or INVERSE_METHOD
    C = lower.shape[-1]
    eye = jnp.eye(C, dtype=lower.dtype)
    if method == "solve":
        return jax.lax.linalg.triangular_solve(lower, jnp.broadcast_to(eye, lower.shape), left_side=True,
                                               lower=True, unit_diagonal=True)
    b = min(INVERSE_BLOCK, C)
    n = C // b
    lead = lower.shape[:-2]
    blocks = lower.reshape(*lead, n, b, n, b)
    diagonal = jnp.stack([blocks[..., i, :, i, :] for i in range(n)], axis=-3)  # [..., n, b, b]
    # Forward substitution, row by row: X_i = e_i - sum_{j<i} L_ij X_j (elementwise fp32, no dot precision).
    rows = []
    for i in range(b):
        row = jnp.zeros(diagonal.shape[:-2] + (b,), lower.dtype).at[..., i].set(1.0)
        for j in range(i):
            row = row - diagonal[..., i, j, None] * rows[j]
        rows.append(row)
    inverses = [x for x in jnp.moveaxis(jnp.stack(rows, axis=-2), -3, 0)]  # n blocks of [..., b, b]
    size = b
    while len(inverses) > 1:
        merged = []
        for j in range(0, len(inverses), 2):
            top, bottom = j * size, (j + 1) * size
            l21 = lower[..., bottom:bottom + size, top:top + size]
            x11, x22 = inverses[j], inverses[j + 1]
            x21 = -_einsum("...ij,...jk,...kl->...il", x22, l21, x11)
            zeros = jnp.zeros_like(x11)
            merged.append(jnp.concatenate([jnp.concatenate([x11, zeros], axis=-1),
                                           jnp.concatenate([x21, x22], axis=-1)], axis=-2))
        inverses, size = merged, size * 2
    return inverses[0]


def _to_chunks(x, num_chunks, chunk_size):
    """[B, T_pad, H, ...] -> [B, H, N, C, ...]."""
    B, _, H = x.shape[:3]
    x = x.reshape(B, num_chunks, chunk_size, H, *x.shape[3:])
    return jnp.moveaxis(x, 3, 1)


def _pad_time(x, pad, mode="constant"):
    if pad == 0 or x is None:
        return x
    widths = [(0, 0)] * x.ndim
    widths[1] = (0, pad)
    return jnp.pad(x, widths, mode=mode)


class CumulativeLogDecay(NamedTuple):
    """In-chunk G_t = sum_{r <= t} log_decay_r as hi + lo: hi is the fp32 cumsum, lo what its rounding lost.

    A plain fp32 cumsum rounds each small gate added after a large one (-1e-4 after -20 loses ~2% of itself), and
    differences G_t - G_s of pairs that should decay by ~1 inherit that error. With the split, differences are
    taken part by part, (hi_t - hi_s) + (lo_t - lo_s), and stay accurate to fp32.
    """

    hi: jax.Array
    lo: jax.Array

    @classmethod
    def of(cls, log_decay, axis):
        hi = jnp.cumsum(log_decay, axis=axis)
        before = jnp.concatenate([jnp.zeros_like(jax.lax.slice_in_dim(hi, 0, 1, axis=axis)),
                                  jax.lax.slice_in_dim(hi, 0, hi.shape[axis] - 1, axis=axis)], axis=axis)
        # hi_r - hi_{r-1} and log_decay_r - that are exact (Sterbenz) whenever the step is small against hi,
        # so each term is the exact rounding error of step r.
        return cls(hi, jnp.cumsum(log_decay - (hi - before), axis=axis))

    def map(self, fn):
        return CumulativeLogDecay(fn(self.hi), fn(self.lo))

    def minus(self, other):
        """G_self - G_other, part by part (arguments broadcast)."""
        return (self.hi - other.hi) + (self.lo - other.lo)

    def total(self):
        return self.hi + self.lo


def pair_scores(a, b, cum_log_decay, mask, precision=HIGHEST):
    """sum_c a_tc b_sc exp(G_tc - G_sc) where `mask` (s <= t and same document), else 0.

    a, b: [..., C, K]; cum_log_decay: None or a `CumulativeLogDecay` of [..., C] or [..., C, K]; mask: bool
    broadcastable to [..., C, C] and never true above the diagonal.
    """
    scores = _einsum("...tk,...sk->...ts", a, b, precision=precision)
    if cum_log_decay is None:
        return jnp.where(mask, scores, 0.0)
    if cum_log_decay.hi.ndim == a.ndim - 1:
        diff = cum_log_decay.map(lambda x: x[..., :, None]).minus(cum_log_decay.map(lambda x: x[..., None, :]))
        # Pairs t = s decay by the constant 1, not exp(G_t - G_t): through the exp they would send +x and -x to
        # G_t along two differently rounded reductions, an O(eps x) residue that swamps d(log_decay) ~ exp(-20)
        # when every gate is -20.
        self_pair = jnp.eye(a.shape[-2], dtype=bool)
        decay = jnp.exp(jnp.where(mask & ~self_pair, diff, -jnp.inf))
        return scores * jnp.where(mask & self_pair, 1.0, decay)
    return jnp.where(mask, _pair_scores_channel(a, b, cum_log_decay, precision), 0.0)


def _pair_scores_channel(a, b, G, precision):
    """Lower-triangular (s <= t) part of sum_c a_tc b_sc exp(G_tc - G_sc) for per-channel G, overflow-free."""
    *lead, C, K = a.shape
    s = min(SUB_CHUNK, C)
    n = C // s
    a_ = a.reshape(*lead, n, s, K)
    b_ = b.reshape(*lead, n, s, K)
    G_ = G.map(lambda x: x.reshape(*lead, n, s, K))
    # Diagonal sub-chunks: the exact pairwise exponent, masked to s < t before exp; the pairs s = t have the
    # constant decay 1 and are added without exp, so that they send nothing to d(log_decay) (see pair_scores).
    lower = jnp.tril(jnp.ones((s, s), bool), -1)[:, :, None]
    diff = G_.map(lambda x: x[..., :, :, None, :]).minus(G_.map(lambda x: x[..., :, None, :, :]))
    diag = jnp.sum(a_[..., :, :, None, :] * b_[..., :, None, :, :] * jnp.exp(jnp.where(lower, diff, -jnp.inf)),
                   axis=-1)
    diag = diag + jnp.eye(s, dtype=diag.dtype) * jnp.sum(a_ * b_, axis=-1)[..., :, None]
    if n == 1:
        return diag.reshape(*lead, C, C)
    # Sub-chunk i > j: split exp(G_t - G_s) at the last gate of sub-chunk j, G_ref, so both factors are <= 1.
    ref = G_.map(lambda x: x[..., :, -1, :])  # [..., n, K]
    later = (jnp.arange(n)[:, None] > jnp.arange(n)[None, :])[:, :, None, None]
    to_ref = G_.map(lambda x: x[..., :, None, :, :]).minus(ref.map(lambda x: x[..., None, :, None, :]))
    left = a_[..., :, None, :, :] * jnp.exp(jnp.where(later, to_ref, -jnp.inf))  # [..., i, j, t, K]
    right = b_ * jnp.exp(ref.map(lambda x: x[..., :, None, :]).minus(G_))  # [..., j, s, K]
    off = _einsum("...ijtk,...jsk->...ijts", left, right, precision=precision)
    eye = jnp.eye(n, dtype=bool)[:, :, None, None]
    blocks = jnp.where(eye, diag[..., :, None, :, :], off)  # off is already 0 for i < j
    blocks = jnp.swapaxes(blocks, -3, -2)  # [..., i, t, j, s]
    return blocks.reshape(*lead, C, C)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def log_decay_to_end(log_decay, axis):
    """G_C - G_s = sum_{r > s} log_decay_r within each chunk (`axis` runs over the chunk's tokens), compensated.

    The value is the part-by-part difference of the compensated cumsum. Its derivative is given directly as the
    reverse exclusive cumsum: differentiating G_C - G_s instead sends +x to G_C and -x to G_s, which cancel for
    every gate r <= s only to O(eps x); with e_s = exp(0) = 1 (s the last token, or the last real one before a
    padded tail), that residue swamps d(log_decay) ~ exp(-20) when every gate is -20.
    """
    g = CumulativeLogDecay.of(log_decay, axis)
    C = log_decay.shape[axis]
    return g.map(lambda x: jax.lax.slice_in_dim(x, C - 1, C, axis=axis)).minus(g)


@log_decay_to_end.defjvp
def _log_decay_to_end_jvp(axis, primals, tangents):
    (log_decay,), (tangent,) = primals, tangents
    C = log_decay.shape[axis]
    # sum_{r > s} tangent_r: a shifted reverse cumsum (never the inclusive one minus tangent, which would cancel).
    after = jax.lax.slice_in_dim(tangent, 1, C, axis=axis)
    suffix = jnp.flip(jnp.cumsum(jnp.flip(after, axis), axis=axis), axis)
    widths = [(0, 0)] * tangent.ndim
    widths[axis] = (0, 1)
    return log_decay_to_end(log_decay, axis), jnp.pad(suffix, widths)


def _decay_to(log_decay_sum, like):
    """exp(log_decay_sum) shaped to multiply rows of `like` ([..., C, K])."""
    e = jnp.exp(log_decay_sum)
    return e[..., None] if e.ndim == like.ndim - 1 else e


def chunk_factors(q, k, v, beta, log_decay, *, segment_ids, chunk_size):
    """Everything chunk-local: returns a dict of [B, Hv, N, C, ...] float32 arrays and masks.

    Keys: q, k (heads repeated to Hv), w (None for linear attention), u0, g (`CumulativeLogDecay` or None),
    carry [B,1,N,C,1], intra mask [B,1,N,C,C] (s <= t, same document), k_end, gamma_end ([..., 1] or [..., K]).
    """
    B, T, _, K = q.shape
    Hv = v.shape[2]
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    f32 = jnp.float32
    precision = matmul_precision(v.dtype)
    cast = lambda x: None if x is None else x.astype(f32)
    q = _pad_time(repeat_key_heads(cast(q), Hv), pad)
    k = _pad_time(repeat_key_heads(cast(k), Hv), pad)
    v = _pad_time(cast(v), pad)
    # Padding tokens have k = 0, beta = 0 and no decay: they leave the state unchanged.
    beta = _pad_time(cast(beta), pad)
    log_decay = _pad_time(cast(log_decay), pad)
    doc = _pad_time(document_index(segment_ids, B, T), pad, mode="edge")

    qc, kc, vc = (_to_chunks(x, N, C) for x in (q, k, v))
    log_decay = None if log_decay is None else _to_chunks(log_decay, N, C)
    g = None if log_decay is None else CumulativeLogDecay.of(log_decay, axis=3)
    doc = doc.reshape(B, 1, N, C)
    doc_before = jnp.concatenate([doc[:, :, :1, :1], doc[:, :, :-1, -1:]], axis=2)  # last doc of previous chunk
    carry = doc == doc_before  # [B, 1, N, C]
    tail = doc == doc[..., -1:]
    same_doc = doc[..., :, None] == doc[..., None, :]
    causal = jnp.tril(jnp.ones((C, C), bool))
    intra = same_doc & causal

    if g is None:
        decay_from_start = decay_to_end = jnp.ones(kc.shape[:-1] + (1,), f32)
        gamma_end = jnp.ones(kc.shape[:3] + (1,), f32)
    else:
        decay_from_start = _decay_to(g.total(), kc)  # exp(G_t)
        g_last = g.map(lambda x: x[:, :, :, -1:])
        decay_to_end = _decay_to(log_decay_to_end(log_decay, 3), kc)  # exp(G_C - G_s) <= 1
        gamma_end = jnp.exp(g_last.total()[:, :, :, 0])
        gamma_end = gamma_end[..., None] if gamma_end.ndim == 3 else gamma_end
    gamma_end = gamma_end * carry[..., -1:]  # the state survives the chunk only if no document starts in it
    k_end = tail[..., None] * decay_to_end * kc

    if beta is None:
        w, u0 = None, vc
    else:
        bc = _to_chunks(beta, N, C)[..., None]
        strict = same_doc & jnp.tril(jnp.ones((C, C), bool), -1)
        a = bc * pair_scores(kc, kc, g, strict, precision)
        inverse = unit_lower_inverse(jnp.eye(C, dtype=f32) + a)
        # The inverse multiplies fp32 intermediates: always IEEE fp32.
        w = _einsum("...ts,...sk->...tk", inverse, bc * carry[..., None] * decay_from_start * kc)
        u0 = _einsum("...ts,...sv->...tv", inverse, bc * vc)
    return dict(q=qc, k=kc, w=w, u0=u0, g=g, carry=carry[..., None], intra=intra, precision=precision,
                q_from_start=carry[..., None] * decay_from_start * qc, k_end=k_end, gamma_end=gamma_end)


def chunk_state_map(factors):
    """The affine map of every chunk, S_end = M S_0 + E: M [B, Hv, N, K, K], E [B, Hv, N, K, V]."""
    k_end, w, u0, gamma_end = factors["k_end"], factors["w"], factors["u0"], factors["gamma_end"]
    precision = factors["precision"]
    K = k_end.shape[-1]
    m = jnp.eye(K, dtype=jnp.float32) * gamma_end[..., None, :]  # Diag(gamma_end); a scalar broadcasts
    if w is not None:
        m = m - _einsum("...ck,...cj->...kj", k_end, w, precision=precision)
    e = _einsum("...ck,...cv->...kv", k_end, u0, precision=precision)
    return m, e


def compose_state_maps(first, second, precision=HIGHEST):
    """(M2, E2) after (M1, E1): S -> M2 (M1 S + E1) + E2. Associative; the operator of `associative_scan`."""
    m1, e1 = first
    m2, e2 = second
    return (_einsum("...ij,...jk->...ik", m2, m1, precision=precision),
            _einsum("...ij,...jv->...iv", m2, e1, precision=precision) + e2)


def _states_sequential(factors, initial_state):
    """Start state of every chunk [B, Hv, N, K, V] and the final state, by a scan over chunks."""
    w, u0, k_end, gamma_end = factors["w"], factors["u0"], factors["k_end"], factors["gamma_end"]
    B, Hv, N, C, V = u0.shape
    K = k_end.shape[-1]
    precision = factors["precision"]
    state = zero_state(u0, B, Hv, K, V) if initial_state is None else initial_state

    def step(S, x):
        u = x["u0"] if x["w"] is None else x["u0"] - _einsum("bhck,bhkv->bhcv", x["w"], S, precision=precision)
        gamma = x["gamma_end"]
        S_end = gamma[..., :, None] * S + _einsum("bhck,bhcv->bhkv", x["k_end"], u, precision=precision)
        return S_end, S

    xs = dict(w=None if w is None else jnp.moveaxis(w, 2, 0), u0=jnp.moveaxis(u0, 2, 0),
              k_end=jnp.moveaxis(k_end, 2, 0), gamma_end=jnp.moveaxis(gamma_end, 2, 0))
    final, starts = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(starts, 0, 2), final


def _states_associative(factors, initial_state):
    """Same as `_states_sequential`, by an associative scan over the chunk maps (log depth)."""
    m, e = chunk_state_map(factors)
    precision = factors["precision"]
    compose = lambda first, second: compose_state_maps(first, second, precision)
    m_cum, e_cum = jax.lax.associative_scan(compose, (m, e), axis=2)
    if initial_state is None:
        after = e_cum
    else:
        after = _einsum("bhnij,bhjv->bhniv", m_cum, initial_state, precision=precision) + e_cum
    B, Hv, N, K, V = e.shape
    first = (zero_state(e, B, Hv, K, V)[:, :, None] if initial_state is None else initial_state[:, :, None])
    starts = jnp.concatenate([first, after[:, :, :-1]], axis=2)
    return starts, after[:, :, -1]


def chunk_outputs(factors, starts, scale):
    """O for every chunk given its start state: [B, Hv, N, C, V] float32."""
    precision = factors["precision"]
    u = factors["u0"]
    if factors["w"] is not None:
        u = u - _einsum("bhnck,bhnkv->bhncv", factors["w"], starts, precision=precision)
    inter = _einsum("bhnck,bhnkv->bhncv", factors["q_from_start"], starts, precision=precision)
    scores = pair_scores(factors["q"], factors["k"], factors["g"], factors["intra"], precision)
    intra = _einsum("bhnts,bhnsv->bhntv", scores, u, precision=precision)
    return scale * (inter + intra)


def chunked(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
            state_passing="sequential"):
    """The chunked form of both ops (`beta is None` is linear attention). Shapes as in `dispatch`."""
    B, T = q.shape[:2]
    factors = chunk_factors(q, k, v, beta, log_decay, segment_ids=segment_ids, chunk_size=chunk_size)
    if state_passing == "associative":
        starts, final = _states_associative(factors, initial_state)
    else:
        starts, final = _states_sequential(factors, initial_state)
    o = chunk_outputs(factors, starts, scale)  # [B, Hv, N, C, V]
    Hv, N, C, V = o.shape[1:]
    o = jnp.moveaxis(o.reshape(B, Hv, N * C, V), 1, 2)[:, :T]
    return o.astype(v.dtype), final
