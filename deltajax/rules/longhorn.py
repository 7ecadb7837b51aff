"""Longhorn (seed 000): the proximal step argmin_S 1/2 |S - S_prev|^2 + gamma/2 |S^T k - v|^2, in closed form
S <- S + gamma / (1 + gamma |k|^2) k (v - S^T k)^T: Kaczmarz with eps = 1 / gamma."""

from deltajax.rules.step_size import delta_rule_with_step_size


def longhorn(q, k, v, gamma, log_decay=None, *, scale=None, initial_state=None, segment_ids=None,
             return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """gamma [B, T, Hv] >= 0 on raw keys k [B, T, H, K]. See `delta_rule` for the rest."""
    return delta_rule_with_step_size("longhorn", q, k, v, gamma, log_decay, scale=scale,
                                     initial_state=initial_state, segment_ids=segment_ids,
                                     return_final_state=return_final_state, impl=impl, chunk_size=chunk_size,
                                     state_passing=state_passing)
