"""The Pallas Triton WY kernels against the fp32 token-by-token scan.

On CPU: the kernels in Pallas's interpreter at float32 (outputs/state <= 1e-5, gradients <= 1e-4 relative), and
every supported configuration lowered for CUDA with an abstract H100 (catches what interprets but cannot compile).
On a GPU: the same comparisons compiled, bf16 against the scan on the same bf16-rounded inputs, and through the
dispatch (`impl="pallas"` and "auto").
"""

import dataclasses
import itertools
import math
import warnings
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax.kernels import gpu as pallas_gpu
from deltajax.kernels.gpu import wy_chunk
from deltajax.kernels.gpu.wy_chunk import chunk_wy, default_config
from deltajax.rules import dispatch, step_size
from deltajax.rules.scan import recurrent_scan
from testing_utils import H100, chunk_form_bounds, covering, fresh_key, relative_error, rule_inputs, share

warnings.filterwarnings("ignore", message=".*triton.*", category=DeprecationWarning)

ON_GPU = jax.default_backend() == "gpu"
FP32_OUT_TOL, FP32_GRAD_TOL = 1e-5, 1e-4
BF16_OUT_TOL, BF16_GRAD_TOL, BF16_GATE_GRAD_TOL = 3e-3, 6e-3, 1e-2
ARG_NAMES = ("q", "k", "v", "beta", "log_decay", "initial_state")
# Gradient methods (`wy_chunk.GRAD_METHODS`) as fields of the default config they override. In the interpreter,
# blocks of 16 give the 32-wide cases several K and V blocks; the lowering test takes the sizes swept on the H100.
GRAD_VARIANTS = {
    "fused": dict(grad_method="fused", grad_block_v=32, grad_block_k=256),
    "fused_k_blocks": dict(grad_method="fused", grad_block_v=16, grad_block_k=16),
    "staged": dict(grad_method="staged", grad_block_v=16, grad_block_k=16),
    "staged_recompute": dict(grad_method="staged", grad_block_v=16, grad_block_k=16, grads_from_passes=False),
    "merged": dict(grad_method="merged", grad_block_v=16, grad_block_k=256),
    # The output methods (`wy_chunk.OUTPUT_METHODS`; the default picks "split" at these sizes): "fused", and
    # "split" with two V blocks of 16 in the output kernel.
    "merged_fused_output": dict(grad_method="merged", grad_block_v=16, grad_block_k=256, output_method="fused"),
    "merged_split_output": dict(grad_method="merged", grad_block_v=16, grad_block_k=256, output_method="split",
                                output_block_v=16),
    # The passes forming their chunk scalars inline (`Config.pass_scalars`; default "stored"), with either output
    # method.
    "merged_split_output_inline_scalars": dict(grad_method="merged", grad_block_v=16, grad_block_k=256,
                                               output_method="split", pass_scalars="inline"),
    "fused_fused_output_inline_scalars": dict(grad_method="fused", grad_block_v=32, grad_block_k=256,
                                              output_method="fused", pass_scalars="inline"),
    # The reverse pass forming scale P^T dO in every step (`Config.reverse_scores`; the default at these sizes,
    # one program per SM, reads it formed chunk-parallel).
    "merged_inline_reverse_scores": dict(grad_method="merged", grad_block_v=16, grad_block_k=256,
                                         reverse_scores="inline"),
}
LOWERED_GRAD_VARIANTS = {
    "fused": GRAD_VARIANTS["fused"],
    "fused_k_blocks": dict(grad_method="fused", grad_block_v=32, grad_block_k=64),
    "staged": dict(grad_method="staged", grad_block_v=64, grad_block_k=64),
    "staged_v32_k128": dict(grad_method="staged", grad_block_v=32, grad_block_k=128),
    "staged_recompute": dict(grad_method="staged", grad_block_v=64, grad_block_k=64, grads_from_passes=False),
    "merged": dict(grad_method="merged", grad_block_v=32, grad_block_k=256),
    "merged_fused_output": dict(grad_method="merged", grad_block_v=32, grad_block_k=256, output_method="fused"),
    "merged_split_output": dict(grad_method="merged", grad_block_v=32, grad_block_k=256, output_method="split"),
    "merged_split_output_fp32_pass_inverse": dict(grad_method="merged", grad_block_v=32, grad_block_k=256,
                                                  output_method="split", pass_inverse_storage="fp32"),
    "merged_passes_read_pair": dict(grad_method="merged", grad_block_v=32, grad_block_k=256, output_method="fused",
                                    pass_inverse_storage="split", reverse_inverse_storage="split"),
    "staged_recompute_passes_read_pair": dict(grad_method="staged", grad_block_v=64, grad_block_k=64,
                                              grads_from_passes=False, pass_inverse_storage="split",
                                              reverse_inverse_storage="split"),
    "fused_split_output": dict(grad_method="fused", grad_block_v=32, grad_block_k=256, output_method="split",
                               output_block_v=64),
    "merged_split_output_inline_scalars": dict(grad_method="merged", grad_block_v=32, grad_block_k=256,
                                               output_method="split", pass_scalars="inline"),
    "merged_fused_output_inline_scalars": dict(grad_method="merged", grad_block_v=32, grad_block_k=256,
                                               output_method="fused", pass_scalars="inline"),
    "merged_inline_reverse_scores": dict(grad_method="merged", grad_block_v=32, grad_block_k=256,
                                         reverse_scores="inline"),
}
# Both output methods, each forced (the default picks one by shape).
OUTPUT_VARIANTS = {method: dict(output_method=method) for method in wy_chunk.OUTPUT_METHODS}


def _call(fn, x, op, **kwargs):
    """fn on x under one jit (op-by-op dispatch would compile every small op separately on a GPU)."""
    arrays = {n: a for n, a in x.items() if isinstance(a, jax.Array)}
    static = {n: a for n, a in x.items() if n not in arrays}
    return jax.jit(lambda a: _call_eager(fn, dict(static, **a), op, **kwargs))(arrays)


def _call_eager(fn, x, op, **kwargs):
    beta = x["beta"] if op == "delta_rule" else None
    return fn(x["q"], x["k"], x["v"], beta, x["log_decay"], scale=x.get("scale", 0.3),
              initial_state=x["initial_state"], segment_ids=x["segment_ids"], **kwargs)


def _kernel(grad=None, interpret=not ON_GPU):
    """chunk_wy with its default config, or with the fields of `grad` (a dict, e.g. from GRAD_VARIANTS) replaced."""
    if grad is None:
        return lambda *a, **kw: chunk_wy(*a, **kw, interpret=interpret)

    def fn(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids):
        cfg = default_config(q, v, scale=scale, chunk_size=64, delta=beta is not None,
                             segmented=segment_ids is not None, interpret=interpret)
        return chunk_wy(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                        interpret=interpret, config=wy_chunk.replace_config(cfg, **grad))

    return fn


