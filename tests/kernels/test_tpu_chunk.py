"""The Mosaic TPU kernels ("pallas_tpu") under the TPU interpreter against the fp32 scan, and their TPU lowering.

No TPU is needed: `deltajax.kernels.tpu.interpret()` runs the kernels in Pallas's TPU interpreter (NaN-filled
uninitialised memory, out-of-bounds reads raise) and lets the dispatch choose them on the CPU backend. Shapes are
shared between cases so that each compiled interpreter program serves several of them.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import deltajax
from deltajax.kernels import tpu
from deltajax.kernels.tpu import chunk as tpu_chunk
from deltajax.rules import dispatch
from testing_utils import assert_tpu_lowering, fresh_key, relative_error, rule_inputs

FP32_OUT_TOL = 1e-5
FP32_GRAD_TOL = 1e-4
BF16_OUT_TOL = 3e-3
BF16_GRAD_TOL = 6e-3  # dq, dk, dv, d(initial state)
BF16_GATE_GRAD_TOL = 1e-2  # dbeta, dlog_decay

# One shape for most cases (3 chunks of 64, grouped value heads), so its compiled programs are reused.
MAIN = dict(B=2, T=130, H=1, Hv=2, K=16, V=8)
DIFF_ARGS = ("q", "k", "v", "beta", "log_decay", "initial_state")


def _call(op, x, impl, **kwargs):
    if op == "linear_attention":
        return deltajax.linear_attention(x["q"], x["k"], x["v"], x["log_decay"], initial_state=x["initial_state"],
                                         segment_ids=x["segment_ids"], impl=impl, **kwargs)
    return deltajax.delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], initial_state=x["initial_state"],
                               segment_ids=x["segment_ids"], impl=impl, **kwargs)


def _as_f32(x):
    return {name: (v.astype(jnp.float32) if v is not None and jnp.issubdtype(v.dtype, jnp.floating) else v)
            for name, v in x.items()}


def _forward_and_grads(op, x, impl, key, cotangent_dtype, **kwargs):
    """(o, final_state, {name: gradient}) of sum(o * c_o) + sum(state * c_s) with random cotangents.

    c_o is rounded to `cotangent_dtype` so that kernel and reference see the same cotangent."""
    names = [n for n in DIFF_ARGS if x.get(n) is not None and not (op == "linear_attention" and n == "beta")]

    def f(*diff):
        return _call(op, {**x, **dict(zip(names, diff))}, impl, **kwargs)

    (o, s), vjp = jax.vjp(f, *(x[n] for n in names))
    k_o, k_s = jax.random.split(key)
    c_o = jax.random.normal(k_o, o.shape, jnp.float32).astype(cotangent_dtype).astype(o.dtype)
    c_s = jax.random.normal(k_s, s.shape, jnp.float32)
    return o, s, dict(zip(names, vjp((c_o, c_s))))


def _check(op, x, *, dtype=jnp.float32, chunk_size=64, grads=True):
    """Kernel (interpreted) vs the fp32 scan on the same (possibly bf16-rounded) inputs."""
    key = fresh_key()
    reference = _as_f32(x)
    if grads:
        o_ref, s_ref, g_ref = _forward_and_grads(op, reference, "scan", key, dtype)
        with tpu.interpret():
            o, s, g = _forward_and_grads(op, x, "pallas_tpu", key, dtype, chunk_size=chunk_size)
    else:
        o_ref, s_ref = _call(op, reference, "scan")
        with tpu.interpret():
            o, s = _call(op, x, "pallas_tpu", chunk_size=chunk_size)
    assert o.dtype == x["v"].dtype and s.dtype == jnp.float32
    out_tol = FP32_OUT_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    assert relative_error(o, o_ref) <= out_tol, relative_error(o, o_ref)
    assert relative_error(s, s_ref) <= out_tol, relative_error(s, s_ref)
    if not grads:
        return
    for name, grad in g.items():
        if dtype == jnp.float32:
            tol = FP32_GRAD_TOL
        else:
            tol = BF16_GATE_GRAD_TOL if name in ("beta", "log_decay") else BF16_GRAD_TOL
        assert grad.shape == x[name].shape, name
        assert relative_error(grad, g_ref[name]) <= tol, (name, relative_error(grad, g_ref[name]))


def _inputs(op, *, decay="scalar", packed=True, init=True, dtype=jnp.float32, beta_max=2.0, **shape):
    shape = {**MAIN, **shape}
    x = rule_inputs(fresh_key(), decay=decay, packed=packed, with_initial_state=init, beta_max=beta_max,
                    dtype=dtype, **shape)
    if op == "linear_attention":
        x["beta"] = None
    return x


# ---------------------------------------------------------------------------------------------------------------
# Forward and gradients

GRAD_CASES = [
    # op, decay, packed, init, dtype, shape overrides
    ("delta_rule", "scalar", True, True, jnp.float32, {}),
    ("delta_rule", "none", False, False, jnp.float32, dict(T=63, H=2, Hv=2)),
    ("linear_attention", "scalar", True, False, jnp.float32, dict(T=65)),
    ("linear_attention", "none", False, True, jnp.float32, dict(T=1, B=1)),
    ("delta_rule", "scalar", False, False, jnp.float32, dict(T=300, B=1, H=2, Hv=2, K=40, V=24)),
    ("delta_rule", "scalar", True, True, jnp.bfloat16, {}),
    ("linear_attention", "scalar", False, True, jnp.bfloat16, dict(T=70, H=2, Hv=2)),
]


@pytest.mark.parametrize("op,decay,packed,init,dtype,shape", GRAD_CASES,
                         ids=[f"{c[0]}-{c[1]}-{'packed' if c[2] else 'dense'}-{'init' if c[3] else 'zero'}-"
                              f"{jnp.dtype(c[4]).name}-T{c[5].get('T', MAIN['T'])}" for c in GRAD_CASES])
def test_forward_and_grads_match_scan(op, decay, packed, init, dtype, shape):
    _check(op, _inputs(op, decay=decay, packed=packed, init=init, dtype=dtype, **shape), dtype=dtype)


def _length_cases():
    combos = itertools.cycle(itertools.product(("delta_rule", "linear_attention"), ("scalar", "none")))
    for T, packed, init in ((1, False, True), (63, True, False), (65, False, True), (300, True, True)):
        op, decay = next(combos)
        yield pytest.param(op, decay, T, packed, init, id=f"{op}-{decay}-T{T}")


@pytest.mark.parametrize("op,decay,T,packed,init", list(_length_cases()))
def test_awkward_lengths_forward(op, decay, T, packed, init):
    _check(op, _inputs(op, decay=decay, packed=packed, init=init, T=T, B=1), grads=False)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
def test_other_chunk_sizes(chunk_size):
    x = _inputs("delta_rule", T=100, B=1, K=20, V=12)
    _check("delta_rule", x, chunk_size=chunk_size, grads=chunk_size == 16)


# ---------------------------------------------------------------------------------------------------------------
# Adversarial families (same shapes as MAIN: the compiled programs are reused)

def _adversarial(family):
    x = _inputs("delta_rule")
    B, T, Hv = x["beta"].shape
    key = fresh_key()
    if family == "beta_to_2":
        x["beta"] = 2.0 - 1e-3 * jax.random.uniform(key, (B, T, Hv))
    elif family == "decay_near_0":
        x["log_decay"] = -1e-6 * jax.random.uniform(key, (B, T, Hv))
    elif family == "decay_to_minus_20":
        x["log_decay"] = -20.0 * jax.random.uniform(key, (B, T, Hv), minval=0.05, maxval=1.0)
    elif family == "mixed_decay":
        strong = jax.random.bernoulli(key, 0.2, (B, T, Hv))
        x["log_decay"] = jnp.where(strong, jnp.float32(-20.0), jnp.float32(-1e-4))
    elif family == "correlated_keys":
        k_base, k_noise = jax.random.split(key)
        base = jax.random.normal(k_base, (1, 1, 1, MAIN["K"]))
        k = base + 0.02 * jax.random.normal(k_noise, x["k"].shape)
        x["k"] = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        x["beta"] = jax.random.uniform(key, (B, T, Hv), minval=1.5, maxval=2.0)
    return x


@pytest.mark.parametrize("family", ["beta_to_2", "decay_near_0", "decay_to_minus_20", "mixed_decay",
                                    "correlated_keys"])
def test_adversarial_families(family):
    _check("delta_rule", _adversarial(family))


def _strong_decay(family, x):
    """[B, T, Hv] log-decays: exactly -20 everywhere, or so on value head 0 and on value head 1 a mix of -20
    and near-0 gates (-1e-4 U(0, 1)), half each."""
    B, T, Hv = x["v"].shape[:3]
    everywhere = jnp.full((B, T, Hv), -20.0, jnp.float32)
    if family == "minus_20_everywhere":
        return everywhere
    k_strong, k_small = jax.random.split(fresh_key())
    strong = jax.random.bernoulli(k_strong, 0.5, (B, T, Hv))
    mixed = jnp.where(strong, jnp.float32(-20.0), -1e-4 * jax.random.uniform(k_small, (B, T, Hv)))
    return everywhere.at[:, :, 1:].set(mixed[:, :, 1:])


@pytest.mark.parametrize("op", ["delta_rule", "linear_attention"])
@pytest.mark.parametrize("family", ["minus_20_everywhere", "minus_20_and_near_0"])
def test_log_decay_minus_20_on_every_token(op, family):
    """d(log_decay) is ~exp(-20) where every gate is -20: it must not carry O(eps) residues of the O(1) terms
    whose decay is exactly 1 (pairs t = s; e_s = exp(G_C - G_s) of the chunk's last token and of the last real
    token before a padded tail). T = 130 is not a chunk multiple, with packed documents and an initial state. The
    gate gradients are compared per value head, so the mixed head (O(1) gradients) cannot hide the all -20 head."""
    x = _inputs(op)
    x["log_decay"] = _strong_decay(family, x)
    key = fresh_key()
    o_ref, s_ref, g_ref = _forward_and_grads(op, x, "scan", key, jnp.float32)
    with tpu.interpret():
        o, s, g = _forward_and_grads(op, x, "pallas_tpu", key, jnp.float32, chunk_size=64)
    assert relative_error(o, o_ref) <= FP32_OUT_TOL, relative_error(o, o_ref)
    assert relative_error(s, s_ref) <= FP32_OUT_TOL, relative_error(s, s_ref)
    for name, grad in g.items():
        assert relative_error(grad, g_ref[name]) <= FP32_GRAD_TOL, (name, relative_error(grad, g_ref[name]))
    for name in [n for n in ("beta", "log_decay") if n in g]:  # [B, T, Hv]
        for head in range(MAIN["Hv"]):
            error = relative_error(g[name][..., head], g_ref[name][..., head])
            assert error <= FP32_GRAD_TOL, (name, head, error)


def test_index_maps_under_x64():
    """With jax_enable_x64 on, grid indices stay int32 while Python ints would become int64 in the index maps."""
    x = _inputs("delta_rule", T=70, B=1)
    key = fresh_key()
    o_ref, s_ref, g_ref = _forward_and_grads("delta_rule", x, "scan", key, jnp.float32)
    x64_before = jax.config.jax_enable_x64
    with jax.enable_x64(True), tpu.interpret():  # the context manager restores the flag on exit
        o, s, g = _forward_and_grads("delta_rule", x, "pallas_tpu", key, jnp.float32, chunk_size=64)
    assert jax.config.jax_enable_x64 == x64_before
    assert o.dtype == jnp.float32 and s.dtype == jnp.float32
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL
    for name, grad in g.items():
        assert relative_error(grad, g_ref[name]) <= FP32_GRAD_TOL, (name, relative_error(grad, g_ref[name]))


STEP_RULE_CASES = [
    ("kaczmarz", lambda q, k, v, p, d, **kw: deltajax.kaczmarz(q, k, v, d, **kw)),
    ("relaxed_kaczmarz", lambda q, k, v, p, d, **kw: deltajax.relaxed_kaczmarz(q, k, v, 1.9 * p, d, **kw)),
    ("longhorn", lambda q, k, v, p, d, **kw: deltajax.longhorn(q, k, v, 3.0 * p, d, **kw)),
    ("efla", lambda q, k, v, p, d, **kw: deltajax.efla(q, k, v, 2.0 * p, d, **kw)),
]


@pytest.mark.parametrize("rule,fn", STEP_RULE_CASES, ids=[c[0] for c in STEP_RULE_CASES])
def test_step_size_rules_on_raw_keys(rule, fn):
    """Un-normalised keys (norms from 0.1 to 5) through the normalised-key reduction into the kernel."""
    x = _inputs("delta_rule", beta_max=1.0)
    norms = jax.random.uniform(fresh_key(), x["k"].shape[:3] + (1,), minval=0.1, maxval=5.0)
    x["k"] = x["k"] * norms
    param = x["beta"]
    c_o = jax.random.normal(fresh_key(), x["v"].shape)
    c_s = jax.random.normal(fresh_key(), x["initial_state"].shape)

    def loss_and_outputs(impl, q, k, v, d, h0):
        o, s = fn(q, k, v, param, d, initial_state=h0, segment_ids=x["segment_ids"], impl=impl)
        return jnp.sum(o * c_o) + jnp.sum(s * c_s), (o, s)

    args = (x["q"], x["k"], x["v"], x["log_decay"], x["initial_state"])
    grad = lambda impl: jax.grad(lambda *a: loss_and_outputs(impl, *a), argnums=(0, 1, 2, 3, 4), has_aux=True)
    g_ref, (o_ref, s_ref) = grad("scan")(*args)
    with tpu.interpret():
        g, (o, s) = grad("pallas_tpu")(*args)
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL
    for name, a, b in zip(("q", "k", "v", "log_decay", "initial_state"), g, g_ref):
        assert relative_error(a, b) <= FP32_GRAD_TOL, (name, relative_error(a, b))


def test_races_and_uninitialised_memory():
    """Two simulated cores split the parallel axis; every kernel reads no NaN-filled memory and has no race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    x = _inputs("delta_rule", B=1, T=70)
    cfg = tpu_chunk.make_config(x["q"], x["v"], x["beta"], x["log_decay"], x["initial_state"], x["segment_ids"],
                                scale=MAIN["K"] ** -0.5, chunk_size=64)
    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"], x["segment_ids"])
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=2)
    prepared = tpu_chunk._prepare(cfg, *args)
    with tpu.interpret(params):
        o, final = tpu_chunk._forward(cfg, prepared, emit_states=False)
        assert not mosaic_interpret.races.races_found
        states, _ = tpu_chunk._forward(cfg, prepared, emit_states=True)
        assert not mosaic_interpret.races.races_found
        do = jnp.pad(jax.random.normal(fresh_key(), o.shape[:3] + (MAIN["V"],)), ((0, 0),) * 3 + ((0, 120),))
        grads = tpu_chunk._backward(cfg, prepared, states, do, jnp.ones_like(final))
        assert not mosaic_interpret.races.races_found
    for array in (o, final, states, *grads.values()):
        assert np.all(np.isfinite(np.asarray(array)))
    o_ref, s_ref = _call("delta_rule", x, "scan")
    assert relative_error(jnp.swapaxes(o[:, :, :70, :MAIN["V"]], 1, 2), o_ref) <= FP32_OUT_TOL
    assert relative_error(final[:, :, :MAIN["K"], :MAIN["V"]], s_ref) <= FP32_OUT_TOL


