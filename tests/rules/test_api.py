"""Errors on bad input, the dispatch policy, and use under jit / vmap / checkpoint / shard_map."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import deltajax
from deltajax import rules
from deltajax.rules import dispatch
from testing_utils import fresh_key, relative_error, rule_inputs


@pytest.fixture
def x():
    return rule_inputs(fresh_key(), T=20, decay="scalar", with_initial_state=True)


def _call(x, **overrides):
    args = dict(x)
    args.update(overrides)
    return deltajax.delta_rule(args["q"], args["k"], args["v"], args["beta"], args["log_decay"],
                               initial_state=args["initial_state"], segment_ids=args["segment_ids"],
                               **{k: v for k, v in overrides.items() if k in ("chunk_size", "impl", "scale",
                                                                                 "state_passing")})


@pytest.mark.parametrize("override,message", [
    (dict(k="bad-k"), "k must be 4-D"),
    (dict(v=jnp.ones((2, 21, 2, 8))), "v must have shape"),
    (dict(v=jnp.ones((2, 20, 3, 8))), "multiple of"),
    (dict(beta=jnp.ones((2, 20))), "beta must have shape"),
    (dict(beta=jnp.full((2, 20, 2), 2.5)), "beta must be <= 2"),
    (dict(beta=jnp.full((2, 20, 2), jnp.nan)), "beta must be finite"),
    (dict(log_decay=jnp.full((2, 20, 2), 0.1)), "log_decay must be <= 0"),
    (dict(log_decay=jnp.zeros((2, 20))), "log_decay must be None"),
    (dict(initial_state=jnp.ones((2, 2, 8, 16))), "initial_state must have shape"),
    (dict(segment_ids=jnp.ones((2, 20), jnp.float32)), "segment_ids must be an integer"),
    (dict(segment_ids=jnp.ones((2, 19), jnp.int32)), "segment_ids must have shape"),
    (dict(chunk_size=48), "chunk_size must be a positive power of two"),
    (dict(state_passing="tree"), "state_passing must be one of"),
    (dict(impl="fast"), "impl must be 'auto' or one of"),
    (dict(scale=-1.0), "scale must be a positive"),
])
def test_bad_input_raises_a_clear_error(x, override, message):
    with pytest.raises(ValueError, match=message):
        _call(x, **override)


def test_mixed_dtypes_and_wrong_decay_rank_raise(x):
    with pytest.raises(ValueError, match="share one dtype"):
        _call(x, v=x["v"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match="gated_deltanet needs log_decay"):
        deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], None)
    with pytest.raises(ValueError, match="kda needs log_decay"):
        deltajax.kda(x["q"], x["k"], x["v"], x["beta"], x["log_decay"])


def test_step_parameter_ranges(x):
    with pytest.raises(ValueError, match="rho must be <= 2"):
        rules.relaxed_kaczmarz(x["q"], x["k"], x["v"], jnp.full((2, 20, 2), 3.0))
    with pytest.raises(ValueError, match="eps must be >= 0"):
        rules.relaxed_kaczmarz(x["q"], x["k"], x["v"], jnp.ones((2, 20, 2)), eps=-1.0)
    with pytest.raises(ValueError, match="gamma must be >= 0"):
        rules.longhorn(x["q"], x["k"], x["v"], jnp.full((2, 20, 2), -1.0))
    with pytest.raises(ValueError, match="eta must be >= 0"):
        rules.efla(x["q"], x["k"], x["v"], -jnp.ones((2, 20, 2)))
    with pytest.raises(ValueError, match="step parameter of efla must have shape"):
        rules.efla(x["q"], x["k"], x["v"], jnp.ones((2, 20)))


def test_auto_falls_back_and_forced_kernels_fail_closed(x):
    calls = []

    def never(call):
        calls.append(call)
        return False

    def broken(call):
        raise RuntimeError("cannot decide")

    dispatch.register("delta_rule", "test_never", lambda *a, **k: None, never, priority=100)
    dispatch.register("delta_rule", "test_broken", lambda *a, **k: None, broken, priority=99)
    try:
        o, _ = _call(x, impl="auto")
        ref, _ = _call(x, impl="chunk")
        assert relative_error(o, ref) == 0.0
        assert calls and calls[0].decay == "scalar" and calls[0].seq_len == 20
        with pytest.raises(ValueError, match="does not support"):
            _call(x, impl="test_never")
    finally:
        dispatch._REGISTRY["delta_rule"].pop("test_never")
        dispatch._REGISTRY["delta_rule"].pop("test_broken")


def test_auto_prefers_a_supporting_kernel(x):
    def kernel(q, k, v, beta, log_decay, **kwargs):
        return dispatch.implementations("delta_rule")["scan"].fn(q, k, v, beta, log_decay, **kwargs)

    dispatch.register("delta_rule", "test_kernel", kernel, lambda call: call.decay == "scalar", priority=100)
    try:
        o, _ = _call(x, impl="auto")
        ref, _ = _call(x, impl="scan")
        assert relative_error(o, ref) == 0.0
    finally:
        dispatch._REGISTRY["delta_rule"].pop("test_kernel")


def test_auto_skips_forward_only_kernels(x):
    """A forward-only kernel runs when named, never under "auto" (which cannot know about later gradients)."""
    ran = []

    def kernel(q, k, v, beta, log_decay, **kwargs):
        ran.append(True)
        return dispatch.implementations("delta_rule")["scan"].fn(q, k, v, beta, log_decay, **kwargs)

    dispatch.register("delta_rule", "test_forward_only", kernel, lambda call: True, priority=1000,
                      forward_only=True)
    try:
        _call(x, impl="auto")
        assert not ran
        o, _ = _call(x, impl="test_forward_only")
        ref, _ = _call(x, impl="scan")
        assert ran and relative_error(o, ref) == 0.0
    finally:
        dispatch._REGISTRY["delta_rule"].pop("test_forward_only")


def test_auto_takes_a_kernel_only_where_auto_when_accepts(x):
    """`auto_when` narrows where "auto" picks a kernel; named, the kernel needs only its `supports`."""
    ran = []

    def kernel(q, k, v, beta, log_decay, **kwargs):
        ran.append(q.shape[1])
        return dispatch.implementations("delta_rule")["scan"].fn(q, k, v, beta, log_decay, **kwargs)

    T = x["q"].shape[1]
    dispatch.register("delta_rule", "test_long_only", kernel, lambda call: True, priority=1000,
                      auto_when=lambda call: call.seq_len > T)
    try:
        _call(x, impl="auto")
        assert not ran
        _call(x, impl="test_long_only")
        assert ran == [T]
        longer = {n: None if a is None else jnp.concatenate([a, a], axis=1) if n in ("q", "k", "v", "beta",
                  "log_decay") else a for n, a in x.items()}
        _call(longer, impl="auto")
        assert ran == [T, 2 * T]
    finally:
        dispatch._REGISTRY["delta_rule"].pop("test_long_only")


def test_return_final_state_false(x):
    o, s = deltajax.delta_rule(x["q"], x["k"], x["v"], x["beta"], return_final_state=False)
    assert s is None and o.shape == x["v"].shape


def test_jit_vmap_checkpoint(x):
    f = lambda q, k, v, b, g, s: deltajax.gated_deltanet(q, k, v, b, g, initial_state=s)[0]
    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"])
    eager = f(*args)
    assert relative_error(jax.jit(f)(*args), eager) <= 1e-6
    # vmap over an extra leading axis of two copies.
    stacked = [jnp.stack([a, a]) for a in args]
    batched = jax.vmap(f)(*stacked)
    assert relative_error(batched[1], eager) <= 1e-6
    grad = jax.grad(lambda *a: jnp.sum(jax.checkpoint(f)(*a) ** 2), argnums=(0, 5))(*args)
    ref = jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 5))(*args)
    assert all(relative_error(a, b) <= 1e-6 for a, b in zip(grad, ref))


def test_inside_shard_map_over_batch():
    from jax.sharding import Mesh, PartitionSpec as P

    devices = np.array(jax.devices()[:1])
    mesh = Mesh(devices, ("data",))
    x = rule_inputs(fresh_key(), B=2, T=40, decay="channel")

    def body(q, k, v, b, g):
        return deltajax.kda(q, k, v, b, g)[0]

    spec = P("data")
    sharded = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))
    out = sharded(x["q"], x["k"], x["v"], x["beta"], x["log_decay"])
    assert relative_error(out, body(x["q"], x["k"], x["v"], x["beta"], x["log_decay"])) <= 1e-6


def test_bf16_inputs_keep_an_fp32_state():
    x = rule_inputs(fresh_key(), T=70, decay="scalar", with_initial_state=True, dtype=jnp.bfloat16)
    o, s = deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["log_decay"],
                                   initial_state=x["initial_state"])
    assert o.dtype == jnp.bfloat16 and s.dtype == jnp.float32
    o_ref, s_ref = deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["log_decay"],
                                           initial_state=x["initial_state"], impl="scan")
    assert relative_error(o, o_ref) <= 1e-2 and relative_error(s, s_ref) <= 1e-5
