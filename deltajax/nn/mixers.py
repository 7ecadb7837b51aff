"""Token mixers: the delta-rule family layer (G, D, K, L) and gated softmax attention (A).

Delta-rule layer (Qwen3-Next's Gated DeltaNet when `rule="gated_deltanet"`), for x [B, T, d]:

    q, k, v = silu(conv4([x W_q | x W_k | x W_v]))              depthwise causal conv over time
    q, k    = l2norm(q), l2norm(k)                               (k stays raw for Kaczmarz/Longhorn/EFLA)
    beta    = sigmoid(x W_b)  (or 2 sigmoid, or the step rule's parameter)
    g       = -exp(A_log) softplus(x W_a + dt_bias)             per head (G) or per key channel (K, low-rank W_a)
    o       = rule(q, k, v, beta, g)                             deltajax.rules, state [Hv, K, V] per sequence
    y       = W_o (rmsnorm(o) * silu(x W_z))                     gated RMSNorm per value head

Decoding passes a `DeltaRuleCache` (state and the last W-1 conv inputs) or an `AttentionCache` (keys and values
of every past position) explicitly; nothing is stored on the module.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax import rules
from deltajax.rules import sequence_parallel
from deltajax.nn.config import MIXER_LETTERS, RAW_KEY_STEP_RULES, ModelConfig
from deltajax.nn.layers import GatedRMSNorm, Linear, RMSNorm, ShortConvolution, apply_rope, l2_normalise
from deltajax.rules.common import document_index


class DeltaRuleCache(NamedTuple):
    """Decoding cache of one recurrent layer."""

    state: jax.Array  # [B, Hv, K, V] float32
    conv_tail: jax.Array  # [B, W-1, 2 H K + Hv V] compute dtype: the last W-1 inputs of the short convolution


class AttentionCache(NamedTuple):
    """Decoding cache of one attention layer; positions >= the model cache's index are unused."""

    keys: jax.Array  # [B, S, Hkv, D] compute dtype, after RoPE
    values: jax.Array  # [B, S, Hkv, D] compute dtype


def _inverse_softplus(y):
    return y + jnp.log(-jnp.expm1(-y))


def init_dt_bias(key, shape, dt_min=1e-3, dt_max=0.1, dt_floor=1e-4):
    """softplus(dt_bias) = dt, log-uniform in [dt_min, dt_max] (Mamba's time-step initialisation)."""
    u = jax.random.uniform(key, shape, jnp.float32)
    dt = jnp.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return _inverse_softplus(jnp.maximum(dt, dt_floor))


def init_a_log(key, shape, low, high):
    """A_log = log U(low, high); the floor keeps log finite when low is 0."""
    return jnp.log(jnp.maximum(jax.random.uniform(key, shape, jnp.float32, low, high), 1e-4))


