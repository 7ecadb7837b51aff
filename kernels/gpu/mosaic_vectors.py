"""The per-token vectors around the Mosaic GPU kernels (`mosaic_wy`, `mosaic_wy_grads`), in two small Triton kernels.

Every chunk's gates, masks and factors are a few MiB, but formed in XLA they took about 14 small fusions before the
forward pass and as many around the backward kernels: the in-chunk cumsums, the exponentials, the (B, Tp, H) ->
(B*H, Tp) layout changes, the stacks and, after the gradient kernel, d(log_decay)'s in-chunk sums. Here each side
is one kernel, one program per (chunk, batch row) with the heads as the lanes (the columns) of its tiles:

- `prologue` (before the passes): the compensated in-chunk cumsum G = hi + lo of the log-decay (`_cumulative`),
  and from it `mosaic_wy_grads.ROW_VECTORS` (G hi, G lo, beta, carry exp(G), tail exp(G_C - G), the document
  index) heads-major, the chunk survival factors carry_C exp(G_C) repeated K times, and the document index as
  fp32: every input of the passes and of the gradient kernel but T.
- `epilogue` (after the gradient kernel): its two warpgroups' shares summed, dbeta, and d(log_decay) as
  `mosaic_wy_grads._dlog` forms it (the in-chunk reverse cumsum of dL/dG's per-token terms, the end terms as an
  exclusive prefix sum, the survival term), both (B, Tp, H).

Whole tiles, no loop over the rows, and tensor-core products (H100, 8x2048x16x128, 2026-11-27): a first version
walked the 64 rows in a `fori_loop`, waiting on each row's load (the forward's inputs took 0.204 ms against 0.168
with XLA's fusions); whole tiles with IEEE fp32 products on one warp took 25-27 us (prologue) and 28-32 us
(epilogue); with the in-chunk sums as tensor-core products with 0/1 matrices (`masked_sum`) on 4 warps, 8 and 10
us. Heads are padded to a power of two of at least 16 lanes (Triton's arrays and dots). The tests hold both
kernels to float64 oracles and to the XLA functions they replace (`tests/kernels/test_mosaic_vectors.py`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from deltajax.kernels.gpu.common import BF16, F32, compiler_params, iota2, split3_bf16


CHUNK = 64
WARPS = 4
ROWS = 6  # mosaic_wy_grads.ROW_VECTORS: G hi, G lo, beta, carry exp(G), tail exp(G_C - G), doc


def masked_sum(x, mask, *, mask_first):
    """mask @ x (`mask_first`) or x @ mask for fp32 x and a 0/1 matrix: each output the sum of the x it selects,
    on the tensor cores as three bf16 products of x's exact parts (fp32 accumulation; an output that selects one
    term is that term exactly). IEEE fp32 products (FMAs, no tensor cores) on one warp made the kernels 3x slower
    (module docstring)."""
    mask = mask.astype(BF16)
    raw = lambda part: lax.dot_general(*((mask, part) if mask_first else (part, mask)), (((1,), (0,)), ((), ())),
                                       preferred_element_type=F32)
    hi, mid, lo = (raw(part) for part in split3_bf16(x))
    return (lo + mid) + hi


def _lanes(num_heads):
    """Heads padded to a power of two (Triton's arrays), at least 16 (the sides of Triton's dots)."""
    return max(16, 1 << (num_heads - 1).bit_length())


def _padded_heads(x, lanes):
    """(B, Tp, H) -> (B, Tp, lanes), zeros in the padding (which no caller reads)."""
    pad = lanes - x.shape[-1]
    return x if pad == 0 else jnp.pad(x, ((0, 0), (0, 0), (0, pad)))


def _two_sum(a, b):
    """(s, e) with s = fl(a + b) and s + e = a + b exactly (Knuth's TwoSum, no branch)."""
    s = a + b
    b_virtual = s - a
    return s, (a - (s - b_virtual)) + (b - b_virtual)


def _matrix(n, keep):
    rows, cols = iota2(n, n, 0), iota2(n, n, 1)
    return jnp.where(keep(rows, cols), 1.0, 0.0).astype(F32)


def _last_row(x):
    """x[-1] of a (C, lanes) value: a masked sum, exact (one term)."""
    return jnp.sum(jnp.where(iota2(*x.shape, 0) == x.shape[0] - 1, x, 0.0), axis=0)


def _cumulative(x):
    """G_t = sum_{r <= t} x_r down the C rows of x (C, lanes), as (hi, lo): hi = cumsum(x) (Triton's scan, a tree),
    lo = the cumsum of what each row's step hi_t - hi_{t-1} misses of x_t, each such term formed in two TwoSums
    (hi_{t-1} selected exactly by `masked_sum` with the shift matrix). The steps telescope, so hi + lo = sum x up to
    the roundings of lo (~2^-24 of lo, itself ~2^-20 of the terms' magnitudes at most; measured 3.5e-14 of them,
    against 3e-7 for hi alone): what `CumulativeLogDecay` is made for, differences G_t - G_s taken part by part
    staying exact to fp32 after a -20 gate."""
    C = x.shape[0]
    hi = jnp.cumsum(x, axis=0)
    before = masked_sum(hi, _matrix(C, lambda t, s: s == t - 1), mask_first=True)  # hi_{t-1}, 0 in row 0
    step, step_error = _two_sum(hi, -before)  # hi_t - hi_{t-1} = step + step_error
    missed, missed_error = _two_sum(x, -step)  # x_t - step = missed + missed_error
    return hi, jnp.cumsum(missed + (missed_error - step_error), axis=0)


def _prologue_kernel(x_ref, beta_ref, *refs, segmented, state_dim):
    """One chunk of batch row b, every head a lane. x_ref, beta_ref: (C, lanes); with `segmented` the chunk's
    carry, tail and document index (C,) follow (else 1, 1 and 0). Outputs: g (2, C, lanes); the vectors (ROWS,
    lanes, C); the survival factors (lanes, K); the document index as fp32 (C,)."""
    if segmented:
        carry_ref, tail_ref, doc_ref, g_ref, vec_ref, survive_ref, doc_out_ref = refs
        carry, tail, doc = carry_ref[...][:, None], tail_ref[...][:, None], doc_ref[...].astype(F32)
    else:
        g_ref, vec_ref, survive_ref, doc_out_ref = refs
        carry, tail, doc = 1.0, 1.0, jnp.zeros(doc_out_ref.shape, F32)
    C, lanes = x_ref.shape
    hi, lo = _cumulative(x_ref[...])
    hi_end, lo_end = _last_row(hi), _last_row(lo)
    g_ref[0] = hi
    g_ref[1] = lo
    vec_ref[0] = hi.T
    vec_ref[1] = lo.T
    vec_ref[2] = beta_ref[...].T
    vec_ref[3] = (carry * jnp.exp(hi + lo)).T
    vec_ref[4] = (tail * jnp.exp((hi_end[None, :] - hi) + (lo_end[None, :] - lo))).T
    vec_ref[5] = jnp.broadcast_to(doc[None, :], (lanes, C))
    carry_last = _last_row(jnp.broadcast_to(carry, (C, lanes))) if segmented else 1.0
    survive = carry_last * jnp.exp(hi_end + lo_end)
    survive_ref[...] = jnp.broadcast_to(survive[:, None], (lanes, state_dim))
    doc_out_ref[...] = doc


@functools.partial(jax.jit, static_argnames=("segmented", "state_dim", "interpret"))
def prologue(log_decay, beta, doc, carry, tail, *, segmented, state_dim, interpret):
    """log_decay, beta: (B, Tp, H) fp32; doc (B, Tp) int, carry, tail (B, Tp) fp32 (read with `segmented` only).
    Returns g = [hi, lo] (2, B, Tp, H), the vectors (ROWS, B*H, Tp), the survival factors (B*H, nt*K) and the
    document index (B, Tp) fp32: what `mosaic_wy_grads.token_vectors` (with doc), `wy_chunk._in_chunk_cumsum` and
    `mosaic_wy._pass_vectors` give."""
    B, Tp, H = beta.shape
    nt, C, K = Tp // CHUNK, CHUNK, state_dim
    lanes = _lanes(H)
    heads = pl.BlockSpec((None, C, lanes), lambda i, b: (b, i, 0))
    token = pl.BlockSpec((None, C), lambda i, b: (b, i))
    in_specs = [heads, heads] + ([token] * 3 if segmented else [])
    inputs = [_padded_heads(log_decay.astype(F32), lanes), _padded_heads(beta.astype(F32), lanes)]
    if segmented:
        inputs += [carry.astype(F32), tail.astype(F32), doc]
    g, vectors, survive, doc_f = pl.pallas_call(
        functools.partial(_prologue_kernel, segmented=segmented, state_dim=K),
        grid=(nt, B),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((2, None, C, lanes), lambda i, b: (0, b, i, 0)),
                   pl.BlockSpec((ROWS, None, lanes, C), lambda i, b: (0, b, 0, i)),
                   pl.BlockSpec((None, lanes, None, K), lambda i, b: (b, 0, i, 0)),
                   token],
        out_shape=[jax.ShapeDtypeStruct((2, B, Tp, lanes), F32), jax.ShapeDtypeStruct((ROWS, B, lanes, Tp), F32),
                   jax.ShapeDtypeStruct((B, lanes, nt, K), F32), jax.ShapeDtypeStruct((B, Tp), F32)],
        compiler_params=compiler_params(WARPS, 1),
        interpret=interpret,
        name="chunk_vectors",
    )(*inputs)
    if lanes != H:
        g, vectors, survive = g[..., :H], vectors[:, :, :H], survive[:, :H]
    return g, vectors.reshape(ROWS, B * H, Tp), survive.reshape(B * H, nt * K), doc_f


