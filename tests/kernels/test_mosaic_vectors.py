"""The Triton kernels that form the per-token vectors around the Mosaic GPU kernels (`kernels/gpu/mosaic_vectors.py`).

Oracles: numpy (the in-chunk gate sums in float64 and the sequential float32 cumsum, d(log_decay) from its
definition in float64) and the XLA functions the kernels replace (`mosaic_wy_grads.token_vectors`,
`mosaic_wy._pass_vectors`). Gates mix -20, near-zero and ordinary values; heads not a power of two (padded lanes);
T not a multiple of 64; packed documents. On CPU in the Pallas interpreter and lowered for an abstract H100; on a
GPU compiled. Through the whole call: `Config.vectors` "kernel" against "xla" (forward and gradients).
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from deltajax.kernels.gpu import mosaic_vectors, mosaic_wy, mosaic_wy_grads, wy_chunk
from testing_utils import H100, fresh_key, relative_error, rule_inputs

ON_GPU = jax.default_backend() == "gpu"
C, K = mosaic_vectors.CHUNK, mosaic_wy.HEAD_DIM


def _gates(key, B, T, H, family):
    """log_decay (B, T, H): "mixed" (ordinary gates, some -20, some -1e-6), "tiny" (all near zero), "none" (zeros)."""
    k1, k2, k3 = jax.random.split(key, 3)
    if family == "none":
        return jnp.zeros((B, T, H), jnp.float32)
    if family == "tiny":
        return -1e-6 * jax.random.uniform(k1, (B, T, H), minval=0.1, maxval=1.0)
    log_decay = -jnp.exp(jax.random.normal(k1, (B, T, H)))
    log_decay = jnp.where(jax.random.bernoulli(k2, 0.05, (B, T, H)), -20.0, log_decay)
    return jnp.where(jax.random.bernoulli(k3, 0.2, (B, T, H)), -1e-6, log_decay)


def _padded(key, B, T, H, family, packed):
    """The padded call inputs (`wy_chunk.padded_call_inputs`): log_decay, beta, doc, carry, tail."""
    x = rule_inputs(key, B=B, T=T, H=H, K=8, V=8, beta_max=2.0, packed=packed)
    x["log_decay"] = _gates(jax.random.fold_in(key, 1), B, T, H, family)
    *_, beta, log_decay, doc, carry, tail, _ = wy_chunk.padded_call_inputs(
        x["q"], x["k"], x["v"], x["beta"], x["log_decay"], None, x["segment_ids"], C)
    return log_decay, beta, doc, carry, tail


def _prologue(inputs, segmented, interpret=not ON_GPU):
    log_decay, beta, doc, carry, tail = inputs
    return jax.jit(lambda *a: mosaic_vectors.prologue(*a, segmented=segmented, state_dim=K, interpret=interpret))(
        log_decay, beta, doc, carry, tail)


def _check_prologue(inputs, segmented):
    log_decay, beta, doc, carry, tail = inputs
    if not segmented:
        doc, carry, tail = jnp.zeros_like(doc), jnp.ones_like(carry), jnp.ones_like(tail)
    g, vectors, survive, doc_f = _prologue(inputs, segmented)
    B, Tp, H = beta.shape
    nt = Tp // C
    assert g.shape == (2, B, Tp, H) and vectors.shape == (6, B * H, Tp) and survive.shape == (B * H, nt * K)
    x = np.asarray(log_decay, np.float32).reshape(B, nt, C, H)
    exact = np.cumsum(x.astype(np.float64), axis=2)
    scale = np.cumsum(np.abs(x.astype(np.float64)), axis=2)
    # G as the inverse kernel reads it (g) and as the passes do (vectors' rows 0 and 1): Triton may form the two
    # layouts' scans apart, so they can differ in lo's last bits (seen on the H100: 4e-12 absolute); each is held
    # to the float64 sum. hi is an fp32 running sum, hi + lo the exact one up to lo's own roundings (~2^-40 of the
    # terms' magnitudes; a plain fp32 cumsum is off by ~2^-24 of them).
    heads_last = lambda row: np.moveaxis(np.asarray(row).reshape(B, H, nt, C), 1, 3)
    for hi, lo in ((np.asarray(g[0]).reshape(B, nt, C, H), np.asarray(g[1]).reshape(B, nt, C, H)),
                   (heads_last(vectors[0]), heads_last(vectors[1]))):
        assert np.all(np.abs(hi - exact) <= 1e-6 * scale)
        assert np.all(np.abs(hi.astype(np.float64) + lo - exact) <= 1e-11 * scale)
    # Everything else against the XLA functions the kernel replaces, on the kernel's own G (the passes' copy).
    g_rows = jnp.stack([jnp.moveaxis(vectors[r].reshape(B, H, Tp), 1, 2) for r in (0, 1)])
    expected = mosaic_wy_grads.token_vectors(g_rows, beta, carry, tail, doc)
    _, expected_doc, expected_survive = mosaic_wy._pass_vectors(g_rows, beta, doc, carry, tail, K)
    for row in (2, 5):  # beta, doc: copies
        np.testing.assert_array_equal(np.asarray(vectors[row]), np.asarray(expected[row]))
    # carry exp(G), tail exp(G_C - G), the survival factors: one exp each of an fp32 sum, whose rounding (ulp(x)/2
    # <= 2^-25 x 87 = 2.6e-6 above exp's underflow) exp turns into a relative error, on either side; seen on the
    # H100: 3.8e-6 at x = -39.6 (atol: where one side flushes a subnormal).
    for row in (3, 4):
        np.testing.assert_allclose(np.asarray(vectors[row]), np.asarray(expected[row]), rtol=1.2e-5, atol=1e-37)
    np.testing.assert_allclose(np.asarray(survive), np.asarray(expected_survive), rtol=1.2e-5, atol=1e-37)
    np.testing.assert_array_equal(np.asarray(doc_f), np.asarray(expected_doc))
    return g, survive, carry


def _epilogue_inputs(key, B, Tp, H, tiny_gates):
    """Random shares of the gradient kernel's outputs: dbeta, dL/dG's per-token terms, the end terms (2, B*H, Tp),
    the survival row sums (2, B*H, nt*K). `tiny_gates`: dL/dG terms of 1e-9 beside O(1) end terms (the case the
    exclusive prefix sum of the end terms exists for)."""
    nt = Tp // C
    ks = jax.random.split(key, 4)
    shares = [jax.random.normal(k, (2, B * H, Tp), jnp.float32) for k in ks[:3]]
    if tiny_gates:
        shares[1] = shares[1] * 1e-9
    return (*shares, jax.random.normal(ks[3], (2, B * H, nt * K), jnp.float32))


def _dlog_float64(dgate_shares, end_shares, survive_shares, survive, B, H):
    """d(log_decay) from its definition in float64, and the sum of the magnitudes of its terms (for the bound)."""
    Tp = dgate_shares.shape[-1]
    nt = Tp // C
    f64 = lambda x: np.asarray(x, np.float64)
    per_chunk = lambda x: x.sum(0).reshape(B, H, nt, C)
    dgate, end = per_chunk(f64(dgate_shares)), per_chunk(f64(end_shares))
    dgate_abs, end_abs = per_chunk(np.abs(f64(dgate_shares))), per_chunk(np.abs(f64(end_shares)))
    factor = f64(survive).reshape(B, H, nt, K)[..., 0]
    sums = f64(survive_shares).sum(0).reshape(B, H, nt, K).sum(-1)
    rev = lambda x: np.flip(np.cumsum(np.flip(x, -1), -1), -1)
    exclusive = lambda x: np.cumsum(x, -1) - x
    value = rev(dgate) + exclusive(end) + (factor * sums)[..., None]
    scale = rev(dgate_abs) + exclusive(end_abs) + np.abs(factor[..., None]) * np.abs(
        f64(survive_shares)).sum(0).reshape(B, H, nt, K).sum(-1)[..., None]
    to_bth = lambda x: np.moveaxis(x.reshape(B, H, Tp), 1, 2)
    return to_bth(value), to_bth(scale)


def _check_epilogue(key, inputs, segmented, tiny_gates, interpret=not ON_GPU):
    log_decay, beta, doc, carry, tail = inputs
    g, survive, carry = _check_prologue(inputs, segmented)
    B, Tp, H = beta.shape
    shares = _epilogue_inputs(key, B, Tp, H, tiny_gates)
    dbeta, dlog = jax.jit(lambda *a: mosaic_vectors.epilogue(*a, num_heads=H, interpret=interpret))(*shares, survive)
    assert dbeta.shape == dlog.shape == (B, Tp, H)
    heads_last = lambda x: jnp.moveaxis(x.reshape(B, H, Tp), 1, 2)
    np.testing.assert_array_equal(np.asarray(dbeta), np.asarray(heads_last(shares[0][0] + shares[0][1])))
    value, scale = _dlog_float64(shares[1], shares[2], shares[3], survive, B, H)
    # fp32 sums of at most 64 + 128 terms: a few hundred roundings of the terms' magnitudes at most.
    err = np.abs(np.asarray(dlog, np.float64) - value)
    assert np.all(err <= 3e-5 * scale + 1e-30), float(np.max(err / (scale + 1e-30)))
    # And against the XLA form it replaces (`mosaic_wy_grads._dlog`), elementwise on the same scale.
    dgate, end = heads_last(shares[1][0] + shares[1][1]), heads_last(shares[2][0] + shares[2][1])
    survive_rows = (shares[3][0] + shares[3][1]).reshape(B, H, Tp // C, K).sum(-1)
    xla = mosaic_wy_grads._dlog(dgate, end, survive_rows, g, carry)
    assert np.all(np.abs(np.asarray(dlog, np.float64) - np.asarray(xla, np.float64)) <= 3e-5 * scale + 1e-30)


@pytest.mark.parametrize("family", ["mixed", "tiny", "none"])
@pytest.mark.parametrize("segmented", [False, True])
def test_prologue_in_interpreter(family, segmented):
    _check_prologue(_padded(fresh_key(), B=2, T=150, H=3, family=family, packed=segmented), segmented)


@pytest.mark.parametrize("tiny_gates", [False, True])
def test_epilogue_in_interpreter(tiny_gates):
    key = fresh_key()
    _check_epilogue(jax.random.fold_in(key, 2), _padded(key, B=2, T=200, H=4, family="mixed", packed=True),
                    segmented=True, tiny_gates=tiny_gates)


@pytest.mark.parametrize("H", [3, 16])
@pytest.mark.parametrize("segmented", [False, True])
def test_lowers_for_cuda(H, segmented):
    """Both kernels compiled for Triton (what the interpreter accepts but Triton may not: scalar and strided row
    loads, the padded lanes)."""
    B, Tp = 2, 192
    S = jax.ShapeDtypeStruct
    vector, token = S((B, Tp, H), jnp.float32), S((B, Tp), jnp.float32)
    shares, rows = S((2, B * H, Tp), jnp.float32), S((2, B * H, Tp // C * K), jnp.float32)

    def both(log_decay, beta, doc, carry, tail, dbeta, dgate, end, survive_rows):
        _, _, survive, _ = mosaic_vectors.prologue(log_decay, beta, doc, carry, tail, segmented=segmented,
                                                   state_dim=K, interpret=False)
        return mosaic_vectors.epilogue(dbeta, dgate, end, survive_rows, survive, num_heads=H, interpret=False)

    with jax.sharding.use_abstract_mesh(H100):
        text = jax.jit(both).trace(vector, vector, S((B, Tp), jnp.int32), token, token, shares, shares, shares,
                                   rows).lower(lowering_platforms=("cuda",)).as_text()
    assert set(re.findall(r'name = "(chunk_vectors|gate_gradients)"', text)) == {"chunk_vectors", "gate_gradients"}


def test_call_with_kernel_vectors_equals_xla_vectors_in_interpreter():
    """The whole Mosaic call (forward and gradients; packed documents, initial state, T = 150) with the vectors from
    the two kernels and from XLA: the same outputs and gradients up to the fp32 roundings of the sums."""
    key = fresh_key()
    x = rule_inputs(key, B=1, T=150, H=2, K=K, V=K, dtype=jnp.bfloat16, beta_max=2.0, packed=True,
                    with_initial_state=True)
    x["log_decay"] = _gates(jax.random.fold_in(key, 1), 1, 150, 2, "mixed")
    weights = jax.random.normal(jax.random.fold_in(key, 2), x["v"].shape)
    base = mosaic_wy.default_config(interpret=True)

    def value_and_grads(vectors):
        cfg = dataclasses.replace(base, vectors=vectors)

        def loss(q, k, v, beta, log_decay, h0):
            o, s = mosaic_wy.chunk_wy_mosaic(q, k, v, beta, log_decay, scale=0.1, initial_state=h0,
                                             segment_ids=x["segment_ids"], interpret=True, config=cfg)
            return jnp.sum(o.astype(jnp.float32) * weights) + jnp.sum(s * s)

        args = [x[n] for n in ("q", "k", "v", "beta", "log_decay", "initial_state")]
        return jax.jit(jax.value_and_grad(loss, argnums=range(6)))(*args)

    (loss_kernel, grads_kernel), (loss_xla, grads_xla) = value_and_grads("kernel"), value_and_grads("xla")
    assert abs(float(loss_kernel) - float(loss_xla)) <= 1e-5 * abs(float(loss_xla))
    for name, ours, theirs in zip(("q", "k", "v", "beta", "log_decay", "initial_state"), grads_kernel, grads_xla):
        assert relative_error(ours.astype(jnp.float32), theirs.astype(jnp.float32)) <= 1e-5, name


@pytest.mark.skipif(not ON_GPU, reason="needs a GPU")
@pytest.mark.parametrize("segmented", [False, True])
def test_gpu_prologue_and_epilogue(segmented):
    key = fresh_key()
    inputs = _padded(key, B=4, T=1000, H=12, family="mixed", packed=segmented)
    _check_epilogue(jax.random.fold_in(key, 2), inputs, segmented, tiny_gates=True)
