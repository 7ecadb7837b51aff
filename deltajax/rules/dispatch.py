"""One dispatch for every rule: the reference scan, the chunked XLA form and any registered kernel.

Every implementation of an op has the same signature::

    fn(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size, state_passing)
        -> (o [B, T, Hv, V] in v.dtype, final_state [B, Hv, K, V] float32)

The inputs it receives are already validated by `deltajax.rules.checks` (shapes, dtypes, ranges), `beta` is
None for linear attention, `initial_state` is None or float32, `segment_ids` is None or int32.

Kernels register themselves (`register`) with a `supports(RuleCall) -> bool` predicate. `impl="auto"` takes the
registered implementation of highest priority whose predicate accepts the call and otherwise falls back to the
chunked form; naming an implementation forces it and raises if it cannot take the call. Forward-only
implementations (no backward) are never picked by "auto"; one registered with `auto_when` is picked by "auto" only
where that predicate also accepts the call (for example where it was measured faster than the next one).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import jax

OPS = ("delta_rule", "linear_attention")
STATE_PASSINGS = ("sequential", "associative")


class RuleCall(NamedTuple):
    """What a `supports` predicate may look at: static facts about one call."""

    op: str  # "delta_rule" | "linear_attention"
    batch: int
    seq_len: int
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    dtype: str  # dtype name of q/k/v, e.g. "bfloat16"
    decay: str  # "none" | "scalar" | "channel"
    has_initial_state: bool
    has_segment_ids: bool
    chunk_size: int
    platform: str  # jax.default_backend() at trace time: "cpu" | "gpu" | "tpu"


@dataclasses.dataclass(frozen=True)
class Implementation:
    name: str
    fn: Callable
    supports: Callable[[RuleCall], bool]
    priority: int = 0
    forward_only: bool = False  # no backward: only ever used when named, never by "auto"
    auto_when: Callable[[RuleCall], bool] | None = None  # where "auto" may pick it (None: wherever it `supports`)


_REGISTRY: dict[str, dict[str, Implementation]] = {op: {} for op in OPS}


def register(op: str, name: str, fn: Callable, supports: Callable[[RuleCall], bool], priority: int = 0,
             forward_only: bool = False, auto_when: Callable[[RuleCall], bool] | None = None):
    """Adds (or replaces) implementation `name` of `op`. A `forward_only` one (differentiating it raises) is run
    only when named: "auto" cannot know whether the caller will take gradients. `auto_when` narrows where "auto"
    takes it (naming it still needs only `supports`)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    _REGISTRY[op][name] = Implementation(name, fn, supports, priority, forward_only, auto_when)


def implementations(op: str) -> dict[str, Implementation]:
    return dict(_REGISTRY[op])


def describe_call(op, q, k, v, log_decay, initial_state, segment_ids, chunk_size) -> RuleCall:
    if log_decay is None:
        decay = "none"
    else:
        decay = "scalar" if log_decay.ndim == 3 else "channel"
    B, T, H, K = q.shape
    return RuleCall(
        op=op, batch=B, seq_len=T, key_heads=H, value_heads=v.shape[2], key_dim=K, value_dim=v.shape[3],
        dtype=jax.numpy.dtype(q.dtype).name, decay=decay, has_initial_state=initial_state is not None,
        has_segment_ids=segment_ids is not None, chunk_size=chunk_size, platform=jax.default_backend())


def select(op: str, impl: str, call: RuleCall) -> Implementation:
    """The implementation that runs `call` (see the module docstring for the policy)."""
    registry = _REGISTRY[op]
    if impl == "auto":
        kernels = sorted((i for i in registry.values() if i.name not in ("scan", "chunk") and not i.forward_only),
                         key=lambda i: -i.priority)
        for candidate in kernels:
            try:
                ok = candidate.supports(call) and (candidate.auto_when is None or candidate.auto_when(call))
            except Exception:  # a predicate that cannot decide declines: fail closed
                ok = False
            if ok:
                return candidate
        return registry["chunk"]
    if impl not in registry:
        raise ValueError(f"impl must be 'auto' or one of {sorted(registry)} for {op}, got {impl!r}")
    chosen = registry[impl]
    if not chosen.supports(call):
        raise ValueError(f"impl={impl!r} does not support this call: {call}")
    return chosen