def _epilogue_kernel(dbeta_ref, dgate_ref, end_ref, survive_sum_ref, survive_ref, dbeta_out_ref, dlog_ref):
    """One chunk of batch row b. Inputs: the two shares (2, lanes, C) of dbeta, of dL/dG's per-token terms and of
    the end terms; the shares (2, lanes, K) of the survival row sums; the survival factors (lanes, K). Outputs
    dbeta and d(log_decay) (C, lanes). The in-chunk sums are fp32 products with 0/1 matrices (each output a sum
    of its own terms only: the end terms of the tokens before t, an exact 0 at the chunk's first token)."""
    lanes, C = dbeta_ref.shape[1:]
    dgate = dgate_ref[0] + dgate_ref[1]
    end = end_ref[0] + end_ref[1]
    from_here = masked_sum(dgate, _matrix(C, lambda s, t: s >= t), mask_first=False)  # sum over s >= t
    ended_before = masked_sum(end, _matrix(C, lambda s, t: s < t), mask_first=False)  # sum over s < t
    survive = survive_ref[...]
    factor = jnp.sum(jnp.where(iota2(lanes, survive.shape[1], 1) == 0, survive, 0.0), axis=1)  # column 0, exact
    survive_term = factor * jnp.sum(survive_sum_ref[0] + survive_sum_ref[1], axis=1)
    dlog_ref[...] = ((from_here + ended_before) + survive_term[:, None]).T
    dbeta_out_ref[...] = (dbeta_ref[0] + dbeta_ref[1]).T


