"""Recurrent decoding of whole models reproduces the parallel forward (float32, see nn_helpers.model_tolerance).

A hybrid with every layer type: every token fed one at a time from an empty cache, and a prompt longer than one
16-token chunk prefilled through the chunked path, then single tokens. Each layer type alone is checked in
test_mixers.py.
"""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from deltajax.nn import LanguageModel
from nn_helpers import fresh_key, model_tolerance, random_tokens, relative_error, tiny_config

B, T = 2, 30


@pytest.mark.parametrize("pattern,n_layers", [("GDKLA", 5)])
def test_model_decoding_matches_parallel(pattern, n_layers):
    config = tiny_config(layer_pattern=pattern, n_layers=n_layers)
    model = LanguageModel(config, rngs=nnx.Rngs(fresh_key()))
    tokens = random_tokens((B, T), config.vocab_size)

    def run(model, tokens):
        full = model(tokens)

        def decoded(prompt_len):
            logits, cache = model(tokens[:, :prompt_len], cache=model.init_cache(B, T))

            def step(cache, t):
                token = jax.lax.dynamic_slice_in_dim(tokens, t, 1, axis=1)
                step_logits, cache = model(token, cache=cache)
                return cache, step_logits[:, 0]

            cache, tail = jax.lax.scan(step, cache, jnp.arange(prompt_len, T))
            return jnp.concatenate([logits, jnp.moveaxis(tail, 0, 1)], axis=1), cache.index

        return full, decoded(1), decoded(21)

    full, (one_by_one, index_a), (prefilled, index_b) = nnx.jit(run)(model, tokens)
    assert full.dtype == jnp.float32 and full.shape == (B, T, config.vocab_size)
    assert int(index_a) == T and int(index_b) == T
    tolerance = model_tolerance(model, tokens)
    assert relative_error(one_by_one, full) <= tolerance
    assert relative_error(prefilled, full) <= tolerance


def test_cache_layout():
    config = tiny_config(layer_pattern="GKA", n_layers=3)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    cache = model.init_cache(3, 50)
    gdn, kda, attention = cache.layers
    assert gdn.state.shape == (3, 4, 8, 8) and gdn.state.dtype == jnp.float32
    assert gdn.conv_tail.shape == (3, 3, 2 * 2 * 8 + 4 * 8)
    assert kda.state.shape == (3, 4, 8, 8)
    assert attention.keys.shape == (3, 50, 2, 8) and attention.values.shape == (3, 50, 2, 8)
    assert int(cache.index) == 0


def test_cache_with_segment_ids_is_refused():
    config = tiny_config(layer_pattern="G", n_layers=1)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    tokens = jnp.ones((1, 4), jnp.int32)
    with pytest.raises(ValueError, match="one document per row"):
        model(tokens, jnp.zeros((1, 4), jnp.int32), cache=model.init_cache(1, 4))
