"""The chunked form (both state passings) against the fp32 token-by-token scan."""

import itertools

import jax
import jax.numpy as jnp
import pytest

import deltajax
from testing_utils import fresh_key, relative_error, rule_inputs

FP32_OUT_TOL = 1e-5
FP32_GRAD_TOL = 1e-4

OPS = ("delta_rule", "linear_attention")
DECAYS = ("none", "scalar", "channel")
LENGTHS = (1, 63, 64, 65, 200, 1000)
DIMS = ((16, 16), (32, 8), (8, 32))


def _cases():
    """Every (op, decay, T) with the other factors cycled so each value of each appears many times."""
    cycle = itertools.cycle(itertools.product((False, True), (False, True), DIMS, ("sequential", "associative")))
    for op, decay, T in itertools.product(OPS, DECAYS, LENGTHS):
        packed, init, (K, V), passing = next(cycle)
        yield pytest.param(op, decay, T, packed, init, K, V, passing,
                           id=f"{op}-{decay}-T{T}-{'packed' if packed else 'dense'}-"
                              f"{'init' if init else 'zero'}-K{K}V{V}-{passing}")


def run(op, inputs, impl, **kwargs):
    x = inputs
    if op == "linear_attention":
        return deltajax.linear_attention(x["q"], x["k"], x["v"], x["log_decay"], initial_state=x["initial_state"],
                                         segment_ids=x["segment_ids"], impl=impl, **kwargs)
    return deltajax.delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], initial_state=x["initial_state"],
                               segment_ids=x["segment_ids"], impl=impl, **kwargs)


@pytest.mark.parametrize("op,decay,T,packed,init,K,V,passing", list(_cases()))
def test_forward_matches_scan(op, decay, T, packed, init, K, V, passing):
    x = rule_inputs(fresh_key(), B=2, T=T, H=2, Hv=4 if K == 32 else 2, K=K, V=V, decay=decay, beta_max=2.0,
                    packed=packed, with_initial_state=init)
    o_ref, s_ref = run(op, x, "scan")
    o, s = run(op, x, "chunk", state_passing=passing)
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL


@pytest.mark.parametrize("chunk_size", [8, 16, 32, 128])
@pytest.mark.parametrize("decay", DECAYS)
def test_other_chunk_sizes(chunk_size, decay):
    x = rule_inputs(fresh_key(), T=150, decay=decay, packed=True, with_initial_state=True)
    o_ref, s_ref = run("delta_rule", x, "scan")
    o, s = run("delta_rule", x, "chunk", chunk_size=chunk_size)
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL


def _loss(op, impl, passing, cotangent_o, cotangent_s):
    def loss(q, k, v, beta, log_decay, initial_state, segment_ids):
        x = dict(q=q, k=k, v=v, beta=beta, log_decay=log_decay, initial_state=initial_state,
                 segment_ids=segment_ids)
        o, s = run(op, x, impl, state_passing=passing)
        return jnp.sum(o * cotangent_o) + jnp.sum(s * cotangent_s)
    return loss


GRAD_CASES = [
    ("delta_rule", "none", 65, True, "sequential"),
    ("delta_rule", "scalar", 130, True, "associative"),
    ("delta_rule", "scalar", 63, False, "sequential"),
    ("delta_rule", "channel", 100, True, "sequential"),
    ("delta_rule", "channel", 64, False, "associative"),
    ("linear_attention", "scalar", 90, True, "associative"),
    ("linear_attention", "channel", 70, False, "sequential"),
    ("linear_attention", "none", 1, False, "sequential"),
]


@pytest.mark.parametrize("op,decay,T,packed,passing", GRAD_CASES)
def test_gradients_match_scan(op, decay, T, packed, passing):
    key = fresh_key()
    x = rule_inputs(key, B=2, T=T, H=2, Hv=4, K=16, V=8, decay=decay, beta_max=2.0, packed=packed,
                    with_initial_state=True)
    ko, ks = jax.random.split(jax.random.fold_in(key, 1))
    cot_o = jax.random.normal(ko, (2, T, 4, 8))
    cot_s = jax.random.normal(ks, (2, 4, 16, 8))
    argnums = [0, 1, 2, 5] + ([3] if op == "delta_rule" else []) + ([4] if decay != "none" else [])
    args = (x["q"], x["k"], x["v"], x["beta"] if op == "delta_rule" else None, x["log_decay"],
            x["initial_state"], x["segment_ids"])
    ref = jax.grad(_loss(op, "scan", "sequential", cot_o, cot_s), argnums=argnums)(*args)
    got = jax.grad(_loss(op, "chunk", passing, cot_o, cot_s), argnums=argnums)(*args)
    for index, g, r in zip(argnums, got, ref):
        assert relative_error(g, r) <= FP32_GRAD_TOL, f"gradient of argument {index}"


MINUS_20_CASES = [
    ("delta_rule", "scalar", "sequential"),
    ("delta_rule", "channel", "associative"),
    ("linear_attention", "scalar", "associative"),
    ("linear_attention", "channel", "sequential"),
]


@pytest.mark.parametrize("op,decay,passing", MINUS_20_CASES)
def test_gradients_with_log_decay_minus_20_on_every_token(op, decay, passing):
    """d(log_decay) is ~exp(-20) here, so it must carry no O(eps) residue of the O(1) terms whose decay is exactly
    1 (pairs t = s, the chunk's last token, the last real token before the padded tail): T = 130 is not a chunk
    multiple, with packed documents and an initial state."""
    key = fresh_key()
    T = 130
    x = rule_inputs(key, B=2, T=T, H=2, Hv=4, K=16, V=8, decay=decay, beta_max=2.0, packed=True,
                    with_initial_state=True)
    x["log_decay"] = jnp.full(x["log_decay"].shape, -20.0, jnp.float32)
    ko, ks = jax.random.split(jax.random.fold_in(key, 1))
    cot_o = jax.random.normal(ko, (2, T, 4, 8))
    cot_s = jax.random.normal(ks, (2, 4, 16, 8))
    argnums = [0, 1, 2, 4, 5] + ([3] if op == "delta_rule" else [])
    args = (x["q"], x["k"], x["v"], x["beta"] if op == "delta_rule" else None, x["log_decay"],
            x["initial_state"], x["segment_ids"])
    o_ref, s_ref = run(op, x, "scan")
    o, s = run(op, x, "chunk", state_passing=passing)
    assert relative_error(o, o_ref) <= FP32_OUT_TOL
    assert relative_error(s, s_ref) <= FP32_OUT_TOL
    ref = jax.grad(_loss(op, "scan", "sequential", cot_o, cot_s), argnums=argnums)(*args)
    got = jax.grad(_loss(op, "chunk", passing, cot_o, cot_s), argnums=argnums)(*args)
    for index, g, r in zip(argnums, got, ref):
        assert relative_error(g, r) <= FP32_GRAD_TOL, (f"gradient of argument {index}", relative_error(g, r))
