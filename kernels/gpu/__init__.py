"""Pallas Triton kernels for the chunkwise WY form, registered with the rules' dispatch as "pallas".

`supports` is fail-closed: it accepts a call only on the GPU backend, for the delta rule and linear attention with
no decay or one log-decay per token and value head (KDA's per-channel decay is declined), bfloat16, float16 or
float32 inputs (each verified on the H100 against the fp32 scan: bf16 and fp32 2026-11-23, fp16 2026-11-25),
K and V in `HEAD_DIMS`, chunk size 64 and at most `MAX_BATCH_HEADS` batch x value-head pairs (one CUDA
grid axis). Everything else (beta in [0, 2], Hv a multiple of H, initial state, segment ids, any T) is handled.

KDA (the delta rule with a log-decay per key channel, `kda.py`) has its own predicate, `supports_kda`: the GPU
backend, log_decay [B, T, Hv, K], bfloat16, float16 or float32 q/k/v (each verified on the H100 against the fp32
scan: fp32 2026-11-23, bf16 2026-11-25, fp16 2026-12-07), K and V in `KDA_HEAD_DIMS` (256 in bfloat16 only), chunk
size 64, at most `MAX_BATCH_HEADS` batch x value-head pairs. For the delta rule the
registered function (`chunked_delta_rule`) routes on the shape of log_decay and the registered predicate accepts
what either accepts.

"mosaic" (`mosaic_wy.py`, `mosaic_wy_grads.py`, Hopper only) is the Gated DeltaNet with its sequential forward and
reverse passes (from `mosaic_wy.mosaic_forward_min_batch_heads` value heads per call, by head dims; the Triton
ones below) and its chunk-parallel gradient kernel in Mosaic GPU; the gates and per-token vectors around them are two
small Triton kernels (`mosaic_vectors.py`). `supports_mosaic`: the GPU backend on a compute capability 9.x device,
the delta rule with no or a scalar decay, bfloat16 q/k/v, K and V of 64, 128 or 256 (the gradient kernel at 256 in
blocks of 128), Hv a multiple of H, chunk size 64. For KDA
(`supports_mosaic_kda`: what `supports_kda` takes, bfloat16, K of 64 or 128, V of 64, 128 or 256, on Hopper)
"mosaic" runs the KDA kernels with `kda.mosaic_config`, whose forward and reverse passes are the Mosaic GPU ones
(`mosaic_kda.py`) from 64 value heads per call, 16 at K = V = 128 (`kda.mosaic_config`; KDA at K = 256 goes to
"pallas"; the Mosaic passes take it
opt-in, measured slower: `mosaic_kda.DISPATCH_KEY_DIMS`). "auto" prefers "mosaic" over
"pallas" (`MOSAIC_PRIORITY`): measured as fast or faster forward and forward+backward at every size timed
(docs/benchmarks.md).

On a machine without a GPU the same kernels run in Pallas's interpreter through `wy_chunk.chunk_wy(...,
interpret=True)` and `kda.kda_chunk(..., interpret=True)`; the dispatch never picks them there.
"""

from __future__ import annotations

import jax

from deltajax.kernels.gpu import kda, mosaic_kda, mosaic_wy, wy_chunk
from deltajax.kernels.gpu.wy_chunk import chunk_wy
from deltajax.rules import dispatch

NAME = "pallas"
PRIORITY = 10
MOSAIC_NAME = "mosaic"
MOSAIC_PRIORITY = 20
DTYPES = ("bfloat16", "float16", "float32")
HEAD_DIMS = (64, 128, 256)
CHUNK_SIZES = (64,)
MAX_BATCH_HEADS = 65535
KDA_DTYPES = ("bfloat16", "float16", "float32")
# K and V each; 256 for bfloat16 inputs only (`kda.compiles_for`). At K = 256 the passes take state blocks of
# 16 columns and one pipeline stage (`kda.default_config`).
KDA_HEAD_DIMS = (64, 128, 256)


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
    if not kda.compiles_for(call.key_dim, call.value_dim, call.dtype):
        return False
    if call.key_heads < 1 or call.value_heads % call.key_heads or call.batch < 1 or call.seq_len < 1:
        return False
    return call.batch * call.value_heads <= MAX_BATCH_HEADS


def supports_delta_rule(call: dispatch.RuleCall) -> bool:
    """What "pallas" accepts for the delta rule: either kernel family."""
    return supports(call) or supports_kda(call)


