"""Linear attention: S_t = D_t S_{t-1} + k_t v_t^T, o_t = scale * S_t^T q_t."""

from deltajax.rules.base import run_rule


def linear_attention(q, k, v, log_decay=None, *, scale=None, initial_state=None, segment_ids=None,
                     return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """q, k [B, T, H, K], v [B, T, Hv, V], log_decay None / [B, T, Hv] / [B, T, Hv, K] (<= 0).

    Returns (o [B, T, Hv, V], final_state [B, Hv, K, V] float32 or None).
    """
    return run_rule("linear_attention", q, k, v, None, log_decay, scale=scale, initial_state=initial_state,
                    segment_ids=segment_ids, return_final_state=return_final_state, impl=impl,
                    chunk_size=chunk_size, state_passing=state_passing)