def _weights(shape, seed):
    """A fixed, non-constant cotangent (so every output element matters)."""
    return jnp.cos(0.37 * jnp.arange(math.prod(shape), dtype=jnp.float32) + seed).reshape(shape)


def _grads(fn, x, op):
    """Gradients of <o, W_o> + <final_state, W_s> w.r.t. every differentiable input present."""
    names = [n for n in ARG_NAMES if x[n] is not None and not (n == "beta" and op != "delta_rule")]

    def loss(*args):
        o, s = _call(fn, dict(x, **dict(zip(names, args))), op)
        return jnp.sum(o.astype(jnp.float32) * _weights(o.shape, 1.0)) + jnp.sum(s * _weights(s.shape, 2.0))

    return dict(zip(names, jax.jit(jax.grad(loss, argnums=tuple(range(len(names)))))(*[x[n] for n in names])))


def _check(x, op, out_tol, grad_tols, fn=None, reference=recurrent_scan, state_tol=None):
    fn = fn or _kernel()
    ref_inputs = dict(x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v")})
    o, s = _call(fn, x, op)
    o_ref, s_ref = _call(reference, ref_inputs, op)
    assert o.dtype == x["v"].dtype and s.dtype == jnp.float32
    assert relative_error(o, o_ref) <= out_tol, relative_error(o, o_ref)
    assert relative_error(s, s_ref) <= (state_tol or out_tol), relative_error(s, s_ref)
    if grad_tols is None:
        return
    grads, grads_ref = _grads(fn, x, op), _grads(reference, ref_inputs, op)
    for name, g in grads.items():
        assert g.shape == x[name].shape
        err = relative_error(g, grads_ref[name])
        assert err <= grad_tols(name), (name, err)


def _fp32_grad_tol(name):
    return FP32_GRAD_TOL


# op, T, decay, packed, initial state, (H, Hv), (K, V): awkward lengths, packing, GVA, beta up to 2.
CPU_CASES = [
    ("delta_rule", 1, "scalar", False, True, (2, 2), (16, 16)),
    ("delta_rule", 63, "none", True, False, (1, 2), (16, 32)),
    ("delta_rule", 65, "scalar", False, True, (2, 4), (32, 16)),
    ("delta_rule", 1000, "scalar", True, True, (1, 1), (16, 16)),
    ("linear_attention", 65, "scalar", True, True, (1, 2), (16, 16)),
    ("linear_attention", 1000, "none", False, False, (1, 1), (16, 16)),
]


@pytest.mark.parametrize("grad", ["fused", "staged", "merged_fused_output"])
@pytest.mark.parametrize("op,T,decay,packed,init,heads,dims", CPU_CASES,
                         ids=[f"{c[0]}-T{c[1]}-{c[2]}-{'packed' if c[3] else 'dense'}-{'init' if c[4] else 'zero'}"
                              f"-H{c[5][0]}Hv{c[5][1]}" for c in CPU_CASES])
def test_matches_scan_fp32(op, T, decay, packed, init, heads, dims, grad):
    x = rule_inputs(fresh_key(), B=2, T=T, H=heads[0], Hv=heads[1], K=dims[0], V=dims[1], decay=decay,
                    beta_max=2.0, packed=packed, with_initial_state=init)
    _check(x, op, FP32_OUT_TOL, _fp32_grad_tol, fn=_kernel(GRAD_VARIANTS[grad]))


@pytest.mark.parametrize("block_v", [16, 32, 64])
def test_sequential_block_widths_fp32(block_v):
    """Every V block the default may pick (`common.sequential_block_v`) for the forward and reverse passes: one,
    two and four blocks of V = 64, gradients included."""
    x = rule_inputs(fresh_key(), B=1, T=130, H=1, Hv=2, K=16, V=64, beta_max=2.0, packed=True,
                    with_initial_state=True)
    _check(x, "delta_rule", FP32_OUT_TOL, _fp32_grad_tol, fn=_kernel(dict(block_v=block_v)))


def _adversarial(key, family, dtype=jnp.float32, B=1, T=130, H=1, Hv=2, K=16, V=16):
    """beta -> 2 (negative eigenvalues) with strongly correlated keys and decay near 0, or decays down to -20."""
    x = rule_inputs(key, B=B, T=T, H=H, Hv=Hv, K=K, V=V, beta_max=2.0, packed=True, with_initial_state=True,
                    dtype=dtype)
    ks = jax.random.split(jax.random.fold_in(key, 7), 3)
    x["beta"] = jax.random.uniform(ks[2], x["beta"].shape, minval=1.9, maxval=1.999)
    if family == "correlated_keys_decay_near_0":
        base = jax.random.normal(ks[0], (1, 1, H, K))
        k = base + 0.02 * jax.random.normal(ks[1], x["k"].shape)
        x["k"] = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
        x["log_decay"] = -1e-6 * jax.random.uniform(ks[0], x["log_decay"].shape)
    elif family == "decay_down_to_-20":
        x["log_decay"] = -20.0 * jax.random.uniform(ks[0], x["log_decay"].shape)
    elif family == "decay_-20_every_token":
        # Every cross-token decay underflows to ~0: only the exact same-token terms carry d(log_decay), so any
        # exp(0)-valued diagonal or end term that leaks into the gate gradient shows up at full size.
        x["log_decay"] = -20.0 + 0.01 * jax.random.uniform(ks[0], x["log_decay"].shape)
    elif family == "mixed_-20_and_near_0":
        # Near-zero gates after a -20 in the same chunk: their pair decays (~1) are differences of large G.
        strong = jax.random.bernoulli(ks[0], 0.2, x["log_decay"].shape)
        x["log_decay"] = jnp.where(strong, -20.0, -1e-4 * jax.random.uniform(ks[1], x["log_decay"].shape))
    return x


ADVERSARIAL = ("correlated_keys_decay_near_0", "decay_down_to_-20", "decay_-20_every_token",
               "mixed_-20_and_near_0")


@pytest.mark.parametrize("family,grad", covering(ADVERSARIAL, GRAD_VARIANTS))
def test_adversarial_fp32(family, grad):
    """fp32 outputs and final state within 1e-5 of the scan's, or within twice the error of the XLA chunked form
    on the same inputs where that is larger. With correlated keys and beta near 2, every chunked fp32 evaluation
    tested (the XLA chunk form, the kernels at C = 64 and 32, with one step of iterative refinement of u) lands
    1e-6 to 1.6e-5 from the scan (which agrees with a float64 scan to 8e-7): the chunk form's own error is what
    fp32 allows a chunked algorithm there. A kernel worse than it can still fail: the block-substitution inverse
    (3x the chunk form's output error on these inputs) failed in 1 of 9 draws.

    The chunk form's error is itself one draw of that rounding: taken at C = 64 alone, the kernel's state error
    exceeded twice it in 3 of 400 draws at K = V = 32 (2026-11-25; up to 1.6e-5 against 3.5e-6, while the chunk
    form alone reached 1.65e-5 on other draws). So the reference error is the largest of the chunk form at C = 32,
    64 and 128 (1 of the same 400 draws above twice that), and with either of its exact inverses: the kernels invert
    by fp32 forward substitution on 16 x 16 blocks, whose rounding differs from XLA's triangular solve (CI, seed
    1428893626: the kernel's state 1.58e-5 from the scan, the chunk form 5.35e-6 with the solve and 1.42e-5 with the
    blocked inverse at C = 64 and 128)."""
    dims = {} if grad == "fused" else dict(K=32, V=32)  # two K and two V blocks of 16
    x = _adversarial(fresh_key(), family, **dims)
    ref_inputs = dict(x, **{n: x[n].astype(jnp.float32) for n in ("q", "k", "v")})
    o_ref, s_ref = _call(recurrent_scan, ref_inputs, "delta_rule")
    chunk_form = dispatch.implementations("delta_rule")["chunk"].fn
    run = lambda chunk_size: _call(chunk_form, ref_inputs, "delta_rule", chunk_size=chunk_size)
    out_tol, state_tol = chunk_form_bounds(run, o_ref, s_ref, FP32_OUT_TOL)
    _check(x, "delta_rule", out_tol, _fp32_grad_tol, fn=_kernel(GRAD_VARIANTS[grad]), state_tol=state_tol)


def _inverse_inputs(key, dtype, *, B=2, T=192, H=1, Hv=2, K=32):
    """Correlated keys, beta in [1.9, 2), gates near 0 and packed documents: (I + A)^-1 has large entries."""
    ks = jax.random.split(key, 5)
    k = jax.random.normal(ks[0], (1, 1, H, K)) + 0.02 * jax.random.normal(ks[1], (B, T, H, K))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    beta = jax.random.uniform(ks[2], (B, T, Hv), minval=1.9, maxval=1.999)
    log_decay = -1e-3 * jax.random.uniform(ks[3], (B, T, Hv))
    g = wy_chunk._in_chunk_cumsum(SimpleNamespace(chunk_size=64), log_decay)  # [hi, lo] as the kernels read G
    doc = jnp.cumsum(jax.random.bernoulli(ks[4], 0.04, (B, T)).astype(jnp.int32), axis=1)
    return k, beta, g, doc


def _inverse_float64(k, beta, g, doc, C=64):
    """(I + A)^-1 of every chunk and value head in float64, laid out as `wy_chunk._inverse` writes it."""
    k, beta, g = (np.asarray(x.astype(jnp.float32), np.float64) for x in (k, beta, g))
    g = g[0] + g[1]  # G = hi + lo
    doc = np.asarray(doc)
    B, T, H, _ = k.shape
    Hv = beta.shape[2]
    t = np.zeros((B, T, Hv, C))
    for b, c, hv in itertools.product(range(B), range(T // C), range(Hv)):
        s = slice(c * C, (c + 1) * C)
        kc, gc = k[b, s, hv // (Hv // H)], g[b, s, hv]
        mask = np.tril(np.ones((C, C), bool), -1) & (doc[b, s][:, None] == doc[b, s][None, :])
        decay = np.exp(np.where(mask, gc[:, None] - gc[None, :], 0.0))
        t[b, s, hv] = np.linalg.inv(np.eye(C) + np.where(mask, beta[b, s, hv][:, None] * (kc @ kc.T) * decay, 0.0))
    return t


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_inverse_methods_are_exact(dtype):
    """T of every inverse method (default config otherwise) against float64 (I + A)^-1 of the same rounded keys,
    and against each other; exact zeros above the diagonal and across documents."""
    k, beta, g, doc = _inverse_inputs(fresh_key(), jnp.dtype(dtype))
    v = jax.ShapeDtypeStruct(beta.shape + k.shape[3:], k.dtype)
    cfg = default_config(k, v, scale=1.0, chunk_size=64, delta=True, segmented=True, interpret=not ON_GPU)
    t_ref = _inverse_float64(k, beta, g, doc)
    B, T, Hv, C = t_ref.shape
    chunks = np.asarray(doc).reshape(B, T // C, C)
    zero = (chunks[..., :, None] != chunks[..., None, :]) | np.triu(np.ones((C, C), bool), 1)  # (B, N, C, C)
    zero = np.broadcast_to(zero[:, :, None], (B, T // C, Hv, C, C))
    ts = {}
    for method in wy_chunk.INVERSE_METHODS:
        t = ts[method] = wy_chunk._inverse(dataclasses.replace(cfg, inverse_method=method), k, beta, g, doc)
        assert relative_error(t, t_ref) <= FP32_OUT_TOL, (method, relative_error(t, t_ref))
        t = np.asarray(t).reshape(B, T // C, C, Hv, C).transpose(0, 1, 3, 2, 4)  # (B, N, Hv, C, C)
        assert np.all(t[zero] == 0), method
    for method in wy_chunk.INVERSE_METHODS[1:]:
        err = relative_error(ts[method], ts[wy_chunk.INVERSE_METHODS[0]])
        assert err <= FP32_OUT_TOL, (method, err)
    # The bf16 pair (hi, lo) written for the gradient kernels: T itself split exactly as the kernels split it.
    t, pair = wy_chunk._inverse(cfg, k, beta, g, doc, pair=True)
    assert pair.dtype == jnp.bfloat16 and pair.shape == (2,) + t.shape
    hi = np.asarray(t.astype(jnp.bfloat16).astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(pair[0].astype(jnp.float32)), hi)
    np.testing.assert_array_equal(np.asarray(pair[1].astype(jnp.float32)),
                                  np.asarray(jnp.asarray(np.asarray(t) - hi).astype(jnp.bfloat16).astype(jnp.float32)))


def test_bf16_default_config_in_interpreter():
    """The 16-bit path (TF32 forward, bf16 backward dots) at the bf16 bounds, on the same rounded inputs."""
    x = rule_inputs(fresh_key(), B=1, T=130, H=1, Hv=2, K=32, V=32, beta_max=2.0, packed=True,
                    with_initial_state=True)
    x["scale"] = 32 ** -0.5
    _check(_round_trip_bf16(x), "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@pytest.mark.parametrize("op", dispatch.OPS)
def test_fp16_default_config_in_interpreter(op):
    """float16 inputs (fp16 products against scaled fp32 partners, fp16 outputs; the delta rule's saved states in
    fp16 at these sizes) at the 16-bit bounds, on the same rounded inputs; `test_gpu_fp16_matches_scan` is the same
    check on a GPU."""
    x = rule_inputs(fresh_key(), B=1, T=130, H=1, Hv=2, K=32, V=32, beta_max=2.0, packed=True,
                    with_initial_state=True)
    x["scale"] = 32 ** -0.5
    _check(_round_trip(x, jnp.float16), op, BF16_OUT_TOL, _bf16_grad_tol)


@pytest.mark.parametrize("op", dispatch.OPS)
def test_fp16_states_beyond_fp16_range(op):
    """float16 inputs whose state reaches ~1e5 (values ~3,000 on positive keys, an initial state of ~1e5) while
    the output, through small queries, stays ~1e3: the state's products scale it into fp16's range per tile
    (`common.fp16_scaled`); rounded to fp16 as it is, o and the final state came out inf. Forward only (the
    gradients of such a state are beyond fp16 themselves)."""
    x = rule_inputs(fresh_key(), B=1, T=300, H=1, Hv=2, K=32, V=32, decay="none", with_initial_state=True)
    x = dict(x, q=1e-3 * x["q"], k=jnp.abs(x["k"]), v=3000.0 + 100.0 * x["v"], initial_state=1e5 * x["initial_state"])
    x["scale"] = 32 ** -0.5
    _check(_round_trip(x, jnp.float16), op, BF16_OUT_TOL, None)


# float16 inputs' saved states as the "fp16" products read them (`Config.state_storage="fp16"`): each tile of the
# passes' V blocks scaled into fp16's range and rounded, with its factor. Forced here at BV 32 with two V blocks
# (the default takes it where the passes' V block holds the gradient kernel's, `rounded_state_storage`).
FP16_STATES = {method: dict(block_v=32, state_storage="fp16", output_method=method)
               for method in wy_chunk.OUTPUT_METHODS}


@pytest.mark.parametrize("output", list(FP16_STATES))
@pytest.mark.parametrize("family", [None, "correlated_keys_decay_near_0"])
def test_fp16_saved_states_in_interpreter(family, output):
    """The gradients with fp16 saved states at the 16-bit bounds, packed with an initial state or on correlated keys
    with beta near 2, and within 2e-3 of the same config's with fp32 saved states: the products that read them see
    the tile they would have scaled and rounded themselves (dq, dv and dbeta came out equal on the CPU), but for
    dk's state terms, which round both operands to bf16 and so round the fp16 tile a second time."""
    if family is None:
        x = rule_inputs(fresh_key(), B=1, T=130, H=1, Hv=2, K=32, V=64, beta_max=2.0, packed=True,
                        with_initial_state=True)
    else:
        x = _adversarial(fresh_key(), family, B=1, T=130, H=1, Hv=2, K=32, V=64)
    x = _round_trip(dict(x, scale=32 ** -0.5), jnp.float16)
    fn = _kernel(FP16_STATES[output])
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=fn)
    with_fp32_states = _grads(_kernel(dict(FP16_STATES[output], state_storage="fp32")), x, "delta_rule")
    for name, grad in _grads(fn, x, "delta_rule").items():
        assert relative_error(grad, with_fp32_states[name]) <= 2e-3, name


@pytest.mark.parametrize("batch,dtype,delta,expected", [
    (2, "float16", True, ("fp16", 32)),  # passes and gradient kernel in V blocks of 32
    (1, "float16", True, ("fp16", 16)),  # passes in V blocks of 16: the gradient kernel too
    (1, "float16", False, ("fp32", 32)),  # linear attention's gradients run the "staged" kernels
    (2, "bfloat16", True, ("bf16", 32)),
    (2, "float32", True, ("fp32", 32)),
])
def test_saved_state_storage_by_dtype_and_blocks(batch, dtype, delta, expected):
    x = rule_inputs(fresh_key(), B=batch, T=1, H=16, K=128, V=128)
    q, v = x["q"].astype(dtype), x["v"].astype(dtype)
    cfg = default_config(q, v, scale=1.0, chunk_size=64, delta=delta, segmented=False, interpret=True)
    assert (cfg.state_storage, cfg.grad_block_v) == expected
    if dtype == "float16":
        wider = 2 * cfg.block_v  # a gradient tile across two of the passes' V blocks
        for changes in [dict(grad_block_v=wider)] if delta else [dict(), dict(grad_block_v=cfg.block_v)]:
            with pytest.raises(ValueError, match="state_storage='fp16' needs"):
                wy_chunk.replace_config(cfg, state_storage="fp16", **changes)


# bf16 operands where the correlated-keys case tolerates them (`Config.grad_k_dots`: part 2's products with S_0,
# dS_end and dA; `Config.state_dots`: K S and K dS in the sequential passes), the default for bfloat16 inputs
# (float16 inputs round to fp16 there, `wy_chunk.FP16_DOTS`): it must hold the bf16 bounds on the case that
# rejected plain bf16 elsewhere. ALL_SPLIT keeps the "split" alternative of the same products tested.
TOLERANT_BF16 = dict(grad_k_dots="bf16", state_dots="bf16")
ALL_SPLIT = dict(grad_k_dots="split", state_dots="split")


def test_default_dots_by_input_dtype():
    """The rounding modes where the products tolerate them (bf16, fp16), the others exact pairs or IEEE fp32."""
    x = rule_inputs(fresh_key(), B=1, T=8, H=1, K=16, V=16)
    for dtype, tolerant, other in ((jnp.bfloat16, "bf16", "split"), (jnp.float16, "fp16", "fp16_split"),
                                   (jnp.float32, "highest", "highest")):
        cfg = default_config(x["q"].astype(dtype), x["v"].astype(dtype), scale=0.25, chunk_size=64, delta=True,
                             segmented=False, interpret=True)
        assert (cfg.state_dots, cfg.grad_k_dots) == (tolerant, tolerant), dtype
        assert (cfg.dots, cfg.grad_dots) == (other, other), dtype
        assert cfg.inverse_dots == ("highest" if dtype == jnp.float32 else "split"), dtype


@pytest.mark.parametrize("K,expected", [(256, ("staged", "bf16", "bf16", 1)), (128, ("merged", "bf16", "bf16", None))])
def test_staged_gradients_run_part_2_in_one_stage(K, expected):
    """bfloat16 inputs above `MERGED_MAX_K` ("staged"): bf16 saved states, part 2 in one pipeline stage, where with
    two its compiled dq exceeded the bound (`wy_chunk.STAGED_GRAD_K_STAGES`; docs/kernels.md, "dq of the staged
    gradient kernels at K = 256")."""
    x = rule_inputs(fresh_key(), B=1, T=8, H=1, K=K, V=64, dtype=jnp.bfloat16)
    cfg = default_config(x["q"], x["v"], scale=0.25, chunk_size=64, delta=True, segmented=False, interpret=True)
    assert (cfg.grad_method, cfg.grad_k_dots, cfg.state_storage, cfg.grad_k_stages) == expected


def test_staged_default_config_at_k256_in_interpreter():
    """The default config at K = 256 (the "staged" gradient kernels, part 2 in one stage) at the bf16 bounds;
    `test_gpu_staged_gradients_at_k256` is the same check compiled, on the sizes that found the bf16 states' defect."""
    x = rule_inputs(fresh_key(), B=1, T=130, H=1, Hv=2, K=256, V=64, beta_max=2.0, packed=True,
                    with_initial_state=True)
    x["scale"] = 256 ** -0.5
    _check(_round_trip_bf16(x), "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@pytest.mark.parametrize("dots", [TOLERANT_BF16, ALL_SPLIT], ids=["tolerant_bf16", "all_split"])
def test_state_dots_on_correlated_keys_in_interpreter(dots):
    x = _round_trip_bf16(_adversarial(fresh_key(), "correlated_keys_decay_near_0", B=1, T=130, H=1, Hv=2, K=32,
                                      V=32))
    x["scale"] = 32 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(dict(GRAD_VARIANTS["staged"], **dots)))


@pytest.mark.parametrize("family", ["correlated_keys_decay_near_0", "mixed_-20_and_near_0"])
def test_fp16_adversarial_in_interpreter(family):
    """float16 inputs' fp16 products (`common.dot`'s "fp16" and "fp16_split") on the correlated keys with beta
    near 2 and on decays of -20 beside ones near 0, at the 16-bit bounds; `test_gpu_adversarial_fp16` compiled."""
    x = _round_trip(_adversarial(fresh_key(), family, B=1, T=130, H=1, Hv=2, K=32, V=32), jnp.float16)
    x["scale"] = 32 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@pytest.mark.parametrize("family", ["correlated_keys_decay_near_0", "mixed_-20_and_near_0"])
def test_inverse_from_stored_a_in_interpreter(family):
    """`inverse_method="blocks16_from_a"` (A by its own kernel, then T from the stored A) through the whole rule:
    bf16 outputs, final state and gradients at the bf16 bounds against the fp32 scan, with packed documents, an
    initial state and grouped value heads."""
    x = _round_trip_bf16(_adversarial(fresh_key(), family, B=1, T=130, H=1, Hv=2, K=32, V=32))
    x["scale"] = 32 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(dict(inverse_method="blocks16_from_a")))


def test_no_gate_arithmetic_without_a_decay():
    """Without a log-decay the gates are zeros outright: the in-chunk cumsums of a constant zero log-decay were
    constant-folded by XLA at compile time (seconds per layer at training shapes). With one they are computed."""
    x = rule_inputs(fresh_key(), B=2, T=130, H=1, Hv=2, K=16, V=16, beta_max=2.0)

    def jaxpr_text(log_decay):
        def loss(q, k, v):
            o, s = chunk_wy(q, k, v, x["beta"], log_decay, scale=0.25, initial_state=None, segment_ids=None,
                            interpret=False)
            return jnp.sum(o) + jnp.sum(s)

        return str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(x["q"], x["k"], x["v"]))

    assert "cumsum" not in jaxpr_text(None)
    assert "cumsum" in jaxpr_text(x["log_decay"])


@pytest.mark.parametrize("rule", ["kaczmarz", "efla"])
def test_step_size_rules_on_raw_keys(rule):
    """Un-normalised keys through the normalised-key reduction, against the raw-key scan."""
    key = fresh_key()
    x = rule_inputs(key, B=1, T=100, H=1, Hv=2, K=16, V=16, normalise_keys=False, packed=True,
                    with_initial_state=True)
    x["k"] = x["k"] * jax.random.uniform(jax.random.fold_in(key, 1), x["k"].shape[:3] + (1,), minval=0.1,
                                         maxval=3.0)
    param = None if rule == "kaczmarz" else jax.random.uniform(jax.random.fold_in(key, 2), x["beta"].shape,
                                                               minval=0.1, maxval=3.0)
    k_hat, v_hat, beta_hat = step_size.normalise_keys(rule, x["k"], x["v"], param)
    o, s = chunk_wy(x["q"], k_hat, v_hat, beta_hat, x["log_decay"], scale=0.25, initial_state=x["initial_state"],
                    segment_ids=x["segment_ids"], interpret=not ON_GPU)
    o_ref, s_ref = step_size.delta_rule_with_step_size(
        rule, x["q"], x["k"], x["v"], param, x["log_decay"], scale=0.25, initial_state=x["initial_state"],
        segment_ids=x["segment_ids"], impl="scan")
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL


@pytest.mark.parametrize("batch,heads,V,expected", [
    (8, 16, 128, 32),  # 512 programs at BV 32: the widest
    (1, 16, 128, 16),  # 64 programs at BV 32: halved once
    (2, 16, 128, 16),  # 128 programs at BV 32, fewer than an H100's 132 SMs
    (1, 1, 64, 16),  # never below 16
    (64, 32, 256, 32),
])
def test_sequential_block_v_buys_programs_for_few_heads(batch, heads, V, expected):
    x = rule_inputs(fresh_key(), B=batch, T=1, H=heads, K=16, V=V)
    cfg = default_config(x["q"], x["v"], scale=1.0, chunk_size=64, delta=True, segmented=False, interpret=True)
    assert cfg.block_v == expected


@pytest.mark.parametrize("batch,heads,dtype,K,expected", [
    (2, 16, "bfloat16", 128, 32),  # BV 32 with one program per SM rather than 256 programs of BV 16
    (2, 16, "float16", 128, 32),  # fp16 too (measured on the H100, 2026-12-07)
    (2, 16, "float32", 128, 16),  # fp32's wider tiles: the narrowing
    (2, 16, "bfloat16", 256, 16),  # three stages do not fit at K = 256
    (1, 16, "bfloat16", 128, 16),  # 128 programs at BV 16 already
    (4, 16, "bfloat16", 128, 32),  # 256 programs at BV 32, none of 16 or 32 gives one per SM: the narrowing
    (8, 16, "bfloat16", 128, 32),
])
def test_16_bit_passes_take_one_program_per_sm_at_bv_32(batch, heads, dtype, K, expected):
    x = rule_inputs(fresh_key(), B=batch, T=1, H=heads, K=K, V=128)
    q, v = x["q"].astype(dtype), x["v"].astype(dtype)
    cfg = default_config(q, v, scale=1.0, chunk_size=64, delta=True, segmented=False, interpret=True)
    assert cfg.block_v == expected


@pytest.mark.parametrize("batch,heads,dtype,expected", [
    (8, 16, "bfloat16", ("fused", None, "fp32", "fp32", "inline")),  # 512 programs: two waves of two per SM
    (2, 16, "bfloat16", ("split", 3, "split", "split", "stored")),  # bf16: 128 programs at BV 32, one per SM
    (2, 16, "float16", ("split", 3, "split", "split", "stored")),  # fp16 likewise
    (2, 16, "float32", ("split", None, "fp32", "fp32", "inline")),  # 256 programs at BV 16: one wave
    (1, 16, "bfloat16", ("split", 3, "split", "split", "stored")),  # 128 programs: at most one per SM
    (1, 16, "float32", ("split", 3, "fp32", "fp32", "stored")),  # IEEE fp32 products with T: no pair
])
@pytest.mark.parametrize("K", [16, 256])
def test_output_method_and_pass_stages_follow_the_programs(batch, heads, dtype, expected, K):
    """(output method, pass stages, how the forward and the reverse pass read T, where the reverse pass gets its
    scores) by the passes' programs."""
    if K == 256:
        # Three stages' buffers do not fit in shared memory at K = 256: two, and the reverse reads fp32. Nor does
        # the 16-bit layout of BV 32 apply: 2 x 16 heads take BV 16, 256 programs.
        expected = (expected[0], None, expected[2], "fp32", "stored" if batch == 1 else "inline")
    x = rule_inputs(fresh_key(), B=batch, T=1, H=heads, K=K, V=128)
    q, v = x["q"].astype(dtype), x["v"].astype(dtype)
    cfg = default_config(q, v, scale=1.0, chunk_size=64, delta=True, segmented=False, interpret=True)
    assert (cfg.output_method, cfg.pass_stages, cfg.pass_inverse_storage, cfg.reverse_inverse_storage,
            cfg.reverse_scores) == expected


def test_supports_fails_closed():
    call = dispatch.RuleCall(op="delta_rule", batch=2, seq_len=100, key_heads=2, value_heads=4, key_dim=128,
                             value_dim=128, dtype="bfloat16", decay="scalar", has_initial_state=True,
                             has_segment_ids=True, chunk_size=64, platform="gpu")
    assert pallas_gpu.supports(call)
    assert pallas_gpu.supports(call._replace(op="linear_attention", decay="none", has_segment_ids=False))
    assert pallas_gpu.supports(call._replace(dtype="float32"))
    assert pallas_gpu.supports(call._replace(dtype="float16"))
    for change in (dict(platform="cpu"), dict(platform="tpu"), dict(decay="channel"), dict(key_dim=96),
                   dict(value_dim=32), dict(dtype="float64"), dict(chunk_size=32),
                   dict(value_heads=3), dict(batch=1 << 14)):
        assert not pallas_gpu.supports(call._replace(**change)), change
    assert dispatch.implementations("delta_rule")["pallas"].fn is pallas_gpu.chunked_delta_rule
    assert dispatch.implementations("linear_attention")["pallas"].fn is chunk_wy


# ---------------------------------------------------------------------------------------------------------------
# Lowering every supported configuration for CUDA on CPU (abstract H100)
# ---------------------------------------------------------------------------------------------------------------


def _lower_for_cuda(op, K, V, dtype, *, T=130, segmented=True, init=True, decay=True, grad=None):
    B, H, Hv = 1, 2, 4
    q = jax.ShapeDtypeStruct((B, T, H, K), dtype)
    v = jax.ShapeDtypeStruct((B, T, Hv, V), dtype)
    gate = jax.ShapeDtypeStruct((B, T, Hv), jnp.float32)
    h0 = jax.ShapeDtypeStruct((B, Hv, K, V), jnp.float32) if init else None
    ids = jax.ShapeDtypeStruct((B, T), jnp.int32) if segmented else None

    def loss(q, k, v, beta, log_decay, h0, ids):
        o, s = _kernel(grad, interpret=False)(q, k, v, beta if op == "delta_rule" else None,
                                              log_decay if decay else None, scale=0.1, initial_state=h0,
                                              segment_ids=ids)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(s)

    argnums = (0, 1, 2, 3, 4) + ((5,) if init else ())
    fn = jax.jit(jax.value_and_grad(loss, argnums=argnums))
    with jax.sharding.use_abstract_mesh(H100):
        text = fn.trace(q, q, v, gate, gate, h0, ids).lower(lowering_platforms=("cuda",)).as_text()
    return text.count("__gpu$xla.gpu.triton")


@pytest.mark.parametrize("method", wy_chunk.INVERSE_METHODS)
def test_inverse_lowers_for_cuda(method):
    """Each inverse method alone, every head size, dtype and mask case (the default one is also lowered below)."""
    B, T, H, Hv = 1, 128, 2, 4  # T padded to chunks, as `chunk_wy` passes it
    gate = jax.ShapeDtypeStruct((B, T, Hv), jnp.float32)
    gates = jax.ShapeDtypeStruct((2, B, T, Hv), jnp.float32)  # G as [hi, lo]
    doc = jax.ShapeDtypeStruct((B, T), jnp.int32)
    for K, dtype, segmented in itertools.product(pallas_gpu.HEAD_DIMS, pallas_gpu.DTYPES, (False, True)):
        k = jax.ShapeDtypeStruct((B, T, H, K), jnp.dtype(dtype))
        v = jax.ShapeDtypeStruct((B, T, Hv, K), jnp.dtype(dtype))
        cfg = default_config(k, v, scale=1.0, chunk_size=64, delta=True, segmented=segmented, interpret=False)
        cfg = dataclasses.replace(cfg, inverse_method=method)
        fn = jax.jit(lambda k, beta, g, doc: wy_chunk._inverse(cfg, k, beta, g, doc))
        with jax.sharding.use_abstract_mesh(H100):
            text = fn.trace(k, gate, gates, doc).lower(lowering_platforms=("cuda",)).as_text()
        kernels = 2 if method == "blocks16_from_a" else 1  # A's kernel, then the inverse
        assert text.count("__gpu$xla.gpu.triton") == kernels, (K, dtype, segmented)


def _kernel_count(op, grad_method, output_method="fused", reverse_scores="inline"):
    """(inverse,) forward pass (and the output kernel of "split"), (the reverse pass's scores,) reverse pass,
    gradients (one kernel, or two when staged; linear attention takes "staged" for "merged")."""
    split = output_method == "split"
    if op == "delta_rule":
        return 4 + (grad_method == "staged") + split + (reverse_scores == "stored")
    return 3 + (grad_method in ("staged", "merged")) + split


@pytest.mark.parametrize("index,op", list(enumerate(dispatch.OPS)))
def test_lowers_for_cuda_every_supported_config(index, op):
    """The default config at every supported (K, V, dtype), then with each combination of documents, initial state
    and decay. On a CPU each op lowers half of them (`share`, the other op the other half: ~100 s per op and half on
    a 2-core machine)."""
    cases = [dict(K=K, V=V, dtype=dtype) for K, V, dtype in itertools.product(
        pallas_gpu.HEAD_DIMS, pallas_gpu.HEAD_DIMS, pallas_gpu.DTYPES)] + [
        dict(K=128, V=128, dtype="bfloat16", T=64, segmented=segmented, init=init, decay=decay)
        for segmented, init, decay in itertools.product((False, True), repeat=3)]
    for case in share(cases, index, 2):
        K, V, dtype = case["K"], case["V"], case["dtype"]
        kernels = _kernel_count(op, wy_chunk.default_grad_method(K), wy_chunk.default_output_method(4, K, V),
                                wy_chunk.default_reverse_scores(4, K, V, sixteen_bit=dtype != "float32"))
        assert _lower_for_cuda(op, **dict(case, dtype=jnp.dtype(dtype))) == kernels, case


@pytest.mark.parametrize("output", list(FP16_STATES))
def test_fp16_saved_states_lower_for_cuda(output):
    """fp16 saved states with their factors, float16 inputs, K = V = 128 and K = 64, V = 256 (both all masks)."""
    for K, V in ((128, 128), (64, 256)):
        kernels = _kernel_count("delta_rule", "merged", output, wy_chunk.default_reverse_scores(4, K, V,
                                                                                               sixteen_bit=True))
        assert _lower_for_cuda("delta_rule", K, V, jnp.float16, grad=FP16_STATES[output]) == kernels, (K, V)


# Head sizes for the gradient variants: every size as K and as V, both square and both lopsided extremes.
VARIANT_HEAD_DIMS = tuple((d, d) for d in pallas_gpu.HEAD_DIMS) + (
    (min(pallas_gpu.HEAD_DIMS), max(pallas_gpu.HEAD_DIMS)), (max(pallas_gpu.HEAD_DIMS), min(pallas_gpu.HEAD_DIMS)))
# Mask/gate cases besides all three present: none, and each one absent.
VARIANT_MASK_CASES = ((False, False, False), (False, True, True), (True, False, True), (True, True, False))
# Linear attention has no beta, so no inverse and no u or dx from the passes: the variants that differ from
# another only there would lower that one's kernels again.
LINEAR_ATTENTION_SAME_KERNELS = ("staged_recompute", "merged_split_output_fp32_pass_inverse",
                                 "merged_passes_read_pair", "staged_recompute_passes_read_pair",
                                 "merged_inline_reverse_scores")
GRAD_LOWERING_CASES = [(op, grad) for op in dispatch.OPS for grad in LOWERED_GRAD_VARIANTS
                       if not (op == "linear_attention" and grad in LINEAR_ATTENTION_SAME_KERNELS)]
# The lowerings of one variant: each head pair (all masks and gates present), then each mask/gate case at 128.
VARIANT_LOWERINGS = [dict(K=K, V=V) for K, V in VARIANT_HEAD_DIMS] + [
    dict(K=128, V=128, T=64, segmented=segmented, init=init, decay=decay)
    for segmented, init, decay in VARIANT_MASK_CASES]


@pytest.mark.parametrize("index,op,grad", [(i, *case) for i, case in enumerate(GRAD_LOWERING_CASES)])
def test_lowers_for_cuda_every_grad_method(index, op, grad):
    """Each gradient variant at the block sizes swept on the H100 (bf16): each head size as K and as V, and the
    mask/gate cases with one or all absent. Lowering is Python-bound: with the full products (9 head pairs, 8
    cases) each variant took 94 s on a 2-core CPU machine (2026-12-02), and with the 9 lowerings of
    `VARIANT_LOWERINGS` 30 s, 12 min of a CI run's worker time for the 25 variant/op pairs (2026-12-05). On a CPU
    each pair therefore lowers one of them (`share`: consecutive pairs take the others, so every lowering runs
    under two or three variants). The default configuration lowers the full products in
    `test_lowers_for_cuda_every_supported_config`."""
    variant = LOWERED_GRAD_VARIANTS[grad]
    for case in share(VARIANT_LOWERINGS, index, len(VARIANT_LOWERINGS)):
        K, V = case["K"], case["V"]
        kernels = _kernel_count(
            op, variant["grad_method"], variant.get("output_method", wy_chunk.default_output_method(4, 128, V)),
            variant.get("reverse_scores", wy_chunk.default_reverse_scores(4, K, V, sixteen_bit=True)))
        assert _lower_for_cuda(op, dtype=jnp.bfloat16, grad=variant, **case) == kernels, case


# ---------------------------------------------------------------------------------------------------------------
# GPU only: compiled kernels, bf16 tolerances, through the dispatch
# ---------------------------------------------------------------------------------------------------------------

gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


def _bf16_grad_tol(name):
    return BF16_GATE_GRAD_TOL if name in ("beta", "log_decay") else BF16_GRAD_TOL


def _round_trip(x, dtype):
    """q/k/v in `dtype`; the fp32 reference sees the same rounded values."""
    return dict(x, **{n: x[n].astype(dtype) for n in ("q", "k", "v")})


def _round_trip_bf16(x):
    return _round_trip(x, jnp.bfloat16)


GPU_CASES = [
    ("delta_rule", 1000, "scalar", True, True, (2, 4), (128, 128)),
    ("delta_rule", 1, "scalar", False, True, (2, 2), (128, 128)),
    ("delta_rule", 300, "none", False, False, (2, 2), (64, 256)),
    ("delta_rule", 257, "scalar", True, True, (1, 2), (256, 64)),
    ("linear_attention", 1000, "scalar", True, True, (2, 4), (128, 128)),
    ("linear_attention", 129, "none", False, False, (1, 1), (256, 256)),
    # 2 x 16 value heads: 16-bit passes at BV 32 with three stages (one program per SM)
    ("delta_rule", 200, "scalar", True, True, (8, 16), (128, 128)),
]


@gpu_only
@pytest.mark.parametrize("op,T,decay,packed,init,heads,dims", GPU_CASES)
def test_gpu_bf16_matches_scan(op, T, decay, packed, init, heads, dims):
    x = rule_inputs(fresh_key(), B=2, T=T, H=heads[0], Hv=heads[1], K=dims[0], V=dims[1], decay=decay,
                    beta_max=2.0, packed=packed, with_initial_state=init)
    x["scale"] = dims[0] ** -0.5
    _check(_round_trip_bf16(x), op, BF16_OUT_TOL, _bf16_grad_tol)


@gpu_only
@pytest.mark.parametrize("op,T,decay,packed,init,heads,dims", GPU_CASES)
def test_gpu_fp16_matches_scan(op, T, decay, packed, init, heads, dims):
    """float16 inputs at the bf16 bounds (fp16 keeps 3 more mantissa bits); it passed on the H100 (2026-11-25)
    before float16 joined `pallas_gpu.DTYPES`."""
    x = rule_inputs(fresh_key(), B=2, T=T, H=heads[0], Hv=heads[1], K=dims[0], V=dims[1], decay=decay,
                    beta_max=2.0, packed=packed, with_initial_state=init)
    x["scale"] = dims[0] ** -0.5
    _check(_round_trip(x, jnp.float16), op, BF16_OUT_TOL, _bf16_grad_tol)


@gpu_only
@pytest.mark.parametrize("op,T,decay,packed,init,heads,dims", GPU_CASES[:2] + GPU_CASES[4:5])
def test_gpu_fp32_matches_scan(op, T, decay, packed, init, heads, dims):
    x = rule_inputs(fresh_key(), B=2, T=T, H=heads[0], Hv=heads[1], K=dims[0], V=dims[1], decay=decay,
                    beta_max=2.0, packed=packed, with_initial_state=init)
    x["scale"] = dims[0] ** -0.5
    _check(x, op, FP32_OUT_TOL, _fp32_grad_tol)


@gpu_only
@pytest.mark.parametrize("draw", range(3))
def test_gpu_staged_gradients_at_k256(draw):
    """The default config at K = 256, V = 128 on the sizes where the "staged" kernels' dq with bf16 saved states
    reached 7.3e-3 with part 2 in two pipeline stages (H200, 2026-12-04; one since, `wy_chunk.STAGED_GRAD_K_STAGES`),
    three fresh draws: every gradient within the bf16 bounds."""
    x = rule_inputs(fresh_key(), B=8, T=600, H=4, K=256, V=128, beta_max=2.0, packed=True, with_initial_state=True)
    x["scale"] = 256 ** -0.5
    _check(_round_trip_bf16(x), "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@gpu_only
@pytest.mark.parametrize("family", ADVERSARIAL)
def test_gpu_adversarial_bf16(family):
    x = _round_trip_bf16(_adversarial(fresh_key(), family, B=2, T=500, H=2, Hv=4, K=128, V=128))
    x["scale"] = 128 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@gpu_only
@pytest.mark.parametrize("family", ADVERSARIAL)
def test_gpu_adversarial_fp16(family):
    x = _round_trip(_adversarial(fresh_key(), family, B=2, T=500, H=2, Hv=4, K=128, V=128), jnp.float16)
    x["scale"] = 128 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol)


@gpu_only
@pytest.mark.parametrize("output", list(FP16_STATES))
@pytest.mark.parametrize("family", ADVERSARIAL)
def test_gpu_adversarial_fp16_saved_states(family, output):
    x = _round_trip(_adversarial(fresh_key(), family, B=2, T=500, H=2, Hv=4, K=128, V=128), jnp.float16)
    x["scale"] = 128 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(FP16_STATES[output]))


@gpu_only
@pytest.mark.parametrize("output", list(OUTPUT_VARIANTS))
@pytest.mark.parametrize("family", ADVERSARIAL)
def test_gpu_adversarial_output_methods(family, output):
    x = _round_trip_bf16(_adversarial(fresh_key(), family, B=2, T=500, H=2, Hv=4, K=128, V=128))
    x["scale"] = 128 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(OUTPUT_VARIANTS[output]))


@gpu_only
@pytest.mark.parametrize("reverse_scores", wy_chunk.REVERSE_SCORES)
@pytest.mark.parametrize("op,T,decay,packed,init,heads,dims", [GPU_CASES[0], GPU_CASES[3]])
def test_gpu_reverse_scores_match_scan(op, T, decay, packed, init, heads, dims, reverse_scores):
    """Both places the reverse pass gets scale P^T dO from (`Config.reverse_scores`), compiled, bf16."""
    x = rule_inputs(fresh_key(), B=2, T=T, H=heads[0], Hv=heads[1], K=dims[0], V=dims[1], decay=decay,
                    beta_max=2.0, packed=packed, with_initial_state=init)
    x["scale"] = dims[0] ** -0.5
    _check(_round_trip_bf16(x), op, BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(dict(reverse_scores=reverse_scores)))


@gpu_only
@pytest.mark.parametrize("family", ADVERSARIAL)
def test_gpu_adversarial_all_split_dots(family):
    x = _round_trip_bf16(_adversarial(fresh_key(), family, B=2, T=500, H=2, Hv=4, K=128, V=128))
    x["scale"] = 128 ** -0.5
    _check(x, "delta_rule", BF16_OUT_TOL, _bf16_grad_tol, fn=_kernel(ALL_SPLIT))


@gpu_only
def test_gpu_dispatch_picks_a_pallas_kernel():
    """"auto" on a GPU takes the Mosaic GPU kernels where they run (Hopper; grouped value heads included), else the
    Triton ones; "pallas" named explicitly runs the Triton kernels, for the delta rule and a step-size rule."""
    x = _round_trip_bf16(rule_inputs(fresh_key(), B=1, T=200, H=2, Hv=4, K=128, V=128, beta_max=2.0,
                                     packed=True, with_initial_state=True))
    call = dispatch.describe_call("delta_rule", x["q"], x["k"], x["v"], x["log_decay"], x["initial_state"],
                                  x["segment_ids"], 64)
    expected = "mosaic" if pallas_gpu.hopper_compute_capability() else "pallas"
    assert dispatch.select("delta_rule", "auto", call).name == expected
    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"])
    kw = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"])
    o, s = deltajax.delta_rule(*args, impl="pallas", **kw)
    o_ref, s_ref = deltajax.delta_rule(*(a.astype(jnp.float32) for a in args), impl="scan", **kw)
    assert relative_error(o, o_ref) <= BF16_OUT_TOL and relative_error(s, s_ref) <= BF16_OUT_TOL
    x["k"] = x["k"] * 2.0
    o, _ = deltajax.kaczmarz(x["q"], x["k"], x["v"], x["log_decay"], impl="pallas", **kw)
    o_ref, _ = deltajax.kaczmarz(*(x[n].astype(jnp.float32) for n in ("q", "k", "v")), x["log_decay"], impl="scan",
                                 **kw)
    assert relative_error(o, o_ref) <= BF16_OUT_TOL
