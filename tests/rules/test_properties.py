"""Properties straight from the seeds, each checked on the scan and on the chunked form."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg
import scipy.optimize

import deltajax
from deltajax import rules
from testing_utils import fresh_key, relative_error, rule_inputs

IMPLS = ("scan", "chunk")


def _raw_keys(key, B, T, H, K, norm_low=0.3, norm_high=3.0):
    direction = jax.random.normal(key, (B, T, H, K))
    direction = direction / jnp.linalg.norm(direction, axis=-1, keepdims=True)
    norm = jax.random.uniform(jax.random.fold_in(key, 1), (B, T, H, 1), minval=norm_low, maxval=norm_high)
    return direction * norm


@pytest.mark.parametrize("impl", IMPLS)
def test_relaxed_kaczmarz_with_rho_one_solves_the_constraint(impl):
    key = fresh_key()
    x = rule_inputs(key, T=37, decay="none", with_initial_state=True)
    k = _raw_keys(jax.random.fold_in(key, 2), 2, 37, 2, 16)
    rho = jnp.ones((2, 37, 2))
    _, state = rules.relaxed_kaczmarz(x["q"], k, x["v"], rho, eps=0.0, initial_state=x["initial_state"], impl=impl)
    prediction = jnp.einsum("bhk,bhkv->bhv", k[:, -1], state)
    assert relative_error(prediction, x["v"][:, -1]) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_relaxed_kaczmarz_interpolates_prediction_and_target(impl):
    """k^T S_t = (1 - rho) k^T (D_t S_{t-1}) + rho v_t with eps = 0, forgetting first."""
    key = fresh_key()
    T = 70
    x = rule_inputs(key, T=T, decay="scalar", with_initial_state=True)
    k = _raw_keys(jax.random.fold_in(key, 2), 2, T, 2, 16)
    rho = jax.random.uniform(jax.random.fold_in(key, 3), (2, T, 2), minval=0.1, maxval=1.9)
    args = dict(eps=0.0, initial_state=x["initial_state"], impl=impl)
    _, before = rules.relaxed_kaczmarz(x["q"][:, :-1], k[:, :-1], x["v"][:, :-1], rho[:, :-1],
                                       x["log_decay"][:, :-1], **args)
    _, after = rules.relaxed_kaczmarz(x["q"], k, x["v"], rho, x["log_decay"], **args)
    decayed = before * jnp.exp(x["log_decay"][:, -1])[..., None, None]
    k_t, v_t, rho_t = k[:, -1], x["v"][:, -1], rho[:, -1][..., None]
    expected = (1 - rho_t) * jnp.einsum("bhk,bhkv->bhv", k_t, decayed) + rho_t * v_t
    assert relative_error(jnp.einsum("bhk,bhkv->bhv", k_t, after), expected) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_longhorn_is_the_minimiser_of_its_proximal_objective(impl):
    """S_t = argmin_S 1/2 |S - S_prev|^2 + gamma/2 |S^T k - v|^2, found by a generic numerical optimiser."""
    key = fresh_key()
    K, V = 5, 3
    ks = jax.random.split(key, 4)
    s_prev = np.asarray(jax.random.normal(ks[0], (1, 1, K, V)), np.float64)
    k = np.asarray(jax.random.normal(ks[1], (1, 1, 1, K)), np.float64) * 1.7
    v = np.asarray(jax.random.normal(ks[2], (1, 1, 1, V)), np.float64)
    gamma = float(jax.random.uniform(ks[3], (), minval=0.2, maxval=3.0))

    def objective(flat):
        S = flat.reshape(K, V)
        return 0.5 * np.sum((S - s_prev[0, 0]) ** 2) + 0.5 * gamma * np.sum((k[0, 0, 0] @ S - v[0, 0, 0]) ** 2)

    found = scipy.optimize.minimize(objective, s_prev.ravel(), method="BFGS", options=dict(gtol=1e-12)).x
    q = jnp.ones((1, 1, 1, K), jnp.float32)
    _, state = rules.longhorn(q, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32),
                              jnp.full((1, 1, 1), gamma, jnp.float32), initial_state=jnp.asarray(s_prev, jnp.float32),
                              impl=impl)
    assert relative_error(state[0, 0], found.reshape(K, V)) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_efla_is_the_exact_solution_of_its_ode(impl):
    """Over an interval eta, X' = X (-k k^T) + v k^T with X = S^T [V, K]; solved by a matrix exponential."""
    key = fresh_key()
    K, V = 6, 4
    ks = jax.random.split(key, 4)
    s0 = np.asarray(jax.random.normal(ks[0], (K, V)), np.float64)
    k = np.asarray(jax.random.normal(ks[1], (K,)), np.float64) * 1.5
    v = np.asarray(jax.random.normal(ks[2], (V,)), np.float64)
    eta = float(jax.random.uniform(ks[3], (), minval=0.1, maxval=2.0))
    # Z = [X | v] evolves as Z' = Z N with N = [[-k k^T, 0], [k^T, 0]] (v is constant).
    N = np.zeros((K + 1, K + 1))
    N[:K, :K] = -np.outer(k, k)
    N[K, :K] = k
    Z0 = np.concatenate([s0.T, v[:, None]], axis=1)
    X_eta = (Z0 @ scipy.linalg.expm(eta * N))[:, :K]
    f32 = lambda a: jnp.asarray(a, jnp.float32)
    _, state = rules.efla(f32(np.ones((1, 1, 1, K))), f32(k[None, None, None]), f32(v[None, None, None]),
                          f32(np.full((1, 1, 1), eta)), initial_state=f32(s0[None, None]), impl=impl)
    assert relative_error(state[0, 0].T, X_eta) <= 1e-5


