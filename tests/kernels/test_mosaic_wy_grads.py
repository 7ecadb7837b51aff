"""The Mosaic GPU gradient kernel of the Gated DeltaNet (`kernels/gpu/mosaic_wy_grads.py`).

Oracle: the Triton "merged" gradient kernel (`wy_chunk._grads`, itself checked against the fp32 scan's gradients)
on the same residuals, the start states, end-state cotangents, u and dx of the Triton passes. Both take the same
product precisions, so they agree to the bf16 rounding of dq, dk, dv and to fp32 summation order elsewhere. The
whole backward against the scan's gradients is `test_mosaic_wy.test_gradients_match_scan_in_interpreter` (CPU) and
`test_gpu_gradients_match_scan` (GPU). On CPU the kernel runs in the Mosaic GPU interpreter and is lowered for an
abstract H100.
"""

import warnings

import jax
import jax.numpy as jnp
import pytest

from deltajax.kernels.gpu import mosaic_wy_grads, wy_chunk
from deltajax.kernels.gpu.common import split_bf16_in_xla
from testing_utils import H100, covering, fresh_key, relative_error, rule_inputs

warnings.filterwarnings("ignore", message=".*triton.*", category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"
D = 128
SCALE = D ** -0.5
# The other (K, V) the kernel takes (`mosaic_wy_grads.HEAD_DIMS`): at V = 64 warpgroup 1 has no V piece; K or V of
# 256 run in blocks of 128, one CTA per (key block, value block).
OTHER_HEAD_DIMS = [(64, 64), (64, 128), (128, 64)]
WIDE_HEAD_DIMS = [(256, 256), (256, 128), (256, 64), (128, 256), (64, 256)]
# dq, dk, dv are bf16 outputs: one rounding each (relative 2^-9 at most per element). dbeta and d(log_decay) are
# fp32 from products in the split mode on both sides (~2^-16 relative per product), the Mosaic kernel reading u and
# dx as bf16 pairs (2^-17 relative) where the Triton one splits fp32 values; d(log_decay) sums them with
# cancellation (reverse cumsums). In the interpreter (2026-11-26): dbeta 1.6e-6 to 2.3e-6, d(log_decay) 7e-7 to
# 2.3e-5 over six draws; 2026-11-28, 150 draws over the five input cases (u read from the pass): dbeta at most 3.2e-6,
# d(log_decay) 5.3e-5, dq / dk / dv 1.0e-4 / 2.5e-4 / 2.6e-4.
TOLS = dict(dq=4e-3, dk=4e-3, dv=4e-3, dbeta=1e-4, dlog=1e-4)


def _residuals(x, do, dfinal):
    """The Triton passes' residuals for the gradient kernels, padded: (q, k, v, beta, g, doc, carry, tail, starts,
    dends, do, u, dx) and the Triton config."""
    segmented = x["segment_ids"] is not None
    cfg = wy_chunk.default_config(x["q"], x["v"], scale=SCALE, chunk_size=64, delta=True, segmented=segmented,
                                  interpret=not ON_GPU, gated=x["log_decay"] is not None)
    # "merged" up to K = 128, "staged" (V blocks, then K blocks) at 256: both read u and dx saved by the passes.
    assert cfg.grad_method in ("merged", "staged") and wy_chunk._saves_u_dx(cfg) and cfg.state_storage == "bf16"
    args = wy_chunk.padded_call_inputs(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"],
                                       x["segment_ids"], 64)
    q, k, v, beta, g, doc, carry, tail, t, t_grads, starts, (u,) = wy_chunk._wy_fwd(cfg, *args)[1]
    do = jnp.pad(do, ((0, 0), (0, q.shape[1] - do.shape[1]), (0, 0), (0, 0)))
    _, dends, dx = wy_chunk._reverse_pass(cfg, q, k, beta, t, g, doc, carry, tail, do, dfinal)
    return cfg, t, t_grads, (q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx)


def _compare(x, u_from_t=False):
    """`u_from_t`: the kernel forms u from T's pair (the split of the Triton pass's fp32 T) instead of reading the
    Triton pass's u, which that pass forms with the same product modes (bf16(S_0) in K S_0, T's products split)."""
    B, T, H, K = x["q"].shape
    V = x["v"].shape[3]
    kd, kf = jax.random.split(fresh_key())
    do = jax.random.normal(kd, (B, T, H, V), jnp.bfloat16)
    dfinal = jax.random.normal(kf, (B, H, K, V), jnp.float32)
    cfg, t, t_grads, res = _residuals(x, do, dfinal)
    segmented = x["segment_ids"] is not None
    t_pair = (t if t.ndim == 5 else jnp.stack(split_bf16_in_xla(t))) if u_from_t else None  # fp32 T or its pair
    ours = jax.jit(lambda *a: mosaic_wy_grads.grads(*a[:11], None if u_from_t else a[11], a[12], scale=SCALE,
                                                    segmented=segmented, interpret=not ON_GPU, t_pair=t_pair))(*res)
    q, k, v, beta, g, doc, carry, tail, starts, dends, do, u, dx = res
    # The Mosaic kernel takes every dk product in the split mode: so does the oracle here (its default rounds the
    # operands of dk's state and dA_k terms to bf16, a 2^-9 relative error per element that both would differ by).
    split_cfg = wy_chunk.replace_config(cfg, grad_k_dots="split")
    ref = jax.jit(lambda *a: wy_chunk._grads(split_cfg, *a[:12], saved=a[12:]))(
        q, k, v, beta, t_grads, g, doc, carry, tail, starts, dends, do, u, dx)
    for name, a, r in zip(TOLS, ours, ref):
        assert a.shape == r.shape, (name, a.shape, r.shape)
        error = relative_error(a.astype(jnp.float32), r.astype(jnp.float32))
        print(f"{name} {error:.2e}")
        assert error <= TOLS[name], (name, error)


@pytest.mark.parametrize("case", ["plain", "packed", "strong_decay", "near_zero_decay", "correlated_keys",
                                  "packed_u_from_t", "strong_decay_u_from_t", "correlated_keys_u_from_t"])
def test_matches_the_triton_kernel_in_interpreter(case):
    """T not a multiple of 64, beta up to 2, an initial state; packed documents; strong (log-decay down to -8 per
    token) and near-zero decay; keys drawn around one direction. "_u_from_t": u formed in the kernel from T."""
    u_from_t = case.endswith("_u_from_t")
    case = case.removesuffix("_u_from_t")
    kwargs = dict(B=1, T=150, H=2, K=D, V=D, dtype=jnp.bfloat16, beta_max=2.0, with_initial_state=True)
    kwargs.update(dict(packed=dict(packed=True), strong_decay=dict(decay_scale=8.0),
                       near_zero_decay=dict(decay_scale=1e-4)).get(case, {}))
    x = rule_inputs(fresh_key(), **kwargs)
    if case == "correlated_keys":
        k = x["k"].astype(jnp.float32)
        k = k[:, :1] + 0.1 * k
        x["k"] = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    _compare(x, u_from_t)


@pytest.mark.parametrize("output_method", ["fused", "split"])
def test_triton_forward_saves_u_as_its_pair(output_method):
    """With few heads `impl="mosaic"` runs the Triton forward pass, which then writes u as its bf16 halves for this
    kernel (`_wy_fwd(u_pair=True)`): bit for bit the split of the fp32 u it saves otherwise, with the same outputs
    (the output pass of "split" reads hi + lo in place of u, whose split it takes anyway)."""
    x = rule_inputs(fresh_key(), B=1, T=150, H=2, K=D, V=D, dtype=jnp.bfloat16, beta_max=2.0, with_initial_state=True,
                    packed=True)
    cfg = wy_chunk.replace_config(
        wy_chunk.default_config(x["q"], x["v"], scale=SCALE, chunk_size=64, delta=True, segmented=True,
                                interpret=not ON_GPU), output_method=output_method)
    args = wy_chunk.padded_call_inputs(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"],
                                       x["segment_ids"], 64)
    (o, final), residuals = jax.jit(lambda *a: wy_chunk._wy_fwd(cfg, *a))(*args)
    (o_pair, final_pair), residuals_pair = jax.jit(lambda *a: wy_chunk._wy_fwd(cfg, *a, u_pair=True))(*args)
    (u,), ((hi, lo),) = residuals[-1], residuals_pair[-1]
    assert hi.dtype == lo.dtype == jnp.bfloat16
    expected_hi, expected_lo = split_bf16_in_xla(u)
    assert bool(jnp.all(hi == expected_hi)) and bool(jnp.all(lo == expected_lo))
    assert bool(jnp.all(final_pair == final))
    assert relative_error(o_pair.astype(jnp.float32), o.astype(jnp.float32)) <= 1e-4


def test_u_none_needs_t_pair():
    x = rule_inputs(fresh_key(), B=1, T=64, H=1, K=D, V=D, dtype=jnp.bfloat16)
    _, _, _, res = _residuals(x, x["v"], jax.random.normal(fresh_key(), (1, 1, D, D), jnp.float32))
    with pytest.raises(ValueError, match="t_pair"):
        mosaic_wy_grads.grads(*res[:11], None, res[12], scale=SCALE, segmented=False, interpret=True)


def test_without_decay_in_interpreter():
    _compare(rule_inputs(fresh_key(), B=1, T=64, H=1, K=D, V=D, dtype=jnp.bfloat16, decay="none", packed=True))


@pytest.mark.parametrize("K,V,case", [(*dims, case) for dims, case in covering(
    OTHER_HEAD_DIMS, ("plain", "packed_correlated_keys"))] + [(K, V, "packed_correlated_keys")
                                                               for K, V in WIDE_HEAD_DIMS[:3]])
def test_other_head_dims_match_the_triton_kernel_in_interpreter(K, V, case):
    """K or V of 64: the V pieces and key-sized tiles follow the call's dims; of 256: each CTA's terms over its key
    and value block, summed (at K = 256 the oracle is the Triton "staged" kernels). T not a multiple of 64, beta up
    to 2, an initial state; packed documents with keys drawn around one direction."""
    x = rule_inputs(fresh_key(), B=1, T=150, H=2, K=K, V=V, dtype=jnp.bfloat16, beta_max=2.0,
                    with_initial_state=True, packed=case != "plain")
    if case != "plain":
        k = x["k"].astype(jnp.float32)
        k = k[:, :1] + 0.1 * k
        x["k"] = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(jnp.bfloat16)
    _compare(x)


def test_other_head_dims_refuse_what_the_kernel_does_not_take():
    x = rule_inputs(fresh_key(), B=1, T=64, H=1, K=64, V=64, dtype=jnp.bfloat16)
    _, _, _, res = _residuals(x, x["v"], jax.random.normal(fresh_key(), (1, 1, 64, 64), jnp.float32))
    t_pair = jax.random.normal(fresh_key(), (2, 1, 64, 1, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match="u None .* takes V = 128 and K <= 128, got K=64, V=64"):
        mosaic_wy_grads.grads(*res[:11], None, res[12], scale=SCALE, segmented=False, interpret=True, t_pair=t_pair)
    key_dim = lambda n: {name: jax.random.normal(fresh_key(), res[i].shape[:-1] + (n,), res[i].dtype)
                         for i, name in ((0, "q"), (1, "k"))}
    narrow = key_dim(32)
    with pytest.raises(ValueError, match=r"K and V must each be one of \(64, 128, 256\), got K=32, V=64"):
        mosaic_wy_grads.grads(narrow["q"], narrow["k"], *res[2:], scale=SCALE, segmented=False, interpret=True)
    # u formed from T needs K S_0 over every key channel: one key block of 256 does not see them.
    wide = key_dim(256)
    with pytest.raises(ValueError, match="u None .* takes V = 128 and K <= 128, got K=256, V=64"):
        mosaic_wy_grads.grads(wide["q"], wide["k"], *res[2:11], None, res[12], scale=SCALE, segmented=False,
                              interpret=True, t_pair=t_pair)
    with pytest.raises(ValueError, match="warpgroups must be 1 .* or 2 .*, got 4"):
        mosaic_wy_grads.grads(*res, scale=SCALE, segmented=False, interpret=True, warpgroups=4)


LOWERED_CASES = [(False, D, D), (True, D, D), (False, 64, 64), (False, 64, 128), (False, 128, 64), (True, 64, 128),
                 (False, 256, 256), (False, 256, 64), (False, 64, 256)]


@pytest.mark.parametrize("segmented,u_from_t,K,V", [(segmented, *case) for case, segmented in covering(
    LOWERED_CASES, (False, True))])
def test_lowers_for_cuda(segmented, u_from_t, K, V):
    """Catches what the interpreter accepts but Mosaic GPU cannot lower (layouts, wgmma operands, transposed
    views, the barriers of the two warpgroups, which the interpreter runs in turn). On a CPU each case with or
    without documents (`covering`)."""
    B, Tp, H = 1, 192, 2
    nt = Tp // 64
    S = jax.ShapeDtypeStruct
    key, value, state = S((B, Tp, H, K), jnp.bfloat16), S((B, Tp, H, V), jnp.float32), S((B, H, nt * K, V),
                                                                                         jnp.bfloat16)
    values = S((B, Tp, H, V), jnp.bfloat16)
    args = (key, key, values, S((B, Tp, H), jnp.float32), S((2, B, Tp, H), jnp.float32), S((B, Tp), jnp.int32),
            S((B, Tp), jnp.float32), S((B, Tp), jnp.float32), state, state, values, value, value)
    t_pair = S((2, B, Tp, H, 64), jnp.bfloat16)
    fn = jax.jit(lambda *a: mosaic_wy_grads.grads(*a[:11], None if u_from_t else a[11], a[12], scale=SCALE,
                                                  segmented=segmented, interpret=False, t_pair=a[13]))
    args += (t_pair,)
    with jax.sharding.use_abstract_mesh(H100):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call @mosaic_gpu_v2") == 1


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("u_from_t", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_gpu_matches_the_triton_kernel(packed, u_from_t):
    _compare(rule_inputs(fresh_key(), B=2, T=1000, H=4, K=D, V=D, dtype=jnp.bfloat16, beta_max=2.0, packed=packed,
                         with_initial_state=True), u_from_t)


@pytest.mark.skipif(not ON_GPU, reason="needs a Hopper GPU")
@pytest.mark.parametrize("K,V", OTHER_HEAD_DIMS + WIDE_HEAD_DIMS)
def test_gpu_other_head_dims_match_the_triton_kernel(K, V):
    _compare(rule_inputs(fresh_key(), B=2, T=1000, H=4, K=K, V=V, dtype=jnp.bfloat16, beta_max=2.0, packed=True,
                         with_initial_state=True))
