"""Autoregressive generation: prefill through the chunked path, then one token at a time from the cache."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx


def sample_token(logits, *, temperature: float, top_k: int | None, rng):
    """Next token [B] from logits [B, vocab]: argmax at temperature 0, else softmax(logits / T) over the top k."""
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


def generate(model, prompt_tokens, max_new_tokens: int, *, temperature: float = 0.0, top_k: int | None = None,
             rng=None):
    """Continues every row of `prompt_tokens` [B, P] (or [P]) by `max_new_tokens` tokens.

    Returns int32 [B, P + max_new_tokens] (prompt followed by the new tokens; [P + N] for a 1-D prompt).
    Greedy at temperature 0; otherwise sampling needs `rng` (a jax.random key). One compiled program: the
    prompt fills the cache in one chunked pass, then a `lax.scan` feeds back one token per step.
    """
    prompt = jnp.asarray(prompt_tokens, jnp.int32)
    squeeze = prompt.ndim == 1
    if squeeze:
        prompt = prompt[None]
    if prompt.ndim != 2 or prompt.shape[1] < 1:
        raise ValueError(f"prompt_tokens must be [B, P] or [P] with P >= 1, got shape {prompt.shape}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if top_k is not None and not (isinstance(top_k, int) and 1 <= top_k <= model.config.vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size], got {top_k!r}")
    if temperature > 0 and rng is None:
        raise ValueError("sampling (temperature > 0) needs rng, a jax.random key")
    if max_new_tokens == 0:
        return prompt[0] if squeeze else prompt
    if rng is None:
        rng = jax.random.key(0)  # unused by greedy decoding; keeps one program shape

    graphdef, state = nnx.split(model)
    run = _compiled_generate(graphdef, prompt.shape[0], prompt.shape[1], max_new_tokens, float(temperature), top_k)
    out = run(state, prompt, rng)
    return out[0] if squeeze else out


@functools.lru_cache(maxsize=32)
def _compiled_generate(graphdef, batch: int, prompt_len: int, max_new_tokens: int, temperature: float,
                       top_k: int | None):
    """One compiled program per model structure and shape, reused across calls (e.g. samples during training)."""

    @jax.jit
    def run(state, prompt, rng):
        model = nnx.merge(graphdef, state)
        cache = model.init_cache(batch, prompt_len + max_new_tokens)
        logits, cache = model(prompt, cache=cache)
        keys = jax.random.split(rng, max_new_tokens)
        first = sample_token(logits[:, -1], temperature=temperature, top_k=top_k, rng=keys[0])

        def step(carry, key):
            token, cache = carry
            logits, cache = model(token[:, None], cache=cache)
            return (sample_token(logits[:, 0], temperature=temperature, top_k=top_k, rng=key), cache), token

        (last, _), tokens = jax.lax.scan(step, (first, cache), keys[1:])
        new = jnp.concatenate([jnp.moveaxis(tokens, 0, 1), last[:, None]], axis=1)
        return jnp.concatenate([prompt, new], axis=1)

    return run