class DeltaRuleMixer(nnx.Module):
    """One delta-rule-family layer; `letter` is G (Gated DeltaNet), D (DeltaNet), K (KDA) or L (linear attention).

    Parameters: q_proj, k_proj [d, H K]; v_proj [d, Hv V]; conv.weight [W, 2 H K + Hv V]; b_proj [d, Hv] (the
    step rule's logits; absent for Kaczmarz and linear attention); G: a_proj [d, Hv], A_log [Hv], dt_bias [Hv];
    K: f_down [d, r], f_up [r, Hv K], A_log [Hv], dt_bias [Hv K]; output gate g_proj [d, Hv V] (K: g_down [d, V],
    g_up [V, Hv V] with bias); norm.weight [V]; o_proj [Hv V, d].
    """

    def __init__(self, config: ModelConfig, letter: str, *, rngs: nnx.Rngs):
        if letter not in "GDKL":
            raise ValueError(f"DeltaRuleMixer takes G, D, K or L, got {letter!r}")
        self.rule = MIXER_LETTERS[letter]
        self.step_rule = config.step_rule if letter != "L" else None
        self.key_heads, self.key_dim = config.n_heads, config.head_dim
        self.value_heads, self.value_dim = config.value_heads, config.value_dim
        self.chunk_size, self.impl = config.chunk_size, config.impl
        self.relaxed_kaczmarz_eps = config.relaxed_kaczmarz_eps
        self.compute_dtype = config.compute_jnp_dtype
        d = config.d_model
        H, K, Hv, V = self.key_heads, self.key_dim, self.value_heads, self.value_dim
        pdt, cdt = config.param_jnp_dtype, self.compute_dtype
        std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
        kw = dict(rngs=rngs, param_dtype=pdt, compute_dtype=cdt)

        self.q_proj = Linear(d, H * K, std=std, **kw)
        self.k_proj = Linear(d, H * K, std=std, **kw)
        self.v_proj = Linear(d, Hv * V, std=std, **kw)
        self.conv_size = config.conv_size
        self.conv = (ShortConvolution(2 * H * K + Hv * V, config.conv_size, rngs=rngs, param_dtype=pdt)
                     if config.conv_size > 0 else None)
        has_step_logits = letter != "L" and self.step_rule != "kaczmarz"
        self.b_proj = Linear(d, Hv, std=std, **kw) if has_step_logits else None
        # Each optional sub-module is assigned exactly once: nnx fixes an attribute's kind (data or static) at
        # its first assignment, and None is static.
        gated, kda = self.rule == "gated_deltanet", self.rule == "kda"
        self.a_proj = Linear(d, Hv, std=std, **kw) if gated else None
        self.f_down = Linear(d, config.gate_rank, std=std, **kw) if kda else None
        self.f_up = Linear(config.gate_rank, Hv * K, std=config.gate_rank ** -0.5, **kw) if kda else None
        if gated or kda:
            low = 0.0 if gated else 1.0
            self.A_log = nnx.Param(init_a_log(rngs.params(), (Hv,), low, 16.0).astype(pdt))
            self.dt_bias = nnx.Param(init_dt_bias(rngs.params(), (Hv if gated else Hv * K,)).astype(pdt))
        else:
            self.A_log = None
            self.dt_bias = None
        output_gate = config.use_output_gate
        self.g_proj = Linear(d, Hv * V, std=std, **kw) if output_gate and not kda else None
        self.g_down = Linear(d, V, std=std, **kw) if output_gate and kda else None
        self.g_up = Linear(V, Hv * V, std=V ** -0.5, use_bias=True, **kw) if output_gate and kda else None
        self.norm = GatedRMSNorm(V, eps=config.norm_eps, activation="sigmoid" if self.rule == "kda" else "silu",
                                 param_dtype=pdt, compute_dtype=cdt)
        self.o_proj = Linear(Hv * V, d, std=out_std, **kw)

    @property
    def raw_keys(self) -> bool:
        return self.step_rule in RAW_KEY_STEP_RULES

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    def init_cache(self, batch_size: int) -> DeltaRuleCache:
        state = jnp.zeros((batch_size, self.value_heads, self.key_dim, self.value_dim), jnp.float32)
        tail = jnp.zeros((batch_size, max(self.conv_size - 1, 0), self.conv_channels), self.compute_dtype)
        return DeltaRuleCache(state, tail)

    def rule_inputs(self, x, *, segment_ids=None, conv_tail=None):
        """Everything the rule consumes, from x [B, T, d].

        Returns (inputs, new_conv_tail) with inputs a dict: q, k [B, T, H, K] and v [B, T, Hv, V] in the compute
        dtype; param [B, T, Hv] float32 (beta, rho, gamma or eta; None for Kaczmarz and linear attention);
        log_decay None / [B, T, Hv] / [B, T, Hv, K] float32; gate [B, T, Hv, V] or None.
        """
        B, T, _ = x.shape
        H, K, Hv, V = self.key_heads, self.key_dim, self.value_heads, self.value_dim
        mixed = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        if self.conv is not None:
            mixed, new_tail = self.conv(mixed, tail=conv_tail, segment_ids=segment_ids)
        else:
            mixed, new_tail = jax.nn.silu(mixed), jnp.zeros((B, 0, mixed.shape[-1]), mixed.dtype)
        q, k, v = jnp.split(mixed, [H * K, 2 * H * K], axis=-1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, Hv, V)
        cdt = self.compute_dtype
        q = l2_normalise(q).astype(cdt)
        k = (k if self.raw_keys else l2_normalise(k)).astype(cdt)

        param = None
        if self.b_proj is not None:
            logits = self.b_proj(x).astype(jnp.float32)
            param = {
                "sigmoid": rules.beta_sigmoid,
                "negative_eigenvalues": rules.beta_negative_eigenvalues,
                # rho in (0, 2): under- to over-relaxation; rho = 1 (logits 0) is plain Kaczmarz.
                "relaxed_kaczmarz": lambda z: 2.0 * jax.nn.sigmoid(z),
                "longhorn": jax.nn.softplus,
                "efla": jax.nn.softplus,
            }[self.step_rule](logits)

        log_decay = None
        if self.rule == "gated_deltanet":
            a = self.a_proj(x).astype(jnp.float32)
            log_decay = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
                a + self.dt_bias[...].astype(jnp.float32))
        elif self.rule == "kda":
            f = self.f_up(self.f_down(x)).astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32)
            log_decay = (-jnp.exp(self.A_log[...].astype(jnp.float32))[:, None]
                         * jax.nn.softplus(f.reshape(B, T, Hv, K)))

        gate = None
        if self.g_proj is not None:
            gate = self.g_proj(x).reshape(B, T, Hv, V)
        elif self.g_up is not None:
            gate = self.g_up(self.g_down(x)).reshape(B, T, Hv, V)
        return dict(q=q, k=k, v=v.astype(cdt), param=param, log_decay=log_decay, gate=gate), new_tail

    def apply_rule(self, inputs, *, initial_state=None, segment_ids=None, impl=None):
        """(o [B, T, Hv, V], final_state [B, Hv, K, V] float32) from `rule_inputs`, through deltajax.rules.

        The sequence-parallel entry points are the plain rules unless a `use_sequence_parallel` context is
        active (the trainer opens one when the sequence is sharded over devices).
        """
        q, k, v, param, log_decay = (inputs[n] for n in ("q", "k", "v", "param", "log_decay"))
        kw = dict(initial_state=initial_state, segment_ids=segment_ids, return_final_state=True,
                  impl=self.impl if impl is None else impl, chunk_size=self.chunk_size)
        if self.rule == "linear_attention":
            return sequence_parallel.linear_attention(q, k, v, None, **kw)
        if self.step_rule == "kaczmarz":
            return sequence_parallel.kaczmarz(q, k, v, log_decay, **kw)
        if self.step_rule == "relaxed_kaczmarz":
            return sequence_parallel.relaxed_kaczmarz(q, k, v, param, log_decay, eps=self.relaxed_kaczmarz_eps, **kw)
        if self.step_rule == "longhorn":
            return sequence_parallel.longhorn(q, k, v, param, log_decay, **kw)
        if self.step_rule == "efla":
            return sequence_parallel.efla(q, k, v, param, log_decay, **kw)
        if self.rule == "deltanet":
            return sequence_parallel.deltanet(q, k, v, param, **kw)
        if self.rule == "gated_deltanet":
            return sequence_parallel.gated_deltanet(q, k, v, param, log_decay, **kw)
        return sequence_parallel.kda(q, k, v, param, log_decay, **kw)

    def project_output(self, o, gate):
        """W_o (rmsnorm(o) * act(gate)) per value head; o [B, T, Hv, V] -> [B, T, d]."""
        B, T = o.shape[:2]
        return self.o_proj(self.norm(o, gate).reshape(B, T, -1))

    def __call__(self, x, *, segment_ids=None, positions=None, cache: DeltaRuleCache | None = None,
                 cache_index=None):
        """x [B, T, d] -> (y [B, T, d], new cache or None). With a cache, continues from its state."""
        del positions, cache_index
        if cache is not None and segment_ids is not None:
            raise ValueError("decoding with a cache takes one document per row; pass segment_ids=None")
        inputs, tail = self.rule_inputs(x, segment_ids=segment_ids,
                                        conv_tail=None if cache is None else cache.conv_tail)
        # One new token: the token-by-token form is the cheapest exact path (no chunk padding).
        impl = "scan" if cache is not None and x.shape[1] == 1 else None
        o, state = self.apply_rule(inputs, initial_state=None if cache is None else cache.state,
                                   segment_ids=segment_ids, impl=impl)
        y = self.project_output(o, inputs["gate"])
        return y, (None if cache is None else DeltaRuleCache(state, tail.astype(self.compute_dtype)))