def hopper_compute_capability() -> bool:
    """Whether the default device is a compute capability 9.x GPU (wgmma and TMA); fail-closed."""
    capability = getattr(jax.devices()[0], "compute_capability", None)
    return isinstance(capability, str) and capability.split(".")[0] == "9"


def supports_mosaic(call: dispatch.RuleCall) -> bool:
    """The Mosaic GPU forward (`mosaic_wy.chunk_wy_mosaic`): what its argument checks accept, on Hopper."""
    if call.platform != "gpu" or call.op != "delta_rule" or call.decay not in ("none", "scalar"):
        return False
    if call.dtype != "bfloat16" or call.chunk_size != mosaic_wy.CHUNK or call.value_heads % call.key_heads:
        return False
    # K and V of 64, 128 or 256 each (`mosaic_wy.HEAD_DIMS`); at K or V of 256 the gradient kernels are Triton's.
    if call.key_dim not in mosaic_wy.HEAD_DIMS or call.value_dim not in mosaic_wy.HEAD_DIMS:
        return False
    if call.batch < 1 or call.seq_len < 1 or call.batch * call.value_heads > MAX_BATCH_HEADS:
        return False
    return hopper_compute_capability()


def supports_mosaic_kda(call: dispatch.RuleCall) -> bool:
    """KDA with its sequential passes in Mosaic GPU (`kda.mosaic_config`, `mosaic_kda.py`): what `supports_kda`
    accepts, bfloat16, K of 64 or 128, V of 64, 128 or 256, on Hopper."""
    if not supports_kda(call) or call.dtype != "bfloat16":
        return False
    if call.key_dim not in mosaic_kda.DISPATCH_KEY_DIMS or call.value_dim not in mosaic_kda.VALUE_DIMS:
        return False
    return hopper_compute_capability()


def supports_mosaic_delta_rule(call: dispatch.RuleCall) -> bool:
    return supports_mosaic(call) or supports_mosaic_kda(call)


def mosaic_delta_rule(q, k, v, beta, log_decay, *, scale, initial_state, segment_ids, chunk_size=64,
                      state_passing="sequential"):
    """The dispatch's signature for `mosaic_wy.chunk_wy_mosaic`, and for per-channel log-decays [B, T, Hv, K] the
    KDA kernels with `kda.mosaic_config` (the state is always passed sequentially)."""
    del state_passing
    if log_decay is not None and log_decay.ndim == 4:
        config = kda.mosaic_config(q, v, scale=scale, chunk_size=chunk_size, segmented=segment_ids is not None,
                                   interpret=jax.default_backend() != "gpu")
        return kda.kda_chunk(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                             segment_ids=segment_ids, chunk_size=chunk_size, config=config)
    return mosaic_wy.chunk_wy_mosaic(q, k, v, beta, log_decay, scale=scale, initial_state=initial_state,
                                     segment_ids=segment_ids, chunk_size=chunk_size)


def chunked_delta_rule(q, k, v, beta, log_decay, **kwargs):
    """The delta rule under "pallas": per-channel log-decays [B, T, Hv, K] go to the KDA kernels."""
    if log_decay is not None and log_decay.ndim == 4:
        return kda.kda_chunk(q, k, v, beta, log_decay, **kwargs)
    return chunk_wy(q, k, v, beta, log_decay, **kwargs)


dispatch.register("delta_rule", NAME, chunked_delta_rule, supports=supports_delta_rule, priority=PRIORITY)
dispatch.register("linear_attention", NAME, chunk_wy, supports=supports, priority=PRIORITY)
dispatch.register("delta_rule", MOSAIC_NAME, mosaic_delta_rule, supports=supports_mosaic_delta_rule,
                  priority=MOSAIC_PRIORITY)

__all__ = ["CHUNK_SIZES", "DTYPES", "HEAD_DIMS", "KDA_DTYPES", "KDA_HEAD_DIMS",
           "MOSAIC_NAME", "MOSAIC_PRIORITY", "NAME", "chunk_wy", "chunked_delta_rule", "hopper_compute_capability",
           "kda", "mosaic_delta_rule", "mosaic_kda", "mosaic_wy", "supports", "supports_delta_rule", "supports_kda",
           "supports_mosaic", "supports_mosaic_delta_rule", "supports_mosaic_kda", "wy_chunk"]
