"""Mosaic TPU kernels for the chunkwise WY form, registered with the rules' dispatch as "pallas_tpu".

Two kernel families share the name:

* `chunk.py` (predicate `supports`): the delta rule and linear attention with no decay or one log-decay per token
  and value head (DeltaNet, Gated DeltaNet, linear attention);
* `kda.py` (predicate `supports_kda`): the delta rule with one log-decay per key channel (KDA).

For the delta rule the registered function routes on the shape of log_decay and the registered predicate accepts
what either family accepts. Both predicates are fail-closed: they accept a call only on the TPU backend (or on CPU
inside `interpret()`), for float32/bfloat16 inputs, a chunk size in `CHUNK_SIZES`, head dims up to `MAX_HEAD_DIM`
and a VMEM need within budget.

On a machine without a TPU, `interpret()` runs the same kernels in Pallas's TPU interpreter and lets the dispatch
pick them on the CPU backend::

    with deltajax.kernels.tpu.interpret():
        o, state = deltajax.delta_rule(q, k, v, beta, impl="pallas_tpu")
        o, state = deltajax.kda(q, k, v, beta, log_decay_per_channel, impl="pallas_tpu")
"""

from __future__ import annotations

import contextlib
import contextvars

from jax.experimental.pallas import tpu as pltpu

from deltajax.kernels.tpu import chunk, kda
from deltajax.kernels.tpu.chunk import CHUNK_SIZES, MAX_HEAD_DIM
from deltajax.rules import dispatch

NAME = "pallas_tpu"
PRIORITY = 10
DTYPES = ("float32", "bfloat16")

_interpreting = contextvars.ContextVar("deltajax_tpu_interpreting", default=False)


@contextlib.contextmanager
def interpret(params: pltpu.InterpretParams | None = None):
    """Runs every Pallas TPU kernel traced inside in the TPU interpreter, and lets `supports` accept "cpu".

    `params` defaults to `pltpu.InterpretParams()` (NaN-filled uninitialised memory, out-of-bounds reads raise);
    pass `detect_races=True` etc. to check more. Leaving the context restores dispatch to real TPUs only.
    """
    token = _interpreting.set(True)
    try:
        with pltpu.force_tpu_interpret_mode(params if params is not None else pltpu.InterpretParams()):
            yield
    finally:
        _interpreting.reset(token)


def interpreting() -> bool:
    return _interpreting.get()


def _common_ok(call: dispatch.RuleCall) -> bool:
    """Platform, dtype, chunk size, head dims and head grouping: what both kernel families require."""
    platform_ok = call.platform == "tpu" or (call.platform == "cpu" and interpreting())
    if not platform_ok or call.op not in dispatch.OPS or call.dtype not in DTYPES:
        return False
    if call.chunk_size not in CHUNK_SIZES:
        return False
    if not (1 <= call.key_dim <= MAX_HEAD_DIM and 1 <= call.value_dim <= MAX_HEAD_DIM):
        return False
    return call.key_heads >= 1 and call.value_heads % call.key_heads == 0 and call.batch >= 1 and call.seq_len >= 1


def supports(call: dispatch.RuleCall) -> bool:
    """The `chunk.py` kernels: both ops, no decay or a scalar log-decay per token and value head."""
    if call.decay not in ("none", "scalar") or not _common_ok(call):
        return False
    cfg = chunk.Config(delta=call.op == "delta_rule", gated=call.decay == "scalar", packed=call.has_segment_ids,
                       has_initial_state=call.has_initial_state, scale=1.0, chunk_size=call.chunk_size,
                       group=call.value_heads // call.key_heads, value_heads=call.value_heads,
                       key_dim=call.key_dim, value_dim=call.value_dim)
    return chunk.fits_vmem(cfg, 2 if call.dtype == "bfloat16" else 4)


def supports_kda(call: dispatch.RuleCall) -> bool:
    """The `kda.py` kernels: the delta rule with a log-decay per token, value head and key channel."""
    if call.op != "delta_rule" or call.decay != "channel" or not _common_ok(call):
        return False
    cfg = kda.Config(packed=call.has_segment_ids, has_initial_state=call.has_initial_state, scale=1.0,
                     chunk_size=call.chunk_size, group=call.value_heads // call.key_heads,
                     value_heads=call.value_heads, key_dim=call.key_dim, value_dim=call.value_dim)
    return kda.fits_vmem(cfg, 2 if call.dtype == "bfloat16" else 4)


def supports_delta_rule(call: dispatch.RuleCall) -> bool:
    """What "pallas_tpu" accepts for the delta rule: either family."""
    return supports(call) or supports_kda(call)


def chunked_delta_rule(q, k, v, beta, log_decay, **kwargs):
    """The delta rule under "pallas_tpu": per-channel log-decays [B, T, Hv, K] go to the KDA kernels."""
    if log_decay is not None and log_decay.ndim == 4:
        return kda.chunked(q, k, v, beta, log_decay, **kwargs)
    return chunk.chunked(q, k, v, beta, log_decay, **kwargs)


dispatch.register("delta_rule", NAME, chunked_delta_rule, supports=supports_delta_rule, priority=PRIORITY)
dispatch.register("linear_attention", NAME, chunk.chunked, supports=supports, priority=PRIORITY)

__all__ = ["CHUNK_SIZES", "MAX_HEAD_DIM", "NAME", "interpret", "interpreting", "supports", "supports_delta_rule",
           "supports_kda"]
