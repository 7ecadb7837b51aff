"""Pallas Triton kernels for the chunkwise WY form, registered with the rules' dispatch as "pallas".

`supports` is fail-closed: it accepts a call only on the GPU backend, for the delta rule and linear attention with
no decay or one log-decay per token and value head (KDA's per-channel decay is declined), bfloat16 inputs (the
only dtype verified on the H100 so far: float32 inputs missed the 1e-5 bound there and float16 was not run; both
lower for CUDA and float32 passes in the interpreter), K and V in `HEAD_DIMS`, chunk size 64 and at most `MAX_BATCH_HEADS` batch x value-head pairs (one CUDA
grid axis). Everything else (beta in [0, 2], Hv a multiple of H, initial state, segment ids, any T) is handled.

On a machine without a GPU the same kernels run in Pallas's interpreter through `wy_chunk.chunk_wy(...,
interpret=True)`; the dispatch never picks them there.
"""

from __future__ import annotations

from deltajax.kernels.gpu import wy_chunk
from deltajax.kernels.gpu.wy_chunk import chunk_wy
from deltajax.rules import dispatch

NAME = "pallas"
PRIORITY = 10
DTYPES = ("bfloat16",)
LOWERED_DTYPES = ("float32", "bfloat16", "float16")  # compile for CUDA; see the docstring for what was verified
HEAD_DIMS = (64, 128, 256)
CHUNK_SIZES = (64,)
MAX_BATCH_HEADS = 65535


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


for _op in dispatch.OPS:
    dispatch.register(_op, NAME, chunk_wy, supports=supports, priority=PRIORITY)

__all__ = ["CHUNK_SIZES", "DTYPES", "HEAD_DIMS", "NAME", "chunk_wy", "supports", "wy_chunk"]
