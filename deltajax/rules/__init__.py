"""The delta-rule family as pure functions: one signature, a scan reference, a chunked form, a dispatch.

Every rule takes q, k [B, T, H, K], v [B, T, Hv, V] (Hv a multiple of H), its per-token coefficient [B, T, Hv],
an optional log_decay (None, [B, T, Hv] or [B, T, Hv, K], <= 0) and the keywords scale, initial_state
[B, Hv, K, V], segment_ids [B, T], return_final_state, impl ("auto" | "scan" | "chunk" | a registered kernel),
chunk_size and state_passing ("sequential" | "associative"); it returns (o [B, T, Hv, V], final_state).
"""

from deltajax.rules import dispatch
from deltajax.rules.chunk import chunk_state_map, compose_state_maps
from deltajax.rules.delta_rule import delta_rule
from deltajax.rules.deltanet import deltanet
from deltajax.rules.efla import efla
from deltajax.rules.gated_deltanet import gated_deltanet
from deltajax.rules.kaczmarz import kaczmarz, relaxed_kaczmarz
from deltajax.rules.kda import kda
from deltajax.rules.linear_attention import linear_attention
from deltajax.rules.longhorn import longhorn
from deltajax.rules.step_size import (
    STEP_RULES,
    beta_negative_eigenvalues,
    beta_sigmoid,
    delta_rule_with_step_size,
    normalise_keys,
    raw_key_beta,
)

__all__ = [
    "STEP_RULES", "beta_negative_eigenvalues", "beta_sigmoid", "chunk_state_map", "compose_state_maps",
    "delta_rule", "delta_rule_with_step_size", "deltanet", "dispatch", "efla", "gated_deltanet", "kaczmarz",
    "kda", "linear_attention", "longhorn", "normalise_keys", "raw_key_beta", "relaxed_kaczmarz",
]
