"""Argument checks shared by every rule and kernel: clear ValueErrors instead of silent NaNs.

Shape and dtype checks always run (they are static). Range checks (log_decay <= 0, beta in [0, 2], step-size
parameters) run whenever the value is concrete, i.e. outside `jit`; inside `jit` values are unknown at trace time,
so check once outside the compiled function when inputs come from an untrusted source.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from deltajax.rules.dispatch import STATE_PASSINGS

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def is_concrete(x) -> bool:
    return x is not None and not isinstance(x, jax.core.Tracer)


def _shape(name, x, expected, what):
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name} must have shape {what} = {tuple(expected)}, got {tuple(x.shape)}")


def check_range(name, x, low=None, high=None, low_open=False, high_open=False):
    """Raises when a concrete `x` has non-finite values or values outside the (half-)open interval."""
    if not is_concrete(x):
        return
    values = np.asarray(jax.device_get(x), dtype=np.float32)
    if not np.all(np.isfinite(values)):
        raise ValueError(f"{name} must be finite, got {int(np.sum(~np.isfinite(values)))} non-finite values")
    if low is not None:
        bad = values <= low if low_open else values < low
        if np.any(bad):
            raise ValueError(f"{name} must be {'>' if low_open else '>='} {low}, got min {values.min()}")
    if high is not None:
        bad = values >= high if high_open else values > high
        if np.any(bad):
            raise ValueError(f"{name} must be {'<' if high_open else '<='} {high}, got max {values.max()}")


def check_chunk_size(chunk_size):
    if not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1 or (chunk_size & (chunk_size - 1)):
        raise ValueError(f"chunk_size must be a positive power of two, got {chunk_size!r}")


def check_rule_inputs(q, k, v, beta, log_decay, *, initial_state, segment_ids, chunk_size, state_passing,
                      scale, needs_beta: bool):
    """Validates the common signature; returns (scale, initial_state as float32 or None, segment_ids int32)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if getattr(x, "ndim", None) != 4:
            raise ValueError(f"{name} must be 4-D [batch, time, heads, dim], got shape {getattr(x, 'shape', None)}")
        if jnp.dtype(x.dtype) not in [jnp.dtype(d) for d in FLOAT_DTYPES]:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if q.shape != k.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K], got q {q.shape} and k {k.shape}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    if v.shape[:2] != (B, T):
        raise ValueError(f"v must have shape [B, T, Hv, V] with B, T = {(B, T)} from q, got {v.shape}")
    Hv, V = v.shape[2], v.shape[3]
    if Hv % H:
        raise ValueError(f"v's heads ({Hv}) must be a multiple of q/k's heads ({H})")
    if needs_beta:
        if beta is None:
            raise ValueError("beta must be given with shape [B, T, Hv]")
        _shape("beta", beta, (B, T, Hv), "[B, T, Hv]")
        check_range("beta", beta, 0.0, 2.0)
    elif beta is not None:
        raise ValueError("beta must be None for linear attention")
    if log_decay is not None:
        if log_decay.ndim == 3:
            _shape("log_decay", log_decay, (B, T, Hv), "[B, T, Hv]")
        elif log_decay.ndim == 4:
            _shape("log_decay", log_decay, (B, T, Hv, K), "[B, T, Hv, K]")
        else:
            raise ValueError(f"log_decay must be None, [B, T, Hv] or [B, T, Hv, K], got shape {log_decay.shape}")
        check_range("log_decay", log_decay, high=0.0)
    if initial_state is not None:
        _shape("initial_state", initial_state, (B, Hv, K, V), "[B, Hv, K, V]")
        initial_state = initial_state.astype(jnp.float32)
    if segment_ids is not None:
        _shape("segment_ids", segment_ids, (B, T), "[B, T]")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be an integer array, got {segment_ids.dtype}")
        segment_ids = segment_ids.astype(jnp.int32)
    check_chunk_size(chunk_size)
    if state_passing not in STATE_PASSINGS:
        raise ValueError(f"state_passing must be one of {STATE_PASSINGS}, got {state_passing!r}")
    if scale is None:
        scale = K ** -0.5
    elif not np.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    return float(scale), initial_state, segment_ids
