"""Hard inputs for the chunked form: it must stay finite and within the fp32 tolerance of the scan."""

import jax
import jax.numpy as jnp
import pytest

import deltajax
from deltajax import rules
from testing_utils import fresh_key, relative_error, rule_inputs


def _compare(x, rule="delta_rule", passing="sequential", out_tol=1e-5, grad_tol=1e-4):
    def run(impl):
        def f(q, k, v, beta, log_decay, initial_state):
            return deltajax.delta_rule(q, k, v, beta, log_decay, initial_state=initial_state,
                                       segment_ids=x["segment_ids"], impl=impl, state_passing=passing)
        return f

    args = (x["q"], x["k"], x["v"], x["beta"], x["log_decay"], x["initial_state"])
    o_ref, s_ref = run("scan")(*args)
    o, s = run("chunk")(*args)
    assert relative_error(o, o_ref) <= out_tol
    assert relative_error(s, s_ref) <= out_tol
    loss = lambda impl: lambda *a: jnp.sum(jnp.sin(run(impl)(*a)[0])) + jnp.sum(jnp.cos(run(impl)(*a)[1]))
    argnums = (0, 1, 2, 3, 5) + ((4,) if x["log_decay"] is not None else ())
    g_ref = jax.grad(loss("scan"), argnums=argnums)(*args)
    g = jax.grad(loss("chunk"), argnums=argnums)(*args)
    for index, a, b in zip(argnums, g, g_ref):
        assert relative_error(a, b) <= grad_tol, f"gradient of argument {index}"


@pytest.mark.parametrize("passing", ("sequential", "associative"))
def test_beta_near_two_negative_eigenvalues(passing):
    key = fresh_key()
    x = rule_inputs(key, T=150, decay="none", with_initial_state=True)
    x["beta"] = 2.0 - 1e-3 * jax.random.uniform(jax.random.fold_in(key, 1), x["beta"].shape)
    _compare(x, passing=passing)


@pytest.mark.parametrize("decay", ("scalar", "channel"))
@pytest.mark.parametrize("strength", ("strong", "near_zero"))
def test_extreme_decays(decay, strength):
    key = fresh_key()
    x = rule_inputs(key, T=130, decay=decay, packed=True, with_initial_state=True)
    u = jax.random.uniform(jax.random.fold_in(key, 1), x["log_decay"].shape)
    # strong: down to -20 per token (exp(-20 * 64) underflows; nothing may overflow); near zero: |g| ~ 1e-6.
    x["log_decay"] = -20.0 * u if strength == "strong" else -1e-6 * u
    _compare(x)


def test_strongly_correlated_keys():
    key = fresh_key()
    x = rule_inputs(key, T=128, decay="scalar", with_initial_state=True, beta_max=1.0)
    base = jax.random.normal(jax.random.fold_in(key, 1), (1, 1, 2, 16))
    k = base + 0.01 * jax.random.normal(jax.random.fold_in(key, 2), x["k"].shape)
    x["k"] = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    x["beta"] = 0.9 + 0.1 * x["beta"]
    _compare(x)


@pytest.mark.parametrize("rule", ("kaczmarz", "efla"))
def test_unnormalised_keys_for_step_rules(rule):
    key = fresh_key()
    x = rule_inputs(key, T=100, decay="scalar", with_initial_state=True, packed=True)
    scale = jnp.exp(jax.random.uniform(jax.random.fold_in(key, 1), (2, 100, 2, 1), minval=-4.0, maxval=3.0))
    k = jax.random.normal(jax.random.fold_in(key, 2), x["k"].shape) * scale
    eta = None if rule == "kaczmarz" else jax.random.uniform(jax.random.fold_in(key, 3), (2, 100, 2), maxval=5.0)
    common = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"])
    ref = rules.delta_rule_with_step_size(rule, x["q"], k, x["v"], eta, x["log_decay"], impl="scan", **common)
    got = rules.delta_rule_with_step_size(rule, x["q"], k, x["v"], eta, x["log_decay"], impl="chunk", **common)
    assert relative_error(got[0], ref[0]) <= 1e-5
    assert relative_error(got[1], ref[1]) <= 1e-5


def test_zero_key_takes_no_step():
    """A key of zero norm leaves the state untouched under every step rule (no 0/0)."""
    x = rule_inputs(fresh_key(), T=3, decay="none", with_initial_state=True)
    k = x["k"].at[:, 1].set(0.0)
    for rule in rules.STEP_RULES:
        param = None if rule == "kaczmarz" else jnp.ones((2, 3, 2))
        for impl in ("scan", "chunk"):
            o, s = rules.delta_rule_with_step_size(rule, x["q"], k, x["v"], param, eps=1e-3, impl=impl,
                                                   initial_state=x["initial_state"])
            assert bool(jnp.all(jnp.isfinite(o))) and bool(jnp.all(jnp.isfinite(s)))


@pytest.mark.parametrize("method", ("solve", "blocked"))
@pytest.mark.parametrize("keys", ("random", "correlated", "identical"))
def test_unit_lower_inverse_is_exact(method, keys):
    """(I + A)^-1 against a float64 inverse, for the WY matrix of unit keys with beta near 1."""
    import numpy as np

    from deltajax.rules.chunk import unit_lower_inverse

    key = fresh_key()
    C, K = 64, 32
    k = jax.random.normal(key, (3, C, K))
    if keys == "correlated":
        k = k[:, :1] + 0.01 * k
    elif keys == "identical":
        k = jnp.broadcast_to(k[:, :1], k.shape)
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    beta = 0.99 + 0.01 * jax.random.uniform(jax.random.fold_in(key, 1), (3, C, 1))
    lower = jnp.eye(C) + jnp.tril(beta * (k @ jnp.swapaxes(k, -1, -2)), -1)
    expected = np.linalg.inv(np.asarray(lower, np.float64))
    got = unit_lower_inverse(lower, method)
    assert np.max(np.abs(np.asarray(got, np.float64) - expected)) <= 1e-5 * max(1.0, np.abs(expected).max())


@pytest.mark.parametrize("decay", ("scalar", "channel"))
def test_mixed_huge_and_tiny_gates(decay):
    """A fifth of the gates at -20, the rest at -1e-4: small gates after large ones must not be rounded away."""
    key = fresh_key()
    x = rule_inputs(key, T=200, decay=decay, with_initial_state=True)
    huge = jax.random.bernoulli(jax.random.fold_in(key, 1), 0.2, x["log_decay"].shape)
    x["log_decay"] = jnp.where(huge, -20.0, -1e-4)
    _compare(x)
