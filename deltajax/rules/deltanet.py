"""DeltaNet: the delta rule without decay, S <- S (I - beta k k^T) + beta k v^T (in our [K, V] layout)."""

from deltajax.rules.delta_rule import delta_rule


def deltanet(q, k, v, beta, *, scale=None, initial_state=None, segment_ids=None, return_final_state=True,
             impl="auto", chunk_size=64, state_passing="sequential"):
    """beta [B, T, Hv] in [0, 1] (sigmoid) or [0, 2] (negative eigenvalues). See `delta_rule`."""
    return delta_rule(q, k, v, beta, None, scale=scale, initial_state=initial_state, segment_ids=segment_ids,
                      return_final_state=return_final_state, impl=impl, chunk_size=chunk_size,
                      state_passing=state_passing)
