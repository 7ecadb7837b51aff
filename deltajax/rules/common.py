"""Pure helpers shared by the scan, the chunked form and the kernels."""

from __future__ import annotations

import jax.numpy as jnp

HIGHEST = "highest"


def repeat_key_heads(x, value_heads: int):
    """[B, T, H, K] -> [B, T, Hv, K]: each key head serves Hv // H consecutive value heads."""
    heads = x.shape[2]
    return x if heads == value_heads else jnp.repeat(x, value_heads // heads, axis=2)


def document_index(segment_ids, batch: int, seq_len: int):
    """[B, T] int32 that increases by one at every document boundary (segment id change).

    Working with this instead of raw ids makes "same document" exact even when ids repeat (A A B A).
    """
    if segment_ids is None:
        return jnp.zeros((batch, seq_len), jnp.int32)
    boundary = jnp.concatenate(
        [jnp.zeros((batch, 1), jnp.int32), (segment_ids[:, 1:] != segment_ids[:, :-1]).astype(jnp.int32)], axis=1)
    return jnp.cumsum(boundary, axis=1)


def resets(segment_ids, batch: int, seq_len: int):
    """[B, T] bool: the state is zeroed before token t (a new document starts there). Never at t = 0."""
    if segment_ids is None:
        return jnp.zeros((batch, seq_len), bool)
    return jnp.concatenate([jnp.zeros((batch, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)


def zero_state(like, batch: int, heads: int, key_dim: int, value_dim: int):
    """A float32 zero state [B, H, K, V] that carries `like`'s sharding type, so a `lax.scan` carry started from
    it type-checks inside `shard_map` (a plain `jnp.zeros` would be replicated while the carry becomes varying)."""
    return jnp.zeros_like(like, shape=(batch, heads, key_dim, value_dim), dtype=jnp.float32)
