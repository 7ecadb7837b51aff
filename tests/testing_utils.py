"""Helpers shared by the tests: relative errors and fresh random inputs for every rule."""

from __future__ import annotations

import secrets

import jax
import jax.numpy as jnp
import numpy as np


def relative_error(x, ref):
    """||x - ref|| / ||ref|| in float64; inf when x has non-finite values."""
    x = np.asarray(jax.device_get(x), np.float64)
    ref = np.asarray(jax.device_get(ref), np.float64)
    if not np.all(np.isfinite(x)):
        return np.inf
    return float(np.linalg.norm(x - ref) / max(np.linalg.norm(ref), 1e-30))


def fresh_key():
    """A new PRNG key per call (inputs differ on every run); the seed is printed on failure by pytest's -l."""
    seed = secrets.randbits(31)
    print(f"seed={seed}")
    return jax.random.PRNGKey(seed)


def rule_inputs(key, *, B=2, T=65, H=2, Hv=None, K=16, V=8, decay="scalar", beta_max=1.0, packed=False,
                with_initial_state=False, normalise_keys=True, decay_scale=0.5, dtype=jnp.float32):
    """Random q, k, v, beta, log_decay, initial_state, segment_ids (never zeros)."""
    Hv = Hv or H
    ks = jax.random.split(key, 8)
    q = jax.random.normal(ks[0], (B, T, H, K), jnp.float32)
    k = jax.random.normal(ks[1], (B, T, H, K), jnp.float32)
    if normalise_keys:
        k = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    v = jax.random.normal(ks[2], (B, T, Hv, V), jnp.float32)
    beta = jax.random.uniform(ks[3], (B, T, Hv), minval=0.05, maxval=beta_max)
    if decay == "none":
        log_decay = None
    elif decay == "scalar":
        log_decay = -decay_scale * jax.random.uniform(ks[4], (B, T, Hv), minval=0.01, maxval=1.0)
    else:
        log_decay = -decay_scale * jax.random.uniform(ks[4], (B, T, Hv, K), minval=0.01, maxval=1.0)
    initial_state = jax.random.normal(ks[5], (B, Hv, K, V), jnp.float32) if with_initial_state else None
    segment_ids = None
    if packed:
        # Documents of random lengths (some shorter than a chunk, some spanning chunk boundaries).
        starts = jax.random.bernoulli(ks[6], 0.04, (B, T)).astype(jnp.int32)
        segment_ids = jnp.cumsum(starts, axis=1) + 3
    cast = lambda x: x.astype(dtype)
    return dict(q=cast(q), k=cast(k), v=cast(v), beta=beta, log_decay=log_decay, initial_state=initial_state,
                segment_ids=segment_ids)
