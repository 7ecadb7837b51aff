"""EFLA (seed 003): the exact solution of dS/dt = -k k^T S + k v^T over an interval eta (our [K, V] layout),
S <- S + (1 - exp(-eta |k|^2)) / |k|^2 k (v - S^T k)^T."""

from deltajax.rules.step_size import delta_rule_with_step_size


def efla(q, k, v, eta, log_decay=None, *, scale=None, initial_state=None, segment_ids=None, return_final_state=True,
         impl="auto", chunk_size=64, state_passing="sequential"):
    """eta [B, T, Hv] >= 0 on raw keys k [B, T, H, K]. See `delta_rule` for the rest."""
    return delta_rule_with_step_size("efla", q, k, v, eta, log_decay, scale=scale, initial_state=initial_state,
                                     segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                                     chunk_size=chunk_size, state_passing=state_passing)