@pytest.mark.parametrize("rule", rules.STEP_RULES)
@pytest.mark.parametrize("passing", ("sequential", "associative"))
def test_step_rules_reduction_matches_raw_key_scan(rule, passing):
    """The normalised-key reduction (chunk) against the recurrence on raw keys (scan)."""
    key = fresh_key()
    T, H, Hv = 90, 2, 4
    x = rule_inputs(key, T=T, H=H, Hv=Hv, decay="scalar", packed=True, with_initial_state=True)
    k = _raw_keys(jax.random.fold_in(key, 5), 2, T, H, 16, norm_low=0.05, norm_high=6.0)
    param = jax.random.uniform(jax.random.fold_in(key, 6), (2, T, Hv), minval=0.1, maxval=1.9)
    param = None if rule == "kaczmarz" else param
    common = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"])
    ref = rules.delta_rule_with_step_size(rule, x["q"], k, x["v"], param, x["log_decay"], eps=1e-3, impl="scan",
                                          **common)
    got = rules.delta_rule_with_step_size(rule, x["q"], k, x["v"], param, x["log_decay"], eps=1e-3, impl="chunk",
                                          state_passing=passing, **common)
    assert relative_error(got[0], ref[0]) <= 1e-5
    assert relative_error(got[1], ref[1]) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
def test_kda_with_equal_channels_is_gated_deltanet(impl):
    x = rule_inputs(fresh_key(), T=100, decay="scalar", packed=True, with_initial_state=True)
    K = x["q"].shape[-1]
    common = dict(initial_state=x["initial_state"], segment_ids=x["segment_ids"], impl=impl)
    o_gdn, s_gdn = deltajax.gated_deltanet(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], **common)
    channel = jnp.broadcast_to(x["log_decay"][..., None], x["log_decay"].shape + (K,))
    o_kda, s_kda = deltajax.kda(x["q"], x["k"], x["v"], x["beta"], channel, **common)
    assert relative_error(o_kda, o_gdn) <= 1e-6
    assert relative_error(s_kda, s_gdn) <= 1e-6


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decay", ("none", "scalar", "channel"))
def test_linear_attention_is_decayed_causal_attention(impl, decay):
    """o_t = scale sum_{s <= t} (q_t . exp(G_t - G_s) k_s) v_s, computed densely in float64."""
    x = rule_inputs(fresh_key(), B=1, T=80, H=2, K=8, V=4, decay=decay)
    q, k, v = (np.asarray(x[n], np.float64) for n in ("q", "k", "v"))
    T, K = q.shape[1], q.shape[-1]
    if x["log_decay"] is None:
        G = np.zeros((1, T, 2, K))
    else:
        g = np.asarray(x["log_decay"], np.float64)
        G = np.cumsum(g if g.ndim == 4 else np.repeat(g[..., None], K, -1), axis=1)
    decay_ts = np.exp(G[:, :, None] - G[:, None, :])  # [1, t, s, H, K]
    scores = np.einsum("bthk,btshk,bshk->bhts", q, decay_ts, k) * np.tril(np.ones((T, T)))
    expected = np.einsum("bhts,bshv->bthv", scores, v) * K ** -0.5
    o, _ = deltajax.linear_attention(x["q"], x["k"], x["v"], x["log_decay"], impl=impl)
    assert relative_error(o, expected) <= 1e-5


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("decay", ("none", "scalar", "channel"))
def test_packed_documents_equal_separate_runs(impl, decay):
    key = fresh_key()
    lengths = (47, 83)
    docs = [rule_inputs(jax.random.fold_in(key, i), B=1, T=n, decay=decay, beta_max=2.0) for i, n in
            enumerate(lengths)]
    initial_state = rule_inputs(jax.random.fold_in(key, 9), B=1, T=1, with_initial_state=True)["initial_state"]
    separate = [deltajax.delta_rule(d["q"], d["k"], d["v"], d["beta"], d["log_decay"], impl=impl,
                                    initial_state=initial_state if i == 0 else None) for i, d in enumerate(docs)]
    packed = {name: None if docs[0][name] is None else jnp.concatenate([d[name] for d in docs], axis=1)
              for name in ("q", "k", "v", "beta", "log_decay")}
    segment_ids = jnp.concatenate([jnp.full((1, n), i, jnp.int32) for i, n in enumerate(lengths)], axis=1)
    o, s = deltajax.delta_rule(packed["q"], packed["k"], packed["v"], packed["beta"], packed["log_decay"],
                               segment_ids=segment_ids, initial_state=initial_state, impl=impl)
    assert relative_error(o, jnp.concatenate([separate[0][0], separate[1][0]], axis=1)) <= 1e-5
    assert relative_error(s, separate[1][1]) <= 1e-5


def test_chunk_state_maps_compose_to_the_final_state():
    """S_end = M S_0 + E per chunk; composing all chunk maps and applying them to S_0 gives the final state."""
    from deltajax.rules.chunk import chunk_factors

    x = rule_inputs(fresh_key(), T=192, decay="channel", packed=True, with_initial_state=True)
    factors = chunk_factors(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], segment_ids=x["segment_ids"],
                            chunk_size=64)
    m, e = rules.chunk_state_map(factors)
    total = (m[:, :, 0], e[:, :, 0])
    for c in range(1, m.shape[2]):
        total = rules.compose_state_maps(total, (m[:, :, c], e[:, :, c]))
    final = jnp.einsum("bhij,bhjv->bhiv", total[0], x["initial_state"]) + total[1]
    _, reference = deltajax.delta_rule(x["q"], x["k"], x["v"], x["beta"], x["log_decay"], impl="scan",
                                       initial_state=x["initial_state"], segment_ids=x["segment_ids"])
    assert relative_error(final, reference) <= 1e-5