class GatedAttention(nnx.Module):
    """Causal softmax attention with grouped-query heads, RoPE, per-head q/k RMSNorm and a sigmoid output gate.

    y = W_o (softmax(q k^T / sqrt(D) + mask) v * sigmoid(x W_gate)); query head h reads key/value head
    h // (Hq / Hkv). The mask keeps s <= t within one document; positions restart at every document.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        d = config.d_model
        self.heads, self.kv_heads, self.head_dim = config.attn_heads, config.kv_heads, config.attn_dim
        self.rope_theta = config.rope_theta
        self.compute_dtype = config.compute_jnp_dtype
        pdt, cdt = config.param_jnp_dtype, self.compute_dtype
        std, out_std = config.init_std, config.init_std / math.sqrt(2 * config.n_layers)
        kw = dict(rngs=rngs, param_dtype=pdt, compute_dtype=cdt)
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        self.q_proj = Linear(d, Hq * D, std=std, **kw)
        self.k_proj = Linear(d, Hkv * D, std=std, **kw)
        self.v_proj = Linear(d, Hkv * D, std=std, **kw)
        self.gate_proj = Linear(d, Hq * D, std=std, **kw)
        self.o_proj = Linear(Hq * D, d, std=out_std, **kw)
        if config.attn_qk_norm:
            self.q_norm = RMSNorm(D, eps=config.norm_eps, param_dtype=pdt, compute_dtype=jnp.float32)
            self.k_norm = RMSNorm(D, eps=config.norm_eps, param_dtype=pdt, compute_dtype=jnp.float32)
        else:
            self.q_norm = self.k_norm = None

    def init_cache(self, batch_size: int, max_len: int) -> AttentionCache:
        shape = (batch_size, max_len, self.kv_heads, self.head_dim)
        return AttentionCache(jnp.zeros(shape, self.compute_dtype), jnp.zeros(shape, self.compute_dtype))

    def __call__(self, x, *, segment_ids=None, positions=None, cache: AttentionCache | None = None,
                 cache_index=None):
        """x [B, T, d], positions [B, T] -> (y [B, T, d], new cache or None); a cache needs cache_index."""
        if cache is not None and segment_ids is not None:
            raise ValueError("decoding with a cache takes one document per row; pass segment_ids=None")
        B, T, _ = x.shape
        Hq, Hkv, D = self.heads, self.kv_heads, self.head_dim
        cdt = self.compute_dtype
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        q = self.q_proj(x).reshape(B, T, Hq, D)
        k = self.k_proj(x).reshape(B, T, Hkv, D)
        v = self.v_proj(x).reshape(B, T, Hkv, D)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, positions, self.rope_theta).astype(cdt)
        k = apply_rope(k, positions, self.rope_theta).astype(cdt)

        query_index = jnp.arange(T)
        if cache is None:
            keys, values = k, v
            allowed = query_index[:, None] >= query_index[None, :]  # [T, S]
            if segment_ids is not None:
                doc = document_index(segment_ids, B, T)
                allowed = allowed[None] & (doc[:, :, None] == doc[:, None, :])
            else:
                allowed = allowed[None]
            new_cache = None
        else:
            keys = jax.lax.dynamic_update_slice(cache.keys, k.astype(cache.keys.dtype), (0, cache_index, 0, 0))
            values = jax.lax.dynamic_update_slice(cache.values, v.astype(cache.values.dtype),
                                                  (0, cache_index, 0, 0))
            key_index = jnp.arange(keys.shape[1])
            allowed = (key_index[None, :] <= cache_index + query_index[:, None])[None]
            new_cache = AttentionCache(keys, values)

        group = Hq // Hkv
        q = q.reshape(B, T, Hkv, group, D)
        precision = jax.lax.Precision.HIGHEST if cdt == jnp.float32 else None
        scores = jnp.einsum("btngd,bsnd->bngts", q, keys.astype(cdt), preferred_element_type=jnp.float32,
                            precision=precision) * (D ** -0.5)
        scores = jnp.where(allowed[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        out = jnp.einsum("bngts,bsnd->btngd", probs.astype(cdt), values.astype(cdt),
                         preferred_element_type=jnp.float32, precision=precision)
        out = out.reshape(B, T, Hq * D) * jax.nn.sigmoid(self.gate_proj(x).astype(jnp.float32))
        return self.o_proj(out.astype(cdt)), new_cache
