"""The one signature every rule shares, and the call into the dispatch."""

from __future__ import annotations

from deltajax.rules import dispatch
from deltajax.rules.checks import check_rule_inputs
from deltajax.rules.chunk import chunked
from deltajax.rules.scan import recurrent_scan

dispatch.register("delta_rule", "scan", recurrent_scan, supports=lambda call: True, priority=-2)
dispatch.register("delta_rule", "chunk", chunked, supports=lambda call: True, priority=-1)
dispatch.register("linear_attention", "scan", recurrent_scan, supports=lambda call: True, priority=-2)
dispatch.register("linear_attention", "chunk", chunked, supports=lambda call: True, priority=-1)


def run_rule(op, q, k, v, beta, log_decay, *, scale=None, initial_state=None, segment_ids=None,
             return_final_state=True, impl="auto", chunk_size=64, state_passing="sequential"):
    """Validates, picks the implementation and returns (o [B, T, Hv, V], final_state [B, Hv, K, V] or None)."""
    scale, initial_state, segment_ids = check_rule_inputs(
        q, k, v, beta, log_decay, initial_state=initial_state, segment_ids=segment_ids, chunk_size=chunk_size,
        state_passing=state_passing, scale=scale, needs_beta=op == "delta_rule")
    call = dispatch.describe_call(op, q, k, v, log_decay, initial_state, segment_ids, chunk_size)
    implementation = dispatch.select(op, impl, call)
    o, final_state = implementation.fn(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                                       segment_ids=segment_ids, chunk_size=chunk_size, state_passing=state_passing)
    return o, (final_state if return_final_state else None)
