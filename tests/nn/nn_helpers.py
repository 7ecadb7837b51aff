"""Helpers for the layer and model tests: a tiny float32 config, fresh random inputs, the relative error."""

import jax
import jax.numpy as jnp
from flax import nnx

from deltajax.nn import ModelConfig
from testing_utils import fresh_key, relative_error

# One tolerance per dtype (relative error |x - ref| / |ref|).
FP32_TOL = 1e-5
# Whole-model comparisons allow this many times the logits' parameter-rounding sensitivity (see model_tolerance);
# over 33 draws the decoding paths differed from the parallel one by 0.9-1.6 times it (CPU, 2026-12-06).
SENSITIVITY_MARGIN = 4.0

__all__ = ["FP32_TOL", "fresh_key", "model_tolerance", "random_normal", "random_tokens", "relative_error",
           "tiny_config"]


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


def model_tolerance(model, tokens, segment_ids=None):
    """The float32 tolerance for comparing two evaluations of a whole model's logits at these tokens.

    A random draw can make the model ill-conditioned: a document's first token whose q.k nearly cancels (0.002 at
    one draw) feeds a per-head RMSNorm near its eps, and the rounding noise of two otherwise equal evaluations grows
    tens of times (1.45e-5 there, against about 2e-6 typically). Two fp32 evaluations differ by about what one
    rounding of every parameter changes, so the tolerance is FP32_TOL or SENSITIVITY_MARGIN times that change,
    whichever is larger. A draw so ill-conditioned that the comparison would say nothing fails here instead."""
    leaves, treedef = jax.tree.flatten(nnx.state(model, nnx.Param))
    keys = jax.random.split(fresh_key(), len(leaves))
    moved_model = nnx.clone(model)
    nnx.update(moved_model, jax.tree.unflatten(treedef, [
        leaf * (1 + jnp.finfo(leaf.dtype).eps / 2 * jax.random.rademacher(key, leaf.shape, leaf.dtype))
        for leaf, key in zip(leaves, keys)]))
    forward = nnx.jit(lambda m, t, s: m(t, s))  # one program for both models
    change = relative_error(forward(moved_model, tokens, segment_ids), forward(model, tokens, segment_ids))
    assert change < 1e-4, f"this draw's logits move by {change:.2e} under one rounding of the parameters"
    return max(FP32_TOL, SENSITIVITY_MARGIN * change)
