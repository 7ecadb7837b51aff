"""The causal language model: embeddings, pre-norm residual blocks from a layer pattern, tied or untied head.

    h_0 = E[tokens];  h <- h + mixer_i(rmsnorm(h));  h <- h + swiglu_i(rmsnorm(h));  logits = rmsnorm(h) E^T

The residual stream is float32; sub-layers compute in `config.compute_dtype`; recurrent states are float32.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax.nn.config import ModelConfig
from deltajax.nn.layers import RMSNorm, SwiGLU, matmul_precision, positions_in_document
from deltajax.nn.mixers import AttentionCache, DeltaRuleCache, DeltaRuleMixer, GatedAttention


class ModelCache(NamedTuple):
    """Decoding cache: one entry per layer and the number of tokens already consumed (every row alike)."""

    layers: tuple  # DeltaRuleCache | AttentionCache per layer
    index: jax.Array  # int32 scalar


class Block(nnx.Module):
    """x + mixer(rmsnorm(x)), then + swiglu(rmsnorm(.)); `letter` picks the mixer."""

    def __init__(self, config: ModelConfig, letter: str, *, rngs: nnx.Rngs):
        pdt, cdt = config.param_jnp_dtype, config.compute_jnp_dtype
        self.letter = letter
        self.mixer_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt, compute_dtype=cdt)
        self.mixer = (GatedAttention(config, rngs=rngs) if letter == "A"
                      else DeltaRuleMixer(config, letter, rngs=rngs))
        self.mlp_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt, compute_dtype=cdt)
        self.mlp = SwiGLU(config.d_model, config.ffn_dim, std=config.init_std,
                          out_std=config.init_std / (2 * config.n_layers) ** 0.5, rngs=rngs, param_dtype=pdt,
                          compute_dtype=cdt)

    def init_cache(self, batch_size: int, max_len: int):
        if self.letter == "A":
            return self.mixer.init_cache(batch_size, max_len)
        return self.mixer.init_cache(batch_size)

    def __call__(self, x, *, segment_ids=None, positions=None, cache=None, cache_index=None):
        mixed, cache = self.mixer(self.mixer_norm(x), segment_ids=segment_ids, positions=positions, cache=cache,
                                  cache_index=cache_index)
        x = x + mixed.astype(x.dtype)
        x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
        return x, cache


class LanguageModel(nnx.Module):
    """Causal LM over `config.layer_types`.

    `model(tokens)` -> logits [B, T, vocab] float32. `segment_ids` [B, T] marks packed documents: recurrent states
    and convolutions restart, attention is masked and positions restart at every change of id.
    `model(tokens, cache=cache)` -> (logits, new cache): continues decoding from `cache` (see `init_cache`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        config.validate()
        self.config = config
        pdt = config.param_jnp_dtype
        self.embedding = nnx.Param(
            config.init_std * jax.random.normal(rngs.params(), (config.vocab_size, config.d_model), pdt))
        self.blocks = nnx.List([Block(config, letter, rngs=rngs) for letter in config.layer_types])
        self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps, param_dtype=pdt,
                                  compute_dtype=config.compute_jnp_dtype)
        self.lm_head = None if config.tie_embeddings else nnx.Param(
            config.init_std * jax.random.normal(rngs.params(), (config.d_model, config.vocab_size), pdt))

    def init_cache(self, batch_size: int, max_len: int) -> ModelCache:
        """An empty cache for `batch_size` rows of up to `max_len` tokens (prompt included).

        Attention layers write keys at `index`; going past `max_len` is not checked inside `jit` (XLA clamps the
        write), so size the cache for the prompt plus every new token.
        """
        layers = tuple(block.init_cache(batch_size, max_len) for block in self.blocks)
        return ModelCache(layers, jnp.zeros((), jnp.int32))

    def logits(self, hidden):
        """float32 logits from the final hidden states [B, T, d]."""
        cdt = self.config.compute_jnp_dtype
        h = self.final_norm(hidden).astype(cdt)
        if self.lm_head is None:
            return jnp.einsum("btd,vd->btv", h, self.embedding[...].astype(cdt),
                              preferred_element_type=jnp.float32, precision=matmul_precision(cdt))
        return jnp.einsum("btd,dv->btv", h, self.lm_head[...].astype(cdt), preferred_element_type=jnp.float32,
                          precision=matmul_precision(cdt))

    def __call__(self, tokens, segment_ids=None, *, cache: ModelCache | None = None):
        if tokens.ndim != 2:
            raise ValueError(f"tokens must be [batch, time] int, got shape {tokens.shape}")
        if segment_ids is not None and segment_ids.shape != tokens.shape:
            raise ValueError(f"segment_ids must have the shape of tokens {tokens.shape}, got {segment_ids.shape}")
        if cache is not None and segment_ids is not None:
            raise ValueError("decoding with a cache takes one document per row; pass segment_ids=None")
        B, T = tokens.shape
        index = None if cache is None else cache.index
        positions = positions_in_document(segment_ids, B, T, offset=0 if cache is None else index)
        x = jnp.take(self.embedding[...], tokens, axis=0).astype(jnp.float32)
        new_layers = []
        for i, block in enumerate(self.blocks):
            x, layer_cache = block(x, segment_ids=segment_ids, positions=positions,
                                   cache=None if cache is None else cache.layers[i], cache_index=index)
            new_layers.append(layer_cache)
        logits = self.logits(x)
        if cache is None:
            return logits
        return logits, ModelCache(tuple(new_layers), index + T)


__all__ = ["AttentionCache", "Block", "DeltaRuleCache", "LanguageModel", "ModelCache"]
