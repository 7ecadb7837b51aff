"""Kaczmarz (seed 000): project the state onto {S : S^T k = v}, S <- S + k (v - S^T k)^T / |k|^2.

Relaxed Kaczmarz moves a fraction rho of the way, with eps in the denominator, after forgetting:
S~ = D_t S;  S <- S~ + rho / (|k|^2 + eps) k (v - S~^T k)^T,  so  k^T S = (1 - rho) k^T S~ + rho v  when eps = 0.
"""

from deltajax.rules.step_size import delta_rule_with_step_size


def kaczmarz(q, k, v, log_decay=None, *, scale=None, initial_state=None, segment_ids=None, return_final_state=True,
             impl="auto", chunk_size=64, state_passing="sequential"):
    """Raw keys k [B, T, H, K]; step 1 / |k|^2 (none for a zero key). See `delta_rule` for the rest."""
    return delta_rule_with_step_size("kaczmarz", q, k, v, None, log_decay, scale=scale, initial_state=initial_state,
                                     segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                                     chunk_size=chunk_size, state_passing=state_passing)


def relaxed_kaczmarz(q, k, v, rho, log_decay=None, *, eps=1e-6, scale=None, initial_state=None, segment_ids=None,
                     return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """rho [B, T, Hv] in [0, 2]; step rho / (|k|^2 + eps) on raw keys k [B, T, H, K]."""
    return delta_rule_with_step_size("relaxed_kaczmarz", q, k, v, rho, log_decay, eps=eps, scale=scale,
                                     initial_state=initial_state, segment_ids=segment_ids,
                                     return_final_state=return_final_state, impl=impl, chunk_size=chunk_size,
                                     state_passing=state_passing)