# ---------------------------------------------------------------------------------------------------------------
# The dispatch: fail-closed predicate, interpretation switch

def _rule_call(**overrides):
    base = dict(op="delta_rule", batch=2, seq_len=100, key_heads=2, value_heads=4, key_dim=128, value_dim=128,
                dtype="bfloat16", decay="scalar", has_initial_state=True, has_segment_ids=True, chunk_size=64,
                platform="tpu")
    return dispatch.RuleCall(**{**base, **overrides})


@pytest.mark.parametrize("overrides,accepted", [
    ({}, True),
    (dict(op="linear_attention", decay="none", dtype="float32", chunk_size=16), True),
    (dict(key_dim=256, value_dim=256, chunk_size=128), True),
    (dict(platform="cpu"), False),
    (dict(platform="gpu"), False),
    (dict(decay="channel"), False),
    (dict(dtype="float16"), False),
    (dict(chunk_size=256), False),
    (dict(chunk_size=8), False),
    (dict(key_dim=512), False),
    (dict(value_heads=3), False),
])
def test_supports_is_fail_closed(overrides, accepted):
    assert tpu.supports(_rule_call(**overrides)) is accepted


def test_interpret_switch_scopes_dispatch():
    call = _rule_call(platform="cpu")
    assert dispatch.select("delta_rule", "auto", call).name == "chunk"
    with tpu.interpret():
        assert dispatch.select("delta_rule", "auto", call).name == "pallas_tpu"
        assert dispatch.select("linear_attention", "auto", call._replace(op="linear_attention")).name == "pallas_tpu"
    assert not tpu.interpreting()
    with pytest.raises(ValueError, match="does not support"):
        x = _inputs("delta_rule", B=1, T=8)
        _call("delta_rule", x, "pallas_tpu")


