"""Helpers for the layer and model tests: a tiny float32 config, fresh random inputs, the relative error."""

import jax
import jax.numpy as jnp

from deltajax.nn import ModelConfig
from testing_utils import fresh_key, relative_error

# One tolerance per dtype (relative error |x - ref| / |ref|).
FP32_TOL = 1e-5

__all__ = ["FP32_TOL", "fresh_key", "random_normal", "random_tokens", "relative_error", "tiny_config"]


def tiny_config(layer_pattern="GGGA", n_layers=None, **overrides):
    """A few thousand parameters, float32 compute, 16-token chunks so that short prompts span several chunks."""
    fields = dict(vocab_size=64, d_model=32, n_layers=len(layer_pattern) if n_layers is None else n_layers,
                  layer_pattern=layer_pattern, n_heads=2, head_dim=8, n_value_heads=4, value_head_dim=8,
                  n_attn_heads=4, n_kv_heads=2, attn_head_dim=8, d_ff=48, compute_dtype="float32",
                  chunk_size=16, kda_gate_rank=4, init_std=0.2)
    fields.update(overrides)
    return ModelConfig(**fields)


def random_tokens(shape, vocab):
    return jax.random.randint(fresh_key(), shape, 0, vocab, dtype=jnp.int32)


def random_normal(shape):
    return jax.random.normal(fresh_key(), shape, jnp.float32)