@functools.partial(jax.jit, static_argnames=("num_heads", "interpret"))
def epilogue(dbeta_shares, dgate_shares, end_shares, survive_shares, survive, *, num_heads, interpret):
    """The gradient kernel's shares (2, B*H, Tp) of dbeta, dL/dG's per-token terms and the end terms, and (2, B*H,
    nt*K) of the survival row sums; the survival factors (B*H, nt*K) from `prologue`. Returns dbeta and
    d(log_decay), (B, Tp, H) fp32, as `mosaic_wy_grads.grads` forms them in XLA."""
    _, BH, Tp = dbeta_shares.shape
    H, lanes = num_heads, _lanes(num_heads)
    B, nt, C = BH // H, Tp // CHUNK, CHUNK
    K = survive.shape[1] // nt

    def heads_padded(x):  # (..., B*H, L) -> (..., B, lanes, L)
        x = x.reshape(*x.shape[:-2], B, H, x.shape[-1])
        pad = [(0, 0)] * x.ndim
        pad[-2] = (0, lanes - H)
        return x if lanes == H else jnp.pad(x, pad)

    shares = pl.BlockSpec((2, None, lanes, C), lambda i, b: (0, b, 0, i))
    out = pl.BlockSpec((None, C, lanes), lambda i, b: (b, i, 0))
    dbeta, dlog = pl.pallas_call(
        _epilogue_kernel,
        grid=(nt, B),
        in_specs=[shares, shares, shares, pl.BlockSpec((2, None, lanes, K), lambda i, b: (0, b, 0, i)),
                  pl.BlockSpec((None, lanes, K), lambda i, b: (b, 0, i))],
        out_specs=[out, out],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, lanes), F32)] * 2,
        compiler_params=compiler_params(WARPS, 1),
        interpret=interpret,
        name="gate_gradients",
    )(*(heads_padded(x.astype(F32)) for x in (dbeta_shares, dgate_shares, end_shares, survive_shares, survive)))
    return dbeta[..., :H], dlog[..., :H]
