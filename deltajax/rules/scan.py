"""Token-by-token references (`jax.lax.scan`, float32, highest precision): the oracle for every faster path.

For each token t (after a reset to zero at document boundaries):
    S <- D_t S                        D_t = exp(log_decay_t), a scalar or Diag over the key channels
    u_t = v_t                         (linear attention)
    u_t = beta_t (v_t - S^T k_t)      (delta rule)
    S <- S + k_t u_t^T
    o_t = scale * S^T q_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from deltajax.rules.common import HIGHEST, repeat_key_heads, resets, zero_state


def recurrent_scan(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=None,
                   state_passing=None):
    """The reference for both ops (`beta is None` is linear attention). Shapes as in `dispatch`."""
    del chunk_size, state_passing
    B, T, _, K = q.shape
    Hv, V = v.shape[2], v.shape[3]
    f32 = jnp.float32
    q = repeat_key_heads(q, Hv).astype(f32)
    k = repeat_key_heads(k, Hv).astype(f32)
    out_dtype = v.dtype
    v = v.astype(f32)
    state = zero_state(v, B, Hv, K, V) if initial_state is None else initial_state.astype(f32)
    reset = resets(segment_ids, B, T)

    def time_major(x):
        return None if x is None else jnp.moveaxis(x.astype(f32) if x.dtype != bool else x, 1, 0)

    xs = dict(q=time_major(q), k=time_major(k), v=time_major(v), reset=time_major(reset),
              beta=time_major(beta), log_decay=time_major(log_decay))

    def step(S, x):
        S = jnp.where(x["reset"][:, None, None, None], 0.0, S)
        if x["log_decay"] is not None:
            decay = jnp.exp(x["log_decay"])
            S = S * (decay[:, :, None, None] if decay.ndim == 2 else decay[..., None])
        if x["beta"] is None:
            u = x["v"]
        else:
            prediction = jnp.einsum("bhk,bhkv->bhv", x["k"], S, precision=HIGHEST)
            u = x["beta"][..., None] * (x["v"] - prediction)
        S = S + x["k"][..., :, None] * u[..., None, :]
        o = scale * jnp.einsum("bhk,bhkv->bhv", x["q"], S, precision=HIGHEST)
        return S, o

    state, o = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(o, 0, 1).astype(out_dtype), state