# ---------------------------------------------------------------------------------------------------------------
# Every supported configuration lowers for the TPU platform, forward and backward

def _lower(op, decay, packed, init, dtype, *, chunk_size=64, K=128, V=128, H=2, Hv=4, T=200, mesh_kind=None):
    x = rule_inputs(jax.random.PRNGKey(0), B=2, T=T, H=H, Hv=Hv, K=K, V=V, decay=decay, packed=packed,
                    with_initial_state=init, dtype=dtype)
    beta = x["beta"] if op == "delta_rule" else None
    segment_ids = x["segment_ids"]

    def forward(q, k, v, beta, log_decay, initial_state):
        return tpu_chunk.chunked(q, k, v, beta, log_decay, scale=K ** -0.5, initial_state=initial_state,
                                 segment_ids=segment_ids, chunk_size=chunk_size)

    assert_tpu_lowering(forward, (x["q"], x["k"], x["v"], beta, x["log_decay"], x["initial_state"]), mesh_kind)


FLAG_GRID = list(itertools.product(("delta_rule", "linear_attention"), ("none", "scalar"), (False, True),
                                   (False, True), (jnp.float32, jnp.bfloat16)))


@pytest.mark.parametrize("op,decay,packed,init,dtype", FLAG_GRID,
                         ids=[f"{o}-{d}-{'packed' if p else 'dense'}-{'init' if i else 'zero'}-{jnp.dtype(t).name}"
                              for o, d, p, i, t in FLAG_GRID])
def test_lowers_for_tpu(op, decay, packed, init, dtype):
    _lower(op, decay, packed, init, dtype)


@pytest.mark.parametrize("chunk_size,K,V", [(16, 64, 256), (32, 256, 100), (128, 256, 256), (128, 1, 7)])
@pytest.mark.parametrize("op", ["delta_rule", "linear_attention"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_sizes(chunk_size, K, V, op, dtype):
    _lower(op, "scalar", True, True, dtype, chunk_size=chunk_size, K=K, V=V, H=1, Hv=2, T=300)


@pytest.mark.parametrize("mesh_kind", ["TPU v5 lite", "TPU v6 lite", "TPU7x"])
def test_lowers_for_tpu_generations(mesh_kind):
    _lower("delta_rule", "scalar", True, True, jnp.bfloat16, mesh_kind=mesh_kind)
