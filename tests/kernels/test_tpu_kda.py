"""The KDA Mosaic TPU kernels (per-key-channel decay, `kernels/tpu/kda.py`, reached as impl "pallas_tpu") under
the TPU interpreter against the fp32 scan, and their TPU lowering.

No TPU is needed: `deltajax.kernels.tpu.interpret()` runs the kernels in Pallas's TPU interpreter (NaN-filled
uninitialised memory, out-of-bounds reads raise) and lets the dispatch choose them on the CPU backend. Shapes are
shared between cases so that each compiled interpreter program serves several of them; every case prints its
measured errors (`pytest -s` shows them).
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import deltajax
from deltajax.kernels import tpu
from deltajax.kernels.tpu import kda as tpu_kda
from deltajax.rules import dispatch
from testing_utils import assert_tpu_lowering, fresh_key, relative_error, rule_inputs

FP32_OUT_TOL = 1e-5
FP32_GRAD_TOL = 1e-4
BF16_OUT_TOL = 3e-3
BF16_GRAD_TOL = 6e-3  # dq, dk, dv, d(initial state)
BF16_GATE_GRAD_TOL = 1e-2  # dbeta, dlog_decay

# One shape for most cases (4 chunks of 64 with a padded tail, two value heads sharing one key head), so its
# compiled programs are reused by the adversarial families.
MAIN = dict(B=2, T=200, H=1, Hv=2, K=32, V=32)
DIFF_ARGS = ("q", "k", "v", "beta", "log_decay", "initial_state")


def _call(x, impl, **kwargs):
    return deltajax.kda(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], initial_state=x["initial_state"],
                        segment_ids=x["segment_ids"], impl=impl, **kwargs)


def _as_f32(x):
    return {name: (v.astype(jnp.float32) if v is not None and jnp.issubdtype(v.dtype, jnp.floating) else v)
            for name, v in x.items()}


def _forward_and_grads(x, impl, key, cotangent_dtype, call=_call, **kwargs):
    """(o, final_state, {name: gradient}) of sum(o * c_o) + sum(state * c_s) with random cotangents.

    c_o is rounded to `cotangent_dtype` so that kernel and reference see the same cotangent."""
    names = [n for n in DIFF_ARGS if x.get(n) is not None]

    def f(*diff):
        return call({**x, **dict(zip(names, diff))}, impl, **kwargs)

    (o, s), vjp = jax.vjp(f, *(x[n] for n in names))
    k_o, k_s = jax.random.split(key)
    c_o = jax.random.normal(k_o, o.shape, jnp.float32).astype(cotangent_dtype).astype(o.dtype)
    c_s = jax.random.normal(k_s, s.shape, jnp.float32)
    return o, s, dict(zip(names, vjp((c_o, c_s))))


def _report(label, errors):
    print(f"{label}: " + " ".join(f"{name}={err:.2e}" for name, err in errors.items()))


def _check(x, *, dtype=jnp.float32, chunk_size=64, grads=True, label=""):
    """Kernel (interpreted) vs the fp32 scan on the same (possibly bf16-rounded) inputs."""
    key = fresh_key()
    reference = _as_f32(x)
    if grads:
        o_ref, s_ref, g_ref = _forward_and_grads(reference, "scan", key, dtype)
        with tpu.interpret():
            o, s, g = _forward_and_grads(x, "pallas_tpu", key, dtype, chunk_size=chunk_size)
    else:
        o_ref, s_ref = _call(reference, "scan")
        with tpu.interpret():
            o, s = _call(x, "pallas_tpu", chunk_size=chunk_size)
        g, g_ref = {}, {}
    assert o.dtype == x["v"].dtype and s.dtype == jnp.float32
    errors = {"o": relative_error(o, o_ref), "state": relative_error(s, s_ref)}
    for name, grad in g.items():
        assert grad.shape == x[name].shape and grad.dtype == x[name].dtype, name
        errors["d" + name] = relative_error(grad, g_ref[name])
    _report(label, errors)
    out_tol = FP32_OUT_TOL if dtype == jnp.float32 else BF16_OUT_TOL
    assert errors["o"] <= out_tol and errors["state"] <= out_tol, errors
    for name in g:
        if dtype == jnp.float32:
            tol = FP32_GRAD_TOL
        else:
            tol = BF16_GATE_GRAD_TOL if name in ("beta", "log_decay") else BF16_GRAD_TOL
        assert errors["d" + name] <= tol, (name, errors)


def _inputs(*, packed=True, init=True, dtype=jnp.float32, beta_max=2.0, **shape):
    shape = {**MAIN, **shape}
    return rule_inputs(fresh_key(), decay="channel", packed=packed, with_initial_state=init, beta_max=beta_max,
                       dtype=dtype, **shape)


# ---------------------------------------------------------------------------------------------------------------
# Forward and gradients

GRAD_CASES = [
    # packed, init, dtype, shape overrides
    (True, True, jnp.float32, {}),
    (False, False, jnp.float32, dict(T=63, H=2, Hv=2)),
    (True, False, jnp.float32, dict(T=65)),
    (False, True, jnp.float32, dict(T=1, B=1)),
    (True, True, jnp.bfloat16, {}),
    (False, True, jnp.bfloat16, dict(T=65, H=2, Hv=4, K=64, V=32)),
]


def _case_id(packed, init, dtype, shape):
    shape = {**MAIN, **shape}
    return (f"{'packed' if packed else 'dense'}-{'init' if init else 'zero'}-{jnp.dtype(dtype).name}-T{shape['T']}"
            f"-H{shape['H']}Hv{shape['Hv']}")


@pytest.mark.parametrize("packed,init,dtype,shape", GRAD_CASES, ids=[_case_id(*c) for c in GRAD_CASES])
def test_forward_and_grads_match_scan(packed, init, dtype, shape):
    _check(_inputs(packed=packed, init=init, dtype=dtype, **shape), dtype=dtype,
           label=_case_id(packed, init, dtype, shape))


@pytest.mark.parametrize("chunk_size,grads", [(16, True), (32, False), (128, True)])
def test_other_chunk_sizes(chunk_size, grads):
    """C = 16 is one sub-chunk (no reference split); C = 128 has eight."""
    x = _inputs(T=100, B=1, K=20, V=12)
    _check(x, chunk_size=chunk_size, grads=grads, label=f"C{chunk_size}-T100")


# ---------------------------------------------------------------------------------------------------------------
# Adversarial families (same shapes as MAIN: the compiled programs are reused)

def _adversarial(family):
    x = _inputs()
    B, T, Hv = x["beta"].shape
    K = MAIN["K"]
    key = fresh_key()
    shape = (B, T, Hv, K)
    if family == "decay_minus_20":
        # Every channel of every token: exp(G) underflows within five tokens; any positive exponent overflows.
        x["log_decay"] = jnp.full(shape, -20.0, jnp.float32)
    elif family == "decay_near_0":
        x["log_decay"] = -1e-6 * jax.random.uniform(key, shape)
    elif family == "mixed_channels":
        # Half the channels always at -20, the others near 0 with random -20 events: a strong and a weak gate
        # in one chunk, and pairs whose decay is ~1 after a -20 in the cumulative sum.
        k_channel, k_event, k_small = jax.random.split(key, 3)
        strong = jax.random.bernoulli(k_channel, 0.5, (1, 1, Hv, K)) | jax.random.bernoulli(k_event, 0.1, shape)
        x["log_decay"] = jnp.where(strong, jnp.float32(-20.0), -1e-4 * jax.random.uniform(k_small, shape))
    elif family == "beta_to_2":
        x["beta"] = 2.0 - 1e-3 * jax.random.uniform(key, (B, T, Hv))
    elif family == "correlated_keys":
        k_base, k_noise = jax.random.split(key)
        base = jax.random.normal(k_base, (1, 1, 1, K))
        k = base + 0.02 * jax.random.normal(k_noise, x["k"].shape)
        x["k"] = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
        x["beta"] = jax.random.uniform(key, (B, T, Hv), minval=1.5, maxval=2.0)
    return x


@pytest.mark.parametrize("family", ["decay_minus_20", "decay_near_0", "mixed_channels", "beta_to_2",
                                    "correlated_keys"])
def test_adversarial_families(family):
    _check(_adversarial(family), label=family)


def test_equal_channels_match_the_scalar_kernel():
    """KDA with every channel's decay equal is Gated DeltaNet: the KDA kernels vs the scalar-decay kernels."""
    x = rule_inputs(fresh_key(), decay="scalar", packed=True, with_initial_state=True, beta_max=2.0, **MAIN)
    scalar_decay = x["log_decay"]
    channel_decay = jnp.broadcast_to(scalar_decay[..., None], scalar_decay.shape + (MAIN["K"],))

    def gated(x, impl):
        return deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["log_decay"],
                                       initial_state=x["initial_state"], segment_ids=x["segment_ids"], impl=impl)

    key = fresh_key()
    with tpu.interpret():
        o_s, s_s, g_s = _forward_and_grads(x, "pallas_tpu", key, jnp.float32, call=gated)
        o_c, s_c, g_c = _forward_and_grads({**x, "log_decay": channel_decay}, "pallas_tpu", key, jnp.float32)
    g_c["log_decay"] = jnp.sum(g_c["log_decay"], axis=-1)  # the scalar gate drives every channel
    errors = {"o": relative_error(o_c, o_s), "state": relative_error(s_c, s_s)}
    errors.update({"d" + name: relative_error(g_c[name], g_s[name]) for name in g_s})
    _report("equal_channels_vs_scalar_kernel", errors)
    assert errors["o"] <= FP32_OUT_TOL and errors["state"] <= FP32_OUT_TOL, errors
    assert all(errors["d" + name] <= FP32_GRAD_TOL for name in g_s), errors


