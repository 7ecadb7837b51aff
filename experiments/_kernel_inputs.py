"""The random inputs every kernel benchmark times on (bench_pallas_gpu.py, bench_kda_gpu.py, bench_mosaic_gpu.py):
q, v normal; k normal then unit-norm per token, all three in bf16 (or `dtype`); beta = sigmoid(normal); log-decays
log_sigmoid(normal + 3) (about -0.05 per token), one per head or (`per_channel`, KDA) one per key channel."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def kernel_inputs(B, T, H, D, *, per_channel=False, seed=0, value_dim=None, dtype=jnp.bfloat16):
    """q, k (B, T, H, D), v (B, T, H, value_dim or D) in `dtype`, beta, log_decay (fp32)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 6)
    q = jax.random.normal(ks[0], (B, T, H, D)).astype(dtype)
    k = jax.random.normal(ks[1], (B, T, H, D))
    k = (k / jnp.linalg.norm(k, axis=-1, keepdims=True)).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, value_dim or D)).astype(dtype)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    gates = (B, T, H, D) if per_channel else (B, T, H)
    log_decay = jax.nn.log_sigmoid(jax.random.normal(ks[4], gates) + 3.0)
    return q, k, v, beta, log_decay
