"""The delta rule: S <- D_t S; u_t = beta_t (v_t - S^T k_t); S <- S + k_t u_t^T; o_t = scale * S^T q_t.

One online-SGD step on 1/2 |S^T k - v|^2 after forgetting by D_t = exp(log_decay_t). DeltaNet has D = I, Gated
DeltaNet a scalar per head, KDA one decay per key channel. beta in (0, 2) gives negative eigenvalues.
"""

from deltajax.rules.base import run_rule


def delta_rule(q, k, v, beta, log_decay=None, *, scale=None, initial_state=None, segment_ids=None,
               return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """q, k [B, T, H, K], v [B, T, Hv, V], beta [B, T, Hv] in [0, 2], log_decay None / [B, T, Hv] / [B, T, Hv, K].

    Returns (o [B, T, Hv, V], final_state [B, Hv, K, V] float32 or None).
    """
    return run_rule("delta_rule", q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                    segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                    chunk_size=chunk_size, state_passing=state_passing)