def test_races_and_uninitialised_memory():
    """Two simulated cores split the parallel axis; every kernel reads no NaN-filled memory and has no race."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as mosaic_interpret

    T, K, V = 70, MAIN["K"], MAIN["V"]
    x = _inputs(B=1, T=T)
    cfg = tpu_kda.make_config(x["q"], x["v"], x["initial_state"], x["segment_ids"], scale=K ** -0.5,
                              chunk_size=64)
    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"], x["segment_ids"])
    params = pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan", num_cores_or_threads=2)
    prepared = tpu_kda._prepare(cfg, *args)
    with tpu.interpret(params):
        o, final = tpu_kda._forward(cfg, prepared, emit_states=False)
        assert not mosaic_interpret.races.races_found
        states, _ = tpu_kda._forward(cfg, prepared, emit_states=True)
        assert not mosaic_interpret.races.races_found
        do = jnp.pad(jax.random.normal(fresh_key(), o.shape[:3] + (V,)), ((0, 0),) * 3 + ((0, o.shape[3] - V),))
        grads = tpu_kda._backward(cfg, prepared, states, do, jnp.ones_like(final))
        assert not mosaic_interpret.races.races_found
    for array in (o, final, states, *grads.values()):
        assert np.all(np.isfinite(np.asarray(array)))
    o_ref, s_ref = _call(x, "scan")
    errors = {"o": relative_error(jnp.swapaxes(o[:, :, :T, :V], 1, 2), o_ref),
              "state": relative_error(final[:, :, :K, :V], s_ref)}
    _report("races", errors)
    assert errors["o"] <= FP32_OUT_TOL and errors["state"] <= FP32_OUT_TOL, errors


# ---------------------------------------------------------------------------------------------------------------
# The dispatch: fail-closed predicate, routing under "pallas_tpu", interpretation switch

def _rule_call(**overrides):
    base = dict(op="delta_rule", batch=2, seq_len=100, key_heads=2, value_heads=4, key_dim=128, value_dim=128,
                dtype="bfloat16", decay="channel", has_initial_state=True, has_segment_ids=True, chunk_size=64,
                platform="tpu")
    return dispatch.RuleCall(**{**base, **overrides})


@pytest.mark.parametrize("overrides,accepted", [
    ({}, True),
    (dict(dtype="float32", chunk_size=16, has_segment_ids=False, has_initial_state=False), True),
    (dict(key_dim=256, value_dim=256, chunk_size=128), True),
    (dict(key_dim=1, value_dim=7, chunk_size=32), True),
    (dict(op="linear_attention"), False),
    (dict(decay="scalar"), False),
    (dict(decay="none"), False),
    (dict(platform="cpu"), False),
    (dict(platform="gpu"), False),
    (dict(dtype="float16"), False),
    (dict(chunk_size=256), False),
    (dict(chunk_size=8), False),
    (dict(key_dim=512), False),
    (dict(value_dim=300), False),
    (dict(value_heads=3), False),
    (dict(key_heads=0), False),
])
def test_supports_kda_is_fail_closed(overrides, accepted):
    call = _rule_call(**overrides)
    assert tpu.supports_kda(call) is accepted
    # The "pallas_tpu" predicate for the delta rule: KDA calls only through `supports_kda`.
    if call.decay == "channel":
        assert tpu.supports_delta_rule(call) is accepted


def test_vmem_budget_of_the_largest_configuration():
    for dtype_bytes, backward in itertools.product((2, 4), (False, True)):
        cfg = tpu_kda.Config(packed=True, has_initial_state=True, scale=1.0, chunk_size=128, group=1,
                             value_heads=1, key_dim=256, value_dim=256)
        assert tpu_kda.vmem_budget(cfg, dtype_bytes, backward) <= tpu_kda.MAX_VMEM_LIMIT
        assert tpu_kda.fits_vmem(cfg, dtype_bytes)


def test_interpret_switch_scopes_dispatch():
    call = _rule_call(platform="cpu")
    assert dispatch.select("delta_rule", "auto", call).name == "chunk"
    with tpu.interpret():
        assert dispatch.select("delta_rule", "auto", call).name == "pallas_tpu"
        assert dispatch.select("delta_rule", "pallas_tpu", call).name == "pallas_tpu"
        with pytest.raises(ValueError, match="does not support"):  # linear attention with channel decay (GLA)
            dispatch.select("linear_attention", "pallas_tpu", call._replace(op="linear_attention"))
    assert not tpu.interpreting()
    with pytest.raises(ValueError, match="does not support"):
        _call(_inputs(B=1, T=8), "pallas_tpu")


# ---------------------------------------------------------------------------------------------------------------
# Every supported configuration lowers for the TPU platform, forward and backward

def _lower(packed, init, dtype, *, chunk_size=64, K=128, V=128, H=2, Hv=4, T=200, mesh_kind=None):
    x = rule_inputs(jax.random.PRNGKey(0), B=2, T=T, H=H, Hv=Hv, K=K, V=V, decay="channel", packed=packed,
                    with_initial_state=init, dtype=dtype)
    segment_ids = x["segment_ids"]

    def forward(q, k, v, beta, log_decay, initial_state):
        return tpu_kda.chunked(q, k, v, beta, log_decay, scale=K ** -0.5, initial_state=initial_state,
                               segment_ids=segment_ids, chunk_size=chunk_size)

    assert_tpu_lowering(forward, (x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"]), mesh_kind)


FLAG_GRID = list(itertools.product((False, True), (False, True), (jnp.float32, jnp.bfloat16)))


@pytest.mark.parametrize("packed,init,dtype", FLAG_GRID,
                         ids=[f"{'packed' if p else 'dense'}-{'init' if i else 'zero'}-{jnp.dtype(t).name}"
                              for p, i, t in FLAG_GRID])
def test_lowers_for_tpu(packed, init, dtype):
    _lower(packed, init, dtype)


@pytest.mark.parametrize("chunk_size,K,V", [(16, 64, 256), (32, 256, 100), (128, 256, 256), (128, 1, 7)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_tpu_sizes(chunk_size, K, V, dtype):
    _lower(True, True, dtype, chunk_size=chunk_size, K=K, V=V, H=1, Hv=2, T=300)


@pytest.mark.parametrize("mesh_kind", ["TPU v5 lite", "TPU v6 lite", "TPU7x"])
def test_lowers_for_tpu_generations(mesh_kind):
    _lower(True, True, jnp.bfloat16, mesh_kind=mesh_kind)
