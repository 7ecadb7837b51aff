"""The language model: shapes and dtypes under jit, finite gradients, packed documents that never leak, generate."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from deltajax.nn import PRESETS, LanguageModel, count_parameters, generate
from nn_helpers import fresh_key, model_tolerance, random_tokens, relative_error, tiny_config


def test_preset_bf16_shapes_dtypes_and_finite_gradients():
    """The default policy (bf16 compute, fp32 params and logits) on a packed batch: loss, gradients, dtypes."""
    config = PRESETS["tiny-hybrid"]
    model = LanguageModel(config, rngs=nnx.Rngs(fresh_key()))
    assert config.compute_dtype == "bfloat16"
    B, T = 2, 40
    tokens = random_tokens((B, T + 1), config.vocab_size)
    segment_ids = jnp.asarray([[0] * 17 + [1] * 24, [5] * 41], jnp.int32)[:, :T]

    def loss_fn(model):
        logits = model(tokens[:, :-1], segment_ids)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        return loss, logits

    (loss, logits), grads = nnx.jit(nnx.value_and_grad(loss_fn, has_aux=True))(model)
    assert logits.shape == (B, T, config.vocab_size) and logits.dtype == jnp.float32
    assert np.isfinite(float(loss))
    leaves = jax.tree.leaves(nnx.state(grads, nnx.Param))
    assert len(leaves) == len(jax.tree.leaves(nnx.state(model, nnx.Param)))
    assert all(leaf.dtype == jnp.float32 for leaf in leaves)
    assert all(bool(jnp.all(jnp.isfinite(leaf))) for leaf in leaves)
    # every parameter receives gradient (nothing is disconnected from the loss)
    assert all(float(jnp.max(jnp.abs(leaf))) > 0 for leaf in leaves)
    for p in jax.tree.leaves(nnx.state(model, nnx.Param)):
        assert p.dtype == jnp.float32


def test_packed_documents_do_not_leak():
    """Every layer type: a document's logits do not depend on what is packed before or after it."""
    config = tiny_config(layer_pattern="GDKLA", n_layers=5)
    model = LanguageModel(config, rngs=nnx.Rngs(fresh_key()))
    a, b = 13, 27  # b spans two 16-token chunks
    doc, other_1, other_2 = (random_tokens((1, n), config.vocab_size) for n in (b, a, a))
    first = jnp.concatenate([other_1, doc], axis=1)  # doc second: state, conv, attention and positions restart
    second = jnp.concatenate([doc, other_2], axis=1)  # doc first: nothing before it
    segments_first = jnp.asarray([[3] * a + [4] * b], jnp.int32)
    segments_second = jnp.asarray([[7] * b + [2] * a], jnp.int32)
    forward = nnx.jit(lambda m, t, s: m(t, s))
    tokens, segment_ids = jnp.concatenate([first, second]), jnp.concatenate([segments_first, segments_second])
    logits = forward(model, tokens, segment_ids)
    assert relative_error(logits[0, a:], logits[1, :b]) <= model_tolerance(model, tokens, segment_ids)
    # without segment ids the same row does see the other document
    unsegmented = forward(model, first, jnp.zeros_like(segments_first))
    assert relative_error(unsegmented[0, a:], logits[1, :b]) > 1e-3


def test_generate_greedy_matches_argmax_of_forward():
    config = tiny_config(layer_pattern="GA", n_layers=2)
    model = LanguageModel(config, rngs=nnx.Rngs(fresh_key()))
    prompt = random_tokens((2, 5), config.vocab_size)
    out = generate(model, prompt, 6)
    assert out.shape == (2, 11) and out.dtype == jnp.int32
    np.testing.assert_array_equal(out[:, :5], prompt)
    logits = nnx.jit(lambda m, t: m(t))(model, out[:, :-1])
    np.testing.assert_array_equal(out[:, 5:], jnp.argmax(logits[:, 4:], axis=-1))
    # top-1 sampling is greedy whatever the temperature; one 1-D prompt gives one 1-D sequence
    sampled = generate(model, prompt, 6, temperature=0.7, top_k=1, rng=jax.random.key(0))
    np.testing.assert_array_equal(sampled, out)
    single = generate(model, prompt[0], 6)
    np.testing.assert_array_equal(single, out[0])


def test_generate_argument_errors():
    config = tiny_config(layer_pattern="G", n_layers=1)
    model = LanguageModel(config, rngs=nnx.Rngs(0))
    prompt = jnp.ones((1, 3), jnp.int32)
    with pytest.raises(ValueError, match="needs rng"):
        generate(model, prompt, 2, temperature=1.0)
    with pytest.raises(ValueError, match="top_k"):
        generate(model, prompt, 2, temperature=1.0, top_k=0, rng=jax.random.key(0))
    with pytest.raises(ValueError, match="temperature"):
        generate(model, prompt, 2, temperature=-1.0)


def test_tied_and_untied_embeddings():
    tied = tiny_config(layer_pattern="GA", n_layers=2)
    untied = tied.replace(tie_embeddings=False)
    assert count_parameters(untied) - count_parameters(tied) == tied.vocab_size * tied.d_model
    model = LanguageModel(tied, rngs=nnx.Rngs(0))
    assert count_parameters(model) == count_parameters(tied)
    assert model.lm_head is None and LanguageModel(untied, rngs=nnx.Rngs(0)).lm_head is not None


def test_tokens_must_be_two_dimensional():
    model = LanguageModel(tiny_config(layer_pattern="G", n_layers=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="tokens must be"):
        model(jnp.ones((4,), jnp.int32))
