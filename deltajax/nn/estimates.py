"""Parameter counts, FLOPs per token and decoding memory (seed 004).

Decoding memory per layer and sequence:
    softmax attention   KV cache  = batch x tokens x kv_heads x head_dim x 2 x bytes     (grows with tokens)
    delta-rule family   state     = batch x heads x d_k x d_v x bytes                   (constant)
                        + the short-convolution tail, batch x (W - 1) x channels x bytes
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax.nn.config import ModelConfig


def count_parameters(model_or_config) -> int:
    """Number of parameters of a model, or of the model a config would build (computed without allocating)."""
    if isinstance(model_or_config, ModelConfig):
        from deltajax.nn.model import LanguageModel

        config = model_or_config
        abstract = nnx.eval_shape(lambda: LanguageModel(config, rngs=nnx.Rngs(0)))
        return count_parameters(abstract)
    params = nnx.state(model_or_config, nnx.Param)
    return int(sum(x.size for x in jax.tree.leaves(params)))


def _mixer_matmul_params(config: ModelConfig, letter: str) -> int:
    d = config.d_model
    if letter == "A":
        Hq, Hkv, D = config.attn_heads, config.kv_heads, config.attn_dim
        return d * (2 * Hq * D + 2 * Hkv * D) + Hq * D * d
    H, K, Hv, V = config.n_heads, config.head_dim, config.value_heads, config.value_dim
    n = d * (2 * H * K + Hv * V) + Hv * V * d
    if letter != "L" and config.step_rule != "kaczmarz":
        n += d * Hv
    if letter == "G":
        n += d * Hv
    if letter == "K":
        n += config.gate_rank * (d + Hv * K)
    if config.use_output_gate:
        n += d * Hv * V if letter != "K" else V * (d + Hv * V)
    return n


def _mixer_sequence_flops(config: ModelConfig, letter: str, seq_len: int) -> float:
    """Forward FLOPs per token spent mixing across positions (beyond the projections)."""
    if letter == "A":
        # causal: a token attends to (T + 1) / 2 keys on average; q k^T and p v are 2 D FLOPs per pair each
        return 4.0 * config.attn_heads * config.attn_dim * (seq_len + 1) / 2
    K, V, Hv = config.head_dim, config.value_dim, config.value_heads
    C = min(config.chunk_size, max(seq_len, 1))
    conv = 2.0 * config.conv_size * (2 * config.n_heads * K + Hv * V)
    if letter == "L":
        # chunked linear attention: q S (2KV), state update k^T v (2KV), intra-chunk q k^T (2CK) and p v (2CV)
        per_head = 4 * K * V + 2 * C * K + 2 * C * V
    else:
        # WY form: k k^T (2CK), two triangular solves (C(K+V)), u = u0 - w S (2KV), state update (2KV),
        # q S (2KV), intra-chunk q k^T (2CK) and p u (2CV)
        per_head = 6 * K * V + 4 * C * K + 2 * C * V + C * (K + V)
    return float(Hv * per_head + conv)


def flops_per_token(config: ModelConfig, seq_len: int, *, training: bool = True) -> float:
    """FLOPs per token of a sequence of `seq_len` tokens: forward x 3 when `training` (forward + backward).

    Counts matrix products (2 FLOPs per multiply-add): all projections, the LM head and the mixers' sequence
    work (the chunked form for recurrent layers, with chunk `config.chunk_size`). Norms, activations and the
    embedding lookup are left out.
    """
    d, f = config.d_model, config.ffn_dim
    forward = 0.0
    for letter in config.layer_types:
        forward += 2.0 * (_mixer_matmul_params(config, letter) + 3 * d * f)
        forward += _mixer_sequence_flops(config, letter, seq_len)
    forward += 2.0 * d * config.vocab_size
    return 3.0 * forward if training else forward


def kv_cache_bytes(batch: int, tokens: int, kv_heads: int, head_dim: int, bytes_per_element: int = 2) -> int:
    """batch x tokens x kv_heads x head_dim x 2 (keys and values) x bytes."""
    return batch * tokens * kv_heads * head_dim * 2 * bytes_per_element


def recurrent_state_bytes(batch: int, heads: int, key_dim: int, value_dim: int, bytes_per_element: int = 4) -> int:
    """batch x heads x d_k x d_v x bytes (no dependence on the number of tokens)."""
    return batch * heads * key_dim * value_dim * bytes_per_element


def decoding_memory(config: ModelConfig, batch: int, tokens: int, *, cache_bytes: int | None = None,
                    state_bytes: int = 4) -> dict:
    """Decoding-cache bytes of `config` for `batch` sequences of `tokens` tokens.

    Returns {"per_layer": {letter: bytes of one layer of that type}, "by_type": {letter: bytes of all layers of
    that type}, "total": bytes}. KV caches and convolution tails use `cache_bytes` per element (default: the
    compute dtype), recurrent states `state_bytes` (float32).
    """
    if cache_bytes is None:
        cache_bytes = jnp.dtype(config.compute_dtype).itemsize
    per_layer = {}
    for letter in sorted(set(config.layer_types)):
        if letter == "A":
            per_layer[letter] = kv_cache_bytes(batch, tokens, config.kv_heads, config.attn_dim, cache_bytes)
        else:
            channels = 2 * config.n_heads * config.head_dim + config.value_heads * config.value_dim
            per_layer[letter] = (recurrent_state_bytes(batch, config.value_heads, config.head_dim, config.value_dim,
                                                       state_bytes)
                                 + batch * max(config.conv_size - 1, 0) * channels * cache_bytes)
    by_type = {letter: per_layer[letter] * config.layer_types.count(letter) for letter in per_layer}
    return {"per_layer": per_layer, "by_type": by_type, "total": sum(by_type.values())}
