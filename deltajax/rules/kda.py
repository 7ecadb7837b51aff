"""KDA (Kimi Delta Attention): the delta rule with one log-decay per key channel, S <- Diag(alpha_t) S first."""

from deltajax.rules.delta_rule import delta_rule


def kda(q, k, v, beta, log_decay, *, scale=None, initial_state=None, segment_ids=None, return_final_state=True,
        impl="auto", chunk_size=64, state_passing="sequential"):
    """log_decay [B, T, Hv, K] (<= 0). See `delta_rule`."""
    if log_decay is None or log_decay.ndim != 4:
        raise ValueError(f"kda needs log_decay of shape [B, T, Hv, K], got "
                         f"{None if log_decay is None else log_decay.shape}")
    return delta_rule(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                      return_final_state=return_final_state, impl=impl, chunk_size=chunk_size,
                      state_passing=state_passing)
