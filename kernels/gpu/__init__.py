"""Pallas Triton kernels for the chunkwise WY form, registered with the rules' dispatch as "pallas".

`supports` is fail-closed: it accepts a call only on the GPU backend, for the delta rule and linear attention with
no decay or one log-decay per token and value head (KDA's per-channel decay is declined), bfloat16 or float32
inputs (both verified on the H100 against the fp32 scan, 2026-11-23; float16 lowers for CUDA but was not run),
K and V in `HEAD_DIMS`, chunk size 64 and at most `MAX_BATCH_HEADS` batch x value-head pairs (one CUDA
grid axis). Everything else (beta in [0, 2], Hv a multiple of H, initial state, segment ids, any T) is handled.

KDA (the delta rule with a log-decay per key channel, `kda.py`) has its own predicate, `supports_kda`: the GPU
backend, log_decay [B, T, Hv, K], bfloat16 (as above; float32 interprets and lowers), K and V in `KDA_HEAD_DIMS`,
chunk size 64, at most `MAX_BATCH_HEADS` batch x value-head pairs. For the delta rule the registered function
(`chunked_delta_rule`) routes on the shape of log_decay and the registered predicate accepts what either accepts.

On a machine without a GPU the same kernels run in Pallas's interpreter through `wy_chunk.chunk_wy(...,
interpret=True)` and `kda.kda_chunk(..., interpret=True)`; the dispatch never picks them there.
"""

from __future__ import annotations

from deltajax.kernels.gpu import kda, wy_chunk
from deltajax.kernels.gpu.wy_chunk import chunk_wy
from deltajax.rules import dispatch

NAME = "pallas"
PRIORITY = 10
DTYPES = ("bfloat16", "float32")
LOWERED_DTYPES = ("float32", "bfloat16", "float16")  # compile for CUDA; see the docstring for what was verified
HEAD_DIMS = (64, 128, 256)
CHUNK_SIZES = (64,)
MAX_BATCH_HEADS = 65535
KDA_DTYPES = ("bfloat16", "float32")
KDA_HEAD_DIMS = (64, 128)  # lowered for CUDA; larger K puts a K x 64 fp32 state block in registers


def supports(call: dispatch.RuleCall) -> bool:
    if call.platform != "gpu" or call.op not in dispatch.OPS:
        return False
    if call.decay not in ("none", "scalar") or call.dtype not in DTYPES:
        return False
    if call.chunk_size not in CHUNK_SIZES:
        return False
    if call.key_dim not in HEAD_DIMS or call.value_dim not in HEAD_DIMS:
        return False
    if call.key_heads < 1 or call.value_heads % call.key_heads or call.batch < 1 or call.seq_len < 1:
        return False
    return call.batch * call.value_heads <= MAX_BATCH_HEADS


def supports_kda(call: dispatch.RuleCall) -> bool:
    """The `kda.py` kernels: the delta rule with a log-decay per token, value head and key channel."""
    if call.platform != "gpu" or call.op != "delta_rule" or call.decay != "channel":
        return False
    if call.dtype not in KDA_DTYPES or call.chunk_size not in CHUNK_SIZES:
        return False
    if call.key_dim not in KDA_HEAD_DIMS or call.value_dim not in KDA_HEAD_DIMS:
        return False
    if call.key_heads < 1 or call.value_heads % call.key_heads or call.batch < 1 or call.seq_len < 1:
        return False
    return call.batch * call.value_heads <= MAX_BATCH_HEADS


def supports_delta_rule(call: dispatch.RuleCall) -> bool:
    """What "pallas" accepts for the delta rule: either kernel family."""
    return supports(call) or supports_kda(call)


def chunked_delta_rule(q, k, v, beta, log_decay, **kwargs):
    """The delta rule under "pallas": per-channel log-decays [B, T, Hv, K] go to the KDA kernels."""
    if log_decay is not None and log_decay.ndim == 4:
        return kda.kda_chunk(q, k, v, beta, log_decay, **kwargs)
    return chunk_wy(q, k, v, beta, log_decay, **kwargs)


dispatch.register("delta_rule", NAME, chunked_delta_rule, supports=supports_delta_rule, priority=PRIORITY)
dispatch.register("linear_attention", NAME, chunk_wy, supports=supports, priority=PRIORITY)

__all__ = ["CHUNK_SIZES", "DTYPES", "HEAD_DIMS", "KDA_DTYPES", "KDA_HEAD_DIMS", "NAME", "chunk_wy",
           "chunked_delta_rule", "kda", "supports", "supports_delta_rule", "supports_kda", "wy_chunk"]
