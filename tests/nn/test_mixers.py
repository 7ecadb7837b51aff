"""Each mixer equals its functional rule, and decodes token by token as it computes in parallel (float32).

The reference rebuilds the layer's features in float64 numpy from its parameters, runs the rule's token-by-token
oracle (impl="scan"), then the gated norm and output projection; the layer runs the chunked form. Decoding
prefills a prompt longer than one 16-token chunk, then feeds one token at a time from the cache.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from deltajax import rules
from deltajax.nn import DeltaRuleMixer, GatedAttention
from nn_helpers import FP32_TOL, fresh_key, random_normal, relative_error, tiny_config

B, T = 2, 37  # three 16-token chunks, the last one partial


def _np(param):
    return np.asarray(param[...], np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(0.0, x)


def _l2(x):
    return x / np.sqrt(np.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def reference_mixer(mixer, x, config):
    """The layer written out per formula: returns y [B, T, d] (float64)."""
    H, K, Hv, V = mixer.key_heads, mixer.key_dim, mixer.value_heads, mixer.value_dim
    x = np.asarray(x, np.float64)
    mixed = np.concatenate([x @ _np(mixer.q_proj.kernel), x @ _np(mixer.k_proj.kernel),
                            x @ _np(mixer.v_proj.kernel)], axis=-1)
    w = _np(mixer.conv.weight)  # [W, C], tap W-1 on the current token
    W = w.shape[0]
    conv = np.zeros_like(mixed)
    for t in range(T):
        for i in range(W):
            s = t - (W - 1) + i
            if s >= 0:
                conv[:, t] += w[i] * mixed[:, s]
    mixed = _silu(conv)
    q = mixed[..., :H * K].reshape(B, T, H, K)
    k = mixed[..., H * K:2 * H * K].reshape(B, T, H, K)
    v = mixed[..., 2 * H * K:].reshape(B, T, Hv, V)
    q = _l2(q)
    if config.step_rule not in ("kaczmarz", "relaxed_kaczmarz", "longhorn", "efla") or mixer.rule == "linear_attention":
        k = _l2(k)
    logits = None if mixer.b_proj is None else x @ _np(mixer.b_proj.kernel)
    log_decay = None
    if mixer.rule == "gated_deltanet":
        log_decay = -np.exp(_np(mixer.A_log)) * _softplus(x @ _np(mixer.a_proj.kernel) + _np(mixer.dt_bias))
    elif mixer.rule == "kda":
        f = x @ _np(mixer.f_down.kernel) @ _np(mixer.f_up.kernel) + _np(mixer.dt_bias)
        log_decay = -np.exp(_np(mixer.A_log))[:, None] * _softplus(f.reshape(B, T, Hv, K))

    f32 = lambda a: None if a is None else jnp.asarray(a, jnp.float32)
    q, k, v, log_decay = f32(q), f32(k), f32(v), f32(log_decay)
    kw = dict(impl="scan")
    if mixer.rule == "linear_attention":
        o, _ = rules.linear_attention(q, k, v, **kw)
    elif config.step_rule == "kaczmarz":
        o, _ = rules.kaczmarz(q, k, v, log_decay, **kw)
    elif config.step_rule == "relaxed_kaczmarz":
        o, _ = rules.relaxed_kaczmarz(q, k, v, f32(2 * _sigmoid(logits)), log_decay,
                                      eps=config.relaxed_kaczmarz_eps, **kw)
    elif config.step_rule == "longhorn":
        o, _ = rules.longhorn(q, k, v, f32(_softplus(logits)), log_decay, **kw)
    elif config.step_rule == "efla":
        o, _ = rules.efla(q, k, v, f32(_softplus(logits)), log_decay, **kw)
    else:
        beta = _sigmoid(logits) * (2.0 if config.step_rule == "negative_eigenvalues" else 1.0)
        fn = {"deltanet": lambda *a, **k_: rules.deltanet(*a[:4], **k_), "gated_deltanet": rules.gated_deltanet,
              "kda": rules.kda}[mixer.rule]
        o, _ = fn(q, k, v, f32(beta), log_decay, **kw)
    o = np.asarray(o, np.float64)

    if mixer.rule == "kda":
        gate = _sigmoid(x @ _np(mixer.g_down.kernel) @ _np(mixer.g_up.kernel) + _np(mixer.g_up.bias))
    else:
        gate = _silu(x @ _np(mixer.g_proj.kernel))
    normed = o / np.sqrt(np.mean(o * o, axis=-1, keepdims=True) + config.norm_eps) * _np(mixer.norm.weight)
    return (normed * gate.reshape(B, T, Hv, V)).reshape(B, T, Hv * V) @ _np(mixer.o_proj.kernel)


CASES = [("G", "sigmoid"), ("D", "sigmoid"), ("K", "sigmoid"), ("L", "sigmoid"), ("D", "negative_eigenvalues"),
         ("G", "kaczmarz"), ("K", "relaxed_kaczmarz"), ("D", "longhorn"), ("G", "efla"), ("A", "sigmoid")]
PROMPT_LEN = 19


@functools.lru_cache(maxsize=None)
def run_case(letter, step_rule):
    """(config, mixer, x, parallel output, prefill-then-step output), one compiled program per case."""
    config = tiny_config(layer_pattern=letter, step_rule=step_rule, impl="chunk")
    rngs = nnx.Rngs(fresh_key())
    mixer = GatedAttention(config, rngs=rngs) if letter == "A" else DeltaRuleMixer(config, letter, rngs=rngs)
    x = random_normal((B, T, config.d_model))
    is_attention = letter == "A"

    def run(mixer, x):
        full, no_cache = mixer(x)
        cache = mixer.init_cache(B, T) if is_attention else mixer.init_cache(B)
        positions = jnp.broadcast_to(jnp.arange(T), (B, T))
        head, cache = mixer(x[:, :PROMPT_LEN], positions=positions[:, :PROMPT_LEN], cache=cache, cache_index=0)

        def step(cache, t):
            x_t = jax.lax.dynamic_slice_in_dim(x, t, 1, axis=1)
            y_t, cache = mixer(x_t, positions=jnp.full((B, 1), t), cache=cache, cache_index=t)
            return cache, y_t[:, 0]

        _, tail = jax.lax.scan(step, cache, jnp.arange(PROMPT_LEN, T))
        assert no_cache is None
        return full, jnp.concatenate([head, jnp.moveaxis(tail, 0, 1)], axis=1)

    full, decoded = nnx.jit(run)(mixer, x)
    return config, mixer, x, full, decoded


@pytest.mark.parametrize("letter,step_rule", [c for c in CASES if c[0] != "A"])
def test_mixer_equals_rule(letter, step_rule):
    config, mixer, x, full, _ = run_case(letter, step_rule)
    assert full.shape == (B, T, config.d_model) and full.dtype == jnp.float32
    assert relative_error(full, reference_mixer(mixer, x, config)) <= FP32_TOL


@pytest.mark.parametrize("letter,step_rule", CASES)
def test_mixer_decoding_matches_parallel(letter, step_rule):
    _, _, _, full, decoded = run_case(letter, step_rule)
    assert relative_error(decoded, full) <= FP32_TOL


def test_attention_equals_softmax_reference():
    config, attn, x, y, _ = run_case("A", "sigmoid")

    xd = np.asarray(x, np.float64)
    Hq, Hkv, D = config.attn_heads, config.kv_heads, config.attn_dim

    def rms(z, w):
        return z / np.sqrt(np.mean(z * z, -1, keepdims=True) + config.norm_eps) * _np(w)

    q = rms((xd @ _np(attn.q_proj.kernel)).reshape(B, T, Hq, D), attn.q_norm.weight)
    k = rms((xd @ _np(attn.k_proj.kernel)).reshape(B, T, Hkv, D), attn.k_norm.weight)
    v = (xd @ _np(attn.v_proj.kernel)).reshape(B, T, Hkv, D)
    angle = np.arange(T)[:, None] * config.rope_theta ** (-np.arange(0, D, 2) / D)  # [T, D/2]
    cos, sin = np.cos(angle)[None, :, None], np.sin(angle)[None, :, None]

    def rope(z):
        z1, z2 = z[..., :D // 2], z[..., D // 2:]
        return np.concatenate([z1 * cos - z2 * sin, z2 * cos + z1 * sin], -1)

    q, k = rope(q), rope(k)
    out = np.zeros((B, T, Hq, D))
    for h in range(Hq):
        kv = h // (Hq // Hkv)
        s = np.einsum("btd,bsd->bts", q[:, :, h], k[:, :, kv]) / np.sqrt(D)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[:, :, h] = p @ v[:, :, kv]
    gate = _sigmoid(xd @ _np(attn.gate_proj.kernel))
    ref = (out.reshape(B, T, Hq * D) * gate) @ _np(attn.o_proj.kernel)
    assert relative_error(y, ref) <= FP32_TOL


def test_kaczmarz_has_no_step_projection_and_linear_attention_no_decay():
    config = tiny_config(layer_pattern="GL", step_rule="kaczmarz")
    assert DeltaRuleMixer(config, "G", rngs=nnx.Rngs(0)).b_proj is None
    linear = DeltaRuleMixer(config, "L", rngs=nnx.Rngs(0))
    assert linear.b_proj is None and linear.A_log is None and linear.a_proj is None
